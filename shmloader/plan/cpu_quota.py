"""The CPU a control group's quota leaves this process: a container or a Kubernetes pod with a
CPU limit (cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us) runs on a machine whose
cores it may all be scheduled on (sched_getaffinity counts them all) but gets only the limit's
share of CPU time; past it every process of the group, the trainer too, waits for the next
period. The loader's defaults (plan/defaults.py) count the quota's cores as the cores it may
use, and readers="auto" counts what the quota leaves unused as idle (readers/bottleneck.py),
so that neither starts nor adds readers that only make the group wait.

The quota is the smallest of those set on the process's group and the groups above it (each
one caps what its subtree runs). Its usage counter is the group's that sets it (v2 cpu.stat's
usage_usec; v1 cpuacct.usage, of the same path in the cpuacct hierarchy). Everything here is
read from files the kernel writes; where one is missing or unreadable (no cgroup file system,
another layout), there is no quota to keep to: None.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"
_BYTES_MAX = 4096


@dataclasses.dataclass(frozen=True)
class Quota:
    """A CPU quota: `cores` (quota / period, fractional), `usage_path` the file of the group's
    cumulative CPU time that sets it, `usage_unit_ns` its unit (1000 for v2's microseconds)."""

    cores: float
    usage_path: str | None
    usage_unit_ns: int


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as file:
            return file.read(_BYTES_MAX).decode("ascii", "replace")
    except OSError:
        return None


def _groups(proc_cgroup: str) -> dict[str, str]:
    """/proc/self/cgroup as {controller: path}: "" for the v2 group (hierarchy 0)."""
    groups = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            groups[""] = path
        for controller in controllers.split(","):
            if controller:
                groups[controller] = path
    return groups


def _directories(mount: str, path: str) -> list[str]:
    """The group's directory under `mount` and those above it, up to the mount: in a
    container the mount's root is the container's group, whose path /proc/self/cgroup names
    from the host's root (absent under the mount), so the walk starts from what exists."""
    parts = [part for part in path.split("/") if part and part != ".."]
    while parts and not os.path.isdir(os.path.join(mount, *parts)):
        parts = parts[1:]  # The host's prefix of a path seen from inside a container.
    found = []
    while True:
        found.append(os.path.join(mount, *parts))
        if not parts:
            return found
        parts = parts[:-1]


def _v2(root: str, path: str) -> Quota | None:
    best = None
    for directory in _directories(root, path):
        fields = (_read(os.path.join(directory, "cpu.max")) or "").split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]) > 0:
            cores = int(fields[0]) / int(fields[1])
            if best is None or cores < best.cores:
                best = Quota(cores, os.path.join(directory, "cpu.stat"), 1000)
    return best


def _v1(root: str, groups: dict[str, str]) -> Quota | None:
    names = [name for name in ("cpu,cpuacct", "cpuacct,cpu", "cpu") if os.path.isdir(os.path.join(root, name))]
    if not names or "cpu" not in groups:
        return None
    mount, best = os.path.join(root, names[0]), None
    # Where cpu and cpuacct are hierarchies apart, the usage is the cpuacct group's of the same path.
    accounting = mount if "cpuacct" in names[0] else os.path.join(root, "cpuacct")
    for directory in _directories(mount, groups["cpu"]):
        quota = (_read(os.path.join(directory, "cpu.cfs_quota_us")) or "").strip()
        period = (_read(os.path.join(directory, "cpu.cfs_period_us")) or "").strip()
        if quota.isdigit() and period.isdigit() and int(period) > 0:  # "-1": no quota.
            cores = int(quota) / int(period)
            if best is None or cores < best.cores:
                relative = os.path.relpath(directory, mount)
                best = Quota(cores, os.path.normpath(os.path.join(accounting, relative, "cpuacct.usage")), 1)
    return best


@functools.lru_cache(maxsize=4)
def _located(root: str, proc_cgroup: str) -> tuple[str, object] | None:
    """Where the quota is read: ("v2", path) or ("v1", groups), or None without a cgroup fs."""
    groups = _groups(proc_cgroup)
    if os.path.isfile(os.path.join(root, "cgroup.controllers")) and "" in groups:
        return "v2", groups[""]
    if groups:
        return "v1", groups
    return None


def cpu_quota(root: str = CGROUP_ROOT, proc_cgroup: str = _PROC_CGROUP) -> Quota | None:
    """This process's CPU quota now (the module), or None where none is set or none can be
    read. The group's place is found once a process; the quota is read at each call (a pod's
    limit may be resized in place)."""
    located = _located(root, proc_cgroup)
    if located is None:
        return None
    kind, where = located
    return _v2(root, where) if kind == "v2" else _v1(root, where)


def quota_cores(quota: Quota | None) -> int | None:
    """The whole cores a quota runs: its share rounded down, at least one (a quota of 2.5
    cores runs two processes at full speed; a third would make all three wait)."""
    return None if quota is None else max(1, math.floor(quota.cores + 1e-9))


def quota_used_ns(quota: Quota | None) -> int | None:
    """The CPU time the quota's group has used, cumulative, in ns; None where unreadable."""
    if quota is None or quota.usage_path is None:
        return None
    text = _read(quota.usage_path) or ""
    if quota.usage_unit_ns == 1:
        value = text.strip()
    else:
        value = next((line.split()[1] for line in text.splitlines()
                      if line.startswith("usage_usec ") and len(line.split()) == 2), "")
    return int(value) * quota.usage_unit_ns if value.isdigit() else None

"""The CPU a control group's quota leaves this process: a container or a Kubernetes pod with a
CPU limit (cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us) runs on a machine whose
cores it may all be scheduled on (sched_getaffinity counts them all) but gets only the limit's
share of CPU time; past it every process of the group, the trainer too, waits for the next
period. The loader's defaults (plan/defaults.py) count the quota's cores as the cores it may
use, and readers="auto" counts what the quota leaves unused as idle (readers/bottleneck.py),
so that neither starts nor adds readers that only make the group wait.

The quota is the smallest of those set on the process's group and the groups above it (each
one caps what its subtree runs). Its usage counter is the group's that sets it (v2 cpu.stat's
usage_usec; v1 cpuacct.usage, of the same path in the cpuacct hierarchy, where this process
is in the same path in both). Everything here is read from files the kernel writes, as
foreign input: where one is missing or unreadable (no cgroup file system, another layout) or
holds what the kernel would not write (no 64-bit number, a zero quota or period), there is
no quota to keep to: None.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import stat

CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"
_BYTES_MAX = 4096
# /proc/self/cgroup names a group per hierarchy: a v1 host's dozen lines of a Kubernetes
# pod's systemd paths (200 characters each) come near _BYTES_MAX, and a line cut short
# names a group that is not there (read as "no quota").
_PROC_CGROUP_BYTES_MAX = 1 << 16
# Groups looked at, the process's own and those above it (cgroup trees are shallow; a
# bound on the files read at each reading, as page_cache.py's).
_CGROUP_DEPTH_MAX = 16
# A group path of more parts than this is not walked (each part is a stat at each reading).
_CGROUP_PARTS_MAX = 64
# The kernel's quota, period and usage counters are 64-bit: a number of more digits is not
# one the kernel wrote (and would overflow the float a share is taken in).
_DIGITS_MAX = 20


@dataclasses.dataclass(frozen=True)
class Quota:
    """A CPU quota: `cores` (quota / period, fractional), `usage_path` the file of the group's
    cumulative CPU time that sets it, `usage_unit_ns` its unit (1000 for v2's microseconds),
    `stat_path` that group's cpu.stat (nr_throttled: the periods it ran out of its quota)."""

    cores: float
    usage_path: str | None
    usage_unit_ns: int
    stat_path: str | None = None


def _read(path: str, limit: int = _BYTES_MAX) -> str | None:
    """A regular file's first `limit` bytes as ASCII, else None (the kernel's cgroup and proc
    files are regular: a FIFO or device put in their place is not read, nor waited on)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        return os.read(descriptor, limit).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(descriptor)


def _number(text: str) -> int | None:
    """A counter or setting the kernel wrote: ASCII digits that fit 64 bits, else None."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= _DIGITS_MAX else None


def _share(quota_text: str, period_text: str) -> float | None:
    """quota / period in cores, None where either is no positive number ("max", "-1": none)."""
    quota, period = _number(quota_text), _number(period_text)
    return quota / period if quota and period else None


def _groups(proc_cgroup: str) -> dict[str, str]:
    """/proc/self/cgroup as {controller: path}: "" for the v2 group (hierarchy 0)."""
    groups = {}
    for line in (_read(proc_cgroup, _PROC_CGROUP_BYTES_MAX) or "").splitlines():
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
    if len(parts) > _CGROUP_PARTS_MAX:
        return []  # Not a path the kernel names: no group to read, and no walk of it.
    while parts and not os.path.isdir(os.path.join(mount, *parts)):
        parts = parts[1:]  # The host's prefix of a path seen from inside a container.
    found = []
    while len(found) < _CGROUP_DEPTH_MAX:
        found.append(os.path.join(mount, *parts))
        if not parts:
            break
        parts = parts[:-1]
    return found


def _v2(directories: list[str]) -> Quota | None:
    best = None
    for directory in directories:
        fields = (_read(os.path.join(directory, "cpu.max")) or "").split()
        cores = _share(*fields) if len(fields) == 2 else None
        if cores is not None and (best is None or cores < best.cores):
            best = Quota(cores, os.path.join(directory, "cpu.stat"), 1000, os.path.join(directory, "cpu.stat"))
    return best


def _v1_places(root: str, groups: dict[str, str]) -> tuple[str, list[str], str | None] | None:
    """(the cpu hierarchy's mount, the group's directories in it, the mount whose same paths
    account its usage), or None without a cpu hierarchy this process is in. Where cpu and
    cpuacct are hierarchies apart, a group of the same path accounts the usage only where
    this process is in the same path in both (docker's and systemd's layout): a process
    moved into a cpu group alone (cgexec -g cpu:...) is accounted elsewhere (None)."""
    names = [name for name in ("cpu,cpuacct", "cpuacct,cpu", "cpu") if os.path.isdir(os.path.join(root, name))]
    if not names or "cpu" not in groups:
        return None
    mount = os.path.join(root, names[0])
    accounting = mount if "cpuacct" in names[0] else \
        os.path.join(root, "cpuacct") if groups.get("cpuacct") == groups["cpu"] else None
    return mount, _directories(mount, groups["cpu"]), accounting


def _v1(mount: str, directories: list[str], accounting: str | None) -> Quota | None:
    best = None
    for directory in directories:
        cores = _share((_read(os.path.join(directory, "cpu.cfs_quota_us")) or "").strip(),
                       (_read(os.path.join(directory, "cpu.cfs_period_us")) or "").strip())
        if cores is not None and (best is None or cores < best.cores):
            usage = None if accounting is None else \
                os.path.normpath(os.path.join(accounting, os.path.relpath(directory, mount), "cpuacct.usage"))
            best = Quota(cores, usage, 1, os.path.join(directory, "cpu.stat"))
    return best


@functools.lru_cache(maxsize=4)
def _located(root: str, proc_cgroup: str) -> tuple[str | None, dict[str, str]] | None:
    """Where the quota is read: (the v2 mount, groups): ROOT, or a hybrid host's ROOT/unified
    where no v1 hierarchy has cpu; (None, groups) for v1; None without a cgroup fs."""
    groups = _groups(proc_cgroup)
    if os.path.isfile(os.path.join(root, "cgroup.controllers")) and "" in groups:
        return root, groups
    if _v1_places(root, groups) is not None:
        return None, groups
    unified = os.path.join(root, "unified")
    if os.path.isfile(os.path.join(unified, "cgroup.controllers")) and "" in groups:
        return unified, groups
    return None


def cpu_quota(root: str = CGROUP_ROOT, proc_cgroup: str = _PROC_CGROUP) -> Quota | None:
    """This process's CPU quota now (the module), or None where none is set or none can be
    read. The group's place is found once a process; the quota is read at each call (a pod's
    limit may be resized in place)."""
    located = _located(root, proc_cgroup)
    if located is None:
        return None
    v2_mount, groups = located
    if v2_mount is not None:
        return _v2(_directories(v2_mount, groups[""]))
    places = _v1_places(root, groups)
    return None if places is None else _v1(*places)


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
    number = _number(value)
    return None if number is None else number * quota.usage_unit_ns


def quota_throttled(quota: Quota | None) -> int | None:
    """The periods the quota's group ran out of its quota (cpu.stat's nr_throttled, v1 and v2),
    cumulative; None where unreadable. Where the group's CPU time cannot be read (v1 with cpu
    and cpuacct apart and this process in other groups of each), a rise says the group had
    no CPU left in the window."""
    if quota is None or quota.stat_path is None:
        return None
    text = _read(quota.stat_path) or ""
    value = next((line.split()[1] for line in text.splitlines()
                  if line.startswith("nr_throttled ") and len(line.split()) == 2), "")
    return _number(value)

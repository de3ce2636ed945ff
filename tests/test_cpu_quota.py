"""A CPU quota (a container's or a Kubernetes pod's CPU limit) bounds the cores the loader's
defaults count and the idle cores readers="auto" may add readers on (plan/cpu_quota.py): the
quota read from cgroup v2 and v1 trees laid out as the kernel does (files written here, so
every layout runs on any host), the idle measure against a property, and a real v1 group with
a quota of one core where this host lets the test make one."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import uuid

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import child_environment, examples, our_shm_entries, wait_until
from shmloader.plan import cpu_quota, defaults
from shmloader.readers.bottleneck import Reading, idle_cores_between


def _tree(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _quota(tmp_path: pathlib.Path, proc_cgroup: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    _tree(root, files)
    (tmp_path / "self_cgroup").write_text(proc_cgroup)
    # The group's place is found once a process, by path: pytest gives a parametrised test's
    # cases the same tmp_path where each passes (its retention policy removes it), so a case
    # would read the place of the one before.
    cpu_quota._located.cache_clear()
    return cpu_quota.cpu_quota(str(root), str(tmp_path / "self_cgroup")), root


def test_v2_the_smallest_quota_of_the_group_and_those_above_with_its_usage(tmp_path):
    quota, root = _quota(tmp_path, "0::/pods/a/worker\n", {
        "cgroup.controllers": "cpu memory", "cpu.stat": "usage_usec 1\n",
        "pods/cpu.max": "800000 100000\n", "pods/a/cpu.max": "250000 100000\n",
        "pods/a/cpu.stat": "usage_usec 7000\nuser_usec 5000\n", "pods/a/worker/cpu.max": "max 100000\n"})
    assert quota.cores == 2.5 and cpu_quota.quota_cores(quota) == 2
    assert cpu_quota.quota_used_ns(quota) == 7_000_000  # The group that sets it: pods/a.


def test_v2_inside_a_container_the_mount_is_the_containers_group(tmp_path):
    """/proc/self/cgroup names the group from the host's root; the container's mount is that
    group: the host's prefix is not there, and the walk starts from what is."""
    quota, _ = _quota(tmp_path, "0::/kubepods/burstable/pod1/c1\n", {
        "cgroup.controllers": "cpu", "cpu.max": "400000 100000\n", "cpu.stat": "usage_usec 3\n"})
    assert quota.cores == 4.0 and cpu_quota.quota_used_ns(quota) == 3000


@pytest.mark.parametrize("mount", ["cpu,cpuacct", "cpu"])
def test_v1_quota_and_the_usage_of_its_group(tmp_path, mount):
    accounting = mount if mount == "cpu,cpuacct" else "cpuacct"
    quota, root = _quota(tmp_path, "4:memory:/x\n2:cpuacct:/docker/j\n1:cpu:/docker/j\n" if mount == "cpu" else
                         "3:cpu,cpuacct:/docker/j\n", {
                             f"{mount}/cpu.cfs_quota_us": "-1\n", f"{mount}/cpu.cfs_period_us": "100000\n",
                             f"{mount}/docker/j/cpu.cfs_quota_us": "150000\n",
                             f"{mount}/docker/j/cpu.cfs_period_us": "100000\n",
                             f"{accounting}/docker/j/cpuacct.usage": "123456789\n"})
    assert quota.cores == 1.5 and cpu_quota.quota_cores(quota) == 1
    assert cpu_quota.quota_used_ns(quota) == 123456789


@pytest.mark.parametrize("files", [
    {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},  # v1, no quota
    {"cgroup.controllers": "cpu", "cpu.max": "max 100000\n"},  # v2, no quota
    {"cgroup.controllers": "cpu", "cpu.max": "garbage\n"},  # unreadable: none to keep to
    {},  # no cgroup file system
])
def test_no_quota_is_none(tmp_path, files):
    quota, _ = _quota(tmp_path, "1:cpu:/\n0::/\n" if files else "", files)
    assert quota is None and cpu_quota.quota_cores(quota) is None and cpu_quota.quota_used_ns(quota) is None


@pytest.mark.parametrize("files", [
    {"cgroup.controllers": "cpu", "cpu.max": "9" * 400 + " 1\n"},  # past 64 bits: overflowed the float share
    {"cgroup.controllers": "cpu", "cpu.max": "1 " + "9" * 30 + "\n"},
    {"cgroup.controllers": "cpu", "cpu.max": "0 100000\n"},  # a zero quota: the kernel refuses one
    {"cgroup.controllers": "cpu", "cpu.max": "100000 0\n"},
    {"cgroup.controllers": "cpu", "cpu.max": "\u0661\u0660\u0660\u0660\u0660\u0660 100000\n"},  # not ASCII digits
    {"cpu/cpu.cfs_quota_us": "9" * 400, "cpu/cpu.cfs_period_us": "1\n"},
    {"cpu/cpu.cfs_quota_us": "0\n", "cpu/cpu.cfs_period_us": "100000\n"},
], ids=["v2-huge-quota", "v2-huge-period", "v2-zero-quota", "v2-zero-period", "v2-arabic-digits", "v1-huge-quota",
        "v1-zero-quota"])
def test_a_value_the_kernel_would_not_write_is_no_quota_not_a_crash_or_zero_cores(tmp_path, files):
    quota, _ = _quota(tmp_path, "1:cpu:/\n0::/\n", files)
    assert quota is None


def test_a_usage_counter_past_64_bits_is_unknown(tmp_path):
    quota, _ = _quota(tmp_path, "1:cpu,cpuacct:/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpuacct.usage": "9" * 400 + "\n"})
    assert quota.cores == 1.0 and cpu_quota.quota_used_ns(quota) is None


def test_a_fifo_in_place_of_a_cgroup_file_is_not_waited_on(tmp_path):
    """A FIFO's open() blocks until a writer comes: the loader must not wait on one (the
    writer here only unblocks a read that would have hung, 2 s on)."""
    import threading
    import time

    root = tmp_path / "cgroup"
    _tree(root, {"cgroup.controllers": "cpu"})
    os.mkfifo(root / "cpu.max")
    (tmp_path / "self_cgroup").write_text("0::/\n")
    cpu_quota._located.cache_clear()
    unblock = threading.Timer(2.0, lambda: os.close(os.open(root / "cpu.max", os.O_WRONLY | os.O_NONBLOCK)))
    unblock.start()
    try:
        started = time.monotonic()
        assert cpu_quota.cpu_quota(str(root), str(tmp_path / "self_cgroup")) is None
        assert time.monotonic() - started < 1.0
    finally:
        unblock.cancel()
        unblock.join()


def test_v1_cpu_and_cpuacct_apart_a_cpu_group_joined_alone_has_no_usage_of_another_group(tmp_path):
    """cgexec -g cpu:lim moves a process into cpu's group alone: its cpuacct group is another
    one, and a cpuacct group named as its cpu group (here, idle: 5 ns) is not the quota's."""
    quota, _ = _quota(tmp_path, "2:cpuacct:/user\n1:cpu:/lim\n", {
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
        "cpu/lim/cpu.cfs_quota_us": "100000\n", "cpu/lim/cpu.cfs_period_us": "100000\n",
        "cpuacct/lim/cpuacct.usage": "5\n", "cpuacct/user/cpuacct.usage": "77\n"})
    assert quota.cores == 1.0 and cpu_quota.quota_used_ns(quota) is None


def test_a_hybrid_hosts_v2_hierarchy_is_read_where_no_v1_one_has_cpu(tmp_path):
    quota, _ = _quota(tmp_path, "4:memory:/a\n0::/a\n", {
        "memory/memory.stat": "", "unified/cgroup.controllers": "cpu", "unified/a/cpu.max": "200000 100000\n",
        "unified/a/cpu.stat": "usage_usec 9\n"})
    assert quota.cores == 2.0 and cpu_quota.quota_used_ns(quota) == 9000


def test_a_long_proc_self_cgroup_is_read_to_its_cpu_line(tmp_path):
    """A v1 host's dozen hierarchies with a Kubernetes pod's systemd paths: past 4 KiB, with
    cpu's line last (as the kernel lists hierarchy 1)."""
    group = "/kubepods.slice/" + "p" * 200 + ".slice/cri-containerd-" + "c" * 64 + ".scope"
    lines = "".join(f"{index}:name=h{index}:{group}\n" for index in range(16, 1, -1)) + f"1:cpu,cpuacct:{group}\n"
    assert len(lines) > 4096
    quota, _ = _quota(tmp_path, lines, {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        f"cpu,cpuacct{group}/cpu.cfs_quota_us": "300000\n", f"cpu,cpuacct{group}/cpu.cfs_period_us": "100000\n"})
    assert quota is not None and quota.cores == 3.0


def test_a_quota_bounds_the_cores_the_defaults_count(monkeypatch):
    monkeypatch.delenv(defaults.CPU_BUDGET_VARIABLE, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(defaults, "cpu_quota", lambda: cpu_quota.Quota(4.5, None, 1))
    assert defaults._affinity_cores() == (4, 4)
    assert defaults.default_readers({}) == 4 and defaults.node_budget({}) == 4  # Never under the default.
    # Four ranks in one pod share its quota: a core each, no more.
    assert defaults.default_readers({"LOCAL_WORLD_SIZE": "4"}) == 1
    monkeypatch.setattr(defaults, "cpu_quota", lambda: cpu_quota.Quota(16.0, None, 1))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # A rank pinned to 8 of them.
    assert defaults._affinity_cores() == (8, 16)
    assert defaults.default_readers({"LOCAL_WORLD_SIZE": "2"}) == 8
    monkeypatch.setattr(defaults, "cpu_quota", lambda: cpu_quota.Quota(0.2, None, 1))  # Never below one.
    assert defaults._affinity_cores() == (1, 1)


@examples(30)
@given(cores=st.integers(1, 64), idle_share=st.floats(0, 1), quota=st.one_of(st.none(), st.floats(0.1, 64)),
       used_share=st.floats(0, 1.5), seconds=st.floats(0.01, 20))
def test_idle_cores_are_the_cores_idle_time_and_no_more_than_the_quota_leaves(cores, idle_share, quota, used_share,
                                                                             seconds):
    total = int(seconds * 1e9) * cores
    used = None if quota is None else int(used_share * quota * seconds * 1e9)
    before = Reading(0, 0, (), 4, 0, 0, 0, cores, quota_cores=quota, quota_used_ns=None if quota is None else 10)
    after = Reading(int(seconds * 1e9), 0, (), 4, 0, int(idle_share * total), total, cores, quota_cores=quota,
                    quota_used_ns=None if quota is None else 10 + used)
    physical = cores * min(1.0, int(idle_share * total) / total)
    expected = physical if quota is None else min(physical, max(0.0, quota - used / int(seconds * 1e9)))
    assert idle_cores_between(before, after) == pytest.approx(expected, abs=1e-6)


def test_where_the_groups_time_is_unknown_a_throttled_window_has_no_idle_core(tmp_path):
    quota, _ = _quota(tmp_path, "2:cpuacct:/\n1:cpu:/lim\n", {
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n", "cpu/lim/cpu.cfs_quota_us": "100000\n",
        "cpu/lim/cpu.cfs_period_us": "100000\n", "cpu/lim/cpu.stat": "nr_periods 40\nnr_throttled 12\n",
        "cpuacct/lim/cpuacct.usage": "5\n"})
    assert quota.cores == 1.0 and cpu_quota.quota_used_ns(quota) is None  # Accounted in cpuacct's "/".
    assert cpu_quota.quota_throttled(quota) == 12
    before = Reading(0, 0, (), 4, 0, 0, 0, 2, quota_cores=1.0, quota_throttled=12)
    after = Reading(10**9, 0, (), 4, 0, 10**9, 2 * 10**9, 2, quota_cores=1.0, quota_throttled=15)
    assert idle_cores_between(before, after) == 0.0
    assert idle_cores_between(before, dataclasses.replace(after, quota_throttled=12)) == 1.0  # The host's, capped.
    v2, _ = _quota(tmp_path / "v2", "0::/a\n", {"cgroup.controllers": "cpu", "a/cpu.max": "50000 100000\n",
                                                 "a/cpu.stat": "usage_usec 4\nnr_periods 9\nnr_throttled 3\n"})
    assert cpu_quota.quota_throttled(v2) == 3


def test_idle_cores_are_no_more_than_the_quota_where_its_groups_time_is_unknown():
    """A 64-core host, 60 of them idle, a quota of 4 cores whose usage cannot be read (v1's
    cpuacct apart), or whose counter went back (a group made again): 4 at most, not 60."""
    before = Reading(0, 0, (), 4, 0, 0, 0, 64, quota_cores=4.0, quota_used_ns=None)
    after = Reading(10**9, 0, (), 4, 0, 60 * 10**9, 64 * 10**9, 64, quota_cores=4.0, quota_used_ns=None)
    assert idle_cores_between(before, after) == 4.0
    went_back = dataclasses.replace(after, cores_idle_ns=None, cores_total_ns=None, quota_used_ns=0)
    assert idle_cores_between(dataclasses.replace(before, quota_used_ns=5 * 10**9), went_back) == 4.0


# ---- A real group ------------------------------------------------------------------------

_CPU_ROOT = pathlib.Path("/sys/fs/cgroup/cpu")
_CPUACCT_ROOT = pathlib.Path("/sys/fs/cgroup/cpuacct")


@contextlib.contextmanager
def _one_core_group(accounted: bool = True):
    """A v1 cpu group with a quota of one core (and, where `accounted`, a cpuacct group of the
    same path where that hierarchy is apart, for its usage): the cgroup.procs files to join.
    Removed at the end; skips where the host cannot make one (v2 alone, a read-only /sys,
    not root)."""
    from test_bottleneck import _remove_group

    if not (_CPU_ROOT / "cpu.cfs_quota_us").exists():
        pytest.skip(f"no cgroup v1 cpu controller at {_CPU_ROOT}: no group to test in")
    name = f"shmloader-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    apart = _CPUACCT_ROOT.exists() and _CPUACCT_ROOT.resolve() != _CPU_ROOT.resolve()
    if not accounted and not apart:
        pytest.skip("cpu and cpuacct are one hierarchy here: a cpu group is always accounted")
    roots = [_CPU_ROOT, _CPUACCT_ROOT] if apart and accounted else [_CPU_ROOT]
    made = []
    try:
        for root in roots:
            try:
                (root / name).mkdir()
            except OSError as error:
                pytest.skip(f"cannot make a cgroup at {root / name}: {error}")
            made.append(root / name)
        try:
            (made[0] / "cpu.cfs_period_us").write_text("100000")
            (made[0] / "cpu.cfs_quota_us").write_text("100000")
        except OSError as error:
            pytest.skip(f"cannot set a quota on {made[0]}: {error}")
        yield [group / "cgroup.procs" for group in made]
    finally:
        for group in made:
            _remove_group(group)


@pytest.mark.parametrize("accounted", [True, False])
def test_under_a_one_core_quota_auto_starts_one_reader_and_adds_none_on_the_idle_core(tmp_path, accounted):
    """A trainer that takes batches as fast as they come, in a group with one core's quota on
    a host of two or more: the defaults count one core (one reader), and the idle cores the
    tuner sees are what the quota leaves, about none, not the host's idle core, so auto adds
    no reader that would only make the group wait (before: two readers from the start).
    Not `accounted` (a process in a cpu group alone, its CPU time unknown): the periods the
    group was throttled say it (before: 1.0 core idle, and a second reader tried)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: a quota of one core changes nothing to see")
    path = tmp_path / "rows.npy"
    np.save(path, np.random.default_rng(5).integers(0, 256, size=(16384, 1024), dtype=np.uint8))
    with _one_core_group(accounted) as procs:
        child = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).with_name("cpu_quota_child.py")),
                                  ",".join(map(str, procs)), str(path), "3.5"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=child_environment())
        try:
            output, errors = child.communicate(timeout=90)
        finally:
            child.kill()
            child.wait()
    assert child.returncode == 0 and output, (child.returncode, errors[-4000:])
    assert wait_until(lambda: not our_shm_entries(child.pid), timeout=10), our_shm_entries(child.pid)
    found = json.loads(output)
    assert found["cores"] == [1, 1] and found["start"] == 1, found
    assert max(found["counts"]) == 1, found
    seen = [idle for idle in found["idle"] if idle is not None]
    assert seen and max(seen) < 0.5, found

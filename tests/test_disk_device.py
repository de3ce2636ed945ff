"""readers/disk_device.py finds the disk a file is read from and how busy it was: device
numbers resolved through a sysfs tree built here (a partition to its disk, device-mapper over
one device to it and over two to itself, a loop device to its backing file's disk; alike
whatever device pytest's tmp is on), the disks of the files a process opened read-only (not
its stdout or a log), kept per (pid, start time) and looked at again, the read limit its
cgroups set (v1 and v2) on the disk or a device on the way to it, and /proc/diskstats parsed and differenced over windows drawn by Hypothesis, against the
counters that were written; then the advice each kind of window gives."""

from __future__ import annotations

import fractions
import os
import pathlib
import tempfile

import pytest

from shmloader.readers import disk_device
from shmloader.readers.disk_device import (
    SECTOR_BYTES,
    DiskCounters,
    DiskRates,
    disk_advice,
    disk_counters,
    disk_of,
    disk_window,
    disks_of_paths,
    disks_of_process,
    read_limit,
)

hypothesis = pytest.importorskip("hypothesis")
from conftest import examples  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# The fake tree's disks: sysfs directory (under sys/devices), device number, rotational.
_DISKS = {
    "sda": ("pci0/ata1/block/sda", (8, 0), "1"),
    "nvme0n1": ("pci0/nvme0/block/nvme0n1", (259, 0), "0"),
    "dm-0": ("virtual/block/dm-0", (253, 0), "0"),
    "dm-1": ("virtual/block/dm-1", (253, 1), "0"),
    "loop0": ("virtual/block/loop0", (7, 0), "0"),
    "loop1": ("virtual/block/loop1", (7, 1), "0"),
}
# The tree's other numbers: a partition, a device with no stat file, one sysfs does not know.
_OTHER_NUMBERS = {"sda1": (8, 1), "ram0": (1, 0), "unknown": (0, 99)}
# Added to every major of the tree where the real device of the test's tmp directory has one
# of the tree's numbers (8:1 on many CI VMs, 253:x under LVM, 7:x on a loop mount): the real
# number is then linked to nvme0n1 without hiding one of the tree's own devices.
_MAJOR_SHIFT = 1000


def _numbers(real: tuple[int, int]) -> dict[str, tuple[int, int]]:
    """The device number of each name in the tree, none of them `real` (a file's real st_dev)."""
    numbers = {name: number for name, (_, number, _) in _DISKS.items()} | _OTHER_NUMBERS
    if real in numbers.values():
        numbers = {name: (major + _MAJOR_SHIFT, minor) for name, (major, minor) in numbers.items()}
    assert real not in numbers.values()
    return numbers


def _link(link: pathlib.Path, target: pathlib.Path) -> None:
    """A relative symbolic link, as sysfs has: the tree resolves inside tmp_path."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _tree(root: pathlib.Path, backing: pathlib.Path) -> dict[str, tuple[int, int]]:
    """A sysfs under `root`: sda with partition sda1, nvme0n1, dm-0 over sda1, dm-1 over sda1
    and nvme0n1, loop0 backed by `backing` (a real file, whose real device number is made
    to name nvme0n1 here), loop1 backed by a file that is gone; the number of each name."""
    real = backing.stat().st_dev
    numbers = _numbers((os.major(real), os.minor(real)))
    devices = root / "sys/devices"
    for name, (place, _, spins) in _DISKS.items():
        major, minor = numbers[name]
        directory = devices / place
        (directory / "queue").mkdir(parents=True)
        (directory / "stat").write_text("0 " * 17)
        (directory / "dev").write_text(f"{major}:{minor}\n")
        (directory / "queue/rotational").write_text(spins + "\n")
        _link(root / f"sys/dev/block/{major}:{minor}", directory)
        _link(root / "sys/block" / name, directory)
    partition = devices / _DISKS["sda"][0] / "sda1"
    partition.mkdir()
    (partition / "partition").write_text("1\n")
    (partition / "dev").write_text("{}:{}\n".format(*numbers["sda1"]))
    (partition / "stat").write_text("0 " * 17)
    _link(root / "sys/dev/block/{}:{}".format(*numbers["sda1"]), partition)
    _link(devices / _DISKS["dm-0"][0] / "slaves/sda1", partition)
    _link(devices / _DISKS["dm-1"][0] / "slaves/sda1", partition)
    _link(devices / _DISKS["dm-1"][0] / "slaves/nvme0n1", devices / _DISKS["nvme0n1"][0])
    for name, file in (("loop0", backing), ("loop1", root / "gone.img")):
        (devices / _DISKS[name][0] / "loop").mkdir()
        (devices / _DISKS[name][0] / "loop/backing_file").write_text(f"{file}\n")
    _link(root / f"sys/dev/block/{os.major(real)}:{os.minor(real)}", devices / _DISKS["nvme0n1"][0])
    (devices / "virtual/block/ram0").mkdir(parents=True)  # A device with no stat file.
    _link(root / "sys/dev/block/{}:{}".format(*numbers["ram0"]), devices / "virtual/block/ram0")
    return numbers


@pytest.fixture
def tree(tmp_path, monkeypatch):
    # The devices met on the way to each disk are kept by root; pytest reuses a passed test's tmp_path.
    monkeypatch.setattr(disk_device, "_CHAINS", {})
    backing = tmp_path / "backing.img"
    backing.write_bytes(b"\0" * 4096)
    root = tmp_path / "root"
    return root, backing, _tree(root, backing)


_RESOLVED = [
    ("a disk is itself", "sda", "sda"),
    ("a partition is its disk", "sda1", "sda"),
    ("device-mapper over one partition is that partition's disk", "dm-0", "sda"),
    ("device-mapper over two devices is itself: its counters are the whole", "dm-1", "dm-1"),
    ("a loop device is its backing file's disk", "loop0", "nvme0n1"),
    ("a loop device whose backing file is gone is itself", "loop1", "loop1"),
    ("a device with no stat file is none", "ram0", None),
    ("a number sysfs does not know (tmpfs, overlay) is none", "unknown", None),
]


@pytest.mark.parametrize("case, name, expected", _RESOLVED, ids=[case for case, _, _ in _RESOLVED])
def test_a_device_number_resolves_to_the_disk_that_holds_it(tree, case, name, expected):
    root, _, numbers = tree
    assert disk_of(os.makedev(*numbers[name]), str(root)) == expected, case


@pytest.mark.parametrize("real", [(8, 0), (8, 1), (253, 0), (253, 1), (7, 0), (7, 1), (259, 0), (1, 0), (0, 99),
                                  (1008, 1)], ids=lambda real: "{}:{}".format(*real))
def test_the_fake_tree_resolves_alike_whatever_device_the_tests_tmp_is_on(tmp_path, monkeypatch, real):
    """The backing file's device reported as each of the tree's own numbers (as it is where
    pytest's tmp is on sda1, LVM or a loop mount): every case resolves as on any other."""
    backing = tmp_path / "backing.img"
    backing.write_bytes(b"\0" * 4096)
    stat = os.stat

    def reported(path, *arguments, **keywords):
        status = stat(path, *arguments, **keywords)
        if os.fspath(path) != os.fspath(backing):
            return status
        fields = list(status)
        fields[2] = os.makedev(*real)
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", reported)
    numbers = _tree(tmp_path / "root", backing)
    found = [disk_of(os.makedev(*numbers[name]), str(tmp_path / "root")) for _, name, _ in _RESOLVED]
    assert found == [expected for _, _, expected in _RESOLVED], real
    assert disks_of_paths([backing], str(tmp_path / "root")) == ("nvme0n1",)


def _reported_on(monkeypatch, devices: dict[pathlib.Path, tuple[int, int]]) -> None:
    """os.stat reports each path of `devices` (or a link to it) on that device number, as a
    file on another disk would be: tmp_path has one real device."""
    stat = os.stat
    numbers = {os.fspath(path): number for path, number in devices.items()}

    def reported(path, *arguments, **keywords):
        status = stat(path, *arguments, **keywords)
        target = os.path.realpath(path) if keywords.get("follow_symlinks", True) else os.fspath(path)
        if target not in numbers and os.fspath(path) not in numbers:
            return status
        fields = list(status)
        fields[2] = os.makedev(*numbers.get(target, numbers.get(os.fspath(path))))
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", reported)


def _open(root: pathlib.Path, pid: int, descriptor: int, target, flags: int) -> None:
    """Descriptor `descriptor` of fake process `pid`: a link to `target`, and its fdinfo's
    flags (octal, as the kernel writes them)."""
    for folder in ("fd", "fdinfo"):
        (root / f"proc/{pid}/{folder}").mkdir(parents=True, exist_ok=True)
    (root / f"proc/{pid}/fd/{descriptor}").symlink_to(target)
    (root / f"proc/{pid}/fdinfo/{descriptor}").write_text(f"pos:\t0\nflags:\t0{flags:o}\nmnt_id:\t24\n")


def test_the_disks_of_paths_and_of_a_processs_open_files_are_each_named_once(tree, tmp_path):
    """Files on one disk name it once; a path that is not there, a descriptor that is not a
    regular file or is closed, and a process without descriptors name none; no diskstats in
    the tree: no counters, nothing made up."""
    root, backing, _ = tree
    assert disk_counters(("nvme0n1",), root=str(root)) == ()
    other = tmp_path / "other.npy"
    other.write_bytes(b"x")
    assert disks_of_paths([backing, other, tmp_path / "not-there"], str(root)) == ("nvme0n1",)
    _open(root, 4242, 3, "/dev/null", os.O_RDONLY)  # Not a regular file: not data.
    _open(root, 4242, 4, backing, os.O_RDONLY)
    _open(root, 4242, 5, other, os.O_RDONLY | os.O_CLOEXEC)
    _open(root, 4242, 6, tmp_path / "closed", os.O_RDONLY)
    assert disks_of_process(4242, str(root)) == ("nvme0n1",)
    assert disks_of_process(4243, str(root)) == ()


def test_a_readers_disks_are_those_of_the_files_it_opened_for_reading(tree, tmp_path, monkeypatch):
    """`python train.py > train.log` with the log on sda and the data on nvme0n1: the
    reader's stdout and stderr (the log), a file it opened to append or to write and read,
    and one whose fdinfo is gone are not its data; the files it opened read-only are."""
    root, backing, numbers = tree
    log, checkpoint, data = tmp_path / "train.log", tmp_path / "checkpoint.pt", tmp_path / "shard.npy"
    for path in (log, checkpoint, data):
        path.write_bytes(b"x")
    _reported_on(monkeypatch, {log: numbers["sda"], checkpoint: numbers["sda"], data: numbers["loop0"]})
    _open(root, 51, 0, "/dev/null", os.O_RDONLY)
    _open(root, 51, 1, log, os.O_WRONLY | os.O_APPEND)
    _open(root, 51, 2, log, os.O_RDONLY)  # Stderr a log opened read-only is still inherited.
    _open(root, 51, 3, log, os.O_WRONLY | os.O_APPEND)
    _open(root, 51, 4, checkpoint, os.O_RDWR)
    assert disks_of_process(51, str(root)) == ()
    _open(root, 51, 7, data, os.O_RDONLY)
    (root / "proc/51/fd/8").symlink_to(log)  # No fdinfo: closed between the two reads.
    assert disks_of_process(51, str(root)) == ("nvme0n1",)


def test_a_readers_disks_are_looked_at_again_and_a_reused_pid_is_another_reader(tree, tmp_path, monkeypatch):
    """top samples a reader before it opened its data: nothing is kept, and the next sample
    finds the data's disk; a kept answer is looked at again after the refresh period (a
    reader met a shard on another disk); a pid reused by a process started later answers
    for itself at once."""
    root, _, numbers = tree
    first, second = tmp_path / "first.npy", tmp_path / "second.npy"
    for path in (first, second):
        path.write_bytes(b"x")
    _reported_on(monkeypatch, {first: numbers["loop0"], second: numbers["sda"]})
    started = {61: 1000}
    monkeypatch.setattr(disk_device, "start_ticks", lambda pid: started.get(pid))
    monkeypatch.setattr(disk_device, "_READER_DISKS", {})
    refresh_s = disk_device._READER_DISKS_REFRESH_SECONDS
    _open(root, 61, 1, tmp_path / "train.log", os.O_WRONLY)
    (tmp_path / "train.log").write_bytes(b"")
    assert disk_device.disks_of_reader(61, str(root), now_s=0.0) == ()
    _open(root, 61, 3, first, os.O_RDONLY)
    assert disk_device.disks_of_reader(61, str(root), now_s=0.1) == ("nvme0n1",)
    (root / "proc/61/fd/3").unlink()
    (root / "proc/61/fd/3").symlink_to(second)
    assert disk_device.disks_of_reader(61, str(root), now_s=0.1 + refresh_s / 2) == ("nvme0n1",)
    assert disk_device.disks_of_reader(61, str(root), now_s=0.2 + refresh_s) == ("sda",)
    started[61] = 2000  # Reused by a process started later: not the answer kept for the other.
    (root / "proc/61/fd/3").unlink()
    (root / "proc/61/fd/3").symlink_to(first)
    assert disk_device.disks_of_reader(61, str(root), now_s=0.3 + refresh_s) == ("nvme0n1",)
    del started[61]  # Gone: nothing.
    assert disk_device.disks_of_reader(61, str(root), now_s=0.4 + refresh_s) == ()


@pytest.mark.parametrize("case, cgroup, files, disk, expected", [
    ("v1: the lowest limit of the group and those above it",
     "12:blkio:/a/b\n4:memory:/m\n", {"blkio/a/blkio.throttle.read_bps_device": "8:0 5000000\n",
                                      "blkio/a/b/blkio.throttle.read_bps_device": "8:0 9000000\n259:0 100\n"},
     "sda", (5000000, "blkio.throttle.read_bps_device of /a")),
    ("v1: another disk's line is not this one's", "12:blkio:/a/b\n",
     {"blkio/a/b/blkio.throttle.read_bps_device": "8:0 9000000\n259:0 100\n"}, "nvme0n1",
     (100, "blkio.throttle.read_bps_device of /a/b")),
    ("v2: io.max's rbps", "0::/c\n", {"c/io.max": "8:0 rbps=3000 wbps=max riops=max wiops=max\n"}, "sda",
     (3000, "io.max of /c")),
    ("v2 on the hybrid mount", "0::/c\n", {"unified/c/io.max": "8:0 rbps=7000 wbps=max riops=max wiops=max\n"},
     "sda", (7000, "io.max of /c")),
    ("v2: rbps=max is no limit", "0::/c\n", {"c/io.max": "8:0 rbps=max wbps=10 riops=max wiops=max\n"}, "sda",
     None),
    ("no blkio line", "4:memory:/m\n", {}, "sda", None),
    ("a group path climbing out is cut", "12:blkio:/../../etc\n", {}, "sda", None),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_processs_cgroups_read_limit_on_a_disk_is_found(tree, case, cgroup, files, disk, expected):
    root, _, numbers = tree
    (root / "proc/77").mkdir(parents=True)
    (root / "proc/77/cgroup").write_text(cgroup)
    for name, text in files.items():
        # The cases name the usual numbers; the tree's may be shifted (_numbers).
        for device in ("sda", "nvme0n1"):
            text = text.replace("{}:{} ".format(*_DISKS[device][1]), "{}:{} ".format(*numbers[device]))
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert read_limit(77, disk, str(root)) == expected, case


@pytest.mark.parametrize("case, on, through, expected", [
    ("a limit on an LVM volume over the disk's partition", "dm-0", "dm-0", (2000, "io.max of /c on {dm-0}")),
    ("a limit on the partition a file is on", "sda1", "sda1", (2000, "io.max of /c on {sda1}")),
    ("a limit on the partition beneath the volume a file is on", "sda1", "dm-0", (2000, "io.max of /c on {sda1}")),
    ("the disk's own limit where it is the lowest", "sda", "dm-0", (1000, "io.max of /c")),
    ("a limit on another volume the loader's files are not on", "dm-1", "dm-0", (9000, "io.max of /c")),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_read_limit_set_on_a_device_on_the_way_to_the_disk_counts(tree, case, on, through, expected):
    """io.max with a limit on the device named `on` (2,000 bytes/s; 1,000 on sda where that
    one is sda's) and 9,000 on sda: read_limit of the disk that a file on `through` resolves
    to is the lowest of the limits on the devices met on the way there."""
    root, _, numbers = tree
    (root / "proc/78").mkdir(parents=True)
    (root / "proc/78/cgroup").write_text("0::/c\n")
    number = "{}:{}".format(*numbers[on])
    disk = "{}:{}".format(*numbers["sda"])
    lines = [f"{disk} rbps={1000 if on == 'sda' else 9000} wbps=max riops=max wiops=max"]
    if on != "sda":
        lines.append(f"{number} rbps=2000 wbps=max riops=max wiops=max")
    (root / "sys/fs/cgroup/c").mkdir(parents=True)
    (root / "sys/fs/cgroup/c/io.max").write_text("\n".join(lines) + "\n")
    assert read_limit(78, "sda", str(root)) == ((1000, "io.max of /c") if on == "sda" else (9000, "io.max of /c"))
    assert disk_of(os.makedev(*numbers[through]), str(root)) == "sda"
    limit, source = expected
    assert read_limit(78, "sda", str(root)) == (limit, source.replace("{" + on + "}", number)), case


_NAMES = ("sda", "nvme0n1", "dm-0", "loop0")


def _diskstats(counters: dict[str, tuple[int, int]]) -> str:
    """/proc/diskstats' lines for (sectors read, io_ticks ms) of each disk, among lines of
    other devices and lines a parser must pass over."""
    lines = ["   1       0 ram0 0 0 0 0 0 0 0 0 0 0 0", "   8       1 sda1 5 0 999999 0 0 0 0 0 0 999999 0",
             "garbage", "   8       2 sdz x y z"]
    for index, (name, (sectors, ticks)) in enumerate(counters.items()):
        lines.append(f" 259 {index:7d} {name} 11 2 {sectors} 40 7 1 56 9 0 {ticks} 120 0 0 0 0 0 0")
    return "\n".join(lines) + "\n"


@st.composite
def _windows(draw):
    """Counters of the disks at a first reading, their growth over a window, the window."""
    start = {name: (draw(st.integers(0, 2**40)), draw(st.integers(0, 2**32))) for name in _NAMES}
    growth = {name: (draw(st.integers(0, 2**24)), draw(st.integers(0, 20_000))) for name in _NAMES}
    return start, growth, draw(st.integers(1, 20 * 10**9))


@examples(150)
@hypothesis.given(_windows())
def test_a_windows_disk_rate_and_busy_share_are_its_counters_growth(window):
    start, growth, window_ns = window
    with tempfile.TemporaryDirectory() as directory:
        (pathlib.Path(directory) / "proc").mkdir()
        stats = pathlib.Path(directory) / "proc/diskstats"
        stats.write_text(_diskstats(start))
        before = disk_counters(_NAMES, root=directory)
        stats.write_text(_diskstats({name: (start[name][0] + growth[name][0], start[name][1] + growth[name][1])
                                     for name in _NAMES}))
        after = disk_counters(_NAMES, root=directory)
    assert [disk.name for disk in before] == list(_NAMES) and [disk.read_bytes for disk in before] == [
        start[name][0] * SECTOR_BYTES for name in _NAMES]
    found = disk_window(before, after, window_ns)
    read = [name for name in _NAMES if growth[name][0] > 0]
    if not read:
        assert found is None
        return
    # The disk read most; of equals, the first of the loader's.
    most = max(read, key=lambda name: (growth[name][0], -_NAMES.index(name)))
    sectors, ticks = growth[most]
    rate = fractions.Fraction(sectors * 512 * 10**9, window_ns)
    assert set(found) == {"device", "device_busy", "device_read_bytes_per_s", "device_best_bytes_per_s"}, found
    assert found["device"] == most, found
    # Rounded to a thousandth and to a byte/s: equal to the exact fractions within that.
    assert found["device_busy"] == pytest.approx(float(min(1, fractions.Fraction(ticks * 10**6, window_ns))), abs=6e-4)
    assert found["device_read_bytes_per_s"] == found["device_best_bytes_per_s"] == pytest.approx(float(rate), abs=1,
                                                                                               rel=1e-12)


@examples(100)
@hypothesis.given(st.lists(st.tuples(st.integers(0, 2**30), st.integers(1, 3 * 10**9)), min_size=1, max_size=8))
def test_the_best_rate_is_the_highest_of_the_windows_long_enough_to_judge(windows):
    """Readings one after another: each window reads `bytes` in `ns`; the best is the highest
    rate over those of 0.2 s or more."""
    rates, at, total = DiskRates(), [], 0
    previous = disk_counters_at(0)
    for read_bytes, window_ns in windows:
        total += read_bytes
        current = disk_counters_at(total)
        rates.see(previous, current, window_ns)
        previous = current
        if window_ns >= 0.2e9:
            at.append(read_bytes / (window_ns / 1e9))
    assert rates.best.get("sda", 0.0) == pytest.approx(max(at, default=0.0))


def disk_counters_at(read_bytes: int) -> tuple[DiskCounters, ...]:
    return (DiskCounters("sda", read_bytes, 0),)


def _disk(busy: float, rate_mb: float, best_mb: float, limit: int | None = None) -> dict:
    found = {"device": "sda", "device_busy": busy, "device_read_bytes_per_s": rate_mb * 1e6,
             "device_best_bytes_per_s": best_mb * 1e6}
    if limit is not None:
        found.update(device_read_limit_bytes_per_s=limit, device_read_limit_source="io.max of /job")
    return found


@pytest.mark.parametrize("case, disk, rotates, readers_rate, words", [
    ("a cgroup's limit reached", _disk(0.02, 10, 10, limit=10**7), True, 9e6,
     "the readers' cgroup limits reads from it to 10 MB/s (io.max of /job): more readers would not help"),
    ("a limit not reached is not the reason", _disk(0.4, 10, 300, limit=10**9), False, 9e6, "it has room"),
    ("a disk with room", _disk(0.4, 120, 900), True, 1e8, "busy 40% of the window at 120 MB/s (the best seen from "
     "it here 900 MB/s): it has room, so more reads in flight would help (readers=4)"),
    ("a saturated disk at its best", _disk(0.97, 410, 420), False, 4e8, "it gives what it can, so more readers "
     "would not help"),
    ("a spinning disk busy below its best", _disk(0.99, 40, 200), True, 4e7, "shuffle_window"),
    ("an SSD busy below its best", _disk(0.99, 410, 1200), False, 4e8,
     "(the best seen from it here 1.2 GB/s): busy counts any request in flight, and an SSD serves many at once, so "
     "it may give more to more reads in flight (readers=4)"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_the_advice_says_whether_more_readers_would_help(case, disk, rotates, readers_rate, words):
    advice = disk_advice(disk, "readers=4", rotates, readers_rate)
    assert words in advice and advice.startswith("the device (sda) was busy"), (case, advice)

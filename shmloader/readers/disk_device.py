"""The disk a loader's files are read from, and how busy it was in a window: the reference
that the "disk reads" verdict (readers/bottleneck.py) compares the readers' reads with.

A file's st_dev names a block device (/sys/dev/block/MAJOR:MINOR); a partition counts as its
disk, a device-mapper or md device with one device beneath it (LVM, dm-crypt) as that
device, a loop device as the disk its backing file is on (where these can be followed; else
the device itself). /proc/diskstats gives each disk's sectors read and its busy time
(io_ticks: the milliseconds with at least one request in flight) since boot; two readings
give its read rate (every process's reads, not the loader's alone) and its busy share in
the window. The best rate seen from a disk in any window (DiskRates) stands in for the rate
it can give, as a measured sequential rate would: the loader has no time to measure one.
A cgroup's read limit on the disk, or on a device met on the way to it (a partition, an
LVM or dm-crypt volume), where the readers' group (or one above it) sets one (v1
blkio.throttle.read_bps_device, v2 io.max rbps), is read with the counters: a limit outside
the device that no busy share shows.

Everything here is read from sysfs and /proc, under `root` ("/"; a test's tree in tests),
and may be missing (tmpfs, overlay, a container without /sys): then nothing is said.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

from .budget_record import start_ticks
from .proc_counters import read_text as _read

# /proc/diskstats counts sectors of 512 bytes whatever the device's own sector size.
SECTOR_BYTES = 512
# Links followed from a file's device to its disk (partition, dm, loop): a bound, not a depth
# any real stack reaches.
_RESOLVE_STEPS_MAX = 8
# A loader's files whose devices are looked up (a glob of many shards sits on few disks).
PATHS_MAX = 1024
# A reader's open descriptors looked at (`shmloader top` finds the files it reads there).
DESCRIPTORS_MAX = 256
# /proc/diskstats: a line a device, loop and ram devices included.
_DISKSTATS_BYTES_MAX = 1 << 18
# A window shorter than this gives no "best rate": a burst of a few requests says little.
BEST_WINDOW_SECONDS_MIN = 0.2


@dataclasses.dataclass(frozen=True)
class DiskCounters:
    """A disk's cumulative counters (/proc/diskstats) at a reading."""

    name: str
    read_bytes: int
    busy_ms: int
    read_limit_bytes_per_s: int | None = None  # the readers' cgroup's, where one is set
    read_limit_source: str = ""  # the file and group that set it


# The device numbers ("MAJOR:MINOR") met on the way from a file's device to each disk
# (disk_of), by (root, disk name): a cgroup's read limit may be set on any of them (io.max
# "253:0 rbps=..." on an LVM volume or a dm-crypt device), and disk_counters is given the
# disk's name alone. Files on two volumes of one disk give both numbers: a limit on either
# counts (a bound on reads from the disk the verdict names, not per volume).
_CHAINS: dict[tuple[str, str], set[str]] = {}
_CHAINS_KEPT_MAX = 256


def disk_of(device: int, root: str = "/") -> str | None:
    """The kernel name of the disk behind device number `device` (a file's st_dev), or None
    where no block device has it (tmpfs, overlay, NFS) or sysfs cannot be read."""
    number = f"{os.major(device)}:{os.minor(device)}"
    path = os.path.join(root, "sys/dev/block", number)
    if not os.path.exists(path):
        return None
    path, chain = os.path.realpath(path), {number}
    for _ in range(_RESOLVE_STEPS_MAX):
        if os.path.exists(os.path.join(path, "partition")):
            chain.add((_read(os.path.join(path, "dev"), 32) or "").strip())
            path = os.path.dirname(path)
        beneath = _one_beneath(path, root)
        if beneath is None:
            break
        chain.add((_read(os.path.join(path, "dev"), 32) or "").strip())
        path = beneath
    if not os.path.exists(os.path.join(path, "stat")):
        return None
    name = os.path.basename(path)
    if len(_CHAINS) >= _CHAINS_KEPT_MAX:
        _CHAINS.clear()
    _CHAINS.setdefault((root, name), set()).update(number for number in chain if number)
    return name


def _one_beneath(path: str, root: str) -> str | None:
    """The sysfs directory of the one device beneath `path` (a dm or md device's single
    slave, a loop device's backing file's disk), or None: a disk, a stack over several
    devices (its own counters are the ones to read), or what cannot be followed."""
    try:
        slaves = os.listdir(os.path.join(path, "slaves"))
    except OSError:
        slaves = []
    if len(slaves) == 1:
        return os.path.realpath(os.path.join(path, "slaves", slaves[0]))
    backing = _read(os.path.join(path, "loop", "backing_file"), 4096)
    if backing:
        try:
            device = os.stat(backing.strip()).st_dev
        except OSError:
            return None  # A deleted or unreachable backing file: the loop device is what is known.
        found = os.path.join(root, "sys/dev/block", f"{os.major(device)}:{os.minor(device)}")
        return os.path.realpath(found) if os.path.exists(found) else None
    return None


def disks_of_paths(paths, root: str = "/") -> tuple[str, ...]:
    """The disks that the first PATHS_MAX of `paths` are stored on, each once, in order."""
    devices = []
    for path in list(paths)[:PATHS_MAX]:
        try:
            device = os.stat(path).st_dev
        except OSError:
            continue  # A copy not made yet (a store's), or removed: its disk is not known.
        if device not in devices:
            devices.append(device)
    return _names(disk_of(device, root) for device in devices)


# Descriptors a reader inherits rather than opens for data: stdin, stdout, stderr (a trainer
# started as `python train.py > train.log` hands every reader its log's descriptor).
_INHERITED_DESCRIPTORS = frozenset({"0", "1", "2"})


def disks_of_process(pid: int, root: str = "/") -> tuple[str, ...]:
    """The disks of the regular files process `pid` holds open for reading only (its first
    DESCRIPTORS_MAX descriptors past 0-2): what `top`, which knows no loader's paths, reads a
    reader's disks from. A file open for writing (a log, a checkpoint the trainer opened
    before the fork) is not data a reader reads."""
    directory = os.path.join(root, "proc", str(pid), "fd")
    try:
        descriptors = sorted(os.listdir(directory), key=lambda name: int(name) if name.isdigit() else -1)
    except OSError:
        return ()
    devices = []
    for name in [name for name in descriptors if name not in _INHERITED_DESCRIPTORS][:DESCRIPTORS_MAX]:
        if not _read_only(os.path.join(root, "proc", str(pid), "fdinfo", name)):
            continue
        try:
            status = os.stat(os.path.join(directory, name))
        except OSError:
            continue  # Closed meanwhile.
        if (status.st_mode & 0o170000) == 0o100000 and status.st_dev not in devices:
            devices.append(status.st_dev)
    return _names(disk_of(device, root) for device in devices)


def _read_only(fdinfo_path: str) -> bool:
    """Whether /proc/PID/fdinfo/N's `flags` (octal) say the descriptor was opened O_RDONLY;
    False where they cannot be read (closed meanwhile, another user's process)."""
    for line in (_read(fdinfo_path, 4096) or "").splitlines():
        name, _, value = line.partition(":")
        value = value.strip()
        if name == "flags" and value and all(digit in "01234567" for digit in value):
            return int(value, 8) & os.O_ACCMODE == os.O_RDONLY
    return False


# The disks each reader's open files are on, by (pid, start time): a pid reused after a wrap
# is another process. Looked at again while none are found (a reader opens its files as it
# starts) and after _READER_DISKS_REFRESH_SECONDS (a reader opens shards as it meets them;
# one glob may span disks). Cleared when full (top watching reader restarts for days).
_READER_DISKS: dict[tuple[int, int], tuple[float, tuple[str, ...]]] = {}
_READERS_KEPT_MAX = 256
_READER_DISKS_REFRESH_SECONDS = 10.0


def disks_of_reader(pid: int, root: str = "/", now_s: float | None = None) -> tuple[str, ...]:
    """disks_of_process(pid), kept for a while once found (see _READER_DISKS); `now_s`: a
    monotonic time in seconds (tests)."""
    ticks = start_ticks(pid)
    if ticks is None:
        return ()  # Gone, or a zombie: it reads nothing.
    now_s = time.monotonic() if now_s is None else now_s
    kept = _READER_DISKS.get((pid, ticks))
    if kept is not None and kept[1] and now_s - kept[0] < _READER_DISKS_REFRESH_SECONDS:
        return kept[1]
    disks = disks_of_process(pid, root)
    if len(_READER_DISKS) >= _READERS_KEPT_MAX:
        _READER_DISKS.clear()
    _READER_DISKS[(pid, ticks)] = (now_s, disks)
    return disks


def _names(names) -> tuple[str, ...]:
    found = []
    for name in names:
        if name is not None and name not in found:
            found.append(name)
    return tuple(found)


def disk_counters(names: tuple[str, ...], pid: int = 0, root: str = "/") -> tuple[DiskCounters, ...]:
    """The counters of the disks `names` from /proc/diskstats (foreign input: fields that
    are not numbers leave that disk out), with the read limit process `pid`'s cgroups set
    on each (pid 0: none looked for); () where it cannot be read."""
    if not names:
        return ()
    text = _read(os.path.join(root, "proc/diskstats"), _DISKSTATS_BYTES_MAX) or ""
    found = {}
    for line in text.splitlines():
        fields = line.split()
        # major minor name, then reads, merged, sectors read, ms reading, (writes: 4), in flight, io_ticks.
        if len(fields) >= 13 and fields[2] in names and fields[5].isdigit() and fields[12].isdigit():
            limit = read_limit(pid, fields[2], root) if pid > 0 else None
            found[fields[2]] = DiskCounters(fields[2], int(fields[5]) * SECTOR_BYTES, int(fields[12]),
                                            *(limit or (None, "")))
    return tuple(found[name] for name in names if name in found)


# Groups above a process's own looked at for a read limit (cgroup trees are shallow).
_CGROUP_DEPTH_MAX = 16


def read_limit(pid: int, name: str, root: str = "/") -> tuple[int, str] | None:
    """The lowest read limit (bytes/s) that process `pid`'s cgroups, or those above them,
    set on disk `name` or a device met on the way to it from a file (_CHAINS: a partition,
    a dm or loop device), and the file that sets it: cgroup v1's
    blkio.throttle.read_bps_device, v2's io.max (rbps); None where none is set or none can
    be read."""
    number = (_read(os.path.join(root, "sys/block", name, "dev"), 32) or "").strip()
    numbers = [number] + sorted(_CHAINS.get((root, name), set()) - {number}) if number else []
    text = _read(os.path.join(root, "proc", str(pid), "cgroup"), 4096) or ""
    places = []
    for line in text.splitlines():
        _, controllers, group = (line.split(":", 2) + ["", ""])[:3]
        if "blkio" in controllers.split(","):
            places.append((os.path.join(root, "sys/fs/cgroup/blkio"), group, "blkio.throttle.read_bps_device"))
        elif controllers == "" and line.startswith("0::"):
            places += [(os.path.join(root, "sys/fs/cgroup", mount), group, "io.max") for mount in ("", "unified")]
    lowest = None
    for mount, group, file_name in places:
        parts = [part for part in group.split("/") if part and part != ".."][:_CGROUP_DEPTH_MAX]
        for depth in range(len(parts), -1, -1):
            for device in numbers:
                limit = _limit_in(os.path.join(mount, *parts[:depth], file_name), device)
                if limit is not None and (lowest is None or limit < lowest[0]):
                    on = "" if device == number else f" on {device}"
                    lowest = (limit, f"{file_name} of /{'/'.join(parts[:depth])}{on}")
    return lowest


def _limit_in(path: str, number: str) -> int | None:
    """The read limit in a v1 blkio.throttle.read_bps_device ("8:0 1048576") or a v2 io.max
    ("8:0 rbps=1048576 wbps=max ...") for device `number` ("MAJOR:MINOR"), None if none."""
    for line in (_read(path, _DISKSTATS_BYTES_MAX) or "").splitlines():
        fields = line.split()
        if fields and fields[0] == number:
            for field in fields[1:]:
                value = field[len("rbps="):] if field.startswith("rbps=") else field
                if value.isdigit():
                    return int(value)
    return None


@functools.lru_cache(maxsize=64)
def rotational(name: str, root: str = "/") -> bool | None:
    """Whether disk `name` says it spins (one request at a time), None where unknown."""
    text = (_read(os.path.join(root, "sys/block", name, "queue/rotational"), 16) or "").strip()
    return {"1": True, "0": False}.get(text)


def _changes(before: tuple[DiskCounters, ...], after: tuple[DiskCounters, ...]) -> list[tuple[str, int, int]]:
    """(name, bytes read, busy ms) of each disk in both readings over the window between them."""
    earlier = {disk.name: disk for disk in before}
    return [(disk.name, max(0, disk.read_bytes - earlier[disk.name].read_bytes),
             max(0, disk.busy_ms - earlier[disk.name].busy_ms)) for disk in after if disk.name in earlier]


class DiskRates:
    """The best read rate seen from each disk between two readings at least
    BEST_WINDOW_SECONDS_MIN apart (bytes/s): the meter's and top's memory across windows."""

    def __init__(self) -> None:
        self.best: dict[str, float] = {}

    def see(self, before: tuple[DiskCounters, ...], after: tuple[DiskCounters, ...], window_ns: int) -> None:
        if window_ns < BEST_WINDOW_SECONDS_MIN * 1e9:
            return
        for name, read_bytes, _ in _changes(before, after):
            self.best[name] = max(self.best.get(name, 0.0), read_bytes * 1e9 / window_ns)


def disk_window(before: tuple[DiskCounters, ...], after: tuple[DiskCounters, ...], window_ns: int,
                best: dict[str, float] | None = None) -> dict | None:
    """The disk read most in the window: {"device", "device_busy" (0-1), "device_read_bytes_per_s",
    "device_best_bytes_per_s" (at least this window's)}, None where no disk was read."""
    changes = [change for change in _changes(before, after) if change[1] > 0]
    if window_ns <= 0 or not changes:
        return None
    name, read_bytes, busy_ms = max(changes, key=lambda change: change[1])
    rate = read_bytes * 1e9 / window_ns
    found = {"device": name, "device_busy": round(min(1.0, busy_ms * 1e6 / window_ns), 3),
             "device_read_bytes_per_s": round(rate),
             "device_best_bytes_per_s": round(max(rate, (best or {}).get(name, 0.0)))}
    limited = next(disk for disk in after if disk.name == name)
    if limited.read_limit_bytes_per_s is not None:
        found["device_read_limit_bytes_per_s"] = limited.read_limit_bytes_per_s
        found["device_read_limit_source"] = limited.read_limit_source
    return found


# Readers that read at this share of their cgroup's read limit on a disk are held by it.
LIMIT_SHARE_REACHED = 0.7
# A disk busy this share of the window has a request in flight nearly all the time: one that
# serves a request at a time (a spinning disk) can give no more.
DEVICE_BUSY_SATURATED = 0.9
# A busy disk reading at less than this share of its best has room an SSD may yet give to
# more requests in flight (io_ticks counts time with any request in flight, not its queue).
BEST_SHARE_SATURATED = 0.7


def disk_advice(disk: dict, more: str, rotates: bool | None, readers_bytes_per_s: float) -> str:
    """What the disk's window (disk_window's) says would help, in words: a cgroup's limit
    reached, the disk saturated or not, and so whether more readers (more reads in flight)
    can help. `more`: the setting that runs more readers (bottleneck.readers_setting);
    `readers_bytes_per_s`: what the loader's readers read from storage."""
    name, busy = disk["device"], disk["device_busy"]
    rate, best = disk["device_read_bytes_per_s"], disk["device_best_bytes_per_s"]
    seen = (f"the device ({name}) was busy {busy:.0%} of the window at {_rate(rate)} "
            f"(the best seen from it here {_rate(best)})")
    remedies = "data in the page cache (memory for it), faster storage, or fewer bytes (shmloader convert compresses)"
    limit = disk.get("device_read_limit_bytes_per_s")
    if limit is not None and readers_bytes_per_s >= LIMIT_SHARE_REACHED * limit:
        return (f"{seen}, and the readers' cgroup limits reads from it to {_rate(limit)} "
                f"({disk['device_read_limit_source']}): more readers would not help; a higher limit, or {remedies}")
    if busy < DEVICE_BUSY_SATURATED:
        return (f"{seen}: it has room, so more reads in flight would help ({more}), unless a limit outside the device "
                f"holds reads back (a cgroup's I/O throttle, a VM's disk cap); else {remedies}")
    if rate >= BEST_SHARE_SATURATED * best:
        return f"{seen}: it gives what it can, so more readers would not help: {remedies}"
    if rotates:
        return (f"{seen}: a spinning disk that busy below its best is seeking: a block-local shuffle "
                f"(shuffle_window) reads longer runs; else {remedies}")
    return (f"{seen}: busy counts any request in flight, and an SSD serves many at once, so it may give more "
            f"to more reads in flight ({more}); else {remedies}")


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.1f} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:,.0f} MB/s"

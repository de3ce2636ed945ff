"""Where a ring's bytes live: its file in /dev/shm when that tmpfs has room, else anonymous
shared memory (a memfd) that the file in /dev/shm only names.

A container's /dev/shm is often tiny (Docker's and a Kubernetes pod's default: 64 MB), far
below what the node's memory allows; PyTorch's DataLoader still runs there. So the ring's
segment name in /dev/shm always exists (it carries the owner lock, and `shmloader top` and
the stale sweep find every ring by it), but where /dev/shm cannot hold the ring it holds
only a stub of STUB_BYTES:

    offset  size  field        meaning
    ------  ----  -----------  ------------------------------------------------------------
    0       8     magic        STUB_MAGIC
    8       4     fd           the trainer's descriptor of the memfd (open for the ring's life)
    12      4     reserved     zero
    16      8     total_bytes  the ring's size (RingLayout.total_bytes)

and the data lives in a memfd of the trainer, named like the segment. Readers, forked
descendants of the trainer, open it again as /proc/<trainer pid>/fd/<fd> (a new open file
description, so their shared probe of the owner lock on the stub keeps its meaning), after
checking that the descriptor is still that memfd. The kernel frees a memfd with its last
descriptor and mapping: a killed trainer cannot leak the ring's memory, only the stub.

Why /dev/shm stays the first choice where it fits: its rings are visible to any process
that shares the tmpfs (another container's `shmloader top`, `ls /dev/shm`), and a memfd is
reachable only through /proc of its trainer's PID namespace. SHMLOADER_RING_MEMORY
("auto", "dev-shm", "anonymous") overrides the choice.
"""

from __future__ import annotations

import os
import struct

from ..errors import SharedMemoryError

STUB_MAGIC = b"SHMLANON"
_STUB_FORMAT = "<8sIIQ"
STUB_BYTES = struct.calcsize(_STUB_FORMAT)
MEMORY_VARIABLE = "SHMLOADER_RING_MEMORY"
_CHOICES = ("auto", "dev-shm", "anonymous")
# Room left free in /dev/shm beyond a ring, so that other users of it (NCCL, another
# loader) do not fail: a quarter of the ring, at least a MiB and at most 64 MiB. A fixed
# 64 MiB refused every ring in a 64 MB container /dev/shm.
_HEADROOM_FRACTION = 4
_HEADROOM_BYTES_MIN = 1 << 20
_HEADROOM_BYTES_MAX = 64 << 20


def headroom_bytes(total_bytes: int) -> int:
    return min(_HEADROOM_BYTES_MAX, max(_HEADROOM_BYTES_MIN, total_bytes // _HEADROOM_FRACTION))


def choice(environment=os.environ) -> str:
    value = environment.get(MEMORY_VARIABLE, "auto").strip() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{MEMORY_VARIABLE}={value!r}: expected one of {', '.join(_CHOICES)}")
    return value


def free_bytes(directory: str) -> int | None:
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None  # Not Linux's /dev/shm: posix_fallocate still guards creation.
    return stats.f_bavail * stats.f_frsize


def _cgroup_room_bytes() -> int | None:
    """What this process's memory cgroup still allows (v2, then v1), or None if unbounded."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as limit_file, open(usage_path) as usage_file:
                limit, usage = limit_file.read().strip(), usage_file.read().strip()
        except OSError:
            continue
        if not limit.isdigit() or not usage.isdigit() or int(limit) >= 1 << 60:
            return None  # "max", or v1's "unlimited" (a huge number).
        return max(0, int(limit) - int(usage))
    return None


def memory_room_bytes() -> int | None:
    """The memory a new anonymous ring may take: the kernel's MemAvailable, bounded by the
    memory cgroup's limit where there is one. None where neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    cgroup = _cgroup_room_bytes()
    known = [value for value in (available, cgroup) if value is not None]
    return min(known) if known else None


def place(total_bytes: int, directory: str, environment=os.environ) -> str:
    """"dev-shm" or "anonymous" for a new ring of `total_bytes`; raises SharedMemoryError,
    naming both limits and the fixes, where neither can hold it."""
    wanted = choice(environment)
    free = free_bytes(directory)
    headroom = headroom_bytes(total_bytes)
    fits_tmpfs = free is None or free >= total_bytes + headroom
    if wanted == "dev-shm" or (wanted == "auto" and fits_tmpfs):
        if not fits_tmpfs:
            raise SharedMemoryError(
                f"not enough room in {directory} for the ring: it needs {total_bytes / 2**20:.1f} MiB "
                f"(+{headroom / 2**20:.1f} MiB headroom), {free / 2**20:.1f} MiB are free, and "
                f"{MEMORY_VARIABLE}=dev-shm forbids anonymous memory. Unset it, use fewer slots or a smaller "
                f"batch_size, or enlarge {directory} (in Docker --shm-size; in Kubernetes an emptyDir with "
                f"medium: Memory mounted there)."
            )
        return "dev-shm"
    room = memory_room_bytes()
    if room is not None and room < total_bytes + headroom:
        tmpfs = "unknown" if free is None else f"{free / 2**20:.1f} MiB"
        raise SharedMemoryError(
            f"no room for the ring's {total_bytes / 2**20:.1f} MiB (+{headroom / 2**20:.1f} MiB headroom): "
            f"{directory} has {tmpfs} free and this process may use {room / 2**20:.1f} MiB more memory "
            f"(MemAvailable, bounded by its memory cgroup). Use fewer slots or a smaller batch_size, or give the "
            f"container more memory (and, to keep rings in {directory}, --shm-size in Docker or an emptyDir with "
            f"medium: Memory in Kubernetes)."
        )
    return "anonymous"


def create_anonymous(segment_name: str, segment_fd: int, total_bytes: int) -> int:
    """The ring's memfd, its pages reserved (so a limit is an error now, not a SIGBUS on
    first touch), named in the stub written to the segment. Returns its descriptor, which
    the trainer keeps open for the ring's lifetime (readers reopen it through /proc)."""
    data_fd = os.memfd_create(segment_name.lstrip("/"), os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(data_fd, 0, total_bytes)
        stub = struct.pack(_STUB_FORMAT, STUB_MAGIC, data_fd, 0, total_bytes)
        if os.pwrite(segment_fd, stub, 0) != STUB_BYTES:
            raise OSError(f"short write of the ring's stub in {segment_name}")
    except BaseException:
        os.close(data_fd)
        raise
    return data_fd


def read_stub(segment_fd: int) -> tuple[int, int] | None:
    """(the trainer's memfd descriptor, total bytes) when the segment is a stub, else None."""
    if os.fstat(segment_fd).st_size != STUB_BYTES:
        return None
    data = os.pread(segment_fd, STUB_BYTES, 0)
    if len(data) != STUB_BYTES:
        return None
    magic, fd, _, total_bytes = struct.unpack(_STUB_FORMAT, data)
    return (fd, total_bytes) if magic == STUB_MAGIC else None


def open_anonymous(segment_name: str, trainer_pid: int, data_fd: int, writable: bool) -> int:
    """Opens the trainer's memfd of ring `segment_name` anew, through /proc. The link is
    checked first: a descriptor number the trainer reused for another file is refused.
    (The check and the open are two steps, but both name the trainer's own table, which
    only the trainer changes, and a reopened memfd is checked by size and header after.)"""
    path = f"/proc/{int(trainer_pid)}/fd/{int(data_fd)}"
    expected = f"/memfd:{segment_name.lstrip('/')} (deleted)"
    link = os.readlink(path)  # FileNotFoundError: the trainer or its ring is gone.
    if link != expected:
        raise SharedMemoryError(f"{path} is {link!r}, not the ring's anonymous memory ({expected!r})")
    return os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)

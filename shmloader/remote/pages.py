"""The node cache's units and primitives: page and request sizes, the OFD locks, page stamps,
hole punching, and where a cache lives by default (see cache.py for the whole design)."""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time

# Pages are the unit of presence and of requests: small enough that a row read at random
# costs little more than itself, large enough that a block read ahead is a few thousand
# stamps. A request covers up to REQUEST_BYTES of consecutive missing pages.
CACHE_PAGE_BYTES = 1 << 14
REQUEST_BYTES = 8 << 20
# The fetch unit of rows read at random from data that fits the budget: a first pass costs
# its data once, in requests of this size, instead of a request per row.
FIT_UNIT_BYTES = 1 << 20
# A fetch unit is at most this share of the budget.
BUDGET_UNITS_MIN = 32
# Pins lock the pages of a fill in units of at most this many bytes (never more than the
# fetch unit: rows at random from data larger than the budget pin their pages alone).
PIN_UNIT_BYTES = 1 << 20
# Requests one process has in flight (its fetch threads).
IN_FLIGHT = 16
FETCH_BASE = 1 << 40  # FETCH lock offsets: far past any pages file's USE bytes.
# An eviction frees at least this share of the budget, so that it runs rarely.
EVICT_SHARE = 1 / 32

COUNTERS = ("requests", "bytes", "retries", "evicted")
_FLOCK = "hhqqi4x"  # struct flock on Linux (x86-64 and arm64): type, whence, start, len, pid.
_F_OFD_SETLK, _F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLK", 37), getattr(fcntl, "F_OFD_SETLKW", 38)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_EPOCH = 1_700_000_000  # Stamps count seconds from here: uint32 lasts past 2150.

MARKER_SUFFIX = ".remote.json"
PAGES_SUFFIX = ".pages"


def lock(descriptor: int, kind: int, start: int, length: int, wait: bool) -> bool:
    """An OFD lock (fcntl.F_RDLCK, F_WRLCK or F_UNLCK) on [start, start + length); False
    when it is held elsewhere and `wait` is False."""
    try:
        fcntl.fcntl(descriptor, _F_OFD_SETLKW if wait else _F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, start,
                                                                                      length, 0))
        return True
    except OSError as error:
        if not wait and error.errno in (11, 13):  # EAGAIN, EACCES: held by another.
            return False
        raise


def process_alive(pid: int) -> bool:
    if pid == 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def evict_page(pages_fd: int, data_fd: int, data_size: int, page: int) -> int:
    """Evicts one page if nobody pins or fetches it (both its locks, never waited for);
    returns the bytes freed."""
    if not lock(pages_fd, fcntl.F_WRLCK, page, 1, False):
        return 0  # Pinned by a gather.
    try:
        if not lock(pages_fd, fcntl.F_WRLCK, FETCH_BASE + page, 1, False):
            return 0
        try:
            if os.pread(pages_fd, 4, 4 * page) == bytes(4):
                return 0
            os.pwrite(pages_fd, bytes(4), 4 * page)  # Absent first: nobody reads it from here on.
            offset = page * CACHE_PAGE_BYTES
            size = min(CACHE_PAGE_BYTES, data_size - offset)
            punch_hole(data_fd, offset, size)
            return size
        finally:
            lock(pages_fd, fcntl.F_UNLCK, FETCH_BASE + page, 1, False)
    finally:
        lock(pages_fd, fcntl.F_UNLCK, page, 1, False)


def now_stamp() -> int:
    return max(1, int(time.time()) - _EPOCH)


def _libc():
    import cffi  # A core dependency: fallocate is not in os.

    ffi = cffi.FFI()
    ffi.cdef("int fallocate(int fd, int mode, long offset, long len);")
    return ffi, ffi.dlopen(None)


_FALLOCATE = None


def punch_hole(descriptor: int, offset: int, size: int) -> None:
    """Frees the disk space of [offset, offset + size) of a file, which reads as zeros after."""
    global _FALLOCATE
    if _FALLOCATE is None:
        _FALLOCATE = _libc()
    ffi, libc = _FALLOCATE
    if libc.fallocate(descriptor, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, size) != 0:
        number = ffi.errno
        raise OSError(number, f"cannot free cached pages ({os.strerror(number)}): the cache directory's file system "
                              f"must support hole punching (ext4, xfs, btrfs and tmpfs do)")


def map_shared(descriptor: int, size: int) -> mmap.mmap:
    return mmap.mmap(descriptor, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def default_root() -> str:
    return os.environ.get("SHMLOADER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "shmloader")

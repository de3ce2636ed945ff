"""The node cache's units and primitives: page and request sizes, the OFD locks, page stamps
and checksums, hole punching, private files and directories, and where a cache lives by
default (see cache.py for the whole design)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
import time

import numpy as np

from ..errors import CacheError

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
# Requests one process has in flight (its fetch threads).
IN_FLIGHT = 16
# ...of which its read-ahead has this many in flight at first, one more as each ends (so the
# count doubles each round, as TCP's slow start): a link shares itself among the requests in
# flight, and IN_FLIGHT 8 MiB requests from each reader at once made the first block, which
# the first batch needs, arrive with the 30 others (bench/RESULTS.md).
IN_FLIGHT_FIRST = 2
FETCH_BASE = 1 << 40  # FETCH lock offsets: far past any pages file's USE bytes.
# The OPEN lock: held shared by each process that has the copy open, taken exclusively
# (never waited for) by the removal of a copy nobody has open (NodeCache._remove_unopened).
OPEN_BASE = 2 << 40
# An eviction frees at least this share of the budget, so that it runs rarely.
EVICT_SHARE = 1 / 32

COUNTERS = ("requests", "bytes", "retries", "evicted")
_FLOCK = "hhqqi4x"  # struct flock on Linux (x86-64 and arm64): type, whence, start, len, pid.
_F_OFD_SETLK, _F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLK", 37), getattr(fcntl, "F_OFD_SETLKW", 38)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_EPOCH = 1_700_000_000  # Stamps count seconds from here: uint32 lasts past 2150.

MARKER_SUFFIX = ".remote.json"
PAGES_SUFFIX = ".pages"
# The pages file: a uint32 stamp per page (0: absent, else its last use), then a uint32
# digest per page of the bytes its download wrote (page_digests).
STAMP_BYTES = CHECKSUM_BYTES = 4
# The kind of those digests, which a copy's marker names: a copy whose marker names another
# kind (or none: CRC-32, before) vouches for no page (cache.create_object fetches it anew).
PAGE_DIGEST = "xxh3-low32"
# Reading a copy a page at a time costs a system call per page: verified in reads of this many pages.
VERIFY_READ_PAGES = 64
# The budget counts disk as file systems give it: in blocks (ext4, xfs and tmpfs: 4 KiB).
DISK_BLOCK_BYTES = 4096
DISK_SECTOR_BYTES = 512  # The unit of st_blocks.
_PRIVATE_DIRECTORY_MODE, _PRIVATE_FILE_MODE = 0o700, 0o600
_NOT_OURS = 0o022  # Write permission for group or others: they could plant or swap entries.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def page_disk_bytes(page: int, object_size: int) -> int:
    """The disk a present page takes: whole file system blocks (an object's last page may
    be shorter than the others, never than a block)."""
    size = min(CACHE_PAGE_BYTES, object_size - page * CACHE_PAGE_BYTES)
    return -(-size // DISK_BLOCK_BYTES) * DISK_BLOCK_BYTES


def pages_file_bytes(page_count: int) -> int:
    return (STAMP_BYTES + CHECKSUM_BYTES) * page_count


def page_digests(data, out: np.ndarray) -> None:
    """The digest of each CACHE_PAGE_BYTES page of `data` (the last may be shorter) into
    `out` (uint32, one per page): the low 32 bits of XXH3-64, as the block digests of a
    .b2nd file (zig/block_digests.zig), many times as fast as zlib's CRC-32 (which it
    replaced: bench/RESULTS.md). It catches a page altered or cut short on disk
    (corruption, a hand edit); a forger is kept out by the directory's owner and mode, not
    by it."""
    native = _native()
    assert out.dtype == np.uint32 and out.flags.c_contiguous, (out.dtype, out.flags)
    size = memoryview(data).nbytes
    ffi = native.ffi
    status = native.lib.shm_page_digests(ffi.from_buffer("uint8_t[]", data), size, CACHE_PAGE_BYTES,
                                         ffi.from_buffer("uint32_t[]", out, require_writable=True), len(out))
    if status:  # The message made only where it is needed: this runs for every piece downloaded.
        native.check(status, f"page digests of {size} bytes into {len(out)}")


def page_digests_at(data, pages: np.ndarray, out: np.ndarray) -> None:
    """The digest (page_digests) of each page of `data` (a whole copy, in place) that
    `pages` lists, into `out` (uint32, one per listed page)."""
    native = _native()
    ffi = native.ffi
    assert pages.dtype == np.uint64 and out.dtype == np.uint32 and len(pages) == len(out), (pages.dtype, out.dtype)
    size = memoryview(data).nbytes
    status = native.lib.shm_page_digests_at(ffi.from_buffer("uint8_t[]", data), size, CACHE_PAGE_BYTES,
                                            ffi.from_buffer("uint64_t[]", pages), len(pages),
                                            ffi.from_buffer("uint32_t[]", out, require_writable=True))
    if status:
        native.check(status, f"page digests of {len(pages)} pages of {size} bytes")


def _native():
    global _NATIVE
    if _NATIVE is None:
        from .. import _native as native

        _NATIVE = native
    return _NATIVE


_NATIVE = None  # shmloader._native, imported at the first digest.


class RunDigests:
    """The digest of each page of a run of pages (page_digests), taken from the run's bytes
    as a download hands them over, in pieces of any size: each piece is digested while it
    is still in the core's cache, where a second pass over a whole request read it all back
    from memory. A page split between pieces is gathered first (one page at most)."""

    def __init__(self, run_bytes: int) -> None:
        self.values = np.zeros(-(-run_bytes // CACHE_PAGE_BYTES), dtype=np.uint32)
        self._split = bytearray(CACHE_PAGE_BYTES)  # The start of a page a piece ended in.
        self._split_bytes = 0
        self._received = 0

    def add(self, offset: int, view: memoryview) -> None:
        """Takes in the bytes at `offset` of the run: pieces in order (offset 0 starts over)."""
        if offset == 0:
            self._split_bytes = self._received = 0
        assert offset == self._received, (offset, self._received)  # A piece lost or repeated.
        taken = 0
        if self._split_bytes:  # The rest of the page the last piece ended in.
            taken = min(CACHE_PAGE_BYTES - self._split_bytes, view.nbytes)
            self._split[self._split_bytes:self._split_bytes + taken] = view[:taken]
            self._split_bytes += taken
            if self._split_bytes == CACHE_PAGE_BYTES:
                page = offset // CACHE_PAGE_BYTES
                page_digests(self._split, self.values[page:page + 1])
                self._split_bytes = 0
        whole = (view.nbytes - taken) // CACHE_PAGE_BYTES
        if whole:
            page = (offset + taken) // CACHE_PAGE_BYTES
            page_digests(view[taken:taken + whole * CACHE_PAGE_BYTES], self.values[page:page + whole])
            taken += whole * CACHE_PAGE_BYTES
        if taken < view.nbytes:
            rest = view.nbytes - taken
            self._split[:rest] = view[taken:]
            self._split_bytes = rest
        self._received = offset + view.nbytes

    def finish(self) -> np.ndarray:
        """The digests, once every piece is in (the run's last page may be short)."""
        if self._split_bytes:
            page = self._received // CACHE_PAGE_BYTES
            page_digests(memoryview(self._split)[:self._split_bytes], self.values[page:page + 1])
            self._split_bytes = 0
        return self.values


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
            # To the end of its last block: a punch frees only whole blocks.
            punch_hole(data_fd, offset, page_disk_bytes(page, data_size))
            return page_disk_bytes(page, data_size)
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


def reserve_file(descriptor: int, size: int, root: str, budget: int, what: str) -> None:
    """Allocates the disk blocks of a file's first `size` bytes before they are mapped: a
    write through a mapping of a sparse file on a full file system is a SIGBUS, where
    fallocate is an ENOSPC that no_space() names."""
    try:
        os.posix_fallocate(descriptor, 0, size)
    except OSError as error:
        raise no_space(error, root, budget, what) from None


def no_space(error: OSError, root: str, budget: int, what: str) -> OSError:
    """`error`, or where it is ENOSPC/EDQUOT a CacheError naming cache_dir and cache_bytes."""
    if error.errno not in _NO_SPACE:
        return error
    setting = f"cache_bytes={budget}" if budget else "cache_bytes (by default half the space free there)"
    return CacheError(f"cache_dir {root}: its file system is full ({what}: {os.strerror(error.errno)}); free space "
                      f"there, point cache_dir at a file system with room, or lower {setting} to leave room for "
                      f"the cache's own files")


def open_private(path: str, flags: int) -> int:
    """A descriptor of the cache's file at `path`, opened without following a link and
    only where it is a regular file of this user: a link or a file planted by another
    user is refused, never followed or trusted. Opened without blocking: a FIFO in place
    of a file would hold an open for reading until a writer came (every loader of the
    node waited for ever); it is refused below as any other non-file."""
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, _PRIVATE_FILE_MODE)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CacheError(f"{path} is a symbolic link: the node cache never follows one (it may have been "
                             f"planted by another user); remove it, or use another cache_dir") from None
        if error.errno == errno.EISDIR:
            raise CacheError(f"{path} is a directory where the node cache keeps a file: remove it (the object is "
                             f"fetched again), or use another cache_dir") from None
        if error.errno == errno.ENXIO:  # A socket, or a FIFO opened for writing that nothing reads.
            raise CacheError(f"{path} is not a regular file (a socket or a FIFO): the node cache reads only files "
                             f"it made; remove it, or use another cache_dir") from None
        raise
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(descriptor)
        raise CacheError(f"{path} is not a regular file of this user (uid {info.st_uid}, mode "
                         f"{stat.filemode(info.st_mode)}): the node cache reads only files it made; remove it, or "
                         f"use another cache_dir")
    # Blocking again, as the callers expect (O_NONBLOCK means nothing to a regular file's
    # reads on Linux; cleared so that no file system that honours it surprises them).
    fcntl.fcntl(descriptor, fcntl.F_SETFL, fcntl.fcntl(descriptor, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return descriptor


def private_directory(path: str, root: str) -> None:
    """Makes `path` (a directory at or under the cache's `root`) and those between, each
    0700 whatever the umask, and checks each is a directory of this user, not a link."""
    relative = os.path.relpath(path, root)
    assert not relative.startswith(".."), (path, root)
    current = root
    for name in [] if relative == "." else relative.split(os.sep):
        current = os.path.join(current, name)
        try:
            os.mkdir(current, _PRIVATE_DIRECTORY_MODE)
            _make_private(current)  # The umask may have cut the mode.
        except FileExistsError:
            pass
        except OSError as error:
            raise no_space(error, root, 0, f"making {current}") from None
        info = os.lstat(current)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise CacheError(f"{current} is not a directory of this user (uid {info.st_uid}, mode "
                             f"{stat.filemode(info.st_mode)}): the node cache never follows a link or trusts what "
                             f"another user may have planted; remove it, or use another cache_dir")
        if info.st_mode & 0o077:
            # One of this user's, made by an older version under its umask: made private.
            # What others could have put in it meanwhile is refused entry by entry (owner, links).
            _make_private(current)


def _make_private(directory: str) -> None:
    """chmod 0700 without following a link where the system can (glibc emulates it for
    what is not a link); else plainly: its parent is private already."""
    try:
        os.chmod(directory, _PRIVATE_DIRECTORY_MODE, follow_symlinks=False)
    except (NotImplementedError, OSError):
        os.chmod(directory, _PRIVATE_DIRECTORY_MODE)


def private_root(root: str) -> None:
    """Makes the cache directory `root` (0700 whatever the umask) or checks the one there:
    refused, naming it, where another user owns it or may write in it, or where a link on
    its path belongs to another user. One of this user's that is empty (just made by a
    permissive umask) is made 0700 instead."""
    current = os.sep
    for name in root.strip(os.sep).split(os.sep):
        current = os.path.join(current, name)
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (0, os.geteuid()):
            raise CacheError(f"cache_dir {root}: {current} on its path is a link of another user (uid "
                             f"{info.st_uid}), who could point it anywhere; use a cache_dir on a path of your own")
    try:
        os.makedirs(root, _PRIVATE_DIRECTORY_MODE)
        os.chmod(root, _PRIVATE_DIRECTORY_MODE)
    except FileExistsError:
        pass
    except OSError as error:
        raise no_space(error, root, 0, "making it") from None
    info = os.stat(root)
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"cache_dir {root} is not a directory")
    if info.st_uid != os.geteuid():
        raise CacheError(f"cache_dir {root} belongs to another user (uid {info.st_uid}, this process runs as "
                         f"{os.geteuid()}): the node cache is its user's own; choose a cache_dir of your own")
    if info.st_mode & _NOT_OURS:
        if os.listdir(root):
            raise CacheError(f"cache_dir {root} may be written by others (mode {stat.filemode(info.st_mode)}), who "
                             f"could plant files or links in it: run `chmod go-w {root}` after checking what it "
                             f"holds, or choose another cache_dir")
        os.chmod(root, _PRIVATE_DIRECTORY_MODE)


def map_shared(descriptor: int, size: int) -> mmap.mmap:
    return mmap.mmap(descriptor, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def default_root() -> str:
    return os.environ.get("SHMLOADER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "shmloader")

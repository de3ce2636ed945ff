"""The node's cache of objects: a sparse local copy of each, filled page by page, shared by
every process of every loader that names the same directory.

An object (one URL at one ETag) is three files in `<root>/objects/<url key>/<etag key>/`:
its bytes at their own offsets (a sparse file the size of the object, so readers map and
gather it exactly as a local file), `NAME.pages` (one uint32 per PAGE_BYTES page: 0 while
absent, else when it was last used, in seconds; its byte ranges are also the page locks),
and `NAME.remote.json` (URL, ETag, size, the header ranges the trainer read). The budget,
the bytes held and the node's counters are `<root>/ledger`.

Locks are open-file-description locks (fcntl F_OFD_SETLK): a process that dies, however
it dies, holds none, so there is nothing to clean by hand after a SIGKILL. For page i:
- USE (byte i of the pages file): held shared while a gather reads the page (a pin);
  taken exclusively, never waited for, by an eviction.
- FETCH (byte FETCH_BASE + i): held exclusively by whoever downloads the page, and by an
  eviction; a reader that finds it taken waits for it shared, then looks again.
A page is written (pwrite) before its stamp says it is present, and evicted (stamp 0,
hole punched) only under both locks: a partial download, or a page being evicted, is
never read as data. Blocking waits only ever wait for a holder that waits for nothing
(an eviction, or a download): no cycle, no deadlock.

Budget: bytes are reserved in the ledger before they are downloaded, evicting first when
the reservation would pass the budget: the present pages used longest ago go first, never
a pinned one (those are the "one block per reader" beyond the budget), and pages fetched
for the next steps are the newest. The count is taken anew from the stamps when a loader
starts on a cache no other process uses (a process killed mid-download leaves its
reservation counted until then).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import struct
import threading
import time

import numpy as np

from ..errors import StorageError
from .store import Client

# Pages are the unit of presence and of requests: small enough that a row read at random
# costs little more than itself, large enough that a block read ahead is a few thousand
# stamps. A request covers up to REQUEST_BYTES of consecutive missing pages.
PAGE_BYTES = 1 << 14
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

_LEDGER_MAGIC = 0x53484D43414348  # "SHMCACH"
_LEDGER = {"magic": 0, "held": 1, "budget": 2, "requests": 3, "bytes": 4, "retries": 5, "evicted": 6}
_LEDGER_BYTES = 4096
# After the counters: (pid, bytes reserved in flight) per process using the cache.
_SLOTS_OFFSET, _SLOT_COUNT = 256, 240
COUNTERS = ("requests", "bytes", "retries", "evicted")
_FLOCK = "hhqqi4x"  # struct flock on Linux (x86-64 and arm64): type, whence, start, len, pid.
_F_OFD_SETLK, _F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLK", 37), getattr(fcntl, "F_OFD_SETLKW", 38)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_EPOCH = 1_700_000_000  # Stamps count seconds from here: uint32 lasts past 2150.

MARKER_SUFFIX = ".remote.json"
PAGES_SUFFIX = ".pages"


def _lock(descriptor: int, kind: int, start: int, length: int, wait: bool) -> bool:
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


def _alive(pid: int) -> bool:
    if pid == 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _evict_page(pages_fd: int, data_fd: int, data_size: int, page: int) -> int:
    """Evicts one page if nobody pins or fetches it (both its locks, never waited for);
    returns the bytes freed."""
    if not _lock(pages_fd, fcntl.F_WRLCK, page, 1, False):
        return 0  # Pinned by a gather.
    try:
        if not _lock(pages_fd, fcntl.F_WRLCK, FETCH_BASE + page, 1, False):
            return 0
        try:
            if os.pread(pages_fd, 4, 4 * page) == bytes(4):
                return 0
            os.pwrite(pages_fd, bytes(4), 4 * page)  # Absent first: nobody reads it from here on.
            offset = page * PAGE_BYTES
            size = min(PAGE_BYTES, data_size - offset)
            punch_hole(data_fd, offset, size)
            return size
        finally:
            _lock(pages_fd, fcntl.F_UNLCK, FETCH_BASE + page, 1, False)
    finally:
        _lock(pages_fd, fcntl.F_UNLCK, page, 1, False)


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


def _map(descriptor: int, size: int) -> mmap.mmap:
    return mmap.mmap(descriptor, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def default_root() -> str:
    return os.environ.get("SHMLOADER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "shmloader")


class NodeCache:
    """One cache directory as this process sees it: the ledger, and the objects it opened."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(os.path.join(self.root, "objects"), exist_ok=True)
        path = os.path.join(self.root, "ledger")
        self._ledger_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(self._ledger_fd).st_size < _LEDGER_BYTES:
            os.ftruncate(self._ledger_fd, _LEDGER_BYTES)  # Zeros: a fresh ledger (held 0, no budget yet).
        self._ledger_inode = os.fstat(self._ledger_fd).st_ino
        self._ledger_map = _map(self._ledger_fd, _LEDGER_BYTES)
        self._ledger = np.frombuffer(self._ledger_map, dtype=np.int64, count=len(_LEDGER))
        self._slots = np.frombuffer(self._ledger_map, dtype=np.int64, count=2 * _SLOT_COUNT,
                                    offset=_SLOTS_OFFSET).reshape(_SLOT_COUNT, 2)
        self._thread_lock = threading.Lock()  # OFD locks do not exclude this process's own threads.
        with self.locked():
            if self._ledger[_LEDGER["magic"]] != _LEDGER_MAGIC:
                self._ledger[:] = 0
                self._slots[:] = 0
                self._ledger[_LEDGER["magic"]] = _LEDGER_MAGIC
        self._recount()
        _lock(self._ledger_fd, fcntl.F_RDLCK, 1, 1, True)  # A user from now on (see _recount).
        self._objects: dict[str, CachedObject] = {}
        self._objects_lock = threading.Lock()
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._pool_lock = threading.Lock()

    # The ledger.

    @contextlib.contextmanager
    def locked(self):
        with self._thread_lock:
            _lock(self._ledger_fd, fcntl.F_WRLCK, 0, 1, True)
            try:
                yield
            finally:
                _lock(self._ledger_fd, fcntl.F_UNLCK, 0, 1, False)

    def count(self, requests: int = 0, size: int = 0, retries: int = 0, evicted: int = 0) -> None:
        with self.locked():
            for name, value in (("requests", requests), ("bytes", size), ("retries", retries), ("evicted", evicted)):
                if value:
                    self._ledger[_LEDGER[name]] += value

    def counters(self) -> dict:
        values = self._ledger.copy()
        return {"bytes_held": int(values[_LEDGER["held"]]), "bytes_budget": int(values[_LEDGER["budget"]]),
                **{name: int(values[_LEDGER[name]]) for name in COUNTERS}}

    def set_budget(self, budget: int) -> None:
        """The node's budget: the one of the loader that started last."""
        with self.locked():
            self._ledger[_LEDGER["budget"]] = budget

    def _recount(self) -> None:
        """The bytes held, counted anew from the pages present, where no other process uses
        the cache (each user holds the ledger's byte 1 shared): it forgets the reservations
        of processes killed mid-download."""
        with self.locked():
            users = os.open(os.path.join(self.root, "ledger"), os.O_RDWR | os.O_CLOEXEC)
            try:
                if _lock(users, fcntl.F_WRLCK, 1, 1, False):
                    self._ledger[_LEDGER["held"]] = sum(held for _, _, held in self._pages_files())
            finally:
                os.close(users)  # Closing the description drops its lock.

    def _pages_files(self):
        """(pages path, data path, bytes present) of every object in the cache."""
        for directory, _, names in os.walk(os.path.join(self.root, "objects")):
            for name in names:
                if name.endswith(PAGES_SUFFIX):
                    pages = os.path.join(directory, name)
                    data = pages[:-len(PAGES_SUFFIX)]
                    try:
                        stamps = np.fromfile(pages, dtype=np.uint32)
                        size = os.path.getsize(data)
                    except OSError:
                        continue
                    present = np.flatnonzero(stamps)
                    held = len(present) * PAGE_BYTES
                    if len(present) and present[-1] == len(stamps) - 1:
                        held -= len(stamps) * PAGE_BYTES - size  # The last page is shorter.
                    yield pages, data, max(0, held)

    def reserve(self, size: int, optional: bool = False) -> bool:
        """Counts `size` bytes about to be downloaded, evicting first what would pass the
        budget; an `optional` reservation (the read-ahead's) that would still pass it is
        refused (False). Each process's reservations in flight are kept in its slot of the
        ledger, so that those of a process that died mid-download are given back."""
        with self.locked():
            budget = int(self._ledger[_LEDGER["budget"]])
            held = int(self._ledger[_LEDGER["held"]])
            if budget and held + size > budget:
                held -= self._reclaim_dead()
                if held + size > budget:
                    freed = self._evict(held + size - budget + int(budget * EVICT_SHARE))
                    held -= freed
                    self._ledger[_LEDGER["evicted"]] += freed // PAGE_BYTES
                self._ledger[_LEDGER["held"]] = held
                if optional and held + size > budget:
                    return False
            self._ledger[_LEDGER["held"]] += size
            self._slot()[1] += size
            return True

    def settle(self, size: int, downloaded: bool) -> None:
        """A reservation's download ended: its bytes stay counted as held if it succeeded
        (nothing once this view is closed: close() gave its reservations back)."""
        if self._ledger_fd is None:
            return
        with self.locked():
            self._slot()[1] -= size
            if not downloaded:
                self._ledger[_LEDGER["held"]] -= size

    def _slot(self) -> np.ndarray:
        """This process's (pid, bytes reserved) in the ledger's table (under the lock)."""
        pid = os.getpid()
        own = np.flatnonzero(self._slots[:, 0] == pid)
        if len(own):
            return self._slots[own[0]]
        free = np.flatnonzero(self._slots[:, 0] == 0)
        if not len(free):
            self._reclaim_dead()
            free = np.flatnonzero(self._slots[:, 0] == 0)
        slot = self._slots[free[0] if len(free) else 0]  # Full of live processes: shares the first.
        if slot[0] != pid and slot[0] == 0:
            slot[:] = (pid, 0)
        return slot

    def _reclaim_dead(self) -> int:
        """Gives back the reservations of processes that are gone (under the lock); returns
        the bytes given back."""
        alive = np.array([_alive(int(pid)) for pid in self._slots[:, 0]], dtype=bool)
        dead = (self._slots[:, 0] != 0) & ~alive
        reclaimed = int(self._slots[dead, 1].sum())
        self._slots[dead] = 0
        return reclaimed

    def _evict(self, wanted: int) -> int:
        """Frees at least `wanted` bytes if it can: present pages by last use, oldest first,
        skipping any page that is pinned or being fetched. Runs under the ledger lock.
        Stamps are read and written with pread/pwrite (the same page cache as every
        process's mapping of them)."""
        candidates = []  # (stamps, pages path, data path) of objects holding pages
        for pages, data, held in self._pages_files():
            if held:
                candidates.append((np.fromfile(pages, dtype=np.uint32), pages, data))
        if not candidates:
            return 0
        stamps = np.concatenate([found for found, _, _ in candidates]).astype(np.int64)
        owners = np.repeat(np.arange(len(candidates)), [len(found) for found, _, _ in candidates])
        numbers = np.concatenate([np.arange(len(found)) for found, _, _ in candidates])
        present = np.flatnonzero(stamps)
        order = present[np.argsort(stamps[present], kind="stable")]
        freed, descriptors = 0, {}
        try:
            for k in order.tolist():
                if freed >= wanted:
                    break
                owner, page = int(owners[k]), int(numbers[k])
                if owner not in descriptors:
                    _, pages, data = candidates[owner]
                    try:
                        descriptors[owner] = (os.open(pages, os.O_RDWR | os.O_CLOEXEC),
                                              os.open(data, os.O_RDWR | os.O_CLOEXEC), os.path.getsize(data))
                    except OSError:
                        descriptors[owner] = None
                if descriptors[owner] is None:
                    continue
                pages_fd, data_fd, data_size = descriptors[owner]
                freed += _evict_page(pages_fd, data_fd, data_size, page)
        finally:
            for found in descriptors.values():
                if found is not None:
                    os.close(found[0])
                    os.close(found[1])
        return freed

    # Objects and fetching.

    def object(self, path: str, url: str = "") -> CachedObject:
        """This process's opening of the copy at `path` (opened anew where the file is not the
        one it opened: the cache directory removed and made again)."""
        with self._objects_lock:
            found = self._objects.get(path)
            if found is not None and not found.current():
                found.close()
                found = None
            if found is None:
                found = self._objects[path] = CachedObject(self, path, url)
            return found

    def current(self) -> bool:
        """Whether the ledger this view opened is still the directory's."""
        try:
            return os.stat(os.path.join(self.root, "ledger")).st_ino == self._ledger_inode
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """Closes every object, the fetch threads and the ledger (a loader's close, when no
        other loader of this process uses the directory)."""
        with self._objects_lock:
            for found in self._objects.values():
                found.close()
            self._objects.clear()
        with self._pool_lock:
            for pool in self._pools.values():
                pool.shutdown(wait=False, cancel_futures=True)
            self._pools.clear()
        if self._ledger_fd is not None:
            with self.locked():  # Downloads given up on: their reservations go back now.
                slot = self._slot()
                self._ledger[_LEDGER["held"]] -= slot[1]
                slot[:] = 0
                del slot  # A view of the mapping: it must go before the mapping can close.
            self._ledger = self._slots = None
            with contextlib.suppress(BufferError):  # A view held elsewhere: unmapped with it.
                self._ledger_map.close()
            os.close(self._ledger_fd)  # Its locks (the users' byte) go with it.
            self._ledger_fd = None

    def pool(self, kind: str = "demand") -> concurrent.futures.ThreadPoolExecutor:
        """The fetch threads: "demand" for the pages a fill waits for, "ahead" for the
        read-ahead's (apart, so that a fill never queues behind the read-ahead's requests)."""
        with self._pool_lock:
            pool = self._pools.get(kind)
            if pool is None:
                pool = self._pools[kind] = concurrent.futures.ThreadPoolExecutor(
                    IN_FLIGHT, thread_name_prefix=f"shmloader-fetch-{kind}")
            return pool

_caches: dict[tuple[int, str], NodeCache] = {}
_users: dict[tuple[int, str], int] = {}  # Loaders of this process holding each view (acquire/release).
_caches_lock = threading.Lock()


def _view(root: str) -> NodeCache:
    """node_cache() under _caches_lock, held by the caller."""
    key = (os.getpid(), os.path.abspath(root))
    cache = _caches.get(key)
    if cache is not None and not cache.current():
        cache.close()
        cache = None
    if cache is None:
        cache = _caches[key] = NodeCache(root)
    return cache


def node_cache(root: str) -> NodeCache:
    """This process's view of the cache at `root` (one per process and directory; a new one
    where the directory was removed and made again)."""
    with _caches_lock:
        return _view(root)


def acquire(root: str) -> NodeCache:
    """node_cache() for a loader, which release()s it when it closes (one lock for both, so
    that a release between them cannot close the view being handed out)."""
    with _caches_lock:
        cache = _view(root)
        key = (os.getpid(), cache.root)
        _users[key] = _users.get(key, 0) + 1
        return cache


def release(cache: NodeCache) -> None:
    """A loader is done with the view: the last one of this process closes it (its files,
    threads and locks)."""
    key = (os.getpid(), cache.root)
    with _caches_lock:
        _users[key] = _users.get(key, 1) - 1
        if _users[key] > 0:
            return
        del _users[key]
        if _caches.get(key) is cache:
            del _caches[key]
    cache.close()


def cache_root(path: str) -> str:
    """The cache directory that holds the copy at `path` (ROOT/objects/URL KEY/VERSION/NAME):
    found from where the copy is, so a cache directory moved or renamed still works."""
    directory = os.path.dirname(os.path.abspath(path))
    while os.path.basename(directory) != "objects":
        parent = os.path.dirname(directory)
        if parent == directory:
            raise StorageError(f"{path}: not in a shmloader cache directory (no objects/ above it)")
        directory = parent
    return os.path.dirname(directory)


def cached_object(path: str, url: str = "") -> CachedObject:
    """The object whose copy is the file at `path`, opened in this process's view of its
    cache; `url` names it in errors."""
    if not os.path.exists(path + MARKER_SUFFIX):
        raise StorageError(f"{url or path}: its copy in the node cache ({path}) is not here: the cache directory "
                           f"was removed while the loader ran (restart the loader), or this reader runs on another "
                           f"machine than the trainer (Ray actors elsewhere cannot share its node's cache)")
    return node_cache(cache_root(path)).object(path, url)


def read_marker(path: str) -> dict | None:
    try:
        with open(path + MARKER_SUFFIX) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None


def object_directory(root: str, url: str, version: str) -> str:
    """Where the copy of `url` at `version` (its ETag, or a ragged directory's ETags) lives."""
    url_key = hashlib.sha256(url.encode()).hexdigest()[:24]
    version_key = hashlib.sha256(version.encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(root), "objects", url_key, version_key)


def create_object(path: str, url: str, etag: str, size: int, options: dict) -> None:
    """The sparse data file, its page stamps and its marker, if they are not there yet
    (several trainers may create the same object at once: every step is idempotent)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pages = -(-size // PAGE_BYTES)
    for name, length in ((path, size), (path + PAGES_SUFFIX, 4 * pages)):
        descriptor = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(descriptor).st_size != length:
                os.ftruncate(descriptor, length)
        finally:
            os.close(descriptor)
    if read_marker(path) is None:
        write_marker(path, {"url": url, "etag": etag, "size": size, "options": options, "meta": []})


def write_marker(path: str, marker: dict) -> None:
    temporary = f"{path}{MARKER_SUFFIX}.{os.getpid()}.{threading.get_ident()}"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)  # It may hold credentials.
    with os.fdopen(descriptor, "w") as handle:
        json.dump(marker, handle)
    os.replace(temporary, path + MARKER_SUFFIX)


def pages_of(offsets: np.ndarray, sizes: np.ndarray, ordered: bool = False) -> np.ndarray:
    """The distinct pages that byte ranges (offsets, sizes) touch: sorted, or (`ordered`) in
    the order the ranges first reach them."""
    keep = sizes > 0
    if not keep.all():
        offsets, sizes = offsets[keep], sizes[keep]
    if not len(offsets):
        return np.empty(0, dtype=np.int64)
    first = offsets.astype(np.int64) // PAGE_BYTES
    last = (offsets.astype(np.int64) + sizes.astype(np.int64) - 1) // PAGE_BYTES
    spans = last - first + 1
    if int(spans.max()) == 1:
        pages = first
    else:
        total = int(spans.sum())
        pages = np.repeat(first - np.concatenate([[0], np.cumsum(spans)[:-1]]), spans) + np.arange(total)
    if not ordered:
        return np.unique(pages)
    _, where = np.unique(pages, return_index=True)
    return pages[np.sort(where)]


def runs_of(pages: np.ndarray, longest: int) -> list[tuple[int, int]]:
    """Distinct pages (sorted, or in any order) as [first, end) runs of consecutive pages,
    each at most `longest`, in the pages' order."""
    if not len(pages):
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    runs = []
    for group in np.split(pages, breaks):
        first, end = int(group[0]), int(group[-1]) + 1
        for start in range(first, end, longest):
            runs.append((start, min(end, start + longest)))
    return runs


class CachedObject:
    """One object's local copy, opened in this process: pins pages for gathers and
    fetches what is missing. Each thread pins and claims through descriptions of its own:
    OFD locks taken through one description do not exclude each other, so two threads
    sharing one would release each other's pins and claims."""

    def __init__(self, cache: NodeCache, path: str, url: str = "") -> None:
        marker = read_marker(path)
        if marker is None:
            raise StorageError(f"{url or path}: its copy in the node cache ({path}) is gone: was the cache directory "
                               f"removed while the loader ran? Restart the loader")
        self.cache, self.path = cache, path
        self.url, self.etag, self.size = marker["url"], marker["etag"], int(marker["size"])
        self.meta = [tuple(extent) for extent in marker.get("meta", [])]
        self.client = Client(marker.get("options") or {}, cache.count)
        self.page_count = -(-self.size // PAGE_BYTES)
        self._data_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.inode = os.fstat(self._data_fd).st_ino
        self._map_fd = os.open(path + PAGES_SUFFIX, os.O_RDWR | os.O_CLOEXEC)
        if os.fstat(self._map_fd).st_size != 4 * self.page_count or os.fstat(self._data_fd).st_size != self.size:
            raise StorageError(f"{self.url}: its copy in the node cache ({path}) does not have the object's size "
                               f"({self.size} bytes)")
        self._map = _map(self._map_fd, max(4, 4 * self.page_count))
        self.stamps = np.frombuffer(self._map, dtype=np.uint32, count=self.page_count)
        self._local = threading.local()
        self._descriptors: list[int] = []
        self._descriptors_lock = threading.Lock()

    def current(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False

    def _fd(self, purpose: str) -> int:
        """This thread's description of the pages file for `purpose` ("pin", "ahead")."""
        descriptor = getattr(self._local, purpose, None)
        if descriptor is None:
            descriptor = os.open(self.path + PAGES_SUFFIX, os.O_RDWR | os.O_CLOEXEC)
            with self._descriptors_lock:
                self._descriptors.append(descriptor)
            setattr(self._local, purpose, descriptor)
        return descriptor

    def _with_units(self, pages: np.ndarray, unit: int) -> np.ndarray:
        """The missing pages of every fetch unit of `unit` pages (aligned) holding one of
        `pages`, units in the order `pages` first reaches them (see set_fetch_unit)."""
        if unit <= 1 or not len(pages):
            return pages
        _, first_seen = np.unique(pages // unit, return_index=True)
        units = (pages // unit)[np.sort(first_seen)]
        starts = units * unit
        counts = np.minimum(starts + unit, self.page_count) - starts
        expanded = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
        return expanded[self.stamps[expanded] == 0]

    # Pins (the gathering thread).

    def pin(self, offsets: np.ndarray, sizes: np.ndarray, unit_pages: int = 1) -> None:
        """Makes the pages under byte ranges (offsets, sizes) present and keeps them so until
        unpin(): they are fetched (by this process, or by whoever fetches them already),
        with the rest of their fetch units of `unit_pages`."""
        pages = pages_of(np.asarray(offsets), np.asarray(sizes))
        if not len(pages):
            return
        descriptor = self._fd("pin")
        self._local.pinned = True
        # Pinned in lock units of pages (an eviction waits for the whole unit's pins): a
        # batch of rows at random costs a lock call per unit, not per page.
        unit = max(1, min(unit_pages, PIN_UNIT_BYTES // PAGE_BYTES))
        for first, end in runs_of(np.unique(pages // unit), 1 << 30):
            _lock(descriptor, fcntl.F_RDLCK, first * unit, (end - first) * unit, True)
        stamps = self.stamps[pages]
        missing = pages[stamps == 0]
        stamp = now_stamp()
        stale = pages[(stamps != 0) & (stamps + 1 < stamp)]
        if len(stale):
            self.stamps[stale] = stamp  # Used now: the last to be evicted.
        if len(missing):
            self._fetch_missing(missing, descriptor, unit_pages)

    def present(self, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Per byte range, whether all its pages are here (unpinned: a hint)."""
        offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
        first, last = offsets // PAGE_BYTES, (offsets + np.maximum(sizes, 1) - 1) // PAGE_BYTES
        single = first == last
        found = self.stamps[first] != 0
        for k in np.flatnonzero(~single).tolist():
            found[k] = bool((self.stamps[first[k]:last[k] + 1] != 0).all())
        return found

    def unpin(self) -> None:
        if getattr(self._local, "pinned", False):
            _lock(self._fd("pin"), fcntl.F_UNLCK, 0, 0, False)  # Length 0: to the end, every USE byte.
            self._local.pinned = False

    @contextlib.contextmanager
    def pinned(self, extents=None):
        """Pins `extents` ((offset, size) pairs; the header ranges when None) for a block."""
        extents = self.meta if extents is None else extents
        try:
            if extents:
                self.pin(np.array([offset for offset, _ in extents], np.int64),
                         np.array([size for _, size in extents], np.int64))
            yield self
        finally:
            self.unpin()

    # Fetching.

    def prefetch(self, offsets: np.ndarray, sizes: np.ndarray, unit_pages: int = 1) -> None:
        """Fetches the missing pages under the ranges, in the ranges' order (the read-ahead
        gives them in the order they will be needed), IN_FLIGHT requests at a time, each run
        claimed just before its request: pages a fill needs meanwhile and nobody claimed
        yet are the fill's to fetch at once. Pages others fetch are skipped, not waited for."""
        pending: collections.deque = collections.deque()
        pages = pages_of(np.atleast_1d(offsets), np.atleast_1d(sizes), ordered=True)
        missing = self._with_units(pages[self.stamps[pages] == 0] if len(pages) else pages, unit_pages)
        descriptor = self._fd("ahead")
        try:
            for run_first, run_end in runs_of(missing, REQUEST_BYTES // PAGE_BYTES):
                while len(pending) >= IN_FLIGHT:
                    self._finish(pending.popleft(), descriptor)
                if not _lock(descriptor, fcntl.F_WRLCK, FETCH_BASE + run_first, run_end - run_first, False):
                    continue  # Being fetched (or evicted) by another: left to it.
                if (self.stamps[run_first:run_end] != 0).all():
                    _lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + run_first, run_end - run_first, False)
                    continue
                size = self._missing_bytes(run_first, run_end)
                try:
                    room = self.cache.reserve(size, optional=True)
                except BaseException:
                    _lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + run_first, run_end - run_first, False)
                    raise
                if not room:  # The budget is full of pages in use: reading further ahead would evict them.
                    _lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + run_first, run_end - run_first, False)
                    break
                future = self.cache.pool("ahead").submit(self._fetch_run, run_first, run_end, size)
                pending.append((future, run_first, run_end))
        finally:
            while pending:
                self._finish(pending.popleft(), descriptor)

    def _finish(self, request, descriptor: int) -> None:
        """Waits for a read-ahead request, then lets go of its claim."""
        future, first, end = request
        try:
            future.result()
        except Exception:  # noqa: BLE001 - the fill that needs the pages reports it.
            pass
        finally:
            _lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + first, end - first, False)

    def _fetch_missing(self, missing: np.ndarray, descriptor: int, unit_pages: int) -> None:
        """Claims (FETCH lock) the missing pages, and those of their fetch units, that nobody
        else claims, downloads them in parallel, then waits for the needed pages others
        claimed and looks again."""
        needed = missing
        while len(needed):
            claimed, others = [], []
            for first, end in runs_of(self._with_units(needed, unit_pages), REQUEST_BYTES // PAGE_BYTES):
                if _lock(descriptor, fcntl.F_WRLCK, FETCH_BASE + first, end - first, False):
                    claimed.append((first, end))
                else:  # Someone fetches some of these: claim page by page.
                    for page in range(first, end):
                        if _lock(descriptor, fcntl.F_WRLCK, FETCH_BASE + page, 1, False):
                            claimed.append((page, page + 1))
                        else:
                            others.append(page)
            self._download(claimed, descriptor)
            others = np.intersect1d(np.asarray(others, dtype=np.int64), needed)
            if not len(others):
                return
            for page in others.tolist():  # Their fetcher is downloading: its lock goes when it is done.
                _lock(descriptor, fcntl.F_RDLCK, FETCH_BASE + page, 1, True)
                _lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + page, 1, False)
            needed = others[self.stamps[others] == 0]  # Their download failed: this process tries.

    def _download(self, claimed: list[tuple[int, int]], descriptor: int) -> None:
        """Downloads claimed runs (FETCH-locked by `descriptor`), then releases them."""
        try:
            todo = [(first, end) for first, end in claimed if not (self.stamps[first:end] != 0).all()]
            if not todo:
                return
            sizes = [self._missing_bytes(first, end) for first, end in todo]
            self.cache.reserve(sum(sizes))  # Each run settles its own share when it ends.
            futures = [self.cache.pool("demand").submit(self._fetch_run, first, end, size)
                       for (first, end), size in zip(todo, sizes)]
            for future in futures:
                future.result()
        finally:
            for first, end in claimed:
                _lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + first, end - first, False)

    def _missing_bytes(self, first: int, end: int) -> int:
        """The bytes of the pages of [first, end) that are absent: what fetching the run adds
        to the cache (its present pages are written again, with the same bytes)."""
        missing = np.flatnonzero(self.stamps[first:end] == 0) + first
        size = len(missing) * PAGE_BYTES
        if len(missing) and missing[-1] == self.page_count - 1:
            size -= self.page_count * PAGE_BYTES - self.size  # The last page is shorter.
        return size

    def _fetch_run(self, first: int, end: int, reserved: int) -> None:
        """Downloads pages [first, end) (claimed), then settles the `reserved` bytes."""
        downloaded = False
        try:
            downloaded = self._download_run(first, end)
        finally:
            self.cache.settle(reserved, downloaded)

    def _download_run(self, first: int, end: int) -> bool:
        """Whether the pages were written (not when the object was closed meanwhile)."""
        start, stop = first * PAGE_BYTES, min(end * PAGE_BYTES, self.size)
        data = self.client.get(self.url, self.etag, start, stop)
        # Under the lock close() takes: a request that outlives its loader (a read-ahead
        # thread given up on) must not write through a descriptor number reused since.
        with self._descriptors_lock:
            if self.stamps is None:
                return False
            written = 0
            while written < len(data):
                written += os.pwrite(self._data_fd, data[written:], start + written)
            self.stamps[first:end] = now_stamp()  # After the bytes: present means written.
            return True

    def close(self) -> None:
        with self._descriptors_lock:
            if self.stamps is None:
                return
            descriptors, self._descriptors = self._descriptors, []
            for descriptor in (*descriptors, self._data_fd, self._map_fd):
                with contextlib.suppress(OSError):
                    os.close(descriptor)
            self.stamps = None
            with contextlib.suppress(BufferError):  # A view still held elsewhere: unmapped with it.
                self._map.close()


def set_fetch_unit(field, random_rows: bool, stored_bytes: int) -> None:
    """What a field's fills fetch around a needed page (`field.unit_pages`, passed to pin
    and prefetch: loaders of one process share the object, not their reading pattern):
    whole requests where rows are read in order (a window's blocks, sequential) or where all
    the data the loader reads fits the budget (every page is needed soon and stays); the
    page alone where rows at random overflow the budget (most of a larger unit would be
    evicted unread)."""
    budget = field.remote.cache.counters()["bytes_budget"]
    fits = budget == 0 or stored_bytes <= budget
    unit = REQUEST_BYTES if not random_rows else (FIT_UNIT_BYTES if fits else PAGE_BYTES)
    if budget:  # A small budget holds many units, not a few: evicting one unit would drop most of it.
        unit = min(unit, max(PAGE_BYTES, budget // BUDGET_UNITS_MIN))
    field.unit_pages = max(1, unit // PAGE_BYTES)

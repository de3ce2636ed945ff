"""The node's cache of objects: a sparse local copy of each, filled page by page, shared by
every process of every loader that names the same directory. (Over the package's ~450 lines
per module: the page protocol below, its locks, stamps, checksums and the reservations around
each download, is kept whole in one file, where each method can be checked against it.)

An object (one URL at one ETag) is three files in `<root>/objects/<url key>/<etag key>/`:
its bytes at their own offsets (a sparse file the size of the object, so readers map and
gather it exactly as a local file), `NAME.pages` (one uint32 per CACHE_PAGE_BYTES page: 0 while
absent, else when it was last used, in seconds; then one digest per page of the bytes its
download wrote (pages.page_digests); its byte ranges are also the page locks), and
`NAME.remote.json` (URL, ETag, size, the header ranges the trainer read, the kind of the
page digests; never the storage_options). The
budget, the bytes held (pages and the cache's own files) and the node's counters are
`<root>/ledger`.

Trust: the cache is its user's own (directories 0700, files 0600, every open O_NOFOLLOW of
a regular file of this user: pages.open_private, private_directory, private_root). A page
a download wrote is served once its stamp says present; a page already present when a
process opened the copy is checked against its digest first, once per process
(CachedObject._verify); a copy whose files are not the object's size is every page absent,
made anew as new files: whoever has the old ones open reads on from them, whose stamps vouch
for their bytes (_create_files), and a process opens the copy again once its files change.
Credentials stay in the memory of the process that read them (_hold_credentials).
Gathers of pages present and checked take no locks on x86-64: evictions count themselves,
and a gather that one may have overlapped is read again, pinned (_read_unpinned).

Locks are open-file-description locks (fcntl F_OFD_SETLK): a process that dies, however
it dies, holds none, so there is nothing to clean by hand after a SIGKILL. For page i:
- USE (byte i of the pages file): held shared while a gather reads the page (a pin);
  taken exclusively, never waited for, by an eviction.
- FETCH (byte FETCH_BASE + i): held exclusively by whoever downloads the page, and by an
  eviction; a reader that finds it taken waits for it shared, then looks again.
A page is written (pwrite) before its stamp says it is present, and evicted (stamp 0,
hole punched) only under both locks: a partial download, or a page being evicted, is
never read as data. A download writes its bytes as they arrive (Client.stream); what it
wrote of absent pages is freed where it fails, or where its object closes first. Blocking waits only ever wait for a holder that waits for nothing
(an eviction, or a download): no cycle, no deadlock.

Budget: bytes are reserved in the ledger before they are downloaded, evicting first when
the reservation would pass the budget: the present pages used longest ago go first, never
a pinned one, and pages fetched for the next steps are the newest. What passes the budget
is bounded (pinned_bytes_max): only the pages under the rows of the batches being filled,
pinned or being fetched for a pin; fetch units around them, the read-ahead (a share of the
budget, storage/readahead.StepAhead) and the cache's own files are fetched or kept only
where the budget has room. Closing a view trims the cache back to its budget, so what a
run leaves on disk is within it. The count is taken anew from the stamps when a loader
starts on a cache no other process uses (a process killed mid-download leaves its
reservation counted until then).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import hashlib
import hmac
import json
import mmap
import os
import platform
import posixpath
import re
import secrets
import threading
import time
import warnings

import numpy as np

from ..errors import CacheError, RemoteError, StorageError
from . import deadline_left
from .node import NodeCache, cache_root, counted_bytes, node_cache
from .pages import (
    BUDGET_UNITS_MIN,
    CACHE_PAGE_BYTES,
    FETCH_BASE,
    FIT_UNIT_BYTES,
    IN_FLIGHT,
    MARKER_SUFFIX,
    OPEN_BASE,
    PAGES_SUFFIX,
    REQUEST_BYTES,
    STAMP_BYTES,
    VERIFY_READ_PAGES,
    lock,
    map_shared,
    no_space,
    now_stamp,
    open_private,
    PAGE_DIGEST,
    RunDigests,
    page_digests,
    page_digests_at,
    page_disk_bytes,
    pages_file_bytes,
    private_directory,
    punch_hole,
    reserve_file,
)
from .store import Client


# A fill with a deadline looks for a page another request fetches this often.
_POLL_SECONDS = 0.02
# See CachedObject._download_run.
AHEAD_STAMP_SECONDS = 2
# See CachedObject._touch_soon: under AHEAD_STAMP_SECONDS, so that a page fetched ahead and
# read is stamped as used before its own stamp comes.
TOUCH_EVERY_SECONDS = 1.0
# Gathers read present pages without locks and check the eviction sequence after them
# (CachedObject._read_unpinned) where loads are seen in program order (x86-64's model);
# elsewhere every gather pins.
UNPINNED_READS = platform.machine().lower() in ("x86_64", "amd64")


def cached_object(path: str, url: str = "", access: str = "") -> CachedObject:
    """The object whose copy is the file at `path`, opened in this process's view of its
    cache; `url` names it in errors; `access` (hold_options) says where its loader's
    storage_options are."""
    if not os.path.exists(path + MARKER_SUFFIX):
        raise StorageError(f"{url or path}: its copy in the node cache ({path}) is not here: the cache directory "
                           f"was removed while the loader ran (restart the loader), or this reader runs on another "
                           f"machine than the trainer (Ray actors elsewhere cannot share its node's cache)")
    return open_object(node_cache(cache_root(path)), path, url, access or None)


def read_marker(path: str, expected: tuple[str, str, int] | None = None) -> dict | None:
    """An object's marker, None where there is none. One that does not parse, lacks a key
    or (given the (URL, ETag, size) `expected`) describes another object is damaged: with
    `expected` (the trainer, which can write it anew) it is discarded with a warning naming
    it, else a CacheError names it."""
    marker_path = path + MARKER_SUFFIX
    try:
        descriptor = open_private(marker_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(descriptor, "rb") as handle:
        content = handle.read(_MARKER_BYTES_MAX + 1)
    problem = _marker_problem(content, expected)
    if problem is None:
        return json.loads(content)
    if expected is None:
        raise CacheError(f"{marker_path}, the marker of a copy in the node cache, is damaged ({problem}): restart "
                         f"the loader (its trainer writes it anew and fetches the object again), or remove the "
                         f"cache directory")
    warnings.warn(f"{marker_path}, the marker of the copy of {expected[0]} in the node cache, was damaged "
                  f"({problem}): discarded, the object is fetched again", RuntimeWarning, stacklevel=3)
    os.unlink(marker_path)
    return None


_MARKER_BYTES_MAX = 1 << 20  # Far past any marker: a header's ranges are a few pairs.


def _marker_problem(content: bytes, expected: tuple[str, str, int] | None) -> str | None:
    """What is wrong with a marker's bytes, or None."""
    if len(content) > _MARKER_BYTES_MAX:
        return f"over {_MARKER_BYTES_MAX} bytes"
    try:
        marker = json.loads(content)
    except (ValueError, UnicodeDecodeError) as error:
        return f"{len(content)} bytes that are not JSON: {error}"
    if not isinstance(marker, dict):
        return f"JSON of type {type(marker).__name__}, not an object"
    types = {"url": str, "etag": str, "size": int, "meta": list}
    for name, kind in types.items():
        if not isinstance(marker.get(name), kind) or isinstance(marker.get(name), bool):
            return f"its {name!r} is {marker.get(name)!r}, expected a {kind.__name__}"
    size = marker["size"]
    if size < 0 or not all(isinstance(extent, list) and len(extent) == 2 and
                           all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in extent) and
                           sum(extent) <= size for extent in marker["meta"]):
        return f"its size {size} or header ranges {marker['meta']!r} are not of an object"
    if expected is not None and (marker["url"], marker["etag"], size) != tuple(expected):
        return (f"it describes {marker['url']} at ETag {marker['etag']}, {size} bytes; the object is "
                f"{expected[0]} at ETag {expected[1]}, {expected[2]} bytes")
    return None


def object_directory(root: str, url: str, version: str) -> str:
    """Where the copy of `url` at `version` (its ETag, or a ragged directory's ETags) lives."""
    url_key = hashlib.sha256(url.encode()).hexdigest()[:24]
    version_key = hashlib.sha256(version.encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(root), "objects", url_key, version_key)


# A copy's file name, from its key's last segment, is at most this long: with the longest
# suffix the cache adds (a marker's temporary, ".remote.json.PID.THREAD", under 50 bytes)
# it stays far below a file system's 255. A longer one keeps its start and its extension
# around a hash of the whole.
_NAME_BYTES_MAX = 160
_NAME_KEPT_BYTES, _EXTENSION_BYTES_MAX = 64, 16


def cached_name(url: str) -> str:
    """The file name of `url`'s copy in its directory: the key's last segment where it is
    short enough, else a bounded name that keeps its start and extension (S3 allows a
    segment of up to 1,024 bytes; a file name is 255 at most)."""
    name = posixpath.basename(url) or "object"
    if len(name.encode()) <= _NAME_BYTES_MAX:
        return name
    stem, dot, extension = name.rpartition(".")
    extension = f".{extension}" if dot and stem and len(extension.encode()) <= _EXTENSION_BYTES_MAX else ""
    start = name.encode()[:_NAME_KEPT_BYTES].decode(errors="ignore")  # Cut at a character boundary.
    return f"{start}-{hashlib.sha256(name.encode()).hexdigest()[:32]}{extension}"


def create_object(path: str, url: str, etag: str, size: int, options: dict | None = None) -> str:
    """The sparse data file, its pages file and its marker, if they are not there yet
    (several trainers may create the same object at once: every step is idempotent). A
    copy whose files do not have the object's sizes (truncated between runs, or of an
    older layout) is not trusted: every page absent, to be fetched again, as one whose
    marker names page digests of another kind (PAGE_DIGEST; an older version's CRC-32s) or
    none. A marker that does not describe this object (damaged, or of an older layout) is
    written anew.
    Returns the access (hold_options) of the loader's storage_options `options`, which
    this process's descriptions of the copy give their readers from now on."""
    root = cache_root(path)
    cache = node_cache(root)
    cache.creating.add(path)
    try:
        private_directory(os.path.dirname(path), root)
        # Before read_marker removes a damaged marker the ledger counts.
        pages_held, own_held = counted_bytes(path)
        had_marker = os.path.lexists(path + MARKER_SUFFIX)
        marker = read_marker(path, (url, etag, size))
        # A damaged marker vouches for nothing of its copy, nor one whose pages file holds
        # digests of another kind (an older version's CRC-32s): every page fetched again.
        other_digests = marker is not None and marker.get("digest") != PAGE_DIGEST
        fresh = _create_files(path, url, size, root, cache.budget(), (had_marker and marker is None) or other_digests)
        if marker is None or fresh:
            write_marker(path, {"url": url, "etag": etag, "size": size, "meta": []})
            # The budget covers the cache's own files too: as they are now, in place of what it
            # counted of them (and of the pages a copy made anew no longer has).
            cache.hold(counted_bytes(path)[1], own_held + (pages_held if fresh else 0))
    except OSError as error:
        raise no_space(error, root, cache.budget(), f"making the copy of {url}") from None
    finally:
        cache.creating.discard(path)
    access = hold_options(options or {})
    with _held_lock:
        _access_of_path[path] = access
    return access


def _create_files(path: str, url: str, size: int, root: str, budget: int, anew: bool = False) -> bool:
    """The data and pages files of create_object (made anew where `anew`); whether they
    were made (or made anew).

    A copy made anew is two new files, never the old ones cut back in place: another
    process of the node (or a loader of this one) may have the old pair open, and its
    stamps, in a pages file this process may not even see (one removed by hand), say its
    pages are present. Cut in place, its data file would read zeros there, served as rows
    with no error. Removed, the old pair stays whole for whoever has it open (its space
    comes back when they close it), and open_object sees new files and opens them."""
    pages_length = pages_file_bytes(-(-size // CACHE_PAGE_BYTES))
    fresh = anew or not _sizes_are(path, size, pages_length)
    if fresh:
        for name in (path, path + PAGES_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
    pages_fd = open_private(path + PAGES_SUFFIX, os.O_RDWR | os.O_CREAT)
    try:
        data_fd = open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            if fresh:  # New and empty: every stamp 0, no byte on disk.
                os.ftruncate(pages_fd, pages_length)
                os.ftruncate(data_fd, size)
            # Mapped by every process: allocated now, so that a full disk is an error, not a SIGBUS.
            reserve_file(pages_fd, pages_length, root, budget, f"the pages file of {url}")
            return fresh
        finally:
            os.close(data_fd)
    finally:
        os.close(pages_fd)


def _sizes_are(path: str, size: int, pages_length: int) -> bool:
    """Whether the copy's pages file and data file are both there with the object's sizes.
    Both are opened as the cache opens its files, so that one that is not a regular file of
    this user is named (CacheError, with its remedy) and never removed here."""
    sizes_right = True
    for name, expected in ((path + PAGES_SUFFIX, pages_length), (path, size)):
        try:
            descriptor = open_private(name, os.O_RDWR)  # As the cache opens it: a directory is named as one.
        except FileNotFoundError:
            sizes_right = False
            continue
        try:
            sizes_right = sizes_right and os.fstat(descriptor).st_size == expected
        finally:
            os.close(descriptor)
    return sizes_right


# A loader's storage_options (endpoint and credentials) never go into the cache's files,
# which every trainer of the node shares: each trainer holds its own in memory, and the
# plan it sends its readers says where (FieldSpec.access), so that a reader fetches with
# its own trainer's options whoever else uses the same copy.
_held_options: dict[tuple, dict] = {}  # (pid, the options' items) -> where this process holds them
_held_lock = threading.Lock()
_access_of_path: dict[str, str] = {}  # This trainer's copies -> the access of the loader that localized it last


def hold_options(options: dict) -> str:
    """Where this process keeps a loader's `options` for the other processes of the loader,
    as a FieldSpec.access string ("" for none): a memfd (memory, never a file system) that
    this process holds open for its lifetime, read by them as /proc/PID/fd/FD (the same
    user only), with a random nonce that tells it from whatever a reused pid or descriptor
    number names later."""
    if not options:
        return ""
    key = (os.getpid(), tuple(sorted(options.items())))
    with _held_lock:
        found = _held_options.get(key)
        if found is None:
            nonce = secrets.token_hex(16)
            descriptor = os.memfd_create("shmloader-credentials", os.MFD_CLOEXEC)
            os.write(descriptor, json.dumps({"nonce": nonce, "options": dict(options)}).encode())
            found = _held_options[key] = {"pid": os.getpid(), "fd": descriptor, "nonce": nonce}
        return json.dumps(found)


def access_for(path: str) -> str:
    """The access (hold_options) this trainer's descriptions of the copy at `path` give
    their readers: that of the loader that made it (create_object) last."""
    with _held_lock:
        return _access_of_path.get(path, "")


def options_of(access: str, url: str) -> dict:
    """The storage_options an access string (hold_options) stands for: {} for none."""
    if not access:
        return {}
    reference = json.loads(access)
    if reference["pid"] == os.getpid():
        with _held_lock:
            for (pid, items), found in _held_options.items():
                if pid == reference["pid"] and found["nonce"] == reference["nonce"]:
                    return dict(items)
    try:
        descriptor = os.open(f"/proc/{int(reference['pid'])}/fd/{int(reference['fd'])}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(descriptor).st_uid != os.geteuid():
                raise PermissionError("not this user's")
            held = json.loads(os.pread(descriptor, 1 << 20, 0))
        finally:
            os.close(descriptor)
        if not hmac.compare_digest(str(held.get("nonce")), str(reference["nonce"])):
            raise PermissionError("another process's")
        return dict(held["options"])
    except (OSError, ValueError, KeyError, AttributeError) as error:
        raise RemoteError(f"{url}: the storage_options of this reader's loader are held by its trainer (pid "
                          f"{reference['pid']}), which cannot give them ({error}); the cache keeps no credential "
                          f"on disk: readers fetch only in their trainer's lifetime") from None


def write_marker(path: str, marker: dict) -> None:
    """Writes an object's marker (URL, ETag, size, header ranges, and the kind of page
    digests its pages file holds, this version's: no storage_options)."""
    marker = {**{name: marker[name] for name in ("url", "etag", "size", "meta")}, "digest": PAGE_DIGEST}
    temporary = f"{path}{MARKER_SUFFIX}.{os.getpid()}.{threading.get_ident()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)  # Left by a process of this pid that died: O_EXCL below must not meet it.
    descriptor = open_private(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(descriptor, "w") as handle:
            json.dump(marker, handle)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise no_space(error, cache_root(path), 0, f"writing {path}{MARKER_SUFFIX}") from None
    os.replace(temporary, path + MARKER_SUFFIX)  # A rename replaces a link, never follows it.


def pages_of(offsets: np.ndarray, sizes: np.ndarray, ordered: bool = False) -> np.ndarray:
    """The distinct pages that byte ranges (offsets, sizes) touch: sorted, or (`ordered`) in
    the order the ranges first reach them."""
    keep = sizes > 0
    if not keep.all():
        offsets, sizes = offsets[keep], sizes[keep]
    if not len(offsets):
        return np.empty(0, dtype=np.int64)
    first = offsets.astype(np.int64) // CACHE_PAGE_BYTES
    last = (offsets.astype(np.int64) + sizes.astype(np.int64) - 1) // CACHE_PAGE_BYTES
    spans = last - first + 1
    longest = int(spans.max())
    if longest == 1:
        pages = first
    elif longest == 2 and not ordered:  # Rows smaller than a page: the second page of those that cross one.
        pages = np.concatenate((first, last[spans == 2]))
    else:
        total = int(spans.sum())
        pages = np.repeat(first - np.concatenate([[0], np.cumsum(spans)[:-1]]), spans) + np.arange(total)
    return first_seen(pages) if ordered else distinct(pages)


# np.unique is not used on a reader's paths: numpy 2.4's asks np.ma.is_masked, whose first
# call imports numpy.ma (a tenth of a CPU second in each reader), and its own sorting costs
# three times these on a fill's few hundred pages.

def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted."""
    values = np.sort(values)
    if len(values) < 2:
        return values
    keep = np.empty(len(values), dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def first_seen(values: np.ndarray) -> np.ndarray:
    """The distinct values, in the order they first appear."""
    if len(values) < 2:
        return values
    order = np.argsort(values, kind="stable")  # Equal values keep their order: the first one leads.
    ranked = values[order]
    keep = np.empty(len(values), dtype=bool)
    keep[0] = True
    np.not_equal(ranked[1:], ranked[:-1], out=keep[1:])
    return values[np.sort(order[keep])]


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


def _identity(status: os.stat_result) -> tuple[int, int]:
    """A file's (device, inode): what tells a file from another at the same path (neither
    is reused while this process holds the file open)."""
    return status.st_dev, status.st_ino


def open_object(cache: NodeCache, path: str, url: str = "", access: str | None = None) -> CachedObject:
    """This process's opening of the copy at `path` in `cache` (opened anew where its files
    are not the ones it opened: the cache directory removed and made again, the copy made
    anew, a pages file removed), fetching with the storage_options `access` stands for
    (hold_options; None: as it was opened)."""
    with cache.objects_lock:
        found = cache.objects.get(path)
        if found is not None and (found.stamps is None or not found.current()):
            if found.stamps is not None:
                # Not closed here: a loader of this process may read on through it, from the
                # files it opened (their bytes the ones its stamps vouch for); closed with the view.
                cache.superseded.append(found)
            found = None
        if found is None:
            found = cache.objects[path] = CachedObject(cache, path, url, access or "")
        elif access is not None and access != found.access:
            found.access, found.client = access, Client(options_of(access, found.url), cache.count)
        return found


class CachedObject:
    """One object's local copy, opened in this process: pins pages for gathers and
    fetches what is missing. Each thread pins and claims through descriptions of its own:
    OFD locks taken through one description do not exclude each other, so two threads
    sharing one would release each other's pins and claims."""

    def __init__(self, cache: NodeCache, path: str, url: str = "", access: str = "") -> None:
        marker = read_marker(path)
        if marker is None:
            raise StorageError(f"{url or path}: its copy in the node cache ({path}) is gone: was the cache directory "
                               f"removed while the loader ran? Restart the loader")
        self.cache, self.path = cache, path
        self.url, self.etag, self.size = marker["url"], marker["etag"], int(marker["size"])
        self.meta = [tuple(extent) for extent in marker.get("meta", [])]
        self.access, self.client = access, Client(options_of(access, self.url), cache.count)
        self.page_count = -(-self.size // CACHE_PAGE_BYTES)
        self._data_fd = open_private(path, os.O_RDWR)
        try:
            self._map_fd = open_private(path + PAGES_SUFFIX, os.O_RDWR)
        except BaseException:
            os.close(self._data_fd)
            raise
        # The pair this process reads by: the stamps of one pages file vouch for the bytes of
        # the data file that was beside it, and for no other (create_object makes a copy anew
        # as new files).
        self.identity = (_identity(os.fstat(self._data_fd)), _identity(os.fstat(self._map_fd)))
        if not self.current():
            os.close(self._data_fd)
            os.close(self._map_fd)
            raise StorageError(f"{self.url}: its copy in the node cache ({path}) was made anew by another process "
                               f"while this one opened it; restart the loader")
        length = pages_file_bytes(self.page_count)
        if os.fstat(self._map_fd).st_size != length or os.fstat(self._data_fd).st_size != self.size:
            os.close(self._data_fd)
            os.close(self._map_fd)
            raise StorageError(f"{self.url}: its copy in the node cache ({path}) does not have the object's size "
                               f"({self.size} bytes): it was cut short or replaced while the loader ran; restart "
                               f"the loader (a new one fetches the object again)")
        # Open from here on: its files stay while this process has it (NodeCache._remove_unopened).
        lock(self._map_fd, fcntl.F_RDLCK, OPEN_BASE, 1, True)
        if os.fstat(self._map_fd).st_nlink == 0:  # Removed, unopened, before the lock was had.
            os.close(self._data_fd)
            os.close(self._map_fd)
            raise StorageError(f"{self.url}: its copy in the node cache ({path}) was removed to keep the budget "
                               f"before this process opened it; restart the loader")
        self._map = map_shared(self._map_fd, max(1, length))
        self.stamps = np.frombuffer(self._map, dtype=np.uint32, count=self.page_count)
        self.checksums = np.frombuffer(self._map, dtype=np.uint32, count=self.page_count,
                                       offset=STAMP_BYTES * self.page_count)
        # Pages this process may serve unchecked: see _verify for why and what it costs.
        # Those absent now count as checked: whoever downloads one while this process has
        # the copy open (this process, or another reader of the node), it is as fresh as
        # this process's own downloads, which are served unchecked for the whole run.
        self.verified = self.stamps == 0
        self._local = threading.local()
        self._descriptors: list[int] = []
        self._descriptors_lock = threading.Lock()
        # The pages of this process's read-ahead requests in flight (prefetch).
        self._fetching = np.zeros(self.page_count, dtype=bool)
        self._fetching_lock = threading.Lock()
        # Runs being downloaded into the data file now -> how many (close() gives back what
        # they wrote); under _descriptors_lock.
        self._writing: dict[tuple[int, int], int] = {}
        self._data_map: mmap.mmap | None = None  # _data_view's.

    def current(self) -> bool:
        """Whether the copy's data and pages files are still the ones this process opened:
        a pages file removed or replaced, or the copy made anew (by a loader of this process
        or another), is another copy, whose stamps this process has never read."""
        try:
            return (_identity(os.lstat(self.path)), _identity(os.lstat(self.path + PAGES_SUFFIX))) == self.identity
        except FileNotFoundError:
            return False

    def _fd(self, purpose: str) -> int:
        """This thread's description of the pages file for `purpose` ("pin", "block",
        "ahead"); StorageError once the object is closed."""
        descriptor = getattr(self._local, purpose, None)
        if descriptor is not None and self.stamps is None:
            raise StorageError(f"{self.url}: its loader is closed")
        if descriptor is None:
            descriptor = open_private(self.path + PAGES_SUFFIX, os.O_RDWR)
            with self._descriptors_lock:
                if self.stamps is None:
                    os.close(descriptor)
                    raise StorageError(f"{self.url}: its loader is closed")
                self._descriptors.append(descriptor)
            setattr(self._local, purpose, descriptor)
        return descriptor

    def _with_units(self, pages: np.ndarray, unit: int) -> np.ndarray:
        """The missing pages of every fetch unit of `unit` pages (aligned) holding one of
        `pages`, units in the order `pages` first reaches them (see set_fetch_unit)."""
        if unit <= 1 or not len(pages):
            return pages
        units = first_seen(pages // unit)
        starts = units * unit
        counts = np.minimum(starts + unit, self.page_count) - starts
        expanded = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
        return expanded[self.stamps[expanded] == 0]

    # Pins (the gathering thread).

    def pin(self, offsets: np.ndarray, sizes: np.ndarray, unit_pages: int = 1, unpinned: bool = False,
            purpose: str = "pin") -> None:
        """Makes the pages under byte ranges (offsets, sizes) present and keeps them so until
        unpin(purpose): they are fetched (by this process, or by whoever fetches them
        already), with the rest of their fetch units of `unit_pages`.
        `unpinned`: where every page present is checked already, the pages missing fit the
        budget, and no eviction runs, no USE lock is taken: unpin() then says whether an
        eviction ran meanwhile, and the caller reads again (pinned) where one did (see
        _read_unpinned).
        `purpose`: pins of one purpose are let go of together, through their own description
        of the pages file ("pin": a fill's; "block": pinned(), which a fill's thread may
        enter while it holds pins of its own, when a field opens a part lazily)."""
        pages = pages_of(np.asarray(offsets), np.asarray(sizes))
        if not len(pages):
            return
        if unpinned and UNPINNED_READS and self._read_unpinned(pages, purpose, unit_pages):
            return
        descriptor = self._fd(purpose)
        setattr(self._local, f"{purpose}_held", True)
        # The pages the ranges touch, and no others (a lock call per run of consecutive
        # pages): what a fill holds beyond the budget is its rows' pages (pinned_bytes_max),
        # not the fetch units around them, which an eviction may take once fetched.
        for first, end in runs_of(pages, 1 << 30):
            lock(descriptor, fcntl.F_RDLCK, first, end - first, True)
        stamps = self.stamps[pages]
        unchecked = pages[(stamps != 0) & ~self.verified[pages]]
        if len(unchecked):
            stamps = self._verify(unchecked, descriptor, pages, stamps)
        missing = pages[stamps == 0]
        stamp = now_stamp()
        # Used now: the last to be evicted (a page fetched ahead, stamped in the future, is
        # from here on a page like any other, which the read-ahead may evict).
        stale = pages[(stamps != 0) & ((stamps + 1 < stamp) | (stamps > stamp))]
        if len(stale):  # Through the ledger lock: a page another process just marked absent stays so.
            self.cache.touch(self.stamps, stale, stamp)
        if len(missing):
            with self.cache.ahead_slots.fill_waiting():
                self._fetch_missing(missing, descriptor, unit_pages)
        self._check_pinned(pages)

    def _read_unpinned(self, pages: np.ndarray, purpose: str, unit_pages: int) -> bool:
        """Whether `pages` may be read without their USE locks: those present all checked,
        those missing fetched here where the budget has room for them (no eviction to make),
        and no eviction running (the ledger's eviction sequence even, NodeCache._evicting).
        A lock call per run of pages was the largest cost of serving rows from the cache:
        a batch of rows at random is hundreds of runs, and each call walks the file's list
        of locks, which every reader shares (py-spy; bench/RESULTS.md); a fill that ran just
        behind the downloads, missing a page or two, took them all. An eviction is what a pin
        holds off, and evictions are counted: unpin() compares the sequence with the one read
        here (and looks at the stamps again), so a gather that an eviction may have
        overlapped is read again, pinned. Pages last used a while ago are stamped as used
        (touch, under the ledger lock) as a pin stamps them."""
        sequence = self.cache.eviction_sequence()
        if sequence is None or sequence % 2:
            return False
        stamps = self.stamps[pages]
        present = stamps != 0
        unchecked = pages[present & ~self.verified[pages]]
        if len(unchecked) and self._unpinned_failing(unchecked):
            return False  # Under pins, _verify looks again and marks the failing pages absent.
        if not present.all():
            missing = pages[~present]
            if not self.cache.has_room(self._bytes_of(missing)):
                return False  # Pinned: what a fill holds past the budget is bounded (pinned_bytes_max).
            with self.cache.ahead_slots.fill_waiting():
                self._fetch_missing(missing, self._fd(purpose), unit_pages)
            stamps = self.stamps[pages]
            if not (stamps != 0).all():
                return False  # Evicted meanwhile (the budget filled up): read pinned.
        stamp = now_stamp()
        stale = pages[(stamps + 1 < stamp) | (stamps > stamp)]
        if len(stale):
            self._touch_soon(stale, stamp)
        reads = getattr(self._local, f"{purpose}_reads", None)
        if reads is None:
            reads = []
            setattr(self._local, f"{purpose}_reads", reads)
        reads.append((sequence, pages))
        return True

    def _touch_soon(self, pages: np.ndarray, stamp: int) -> None:
        """Stamps `pages` used (NodeCache.touch) together with those of this thread's other
        unpinned reads within TOUCH_EVERY_SECONDS: a fill of rows at random finds pages to
        stamp at nearly every step (those fetched ahead are stamped in the future, others
        used a second ago or more), and the ledger's lock for each was a tenth of a fill's
        Python. Stamps count whole seconds: a page stamped a second late is evicted in the
        same order."""
        pending = getattr(self._local, "touch_pending", None)
        if pending is None:
            pending = self._local.touch_pending = []
            self._local.touched = time.monotonic()
        pending.append(pages)
        if time.monotonic() - self._local.touched < TOUCH_EVERY_SECONDS:
            return
        self._local.touched = time.monotonic()
        self._local.touch_pending = []
        if self.stamps is not None:
            self.cache.touch(self.stamps, np.concatenate(pending), stamp)

    def _unpinned_failing(self, pages: np.ndarray) -> bool:
        """Checks present `pages` without pins, in place in a mapping of the copy (one call
        for a fill's pages, where _failing reads each run of pages), marking those that match
        as checked; whether any failed. Sound without locks: a page's bytes match its stored
        digest only where they are the object's (an eviction, a rewrite or a torn read
        meanwhile makes a page fail, and a failure is looked at again under pins). A reader
        opens the copy after its trainer fetched the first steps' pages, so its first fills
        find many pages it has to check: under pins, each of those fills took a lock per run
        of pages, a tenth of the readers' CPU over a store's first pass (perf,
        bench/RESULTS.md)."""
        digests = np.empty(len(pages), dtype=np.uint32)
        try:
            page_digests_at(self._data_view(), pages.astype(np.uint64), digests)
        except (ValueError, StorageError):  # Closed meanwhile: the pinned path says so.
            return True
        good = digests == self.checksums[pages]
        self.verified[pages[good]] = True
        return not good.all()

    def _data_view(self) -> mmap.mmap:
        """A read-only mapping of the copy's data file (made at its first use: only a process
        that opened pages already there checks any); ValueError once the object is closed."""
        found = self._data_map
        if found is None:
            with self._descriptors_lock:
                if self.stamps is None:
                    raise ValueError(f"{self.url}: closed")
                if self._data_map is None:
                    self._data_map = mmap.mmap(self._data_fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
                found = self._data_map
        return found

    def _check_pinned(self, pages: np.ndarray) -> None:
        """A pin returns with every page it holds present: an eviction, the one change that
        makes a page absent for reasons of its own, takes the page's USE lock, which the pin
        holds. Only another process that found a pinned page's bytes on disk not those its
        download wrote (_verify) marks it absent under a pin: an operating error (a failing
        disk, an edit of the cache directory), raised as one, never read as data. One
        vectorised look per pin, not per row."""
        stamps = self.stamps
        if stamps is None:  # Closed meanwhile (the loader's close): nothing is read through it.
            return
        absent = pages[stamps[pages] == 0]
        if len(absent):
            raise CacheError(
                f"{self.url}: {len(absent)} page(s) of its copy in the node cache ({self.path}), from page "
                f"{int(absent[0])}, were marked absent while this process held them pinned: another process found "
                f"their bytes on disk changed since they were written (a failing disk, or the cache directory edited "
                f"while loaders ran). Restart the loader; if it happens again, check the disk under cache_dir")

    def _verify(self, pages: np.ndarray, descriptor: int, pinned: np.ndarray, stamps: np.ndarray) -> np.ndarray:
        """Checks present `pages` (pinned through `descriptor`) against the digest their
        download stored, the first time this process serves them: a page that was present
        when this process opened the copy, written by an earlier run or process, may have
        been altered on disk since (a flipped bit, a hand edit, a file cut short and grown
        again). What it costs: the stored digest, 4 bytes a page in the pages file; one
        digest per page downloaded; and, once per such page and process, a read of the page
        and its digest. Pages downloaded while this process had the copy open, by it or by
        another reader of the node, count as checked: checking those too made every reader
        read and checksum every page the others fetched, the largest cost of serving rows
        from the cache (py-spy, bench/RESULTS.md). One that fails is marked absent and
        fetched again. Returns the stamps of `pinned` as they are now."""
        bad = []
        for first, end in runs_of(pages, VERIFY_READ_PAGES):
            for page in self._failing(first, end, pages):
                bad.append(page)
        for page in bad:
            # Under the page's FETCH lock, looked at again: another process may have found
            # it bad first and fetched it again since.
            lock(descriptor, fcntl.F_WRLCK, FETCH_BASE + page, 1, True)
            try:
                if self.stamps[page] != 0 and page in self._failing(page, page + 1, np.array([page])):
                    # Absent from here on: nobody serves it again.
                    self.cache.mark_absent(self.stamps, page, page_disk_bytes(page, self.size))
            finally:
                lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + page, 1, False)
        return self.stamps[pinned]

    def _failing(self, first: int, end: int, wanted: np.ndarray) -> list[int]:
        """The pages of [first, end) among `wanted` whose bytes on disk fail their digest;
        the others are marked checked."""
        start, stop = first * CACHE_PAGE_BYTES, min(end * CACHE_PAGE_BYTES, self.size)
        data = os.pread(self._data_fd, stop - start, start)
        # A file cut short reads short: the pages past its end fail (and those it cuts, below).
        whole = -(-len(data) // CACHE_PAGE_BYTES)
        digests = np.zeros(end - first, dtype=np.uint32)
        page_digests(data, digests[:whole])
        pages = wanted[(wanted >= first) & (wanted < end)]
        read = np.minimum(len(data) - (pages - first) * CACHE_PAGE_BYTES, CACHE_PAGE_BYTES)
        good = (pages - first < whole) & (read == np.minimum(stop - pages * CACHE_PAGE_BYTES, CACHE_PAGE_BYTES)) \
            & (digests[pages - first] == self.checksums[pages])
        self.verified[pages[good]] = True
        return pages[~good].tolist()

    def present(self, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Per byte range, whether all its pages are here (unpinned: a hint)."""
        offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
        first, last = offsets // CACHE_PAGE_BYTES, (offsets + np.maximum(sizes, 1) - 1) // CACHE_PAGE_BYTES
        single = first == last
        # Checked pages only: a page is read here unpinned (a block table for the read-ahead).
        found = (self.stamps[first] != 0) & self.verified[first]
        for k in np.flatnonzero(~single).tolist():
            found[k] = bool(((self.stamps[first[k]:last[k] + 1] != 0) & self.verified[first[k]:last[k] + 1]).all())
        return found

    def unpin(self, purpose: str = "pin") -> bool:
        """Lets go of this thread's pins of `purpose`; False where pages it read unpinned
        since its last unpin may have been evicted meanwhile (what was read from them must
        be read again)."""
        held = True
        if self.stamps is None:  # Closed: its descriptors, and the locks taken through them, are gone.
            setattr(self._local, f"{purpose}_held", False)
            reads = getattr(self._local, f"{purpose}_reads", None)
            return not reads
        reads = getattr(self._local, f"{purpose}_reads", None)
        if reads:
            # Read after the gather: on x86-64 (UNPINNED_READS) loads are not reordered
            # with older loads, so the gather's reads came before this one.
            sequence, stamps = self.cache.eviction_sequence(), self.stamps
            held = stamps is not None and all(
                read == sequence and (stamps[pages] != 0).all() for read, pages in reads)
            reads.clear()
        if getattr(self._local, f"{purpose}_held", False):
            lock(self._fd(purpose), fcntl.F_UNLCK, 0, 0, False)  # Length 0: to the end, every USE byte.
            setattr(self._local, f"{purpose}_held", False)
        return held

    @contextlib.contextmanager
    def pinned(self, extents=None):
        """Pins `extents` ((offset, size) pairs; the header ranges when None) for a block."""
        extents = self.meta if extents is None else extents
        try:
            if extents:
                self.pin(np.array([offset for offset, _ in extents], np.int64),
                         np.array([size for _, size in extents], np.int64), purpose="block")
            yield self
        finally:
            self.unpin("block")

    @contextlib.contextmanager
    def reading_header(self):
        """Its header ranges pinned while a block opens or describes the copy, and a
        StorageError raised there named by the object's URL: the cache's path means nothing
        to the user."""
        try:
            with self.pinned():
                yield self
        except StorageError as error:
            raise type(error)(str(error).replace(self.path, self.url)) from None

    # Fetching.

    def prefetch(self, offsets: np.ndarray, sizes: np.ndarray, unit_pages: int = 1, throttled: bool = True) -> None:
        """Fetches the missing pages under the ranges, in the ranges' order (the read-ahead
        gives them in the order they will be needed), each run claimed just before its
        request: pages a fill needs meanwhile and nobody claimed yet are the fill's to fetch
        at once. Pages others fetch are skipped, not waited for.
        Returns once its requests
        are made, each claimed only when one of the node cache's IN_FLIGHT read-ahead
        threads is free for it (so that no claim waits in the pool's queue, where a fill
        would wait behind it); each request lets go of its claim and thread when it ends.
        (Waiting for a call's requests before the next call left one request per reader in
        flight, and the link idle between them: the read-ahead asks step by step.)
        Not `throttled` (the trainer's first steps, fetch_first_steps): the first IN_FLIGHT
        requests are made at once, without waiting for a thread, and the rest left to the
        fills (claims queued behind busy threads would make the fills that need them wait)."""
        pages = pages_of(np.atleast_1d(offsets), np.atleast_1d(sizes), ordered=True)
        missing = self._with_units(pages[self.stamps[pages] == 0] if len(pages) else pages, unit_pages)
        with self._fetching_lock:  # Pages of this process's requests in flight are asked for already.
            missing = missing[~self._fetching[missing]] if len(missing) else missing
        descriptor = self._fd("ahead")
        slots = self.cache.ahead_slots if throttled else None
        runs = runs_of(missing, REQUEST_BYTES // CACHE_PAGE_BYTES)
        for run_first, run_end in runs if throttled else runs[:IN_FLIGHT]:
            if slots is not None:
                slots.acquire()
            made = False
            try:
                # Under the lock close() takes: a closed object's descriptor number may name
                # another file by now, and a claim taken through it would never go.
                with self._descriptors_lock:
                    if self.stamps is None:
                        return
                    with self._fetching_lock:  # Checked before the lock: this thread's own claim would not stop it.
                        if self._fetching[run_first:run_end].any():
                            continue
                    if not lock(descriptor, fcntl.F_WRLCK, FETCH_BASE + run_first, run_end - run_first, False):
                        continue  # Being fetched (or evicted) by another: left to it.
                    if (self.stamps[run_first:run_end] != 0).all():
                        lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + run_first, run_end - run_first, False)
                        continue
                    with self._fetching_lock:
                        self._fetching[run_first:run_end] = True
                try:
                    size = self._missing_bytes(run_first, run_end)
                    room = self.cache.reserve(size, optional=True)
                except BaseException:
                    self._let_go(descriptor, run_first, run_end)
                    raise
                if not room:  # The budget is full of pages in use: reading further ahead would evict them.
                    self._let_go(descriptor, run_first, run_end)
                    break
                try:
                    future = self.cache.pool("ahead").submit(self._fetch_run, run_first, run_end, size, True)
                except BaseException:  # The pool is shut down (the cache closing): nothing fetched.
                    self.cache.settle(size, False)
                    self._let_go(descriptor, run_first, run_end)
                    raise
                made = True
                future.add_done_callback(
                    lambda _, first=run_first, end=run_end: self._ahead_done(descriptor, first, end, slots))
            finally:
                if not made and slots is not None:
                    slots.release(used=False)

    def _let_go(self, descriptor: int, first: int, end: int) -> None:
        """Ends a read-ahead claim on pages [first, end): unlocked (unless the object was
        closed: its descriptors, and their locks, are gone), then marked fetched by nobody
        here. In that order: marked first, the next prefetch of this thread could claim the
        pages again through the same description, and this unlock would drop its claim."""
        with self._descriptors_lock:
            if self.stamps is not None:
                with contextlib.suppress(OSError):
                    lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + first, end - first, False)
        with self._fetching_lock:
            self._fetching[first:end] = False

    def _ahead_done(self, descriptor: int, first: int, end: int, slots) -> None:
        """A read-ahead request ended (its failure is the fill's to report, when it needs the
        pages): its claim and its thread (its permit of `slots`, where it took one) go."""
        try:
            self._let_go(descriptor, first, end)
        finally:
            if slots is not None:
                slots.release()

    def _fetch_missing(self, missing: np.ndarray, descriptor: int, unit_pages: int) -> None:
        """Claims (FETCH lock) the missing pages, and those of their fetch units, that nobody
        else claims, downloads them in parallel, then waits for the needed pages others
        claimed and looks again. Where another request holds part of a run, the run's needed
        pages alone are claimed, one by one: the rest of the unit is no fill's to wait for,
        and a claim per page of a whole unit was hundreds of lock calls (each walking the
        file's list of locks) and as many one-page requests."""
        needed = missing
        while len(needed):
            claimed, others = [], []
            for first, end in runs_of(self._demand_pages(needed, unit_pages), REQUEST_BYTES // CACHE_PAGE_BYTES):
                if lock(descriptor, fcntl.F_WRLCK, FETCH_BASE + first, end - first, False):
                    claimed.append((first, end))
                    continue
                for page in needed[(needed >= first) & (needed < end)].tolist():
                    if not lock(descriptor, fcntl.F_WRLCK, FETCH_BASE + page, 1, False):
                        others.append(page)
                    elif claimed and claimed[-1][1] == page and page - claimed[-1][0] < REQUEST_BYTES // CACHE_PAGE_BYTES:
                        # Beside the last claim: one request.
                        claimed[-1] = (claimed[-1][0], page + 1)
                    else:
                        claimed.append((page, page + 1))
            self._download(claimed, descriptor)
            others = np.asarray(others, dtype=np.int64)  # Needed pages, each once (the runs are disjoint).
            if not len(others):
                return
            for page in others.tolist():  # Their fetcher is downloading: its lock goes when it is done.
                self._wait_for_fetcher(descriptor, page)
                lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + page, 1, False)
            needed = others[self.stamps[others] == 0]  # Their download failed: this process tries.

    def _wait_for_fetcher(self, descriptor: int, page: int) -> None:
        """Waits (its FETCH lock, shared) for whoever fetches `page`: blocking where this
        thread's step has no deadline, else polled until it (remote.step_deadline)."""
        if deadline_left(f"{self.url}: page {page}, which another request fetches") is None:
            lock(descriptor, fcntl.F_RDLCK, FETCH_BASE + page, 1, True)
            return
        while not lock(descriptor, fcntl.F_RDLCK, FETCH_BASE + page, 1, False):
            time.sleep(min(_POLL_SECONDS, deadline_left(f"{self.url}: page {page}, which another request fetches")))

    def _demand_pages(self, needed: np.ndarray, unit_pages: int) -> np.ndarray:
        """The pages a fill fetches for its `needed` ones: with the rest of their fetch units
        where the budget has room for those (evicting pages used longest ago), else the
        needed pages alone. Only the needed ones may pass the budget (they are pinned next):
        a unit around each row of a batch at random would be many times what it reads."""
        if unit_pages <= 1:
            return needed
        wanted = self._with_units(needed, unit_pages)
        extra = self._bytes_of(np.setdiff1d(wanted, needed, assume_unique=True))
        return wanted if not extra or self.cache.fits(extra + self._bytes_of(needed)) else needed

    def _bytes_of(self, pages: np.ndarray) -> int:
        """The disk `pages` (distinct) take once present."""
        size = len(pages) * CACHE_PAGE_BYTES
        if len(pages) and int(pages.max()) == self.page_count - 1:  # The last page may be shorter.
            size -= CACHE_PAGE_BYTES - page_disk_bytes(self.page_count - 1, self.size)
        return size

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
                try:
                    future.result(timeout=deadline_left(f"{self.url}: a GET of its pages"))
                except concurrent.futures.TimeoutError:
                    deadline_left(f"{self.url}: a GET of its pages")
                    raise
        finally:
            for first, end in claimed:
                lock(descriptor, fcntl.F_UNLCK, FETCH_BASE + first, end - first, False)

    def _missing_bytes(self, first: int, end: int) -> int:
        """The bytes of the pages of [first, end) that are absent: what fetching the run adds
        to the cache (its present pages are written again, with the same bytes)."""
        return self._bytes_of(np.flatnonzero(self.stamps[first:end] == 0) + first)

    def _fetch_run(self, first: int, end: int, reserved: int, ahead: bool = False) -> None:
        """Downloads pages [first, end) (claimed), settling the `reserved` bytes: before
        their stamps where the pages were written (_download_run), else here."""
        settling: list[bool] = []  # Set as _download_run settles: one that raises is not settled again.
        try:
            self._download_run(first, end, reserved, ahead, settling)
        finally:
            if not settling:
                self.cache.settle(reserved, False)

    def _download_run(self, first: int, end: int, reserved: int, ahead: bool, settling: list[bool]) -> bool:
        """Whether the pages were written (not when the object was closed meanwhile), their
        `reserved` bytes then settled as held before their stamps say present: a process
        killed between the two leaves bytes counted that no stamp vouches for (given back
        when the cache is next counted anew), never a present page the ledger does not count.
        Pages fetched `ahead` of their step are stamped AHEAD_STAMP_SECONDS in the future:
        the newest of the cache, evicted after the pages the fills just read (stamps count
        whole seconds, and a small cache turns over within one)."""
        # A request, whatever its fetch unit, lies within the object.
        assert 0 <= first < end <= self.page_count, (first, end, self.page_count, self.url)
        start, stop = first * CACHE_PAGE_BYTES, min(end * CACHE_PAGE_BYTES, self.size)
        checksums = RunDigests(stop - start)
        run = (first, end)
        with self._descriptors_lock:
            if self.stamps is None:  # Closed while the request waited for a thread: not made.
                return False
            self._writing[run] = self._writing.get(run, 0) + 1
        try:
            # Each piece written as it arrives (Client.stream: no request-sized buffer).
            self.client.stream(self.url, self.etag, start, stop, self.size,
                               lambda offset, view: self._write_piece(start, offset, view, checksums))
        except BaseException as error:
            self._give_back_written(run)
            if isinstance(error, _Closed):
                return False
            named = no_space(error, self.cache.root, self.cache.budget(), f"writing {self.path}") \
                if isinstance(error, OSError) else error
            if named is not error:  # The disk is full: said so, naming cache_dir and cache_bytes.
                raise named from None
            raise
        with self._descriptors_lock:
            self._done_writing(run)
            if self.stamps is None:  # Closed since its last piece: close() gave its bytes back.
                return False
            settling.append(True)
            self.cache.settle(reserved, True)
            self.checksums[first:end] = checksums.finish()  # With the bytes, before the stamps.
            self.stamps[first:end] = now_stamp() + (AHEAD_STAMP_SECONDS if ahead else 0)  # After the bytes.
            self.verified[first:end] = True
            return True

    def _write_piece(self, start: int, offset: int, view: memoryview, checksums: RunDigests) -> None:
        """Writes a piece of a download at `start + offset` and checksums it. Under the lock
        close() takes: a request that outlives its loader (a read-ahead thread given up on)
        must not write through a descriptor number reused since (_Closed ends it)."""
        checksums.add(offset, view)
        with self._descriptors_lock:
            if self.stamps is None:
                raise _Closed
            written = 0
            while written < view.nbytes:  # Bounded: a write that makes no progress raises.
                count = os.pwrite(self._data_fd, view[written:], start + offset + written)
                if count <= 0:
                    raise OSError(f"{self.path}: a write at byte {start + offset + written} wrote nothing")
                written += count

    def _done_writing(self, run: tuple[int, int]) -> None:
        """A download of `run` writes no more (under _descriptors_lock)."""
        self._writing[run] -= 1
        if not self._writing[run]:
            del self._writing[run]

    def _give_back_written(self, run: tuple[int, int]) -> None:
        """Ends a download of `run` that failed, freeing what it wrote of the run's absent
        pages (claimed: nobody else writes or stamps them meanwhile), which no stamp will
        vouch for; where the object was closed, close() freed them already."""
        with self._descriptors_lock:
            self._done_writing(run)
            if self.stamps is None:
                return
            self._punch_absent(*run)

    def _punch_absent(self, first: int, end: int) -> None:
        """Frees the disk of the absent pages of [first, end) (under _descriptors_lock)."""
        for page in (np.flatnonzero(self.stamps[first:end] == 0) + first).tolist():
            with contextlib.suppress(OSError):
                punch_hole(self._data_fd, page * CACHE_PAGE_BYTES, page_disk_bytes(page, self.size))

    def close(self, wait_seconds: float | None = None) -> None:
        """Closes the copy's files in this process. `wait_seconds` bounds the wait for a
        request that is writing pages meanwhile (one that waits for the ledger's lock, which
        a stopped process may hold: NodeCache.locked); past it the files stay open, and
        their locks go when the process exits."""
        if not self._descriptors_lock.acquire(timeout=-1 if wait_seconds is None else wait_seconds):
            return
        try:
            if self.stamps is None:
                return
            # Downloads writing meanwhile write no more (_write_piece); what they wrote of
            # absent pages, which no stamp will vouch for, is given back while their claims
            # (whose descriptors close below) still keep every other writer out.
            for first, end in self._writing:
                self._punch_absent(first, end)
            descriptors, self._descriptors = self._descriptors, []
            for descriptor in (*descriptors, self._data_fd, self._map_fd):
                with contextlib.suppress(OSError):
                    os.close(descriptor)
            self.stamps = self.checksums = None
            for mapping in (self._map, self._data_map):
                if mapping is not None:
                    with contextlib.suppress(BufferError):  # A view still held elsewhere: unmapped with it.
                        mapping.close()
        finally:
            self._descriptors_lock.release()


class _Closed(Exception):
    """A download's object was closed while it ran: it writes no more."""


def pinned_bytes_max(fillers: int, batch_size: int, row_bytes: int) -> int:
    """How far past its budget the node cache may hold bytes while loaders fill steps: the
    pages under the rows of the batch each filling process has pinned or is fetching
    (`fillers`: the readers of every loader on the node, or 1 for a trainer with
    readers=0; `row_bytes`: the stored bytes of one row, all fields together). A row
    touches ceil(row_bytes / CACHE_PAGE_BYTES) + 1 pages at most. Fetch units, the
    read-ahead and the cache's own files stay within the budget; once no fill pins them,
    the pages past it are evicted (NodeCache.close trims the cache back to its budget)."""
    pages_per_row = (row_bytes + CACHE_PAGE_BYTES - 2) // CACHE_PAGE_BYTES + 1
    return fillers * batch_size * pages_per_row * CACHE_PAGE_BYTES


def set_fetch_unit(field, random_rows: bool, stored_bytes: int) -> None:
    """What a field's fills fetch around a needed page (`field.unit_pages`, passed to pin
    and prefetch: loaders of one process share the object, not their reading pattern):
    whole requests where rows are read in order (a window's blocks, sequential) or where all
    the data the loader reads fits the budget (every page is needed soon and stays); the
    page alone where rows at random overflow the budget (most of a larger unit would be
    evicted unread)."""
    budget = field.remote.cache.counters()["bytes_budget"]
    fits = budget == 0 or stored_bytes <= budget
    unit = REQUEST_BYTES if not random_rows else (FIT_UNIT_BYTES if fits else CACHE_PAGE_BYTES)
    if budget:  # A small budget holds many units, not a few: evicting one unit would drop most of it.
        unit = min(unit, max(CACHE_PAGE_BYTES, budget // BUDGET_UNITS_MIN))
    field.unit_pages = max(1, unit // CACHE_PAGE_BYTES)

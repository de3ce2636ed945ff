"""The trainer's step for fields in a store: every URL of the field declarations becomes the
path of its copy in the node cache, with the header and index bytes fetched, so that the
plan describes it (and readers map it) exactly as a local file.

A URL names an object (`.npy`, `.b2nd`), a ragged directory (a key prefix holding
values.b2nd and offsets.b2nd, and shapes.b2nd where records are N-D), or a glob of objects
(`s3://bucket/train/shard-*.b2nd`). A list may mix URLs and local paths.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import fnmatch
import glob
import os
import posixpath
import shutil
import struct
import warnings

from ..errors import StorageError
from ..remote import is_url
from ..remote.cache import (
    cached_name,
    create_object,
    object_directory,
    open_object,
    read_marker,
    write_marker,
)
from ..remote.node import acquire, release
from ..remote.pages import CACHE_PAGE_BYTES
from ..remote.store import Client
from ..storage.ragged import OFFSETS_NAME, SHAPES_NAME, VALUES_NAME
from ..storage.spec import B2FRAME_HEADER_LENGTH_OFFSET, CHUNK_HEADER_BYTES
from .sources import Source

# A ragged directory's members: its offsets and shapes are the index, fetched whole by the trainer.
_RAGGED_VALUES, _RAGGED_INDEX = VALUES_NAME, (OFFSETS_NAME, SHAPES_NAME)
# Where a Blosc2 frame's header keeps its length (int32) and its chunks' bytes (int64),
# big-endian (c-blosc2's frame.h: FRAME_HEADER_LEN, FRAME_CBYTES), and the bytes of the
# first chunk's header that opening a frame reads.
_B2_HEADER_LENGTH, _B2_CBYTES, _B2_CHUNK_HEADER = B2FRAME_HEADER_LENGTH_OFFSET, 39, CHUNK_HEADER_BYTES


@dataclasses.dataclass
class CacheSettings:
    """The loader's cache_dir, cache_bytes and storage_options."""

    root: str
    budget: int
    options: dict = dataclasses.field(repr=False)  # Credentials: never printed.
    explicit: bool = True  # cache_bytes given; else budget is half the disk free, read now.

    @classmethod
    def of(cls, cache_dir, cache_bytes, storage_options) -> CacheSettings:
        from ..remote.pages import default_root

        root = os.path.abspath(os.fspath(cache_dir)) if cache_dir is not None else default_root()
        # 0700 where it is made here (the umask only takes bits away): made with the umask's
        # 0755, every user of the node could list it (private_root makes private only one
        # that others may write in).
        os.makedirs(root, mode=0o700, exist_ok=True)
        # The values' types and bounds are plan/options.LoaderOptions'; here what they mean.
        explicit = cache_bytes is not None
        if not explicit:
            cache_bytes = shutil.disk_usage(root).free // 2  # Half of what is free where it lives.
        assert storage_options is None or isinstance(storage_options, collections.abc.Mapping), storage_options
        return cls(root, int(cache_bytes), {str(k): str(v) for k, v in (storage_options or {}).items()}, explicit)


def declares_urls(fields, label_path=None) -> bool:
    return any(is_url(path) for path in _paths(fields)) or is_url(label_path)


def _paths(value):
    """Every path string a declaration holds."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, collections.abc.Mapping):
        for item in value.values():
            yield from _paths(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _paths(item)
    elif isinstance(value, Source):
        yield from _paths(value.fields)
    elif hasattr(value, "path") and dataclasses.is_dataclass(value):
        yield from _paths(value.path)


class Localizer:
    """Turns the declarations' URLs into cache paths (one per loader, in the trainer)."""

    def __init__(self, settings: CacheSettings) -> None:
        self.settings = settings
        self.cache = acquire(settings.root)  # The loader release()s it when it closes; localize() if it fails.
        try:
            budget = self.cache.join_budget(settings.budget)
        except BaseException:
            release(self.cache)
            raise
        # Only a budget the user gave is worth a warning: two default budgets differ by what
        # the disk gained or lost between two loaders' starts, and lowering one of them is
        # no surprise the user could act on.
        if budget < settings.budget and settings.explicit:
            warnings.warn(f"cache_dir {settings.root}: the node cache's budget is {budget} bytes, below this loader's "
                          f"{settings.budget}: a node's loaders share one budget, the smallest of theirs (cache_bytes, "
                          f"else half the disk free) since the cache was last unused", RuntimeWarning, stacklevel=4)
        self.client = Client(settings.options, self.cache.count)
        self.urls: dict[str, str] = {}  # cache path -> the URL it is a copy of

    def renamed(self, error: Exception) -> Exception:
        """`error` (of the same type) with every cache path in its message named by its URL."""
        text = str(error)
        for path in sorted(self.urls, key=len, reverse=True):
            text = text.replace(path, self.urls[path])
        if text == str(error):
            return error
        try:
            renamed = type(error)(text)
        except Exception:  # noqa: BLE001 - a type that takes other arguments keeps its message.
            return error
        renamed.__cause__ = error.__cause__
        return renamed

    def fields(self, value):
        """`value` (fields, a Source, a declaration, a path, a list) with URLs replaced."""
        if isinstance(value, str):
            return self.path(value) if is_url(value) else value
        if isinstance(value, collections.abc.Mapping):
            return {name: self.fields(item) for name, item in value.items()}
        if isinstance(value, (list, tuple)):
            expanded = []
            for item in value:
                local = self.fields(item)
                expanded.extend(local if isinstance(item, str) and is_url(item) and isinstance(local, list) else [local])
            return expanded if isinstance(value, list) else tuple(expanded)
        if isinstance(value, Source):
            return dataclasses.replace(value, fields=self.fields(value.fields))
        if hasattr(value, "path") and dataclasses.is_dataclass(value):
            return dataclasses.replace(value, path=self.fields(value.path))
        return value

    def path(self, url: str):
        """A cache path for an object or a ragged directory; a list of them for a glob."""
        if glob.has_magic(url):
            return [self._object(*match) if match[1] is not None else self._ragged(match[0])
                    for match in self._glob(url)]
        try:
            size, etag = self.client.head(url)
        except FileNotFoundError:
            return self._ragged(url)
        return self._object(url, size, etag)

    def _glob(self, url: str) -> list[tuple]:
        """(URL, size, ETag) of each object, or (URL, None, None) of each ragged directory,
        that the pattern matches as glob.glob matches paths: a wildcard matches within one
        "/"-separated name, and names starting with "." only where the pattern's do."""
        magic = url[:min(url.index(mark) for mark in "*?[" if mark in url)]
        prefix = magic[:magic.rindex("/") + 1]  # Stores list by key prefix up to a "/".
        wanted = url[len(prefix):].rstrip("/").split("/")
        objects, directories = [], set()
        for found, size, etag in self.client.list(prefix):
            names = found[len(prefix):].split("/")
            if _names_match(names, wanted):
                objects.append((found, size, etag))
            elif len(names) > len(wanted) and _names_match(names[:len(wanted)], wanted):
                directories.add(prefix + "/".join(names[:len(wanted)]))
        matches = objects + [(directory, None, None) for directory in sorted(directories)]
        if not matches:
            raise FileNotFoundError(f"no object or ragged directory matches {url}")
        return sorted(matches)

    def _ragged(self, url: str) -> str:
        base = url.rstrip("/")
        members = {posixpath.relpath(found, base): (found, size, etag) for found, size, etag in self.client.list(base + "/")}
        members = {name: member for name, member in members.items() if "/" not in name}
        if _RAGGED_VALUES not in members or _RAGGED_INDEX[0] not in members:
            if members:
                raise StorageError(f"{url} is a prefix of {len(members)} objects but not a ragged directory (it needs "
                                   f"{_RAGGED_VALUES} and {_RAGGED_INDEX[0]}); name an object, a glob, or a ragged "
                                   f"directory")
            raise FileNotFoundError(f"{url}: no such object, and no ragged directory under it")
        wanted = [name for name in (_RAGGED_VALUES, *_RAGGED_INDEX) if name in members]
        version = ";".join(f"{name}={members[name][2]}" for name in wanted)
        directory = object_directory(self.settings.root, base, version)
        for name in wanted:
            found, size, etag = members[name]
            self._object(found, size, etag, path=os.path.join(directory, name), whole=name in _RAGGED_INDEX)
        self.urls[directory] = base
        return directory

    def _object(self, url: str, size: int, etag: str, path: str | None = None, whole: bool = False) -> str:
        if size == 0:
            raise StorageError(f"{url}: an empty object; expected a .npy or .b2nd file, or a ragged directory")
        name = cached_name(url)  # Bounded: an S3 key segment may be longer than a file name.
        path = path or os.path.join(object_directory(self.settings.root, url, etag), name)
        # This loader's storage_options, held in the trainer's memory: its readers get them
        # from the plan (FieldSpec.access), never from another trainer's loader.
        # Under the ledger lock until it is open: no eviction removes it before (node._remove_unopened).
        with self.cache.locked():
            access = create_object(path, url, etag, size, self.settings.options)
            marker = read_marker(path, (url, etag, size))
            if marker is None:  # Damaged by another process since (a warning names it): written anew.
                create_object(path, url, etag, size, self.settings.options)
                marker = read_marker(path, (url, etag, size))
            cached = open_object(self.cache, path, url, access)
        if not marker["meta"]:
            marker["meta"] = [[0, size]] if whole else self._header_extents(cached, size)
            write_marker(path, marker)
        cached.meta = [tuple(extent) for extent in marker["meta"]]
        self.urls[path] = url
        return path

    @staticmethod
    def _header_extents(cached, size: int) -> list[list[int]]:
        """The byte ranges that describing and opening the object read: a .npy header; a
        Blosc2 frame's header, first chunk header, offsets and trailer."""
        first = min(size, CACHE_PAGE_BYTES)
        with cached.pinned([(0, first)]):
            with open(cached.path, "rb") as handle:
                head = handle.read(first)
        if head.startswith(b"\x93NUMPY") and len(head) >= 12:
            if head[6] == 1:
                (length,), start = struct.unpack_from("<H", head, 8), 10
            else:
                (length,), start = struct.unpack_from("<I", head, 8), 12
            return [[0, min(size, start + length)]]
        if head[1:10] == b"\xa8b2frame\x00" and len(head) >= _B2_CBYTES + 8:
            (header,) = struct.unpack_from(">i", head, _B2_HEADER_LENGTH)
            (data,) = struct.unpack_from(">q", head, _B2_CBYTES)
            tail = header + data
            if 0 < header and 0 <= data and tail <= size:
                return [[0, min(size, header + _B2_CHUNK_HEADER)], [tail, size - tail]]
        return [[0, first]]  # Not a field file: describing it says so, naming the URL.


def _names_match(names: list[str], patterns: list[str]) -> bool:
    return len(names) == len(patterns) and all(
        fnmatch.fnmatchcase(name, pattern) and (not name.startswith(".") or pattern.startswith("."))
        for name, pattern in zip(names, patterns))


def localize(fields, label_path, cache_dir, cache_bytes, storage_options):
    """(fields, label_path, the Localizer or None) with every URL replaced by its cache path."""
    if not declares_urls(fields, label_path):
        if cache_dir is not None or cache_bytes is not None or storage_options is not None:
            raise ValueError("cache_dir, cache_bytes and storage_options go with fields in a store (s3:// URLs); "
                             "these fields are local files")
        return fields, label_path, None
    localizer = Localizer(CacheSettings.of(cache_dir, cache_bytes, storage_options))
    try:
        local_label = localizer.path(label_path) if is_url(label_path) else label_path
        return localizer.fields(fields), local_label, localizer
    except BaseException:
        # The loader has not taken the view yet (its Resources release it once it has): a
        # copy that cannot be made (a directory or a FIFO in place of a file, the store
        # refusing) must not leave this process's view of the cache, its files and locks, open.
        release(localizer.cache)
        raise

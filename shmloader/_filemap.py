"""Read-only file mappings that keep no file descriptor open.

CPython's mmap keeps a duplicate of the descriptor for every mapping, so a reader that
mapped a field of thousands of shards held a descriptor per shard and ran into
RLIMIT_NOFILE (EMFILE at 1,024 by default). Here libc's mmap maps the file, the caller
closes its descriptor at once, and the mapping lives while anything refers to its buffer:
munmap runs when the last reference goes (cffi's gc), never under a live view.
"""

from __future__ import annotations

import mmap
import os
import weakref

from ._native import ffi as _ffi

_libc = _ffi.dlopen(None)
_PAGE_BYTES = mmap.PAGESIZE


class FileMapping:
    """A whole file mapped read-only (MAP_SHARED). `buffer` supports the buffer protocol
    (numpy, memoryview, struct, cffi read it); do not write through it."""

    __slots__ = ("buffer", "size", "_pointer")

    def __init__(self, descriptor: int, size: int) -> None:
        if size <= 0:
            raise OSError(f"cannot map an empty file ({size} bytes)")
        pointer = _libc.mmap(_ffi.NULL, size, mmap.PROT_READ, mmap.MAP_SHARED, descriptor, 0)
        if int(_ffi.cast("intptr_t", pointer)) == -1:
            number = _ffi.errno
            raise OSError(number, os.strerror(number))
        self._pointer = _ffi.gc(pointer, lambda address, size=size: _libc.munmap(address, size), size=size)
        self.size = size
        self.buffer = _ffi.buffer(self._pointer, size)  # Refers to the pointer: keeps the mapping.

    def __len__(self) -> int:
        return self.size

    def advise(self, advice: int, offset: int = 0, size: int | None = None) -> None:
        """madvise over [offset, offset + size) widened to whole pages; errors are ignored
        (advice costs speed, never data)."""
        size = self.size - offset if size is None else size
        start = offset - offset % _PAGE_BYTES
        end = min(self.size, offset + size)
        if end > start:
            _libc.madvise(self._pointer + start, end - start, advice)


class KeptDescriptor:
    """A mapped file's descriptor, kept open to ask whether the file changed (storage/rows.py,
    check_unchanged): closed by close() or when nothing refers to it."""

    __slots__ = ("descriptor", "_finalizer", "__weakref__")

    def __init__(self, descriptor: int) -> None:
        self.descriptor = descriptor
        self._finalizer = weakref.finalize(self, os.close, descriptor)

    def status(self) -> os.stat_result:
        return os.fstat(self.descriptor)

    def close(self) -> None:
        self._finalizer()


def map_file(path: str, check=None, keep: bool = False) -> tuple[FileMapping, KeptDescriptor | None]:
    """Maps the file at `path`; `check(os.stat_result)` runs on the open descriptor first
    (the file identity check) and may raise. `keep`: the descriptor stays open, returned
    beside the mapping (a few files' worth; thousands of shards would run into
    RLIMIT_NOFILE), else None."""
    descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        status = os.fstat(descriptor)
        if check is not None:
            check(status)
        mapping = FileMapping(descriptor, status.st_size)
    except BaseException:
        os.close(descriptor)
        raise
    if keep:
        return mapping, KeptDescriptor(descriptor)
    os.close(descriptor)
    return mapping, None

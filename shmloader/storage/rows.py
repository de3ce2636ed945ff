"""Gathering rows (the readers' side): the checks and error reports every gather shares,
the Blosc2 layout the Zig gather reads, and .npy and empty fields."""

from __future__ import annotations

import mmap
import os

import numpy as np

from .._filemap import FileMapping, map_file
from .._native import Status, check, ffi, lib
from ..errors import StorageError
from .spec import FieldSpec, check_identity


def check_indices(spec: FieldSpec, indices) -> np.ndarray:
    indices = np.asarray(indices)
    if indices.ndim != 1:
        raise ValueError(f"indices must be one-dimensional, got shape {indices.shape}")
    if indices.dtype != np.uint64:
        if indices.size and indices.dtype.kind in "iu" and indices.min() < 0:
            position = int(np.argmax(indices < 0))
            raise IndexError(f"{spec.name}: index {int(indices[position])} at position {position} is negative")
        if indices.dtype.kind not in "iu" and indices.size:
            raise TypeError(f"indices must be integers, got dtype {indices.dtype}")
        indices = indices.astype(np.uint64)
    return np.ascontiguousarray(indices)


def checked_out_pointer(spec: FieldSpec, out, count: int):
    """A cdata pointer to `out`, after checking it is writable and exactly the batch's size."""
    expected_bytes = count * spec.row_bytes
    if isinstance(out, np.ndarray):
        if out.dtype != spec.numpy_dtype and out.dtype != np.uint8:
            raise TypeError(f"{spec.name}: out has dtype {out.dtype}, expected {spec.numpy_dtype} (or raw uint8 bytes)")
        if not out.flags.c_contiguous:
            raise ValueError(f"{spec.name}: out must be C-contiguous")
        if not out.flags.writeable:
            raise ValueError(f"{spec.name}: out is read-only; gather needs a writable buffer")
        actual_bytes = out.nbytes
    else:
        try:
            actual_bytes = memoryview(out).nbytes
        except TypeError:
            raise TypeError(f"{spec.name}: out must be a numpy array or a writable buffer, got {type(out).__name__}") from None
    if actual_bytes != expected_bytes:
        raise ValueError(
            f"{spec.name}: out holds {actual_bytes} bytes, expected {expected_bytes} "
            f"({count} rows of {spec.row_bytes} bytes)"
        )
    try:
        return ffi.from_buffer("uint8_t[]", out, require_writable=True)
    except (TypeError, BufferError):
        raise ValueError(f"{spec.name}: out is read-only; gather needs a writable buffer") from None


def raise_index_error(spec: FieldSpec, indices: np.ndarray, position: int) -> None:
    raise IndexError(
        f"{spec.name}: index {int(indices[position])} at batch position {position} is out of range "
        f"for {spec.row_count} rows"
    )


def forget_mapped(mapping: FileMapping | None, offset: int, size: int) -> None:
    """Drops this process's page-table entries for bytes [offset, offset + size) of a file
    mapping (MADV_DONTNEED: the pages stay in the page cache, unmapped, so the kernel can
    reclaim them without an rmap walk, and fadvise DONTNEED can drop them). A later read
    maps them again: it costs a fault, never data."""
    if mapping is not None and size > 0:
        mapping.advise(mmap.MADV_DONTNEED, offset, size)


def u64(array: np.ndarray):
    """A cffi pointer to a C-contiguous uint64 array; it keeps the array alive while it lives."""
    return ffi.from_buffer("uint64_t[]", array)


_OK = int(Status.OK)


def check_gather(status: int, failure, path: str, what, out_of_range) -> None:
    """A native gather's status as an exception: its own cases here (an index out of range,
    a chunk that fails to decompress), any other through _native.check. `what(position)` names
    the row or range at the failing batch position; `out_of_range(position)` gives an
    IndexError's message (or None: out of range is then a corrupted layout)."""
    if status == Status.OK:
        return
    position = int(failure.position)
    if status == Status.INDEX_OUT_OF_RANGE and out_of_range is not None:
        raise IndexError(f"{path}: {out_of_range(position)}")
    if status == Status.DECOMPRESS_FAILED:
        raise StorageError(f"{path}: {what(position)} failed to decompress (libblosc2 error {int(failure.code)}); "
                           f"the file is corrupted")
    check(status, f"{path}: gather of {what(position)} failed", StorageError)


def check_range_status(spec: FieldSpec, status: int, starts, counts, failure) -> None:
    if status == _OK:
        return  # Before the messages' closures are made: this runs once per field and batch.
    check_gather(status, failure, spec.name,
                 lambda k: f"the chunk holding element {int(starts[k])}",
                 lambda k: f"elements [{int(starts[k])}, {int(starts[k]) + int(counts[k])}) are out of range for "
                           f"{spec.row_count} elements")


def check_row_status(spec: FieldSpec, status: int, indices, failure) -> None:
    if status == _OK:
        return  # As above.
    check_gather(status, failure, spec.name,
                 lambda k: f"chunk {int(indices[k]) // max(spec.chunk_rows, 1)} (holding row {int(indices[k])})",
                 lambda k: f"index {int(indices[k])} at batch position {k} is out of range for {spec.row_count} rows")


def blosc_layout(getitem, context, addresses: np.ndarray, sizes: np.ndarray, row_count: int, chunk_rows: int,
                 block_rows: int, row_bytes: int, batch_size_max: int, digests: np.ndarray | None = None,
                 checked: np.ndarray | None = None):
    """The native gather's view of chunked Blosc2 rows (shm_blosc_layout), built in one
    place for one file (BloscField) and for many joined (CombinedBlosc). Returns the
    struct and what its raw pointers point to, which the caller keeps alive with it.
    `digests` (uint32, one row of part digests per chunk: BloscField.block_digests) makes
    the gather check each part of a chunk before it first decompresses it; `checked`: the
    bits that say which parts matched, shared by the loader's readers (checked_blocks.py),
    or None for bits of this process's own."""
    block_bytes = block_rows * row_bytes if block_rows > 1 else 0
    block_buffer = np.empty(max(block_bytes, 1), dtype=np.uint8)
    order_count = batch_size_max if block_rows > 1 else 0
    order_buffer = np.empty(max(2 * order_count, 1), dtype=np.uint64)
    layout = ffi.new("shm_blosc_layout *")
    layout.getitem, layout.context = getitem, context
    layout.chunk_addresses = ffi.from_buffer("uint64_t[]", addresses)
    layout.chunk_bytes = ffi.from_buffer("uint64_t[]", sizes)
    layout.chunk_count = len(addresses)
    layout.row_count = row_count
    layout.rows_per_chunk = chunk_rows
    layout.rows_per_block = max(block_rows, 1)
    layout.row_bytes = row_bytes
    layout.block_buffer = ffi.from_buffer("uint8_t[]", block_buffer)
    layout.block_buffer_bytes = block_bytes
    layout.order_buffer = ffi.from_buffer("uint64_t[]", order_buffer)
    layout.order_buffer_count = order_count
    if digests is None:
        checked = None
    else:
        assert digests.ndim == 2 and digests.shape[0] == len(addresses), "one row of part digests per chunk"
        digests = np.ascontiguousarray(digests, dtype=np.uint32)
        # One bit per part, set once it matched, then one per chunk (blocks stored in order).
        words = -(-(digests.size + digests.shape[0]) // 64)
        if checked is None:
            checked = np.zeros(words, dtype=np.uint64)
        assert checked.dtype == np.uint64 and checked.size == words, "the checked bits of this file's digests"
        layout.digests = ffi.from_buffer("uint32_t[]", digests)
        layout.digest_stride = digests.shape[1]
        layout.digests_checked = ffi.from_buffer("uint64_t[]", checked)
    keepalive = (addresses, sizes, block_buffer, order_buffer, layout.chunk_addresses, layout.chunk_bytes,
                 layout.block_buffer, layout.order_buffer, digests, checked, layout.digests, layout.digests_checked)
    return layout, keepalive


def check_unchanged(spec: FieldSpec, kept) -> None:
    """A watched field's file as it was described (spec.identity), by its kept descriptor:
    a write in place changes its modification time before its bytes (the kernel stamps the
    file first), so a fill followed by this check read only bytes of the described file.
    Natively (statx: one system call, no Python object); os.fstat names what changed."""
    if kept is None or not spec.identity:
        return
    _, _, size, mtime_ns = spec.identity
    if lib.shm_file_unchanged(kept.descriptor, size, mtime_ns) != 1:
        check_identity(spec, kept.status())


class NpyField:
    """A memory-mapped .npy field; gather is a native row copy."""

    remote = None  # The node cache's object, for a field read from a store (open_cached).
    unit_pages = 1  # What its fills fetch around a needed page (remote.cache.set_fetch_unit).

    def __init__(self, spec: FieldSpec, watch: bool = False) -> None:
        self.spec, self._kept = spec, None
        data_bytes = spec.row_count * spec.row_bytes
        def check(status: os.stat_result) -> None:
            check_identity(spec, status)
            if status.st_size < spec.data_offset + data_bytes:
                raise OSError("the file is shorter than the rows it was described with")

        try:
            # Mapped at the offset the trainer found: no header parsing per reader and file,
            # which matters for fields of thousands of shards. No descriptor stays open.
            self._mapping, self._kept = map_file(spec.path, check, keep=watch)
        except OSError as error:
            size = os.path.getsize(spec.path) if os.path.exists(spec.path) else "no"
            raise StorageError(
                f"{spec.name}: cannot map the .npy file ({error}); it has {size} bytes now, "
                f"{spec.row_count} rows of {spec.row_bytes} bytes were described (truncated or replaced?)"
            ) from None
        self._map = self._mapping.buffer
        self._array = np.frombuffer(self._map, dtype=np.uint8, count=data_bytes, offset=spec.data_offset)
        self._table = ffi.from_buffer("uint8_t[]", self._array)
        self._failure = ffi.new("shm_gather_error *")

    def gather(self, indices, out) -> None:
        """Writes rows `indices` (in order, duplicates allowed) into `out` (len(indices) * row_bytes)."""
        indices = check_indices(self.spec, indices)
        out_pointer = checked_out_pointer(self.spec, out, len(indices))
        self.gather_into(indices, ffi.from_buffer("uint64_t[]", indices), out_pointer, len(out_pointer))

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        """gather() for callers that checked their buffers once (the reader's slots)."""
        status = lib.shm_gather_rows(
            self._table, self.spec.row_count, self.spec.row_bytes,
            index_pointer, len(indices), out_pointer, out_bytes, self._failure,
        )
        check_row_status(self.spec, status, indices, self._failure)

    def gather_ranges(self, starts: np.ndarray, counts: np.ndarray, destinations: np.ndarray, out_pointer,
                      out_bytes: int) -> None:
        """Copies element ranges of a 1-D field to byte offsets of `out` (uint64 arrays)."""
        status = lib.shm_gather_ranges_raw(
            self._table, self.spec.row_count, self.spec.row_bytes, u64(starts), u64(counts), u64(destinations),
            len(starts), out_pointer, out_bytes, self._failure,
        )
        check_range_status(self.spec, status, starts, counts, self._failure)

    def extents(self, starts: np.ndarray, counts: np.ndarray, wait: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(file offsets, bytes) under element ranges (starts, counts)."""
        row_bytes = self.spec.row_bytes
        return self.spec.data_offset + starts.astype(np.int64) * row_bytes, counts.astype(np.int64) * row_bytes

    def byte_ranges(self, first_row: int, row_count: int) -> list[tuple[int, int]]:
        """(file offset, bytes) holding rows [first_row, first_row + row_count)."""
        first_row = min(first_row, self.spec.row_count)
        row_count = min(row_count, self.spec.row_count - first_row)
        return [(self.spec.data_offset + first_row * self.spec.row_bytes, row_count * self.spec.row_bytes)]

    def forget(self, offset: int, size: int) -> None:
        forget_mapped(self._mapping, offset, size)

    def check_unchanged(self) -> None:
        """Raises StorageError when the file was written since it was described (watch=True)."""
        check_unchanged(self.spec, self._kept)

    def close(self) -> None:
        # The mapping goes with the last object that refers to it (a pointer still in use
        # keeps it): dropping this field's references is all closing takes.
        self._table = self._array = self._map = self._mapping = None
        if self._kept is not None:
            self._kept.close()


class EmptyRowsField:
    """Rows of zero bytes (shape (N, 0)), or no rows at all (the values of a ragged field whose
    records are all empty): nothing to read, but indices and ranges are still checked."""

    remote = None  # The node cache's object, for a field read from a store (open_cached).
    unit_pages = 1  # What its fills fetch around a needed page (remote.cache.set_fetch_unit).

    def __init__(self, spec: FieldSpec) -> None:
        self.spec = spec

    def gather(self, indices, out) -> None:
        indices = check_indices(self.spec, indices)
        self.gather_into(indices, None, checked_out_pointer(self.spec, out, len(indices)), 0)

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        bad = np.flatnonzero(indices >= self.spec.row_count)
        if bad.size:
            raise_index_error(self.spec, indices, int(bad[0]))

    def gather_ranges(self, starts, counts, destinations, out_pointer, out_bytes: int) -> None:
        ends = np.asarray(starts, dtype=np.uint64) + np.asarray(counts, dtype=np.uint64)
        bad = np.flatnonzero(ends > self.spec.row_count)
        if bad.size:
            k = int(bad[0])
            raise StorageError(f"{self.spec.name}: elements [{int(starts[k])}, {int(ends[k])}) are out of range for "
                               f"{self.spec.row_count} elements")

    def check_unchanged(self) -> None:
        """Nothing is read from the file."""

    def close(self) -> None:
        pass



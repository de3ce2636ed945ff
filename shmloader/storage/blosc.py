"""Gathering rows of Blosc2 .b2nd fields (the readers' side): one frame's chunks mapped and
decompressed by the Zig gather, and several frames at once. Layouts the gather cannot read
(rows split across chunks, DELTA, ZSTD dictionaries) are blosc_python.py's."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np

from .. import _blosc2_capi
from .._filemap import map_file
from .._native import Status, ffi, lib
from ..errors import StorageError
from . import checked_blocks
from .rows import (
    blosc_layout,
    check_gather,
    check_indices,
    check_range_status,
    check_row_status,
    check_unchanged,
    checked_out_pointer,
    forget_mapped,
    u64,
)
from .spec import (
    B2FRAME_HEADER_LENGTH_OFFSET,
    BLOCK_DIGESTS_META,
    CHECKSUM_META,
    CHUNK_CBYTES_OFFSET,
    CHUNK_HEADER_BYTES,
    FieldSpec,
    check_identity,
)

_WHOLE_CHUNK = "whole chunk"  # BloscField._block_table: read the chunk whole.


class BloscField:
    """A contiguous Blosc2 frame, mapped into memory; rows are decompressed natively.

    Chunk addresses are computed once from the frame's offset index, one decompression
    context is reused, and only the blocks holding the requested rows are decompressed,
    straight into `out` (one-row blocks) or through one block buffer (larger blocks, where
    rows sharing a block cost one decompression per batch).
    """

    remote = None  # The node cache's object, for a field read from a store (open_cached).
    unit_pages = 1  # What its fills fetch around a needed page (remote.cache.set_fetch_unit).

    def __init__(self, spec: FieldSpec, batch_size_max: int = 1 << 16, share_blocks: bool = True,
                 verify: bool = False, watch: bool = False) -> None:
        """`share_blocks=False` decompresses a multi-row block once per row (for measurements).
        `verify=True` checks what a gather reads against the file's checksums the first time
        it reads it: each block and its chunk's head against their digests, natively,
        where the file carries them (BLOCK_DIGESTS_META); else each whole chunk's CRC-32 at
        its first row; files without checksums load unchecked."""
        if not spec.row_contiguous:
            raise StorageError(f"{spec.name}: layout {spec.chunks}/{spec.blocks} is not row-contiguous")
        self.spec = spec
        self._block_rows = spec.block_rows if share_blocks else 1
        self._chunk_blocks = -(-spec.chunk_rows // max(spec.block_rows, 1))  # Blocks per chunk (at most).
        self._capi_ffi, self._capi = _blosc2_capi.load()
        self._schunk = None
        self._context = self._kept = None
        self._special_by_index = {}  # Chunks Blosc2 builds in memory (all zeros, etc.).
        self._mapping, self._kept = map_file(spec.path, lambda status: check_identity(spec, status), keep=watch)
        self._map = self._mapping.buffer
        self._checksums = None  # Expected CRC-32 per chunk, until every chunk is verified.
        # Each chunk's part digests (head, then blocks), which the native gather checks.
        self.block_digests = None
        try:
            self._locate_chunks()
            if verify and spec.block_digests:
                self.block_digests = self._load_block_digests()
            self._create_context(batch_size_max)
            if verify and spec.checksums and self.block_digests is None:
                self._load_checksums()
        except BaseException:
            self.close()
            raise

    def _locate_chunks(self) -> None:
        spec, capi, capi_ffi = self.spec, self._capi, self._capi_ffi
        file_bytes = len(self._map)
        (header_bytes,) = struct.unpack_from(">i", self._map, B2FRAME_HEADER_LENGTH_OFFSET)
        if not 0 < header_bytes < file_bytes:
            raise StorageError(f"{spec.name}: corrupted frame header (header length {header_bytes}, file {file_bytes} bytes)")
        schunk = capi.blosc2_schunk_open(spec.path.encode())
        if schunk == capi_ffi.NULL:
            raise StorageError(f"{spec.name}: libblosc2 cannot open the frame (corrupted or truncated file)")
        self._schunk = schunk  # Only a real handle: close() must never free NULL.
        # libblosc2 opened the path again: it must still be the file mapped above, or its
        # offset table would not have the description's chunk count read below.
        check_identity(spec, os.stat(spec.path))
        offsets_pointer = capi.blosc2_frame_get_offsets(self._schunk)
        if offsets_pointer == capi_ffi.NULL:
            raise StorageError(f"{spec.name}: cannot read the frame's chunk offsets (corrupted or truncated file)")
        try:
            offsets = np.frombuffer(capi_ffi.buffer(offsets_pointer, 8 * spec.chunk_count), dtype=np.int64).copy()
        finally:
            capi.free(offsets_pointer)
        base_address = int(ffi.cast("uintptr_t", ffi.from_buffer("uint8_t[]", self._map)))
        self._addresses = np.zeros(spec.chunk_count, dtype=np.uint64)
        self._sizes = np.zeros(spec.chunk_count, dtype=np.uint64)
        in_file = np.flatnonzero(offsets >= 0)
        starts = header_bytes + offsets[in_file]
        if spec.remote and in_file.size:
            # A cached object's chunks are fetched as they are read: their headers cannot be
            # read here. Stored one after another, a chunk reaches to the next one's start
            # (the data's end for the last): a bound the gather accepts (libblosc2 reads each
            # chunk's own length from its header), and the range its pin fetches.
            data_end = min(header_bytes + spec.compressed_bytes, file_bytes)
            if np.any(np.diff(starts) <= 0) or int(starts[-1]) + CHUNK_HEADER_BYTES > data_end:
                raise StorageError(f"{spec.remote}: its chunks are not stored in order, one after another; re-save "
                                   f"it with `shmloader convert` before uploading it")
            self._addresses[in_file] = base_address + starts
            self._sizes[in_file] = np.diff(np.append(starts, data_end))
        elif in_file.size:
            past_end = np.flatnonzero(starts + CHUNK_HEADER_BYTES > file_bytes)
            if past_end.size:
                raise StorageError(f"{spec.name}: chunk {int(in_file[past_end[0]])} starts past the end of the file (truncated?)")
            raw = np.frombuffer(self._map, dtype=np.uint8)
            size_bytes = raw[(starts[:, None] + CHUNK_CBYTES_OFFSET + np.arange(4)).ravel()]
            sizes = size_bytes.view("<i4").astype(np.int64)
            del raw, size_bytes
            bad = np.flatnonzero((sizes < CHUNK_HEADER_BYTES) | (starts + sizes > file_bytes))
            if bad.size:
                chunk = int(in_file[bad[0]])
                raise StorageError(
                    f"{spec.name}: chunk {chunk} is corrupted or truncated: it claims {int(sizes[bad[0]])} "
                    f"bytes at offset {int(starts[bad[0]])} of a {file_bytes}-byte file"
                )
            self._addresses[in_file] = base_address + starts
            self._sizes[in_file] = sizes
        self._file_offsets = np.full(spec.chunk_count, -1, dtype=np.int64)
        self._file_offsets[in_file] = starts
        # Per chunk, the stored bytes from where it starts (or the next stored chunk, for
        # one Blosc2 builds in memory) and to where it ends (or the previous one's end):
        # the file range under any run of chunks (extents()).
        ends = np.zeros(spec.chunk_count, dtype=np.int64)
        ends[in_file] = starts + self._sizes[in_file].astype(np.int64)
        self._chunk_high = np.maximum.accumulate(np.maximum(ends, header_bytes)) if spec.chunk_count else ends
        low = np.full(spec.chunk_count, file_bytes, dtype=np.int64)
        low[in_file] = starts
        self._chunk_low = np.minimum.accumulate(low[::-1])[::-1]
        for chunk in np.flatnonzero(offsets < 0):
            self._load_special_chunk(int(chunk))

    def _load_special_chunk(self, chunk: int) -> None:
        capi, capi_ffi = self._capi, self._capi_ffi
        chunk_pointer = capi_ffi.new("uint8_t **")
        needs_free = capi_ffi.new("bool *")
        chunk_bytes = capi.blosc2_schunk_get_chunk(self._schunk, chunk, chunk_pointer, needs_free)
        if chunk_bytes < CHUNK_HEADER_BYTES:
            raise StorageError(f"{self.spec.name}: chunk {chunk} is unreadable (libblosc2 error {chunk_bytes})")
        copy = np.frombuffer(capi_ffi.buffer(chunk_pointer[0], chunk_bytes), dtype=np.uint8).copy()
        if needs_free[0]:
            capi.free(chunk_pointer[0])
        self._special_by_index[chunk] = copy
        self._addresses[chunk] = int(ffi.cast("uintptr_t", ffi.from_buffer("uint8_t[]", copy)))
        self._sizes[chunk] = chunk_bytes

    def _create_context(self, batch_size_max: int) -> None:
        spec, capi, capi_ffi = self.spec, self._capi, self._capi_ffi
        dparams = capi_ffi.new("blosc2_dparams *")
        dparams.nthreads = 1  # One reader process is one core; parallelism comes from readers.
        dparams.typesize = 8
        context = capi.blosc2_create_dctx(dparams[0])
        if context == capi_ffi.NULL:
            raise StorageError(f"{spec.name}: libblosc2 could not create a decompression context")
        self._context = context
        self._getitem = capi_ffi.cast("void *", capi_ffi.addressof(capi, "blosc2_getitem_ctx"))
        self._layout, self._layout_keepalive = blosc_layout(
            ffi.cast("void *", int(capi_ffi.cast("uintptr_t", self._getitem))),
            ffi.cast("void *", int(capi_ffi.cast("uintptr_t", self._context))),
            self._addresses, self._sizes, spec.row_count, spec.chunk_rows, self._block_rows, spec.row_bytes,
            batch_size_max, self.block_digests,  # With the loader's record of its checked blocks, where it has one.
            None if self.block_digests is None else checked_blocks.shared_bits(self.spec, *self.block_digests.shape))
        self._failure = ffi.new("shm_gather_error *")

    def gather(self, indices, out) -> None:
        """Writes rows `indices` (in order, duplicates allowed) into `out` (len(indices) * row_bytes)."""
        indices = check_indices(self.spec, indices)
        capacity = self._layout.order_buffer_count
        if len(indices) > capacity and self._block_rows > 1:
            raise ValueError(f"{self.spec.name}: a batch of {len(indices)} rows exceeds this reader's {capacity}")
        out_pointer = checked_out_pointer(self.spec, out, len(indices))
        self.gather_into(indices, ffi.from_buffer("uint64_t[]", indices), out_pointer, len(out_pointer))

    def _metadata(self, key: str) -> bytes:
        """The bytes a converter stored under vlmeta `key`."""
        capi, capi_ffi = self._capi, self._capi_ffi
        content, length = capi_ffi.new("uint8_t **"), capi_ffi.new("int32_t *")
        if capi.blosc2_vlmeta_get(self._schunk, key.encode(), content, length) < 0:
            raise StorageError(f"{self.spec.name}: its checksums ({key}) cannot be read")
        try:
            packed = bytes(capi_ffi.buffer(content[0], length[0]))
        finally:
            capi.free(content[0])
        return msgpack_binary(packed, self.spec.name)

    def _load_block_digests(self) -> np.ndarray:
        payload, chunks = self._metadata(BLOCK_DIGESTS_META), self.spec.chunk_count
        if not chunks or len(payload) % (4 * chunks) or len(payload) < 4 * chunks:
            raise StorageError(f"{self.spec.name}: its {BLOCK_DIGESTS_META} metadata holds {len(payload)} bytes, not "
                               f"a row of 4-byte digests for each of its {chunks} chunks (corrupted metadata)")
        return np.frombuffer(payload, dtype="<u4").reshape(chunks, -1)

    def _load_checksums(self) -> None:
        payload = self._metadata(CHECKSUM_META)
        if len(payload) % 4:
            raise StorageError(f"{self.spec.name}: its {CHECKSUM_META} metadata holds {len(payload)} bytes, not a whole "
                               f"number of 4-byte CRC-32s (corrupted metadata)")
        checksums = np.frombuffer(payload, dtype="<u4")
        if checksums.size != self.spec.chunk_count:
            raise StorageError(
                f"{self.spec.name}: {checksums.size} chunk checksums for {self.spec.chunk_count} chunks (corrupted metadata)"
            )
        self._checksums = checksums
        self._verified = np.zeros(self.spec.chunk_count, dtype=bool)
        self._unverified_count = self.spec.chunk_count

    def raise_mismatch(self, digest_index: int) -> None:
        """Raises the StorageError for the native gather's .checksum_mismatch: which chunk,
        and which of its parts (GatherError.code: chunk * digest stride + part)."""
        chunk, part = divmod(digest_index, self.block_digests.shape[1])
        where = "its header and block table" if part == 0 else f"its block {part - 1}"
        raise StorageError(
            f"{self.spec.name}: chunk {chunk} fails its checksum ({where}, as stored, does not match the digest the "
            f"file records): the file is corrupted. `shmloader verify "
            f"{'LOCAL_COPY' if self.spec.remote else self.spec.path}` lists every bad chunk."
        )

    def _verify_chunks(self, indices: np.ndarray) -> None:
        """Checks the CRC-32 of every chunk these rows touch that this reader has not checked yet."""
        chunks = np.unique(indices // self.spec.chunk_rows)
        chunks = chunks[chunks < self.spec.chunk_count]  # Bad indices are the gather's to report.
        for chunk in chunks[~self._verified[chunks]].tolist():
            found = zlib.crc32(self.chunk_bytes(chunk))
            expected = int(self._checksums[chunk])
            if found != expected:
                raise StorageError(
                    f"{self.spec.name}: chunk {chunk} fails its checksum (stored CRC-32 {expected:#010x}, read "
                    f"{found:#010x}): the file is corrupted. `shmloader verify "
                    f"{'LOCAL_COPY' if self.spec.remote else self.spec.path}` lists every bad chunk."
                )
            self._verified[chunk] = True
            self._unverified_count -= 1
        if self._unverified_count == 0:
            self._checksums = None  # Every chunk checked once: gathers skip this from now on.

    def gather_ranges(self, starts: np.ndarray, counts: np.ndarray, destinations: np.ndarray, out_pointer,
                      out_bytes: int) -> None:
        """Decompresses element ranges of a 1-D field to byte offsets of `out` (uint64
        arrays), touching only the blocks that hold them."""
        if self._checksums is not None and len(starts):
            first = starts.astype(np.int64)
            last = np.maximum(first + counts.astype(np.int64), first + 1) - 1
            first_chunk, last_chunk = first // self.spec.chunk_rows, last // self.spec.chunk_rows
            spans = last_chunk - first_chunk + 1
            chunks = np.repeat(first_chunk, spans) + (np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans))
            self._verify_chunks(chunks.astype(np.uint64) * np.uint64(self.spec.chunk_rows))
        status = lib.shm_gather_ranges_blosc(
            self._layout, u64(starts), u64(counts), u64(destinations), len(starts), out_pointer, out_bytes,
            self._failure,
        )
        if status == Status.CHECKSUM_MISMATCH:
            self.raise_mismatch(int(self._failure.code))
        check_range_status(self.spec, status, starts, counts, self._failure)

    def byte_ranges(self, first_row: int, row_count: int) -> list[tuple[int, int]]:
        """(file offset, bytes) of the stored chunks holding rows [first_row, first_row +
        row_count), one range (chunks are stored in order, one after another)."""
        rows = self.spec.chunk_rows
        first = min(first_row // rows, self.spec.chunk_count)
        last = min((first_row + max(row_count, 1) - 1) // rows, self.spec.chunk_count - 1)
        offsets = self._file_offsets[first:last + 1]
        stored = offsets >= 0  # Chunks Blosc2 builds in memory are not in the file.
        if not stored.any():
            return []
        starts, ends = offsets[stored], offsets[stored] + self._sizes[first:last + 1][stored].astype(np.int64)
        return [(int(starts.min()), int(ends.max() - starts.min()))]

    def forget(self, offset: int, size: int) -> None:
        forget_mapped(self._mapping, offset, size)

    def chunk_bytes(self, chunk: int):
        """The bytes of a chunk as stored (a view of the mapped file, or Blosc2's built copy)."""
        offset = int(self._file_offsets[chunk])
        if offset < 0:
            return self._special_by_index[chunk]
        size = int(self._sizes[chunk])
        if self.spec.remote:  # Its size was a bound (see _locate_chunks); its header, pinned now, knows.
            (size,) = struct.unpack_from("<i", self._map, offset + CHUNK_CBYTES_OFFSET)
        return memoryview(self._map)[offset: offset + size]

    def extents(self, starts: np.ndarray, counts: np.ndarray, wait: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(file offsets, bytes) under element ranges (starts, counts): their whole chunks;
        for a range inside one chunk of a cached object, only the chunk's header and block
        table and the blocks holding it (a row read at random costs its block, not its
        chunk). The headers are pinned first to be read; with `wait` False (the
        read-ahead's call), a chunk whose header is not here yet gives its header alone."""
        starts, counts = starts.astype(np.int64), counts.astype(np.int64)
        last_chunk = self.spec.chunk_count - 1
        first = np.minimum(starts // self.spec.chunk_rows, last_chunk)
        last = np.minimum((starts + np.maximum(counts, 1) - 1) // self.spec.chunk_rows, last_chunk)
        low, high = self._chunk_low[first], self._chunk_high[last]
        sizes = np.where(counts > 0, np.maximum(high - low, 0), 0)
        if self.remote is None or self._checksums is not None or self.unit_pages > 1:
            return low, sizes  # Checksums cover whole chunks; a fetch unit of many pages takes them anyway.
        inside = np.flatnonzero((first == last) & (counts > 0) & (self._file_offsets[first] >= 0))
        if not len(inside):
            return low, sizes
        chunks = np.unique(first[inside])
        tables = (self._file_offsets[chunks], np.minimum(CHUNK_HEADER_BYTES + 4 * self._chunk_blocks,
                                                          self._sizes[chunks].astype(np.int64)))
        if wait:
            self.remote.pin(*tables)
            ready = np.ones(len(chunks), dtype=bool)
        else:
            ready = self.remote.present(*tables)
        blocks = {int(chunk): self._block_table(int(chunk)) for chunk in chunks[ready]}
        row_bytes, chunk_rows = self.spec.row_bytes, self.spec.chunk_rows
        more_offsets, more_sizes = [tables[0]], [tables[1]]
        for k in inside.tolist():
            table = blocks.get(int(first[k]))
            if table is None:  # Its header is not here yet (read-ahead only): the header alone.
                low[k], sizes[k] = tables[0][chunks == first[k]][0], tables[1][chunks == first[k]][0]
            elif table is not _WHOLE_CHUNK:
                chunk_start, block_bytes, block_starts, block_ends = table
                inner = int(starts[k] % chunk_rows) * row_bytes
                first_block = inner // block_bytes
                last_block = (inner + int(counts[k]) * row_bytes - 1) // block_bytes
                low[k] = chunk_start + block_starts[first_block]
                sizes[k] = block_ends[first_block] - block_starts[first_block]
                if last_block > first_block:  # Blocks may be stored in any order (threads compress them).
                    more_offsets.append(chunk_start + block_starts[first_block + 1:last_block + 1])
                    more_sizes.append(block_ends[first_block + 1:last_block + 1] -
                                      block_starts[first_block + 1:last_block + 1])
        return np.concatenate([*more_offsets, low]), np.concatenate([*more_sizes, sizes])

    def _block_table(self, chunk: int):
        """(chunk start, uncompressed block bytes, each block's start and end in the chunk)
        from a chunk's header (pinned), or _WHOLE_CHUNK where its blocks cannot be told apart
        (a dictionary, a special value, blocks not stored in order)."""
        offset = int(self._file_offsets[chunk])
        header = bytes(memoryview(self._map)[offset: offset + CHUNK_HEADER_BYTES])
        flags, flags2 = header[2], header[31]
        uncompressed, block_bytes, stored = struct.unpack_from("<iii", header, 4)
        if block_bytes <= 0 or uncompressed <= 0 or flags2 & 0x1 or (flags2 >> 4) & 0x7:
            return _WHOLE_CHUNK  # BLOSC2_USEDICT, or a special chunk (zeros, NaNs, a value).
        count = -(-uncompressed // block_bytes)
        if flags & 0x2:  # BLOSC_MEMCPYED: the blocks as they are, after the header.
            block_starts = CHUNK_HEADER_BYTES + np.arange(count, dtype=np.int64) * block_bytes
        else:
            if count > self._chunk_blocks or CHUNK_HEADER_BYTES + 4 * count > stored:
                return _WHOLE_CHUNK
            block_starts = np.frombuffer(self._map, dtype="<i4", count=count,
                                         offset=offset + CHUNK_HEADER_BYTES).astype(np.int64)
        # A block ends where the next stored one starts: blocks compressed by several threads
        # are stored in the order they finished.
        order = np.argsort(block_starts, kind="stable")
        stored_order = block_starts[order]
        if np.any(np.diff(stored_order) <= 0) or stored_order[0] < CHUNK_HEADER_BYTES or stored_order[-1] >= stored:
            return _WHOLE_CHUNK
        block_ends = np.empty_like(block_starts)
        block_ends[order] = np.append(stored_order[1:], stored)
        return offset, block_bytes, block_starts, block_ends

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        """gather() for callers that checked their buffers once (the reader's slots)."""
        if self._checksums is not None:
            self._verify_chunks(indices)
        status = lib.shm_gather_blosc(self._layout, index_pointer, len(indices), out_pointer, out_bytes, self._failure)
        if status == Status.CHECKSUM_MISMATCH:
            self.raise_mismatch(int(self._failure.code))
        check_row_status(self.spec, status, indices, self._failure)

    def close(self) -> None:
        if self._context is not None:
            self._capi.blosc2_free_ctx(self._context)
            self._context = None
        if self._schunk is not None:
            self._capi.blosc2_schunk_free(self._schunk)
            self._schunk = None
        self._layout = self._layout_keepalive = None
        self._special_by_index = {}
        self._map = self._mapping = None  # Unmapped with the last pointer into it.
        if self._kept is not None:
            self._kept.close()

    def check_unchanged(self) -> None:
        """Raises StorageError when the file was written since it was described (watch=True)."""
        check_unchanged(self.spec, self._kept)


class CombinedBlosc:
    """Many row-friendly .b2nd files of one layout read as one: their chunk tables joined,
    so that a batch spread over hundreds of shards is one native gather. A file's row r
    is "virtual" row (its first chunk + r // chunk_rows) * chunk_rows + r % chunk_rows:
    Blosc2 stores every chunk at full size, so chunk c holds virtual rows from c * chunk_rows.
    The parts stay open (their mappings and in-memory chunks back the joined table)."""

    def __init__(self, parts: list[BloscField], batch_size_max: int) -> None:
        first = parts[0]
        for part in parts[1:]:
            if (part.spec.chunk_rows, part._block_rows, part.spec.row_bytes) != \
                    (first.spec.chunk_rows, first._block_rows, first.spec.row_bytes):
                raise ValueError(f"{part.spec.name}: another chunk layout than {first.spec.name}")
        self.parts = parts
        self.chunk_rows = first.spec.chunk_rows
        self.chunk_starts = np.concatenate([[0], np.cumsum([part.spec.chunk_count for part in parts])[:-1]]).astype(np.uint64)
        addresses = np.concatenate([part._addresses for part in parts])
        sizes = np.concatenate([part._sizes for part in parts])
        digests = None  # The parts' digests, joined; the joined table checks each part once more, by its own bits.
        if any(part.block_digests is not None for part in parts):
            if any(part.block_digests is None or part.block_digests.shape[1] != first.block_digests.shape[1]
                   for part in parts):
                raise ValueError(f"{first.spec.name}: its files do not all carry block digests of one layout")
            digests = np.concatenate([part.block_digests for part in parts])
        self._layout, self._layout_keepalive = blosc_layout(
            first._layout.getitem, first._layout.context, addresses, sizes, len(addresses) * self.chunk_rows,
            self.chunk_rows, first._block_rows, first.spec.row_bytes, batch_size_max, digests)
        self._failure = ffi.new("shm_gather_error *")

    def virtual_rows(self, parts: np.ndarray, local: np.ndarray) -> np.ndarray:
        chunk_rows = np.uint64(self.chunk_rows)
        return (self.chunk_starts[parts] + local // chunk_rows) * chunk_rows + local % chunk_rows

    def gather_into(self, virtual_rows: np.ndarray, out_pointer, out_bytes: int) -> None:
        status = lib.shm_gather_blosc(self._layout, u64(virtual_rows), len(virtual_rows), out_pointer, out_bytes,
                                      self._failure)
        if status == Status.CHECKSUM_MISMATCH:  # A virtual chunk's digest index: its part file's own.
            chunk, part = divmod(int(self._failure.code), self.parts[0].block_digests.shape[1])
            owner = int(np.searchsorted(self.chunk_starts, chunk, side="right")) - 1
            self.parts[owner].raise_mismatch((chunk - int(self.chunk_starts[owner])) * self.parts[0].block_digests.shape[1]
                                             + part)
        if status != Status.OK:
            chunk = int(virtual_rows[int(self._failure.position)]) // self.chunk_rows
            part = int(np.searchsorted(self.chunk_starts, chunk, side="right")) - 1
            check_gather(status, self._failure, self.parts[part].spec.name,
                         lambda k: f"chunk {chunk - int(self.chunk_starts[part])}", None)


def msgpack_binary(packed: bytes, path: str) -> bytes:
    """The payload of a msgpack bin 8/16/32 value (how Blosc2 stores a bytes vlmeta)."""
    sizes = {0xC4: 1, 0xC5: 2, 0xC6: 4}
    width = sizes.get(packed[0]) if packed else None
    if width is None or len(packed) < 1 + width:
        raise StorageError(f"{path}: its {CHECKSUM_META} metadata is not msgpack binary data")
    length = int.from_bytes(packed[1:1 + width], "big")
    payload = packed[1 + width: 1 + width + length]
    if len(payload) != length:
        raise StorageError(f"{path}: its {CHECKSUM_META} metadata is truncated")
    return payload



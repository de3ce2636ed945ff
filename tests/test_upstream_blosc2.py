"""Faults of libblosc2 that shmloader works around, each kept as its minimal reproduction
(so that an upgrade that fixes or changes one shows here), and the loader's reads of the
same cases, which must be right whatever libblosc2 does.

getitem on a block-long range that starts inside a block (upstream, blosc/blosc2.c,
`_blosc_getitem`: `get_single_block = (startb == 0) && (bsize == nitems_bytes)` is true for
the range's *second* block when that block is exactly as long as the range, which is then
decompressed over the whole destination). A note for upstream: the condition also needs
the block to be the range's first (`start * typesize == j * blocksize`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import write_b2nd

from shmloader import Packed, Padded, ShmDataLoader, Windows
from shmloader.storage.ragged import (
    OFFSETS_NAME,
    VALUES_NAME,
    RaggedField,
    describe_ragged,
)

BLOCK_ELEMENTS = 1024
# python-blosc2 4.15.0 (and the libblosc2 it ships) reads these three ranges right: from it
# on they are plain tests of the fix, before it the faults are expected (strict: a release
# that fixes them shows).
_FIXED_IN = (4, 15)
_FIXED = tuple(int(part) for part in __import__("blosc2").__version__.split(".")[:2] if part.isdigit()) >= _FIXED_IN
CHUNK_ELEMENTS = 8 * BLOCK_ELEMENTS
# The reported case: records of 1,000 int32 elements, then one of exactly one block
# starting at element 3,000 (inside block 2), then more of 1,000.
LENGTHS = [1000, 1000, 1000, BLOCK_ELEMENTS, 1000, 1000]


def write_ragged_layout(path, records, *, block_elements=BLOCK_ELEMENTS, chunk_elements=CHUNK_ELEMENTS,
                        codec="LZ4"):
    """A ragged directory whose values have the given Blosc2 blocks and chunks (write_ragged
    chooses its own), written with Blosc2's API alone."""
    os.makedirs(path)
    values = np.concatenate(records) if records else np.zeros(0, np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(record) for record in records])]).astype(np.uint64)
    write_b2nd(os.path.join(path, VALUES_NAME), values, chunks=(chunk_elements,), blocks=(block_elements,),
               codec=codec)
    write_b2nd(os.path.join(path, OFFSETS_NAME), offsets)
    return str(path)


@pytest.mark.xfail(not _FIXED, strict=True, reason="libblosc2 getitem returns the next aligned block for a block-long range "
                                       "that starts inside a block; when this passes, upstream fixed it")
def test_upstream_getitem_reads_a_block_long_unaligned_range_right():
    import blosc2

    values = np.arange(CHUNK_ELEMENTS, dtype=np.int32)
    chunk = blosc2.SChunk(chunksize=values.nbytes, data=values,
                          cparams=blosc2.CParams(typesize=4, blocksize=BLOCK_ELEMENTS * 4))
    got = np.frombuffer(chunk.get_slice(3000, 3000 + BLOCK_ELEMENTS), dtype=np.int32)
    assert got[0] == 3000, f"got elements {got[0]}..{got[-1]}"


def test_upstream_getitem_is_right_one_element_shorter_or_longer():
    """The fault is exactly the block-long range: its neighbours read right (the reason
    the loader only splits that one case)."""
    import blosc2

    values = np.arange(CHUNK_ELEMENTS, dtype=np.int32)
    chunk = blosc2.SChunk(chunksize=values.nbytes, data=values,
                          cparams=blosc2.CParams(typesize=4, blocksize=BLOCK_ELEMENTS * 4))
    for count in (BLOCK_ELEMENTS - 1, BLOCK_ELEMENTS + 1):
        got = np.frombuffer(chunk.get_slice(3000, 3000 + count), dtype=np.int32)
        np.testing.assert_array_equal(got, values[3000:3000 + count])


@pytest.mark.parametrize("codec", ["LZ4", "ZSTD"])
def test_the_ragged_gather_reads_a_block_long_unaligned_record_right(tmp_path, codec):
    records = [np.arange(sum(LENGTHS[:k]), sum(LENGTHS[:k + 1]), dtype=np.int32) for k in range(len(LENGTHS))]
    path = write_ragged_layout(tmp_path / "docs.ragged", records, codec=codec)
    field = RaggedField(describe_ragged(path))
    try:
        for record in range(len(records)):
            starts, lengths = field.starts_and_lengths(np.array([record], dtype=np.uint64))
            out = np.full(int(lengths[0]), -1, dtype=np.int32)
            field.values.gather_ranges(starts, lengths, np.zeros(1, np.uint64), _pointer(out), out.nbytes)
            np.testing.assert_array_equal(out, records[record], err_msg=f"record {record}")
    finally:
        field.close()


@pytest.mark.xfail(not _FIXED, strict=True, reason="libblosc2 getitem returns a chunk's shorter last block for a range as long "
                                       "as it that starts inside the block before; when this passes, upstream fixed it")
def test_upstream_getitem_reads_a_range_as_long_as_the_last_block_right():
    """The same fault with a chunk's shorter last block. A .b2nd pads every chunk to whole
    blocks, so its files never have one; a plain SChunk frame does (the split in
    gather.zig covers both)."""
    import blosc2

    values = np.arange(3 * BLOCK_ELEMENTS + 500, dtype=np.int32)  # Blocks of 1,024, 1,024, 1,024 and 500.
    chunk = blosc2.SChunk(chunksize=values.nbytes, data=values,
                          cparams=blosc2.CParams(typesize=4, blocksize=BLOCK_ELEMENTS * 4))
    got = np.frombuffer(chunk.get_slice(3000, 3500), dtype=np.int32)
    assert got[0] == 3000, f"got elements {got[0]}..{got[-1]}"


@pytest.mark.parametrize("readers", [0, 2])
@pytest.mark.parametrize("declare", [
    lambda path: Packed(path),
    lambda path: Padded(path, max_length=BLOCK_ELEMENTS),
    lambda path: Padded(path, max_length=BLOCK_ELEMENTS, overflow="truncate"),
    lambda path: Padded(path, max_length=BLOCK_ELEMENTS, overflow="random"),
], ids=["packed", "padded", "padded-truncate", "padded-random"])
def test_every_ragged_layout_delivers_the_block_long_record(tmp_path, readers, declare):
    records = [np.arange(sum(LENGTHS[:k]), sum(LENGTHS[:k + 1]), dtype=np.int32) for k in range(len(LENGTHS))]
    path = write_ragged_layout(tmp_path / "docs.ragged", records)
    with ShmDataLoader({"docs": declare(path)}, batch_size=len(LENGTHS), mode="sequential", readers=readers,
                       slots=4) as loader:
        batch = next(loader)
        if "docs.offsets" in batch:
            offsets = batch["docs.offsets"]
            row = batch["docs"][offsets[3]:offsets[4]]
        else:
            row = batch["docs"][3][:batch["docs.lengths"][3]]
        np.testing.assert_array_equal(row, records[3])


@pytest.mark.parametrize("readers", [0, 2])
def test_windows_of_a_block_long_length_are_right(tmp_path, readers):
    """Windows(length=L) reads L + 1 elements per row from L * i: with L + 1 one block,
    every row but the first starts inside a block."""
    stream = np.arange(40 * BLOCK_ELEMENTS, dtype=np.uint16)
    path = write_b2nd(tmp_path / "stream.b2nd", stream, chunks=(CHUNK_ELEMENTS,), blocks=(BLOCK_ELEMENTS,))
    length = BLOCK_ELEMENTS - 1
    with ShmDataLoader({"tokens": Windows(path, length=length)}, batch_size=8, mode="sequential",
                       readers=readers, slots=4) as loader:
        for _ in range(4):
            batch = next(loader)
            for row, index in enumerate(batch.indices.tolist()):
                np.testing.assert_array_equal(batch["tokens"][row], stream[index * length:index * length + length + 1],
                                              err_msg=f"step {batch.step} row {row}")


def _pointer(array: np.ndarray):
    from shmloader._native import ffi

    return ffi.from_buffer("uint8_t[]", array.view(np.uint8))


@pytest.mark.xfail(not _FIXED, strict=True, reason="upstream: a range of a DELTA-filtered chunk that does not start at its "
                                       "first block decodes against the wrong reference block (python-blosc2 and "
                                       "libblosc2's getitem); whole chunks decode right. shmloader reads such "
                                       "files a chunk at a time (FieldSpec.whole_chunks).")
def test_upstream_a_delta_range_past_the_first_block_reads_right(tmp_path):
    import blosc2

    rows = np.cumsum(np.random.default_rng(7).integers(0, 5, size=(2000, 16)), axis=0).astype(np.int32)
    blosc2.asarray(rows, urlpath=str(tmp_path / "d.b2nd"), mode="w", chunks=(1000, 16), blocks=(100, 16),
                   cparams={"codec": blosc2.Codec.LZ4, "clevel": 5, "filters": [blosc2.Filter.DELTA],
                            "filters_meta": [0]})
    reopened = blosc2.open(str(tmp_path / "d.b2nd"), mode="r")
    assert np.array_equal(reopened.schunk.decompress_chunk(0), rows[:1000].tobytes())  # Whole: right.
    np.testing.assert_array_equal(reopened[100:200], rows[100:200])

"""Field readers gather exactly the rows numpy would, for every format, layout and dtype; bad
input gets an error naming the file."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from conftest import image_like, write_b2nd

from shmloader import StorageError, _blosc2_capi
from shmloader.storage.blosc import BloscField
from shmloader.storage.blosc_python import BloscPythonField
from shmloader.storage.opening import open_field
from shmloader.storage.spec import describe_field, row_contiguous_layout
from shmloader.tools.convert import convert

INDEX_CASES = {
    "random": lambda rows: np.random.default_rng(0).integers(0, rows, 300),
    "sorted": lambda rows: np.arange(0, rows, 3),
    "reversed-with-duplicates": lambda rows: np.array([rows - 1, 0, 0, rows - 1, 5, 5, 5, rows // 2]),
    "single": lambda rows: np.array([rows - 1]),
}


def make_array(dtype, row_shape, rows=517):
    data = image_like(rows, row_shape if row_shape else (1,), seed=3).astype(np.int64)
    if dtype == np.bool_:
        data = data % 2
    array = data.astype(dtype)
    return array.reshape(rows, *row_shape)


def gather(field, indices):
    spec = field.spec
    out = np.empty((len(indices), *spec.row_shape), dtype=spec.numpy_dtype)
    field.gather(np.asarray(indices, dtype=np.uint64), out)
    return out


FORMATS = ["npy", "b2nd-converted", "b2nd-default", "b2nd-small-chunks-partial"]


def write_format(tmp_path, array, kind):
    if kind == "npy":
        np.save(tmp_path / "a.npy", array)
        return str(tmp_path / "a.npy")
    if kind == "b2nd-converted":
        np.save(tmp_path / "in.npy", array)
        return str(convert(tmp_path / "in.npy", tmp_path / "a.b2nd", progress=False).path)
    if kind == "b2nd-default":
        return write_b2nd(tmp_path / "a.b2nd", array, codec="ZSTD")
    # 517 rows in chunks of 50 (last one partial), blocks of 7 (not dividing the chunk).
    return write_b2nd(tmp_path / "a.b2nd", array, chunks=(50, *array.shape[1:]), blocks=(7, *array.shape[1:]))


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float32, np.float64, np.bool_], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("row_shape", [(), (3072,), (3, 32, 32)], ids=["scalar", "3072", "3x32x32"])
def test_gather_equals_numpy(tmp_path, kind, dtype, row_shape):
    array = make_array(dtype, row_shape)
    path = write_format(tmp_path, array, kind)
    field = open_field(describe_field(path), batch_size_max=512)
    try:
        for name, make in INDEX_CASES.items():
            indices = make(len(array))
            assert np.array_equal(gather(field, indices), array[indices]), name
    finally:
        field.close()


def test_default_layout_of_large_rows_uses_the_native_path(tmp_path):
    # Blosc2 picks blocks of (1, 112, 224, 3) for such images: a row spans two blocks.
    array = image_like(60, (224, 224, 3), seed=2)
    path = write_b2nd(tmp_path / "big.b2nd", array, codec="LZ4")
    spec = describe_field(path)
    field = open_field(spec, batch_size_max=64)
    try:
        assert isinstance(field, BloscField) == spec.row_contiguous
        indices = [59, 0, 31, 31, 2]
        assert np.array_equal(gather(field, indices), array[indices])
    finally:
        field.close()


def test_layouts_that_split_rows_fall_back_to_python_and_stay_correct(tmp_path):
    array = image_like(40, (6, 10), seed=4)
    path = write_b2nd(tmp_path / "split.b2nd", array, chunks=(8, 3, 10), blocks=(4, 3, 5))
    spec = describe_field(path)
    assert not spec.row_contiguous
    field = open_field(spec)
    assert isinstance(field, BloscPythonField)
    assert np.array_equal(gather(field, [39, 0, 7, 7]), array[[39, 0, 7, 7]])


@pytest.mark.parametrize(
    "shape,chunks,blocks,expected",
    [
        ((100, 3072), (50, 3072), (1, 3072), True),
        ((100, 3072), (50, 3072), (40, 3072), True),
        ((100, 224, 224, 3), (50, 224, 224, 3), (1, 112, 224, 3), True),
        ((100, 224, 224, 3), (50, 224, 224, 3), (1, 1, 224, 3), True),
        ((100, 224, 224, 3), (50, 224, 224, 3), (1, 224, 112, 3), False),
        ((100, 224, 224, 3), (50, 224, 224, 3), (2, 112, 224, 3), False),
        ((100, 10, 7), (50, 10, 7), (1, 3, 7), False),
        ((100, 224, 224, 3), (50, 112, 224, 3), (1, 112, 224, 3), False),
    ],
)
def test_row_contiguity_rule(shape, chunks, blocks, expected):
    assert row_contiguous_layout(shape, chunks, blocks) is expected


def test_special_chunks_of_zeros(tmp_path):
    import blosc2

    array = blosc2.zeros((300, 16), dtype=np.float32, urlpath=str(tmp_path / "z.b2nd"), mode="w", chunks=(100, 16), blocks=(1, 16))
    array[100:200] = np.ones((100, 16), dtype=np.float32)
    field = open_field(describe_field(tmp_path / "z.b2nd"), 8)
    expected = np.zeros((300, 16), dtype=np.float32)
    expected[100:200] = 1
    try:
        assert np.array_equal(gather(field, [0, 150, 299, 100]), expected[[0, 150, 299, 100]])
    finally:
        field.close()


def test_out_may_be_raw_bytes_and_must_match(tmp_path):
    array = make_array(np.float32, (4,))
    field = open_field(describe_field(write_format(tmp_path, array, "b2nd-converted")), 8)
    raw = np.empty(3 * 16, dtype=np.uint8)
    field.gather(np.array([1, 2, 3], dtype=np.uint64), raw)
    assert np.array_equal(raw.view(np.float32).reshape(3, 4), array[[1, 2, 3]])
    with pytest.raises(ValueError, match=r"holds 32 bytes, expected 48"):
        field.gather(np.array([1, 2, 3], dtype=np.uint64), np.empty(32, dtype=np.uint8))
    with pytest.raises(TypeError, match="dtype int16"):
        field.gather(np.array([1], dtype=np.uint64), np.empty(8, dtype=np.int16))
    read_only = np.empty((3, 4), dtype=np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        field.gather(np.array([1, 2, 3], dtype=np.uint64), read_only)
    with pytest.raises(ValueError, match="read-only"):
        field.gather(np.array([1], dtype=np.uint64), bytes(16))
    field.close()


@pytest.mark.parametrize("kind", ["npy", "b2nd-converted", "b2nd-default"])
def test_index_out_of_range_names_index_and_rows(tmp_path, kind):
    array = make_array(np.uint8, (8,))
    field = open_field(describe_field(write_format(tmp_path, array, kind)), 8)
    with pytest.raises(IndexError, match=r"index 517 at batch position 1 is out of range for 517 rows"):
        gather(field, [0, 517])
    with pytest.raises(IndexError, match="negative"):
        field.gather(np.array([0, -1]), np.empty((2, 8), np.uint8))
    field.close()


def test_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.b2nd"):
        describe_field(tmp_path / "nope.b2nd")
    (tmp_path / "text.b2nd").write_text("hello, not a frame")
    with pytest.raises(StorageError, match=r"text\.b2nd is neither a \.npy file nor a Blosc2 frame"):
        describe_field(tmp_path / "text.b2nd")
    with pytest.raises(StorageError, match="directory"):
        describe_field(tmp_path)


@pytest.mark.parametrize(
    "array,words",
    [
        (np.array([{"a": 1}, None], dtype=object), "dtype object"),
        (np.zeros(3, dtype=[("a", np.int32), ("b", np.float32)]), "structured"),
        (np.zeros((0, 4), dtype=np.float32), "zero rows"),
        (np.float32(3.0), "0-d"),
    ],
    ids=["object", "structured", "zero-rows", "0-d"],
)
def test_unsupported_npy_arrays(tmp_path, array, words):
    np.save(tmp_path / "bad.npy", array, allow_pickle=True)
    with pytest.raises(StorageError, match=re.compile(f"bad.npy.*({words})", re.S)):
        describe_field(tmp_path / "bad.npy")


def test_npy_headers_are_read_as_numpy_reads_them(tmp_path):
    """describe_field matches np.save's plain headers itself (numpy's literal_eval was a third
    of describing many small files); every header must give what numpy's parser gives, and
    other headers (version 2.0, a dtype with a shape, an odd layout) go to numpy's parser."""
    import io
    import struct

    from shmloader.storage.spec import _simple_npy_header

    arrays = [np.zeros(5, np.int64), np.ones((3, 1), ">f8"), np.zeros((2, 0, 3), np.uint8),
              np.zeros((4, 7, 11, 2), np.bool_), np.zeros((1,), np.complex64), np.zeros((12345678, 0), "<u2"),
              np.asfortranarray(np.zeros((3, 4), np.float32)), np.zeros(6, "<M8[s]"), np.zeros(6, "<U3")]
    for number, array in enumerate(arrays):
        for version in ((1, 0), (2, 0), (3, 0)):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, array, version=version)
            buffer.seek(0)
            np.lib.format.read_magic(buffer)
            reader = {(1, 0): np.lib.format.read_array_header_1_0}.get(version, np.lib.format.read_array_header_2_0)
            expected = (*reader(buffer), buffer.tell())
            buffer.seek(0)
            found = _simple_npy_header(buffer)
            assert found == expected or (found is None and array.dtype.kind not in "biufc"), (number, version, found)
    for header in (b"{'descr': [('a', '<i4')], 'fortran_order': False, 'shape': (3,), }",
                   b"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'extra': 1, }"):
        padded = header + b" " * (63 - len(header) % 64) + b"\n"
        assert _simple_npy_header(io.BytesIO(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(padded)) + padded)) is None
    array = np.arange(24, dtype=">i4").reshape(6, 4)
    np.save(tmp_path / "big.npy", array)
    spec = describe_field(tmp_path / "big.npy")
    assert (spec.row_count, spec.row_shape, spec.dtype, spec.data_offset) == (6, (4,), ">i4", 128)
    assert spec.identity[1] == os.stat(tmp_path / "big.npy").st_ino


def test_truncated_npy(tmp_path):
    np.save(tmp_path / "t.npy", np.zeros((100, 10), np.float32))
    size = os.path.getsize(tmp_path / "t.npy")
    os.truncate(tmp_path / "t.npy", size - 100)
    with pytest.raises(StorageError, match=r"t\.npy: truncated"):
        describe_field(tmp_path / "t.npy")


def test_fortran_npy_is_refused_with_a_fix(tmp_path):
    np.save(tmp_path / "f.npy", np.asfortranarray(np.zeros((10, 3), np.float32)))
    with pytest.raises(StorageError, match="Fortran order.*ascontiguousarray"):
        describe_field(tmp_path / "f.npy")


def test_truncated_b2nd(tmp_path):
    array = make_array(np.uint8, (3072,))
    path = write_format(tmp_path, array, "b2nd-converted")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(StorageError, match=r"a\.b2nd"):
        field = open_field(describe_field(path), 8)
        gather(field, np.arange(len(array)))


def test_flipped_bytes_in_a_chunk_raise_an_error_naming_the_chunk(tmp_path):
    # Compressible rows: Blosc2 stores incompressible chunks verbatim, and a verbatim
    # chunk has no structure (nor checksum) left to notice flipped bytes with.
    array = ((np.arange(400)[:, None] + np.arange(512)[None, :] // 16) % 256).astype(np.uint8)
    path = write_b2nd(tmp_path / "c.b2nd", array, chunks=(100, 512), blocks=(10, 512), codec="LZ4")
    spec = describe_field(path)
    # Overwrite the compressed stream of chunk 2 (past its 32-byte header and block table).
    reader = open_field(spec, 8)
    offset_in_file = int(reader._addresses[2]) - int(reader._addresses[0]) + _chunk_zero_offset(reader)
    chunk_bytes = int(reader._sizes[2])
    reader.close()
    with open(path, "r+b") as handle:
        handle.seek(offset_in_file + 32 + 4 * 10)
        handle.write(b"\x5a" * (chunk_bytes - 32 - 4 * 10))
    field = open_field(describe_field(path), 8)
    with pytest.raises(StorageError, match=r"c\.b2nd: chunk 2 \(holding row 2\d\d\) failed to decompress"):
        gather(field, [250])
    # Other chunks still read fine.
    assert np.array_equal(gather(field, [5, 399]), array[[5, 399]])
    field.close()


def _chunk_zero_offset(field) -> int:
    """File offset of chunk 0: its mapped address minus the mapping's base address."""
    from shmloader._native import ffi

    base = int(ffi.cast("uintptr_t", ffi.from_buffer("uint8_t[]", field._map)))
    return int(field._addresses[0]) - base


def test_dparams_declaration_matches_the_installed_header():
    header = _blosc2_capi.blosc2_package_dir() / "include" / "blosc2.h"
    if not header.exists():
        pytest.skip("the blosc2 wheel ships no header")
    text = header.read_text()
    end = text.index("} blosc2_dparams;")
    start = text.rindex("typedef struct {", 0, end)
    body = re.sub(r"/\*.*?\*/", "", text[start + len("typedef struct {"):end], flags=re.S)
    body = re.sub(r"//[^\n]*", "", body)
    fields = re.findall(r"(\w+)\s*;", body)
    assert tuple(fields) == _blosc2_capi.DPARAMS_FIELDS

"""Every read path equals an independent reference over inputs no one picked by hand:
Hypothesis draws record lengths at and around block and chunk multiples, unaligned
starts, empty records, dtypes, codecs, layouts, modes and windows, and each gather is
compared with numpy's read of the same values (Blosc2's own full decompression, not the
partial reads the loader makes), each import with pyarrow's or tarfile's read. The order
is checked against what a shuffle must be (every row once per epoch, shards disjoint),
not against the sampler's own code.

Bounded for the suite (the "default" profile, about a minute on 2 cores); before a stop
run `pytest tests/test_reference.py tests/test_elastic.py --hypothesis-profile=long --timeout 0`
(tests/conftest.py).
"""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from conftest import examples, write_b2nd  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st

from shmloader import Packed, Padded, Sampler, ShmDataLoader, Windows  # noqa: E402
from shmloader._native import ffi  # noqa: E402
from shmloader.storage.opening import open_field
from shmloader.storage.ragged import (  # noqa: E402
    OFFSETS_NAME,
    VALUES_NAME,
    RaggedField,
    describe_ragged,
)
from shmloader.storage.spec import describe_field  # noqa: E402

DTYPES = [np.uint8, np.uint16, np.int32, np.float64]
CODECS = ["LZ4", "ZSTD", "BLOSCLZ", "NONE"]
BLOCK_ELEMENTS = [8, 16, 64, 256, 1024]


def _fresh(tmp_path_factory, name: str):
    """A new directory per drawn case: mkdtemp, since tmp_path_factory.mktemp scans every
    earlier one for the next number (quadratic over the long profile's thousands)."""
    import pathlib
    import tempfile

    return pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp_path_factory.getbasetemp()))


def _pointer(array: np.ndarray):
    return ffi.from_buffer("uint8_t[]", array.reshape(-1).view(np.uint8))


def _write(path, array: np.ndarray, chunks, blocks, codec: str) -> str:
    clevel = 0 if codec == "NONE" else 5
    return write_b2nd(path, array, chunks=chunks, blocks=blocks, codec="LZ4" if codec == "NONE" else codec,
                      clevel=clevel)


def _full_read(path: str) -> np.ndarray:
    """The reference: Blosc2 decompresses every chunk whole (no partial getitem)."""
    import blosc2

    return blosc2.open(path, mode="r")[...]


@st.composite
def record_lengths(draw, block: int):
    """Lengths near multiples of the block (k * block + d, d in -2..2), empty ones, and others."""
    near = st.builds(lambda k, d: max(0, k * block + d), st.integers(0, 3), st.integers(-2, 2))
    return draw(st.lists(st.one_of(near, st.integers(0, 3 * block)), min_size=1, max_size=40))


@st.composite
def ragged_layouts(draw):
    block = draw(st.sampled_from(BLOCK_ELEMENTS))
    return {
        "dtype": draw(st.sampled_from(DTYPES)),
        "block": block,
        "chunk": block * draw(st.sampled_from([1, 2, 3, 8])),
        "codec": draw(st.sampled_from(CODECS)),
        "lengths": draw(record_lengths(block)),
    }


def _write_ragged(directory, layout, seed: int):
    """A ragged directory with the drawn layout, written with Blosc2 alone, and its values."""
    rng = np.random.default_rng(seed)
    lengths = layout["lengths"]
    if sum(lengths) == 0:
        lengths[0] = 1  # A field of empty records only has no values file to write.
    total = sum(lengths)
    values = (rng.integers(0, 250, total) if np.dtype(layout["dtype"]).kind in "ui" else
              rng.standard_normal(total)).astype(layout["dtype"])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64)
    path = os.path.join(directory, "docs.ragged")
    os.makedirs(path, exist_ok=True)
    _write(os.path.join(path, VALUES_NAME), values, (layout["chunk"],), (layout["block"],), layout["codec"])
    write_b2nd(os.path.join(path, OFFSETS_NAME), offsets)
    reference = _full_read(os.path.join(path, VALUES_NAME))
    records = [reference[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:])]
    return path, records


@examples(200)
@given(layout=ragged_layouts(), picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=24),
       seed=st.integers(0, 2**16))
def test_ragged_ranges_equal_numpy_for_any_lengths_layout_and_codec(tmp_path_factory, layout, picks, seed):
    path, records = _write_ragged(_fresh(tmp_path_factory, "ragged"), layout, seed)
    indices = np.array([pick % len(records) for pick in picks], dtype=np.uint64)
    field = RaggedField(describe_ragged(path))
    try:
        starts, lengths = field.starts_and_lengths(indices)
        itemsize = np.dtype(layout["dtype"]).itemsize
        destinations = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64) * np.uint64(itemsize)
        out = np.full(max(1, int(lengths.sum())), 77, dtype=layout["dtype"])
        field.values.gather_ranges(starts, lengths, destinations, _pointer(out), out.nbytes)
    finally:
        field.close()
    expected = np.concatenate([records[int(i)] for i in indices]) if int(lengths.sum()) else out[:0]
    np.testing.assert_array_equal(out[:int(lengths.sum())], expected)


@examples(60)
@given(layout=ragged_layouts(), seed=st.integers(0, 2**16), batch_size=st.integers(1, 9),
       mode=st.sampled_from(["sequential", "random", "shuffle"]),
       declaration=st.sampled_from(["packed", "padded", "truncate", "random"]), max_length=st.integers(1, 2048))
def test_packed_and_padded_batches_equal_numpy(tmp_path_factory, layout, seed, batch_size, mode, declaration,
                                               max_length):
    path, records = _write_ragged(_fresh(tmp_path_factory, "ragged"), layout, seed)
    longest = max(len(record) for record in records)
    declare = {"packed": lambda: Packed(path),
               "padded": lambda: Padded(path, max_length=max(longest, 1)),
               "truncate": lambda: Padded(path, max_length=max_length, overflow="truncate"),
               "random": lambda: Padded(path, max_length=max_length, overflow="random")}[declaration]
    with ShmDataLoader({"docs": declare()}, batch_size=batch_size, mode=mode, seed=seed, readers=0,
                       slots=3) as loader:
        for _ in range(3):
            batch = next(loader)
            for row, index in enumerate(batch.indices.tolist()):
                record = records[index]
                if declaration == "packed":
                    offsets = batch["docs.offsets"]
                    np.testing.assert_array_equal(batch["docs"][offsets[row]:offsets[row + 1]], record)
                    continue
                kept = int(batch["docs.lengths"][row])
                assert kept == min(len(record), batch["docs"].shape[1])
                got = batch["docs"][row]
                assert not got[kept:].any()  # The padding.
                if declaration == "random":  # A window of the record at a start the loader chose.
                    windows = [record[start:start + kept] for start in range(len(record) - kept + 1)]
                    assert any(np.array_equal(got[:kept], window) for window in windows), (index, row)
                else:
                    np.testing.assert_array_equal(got[:kept], record[:kept])


@examples(80)
@given(block=st.sampled_from(BLOCK_ELEMENTS), chunk_blocks=st.sampled_from([1, 2, 5]),
       codec=st.sampled_from(CODECS), dtype=st.sampled_from([np.uint16, np.int32]),
       length_offset=st.integers(-2, 2), blocks_per_window=st.integers(0, 3), extra=st.integers(0, 400),
       seed=st.integers(0, 2**16), source=st.sampled_from(["b2nd", "ragged"]))
def test_windows_equal_numpy_at_and_around_block_lengths(tmp_path_factory, block, chunk_blocks, codec, dtype,
                                                         length_offset, blocks_per_window, extra, seed, source):
    """Windows(length=L) row i is stream[i*L : i*L + L + 1]: L around block multiples puts
    every row's start at another offset in its block."""
    length = max(1, blocks_per_window * block + length_offset)
    count = 4 * (length + 1) + extra
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, 60000, count).astype(dtype)
    directory = _fresh(tmp_path_factory, "windows")
    if source == "b2nd":
        path = _write(directory / "stream.b2nd", stream, (block * chunk_blocks,), (block,), codec)
    else:  # Documents back to back: the stream is their concatenation.
        cuts = np.sort(rng.choice(np.arange(1, count), size=min(5, count - 1), replace=False))
        layout = {"dtype": dtype, "block": block, "chunk": block * chunk_blocks, "codec": codec,
                  "lengths": np.diff(np.concatenate([[0], cuts, [count]])).tolist()}
        path, records = _write_ragged(directory, layout, seed)
        stream = np.concatenate(records)
    reference = _full_read(path) if source == "b2nd" else stream
    with ShmDataLoader({"tokens": Windows(path, length=length)}, batch_size=3, mode="shuffle", seed=seed,
                       readers=0, slots=3) as loader:
        for _ in range(3):
            batch = next(loader)
            for row, index in enumerate(batch.indices.tolist()):
                np.testing.assert_array_equal(batch["tokens"][row], reference[index * length:index * length + length + 1])


@st.composite
def fixed_layouts(draw):
    rows = draw(st.integers(1, 400))
    width = draw(st.integers(1, 6))
    chunk_rows = draw(st.integers(1, 64))
    return {"rows": rows, "width": width, "chunk_rows": chunk_rows,
            "block_rows": draw(st.integers(1, chunk_rows)),
            # A chunk that splits rows (a layout made elsewhere) goes through Blosc2's API.
            "chunk_width": draw(st.sampled_from([width, max(1, width // 2)])),
            "dtype": draw(st.sampled_from(DTYPES)), "codec": draw(st.sampled_from(CODECS))}


@examples(200)
@given(layout=fixed_layouts(), picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=40),
       seed=st.integers(0, 2**16))
def test_fixed_rows_equal_numpy_for_any_layout_and_codec(tmp_path_factory, layout, picks, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 200, (layout["rows"], layout["width"])).astype(layout["dtype"])
    directory = _fresh(tmp_path_factory, "rows")
    chunks = (layout["chunk_rows"], layout["chunk_width"])
    blocks = (layout["block_rows"], layout["chunk_width"])
    path = _write(directory / "rows.b2nd", data, chunks, blocks, layout["codec"])
    np.save(directory / "rows.npy", data)
    indices = np.array([pick % layout["rows"] for pick in picks], dtype=np.uint64)
    for file in (path, str(directory / "rows.npy")):
        field = open_field(describe_field(file), batch_size_max=len(indices))
        try:
            out = np.full((len(indices), layout["width"]), 99, dtype=layout["dtype"])
            field.gather(indices, out)
        finally:
            field.close()
        np.testing.assert_array_equal(out, data[indices.astype(np.int64)], err_msg=file)


@examples(100)
@given(rows=st.integers(1, 300), batch_size=st.integers(1, 40), shard_count=st.integers(1, 4),
       seed=st.integers(0, 2**32), window=st.one_of(st.none(), st.integers(1, 400)), block_rows=st.integers(1, 16))
def test_every_row_comes_once_per_epoch_across_shards(rows, batch_size, shard_count, seed, window, block_rows):
    """What a shuffle must be, checked without the sampler's own arithmetic: over
    shard_count shards, the positions of an epoch hold every row exactly once."""
    if window is not None and rows // block_rows < shard_count:
        return  # A shard would get no block: refused (tested in test_window_shuffle.py).
    samplers = [Sampler(rows, batch_size, "shuffle", seed, shard, shard_count, window,
                        block_rows if window is not None else 1) for shard in range(shard_count)]
    per_shard = []
    for sampler in samplers:
        epoch = sampler.epoch_length
        steps = -(-2 * epoch // batch_size)
        stream = np.concatenate([sampler.fill(step) for step in range(steps)])
        per_shard.append((stream, epoch))
    if not samplers[0].shard_blocks:  # Shards interleave one global stream: batch k of shard h is its h-th share.
        global_stream = np.stack([stream[:len(per_shard[0][0])].reshape(-1, batch_size) for stream, _ in per_shard],
                                 axis=1).reshape(-1)
        for epoch in range(2):
            assert sorted(global_stream[epoch * rows:(epoch + 1) * rows].tolist()) == list(range(rows))
    else:  # A window smaller than the data: each shard has its own share of blocks, dealt anew each
        # epoch, and the shares partition the rows.
        for number in range(2):
            shares = np.concatenate([stream[number * epoch:(number + 1) * epoch] for stream, epoch in per_shard])
            assert sorted(shares.tolist()) == list(range(rows)), number


# ---- Importers against pyarrow and tarfile ------------------------------------------------

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@st.composite
def arrow_tables(draw):
    rows = draw(st.integers(1, 60))
    maybe_null = st.booleans()

    def column(kind):
        nulls = draw(maybe_null)
        value = lambda: None if nulls and draw(st.integers(0, 4)) == 0 else draw(st.integers(-100, 100))
        if kind == "int":
            return pa.array([value() for _ in range(rows)], type=pa.int32())
        if kind == "float":
            return pa.array([None if nulls and i % 5 == 0 else float(i) / 3 for i in range(rows)], type=pa.float64())
        if kind == "fixed":
            return pa.array([None if nulls and draw(st.integers(0, 6)) == 0 else [value(), value(), value()]
                             for _ in range(rows)], type=pa.list_(pa.int32(), 3))
        if kind == "list":
            return pa.array([[draw(st.integers(0, 9)) for _ in range(draw(st.integers(0, 5)))]
                             for _ in range(rows)], type=pa.list_(pa.int64()))
        return pa.array([draw(st.text(max_size=6)) for _ in range(rows)])

    kinds = draw(st.lists(st.sampled_from(["int", "float", "fixed", "list", "text"]), min_size=1, max_size=5))
    return pa.table({f"c{index}_{kind}": column(kind) for index, kind in enumerate(kinds)})


def _read_ragged(path: str) -> list:
    """A ragged directory read with Blosc2 alone."""
    import blosc2

    values = blosc2.open(os.path.join(path, VALUES_NAME))[...]
    offsets = blosc2.open(os.path.join(path, OFFSETS_NAME))[...]
    return [values[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:])]


@examples(60)
@given(table=arrow_tables(), row_group=st.integers(1, 64), nulls_given=st.booleans())
def test_parquet_imports_equal_pyarrows_read(tmp_path_factory, table, row_group, nulls_given):
    from shmloader import StorageError
    from shmloader.tools.formats import from_parquet

    directory = _fresh(tmp_path_factory, "parquet")
    pq.write_table(table, directory / "t.parquet", row_group_size=row_group)
    nulls = {name: -7 for name in table.column_names if name.endswith(("int", "fixed", "float"))} if nulls_given else None
    has_nulls = any(_nested_null_count(table[name]) for name in table.column_names if name.endswith(("int", "fixed",
                                                                                                    "float")))
    if has_nulls and not nulls_given:
        with pytest.raises(StorageError, match="is null"):
            from_parquet(directory / "t.parquet", directory / "out", progress=False)
        assert not (directory / "out").exists()
        return
    try:
        paths = from_parquet(directory / "t.parquet", directory / "out", nulls=nulls, progress=False)
    except StorageError as error:
        # A pyarrow before 26 cannot read some null rows of a fixed-size list column (its own
        # cast fails): the import says a row is null, and which pyarrow reads it.
        null_rows = any(table[name].null_count for name in table.column_names if name.endswith("fixed"))
        if not (null_rows and int(pa.__version__.split(".")[0]) < 26 and "is null" in str(error)
                and "pyarrow>=26 reads it" in str(error)):
            raise
        return
    for name in table.column_names:
        expected = table[name].to_pylist()
        if name.endswith("list"):
            assert [record.tolist() for record in _read_ragged(paths[name])] == expected
        elif name.endswith("text"):
            assert [record.tobytes().decode() for record in _read_ragged(paths[name])] == expected
        elif name.endswith("fixed"):
            filled = [[-7] * 3 if row is None else [-7 if item is None else item for item in row] for row in expected]
            np.testing.assert_array_equal(np.load(paths[name]), np.array(filled, dtype=np.int32), err_msg=name)
        else:
            filled = [-7 if value is None else value for value in expected]
            got = np.load(paths[name])
            np.testing.assert_array_equal(got, np.array(filled, dtype=got.dtype), err_msg=name)


@pytest.mark.parametrize("nulls", [None, {"x": -7}])
def test_a_null_row_of_a_fixed_size_list_column_is_the_imports_own_null_error_on_any_pyarrow(tmp_path, nulls):
    """pyarrow before 26 fails reading such a row with its own "Expected all lists to be of
    size=3": the import still says, naming the file, row group and column, that it is null
    (and that a newer pyarrow reads it); from 26 on, the row is read, refused, or filled."""
    from shmloader import StorageError
    from shmloader.tools.formats import from_parquet

    table = pa.table({"x": pa.array([[1, 2, 3], None, [4, 5, 6], [7, 8, 9]], type=pa.list_(pa.int32(), 3))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
    if int(pa.__version__.split(".")[0]) < 26:
        with pytest.raises(StorageError, match=r"t.parquet: row group 0, column 'x': a row or item is null \(1 null"):
            from_parquet(tmp_path / "t.parquet", tmp_path / "out", nulls=nulls, progress=False)
    elif nulls is None:
        with pytest.raises(StorageError, match=r"column 'x': item 0 of row 1 is null"):
            from_parquet(tmp_path / "t.parquet", tmp_path / "out", progress=False)
    else:
        paths = from_parquet(tmp_path / "t.parquet", tmp_path / "out", nulls=nulls, progress=False)
        assert np.load(paths["x"]).tolist() == [[1, 2, 3], [-7, -7, -7], [4, 5, 6], [7, 8, 9]]


def _nested_null_count(column) -> int:
    count = column.null_count
    for chunk in column.chunks:
        while pa.types.is_fixed_size_list(chunk.type):
            chunk = chunk.flatten()
            count += chunk.null_count
    return count


@examples(40)
@given(samples=st.lists(st.tuples(st.binary(max_size=300), st.integers(0, 9), st.text(max_size=20)), min_size=1,
                        max_size=30),
       per_shard=st.integers(1, 12))
def test_webdataset_imports_equal_tarfiles_read(tmp_path_factory, samples, per_shard):
    from shmloader.tools.webdataset import from_webdataset

    directory = _fresh(tmp_path_factory, "wds")
    for shard, start in enumerate(range(0, len(samples), per_shard)):
        with tarfile.open(directory / f"shard-{shard:04d}.tar", "w") as archive:
            for index in range(start, min(start + per_shard, len(samples))):
                image, label, caption = samples[index]
                for extension, data in (("seg.png", image), ("cls", str(label).encode()), ("txt", caption.encode())):
                    info = tarfile.TarInfo(f"dir/s{index:05d}.{extension}")
                    info.size = len(data)
                    archive.addfile(info, io.BytesIO(data))
    paths = from_webdataset(str(directory / "shard-*.tar"), directory / "out", progress=False)
    reference = {"seg_png": [], "cls": [], "txt": [], "__key__": []}
    for shard in sorted(directory.glob("shard-*.tar")):
        with tarfile.open(shard) as archive:
            for member in archive.getmembers():
                key, extension = member.name.split(".", 1)
                data = archive.extractfile(member).read()
                if extension == "cls":
                    reference["cls"].append(int(data))
                    reference["__key__"].append(key.encode())
                else:
                    reference[extension.replace(".", "_")].append(data)
    assert np.load(paths["cls"]).tolist() == reference["cls"]
    for name in ("seg_png", "txt", "__key__"):
        assert [record.tobytes() for record in _read_ragged(paths[name])] == reference[name], name

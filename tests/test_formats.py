"""Parquet and Arrow in: tables written by pyarrow (row groups of several sizes, every
column kind), imported column by column, read back through the loader: every batch equals
what pyarrow reads for the same rows; nulls and bad input name the column and row."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shmloader import Packed, ShmDataLoader, StorageError
from shmloader.formats import from_arrow, from_parquet

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = 1000


def make_table(rows: int = ROWS, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 12, size=rows)  # Empty token lists too.
    tokens = [rng.integers(0, 50_000, size=int(n)).astype(np.int32).tolist() for n in lengths]
    return pa.table({
        "id": pa.array(np.arange(rows, dtype=np.int64)),
        "score": pa.array(rng.standard_normal(rows).astype(np.float32)),
        "flag": pa.array(rng.integers(0, 2, rows).astype(bool)),
        "vector": pa.array(rng.standard_normal((rows, 3)).astype(np.float32).tolist(), type=pa.list_(pa.float32(), 3)),
        "grid": pa.array(rng.integers(-9, 9, (rows, 3, 2)).astype(np.int16).tolist(),
                         type=pa.list_(pa.list_(pa.int16(), 2), 3)),
        "tokens": pa.array(tokens, type=pa.list_(pa.int32())),
        "caption": pa.array([f"caption {i} " + "é" * (i % 5) for i in range(rows)]),
        "blob": pa.array([bytes([i % 256]) * (i % 7) for i in range(rows)], type=pa.binary()),
    })


def read_back(paths: dict, rows: int) -> dict:
    fields = {name: Packed(path) if path.endswith(".ragged") else path for name, path in paths.items()}
    out = {}
    with ShmDataLoader(fields, batch_size=128, mode="sequential", epochs=1, readers=2) as loader:
        for batch in loader:
            for name in paths:
                if paths[name].endswith(".ragged"):
                    offsets = batch[f"{name}.offsets"].tolist()
                    values = np.array(batch[name])
                    records = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
                    if name in ("caption", "blob"):
                        records = batch.strings(name) if name == "caption" else [r.tobytes() for r in records]
                    out.setdefault(name, []).extend(records)
                else:
                    out.setdefault(name, []).append(np.array(batch[name]))
    assert sum(len(chunk) for chunk in out["id"]) == rows
    return out


def check_equal(table, got: dict) -> None:
    np.testing.assert_array_equal(np.concatenate(got["id"]), table["id"].to_numpy())
    np.testing.assert_array_equal(np.concatenate(got["score"]), table["score"].to_numpy())
    np.testing.assert_array_equal(np.concatenate(got["flag"]), table["flag"].to_numpy(zero_copy_only=False))
    np.testing.assert_array_equal(np.concatenate(got["vector"]), np.array(table["vector"].to_pylist(), np.float32))
    np.testing.assert_array_equal(np.concatenate(got["grid"]), np.array(table["grid"].to_pylist(), np.int16))
    for record, expected in zip(got["tokens"], table["tokens"].to_pylist()):
        assert record.dtype == np.int32 and record.tolist() == expected
    assert got["caption"] == table["caption"].to_pylist()
    assert got["blob"] == table["blob"].to_pylist()


def test_parquet_with_row_groups_of_several_sizes_reads_back_exactly(tmp_path):
    table = make_table()
    with pq.ParquetWriter(tmp_path / "part-0.parquet", table.schema) as writer:
        for start, size in ((0, 100), (100, 37), (137, 363)):  # Row groups of three sizes.
            writer.write_table(table.slice(start, size), row_group_size=size)
    pq.write_table(table.slice(500), tmp_path / "part-1.parquet", row_group_size=128)
    paths = from_parquet(str(tmp_path / "part-*.parquet"), tmp_path / "out", progress=False)
    assert paths["id"].endswith("id.npy") and paths["tokens"].endswith("tokens.ragged")
    check_equal(table, read_back(paths, ROWS))


def test_no_parquet_reader_is_shared_between_the_column_threads(tmp_path, monkeypatch):
    """pyarrow's ParquetFile is not safe to read from two threads at once (a shared one
    crashed the interpreter, or hung a suite, now and then): each column's thread opens
    its own."""
    import threading

    pq.write_table(make_table(), tmp_path / "part-0.parquet", row_group_size=100)
    readers: dict[int, set] = {}
    alive = []  # Keeps every reader, so that no id is reused for another.
    original = pq.ParquetFile.read_row_group

    def recording(self, *args, **kwargs):
        alive.append(self)
        readers.setdefault(id(self), set()).add(threading.get_ident())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", recording)
    from_parquet(str(tmp_path / "part-0.parquet"), tmp_path / "out", progress=False, threads=4)
    assert len(readers) >= 8  # One reader per column (eight columns), each read by one thread.
    assert all(len(threads) == 1 for threads in readers.values())


def test_an_arrow_table_reads_back_exactly(tmp_path):
    table = make_table(300, seed=1)
    check_equal(table, read_back(from_arrow(table, tmp_path / "arrow", progress=False), 300))


def test_a_hugging_face_dataset_built_offline(tmp_path):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [], [4]] * 50, "label": [0, 1, 2] * 50})
    paths = from_arrow(dataset, tmp_path / "hf", progress=False)
    with ShmDataLoader({"input_ids": Packed(paths["input_ids"]), "label": paths["label"]}, batch_size=3,
                       mode="sequential", readers=1) as loader:
        batch = next(loader)
        assert batch["input_ids.offsets"].tolist() == [0, 3, 3, 4] and batch["label"].tolist() == [0, 1, 2]


def test_nulls_are_refused_naming_column_and_row_or_mapped(tmp_path):
    table = pa.table({"x": pa.array([1, 2, None, 4], type=pa.int64()),
                      "text": pa.array(["a", None, "c", "d"])})
    pq.write_table(table, tmp_path / "nulls.parquet", row_group_size=2)
    with pytest.raises(StorageError, match=r"column 'x': row 2 is null"):
        from_parquet(tmp_path / "nulls.parquet", tmp_path / "out", progress=False)
    assert not [entry for entry in os.listdir(tmp_path) if entry.startswith(("out", ".out"))]  # Nothing half-written.
    paths = from_parquet(tmp_path / "nulls.parquet", tmp_path / "out", nulls={"x": -1, "text": "empty"},
                         progress=False)
    assert np.load(paths["x"]).tolist() == [1, 2, -1, 4]
    with ShmDataLoader({"text": Packed(paths["text"])}, batch_size=4, mode="sequential", readers=1) as loader:
        assert next(loader).strings("text") == ["a", "", "c", "d"]


def test_bad_input_names_the_file_or_column(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(StorageError, match=r"bad.parquet: not a readable Parquet file"):
        from_parquet(tmp_path / "bad.parquet", tmp_path / "out", progress=False)
    good = make_table(200)
    pq.write_table(good, tmp_path / "damaged.parquet", row_group_size=50)
    data = bytearray((tmp_path / "damaged.parquet").read_bytes())
    data[300:2300] = bytes(2000)  # Inside the first row groups' pages; the footer stays readable.
    (tmp_path / "damaged.parquet").write_bytes(bytes(data))
    with pytest.raises(StorageError, match=r"damaged.parquet: row group \d+, column '\w+'"):
        from_parquet(tmp_path / "damaged.parquet", tmp_path / "out", progress=False)
    assert not [entry for entry in os.listdir(tmp_path) if entry.startswith(("out", ".out"))]
    table = pa.table({"nested": pa.array([{"a": 1}], type=pa.struct([("a", pa.int64())]))})
    with pytest.raises(StorageError, match="column 'nested'"):
        from_arrow(table, tmp_path / "out", progress=False)


def write_shards(directory, samples: int = 90, per_shard: int = 40, drop=None):
    webdataset = pytest.importorskip("webdataset")
    rng = np.random.default_rng(3)
    expected = []
    for shard in range(-(-samples // per_shard)):
        with webdataset.TarWriter(str(directory / f"shard-{shard:03d}.tar")) as sink:
            for index in range(shard * per_shard, min(samples, (shard + 1) * per_shard)):
                sample = {"__key__": f"sample{index:05d}", "jpg": rng.bytes(int(rng.integers(0, 300))),
                          "cls": index % 7, "txt": f"caption of {index}"}
                if index == drop:
                    del sample["txt"]
                sink.write(sample)
                expected.append(sample)
    return expected


def test_webdataset_shards_import_in_order_and_read_back_like_webdataset_reads_them(tmp_path):
    from shmloader.formats import from_webdataset

    webdataset = pytest.importorskip("webdataset")
    write_shards(tmp_path)
    paths = from_webdataset(str(tmp_path / "shard-*.tar"), tmp_path / "out", progress=False)
    assert sorted(paths) == ["__key__", "cls", "jpg", "txt"]
    reference = list(webdataset.WebDataset(sorted(str(p) for p in tmp_path.glob("shard-*.tar")), shardshuffle=False))
    fields = {"jpg": Packed(paths["jpg"]), "txt": Packed(paths["txt"]), "key": Packed(paths["__key__"]),
              "cls": paths["cls"]}
    got = {"jpg": [], "txt": [], "key": [], "cls": []}
    with ShmDataLoader(fields, batch_size=16, mode="sequential", epochs=1, readers=2) as loader:
        for batch in loader:
            offsets = batch["jpg.offsets"].tolist()
            got["jpg"] += [batch["jpg"][a:b].tobytes() for a, b in zip(offsets[:-1], offsets[1:])]
            got["txt"] += batch.strings("txt")
            got["key"] += batch.strings("key")
            got["cls"] += batch["cls"].tolist()
    assert got["key"] == [sample["__key__"] for sample in reference]
    assert got["jpg"] == [sample["jpg"] for sample in reference]
    assert got["txt"] == [sample["txt"].decode() for sample in reference]
    assert got["cls"] == [int(sample["cls"]) for sample in reference]


def test_a_sample_missing_an_extension_or_a_broken_shard_is_named(tmp_path):
    from shmloader.formats import from_webdataset

    write_shards(tmp_path, drop=57)
    with pytest.raises(StorageError, match=r"shard-001.tar: sample sample00057 has extensions \['cls', 'jpg'\].*missing \['txt'\]"):
        from_webdataset(str(tmp_path / "shard-*.tar"), tmp_path / "out", progress=False)
    assert not [entry for entry in os.listdir(tmp_path) if entry.startswith(("out", ".out"))]
    (tmp_path / "broken.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(StorageError, match="broken.tar: not a readable tar shard"):
        from_webdataset(tmp_path / "broken.tar", tmp_path / "out2", progress=False)

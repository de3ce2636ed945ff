"""Variable-length fields: the ragged stored form round-trips through Blosc2 alone; every
slot layout (Padded, Packed, Windows) equals a numpy reference for any reader count and
sampler mode, resumes exactly, and bad files or settings fail naming file, record or step."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shmloader import (
    Packed,
    Padded,
    ReaderError,
    Sampler,
    ShmDataLoader,
    StorageError,
    Windows,
)
from shmloader.plan.fields import plan_field
from shmloader.storage.ragged import (
    OFFSETS_NAME,
    SHAPES_NAME,
    VALUES_NAME,
    describe_ragged,
    record_lengths,
)
from shmloader.tools.convert import convert, write_ragged

RECORDS = 300


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Token documents of log-normal lengths (one longer than any max_length used below)."""
    rng = np.random.default_rng(7)
    lengths = np.maximum(1, rng.lognormal(3.5, 0.9, RECORDS)).astype(int)
    lengths[17] = 400
    docs = [rng.integers(1, 30000, size=length, dtype=np.int32) for length in lengths]
    directory = tmp_path_factory.mktemp("ragged")
    spec = write_ragged(directory / "docs.ragged", (doc for doc in docs))
    np.save(directory / "labels.npy", np.arange(RECORDS, dtype=np.int64) * 7)
    return {"docs": docs, "path": spec.path, "labels": str(directory / "labels.npy"), "directory": directory}


def test_the_stored_form_is_plain_blosc2_arrays(documents):
    import blosc2

    values = blosc2.open(os.path.join(documents["path"], VALUES_NAME))[:]
    offsets = blosc2.open(os.path.join(documents["path"], OFFSETS_NAME))[:]
    assert offsets.dtype == np.uint64 and offsets.size == RECORDS + 1
    for record in (0, 17, RECORDS - 1):
        assert np.array_equal(values[offsets[record]:offsets[record + 1]], documents["docs"][record])
    spec = describe_ragged(documents["path"])
    assert spec.record_count == RECORDS and spec.length_max == 400 and spec.values.checksums


def test_n_dimensional_records_round_trip_with_their_shapes(tmp_path):
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8) for h, w in rng.integers(5, 40, size=(50, 2))]
    spec = write_ragged(tmp_path / "images.ragged", images)
    assert spec.record_ndim == 3
    sampler = Sampler(50, 8, seed=2)
    with ShmDataLoader({"image": Packed(spec.path)}, batch_size=8, readers=2, seed=2) as loader:
        for _ in range(10):
            batch = next(loader)
            offsets, shapes = batch["image.offsets"], batch["image.shapes"]
            for row, record in enumerate(sampler.fill(batch.step)):
                image = batch["image"][offsets[row]:offsets[row + 1]].reshape(shapes[row])
                assert np.array_equal(image, images[record])
    with ShmDataLoader({"image": Padded(spec.path, max_length=(20, 30, 3), overflow="truncate")}, batch_size=8,
                       readers=1, seed=2) as loader:
        batch = next(loader)
        for row, record in enumerate(sampler.fill(batch.step)):
            h, w = min(images[record].shape[0], 20), min(images[record].shape[1], 30)
            assert tuple(batch["image.shapes"][row]) == (h, w, 3)
            assert np.array_equal(batch["image"][row, :h, :w], images[record][:h, :w])
            assert not batch["image"][row, h:].any() and not batch["image"][row, :, w:].any()


def padded_reference(docs, indices, max_length, pad):
    out = np.full((len(indices), max_length), pad, dtype=np.int32)
    lengths = np.zeros(len(indices), dtype=np.uint32)
    for row, record in enumerate(indices):
        doc = docs[record][:max_length]
        out[row, :len(doc)], lengths[row] = doc, len(doc)
    return out, lengths


@pytest.mark.parametrize("readers", [1, 2, 4])
@pytest.mark.parametrize("mode", ["sequential", "random", "shuffle"])
def test_every_layout_equals_the_numpy_reference(documents, readers, mode):
    docs, batch_size = documents["docs"], 16
    sampler = Sampler(RECORDS, batch_size, mode, seed=5)
    labels = np.load(documents["labels"])
    fields = {
        "padded": Padded(documents["path"], max_length=64, pad=-1, overflow="truncate"),
        "packed": Packed(documents["path"]),
        "label": documents["labels"],
    }
    with ShmDataLoader(fields, batch_size=batch_size, readers=readers, mode=mode, seed=5) as loader:
        for _ in range(25):
            batch = next(loader)
            indices = sampler.fill(batch.step)
            padded, lengths = padded_reference(docs, indices, 64, -1)
            assert np.array_equal(batch["padded"], padded) and np.array_equal(batch["padded.lengths"], lengths)
            offsets = batch["packed.offsets"]
            assert np.array_equal(np.diff(offsets), [len(docs[record]) for record in indices])
            assert np.array_equal(batch["packed"][:offsets[-1]], np.concatenate([docs[r] for r in indices]))
            assert np.array_equal(batch["label"], labels[indices])


def test_windows_are_rows_of_length_plus_one_from_npy_and_b2nd(tmp_path):
    stream = np.random.default_rng(3).integers(0, 50000, size=20011, dtype=np.int32)
    np.save(tmp_path / "stream.npy", stream)
    convert(tmp_path / "stream.npy", tmp_path / "stream.b2nd", codec="lz4", progress=False)
    length = 100
    sampler = Sampler((stream.size - 1) // length, 8, seed=1)
    for path in (tmp_path / "stream.npy", tmp_path / "stream.b2nd"):
        with ShmDataLoader({"tokens": Windows(path, length=length)}, batch_size=8, readers=2, seed=1) as loader:
            for _ in range(30):
                batch = next(loader)
                expected = np.stack([stream[i * length: i * length + length + 1] for i in sampler.fill(batch.step)])
                assert np.array_equal(batch["tokens"], expected)


def test_resume_and_seek_give_identical_batches(documents):
    fields = {"tokens": Padded(documents["path"], max_length=32, overflow="random")}
    with ShmDataLoader(fields, batch_size=8, readers=2, seed=9) as loader:
        first = [np.array(next(loader)["tokens"]) for _ in range(12)]
        state = loader.state_dict()
    with ShmDataLoader(fields, batch_size=8, readers=3, seed=9, start_step=5) as resumed:
        for step in range(5, 12):
            assert np.array_equal(next(resumed)["tokens"], first[step])
        resumed.seek(2)
        assert np.array_equal(next(resumed)["tokens"], first[2])
    assert state["step"] == 12


def test_random_windows_depend_only_on_seed_step_and_row(documents):
    """overflow="random" keeps max_length elements of a long record at a position that is a
    pure function of (seed, step, shard, row): the same for 1 or 4 readers."""
    fields = {"tokens": Padded(documents["path"], max_length=16, overflow="random")}
    runs = []
    for readers in (1, 4):
        with ShmDataLoader(fields, batch_size=8, readers=readers, seed=4, mode="sequential") as loader:
            runs.append([np.array(next(loader)["tokens"]) for _ in range(40)])
    assert all(np.array_equal(a, b) for a, b in zip(*runs))
    docs = documents["docs"]
    window = runs[0][17 // 8][17 % 8]  # Record 17 (400 tokens) at step 2, row 1 in sequential mode.
    start = next(i for i in range(400 - 16 + 1) if np.array_equal(docs[17][i:i + 16], window))
    assert 0 <= start <= 400 - 16


def test_a_record_longer_than_max_length_names_step_row_and_length(documents):
    longest_other = max(len(doc) for record, doc in enumerate(documents["docs"]) if record != 17)
    assert longest_other < 400
    fields = {"tokens": Padded(documents["path"], max_length=longest_other)}
    with ShmDataLoader(fields, batch_size=8, readers=1, mode="sequential") as loader:
        with pytest.raises(ReaderError, match=rf"record 17 \(step 2, batch row 1\) has 400 elements, more than "
                                               rf"max_length={longest_other}"):
            for _ in range(10):
                next(loader)


def test_a_packed_batch_over_max_elements_names_its_step(documents):
    docs = documents["docs"]
    # Just enough for every batch of 8 but step 2's, which holds record 17 (400 tokens).
    limit = max(sum(len(doc) for doc in docs[start:start + 8]) for start in range(0, 80, 8) if start != 16)
    assert limit < sum(len(doc) for doc in docs[16:24])
    fields = {"tokens": Packed(documents["path"], max_elements=max(limit, 400))}
    with ShmDataLoader(fields, batch_size=8, readers=1, mode="sequential") as loader:
        with pytest.raises(ReaderError, match=r"step 2's 8 records hold \d+ elements, more than the packed region's"):
            for _ in range(10):
                next(loader)


def test_a_ragged_directory_without_a_layout_is_refused_with_the_fix(documents):
    with pytest.raises(StorageError, match=r"field 'tokens'.*Padded\(path, max_length=...\) or Packed\(path\)"):
        ShmDataLoader({"tokens": documents["path"]}, batch_size=8, readers=1)


@pytest.mark.parametrize(
    "damage,words",
    [
        ("decreasing", r"offsets decrease at record 1"),
        ("past_end", r"the last offset is 999, but values.b2nd holds 6 values"),
        ("shapes", r"record 0 has shape \(2, 2\), which holds 4 elements, but its offsets give 3"),
        ("truncated", r"values.b2nd"),
    ],
)
def test_bad_ragged_files_are_named_with_the_record(tmp_path, damage, words):
    directory = tmp_path / "bad.ragged"
    directory.mkdir()
    offsets = {"decreasing": [0, 4, 2, 6], "past_end": [0, 3, 6, 999]}.get(damage, [0, 3, 5, 6])
    convert(np.arange(6, dtype=np.int32), directory / VALUES_NAME, progress=False)
    convert(np.asarray(offsets, dtype=np.uint64), directory / OFFSETS_NAME, progress=False)
    if damage == "shapes":
        convert(np.array([[2, 2], [2, 1], [1, 1]], dtype=np.uint64), directory / SHAPES_NAME, progress=False)
    if damage == "truncated":
        with open(directory / VALUES_NAME, "r+b") as handle:
            handle.truncate(os.path.getsize(directory / VALUES_NAME) // 2)
    with pytest.raises(StorageError, match=words):
        describe_ragged(directory)


def test_write_ragged_refuses_mixed_records_and_leaves_nothing(tmp_path):
    records = [np.arange(3, dtype=np.int32), np.arange(4, dtype=np.int64)]
    with pytest.raises(ValueError, match="record 1 is int64 with 1 dimensions; the first record was int32"):
        write_ragged(tmp_path / "mixed.ragged", records)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("codec", ["lz4", "none"])
def test_empty_records_are_all_pad_rows_and_empty_segments(tmp_path, codec):
    """Records of length 0 (28 empty __init__.py files in a token corpus): an all-pad row of
    length 0 in Padded, an empty segment in Packed, an empty record in a transform."""
    records = [np.arange(i % 4, dtype=np.int32) + 100 * i for i in range(50)] + [np.zeros(0, dtype=np.int32)]
    write_ragged(tmp_path / "docs.ragged", records, codec=codec)
    spec = describe_ragged(tmp_path / "docs.ragged")
    assert spec.record_count == 51 and int(record_lengths(spec).min()) == 0
    for readers in (0, 2):
        with ShmDataLoader({"t": Padded(str(tmp_path / "docs.ragged"), max_length=4, pad=-1)}, batch_size=51,
                           mode="sequential", readers=readers) as loader:
            batch = next(loader)
            for i, record in enumerate(records):
                assert batch["t.lengths"][i] == len(record)
                np.testing.assert_array_equal(batch["t"][i][:len(record)], record)
                assert (batch["t"][i][len(record):] == -1).all()
        with ShmDataLoader({"t": Packed(str(tmp_path / "docs.ragged"))}, batch_size=51, mode="sequential",
                           readers=readers) as loader:
            batch = next(loader)
            offsets = batch["t.offsets"]
            for i, record in enumerate(records):
                np.testing.assert_array_equal(batch["t"][offsets[i]:offsets[i + 1]], record)


def png_bytes(height: int, width: int, seed: int) -> bytes:
    """A real PNG (8-bit greyscale), written with zlib alone."""
    import struct
    import zlib

    pixels = np.random.default_rng(seed).integers(0, 255, size=(height, width), dtype=np.uint8)
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def jpeg_header_bytes(height: int, width: int, payload: int) -> bytes:
    """The markers of a baseline JPEG up to its frame header, then opaque bytes and EOI."""
    import struct

    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof0 + bytes(range(256)) * payload + b"\xff\xd9"


def test_convert_images_stores_bytes_unchanged_with_labels_and_sizes(tmp_path, capsys):
    from shmloader.tools.cli import main

    images = tmp_path / "photos"
    expected = []
    for label, name in enumerate(["cat", "dog"]):
        (images / name).mkdir(parents=True)
        for index in range(3):
            height, width = 20 + index, 30 + label
            data = png_bytes(height, width, index) if index % 2 else jpeg_header_bytes(height, width, index + 1)
            (images / name / f"{index}.{'png' if index % 2 else 'JPG'}").write_bytes(data)
            expected.append((data, label, (height, width)))
    (images / "cat" / "notes.txt").write_text("not an image")
    assert main(["convert-images", str(images), str(tmp_path / "out"), "--quiet"]) == 0
    assert "Packed(" in capsys.readouterr().out
    labels, sizes = np.load(tmp_path / "out.label"), np.load(tmp_path / "out.size")
    assert labels.tolist() == [label for _, label, _ in expected]
    assert [tuple(size) for size in sizes] == [size for _, _, size in expected]
    with ShmDataLoader({"image": Packed(tmp_path / "out.image"), "label": str(tmp_path / "out.label")},
                       batch_size=6, readers=2, mode="sequential") as loader:
        batch = next(loader)
        for row in range(6):
            start, stop = batch["image.offsets"][row], batch["image.offsets"][row + 1]
            assert batch["image"][start:stop].tobytes() == expected[row][0]  # Byte-exact.
    first = (tmp_path / "out.image" / VALUES_NAME).read_bytes()
    assert main(["convert-images", str(images), str(tmp_path / "out"), "--quiet", "--force"]) == 0
    assert (tmp_path / "out.image" / VALUES_NAME).read_bytes() == first  # Deterministic.
    (images / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF")
    assert main(["convert-images", str(images), str(tmp_path / "again"), "--quiet"]) == 2
    assert "broken.jpg: a JPEG without a readable frame header" in capsys.readouterr().err


def test_padded_without_max_length_warns_when_one_record_sizes_every_slot(tmp_path):
    """One 757k-token file in a corpus made 924 MiB of /dev/shm for batch 32 without a word."""
    from shmloader import PerformanceWarning

    documents = [np.arange(50, dtype=np.int32)] * 300 + [np.arange(600_000, dtype=np.int32)]
    spec = write_ragged(tmp_path / "docs.ragged", documents)
    with pytest.warns(PerformanceWarning, match=r"record 300 of 600,000 elements: 73 MiB per batch.*max_length \(e\.g\. 50\)"):
        plan = plan_field("tokens", Padded(spec.path), 32)
    assert plan.regions[0].shape == (32, 600_000)


def test_packed_offsets_are_torch_ready_and_int32_on_request(documents):
    torch = pytest.importorskip("torch")
    expected = None
    for dtype, torch_dtype in (("int64", torch.int64), ("int32", torch.int32)):
        with ShmDataLoader({"t": Packed(documents["path"], offsets=dtype)}, batch_size=8, readers=1,
                           mode="sequential") as loader:
            batch = next(loader)
            offsets = torch.from_numpy(batch["t.offsets"])
            assert offsets.dtype == torch_dtype
            lengths = torch.diff(offsets).tolist()  # "add_stub" not implemented for 'UInt64' before
            assert lengths == [len(documents["docs"][int(i)]) for i in batch.indices]
            values = np.asarray(batch["t"])
            got = [values[int(a):int(b)] for a, b in zip(batch["t.offsets"][:-1], batch["t.offsets"][1:])]
            expected = expected or got
            for one, other in zip(expected, got):
                np.testing.assert_array_equal(one, other)
    with pytest.raises(ValueError, match="'int64' or 'int32'"):
        ShmDataLoader({"t": Packed(documents["path"], offsets="uint64")}, batch_size=8, readers=1)


@pytest.mark.parametrize("separator", [None, -1])
def test_windows_over_documents_span_them_with_segments(tmp_path, separator):
    """Windows over a ragged field: the documents back to back (each followed by the
    separator), rows of length + 1 that span documents, and the documents present in a row
    numbered from 0; equal to a numpy reference for readers 0 and 2 (empty documents too)."""
    rng = np.random.default_rng(11)
    documents = [rng.integers(0, 1000, size=int(n)).astype(np.int32) for n in rng.integers(0, 40, size=300)]
    write_ragged(tmp_path / "docs.ragged", documents)
    stream, owner = [], []
    for number, document in enumerate(documents):
        pieces = list(document) + ([separator] if separator is not None else [])
        stream += pieces
        owner += [number] * len(pieces)
    stream, owner = np.asarray(stream, np.int32), np.asarray(owner)
    length = 16
    for readers in (0, 2):
        with ShmDataLoader({"tokens": Windows(str(tmp_path / "docs.ragged"), length=length, separator=separator)},
                           batch_size=8, readers=readers, seed=4) as loader:
            assert len(loader.plan.plans["tokens"].parts) == 1
            for _, batch in zip(range(30), loader):
                for row, index in enumerate(batch.indices.tolist()):
                    window = slice(index * length, index * length + length + 1)
                    np.testing.assert_array_equal(batch["tokens"][row], stream[window])
                    # Documents numbered in order of appearance (an empty one, with no token, has no number).
                    segments = np.unique(owner[window], return_inverse=True)[1]
                    np.testing.assert_array_equal(batch["tokens.segments"][row], segments)


def test_write_ragged_takes_record_chunks_beside_single_records(tmp_path):
    from shmloader.tools.convert import RecordChunk

    records = [np.arange(n, dtype=np.int32) + n for n in (3, 0, 5, 1, 0, 7)]
    items = [records[0], RecordChunk(np.concatenate(records[1:4]), np.array([0, 5, 1])), RecordChunk(
        np.zeros(0, np.int32), np.zeros(0, np.int64)), records[4], RecordChunk(records[5], np.array([7]))]
    write_ragged(tmp_path / "mixed.ragged", items)
    with ShmDataLoader({"t": Packed(str(tmp_path / "mixed.ragged"))}, batch_size=6, mode="sequential",
                       readers=0) as loader:
        batch = next(loader)
        offsets = batch["t.offsets"].tolist()
        for i, record in enumerate(records):
            np.testing.assert_array_equal(batch["t"][offsets[i]:offsets[i + 1]], record)
    with pytest.raises(ValueError, match="lengths must be non-negative and sum to its 4 values"):
        write_ragged(tmp_path / "bad.ragged", [RecordChunk(np.zeros(4, np.int32), np.array([1, 2]))])
    assert not (tmp_path / "bad.ragged").exists()


@pytest.mark.parametrize("options", [dict(mode="shuffle"), dict(mode="random"), dict(mode="sequential"),
                                     dict(mode="shuffle", shuffle_window=4, shard_count=2)],
                         ids=["shuffle", "random", "sequential", "windowed-shards"])
def test_packed_without_max_elements_holds_a_batch_that_repeats_its_longest_record(tmp_path, options):
    """A batch can hold a record twice or more (crossing epochs, draws with replacement):
    before, a batch of 4 over 5 rows whose longest record came twice overflowed the region
    sized for the 4 longest distinct records, and the loader raised mid-run."""
    docs = [np.arange(n, dtype=np.int32) + 1000 * k for k, n in enumerate([3, 500, 2, 4, 1])]
    spec = write_ragged(tmp_path / "docs.ragged", docs)
    with ShmDataLoader({"docs": Packed(spec.path)}, batch_size=4, readers=0, seed=5, **options) as loader:
        repeated = 0
        for _ in range(60):
            batch = next(loader)
            offsets = batch["docs.offsets"]
            indices = batch.indices.tolist()
            repeated += indices.count(1) > 1
            for row, record in enumerate(indices):
                np.testing.assert_array_equal(batch["docs"][offsets[row]:offsets[row + 1]], docs[record])
    assert repeated or options["mode"] == "sequential"  # The case was met.


def test_packed_capacity_counts_each_record_as_often_as_a_batch_can_hold_it():
    from shmloader.plan.fields import packed_capacity

    lengths = np.array([3, 500, 2, 4, 1])
    assert packed_capacity(lengths, 4, 1) == 500 + 4 + 3 + 2
    assert packed_capacity(lengths, 4, 2) == 500 * 2 + 4 * 2
    assert packed_capacity(lengths, 4, 4) == 500 * 4
    assert packed_capacity(lengths, 5, 2) == 1000 + 8 + 3

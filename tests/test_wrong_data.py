"""The six ways an outside attack got wrong data out of the loader stay closed: files
replaced under a running loader, ragged shapes and offsets that wrap, a transform that
forks, writes ctx.indices, or keeps `out` for later, and 16-bit greyscale PNGs. Each test
drives the situation for real (files replaced on disk, readers killed, real forks) and
checks every delivered batch against a reference read, or the error that names the file."""

from __future__ import annotations

import io
import os
import signal

import numpy as np
import pytest
from conftest import float_rows, process_alive, wait_until, write_b2nd

from shmloader import ReaderError, ShmDataLoader, StorageError
from shmloader.plan.sampler import Sampler
from shmloader.storage.opening import open_field
from shmloader.storage.ragged import OFFSETS_NAME, SHAPES_NAME, describe_ragged
from shmloader.storage.spec import describe_field

CHANGED = "changed since the loader described it"


def _replace(path: str, array: np.ndarray) -> None:
    """Replaces `path` atomically by a new file holding `array`, as a data pipeline would."""
    staging = f"{path}.new.npy"
    if path.endswith(".b2nd"):
        staging = write_b2nd(f"{path}.new.b2nd", array)
    else:
        np.save(staging, array)
    os.replace(staging, path)


# 1. Files replaced under a running loader.

@pytest.mark.parametrize("kind", ["npy", "b2nd"])
def test_a_file_replaced_after_description_is_refused_when_a_reader_opens_it(tmp_path, kind):
    path = str(tmp_path / f"rows.{kind}")
    data = np.arange(4096, dtype=np.int64).reshape(512, 8)
    if kind == "npy":
        np.save(path, data)
    else:
        write_b2nd(path, data)
    spec = describe_field(path)
    # Same size and shape, another dtype: the bytes would be read as int64 without a word.
    _replace(path, np.arange(4096, dtype=np.float64).reshape(512, 8) if kind == "npy" else
             np.arange(2 * 4096, dtype=np.int64).reshape(1024, 8))
    with pytest.raises(StorageError, match=CHANGED) as raised:
        open_field(spec)
    assert path in str(raised.value)


def test_a_file_rewritten_in_place_is_refused(tmp_path):
    path = str(tmp_path / "rows.npy")
    np.save(path, np.arange(800, dtype=np.int32).reshape(100, 8))
    spec = describe_field(path)
    os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 1_000_000))  # A write in place moves mtime.
    with pytest.raises(StorageError, match=CHANGED):
        open_field(spec)


def test_an_unchanged_file_still_opens_and_reads_right(tmp_path):
    path = str(tmp_path / "rows.npy")
    data = np.arange(800, dtype=np.int32).reshape(100, 8)
    np.save(path, data)
    field = open_field(describe_field(path))
    out = np.empty((3, 8), dtype=np.int32)
    field.gather(np.array([5, 0, 99]), out)
    field.close()
    np.testing.assert_array_equal(out, data[[5, 0, 99]])


def test_a_file_replaced_under_a_running_loader_gives_an_error_never_wrong_batches(tmp_path):
    """The attack: a .npy replaced by one of the same size and another dtype, then a reader
    restart. Before: 191 of 200 batches wrong and no error."""
    path = str(tmp_path / "label.npy")
    labels = np.arange(4000, dtype=np.int64)
    np.save(path, labels)
    with ShmDataLoader({"label": path}, batch_size=16, readers=1, slots=4, mode="shuffle", seed=3) as loader:
        batch = next(loader)
        np.testing.assert_array_equal(batch["label"], labels[batch.indices])
        del batch
        _replace(path, np.arange(4000, dtype=np.float64))
        victim = loader.diagnostics.reader_pids[0]
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: not process_alive(victim), timeout=30)
        with pytest.raises(ReaderError, match=CHANGED) as raised:
            for _ in range(200):
                batch = next(loader)
                # Batches filled before the restart were read from the old file: still right.
                np.testing.assert_array_equal(batch["label"], labels[batch.indices])
                del batch
        assert path in str(raised.value)


# 2. Ragged shapes and offsets that wrap.

def _ragged(tmp_path, offsets, shapes=None, values=None):
    directory = tmp_path / "ragged"
    directory.mkdir()
    offsets = np.asarray(offsets, dtype=np.uint64)
    values = np.arange(int(offsets[-1]) if values is None else values, dtype=np.float32)
    write_b2nd(directory / "values.b2nd", values)
    write_b2nd(directory / OFFSETS_NAME, offsets)
    if shapes is not None:
        write_b2nd(directory / SHAPES_NAME, np.asarray(shapes))
    return str(directory)


def test_offsets_that_wrap_past_two_to_the_63_are_refused_naming_the_record(tmp_path):
    path = _ragged(tmp_path, [0, 10, 2**63 + 9, 8, 100])
    with pytest.raises(StorageError, match=r"decrease at record 2\b") as raised:
        describe_ragged(path)
    assert path in str(raised.value)


def test_negative_shapes_whose_product_wraps_to_the_length_are_refused(tmp_path):
    """(-2, -4) stored as int64 has the product 8 in uint64 arithmetic, like (2, 4)."""
    path = _ragged(tmp_path, [0, 8, 16], shapes=np.array([[2, 4], [-2, -4]], dtype=np.int64))
    with pytest.raises(StorageError, match=r"record 1\b.*negative"):
        describe_ragged(path)


def test_shapes_whose_product_overflows_64_bits_are_refused(tmp_path):
    """8 * (2**63 + 1) wraps to 8 in uint64: the product must be checked exactly."""
    path = _ragged(tmp_path, [0, 8, 16], shapes=np.array([[2, 4], [8, 2**63 + 1]], dtype=np.uint64))
    with pytest.raises(StorageError, match=r"record 1\b"):
        describe_ragged(path)


# 3-6. Transforms.

@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return float_rows(tmp_path_factory, "wrong_data_rows", 200)


def _expected_indices(step: int, rows: int = 200, batch_size: int = 8, seed: int = 0) -> np.ndarray:
    return Sampler(rows, batch_size, "shuffle", seed, 0, 1).fill(step)


def test_a_transform_that_forks_delivers_every_step_once_and_right(rows):
    """The child returned into the reader loop, published a slot a second time (step 53 with
    step 3's data) and then unlinked the live ring."""
    path, data = rows
    with ShmDataLoader({"data": path}, transform="transform_fixtures:forks", batch_size=8, readers=1,
                       slots=4) as loader:
        for step, batch in zip(range(40), loader):
            assert batch.step == step
            np.testing.assert_array_equal(batch.indices, _expected_indices(step))
            np.testing.assert_array_equal(batch["x"], data[batch.indices])
            del batch
        assert all(os.path.exists(f"/dev/shm/{name}") for name in
                   [loader.diagnostics.ring_name.lstrip("/"), "sem." + loader._session.ring.names.work.lstrip("/")])


def test_a_transform_cannot_change_the_indices_the_trainer_receives(rows):
    path, _ = rows
    with ShmDataLoader({"data": path}, transform="transform_fixtures:sorts_indices", batch_size=8, readers=1,
                       slots=4) as loader:
        with pytest.raises(ReaderError, match="read-only"):
            next(loader)


def test_a_transform_that_keeps_out_cannot_change_a_batch_after_its_call(rows):
    """Before: 32 of 40 delivered batches held the next call's late writes."""
    path, data = rows
    with ShmDataLoader({"data": path}, transform="transform_fixtures:writes_late", batch_size=8, readers=1,
                       slots=4) as loader:
        kept = []
        for step, batch in zip(range(40), loader):
            kept.append((batch.step, np.array(batch.indices), batch["x"]))  # Views: the slot stays held.
            if len(kept) > 2:
                kept.pop(0)
            for kept_step, indices, x in kept:
                np.testing.assert_array_equal(x, data[indices], err_msg=f"step {kept_step} seen at step {step}")
            del batch


def test_a_16_bit_greyscale_png_decodes_to_its_8_bit_values_with_pillow(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    from shmloader.transforms.images import ImageWriter

    grey = (np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * 61 % 65536).astype(np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(grey).save(buffer, format="PNG")
    data = np.frombuffer(buffer.getvalue(), dtype=np.uint8)
    expected = np.repeat((grey >> 8).astype(np.uint8)[:, :, None], 3, axis=2)
    decoders = ["pillow"]
    try:
        import cv2  # noqa: F401
        decoders.append("fast")
    except ImportError:
        pass
    for decoder in decoders:
        target = np.zeros((32, 32, 3), dtype=np.uint8)
        ImageWriter(decoder, "nearest").write(data, target, lambda height, width: (0, 0, height, width), False)
        np.testing.assert_array_equal(target, expected, err_msg=decoder)


@pytest.mark.parametrize("cparams", [
    {"filters": ["DELTA"], "codec": "LZ4"},           # each block stored against its chunk's first
    {"filters": ["SHUFFLE"], "codec": "ZSTD", "use_dict": True},  # a dictionary inside each chunk
])
def test_blocks_that_cannot_be_decoded_alone_are_read_right(tmp_path, cparams):
    """Found by an outside attack: the native gather decodes one block at a time, which
    DELTA (blocks relative to the chunk's first) reads wrong and a ZSTD dictionary fails."""
    import warnings

    import blosc2

    rng = np.random.default_rng(7)
    rows = np.cumsum(rng.integers(0, 5, size=(4000, 16)), axis=0).astype(np.int32)
    options = {"codec": getattr(blosc2.Codec, cparams["codec"]), "clevel": 5,
               "filters": [getattr(blosc2.Filter, name) for name in cparams["filters"]],
               "filters_meta": [0] * len(cparams["filters"]), "use_dict": cparams.get("use_dict", False)}
    path = tmp_path / "rows.b2nd"
    blosc2.asarray(rows, urlpath=str(path), mode="w", chunks=(1000, 16), blocks=(100, 16), cparams=options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Read through Blosc2's Python API: a slow-layout warning.
        with ShmDataLoader({"x": str(path)}, batch_size=500, mode="sequential", readers=1, epochs=1) as loader:
            got = np.concatenate([np.array(batch["x"]) for batch in loader])
    np.testing.assert_array_equal(got, blosc2.open(str(path))[:])

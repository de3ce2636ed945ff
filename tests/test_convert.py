"""Conversion is value-exact for every input kind and shape, atomic, and bounded in memory;
inspect measures a layout's cost and names the fix; poor layouts are flagged, good ones not."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import image_like, write_b2nd

from shmloader import StorageError
from shmloader.storage.layout import choose_layout, poor_layout
from shmloader.storage.opening import open_field
from shmloader.storage.spec import describe_field
from shmloader.tools.convert import convert
from shmloader.tools.inspection import inspect

HERE = pathlib.Path(__file__).resolve().parent


def read_all(path) -> np.ndarray:
    spec = describe_field(path)
    field = open_field(spec, spec.row_count)
    out = np.empty((spec.row_count, *spec.row_shape), dtype=spec.numpy_dtype)
    field.gather(np.arange(spec.row_count, dtype=np.uint64), out)
    field.close()
    return out


SHAPES = {
    "1-d": (1003,),
    "rows-of-3072": (517, 3072),
    "3-d-rows": (301, 3, 32, 32),
    "odd-rows": (257, 7, 5),
}


@pytest.fixture
def convert_layout_measured_no_slower(monkeypatch):
    """convert measures a .b2nd input's layout against its own before writing and keeps the
    input's where that reads faster (test_layout_advice.py); here the measurement says
    convert's is as fast, so that these tests check convert's own layout and values."""
    from shmloader.storage.layout_advice import Advice
    from shmloader.tools import convert as convert_module

    monkeypatch.setattr(convert_module, "measure_layout",
                        lambda spec, batch_size=256: Advice(spec, 1.0, 1.0, spec.row_count, batch_size, ()))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.float32, np.float64, np.bool_], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("source", ["npy", "b2nd-default", "b2nd-partial-chunks"])
def test_conversion_is_value_exact(tmp_path, shape, dtype, source, convert_layout_measured_no_slower):
    array = image_like(shape[0], shape[1:] or (1,), seed=6).reshape(shape)
    array = (array % 2).astype(dtype) if dtype == np.bool_ else array.astype(dtype)
    if source == "npy":
        np.save(tmp_path / "in.npy", array)
        path = tmp_path / "in.npy"
    elif source == "b2nd-default":
        path = write_b2nd(tmp_path / "in.b2nd", array, codec="ZSTD")
    else:
        chunks = (max(1, shape[0] // 3 + 1), *shape[1:])
        path = write_b2nd(tmp_path / "in.b2nd", array, chunks=chunks, blocks=(max(1, chunks[0] // 4), *shape[1:]))
    spec = convert(path, tmp_path / "out.b2nd", progress=False, piece_bytes=1 << 16)
    assert spec.row_contiguous and spec.codec in ("LZ4", "none")  # --codec auto decides.
    assert spec.dtype == np.dtype(dtype).str and (spec.row_count, *spec.row_shape) == shape
    assert np.array_equal(read_all(spec.path), array)


@pytest.mark.parametrize("codec", ["lz4", "blosclz", "zstd", "none"])
def test_codecs(tmp_path, codec):
    array = image_like(200, (64,), seed=1)
    np.save(tmp_path / "in.npy", array)
    spec = convert(tmp_path / "in.npy", tmp_path / "out.b2nd", codec=codec, progress=False)
    assert np.array_equal(read_all(spec.path), array)
    assert spec.codec == codec.upper() if codec != "none" else spec.codec == "none"
    assert inspect(spec.path, sample=4)["codec"] == spec.codec


def test_layout_choice():
    assert choose_layout(100_000, 3072) == (64, 1)  # One row per block for image rows.
    rows_per_chunk, rows_per_block = choose_layout(100_000, 8)
    assert rows_per_block == 512 and rows_per_chunk % rows_per_block == 0
    assert choose_layout(10, 8) == (10, 10)


def test_refuses_to_overwrite_and_never_leaves_a_partial_file(tmp_path, monkeypatch):
    np.save(tmp_path / "in.npy", np.arange(1000, dtype=np.int64))
    (tmp_path / "out.b2nd").write_text("precious")
    with pytest.raises(FileExistsError, match="out.b2nd exists.*--force"):
        convert(tmp_path / "in.npy", tmp_path / "out.b2nd", progress=False)
    assert (tmp_path / "out.b2nd").read_text() == "precious"

    import shmloader.tools.convert as module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "_progress_bar", lambda *a, **k: type("Bar", (), {"update": interrupted, "close": lambda self: None})())
    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "in.npy", tmp_path / "new.b2nd", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["in.npy", "out.b2nd"]
    monkeypatch.undo()
    convert(tmp_path / "in.npy", tmp_path / "out.b2nd", progress=False, force=True)
    assert np.array_equal(read_all(tmp_path / "out.b2nd"), np.arange(1000))


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.npy"):
        convert(tmp_path / "nothing.npy", tmp_path / "out.b2nd")
    (tmp_path / "text.npy").write_text("not an array")
    with pytest.raises(StorageError, match="text.npy"):
        convert(tmp_path / "text.npy", tmp_path / "out.b2nd")
    with pytest.raises(ValueError, match="codec"):
        convert(np.zeros((3, 3)), tmp_path / "out.b2nd", codec="gzip")
    with pytest.raises(StorageError, match="zero rows"):
        convert(np.zeros((0, 3)), tmp_path / "out.b2nd")
    assert not (tmp_path / "out.b2nd").exists()


def test_inspect_measures_and_names_the_fix(dataset):
    report = inspect(dataset["paths"]["images_default"], sample=16)
    assert report["poor_layout"] and report["fix"].startswith("shmloader convert ")
    assert report["random_row_us"] > 0 and report["codec"] == "ZSTD"
    good = inspect(dataset["paths"]["images_b2nd"], sample=16)
    assert not good["poor_layout"] and "fix" not in good
    assert good["blocks"][0] == 1 and good["compression_ratio"] > 0


def test_poor_layout_rule(dataset):
    assert poor_layout(describe_field(dataset["paths"]["images_default"]))
    assert not poor_layout(describe_field(dataset["paths"]["images_b2nd"]))
    assert not poor_layout(describe_field(dataset["paths"]["labels_b2nd"]))
    assert not poor_layout(describe_field(dataset["paths"]["images_npy"]))


def test_converting_a_large_b2nd_stays_within_a_small_memory_budget(tmp_path):
    """A 256 MiB (uncompressed) default-layout file converts in less than half that memory
    (its 16 MiB pieces bound the peak, not the file's size). The input's layout is the one
    Blosc2 picks by default on a machine with an 8 MiB L3 cache, given explicitly: Blosc2
    sizes default chunks from the host's cache (120 MiB chunks on a 480 MiB L3), and a
    piece is at least one input chunk, so the default would make the bound the host's."""
    import blosc2

    rows, row_bytes = 87_382, 3072  # 256 MiB.
    source = blosc2.empty((rows, row_bytes), dtype=np.uint8, urlpath=str(tmp_path / "big.b2nd"), mode="w",
                          chunks=(2720, row_bytes), blocks=(85, row_bytes))
    ramp = (np.arange(row_bytes) % 251).astype(np.uint8)
    for start in range(0, rows, 8192):
        stop = min(start + 8192, rows)
        source[start:stop] = np.broadcast_to(ramp, (stop - start, row_bytes)) + (np.arange(start, stop) % 7).astype(np.uint8)[:, None]
    del source
    # VmHWM: the peak resident size of this process image (ru_maxrss would include the
    # parent's, inherited across fork and exec).
    code = (
        "import re, sys; from shmloader.tools.convert import convert;"
        "peak = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1));"
        "before = peak(); convert(sys.argv[1], sys.argv[2], progress=False, piece_bytes=16 << 20); print(before, peak())"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big.b2nd"), str(tmp_path / "rows.b2nd")],
                            capture_output=True, text=True, cwd=HERE, timeout=300)
    assert result.returncode == 0, result.stderr
    before_kib, peak_kib = map(int, result.stdout.split())
    assert (peak_kib - before_kib) * 1024 < 128 << 20, (before_kib, peak_kib)  # Half the file.
    spec = describe_field(tmp_path / "rows.b2nd")
    field = open_field(spec, 8)
    out = np.empty((3, row_bytes), dtype=np.uint8)
    field.gather(np.array([0, 50_000, rows - 1], dtype=np.uint64), out)
    expected = np.stack([ramp + np.uint8(index % 7) for index in (0, 50_000, rows - 1)])
    assert np.array_equal(out, expected)
    field.close()


def test_auto_codec_stores_incompressible_data_plainly_and_compresses_the_rest(tmp_path):
    noise = np.random.default_rng(0).integers(0, 256, size=(2000, 512), dtype=np.uint8)
    labels = (np.arange(20000) % 10).astype(np.int64)
    np.save(tmp_path / "noise.npy", noise)
    np.save(tmp_path / "labels.npy", labels)
    stored = convert(tmp_path / "noise.npy", tmp_path / "noise.b2nd", progress=False)
    compressed = convert(tmp_path / "labels.npy", tmp_path / "labels.b2nd", progress=False)
    assert stored.clevel == 0
    assert compressed.clevel > 0 and compressed.uncompressed_bytes > 10 * compressed.compressed_bytes
    assert np.array_equal(read_all(stored.path), noise)
    assert np.array_equal(read_all(compressed.path), labels)

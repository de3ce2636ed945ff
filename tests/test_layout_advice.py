"""Layout advice follows a measurement: over layouts python-blosc2 writes (made here), the
loader and `inspect` advise `shmloader convert` only for a measured gain of at least 1.5x and
name the cause in the user's words, and `convert` keeps an input's layout where its own would
read slower. The measurements are replaced by given figures: no assertion depends on timing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from shmloader import PerformanceWarning, ShmDataLoader
from shmloader.storage import layout_advice
from shmloader.storage.layout_advice import Advice, causes, sample_batch, should_advise
from shmloader.storage.spec import describe_field
from shmloader.tools import convert as convert_module
from shmloader.tools.convert import convert

blosc2 = pytest.importorskip("blosc2")


def _write(path, data, **options):
    blosc2.asarray(data, urlpath=str(path), mode="w", **options)
    return describe_field(str(path))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Files as python-blosc2 writes them, each with the cause a user should be told."""
    directory = tmp_path_factory.mktemp("layouts")
    rng = np.random.default_rng(0)
    lz4 = blosc2.CParams(codec=blosc2.Codec.LZ4)
    labels = rng.integers(0, 1000, 200_000)
    return {
        "int64 in one LZ4 chunk": (_write(directory / "labels.b2nd", labels, chunks=(200_000,), cparams=lz4),
                                   labels, ["the whole array is one chunk of 200,000 rows", "a block of"]),
        "bool rows, defaults": (_write(directory / "bool.b2nd", bools := rng.random((50_000, 64)) > 0.5), bools,
                                ["a block of"]),
        "DELTA": (_write(directory / "delta.b2nd", steps := np.arange(40_000, dtype=np.int64).reshape(-1, 4),
                         cparams=blosc2.CParams(filters=[blosc2.Filter.DELTA], filters_meta=[0])), steps,
                  ["DELTA filter", "whole chunk"]),
        "blocks splitting rows": (_write(directory / "split.b2nd", images := rng.integers(0, 9, (200, 16, 16),
                                                                                        dtype=np.uint8),
                                         chunks=(50, 16, 16), blocks=(5, 8, 16)), images, ["split rows"]),
        "ZSTD, large blocks": (_write(directory / "zstd.b2nd", floats := rng.random((20_000, 32), dtype=np.float32),
                                      cparams=blosc2.CParams(codec=blosc2.Codec.ZSTD)), floats,
                               ["codec ZSTD", "a block of"]),
    }


@pytest.mark.parametrize("name", ["int64 in one LZ4 chunk", "bool rows, defaults", "DELTA", "blocks splitting rows",
                                  "ZSTD, large blocks"])
def test_each_layout_is_given_its_cause_in_the_users_words(layouts, name):
    spec, _, words = layouts[name]
    text = " and ".join(causes(spec))
    for word in words:
        assert word in text, text


def test_convert_output_has_no_named_cost(dataset):
    assert causes(describe_field(dataset["paths"]["labels_b2nd"]))[0].startswith("its codec and block size")


@pytest.mark.parametrize("gain,advised", [(0.6, False), (1.0, False), (1.49, False), (1.5, True), (20.0, True)])
def test_advice_only_from_a_gain_of_one_and_a_half(gain, advised):
    assert should_advise(gain) is advised


@pytest.mark.parametrize("batch,sample,rows,expected", [
    (256, 1_000_000, 2_000_000, 128),  # Half the file: half the batch, as many rows per block.
    (256, 600, 600, 256),              # The whole file: the batch itself.
    (4, 100, 1_000_000, 1),            # At least one row.
    (100_000, 500, 500, 500),          # At most the sample.
])
def test_a_sample_is_read_with_as_many_rows_per_block_as_the_loaders_batches(batch, sample, rows, expected):
    assert sample_batch(batch, sample, rows) == expected


def _fake_measure(gain: float, calls: list | None = None):
    def measure(spec, batch_size=256):
        if calls is not None:
            calls.append(batch_size)
        return Advice(spec, 1000.0, 1000.0 * gain, min(spec.row_count, 1000), batch_size, causes(spec))
    return measure


@pytest.mark.parametrize("gain", [0.7, 1.2, 1.49])
def test_the_loader_does_not_advise_a_layout_measured_no_faster(dataset, monkeypatch, gain):
    """1-D int64 in one LZ4 chunk was advised convert, and the converted file read at 0.7x."""
    monkeypatch.setattr(layout_advice, "measure", _fake_measure(gain))
    monkeypatch.setattr(layout_advice, "_measured", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        ShmDataLoader({"image": dataset["paths"]["images_default"]}, batch_size=4, readers=1, slots=2).close()


def test_the_loader_advises_a_measured_gain_with_its_cause_at_its_batch_size(dataset, monkeypatch):
    calls = []
    monkeypatch.setattr(layout_advice, "measure", _fake_measure(3.0, calls))
    monkeypatch.setattr(layout_advice, "_measured", {})
    with pytest.warns(PerformanceWarning, match=r"field 'image'.*3\.0x faster.*because .*codec ZSTD.*shmloader "
                                                r"convert") as record:
        ShmDataLoader({"image": dataset["paths"]["images_default"]}, batch_size=4, readers=1, slots=2).close()
    assert len(record) == 1 and calls == [4]


def test_a_real_measurement_of_a_good_layout_never_advises(dataset):
    """Convert's own output measured against convert's layout: no gain to advise."""
    spec = describe_field(dataset["paths"]["labels_b2nd"])
    advice = layout_advice.measure(spec, 256)
    assert advice is not None and advice.rows_per_s > 0 and advice.converted_rows_per_s > 0


def test_convert_keeps_an_input_layout_that_reads_faster_and_says_so(layouts, tmp_path, monkeypatch):
    spec, data, _ = layouts["int64 in one LZ4 chunk"]
    monkeypatch.setattr(convert_module, "measure_layout", _fake_measure(0.7))
    notes = []
    written = convert(spec.path, tmp_path / "kept.b2nd", progress=False, notes=notes, batch_size=4096)
    assert (written.chunks, written.blocks, written.codec) == (spec.chunks, spec.blocks, spec.codec)
    assert written.checksums and "kept the input's layout" in notes[0] and "4,096" in notes[0]
    np.testing.assert_array_equal(blosc2.open(written.path)[:], data)
    with ShmDataLoader({"label": written.path}, batch_size=1000, readers=1, slots=2, mode="sequential",
                       epochs=1) as loader:
        np.testing.assert_array_equal(np.concatenate([batch["label"].copy() for batch in loader]), data)


def test_convert_writes_its_own_layout_where_it_is_no_slower_or_where_told(layouts, tmp_path, monkeypatch):
    spec, data, _ = layouts["int64 in one LZ4 chunk"]
    calls = []
    monkeypatch.setattr(convert_module, "measure_layout", _fake_measure(1.0, calls))
    notes = []
    written = convert(spec.path, tmp_path / "own.b2nd", progress=False, notes=notes)
    assert written.chunks != spec.chunks and not notes and calls == [256]
    monkeypatch.setattr(convert_module, "measure_layout", _fake_measure(0.5, calls))
    told = convert(spec.path, tmp_path / "told.b2nd", progress=False, notes=notes, codec="lz4")
    assert told.chunks != spec.chunks and not notes and calls == [256]  # --codec given: not measured.
    np.testing.assert_array_equal(blosc2.open(told.path)[:], data)


def test_the_sample_stays_small_whatever_the_chunks(layouts):
    """One chunk of the whole array must not be read whole to measure it: the sample is about
    8 MiB, a few blocks at least, 64 MiB at most."""
    import dataclasses

    spec, _, _ = layouts["int64 in one LZ4 chunk"]
    huge = dataclasses.replace(spec, row_count=10**9, chunk_rows=10**9, block_rows=40_000)
    assert layout_advice.sample_rows(huge) == (8 << 20) // 8
    huge_blocks = dataclasses.replace(huge, block_rows=10**8)
    assert layout_advice.sample_rows(huge_blocks) == (64 << 20) // 8
    assert layout_advice.sample_rows(dataclasses.replace(spec, row_count=100)) == 100

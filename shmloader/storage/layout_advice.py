"""Whether re-laying a Blosc2 file out with `shmloader convert` would make its random rows
faster: measured on a sample against the layout convert writes, advised only for a real
gain, with the cause in the user's words."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import numpy as np

from .layout import choose_layout, compression_params, convert_command
from .opening import open_field
from .spec import FieldSpec, describe_field

# Advice is given only where convert's layout gathers random rows at least this many times
# faster than the file's own: below it, the gain would be lost in a run's noise and a
# converted file would cost the user a copy of the data for nothing.
ADVISE_GAIN_MIN = 1.5
# The sample: the file's first rows, about this many bytes of them. Convert's chunks hold at
# most 64 blocks, so a sample of a few of them reads as the whole converted file would.
_SAMPLE_BYTES = 8 << 20
_SAMPLE_BYTES_MAX = 64 << 20  # What the sample holds in memory at most, whatever the blocks.
# Rows in a batch where the caller names no batch size (`shmloader bench`'s default).
DEFAULT_BATCH_SIZE = 256
# Each side is timed for about this long after one untimed batch, and at most this many
# batches.
_TIME_PER_SIDE_S = 0.1
_BATCHES_MAX = 200
# "auto" stores data uncompressed where LZ4 gains less than this (tools/convert.py).
_AUTO_MIN_RATIO = 1.1
# Blocks this many times larger than convert's are named as the cause.
_LARGE_BLOCK_FACTOR = 4
# Codecs that decompress several times slower than LZ4.
_SLOW_CODECS = {"ZSTD", "ZLIB"}


@dataclasses.dataclass(frozen=True)
class Advice:
    """A measured comparison of a file's random-row gather with convert's layout."""

    spec: FieldSpec
    rows_per_s: float            # The file as it is, rows of the sample gathered per second.
    converted_rows_per_s: float  # The same rows in convert's layout.
    sample_rows: int
    batch_size: int
    causes: tuple[str, ...]

    @property
    def gain(self) -> float:
        return self.converted_rows_per_s / max(self.rows_per_s, 1e-9)

    @property
    def worth_it(self) -> bool:
        return should_advise(self.gain)

    def message(self) -> str:
        return (f"random rows read {self.gain:.1f}x faster after re-laying it out ({self.converted_rows_per_s:,.0f} "
                f"against {self.rows_per_s:,.0f} rows/s, measured on {self.sample_rows:,} rows in batches of "
                f"{self.batch_size:,}), because "
                f"{' and '.join(self.causes)}. Re-lay it out once with: {convert_command(self.spec)}")


def should_advise(gain: float) -> bool:
    """The rule: advise convert only for a gain of at least ADVISE_GAIN_MIN."""
    return gain >= ADVISE_GAIN_MIN


def causes(spec: FieldSpec) -> tuple[str, ...]:
    """What in the file's layout costs random rows, in the user's words (no measurement)."""
    if spec.kind != "b2nd":
        return ()
    found = []
    chunk_mb = spec.chunk_rows * spec.row_bytes / 1e6
    if spec.whole_chunks:
        found.append(f"its DELTA filter (or ZSTD dictionary) makes each row decompress its whole chunk "
                     f"({spec.chunk_rows:,} rows, {chunk_mb:,.1f} MB)")
    elif not spec.row_contiguous:
        found.append(f"its blocks {spec.blocks} split rows of shape {spec.row_shape}, which sends every row through "
                     f"Blosc2's slow per-row path")
    converted_chunk_rows, converted_block_rows = choose_layout(spec.row_count, spec.row_bytes)
    if spec.chunk_count == 1 and spec.row_count > converted_chunk_rows:
        found.append(f"the whole array is one chunk of {spec.row_count:,} rows ({chunk_mb:,.1f} MB)")
    if spec.row_contiguous and spec.block_rows >= _LARGE_BLOCK_FACTOR * converted_block_rows:
        found.append(f"each row decompresses a block of {spec.block_rows:,} rows "
                     f"({spec.block_rows * spec.row_bytes / 1024:,.0f} KiB), where convert's hold "
                     f"{converted_block_rows:,} ({converted_block_rows * spec.row_bytes / 1024:,.0f} KiB)")
    if spec.clevel > 0 and spec.codec.upper() in _SLOW_CODECS:
        found.append(f"its codec {spec.codec} decompresses several times slower than LZ4")
    if not found:
        found.append(f"its codec and block size ({spec.codec}, blocks of {spec.block_rows:,} rows)")
    return tuple(found)


def sample_rows(spec: FieldSpec) -> int:
    """How many of the file's first rows the comparison reads: about _SAMPLE_BYTES, at least
    a few of its blocks (what a row costs depends on its block, and on its whole chunk only
    where blocks depend on each other, which any sample pays), at most _SAMPLE_BYTES_MAX."""
    row_bytes = max(spec.row_bytes, 1)
    wanted = max(_SAMPLE_BYTES // row_bytes, 4 * max(spec.block_rows, 1))
    return max(1, min(spec.row_count, wanted, _SAMPLE_BYTES_MAX // row_bytes))


def sample_batch(batch_size: int, sample: int, row_count: int) -> int:
    """Rows per batch drawn from a sample of `sample` of `row_count` rows so that a batch
    meets as many rows per block as the loader's batches of `batch_size` over the whole
    file: rows sharing a block are decompressed once per batch, so large blocks cost less
    per row in large batches, and a sample must not change that."""
    return max(1, min(sample, round(batch_size * sample / max(row_count, 1))))


def gather_rate(spec: FieldSpec, rows: int, batch: int, seed: int = 0) -> float:
    """Random rows of the first `rows` gathered per second, in batches of `batch` as a
    reader gathers them."""
    field = open_field(spec, batch_size_max=batch, access="random")
    try:
        rng = np.random.default_rng(seed)
        out = np.empty((batch, *spec.row_shape), dtype=spec.numpy_dtype)
        field.gather(rng.integers(0, rows, size=batch, dtype=np.uint64), out)  # Maps the file: untimed.
        done, started = 0, time.perf_counter()
        for _ in range(_BATCHES_MAX):
            field.gather(rng.integers(0, rows, size=batch, dtype=np.uint64), out)
            done += batch
            if time.perf_counter() - started >= _TIME_PER_SIDE_S:
                break
        return done / max(time.perf_counter() - started, 1e-9)
    finally:
        field.close()


def write_converted_sample(spec: FieldSpec, rows: int, path: str) -> FieldSpec:
    """The file's first `rows` rows written to `path` as `shmloader convert` (codec auto)
    would lay out the whole file."""
    import blosc2

    source = blosc2.open(spec.path, mode="r")
    data = np.ascontiguousarray(source[:rows])
    chunk_rows, block_rows = choose_layout(spec.row_count, spec.row_bytes)
    chunks, blocks = (min(chunk_rows, rows), *spec.row_shape), (min(block_rows, rows), *spec.row_shape)
    itemsize = spec.numpy_dtype.itemsize
    written = blosc2.asarray(data, chunks=chunks, blocks=blocks, urlpath=path, mode="w",
                             cparams=compression_params("lz4", 5, itemsize, 1))
    if written.schunk.nbytes / max(written.schunk.cbytes, 1) < _AUTO_MIN_RATIO:  # What "auto" would store.
        del written
        written = blosc2.asarray(data, chunks=chunks, blocks=blocks, urlpath=path, mode="w",
                                 cparams=compression_params("none", 0, itemsize, 1))
    del written
    return describe_field(path)


def measure(spec: FieldSpec, batch_size: int = DEFAULT_BATCH_SIZE) -> Advice | None:
    """The file's gather against convert's layout on a sample of its rows, in batches like
    the loader's of `batch_size`; None for a file this cannot measure (not a local Blosc2
    file, no rows)."""
    if spec.kind != "b2nd" or spec.remote or spec.row_count == 0 or spec.row_bytes == 0:
        return None
    rows = sample_rows(spec)
    batch = sample_batch(batch_size, rows, spec.row_count)
    with tempfile.TemporaryDirectory(prefix="shmloader-layout-") as directory:
        converted = write_converted_sample(spec, rows, os.path.join(directory, "sample.b2nd"))
        # Alternated, twice each, the better of each kept: a moment of load on a shared
        # machine then slows one run, not one side.
        ours, theirs = [], []
        for _ in range(2):
            ours.append(gather_rate(spec, rows, batch))
            theirs.append(gather_rate(converted, rows, batch))
    return Advice(spec, max(ours), max(theirs), rows, batch_size, causes(spec))


_measured: dict[tuple, Advice | None] = {}


def advice_for(spec: FieldSpec, batch_size: int = DEFAULT_BATCH_SIZE) -> Advice | None:
    """measure(spec, batch_size), once per file version and batch size in this process (a
    loader built in a loop measures once)."""
    key = (spec.path, spec.identity, batch_size)
    if key not in _measured:
        _measured[key] = measure(spec, batch_size)
    return _measured[key]

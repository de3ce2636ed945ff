"""What a file's layout costs: `shmloader inspect` (layout, compression, measured random-row
cost) and the advice `shmloader convert` prints on compression for cold reads."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from .._native import ffi
from ..storage.layout import convert_command
from ..storage.layout_advice import DEFAULT_BATCH_SIZE, measure
from ..storage.opening import open_field
from ..storage.spec import FieldSpec, describe_field

__all__ = ["decompression_rate", "inspect", "io_advice", "measure_row_cost_us"]


def measure_row_cost_us(spec: FieldSpec, sample: int = 64, seed: int = 0) -> float:
    """Median time to gather one random row, over `sample` rows, in microseconds."""
    field = open_field(spec, batch_size_max=1)
    try:
        rng = np.random.default_rng(seed)
        out = np.empty(spec.row_bytes, dtype=np.uint8)
        timings = []
        for index in rng.integers(0, spec.row_count, size=sample, dtype=np.uint64):
            started = time.perf_counter()
            field.gather(np.array([index], dtype=np.uint64), out)
            timings.append((time.perf_counter() - started) * 1e6)
        return statistics.median(timings)
    finally:
        field.close()


# How much of a compressed file io_advice decompresses to time it: enough chunks that one
# read's overhead does not count, few enough to take a moment.
_ADVICE_BYTES = 32 << 20


def decompression_rate(spec: FieldSpec) -> float:
    """Uncompressed bytes per second one core gets out of the file's first chunks, through
    the native gather a reader runs: whole chunks as element ranges for a 1-D field (token
    streams, read as Windows), rows in order otherwise."""
    field = open_field(spec, batch_size_max=max(1, spec.chunk_rows))
    try:
        rows = max(1, min(spec.row_count, _ADVICE_BYTES // max(1, spec.row_bytes)))
        step = max(1, min(spec.chunk_rows, spec.row_count))
        out = np.empty((step, *spec.row_shape), dtype=spec.numpy_dtype)
        pointer = ffi.from_buffer("uint8_t[]", out.reshape(-1).view(np.uint8))
        one = np.ones(1, dtype=np.uint64)

        def read(first: int, count: int) -> None:
            if spec.row_shape == ():
                field.gather_ranges(np.array([first], np.uint64), one * np.uint64(count), np.zeros(1, np.uint64),
                                    pointer, count * spec.row_bytes)
            else:
                field.gather(np.arange(first, first + count, dtype=np.uint64), out[:count])

        read(0, step)  # The first read maps the file and warms the context: not timed.
        started, done = time.perf_counter(), 0
        for first in range(0, rows, step):
            count = min(step, rows - first)
            read(first, count)
            done += count
        return done * spec.row_bytes / max(time.perf_counter() - started, 1e-9)
    finally:
        field.close()


def io_advice(spec: FieldSpec) -> str:
    """When this file's compression pays for cold reads: a reader spends 1/rate decompressing
    each byte and reads 1/ratio of it, so the compressed file is faster only where the disk
    gives each reader less than rate * (1 - 1/ratio) (bench/cold_tokens.py measures both)."""
    ratio = spec.uncompressed_bytes / max(spec.compressed_bytes, 1)
    if spec.kind != "b2nd" or spec.clevel == 0 or ratio <= 1.0:
        return "stored uncompressed: cold reads run at the disk's speed"
    rate = decompression_rate(spec)
    threshold = rate * (1 - 1 / ratio)
    return (f"decompresses at {rate / 1e6:,.0f} MB/s on one core: compression pays for cold reads only where the disk "
            f"gives each reader less than {threshold / 1e6:,.0f} MB/s (a network volume, a shared disk); on a faster "
            f"one, or data that stays cached, --codec none reads faster")


def inspect(path: str | os.PathLike, sample: int = 64, batch_size: int = DEFAULT_BATCH_SIZE) -> dict:
    """What `shmloader inspect` prints: layout, compression ratio, measured row cost, and for
    a Blosc2 file the measured gain of convert's layout in batches of `batch_size`, with its
    causes and the command where it is worth it (at least 1.5x)."""
    spec = describe_field(path)
    report = {
        "path": spec.path,
        "format": spec.kind,
        "rows": spec.row_count,
        "row_shape": spec.row_shape,
        "dtype": str(spec.numpy_dtype),
        "row_bytes": spec.row_bytes,
    }
    if spec.kind == "b2nd":
        report.update(
            codec=spec.codec,
            clevel=spec.clevel,
            chunks=spec.chunks,
            blocks=spec.blocks,
            compression_ratio=round(spec.uncompressed_bytes / max(spec.compressed_bytes, 1), 2),
            row_contiguous=spec.row_contiguous,
            checksums=spec.checksums,
        )
    cost_us = measure_row_cost_us(spec, sample)
    report["random_row_us"] = round(cost_us, 2)
    report["random_row_MBps"] = round(spec.row_bytes / cost_us, 1) if cost_us > 0 else float("inf")
    advice = measure(spec, batch_size)
    report["poor_layout"] = bool(advice is not None and advice.worth_it)
    if advice is not None:
        report["batch_rows_per_s"] = round(advice.rows_per_s)
        report["converted_rows_per_s"] = round(advice.converted_rows_per_s)
        report["convert_gain"] = round(advice.gain, 2)
    if report["poor_layout"]:
        report["layout_costs"] = "; ".join(advice.causes)
        report["fix"] = convert_command(spec)
    elif advice is not None:
        report["advice"] = (f"keep this layout: convert's would read {advice.gain:.2f}x as fast in batches of "
                            f"{batch_size:,} (advised from 1.5x)")
    return report

"""Random-row gather speed in one process: this project's gather against numpy and Blosc2's own API.

Run: python bench/gather.py [--quick]
Data: 100,000 rows of 3,072 bytes and 8,000 rows of 150,528 bytes that compress like images,
as .npy and as `shmloader convert`ed LZ4 .b2nd (plus Blosc2's default layout for the
3 KB rows). Files are written to /tmp/shmloader-bench and removed at exit, or kept between
runs in $SHMLOADER_BENCH_DATA when it is set; they are read warm from the page cache: this measures gathering and decompression, not the disk.
It compares the loader's gather on a converted .b2nd with np.take on .npy and with a
per-row get_slice loop, for 3 KB and 150 KB rows.
Beside each rate: CPU seconds per million rows of the same measurement, this process's
user+system time over all its threads (Blosc2's included). Every method runs in this one
process and starts none, so no other process does part of its work (the loader benchmarks
run theirs in child processes to count their readers).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import numpy as np
from _common import best_rate_and_cpu, format_per_million, image_rows, machine_line, table

from shmloader.storage.blosc import BloscField
from shmloader.storage.opening import open_field
from shmloader.storage.spec import describe_field
from shmloader.tools.convert import convert

BATCH = 256
DATA_DIR = pathlib.Path(os.environ.get("SHMLOADER_BENCH_DATA", "/tmp/shmloader-bench"))
if "SHMLOADER_BENCH_DATA" not in os.environ:  # A cache only where asked for: over a GB otherwise stays in /tmp.
    import atexit
    import shutil

    atexit.register(shutil.rmtree, DATA_DIR, ignore_errors=True)


def child_environment() -> dict[str, str]:
    """The environment for a benchmark's child process (_common.run_contender): the data
    directory named, so that the child, which imports this module too, leaves it in place
    at its exit; only the process that chose /tmp/shmloader-bench removes it."""
    return {**os.environ, "SHMLOADER_BENCH_DATA": str(DATA_DIR)}


def _converted_here(path: str) -> bool:
    """Whether a cached file exists and was written by this version's converter (checksums
    and block digests)."""
    if not os.path.exists(path):
        return False
    spec = describe_field(path)
    return spec.checksums and spec.block_digests


def make_files(rows: int, row_bytes: int, with_default: bool) -> dict[str, str]:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    stem = DATA_DIR / f"rows{rows}x{row_bytes}"
    paths = {"npy": f"{stem}.npy", "b2nd": f"{stem}.lz4.b2nd"}
    if not os.path.exists(paths["npy"]):
        print(f"writing {paths['npy']} ...", file=sys.stderr)
        array = np.lib.format.open_memmap(paths["npy"] + ".partial", mode="w+", dtype=np.uint8, shape=(rows, row_bytes))
        for start in range(0, rows, 2048):
            stop = min(start + 2048, rows)
            array[start:stop] = image_rows(stop - start, row_bytes, seed=start)
        array.flush()
        del array
        os.replace(paths["npy"] + ".partial", paths["npy"])
    if not _converted_here(paths["b2nd"]):
        convert(paths["npy"], paths["b2nd"], codec="lz4", progress=False, force=True)
    paths["auto"] = f"{stem}.auto.b2nd"
    if not _converted_here(paths["auto"]):
        convert(paths["npy"], paths["auto"], codec="auto", progress=False, force=True)
    if with_default:
        paths["default"] = f"{stem}.default.b2nd"
        if not os.path.exists(paths["default"]):
            import blosc2

            blosc2.asarray(np.load(paths["npy"], mmap_mode="r"), urlpath=paths["default"] + ".partial", mode="w")
            os.replace(paths["default"] + ".partial", paths["default"])
    return paths


def ratio_of(path: str) -> str:
    spec = describe_field(path)
    if spec.kind != "b2nd":
        return "1.00"
    return f"{spec.uncompressed_bytes / spec.compressed_bytes:.2f}"


def measure(rows: int, row_bytes: int, quick: bool) -> dict[str, float]:
    import blosc2

    paths = make_files(rows, row_bytes, with_default=row_bytes < 10000)
    rng = np.random.default_rng(0)
    batches = [np.sort(rng.integers(0, rows, BATCH)).astype(np.uint64) for _ in range(64)]
    batches = [rng.permutation(batch) for batch in batches]  # Random order, as a shuffle gives.
    state = {"i": 0}

    def next_indices():
        state["i"] = (state["i"] + 1) % len(batches)
        return batches[state["i"]]

    out = np.empty((BATCH, row_bytes), dtype=np.uint8)
    repeats, seconds = (2, 0.1) if quick else (5, 0.3)
    rates, cases = {}, []

    ours_b2nd = open_field(describe_field(paths["b2nd"]), BATCH)
    cases.append(("shmloader gather, .b2nd LZ4 (converted)", paths["b2nd"], lambda: ours_b2nd.gather(next_indices(), out)))
    ours_auto = open_field(describe_field(paths["auto"]), BATCH)
    codec_chosen = "stored uncompressed" if describe_field(paths["auto"]).clevel == 0 else "LZ4"
    cases.append((f"shmloader gather, .b2nd --codec auto ({codec_chosen})", paths["auto"], lambda: ours_auto.gather(next_indices(), out)))
    ours_npy = open_field(describe_field(paths["npy"]), BATCH)
    cases.append(("shmloader gather, .npy", paths["npy"], lambda: ours_npy.gather(next_indices(), out)))
    table_npy = np.load(paths["npy"], mmap_mode="r")
    cases.append(("np.take(out=), .npy memmap", paths["npy"], lambda: np.take(table_npy, next_indices(), axis=0, out=out)))
    array_b2nd = blosc2.open(paths["b2nd"], mode="r")
    cases.append(("blosc2 arr[idx], .b2nd LZ4", paths["b2nd"], lambda: array_b2nd[next_indices()]))
    schunk = array_b2nd.schunk

    def get_slice_loop():
        for position, index in enumerate(next_indices()):
            start = int(index) * row_bytes
            schunk.get_slice(start, start + row_bytes, out=out[position])

    cases.append(("per-row schunk.get_slice(out=), .b2nd LZ4", paths["b2nd"], get_slice_loop))
    if "default" in paths:
        spec = describe_field(paths["default"])
        shared = BloscField(spec, BATCH, share_blocks=True)
        unshared = BloscField(spec, BATCH, share_blocks=False)
        cases.append(("shmloader gather, default layout, block sharing", paths["default"], lambda: shared.gather(next_indices(), out)))
        cases.append(("shmloader gather, default layout, row by row", paths["default"], lambda: unshared.gather(next_indices(), out)))
        # Sequential mode: a batch is 256 consecutive rows, so most rows share a block.
        window = np.arange(5000, 5000 + BATCH, dtype=np.uint64)
        cases.append(("default layout, sequential batch, block sharing", paths["default"], lambda: shared.gather(window, out)))
        cases.append(("default layout, sequential batch, row by row", paths["default"], lambda: unshared.gather(window, out)))
    print(f"\n## {rows:,} rows of {row_bytes:,} bytes, batches of {BATCH} random rows")
    lines = []
    for name, path, function in cases:
        slow = "get_slice" in name or "arr[idx]" in name or "default" in name
        rate, cpu_per_row = best_rate_and_cpu(function, BATCH, repeats=2 if slow else repeats, min_seconds=seconds)
        rates[name] = rate
        lines.append([name, f"{rate:,.0f}", f"{rate * row_bytes / 1e9:.2f}", format_per_million(cpu_per_row * 1e6),
                      ratio_of(path)])
    print(table(lines, ["method", "rows/s", "GB/s", "CPU s / M rows", "compression ratio"]))
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repeats")
    arguments = parser.parse_args()
    print(f"# gather benchmark ({machine_line()})")
    small = measure(100_000, 3072, arguments.quick)
    large = measure(8_000, 150_528, arguments.quick)
    ours, numpy_take = "shmloader gather, .b2nd LZ4 (converted)", "np.take(out=), .npy memmap"
    loop = "per-row schunk.get_slice(out=), .b2nd LZ4"
    print("\n## summary")
    share = small[ours] / small[numpy_take]
    print(f"3 KB rows: .b2nd gather / np.take .npy = {share:.0%}")
    speedup = small[ours] / small[loop]
    print(f"3 KB rows: .b2nd gather / get_slice loop = {speedup:.1f}x")
    share_large = large[ours] / large[numpy_take]
    print(f"150 KB rows: .b2nd gather / np.take .npy = {share_large:.0%}")
    sharing = small["shmloader gather, default layout, block sharing"] / small["shmloader gather, default layout, row by row"]
    relaid = small[ours] / small["shmloader gather, default layout, block sharing"]
    sequential = small["default layout, sequential batch, block sharing"] / small["default layout, sequential batch, row by row"]
    print(f"default layout, random rows: block sharing gains {sharing:.2f}x over row by row; re-laid out is {relaid:.0f}x faster still")
    print(f"default layout, sequential batches: block sharing gains {sequential:.1f}x over row by row")
    return 0


if __name__ == "__main__":
    sys.exit(main())

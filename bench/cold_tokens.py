"""Does compression pay for I/O? A token corpus (uint16 ids, Zipf-distributed like BPE
output) read cold as rows of `Windows(length=2048)` from a raw .npy and from `shmloader
convert` .b2nd files (LZ4 and ZSTD), sequentially and with a shuffle window, by a loader
confined to a memory group smaller than the corpus (the disk is then the bound).

    python bench/cold_tokens.py                     # 1.5 G tokens (3 GB raw), 2 GiB group
    python bench/cold_tokens.py --tokens 300000000 --limit-gib 0.4 --seconds 10

Needs root and /sys/fs/cgroup/memory (see bench/cold.py); files are kept in --directory.
Beside each rate: the CPU seconds per billion tokens of the trainer and its readers from
the run's start to their exit, and the trainer's own share (bench/_common.py, run_contender).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_mark, finish_child, machine_line, per_million, table  # noqa: E402
from cold import add_run_arguments, evict, parse_or_run_child, run_in_group  # noqa: E402

_LENGTH = 2048


def write_corpus(directory: str, tokens: int) -> dict[str, str]:
    """The corpus as raw .npy, and converted to LZ4 and ZSTD .b2nd (made once, kept)."""
    from shmloader.tools.convert import convert

    raw = os.path.join(directory, "tokens.npy")
    if not os.path.exists(raw) or np.load(raw, mmap_mode="r").shape != (tokens,):
        print(f"writing {tokens:,} tokens ...", flush=True)
        array = np.lib.format.open_memmap(raw + ".partial.npy", mode="w+", dtype=np.uint16, shape=(tokens,))
        rng = np.random.default_rng(0)
        for start in range(0, tokens, 1 << 24):
            stop = min(tokens, start + (1 << 24))
            # Zipf ranks folded into a 50,000-token vocabulary: frequent ids dominate, as in text.
            array[start:stop] = (rng.zipf(1.2, stop - start) - 1) % 50_000
        array.flush()
        del array
        os.replace(raw + ".partial.npy", raw)
    paths = {"npy": raw}
    for codec in ("lz4", "zstd"):
        path = os.path.join(directory, f"tokens.{codec}.b2nd")
        # Made again when the raw corpus is newer (another --tokens): a stale file would be
        # a smaller corpus that the memory group caches.
        if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(raw):
            print(f"converting to {codec} ...", flush=True)
            convert(raw, path, codec=codec, progress=False)
        paths[codec] = path
    return paths


def run_child(args) -> None:
    from shmloader import ShmDataLoader, Windows

    window = None if args.window == 0 else args.window
    mode = "sequential" if window is None else "shuffle"
    stream = np.load(args.reference, mmap_mode="r")
    with ShmDataLoader({"tokens": Windows(args.path, length=_LENGTH)}, batch_size=args.batch_size,
                       readers=args.readers, mode=mode, seed=1, shuffle_window=window) as loader:
        cpu_start = cpu_mark()
        rows, wrong, started = 0, 0, time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            batch = next(loader)
            first = int(batch.indices[0]) * _LENGTH  # One row a batch checked against the raw stream.
            wrong += not np.array_equal(batch["tokens"][0], stream[first:first + _LENGTH + 1])
            rows += len(batch.indices)
            del batch
        elapsed = time.perf_counter() - started
        cpu_end = cpu_mark()
    finish_child({"tokens": rows * _LENGTH, "seconds": elapsed, "wrong_batches": wrong, "cpu_start": cpu_start,
                  "cpu_end": cpu_end})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--directory", default="/var/tmp/shmloader_cold_tokens")
    parser.add_argument("--tokens", type=int, default=1_500_000_000)
    add_run_arguments(parser, batch_size=32)
    parser.add_argument("--window", type=int, default=65536, help="shuffle_window rows for the shuffled runs")
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    args = parse_or_run_child(parser, run_child)
    if args is None:
        return
    os.makedirs(args.directory, exist_ok=True)
    paths = write_corpus(args.directory, args.tokens)
    sizes = {name: os.path.getsize(path) for name, path in paths.items()}
    print(f"{machine_line()}; corpus {sizes['npy'] / 2**30:.2f} GiB raw, memory group {args.limit_gib:g} GiB, "
          f"{args.readers} readers, batch {args.batch_size} rows of {_LENGTH + 1} tokens, cold cache each run")
    rows, rates = [], {}
    for window in (0, args.window):
        for name, path in paths.items():
            for other in paths.values():
                evict(other)
            command = [sys.executable, os.path.abspath(__file__), "--child", "--path", path, "--reference",
                       paths["npy"], "--window", str(window), "--seconds", str(args.seconds), "--readers",
                       str(args.readers), "--batch-size", str(args.batch_size)]
            measured = run_in_group(command, int(args.limit_gib * 2**30), args.seconds + 300)
            rate = measured["tokens"] / measured["seconds"]
            order = "sequential" if window == 0 else f"shuffle_window={window:,}"
            rates[order, name] = rate
            # CPU per billion tokens (a million thousands): per million, every figure starts 0.0.
            rows.append([order, name, f"{sizes['npy'] / sizes[name]:.2f}", f"{rate / 1e6:,.1f}",
                         f"{rate / rates[order, 'npy']:.2f}", per_million(measured["cpu_s"], measured["tokens"] / 1e3),
                         per_million(measured["trainer_cpu_s"], measured["tokens"] / 1e3), measured["wrong_batches"]])
            print(" | ".join(str(cell) for cell in rows[-1]), flush=True)
    print(table(rows, ["order", "file", "ratio", "M tokens/s", "/ raw .npy", "CPU s / G tokens",
                       "trainer CPU s / G tokens", "wrong batches"]))


if __name__ == "__main__":
    main()

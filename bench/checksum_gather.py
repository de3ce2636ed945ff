"""What verify=True costs readers' gathers in their first batches, where every block read is a
first read: one reader in this process, or two forked readers with the loader's shared
record of checked blocks or a record each.

Run: python bench/checksum_gather.py [--batches 150] [--runs 30] [--pairs]
Data: bench/throughput.py's 100,000 rows of 3,072 bytes as converted LZ4 .b2nd (gather.py
writes it, kept in $SHMLOADER_BENCH_DATA where set). Each run opens the field afresh (a new
reader: nothing checked, the mapping's pages not faulted in yet) and gathers `--batches`
batches of 256 rows: every other step of a shuffled pass, one reader's share of twice that
many batches with two readers. Runs with verify on and off alternate, which goes first
swapped every pair; the CPU seconds of each run's gathers (a quieter figure than a loader's
rates on a shared machine) give, per percentile, on / off and the extra nanoseconds per
row. Other processes' load only adds time, so the low percentiles are the steadiest.
--pairs: each run is two processes forked at once, reading the odd and the even steps (as a
loader's two readers), with the checks off, with a record each, and with one shared record
(storage/checked_blocks.py, in shared memory as in the ring): their CPU seconds summed.
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import time

import numpy as np
from _common import machine_line
from gather import make_files

from shmloader import Sampler
from shmloader.storage.opening import open_field
from shmloader.storage.spec import describe_field

ROWS, ROW_BYTES, BATCH = 100_000, 3072, 256
_PERCENTILES = (10, 25, 50)
_PAIR_MODES = ("off", "own records", "shared record")


def run(spec, steps: list[np.ndarray], out: np.ndarray, verify: bool) -> float:
    """CPU seconds of one fresh field's gathers of `steps`."""
    field = open_field(spec, BATCH, verify=verify)
    try:
        started = time.process_time()
        for indices in steps:
            field.gather(indices, out)
        return time.process_time() - started
    finally:
        field.close()


def run_pair(spec, steps: list[list[np.ndarray]], out: np.ndarray, mode: str) -> float:
    """CPU seconds of two forked readers' gathers, started together (`mode`: _PAIR_MODES)."""
    from shmloader.storage import checked_blocks  # Here: one reader per run needs no record (older checkouts).

    pages = checked_blocks.record_pages([spec])
    memory = mmap.mmap(-1, pages * 4096, flags=mmap.MAP_SHARED)
    checked_blocks.write_record(memory, 0, pages, [spec])
    results, start = os.pipe(), os.pipe()
    children = []
    for reader in range(2):
        pid = os.fork()
        if pid == 0:  # A reader: nothing here returns.
            if mode == "shared record":
                checked_blocks.attach(memory, 0, pages)
            seconds = 0.0
            if os.read(start[0], 1):
                seconds = run(spec, steps[reader], out, verify=mode != "off")
            os.write(results[1], struct.pack("<d", seconds))
            os._exit(0)
        children.append(pid)
    os.write(start[1], b"go")
    total = sum(struct.unpack("<d", os.read(results[0], 8))[0] for _ in children)
    for pid in children:
        os.waitpid(pid, 0)
    for descriptor in (*results, *start):
        os.close(descriptor)
    memory.close()
    return total


def report(times: dict, baseline, rows: int) -> None:
    for percentile in _PERCENTILES:
        base = float(np.percentile(times[baseline], percentile))
        parts = [f"{name} {float(np.percentile(values, percentile)) * 1e3:.1f} ms" for name, values in times.items()]
        ratios = [f"{name} / {baseline} {float(np.percentile(values, percentile)) / base:.3f} "
                  f"({(float(np.percentile(values, percentile)) - base) / rows * 1e9:.0f} ns more per row)"
                  for name, values in times.items() if name != baseline]
        print(f"p{percentile}: {', '.join(parts)} of CPU; {'; '.join(ratios)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--runs", type=int, default=30, help="runs of each kind")
    parser.add_argument("--pairs", action="store_true", help="two forked readers per run (see above)")
    arguments = parser.parse_args()
    spec = describe_field(make_files(ROWS, ROW_BYTES, with_default=False)["b2nd"])
    sampler = Sampler(spec.row_count, BATCH, "shuffle", seed=1)
    steps = [[np.empty(BATCH, dtype=np.uint64) for _ in range(arguments.batches)] for _ in range(2)]
    for reader, own in enumerate(steps):
        for index, indices in enumerate(own):
            sampler.fill(2 * index + reader, indices)
    out = np.empty((BATCH, ROW_BYTES), dtype=np.uint8)
    if arguments.pairs:
        kinds = {mode: (lambda mode=mode: run_pair(spec, steps, out, mode)) for mode in _PAIR_MODES}
        rows, what = 2 * arguments.batches * BATCH, "two forked readers per run"
    else:
        kinds = {f"verify {'on' if verify else 'off'}": (lambda verify=verify: run(spec, steps[0], out, verify))
                 for verify in (True, False)}
        rows, what = arguments.batches * BATCH, "one reader per run"
    for measure in kinds.values():  # Warm-up: the file's pages into the page cache.
        measure()
    times = {name: [] for name in kinds}
    for turn in range(arguments.runs):  # Alternated, the order reversed every other turn.
        for name in (list(kinds) if turn % 2 == 0 else list(kinds)[::-1]):
            times[name].append(kinds[name]())
    print(f"# checksum cost of readers' first gathers ({machine_line()})")
    print(f"{rows:,} rows ({arguments.batches} batches of {BATCH} a reader), {what}, fresh fields, "
          f"{arguments.runs} runs of each kind")
    report(times, "off" if arguments.pairs else "verify off", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

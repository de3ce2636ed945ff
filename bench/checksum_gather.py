"""What verify=True costs one reader's gathers, in one process: its first batches, where every
block it reads is a first read.

Run: python bench/checksum_gather.py [--batches 150] [--runs 30]
Data: bench/throughput.py's 100,000 rows of 3,072 bytes as converted LZ4 .b2nd (gather.py
writes it, kept in $SHMLOADER_BENCH_DATA where set). Each run opens the field afresh (a new
reader: nothing checked, the mapping's pages not faulted in yet) and gathers `--batches`
batches of 256 rows: every other step of a shuffled pass, one reader's share of twice that
many batches with two readers. Runs with verify on and off alternate, which goes first
swapped every pair; the CPU seconds of each run's gathers (this process alone: a quieter
figure than a loader's rates on a shared machine) give, per percentile, on / off and the
extra nanoseconds per row. Other processes' load only adds time, so the low percentiles
are the steadiest.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import machine_line
from gather import make_files

from shmloader import Sampler
from shmloader.storage.opening import open_field
from shmloader.storage.spec import describe_field

ROWS, ROW_BYTES, BATCH = 100_000, 3072, 256
_PERCENTILES = (10, 25, 50)


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--runs", type=int, default=30, help="runs with verify on, and as many off")
    arguments = parser.parse_args()
    spec = describe_field(make_files(ROWS, ROW_BYTES, with_default=False)["b2nd"])
    sampler = Sampler(spec.row_count, BATCH, "shuffle", seed=1)
    steps = [np.empty(BATCH, dtype=np.uint64) for _ in range(arguments.batches)]
    for index, indices in enumerate(steps):
        sampler.fill(2 * index, indices)
    out = np.empty((BATCH, ROW_BYTES), dtype=np.uint8)
    times = {True: [], False: []}
    for verify in (True, False):  # Warm-up: the file's pages into the page cache.
        run(spec, steps, out, verify)
    for pair in range(arguments.runs):
        for verify in ((True, False) if pair % 2 == 0 else (False, True)):
            times[verify].append(run(spec, steps, out, verify))
    rows = arguments.batches * BATCH
    print(f"# checksum cost of one reader's gathers ({machine_line()})")
    print(f"{rows:,} rows ({arguments.batches} batches of {BATCH}) from a fresh field per run, "
          f"{arguments.runs} runs each")
    for percentile in _PERCENTILES:
        on, off = (float(np.percentile(times[verify], percentile)) for verify in (True, False))
        print(f"p{percentile}: verify on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms of CPU: on / off {on / off:.3f}, "
              f"{(on - off) / rows * 1e9:.0f} ns more per row")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

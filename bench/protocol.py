"""The wake-up and claim protocol alone: the real ring, native next() and reader loop, with
readers as threads whose fill is a sleep (shmloader.testing.simulation), so R readers act like R
readers on R free cores even on this 2-core machine. The trainer consumes as fast as it
can, or takes a step of its own (--consume-ms); ideal batches/s = the lesser of the
readers' rate while busy and the trainer's rate outside next(). What must go to zero: the
readers' starved time (asleep while a slot was requested) while the trainer waits.

Run: python bench/protocol.py [--readers 1,2,4,8,14] [--fill-ms 2] [--batches 1500]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np
from _common import machine_line, table

from shmloader.testing.simulation import simulated_loader


def fill_time(fill_s: float, slow_every: int, slow_factor: float):
    """Every slow_every-th step (by a fixed hash of the step) takes slow_factor times longer:
    the uneven fills of real readers (a page fault, a preemption, a large record)."""
    if not slow_every:
        return lambda step, reader: fill_s
    return lambda step, reader: fill_s * (slow_factor if (step * 0x9E3779B1) % 2**32 % slow_every == 0 else 1)


def run(path: str, readers: int, fill, batches: int, slots: int | None, consume_s: float) -> dict:
    import time

    with simulated_loader(path, readers, fill, batch_size=8, slots=slots) as loader:
        consumed_s = 0.0
        for step, batch in zip(range(batches), loader):
            if int(batch.indices[0]) != step:
                raise AssertionError(f"step {step} got a slot filled for step {int(batch.indices[0])}")
            if consume_s:
                began = time.perf_counter()
                time.sleep(consume_s)
                consumed_s += time.perf_counter() - began
        stats = loader.stats()
    per_reader = stats["readers"]
    elapsed = stats["elapsed_s"]
    # The rates the parts reached on their own (sleeps overshoot what they ask for): the
    # readers' filling when busy, and the trainer's step outside next().
    readers_rate = sum(r["batches"] / r["busy_s"] for r in per_reader if r["busy_s"])
    return {
        "batches_per_s": stats["batches_per_s"],
        "ideal": min(readers_rate, batches / consumed_s if consumed_s else float("inf")),
        "wait": stats["wait_fraction"],
        "busy": float(np.mean([r["busy_fraction"] for r in per_reader])),
        "starved": sum(r["starved_s"] for r in per_reader) / (elapsed * readers) if elapsed else 0.0,
        "per_wakeup": float(np.mean([r["batches_per_wakeup"] for r in per_reader])),
        "slots": loader.slots,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readers", default="1,2,4,8,14", help="reader counts (default 1,2,4,8,14)")
    parser.add_argument("--fill-ms", type=float, default=2.0, help="each fill's duration (default 2 ms)")
    parser.add_argument("--consume-ms", type=float, default=0.0, help="the trainer's step per batch (default 0)")
    parser.add_argument("--batches", type=int, default=1500, help="batches per run (default 1500)")
    parser.add_argument("--slots", type=int, default=None, help="slots (default: the loader's default)")
    parser.add_argument("--slow-every", type=int, default=0, help="one step in N is slow (default: none)")
    parser.add_argument("--slow-factor", type=float, default=5.0, help="how much slower (default 5)")
    args = parser.parse_args(argv)
    fill_s, consume_s = args.fill_ms / 1e3, args.consume_ms / 1e3
    print(machine_line())
    slow = f", one step in {args.slow_every} {args.slow_factor:g}x slower" if args.slow_every else ""
    print(f"simulated fills of {args.fill_ms} ms{slow}, trainer step {args.consume_ms} ms, {args.batches} batches "
          f"per run")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/rows.npy"
        np.save(path, np.zeros((64, 4), np.float32))
        for readers in (int(x) for x in args.readers.split(",")):
            fill = fill_time(fill_s, args.slow_every, args.slow_factor)
            result = run(path, readers, fill, args.batches, args.slots, consume_s)
            rows.append([readers, result["slots"], f"{result['batches_per_s']:,.0f}", f"{result['ideal']:,.0f}",
                         f"{result['batches_per_s'] / result['ideal']:.0%}", f"{result['wait']:.0%}",
                         f"{result['busy']:.0%}", f"{result['starved']:.1%}", f"{result['per_wakeup']:.1f}"])
    print(table(rows, ["readers", "slots", "batches/s", "ideal", "of ideal", "trainer waits", "readers busy",
                       "readers starved", "batches/wake-up"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What audit_log costs the trainer: the loader warm (data in the page cache) with the log on
and off, in alternated rounds, and next()'s own time when the batch is ready.

Run: python bench/audit_cost.py [--rounds 6] [--batches 400]
Data: 20,000 rows of 3,072 bytes plus an int64 label (.npy), batches of 256, in a temporary
directory. Each round runs both settings in turn (the order swapped every round), each in
a fresh loader after a warm-up of 20 batches: rows/s over --batches batches, and the median
time of next() inside a loop whose simulated training step (2 ms) leaves the readers time
to fill the ring, so that next() finds its batch ready (the cost the log adds is then
all of what it measures); then the writer's step alone in a tight loop. Nothing is
written; copy the printout to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from shmloader import ShmDataLoader

ROWS, ROW_BYTES, BATCH = 20_000, 3072, 256
_STEP_SECONDS = 0.002


def throughput(fields: dict, batches: int, log: str | None) -> float:
    with ShmDataLoader(fields, batch_size=BATCH, readers=1, seed=1, audit_log=log) as loader:
        for _ in range(20):
            next(loader)
        start = time.perf_counter()
        for _ in range(batches):
            batch = next(loader)
            int(batch["image"][:, 0].sum())
        return batches * BATCH / (time.perf_counter() - start)


def next_median_us(fields: dict, batches: int, log: str | None) -> float:
    with ShmDataLoader(fields, batch_size=BATCH, readers=1, seed=1, audit_log=log) as loader:
        for _ in range(20):
            next(loader)
        times = []
        for _ in range(batches):
            deadline = time.perf_counter() + _STEP_SECONDS
            while time.perf_counter() < deadline:
                pass
            start = time.perf_counter_ns()
            next(loader)
            times.append(time.perf_counter_ns() - start)
        return statistics.median(times) / 1000


def writer_step_us(directory: str, name: str, records: int = 20_000) -> float:
    """AuditWriter.step alone, in a tight loop over a batch of BATCH indices."""
    from shmloader.audit_log import AuditWriter

    class Delivered:
        indices, step = np.arange(BATCH, dtype=np.uint64), 0

    writer = AuditWriter(os.path.join(directory, name))
    try:
        writer.begin({}, None, True)
        batch = Delivered()
        start = time.perf_counter_ns()
        for _ in range(records):
            writer.step(batch)
        return (time.perf_counter_ns() - start) / records / 1000
    finally:
        writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", type=int, default=400)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        fields = {"image": os.path.join(directory, "image.npy"), "label": os.path.join(directory, "label.npy")}
        np.save(fields["image"], np.random.default_rng(0).integers(0, 255, (ROWS, ROW_BYTES), dtype=np.uint8))
        np.save(fields["label"], np.arange(ROWS, dtype=np.int64))
        results = {"off": [], "on": []}
        ready = {"off": [], "on": []}
        for number in range(arguments.rounds):
            order = ("off", "on") if number % 2 == 0 else ("on", "off")
            for setting in order:
                log = None if setting == "off" else os.path.join(directory, f"audit-{number}.log")
                results[setting].append(throughput(fields, arguments.batches, log))
                ready[setting].append(next_median_us(fields, arguments.batches // 2, log))
        log_bytes = sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
                        if name.startswith("audit-"))
        alone = [writer_step_us(directory, f"alone-{number}.log") for number in range(3)]
    for setting in ("off", "on"):
        rates = results[setting]
        print(f"audit_log {setting:>3}: rows/s median {statistics.median(rates):,.0f} (min {min(rates):,.0f}, max "
              f"{max(rates):,.0f}); next() ready median {statistics.median(ready[setting]):.1f} us (rounds: "
              f"{', '.join(f'{value:.1f}' for value in ready[setting])})")
    ratios = [on / off for on, off in zip(results["on"], results["off"])]
    print(f"on/off rows/s per round: {', '.join(f'{ratio:.3f}' for ratio in ratios)}; median "
          f"{statistics.median(ratios):.3f}")
    print(f"AuditWriter.step alone: {', '.join(f'{value:.1f}' for value in alone)} us a step (tight loop)")
    print(f"log bytes written: {log_bytes:,} ({log_bytes / (arguments.rounds * arguments.batches * 1.5):.0f} per step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

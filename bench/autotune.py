"""readers="auto", slots="auto" against a sweep of fixed readers x slots, in one run: warm .npy
rows, a map-style Dataset whose __getitem__ computes (a sort of a few thousand floats), and
that Dataset under a training step that is slow (--step-ms) for --slow-seconds, then free
(stepchange: rows/s after the change, and how soon auto's reader count moved).
Contenders alternate within each round (the order rotates from round to round); medians and
spreads over the rounds are printed.

    python bench/autotune.py [--rounds 3] [--seconds 3] [--warmup 1.5] [--readers 1,2,4]
                             [--cases npy,dataset,stepchange] [--step-ms 20] [--slow-seconds 6] [--write]

Each contender is built, iterated for --warmup seconds (auto adapts there, as it would in a
job's first seconds; the fixed ones fill their rings), then timed for --seconds: rows/s,
and the trainer's CPU per batch (its process time, every thread). Auto's reader count at
the end of each run and its last change are printed. The fixed sweep: --readers, each with
2 * readers + 2 and 4 * readers + 2 slots (the default). The best fixed contender is the
one with the highest median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import add_write_argument, command_line, machine_line, record, table  # noqa: E402

_NPY_ROWS, _NPY_ROW_FLOATS, _NPY_BATCH = 1 << 18, 64, 1024
_DATASET_BATCH, _SORTED_FLOATS = 64, 4096


class Computed:
    """A Dataset whose samples cost CPU: each sorts _SORTED_FLOATS floats drawn from its index."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int):
        values = np.random.default_rng(index).random(_SORTED_FLOATS, dtype=np.float32)
        return {"x": np.sort(values)[:64], "label": index}


def _loader(case: str, path: str, readers, slots):
    from shmloader import ShmDataLoader

    if case == "npy":
        return ShmDataLoader(path, batch_size=_NPY_BATCH, readers=readers, slots=slots)
    return ShmDataLoader.from_dataset(Computed(), batch_size=_DATASET_BATCH, readers=readers, slots=slots)


def _run(case: str, path: str, readers, slots, warmup_s: float, seconds: float) -> dict:
    """One contender's run: rows/s over `seconds` after `warmup_s`, trainer CPU ms a batch."""
    with _loader(case, path, readers, slots) as loader:
        iterator = iter(loader)
        end = time.perf_counter() + warmup_s
        while time.perf_counter() < end:
            next(iterator)
        batches, started, cpu_started = 0, time.perf_counter(), time.process_time()
        end = started + seconds
        while time.perf_counter() < end:
            next(iterator)
            batches += 1
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        stats = loader.stats()
        return {"rows_per_s": batches * loader.batch_size / elapsed, "trainer_ms": 1e3 * cpu / max(1, batches),
                "readers": stats["reader_count"], "slots": loader.slots, "change": stats["reader_change"]}


def _run_step_change(path: str, readers, slots, slow_s: float, seconds: float, step_ms: float) -> dict:
    """The Dataset case with a training step of `step_ms` (a sleep) for `slow_s`, then none
    for `seconds`: rows/s over that second phase and over its last half (once auto had time
    to adapt), and how long after the change auto's reader count first moved."""
    with _loader("dataset", path, readers, slots) as loader:
        iterator = iter(loader)
        end = time.perf_counter() + slow_s
        while time.perf_counter() < end:
            next(iterator)
            time.sleep(step_ms / 1e3)
        readers_slow = loader.stats()["reader_count"]
        started, cpu_started = time.perf_counter(), time.process_time()
        half, end = started + seconds / 2, started + seconds
        batches = batches_late = 0
        adapted_s = None
        while (now := time.perf_counter()) < end:
            next(iterator)
            batches += 1
            batches_late += now >= half
            if adapted_s is None and batches % 16 == 0 and loader.stats()["reader_count"] != readers_slow:
                adapted_s = now - started
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return {"rows_per_s": batches * loader.batch_size / elapsed, "trainer_ms": 1e3 * cpu / max(1, batches),
                "late_rows_per_s": batches_late * loader.batch_size / (elapsed - seconds / 2),
                "readers_slow": readers_slow, "readers": loader.stats()["reader_count"], "adapted_s": adapted_s,
                "slots": loader.slots, "change": loader.stats()["reader_change"]}


def _contenders(readers: list[int]) -> list[tuple[str, object, object]]:
    fixed = [(f"readers={count}, slots={slots}", count, slots) for count in readers
             for slots in (2 * count + 2, 4 * count + 2)]
    return [("auto", "auto", "auto"), *fixed]


def _late(run: dict) -> str:
    if "late_rows_per_s" not in run:
        return ""
    moved = "never" if run["adapted_s"] is None else f"after {run['adapted_s']:.2f} s"
    return f", second half {run['late_rows_per_s']:,.0f} rows/s, readers moved {moved}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--cases", default="npy,dataset,stepchange")
    parser.add_argument("--readers", default="1,2,4")
    parser.add_argument("--step-ms", type=float, default=20.0, help="stepchange: the slow phase's training step")
    parser.add_argument("--slow-seconds", type=float, default=6.0, help="stepchange: the slow phase's length")
    add_write_argument(parser)
    arguments = parser.parse_args()
    contenders = _contenders([int(count) for count in arguments.readers.split(",")])
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "rows.npy")
        np.save(path, np.random.default_rng(0).random((_NPY_ROWS, _NPY_ROW_FLOATS), dtype=np.float32))
        for case in arguments.cases.split(","):
            runs = {name: [] for name, _, _ in contenders}
            for round_index in range(arguments.rounds):
                shift = round_index % len(contenders)
                for name, readers, slots in contenders[shift:] + contenders[:shift]:
                    if case == "stepchange":
                        run = _run_step_change(path, readers, slots, arguments.slow_seconds, arguments.seconds,
                                               arguments.step_ms)
                    else:
                        run = _run(case, path, readers, slots, arguments.warmup, arguments.seconds)
                    runs[name].append(run)
                    print(f"{case} round {round_index}: {name}: {run['rows_per_s']:,.0f} rows/s, trainer "
                          f"{run['trainer_ms']:.3f} ms/batch, readers {run.get('readers_slow', '')}"
                          f"{'->' if 'readers_slow' in run else ''}{run['readers']}, slots {run['slots']}"
                          f"{_late(run)}", flush=True)
            medians = {name: statistics.median(run["rows_per_s"] for run in found) for name, found in runs.items()}
            best = max((name for name in medians if name != "auto"), key=medians.get)
            for name, found in runs.items():
                rates = [run["rows_per_s"] for run in found]
                rows.append([case, name, f"{medians[name]:,.0f} ({min(rates):,.0f}-{max(rates):,.0f})",
                             f"{medians[name] / medians[best]:.2f}",
                             f"{statistics.median(run['trainer_ms'] for run in found):.3f}",
                             "/".join(f"{run['readers_slow']}->{run['readers']}" if "readers_slow" in run
                                      else str(run["readers"]) for run in found), str(found[0]["slots"])])
            if case == "stepchange":
                late = {name: statistics.median(run["late_rows_per_s"] for run in found)
                        for name, found in runs.items()}
                adapted = [run["adapted_s"] for run in runs["auto"] if run["adapted_s"] is not None]
                notes.append(f"stepchange: after the step got fast, auto's readers moved "
                             f"{', '.join(f'{seconds:.2f}' for seconds in adapted) or 'never'} s after the change; "
                             f"the second half's rows/s, auto / best fixed: "
                             f"{late['auto'] / max(late[name] for name in late if name != 'auto'):.2f}")
            changes = [run["change"] for run in runs["auto"] if run["change"] is not None]
            notes.append(f"{case}: best fixed {best}; auto's last change: {changes[-1] if changes else 'none'}")
    header = ["case", "contender", "rows/s median (min-max)", "/ best fixed", "trainer CPU ms/batch",
              "readers at the end, by round", "slots"]
    print()
    print(table(rows, header))
    for note in notes:
        print(note)
    load = os.getloadavg()[0]
    notes.append(f"load average (1 min) at the end: {load:.1f}")
    record("autotune", command_line("autotune.py"), header, rows, notes=notes, write=arguments.write)
    print(machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""readers="auto", slots="auto" against a sweep of fixed readers x slots, in one run: warm .npy
rows, warm .b2nd rows (LZ4, rows that compress like images), JPEG decode (small synthetic JPEGs,
the fast decoder, a random resized crop), a map-style Dataset whose __getitem__ computes (a sort
of a few thousand floats), a shuffle window over a file read cold (cold), that Dataset under a
training step that is slow (--step-ms) for --slow-seconds, then free (stepchange), and 2 and 4
ranks under torchrun whose steps cost unequal times (torchrun: bench/_autotune_ranks.py).
Contenders alternate within each round (the order rotates from round to round); medians and
spreads over the rounds are printed.

    python bench/autotune.py [--rounds 3] [--seconds 3] [--warmup 1.5] [--readers 1,2,4]
                             [--cases npy,b2nd,jpeg,dataset,cold,stepchange,torchrun]
                             [--step-ms 20] [--slow-seconds 6] [--fast-seconds 8] [--ranks 2,4] [--write]

Each contender is built, iterated for --warmup seconds (auto adapts there, as it would in a
job's first seconds; the fixed ones fill their rings), then timed for --seconds: rows/s,
and the trainer's CPU per batch (its process time, every thread). Auto's reader count at
the end of each run and its last change are printed. The fixed sweep: --readers, each with
2 * readers + 2 and 4 * readers + 2 slots (the default). The best fixed contender is the
one with the highest median.

cold: each run in a child process, inside a cgroup-v1 memory group of --cold-limit-mib (root
and /sys/fs/cgroup/memory; bench/cold.py's), below the file's size, and the file's pages
dropped (posix_fadvise DONTNEED) before it starts: every run reads the file from the disk.
Without the group (not root) the file is only dropped before each run, and the run says so.

The run's loaders share a node reader budget of their own (SHMLOADER_BUDGET_SCOPE, unless set):
another job's loaders on a shared host would otherwise hold part of auto's budget.

stepchange: the fast phase lasts --fast-seconds; rows/s over it and over its part after
--adapt-seconds (the time auto is given to adapt, 5 s; at most half the phase), and how long
after the change auto's reader count first moved.
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

from _autotune_ranks import last_decision  # noqa: E402
from _common import (  # noqa: E402
    add_write_argument,
    command_line,
    cpu_mark,
    finish_child,
    image_rows,
    machine_line,
    record,
    table,
)

_NPY_ROWS, _NPY_ROW_FLOATS, _NPY_BATCH = 1 << 18, 64, 1024
_B2ND_ROWS, _B2ND_ROW_BYTES, _B2ND_BATCH = 1 << 14, 3072, 256
# Small JPEGs (a run is seconds), decoded and cropped to _JPEG_SIZE: the decode is the cost.
_JPEG_COUNT, _JPEG_SIDES, _JPEG_SIZE, _JPEG_BATCH = 1024, (96, 160), 64, 64
_DATASET_BATCH, _SORTED_FLOATS = 64, 4096
# The cold file: larger than its memory group, so that no run finds it in the page cache.
_COLD_ROW_BYTES, _COLD_BATCH, _COLD_WINDOW_ROWS = 3072, 256, 16384
CASES = ("npy", "b2nd", "jpeg", "dataset", "cold", "stepchange", "torchrun")


class Computed:
    """A Dataset whose samples cost CPU: each sorts _SORTED_FLOATS floats drawn from its index."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int):
        values = np.random.default_rng(index).random(_SORTED_FLOATS, dtype=np.float32)
        return {"x": np.sort(values)[:64], "label": index}


# ---- The data each case reads ----------------------------------------------------------------


def _write_jpegs(directory: str) -> dict:
    """_JPEG_COUNT synthetic JPEGs (gradients with noise, quality 90) in 4 class directories,
    converted for the loader (convert_images): its fields."""
    from PIL import Image

    from shmloader.tools.imagefolder import convert_images

    rng = np.random.default_rng(0)
    images = os.path.join(directory, "jpegs")
    for index in range(_JPEG_COUNT):
        height, width = (int(side) for side in rng.integers(_JPEG_SIDES[0], _JPEG_SIDES[1] + 1, 2))
        y, x = np.mgrid[0:height, 0:width]
        picture = np.stack([127 + 100 * np.sin(x / rng.uniform(8, 40) + y / rng.uniform(8, 40) + phase)
                            for phase in rng.uniform(0, 6, 3)], axis=-1) + rng.normal(0, 6, (height, width, 3))
        target = os.path.join(images, f"class{index % 4}", f"{index:05d}.jpg")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        Image.fromarray(np.clip(picture, 0, 255).astype(np.uint8)).save(target, quality=90)
    converted = convert_images(images, os.path.join(directory, "jpegs.converted"), progress=False)
    return {"image": converted["image"], "label": converted["label"]}


def prepare(case: str, directory: str, arguments) -> dict:
    """What `case` reads, written into `directory`: {"path": ...} or {"fields": ...}."""
    if case == "npy":
        path = os.path.join(directory, "rows.npy")
        if not os.path.exists(path):
            np.save(path, np.random.default_rng(0).random((_NPY_ROWS, _NPY_ROW_FLOATS), dtype=np.float32))
        return {"path": path}
    if case == "b2nd":
        from shmloader.tools.convert import convert

        source, path = os.path.join(directory, "images.npy"), os.path.join(directory, "images.lz4.b2nd")
        np.save(source, image_rows(_B2ND_ROWS, _B2ND_ROW_BYTES))
        convert(source, path, codec="lz4", progress=False, force=True)
        os.unlink(source)
        return {"path": path}
    if case == "jpeg":
        return {"fields": _write_jpegs(directory)}
    if case == "cold":
        from cold import write_file

        path = os.path.join(directory, "cold.npy")
        write_file(path, int(arguments.cold_mib * 2**20) // _COLD_ROW_BYTES, _COLD_ROW_BYTES)
        return {"path": path}
    return {}  # The Dataset cases compute their rows.


def _loader(case: str, data: dict, readers, slots):
    from shmloader import ShmDataLoader

    settings = {"readers": readers, "slots": slots}
    if case == "npy":
        return ShmDataLoader(data["path"], batch_size=_NPY_BATCH, **settings)
    if case == "b2nd":
        return ShmDataLoader(data["path"], batch_size=_B2ND_BATCH, **settings)
    if case == "jpeg":
        return ShmDataLoader(data["fields"], batch_size=_JPEG_BATCH, transform="shmloader.transforms.images:train",
                             transform_args={"size": _JPEG_SIZE, "decoder": "fast"}, **settings)
    if case == "cold":
        return ShmDataLoader({"x": data["path"]}, batch_size=_COLD_BATCH, mode="shuffle", seed=1,
                             shuffle_window=_COLD_WINDOW_ROWS, **settings)
    return ShmDataLoader.from_dataset(Computed(), batch_size=_DATASET_BATCH, **settings)


# ---- One contender's run ---------------------------------------------------------------------


def _run(case: str, data: dict, readers, slots, warmup_s: float, seconds: float, marks: bool = False) -> dict:
    """One contender's run: rows/s over `seconds` after `warmup_s`, trainer CPU ms a batch
    (`marks`: with the cpu_mark()s a child's run_contender reads)."""
    with _loader(case, data, readers, slots) as loader:
        iterator = iter(loader)
        end = time.perf_counter() + warmup_s
        while time.perf_counter() < end:
            next(iterator)
        batches, started, cpu_started = 0, time.perf_counter(), time.process_time()
        cpu_start = cpu_mark() if marks else None
        end = started + seconds
        while time.perf_counter() < end:
            next(iterator)
            batches += 1
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        stats = loader.stats()
        result = {"rows_per_s": batches * loader.batch_size / elapsed, "trainer_ms": 1e3 * cpu / max(1, batches),
                  "readers": stats["reader_count"], "slots": loader.slots, "change": stats["reader_change"],
                  "decision": last_decision(loader)}
        if marks:
            result.update(cpu_start=cpu_start, cpu_end=cpu_mark())
        return result


def _run_cold(data: dict, readers, slots, warmup_s: float, seconds: float, limit_mib: float) -> dict:
    """_run of the cold case in a child process, in a memory group of `limit_mib` where root
    may make one, the file's pages dropped first."""
    from cold import _CGROUP_ROOT, evict, run_in_group

    evict(data["path"])
    grouped = os.geteuid() == 0 and os.path.isdir(_CGROUP_ROOT)
    command = [sys.executable, os.path.abspath(__file__), "--child", "--path", data["path"], "--child-readers",
               str(readers), "--child-slots", str(slots), "--warmup", str(warmup_s), "--seconds", str(seconds)]
    result = run_in_group(command, int(limit_mib * 2**20) if grouped else 0, warmup_s + seconds + 120)
    return {**result, "grouped": grouped}


def _run_child(arguments) -> None:
    """The cold case's run inside its memory group (--child): its JSON line, then exit."""
    def setting(text: str):
        return text if text == "auto" else int(text)

    finish_child(_run("cold", {"path": arguments.path}, setting(arguments.child_readers),
                      setting(arguments.child_slots), arguments.warmup, arguments.seconds, marks=True))


def _run_step_change(readers, slots, slow_s: float, seconds: float, step_ms: float, adapt_s: float) -> dict:
    """The Dataset case with a training step of `step_ms` (a sleep) for `slow_s`, then none
    for `seconds`: rows/s over that second phase and over its part after `adapt_s` (once auto
    had time to adapt), and how long after the change auto's reader count first moved."""
    with _loader("dataset", {}, readers, slots) as loader:
        iterator = iter(loader)
        end = time.perf_counter() + slow_s
        while time.perf_counter() < end:
            next(iterator)
            time.sleep(step_ms / 1e3)
        readers_slow = loader.stats()["reader_count"]
        started, cpu_started = time.perf_counter(), time.process_time()
        adapted_at, end = started + adapt_s, started + seconds
        batches = batches_late = 0
        adapted_s = None
        while (now := time.perf_counter()) < end:
            next(iterator)
            batches += 1
            batches_late += now >= adapted_at
            if adapted_s is None and batches % 16 == 0 and loader.stats()["reader_count"] != readers_slow:
                adapted_s = now - started
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return {"rows_per_s": batches * loader.batch_size / elapsed, "trainer_ms": 1e3 * cpu / max(1, batches),
                "late_rows_per_s": batches_late * loader.batch_size / (elapsed - adapt_s),
                "readers_slow": readers_slow, "readers": loader.stats()["reader_count"], "adapted_s": adapted_s,
                "slots": loader.slots, "change": loader.stats()["reader_change"], "decision": last_decision(loader)}


def _contenders(readers: list[int]) -> list[tuple[str, object, object]]:
    fixed = [(f"readers={count}, slots={slots}", count, slots) for count in readers
             for slots in (2 * count + 2, 4 * count + 2)]
    return [("auto", "auto", "auto"), *fixed]


def _late(run: dict) -> str:
    if "late_rows_per_s" not in run:
        return ""
    moved = "never" if run["adapted_s"] is None else f"after {run['adapted_s']:.2f} s"
    return f", after adapting {run['late_rows_per_s']:,.0f} rows/s, readers moved {moved}"


def _measure(case: str, data: dict, readers, slots, arguments) -> dict:
    if case == "stepchange":
        return _run_step_change(readers, slots, arguments.slow_seconds, arguments.fast_seconds, arguments.step_ms,
                                _adapt_seconds(arguments))
    if case == "cold":
        return _run_cold(data, readers, slots, arguments.warmup, arguments.seconds, arguments.cold_limit_mib)
    return _run(case, data, readers, slots, arguments.warmup, arguments.seconds)


def _adapt_seconds(arguments) -> float:
    return min(arguments.adapt_seconds, arguments.fast_seconds / 2)


def _case_rows(case: str, runs: dict[str, list[dict]], notes: list[str]) -> list[list]:
    """The table's rows of one case, and its notes: the best fixed contender and auto's last change."""
    medians = {name: statistics.median(run["rows_per_s"] for run in found) for name, found in runs.items()}
    best = max((name for name in medians if name != "auto"), key=medians.get)
    rows = []
    for name, found in runs.items():
        rates = [run["rows_per_s"] for run in found]
        rows.append([case, name, f"{medians[name]:,.0f} ({min(rates):,.0f}-{max(rates):,.0f})",
                     f"{medians[name] / medians[best]:.2f}",
                     f"{statistics.median(run['trainer_ms'] for run in found):.3f}",
                     "/".join(f"{run['readers_slow']}->{run['readers']}" if "readers_slow" in run
                              else str(run["readers"]) for run in found), str(found[0]["slots"])])
    if case == "stepchange":
        late = {name: statistics.median(run["late_rows_per_s"] for run in found) for name, found in runs.items()}
        adapted = [run["adapted_s"] for run in runs["auto"] if run["adapted_s"] is not None]
        best_late = max((name for name in late if name != "auto"), key=late.get)
        moved = f"{', '.join(f'{seconds:.2f}' for seconds in adapted)} s after the change" if adapted else "never"
        notes.append(f"stepchange: after the step got fast, auto's readers moved {moved} "
                     f"({len(adapted)} of {len(runs['auto'])} rounds); "
                     f"rows/s after the time given to adapt, auto / best fixed ({best_late}): "
                     f"{late['auto'] / late[best_late]:.2f}")
    if case == "cold" and not all(run.get("grouped") for found in runs.values() for run in found):
        notes.append("cold: no memory group (needs root and /sys/fs/cgroup/memory): the file was dropped from the "
                     "page cache before each run only, and what a run read stayed cached within it")
    changes = [run["change"] for run in runs["auto"] if run["change"] is not None]
    notes.append(f"{case}: best fixed {best}; auto's last change: {changes[-1] if changes else 'none'}; its last "
                 f"decision: {runs['auto'][-1]['decision']}")
    return rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--readers", default="1,2,4")
    parser.add_argument("--step-ms", type=float, default=20.0, help="stepchange: the slow phase's training step")
    parser.add_argument("--slow-seconds", type=float, default=6.0, help="stepchange: the slow phase's length")
    parser.add_argument("--fast-seconds", type=float, default=8.0, help="stepchange: the fast phase's length")
    parser.add_argument("--adapt-seconds", type=float, default=5.0,
                        help="stepchange: the time auto is given to adapt after the change (at most half the phase)")
    parser.add_argument("--cold-mib", type=float, default=1536.0, help="cold: the file's size")
    parser.add_argument("--cold-limit-mib", type=float, default=512.0, help="cold: the memory group's limit")
    parser.add_argument("--ranks", default="2,4", help="torchrun: the rank counts measured")
    parser.add_argument("--rank-step-ms", type=float, default=20.0,
                        help="torchrun: the slowest rank's step; rank r's is r / (ranks - 1) of it")
    parser.add_argument("--rank-readers", default="1,2",
                        help="torchrun: the fixed splits give the faster and the slower half of the ranks each of these")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--child-readers", help=argparse.SUPPRESS)
    parser.add_argument("--child-slots", help=argparse.SUPPRESS)
    add_write_argument(parser)
    return parser


def main() -> int:
    arguments = _parser().parse_args()
    if arguments.child:
        _run_child(arguments)
    # The run's loaders (the cold children and the torchrun ranks too) share a node budget of
    # their own: on a shared host another job's loaders would hold part of it, which limits
    # auto and no fixed contender, and the comparison would measure them.
    os.environ.setdefault("SHMLOADER_BUDGET_SCOPE", f"autotune-bench-{os.getpid()}")
    cases = arguments.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        sys.exit(f"--cases: unknown {', '.join(unknown)}; the cases are {', '.join(CASES)}")
    contenders = _contenders([int(count) for count in arguments.readers.split(",")])
    rows, notes, rank_rows = [], [], []
    with tempfile.TemporaryDirectory() as directory:  # On a disk (/tmp here), not tmpfs: the cold case reads it.
        for case in cases:
            if case == "torchrun":
                from _autotune_ranks import measure_ranks

                rank_rows += measure_ranks(os.path.abspath(__file__), arguments, notes)
                continue
            data = prepare(case, directory, arguments)
            runs = {name: [] for name, _, _ in contenders}
            for round_index in range(arguments.rounds):
                shift = round_index % len(contenders)
                for name, readers, slots in contenders[shift:] + contenders[:shift]:
                    run = _measure(case, data, readers, slots, arguments)
                    runs[name].append(run)
                    print(f"{case} round {round_index}: {name}: {run['rows_per_s']:,.0f} rows/s, trainer "
                          f"{run['trainer_ms']:.3f} ms/batch, readers {run.get('readers_slow', '')}"
                          f"{'->' if 'readers_slow' in run else ''}{run['readers']}, slots {run['slots']}"
                          f"{_late(run)}", flush=True)
            rows += _case_rows(case, runs, notes)
    header = ["case", "contender", "rows/s median (min-max)", "/ best fixed", "trainer CPU ms/batch",
              "readers at the end, by round", "slots"]
    print()
    print(table(rows + rank_rows, header))
    for note in notes:
        print(note)
    load = os.getloadavg()[0]
    notes.append(f"load average (1 min) at the end: {load:.1f}")
    record("autotune", command_line("autotune.py"), header, rows + rank_rows, notes=notes, write=arguments.write)
    print(machine_line())
    return 0


if __name__ == "__main__":
    if "--rank-child" in sys.argv:  # A rank of the torchrun case, started by torchrun.
        from _autotune_ranks import rank_child

        rank_child(Computed, sys.argv[sys.argv.index("--rank-child") + 1:])
    sys.exit(main())

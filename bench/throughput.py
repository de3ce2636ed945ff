"""End-to-end throughput: ShmDataLoader against PyTorch's DataLoader and a single-process loop.

Run: python bench/throughput.py [--quick] [--checksums-only]   (PyTorch rows need `pip install torch`)
Data: 100,000 rows of 3,072 bytes (image-like) plus an int64 label, as .npy and as
converted LZ4 .b2nd; batches of 256; the consumer reads every batch (sums one byte per row
and the labels). It reports shmloader against PyTorch and against the
single-process loop; the cost of next() when a batch is ready, for 1 MB and 64 MB batches
(measured inside a loop whose simulated training step leaves the readers time to fill the
ring, beside the floor: next() of a bare C iterator in the same conditions); the time to
the first batch. Add --write to save the run in bench/results/ (nothing is written without it).

shmloader, the single process and the pair (the same gather in two processes at once: the
ceiling of two readers) run in turn, ROUNDS rounds (one with --quick); each round's ratios
come from its own runs, and the ratios reported are the medians of the rounds'.

Each contender of the main table runs in a child process of its own, and its row gives
the CPU seconds per million rows of all its processes (the trainer, shmloader's fork
server and readers, PyTorch's forkserver and workers; user+system) from the start of the
timed batches to their exit, and the trainer's own share within the timed batches
(bench/_common.py, run_contender, says how every process is counted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from _common import add_write_argument, command_line, cpu_mark, finish_child, machine_line, per_million, record, run_contender, table
from gather import child_environment, make_files

from shmloader import ShmDataLoader
from shmloader.ring.layout import SlotState
from shmloader.storage.opening import open_field
from shmloader.storage.spec import describe_field
from shmloader.tools import benchmark

ROWS, ROW_BYTES, BATCH = 100_000, 3072, 256
# Rounds of the main table: shmloader, one process and two processes run in turn, each
# round's ratios from its own runs (this host's speed moves within seconds; bench/RESULTS.md).
ROUNDS = 5


def label_files(directory: str) -> dict[str, str]:
    from shmloader.tools.convert import convert

    npy = os.path.join(directory, f"labels{ROWS}.npy")
    b2nd = os.path.join(directory, f"labels{ROWS}.lz4.b2nd")
    if not os.path.exists(npy):
        np.save(npy, np.arange(ROWS, dtype=np.int64) % 1000)
    if not os.path.exists(b2nd) or not describe_field(b2nd).block_digests:
        convert(npy, b2nd, progress=False, force=True)
    return {"npy": npy, "b2nd": b2nd}


def read_through(path: str) -> None:
    """Reads a file (or every file of a directory) once, so that it is in the page cache."""
    paths = [os.path.join(path, name) for name in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    for one in paths:
        with open(one, "rb", buffering=0) as handle:
            while handle.read(16 << 20):
                pass


def consume(image, label) -> int:
    return int(image[:, 0].sum()) + int(label.sum())


def memory_of(pid: int) -> str:
    """Resident memory of a process, and the part of it that is its own (not the ring, not the page cache)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            fields = {line.split(":")[0]: int(line.split()[1]) for line in handle if line.split()[0].endswith(":")}
        return f"{fields['Rss'] / 1024:.0f} MiB RSS, {(fields['Private_Clean'] + fields['Private_Dirty']) / 1024:.0f} MiB private"
    except (OSError, KeyError, ValueError):
        return "?"


def median_run(results: list[dict]) -> dict:
    """The run of median rate (the lower middle one of an even count)."""
    return sorted(results, key=lambda result: result["rows_per_s"])[(len(results) - 1) // 2]


def readers_cpu_s(pids) -> float:
    """Seconds the readers have spent on a CPU (schedstat: nanoseconds, where /proc/PID/stat
    counts 10 ms ticks, coarse against a run of 300 batches)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/schedstat") as handle:
            total += int(handle.read().split()[0])
    return total / 1e9


def run_shmloader(fields: dict, batches: int, readers=2, slots=8, verify=False, warm_up=0) -> dict:
    started = time.perf_counter()
    loader = ShmDataLoader(fields, batch_size=BATCH, readers=readers, slots=slots, seed=1, warn_layout=False,
                           verify=verify)
    with loader:
        first = next(loader)
        first_batch_s = time.perf_counter() - started
        consume(first["image"], first["label"])
        del first
        for _, batch in zip(range(warm_up), loader):
            consume(batch["image"], batch["label"])
        cpu_start = cpu_mark()
        readers_start = readers_cpu_s(loader.diagnostics.reader_pids)
        timed_start = time.perf_counter()
        for _, batch in zip(range(batches), loader):
            consume(batch["image"], batch["label"])
        elapsed = time.perf_counter() - timed_start
        readers_s = readers_cpu_s(loader.diagnostics.reader_pids) - readers_start
        cpu_end = cpu_mark()
        memory = [memory_of(pid) for pid in loader.diagnostics.reader_pids]
        stats = loader.stats()
    return {
        "rows_per_s": batches * BATCH / elapsed,
        "rows": batches * BATCH,
        "first_batch_s": first_batch_s,
        "shm_mib": loader.diagnostics.shared_memory_bytes / 2**20,
        "reader_memory": memory,
        "wait_fraction": stats["wait_fraction"],
        "readers_cpu_s": readers_s,
        "cpu_start": cpu_start,
        "cpu_end": cpu_end,
    }


# Checks cost most in a loader's first batches, where every row read is a first read: they
# are timed over this many batches from the first, and over a run's batches.
_CHECKSUM_FIRST_BATCHES = 300
# Alternating pairs per count: short runs are noisier (one pair of them can land on another
# process's burst), and cheap.
_CHECKSUM_PAIRS_SHORT, _CHECKSUM_PAIRS = 25, 5
_SHARD_FILES = 1000
_SHARD_WARM_UP = 500


def shard_files(images: dict, labels: dict) -> dict:
    """The .npy rows and labels split into _SHARD_FILES files each (written once)."""
    directory = os.path.join(os.path.dirname(images["npy"]), f"shards{_SHARD_FILES}")
    if not os.path.exists(os.path.join(directory, "done")):
        os.makedirs(directory, exist_ok=True)
        rows = np.load(images["npy"], mmap_mode="r")
        label_rows = np.load(labels["npy"])
        per_file = -(-ROWS // _SHARD_FILES)
        for shard in range(_SHARD_FILES):
            np.save(os.path.join(directory, f"image-{shard:04d}.npy"), rows[shard * per_file:(shard + 1) * per_file])
            np.save(os.path.join(directory, f"label-{shard:04d}.npy"), label_rows[shard * per_file:(shard + 1) * per_file])
        open(os.path.join(directory, "done"), "w").close()
    return {"image": os.path.join(directory, "image-*.npy"), "label": os.path.join(directory, "label-*.npy")}


def many_files_ratio(images: dict, labels: dict, batches: int) -> float:
    """rate(the rows split over _SHARD_FILES files) / rate(one file), the median of
    alternating pairs, after a warm-up of _SHARD_WARM_UP batches in which every reader has
    mapped the files and faulted their pages in (one-time costs, which a 50-batch warm-up
    left partly inside the timed run)."""
    one = {"image": images["npy"], "label": labels["npy"]}
    many = shard_files(images, labels)
    ratios = [run_shmloader(many, batches, warm_up=_SHARD_WARM_UP)["rows_per_s"]
              / run_shmloader(one, batches, warm_up=_SHARD_WARM_UP)["rows_per_s"] for _ in range(_CHECKSUM_PAIRS)]
    print(f"\n{_SHARD_FILES} files / one file, rows/s per pair: {', '.join(f'{r:.3f}' for r in ratios)}")
    return statistics.median(ratios)


def checksum_cost(images: dict, labels: dict, batches: int) -> dict[int, tuple[float, list[float]]]:
    """1 - rate(verify=True) / rate(verify=False) on the .b2nd files, over the first
    _CHECKSUM_FIRST_BATCHES batches and over `batches`: {batches: (median, per pair)}, from
    alternating pairs (which of the two runs first alternates too: the machine's noise moves
    both alike within a pair). Each run starts fresh readers, so every run pays the first
    reads of the blocks it reads: the first batches are the worst case."""
    fields = {"image": images["b2nd"], "label": labels["b2nd"]}
    costs = {}
    for count in sorted({_CHECKSUM_FIRST_BATCHES, batches}):
        ratios, cpu_ratios = [], []
        for pair in range(_CHECKSUM_PAIRS_SHORT if count <= _CHECKSUM_FIRST_BATCHES else _CHECKSUM_PAIRS):
            order = (True, False) if pair % 2 == 0 else (False, True)
            runs = {verify: run_shmloader(fields, count, verify=verify) for verify in order}
            ratios.append(runs[True]["rows_per_s"] / runs[False]["rows_per_s"])
            cpu_ratios.append(runs[True]["readers_cpu_s"] / runs[False]["readers_cpu_s"])
        print(f"\nchecksums over {count} batches, verify=True / verify=False rows/s per pair: "
              f"{', '.join(f'{r:.3f}' for r in ratios)} (load average {os.getloadavg()[0]:.2f}); the readers' CPU "
              f"seconds, True / False: median {statistics.median(cpu_ratios):.3f} "
              f"({min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})")
        costs[count] = (1 - statistics.median(ratios), ratios)
    return costs


def run_single_process(fields: dict, batches: int, ready=None) -> dict:
    """The same gather (this project's native code), one process, one preallocated buffer;
    `ready()`, where given, is called once the files are open, before the timed batches."""
    from shmloader import Sampler

    specs = {name: describe_field(path) for name, path in fields.items()}
    opened = {name: open_field(spec, BATCH) for name, spec in specs.items()}
    buffers = {name: np.empty((BATCH, *spec.row_shape), dtype=spec.numpy_dtype) for name, spec in specs.items()}
    sampler = Sampler(ROWS, BATCH, "shuffle", seed=1)
    indices = np.empty(BATCH, dtype=np.uint64)
    if ready is not None:
        ready()
    cpu_start = cpu_mark()
    started = time.perf_counter()
    for step in range(batches):
        sampler.fill(step, indices)
        for name, field in opened.items():
            field.gather(indices, buffers[name])
        consume(buffers["image"], buffers["label"])
    elapsed = time.perf_counter() - started
    cpu_end = cpu_mark()
    for field in opened.values():
        field.close()
    return {"rows_per_s": batches * BATCH / elapsed, "rows": batches * BATCH, "cpu_start": cpu_start,
            "cpu_end": cpu_end}


def run_pair(fields: dict, batches: int) -> dict:
    """The same gather in two processes at once (run_single_process's loop in each, started
    together): what two cores of this machine deliver with no ring and no trainer, the
    ceiling of two readers. Two processes of one gather share the memory bus, and on a
    machine lent by the core they share more (bench/RESULTS.md)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")  # This child runs no thread yet.
    barrier, results = context.Barrier(3), context.Queue()

    def gather() -> None:
        result = run_single_process(fields, batches, ready=barrier.wait)
        results.put(result["rows"] / result["rows_per_s"])  # Its elapsed seconds.

    processes = [context.Process(target=gather) for _ in range(2)]
    for process in processes:
        process.start()
    barrier.wait()  # Both have their files open: the timed batches start.
    cpu_start = cpu_mark()
    started = time.perf_counter()
    slowest = max(results.get(timeout=600) for _ in processes)
    elapsed = time.perf_counter() - started
    for process in processes:
        process.join()
    cpu_end = cpu_mark()
    return {"rows_per_s": 2 * batches * BATCH / slowest, "rows": 2 * batches * BATCH, "cpu_start": cpu_start,
            "cpu_end": cpu_end, "elapsed_s": elapsed}


def run_torch(fields: dict, batches: int) -> dict:
    """PyTorch's DataLoader, 2 workers, its batched __getitems__ fast path: the loop of
    shmloader.tools.benchmark.run_torch, with the CPU marks around its timed batches."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    torch.set_num_threads(1)
    dataset = benchmark.TorchRows(fields)
    # Forking a process that runs threads risks a deadlock in the child; forkserver starts
    # the workers from a clean single-threaded server (as benchmark.run_torch does).
    loader = DataLoader(dataset, batch_size=BATCH, sampler=RandomSampler(dataset, num_samples=(batches + 2) * BATCH),
                        num_workers=2, collate_fn=benchmark._no_collate, persistent_workers=True, prefetch_factor=4,
                        multiprocessing_context="forkserver")
    iterator = iter(loader)
    benchmark.touch({name: tensor.numpy() for name, tensor in next(iterator).items()})
    cpu_start = cpu_mark()
    started = time.perf_counter()
    for _ in range(batches):
        benchmark.touch({name: tensor.numpy() for name, tensor in next(iterator).items()})
    elapsed = time.perf_counter() - started
    cpu_end = cpu_mark()
    del iterator  # Its workers end here, inside the figure (run_contender counts up to their exit).
    return {"rows_per_s": batches * BATCH / elapsed, "rows": batches * BATCH, "cpu_start": cpu_start,
            "cpu_end": cpu_end}


_CONTENDERS = {"shmloader": run_shmloader, "single": run_single_process, "pair": run_pair, "torch": run_torch}


def contender(name: str, fields: dict, batches: int) -> dict | None:
    """One contender of the main table, run in a child process of its own (for its CPU,
    readers and workers included); None for PyTorch where it is not installed."""
    if name == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            return None
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--fields", json.dumps(fields),
               "--batches", str(batches)]
    return run_contender(command, 600, f"throughput.py --child {name}", env=child_environment())


def simulated_training_step(seconds: float, work: np.ndarray) -> None:
    """Busy numpy work for `seconds`, touching memory like a small model's step would."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        np.sin(work, out=work)  # Elementwise: BLAS threads would spin on both cores.


def next_cost_us(fields: dict, batch_bytes: int, samples: int, step_seconds: float | None) -> dict:
    """The cost of next() when its batch is ready; only such calls are counted.

    step_seconds=None: back to back, each call made once the batch is ready and no reader
    is filling (the trainer spins meanwhile, so its caches stay warm). Otherwise a
    simulated training step of that length precedes each call, as in a real loop, long
    enough for the readers to keep the ring full. Iterations alternate between timing
    next(loader) and timing next() of a bare C iterator (`range`), the floor any next()
    pays here in the same conditions; the loader's next() is still called, untimed, in
    the floor's iterations, so both see the same ring. The previous batch is dropped
    before the step, so next() includes handing its slot back (and any reader wake-up).
    """
    batch_size = max(1, batch_bytes // (ROW_BYTES + 8))
    slots = 8
    work = np.random.default_rng(0).random((256, 256))
    floor_iterator = iter(range(1 << 62))
    # Which samples time the floor is drawn at random: alternating would alias with the
    # readers' wake-up, due every few calls, and time it in half the calls or in none.
    timed_floor = np.random.default_rng(1).random(2 * samples) < 0.5
    ours, floor = [], []
    with ShmDataLoader(fields, batch_size=batch_size, readers=2, slots=slots, seed=2, warn_layout=False) as loader:
        ring = loader._session.ring
        batch = next(loader)
        for sample in range(2 * samples):
            del batch  # The step is done with the previous batch.
            if step_seconds is None:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and (
                    ring.state(loader._session.cursor.next_step % slots)[0] != SlotState.READY
                    or any(ring.state(slot)[0] == SlotState.FILLING for slot in range(slots))
                ):
                    pass
            else:
                simulated_training_step(step_seconds, work)
            ready = ring.state(loader._session.cursor.next_step % slots)[0] == SlotState.READY
            if timed_floor[sample]:
                started = time.perf_counter_ns()
                next(floor_iterator)
                floor.append((time.perf_counter_ns() - started) / 1e3)
                batch = next(loader)
            else:
                started = time.perf_counter_ns()
                batch = next(loader)
                elapsed_us = (time.perf_counter_ns() - started) / 1e3
                if ready:
                    ours.append(elapsed_us)
        del batch
    return {
        "median": statistics.median(ours) if ours else float("nan"),
        "mean": statistics.fmean(ours) if ours else float("nan"),
        "p90": float(np.percentile(ours, 90)) if ours else float("nan"),
        "floor": statistics.median(floor),
        "calls": len(ours),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--checksums-only", action="store_true",
                        help="only the cost of verify=True on .b2nd, over the first batches and over --batches")
    parser.add_argument("--child", choices=sorted(_CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--fields", help=argparse.SUPPRESS)
    add_write_argument(parser)
    arguments = parser.parse_args()
    if arguments.child:
        finish_child(_CONTENDERS[arguments.child](json.loads(arguments.fields), arguments.batches))
    batches = arguments.batches or (300 if arguments.quick else 8000)
    images = make_files(ROWS, ROW_BYTES, with_default=False)
    labels = label_files(os.path.dirname(images["npy"]))
    # Data in memory is what this compares: files the page cache dropped since they were
    # written would make the first run (shmloader's, on .npy) read them from disk at random.
    for path in [*images.values(), *labels.values()]:
        read_through(path)
    print(f"# throughput benchmark ({machine_line()})")
    if arguments.checksums_only:
        for count, (cost, ratios) in checksum_cost(images, labels, batches).items():
            print(f"b2nd: checksums (verify=True) cost {cost:.1%} of throughput over {count} batches from the "
                  f"first, the median of {len(ratios)} alternating pairs (against verify=False)")
        return 0
    print(f"{ROWS:,} rows of {ROW_BYTES} bytes + int64 label, batch {BATCH}, {batches} batches per run, consumer sums a byte per row")
    lines, rates, ceilings, ratios = [], {}, {}, {}
    rounds = 1 if arguments.quick else ROUNDS
    print(f"shmloader, one process and two processes alternate, {rounds} round(s); each row is the median run, "
          f"ratios the median of the rounds' ratios")
    for kind in ("npy", "b2nd"):
        fields = {"image": images[kind], "label": labels[kind]}
        runs = {"shmloader": [], "single": [], "pair": []}
        for _ in range(rounds):  # The host's speed drifts within seconds: each round compares its own runs.
            for name, results in runs.items():
                results.append(contender(name, fields, batches))
        per_round = [ours["rows_per_s"] / single["rows_per_s"]
                     for ours, single in zip(runs["shmloader"], runs["single"])]
        pair_rounds = [pair["rows_per_s"] / single["rows_per_s"] for pair, single in zip(runs["pair"], runs["single"])]
        ratios[kind] = (statistics.median(per_round), per_round)
        ceilings[kind] = (statistics.median(pair_rounds), pair_rounds)
        ours, single, pair = (median_run(runs[name]) for name in ("shmloader", "single", "pair"))
        torch_result = contender("torch", fields, max(50, batches // 4))
        rates[kind] = (ours, single, torch_result)
        gigabytes = (ROW_BYTES + 8) / 1e9

        def line(what: str, result: dict, notes: str) -> list:
            return [kind, what, f"{result['rows_per_s']:,.0f}", f"{result['rows_per_s'] * gigabytes:.2f}",
                    per_million(result["cpu_s"], result["rows"]), per_million(result["trainer_cpu_s"], result["rows"]),
                    notes]

        def spread(results: list) -> str:
            rates_seen = sorted(result["rows_per_s"] for result in results)
            return f"runs {rates_seen[0]:,.0f}-{rates_seen[-1]:,.0f}" if len(rates_seen) > 1 else ""

        lines.append(line("shmloader, 2 readers, 8 slots", ours,
                          f"first batch {ours['first_batch_s']:.2f} s, ring {ours['shm_mib']:.1f} MiB, "
                          f"trainer waited {ours['wait_fraction']:.0%}; {spread(runs['shmloader'])}"))
        lines.append(line("single process, same gather", single, spread(runs["single"])))
        lines.append(line("2 processes, same gather, at once", pair,
                          f"the ceiling of 2 readers here; {spread(runs['pair'])}"))
        if torch_result:
            lines.append(line("PyTorch DataLoader, 2 workers, __getitems__", torch_result,
                              "np.take" if kind == "npy" else "blosc2 arr[sorted unique idx]"))
        print(f"reader memory ({kind}): " + "; ".join(ours["reader_memory"]))
    header = ["file", "loader", "rows/s", "GB/s", "CPU s / M rows", "trainer CPU s / M rows", "notes"]
    print(table(lines, header))
    verify_cost = checksum_cost(images, labels, batches)
    shard_ratio = many_files_ratio(images, labels, batches)
    print("\n## next() when the batch is ready (2 readers, 8 slots; microseconds)")
    costs = {}
    fields = {"image": images["npy"], "label": labels["npy"]}
    rows = []
    # A training step long enough that two readers keep the ring full (64 MB take ~40 ms).
    for label, batch_bytes, step_seconds in (("1 MB", 1 << 20, 0.003), ("64 MB", 64 << 20, 0.12)):
        many = (30 if arguments.quick else 100) if batch_bytes > (8 << 20) else (100 if arguments.quick else 400)
        for condition, seconds in (("back to back", None), (f"after a {step_seconds * 1e3:.0f} ms step", step_seconds)):
            cost = next_cost_us(fields, batch_bytes, many, seconds)
            if seconds is not None:
                costs[label] = cost
            rows.append([label, condition, f"{cost['median']:.1f}", f"{cost['mean']:.1f}", f"{cost['p90']:.1f}",
                         f"{cost['floor']:.1f}", str(cost["calls"])])
    print(table(rows, ["batch", "when", "median", "mean", "p90", "floor: next(range)", "calls"]))
    print("\n## summary")
    for kind in ("npy", "b2nd"):
        ours, single, torch_result = rates[kind]
        if torch_result:
            ratio = ours["rows_per_s"] / torch_result["rows_per_s"]
            print(f"{kind}: shmloader / PyTorch DataLoader = {ratio:.1f}x")
        else:
            print(f"{kind}: PyTorch not installed, comparison skipped")
        ratio, per_round = ratios[kind]
        ceiling, ceiling_rounds = ceilings[kind]
        print(f"{kind}: shmloader / single process = {ratio:.2f}x, rounds {', '.join(f'{r:.2f}' for r in per_round)} "
              f"(median of the rounds)")
        print(f"{kind}: 2 processes of the same gather at once / single process = {ceiling:.2f}x, rounds "
              f"{', '.join(f'{r:.2f}' for r in ceiling_rounds)}; shmloader at {ratio / ceiling:.0%} of it")
        print(f"{kind}: first batch after {ours['first_batch_s']:.2f} s")
    for count, (cost, pairs) in verify_cost.items():
        print(f"b2nd: checksums (verify=True) cost {cost:.1%} of throughput over {count} batches from the first, the "
              f"median of {len(pairs)} alternating pairs (against verify=False)")
    print(f"npy: the same rows in {_SHARD_FILES} files load at {shard_ratio:.0%} of one file's rate")
    for label, cost in costs.items():
        print(f"next() with {label} batches, after a training step: median {cost['median']:.1f} us; "
              f"the floor of any next() there: {cost['floor']:.1f} us")
    headline = []
    for kind, what in (("npy", "`.npy` rows"), ("b2nd", "`.b2nd` rows (converted)")):
        ours, single, torch_result = rates[kind]
        headline.append([what, f"{ours['rows_per_s'] / 1e6:.2f} M/s", f"{ratios[kind][0]:.2f}x",
                         f"{ours['rows_per_s'] / torch_result['rows_per_s']:.1f}x" if torch_result else "n/a",
                         f"{per_million(ours['cpu_s'], ours['rows'])} / "
                         f"{per_million(torch_result['cpu_s'], torch_result['rows']) if torch_result else '-'} per M rows"])
    notes = [f"{ROWS:,} rows of {ROW_BYTES} B + an int64 label, batch {BATCH}, {batches} batches a run, warm; "
             f"shmloader, one process and two alternate in {rounds} round(s): rows are the median runs, "
             f"x single the median of the rounds' ratios",
             f"checksums (verify=True, the default) cost "
             f"{', '.join(f'{cost:.1%} over {count} batches' for count, (cost, _) in verify_cost.items())}; "
             f"{_SHARD_FILES} files load at {shard_ratio:.0%} of one file's rate",
             *(f"next() with {label} batches after a training step: median {cost['median']:.1f} us" for label, cost
               in costs.items())]
    notes.append("CPU s / M rows: all the contender's processes (trainer, readers or workers) from the timed "
                 "batches' start to their exit; trainer: its own process within the timed batches")
    record("throughput", command_line("throughput.py"), header, lines, headline, notes, write=arguments.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The user's own Dataset: the same map-style Dataset classes through PyTorch's DataLoader and
through shmloader.torch.DataLoader (its __getitem__, and a collate_fn, run in shmloader's
readers, samples written into the ring), same arguments and worker count, in one run.
Contenders alternate and repeat; medians and spreads are printed.

    python bench/dataset.py [--workers 2] [--rounds 3] [--seconds 4] [--cases abcdefg]

Cases: (a) small samples, a 3 KB uint8 array and a label; (b) large samples, a 4 MiB
float32 volume; (c) JPEG decode, random resized crop and flip with PIL in __getitem__;
(d) a Python-heavy sample, a dict of 20 small arrays; (e) tokenized text, 16-512 tokens a
document (lengths from a seeded generator), with a padding collate_fn that pads to the
batch's longest and returns a dict of input_ids, attention_mask and labels tensors; (f) (a)'s
dataset under torch's DistributedSampler with 2 ranks: two processes, one per rank, each
with its own loader, sampler.set_epoch(epoch) before each epoch, started together; (g) a
500 MB in-memory numpy array, persistent_workers=False, 3 whole epochs (each epoch's
workers or readers start anew: torch's fork, shmloader's fork from the trainer on Linux).

Reported, per contender (medians over the rounds):
- samples/s: (a)-(f) over --seconds after a warm-up of 3 batches, a new epoch begun where
  one ends; (g) over its 3 epochs, from the first iter() to the last batch, epoch starts
  included; (f) per rank, and the ranks' sum;
- first batch: from iter() to the first batch (the loader's construction, DataLoader(...),
  is timed apart: the drop-in plans the dataset and starts its readers there);
- epoch starts (g): each epoch's iter() to its first batch;
- CPU seconds per million samples of all the loader's processes (the trainer and its
  workers or readers, user+system, from the timed window's start to their exit; each run
  is a child process of this script, bench/_common.py, run_contender, says how every
  process is counted); and the trainer's CPU per batch (its process time, every thread,
  per batch delivered: unpickling and collating are the trainer's work in PyTorch's
  loader);
- memory: the summed PSS of all the loader's processes (bench/_memory.py: private memory,
  and shared memory divided among the processes that map it), sampled from this script
  every 0.2 s: its peak over the whole run (the loader's construction and start-up
  included), and its median within the timed window (the loader running);
- the 1-minute load average when each run ended (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    add_write_argument,
    command_line,
    cpu_mark,
    finish_child,
    format_per_million,
    machine_line,
    record,
    run_contender,
    table,
)
from _datasets import InMemory, Jpeg, Large, ManyArrays, Small, Tokens, pad_collate  # noqa: E402
from _memory import PssSampler  # noqa: E402


@dataclass(frozen=True)
class Case:
    title: str
    make: type
    arguments: dict = field(default_factory=dict)  # DataLoader's, beside num_workers and persistent_workers.
    kind: str = "window"  # "window": samples/s over --seconds; "ranks": one per rank, at once; "epochs": whole ones.


RANKS = 2  # Case (f)'s world size.
EPOCHS = 3  # Case (g)'s epochs.
CASES = {
    "a": Case("3 KB array + label", Small, {"batch_size": 256, "shuffle": True}),
    "b": Case("4 MiB volume", Large, {"batch_size": 8, "shuffle": True}),
    "c": Case("JPEG decode + crop + flip", Jpeg, {"batch_size": 64, "shuffle": True}),
    "d": Case("dict of 20 small arrays", ManyArrays, {"batch_size": 256, "shuffle": True}),
    "e": Case("tokenized text, padding collate_fn", Tokens, {"batch_size": 64, "shuffle": True,
                                                             "collate_fn": pad_collate}),
    "f": Case(f"DistributedSampler, {RANKS} ranks, (a)'s dataset", Small, {"batch_size": 256}, kind="ranks"),
    "g": Case(f"500 MB in-memory array, {EPOCHS} epochs", InMemory, {"batch_size": 256, "shuffle": True},
              kind="epochs"),
}


def _loader_class(contender: str):
    """The contender's DataLoader class, imported here (torch's import is no loader's start-up)."""
    if contender == "torch":
        import torch.utils.data

        return torch.utils.data.DataLoader
    from shmloader.torch import DataLoader

    return DataLoader


def _close(loader) -> None:
    close = getattr(loader, "close", None)  # The drop-in's; torch's workers end with its iterator.
    if close is not None:
        close()


def _batch_samples(batch) -> int:
    """How many samples a batch holds: its first tensor's first dimension (an epoch's last
    batch may be short)."""
    for _ in range(8):  # Nesting depth: a tuple or dict of tensors here.
        if isinstance(batch, dict):
            batch = next(iter(batch.values()))
        elif isinstance(batch, (list, tuple)):
            batch = batch[0]
        else:
            return int(batch.shape[0])
    raise TypeError(f"no tensor found in the batch within 8 levels: {type(batch)!r}")


def _measure_window(make_loader, seconds: float, epoch_started=None, ready=None) -> dict:
    """Builds the loader (timed), waits for `ready()` where given, then times iter() to the
    first batch; after a warm-up of 3 batches, samples, batches and seconds over `seconds`
    with the CPU marks around them. `epoch_started(epoch)` runs before each iter()."""
    started = time.perf_counter()
    loader = make_loader()
    construct_s = time.perf_counter() - started
    if ready is not None:
        ready()
    epoch = 0
    if epoch_started is not None:
        epoch_started(epoch)
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    first_batch_s = time.perf_counter() - started
    for _ in range(2):
        next(iterator)
    cpu_start, wall_start = cpu_mark(), time.time()
    samples, batches, started = 0, 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        try:
            batch = next(iterator)
        except StopIteration:  # An epoch ended: the next one, as a training loop would.
            epoch += 1
            if epoch_started is not None:
                epoch_started(epoch)
            iterator = iter(loader)
            continue
        samples += _batch_samples(batch)
        batches += 1
        del batch
    elapsed = time.perf_counter() - started
    cpu_end, wall_end = cpu_mark(), time.time()
    del iterator
    _close(loader)
    return {"samples": samples, "batches": batches, "seconds": elapsed, "cpu_start": cpu_start, "cpu_end": cpu_end,
            "window": [wall_start, wall_end], "first_batch_s": first_batch_s, "construct_s": construct_s}


def _measure_epochs(make_loader, epochs: int) -> dict:
    """Builds the loader (timed), then runs `epochs` whole epochs, timing each one's iter()
    to its first batch; samples/s and CPU over all of them, epoch starts included."""
    started = time.perf_counter()
    loader = make_loader()
    construct_s = time.perf_counter() - started
    cpu_start, wall_start, epoch_starts = cpu_mark(), time.time(), []
    samples, batches, started = 0, 0, time.perf_counter()
    for epoch in range(epochs):
        epoch_started = time.perf_counter()
        for batch in loader:
            if len(epoch_starts) == epoch:  # This epoch's first batch.
                epoch_starts.append(time.perf_counter() - epoch_started)
            samples += _batch_samples(batch)
            batches += 1
            del batch
    elapsed = time.perf_counter() - started
    cpu_end, wall_end = cpu_mark(), time.time()
    _close(loader)
    return {"samples": samples, "batches": batches, "seconds": elapsed, "cpu_start": cpu_start, "cpu_end": cpu_end,
            "window": [wall_start, wall_end], "first_batch_s": epoch_starts[0], "epoch_starts_s": epoch_starts,
            "construct_s": construct_s}


def run_child(contender: str, letter: str, workers: int, seconds: float, rank: int | None) -> None:
    """One run of one contender on case `letter`, in this child process (for (f), one rank's,
    or the launcher of both): prints its JSON line, with the warnings it saw."""
    import warnings

    case = CASES[letter]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case.kind == "ranks" and rank is None:
            result = _run_ranks(contender, workers, seconds)
        else:
            dataset = case.make()
            arguments = dict(case.arguments)
            if case.kind == "ranks":
                from torch.utils.data.distributed import DistributedSampler

                arguments["sampler"] = sampler = DistributedSampler(dataset, num_replicas=RANKS, rank=rank,
                                                                    shuffle=True, seed=0)
            loader_class = _loader_class(contender)
            # Both loaders with the same arguments; persistent_workers=False is torch's default.
            make = lambda: loader_class(dataset, num_workers=workers, persistent_workers=False,  # noqa: E731
                                        **arguments)
            if case.kind == "epochs":
                result = _measure_epochs(make, EPOCHS)
            elif case.kind == "ranks":
                result = _measure_window(make, seconds, epoch_started=sampler.set_epoch, ready=_wait_for_go)
            else:
                result = _measure_window(make, seconds)
    seen = {f"{item.category.__name__}: {str(item.message)[:200]}" for item in caught}
    result["warnings"] = sorted(seen | set(result.get("warnings", ())))  # (f)'s launcher: its ranks' too.
    finish_child(result)


def _wait_for_go() -> None:
    """A rank's side of the start line: says it is ready (its loader built), waits for go."""
    print("ready", flush=True)
    line = sys.stdin.readline()  # The launcher's; at its exit, EOF ends the wait.
    if line.strip() != "go":
        raise SystemExit(f"dataset.py rank child: expected 'go' from the launcher on stdin, got {line!r}")


def _await_ready(process: subprocess.Popen, rank: int, deadline: float) -> None:
    """Reads rank `rank`'s stdout, byte by byte (the pipe is unbuffered, so communicate()
    later finds the rest), until its "ready" line; bounded by `deadline`."""
    line = b""
    for _ in range(1 << 16):  # Bytes before "ready": nothing else prints to stdout there.
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([process.stdout], [], [], remaining)[0]:
            raise TimeoutError(f"dataset.py case f: rank {rank} not ready within its deadline")
        byte = process.stdout.read(1)
        if not byte:
            raise RuntimeError(f"dataset.py case f: rank {rank} exited with {process.wait()} before it was ready")
        line += byte
        if byte == b"\n":
            if line == b"ready\n":
                return
            line = b""  # Another line (none is expected): the next one.
    raise RuntimeError(f"dataset.py case f: rank {rank} printed 64 KiB without a 'ready' line")


def _run_ranks(contender: str, workers: int, seconds: float) -> dict:
    """Case (f): one child process per rank (each builds its loader, then all start at once),
    reaped here so their CPU reaches run_contender's rusage. The marks are the ranks' summed
    (each rank's tree at its window's start and end) plus this launcher's own CPU."""
    deadline = time.monotonic() + seconds + 300
    with tempfile.TemporaryFile() as errors:
        ranks = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", contender, "--cases", "f",
                                   "--rank", str(rank), "--workers", str(workers), "--seconds", str(seconds)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, bufsize=0)
                 for rank in range(RANKS)]
        try:
            for rank, process in enumerate(ranks):
                _await_ready(process, rank, deadline)
            launcher_start_s = time.process_time()
            for process in ranks:
                process.stdin.write(b"go\n")
            outputs = [process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for process in ranks]
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        if any(process.returncode for process in ranks):
            errors.seek(0)
            raise RuntimeError(f"dataset.py case f: rank exit codes {[process.returncode for process in ranks]}\n"
                               f"{errors.read().decode(errors='replace')[-3000:]}")
    import json

    results = [json.loads(output.decode().strip().splitlines()[-1]) for output in outputs]
    launcher_end_s = time.process_time()
    mark = {"start": launcher_start_s, "end": launcher_end_s}
    return {"samples": sum(result["samples"] for result in results),
            "batches": sum(result["batches"] for result in results),
            "seconds": max(result["seconds"] for result in results),
            "window": [min(result["window"][0] for result in results), max(result["window"][1] for result in results)],
            "ranks": [{key: result[key] for key in ("samples", "batches", "seconds", "first_batch_s", "construct_s")}
                      for result in results],
            "warnings": sorted({item for result in results for item in result["warnings"]}),
            "cpu_start": {key: mark["start"] * (key == "tree_s") + sum(result["cpu_start"][key] for result in results)
                          for key in ("tree_s", "trainer_s")},
            "cpu_end": {key: mark["end"] * (key == "tree_s") + sum(result["cpu_end"][key] for result in results)
                        for key in ("tree_s", "trainer_s")}}


def run_case(letter: str, workers: int, rounds: int, seconds: float) -> dict:
    """Per contender, its runs' results in round order, each run a child process (for the CPU
    of its workers) whose processes' PSS is sampled from here while it runs."""
    results = {"torch": [], "shmloader": []}
    for round_index in range(rounds):  # Alternate, so the host's caches and noise hit both.
        order = ["torch", "shmloader"] if round_index % 2 == 0 else ["shmloader", "torch"]
        for contender in order:
            command = [sys.executable, os.path.abspath(__file__), "--child", contender, "--cases", letter,
                       "--workers", str(workers), "--seconds", str(seconds)]
            with PssSampler() as memory:
                result = run_contender(command, seconds + 300, f"dataset.py --child {contender} --cases {letter}")
            rank_rates = [rank["samples"] / rank["seconds"] for rank in result.get("ranks", ())]
            result.update(rate=sum(rank_rates) if rank_rates else result["samples"] / result["seconds"],
                          rank_rates=rank_rates, pss_bytes=memory.peak_bytes, pss_processes=memory.peak_processes,
                          pss_window_bytes=memory.median_between(*result["window"]),
                          load=os.getloadavg()[0])
            results[contender].append(result)
    return results


def _median(runs: list[dict], value) -> float:
    return statistics.median(value(run) for run in runs)


def _rate_cell(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def _ratio(results: dict, value) -> tuple[float, str]:
    """The median over the rounds of shmloader's `value` over torch's in the same round."""
    ratios = [value(mine) / value(theirs) for theirs, mine in zip(results["torch"], results["shmloader"])]
    median = statistics.median(ratios)
    return median, f"{median:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _pair(results: dict, value, digits: int = 3) -> str:
    return " / ".join(f"{_median(results[key], value):.{digits}f}" for key in ("torch", "shmloader"))


def case_rows(letter: str, results: dict) -> tuple[list[list], dict]:
    """The table's rows for one case, and its figures (ratios, memory, first batch)."""
    case, runs = CASES[letter], [run for key in ("torch", "shmloader") for run in results[key]]
    loads = [run["load"] for run in runs]
    load = f"{min(loads):.1f}-{max(loads):.1f}"
    rows, figures = [], {}
    for rank in range(RANKS if case.kind == "ranks" else 0):
        rate = lambda run, rank=rank: run["rank_rates"][rank]  # noqa: E731
        figures[f"rank {rank}"], ratio_cell = _ratio(results, rate)
        rows.append([f"{letter}: {case.title}, rank {rank}", *(_rate_cell([rate(run) for run in results[key]])
                                                               for key in ("torch", "shmloader")), ratio_cell,
                     _pair(results, lambda run, rank=rank: run["ranks"][rank]["first_batch_s"]),
                     _pair(results, lambda run, rank=rank: run["ranks"][rank]["construct_s"]), "-", "", "", "", "",
                     "", "", load])
    figures["ratio"], ratio_cell = _ratio(results, lambda run: run["rate"])
    figures["memory"], _ = _ratio(results, lambda run: run["pss_bytes"])
    figures["memory_window"], _ = _ratio(results, lambda run: run["pss_window_bytes"])
    figures["first_batch_s"] = _median(results["shmloader"], lambda run: run.get("first_batch_s", 0.0))
    epoch_starts = "-"
    if case.kind == "epochs":
        medians = {key: [statistics.median(run["epoch_starts_s"][epoch] for run in results[key])
                         for epoch in range(EPOCHS)] for key in ("torch", "shmloader")}
        epoch_starts = "; ".join(f"{key} " + "/".join(f"{value:.2f}" for value in medians[key]) for key in medians)
    cpu = {key: _median(results[key], lambda run: run["cpu_s"] / run["samples"] * 1e6) for key in results}
    trainer = {key: _median(results[key], lambda run: 1000 * run["trainer_cpu_s"] / run["batches"]) for key in results}
    memory = {key: _median(results[key], lambda run: run["pss_bytes"] / 1e6) for key in results}
    steady = {key: _median(results[key], lambda run: run["pss_window_bytes"] / 1e6) for key in results}
    first = "-" if case.kind == "ranks" else _pair(results, lambda run: run["first_batch_s"])
    construct = "-" if case.kind == "ranks" else _pair(results, lambda run: run["construct_s"])
    rows.append([f"{letter}: {case.title}" + (f", all {RANKS} ranks" if case.kind == "ranks" else ""),
                 *(_rate_cell([run["rate"] for run in results[key]]) for key in ("torch", "shmloader")), ratio_cell,
                 first, construct, epoch_starts, format_per_million(cpu["torch"]),
                 format_per_million(cpu["shmloader"]), f"{trainer['torch']:.2f}", f"{trainer['shmloader']:.2f}",
                 f"{memory['torch']:,.0f} / {memory['shmloader']:,.0f} ({memory['shmloader'] / memory['torch']:.2f}x)",
                 f"{steady['torch']:,.0f} / {steady['shmloader']:,.0f} ({steady['shmloader'] / steady['torch']:.2f}x)",
                 load])
    figures.update(cpu=cpu, rate=_median(results["shmloader"], lambda run: run["rate"]))
    return rows, figures


HEADER = ["case", "torch DataLoader samples/s (min-max)", "shmloader.torch samples/s (min-max)",
          "ratio (rounds' min-max)", "first batch s, torch / shmloader", "DataLoader() s, torch / shmloader",
          "epoch starts s", "torch CPU s / M samples", "shmloader CPU s / M samples", "torch trainer CPU ms/batch",
          "shmloader trainer CPU ms/batch", "PSS peak MB, torch / shmloader",
          "PSS in the timed window MB (median), torch / shmloader", "load avg (1 min)"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--cases", default="abcdefg", help="which cases, by letter")
    parser.add_argument("--child", choices=("torch", "shmloader"), help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # Case (f): one rank's child.
    add_write_argument(parser)
    arguments = parser.parse_args()
    if arguments.child:
        run_child(arguments.child, arguments.cases, arguments.workers, arguments.seconds, arguments.rank)
    unknown = set(arguments.cases) - set(CASES)
    if unknown:
        parser.error(f"--cases: {''.join(sorted(unknown))} are not cases; expected letters of {''.join(CASES)}")
    print(f"load average at the start: {' '.join(f'{value:.2f}' for value in os.getloadavg())}", flush=True)
    rows, headline, figures, notes = [], [], {}, []
    for letter in (letter for letter in CASES if letter in arguments.cases):
        results = run_case(letter, arguments.workers, arguments.rounds, arguments.seconds)
        case_table, figures[letter] = case_rows(letter, results)
        rows += case_table
        for key in results:
            notes += [f"{letter}, {key}: {warning}" for warning in
                      sorted({item for run in results[key] for item in run["warnings"]})]
        cpu = figures[letter]["cpu"]
        headline.append([f"your Dataset, {CASES[letter].title}", f"{figures[letter]['rate']:,.0f} samples/s", "n/a",
                         f"{figures[letter]['ratio']:.2f}x",
                         f"{format_per_million(cpu['shmloader'])} / {format_per_million(cpu['torch'])} per M samples"])
        for row in case_table:
            print(row, flush=True)
    print(f"\n{machine_line()}; {arguments.workers} workers each, {arguments.rounds} alternating rounds of "
          f"{arguments.seconds:g} s, medians; load average at the end: "
          f"{' '.join(f'{value:.2f}' for value in os.getloadavg())}\n")
    print(table(rows, HEADER))
    print("\n" + "\n".join(notes))
    record("dataset", command_line("dataset.py"), HEADER, rows, headline, notes=notes, write=arguments.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`shmloader bench`: measure the loader (and optionally PyTorch's DataLoader) on the user's own files."""

from __future__ import annotations

import glob
import os
import pathlib
import statistics
import time

import numpy as np

from ..loader import ShmDataLoader
from ..plan.defaults import TRAINER_SLOTS, usable_cores
from ..plan.fields import Packed
from ..storage.ragged import describe_ragged, is_ragged
from ..storage.spec import describe_field
from .measuring import StopRule, describe_cache, describe_figure, measure, page_cache_share

# --sweep tries these many slots per reader for each reader count, plus the trainer's two
# (the loader's default is 4 per reader + 2; with fewer than 2 per reader readers ran dry).
_SLOTS_PER_READER = (2, 4)


def field_names(paths: list[str]) -> dict[str, str]:
    """Field names from file names (stems; a glob's, without its wildcards), made unique."""
    names: dict[str, str] = {}
    for path in paths:
        stem = pathlib.Path(path).name.split(".")[0].strip("*?[]-_") or "field"
        name, counter = stem, 1
        while name in names:
            counter += 1
            name = f"{stem}{counter}"
        names[name] = path
    return names


def touch(batch) -> int:
    """Reads one byte per row of every field, so that a lazy loader cannot skip work."""
    total = 0
    for array in batch.values():
        flat = array.reshape(len(array), -1)
        total += int(flat[:, 0].view(np.uint8).sum()) if flat.dtype.itemsize == 1 else int(flat[:, 0].sum())
    return total


def run_loader(fields: dict, batch_size: int, readers, slots, mode: str, progress: bool, rule: StopRule) -> dict:
    """One measurement of the loader: a warm-up, then rounds until the rate settles (`rule`)."""
    from tqdm import tqdm

    started = time.perf_counter()
    declared = {name: Packed(path) if is_ragged(path) else path for name, path in fields.items()}
    with ShmDataLoader(declared, batch_size=batch_size, readers=readers, slots=slots, mode=mode) as loader:
        first = next(loader)
        first_batch_s = time.perf_counter() - started
        batch_bytes = sum(array.nbytes for array in first.values())
        touch(first)
        del first
        # A bar updated by hand: tqdm(zip(range(n), loader)) keeps the batch before the
        # loop variable's alive (in the tuple tqdm holds), one more than a plain loop.
        with tqdm(desc=f"readers={loader.readers} slots={loader.slots}", unit=" batches", disable=not progress,
                  leave=False) as bar:
            def step() -> int:
                batch = next(loader)
                touch(batch)
                del batch
                bar.update()
                return batch_size

            result = measure(step, rule)
        stats = loader.stats()
        result.update({
            # Under readers="auto" (the default) loader.readers is the most it may reach: the
            # readers that ran at the end, and the most (None for a fixed count).
            "readers": stats["reader_count"],
            "readers_most": stats.get("readers_most"),
            "slots": loader.slots,
            "batches_per_s": result["rows_per_s"] / batch_size,
            "gb_per_s": result["rows_per_s"] / batch_size * batch_bytes / 1e9,  # Slot bytes (a Packed field's capacity).
            "wait_fraction": stats["wait_fraction"],
            "first_batch_s": first_batch_s,
            "shared_memory_mib": loader.diagnostics.shared_memory_bytes / 2**20,
            "starved_fraction": max((reader["starved_fraction"] for reader in stats["readers"]), default=0.0),
            "batches_per_wakeup": sum(r["batches"] for r in stats["readers"]) / max(1, sum(r["wakeups"] for r in stats["readers"])),
        })
        return result


class TorchRows:
    """A map-style dataset for PyTorch's DataLoader whose __getitems__ gathers a whole batch
    the way a PyTorch user would: np.take on memory-mapped .npy, Blosc2's own indexing on .b2nd."""

    def __init__(self, fields: dict) -> None:
        self.fields = fields
        self.row_count = describe_field(next(iter(fields.values()))).row_count
        self.arrays = None

    def _open(self) -> None:
        import blosc2

        self.arrays = {}
        for name, path in self.fields.items():
            if describe_field(path).kind == "npy":
                self.arrays[name] = np.load(path, mmap_mode="r")
            else:
                self.arrays[name] = blosc2.open(path, mode="r")

    def __len__(self) -> int:
        return self.row_count

    def __getitems__(self, indices):
        import torch

        if self.arrays is None:
            self._open()
        order = np.asarray(indices)
        batch = {}
        for name, array in self.arrays.items():
            if isinstance(array, np.ndarray):
                batch[name] = torch.from_numpy(np.take(array, order, axis=0))
            else:
                # Blosc2 reads sorted, unique coordinates fastest; scatter back afterwards.
                unique, inverse = np.unique(order, return_inverse=True)
                batch[name] = torch.from_numpy(np.asarray(array[unique])[inverse])
        return batch


def _no_collate(batch):
    """__getitems__ already returns the whole batch (module level: workers pickle it)."""
    return batch


def run_torch(fields: dict, batch_size: int, workers: int, rule: StopRule) -> dict:
    """PyTorch's DataLoader over the same files, measured by the same rule as the loader."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    torch.set_num_threads(1)
    dataset = TorchRows(fields)
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=RandomSampler(dataset), num_workers=workers,
        collate_fn=_no_collate, persistent_workers=workers > 0, prefetch_factor=4 if workers > 0 else None,
        # Forking a process that runs threads (the loader's, torch's) risks a deadlock in
        # the child; forkserver starts workers from a clean single-threaded server.
        multiprocessing_context="forkserver" if workers > 0 else None,
    )
    iterator = iter(loader)

    def step() -> int:
        nonlocal iterator
        try:
            batch = next(iterator)
        except StopIteration:  # An epoch ended: the next one, as a training loop would.
            iterator = iter(loader)
            batch = next(iterator)
        touch({name: tensor.numpy() for name, tensor in batch.items()})
        return len(next(iter(batch.values())))

    try:
        return measure(step, rule)
    finally:
        del iterator


def _print_result(result: dict, rule: StopRule) -> None:
    runs = result.get("rows_per_s_range")
    figure = (f"median of {result['repeats']} runs ({runs[0]:,.0f}-{runs[1]:,.0f})" if runs
              else describe_figure(result, rule))
    most = result.get("readers_most")
    readers = result["readers"] if most is None else f"auto ({result['readers']} at the end, at most {most})"
    print(
        f"readers={readers} slots={result['slots']}: {result['rows_per_s']:,.0f} rows/s, {figure}; "
        f"{result['gb_per_s']:.2f} GB/s, {result['batches_per_s']:,.1f} batches/s, trainer waited "
        f"{result['wait_fraction']:.0%}, readers starved up to {result['starved_fraction']:.0%} "
        f"({result['batches_per_wakeup']:.1f} batches per wake-up), first batch {result['first_batch_s']:.2f} s, "
        f"shared memory {result['shared_memory_mib']:.1f} MiB"
    )


def _require(module: str, option: str, package: str, extra: str) -> None:
    """Refuses an option whose optional dependency is missing, before anything runs."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"{option} needs {package}, which is not installed: pip install {package} "
            f"(or, from a source checkout of shmloader, pip install '.[{extra}]')"
        )


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for per_reader in _SLOTS_PER_READER:
        points = sorted((r["readers"], r["rows_per_s"]) for r in results
                        if r["slots"] == per_reader * r["readers"] + TRAINER_SLOTS)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                  label=f"slots = {per_reader} x readers + {TRAINER_SLOTS}")
    axis.set_xticks(sorted({result["readers"] for result in results}))
    axis.set_xlabel("reader processes")
    axis.set_ylabel("rows / s")
    axis.set_title("shmloader throughput")
    axis.legend()
    axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"plot written to {path}")


def _describe(path: str) -> str:
    if is_ragged(path):
        spec = describe_ragged(path)
        return f"{spec.path}, {spec.record_count:,} ragged records of {spec.dtype}, read as Packed"
    if glob.has_magic(path):
        parts = [describe_field(part) for part in sorted(glob.glob(path))]
        if not parts:
            raise FileNotFoundError(f"no file matches {path}")
        return f"{path}, {len(parts):,} files, {sum(part.row_count for part in parts):,} rows of {parts[0].row_shape} " \
               f"{parts[0].numpy_dtype}"
    spec = describe_field(path)
    return f"{path}, {spec.row_count:,} rows of {spec.row_shape} {spec.numpy_dtype}"


def _sweep(fields: dict, arguments, points: list[tuple[int, int]], progress: bool, rule: StopRule) -> list[dict]:
    """Each point run `repeats` times, every round over all points (in reverse order on odd
    rounds, so that a machine's drift does not favour one end), each run measured by `rule`;
    a point's rows_per_s is the median of its runs, with their lowest and highest."""
    rates: dict[tuple[int, int], list[dict]] = {point: [] for point in points}
    for round_index in range(arguments.repeats):
        for readers, slots in (points if round_index % 2 == 0 else points[::-1]):
            rates[readers, slots].append(run_loader(fields, arguments.batch_size, readers, slots, arguments.mode,
                                                    progress, rule))
    results = []
    for point in points:
        runs = sorted(rates[point], key=lambda result: result["rows_per_s"])
        result = dict(runs[len(runs) // 2])  # The middle run's statistics, the median's rate.
        result["rows_per_s"] = statistics.median(run["rows_per_s"] for run in runs)
        result["rows_per_s_range"] = (runs[0]["rows_per_s"], runs[-1]["rows_per_s"])
        result["repeats"] = len(runs)
        results.append(result)
        _print_result(result, rule)
    return results


def _pick(results: list[dict]) -> str:
    """The best point by median, and whether another point's runs reach it."""
    best = max(results, key=lambda result: result["rows_per_s"])
    close = [result for result in results if result is not best
             and result["rows_per_s_range"][1] >= best["rows_per_s_range"][0]]
    text = f"best: readers={best['readers']} slots={best['slots']} ({best['rows_per_s']:,.0f} rows/s median)"
    if not close:
        return text + "; every other setting's runs stayed below its slowest run"
    shown = ", ".join(f"readers={result['readers']} slots={result['slots']}" for result in close[:4])
    return text + f"; within run-to-run noise of {shown}: any of them will do (more --repeats tell them apart)"


def stop_rule(arguments) -> StopRule:
    """The measurement's rule from the options: --steps (one fixed round), else --seconds at
    most and --tolerance; a sweep's point lasts --seconds-per-point (its repeats and their
    range tell noise apart)."""
    if arguments.steps is not None:
        return StopRule(steps=arguments.steps)
    if arguments.sweep:
        seconds = arguments.seconds_per_point
        return StopRule(warmup_s=min(1.0, seconds), round_s=max(seconds / 5, 0.05), window=5,
                        tolerance=arguments.tolerance, min_s=seconds, max_s=seconds)
    return StopRule(tolerance=arguments.tolerance, max_s=max(arguments.seconds, StopRule.min_s))


def _check_options(fields: dict, arguments) -> None:
    if arguments.plot and not arguments.sweep:
        raise ValueError("--plot goes with --sweep")
    if arguments.plot:
        _require("matplotlib", "--plot", "matplotlib", "plot")
    if arguments.compare == "torch":
        _require("torch", "--compare torch", "torch", "torch")
        for path in fields.values():
            if is_ragged(path) or glob.has_magic(path):
                raise ValueError(f"--compare torch takes single .npy or .b2nd files; {path} is "
                                 f"{'a ragged directory' if is_ragged(path) else 'a glob'}")


def run_cli(arguments) -> int:
    fields = field_names(arguments.files)
    for name, path in fields.items():
        print(f"field {name!r}: {_describe(path)}")
    progress = not arguments.quiet
    _check_options(fields, arguments)
    rule = stop_rule(arguments)
    cache_before = page_cache_share(list(fields.values()))
    results = []
    if arguments.sweep:
        cores = usable_cores()
        reader_counts = sorted({1, 2, max(1, cores // 2), cores, 2 * cores})
        points = [(readers, per_reader * readers + TRAINER_SLOTS) for readers in reader_counts
                  for per_reader in _SLOTS_PER_READER]
        results = _sweep(fields, arguments, points, progress, rule)
        print(_pick(results))
        if arguments.plot:
            _plot(results, arguments.plot)
    else:
        results.append(run_loader(fields, arguments.batch_size, arguments.readers, arguments.slots, arguments.mode,
                                  progress, rule))
        _print_result(results[-1], rule)
    if arguments.compare == "torch":
        best = max(results, key=lambda result: result["rows_per_s"])
        workers = best["readers"]  # The best point's.
        theirs = run_torch(fields, arguments.batch_size, workers, rule)
        print(f"PyTorch DataLoader, {workers} workers, __getitems__: {theirs['rows_per_s']:,.0f} rows/s, "
              f"{describe_figure(theirs, rule)}")
        print(f"shmloader / PyTorch DataLoader: {best['rows_per_s'] / theirs['rows_per_s']:.1f}x "
              f"(readers={best['readers']} against {workers} workers, batch {arguments.batch_size}, "
              f"both measured the same way in this run"
              f"{'' if best.get('settled', True) and theirs['settled'] else '; not both stable, so a rough ratio'})")
    print(describe_cache(cache_before, page_cache_share(list(fields.values()))))
    return 0

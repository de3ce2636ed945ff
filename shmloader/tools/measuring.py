"""How `shmloader bench` decides a figure is stable, and whether the data was in the page cache."""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import mmap
import os
import statistics
import time
from typing import Callable

# Below this share of the data in the page cache at the start, a run reads from the disk
# and its figure says so: a warm run next time can be many times faster.
COLD_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class StopRule:
    """When to stop measuring: after a warm-up, rounds of `round_s` seconds until the
    last `window` rounds agree within `tolerance` (max - min over their median) and at
    least `min_s` seconds were timed, or `max_s` seconds (then the spread says how far it
    got). `steps` instead times that many batches as one round (no spread)."""

    warmup_s: float = 1.0
    round_s: float = 0.5
    window: int = 5
    tolerance: float = 0.03
    min_s: float = 2.5
    max_s: float = 20.0
    steps: int | None = None


def spread(rates: list[float]) -> float:
    """(max - min) / median: 0.04 means the rounds lay within 4% of their median."""
    if len(rates) < 2:
        return 0.0
    return (max(rates) - min(rates)) / statistics.median(rates)


def settled(rates: list[float], timed_s: float, rule: StopRule) -> bool:
    """Whether to stop after these rounds' rates, `timed_s` seconds of them."""
    if rule.steps is not None:
        return len(rates) >= 1
    if timed_s >= rule.max_s and rates:
        return True
    return len(rates) >= rule.window and timed_s >= rule.min_s and spread(rates[-rule.window:]) <= rule.tolerance


def summary(rates: list[float], timed_s: float, rule: StopRule) -> dict:
    """The figure of a measurement. Settled: the median of the last `window` rounds and
    their range. Not settled (the time limit came first): the median of every round, which
    a few slow rounds move less, and the spread of their middle half."""
    assert rates, "a measurement has at least one round"
    last = rates[-rule.window:]
    if rule.steps is not None or spread(last) <= rule.tolerance:
        return {"rows_per_s": statistics.median(last), "spread": spread(last), "rounds": len(rates),
                "rounds_used": len(last), "timed_s": timed_s, "settled": True}
    ordered = sorted(rates)
    middle = ordered[len(ordered) // 4:len(ordered) - len(ordered) // 4]
    return {"rows_per_s": statistics.median(rates), "spread": spread(middle), "rounds": len(rates),
            "rounds_used": len(rates), "timed_s": timed_s, "settled": False}


def measure(step: Callable[[], int], rule: StopRule, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Calls `step` (one batch; it returns the rows delivered) through a warm-up and then
    rounds until `rule` says the rate settled; returns `summary`'s figure."""
    if rule.steps is None:
        started = clock()
        while clock() - started < rule.warmup_s:
            step()
    rates: list[float] = []
    timed_s = 0.0
    while not settled(rates, timed_s, rule):
        rows, round_started = 0, clock()
        if rule.steps is not None:
            for _ in range(rule.steps):
                rows += step()
        else:
            while clock() - round_started < rule.round_s:
                rows += step()
        elapsed = max(clock() - round_started, 1e-9)
        timed_s += elapsed
        rates.append(rows / elapsed)
    return summary(rates, timed_s, rule)


def describe_figure(result: dict, rule: StopRule) -> str:
    """'median of N rounds, spread x%' in words, and what an unsettled figure means."""
    if rule.steps is not None:
        return f"one round of {rule.steps} batches (no spread: leave out --steps to measure until stable)"
    if result["settled"]:
        return (f"median of the last {result['rounds_used']} of {result['rounds']} rounds of {rule.round_s:g} s, "
                f"spread {result['spread']:.1%}")
    return (f"median of all {result['rounds']} rounds of {rule.round_s:g} s, the middle half within "
            f"{result['spread']:.1%}; NOT stable within {rule.max_s:g} s (no {rule.window} rounds in a row within "
            f"{rule.tolerance:.0%}: a busy machine? run it at a quieter moment, or give more --seconds)")


def data_files(path: str) -> list[str]:
    """The files a field reads: a glob's matches, a directory's files (ragged fields,
    sparse Blosc2 frames), or the file itself."""
    paths = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
    files = []
    for found in paths:
        if os.path.isdir(found):
            files += sorted(os.path.join(root, name) for root, _, names in os.walk(found) for name in names)
        elif os.path.isfile(found):
            files.append(found)
    return files


def _resident_pages(path: str) -> tuple[int, int]:
    """(pages in the page cache, pages) of one file, from mincore over a read-only mapping
    that touches none of them. (0, 0) for an empty file or where mincore is unavailable."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        # ACCESS_COPY: a private mapping Python lets ctypes take the address of; nothing is
        # written to it, so no page is copied and none is read.
        anchor = ctypes.c_char.from_buffer(mapped)
        try:
            status = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector)
        finally:
            del anchor
    if status != 0:
        return 0, 0
    return sum(flag & 1 for flag in bytes(vector)), pages


def page_cache_share(paths: list[str]) -> tuple[float, int] | None:
    """The share of the data's pages in the page cache, and the data's bytes; None where
    it cannot be told (no mincore on this system, no file with data)."""
    resident = total = size = 0
    for path in paths:
        for file in data_files(path):
            try:
                found, pages = _resident_pages(file)
            except (OSError, AttributeError, ValueError):
                return None
            resident, total, size = resident + found, total + pages, size + os.path.getsize(file)
    if total == 0:
        return None
    return resident / total, size


def describe_cache(before: tuple[float, int] | None, after: tuple[float, int] | None) -> str:
    """The page cache in one line: warm, or cold (the figure includes the disk), or data
    that does not stay in memory."""
    if before is None:
        return "page cache: not measured (no mincore here)"
    share, size = before
    text = f"page cache: {share:.0%} of the data's {size / 1e6:,.{0 if size >= 1e8 else 2}f} MB was in memory at the start"
    if share < COLD_SHARE:
        text += ("; COLD: this run read from the disk and its figure includes that (run again for the warm-cache "
                 "figure, or keep it if training reads cold data)")
    if after is not None and after[0] < COLD_SHARE:
        text += f"; {after[0]:.0%} after the run: the data does not stay in the page cache (disk-bound)"
    return text

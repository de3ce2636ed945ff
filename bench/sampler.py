"""Sampler speed: indices per second for shuffle and random, against numpy doing the same job.

Run: python bench/sampler.py
It reports shuffle's indices/s at B=8192 on one core, the cost of one fill() from Python at
B=256 with a preallocated `out`, and a three-source mixture's rate (weights 7/2/1, one source
down-sampled, one fixed subset) against plain shuffle's.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from _common import best_rate, machine_line, table

from shmloader import Sampler
from shmloader._native import ffi
from shmloader.plan.sources import MixtureSampler

LENGTH = 1_281_167  # ImageNet's training set: not a power of two.


def numpy_random(batch_size: int):
    rng = np.random.default_rng(0)
    return lambda: rng.integers(0, LENGTH, size=batch_size, dtype=np.uint64)


def numpy_shuffle(batch_size: int):
    """A per-epoch permutation sliced into batches (its cost amortised over the epoch)."""
    rng = np.random.default_rng(0)
    state = {"permutation": rng.permutation(LENGTH).astype(np.uint64), "offset": 0}

    def next_batch():
        if state["offset"] + batch_size > LENGTH:
            state["permutation"] = rng.permutation(LENGTH).astype(np.uint64)
            state["offset"] = 0
        batch = state["permutation"][state["offset"]: state["offset"] + batch_size]
        state["offset"] += batch_size
        return batch

    return next_batch


def shmloader_fill(mode: str, batch_size: int):
    sampler = Sampler(LENGTH, batch_size, mode, seed=1)
    out = np.empty(batch_size, dtype=np.uint64)
    state = {"step": 0}

    def fill():
        sampler.fill(state["step"], out)
        state["step"] += 1

    return fill


def mixture_fill(batch_size: int):
    lengths = [LENGTH, LENGTH // 5, LENGTH // 20]
    sampler = MixtureSampler(lengths, [7, 2, 1], [1.0, 0.5, 0.3], [False, False, True], batch_size, seed=1)
    rows = np.empty(batch_size, dtype=np.uint64)
    sources = np.empty(batch_size, dtype=np.uint32)
    rows_pointer, sources_pointer = ffi.from_buffer("uint64_t[]", rows), ffi.from_buffer("uint32_t[]", sources)
    state = {"step": 0}

    def fill():
        sampler.fill_unchecked(state["step"], rows_pointer, sources_pointer)
        state["step"] += 1

    return fill


def fill_call_microseconds(batch_size: int = 256, calls: int = 20000, repeats: int = 7) -> float:
    sampler = Sampler(LENGTH, batch_size, "shuffle", seed=1)
    out = np.empty(batch_size, dtype=np.uint64)
    medians = []
    for _ in range(repeats):
        started = time.perf_counter()
        for step in range(calls):
            sampler.fill(step, out)
        medians.append((time.perf_counter() - started) / calls * 1e6)
    return min(medians)


def main() -> int:
    print(f"# sampler benchmark ({machine_line()}), N = {LENGTH:,}")
    rows, results = [], {}
    for mode, baseline in (("shuffle", numpy_shuffle), ("random", numpy_random)):
        for batch_size in (256, 8192):
            ours = best_rate(shmloader_fill(mode, batch_size), batch_size)
            theirs = best_rate(baseline(batch_size), batch_size)
            results[(mode, batch_size)] = ours
            numpy_job = "rng.permutation per epoch, sliced" if mode == "shuffle" else "rng.integers"
            rows.append([mode, batch_size, f"{ours / 1e6:.1f}", f"{theirs / 1e6:.1f}", numpy_job, f"{ours / theirs:.2f}x"])
    print(table(rows, ["mode", "B", "shmloader M idx/s", "numpy M idx/s", "numpy does", "ratio"]))
    mixture_rows = []
    for batch_size in (256, 8192):
        mixture = best_rate(mixture_fill(batch_size), batch_size)
        results[("mixture", batch_size)] = mixture
        mixture_rows.append([batch_size, f"{mixture / 1e6:.1f}", f"{results[('shuffle', batch_size)] / 1e6:.1f}",
                             f"{mixture / results[('shuffle', batch_size)]:.0%}"])
    print("\n## three-source mixture (weights 7/2/1, fractions 1/0.5/0.3 fixed)")
    print(table(mixture_rows, ["B", "mixture M idx/s", "plain shuffle M idx/s", "share"]))
    call_us = fill_call_microseconds()
    shuffle_rate = results[("shuffle", 8192)]
    print()
    print(f"one fill() call, B=256, preallocated out: {call_us:.2f} us")
    print(f"shuffle at B=8192: {shuffle_rate / 1e6:.1f} M indices/s")
    for batch_size in (256, 8192):
        share = results[("mixture", batch_size)] / results[("shuffle", batch_size)]
        print(f"three-source mixture at B={batch_size}: {share:.0%} of plain shuffle's rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())

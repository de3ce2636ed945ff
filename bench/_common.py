"""Helpers shared by the benchmarks: timing, test data that compresses like images, tables."""

from __future__ import annotations

import os
import platform
import time

import numpy as np


def best_rate(function, items_per_call: int, repeats: int = 5, min_seconds: float = 0.2) -> float:
    """The best of `repeats` measurements of items per second (noise on a shared machine is one-sided)."""
    best = 0.0
    for _ in range(repeats):
        calls, started = 0, time.perf_counter()
        while True:
            function()
            calls += 1
            elapsed = time.perf_counter() - started
            if elapsed >= min_seconds:
                break
        best = max(best, calls * items_per_call / elapsed)
    return best


def image_rows(rows: int, row_bytes: int, seed: int = 0) -> np.ndarray:
    """uint8 rows that compress like natural images (smooth gradients plus sensor noise),
    not like pure noise, nor like a constant: LZ4 gains little on them, ZSTD some."""
    rng = np.random.default_rng(seed)
    side = int(np.sqrt(row_bytes / 3))
    out = np.empty((rows, row_bytes), dtype=np.uint8)
    position = np.arange(row_bytes)
    for start in range(0, rows, 1024):
        stop = min(start + 1024, rows)
        count = stop - start
        slope = rng.uniform(0.02, 0.2, size=(count, 1))
        phase = rng.uniform(0, 255, size=(count, 1))
        pixel = position // 3
        smooth = phase + slope * (pixel % max(side, 1)) + slope * (pixel // max(side, 1)) * 0.5
        noise = rng.normal(0, 2, size=(count, row_bytes))
        out[start:stop] = np.clip(smooth + noise, 0, 255).astype(np.uint8)
    return out


def machine_line() -> str:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return f"{platform.machine()}, {cores} cores, Python {platform.python_version()}, numpy {np.__version__}"


def table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [" | ".join(str(cell).ljust(width) for cell, width in zip(header, widths))]
    lines.append("-|-".join("-" * width for width in widths))
    lines += [" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


RESULTS_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def record(benchmark: str, command: str, header: list[str], rows: list[list], headline: list[list] = (),
           notes: list[str] = ()) -> str:
    """Writes bench/results/<benchmark>.json: the run's table, where and when it ran, and
    `headline`, its rows for the README's table ([what, rate, / single process, / PyTorch]).
    `python bench/report.py` turns these files into RESULTS.md's current table and the
    README's. Returns the path."""
    import datetime
    import json
    import subprocess

    root = os.path.dirname(RESULTS_DIRECTORY)
    try:  # The commit measured; "-dirty" where a file other than the results differs from it.
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  ":(exclude)bench/results"], cwd=root, capture_output=True, text=True,
                                 check=True).stdout.strip()
        commit += "-dirty" if changed else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    data = {"benchmark": benchmark, "command": command, "date": datetime.date.today().isoformat(), "commit": commit,
            "machine": machine_line(), "header": list(header), "rows": [[str(cell) for cell in row] for row in rows],
            "headline": [[str(cell) for cell in row] for row in headline], "notes": list(notes)}
    os.makedirs(RESULTS_DIRECTORY, exist_ok=True)
    path = os.path.join(RESULTS_DIRECTORY, f"{benchmark}.json")
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")
    return path

"""Start-up on a field of many small files: the time from ShmDataLoader(...) to the first
batch, split into the plan (each file's header read and checked) and the rest (the ring, the
readers' configuration, their first step), against reading the same files once with numpy.

Run: python bench/many_files.py [--files 10000] [--readers 2] [--repeats 3]
Data: FILES .npy files of 1 to 3 int64 rows each (written once under the data directory).
Each figure is the best of --repeats runs (the files stay in the page cache).
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import numpy as np
from _common import machine_line, table
from gather import DATA_DIR

from shmloader import ShmDataLoader
from shmloader.plan.options import LoaderOptions
from shmloader.plan.planner import plan_loader


def make_files(count: int) -> str:
    directory = os.path.join(str(DATA_DIR), f"many_files_{count}")
    if not os.path.exists(os.path.join(directory, "done")):
        os.makedirs(directory, exist_ok=True)
        start = 0
        for shard in range(count):
            size = 1 + (shard * 7) % 3
            np.save(os.path.join(directory, f"part-{shard:06d}.npy"), np.arange(start, start + size, dtype=np.int64))
            start += size
        open(os.path.join(directory, "done"), "w").close()
    return os.path.join(directory, "part-*.npy")


def best(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pattern = make_files(args.files)
    paths = sorted(glob.glob(pattern))

    def numpy_headers():
        for path in paths:
            np.load(path, mmap_mode="r")

    def plan():
        plan_loader({"x": pattern}, None, LoaderOptions(batch_size=500, mode="sequential"))

    def first_batch():
        with ShmDataLoader({"x": pattern}, batch_size=500, readers=args.readers, mode="sequential") as loader:
            batch = next(loader)
            assert np.array_equal(batch["x"], batch.indices.astype(np.int64))

    print(machine_line())
    rows = [("np.load(mmap_mode='r') of every file", best(numpy_headers, args.repeats)),
            ("shmloader plan (headers read and checked)", best(plan, args.repeats)),
            (f"shmloader to the first batch ({args.readers} readers)", best(first_batch, args.repeats))]
    print(table([[name, f"{seconds:.2f}"] for name, seconds in rows], ["what", "seconds"]))


if __name__ == "__main__":
    main()

"""Start-up and shutdown of a loader: readers forked by the trainer's fork server against
readers started as interpreters of their own (SHMLOADER_FORKSERVER=0), in the same run.

For each reader count: the median over --loaders loaders, one after another in one trainer
(as an evaluation loader made each epoch is), of the time from ShmDataLoader(...) to the
first batch, and of close(); a trainer's first loader (which starts the fork server)
separately. Each mode runs in a fresh trainer process. Every batch is checked.

Run: python bench/startup.py [--readers 1,2,4] [--loaders 15]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import machine_line, table

_TRAINER = """
import json, statistics, sys, time
import numpy as np
from shmloader import ShmDataLoader
path, counts, loaders = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
rows = np.load(path)
out = {}
for count in counts:
    times = []
    for _ in range(loaders):
        started = time.perf_counter()
        loader = ShmDataLoader({"x": path}, batch_size=64, readers=count, seed=len(times))
        batch = next(loader)
        first = time.perf_counter()
        assert np.array_equal(batch["x"], rows[batch.indices])
        checked = time.perf_counter()
        loader.close()
        times.append((first - started, time.perf_counter() - checked))
    out[count] = {"first_ever": times[0][0], "first_batch": statistics.median(t[0] for t in times[1:]),
                  "close": statistics.median(t[1] for t in times[1:])}
print(json.dumps(out))
"""


def run(mode: str, path: str, counts: list[int], loaders: int) -> dict:
    environment = dict(os.environ, SHMLOADER_FORKSERVER="1" if mode == "forked" else "0")
    result = subprocess.run([sys.executable, "-c", _TRAINER, path, json.dumps(counts), str(loaders)],
                            capture_output=True, text=True, env=environment, check=True)
    return {int(count): figures for count, figures in json.loads(result.stdout).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", default="1,2,4")
    parser.add_argument("--loaders", type=int, default=15)
    args = parser.parse_args()
    counts = [int(count) for count in args.readers.split(",")]
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "rows.npy")
        np.save(path, np.arange(4096 * 16, dtype=np.float32).reshape(4096, 16))
        started = time.perf_counter()
        results = {mode: run(mode, path, counts, args.loaders) for mode in ("forked", "interpreter")}
    print(machine_line())
    rows = []
    for count in counts:
        forked, alone = results["forked"][count], results["interpreter"][count]
        rows.append([count, f"{forked['first_batch'] * 1e3:.1f}", f"{alone['first_batch'] * 1e3:.1f}",
                     f"{alone['first_batch'] / forked['first_batch']:.0f}x",
                     f"{forked['close'] * 1e3:.1f}", f"{alone['close'] * 1e3:.1f}"])
    print(table(rows, ["readers", "first batch ms, forked", "interpreters", "ratio", "close ms, forked",
                       "interpreters"]))
    first = counts[0]
    print(f"a trainer's first loader ({first} readers; it starts the fork server): "
          f"{results['forked'][first]['first_ever'] * 1e3:.0f} ms forked, "
          f"{results['interpreter'][first]['first_ever'] * 1e3:.0f} ms interpreters")
    print(f"{args.loaders} loaders per reader count and mode; {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()

"""Stress: kill a random reader every few hundred batches for minutes; every batch must be right.

Run: python bench/stress.py [--seconds 180]
Prints batches delivered, readers killed, batches lost or duplicated (must be 0), batches with
wrong contents (must be 0) and entries left in /dev/shm (must be 0). Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time

import numpy as np

from shmloader import Sampler, ShmDataLoader
from shmloader.convert import convert


def shm_entries(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.removeprefix("sem.").startswith(f"shml_{pid}_")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--readers", type=int, default=3)
    arguments = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as directory:
        rows = 20_000
        images = np.random.default_rng(1).integers(0, 255, size=(rows, 768), dtype=np.uint8)
        labels = np.arange(rows, dtype=np.int64)
        np.save(f"{directory}/images.npy", images)
        np.save(f"{directory}/labels.npy", labels)
        convert(f"{directory}/images.npy", f"{directory}/images.b2nd", progress=False)
        fields = {"image": f"{directory}/images.b2nd", "label": f"{directory}/labels.npy"}
        sampler = Sampler(rows, 64, "shuffle", seed=5)
        delivered, killed, wrong, out_of_order = 0, 0, 0, 0
        expected_step = 0
        next_kill = rng.randint(200, 400)
        deadline = time.monotonic() + arguments.seconds
        with ShmDataLoader(fields, batch_size=64, readers=arguments.readers, slots=6, seed=5,
                           max_reader_restarts=1 << 20) as loader:
            for batch in loader:
                if batch.step != expected_step:
                    out_of_order += 1
                expected_step = batch.step + 1
                indices = sampler.fill(batch.step)
                if not (np.array_equal(batch.indices, indices) and np.array_equal(batch["label"], labels[indices])
                        and np.array_equal(batch["image"], images[indices])):
                    wrong += 1
                delivered += 1
                if delivered == next_kill:
                    victim = rng.choice(loader.reader_pids)
                    try:
                        os.kill(victim, signal.SIGKILL)
                        killed += 1
                    except ProcessLookupError:
                        pass
                    next_kill += rng.randint(200, 400)
                if time.monotonic() > deadline:
                    break
            restarts = loader.stats()["reader_restarts"]
        time.sleep(0.5)
        left = shm_entries(os.getpid())
    print(f"ran {arguments.seconds:.0f} s with {arguments.readers} readers")
    print(f"batches delivered: {delivered}")
    print(f"readers killed: {killed} (restarts seen by the loader: {restarts})")
    print(f"batches lost or duplicated: {out_of_order}")
    print(f"batches with wrong contents: {wrong}")
    print(f"entries left in /dev/shm: {len(left)} {left if left else ''}")
    return 0 if out_of_order == wrong == len(left) == 0 and restarts >= killed - 1 else 1


if __name__ == "__main__":
    sys.exit(main())

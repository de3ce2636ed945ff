"""The user's own Dataset: the same map-style Dataset classes through PyTorch's DataLoader and
through shmloader.torch.DataLoader (its __getitem__ run in shmloader's readers, samples
written into the ring), same worker count, in one run. Contenders alternate and repeat;
medians and spreads are printed.

    python bench/dataset.py [--workers 2] [--rounds 3] [--seconds 4]

Cases: (a) small samples, a 3 KB uint8 array and a label; (b) large samples, a 4 MiB
float32 volume; (c) JPEG decode, random resized crop and flip with PIL in __getitem__;
(d) a Python-heavy sample, a dict of 20 small arrays. Reported: samples/s; the CPU
seconds per million samples of all the loader's processes (the trainer and its workers or
readers, user+system, from the timed batches' start to their exit; each run is a child
process of this script, bench/_common.py, run_contender, says how every process is
counted); and the trainer's CPU per batch (its process time, every thread, per batch
delivered: unpickling and collating are the trainer's work in PyTorch's loader, and
nothing in shmloader's).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

import numpy as np

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


class Small:
    def __len__(self):
        return 200_000

    def __getitem__(self, index):
        return np.full(3072, index % 251, np.uint8), index % 10


class Large:
    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        return np.full((64, 128, 128), index, np.float32), index % 10


class Jpeg:
    """Decodes one of 64 stored JPEGs (384x384), random-resized-crops it to 224 and flips it."""

    def __init__(self):
        from PIL import Image

        rng = np.random.default_rng(0)
        self.images = []
        for _ in range(64):
            base = np.linspace(0, 255, 384 * 384 * 3).reshape(384, 384, 3) + rng.normal(0, 12, (384, 384, 3))
            buffer = io.BytesIO()
            Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
            self.images.append(buffer.getvalue())

    def __len__(self):
        return 100_000

    def __getitem__(self, index):
        import random

        from PIL import Image

        image = Image.open(io.BytesIO(self.images[index % len(self.images)])).convert("RGB")
        scale, ratio = random.uniform(0.08, 1.0), random.uniform(3 / 4, 4 / 3)
        width = min(image.width, int(round((image.width * image.height * scale * ratio) ** 0.5)))
        height = min(image.height, int(round((image.width * image.height * scale / ratio) ** 0.5)))
        left, top = random.randint(0, image.width - width), random.randint(0, image.height - height)
        image = image.resize((224, 224), Image.BILINEAR, box=(left, top, left + width, top + height))
        if random.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return np.asarray(image), index % 1000


class ManyArrays:
    def __len__(self):
        return 200_000

    def __getitem__(self, index):
        return {f"feature_{k}": np.full(8, index + k, np.float32) for k in range(20)}


CASES = {"a: 3 KB array + label": (Small, 256), "b: 4 MiB volume": (Large, 8),
         "c: JPEG decode + crop + flip": (Jpeg, 64), "d: dict of 20 small arrays": (ManyArrays, 256)}


def _measure(loader, batch_size: int, seconds: float) -> dict:
    """Samples, batches and seconds over `seconds` after a warm-up of 3 batches, with the
    CPU marks around them."""
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    cpu_start = cpu_mark()
    batches, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        try:
            batch = next(iterator)
        except StopIteration:  # An epoch ended: the next one, as a training loop would.
            iterator = iter(loader)
            continue
        del batch
        batches += 1
    elapsed = time.perf_counter() - started
    cpu_end = cpu_mark()
    del iterator
    return {"samples": batches * batch_size, "batches": batches, "seconds": elapsed, "cpu_start": cpu_start,
            "cpu_end": cpu_end}


def run_child(contender: str, name: str, workers: int, seconds: float) -> None:
    """One run of one contender on case `name`, in this child process: prints its JSON line."""
    import torch.utils.data

    import shmloader.torch

    make, batch_size = CASES[name]
    dataset = make()
    if contender == "torch":
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                             persistent_workers=False)
        result = _measure(loader, batch_size, seconds)
        del loader
    else:
        loader = shmloader.torch.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)
        result = _measure(loader, batch_size, seconds)
        loader.close()
    finish_child(result)


def run_case(name: str, workers: int, rounds: int, seconds: float) -> dict:
    """Per contender, its runs' results, each run a child process (for the CPU of its workers)."""
    results = {"torch": [], "shmloader": []}
    for round_index in range(rounds):  # Alternate, so the host's caches and noise hit both.
        order = ["torch", "shmloader"] if round_index % 2 == 0 else ["shmloader", "torch"]
        for contender in order:
            command = [sys.executable, os.path.abspath(__file__), "--child", contender, "--cases", name[0],
                       "--workers", str(workers), "--seconds", str(seconds)]
            result = run_contender(command, seconds + 300, f"dataset.py --child {contender} --cases {name[0]}")
            result["rate"] = result["samples"] / result["seconds"]
            results[contender].append(result)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--cases", default="abcd", help="which cases, by letter")
    parser.add_argument("--child", choices=("torch", "shmloader"), help=argparse.SUPPRESS)
    add_write_argument(parser)
    arguments = parser.parse_args()
    if arguments.child:
        run_child(arguments.child, next(name for name in CASES if name[0] == arguments.cases), arguments.workers,
                  arguments.seconds)
    rows, headline = [], []
    for name in CASES:
        if name[0] not in arguments.cases:
            continue
        results = run_case(name, arguments.workers, arguments.rounds, arguments.seconds)
        rate = {key: statistics.median(run["rate"] for run in runs) for key, runs in results.items()}
        spread = {key: (min(run["rate"] for run in runs), max(run["rate"] for run in runs))
                  for key, runs in results.items()}
        # Medians of each run's own figure: CPU per million samples, trainer ms per batch.
        cpu = {key: statistics.median(run["cpu_s"] / run["samples"] * 1e6 for run in runs)
               for key, runs in results.items()}
        trainer = {key: statistics.median(1000 * run["trainer_cpu_s"] / run["batches"] for run in runs)
                   for key, runs in results.items()}
        ratio = rate["shmloader"] / rate["torch"]
        rows.append([name, f"{rate['torch']:,.0f} ({spread['torch'][0]:,.0f}-{spread['torch'][1]:,.0f})",
                     f"{rate['shmloader']:,.0f} ({spread['shmloader'][0]:,.0f}-{spread['shmloader'][1]:,.0f})",
                     f"{ratio:.2f}x", format_per_million(cpu["torch"]), format_per_million(cpu["shmloader"]),
                     f"{trainer['torch']:.2f}", f"{trainer['shmloader']:.2f}"])
        headline.append([f"your Dataset, {name[3:]}", f"{rate['shmloader']:,.0f} samples/s", "n/a", f"{ratio:.2f}x",
                         f"{format_per_million(cpu['shmloader'])} / {format_per_million(cpu['torch'])} per M samples"])
        print(rows[-1], flush=True)
    header = ["case", "torch DataLoader samples/s (min-max)", "shmloader.torch samples/s (min-max)",
              "ratio", "torch CPU s / M samples", "shmloader CPU s / M samples", "torch trainer CPU ms/batch",
              "shmloader trainer CPU ms/batch"]
    print(f"\n{machine_line()}; {arguments.workers} workers each, {arguments.rounds} alternating rounds of "
          f"{arguments.seconds:g} s, medians\n")
    print(table(rows, header))
    record("dataset", command_line("dataset.py"), header, rows, headline, write=arguments.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

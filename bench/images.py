"""ImageNet-style loading: decode + random resized crop 224 + flip, batch 256, equal process
counts: shmloader (Pillow decoder, and the fast DCT-scaled simplejpeg + OpenCV path) against
PyTorch's DataLoader over an ImageFolder with torchvision's transforms, and against one
process doing the fast path's work alone (the per-core limit).

Run: python bench/images.py [--images 20000] [--workers 2] [--batches 30]
Needs the images extra, torch and torchvision (torchvision is optional: without it the
PyTorch row is left out), and scikit-image for its bundled photographs (without it the
images are synthetic gradients, which decode faster than photographs: the run says so).
Data: JPEGs of 300-500 px a side at quality 90, random crops of the photographs with
colour shifts and noise, in 10 class directories; converted once with convert-images.
It compares shmloader with PyTorch using the same decoder and with the fast path, and with
(readers x the one-process limit).
Beside each rate: the CPU seconds per million images of all the loader's processes (the
trainer, readers or workers; user+system) from the timed batches' start to their exit,
each loader in a child process of its own (bench/_common.py, run_contender, says how every
process is counted); for the one-process rows, that process's own CPU over its images.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import sys
import time

import numpy as np
from _common import add_write_argument, command_line, cpu_mark, finish_child, machine_line, per_million, record, run_contender, table
from gather import DATA_DIR, child_environment

BATCH = 256
SIZE = 224
CLASSES = 10


def _photographs():
    try:
        from skimage import data
    except ImportError:
        return None
    names = ["astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "retina", "hubble_deep_field"]
    return [np.asarray(getattr(data, name)())[..., :3] for name in names if hasattr(data, name)]


def _write_some(arguments) -> None:
    directory, first, count = arguments
    from PIL import Image

    photographs = _photographs()
    rng = np.random.default_rng(first)
    for index in range(first, first + count):
        height, width = (int(x) for x in rng.integers(300, 501, 2))
        if photographs:
            source = photographs[index % len(photographs)]
            scale = max(height / source.shape[0], width / source.shape[1], rng.uniform(0.6, 1.4))
            picture = Image.fromarray(source).resize((max(width, int(source.shape[1] * scale)),
                                                      max(height, int(source.shape[0] * scale))))
            array = np.asarray(picture)
            top = int(rng.integers(0, array.shape[0] - height + 1))
            left = int(rng.integers(0, array.shape[1] - width + 1))
            array = array[top:top + height, left:left + width].astype(np.float32)
        else:
            y, x = np.mgrid[0:height, 0:width]
            array = np.stack([127 + 100 * np.sin(x / rng.uniform(10, 60) + y / rng.uniform(10, 60) + p)
                              for p in rng.uniform(0, 6, 3)], axis=-1)
        array = array * rng.uniform(0.8, 1.2, 3) + rng.normal(0, 4, array.shape)
        target = pathlib.Path(directory) / f"class{index % CLASSES}" / f"{index:06d}.jpg"
        Image.fromarray(np.clip(array, 0, 255).astype(np.uint8)).save(target, quality=90)


def make_images(count: int, workers: int) -> tuple[pathlib.Path, dict]:
    directory = DATA_DIR / f"jpegs{count}"
    done = directory / "done.json"
    if not done.exists():
        print(f"writing {count} JPEGs into {directory} ...", file=sys.stderr)
        for k in range(CLASSES):
            (directory / f"class{k}").mkdir(parents=True, exist_ok=True)
        chunk = 500
        with multiprocessing.Pool(workers) as pool:
            pool.map(_write_some, [(str(directory), first, min(chunk, count - first)) for first in range(0, count, chunk)])
        done.write_text(json.dumps({"photographs": _photographs() is not None}))
    converted = DATA_DIR / f"jpegs{count}.converted"
    if not pathlib.Path(f"{converted}.classes.json").exists():
        from shmloader.tools.imagefolder import convert_images

        convert_images(directory, converted, progress=False)
    fields = {"image": f"{converted}.image", "label": f"{converted}.label"}
    return directory, {"fields": fields, **json.loads(done.read_text())}


def one_process(fields: dict, decoder: str, images: int) -> tuple[float, float]:
    """(images/s, CPU seconds per image) of decode + crop + flip alone, in this process,
    into one output buffer (this process starts none: its own CPU is all of it)."""
    import blosc2

    from shmloader.storage.ragged import describe_ragged
    from shmloader.transforms import sample_rng
    from shmloader.transforms.images import ImageWriter, random_resized_crop_box

    spec = describe_ragged(fields["image"])
    offsets = blosc2.open(spec.offsets.path)[:images + 1]
    values = blosc2.open(spec.values.path)[:int(offsets[-1])]
    records = [values[offsets[k]:offsets[k + 1]] for k in range(images)]
    writer = ImageWriter(decoder, "bilinear")
    target = np.empty((SIZE, SIZE, 3), np.uint8)
    started, cpu_started = time.perf_counter(), time.process_time()
    for k, data in enumerate(records):
        rng = sample_rng(0, k, "bench")
        flip = rng.random() < 0.5
        writer.write(data, target, lambda h, w: random_resized_crop_box(h, w, rng), flip)
    return images / (time.perf_counter() - started), (time.process_time() - cpu_started) / images


def run_shmloader(fields: dict, decoder: str, workers: int, batches: int) -> dict:
    from shmloader import ShmDataLoader

    with ShmDataLoader(fields, transform="shmloader.transforms.images:train", batch_size=BATCH, readers=workers,
                       transform_args={"size": SIZE, "decoder": decoder}) as loader:
        for _, batch in zip(range(3), loader):  # Readers started, first batches through.
            pass
        cpu_start = cpu_mark()
        next_ns, started = 0, time.perf_counter()
        for _ in range(batches):
            before = time.thread_time_ns()  # CPU time: next()'s own cost, not its waiting.
            batch = next(loader)
            next_ns += time.thread_time_ns() - before
            int(batch["image"][:, 0, 0, 0].sum())  # The trainer touches its batch.
        elapsed = time.perf_counter() - started
        cpu_end = cpu_mark()
    return {"rate": batches * BATCH / elapsed, "images": batches * BATCH, "next_us": next_ns / batches / 1e3,
            "cpu_start": cpu_start, "cpu_end": cpu_end}


def torchvision_installed() -> bool:
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def run_torch(directory: pathlib.Path, workers: int, batches: int, prefetch: int) -> dict:
    import torch
    import torchvision
    from torchvision import transforms

    torch.set_num_threads(1)
    pipeline = transforms.Compose([transforms.RandomResizedCrop(SIZE), transforms.RandomHorizontalFlip(),
                                   transforms.PILToTensor()])
    dataset = torchvision.datasets.ImageFolder(str(directory), transform=pipeline)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers,
                                         persistent_workers=True, prefetch_factor=prefetch, drop_last=True)
    def endless():  # Epochs back to back, like the endless loaders it is compared with.
        while True:
            yield from loader

    iterator = endless()
    for _ in range(3):
        next(iterator)
    cpu_start = cpu_mark()
    started = time.perf_counter()
    for _ in range(batches):
        images, _ = next(iterator)
        int(images[:, 0, 0, 0].sum())
    rate = batches * BATCH / (time.perf_counter() - started)
    cpu_end = cpu_mark()
    del iterator
    return {"rate": rate, "images": batches * BATCH, "cpu_start": cpu_start, "cpu_end": cpu_end}


def contender(args, name: str, fields: dict, directory: pathlib.Path, option: str) -> dict | None:
    """One loader's run in a child process of its own (for its CPU, readers and workers
    included): name "shmloader" with a decoder, or "torch" with a prefetch factor; None for
    PyTorch where torchvision is not installed."""
    if name == "torch" and not torchvision_installed():
        return None
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--option", option, "--fields",
               json.dumps(fields), "--directory", str(directory), "--images", str(args.images), "--workers",
               str(args.workers), "--batches", str(args.batches)]
    return run_contender(command, 900, f"images.py --child {name} --option {option}", env=child_environment())


def run_child(args) -> None:
    """One loader's run, in this child process: prints its JSON line and exits."""
    if args.child == "shmloader":
        finish_child(run_shmloader(json.loads(args.fields), args.option, args.workers, args.batches))
    finish_child(run_torch(pathlib.Path(args.directory), args.workers, args.batches, int(args.option)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=20_000, help="JPEGs generated (default 20000)")
    parser.add_argument("--workers", type=int, default=2, help="readers / DataLoader workers (default 2)")
    parser.add_argument("--batches", type=int, default=30, help="batches timed per run, after 3 (default 30)")
    parser.add_argument("--child", choices=("shmloader", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--option", help=argparse.SUPPRESS)
    parser.add_argument("--fields", help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    add_write_argument(parser)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args)
    directory, made = make_images(args.images, max(1, os.cpu_count() or 1))
    fields = made["fields"]
    print(machine_line())
    print(f"{args.images} JPEGs ({'photographs' if made['photographs'] else 'SYNTHETIC gradients'}), batch {BATCH}, "
          f"{args.workers} processes, {args.batches} batches per run")
    limit_fast, limit_fast_cpu = one_process(fields, "fast", min(args.images, 4000))
    limit_pillow, limit_pillow_cpu = one_process(fields, "pillow", min(args.images, 2000))
    pillow = contender(args, "shmloader", fields, directory, "pillow")
    fast = contender(args, "shmloader", fields, directory, "fast")
    shm_pillow, shm_fast = pillow["rate"], fast["rate"]
    torch_runs = {prefetch: contender(args, "torch", fields, directory, str(prefetch)) for prefetch in (2, 4)}
    torch_rate = max((run["rate"] for run in torch_runs.values() if run), default=None)
    rows = [
        ["one process, fast path (per-core limit)", f"{limit_fast:,.0f}", f"{limit_fast:,.0f}",
         per_million(limit_fast_cpu, 1), "", ""],
        ["one process, Pillow", f"{limit_pillow:,.0f}", f"{limit_pillow:,.0f}", per_million(limit_pillow_cpu, 1),
         "", ""],
    ]
    for label, run in (("shmloader, Pillow decoder", pillow), ("shmloader, fast path", fast),
                       *((f"PyTorch DataLoader + torchvision, prefetch {prefetch}", run)
                         for prefetch, run in torch_runs.items())):
        if run:
            rows.append([label, f"{run['rate']:,.0f}", f"{run['rate'] / args.workers:,.0f}",
                         per_million(run["cpu_s"], run["images"]), per_million(run["trainer_cpu_s"], run["images"]),
                         f"{run['next_us']:.0f}" if "next_us" in run else ""])
    header = ["loader", "images/s", "per process", "CPU s / M images", "trainer CPU s / M images",
              "trainer CPU per next(), us"]
    print(table(rows, header))
    if torch_rate:
        print(f"shmloader Pillow / PyTorch DataLoader (same decoder): {shm_pillow / torch_rate:.2f}x")
        print(f"shmloader fast path / PyTorch DataLoader: {shm_fast / torch_rate:.2f}x")
    else:
        print("PyTorch rows skipped: torchvision is not installed")
    share = shm_fast / (args.workers * limit_fast)
    print(f"shmloader fast / ({args.workers} x one-process limit): {share:.0%}")
    best_torch = max((run for run in torch_runs.values() if run), key=lambda run: run["rate"], default=None)
    cpu = [per_million(run["cpu_s"], run["images"]) if run else "-" for run in (fast, best_torch)]
    headline = [["JPEGs, decode + crop 224 + flip, fast path", f"{shm_fast:,.0f} images/s",
                 f"{shm_fast / limit_fast:.2f}x ({share:.0%} of {args.workers})",
                 f"{shm_fast / torch_rate:.2f}x" if torch_rate else "n/a", f"{cpu[0]} / {cpu[1]} per M images"]]
    record("images", command_line("images.py"), header, rows, headline,
           [f"{args.images} JPEGs ({'photographs' if made['photographs'] else 'synthetic'}), batch "
            f"{BATCH}, {args.workers} processes, {args.batches} batches a run",
            "CPU s / M images: all the loader's processes (trainer, readers or workers) from the timed batches' start "
            "to their exit; the one-process rows: that process over its images"], write=args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

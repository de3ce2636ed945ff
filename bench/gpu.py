"""The last hop to the GPU: the link's limits, the loader host-only, pageable copies, the
pinned device iterator, PyTorch's DataLoader with pin_memory, and a loader-bound MLP.

Run on any CUDA machine: python bench/gpu.py [--readers 4,8,14] [--batches 300]
Data: 8,192 rows of 150,528 bytes (224x224x3 uint8) as .npy, batch 256, for the copy
table; 200,000 rows of 3,072 bytes plus a label, batch 1024, for the MLP. It compares
the device iterator with the host-only rate (up to the link's limit), the MLP fed by the
loader with the same MLP on data already on the GPU, and the rate as readers are added.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from _common import machine_line, table
from gather import DATA_DIR

from shmloader import ShmDataLoader

COPY_ROWS, COPY_ROW_BYTES, COPY_BATCH = 8192, 150_528, 256
MLP_ROWS, MLP_ROW_BYTES, MLP_BATCH, CLASSES = 200_000, 3072, 1024, 1000


def make_file(rows: int, row_bytes: int, name: str) -> str:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    path = DATA_DIR / name
    if not path.exists():
        array = np.lib.format.open_memmap(str(path) + ".partial", mode="w+", dtype=np.uint8, shape=(rows, row_bytes))
        rng = np.random.default_rng(0)
        for start in range(0, rows, 1024):
            array[start:start + 1024] = rng.integers(0, 255, size=(min(1024, rows - start), row_bytes), dtype=np.uint8)
        array.flush()
        del array
        os.replace(str(path) + ".partial", path)
    return str(path)


def raw_copy_gb_per_s(torch, pinned: bool, repeats: int = 50) -> float:
    host = torch.empty(COPY_BATCH * COPY_ROW_BYTES, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    device = torch.empty_like(host, device="cuda")
    device.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        device.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    return repeats * host.numel() / (time.perf_counter() - started) / 1e9


def loader_gb_per_s(torch, path: str, readers: int, batches: int, how: str) -> float:
    """how: "host" (touch a byte per row), "pageable" (.to() from the ring as it is),
    "device" (pin_memory=True and to_device, prefetch 2)."""
    pinned = how == "device"
    with ShmDataLoader({"x": path}, batch_size=COPY_BATCH, readers=readers, slots=max(2 * readers + 2, 6),
                       pin_memory=pinned) as loader:
        if how == "device":
            iterator = loader.to_device("cuda", prefetch=2)
            next(iterator)
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _, tensors in zip(range(batches), iterator):
                tensors["x"][:, 0].sum()
            torch.cuda.synchronize()
        else:
            next(loader)
            started = time.perf_counter()
            for _, batch in zip(range(batches), loader):
                if how == "host":
                    int(batch["x"][:, 0].sum())
                else:
                    torch.from_numpy(batch["x"]).to("cuda")[:, 0].sum()
            torch.cuda.synchronize()
        return batches * COPY_BATCH * COPY_ROW_BYTES / (time.perf_counter() - started) / 1e9


class TorchRows:
    def __init__(self, path: str) -> None:
        self.path, self.array = path, None
        self.rows = int(np.load(path, mmap_mode="r").shape[0])

    def __len__(self) -> int:
        return self.rows

    def __getitems__(self, indices):
        import torch

        if self.array is None:
            self.array = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.take(self.array, np.asarray(indices), axis=0))


def _identity(batch):
    return batch


def torch_loader(path: str, workers: int, batch_size: int, batches: int):
    from torch.utils.data import DataLoader, RandomSampler

    dataset = TorchRows(path)
    return DataLoader(dataset, batch_size=batch_size, sampler=RandomSampler(dataset, num_samples=(batches + 4) * batch_size),
                      num_workers=workers, collate_fn=_identity, pin_memory=True, persistent_workers=True,
                      prefetch_factor=4, multiprocessing_context="forkserver")


def torch_gb_per_s(torch, path: str, workers: int, batches: int) -> float:
    iterator = iter(torch_loader(path, workers, COPY_BATCH, batches))
    next(iterator)
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator).to("cuda", non_blocking=True)[:, 0].sum()
    torch.cuda.synchronize()
    return batches * COPY_BATCH * COPY_ROW_BYTES / (time.perf_counter() - started) / 1e9


def mlp(torch):
    model = torch.nn.Sequential(torch.nn.Linear(MLP_ROW_BYTES, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, CLASSES))
    model = model.to("cuda", dtype=torch.bfloat16)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def train_step(torch, model, optimizer, images, labels) -> None:
    logits = model(images.to(torch.bfloat16) / 255)
    loss = torch.nn.functional.cross_entropy(logits.float(), labels.long())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def mlp_samples_per_s(torch, feed, steps: int) -> float:
    model, optimizer = mlp(torch)
    warm_up = 5
    started = time.perf_counter()
    for step, (images, labels) in zip(range(steps + warm_up), feed):
        if step == warm_up:
            torch.cuda.synchronize()
            started = time.perf_counter()
        train_step(torch, model, optimizer, images, labels)
    torch.cuda.synchronize()
    return steps * MLP_BATCH / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", default="4,8", help="comma-separated reader counts")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--steps", type=int, default=300, help="MLP training steps per run")
    arguments = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("bench/gpu.py needs PyTorch with CUDA: pip install torch")
        return 2
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA machine: torch.cuda.is_available() is False here; nothing measured")
        return 2
    reader_counts = [int(count) for count in arguments.readers.split(",")]
    copy_path = make_file(COPY_ROWS, COPY_ROW_BYTES, f"gpu{COPY_ROWS}x{COPY_ROW_BYTES}.npy")
    mlp_path = make_file(MLP_ROWS, MLP_ROW_BYTES, f"gpu{MLP_ROWS}x{MLP_ROW_BYTES}.npy")
    label_path = str(DATA_DIR / f"gpu{MLP_ROWS}.labels.npy")
    if not os.path.exists(label_path):
        np.save(label_path, np.random.default_rng(1).integers(0, CLASSES, MLP_ROWS).astype(np.int64))
    print(f"# gpu benchmark ({machine_line()}, {torch.cuda.get_device_name()})")
    pinned_limit, pageable_limit = raw_copy_gb_per_s(torch, True), raw_copy_gb_per_s(torch, False)
    rows = [["raw copy, page-locked", "-", f"{pinned_limit:.1f}"], ["raw copy, pageable", "-", f"{pageable_limit:.1f}"]]
    results = {}
    for readers in reader_counts:
        for how in ("host", "pageable", "device"):
            results[(how, readers)] = loader_gb_per_s(torch, copy_path, readers, arguments.batches, how)
            rows.append([f"shmloader, {how}", str(readers), f"{results[(how, readers)]:.1f}"])
        results[("torch", readers)] = torch_gb_per_s(torch, copy_path, readers, max(50, arguments.batches // 2))
        rows.append(["PyTorch DataLoader, pin_memory", str(readers), f"{results[('torch', readers)]:.1f}"])
    print(table(rows, ["path", "readers", "GB/s"]))
    images_on_gpu = torch.from_numpy(np.load(mlp_path)).to("cuda")
    labels_on_gpu = torch.from_numpy(np.load(label_path)).to("cuda")

    def on_gpu():
        generator = torch.Generator(device="cuda")
        while True:
            index = torch.randint(0, MLP_ROWS, (MLP_BATCH,), device="cuda", generator=generator)
            yield images_on_gpu[index], labels_on_gpu[index]

    mlp_rows = [["data already on the GPU", "-", f"{mlp_samples_per_s(torch, on_gpu(), arguments.steps):,.0f}"]]
    reference = float(mlp_rows[0][2].replace(",", ""))
    images_on_gpu = None  # Its memory back for the runs that follow.
    fed = {}
    for readers in reader_counts:
        with ShmDataLoader({"x": mlp_path, "y": label_path}, batch_size=MLP_BATCH, readers=readers, pin_memory=True,
                           slots=max(2 * readers + 2, 6)) as loader:
            feed = ((tensors["x"], tensors["y"]) for tensors in loader.to_device("cuda", prefetch=2))
            fed[readers] = mlp_samples_per_s(torch, feed, arguments.steps)
        mlp_rows.append(["shmloader to_device", str(readers), f"{fed[readers]:,.0f}"])
        theirs = iter(torch_loader(mlp_path, readers, MLP_BATCH, arguments.steps + 10))
        feed = ((chunk.to("cuda", non_blocking=True), labels_on_gpu[:MLP_BATCH]) for chunk in theirs)
        mlp_rows.append(["PyTorch DataLoader, pin_memory", str(readers),
                         f"{mlp_samples_per_s(torch, feed, arguments.steps):,.0f}"])
    print("\n## MLP training (samples/s)")
    print(table(mlp_rows, ["fed by", "readers", "samples/s"]))
    print("\n## summary")
    for readers in reader_counts:
        host, device = results[("host", readers)], results[("device", readers)]
        goal = 0.9 * min(host, pinned_limit)
        print(f"{readers} readers: device iterator {device:.1f} GB/s, host-only {host:.1f}, link {pinned_limit:.1f} "
              f"({device / min(host, pinned_limit):.0%} of the lower of the two)")
        print(f"{readers} readers: MLP fed {fed[readers]:,.0f} samples/s = {fed[readers] / reference:.0%} of data on "
              f"the GPU")
    device_rates = [results[("device", readers)] for readers in sorted(reader_counts)]
    falls = any(later < 0.95 * earlier for earlier, later in zip(device_rates, device_rates[1:]))
    print(f"device iterator over readers {sorted(reader_counts)}: {', '.join(f'{r:.1f}' for r in device_rates)} GB/s "
          + ("; it falls as readers are added" if falls else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

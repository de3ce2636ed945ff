"""Train a small PyTorch model from ShmDataLoader batches (CPU is fine).

Run: python examples/train_torch.py   (needs `pip install torch`)

The batch lifetime rule: batch["image"] is a view of a shared-memory slot, and so is
torch.from_numpy(batch["image"]) (no copy). Release the batch (leave `with batch:`) only
after its data has been copied to where the model runs: `.to(device)` on a GPU, or here on
the CPU the `.float()` conversion, which makes a new tensor. A tensor that still views the
slot keeps the slot reserved; the loader never overwrites it under you.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import numpy as np
import torch

from shmloader import ShmDataLoader
from shmloader.demo import CLASSES, IMAGE_SHAPE, make_dataset, write_dataset


def main(steps: int = 300, batch_size: int = 256) -> float:
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as directory:
        fields = write_dataset(pathlib.Path(directory))
        model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(int(np.prod(IMAGE_SHAPE)), 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES)
        ).to(device)
        optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
        with ShmDataLoader(fields, batch_size=batch_size, readers=2, slots=8, seed=0) as loader:
            for step, batch in zip(range(steps), loader):
                with batch:  # The slot goes back to the readers at the end of this block.
                    x = torch.from_numpy(batch["image"]).to(device).float().sub_(128).div_(64)  # Copies out of the slot.
                    y = torch.from_numpy(batch["label"]).to(device)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                if step % 100 == 0:
                    print(f"step {step}: loss {loss.item():.3f}")
            print(f"loader: {loader.stats()['rows_per_s']:,.0f} rows/s")
        accuracy = evaluate(model, device, pathlib.Path(directory), batch_size)
    print(f"held-out accuracy {accuracy:.1%} (chance {1 / CLASSES:.0%})")
    return accuracy


def evaluate(model, device, directory: pathlib.Path, batch_size: int) -> float:
    """An exact evaluation pass: mode="sequential", epochs=1 gives every held-out row once,
    in order, the last batch partial (len(loader) batches), so nothing is counted twice."""
    images, labels = make_dataset(2_003, seed=1)  # Not a multiple of the batch: a partial last batch.
    np.save(directory / "test_images.npy", images)
    np.save(directory / "test_labels.npy", labels)
    fields = {"image": directory / "test_images.npy", "label": directory / "test_labels.npy"}
    correct = seen = 0
    with torch.no_grad(), ShmDataLoader(fields, batch_size=batch_size, mode="sequential", epochs=1, readers=1) as loader:
        for batch in loader:  # Ends after len(loader) batches.
            with batch:
                x = torch.from_numpy(batch["image"]).to(device).float().sub_(128).div_(64)
                y = torch.from_numpy(batch["label"]).to(device)
            correct += int((model(x).argmax(dim=1) == y).sum())
            seen += len(y)
    assert seen == len(labels)
    return correct / seen


if __name__ == "__main__":
    sys.exit(0 if main() > 2 / CLASSES else 1)

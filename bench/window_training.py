"""What the block-local shuffle costs a real training run on data stored sorted by class:
the demo's softmax regression (shmloader/demo.py: 10 classes of noisy 3x16x16 images)
trained through the loader on a class-sorted copy of its data, with the global shuffle and
with several shuffle windows; test accuracy on held-out data after the same steps.

    python bench/window_training.py                 # 40,000 rows, 2 epochs, 4 windows
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import table  # noqa: E402

from shmloader import ShmDataLoader  # noqa: E402
from shmloader.tools.demo import IMAGE_SHAPE, SoftmaxRegression, make_dataset  # noqa: E402


def train(fields: dict, steps: int, batch_size: int, window, test: tuple) -> tuple[float, float, float]:
    """(test accuracy, mean loss of the last tenth of the steps, distinct labels a batch)."""
    model = SoftmaxRegression(int(np.prod(IMAGE_SHAPE)))
    losses, distinct = [], []
    with ShmDataLoader(fields, batch_size=batch_size, readers=2, seed=0, shuffle_window=window) as loader:
        for _, batch in zip(range(steps), loader):
            losses.append(model.step(batch["image"], batch["label"]))
            distinct.append(len(np.unique(batch["label"])))
            del batch
    return model.accuracy(*test), float(np.mean(losses[-max(1, steps // 10):])), float(np.mean(distinct))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--windows", default="16384,4096,1024,256")
    args = parser.parse_args()
    images, labels = make_dataset(args.rows, seed=0)
    order = np.argsort(labels, kind="stable")  # Stored sorted by class, as an ImageFolder tree is.
    test = make_dataset(4_000, seed=1)
    steps = int(args.epochs * args.rows / args.batch_size)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        np.save(f"{directory}/image.npy", images[order])
        np.save(f"{directory}/label.npy", labels[order])
        fields = {"image": f"{directory}/image.npy", "label": f"{directory}/label.npy"}
        for window in [None] + [int(window) for window in args.windows.split(",")]:
            accuracy, loss, distinct = train(fields, steps, args.batch_size, window, test)
            rows.append(["global shuffle" if window is None else f"shuffle_window={window:,}", f"{accuracy:.3f}",
                         f"{loss:.3f}", f"{distinct:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    print(f"{args.rows:,} rows sorted by class (10 classes), {steps} steps of {args.batch_size} ({args.epochs:g} "
          f"epochs), softmax regression, test accuracy on 4,000 held-out rows:")
    print(table(rows, ["order", "test accuracy", "loss (last 10%)", "distinct labels / batch"]))


if __name__ == "__main__":
    main()

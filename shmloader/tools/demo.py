"""`shmloader demo`: make a small labelled image dataset, convert it, and train on it through the loader."""

from __future__ import annotations

import pathlib
import tempfile
import time

import numpy as np

from ..loader import ShmDataLoader
from .convert import convert

CLASSES = 10
IMAGE_SHAPE = (3, 16, 16)


def make_dataset(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Images whose class decides a colour pattern, buried in noise: learnable, not trivial."""
    rng = np.random.default_rng(seed)
    patterns = np.random.default_rng(12345).normal(0, 1, size=(CLASSES, *IMAGE_SHAPE))
    labels = rng.integers(0, CLASSES, size=rows)
    images = 128 + 5 * patterns[labels] + rng.normal(0, 48, size=(rows, *IMAGE_SHAPE))
    return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.int64)


def write_dataset(directory: pathlib.Path, rows: int = 20_000, progress: bool = False) -> dict[str, pathlib.Path]:
    """Writes a training set as converted .b2nd files in `directory`; returns the loader's fields."""
    images, labels = make_dataset(rows, seed=0)
    np.save(directory / "images.npy", images)
    np.save(directory / "labels.npy", labels)
    convert(directory / "images.npy", directory / "images.b2nd", progress=progress)
    convert(directory / "labels.npy", directory / "labels.b2nd", progress=progress)
    return {"image": directory / "images.b2nd", "label": directory / "labels.b2nd"}


class SoftmaxRegression:
    """A linear classifier trained with plain SGD, in numpy."""

    def __init__(self, features: int, learning_rate: float = 0.05) -> None:
        self.weights = np.zeros((features, CLASSES), dtype=np.float32)
        self.bias = np.zeros(CLASSES, dtype=np.float32)
        self.learning_rate = learning_rate

    @staticmethod
    def features(images: np.ndarray) -> np.ndarray:
        return (images.reshape(len(images), -1).astype(np.float32) - 128.0) / 64.0

    def logits(self, images: np.ndarray) -> np.ndarray:
        return self.features(images) @ self.weights + self.bias

    def step(self, images: np.ndarray, labels: np.ndarray) -> float:
        x = self.features(images)
        logits = x @ self.weights + self.bias
        logits -= logits.max(axis=1, keepdims=True)
        probabilities = np.exp(logits)
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        loss = float(-np.log(probabilities[np.arange(len(labels)), labels] + 1e-9).mean())
        probabilities[np.arange(len(labels)), labels] -= 1.0
        gradient = probabilities / len(labels)
        self.weights -= self.learning_rate * (x.T @ gradient)
        self.bias -= self.learning_rate * gradient.sum(axis=0)
        return loss

    def accuracy(self, images: np.ndarray, labels: np.ndarray) -> float:
        return float((self.logits(images).argmax(axis=1) == labels).mean())


# Fewer rows than this leave the model too little to learn the ten classes from.
ROWS_MIN = 2_000


def run(rows: int = 20_000, steps: int = 300, batch_size: int = 256, readers: int = 2, slots: int = 8,
        progress: bool = True) -> dict:
    from tqdm import tqdm

    if isinstance(rows, bool) or not isinstance(rows, int) or rows < ROWS_MIN:
        raise ValueError(f"rows must be an integer of at least {ROWS_MIN:,} (the model learns ten classes from "
                         f"them), got {rows!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer of at least 1, got {steps!r}")

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shmloader-demo-") as directory:
        directory = pathlib.Path(directory)
        fields = write_dataset(directory, rows, progress)
        test_images, test_labels = make_dataset(2_000, seed=1)
        print(f"dataset: {rows:,} images {IMAGE_SHAPE} uint8, {CLASSES} classes, in {directory}")
        model = SoftmaxRegression(int(np.prod(IMAGE_SHAPE)))
        with ShmDataLoader(fields, batch_size=batch_size, readers=readers, slots=slots, seed=0) as loader:
            bar = tqdm(total=steps, desc="training", unit="step", disable=not progress)
            for step, batch in zip(range(steps), loader):
                with batch:
                    loss = model.step(batch["image"], batch["label"])
                bar.update()
                if step % 20 == 0:
                    bar.set_postfix(loss=f"{loss:.3f}")
            bar.close()
            stats = loader.stats()
    accuracy = model.accuracy(test_images, test_labels)
    result = {
        "steps": steps,
        "rows_per_s": stats["rows_per_s"],
        "wait_fraction": stats["wait_fraction"],
        "accuracy": accuracy,
        "chance": 1 / CLASSES,
        "seconds": time.perf_counter() - started,
    }
    print(
        f"trained {steps} steps of {batch_size}: {stats['rows_per_s']:,.0f} rows/s through the loader "
        f"(trainer waited {stats['wait_fraction']:.0%} of the time, the model's own math is the rest)"
    )
    print(f"held-out accuracy {accuracy:.1%} (chance {1 / CLASSES:.0%}); total {result['seconds']:.1f} s")
    return result

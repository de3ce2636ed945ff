"""ImageNet-style training: a directory of JPEGs with labels from its subdirectories,
converted once, decoded + random-resized-cropped + flipped in the readers, trained with a
small PyTorch CNN (CPU is fine).

Run: python examples/train_imagenet_style.py [IMAGE_DIR]
     (needs `pip install torch 'shmloader[images]'`; without IMAGE_DIR it makes a small
     directory of 4 colour classes first)

One image of the generated directory is truncated: on_error="skip" replaces it with the
next good image of its batch, and stats()["skipped"] names its file (convert-images keeps
each record's path). `shmloader convert-images DIR OUT --check` lists such files first.

The readers run shmloader.transforms.images:train on each batch: the slot receives
(B, size, size, 3) uint8 images and (B,) int64 labels, nothing else. Each image's crop and
flip come from its own generator, keyed by (seed, its position in the stream, the
transform), so a resumed run sees exactly the augmentations it would have seen.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import numpy as np
import torch

from shmloader import ShmDataLoader
from shmloader.imagefolder import convert_images

SIZE = 48
TINTS = [(200, 60, 60), (60, 180, 60), (60, 80, 200), (150, 150, 150)]


def make_image_directory(root: pathlib.Path, per_class: int = 60) -> pathlib.Path:
    """JPEGs of 80-120 px: a class's tint under random gradients and noise."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, tint in enumerate(TINTS):
        directory = root / f"class{label}"
        directory.mkdir(parents=True)
        for index in range(per_class):
            height, width = (int(x) for x in rng.integers(80, 121, 2))
            y, x = np.mgrid[0:height, 0:width]
            shade = 0.7 + 0.3 * np.sin(x / rng.uniform(5, 30) + y / rng.uniform(5, 30))[..., None]
            image = np.array(tint) * shade + rng.normal(0, 12, (height, width, 3))
            Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(directory / f"{index:04d}.jpg", quality=90)
    # One file cut short, as an interrupted copy leaves it: its header reads, its pixels do not.
    broken = root / "class0" / "0007.jpg"
    broken.write_bytes(broken.read_bytes()[:600])
    return root


def main(steps: int = 150, image_directory: str | None = None, batch_size: int = 32) -> float:
    """Trains for `steps` batches; returns the accuracy over the last 20 of them."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        source = pathlib.Path(image_directory) if image_directory else make_image_directory(scratch / "images")
        paths = convert_images(source, scratch / "photos", progress=False)  # Once: bytes unchanged, plus labels.
        classes = len(__import__("json").loads(pathlib.Path(paths["classes"]).read_text())["classes"])
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes),
        )
        optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
        correct = seen = 0
        with ShmDataLoader({"image": paths["image"], "label": paths["label"]},
                           transform="shmloader.transforms.images:train",
                           transform_args={"size": SIZE, "scale": [0.3, 1.0]},
                           batch_size=batch_size, readers=2, seed=0,
                           on_error="skip") as loader:  # A broken image is replaced, counted and named.
            for step, batch in zip(range(steps), loader):
                with batch:  # The slot goes back once the data is copied out (the float conversion).
                    images = torch.from_numpy(batch["image"]).permute(0, 3, 1, 2).float().div_(255)
                    labels = torch.from_numpy(batch["label"]).clone()
                logits = model(images)
                loss = torch.nn.functional.cross_entropy(logits, labels)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                if step >= steps - 20:
                    correct += int((logits.argmax(1) == labels).sum())
                    seen += len(labels)
                if step % 50 == 0:
                    print(f"step {step}: loss {loss.item():.3f}")
            skipped = loader.stats()["skipped"]
            for record in skipped["records"][:3]:
                print(f"skipped at step {record['step']}: {record['where']}")
    accuracy = correct / seen
    print(f"accuracy over the last 20 batches: {accuracy:.2f}")
    return accuracy


if __name__ == "__main__":
    main(image_directory=sys.argv[1] if len(sys.argv) > 1 else None)

"""The Datasets and the collate_fn that bench/dataset.py runs through both DataLoaders: map-style
classes as a user writes them (its cases a-e and g; f reuses a's)."""

from __future__ import annotations

import io

import numpy as np


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



class Tokens:
    """Pre-tokenized documents of 16-512 tokens (lengths and ids from a seeded generator),
    each an int64 array under "input_ids", as a tokenized Hugging Face dataset in numpy
    format gives them: the padding happens in the collate_fn."""

    def __init__(self):
        rng = np.random.default_rng(0)
        lengths = rng.integers(16, 512, size=50_000, endpoint=True)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.tokens = rng.integers(1, 32_000, size=int(self.offsets[-1]), dtype=np.int32)  # 0 is the pad id.

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, index):
        return {"input_ids": self.tokens[self.offsets[index]:self.offsets[index + 1]].astype(np.int64)}


def pad_collate(samples):
    """Pads to the batch's longest: input_ids (pad 0), attention_mask, and labels (the ids,
    -100 where padded, which a loss ignores), as DataCollatorWithPadding does for an LM."""
    import torch

    longest = max(len(sample["input_ids"]) for sample in samples)
    input_ids = torch.zeros((len(samples), longest), dtype=torch.int64)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.int64)
    for row, sample in enumerate(samples):
        count = len(sample["input_ids"])
        input_ids[row, :count] = torch.from_numpy(sample["input_ids"])
        attention_mask[row, :count] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


class InMemory:
    """A 500 MB float32 array made in the trainer (125,000 rows of 1,000), every page
    written, indexed in __getitem__: what a script that np.load()s its data does."""

    def __init__(self):
        self.data = np.empty((125_000, 1_000), np.float32)
        self.data[:] = np.arange(1_000, dtype=np.float32)
        self.data[:, 0] = np.arange(len(self.data))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index], index % 10

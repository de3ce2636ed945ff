"""Map-style datasets for the dataset-source tests, importable by name (as a user's module
would be): readers unpickle them, or build them from an import path."""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np


class Drawn:
    """Samples of a drawn structure: `leaves` maps a path (tuple of keys; ints index a
    tuple) to (shape, dtype); each value is a function of the index alone."""

    def __init__(self, length: int, leaves: dict, container: str = "dict") -> None:
        self.length, self.leaves, self.container = length, leaves, container

    def __len__(self) -> int:
        return self.length

    def value(self, index: int, name: str, shape, dtype):
        rng = np.random.default_rng([index, sum(map(ord, name))])
        if np.dtype(dtype) == np.bool_:
            return rng.integers(0, 2, size=shape).astype(bool)
        return (rng.random(size=shape) * 100).astype(dtype)

    def __getitem__(self, index: int):
        values = {name: self.value(index, name, shape, dtype) for name, (shape, dtype) in self.leaves.items()}
        if self.container == "tuple":
            return tuple(values[name] for name in sorted(values))
        if self.container == "nested":
            names = sorted(values)
            return {"a": values[names[0]], "b": {"c": tuple(values[name] for name in names[1:])}}
        return values


class Augmented:
    """Each sample drawn from Python's, numpy's global generators (and torch's where it is
    imported): a resumed or re-sharded run must give the same draws."""

    def __init__(self, length: int = 40) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        drawn = [random.random(), float(np.random.random())]
        try:
            import torch

            drawn.append(float(torch.rand(1)))
        except ImportError:
            drawn.append(0.0)
        return {"index": index, "drawn": np.asarray(drawn)}


class Failing:
    """Index `bad` raises a KeyError of its own."""

    def __init__(self, length: int = 30, bad=(7,)) -> None:
        self.length, self.bad = length, set(bad)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if index in self.bad:
            raise KeyError(f"no record {index}")
        return {"x": np.full(2, index, np.int64)}


class Varying:
    """Token-like samples whose length varies with the index."""

    def __len__(self) -> int:
        return 25

    def __getitem__(self, index: int):
        return {"tokens": np.arange(index % 6 + 1, dtype=np.int32), "label": index}


class Slow:
    """Takes `delay` seconds per sample (a reader killed mid-batch is likely mid-sample)."""

    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        time.sleep(self.delay)
        return np.full(3, index, np.int64)


class HoldsALock:
    """Not picklable: a lock among its attributes."""

    def __init__(self) -> None:
        self.guard = threading.Lock()

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int):
        return np.zeros(2)


def make_squares(length: int = 20, scale: int = 1):
    """A factory by import path: each reader builds its own."""
    return [np.asarray([index * index * scale], np.int64) for index in range(length)]


def make_squares_padded(length: int = 20, padding: str = ""):
    """make_squares, with an argument whose only use is to make the readers' configuration
    (which carries dataset_args) longer than a pipe holds."""
    return make_squares(length)


class Packable:
    """Samples whose first dimension varies (0 to `longest` items of `item_shape`), drawn
    from the index alone, for a PackedRagged output."""

    def __init__(self, length: int, item_shape=(), dtype="int32", longest: int = 5) -> None:
        self.length, self.item_shape, self.dtype, self.longest = length, tuple(item_shape), dtype, longest

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        rng = np.random.default_rng([index, 7])
        count = int(rng.integers(0, self.longest + 1))
        return {"points": (rng.random((count, *self.item_shape)) * 100).astype(self.dtype), "label": index}


class OpensLazily:
    """Opens its file at its first __getitem__, in whichever process calls it (the pattern
    torch's documentation recommends for workers): the handle does not pickle."""

    def __init__(self, path: str, length: int) -> None:
        self.path, self.length, self.handle = path, length, None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if self.handle is None:
            self.handle = open(self.path, "rb")
        self.handle.seek(index)
        return {"byte": np.frombuffer(self.handle.read(1), np.uint8)}


class UndecodableFirst:
    """dataset[0] raises a UnicodeDecodeError (whose constructor takes five arguments)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return {"text": np.frombuffer(b"\xff".decode("utf-8").encode(), np.uint8)}


class Scaled:
    """index * scale: a dataset whose attribute a training loop changes between epochs."""

    def __init__(self, length: int = 8) -> None:
        self.length, self.scale = length, 1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return {"value": index * self.scale}


class StartsSlowly:
    """Takes `start_seconds` to load in a reader (its unpickling sleeps there, as a dataset
    that imports torch or opens a large index at load would; the trainer's own copies load
    at once): a reader's start, not any step, is slow."""

    def __init__(self, start_seconds: float, length: int = 32) -> None:
        self.start_seconds, self.length, self.trainer_pid = start_seconds, length, os.getpid()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if os.getpid() != self.trainer_pid:
            time.sleep(self.start_seconds)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return np.full(3, index, np.int64)


class Sleepy:
    """Samples that each take `seconds` in __getitem__ (a slow decode or augmentation, as a
    sleep: it limits the loader whatever the machine's load)."""

    def __init__(self, seconds: float, length: int = 1000) -> None:
        self.seconds, self.length = seconds, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if self.seconds:
            time.sleep(self.seconds)
        return {"x": np.full(8, index, np.float32)}

"""Python's, numpy's and torch's global generators, seeded before each sample of a dataset
from the sample's seed (its stream position's), so that a sample is the same whatever the
reader count, reader, batch or resume, and each sample's __getitem__ runs once.

Every generator there is (torch's once anything imported it) is seeded before every
sample, whether or not the dataset draws from it. An earlier, lazier scheme seeded Python's
and numpy's only once a batch showed them drawn from, and filled that batch again with them
seeded per sample: a dataset that memoizes its samples, counts its calls or caches what it
decodes saw __getitem__ twice and kept its first, wrongly seeded, result. Seeding costs a few
microseconds a sample (Python's `random.seed` most: its init_by_array; bench/RESULTS.md has
the figures); the seeding is one call per sample (seed_all), which looks torch up each time,
so that a __getitem__ that imports torch has it seeded from the next sample on.

What stays outside: a generator other than these three (a dataset's own, which it should
seed from torch.initial_seed() or a seed of its own making), and numpy's new-style
Generators (np.random.default_rng()), which draw from their own seed.
"""

from __future__ import annotations

import contextlib
import random
import sys

import numpy as np

_MASK32 = (1 << 32) - 1
_MASK63 = (1 << 63) - 1


def _numpy_state() -> dict:
    # The dict form: the legacy tuple exists for MT19937 alone (np.random.set_bit_generator
    # may have put another behind the global functions), and warns for the others.
    return np.random.get_state(legacy=False)


def seed_all(value: int) -> None:
    """Seeds Python's, numpy's and (once imported) torch's global generators from `value`,
    as before every sample. Torch's CPU generator alone: torch.manual_seed also queues a
    CUDA seeding with a formatted stack on every call while CUDA is not initialised."""
    random.seed(value)  # Inlined: this runs before every sample.
    np.random.seed(value & _MASK32)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "default_generator"):  # Not while torch is half imported.
        torch.default_generator.manual_seed(value & _MASK63)


class GlobalSeeds:
    """Has a batch filled with every global generator seeded before each sample."""

    def fill(self, seeds: list[int], fill_rows) -> None:
        """Calls fill_rows(seeders) once: it must call each of `seeders` with a sample's seed
        before that sample (the i-th sample with seeds[i]), and call __getitem__ once a sample."""
        fill_rows([seed_all])


def _cuda_generators():
    """torch's CUDA generators where CUDA is initialised (a dataset's torch.manual_seed
    seeds them too), else None."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    return cuda if cuda is not None and cuda.is_initialized() else None


def _torch_generator():
    return sys.modules["torch"].default_generator


# What global_states_kept saves and puts back: (there now?, save, restore) by generator.
_KEPT = {
    "random": (lambda: True, random.getstate, random.setstate),
    "numpy": (lambda: True, _numpy_state, np.random.set_state),
    "torch": (lambda: "torch" in sys.modules, lambda: _torch_generator().get_state(),
              lambda state: _torch_generator().set_state(state)),
    "cuda": (lambda: _cuda_generators() is not None, lambda: _cuda_generators().get_rng_state_all(),
             lambda states: _cuda_generators().set_rng_state_all(states)),
}


@contextlib.contextmanager
def global_states_kept():
    """Puts the global generators back as they were after the block. User code run in the
    trainer's own process (a dataset's samples or a transform with readers=0, dataset[0]
    which the plan reads there, compute_batch and check_determinism) has them seeded per
    sample or per batch, and the trainer's own draws (dropout, augmentation in its loop)
    must not depend on the loader's settings. Saving and restoring numpy's costs about
    0.1 ms (its state is 624 words), once per batch filled in the trainer.

    Not covered: a generator imported during the block (it had no state before, and keeps
    the one it has), and a CUDA seeding that torch.manual_seed queues while CUDA is not
    initialised (it runs when CUDA starts; a dataset that calls torch.manual_seed itself
    should use a torch.Generator of its own)."""
    saved = [(restore, save()) for there, save, restore in _KEPT.values() if there()]
    try:
        yield
    finally:
        for restore, state in saved:
            restore(state)


def runs_user_code(filler) -> bool:
    """Whether `filler` calls a dataset's __getitem__ or a transform, which run with the
    global generators seeded (a stand-in filler in a test may have neither attribute)."""
    return getattr(filler, "dataset", None) is not None or getattr(filler, "runner", None) is not None

"""Python's, numpy's and torch's global generators, seeded before each sample of a dataset;
Python's and numpy's only once the dataset is seen drawing from them.

Seeding all three costs about 7 µs a sample (Python's `random.seed` alone is ~3.6 µs: its
init_by_array; numpy's 1.5), more than the rest of a small sample's path. A generator the
dataset never draws from need not be seeded for each sample: its state cannot change a
sample. So a batch is filled optimistically while Python's or numpy's generator is not yet
known to be drawn from: seeded once, from the first sample's seed, and its state compared
after the batch with the state it had right after that seeding. Unchanged, no sample drew
from it and the batch is exact; changed, it is known drawn from for the rest of this
process, and the batch is filled again with it seeded before every sample. A batch that
raises is judged the same way: if no unknown generator changed, its error is the exact
one. A dataset that draws costs one batch twice per reader; one that never does pays no
seeding per sample. Torch's generator is seeded before every sample whenever torch is
imported (about 1 µs): `torch.initial_seed()` reads the seed without drawing, a common
way to seed a sample's own generator, which a comparison of states cannot see.

What this cannot see: a `__getitem__` that reads Python's or numpy's global state without
drawing (random.getstate(), np.random.get_state()), or draws and then puts the state back
(random.setstate): those reads and draws see the batch's first seed.
"""

from __future__ import annotations

import contextlib
import random
import sys

import numpy as np

_MASK32 = (1 << 32) - 1
_MASK63 = (1 << 63) - 1


def _seed_random(value: int) -> None:
    random.seed(value)


def _seed_numpy(value: int) -> None:
    np.random.seed(value & _MASK32)


def _seed_torch(value: int) -> None:
    # The CPU generator alone: torch.manual_seed also queues a CUDA seeding with a
    # formatted stack on every call while CUDA is not initialised (time and memory).
    sys.modules["torch"].default_generator.manual_seed(value & _MASK63)


def _state_random():
    return random.getstate()


def _frozen(value):
    """`value` (a generator's state: dicts, arrays, numbers) as something `==` compares."""
    if isinstance(value, dict):
        return tuple((key, _frozen(item)) for key, item in sorted(value.items()))
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.tobytes()
    return value


def _numpy_state() -> dict:
    # The dict form: the legacy tuple exists for MT19937 alone (np.random.set_bit_generator
    # may have put another behind the global functions), and warns for the others.
    return np.random.get_state(legacy=False)


def _state_numpy():
    return _frozen(_numpy_state())


def _state_torch():
    return sys.modules["torch"].default_generator.get_state().numpy().tobytes()


_GENERATORS = {"random": (_seed_random, _state_random), "numpy": (_seed_numpy, _state_numpy),
               "torch": (_seed_torch, _state_torch)}


class GlobalSeeds:
    """Which global generators this process's dataset draws from, learned batch by batch."""

    def __init__(self) -> None:
        self.drawn: set[str] = set()

    def present(self) -> list[str]:
        """The generators there are: torch's once anything imported torch."""
        return [name for name in _GENERATORS if name != "torch" or "torch" in sys.modules]

    def fill(self, seeds: list[int], fill_rows) -> None:
        """Calls fill_rows(seeders), which must seed with each of `seeders` before each
        sample (the i-th sample with seeds[i]); again with every generator among them if a
        generator not yet known drawn from was drawn from (see the module's docstring)."""
        if "torch" in sys.modules:
            self.drawn.add("torch")  # Seeded before every sample: see the module's docstring.
        unknown = [name for name in self.present() if name not in self.drawn]
        if not unknown or not seeds:
            fill_rows(self._seeders(self.drawn))
            return
        for name in unknown:
            _GENERATORS[name][0](seeds[0])
        before = {name: _GENERATORS[name][1]() for name in unknown}
        try:
            fill_rows(self._seeders(self.drawn))
        except Exception:
            if not self._learn(before):
                raise  # No unknown generator was drawn from: the error is the exact pass's.
        else:
            if not self._learn(before):
                return
        fill_rows(self._seeders(self.drawn))

    def _learn(self, before: dict) -> bool:
        """Whether a generator of `before` (states right after seeding) was drawn from since,
        or one appeared meanwhile (torch imported by __getitem__: no state from before to
        compare); such generators are known drawn from from now on."""
        drawn = {name for name in self.present() if name not in self.drawn and
                 (name not in before or _GENERATORS[name][1]() != before[name])}
        self.drawn.update(drawn)
        return bool(drawn)

    @staticmethod
    def _seeders(names) -> list:
        return [_GENERATORS[name][0] for name in _GENERATORS if name in names]


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

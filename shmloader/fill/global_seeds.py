"""Python's, numpy's and torch's global generators, set before each sample of a dataset
to states that are a function of the sample's seed (its stream position's), so that a
sample is the same whatever the reader count, reader, batch or resume, and each sample's
__getitem__ runs once.

Every generator there is (torch's once anything imported it) is set before every sample,
whether or not the dataset draws from it: what a sample will draw from is not known before
it runs, and running it twice (an earlier, lazier scheme filled a batch again once it saw a
generator drawn from) gives a dataset that memoizes, counts its calls or caches what it
decodes its first, wrongly seeded, result.

Python's `random` and numpy's legacy `np.random` are Mersenne Twisters whose own seeding
(init_by_array, init_genrand) is a serial chain of 1,900 and 624 steps, microseconds a
sample; their states are instead the 624 words of ring/_cursor_seeds.c (splitmix64
outputs, no chain, vectorised), written into the generators' memory by one call into the
C extension a sample (its SampleSeeder), at the addresses _MersenneTwisters finds and
checks once per process through the generators' public getstate/get_state. Where it cannot (another Python or numpy layout), the same
states go through random.setstate and np.random.set_state: the same values, slower. Torch's
CPU generator gets its words through set_state of a state tensor the same call fills (its
layout checked once against a manual_seed's); where that layout is not the one checked,
torch.manual_seed (deterministic, but other values). bench/RESULTS.md has the costs.

What stays outside: a generator other than these three (a dataset's own, which it should
seed from torch.initial_seed() or a seed of its own making), numpy's new-style Generators
(np.random.default_rng()), which draw from their own seed, and a global numpy generator
that is not a MT19937 (np.random.set_bit_generator), which is seeded with np.random.seed.
"""

from __future__ import annotations

import contextlib
import random
import struct
import sys

import numpy as np

_MASK32 = (1 << 32) - 1
_MASK63 = (1 << 63) - 1


def _numpy_state() -> dict:
    # The dict form: the legacy tuple exists for MT19937 alone (np.random.set_bit_generator
    # may have put another behind the global functions), and warns for the others.
    return np.random.get_state(legacy=False)


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# ring/_cursor_seeds.c's domains (its `domains`, in this order): the two generators get different states from one seed.
PYTHON_DOMAIN = 0x7079_7468_6F6E_0001
NUMPY_DOMAIN = 0x6E75_6D70_7900_0002
TORCH_DOMAIN = 0x746F_7263_6800_0003
_WORDS = 624
# Torch's CPU generator (ring/_cursor_seeds.c's TORCH_*): the engine's key after its header,
# the cached normals' flags after the key; get_state's float normal after its legacy state.
_TORCH_STATE = 20
_TORCH_FLOAT_ENGAGED = _TORCH_STATE + 4 * _WORDS + 8
_TORCH_DOUBLE_ENGAGED = _TORCH_STATE + 4 * _WORDS + 20
_TORCH_NORMALS = 24 + 8 * _WORDS + 3 * 8 + 8  # normal_x, _y, _rho, normal_is_valid (padded)


def mt19937_words(seed: int, domain: int) -> np.ndarray:
    """The 624 state words ring/_cursor_seeds.c writes for (seed, domain), by numpy:
    splitmix64's sequence from its finaliser of seed ^ domain, each output's low then high
    half, word 0 set to 0x80000000."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64's does.
        z = np.array([(seed ^ domain) & _MASK64], dtype=np.uint64)
        z = _mix64(z)
        z = _mix64(z + np.arange(1, _WORDS // 2 + 1, dtype=np.uint64) * np.uint64(_GOLDEN))
    words = z.view(np.uint32).copy() if sys.byteorder == "little" else \
        np.stack([z & np.uint64(0xFFFFFFFF), z >> np.uint64(32)], axis=1).astype(np.uint32).ravel()
    words[0] = 0x80000000
    return words


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _set_by_public_calls(value: int) -> None:
    """The states of `value` through random.setstate and np.random.set_state: what the
    native write does, where its addresses could not be found or checked."""
    random.setstate((3, (*mt19937_words(value, PYTHON_DOMAIN).tolist(), _WORDS), None))
    if isinstance(np.random.mtrand._rand._bit_generator, np.random.MT19937):
        np.random.set_state(("MT19937", mt19937_words(value, NUMPY_DOMAIN), _WORDS, 0, 0.0))
    else:
        np.random.seed(value & _MASK32)  # numpy seeds another bit generator its own way.


def _torch_state_template(torch):
    """(a state tensor for torch.Generator.set_state, its initial seed's and key's offsets)
    where torch's get_state() has the layout checked here (the initial seed, left, seeded,
    next, then the 624 key words as 64-bit integers, as torch's CPUGeneratorImplState has
    them), else None."""
    probe = torch.Generator()
    probe.manual_seed(12345)
    template = probe.get_state()
    raw = template.numpy()
    if raw.size < 24 + 8 * _WORDS:
        return None
    head = struct.unpack_from("=QiiQ", raw, 0)
    words = np.frombuffer(raw, np.uint64, 2, 24).tolist()
    # init_genrand(12345): the key's first two words; a fresh seeding's left 1, next 0.
    if head != (12345, 1, 1, 0) or words != [12345, (1812433253 * (12345 ^ (12345 >> 30)) + 1) & _MASK32]:
        return None
    return template, raw


class _MersenneTwisters:
    """Finds, once per process, where `random`'s and np.random's states are in memory, checks
    each address by writing a state through it into a probe generator of the same type and
    reading it back through the public getstate/get_state, and then sets the global
    generators with one native call a sample (set)."""

    def __init__(self) -> None:
        from .._native import load_cursor

        self.cursor = load_cursor()
        self._write = self.cursor.write_generator_states
        self._python = self._python_addresses()
        self._numpy_generator = None
        self._numpy = self._numpy_addresses()
        self.torch = None  # torch_route(): (generator, state tensor or None, the write's two torch arguments).

    def set(self, value: int) -> None:
        if np.random.mtrand._rand._bit_generator is not self._numpy_generator:  # np.random.set_bit_generator.
            self._numpy = self._numpy_addresses()
        torch = self.torch_route()
        python, numpy = self._python, self._numpy
        engine = torch[2] if torch is not None else 0
        if python is None or numpy is None:
            _set_by_public_calls(value)
            if engine:
                self._write(value, (0,) * 6 + (engine,))
        else:
            self._write(value, (*python, *numpy, engine))
            random._inst.gauss_next = None  # As Random.seed leaves it.
        if torch is not None and not engine:
            generator, template, _ = torch
            if template is None:
                generator.manual_seed(value & _MASK63)
            else:  # Its words through the state tensor set_state reads.
                raw = template.numpy()
                struct.pack_into("=Q", raw, 0, value & _MASK63)
                np.frombuffer(raw, np.uint64, _WORDS, 24)[:] = mt19937_words(value, TORCH_DOMAIN)
                generator.set_state(template)

    no_torch = 0  # The write's torch address where torch's state is not written there.

    def torch_route(self):
        """Once torch is imported: (its default CPU generator, a state tensor its set_state
        takes or None, the address of its engine or 0). The engine's address where found and
        checked (_torch_engine): the native write sets it, no call into torch. Else the
        tensor, where torch's get_state has the layout checked (_torch_state_template) and
        set_state gives back what was written; else torch.manual_seed (deterministic, other
        values). None before torch."""
        if self.torch is not None:
            return self.torch
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "default_generator"):  # Not while torch is half imported.
            return None
        found = _torch_state_template(torch)
        self.torch = (torch.default_generator, None, 0)
        if found is not None:
            template, raw = found
            struct.pack_into("=Q", raw, 0, 7)
            np.frombuffer(raw, np.uint64, _WORDS, 24)[:] = mt19937_words(7, TORCH_DOMAIN)
            probe = torch.Generator()
            probe.set_state(template)
            if probe.initial_seed() == 7 and torch.equal(probe.get_state(), template):
                self.torch = (torch.default_generator, template, self._torch_engine(torch, template))
        return self.torch

    def _torch_engine(self, torch, template) -> int:
        """The address of the default CPU generator's engine (ring/_cursor_seeds.c's TORCH_*
        layout), or 0. Found in a probe generator seeded with 12345 (its key's first words
        after the engine's header), then checked: with both cached normals set through
        set_state, a write there must give the probe exactly the state set_state of
        `template` (seed 7's, written by set) gives; and the default generator's memory at the
        same offset must hold what its get_state says. Reads stay inside the generator
        object's first bytes (its engine's key is larger than the span searched)."""
        import ctypes

        def impl_of(generator) -> int:  # THPGenerator: the object's head, then at::Generator's one pointer.
            return ctypes.c_void_p.from_address(id(generator) + object.__basicsize__).value or 0

        probe = torch.Generator()
        probe.manual_seed(12345)
        impl = impl_of(probe)
        if not impl:
            return 0
        key = [12345]
        for i in range(1, 3):
            key.append((1812433253 * (key[-1] ^ (key[-1] >> 30)) + i) & _MASK32)
        at = ctypes.string_at(impl, 512 + 12).find(struct.pack("=3I", *key)) - _TORCH_STATE
        if at < 0 or struct.unpack_from("=QiB3xI", ctypes.string_at(impl + at, _TORCH_STATE)) != (12345, 1, 1, 0):
            return 0
        cached = template.clone()
        raw = cached.numpy()
        if raw.size < _TORCH_NORMALS + 8:
            return 0
        struct.pack_into("=ddd i", raw, 24 + 8 * _WORDS, 0.5, 0.25, 1.5, 1)  # normal_x, _y, _rho, valid
        struct.pack_into("=f?", raw, _TORCH_NORMALS, 1.5, True)  # the float normal and its flag
        probe.set_state(cached)
        flags = ctypes.string_at(impl + at + _TORCH_FLOAT_ENGAGED, 1) + ctypes.string_at(impl + at + _TORCH_DOUBLE_ENGAGED, 1)
        if flags != b"\x01\x01":
            return 0
        self._write(7, (0,) * 6 + (impl + at,))
        if probe.initial_seed() != 7 or not torch.equal(probe.get_state(), template):
            return 0
        generator = torch.default_generator
        if not impl_of(generator):
            return 0
        engine = impl_of(generator) + at
        state = generator.get_state().numpy()
        seed, left, seeded, position = struct.unpack_from("=QiiQ", state, 0)
        words = ctypes.string_at(engine + _TORCH_STATE, 4 * _WORDS)
        if struct.unpack_from("=QiB3xI", ctypes.string_at(engine, _TORCH_STATE)) != \
                (seed, left, seeded, position) or \
                np.frombuffer(words, np.uint32).tolist() != np.frombuffer(state, np.uint64, _WORDS, 24).tolist():
            return 0
        return engine

    def _python_addresses(self):
        """random._inst's index and key addresses (CPython's RandomObject: the index, then the
        624 words), or None."""
        import ctypes

        probe = random.Random(12345)
        words = struct.pack(f"={_WORDS}I", *probe.getstate()[1][:_WORDS])
        size = type(probe).__basicsize__
        offset = ctypes.string_at(id(probe), size).find(words)
        if offset < 4:
            return None
        addresses = lambda instance: (id(instance) + offset - 4, id(instance) + offset)  # noqa: E731 (index, key)
        self._write(7, (*addresses(probe), *(0,) * 5))
        expected = (3, (*mt19937_words(7, PYTHON_DOMAIN).tolist(), _WORDS), probe.gauss_next)
        if probe.getstate() != expected or type(random._inst) is not type(probe):
            return None
        return addresses(random._inst)

    def _numpy_addresses(self):
        """np.random's MT19937 key and position and its RandomState's cached normal, or None
        (the global generator is no MT19937, or the layout is not the one checked)."""
        import ctypes

        generator = self._numpy_generator = np.random.mtrand._rand._bit_generator
        if type(generator) is not np.random.MT19937:
            return None
        probe = np.random.RandomState(np.random.MT19937(12345))
        probe.standard_normal()  # Box-Muller: one normal of a pair is cached.
        _, _, _, has_gauss, gauss = probe.get_state()
        # The RandomState's cached normal follows its pointer to the bit generator's functions,
        # a pointer into the RandomState itself (numpy's aug_bitgen_t).
        size = type(probe).__basicsize__
        memory = ctypes.string_at(id(probe), size)
        cached = None
        for offset in range(0, size - struct.calcsize("@Pid") + 1, 8):
            pointer, flag, value = struct.unpack_from("@Pid", memory, offset)  # aug_bitgen_t's fields, native alignment
            if id(probe) <= pointer < id(probe) + size and flag == has_gauss == 1 and value == gauss:
                cached = offset
                break
        if cached is None:
            return None

        def addresses(state, bit_generator) -> tuple:
            key = bit_generator.ctypes.state_address
            # (position, key, has_gauss, gauss)
            return key + 4 * _WORDS, key, id(state) + cached + 8, id(state) + cached + 16

        self._write(7, (0, 0, *addresses(probe, probe._bit_generator), self.no_torch))
        state = probe.get_state()
        if state[0] != "MT19937" or not np.array_equal(state[1], mt19937_words(7, NUMPY_DOMAIN)) or \
                state[2:] != (_WORDS, 0, 0.0):
            return None
        return addresses(np.random.mtrand._rand, generator)


_TWISTERS: _MersenneTwisters | None = None


def _twisters() -> _MersenneTwisters:
    global _TWISTERS
    if _TWISTERS is None:
        _TWISTERS = _MersenneTwisters()
    return _TWISTERS


def seed_all(value: int) -> None:
    """Sets Python's, numpy's and (once imported) torch's global generators to the states of
    `value`, as before every sample. Torch's CPU generator alone: torch.manual_seed also
    queues a CUDA seeding with a formatted stack on every call while CUDA is not initialised
    (CUDA generators are not set per sample)."""
    _twisters().set(value)


def sample_seeder():
    """seed_all for a batch's samples, as one C callable (ring/_cursor_seeds.c's
    SampleSeeder) holding the addresses and torch's generator: a sample's seeding is most of
    a small sample's cost. It calls seed_all instead where the native write is not used, where
    np.random's bit generator was replaced since, and while torch was imported since (a
    __getitem__ that imports torch has it seeded from its next sample on; the next batch's
    seeder writes it natively)."""
    twisters = _twisters()
    python, numpy = twisters._python, twisters._numpy
    torch = twisters.torch_route()
    if python is None or numpy is None or (torch is not None and not torch[2]):
        return seed_all
    return twisters.cursor.SampleSeeder((*python, *numpy, torch[2] if torch else 0), random._inst,
                                        np.random.mtrand._rand, twisters._numpy_generator, sys.modules, seed_all)


class GlobalSeeds:
    """Has a batch filled with every global generator seeded before each sample."""

    def fill(self, seeds: list[int], fill_rows) -> None:
        """Calls fill_rows(seeders) once: it must call each of `seeders` with a sample's seed
        before that sample (the i-th sample with seeds[i]), and call __getitem__ once a sample."""
        fill_rows([sample_seeder()])


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

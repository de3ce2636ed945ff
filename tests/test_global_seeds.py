"""Global generators are seeded before every sample (shmloader/fill/global_seeds.py):
whatever a dataset draws, from which generator, at which indices and in which batch, the
samples equal those of seeding every generator before every sample, each __getitem__ called
once (tests/test_once_per_sample.py has the loader-level cases)."""

from __future__ import annotations

import pathlib
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import sample_generator_words, seed_sample_generators
from shmloader import ReaderStallWarning, ShmDataLoader
from shmloader._native import load_cursor
from shmloader.fill.dataset_runner import sample_seeds
from shmloader.fill import global_seeds
from shmloader.fill.global_seeds import GlobalSeeds

try:
    import torch
except ImportError:  # The tests of Python's and numpy's generators run without it.
    torch = None

# "gauss" and "normal" leave a cached normal behind (random.gauss's gauss_next, the legacy
# RandomState's Box-Muller pair): the next sample must not get it.
GENERATORS = ("random", "numpy", "gauss", "normal") + (("torch",) if torch is not None else ())
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _draw(name: str) -> float:
    if name == "random":
        return random.random()
    if name == "numpy":
        return float(np.random.random())
    if name == "gauss":
        return random.gauss(0.0, 1.0)
    if name == "normal":
        return float(np.random.standard_normal())
    return float(torch.rand(1))


def _eager(value: int) -> None:
    seed_sample_generators(value)


class Draws:
    """Sample `index` draws from the generators `plan[index]` names (most draw nothing),
    and raises where `plan[index]` is "raise" after a draw from numpy."""

    def __init__(self, plan: dict) -> None:
        self.plan = plan

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        names = self.plan.get(index, ())
        if names == "raise":
            np.random.random()
            raise KeyError(index)
        return [_draw(name) for name in names]


def _batch(seeds, dataset, indices, seeders):
    samples = []
    for index, seed in zip(indices, seeds):
        for seeder in seeders:
            seeder(seed)
        samples.append(dataset[index])
    return samples


plans = st.dictionaries(st.integers(0, 63), st.one_of(st.lists(st.sampled_from(GENERATORS), max_size=3),
                                                      st.just("raise")), max_size=8)


@settings(max_examples=60, deadline=None)
@given(plans, st.lists(st.lists(st.integers(0, 63), min_size=1, max_size=9), min_size=1, max_size=6),
       st.integers(0, 2**64 - 1))
def test_seeding_gives_what_seeding_every_generator_before_every_sample_gives(plan, batches, seed):
    dataset, seeding = Draws(plan), GlobalSeeds()
    for step, indices in enumerate(batches):  # One reader's batches, in order.
        seeds = sample_seeds(seed + step, np.arange(len(indices)))
        try:
            expected = [_batch([value], dataset, [index], [_eager]) [0] for index, value in zip(indices, seeds)]
        except KeyError as error:
            expected = error
        found, calls = [], []

        def fill_rows(seeders):
            calls.append(1)
            found[:] = _batch(seeds, dataset, indices, seeders)

        try:
            seeding.fill(list(seeds), fill_rows)
        except KeyError as error:
            assert isinstance(expected, KeyError) and error.args == expected.args
            continue
        finally:
            assert len(calls) == 1  # Before: a batch that drew was filled twice.
        assert found == expected


@needs_torch
def test_torch_is_seeded_per_sample_so_that_reading_its_seed_is_exact():
    """torch.initial_seed() reads without drawing (a comparison of states cannot see it),
    a common way to seed a sample's own generator."""
    seeds = list(sample_seeds(11, np.arange(6)))
    found = []
    GlobalSeeds().fill(seeds, lambda seeders: found.__setitem__(slice(None), _batch(
        seeds, _InitialSeed(), range(6), seeders)))
    expected = [_batch([seed], _InitialSeed(), [0], [_eager])[0] for seed in seeds]
    assert found == expected and len(set(found)) == 6


class _InitialSeed:
    def __getitem__(self, index: int):
        return torch.initial_seed()


class LateTorch:
    """Only indices past 40 draw (from torch alone), so readers learn it batches in."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        return np.float32(float(torch.rand(1)) if index > 40 and index % 3 == 0 else -1.0)


def _samples(readers: int) -> dict[int, float]:
    with ShmDataLoader.from_dataset(LateTorch(), batch_size=4, readers=readers, seed=5, epochs=1) as loader:
        return {int(index): float(value) for batch in loader for index, value in zip(batch.indices, batch["data"])}


@needs_torch
def test_a_loader_over_a_dataset_that_draws_late_equals_seeding_every_sample():
    here, readers = _samples(0), _samples(2)
    with ShmDataLoader.from_dataset(LateTorch(), batch_size=4, readers=0, seed=5, epochs=1) as loader:
        expected = {}
        for batch in loader:
            for index, key in zip(batch.indices.tolist(), loader.sampler.row_keys(batch.step, len(batch.indices))):
                _eager(sample_seeds(5, np.array([key]))[0])
                expected[index] = float(LateTorch()[index])
    assert len(expected) == 64 and len({value for value in expected.values() if value >= 0}) == 8
    assert here == expected and readers == expected


def _trainer_states():
    states = [random.getstate(), np.random.get_state(legacy=False)]
    return states + ([torch.get_rng_state()] if torch is not None else [])


def _assert_states_are(states):
    assert random.getstate() == states[0]
    now = np.random.get_state(legacy=False)
    assert now["bit_generator"] == states[1]["bit_generator"] and now["state"].keys() == states[1]["state"].keys()
    for key, value in states[1]["state"].items():
        assert np.array_equal(now["state"][key], value), key
    assert {k: v for k, v in now.items() if k != "state"} == {k: v for k, v in states[1].items() if k != "state"}
    if torch is not None:
        assert torch.equal(torch.get_rng_state(), states[2])


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.npy"
    np.save(path, np.arange(200, dtype=np.float32).reshape(50, 4))
    return str(path)


def test_a_transform_run_in_the_trainer_leaves_its_global_generators_as_they_were(data_file):
    """readers=0 runs the transform in the trainer, with `random` and `np.random` seeded per
    batch (transforms/core.reseed_globals); compute_batch and check_determinism too."""
    from shmloader.transforms import check_determinism, compute_batch

    options = dict(transform="transform_fixtures:scaled", batch_size=4, seed=5)
    random.seed(21)
    np.random.seed(22)
    states = _trainer_states()
    with ShmDataLoader({"data": data_file}, readers=0, **options) as loader:
        for _, batch in zip(range(5), loader):
            pass
        _assert_states_are(states)
    compute_batch({"data": data_file}, 3, options["transform"], batch_size=4, seed=5)
    check_determinism({"data": data_file}, options["transform"], batch_size=4, seed=5)
    _assert_states_are(states)


@pytest.mark.parametrize("loaded", [False, True], ids=["idle", "loaded"])
def test_a_global_generator_other_than_mt19937_is_kept_without_a_warning(monkeypatch, loaded):
    """np.random.set_bit_generator(PCG64): the legacy get_state() warns for it (an error
    under -W error) and has no 5-tuple; the loader keeps and compares its state anyway.
    `loaded`: every wait is long enough for a stall warning, as on a machine where 14 test
    workers start readers at once; a ReaderStallWarning is then no failure of this test."""
    from dataset_fixtures import Augmented

    from shmloader.readers import supervision

    if loaded:
        monkeypatch.setattr(supervision, "STALL_WARNING_SECONDS", 0.0)

    original = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(7))
    try:
        states = _trainer_states()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # A machine's load (readers slow to start or to fill) is no warning of the generator's.
            warnings.simplefilter("default", ReaderStallWarning)
            for readers in (0, 2):
                with ShmDataLoader.from_dataset(Augmented(12), batch_size=4, readers=readers, seed=3) as loader:
                    drawn = [batch["drawn"].copy() for _, batch in zip(range(4), loader)]
                _assert_states_are(states)
                assert len(drawn) == 4
    finally:
        np.random.set_bit_generator(original)


@pytest.mark.parametrize("readers", [0, 2])
def test_a_loader_leaves_the_trainers_global_generators_as_they_were(readers):
    """Augmented draws from Python's, numpy's (and torch's) global generators, which a fill
    seeds per sample: neither the plan's read of dataset[0] in the trainer nor readers=0's
    fills there may move the trainer's own generators, or its draws (dropout, its own
    augmentation) would depend on the loader's settings. The batches are those of readers=1."""
    from dataset_fixtures import Augmented

    random.seed(11)
    np.random.seed(12)
    states = [random.getstate(), np.random.get_state()]
    if torch is not None:
        torch.manual_seed(13)
        states.append(torch.get_rng_state())
    with ShmDataLoader.from_dataset(Augmented(40), batch_size=4, readers=readers, seed=3) as loader:
        drawn = [batch["drawn"].copy() for _, batch in zip(range(20), loader)]
        assert random.getstate() == states[0]
        after = np.random.get_state()
        assert after[0] == states[1][0] and np.array_equal(after[1], states[1][1]) and after[2:] == states[1][2:]
        if torch is not None:
            assert torch.equal(torch.get_rng_state(), states[2])
    with ShmDataLoader.from_dataset(Augmented(40), batch_size=4, readers=1, seed=3) as loader:
        expected = [batch["drawn"].copy() for _, batch in zip(range(20), loader)]
    np.testing.assert_array_equal(np.stack(drawn), np.stack(expected))


def _public_states():
    numpy = np.random.get_state()
    states = [random.getstate(), (numpy[0], numpy[1].tolist(), *numpy[2:])]
    return states + ([torch.default_generator.get_state().tolist()] if torch is not None else [])


def _assert_documented_states(value):
    """The three generators hold what conftest.seed_sample_generators sets through their
    public calls, from its own rebuild of ring/_cursor_seeds.c's words."""
    found = _public_states()
    seed_sample_generators(value)
    assert found == _public_states()
    python = found[0]
    assert python[1][:624] == tuple(sample_generator_words(value, 0x7079_7468_6F6E_0001))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_a_sample_s_generators_hold_the_documented_states_written_natively(value):
    """The native write (one call into the three generators' memory) leaves exactly the
    states that random.setstate, np.random.set_state and torch's set_state would, every
    cached normal cleared, here on CPython with numpy's MT19937 and this torch (where it
    found and checked its addresses)."""
    global_seeds.seed_all(1)
    twisters = global_seeds._TWISTERS
    assert twisters._python is not None and twisters._numpy is not None
    assert torch is None or twisters.torch[2] != 0  # torch's engine written, no set_state.
    assert isinstance(global_seeds.sample_seeder(), load_cursor().SampleSeeder)
    for seed in (lambda: global_seeds.sample_seeder()(value), lambda: global_seeds.seed_all(value)):
        _cache_normals()
        seed()
        _assert_documented_states(value)


def _cache_normals():
    """Each generator holds a cached normal: random's and numpy's from a draw, torch's double
    one from a draw and its float one through set_state (no public draw leaves it)."""
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    if torch is not None:
        torch.randn((), dtype=torch.float64)
        state = torch.get_rng_state()
        raw = state.numpy()
        raw[-8:-4] = np.frombuffer(np.float32(1.5).tobytes(), np.uint8)
        raw[-4] = 1
        torch.set_rng_state(state)
        assert torch.get_rng_state()[-4] == 1


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2]))
def test_every_vector_width_writes_the_documented_words(value, domain):
    """_cursor_seeds.c's loop for each instruction set this CPU has (portable, AVX2,
    AVX-512) gives conftest's plain-integer words."""
    cursor = load_cursor()
    expected = sample_generator_words(value, (global_seeds.PYTHON_DOMAIN, global_seeds.NUMPY_DOMAIN,
                                              global_seeds.TORCH_DOMAIN)[domain])
    widths = [width for width in (1, 2, 3) if _has_width(cursor, width)]
    assert 1 in widths
    for width in widths:
        assert np.frombuffer(cursor.generator_words(value, domain, width), np.uint32).tolist() == expected, width


def _has_width(cursor, width):
    try:
        cursor.generator_words(0, 0, width)
    except ValueError:
        return False
    return True


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_where_torch_s_engine_is_not_found_its_state_tensor_sets_the_same_states(monkeypatch):
    twisters = global_seeds._MersenneTwisters()
    generator, template, _ = twisters.torch_route()
    twisters.torch = (generator, template, 0)  # As where the engine's layout was not the one checked.
    monkeypatch.setattr(global_seeds, "_TWISTERS", twisters)
    assert global_seeds.sample_seeder() is global_seeds.seed_all
    _cache_normals()
    global_seeds.seed_all(2**64 - 3)
    _assert_documented_states(2**64 - 3)


def test_without_the_native_write_the_public_calls_set_the_same_states(monkeypatch):
    twisters = global_seeds._MersenneTwisters()
    twisters._python = None  # As where the layout was not found.
    monkeypatch.setattr(global_seeds, "_TWISTERS", twisters)
    assert global_seeds.sample_seeder() is global_seeds.seed_all
    random.gauss(0.0, 1.0)
    global_seeds.seed_all(2**63 + 5)
    _assert_documented_states(2**63 + 5)


def test_a_replaced_numpy_bit_generator_is_found_again():
    """np.random.set_bit_generator(MT19937(...)) moves the state the native write must reach."""
    original = np.random.get_bit_generator()
    seeder = global_seeds.sample_seeder()
    np.random.set_bit_generator(np.random.MT19937(3))
    try:
        seeder(77)  # A seeder made before the replacement.
        _assert_documented_states(77)
        global_seeds.sample_seeder()(78)
        _assert_documented_states(78)
    finally:
        np.random.set_bit_generator(original)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_a_seeder_made_before_torch_is_imported_seeds_torch_from_the_next_sample_on(tmp_path):
    """A __getitem__ may import torch halfway through a batch: the batch's seeder, made
    without torch, sees it in sys.modules and seeds all three through seed_all from then on
    (a fresh process: this one has torch already)."""
    script = tmp_path / "late_torch.py"
    script.write_text(
        "import random, sys\n"
        f"sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})\n"
        "from shmloader.fill import global_seeds\n"
        "from conftest import sample_generator_words, seed_sample_generators\n"
        "seeder = global_seeds.sample_seeder()\n"
        "assert 'torch' not in sys.modules\n"
        "seeder(5)\n"
        "assert random.getstate()[1][:624] == tuple(sample_generator_words(5, global_seeds.PYTHON_DOMAIN))\n"
        "import torch\n"
        "seeder(6)\n"
        "state = torch.get_rng_state().clone()\n"
        "seed_sample_generators(6)\n"
        "assert torch.equal(state, torch.get_rng_state()), 'torch was not seeded'\n"
        "print('seeded')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "seeded" in done.stdout, done.stderr

"""shmloader.torch.DataLoader with sampler= and batch_sampler=, against PyTorch's own DataLoader
given the same arguments: every batch equal (types, nesting, values) over two epochs for
DistributedSampler with set_epoch, WeightedRandomSampler and SubsetRandomSampler with a
generator, RandomSampler drawing from torch's global generator, a user Sampler, batch
samplers of varying sizes, drop_last both ways, num_workers 0, 1 and 3; exact resume from a
checkpoint taken mid-epoch under another num_workers (the order kept, or rebuilt from the
generators' states); a sampler whose order cannot be rebuilt named by state_dict(); str
fields come back as default_collate gives them (a list, a tuple inside a tuple)."""

from __future__ import annotations

import copy
import os
import pathlib
import random
import signal
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# The drop-in forks its readers from the trainer unless threads run there; the harness's own
# (pytest-timeout's timer thread, an xdist worker's) are not the script's, so they are left out
# and the timer is a signal: these tests run the path a script takes (the spawn path has tests
# of its own, pinned with multiprocessing_context="spawn").
pytestmark = [pytest.mark.timeout(300, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.data import BatchSampler, Dataset, DistributedSampler, RandomSampler, Sampler  # noqa: E402
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402
from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler  # noqa: E402

import sampling_child  # noqa: E402
from conftest import examples, our_shm_entries, torch_queue_threads_ended, wait_until  # noqa: E402
from shmloader.torch import sampling as torch_sampling  # noqa: E402
from shmloader.torch import DataLoader  # noqa: E402


class Items(Dataset):
    """Dicts of an array, an int, a float and a tuple: each field tells the index apart."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return {"image": np.full((2, 3), index, np.float32), "label": index, "name": f"#{index}" + "é" * (index % 3),
                "pair": (index * 3, np.int16(index), str(index)), "weight": index / 4}


class Noisy(Items):
    """Items with an augmentation drawn from torch's global generator."""

    def __getitem__(self, index: int):
        return {**super().__getitem__(index), "noise": torch.rand(3)}


class EveryOtherFirst(Sampler):
    """A user sampler: the even indices, then the odd ones, reversed on odd epochs."""

    def __init__(self, length: int) -> None:
        self.length, self.epoch = length, 0

    def __iter__(self):
        order = [*range(0, self.length, 2), *range(1, self.length, 2)]
        return iter(order[::-1] if self.epoch % 2 else order)

    def __len__(self) -> int:
        return self.length

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class Buckets(Sampler):
    """A batch sampler of varying sizes: batches of 1, 2, 3, ... indices from a permutation
    drawn from its generator."""

    def __init__(self, length: int, generator) -> None:
        self.length, self.generator = length, generator

    def __iter__(self):
        order = torch.randperm(self.length, generator=self.generator).tolist()
        size = 1
        while order:
            yield order[:size]
            order, size = order[size:], size + 1

    def __len__(self) -> int:
        size, left, count = 1, self.length, 0
        while left > 0:
            left, size, count = left - size, size + 1, count + 1
        return count


class PythonRandom(Sampler):
    """A sampler drawing from a random.Random of its own: its order is no function of torch's
    generators, so a checkpoint cannot rebuild it."""

    def __init__(self, length: int) -> None:
        self.length, self.rng = length, random.Random(7)

    def __iter__(self):
        return iter(self.rng.sample(range(self.length), self.length))

    def __len__(self) -> int:
        return self.length


def assert_same(expected, found, where="batch") -> None:
    """Equal types, nesting, dtypes, shapes and values."""
    assert type(expected) is type(found), (where, type(expected), type(found))
    if isinstance(expected, dict):
        assert list(expected) == list(found), where
        for key in expected:
            assert_same(expected[key], found[key], f"{where}[{key!r}]")
    elif isinstance(expected, str):
        assert expected == found, (where, expected, found)
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(found), where
        for index, (one, other) in enumerate(zip(expected, found)):
            assert_same(one, other, f"{where}[{index}]")
    else:
        assert expected.dtype == found.dtype and expected.shape == found.shape, (where, expected, found)
        assert torch.equal(expected, found), (where, expected, found)


def make_arguments(kind: str, length: int, batch_size: int, drop_last: bool, seed: int, ranks: int) -> dict:
    """The DataLoader arguments of one sampler kind, built afresh (each loader its own objects)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "random":  # No generator: torch's global one decides, as under PyTorch's loader.
        return {"sampler": RandomSampler(range(length)), "batch_size": batch_size, "drop_last": drop_last}
    if kind == "distributed":
        return {"sampler": DistributedSampler(range(length), num_replicas=ranks, rank=seed % ranks, seed=seed,
                                              drop_last=drop_last),
                "batch_size": batch_size, "drop_last": drop_last}
    if kind == "weighted":
        weights = [1 + (index * seed) % 5 for index in range(length)]
        return {"sampler": WeightedRandomSampler(weights, num_samples=length + seed % 7, generator=generator),
                "batch_size": batch_size, "drop_last": drop_last}
    if kind == "subset":
        return {"sampler": SubsetRandomSampler(range(seed % 3, length, 2), generator=generator),
                "batch_size": batch_size, "drop_last": drop_last}
    if kind == "user":
        return {"sampler": EveryOtherFirst(length), "batch_size": batch_size, "drop_last": drop_last}
    if kind == "buckets":
        return {"batch_sampler": Buckets(length, generator)}
    assert kind == "batch_list", kind
    rng = random.Random(seed)
    batches = [[rng.randrange(length) for _ in range(rng.randint(1, batch_size + 2))] for _ in range(5)]
    return {"batch_sampler": batches}


def epochs_of(loader, epochs: int = 2, seed: int = 0) -> list:
    """Each epoch's batches (copies), with set_epoch where the sampler has it."""
    torch.manual_seed(seed)
    found = []
    for epoch in range(epochs):
        for sampler in (loader.sampler, loader.batch_sampler):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        found.append([copy.deepcopy(batch) for batch in loader])
    return found


def compare(kind: str, length: int, batch_size: int, drop_last: bool, seed: int, ranks: int, num_workers: int,
            persistent: bool = False) -> None:
    """The drop-in runs first, and torch's queue threads are waited for after: made while
    they run, the drop-in (here or in the next example) would take its spawn path, tested
    elsewhere, instead of the fork a script's loop takes."""
    dataset = Items(length)
    arguments = make_arguments(kind, length, batch_size, drop_last, seed, ranks)
    reference = TorchDataLoader(dataset, num_workers=num_workers, persistent_workers=persistent, **arguments)
    arguments = make_arguments(kind, length, batch_size, drop_last, seed, ranks)
    with DataLoader(dataset, num_workers=num_workers, persistent_workers=persistent, **arguments) as loader:
        assert len(loader) == len(reference)
        found = epochs_of(loader, seed=seed)
    expected = epochs_of(reference, seed=seed)
    del reference  # Persistent workers end with their loader.
    torch_queue_threads_ended()
    assert [len(epoch) for epoch in found] == [len(epoch) for epoch in expected]
    for epoch, (one, other) in enumerate(zip(expected, found)):
        for step, (batch, ours) in enumerate(zip(one, other)):
            assert_same(batch, ours, f"epoch {epoch} step {step}")


KINDS = ["random", "distributed", "weighted", "subset", "user", "buckets", "batch_list"]


@examples(12)
@given(kind=st.sampled_from(KINDS), length=st.integers(1, 30), batch_size=st.integers(1, 6), drop_last=st.booleans(),
       seed=st.integers(0, 50), ranks=st.integers(1, 3), num_workers=st.sampled_from([0, 1]))
def test_batches_equal_pytorchs_for_the_same_sampler_epoch_by_epoch(kind, length, batch_size, drop_last, seed, ranks,
                                                                     num_workers):
    compare(kind, length, batch_size, drop_last, seed, ranks, num_workers)


@pytest.mark.parametrize("kind, persistent", [("distributed", False), ("buckets", True), ("random", True)])
def test_three_workers_and_persistent_ones_draw_as_pytorchs(kind, persistent):
    compare(kind, 29, 4, False, 3, 2, 3, persistent)


def test_set_epoch_changes_the_order_as_pytorchs_does():
    dataset = Items(20)
    with DataLoader(dataset, batch_size=5, sampler=DistributedSampler(dataset, num_replicas=1, rank=0)) as loader:
        first, second = epochs_of(loader)
        loader.sampler.set_epoch(0)
        again = [copy.deepcopy(batch) for batch in loader]
    assert [batch["label"].tolist() for batch in first] != [batch["label"].tolist() for batch in second]
    for one, other in zip(first, again):
        assert_same(one, other)


def test_a_wider_batch_in_a_later_epoch_grows_the_slot_and_says_so():
    class Growing(Sampler):
        def __init__(self):
            self.epoch = 0

        def __iter__(self):
            self.epoch += 1
            return iter([[0, 1], [2]] if self.epoch == 1 else [[3, 4, 5, 6], [7]])

        def __len__(self):
            return 2

    dataset = Items(9)
    expected = epochs_of(TorchDataLoader(dataset, batch_sampler=Growing()))
    with DataLoader(dataset, batch_sampler=Growing()) as loader:
        first = epochs_of(loader, epochs=1)[0]
        with pytest.warns(UserWarning, match="slot grows"):
            second = [copy.deepcopy(batch) for batch in loader]
    for one, other in zip(expected[0] + expected[1], first + second):
        assert_same(one, other)


@pytest.mark.parametrize("kind, kept, num_workers, resumed_workers", [
    ("distributed", False, 2, 0), ("buckets", True, 0, 2), ("random", False, 0, 1), ("weighted", True, 1, 0),
    ("subset", True, 1, 2)])
def test_a_checkpoint_mid_epoch_resumes_exactly_under_another_num_workers(monkeypatch, kind, kept, num_workers,
                                                                          resumed_workers):
    """Two workers each side are persistent: their epochs' seeds come from the first iter()'s draw."""
    if not kept:
        monkeypatch.setattr(torch_sampling, "SEQUENCE_KEPT_MAX", 0)
    dataset = Noisy(31)

    def loader_of(workers):
        return DataLoader(dataset, num_workers=workers, persistent_workers=bool(num_workers and resumed_workers),
                          **make_arguments(kind, 31, 3, False, 5, 2))

    with loader_of(num_workers) as loader:
        whole = epochs_of(loader, epochs=2, seed=1)
    with loader_of(num_workers) as loader:
        torch.manual_seed(1)
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(0)
        iterator = iter(loader)
        before = [copy.deepcopy(next(iterator)) for _ in range(4)]
        state = copy.deepcopy(loader.state_dict())
    assert ("batches" in state["sampler"]) == kept
    with loader_of(resumed_workers) as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == len(whole[0]) - 4
        rest = [copy.deepcopy(batch) for batch in resumed]
        if hasattr(resumed.sampler, "set_epoch"):
            resumed.sampler.set_epoch(1)
        after = [copy.deepcopy(batch) for batch in resumed]
    for one, other in zip(whole[0] + whole[1], before + rest + after, strict=True):
        assert_same(one, other)


def test_a_trainer_killed_mid_epoch_resumes_exactly_under_another_num_workers(tmp_path):
    """kill -9 of a DistributedSampler run with 2 workers after 4 batches of epoch 1; the last
    checkpoint resumed with no workers gives the uninterrupted run's batches, noise included."""
    with sampling_child.make_loader(1) as loader:
        whole = epochs_of(loader)
    here = pathlib.Path(__file__).resolve().parent
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    child = subprocess.Popen([sys.executable, str(here / "sampling_child.py"), str(tmp_path), "4"], env=environment)
    assert child.wait(timeout=300) == -signal.SIGKILL
    assert wait_until(lambda: not our_shm_entries(child.pid), timeout=60)  # Its readers clean up after it.
    record = torch.load(tmp_path / "last.pt", weights_only=False)
    assert_same(whole[1][3], record["batch"])
    with sampling_child.make_loader(0) as resumed:
        resumed.load_state_dict(record["state"])
        resumed.sampler.set_epoch(1)
        rest = [copy.deepcopy(batch) for batch in resumed]
    for one, other in zip(whole[1][4:], rest, strict=True):
        assert_same(one, other)


def test_a_sampler_whose_order_cannot_be_rebuilt_is_named_by_state_dict(monkeypatch):
    monkeypatch.setattr(torch_sampling, "SEQUENCE_KEPT_MAX", 0)
    with DataLoader(Items(12), batch_size=4, sampler=PythonRandom(12)) as loader:
        next(iter(loader))
        with pytest.raises(ValueError, match="PythonRandom.*is not drawn again"):
            loader.state_dict()
    monkeypatch.undo()
    with DataLoader(Items(12), batch_size=4, sampler=PythonRandom(12)) as loader:
        next(iter(loader))
        assert len(loader.state_dict()["sampler"]["batches"]) == 3  # Small: kept as it is, resumable.


@pytest.mark.parametrize("arguments, message", [
    ({"sampler": [0, 12], "batch_size": 2}, "holds index 12, outside the dataset's 0 .. 11"),
    ({"sampler": [0, -1], "batch_size": 2}, "holds index -1"),
    ({"batch_sampler": [[0], []]}, "empty batch"),
    ({"batch_sampler": [[0, "a"]]}, "expected a list of integer"),
])
def test_a_sampler_giving_what_is_no_batch_of_indices_is_named(arguments, message):
    with DataLoader(Items(12), **arguments) as loader:
        with pytest.raises(ValueError, match=message):
            next(iter(loader))


def test_pytorchs_argument_checks_and_attributes_hold():
    dataset = Items(10)
    with pytest.raises(ValueError, match="mutually exclusive"):
        DataLoader(dataset, batch_size=2, shuffle=True, sampler=range(10))
    with pytest.raises(ValueError, match="mutually exclusive"):
        DataLoader(dataset, batch_size=2, batch_sampler=[[0]])
    sampler = RandomSampler(dataset)
    loader = DataLoader(dataset, batch_size=3, sampler=sampler, drop_last=True, num_workers=2)
    reference = TorchDataLoader(dataset, batch_size=3, sampler=sampler, drop_last=True, num_workers=2)
    with loader:
        assert loader.sampler is sampler and loader.dataset is dataset
        assert isinstance(loader.batch_sampler, BatchSampler) and loader.batch_sampler.sampler is sampler
        for name in ("batch_size", "drop_last", "num_workers", "prefetch_factor", "persistent_workers", "timeout",
                     "generator", "pin_memory"):
            assert getattr(loader, name) == getattr(reference, name), name
        assert len(loader) == len(reference) == 3


class Counted(Items):
    """Items that count their __getitem__ calls (in the trainer: num_workers=0)."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.calls = []

    def __getitem__(self, index: int):
        self.calls.append(index)
        return super().__getitem__(index)


def test_a_narrower_batch_reads_only_its_own_samples():
    dataset = Counted(12)
    batches = [[5, 6, 7, 8], [1], [2, 3]]
    with DataLoader(dataset, batch_sampler=batches) as loader:
        found = [batch["label"].tolist() for batch in loader]
    assert found == batches
    # The probe of dataset[0] for the samples' structure reads a copy, never this object.
    assert sorted(dataset.calls) == sorted(index for batch in batches for index in batch)


# The loader in its own order (no sampler=): PyTorch's attributes, and set_epoch.

def test_the_attributes_a_script_reads_are_pytorchs():
    dataset = Items(10)
    generator = torch.Generator().manual_seed(4)
    arguments = {"batch_size": 3, "shuffle": True, "drop_last": True, "generator": generator, "timeout": 30}
    for workers, persistent in ((0, False), (2, True)):
        reference = TorchDataLoader(dataset, num_workers=workers, persistent_workers=persistent, **arguments)
        with DataLoader(dataset, num_workers=workers, persistent_workers=persistent, in_order=False,
                        **arguments) as loader:
            for name in ("dataset", "batch_size", "drop_last", "num_workers", "prefetch_factor", "persistent_workers",
                         "timeout", "generator", "pin_memory", "collate_fn", "in_order"):
                assert getattr(loader, name) == getattr(reference, name) or name == "in_order", name
            assert loader.in_order is False
            assert len(loader.batch_sampler) == len(loader) == len(reference)
            batches = list(loader.batch_sampler)
            assert list(loader.sampler) == [index for batch in batches for index in batch]
            assert len(loader.sampler) == 9
            assert [batch["label"].tolist() for batch in loader] == batches


def test_set_epoch_on_the_loaders_own_order_makes_the_next_loop_that_epoch():
    dataset = Items(13)
    with DataLoader(dataset, batch_size=4, shuffle=True, seed=3, num_workers=1) as loader:
        epochs = [[batch["label"].tolist() for batch in loader] for _ in range(3)]
    assert epochs[0] != epochs[2]
    with DataLoader(dataset, batch_size=4, shuffle=True, seed=3) as loader:
        loader.sampler.set_epoch(2)
        assert [batch["label"].tolist() for batch in loader] == epochs[2]
        loader.sampler.set_epoch(0)
        assert [batch["label"].tolist() for batch in loader] == epochs[0]
        loader.sampler.set_epoch(0)  # The same epoch again: the same order, as DistributedSampler gives.
        assert [batch["label"].tolist() for batch in loader] == epochs[0]
        assert [batch["label"].tolist() for batch in loader] == epochs[1]  # Without set_epoch: the next one.


class Tokens(Dataset):
    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int):
        return {"ids": np.arange(1 + index % 4, dtype=np.int64), "label": index}


@pytest.mark.parametrize("num_workers", [0, 1])
def test_padded_lengths_are_int64_as_torch_masks_and_counts_take_them(num_workers):
    from shmloader import Ragged

    with DataLoader(Tokens(), batch_size=4, outputs={"ids": Ragged(4)}, num_workers=num_workers) as loader:
        for batch in loader:
            lengths = batch["ids"]["lengths"]
            assert lengths.dtype == torch.int64
            mask = torch.arange(4) < lengths[:, None]
            assert mask.sum(1).tolist() == [1 + label % 4 for label in batch["label"].tolist()]
            assert (lengths - 1).max() == lengths.max() - 1


class Captions(Dataset):
    def __init__(self, long_at: int = -1) -> None:
        self.long_at = long_at

    def __len__(self) -> int:
        return 7

    def __getitem__(self, index: int):
        return {"caption": "x" * (300 if index == self.long_at else index), "label": index}


def test_a_str_longer_than_its_output_holds_grows_it_saying_so_and_a_declared_bound_takes_it():
    from shmloader import Ragged
    from shmloader.plan.collated import CollateGrowthWarning

    with DataLoader(Captions(long_at=5), batch_size=2) as loader:
        with pytest.warns(CollateGrowthWarning, match=r"'caption' needs 300 bytes.*Ragged\(max_bytes\)"):
            captions = [caption for batch in loader for caption in batch["caption"]]
    assert captions == [Captions(long_at=5)[index]["caption"] for index in range(7)]
    with DataLoader(Captions(long_at=5), batch_size=2, outputs={"caption": Ragged(300)}) as loader:
        captions = [caption for batch in loader for caption in batch["caption"]]
    assert captions == [Captions(long_at=5)[index]["caption"] for index in range(7)]


def test_a_dataset_given_by_import_path_keeps_its_loader_across_epochs():
    """Built in each reader from "module:function": planned once, not again at each epoch."""
    sampler = torch.utils.data.SequentialSampler(range(10))
    with DataLoader("dataset_fixtures:make_squares", dataset_args={"length": 10}, batch_size=4,
                    sampler=sampler) as loader:
        first = [batch.tolist() for batch in loader]
        inner = loader._loader
        assert [batch.tolist() for batch in loader] == first and loader._loader is inner
    assert first == [[[0], [1], [4], [9]], [[16], [25], [36], [49]], [[64], [81]]]

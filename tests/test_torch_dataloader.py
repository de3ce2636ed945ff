"""shmloader.torch.DataLoader as a drop-in for torch.utils.data.DataLoader over a map-style
Dataset: batches equal PyTorch's own loader's (types, shapes, nesting) with shuffle=False;
each index once per epoch, per shard and across two; a new order each epoch; exact resume
under another num_workers; a PackedRagged leaf comes as its values and offsets; what it
cannot honour is refused by name."""

from __future__ import annotations

import collections
import collections.abc
import copy
import os
import pathlib
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# The drop-in forks its readers from the trainer unless threads run there; the harness's own
# (pytest-timeout's timer thread, an xdist worker's) are not the script's, so they are left out
# and the timer is a signal: these tests run the path a script takes (the spawn path has tests
# of its own, pinned with multiprocessing_context="spawn").
pytestmark = [pytest.mark.timeout(300, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402
from torch.utils.data import Dataset, IterableDataset  # noqa: E402

import dataset_fixtures as fixtures  # noqa: E402
from conftest import examples, kill_this_process_while_kills_left, wait_until  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from shmloader import PackedRagged, Ragged  # noqa: E402
from shmloader.torch import DataLoader  # noqa: E402


class Samples(Dataset):
    """Dicts with an array, a tuple of Python scalars, a numpy scalar and an augmentation."""

    def __init__(self, length: int = 37) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return {"image": np.full((2, 3), index, np.float32), "pair": (index, index / 2),
                "weight": np.float32(index) * 2, "noise": torch.rand(2)}


def _assert_same_structure(expected, found, where="batch"):
    assert type(expected) is type(found), (where, type(expected), type(found))
    if isinstance(expected, collections.abc.Mapping):
        assert expected.keys() == found.keys(), where
        for key in expected:
            _assert_same_structure(expected[key], found[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(found), where
        for index, (one, other) in enumerate(zip(expected, found)):
            _assert_same_structure(one, other, f"{where}[{index}]")
    else:
        assert expected.dtype == found.dtype and expected.shape == found.shape, (where, expected, found)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_equal_torchs_own_loader_with_shuffle_off(num_workers, drop_last):
    dataset = Samples()
    expected = list(TorchDataLoader(dataset, batch_size=8, shuffle=False, drop_last=drop_last))
    loader = DataLoader(dataset, batch_size=8, shuffle=False, num_workers=num_workers, drop_last=drop_last)
    with loader:
        found = [copy.deepcopy(batch) for batch in loader]
    assert len(found) == len(expected) == len(loader)
    for one, other in zip(expected, found):
        _assert_same_structure(one, other)
        for key in ("image", "weight"):
            assert torch.equal(one[key], other[key]), key
        assert all(torch.equal(a, b) for a, b in zip(one["pair"], other["pair"]))


Point = collections.namedtuple("Point", ["position", "label"])


class Points(Dataset):
    """Namedtuples, one inside a dict: default_collate keeps their class."""

    def __len__(self) -> int:
        return 21

    def __getitem__(self, index: int):
        return {"point": Point(np.full(3, index, np.float32), index % 4), "plain": (index, -index)}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_namedtuples_come_back_as_their_class_as_default_collate_gives_them(num_workers):
    expected = list(TorchDataLoader(Points(), batch_size=4, shuffle=False))
    with DataLoader(Points(), batch_size=4, shuffle=False, num_workers=num_workers) as loader:
        found = [copy.deepcopy(batch) for batch in loader]
    assert len(found) == len(expected)
    for one, other in zip(expected, found):
        _assert_same_structure(one, other)
        assert type(other["point"]) is Point and other["point"]._fields == ("position", "label")
        assert torch.equal(one["point"].position, other["point"].position)
        assert torch.equal(one["point"].label, other["point"].label)


class Encoding(collections.UserDict):
    """What a Hugging Face tokenizer returns (BatchEncoding is a UserDict, no dict)."""


class Tokenized(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int):
        return Encoding({"input_ids": torch.arange(4) + index, "attention_mask": torch.ones(4, dtype=torch.int64),
                         "meta": collections.OrderedDict(index=index)})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mappings_that_are_no_dict_come_back_as_their_class_as_default_collate_gives_them(num_workers):
    """A UserDict sample (a tokenizer's BatchEncoding) was refused as a leaf, and an OrderedDict came back a dict."""
    expected = list(TorchDataLoader(Tokenized(), batch_size=4))
    with DataLoader(Tokenized(), batch_size=4, num_workers=num_workers) as loader:
        found = [copy.deepcopy(batch) for batch in loader]
    assert len(found) == len(expected)
    for one, other in zip(expected, found):
        _assert_same_structure(one, other)
        for key in ("input_ids", "attention_mask"):
            assert torch.equal(one[key], other[key]), key
        assert torch.equal(one["meta"]["index"], other["meta"]["index"])


def _epoch_indices(loader) -> list[int]:
    return [int(value) for batch in loader for value in batch["pair"][0]]


def test_each_epoch_holds_each_index_once_in_a_new_order():
    with DataLoader(Samples(), batch_size=5, shuffle=True, num_workers=1, seed=4) as loader:
        first, second = _epoch_indices(loader), _epoch_indices(loader)
    assert sorted(first) == sorted(second) == list(range(37)) and first != second


@pytest.mark.parametrize("drop_last", [False, True])
class WithPid(Samples):
    def __getitem__(self, index: int):
        return {**super().__getitem__(index), "pid": os.getpid()}


def test_readers_live_across_epochs_and_each_epoch_equals_one_computed_in_the_trainer():
    """The next epoch is the same readers given the new pass through their pipe (they were
    replaced, a second each); epoch by epoch, batches and augmentations equal num_workers=0's.
    The spawn path's (forked readers are forked anew each epoch, as torch's: test_torch_fork.py)."""
    dataset = WithPid(23)
    with DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, seed=6,
                    multiprocessing_context="spawn") as loader, \
            DataLoader(dataset, batch_size=4, shuffle=True, num_workers=0, seed=6) as local:
        pids = []
        for _ in range(3):
            found = [copy.deepcopy(batch) for batch in loader]
            expected = [copy.deepcopy(batch) for batch in local]
            assert len(found) == len(expected) == 6
            for one, other in zip(found, expected):
                assert torch.equal(one["pair"][0], other["pair"][0]) and torch.equal(one["noise"], other["noise"])
            pids.append({int(pid) for batch in found for pid in batch["pid"]})
    readers = set().union(*pids)  # Fresh readers each epoch would be at least one new pid per epoch.
    assert len(readers) <= 2 and os.getpid() not in readers


@pytest.mark.parametrize("drop_last", [False, True])
def test_two_ranks_see_each_index_once_between_them(drop_last):
    rows = []
    for rank in range(2):
        with DataLoader(Samples(), batch_size=4, shuffle=True, num_workers=1, drop_last=drop_last, shard_index=rank,
                        shard_count=2) as loader:
            rows += _epoch_indices(loader)
    assert len(rows) == len(set(rows))
    assert len(rows) == (32 if drop_last else 37)


def test_the_generator_is_the_seed_and_the_environment_gives_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    generator = torch.Generator().manual_seed(1234)
    with DataLoader(Samples(), batch_size=4, shuffle=True, generator=generator) as loader:
        assert (loader.seed, loader.shard_index, loader.shard_count) == (1234, 1, 2)


@pytest.mark.parametrize("launcher", ["lightning", "process group", "no rank"])
def test_ranks_come_from_wherever_the_launcher_gives_them(launcher, monkeypatch):
    """Lightning's own DDP launcher sets WORLD_SIZE, LOCAL_RANK and NODE_RANK, never RANK (and
    gives this loader, no torch DataLoader subclass, no DistributedSampler); a script may have
    only torch.distributed's process group. Each rank reads its shard, the two shards the
    dataset once between them; where no rank is to be had the process reads it all, saying so."""
    import warnings

    for name in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    rows = []
    for rank in range(2):
        if launcher == "lightning":
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            monkeypatch.setenv("NODE_RANK", "0")
        elif launcher == "process group":
            monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
            monkeypatch.setattr(torch.distributed, "get_rank", lambda rank=rank: rank)
            monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            with DataLoader(Samples(), batch_size=4, shuffle=True, seed=3) as loader:
                shard = (loader.shard_index, loader.shard_count)
                rows += _epoch_indices(loader)
        unsharded = [str(warning.message) for warning in said if "reads the whole dataset" in str(warning.message)]
        if launcher == "no rank":
            assert shard == (0, 1) and len(unsharded) == 1 and "WORLD_SIZE=2" in unsharded[0], said
        else:
            assert shard == (rank, 2) and not unsharded, said
    assert sorted(rows) == sorted(list(range(37)) * (2 if launcher == "no rank" else 1))


def test_a_resumed_epoch_equals_the_uninterrupted_one_under_another_num_workers():
    with DataLoader(Samples(), batch_size=4, shuffle=True, num_workers=2, seed=8) as loader:
        _epoch_indices(loader)  # Epoch 0 whole, then epoch 1 interrupted after 3 batches.
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        state = loader.state_dict()
        rest = [(batch["pair"][0].clone(), batch["noise"].clone()) for batch in iterator]
    with DataLoader(Samples(), batch_size=4, shuffle=True, num_workers=0, seed=8) as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == len(rest)
        found = [(batch["pair"][0].clone(), batch["noise"].clone()) for batch in resumed]
        assert len(resumed) == 10  # The next epoch is whole again.
    assert len(found) == len(rest)
    for (indices, noise), (found_indices, found_noise) in zip(rest, found):
        assert torch.equal(indices, found_indices) and torch.equal(noise, found_noise)


def _packed_epoch(batches, dataset) -> list:
    """(labels, values, offsets) of each of `batches`, checked against the samples
    concatenated (the reference)."""
    found = []
    for batch in batches:
        assert set(batch) == {"points", "label"} and set(batch["points"]) == {"values", "offsets"}
        labels, offsets = batch["label"].clone(), batch["points"]["offsets"].clone()
        samples = [torch.from_numpy(dataset[int(label)]["points"]) for label in labels]
        assert offsets.dtype == torch.int64
        assert offsets.tolist() == [0, *np.cumsum([len(sample) for sample in samples]).tolist()]
        values = batch["points"]["values"][:int(offsets[-1])].clone()
        assert torch.equal(values, torch.cat(samples))
        found.append((labels, values, offsets))
    return found


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_packed_leaf_comes_as_values_and_offsets_and_resumes(num_workers):
    dataset = fixtures.Packable(23, (3,), "float32", 6)
    options = {"batch_size": 4, "shuffle": True, "seed": 2, "outputs": {"points": PackedRagged(24)}}
    with DataLoader(dataset, num_workers=num_workers, **options) as loader:
        whole = _packed_epoch(loader, dataset)
        assert sorted(label for labels, _, _ in whole for label in labels.tolist()) == list(range(23))
        iterator = iter(loader)  # Epoch 1, interrupted after 2 batches.
        for _ in range(2):
            next(iterator)
        state = loader.state_dict()
        rest = _packed_epoch(iterator, dataset)
    with DataLoader(dataset, num_workers=2 - num_workers, **options) as resumed:
        resumed.load_state_dict(state)
        found = _packed_epoch(resumed, dataset)
    assert len(found) == len(rest) == 4
    for one, other in zip(rest, found):
        assert all(torch.equal(a, b) for a, b in zip(one, other))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_padded_leaf_comes_as_values_and_lengths(num_workers):
    dataset = fixtures.Packable(19, (2,), "float32", 5)
    with DataLoader(dataset, batch_size=4, shuffle=True, seed=3, num_workers=num_workers,
                    outputs={"points": Ragged(5, pad=-1)}) as loader:
        seen = []
        for batch in loader:
            assert set(batch["points"]) == {"values", "lengths"}
            values, lengths = batch["points"]["values"], batch["points"]["lengths"]
            assert values.shape[1:] == (5, 2)
            for label, row, length in zip(batch["label"].tolist(), values, lengths.tolist()):
                sample = torch.from_numpy(dataset[label]["points"])
                assert length == len(sample) and torch.equal(row[:length], sample)
                assert bool((row[length:] == -1).all())
                seen.append(label)
    assert sorted(seen) == list(range(19))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize("argument, value, message", [
    ("batch_size", None, "batch_size=None"),
])
def test_what_cannot_be_honoured_is_refused_by_name(argument, value, message):
    with pytest.raises(ValueError, match=message):
        DataLoader(Samples(), **{"batch_size": 4, argument: value})


@pytest.mark.parametrize("arguments", [{"num_workers": -1}, {"timeout": -1}, {"prefetch_factor": 2},
                                       {"persistent_workers": True}, {"num_workers": 2, "prefetch_factor": -1}],
                         ids=["negative workers", "negative timeout", "prefetch without workers",
                              "persistent without workers", "negative prefetch"])
@pytest.mark.parametrize("order", [{}, {"sampler": [0, 1]}, {"iterable": True}], ids=["own", "sampler", "iterable"])
def test_worker_settings_torch_refuses_are_refused_in_torchs_words(arguments, order):
    """prefetch_factor= or persistent_workers=True without workers were taken in silence."""
    dataset = Stream() if order.pop("iterable", False) else Samples()
    with pytest.raises(ValueError) as torchs:
        TorchDataLoader(dataset, batch_size=2, **order, **arguments)
    with pytest.raises(ValueError) as ours:
        DataLoader(dataset, batch_size=2, **order, **arguments)
    assert str(ours.value) == str(torchs.value)


def test_an_iterable_dataset_is_iterated_as_torchs_loader_iterates_it():
    """Taken, not refused (tests/test_torch_iterable.py compares it with torch's at length)."""
    with DataLoader(Stream(), batch_size=2) as loader:
        assert [batch.tolist() for batch in loader] == [[0, 1], [2]]


@pytest.mark.parametrize("num_workers, resumed_workers", [(0, 2), (2, 0)])
def test_a_checkpoint_taken_at_an_epochs_end_resumes_with_the_next_epoch(num_workers, resumed_workers):
    """state_dict() after a whole epoch, loaded into a new loader: its next loop is the next
    epoch, as the uninterrupted run's (not an error for the pass that ended, not the
    finished epoch again), and the one after that follows it."""
    with DataLoader(Samples(), batch_size=4, shuffle=True, num_workers=num_workers, seed=3) as loader:
        _epoch_indices(loader)
        state = loader.state_dict()
        expected = [_epoch_indices(loader), _epoch_indices(loader)]
    with DataLoader(Samples(), batch_size=4, shuffle=True, num_workers=resumed_workers, seed=3) as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == 10
        found = [_epoch_indices(resumed), _epoch_indices(resumed)]
        assert resumed.state_dict()["epoch"] == 2
    assert found == expected


class _IndexAndDraw(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        return {"index": index, "draw": float(np.random.random())}


def test_without_a_generator_or_seed_torch_manual_seed_decides_the_order_and_the_samples_seeds():
    """As torch's DataLoader draws its base seed from torch's global generator: runs under
    other torch.manual_seed values shuffle (and augment) otherwise, runs under the same
    one alike (before, every such loader had seed 0)."""
    def epoch(seed: int) -> tuple[list, list]:
        torch.manual_seed(seed)
        loader = DataLoader(_IndexAndDraw(), batch_size=8, shuffle=True)
        try:
            order, drawn = [], []
            for batch in loader:
                order += batch["index"].tolist()
                drawn += batch["draw"].tolist()
            return order, drawn
        finally:
            loader.close()

    first, again, other = epoch(1), epoch(1), epoch(2)
    assert first == again
    assert sorted(first[0]) == sorted(other[0]) == list(range(64))
    assert first[0] != other[0] and not set(first[1]) & set(other[1])


class _Indices(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int):
        return {"index": index, "image": np.full((3,), index, np.float32)}


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loop_variable_kept_from_an_epoch_lets_the_next_one_start_and_keeps_its_values(workers):
    """`for batch in loader` leaves the last batch bound to `batch` when the loop ends; the
    next epoch's loop used to raise 'cannot seek while batch N is held'. An epoch's last
    batch is a copy now, as torch's batches are the caller's: kept, its values stay."""
    loader = DataLoader(_Indices(), batch_size=4, shuffle=True, num_workers=workers, generator=torch.Generator())
    try:
        kept = []
        for _ in range(3):
            for batch in loader:
                image = batch["image"].view(len(batch["image"]), -1)  # PyTorch's MNIST loop keeps a view.
            array = batch["image"].numpy()
            kept.append((batch, image, array, batch["index"].tolist(), batch["image"].clone()))
        assert sorted(i for batch in loader for i in batch["index"].tolist()) == list(range(10))
        for batch, image, array, indices, values in kept:
            assert batch["index"].tolist() == indices and torch.equal(batch["image"], values)
            assert torch.equal(image, values) and np.array_equal(array, values.numpy())
            assert torch.equal(batch["image"][:, 0], batch["index"].float())
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_kept_from_a_loop_left_early_by_break_or_an_error_or_a_peek_keeps_its_values(workers):
    """The next epoch used to raise 'still referenced' where torch's DataLoader goes on. Its
    tensors (and any array made of them) view a slot the next pass needs; the pass gives
    those pages memory of their own, at the same address, instead of moving the tensors."""
    loader = DataLoader(_Indices(), batch_size=4, num_workers=workers)
    try:
        for index, batch in enumerate(loader):
            if index == 0:
                break
        array, tensor = batch["image"].numpy(), batch["image"][1:]
        epoch = sorted(i for one in loader for i in one["index"].tolist())
        assert epoch == list(range(10))
        assert np.array_equal(array[:, 0], np.arange(4)) and torch.equal(tensor[:, 0], torch.arange(1, 4).float())
        assert batch["index"].tolist() == [0, 1, 2, 3]
        peek = next(iter(loader))
        with pytest.raises(ZeroDivisionError):
            for batch in loader:
                if batch["index"][0] == 4:
                    1 / 0  # The training step fails; the loop's variable keeps the batch.
        assert [one["index"].tolist() for one in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert peek["index"].tolist() == [0, 1, 2, 3] and batch["index"].tolist() == [4, 5, 6, 7]
        assert torch.equal(batch["image"][:, 0], batch["index"].float())
    finally:
        loader.close()


class _FailsWhileFlagged(Dataset):
    """Sample 5 raises while its flag file exists (a transient fault: a network read)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int):
        if index == 5 and os.path.exists(self.flag):
            raise OSError(f"sample {index} could not be read")
        return np.full((2,), index, np.int64)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_after_a_getitem_error_starts_afresh_as_torchs_does(tmp_path, workers):
    """torch's DataLoader starts new workers for each epoch; a reader that failed stayed
    failed here, and every later epoch raised the same error."""
    flag = tmp_path / "flag"
    flag.touch()
    with DataLoader(_FailsWhileFlagged(str(flag)), batch_size=3, num_workers=workers) as loader:
        for _ in range(2):  # The fault is still there: each epoch raises it anew.
            seen = []
            with pytest.raises(OSError, match="sample 5 could not be read"):
                for batch in loader:
                    seen.append(batch[:, 0].tolist())
            assert seen == [[0, 1, 2]]
        flag.unlink()
        for _ in range(2):
            assert [batch[:, 0].tolist() for batch in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
        assert loader._loader.stats()["reader_restarts"] == 0


class _Faults(Dataset):
    """While its flag file exists: sample i in `slow` raises after slow[i] seconds (where
    negative: -slow[i] seconds after the flag goes, FLAG.i made when it starts), and
    sample `kill` SIGKILLs its reader as long as the count in `kills` is above zero (one
    less each time); its readers' copy fails to unpickle while `load_flag` exists."""

    def __init__(self, flag: str, slow: dict, kill: int = -1, kills: str = "", load_flag: str = "") -> None:
        self.flag, self.slow, self.kill, self.kills, self.load_flag = flag, slow, kill, kills, load_flag
        self.trainer = os.getpid()

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        if os.getpid() != self.trainer and self.load_flag and os.path.exists(self.load_flag):
            raise OSError("the dataset's resource is not there")

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int):
        if index in self.slow and os.path.exists(self.flag):
            if self.slow[index] < 0:  # Raises -slow[i] seconds after the flag goes (the epoch has ended).
                pathlib.Path(f"{self.flag}.{index}").touch()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and os.path.exists(self.flag):
                    time.sleep(0.01)
            time.sleep(abs(self.slow[index]))
            raise OSError(f"sample {index} could not be read")
        if index == self.kill:
            kill_this_process_while_kills_left(self.kills)
        return np.full((2,), index, np.int64)


def _epoch(loader) -> tuple[list, BaseException | None]:
    seen = []
    try:
        for batch in loader:
            seen.extend(batch[:, 0].tolist())
    except (OSError, RuntimeError) as error:
        return seen, error
    return seen, None


def test_the_next_epoch_does_not_raise_what_the_readers_failed_ahead_in_the_epoch_before(tmp_path):
    """A second reader failing on a later sample of the read-ahead reported it while the
    next epoch took its slots back, which raised it from iter() before any batch."""
    flag = tmp_path / "flag"
    flag.touch()
    with DataLoader(_Faults(str(flag), {10: 0.0, 12: -0.5}), batch_size=2, num_workers=2) as loader:
        seen, error = _epoch(loader)
        assert seen == list(range(10)) and "sample 10" in str(error)
        assert wait_until((tmp_path / "flag.12").exists)  # The other reader is on sample 12, and
        flag.unlink()  # raises it while the next epoch takes the slots back.
        for _ in range(2):
            assert _epoch(loader) == (list(range(20)), None)


def test_an_epoch_whose_readers_fail_to_load_the_dataset_is_followed_by_one_that_runs(tmp_path):
    """With persistent_workers=False each epoch's readers load the dataset anew. One that
    failed there left its slot claimed (the next epoch waited 60 s for it, then raised),
    and its replacement was started with that epoch's copy (every later epoch failed)."""
    load_flag = tmp_path / "load"
    dataset = _Faults(str(tmp_path / "none"), {}, load_flag=str(load_flag))
    with DataLoader(dataset, batch_size=3, num_workers=2, multiprocessing_context="spawn") as loader:  # Unpickled.
        assert _epoch(loader) == (list(range(20)), None)
        load_flag.touch()
        seen, error = _epoch(loader)
        assert seen == [] and "resource is not there" in str(error)
        load_flag.unlink()
        # One epoch after: each starts its readers anew (2 interpreters importing torch), and
        # both faults (a claimed slot, a replacement with the failed copy) fail the first.
        assert _epoch(loader) == (list(range(20)), None)


class _LoadFailsInTurn(Dataset):
    """While the flag exists, the readers' copy fails to load: the first reader at once,
    the others once the flag is gone (the epoch has ended), 0.3 s later."""

    def __init__(self, flag: str) -> None:
        self.flag, self.trainer = flag, os.getpid()

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        if os.getpid() == self.trainer or not os.path.exists(self.flag):
            return
        try:
            os.close(os.open(f"{self.flag}.first", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            deadline = time.monotonic() + 30
            while os.path.exists(self.flag) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            raise OSError("a later reader failed to load the dataset") from None
        raise OSError("the first reader failed to load the dataset")

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        return np.full((2,), index, np.int64)


def test_an_epoch_after_one_whose_readers_failed_to_load_is_not_failed_by_a_slower_one(tmp_path):
    """A reader still loading the failed epoch's dataset when the next began was sent the
    next epoch's filler as a live reader, then reported its own failure there (found by an
    outside review): every reader goes once one has failed."""
    flag = tmp_path / "flag"
    with DataLoader(_LoadFailsInTurn(str(flag)), batch_size=4, num_workers=2,
                    multiprocessing_context="spawn") as loader:  # Its readers unpickle it.
        assert _epoch(loader) == (list(range(8)), None)
        flag.touch()
        seen, error = _epoch(loader)
        # Which reader's failure is reported depends on which the trainer sees first (a
        # loaded 2-core CI host once gave the later one's): what matters is the epochs after.
        assert seen == [] and "reader failed to load the dataset" in str(error), error
        flag.unlink()
        (tmp_path / "flag.first").unlink()
        assert _epoch(loader) == (list(range(8)), None)  # The slower reader's failure would land here.


def test_a_reader_killed_past_its_restart_budget_is_replaced_for_the_next_epoch(tmp_path):
    kills = tmp_path / "kills"
    kills.write_text("4\n")  # One more than max_reader_restarts (3).
    with DataLoader(_Faults(str(tmp_path / "none"), {}, kill=4, kills=str(kills)), batch_size=2,
                    num_workers=1) as loader:
        seen, error = _epoch(loader)
        assert seen == [0, 1, 2, 3] and "SIGKILL" in str(error) and kills.read_text().strip() == "0"
        for _ in range(2):
            assert _epoch(loader) == (list(range(20)), None)


def test_two_iterators_of_one_loader_at_once_raise_instead_of_ending_in_silence():
    loader = DataLoader(_Indices(), batch_size=4)
    try:
        with pytest.raises(RuntimeError, match="ended by a newer iter"):
            list(zip(loader, loader))
        assert sorted(i for batch in loader for i in batch["index"].tolist()) == list(range(10))
    finally:
        loader.close()


@pytest.mark.parametrize("arguments", [{"batch_size": 3}, {"batch_size": 3, "drop_last": True},
                                       {"batch_size": 3, "sampler": [4, 2, 0, 1]}, {"batch_sampler": [[0], [1, 2]]}],
                         ids=["own order", "drop_last", "sampler", "batch_sampler"])
def test_an_iterators_len_is_the_epochs_batches_as_torchs_iterators_is(arguments):
    """`it = iter(loader); for _ in range(len(it))` raised TypeError: the iterator had no len()."""
    expected = iter(TorchDataLoader(_Indices(), **arguments))
    with DataLoader(_Indices(), **arguments) as loader:
        found = iter(loader)
        next(found)
        next(expected)
        assert len(found) == len(expected) == len(loader)


def _dataset_files() -> int:
    """This process's descriptors of the dataset's pickle (its memory files), not of what
    other threads of a test worker open meanwhile."""
    found = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:shmloader-dataset")
        except OSError:
            pass  # Closed meanwhile.
    return found


@pytest.mark.parametrize("persistent", [False, True])
def test_a_dataset_changed_between_epochs_reaches_the_readers_unless_they_persist(persistent):
    """torch's workers (persistent_workers=False, its default) get the dataset anew each
    epoch, so a change made between epochs (a curriculum, set_epoch) is seen; the readers
    kept the copy they were started with. With persistent_workers=True they still do."""
    dataset = fixtures.Scaled()
    loader = DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=persistent,
                        multiprocessing_context="spawn")  # Pickled (forked: test_torch_fork.py).
    try:
        seen, descriptors = [], []
        for epoch in range(4):
            dataset.scale = 10 ** epoch
            seen.append(sorted(value for batch in loader for value in batch["value"].tolist()))
            descriptors.append(_dataset_files())
        assert descriptors == [1, 1, 1, 1], descriptors  # Each epoch's pickle closed once replaced.
    finally:
        loader.close()
    scales = [1, 1, 1, 1] if persistent else [1, 10, 100, 1000]
    assert seen == [[index * scale for index in range(8)] for scale in scales]


class _Typed(Dataset):
    def __init__(self, make) -> None:
        self.make = make

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return {"x": self.make(index)}


def _bfloat16(index: int):
    return torch.full((2,), index + 0.5, dtype=torch.bfloat16)


def _stacked(samples: list) -> dict:
    return {"x": torch.stack([sample["x"] for sample in samples])}


@pytest.mark.parametrize("collate_fn", [None, _stacked], ids=["default_collate", "collate_fn"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_bfloat16_sample_comes_as_torchs_bfloat16_batch(num_workers, collate_fn):
    """A bfloat16 tensor was refused (numpy has no bfloat16): it travels as its bits now."""
    expected = list(TorchDataLoader(_Typed(_bfloat16), batch_size=3, collate_fn=collate_fn))
    with DataLoader(_Typed(_bfloat16), batch_size=3, num_workers=num_workers, collate_fn=collate_fn) as loader:
        found = [copy.deepcopy(batch) for batch in loader]
    assert len(found) == len(expected) == 2
    for one, other in zip(expected, found):
        assert other["x"].dtype == torch.bfloat16 and torch.equal(one["x"], other["x"])


def test_a_conjugate_view_is_taken():
    """A conjugate view (its lazy bit set) failed with a RuntimeError that did not name the sample."""
    loader = DataLoader(_Typed(lambda index: torch.tensor([index + 1j]).conj()), batch_size=2)
    try:
        values = [value for batch in loader for value in batch["x"][:, 0].tolist()]
        assert values == [complex(index, -1) for index in range(4)]
    finally:
        loader.close()


def test_a_lazily_opened_dataset_goes_to_readers_every_epoch(tmp_path):
    """The probe of dataset[0] opened the trainer's own object's file, which the next
    epoch's pickle then carried (persistent_workers=False pickles it again each epoch)."""
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(24)))
    loader = DataLoader(fixtures.OpensLazily(str(path), 24), batch_size=8, num_workers=2)
    try:
        for _ in range(3):
            assert sorted(v for batch in loader for v in batch["byte"][:, 0].tolist()) == list(range(24))
    finally:
        loader.close()


def test_a_checkpoint_of_a_run_without_a_seed_resumes_in_a_new_loader_without_one():
    """The seed drawn from torch's generator differs between processes: the checkpoint's
    is taken where this loader's was drawn, not given, and the rest of the epoch is exact."""
    torch.manual_seed(11)
    first = DataLoader(_Indices(), batch_size=2, shuffle=True)
    try:
        iterator = iter(first)
        next(iterator)
        state = copy.deepcopy(first.state_dict())
        rest = [batch["index"].tolist() for batch in iterator]
    finally:
        first.close()
    torch.manual_seed(12)
    resumed = DataLoader(_Indices(), batch_size=2, shuffle=True)
    try:
        assert resumed.seed != state["seed"]
        resumed.load_state_dict(state)
        assert [batch["index"].tolist() for batch in resumed] == rest
    finally:
        resumed.close()
    given = DataLoader(_Indices(), batch_size=2, shuffle=True, seed=5)
    try:
        with pytest.raises(ValueError, match="made with seed"):
            given.load_state_dict(state)
    finally:
        given.close()


def test_the_drop_in_refuses_a_flag_that_is_not_a_bool():
    with pytest.raises(TypeError, match="drop_last must be True or False"):
        DataLoader(_Indices(), batch_size=4, drop_last="False")


def _indices_and_noise(loader) -> list:
    return [(batch["pair"][0].clone(), batch["noise"].clone()) for batch in loader]


@pytest.mark.parametrize("order", ["shuffle", "sampler"])
def test_num_workers_auto_gives_a_fixed_counts_batches_and_reads_back_the_most_as_an_integer(order, monkeypatch):
    """num_workers="auto" is readers="auto" (readers join and leave; batch k does not depend on
    which fills it): every epoch's batches are those of num_workers=2, and num_workers reads
    back the most readers, an int as PyTorch's, within the node's budget."""
    monkeypatch.setenv("SHMLOADER_CPU_BUDGET", "3")
    dataset = Samples()
    options = {"batch_size": 4, "seed": 8, **({"shuffle": True} if order == "shuffle" else
                                               {"sampler": torch.utils.data.SequentialSampler(dataset)})}
    with DataLoader(dataset, num_workers=2, **options) as fixed:
        expected = [_indices_and_noise(fixed) for _ in range(2)]
    with DataLoader(dataset, num_workers="auto", **options) as auto:
        assert auto.num_workers == 3 and type(auto.num_workers) is int
        found = [_indices_and_noise(auto) for _ in range(2)]  # The second epoch's readers forked anew.
        assert auto._loader.stats()["readers_most"] == 3
    for epoch, (one, other) in enumerate(zip(expected, found)):
        assert len(one) == len(other) == 10, epoch
        for (indices, noise), (found_indices, found_noise) in zip(one, other):
            assert torch.equal(indices, found_indices) and torch.equal(noise, found_noise), epoch


def test_num_workers_auto_is_refused_for_an_iterable_dataset_saying_why_and_what_to_pass_and_a_word_by_name():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    with pytest.raises(ValueError, match=r'num_workers="auto" cannot be honoured for an IterableDataset: batch k '
                                         r"comes from worker k % num_workers.*give num_workers an integer"):
        DataLoader(Stream(), batch_size=2, num_workers="auto")
    with pytest.raises(TypeError, match=r"num_workers must be an integer \(PyTorch's meaning\) or \"auto\", got "
                                        r"'four'"):
        DataLoader(Samples(), batch_size=2, num_workers="four")


class Captions(Dataset):
    """A caption and a label a sample; caption i is `lengths[i]` characters, some of them
    not ASCII (two bytes each in UTF-8)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        text = "".join("é" if (index + position) % 7 == 0 else chr(97 + position % 26)
                       for position in range(self.lengths[index]))
        return {"caption": text, "label": index}


@examples(4)
@given(lengths=st.lists(st.integers(0, 3000), min_size=2, max_size=12), workers=st.sampled_from([0, 2]),
       batch_size=st.integers(1, 4))
def test_strs_longer_than_dataset_0s_grow_their_room_and_come_as_torchs(lengths, workers, batch_size):
    """A str leaf's room comes from dataset[0]'s (plan/dataset_outputs.TEXT_BYTES_DEFAULT): a
    longer one later grows it, as a collate_fn's batch grows its slot, with a warning, and
    two epochs are torch's, each batch's captions and labels."""
    import warnings

    from shmloader.plan.collated import CollateGrowthWarning

    lengths[0] = min(lengths[0], 10)  # dataset[0]'s is short: the room it gives is the default's.
    arguments = {"batch_size": batch_size, "num_workers": workers}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with DataLoader(Captions(lengths), **arguments) as loader:
            found = [[copy.deepcopy(batch) for batch in loader] for _ in range(2)]
    expected = [list(TorchDataLoader(Captions(lengths), **arguments)) for _ in range(2)]
    for epoch, (one, other) in enumerate(zip(expected, found, strict=True)):
        assert len(one) == len(other), epoch
        for batch, got in zip(one, other):
            assert batch["caption"] == got["caption"] and torch.equal(batch["label"], got["label"]), epoch
    longest = max(len(Captions(lengths)[index]["caption"].encode()) for index in range(len(lengths)))
    grew = [str(warning.message) for warning in said if issubclass(warning.category, CollateGrowthWarning)]
    assert bool(grew) == (longest > 256), (longest, grew)
    assert all("str at step" in message and "Ragged(max_bytes)" in message for message in grew), grew


def test_a_declared_str_room_stays_its_maximum():
    """outputs={"caption": Ragged(n)} is the caller's bound: a longer caption raises, naming it."""
    from shmloader.plan.dataset_outputs import TextRoomError

    with DataLoader(Captions([5, 40]), batch_size=1, outputs={"caption": Ragged(16)}) as loader:
        with pytest.raises(TextRoomError, match=r"a str of 45 bytes .* more than the 16 its output 'caption' holds"):
            list(loader)



class QuotedCaptions(Dataset):
    """A str leaf under a key that holds a quote, whose repr is double-quoted: sample 0's
    caption is short, the later ones longer than the room it gives."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        return {"user's caption": "x" * (3 if index == 0 else 400 * index), "label": index}


def test_a_str_leaf_whose_key_holds_a_quote_grows_its_room_as_any_other():
    """text_room_needed read only a single-quoted leaf name from the error, so this one raised
    TextRoomError where a key without a quote grows its room."""
    import warnings

    from shmloader.plan.collated import CollateGrowthWarning

    expected = [batch["user's caption"] for batch in TorchDataLoader(QuotedCaptions(), batch_size=2)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with DataLoader(QuotedCaptions(), batch_size=2) as loader:
            found = [batch["user's caption"] for batch in loader]
    assert found == expected
    assert any(issubclass(warning.category, CollateGrowthWarning) and "user's caption" in str(warning.message)
               for warning in said), said


class Ordered(Dataset):
    """The same samples as a dict or, with `ordered`, as an OrderedDict."""

    def __init__(self, ordered: bool) -> None:
        self.ordered = ordered

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        sample = {"x": torch.tensor([index]), "y": index}
        return collections.OrderedDict(sample) if self.ordered else sample


def test_a_checkpoint_over_dict_samples_resumes_the_same_samples_as_an_ordered_dict():
    """A Mapping's class decides what the trainer rebuilds, not the data a checkpoint names:
    before OrderedDict samples came back as their class they were planned as dicts, so a
    checkpoint taken then (here: over dict samples) must resume them, not be refused as
    "made from other data"."""
    with DataLoader(Ordered(False), batch_size=2) as loader:
        batches = iter(loader)
        next(batches)
        state = loader.state_dict()
    expected = list(TorchDataLoader(Ordered(True), batch_size=2))[1:]
    with DataLoader(Ordered(True), batch_size=2) as resumed:
        resumed.load_state_dict(state)
        found = [copy.deepcopy(batch) for batch in resumed]
    assert len(found) == len(expected)
    for one, other in zip(expected, found):
        _assert_same_structure(one, other)
        assert torch.equal(one["x"], other["x"]) and torch.equal(one["y"], other["y"])


@pytest.mark.parametrize("kind", ["own order", "sampler", "iterable"])
def test_an_iterator_never_asked_for_a_batch_leaves_the_next_iter_its_epoch(kind):
    """iter(loader) then a `for` loop (Lightning's iterable check, then its epoch): the loop
    gets the epoch that iterator would have given, as a loader iterated once gives it, and the
    epoch after moves on; an iterator asked for one batch ends its epoch, as before (where the
    order is the loader's or the sampler's: a persistent worker's copy of an IterableDataset
    may or may not have begun that epoch, as its reader had been asked for a step or not)."""
    from torch.utils.data import RandomSampler

    from test_torch_iterable import Shards, whole

    def made():
        if kind == "sampler":
            sampler = RandomSampler(range(37), generator=torch.Generator().manual_seed(2))
            return DataLoader(Samples(), batch_size=4, sampler=sampler, num_workers=1)
        if kind == "iterable":
            return DataLoader(Shards([3, 5], count_epochs=True), batch_size=2, num_workers=2, persistent_workers=True,
                              collate_fn=whole)
        return DataLoader(Samples(), batch_size=4, shuffle=True, seed=6, num_workers=1)

    def epoch(loader) -> list:
        return [repr(batch["at"] if kind == "iterable" else batch["pair"][0].tolist()) for batch in loader]

    with made() as loader:
        expected = [epoch(loader), epoch(loader)]
    with made() as loader:
        iter(loader)
        assert [epoch(loader), epoch(loader)] == expected
    if kind == "iterable":
        return  # After a peek, whether a persistent reader's copy began its epoch depends on timing.
    with made() as loader:
        next(iter(loader))
        assert epoch(loader) == expected[1]


class Growing(Dataset):
    """A replay buffer: `length` samples now, set between epochs."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if not 0 <= index < self.length:
            raise IndexError(index)
        return {"index": index, "x": torch.full((2,), float(index))}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("start", ["empty", "sampler", "own order", "own order, drop_last"])
def test_a_dataset_read_by_len_at_each_epoch_as_torchs_sampler_reads_it(start, num_workers):
    """Each epoch reads len(dataset) then, as torch's sampler does: one that grew or shrank
    between epochs (a replay buffer) is read whole, len(loader) included (the loader's own
    order is planned again over it, with readers that read it as it is). A dataset empty when
    the loader is made gives epochs of no batch while it is, as torch's loader does (the
    loader's own order is planned from dataset[0]: such a loader draws torch's sampler)."""
    lengths = [0, 5, 0, 3, 8] if start == "empty" else [4, 7, 2, 9, 9]

    def run(loader_class) -> list:
        dataset = Growing(lengths[0])
        arguments = {"sampler": torch.utils.data.SequentialSampler(dataset)} if start == "sampler" else {}
        if start.endswith("drop_last"):
            arguments["drop_last"] = True
        if loader_class is DataLoader:
            arguments["num_workers"] = num_workers
        loader = loader_class(dataset, batch_size=2, **arguments)
        epochs = []
        try:
            for length in lengths:
                dataset.length = length
                epochs.append((len(loader), [batch["index"].tolist() for batch in loader]))
        finally:
            if hasattr(loader, "close"):
                loader.close()
        return epochs

    assert run(DataLoader) == run(TorchDataLoader)


def test_a_grown_dataset_shuffled_holds_each_index_once_an_epoch_and_resumes_exactly():
    """The loader's own shuffled order over a dataset that grows between epochs: each epoch
    every index once, and a checkpoint taken in a grown epoch resumes it with the batches the
    uninterrupted run gave."""
    def epochs(loader, dataset, lengths, stop=None):
        seen = []
        for epoch, length in enumerate(lengths):
            dataset.length = length
            iterator = iter(loader)
            seen.append([batch["index"].tolist() for _, batch in zip(range(stop if epoch == len(lengths) - 1 and stop
                                                                        else 10**6), iterator)])
        return seen

    lengths = [6, 11, 17]
    dataset = Growing(lengths[0])
    with DataLoader(dataset, batch_size=4, shuffle=True, seed=9, num_workers=2) as loader:
        whole = epochs(loader, dataset, lengths)
    assert [sorted(index for batch in epoch for index in batch) for epoch in whole] == \
        [list(range(length)) for length in lengths]
    dataset = Growing(lengths[0])
    with DataLoader(dataset, batch_size=4, shuffle=True, seed=9, num_workers=2) as loader:
        assert epochs(loader, dataset, lengths, stop=2)[-1] == whole[-1][:2]
        state = loader.state_dict()
    with DataLoader(Growing(lengths[-1]), batch_size=4, shuffle=True, seed=9, num_workers=2) as resumed:
        resumed.load_state_dict(state)
        assert [batch["index"].tolist() for batch in resumed] == whole[-1][2:]


def test_a_dataset_given_by_import_path_keeps_its_length_and_its_readers_across_epochs():
    """Built in each reader from "module:function": its length is the one planned (the str is
    no dataset to take len() of), and its readers stay from epoch to epoch."""
    with DataLoader("dataset_fixtures:make_squares", dataset_args={"length": 10}, batch_size=4, num_workers=1,
                    persistent_workers=True) as loader:
        assert len(loader) == 3
        inner = loader._loader
        epochs = [[batch.tolist() for batch in loader] for _ in range(2)]
        assert loader._loader is inner and len(loader) == 3
    assert epochs[0] == epochs[1] == [[[0], [1], [4], [9]], [[16], [25], [36], [49]], [[64], [81]]]

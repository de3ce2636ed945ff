"""A Stateful IterableDataset under shmloader.torch.DataLoader, against an uninterrupted run
and torch's DataLoader where resume or a restart of the readers could drift: a dataset whose
state_dict() exists only once iter() was called, a slot grown in a persistent copy's later
epoch, old checkpoints' two-element reader entries, persistent_workers=False, a break then
a checkpoint in the next epoch, batch_size=None and drop_last, int keys in a state, a
state_dict() that raises, an in-place load, a worker killed and replaced."""

from __future__ import annotations

import gc
import os
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.timeout(120, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

from conftest import (  # noqa: E402
    examples,
    kill_this_process_while_kills_left,
    process_alive,
    torch_queue_threads_ended,
    wait_until,
)
from shmloader.torch import DataLoader  # noqa: E402
from test_torch_iterable import Counting, assert_epochs, assert_resumes_from_every_batch, epochs_of  # noqa: E402


class KillingCounting(Counting):
    """Counting whose worker 1 is SIGKILLed once at its position 3 of its copy's `iteration`th
    iteration (2: a persistent copy's second epoch)."""

    def __init__(self, lengths, kills, iteration=2):
        super().__init__(lengths)
        self.kills, self.iteration = kills, iteration

    def __iter__(self):
        for sample in super().__iter__():
            if sample[0] == 1 and sample[1] == 3 and sample[2] == self.iteration:
                kill_this_process_while_kills_left(self.kills)
            yield sample


@pytest.mark.parametrize("context, iteration", [("fork", 1), ("fork", 2), ("spawn", 2)])
def test_killed_persistent_stateful_worker_goes_on_from_the_states_taken(tmp_path, context, iteration):
    """A worker SIGKILLed mid-epoch is replaced, and its replacement goes on from the state
    the trainer took last of it (the trainer publishes them: IterableDataLoader._publish), also
    in a persistent copy's second epoch, which a fresh copy's replay would not give (before:
    its batches of the first epoch again)."""
    arguments = {"batch_size": 2, "num_workers": 2, "persistent_workers": True, "multiprocessing_context": context}
    with DataLoader(Counting([3, 7]), **arguments) as loader:
        whole_run = epochs_of(loader, 2)
    kills = tmp_path / "kills"
    kills.write_text("1\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with DataLoader(KillingCounting([3, 7], str(kills), iteration), **arguments) as loader:
            found = epochs_of(loader, 2)
    assert kills.read_text().strip() == "0"
    assert_epochs(whole_run, found)



def _resume_memfds() -> int:
    """The trainer's published-resume descriptors (IterableDataLoader._publish) open now."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:shmloader-resume")
        except OSError:  # The listing's own descriptor, closed already.
            pass
    return count


def test_an_unclosed_stateful_loader_with_workers_is_collected():
    """A loader dropped unclosed ends its readers and closes its descriptors once collected,
    as a non-Stateful one does. Before: the pool's before_replace held the loader itself,
    and the session's finalizer (a global registry) holds the pool, so the loader, its
    readers and its memfd lived until the process ended."""
    before = _resume_memfds()
    loader = DataLoader(Counting([3, 4]), batch_size=2, num_workers=2)
    assert len(list(loader)) == 4
    pids = list(loader._loader.diagnostics.reader_pids)
    assert pids and all(process_alive(pid) for pid in pids)
    del loader
    gc.collect()
    assert wait_until(lambda: not any(process_alive(pid) for pid in pids), timeout=10), pids
    assert _resume_memfds() == before


def test_a_checkpoint_at_an_epochs_end_leaves_no_older_states_published(tmp_path):
    """After a replacement published epoch 2's states, loading a checkpoint taken at epoch 1's
    end (readers not kept) publishes nothing: the next epoch's readers start afresh, not from
    states of a run the checkpoint is not (before: the replacement's stayed published, and
    the adapter's resume too)."""
    kills = tmp_path / "kills"
    kills.write_text("1\n")
    arguments = {"batch_size": 2, "num_workers": 2, "persistent_workers": False}
    with DataLoader(Counting([3, 7]), **arguments) as loader:
        list(loader)
        state = loader.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with DataLoader(KillingCounting([3, 7], str(kills), 1), **arguments) as loader:
            list(loader)
            assert kills.read_text().strip() == "0"
            assert os.fstat(loader._published).st_size > 0  # The replacement's states.
            loader.load_state_dict(state)
            assert os.fstat(loader._published).st_size == 0 and loader._adapter.resume is None


class LazyState(IterableDataset):
    """A Stateful dataset whose state exists once iter() was called (its attributes are set there)."""

    def __init__(self, length):
        self.length = length

    def __iter__(self):
        if not getattr(self, "_loaded", False):
            self.position = 0
        self._loaded = False
        while self.position < self.length:
            self.position += 1
            yield self.position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position, self._loaded = state["position"], True


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_only_valid_after_iter(workers):
    with DataLoader(LazyState(5), batch_size=2, num_workers=workers) as loader:
        found = epochs_of(loader, 1)
    expected = epochs_of(TorchDataLoader(LazyState(5), batch_size=2, num_workers=workers), 1)
    torch_queue_threads_ended()
    assert_epochs(expected, found)


@pytest.mark.parametrize("workers", [0, 2])
def test_old_two_element_checkpoint_entries_load(workers):
    arguments = {"batch_size": 2, "num_workers": workers, "persistent_workers": bool(workers)}
    lengths = [3, 4] if workers else [5]
    with DataLoader(Counting(lengths), **arguments) as loader:
        whole_run = epochs_of(loader, 1)
    with DataLoader(Counting(lengths), **arguments) as loader:
        batches = iter(loader)
        next(batches)
        state = loader.state_dict()
    for key in ("reader_states", "next_pass_states"):
        state[key] = {reader: entry[:2] for reader, entry in state[key].items()}
    with DataLoader(Counting(lengths), **arguments) as resumed:
        resumed.load_state_dict(state)
        assert_epochs([whole_run[0][1:]], epochs_of(resumed, 1))


def drawn_stops(data, whole_run: list, epochs=None, most: int = 2) -> list[tuple[int, int]]:
    """Up to `most` checkpoints (epoch, batch index) of `whole_run`'s epochs (or of `epochs`),
    drawn: every stop of every batching is drawn across runs (and the long profile's 20
    examples), at a fraction of the loaders each run."""
    every = [(epoch, stop) for epoch, batches in enumerate(whole_run) for stop in range(len(batches))
             if epochs is None or epoch in epochs]
    return data.draw(st.lists(st.sampled_from(every), min_size=1, max_size=most, unique=True), "checkpoints")


@examples(1)
@given(data=st.data())
@pytest.mark.parametrize("workers", [0, 2])
def test_non_persistent_checkpoint_in_second_epoch(workers, data):
    arguments = {"batch_size": 2, "num_workers": workers, "persistent_workers": False}
    lengths = [2, 3] if workers else [5]
    with DataLoader(Counting(lengths), **arguments) as loader:
        whole_run = epochs_of(loader, 3)
    assert_resumes_from_every_batch(lambda: Counting(lengths), arguments, whole_run,
                                    drawn_stops(data, whole_run, epochs=(1,)))


@examples(1)
@given(data=st.data())
def test_break_then_new_epoch_then_checkpoint(data):
    arguments = {"batch_size": 1, "num_workers": 2, "persistent_workers": True}
    lengths = [3, 3]
    with DataLoader(Counting(lengths), **arguments) as loader:
        for index, _ in enumerate(loader):
            if index == 2:
                break
        whole = epochs_of(loader, 2)
    # A checkpoint in the epoch after the break, once each worker gave a batch.
    for stop in data.draw(st.lists(st.integers(2, len(whole[0]) - 1), min_size=1, max_size=2, unique=True)):
        with DataLoader(Counting(lengths), **arguments) as loader:
            for index, _ in enumerate(loader):
                if index == 2:
                    break
            batches = iter(loader)
            for _ in range(stop):
                next(batches)
            state = loader.state_dict()
        with DataLoader(Counting(lengths), **arguments) as resumed:
            resumed.load_state_dict(state)
            assert_epochs([whole[0][stop:], whole[1]], epochs_of(resumed, 2))


def grows_in_second_iteration(samples):
    """A collate whose batch outgrows the probe's room once a copy is iterated a second time
    (from its first batch there)."""
    return {"data": torch.tensor(samples), "pad": torch.zeros(8 if samples[0][2] >= 2 else 1)}


def grows_late_in_second_iteration(samples):
    """As grows_in_second_iteration, from position 3 on: after batches of that pass were taken."""
    return {"data": torch.tensor(samples), "pad": torch.zeros(8 if samples[0][2] >= 2 and samples[-1][1] >= 3 else 1)}


@pytest.mark.parametrize("collate_fn", [grows_in_second_iteration, grows_late_in_second_iteration])
@pytest.mark.parametrize("workers, persistent", [(0, False), (2, True), (2, False)])
def test_slot_growth_in_a_stateful_second_epoch(workers, persistent, collate_fn):
    arguments = {"batch_size": 2, "num_workers": workers, "persistent_workers": persistent, "collate_fn": collate_fn}
    lengths = [3, 4] if workers else [5]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with DataLoader(Counting(lengths), **arguments) as loader:
            found = epochs_of(loader, 3)
        expected = epochs_of(TorchDataLoader(Counting(lengths), **arguments), 3)
    torch_queue_threads_ended()
    assert_epochs(expected, found)


@examples(1)
@given(data=st.data())
@pytest.mark.parametrize("arguments", [{"batch_size": None}, {"batch_size": 2, "drop_last": True},
                                       {"batch_size": 3, "drop_last": False}])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_under_other_batching(workers, arguments, data):
    arguments = {**arguments, "num_workers": workers, "persistent_workers": bool(workers)}
    lengths = [2, 3] if workers else [4]
    with DataLoader(Counting(lengths), **arguments) as loader:
        whole_run = epochs_of(loader, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_epochs(epochs_of(TorchDataLoader(Counting(lengths), **arguments), 2), whole_run)
    torch_queue_threads_ended()
    assert_resumes_from_every_batch(lambda: Counting(lengths), arguments, whole_run, drawn_stops(data, whole_run, most=3))


class KeyedState(Counting):
    """Counting whose state keys its position by worker id (an int key, as a dict of shards would)."""

    def state_dict(self):
        return {"by_worker": {0: self.position}, "iterations": self.iterations, "active": self.active}

    def load_state_dict(self, state):
        self.position, self.iterations = state["by_worker"][0], state["iterations"]
        self.resuming = self.active = state["active"]


def test_a_state_with_int_keys_resumes():
    arguments = {"batch_size": 2, "num_workers": 0}
    with DataLoader(KeyedState([5]), **arguments) as loader:
        whole_run = epochs_of(loader, 1)
    with DataLoader(KeyedState([5]), **arguments) as loader:
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
    with DataLoader(KeyedState([5]), **arguments) as resumed:
        resumed.load_state_dict(state)
        assert_epochs([whole_run[0][1:]], epochs_of(resumed, 1))


class BrokenState(Counting):
    def state_dict(self):
        raise RuntimeError("state of shard 3 is lost")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_dict_that_raises_is_named_with_its_type_and_the_epoch_runs(workers):
    """torch's loader never calls state_dict(): the epoch runs, and a warning names what it
    raised (test_torch_iterable.py compares such a dataset's batches and resume with torch's)."""
    with pytest.warns(UserWarning, match="raised RuntimeError: state of shard 3 is lost"):
        with DataLoader(BrokenState([3, 4] if workers else [3]), batch_size=2, num_workers=workers) as loader:
            assert len(list(loader)) == (4 if workers else 2)


@pytest.mark.parametrize("workers, stop", [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2)])
def test_in_place_load_after_two_epochs(workers, stop):
    arguments = {"batch_size": 2, "num_workers": workers, "persistent_workers": bool(workers)}
    lengths = [3, 4] if workers else [5]
    with DataLoader(Counting(lengths), **arguments) as loader:
        whole_run = epochs_of(loader, 2)
    with DataLoader(Counting(lengths), **arguments) as loader:
        iterator = iter(loader)
        for _ in range(stop):
            next(iterator)
        state = loader.state_dict()
        del iterator
        epochs_of(loader, 2)
        loader.load_state_dict(state)
        assert_epochs([whole_run[0][stop:], whole_run[1]], epochs_of(loader, 2))

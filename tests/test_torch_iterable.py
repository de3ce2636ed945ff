"""shmloader.torch.DataLoader over an IterableDataset, against PyTorch's own DataLoader given
the same arguments: every batch equal (types, nesting, values, order) over two epochs for a
dataset sharded by get_worker_info() with uneven shards (workers exhaust at different
times), num_workers 0, 1 and 3, drop_last both ways, default_collate and a padding
collate_fn, persistent_workers both ways, batch_size=None, worker_init_fn narrowing each
worker's copy, the spawn path, an epoch without a sample; an unsharded dataset read whole
by every worker (duplicates, as torch's); resume by replay from a checkpoint mid-epoch and
at an epoch's end (a Stateful dataset from each worker's state), an epoch left by break, a
killed worker replaced and replaying, batches kept by the loop; what torch refuses refused
with torch's words."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
# As test_torch_sampling.py: the harness's threads are not the script's (the fork path runs).
pytestmark = [pytest.mark.timeout(300, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402
from torch.utils.data import IterableDataset, get_worker_info  # noqa: E402

from conftest import examples, kill_this_process_while_kills_left, torch_queue_threads_ended, wait_until  # noqa: E402
from shmloader.torch import CollateGrowthWarning, DataLoader  # noqa: E402


class Shards(IterableDataset):
    """Worker w (0 without workers) yields shard w: `lengths[w]` samples, each a dict of a
    sequence whose length varies, its position, a str and a float, telling apart worker and
    position; with `count_epochs`, also how many times this copy was iterated."""

    def __init__(self, lengths: list[int], count_epochs: bool = False) -> None:
        self.lengths, self.epoch, self.count_epochs = list(lengths), 0, count_epochs

    def __iter__(self):
        info = get_worker_info()
        worker = 0 if info is None else info.id
        assert info is None or (info.num_workers == len(self.lengths) and isinstance(info.dataset, Shards)
                                and isinstance(info.seed, int))
        self.epoch += 1
        for position in range(self.lengths[worker]):
            at = (worker, position, self.epoch) if self.count_epochs else (worker, position)
            yield {"tokens": torch.arange(1 + (worker + position) % 4, dtype=torch.int64) + 10 * worker,
                   "at": at, "name": f"w{worker}-{position}", "weight": position / 8}


class Everything(IterableDataset):
    """Ignores get_worker_info(): every worker yields every sample (torch duplicates them)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self):
        return iter(range(self.length))


def pad(samples: list) -> dict:
    """A padding collate: the batch's sequences padded to its longest, their lengths, the names."""
    longest = max(len(sample["tokens"]) for sample in samples)
    tokens = torch.zeros((len(samples), longest), dtype=torch.int64)
    for row, sample in enumerate(samples):
        tokens[row, :len(sample["tokens"])] = sample["tokens"]
    return {"tokens": tokens, "lengths": torch.tensor([len(sample["tokens"]) for sample in samples]),
            "names": [sample["name"] for sample in samples], "rows": len(samples)}


def whole(samples: list) -> dict:
    """default_collate's batch of Shards samples, without the sequences (which it cannot stack)."""
    return torch.utils.data.default_collate([{key: value for key, value in sample.items() if key != "tokens"}
                                             for sample in samples])


def assert_same(expected, found, where="batch") -> None:
    """Equal types, nesting, dtypes, shapes and values."""
    assert type(expected) is type(found), (where, type(expected), type(found))
    if isinstance(expected, dict):
        assert list(expected) == list(found), where
        for key in expected:
            assert_same(expected[key], found[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(found), where
        for index, (one, other) in enumerate(zip(expected, found)):
            assert_same(one, other, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert expected.dtype == found.dtype and expected.shape == found.shape, (where, expected, found)
        assert torch.equal(expected, found), (where, expected, found)
    else:
        assert expected == found, (where, expected, found)


def epochs_of(loader, count: int = 2) -> list[list]:
    """`count` epochs of the loader's batches, each a list (the tensors cloned)."""
    return [[_cloned(batch) for batch in loader] for _ in range(count)]


def _cloned(batch):
    if isinstance(batch, dict):
        return {key: _cloned(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cloned(value) for value in batch)
    return batch.clone() if isinstance(batch, torch.Tensor) else batch


def both(dataset_of, count: int = 2, **arguments) -> tuple[list, list]:
    """(torch's epochs, the drop-in's) for the same arguments, each loader its own dataset.
    The drop-in runs first, and torch's queue threads are waited for after: made while
    they run, the drop-in (here or in a later example) would take its spawn path (tested
    elsewhere)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "more workers than cores" on a small host.
        with DataLoader(dataset_of(), **arguments) as loader:
            found = epochs_of(loader, count)
        expected = epochs_of(TorchDataLoader(dataset_of(), **arguments), count)
    torch_queue_threads_ended()
    return expected, found


def assert_epochs(expected: list, found: list) -> None:
    for epoch, (one, other) in enumerate(zip(expected, found)):
        assert len(one) == len(other), (epoch, len(one), len(other))
        for index, (batch, got) in enumerate(zip(one, other)):
            assert_same(batch, got, f"epoch {epoch} batch {index}")
    assert len(expected) == len(found)


@examples(6)
@given(workers=st.sampled_from([0, 1, 3]), data=st.data(), batch_size=st.integers(1, 3), drop_last=st.booleans(),
       padded=st.booleans(), persistent=st.booleans())
def test_batches_equal_torchs_for_a_sharded_dataset(workers, data, batch_size, drop_last, padded, persistent):
    lengths = data.draw(st.lists(st.integers(0, 7), min_size=max(1, workers), max_size=max(1, workers)), "lengths")
    if sum(lengths) == 0:
        lengths[-1] = 1  # The slot is laid out from a first batch: a dataset with none is its own test.
    arguments = {"batch_size": batch_size, "drop_last": drop_last, "num_workers": workers,
                 "collate_fn": pad if padded else whole}
    if workers:
        arguments["persistent_workers"] = persistent
    assert_epochs(*both(lambda: Shards(lengths), **arguments))


@pytest.mark.parametrize("workers", [1, 3])
def test_workers_that_end_at_once_and_late_are_skipped_in_turn(workers):
    lengths = [0, 9, 2][:workers] if workers == 3 else [5]
    assert_epochs(*both(lambda: Shards(lengths), batch_size=2, num_workers=workers, collate_fn=pad))


@pytest.mark.parametrize("persistent", [False, True])
def test_a_persistent_workers_copy_is_iterated_again_and_a_new_ones_afresh(persistent):
    expected, found = both(lambda: Shards([2, 3], count_epochs=True), count=3, batch_size=2, num_workers=2,
                           collate_fn=whole, persistent_workers=persistent)
    assert_epochs(expected, found)
    assert {int(epoch) for batch in found[2] for epoch in batch["at"][2]} == ({3} if persistent else {1})


def test_outputs_declares_a_leafs_room_by_the_collates_name():
    """The padding collate's leaves are declared by the names it gives them (the slot wraps them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CollateGrowthWarning)
        with DataLoader(Shards([9, 9]), batch_size=2, num_workers=2, collate_fn=pad,
                        outputs={"tokens": (2, 14), "lengths": 2}) as loader:
            found = epochs_of(loader, 1)
    assert_epochs(epochs_of(TorchDataLoader(Shards([9, 9]), batch_size=2, num_workers=2, collate_fn=pad), 1), found)


@pytest.mark.parametrize("persistent", [False, True])
def test_an_epoch_left_by_break_is_followed_by_a_whole_one(persistent):
    def two_epochs(loader) -> list:
        first = []
        for batch in loader:
            first.append(_cloned(batch))
            if len(first) == 2:
                break
        return [first, [_cloned(batch) for batch in loader]]

    arguments = {"batch_size": 2, "num_workers": 2, "collate_fn": pad, "persistent_workers": persistent}
    with DataLoader(Shards([5, 3]), **arguments) as loader:
        found = two_epochs(loader)
    assert_epochs(two_epochs(TorchDataLoader(Shards([5, 3]), **arguments)), found)


def test_an_unsharded_dataset_is_read_whole_by_every_worker():
    expected, found = both(lambda: Everything(5), batch_size=2, num_workers=3)
    assert_epochs(expected, found)
    assert sorted(torch.cat(found[0]).tolist()) == sorted(list(range(5)) * 3)


def test_batch_size_none_gives_each_item_as_its_batch():
    assert_epochs(*both(lambda: Everything(4), batch_size=None, num_workers=2))


def test_the_default_collate_gives_torchs_types():
    class Pairs(IterableDataset):
        def __iter__(self):
            info = get_worker_info()
            start = 0 if info is None else info.id * 100
            return iter([(start + index, f"s{index}", (index / 2, index)) for index in range(5)])

    assert_epochs(*both(Pairs, batch_size=2, num_workers=2, persistent_workers=True))


@pytest.mark.parametrize("workers", [0, 3])
def test_resume_mid_epoch_replays_each_worker_to_the_step(workers):
    lengths = [3, 8, 1] if workers else [7]
    arguments = {"batch_size": 2, "num_workers": workers, "collate_fn": pad}
    with DataLoader(Shards(lengths), **arguments) as loader:
        whole_run = epochs_of(loader, 2)
    stop = 2
    with DataLoader(Shards(lengths), **arguments) as loader:
        batches = iter(loader)
        for _ in range(stop):
            next(batches)
        state = loader.state_dict()
    with DataLoader(Shards(lengths), **arguments) as resumed:
        resumed.load_state_dict(state)
        rest = [[_cloned(batch) for batch in resumed]]
        rest.append([_cloned(batch) for batch in resumed])
    assert_epochs([whole_run[0][stop:], whole_run[1]], rest)


def test_a_checkpoint_at_an_epochs_end_resumes_with_the_next_epoch():
    arguments = {"batch_size": 2, "num_workers": 2, "collate_fn": pad}
    with DataLoader(Shards([3, 1]), **arguments) as loader:
        first = [_cloned(batch) for batch in loader]
        state = loader.state_dict()
    with DataLoader(Shards([3, 1]), **arguments) as resumed:
        resumed.load_state_dict(state)
        assert [batch["names"] for batch in resumed] == [batch["names"] for batch in first]
        assert state["epoch"] == 0 and resumed.state_dict()["epoch"] == 1


def test_resume_under_another_num_workers_is_refused_by_name():
    with DataLoader(Shards([3, 1]), batch_size=2, num_workers=2, collate_fn=whole) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with DataLoader(Shards([3, 1, 2]), batch_size=2, num_workers=3, collate_fn=whole) as other:
        with pytest.raises(ValueError, match="num_workers=2"):
            other.load_state_dict(state)


@pytest.mark.parametrize("argument", [{"shuffle": True}, {"sampler": [0, 1]}, {"batch_sampler": [[0]]}])
def test_what_torch_refuses_is_refused_with_torchs_words(argument):
    with pytest.raises(ValueError) as torchs:
        TorchDataLoader(Everything(3), **argument)
    with pytest.raises(ValueError) as ours:
        DataLoader(Everything(3), **argument)
    assert str(ours.value) == str(torchs.value)


def test_len_is_torchs():
    class Sized(Everything):
        def __len__(self) -> int:
            return self.length

    with DataLoader(Sized(5), batch_size=2) as loader:
        assert len(loader) == len(TorchDataLoader(Sized(5), batch_size=2)) == 3
    with DataLoader(Everything(5), batch_size=2) as loader, pytest.raises(TypeError):
        len(loader)
    # torch's iterator has no len() over an IterableDataset (its sampler is infinite), sized or not.
    with pytest.raises(TypeError):
        len(iter(TorchDataLoader(Sized(5), batch_size=2)))
    with DataLoader(Sized(5), batch_size=2) as loader, pytest.raises(TypeError, match="no len"):
        len(iter(loader))


class Range(IterableDataset):
    """torch's documented pattern: worker_init_fn narrows each worker's copy to its part."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def split_range(worker_id: int) -> None:
    info = get_worker_info()
    dataset = info.dataset
    per_worker = -(-(dataset.end - dataset.start) // info.num_workers)
    dataset.start, dataset.end = dataset.start + worker_id * per_worker, min(dataset.end,
                                                                           dataset.start + (worker_id + 1) * per_worker)


def test_worker_init_fn_shards_each_workers_copy_as_under_torch():
    assert_epochs(*both(lambda: Range(3, 14), batch_size=3, num_workers=3, worker_init_fn=split_range))


def test_an_epoch_without_a_sample_gives_no_batch():
    assert_epochs(*both(lambda: Shards([0, 0]), batch_size=2, num_workers=2, collate_fn=whole))


def test_the_spawn_path_reads_a_pickled_copy_in_torchs_order():
    arguments = {"batch_size": 2, "num_workers": 3, "collate_fn": pad, "persistent_workers": True}
    with DataLoader(Shards([4, 1, 6]), multiprocessing_context="spawn", **arguments) as loader:
        found = epochs_of(loader)
    # torch's batches do not depend on its start method: its forked workers, faster here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "more workers than cores" on a small host.
        expected = epochs_of(TorchDataLoader(Shards([4, 1, 6]), **arguments))
    assert_epochs(expected, found)


def test_batches_the_loop_keeps_do_not_start_a_workers_iterator_again():
    """Kept batches hold their slots, so the ring requests a later step of a worker before
    an earlier one: the worker's iterator still runs once an epoch (its copy counts them)."""
    arguments = {"batch_size": 1, "num_workers": 2, "persistent_workers": True, "collate_fn": whole}
    with DataLoader(Shards([12, 15], count_epochs=True), **arguments) as loader:
        found = [list(loader), list(loader)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchs = TorchDataLoader(Shards([12, 15], count_epochs=True), **arguments)
        expected = [list(torchs), list(torchs)]
    assert_epochs(expected, found)


def test_batches_the_loop_keeps_keep_their_values():
    """list(loader): every batch held at once, more than the ring's slots (kept.py)."""
    with DataLoader(Everything(40), batch_size=2, num_workers=2) as loader:
        found = list(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = list(TorchDataLoader(Everything(40), batch_size=2, num_workers=2))
    assert_epochs([expected], [found])


class Killing(Shards):
    """Shards whose worker 1 is killed (SIGKILL) once, at its sample 3, in the first process
    that reaches it (`kills` holds how many kills are left)."""

    def __init__(self, lengths: list[int], kills: str) -> None:
        super().__init__(lengths)
        self.kills = kills

    def __iter__(self):
        for sample in super().__iter__():
            if sample["at"] == (1, 3):
                kill_this_process_while_kills_left(self.kills)
            yield sample


def test_a_killed_worker_is_replaced_and_replays_its_iterator(tmp_path):
    kills = tmp_path / "kills"
    kills.write_text("1\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The restart's warning.
        with DataLoader(Killing([3, 7], str(kills)), batch_size=2, num_workers=2, collate_fn=pad) as loader:
            found = [_cloned(batch) for batch in loader]
    assert kills.read_text().strip() == "0"
    expected = list(TorchDataLoader(Shards([3, 7]), batch_size=2, num_workers=2, collate_fn=pad))
    assert_epochs([expected], [found])


class Failing(IterableDataset):
    def __iter__(self):
        yield 1
        raise KeyError("shard 7 is missing")


@pytest.mark.parametrize("workers", [0, 2])
def test_the_datasets_exception_reaches_the_loop_with_its_type(workers):
    with DataLoader(Failing(), batch_size=1, num_workers=workers) as loader:
        batches = iter(loader)
        assert next(batches).tolist() == [1]
        with pytest.raises(KeyError, match="shard 7 is missing"):
            list(batches)


def test_an_error_at_a_later_step_waits_while_the_awaited_step_is_ready():
    """Reader 0 fills step 0, then fails at its next step (2), between next()'s look at step
    0's slot (not ready yet) and its check of the readers: the check lets next() take step 0,
    and the error comes at step 2, as torch's (before: raised for step 0, under load, about
    one run in a few hundred of test_the_datasets_exception_reaches_the_loop_with_its_type)."""
    with DataLoader(Failing(), batch_size=1, num_workers=2) as loader:
        session = loader._loader._session
        assert wait_until(lambda: session.pool.ring.records.error(0) and session.pool.processes[0].poll() is not None,
                          timeout=30)
        session.pool.check(session.cursor.request, awaited=0)  # Step 0 is ready: no error yet.
        with pytest.raises(Exception, match="shard 7 is missing"):
            session.pool.check(session.cursor.request, awaited=2)
        batches = iter(loader)
        assert next(batches).tolist() == [1]
        with pytest.raises(KeyError, match="shard 7 is missing"):
            list(batches)


class Counting(IterableDataset):
    """A Stateful dataset (torchdata's protocol) that a replay cannot rebuild: each iter()
    counts the iter() calls of this copy, so iterating a new copy again gives other samples
    from the second epoch on; its state_dict() rebuilds the count and the position, mid-
    iteration (iter() then continues it) or between two (iter() starts the next)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.position, self.iterations, self.active, self.resuming = lengths, 0, 0, False, False

    def __iter__(self):
        info = get_worker_info()
        worker = 0 if info is None else info.id
        if not self.resuming:
            self.iterations, self.position = self.iterations + 1, 0
        self.resuming, self.active = False, True
        while self.position < self.lengths[worker]:
            self.position += 1
            yield (worker, self.position, self.iterations)
        self.active = False

    def state_dict(self) -> dict:
        # A tensor leaf too: a state's arrays cross in the slot, which is filled again after.
        return {"position": torch.tensor([self.position]), "iterations": self.iterations, "active": self.active}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.iterations = int(state["position"][0]), state["iterations"]
        self.resuming = self.active = state["active"]


@pytest.mark.parametrize("workers", [0, 3])
def test_a_stateful_dataset_resumes_from_each_workers_state(workers):
    lengths = [5, 9, 1] if workers else [7]
    arguments = {"batch_size": 2, "num_workers": workers, "persistent_workers": bool(workers)}
    with DataLoader(Counting(lengths), **arguments) as loader:
        whole_run = epochs_of(loader, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_epochs(epochs_of(TorchDataLoader(Counting(lengths), **arguments), 2), whole_run)
    torch_queue_threads_ended()  # Or the next loaders would take the spawn path.
    stop = 2
    # In the second epoch: a persistent worker's copy (the trainer's, without workers)
    # was iterated once before, which iterating a new copy again would not give.
    with DataLoader(Counting(lengths), **arguments) as loader:
        list(loader)
        batches = iter(loader)
        for _ in range(stop):
            next(batches)
        state = loader.state_dict()
    assert set(state["reader_states"]) <= {str(reader) for reader in range(max(1, workers))}
    with DataLoader(Counting(lengths), **arguments) as resumed:
        resumed.load_state_dict(state)
        assert_epochs([whole_run[1][stop:]], epochs_of(resumed, 1))
        again = resumed.state_dict()
    assert again["ended"] and again["epoch"] == 1


def _plain(made):
    """A reader's made step ({"batch"| "end", "state"}) as plain values, to compare."""
    if isinstance(made, dict):
        return {key: _plain(value) for key, value in made.items()}
    if isinstance(made, (list, tuple)):
        return [_plain(value) for value in made]
    return made.tolist() if isinstance(made, torch.Tensor) else made


@examples(10)
@given(data=st.data(), length=st.integers(1, 9), batch_size=st.integers(1, 3), readers=st.integers(1, 3),
       kept=st.booleans())
def test_a_resumed_readers_steps_do_not_depend_on_the_order_it_is_asked_for_them(data, length, batch_size, readers,
                                                                                 kept):
    """A resumed reader may be asked for its steps before the checkpoint's, and fill them,
    before the ring's cursor moves to the checkpoint's step (its readers start at step 0 of
    the pass: session.new_pass, then seek), and for a step again after a seek back: each
    step it delivers from the checkpoint's on is still that of the state saved, or of the
    copy's state when the pass started where none was saved, not of the iter() calls those
    requests made. The dataset's next iter() gives other samples (Counting), which only its
    state rebuilds. `kept`: a persistent worker's copy, iterated for a pass before."""
    from torch.utils.data import default_collate

    from shmloader.torch.iterable import IterableBatches, checkpoint_entry

    def view():
        return IterableBatches(Counting([length]), default_collate, batch_size, False, readers)

    reader = data.draw(st.integers(0, readers - 1), "reader")
    ends = -(-length // batch_size) + 1  # This reader's batches and its end mark in a pass.
    steps = [reader + readers * index for index in range(ends + 2)]  # End marks after its end too.
    whole = view()
    if kept:  # The first pass: the persistent copy's iter() count moves on.
        before = [whole.batch_of(step, pass_seed=1) for step in steps]
    reference = {step: _plain(whole.batch_of(step, pass_seed=2)) for step in steps}
    taken = data.draw(st.integers(0, ends - 1), "batches taken before the checkpoint")
    resumed = view()
    resumed.resume = {"pass_seed": 2, "readers": {}}
    if taken:  # What the trainer keeps of the last batch taken.
        resumed.resume["readers"][reader] = checkpoint_entry(reference[steps[taken - 1]], steps[taken - 1], readers)
    elif kept:  # None taken in this pass: the end mark of the pass before gave the state it starts from.
        resumed.resume["readers"][reader] = [reader, _plain(before[-1]["state"])]
        if data.draw(st.booleans(), "the copy iterated a pass before too"):
            for step in steps:
                resumed.batch_of(step, pass_seed=1)
    saved_step = steps[taken]
    early = data.draw(st.lists(st.sampled_from(steps[:taken]), max_size=4), "asked before the cursor moved") \
        if taken else []
    after = steps[taken:]
    ahead = data.draw(st.lists(st.sampled_from(after), max_size=3, unique=True), "filled before the seek")
    asked = early + sorted(ahead) + [step for step in after for _ in range(data.draw(st.integers(1, 2)))]
    back = data.draw(st.sampled_from(after), "a seek back to")
    asked += [step for step in after if step >= back]
    for step in asked:
        made = _plain(resumed.batch_of(step, pass_seed=2))
        if step >= saved_step:
            assert made == reference[step], (step, asked)


class UnwrittenState(Shards):
    """Shards with the Stateful protocol's methods, not written yet: torch's DataLoader never
    calls them."""

    def state_dict(self):
        raise NotImplementedError("state_dict is not written yet")

    def load_state_dict(self, state):
        raise NotImplementedError("load_state_dict is not written yet")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_whose_state_dict_raises_runs_as_torchs_and_resumes_by_replay(workers):
    """Its batches are torch's, a warning says once that checkpoints keep no state of it (it
    was refused when the loader was made), and a checkpoint mid-epoch resumes by replay with
    the batches the uninterrupted run gave."""
    arguments = {"batch_size": 2, "num_workers": workers, "collate_fn": pad}
    lengths = [5, 3] if workers else [7]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with DataLoader(UnwrittenState(lengths), **arguments) as loader:
            found = epochs_of(loader, 2)
    assert_epochs(epochs_of(TorchDataLoader(UnwrittenState(lengths), **arguments), 2), found)
    torch_queue_threads_ended()
    stateless = [str(warning.message) for warning in said if "checkpoints keep no state" in str(warning.message)]
    assert len(stateless) == 1 and "raised NotImplementedError: state_dict is not written yet" in stateless[0], said
    stop = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with DataLoader(UnwrittenState(lengths), **arguments) as loader:
            batches = iter(loader)
            for _ in range(stop):
                next(batches)
            state = loader.state_dict()
        assert "reader_states" not in state
        with DataLoader(UnwrittenState(lengths), **arguments) as resumed:
            resumed.load_state_dict(state)
            assert_epochs([found[0][stop:]], epochs_of(resumed, 1))


@examples(10)
@given(data=st.data(), readers=st.integers(1, 3), slots=st.integers(1, 8), length=st.integers(1, 60))
def test_a_reader_keeps_batches_made_ahead_only_while_the_ring_may_still_ask_them(data, readers, slots, length):
    """A reader asked for a step past its next makes the batches between; it keeps one only
    while the ring may still ask for its step (within the ring's slots of the step asked:
    batch_of's window), so a seek forward (a resume deep into a pass) leaves nothing behind,
    and every step it delivers is the dataset's, whatever order a ring of `slots` slots asks
    for them in, seeks forward and back included. The reference: the same view asked for
    every step in order."""
    from torch.utils.data import default_collate

    from shmloader.torch.iterable import IterableBatches

    def view():
        return IterableBatches(Everything(length), default_collate, 1, False, readers)

    reader = data.draw(st.integers(0, readers - 1), "reader")
    last = (length + 4) * readers  # Past the end mark, a few more end marks.
    whole = view()
    reference = {step: _plain(whole.batch_of(step, pass_seed=1)) for step in range(reader, last, readers)}
    asked_view, position, delivered = view(), 0, set()
    for _ in range(data.draw(st.integers(1, 40), "moves")):
        window = [step for step in range(position, min(position + slots, last)) if step % readers == reader]
        waiting = [step for step in window if step not in delivered]
        move = data.draw(st.sampled_from(["ask", "ask", "take", "seek"]), "move")
        if move == "ask" and waiting:  # Any requested step: a kept batch may hold a lower one's slot.
            step = data.draw(st.sampled_from(waiting), "asked")
            assert _plain(asked_view.batch_of(step, pass_seed=1, window=slots)) == reference[step], step
            assert all(step - slots < kept for kept in asked_view._ahead), (step, slots, asked_view._ahead)
            delivered.add(step)
        elif move == "take":  # The trainer takes what was delivered, up to the first own step not.
            while position < last and (position % readers != reader or position in delivered):
                position += 1
        elif move == "seek":
            position, delivered = data.draw(st.integers(0, last - 1), "seek to"), set()
        assert len(asked_view._ahead) < slots


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataset_resumes_exactly_from_every_batch_of_two_epochs(workers):
    """Every checkpoint of two epochs, the next epoch included: among them one taken after
    a worker's last batch (which ended its iterator) and before its end mark, whose state
    the next epoch starts from (torch's persistent worker iterates its copy again)."""
    arguments = {"batch_size": 2, "num_workers": workers, "persistent_workers": bool(workers)}
    lengths = [1, 2] if workers else [3]  # Worker 0's (or the only) iterator ends making its last batch.
    with DataLoader(Counting(lengths), **arguments) as loader:
        whole_run = epochs_of(loader, 2)
    assert_resumes_from_every_batch(lambda: Counting(lengths), arguments, whole_run)


def assert_resumes_from_every_batch(make, arguments: dict, whole_run: list, stops=None) -> None:
    """A checkpoint after each batch of `whole_run` (the epochs of a loader over make() with
    `arguments`), or after those of `stops` ((epoch, batch index) pairs), each loaded into a
    new loader: the rest of the run, exactly."""
    every = [(epoch, stop) for epoch, batches in enumerate(whole_run) for stop in range(len(batches))]
    for epoch, stop in every if stops is None else stops:
        with DataLoader(make(), **arguments) as loader:
            for _ in range(epoch):
                list(loader)
            iterator = iter(loader)
            for _ in range(stop + 1):
                next(iterator)
            state = loader.state_dict()
        with DataLoader(make(), **arguments) as resumed:
            resumed.load_state_dict(state)
            rest = [whole_run[epoch][stop + 1:]] + whole_run[epoch + 1:]
            assert_epochs(rest, epochs_of(resumed, len(rest)))


def test_a_stateful_datasets_checkpoint_at_an_epochs_end_starts_the_next_from_where_each_worker_ended():
    arguments = {"batch_size": 2, "num_workers": 2, "persistent_workers": True}
    with DataLoader(Counting([3, 4]), **arguments) as loader:
        whole_run = epochs_of(loader, 2)
    with DataLoader(Counting([3, 4]), **arguments) as loader:
        list(loader)
        state = loader.state_dict()
    with DataLoader(Counting([3, 4]), **arguments) as resumed:
        resumed.load_state_dict(state)
        assert_epochs([whole_run[1]], epochs_of(resumed, 1))

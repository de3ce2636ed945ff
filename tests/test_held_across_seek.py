"""A batch still held when the loader seeks, resumes or starts a new pass keeps its values,
and the loader goes on (kept.KeptBatches.detach, Ring.detach_slot): its slot's pages become memory of
its own at the same address, and the slot is mapped anew for the readers. Before, seek raised
'cannot seek while batch N is held', and shmloader.torch.DataLoader's next epoch raised after
a loop left by `break` or by an exception, where torch's DataLoader goes on."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from conftest import examples, our_shm_entries, wait_until  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from shmloader import ShmDataLoader  # noqa: E402

ROWS = 300


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    directory = tmp_path_factory.mktemp("held")
    data = np.random.default_rng(11).integers(0, 1 << 40, size=(ROWS, 5), dtype=np.int64)
    np.save(directory / "rows.npy", data)
    return str(directory / "rows.npy"), data


@pytest.fixture(scope="module")
def order(rows):
    """Each step's row indices, from a loader that never seeks (the order to check against)."""
    with ShmDataLoader({"x": rows[0]}, readers=0, batch_size=7, seed=5, warn_layout=False) as loader:
        return [batch.indices.copy() for _, batch in zip(range(40 + 24 + 12), loader)]


def _kept(batch) -> dict:
    """What a batch held: its step, its indices and rows as they were when it came."""
    return {"batch": batch, "step": batch.step, "indices": batch.indices.copy(), "x": np.array(batch["x"]),
            "view": batch["x"][1:3]}


def _assert_kept(kept: dict, data: np.ndarray) -> None:
    batch = kept["batch"]
    assert batch.step == kept["step"]
    np.testing.assert_array_equal(batch.indices, kept["indices"])
    np.testing.assert_array_equal(batch["x"], data[kept["indices"]])  # An independent read of the rows.
    np.testing.assert_array_equal(kept["view"], kept["x"][1:3])


@pytest.mark.parametrize("readers", [0, 2])
@examples(6)
@given(choices=st.data())
def test_batches_held_across_seeks_keep_their_rows_and_the_loader_goes_on(rows, order, readers, choices):
    path, data = rows
    slots = choices.draw(st.integers(2, 5), label="slots")
    operations = choices.draw(st.lists(st.sampled_from(["next", "hold", "seek", "drop", "resume"]), min_size=4,
                                       max_size=24), label="operations")
    with ShmDataLoader({"x": path}, readers=readers, batch_size=7, seed=5, slots=slots, warn_layout=False) as loader:
        held, blocking, next_step, state = [], [], 0, None  # blocking: steps held since the last seek.

        def take():
            nonlocal next_step
            batch = next(loader)
            assert batch.step == next_step
            np.testing.assert_array_equal(batch.indices, order[batch.step])
            np.testing.assert_array_equal(batch["x"], data[batch.indices])
            next_step += 1
            return batch

        for operation in operations:
            # A batch held since the last seek keeps the slot of its step + slots: a seek first.
            if operation in ("next", "hold") and (not blocking or next_step < min(blocking) + slots):
                batch = take()
                if operation == "hold":
                    if state is None:
                        state = (loader.state_dict(), next_step)
                    held.append(_kept(batch))
                    blocking.append(batch.step)
                del batch
            elif operation == "drop" and held:
                held.pop(choices.draw(st.integers(0, len(held) - 1), label="dropped"))
            elif operation == "resume" and state is not None:
                loader.load_state_dict(state[0])
                next_step, blocking = state[1], []
            else:
                step = choices.draw(st.integers(0, 40), label="seek to")
                loader.seek(step)
                next_step, blocking = step, []
            for kept in held:
                _assert_kept(kept, data)
        for kept in held:
            _assert_kept(kept, data)
        loader.seek(next_step)  # Where it is: the slots still held are given up, and
        for _ in range(2 * slots):  # go on being filled, and right.
            take()
        for kept in held:
            _assert_kept(kept, data)
    for kept in held:  # Past the loader's close too.
        _assert_kept(kept, data)


def test_a_batch_held_across_seeks_is_the_same_step_read_again(rows):
    """The slot given up is filled with the same rows when its step comes again, while the
    batch that held it keeps them in memory of its own."""
    path, _ = rows
    with ShmDataLoader({"x": path}, readers=2, batch_size=7, seed=5, slots=3, warn_layout=False) as loader:
        first = next(loader)
        kept = np.array(first["x"])
        for _ in range(3):
            loader.seek(0)
            again = next(loader)
            assert again.step == first.step == 0
            np.testing.assert_array_equal(again["x"], kept)
            assert again["x"].__array_interface__["data"][0] != first["x"].__array_interface__["data"][0]
            del again
        np.testing.assert_array_equal(first["x"], kept)


class _Backend:
    """A device backend that records what is pinned (shmloader.device's protocol)."""

    def __init__(self):
        self.registered = []

    def register(self, address, size):
        self.registered.append((address, size))

    def unregister(self, address):
        pass

    def copy(self, *arguments, **options):
        raise AssertionError("not asked for in this test")

    def done(self, *arguments):
        return True

    def synchronize(self, *arguments):
        pass


def test_under_pin_memory_a_held_batch_still_stops_a_seek_naming_its_step(rows):
    """The device has the ring's pages registered: a copy made elsewhere would not be."""
    path, data = rows
    with ShmDataLoader({"x": path}, readers=0, batch_size=7, seed=5, slots=3, pin_memory=_Backend(),
                       warn_layout=False) as loader:
        batch = next(loader)
        with pytest.raises(RuntimeError, match="batch 0 is held under pin_memory"):
            loader.seek(2)
        np.testing.assert_array_equal(batch["x"], data[batch.indices])
        del batch
        loader.seek(2)
        assert next(loader).step == 2


def test_detached_slots_leave_nothing_behind(rows):
    path, _ = rows
    with ShmDataLoader({"x": path}, readers=2, batch_size=7, seed=5, slots=3, warn_layout=False) as loader:
        kept = [next(loader)]
        for step in range(4):
            loader.seek(step)
            kept.append(next(loader))
        assert our_shm_entries(os.getpid())
    assert not our_shm_entries(os.getpid())  # Unlinked at close; the kept batches' memory goes with them.
    for batch in kept:
        assert len(batch["x"]) == 7
    del kept
    gc.collect()


def test_a_batch_held_when_the_process_forked_still_stops_a_seek(rows):
    """The child maps the batch's pages too, shared: had the seek given them to the readers,
    the child would read their new rows (found by an outside review)."""
    path, data = rows
    with ShmDataLoader({"x": path}, readers=2, batch_size=7, seed=5, slots=3, warn_layout=False) as loader:
        forked = next(loader)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        later = next(loader)  # Taken after the fork: the child cannot know it.
        with pytest.raises(RuntimeError, match="batch 0 is held: this process forked while it was held"):
            loader.seek(5)
        np.testing.assert_array_equal(forked["x"], data[forked.indices])
        del forked
        loader.seek(5)  # `later` is detached.
        assert next(loader).step == 5
        np.testing.assert_array_equal(later["x"], data[later.indices])


class _Stalls:
    """Sample 28 (step 4 of batches of 7) waits while its flag file exists (30 s at most)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __len__(self) -> int:
        return 300

    def __getitem__(self, index: int):
        deadline = time.monotonic() + 30
        while index == 28 and os.path.exists(self.flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"x": np.full(3, index, dtype=np.int64)}


def test_a_seek_that_times_out_changes_nothing_with_a_batch_held(tmp_path, monkeypatch):
    """The held slot was detached before the readers were waited for: a seek that then
    timed out left it IDLE, and the next step of that slot raised (found by an outside review).
    A reader past the take-back's bound is replaced; here its replacement cannot start."""
    from shmloader.readers import pool as pool_module

    flag = tmp_path / "slow"
    flag.touch()
    # The take-back's bound short; step_timeout long enough for a restarted reader's start.
    monkeypatch.setattr(pool_module.ReaderPool, "take_back_seconds", 1.0)
    with ShmDataLoader.from_dataset(_Stalls(str(flag)), batch_size=7, mode="sequential", readers=1, slots=3,
                                    step_timeout=30.0, warn_layout=False) as loader:
        kept = [next(loader) for _ in range(3)][2]  # Step 2 (slot 2) held.
        next(loader)  # Step 3; the reader is on step 4 (stalled) now.
        assert wait_until(lambda: ("FILLING", 4) in loader.diagnostics.slot_states())
        states = loader.diagnostics.slot_states()
        with monkeypatch.context() as refusing:
            refusing.setattr(pool_module, "spawn_reader", lambda: (_ for _ in ()).throw(OSError("fork refused")))
            with pytest.raises(OSError, match="fork refused"):
                loader.seek(0)
        assert ("HELD", 2) in loader.diagnostics.slot_states() and states[2] == ("HELD", 2)
        assert kept["x"][:, 0].tolist() == list(range(14, 21))
        del kept
        flag.unlink()
        assert [next(loader).step for _ in range(4)] == [4, 5, 6, 7]

"""trainer_fills=True (readers/local.py, HelpingIterator): while next()'s step is not ready,
the trainer claims the lowest requested step under a reader record of its own, fills and
publishes it, and looks again. Batches stay exact and in order whoever filled them; the
trainer's own failure hands its step back to the readers, which report it at its step;
records it skips are counted; its global generators are left as they were."""

from __future__ import annotations

import os
import random
import signal
import threading

import numpy as np
import pytest
from conftest import examples, wait_until
from hypothesis import given
from hypothesis import strategies as st

from shmloader import ReaderError, Sampler, ShmDataLoader

GATED = "transform_fixtures:gated"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("trainer_fills") / "data.npy"
    data = np.random.default_rng(5).random((300, 4)).astype(np.float32)
    np.save(path, data)
    return str(path), data


def gated(tmp_path, **arguments):
    gate = tmp_path / "gate"
    return gate, dict(transform=GATED, transform_args={"trainer_pid": os.getpid(), "gate": str(gate), **arguments})


def reader_blocks_in_step_0(loader, gate) -> None:
    """Waits for the reader to claim step 0 (where the gate holds it), then opens the gate
    in 0.5 s: the trainer meanwhile fills the other steps."""
    assert wait_until(lambda: loader.diagnostics.slot_states()[0] == ("FILLING", 0), timeout=30)
    threading.Timer(0.5, gate.touch).start()


@examples(12)
@given(readers=st.integers(1, 2), batch_size=st.integers(1, 40), seed=st.integers(0, 2**16),
       mode=st.sampled_from(["shuffle", "sequential"]), epochs=st.sampled_from([None, 1, 2]),
       slots=st.sampled_from([None, 3, 5]), stop_reader=st.booleans())
def test_batches_equal_numpy_whoever_fills_them(rows, readers, batch_size, seed, mode, epochs, slots, stop_reader):
    """Each batch's indices are the sampler's and its rows numpy's, in step order, while the
    trainer fills part of the steps; with one reader stopped (SIGSTOP) for a while, the
    trainer fills the steps it can."""
    path, data = rows
    options = dict(batch_size=batch_size, seed=seed, mode=mode, readers=readers, slots=slots, epochs=epochs,
                   trainer_fills=True, warn_layout=False)
    with ShmDataLoader({"x": path}, **options) as loader:
        sampler = loader.sampler
        steps = len(loader) if epochs else 40
        stopped = loader.diagnostics.reader_pids[0] if stop_reader else None
        if stopped:
            os.kill(stopped, signal.SIGSTOP)
            threading.Timer(0.2, os.kill, (stopped, signal.SIGCONT)).start()
        got = 0
        for step, batch in zip(range(steps), loader):
            assert batch.step == step
            indices = np.empty(batch_size, np.uint64)
            sampler.fill(step, indices)
            rows_in_batch = len(batch["x"])  # A finite pass's last step may be cut.
            np.testing.assert_array_equal(batch.indices[:rows_in_batch], indices[:rows_in_batch])
            np.testing.assert_array_equal(batch["x"], data[indices[:rows_in_batch].astype(np.int64)])
            got += 1
        assert got == steps
        stats = loader.stats()["trainer_fills"]
        assert stats["stopped"] is None and stats["steps"] >= 0


def test_the_trainer_fills_the_steps_a_blocked_reader_cannot(rows, tmp_path):
    """The only reader blocks in its first step; the trainer fills every other requested
    step meanwhile, then waits for that one, and delivers all in order."""
    path, data = rows
    gate, transform = gated(tmp_path)
    with ShmDataLoader({"data": path}, batch_size=8, readers=1, slots=6, mode="sequential", trainer_fills=True,
                       **transform) as loader:
        reader_blocks_in_step_0(loader, gate)
        got = [batch["x"].copy() for _, batch in zip(range(30), loader)]
        filled = loader.stats()["trainer_fills"]["steps"]
    np.testing.assert_array_equal(np.concatenate(got), data[:240])
    assert filled >= 5, filled  # Steps 1-5 at least: the ring's other slots while the reader held step 0.


def test_an_interrupt_during_the_trainers_fill_loses_no_step(rows, tmp_path):
    """SIGINT while the trainer fills a step (its transform sleeps): next() raises
    KeyboardInterrupt, the step goes back to the readers, and the loop goes on exactly."""
    path, data = rows
    gate, transform = gated(tmp_path, trainer_sleep=0.4)
    with ShmDataLoader({"data": path}, batch_size=8, readers=1, slots=6, mode="sequential", trainer_fills=True,
                       **transform) as loader:
        reader_blocks_in_step_0(loader, gate)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            next(loader)
        states = loader.diagnostics.slot_states()  # Only the reader's step 0 is being filled.
        assert all(state != "FILLING" or step == 0 for state, step in states), states
        got = [batch["x"].copy() for _, batch in zip(range(30), loader)]
    np.testing.assert_array_equal(np.concatenate(got), data[:240])


def test_the_trainers_own_failure_hands_its_step_to_the_readers(rows, tmp_path):
    """A fill that raises in the trainer alone stops its fills; the readers fill that step
    and every later one, and nothing is raised."""
    path, data = rows
    gate, transform = gated(tmp_path, cursed_row=20, cursed_in_trainer=True)
    with ShmDataLoader({"data": path}, batch_size=8, readers=1, slots=6, mode="sequential", trainer_fills=True,
                       **transform) as loader:
        reader_blocks_in_step_0(loader, gate)
        got = [batch["x"].copy() for _, batch in zip(range(30), loader)]
        stats = loader.stats()["trainer_fills"]
    np.testing.assert_array_equal(np.concatenate(got), data[:240])
    assert "row 20 is cursed" in stats["stopped"] and stats["stopped"].startswith("TransformError"), stats


def test_a_step_that_fails_everywhere_raises_at_its_step_not_before(rows, tmp_path):
    """The trainer fills step 2 (rows 16-23) ahead of step 0 and fails; the error reaches
    the caller at step 2, from the reader that then fills it, after steps 0 and 1."""
    path, data = rows
    gate, transform = gated(tmp_path, cursed_row=20)
    with ShmDataLoader({"data": path}, batch_size=8, readers=1, slots=6, mode="sequential", trainer_fills=True,
                       **transform) as loader:
        reader_blocks_in_step_0(loader, gate)
        first = [next(loader)["x"].copy() for _ in range(2)]
        with pytest.raises(ReaderError, match="row 20 is cursed") as caught:
            next(loader)
        assert "at step 2" in str(caught.value) or caught.value.step == 2
        assert loader.stats()["trainer_fills"]["stopped"] is not None
    np.testing.assert_array_equal(np.concatenate(first), data[:16])


def test_records_the_trainer_skips_are_counted(rows, tmp_path):
    """on_error="skip": the bad row in a step the trainer filled is replaced as a reader
    would replace it (the same batches as readers=0) and counted in stats()."""
    path, _ = rows
    gate, transform = gated(tmp_path, cursed_row=20)
    options = dict(batch_size=8, slots=6, mode="sequential", on_error="skip", **transform)
    with pytest.warns(Warning, match="replaced 1 record"):
        with ShmDataLoader({"data": path}, readers=1, trainer_fills=True, **options) as loader:
            reader_blocks_in_step_0(loader, gate)
            got = [(batch.indices.copy(), batch["x"].copy()) for _, batch in zip(range(5), loader)]
            skipped = loader.stats()["skipped"]
            by_trainer = loader._session.local.skipped()
    gate.touch()
    with pytest.warns(Warning, match="replaced 1 record"):
        with ShmDataLoader({"data": path}, readers=0, **options) as loader:
            expected = [(batch.indices.copy(), batch["x"].copy()) for _, batch in zip(range(5), loader)]
    for (indices, x), (expected_indices, expected_x) in zip(got, expected):
        np.testing.assert_array_equal(indices, expected_indices)
        np.testing.assert_array_equal(x, expected_x)
    assert skipped["count"] == 1 and skipped["records"][0]["step"] == 2 and skipped["records"][0]["row"] == 20
    assert by_trainer[0] == 1  # The trainer filled step 2 while the reader held step 0.


@pytest.mark.parametrize("readers, trainer_fills", [(0, False), (1, True)])
def test_a_dataset_filled_in_the_trainer_leaves_its_global_generators_as_they_were(readers, trainer_fills):
    """Augmented draws from Python's and numpy's global generators, which a fill seeds per
    sample: the trainer's own draws after next() must not depend on which process filled."""
    from dataset_fixtures import Augmented

    random.seed(11)
    np.random.seed(12)
    states = random.getstate(), np.random.get_state()
    with ShmDataLoader.from_dataset(Augmented(40), batch_size=4, readers=readers, trainer_fills=trainer_fills,
                                    seed=3) as loader:
        drawn = [batch["drawn"].copy() for _, batch in zip(range(20), loader)]
        assert random.getstate() == states[0]
        after = np.random.get_state()
        assert after[0] == states[1][0] and np.array_equal(after[1], states[1][1]) and after[2:] == states[1][2:]
    with ShmDataLoader.from_dataset(Augmented(40), batch_size=4, readers=2, seed=3) as loader:
        expected = [batch["drawn"].copy() for _, batch in zip(range(20), loader)]
    np.testing.assert_array_equal(np.stack(drawn), np.stack(expected))


def test_trainer_fills_needs_a_reader(rows):
    with pytest.raises(ValueError, match="trainer_fills=True needs readers >= 1"):
        ShmDataLoader({"x": rows[0]}, readers=0, trainer_fills=True)
    with pytest.raises(TypeError, match="trainer_fills must be True or False"):
        ShmDataLoader({"x": rows[0]}, readers=1, trainer_fills="yes")

"""A reader that does not hand its slot back when the trainer takes the slots back (a new
epoch, a seek, the next iter() after a step timed out) is killed and replaced within the
bound (ReaderPool.take_back_seconds, or step_timeout where shorter), with a warning naming
it, its pid, the step and what it was doing; the new position delivers every row once.
Before: the take-back waited 60 s (step_timeout where given) and raised
SlotsExhaustedError "... during seek", and the loader stayed broken until a reader
finished on its own."""

from __future__ import annotations

import os
import signal
import time
import warnings

import numpy as np
import pytest

from conftest import process_alive, wait_until
from shmloader import ReaderStallWarning, ShmDataLoader, StepTimeoutError
from shmloader.readers.pool import ReaderPool

BOUND_SECONDS = 1.0


class Blocks:
    """Rows of their index; row `row` blocks while `flag` exists (at most 60 s), or, with
    `once`, the first call for it sleeps `sleep_s` (the marker file `once` made exclusively)."""

    def __init__(self, length: int, row: int, flag: str | None = None, once: str | None = None,
                 sleep_s: float = 60.0) -> None:
        self.length, self.row, self.flag, self.once, self.sleep_s = length, row, flag, once, sleep_s

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if index == self.row:
            if self.flag is not None:
                deadline = time.monotonic() + 60
                while os.path.exists(self.flag) and time.monotonic() < deadline:
                    time.sleep(0.01)
            if self.once is not None:
                try:
                    os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    time.sleep(self.sleep_s)
                except FileExistsError:
                    pass
        return {"x": np.full(2, index, dtype=np.int64)}


def _filling_reader(session, step: int):
    """(reader index, pid) of the reader filling `step`, once one is."""
    slot = step % session.slots
    assert wait_until(lambda: session.slot_states()[slot] == ("FILLING", step), 60), session.slot_states()
    owner = session.ring.state(slot)[1]
    return owner, session.pool.pids[owner]


@pytest.fixture
def short_bound(monkeypatch):
    monkeypatch.setattr(ReaderPool, "take_back_seconds", BOUND_SECONDS)


def _torch_dataloader():
    """The drop-in. Its tests run as a script's loop does, the readers forked from the
    trainer (timeout method "signal" and harness_threads_not_counted): pytest-timeout's
    timer thread would send them to the spawn path, each reader a fresh interpreter
    importing torch. A fork server's readers are taken back in the from_dataset tests."""
    pytest.importorskip("torch")
    from shmloader.torch import DataLoader

    return DataLoader


@pytest.mark.parametrize("stall", ["sigstop", "sleeping_getitem"])
@pytest.mark.timeout(120, method="signal")
@pytest.mark.usefixtures("harness_threads_not_counted")
def test_the_next_epoch_replaces_a_reader_stuck_in_the_one_left(tmp_path, short_bound, stall):
    DataLoader = _torch_dataloader()
    flag = tmp_path / "stall"
    flag.touch()
    dataset = Blocks(60, row=22, flag=str(flag)) if stall == "sigstop" else \
        Blocks(60, row=22, once=str(tmp_path / "slept"), sleep_s=60)
    with DataLoader(dataset, batch_size=4, num_workers=3, prefetch_factor=2) as loader:
        session = loader._loader._session
        epoch = iter(loader)
        first = [int(value) for value in next(epoch)["x"][:, 0]]
        owner, pid = _filling_reader(session, 5)  # Rows 20-23: the reader is in row 22.
        if stall == "sigstop":
            os.kill(pid, signal.SIGSTOP)
            flag.unlink()
        del epoch  # The epoch is left while the reader holds step 5.
        began = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = [int(value) for batch in loader for value in batch["x"][:, 0]]
        took = time.monotonic() - began
        stalls = [str(warning.message) for warning in caught if issubclass(warning.category, ReaderStallWarning)]
        assert sorted(rows) == list(range(60)), rows
        assert first == [0, 1, 2, 3]
        assert len(stalls) == 1, stalls
        doing = "stopped" if stall == "sigstop" else "asleep"
        assert f"reader {owner} (pid {pid})" in stalls[0] and "filling step 5, rows [20, 21, 22, 23]" in stalls[0]
        assert doing in stalls[0] and "the start of the next epoch" in stalls[0], stalls[0]
        assert not process_alive(pid) and pid not in session.pool.pids
        assert took < 45, took  # The bound and a reader's start, on a loaded machine; before: 60 s, then an error.
        # And the epoch after is whole too, with the replaced reader.
        assert sorted(int(value) for batch in loader for value in batch["x"][:, 0]) == list(range(60))


def test_a_seek_replaces_a_stopped_reader(tmp_path, short_bound):
    flag = tmp_path / "stall"
    flag.touch()
    with ShmDataLoader.from_dataset(Blocks(60, row=22, flag=str(flag)), batch_size=4, mode="sequential", readers=3,
                                    slots=6, warn_layout=False) as loader:
        session = loader._session
        assert next(loader).step == 0
        owner, pid = _filling_reader(session, 5)
        os.kill(pid, signal.SIGSTOP)
        flag.unlink()
        with pytest.warns(ReaderStallWarning, match=rf"reader {owner} \(pid {pid}\).*at a seek: it was stopped"):
            loader.seek(3)
        got = [batch["x"][:, 0].tolist() for batch in (next(loader) for _ in range(12))]
    assert got == [list(range(4 * step, 4 * step + 4)) for step in range(3, 15)]


@pytest.mark.parametrize("readers", [1, 3])
def test_after_a_step_timeout_the_next_iteration_runs_with_a_healthy_reader(tmp_path, short_bound, readers):
    """A row whose first read sleeps (60 s) under step_timeout=3: the step times out
    (right); the next `for` loop goes on from that step with a new reader, every row once."""
    dataset = Blocks(48, row=13, once=str(tmp_path / "slept"), sleep_s=60)
    with ShmDataLoader.from_dataset(dataset, batch_size=4, mode="sequential", readers=readers, slots=4,
                                    step_timeout=3, epochs=1, warn_layout=False) as loader:
        # The readers' start is not what is timed here (a loaded machine's may pass 3 s).
        assert wait_until(lambda: loader.diagnostics.slot_states()[2] == ("READY", 2), 60)
        rows = []
        with pytest.raises(StepTimeoutError, match="step 3 ") as timed_out:
            for batch in loader:
                rows += batch["x"][:, 0].tolist()
        assert rows == list(range(12))
        with pytest.warns(ReaderStallWarning, match="the next iteration after a failed step"):
            iter(loader)
        stuck = timed_out.value.pid
        assert stuck not in loader.diagnostics.reader_pids and not process_alive(stuck)
        # The new reader's start is not what is timed either.
        assert wait_until(lambda: loader.diagnostics.slot_states()[3 % 4] == ("READY", 3), 60)
        for batch in loader:
            rows += batch["x"][:, 0].tolist()
    assert rows == list(range(48))


@pytest.mark.parametrize("num_workers", [1, 3])
@pytest.mark.timeout(120, method="signal")
@pytest.mark.usefixtures("harness_threads_not_counted")
def test_the_drop_in_recovers_from_a_timeout_at_the_next_epoch(tmp_path, short_bound, num_workers):
    """torch's DataLoader starts new workers each epoch; before, epochs 1 and 2 after the
    time-out delivered no batch (SlotsExhaustedError ... during seek)."""
    DataLoader = _torch_dataloader()
    dataset = Blocks(48, row=13, once=str(tmp_path / "slept"), sleep_s=60)
    with DataLoader(dataset, batch_size=4, num_workers=num_workers, timeout=3) as loader:
        states = loader._loader.diagnostics.slot_states  # The readers' start is not what is timed here.
        assert wait_until(lambda: states()[2] == ("READY", 2), 60)
        with pytest.raises(StepTimeoutError, match="step 3 "):
            for _ in loader:
                pass
        with pytest.warns(ReaderStallWarning, match="the start of the next epoch"):
            epoch = iter(loader)
        # The new reader's start is not what is timed either.
        assert wait_until(lambda: states()[0] == ("READY", 0), 60)
        first = [int(value) for batch in epoch for value in batch["x"][:, 0]]
        second = [int(value) for batch in loader for value in batch["x"][:, 0]]
    assert first == second == list(range(48))


class FailsOnce(Blocks):
    """Row `row` raises the first time it is read (a transient error: a flaky mount)."""

    def __getitem__(self, index: int):
        if index == self.row:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                raise OSError(f"row {index}: a transient read error")
            except FileExistsError:
                pass
        return {"x": np.full(2, index, dtype=np.int64)}


@pytest.mark.parametrize("readers", [1, 3])
def test_after_a_reader_failed_the_next_iteration_runs_with_healthy_readers(tmp_path, readers):
    """Before: the next `for` loop raised the same reader's error again (its slot stayed
    FAILED, its process gone)."""
    from shmloader import ReaderError

    dataset = FailsOnce(48, row=13, once=str(tmp_path / "failed"))
    with ShmDataLoader.from_dataset(dataset, batch_size=4, mode="sequential", readers=readers, slots=4, epochs=1,
                                    warn_layout=False) as loader:
        rows = []
        with pytest.raises(ReaderError, match="a transient read error"):
            for batch in loader:
                rows += batch["x"][:, 0].tolist()
        assert rows == list(range(12))
        for batch in loader:
            rows += batch["x"][:, 0].tolist()
    assert rows == list(range(48))


def test_a_resume_replaces_a_stopped_reader_and_continues_exactly(tmp_path, short_bound):
    flag = tmp_path / "stall"
    flag.touch()
    with ShmDataLoader.from_dataset(Blocks(60, row=22, flag=str(flag)), batch_size=4, mode="sequential", readers=2,
                                    slots=6, warn_layout=False) as loader:
        assert [next(loader).step for _ in range(2)] == [0, 1]
        state = loader.state_dict()
        owner, pid = _filling_reader(loader._session, 5)
        os.kill(pid, signal.SIGSTOP)
        flag.unlink()
        with pytest.warns(ReaderStallWarning, match=rf"reader {owner} \(pid {pid}\).*at a resume \(load_state_dict\)"):
            loader.load_state_dict(state)
        got = [batch["x"][:, 0].tolist() for batch in (next(loader) for _ in range(8))]
    assert got == [list(range(4 * step, 4 * step + 4)) for step in range(2, 10)]

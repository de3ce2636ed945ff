"""readers=0's local reader (shmloader/readers/local.py) is a reader: it fills each step before
the native next() looks, so next() finds every step READY and never asks supervision to fill;
it keeps reader record 0 as a reader process does, fills only the steps next() asks for,
gives a held slot's batch memory of its own (or, after a fork, waits for it) as next() would, counts its fills as the trainer's wait, and leaves a
child forked inside a fill an error instead of a second publisher."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import our_shm_entries

from shmloader import ShmDataLoader
from shmloader.errors import SlotsExhaustedError
from shmloader.readers.local import LocalIterator
from shmloader.readers.supervision import Supervisor
from shmloader.ring.step_codes import StepActions, StepCode

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(400, dtype=np.int64))
    return str(path)


def test_next_finds_every_step_ready_and_supervision_never_fills(rows, monkeypatch):
    codes = []

    def recording(self, cursor, state, owner, step):
        codes.append(StepCode(state))
        return StepActions.supervise(self, cursor, state, owner, step)

    monkeypatch.setattr(Supervisor, "supervise", recording)
    with ShmDataLoader({"x": rows}, batch_size=8, readers=0, slots=3, mode="sequential") as loader:
        got = [next(loader)["x"].tolist() for _ in range(200)]
        pid, busy_ns, batches = loader._session.ring.records.stats(0)
    assert got == [list(range(8 * step % 400, 8 * step % 400 + 8)) for step in range(200)]
    assert set(codes) == {StepCode.READY}, codes  # Only the periodic reader check: nothing in flight, ever.
    # Reader record 0 is the local reader's, kept as a reader process keeps its own; it filled
    # the 200 steps next() asked for and none ahead of them.
    assert (pid, batches) == (os.getpid(), 200) and busy_ns > 0


def test_the_iterator_of_a_temporary_readers_0_loader_keeps_its_ring_until_the_loop_ends(rows):
    was = gc.isenabled()
    gc.disable()  # Teardown by reference counts alone: no cycle through the iterator.
    try:
        loader = ShmDataLoader({"x": rows}, batch_size=8, readers=0, slots=3, mode="sequential")
        iterator = iter(loader)
        assert type(iterator) is LocalIterator and loader._cursor is iterator and iter(iterator) is iterator
        assert next(iterator).step == 0 and next(loader).step == 1  # One stream, whichever is called.
        del loader
        assert our_shm_entries(os.getpid())
        steps = []
        for _, batch in zip(range(3), iterator):
            steps.append(batch.step)
        assert steps == [2, 3, 4]
        del batch, iterator
        assert not our_shm_entries(os.getpid())
    finally:
        if was:
            gc.enable()


def test_a_held_slot_gets_memory_of_its_own_and_the_local_reader_fills_it_anew(rows):
    """Before: next() waited hold_timeout for the batch from a ring ago, then raised
    SlotsExhaustedError. Now that batch keeps its rows in memory of its own (kept.py)."""
    reference = np.load(rows)
    with ShmDataLoader({"x": rows}, batch_size=8, readers=0, slots=3, mode="sequential", hold_timeout=0.2) as loader:
        kept = [next(loader) for _ in range(12)]  # Steps 3 on need slots that kept batches hold.
        assert [batch.step for batch in kept] == list(range(12))
        for batch in kept:
            assert batch["x"].tolist() == reference[8 * batch.step:8 * batch.step + 8].tolist()
        assert loader._session.kept.count == 9  # readers=0: only the batch next() needs, each time.
        del kept, batch
    assert not our_shm_entries(os.getpid())


def test_a_batch_held_when_the_process_forked_is_waited_for_and_refused_past_hold_timeout(rows):
    """A child shares the batch's pages: they cannot become the batch's own, so next() waits
    for the batch to go, as before, and names why past hold_timeout."""
    with ShmDataLoader({"x": rows}, batch_size=8, readers=0, slots=3, mode="sequential", hold_timeout=1.0) as loader:
        kept = [next(loader) for _ in range(3)]  # Step 3 needs slot 0, which step 0 holds.
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        dropper = threading.Timer(0.1, kept.pop, (0,))  # Let go of step 0 while next() waits for it.
        dropper.start()
        batch = next(loader)
        dropper.join()
        assert batch.step == 3 and batch["x"].tolist() == list(range(24, 32))
        kept.append(batch)
        del batch
        with pytest.raises(SlotsExhaustedError, match=r"step 4 needs slot 1, which still holds step 1.*forked while"):
            next(loader)
        assert [batch["x"].tolist() for batch in kept] == [list(range(8 * step, 8 * step + 8)) for step in (1, 2, 3)]
        del kept
    assert not our_shm_entries(os.getpid())


class SlowSamples:
    """A dataset whose every sample takes SAMPLE_SECONDS."""

    SAMPLE_SECONDS = 0.002

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        time.sleep(self.SAMPLE_SECONDS)
        return np.full(2, index, dtype=np.int32)


def test_the_local_fills_are_the_trainers_wait(rows):
    with ShmDataLoader.from_dataset(SlowSamples(), batch_size=4, readers=0, mode="sequential") as loader:
        for _ in range(10):
            next(loader)
        stats = loader.stats()
    filled_s = 10 * 4 * SlowSamples.SAMPLE_SECONDS  # At least: each sample sleeps that long.
    assert stats["wait_s"] >= filled_s, stats
    assert stats["elapsed_s"] >= stats["wait_s"] and 0 < stats["wait_fraction"] <= 1, stats


def test_the_bare_cursor_of_a_readers_0_loader_raises_instead_of_waiting_for_nobody(rows):
    with ShmDataLoader({"x": rows}, batch_size=8, readers=0, slots=3, mode="sequential") as loader:
        with pytest.raises(RuntimeError, match="step 0 is requested and no reader fills it"):
            next(loader._session.cursor)
        assert next(loader)["x"].tolist() == list(range(8))  # The loader's own iterator fills it.


def test_a_fill_said_to_begin_in_the_future_is_an_assertion_of_the_cursor(rows):
    """waiting_since_ns (the local reader's fill start, which next() counts as its wait) is a
    time that has come: from a later one, the unsigned wait would wrap to centuries."""
    with ShmDataLoader({"x": rows}, batch_size=8, readers=0, slots=3, mode="sequential") as loader:
        cursor = loader._session.cursor
        cursor.waiting_since_ns = cursor.now_ns() + 10**12
        with pytest.raises(AssertionError, match=r"started_ns == 0 \|\| started_ns <= monotonic_ns\(\) \(an invariant"):
            next(cursor)
        assert next(loader).step == 0 and loader.stats()["wait_s"] < 100


_FORK_IN_FILL = '''
import os, sys
import numpy as np
from shmloader import ShmDataLoader
parent = os.getpid()
loader = ShmDataLoader({"data": sys.argv[1]}, transform="transform_fixtures:forks", batch_size=8, readers=0,
                       mode="sequential")
try:
    steps = [(batch.step, float(batch["x"][0, 0])) for batch in (next(loader) for _ in range(6))]
    got = ("batches", steps)
except RuntimeError as error:
    got = ("error", str(error))
if os.getpid() != parent:  # The child the transform forked at step 3, come back into the loader.
    print("child", got, flush=True)
    os._exit(0)
print("parent", got, flush=True)
loader.close()
'''


def test_a_child_forked_inside_a_local_fill_gets_an_error_and_publishes_nothing(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(400, dtype=np.float32).reshape(100, 4))
    child = subprocess.run([sys.executable, "-c", _FORK_IN_FILL, str(tmp_path / "x.npy")], capture_output=True,
                           text=True, timeout=120, cwd=HERE)
    assert child.returncode == 0, child.stderr
    assert "child ('error', 'this loader belongs to process" in child.stdout, child.stdout
    expected = [(step, float(4 * 8 * step)) for step in range(6)]  # Row 8k's first value: the parent's are right.
    assert f"parent ('batches', {expected})" in child.stdout, child.stdout

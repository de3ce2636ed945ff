"""readers="auto" and slots="auto": the decision rule on synthetic windows (adds while the
trainer waits and a core is idle, holds without one, retires idle readers, never oscillates on
a modelled workload), and real loaders whose readers join and leave a running ring, under
SIGKILL too, delivering exactly the batches of a fixed readers=1 loader."""

from __future__ import annotations

import math
import os
import signal
import time
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import examples, our_shm_entries, process_alive, wait_until
from dataset_fixtures import Sleepy
from shmloader import ShmDataLoader
from shmloader.errors import ReaderRestartWarning
from shmloader.plan import defaults
from shmloader.plan.options import AutoReaders, LoaderOptions
from shmloader import session as session_module
from shmloader.readers import autotune
from shmloader.readers.autotune import RETIRE_WINDOWS, Window, decide



@pytest.fixture(autouse=True)
def budget_past_the_tests_readers(monkeypatch):
    """The rule's own behaviour is tested here: the node's reader budget (on a 2-core host one
    reader, its cores less the trainer) is test_node_budget.py's, and would hold these
    loaders at their start."""
    monkeypatch.setenv("SHMLOADER_CPU_BUDGET", "64")


# ---- The rule, on synthetic windows --------------------------------------------------------


def test_a_waiting_trainer_with_busy_readers_and_an_idle_core_gets_more_readers():
    decision = decide(Window(1.0, trainer_wait=0.5, readers=2, readers_busy=1.9, readers_blocked=0.0,
                             idle_cores=1.5), least=1, most=8)
    assert decision.change == 1  # One idle core: one reader, though the wait asks for two.
    assert "1.5 cores idle" in decision.why


def test_no_reader_is_added_while_no_core_is_idle():
    decision = decide(Window(1.0, trainer_wait=0.5, readers=2, readers_busy=2.0, readers_blocked=0.0,
                             idle_cores=0.3), least=1, most=8)
    assert decision.change == 0
    assert "no core is idle" in decision.why


def test_readers_that_wait_off_the_cpu_get_more_readers_without_an_idle_core():
    decision = decide(Window(1.0, trainer_wait=0.75, readers=1, readers_busy=1.0, readers_blocked=0.95,
                             idle_cores=0.0), least=1, most=8)
    assert decision.change == 3  # 1 / (1 - 0.75) = 4 readers in all.


def test_no_reader_is_added_past_most_nor_while_readers_are_not_what_the_trainer_waits_for():
    busy = Window(1.0, trainer_wait=0.9, readers=4, readers_busy=4.0, readers_blocked=0.0, idle_cores=4.0)
    assert decide(busy, least=1, most=4).change == 0
    starting = Window(1.0, trainer_wait=0.9, readers=2, readers_busy=0.2, readers_blocked=None, idle_cores=4.0)
    assert decide(starting, least=1, most=8).change == 0


def test_idle_readers_are_retired_one_at_a_time_after_calm_windows():
    idle = Window(1.0, trainer_wait=0.0, readers=4, readers_busy=0.8, readers_blocked=0.0, idle_cores=3.0)
    calm, changes = 0, []
    for _ in range(RETIRE_WINDOWS):
        decision = decide(idle, least=1, most=8, calm=calm)
        calm, changes = decision.calm, changes + [decision.change]
    assert changes == [0] * (RETIRE_WINDOWS - 1) + [-1]
    assert calm == 0  # Counted again from the next window.
    # A window in between that is not calm starts the count again.
    assert decide(Window(1.0, 0.2, 4, 3.9, 0.0, 0.0), least=1, most=8, calm=RETIRE_WINDOWS - 1).calm == 0
    # Never below least.
    assert decide(Window(1.0, 0.0, 2, 0.1, 0.0, 3.0), least=2, most=8, calm=RETIRE_WINDOWS).change == 0


def _modelled_window(readers: int, work: float, cores: int, blocked: float) -> Window:
    """A workload that needs `work` readers' worth of fills: fewer readers keep the trainer
    waiting for the rest; the trainer's own core and the readers' CPU leave the idle cores."""
    wait = max(0.0, 1.0 - readers / work)
    busy = min(float(readers), work)
    idle = max(0.0, cores - (1.0 - wait) - busy * (1.0 - blocked))
    return Window(1.0, wait, readers, busy, blocked, idle)


@settings(max_examples=300, deadline=None)
@given(work=st.floats(0.2, 20.0), start=st.integers(1, 16), most=st.integers(1, 16), cores=st.integers(1, 32),
       blocked=st.sampled_from([0.0, 0.2, 0.9]))
def test_the_reader_count_settles_without_oscillating(work, start, most, cores, blocked):
    start = min(start, most)
    readers, calm, counts = start, 0, [start]
    for _ in range(60):
        decision = decide(_modelled_window(readers, work, cores, blocked), least=1, most=most, calm=calm)
        readers, calm = readers + decision.change, decision.calm
        assert 1 <= readers <= most
        counts.append(readers)
    directions = [b - a for a, b in zip(counts, counts[1:]) if b != a]
    turns = sum(1 for a, b in zip(directions, directions[1:]) if (a > 0) != (b > 0))
    assert turns <= 1, counts
    assert len(set(counts[-20:])) == 1, counts  # Settled.
    if blocked >= autotune.BLOCKED_SHARE_MIN:  # Cores do not bound readers that wait off the CPU.
        assert readers >= min(most, math.ceil(work * 0.95 - 1e-9)), counts


# ---- slots="auto" ----------------------------------------------------------------------------


def test_auto_slots_keep_every_reader_busy_and_stay_inside_the_budget():
    assert defaults.auto_slots(4, 1 << 20, 1 << 40) == 4 * 4 + defaults.TRAINER_SLOTS
    assert defaults.auto_slots(4, 1 << 20, 10 << 20) == 10
    assert defaults.auto_slots(4, 1 << 20, 1 << 20) == 4 + defaults.TRAINER_SLOTS + 1  # The floor.
    assert defaults.auto_slots(0, 1 << 20, 1 << 40) == defaults.TRAINER_SLOTS + 1


def test_a_loader_with_auto_slots_keeps_its_ring_inside_a_small_memory_limit(tmp_path, monkeypatch):
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(2048 * 1024, dtype=np.uint8).reshape(2048, 1024))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    limit = 64 << 20
    monkeypatch.setattr(defaults, "memory_limit_bytes", lambda: limit)
    budget = int(limit * defaults.AUTO_RING_MEMORY_SHARE)
    with ShmDataLoader(str(path), batch_size=1024, readers=2, slots="auto") as loader:
        slot_bytes = loader.plan.slot.nbytes
        assert slot_bytes >= 1 << 20
        assert loader.slots == budget // slot_bytes < 4 * 2 + defaults.TRAINER_SLOTS
        assert loader.slots * slot_bytes <= budget
        next(iter(loader))
    monkeypatch.setattr(defaults, "memory_limit_bytes", lambda: 1 << 40)
    with ShmDataLoader(str(path), batch_size=1024, readers=2, slots="auto") as loader:
        assert loader.slots == 4 * 2 + defaults.TRAINER_SLOTS


def test_auto_reaches_at_most_a_loaders_readers_however_large_the_nodes_budget(monkeypatch):
    """The most auto may reach defaults to the node's budget, which a node of 300 cores or a
    SHMLOADER_CPU_BUDGET may set past READERS_MAX, the bound readers=N is held to: a default
    loader made 5000 reader records and 5003 slots (SLOTS_MAX is 4096), a ring `shmloader
    monitor` refuses to read."""
    from shmloader.plan.options import READERS_MAX

    monkeypatch.setenv("SHMLOADER_CPU_BUDGET", "5000")
    start, least, most = AutoReaders().resolve()
    assert most == READERS_MAX and least <= start <= most, (start, least, most)


def test_auto_settings_are_checked_where_they_are_given():
    with pytest.raises(ValueError, match="AutoReaders.start"):
        AutoReaders(start=5, most=2)
    with pytest.raises(ValueError, match="remote readers"):
        LoaderOptions(readers="auto", remote=type("Remote", (), {"start": 0, "count": 1, "capacity": 1})())
    assert isinstance(LoaderOptions(readers="auto").readers, AutoReaders)
    assert isinstance(LoaderOptions().readers, AutoReaders)  # The default.
    remote = type("Remote", (), {"start": 0, "count": 1, "capacity": 1})()
    assert LoaderOptions(remote=remote).readers is None  # Local readers beside remote ones stay fixed.
    with pytest.raises(TypeError, match='slots must be an integer or "auto", got .many.'):
        LoaderOptions(slots="many")
    with pytest.raises(TypeError, match='readers must be an integer or "auto"'):
        LoaderOptions(readers="Auto")


# ---- Readers joining and leaving a running ring ------------------------------------------------

_SEED, _BATCH = 7, 4


def _reference(dataset, steps: int) -> list[np.ndarray]:
    with ShmDataLoader.from_dataset(dataset, batch_size=_BATCH, seed=_SEED, readers=1) as loader:
        return [batch["x"].copy() for _, batch in zip(range(steps), loader)]


def _decide_often(monkeypatch) -> None:
    """The tuner on windows of 0.2 s, called at a periodic check every 8 batches (64 in use):
    a loader whose steps take 16 ms (next() waits less than a poll interval, and only the
    periodic check calls the tuner) is judged within a fifth of a second. Sleeps of 4 ms keep
    the readers off the CPU most of their fills on a loaded machine too (waking from a shorter
    one, a reader waits for a core a large share of it)."""
    monkeypatch.setattr(autotune.Tuner, "window_seconds", 0.2)
    monkeypatch.setattr(session_module, "_READER_CHECK_BATCHES", 8)


_REFERENCES: dict = {}


def _reference_cached(dataset, steps: int) -> list[np.ndarray]:
    """_reference, computed once per dataset and length for the tests that share it."""
    key = (dataset.seconds, dataset.length, steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(dataset, steps)
    return _REFERENCES[key]


def test_auto_readers_grow_while_the_trainer_waits_and_deliver_the_fixed_readers_batches(monkeypatch):
    _decide_often(monkeypatch)
    dataset, steps = Sleepy(0.004), 80
    expected = _reference_cached(dataset, steps)
    counts = []
    with ShmDataLoader.from_dataset(dataset, batch_size=_BATCH, seed=_SEED,
                                    readers=AutoReaders(start=1, most=3)) as loader:
        assert loader.readers == 3 and loader.stats()["reader_count"] == 1
        for step, batch in zip(range(steps), loader):
            np.testing.assert_array_equal(batch["x"], expected[step], err_msg=f"step {step}")
            counts.append(loader.stats()["reader_count"])
        change = loader.stats()["reader_change"]
        restarts = loader.stats()["reader_restarts"]
    assert max(counts) > 1, counts
    assert change is not None and change["from"] == 1 and change["to"] > 1, change
    assert "the trainer waited" in change["why"]
    assert restarts == 0


def test_a_reader_that_cannot_be_started_is_reported_and_training_goes_on(monkeypatch):
    _decide_often(monkeypatch)
    dataset, steps = Sleepy(0.004), 80
    expected = _reference_cached(dataset, steps)
    with ShmDataLoader.from_dataset(dataset, batch_size=_BATCH, seed=_SEED,
                                    readers=AutoReaders(start=1, most=3)) as loader:
        def refuse():
            raise OSError(11, "Resource temporarily unavailable")

        monkeypatch.setattr(loader._session.pool, "_spawn", refuse)
        for step, batch in zip(range(steps), loader):
            np.testing.assert_array_equal(batch["x"], expected[step], err_msg=f"step {step}")
        stats = loader.stats()
    assert stats["reader_count"] == 1 and stats["reader_change"] is None
    assert "adding a reader failed" in stats["reader_add_failure"], stats["reader_add_failure"]
    assert "Resource temporarily unavailable" in stats["reader_add_failure"]


def test_a_long_fill_the_trainer_waits_for_retires_no_reader(monkeypatch):
    """A batch that takes far longer than a window to fill (a slow __getitem__, a first batch
    of seconds): while next() waits for it the ring has counted no wait yet (a wait is added
    at its take) and no reader has finished a batch, and windows that looked calm retired a
    reader the trainer was waiting for. The wait so far counts."""
    monkeypatch.setattr(autotune.Tuner, "window_seconds", 0.2)
    dataset = Sleepy(0.3)  # 1.2 s a batch of 4: six windows inside each fill.
    with ShmDataLoader.from_dataset(dataset, batch_size=_BATCH, seed=_SEED,
                                    readers=AutoReaders(start=2, least=1, most=2)) as loader:
        for _, batch in zip(range(3), loader):
            assert batch["x"].shape == (_BATCH, 8)
        stats = loader.stats()
    assert stats["reader_count"] == 2, stats["reader_change"]
    assert stats["reader_change"] is None, stats["reader_change"]


def test_idle_readers_retire_without_being_restarted_and_the_batches_stay_the_same(monkeypatch):
    monkeypatch.setattr(autotune.Tuner, "window_seconds", 0.2)
    dataset, steps = Sleepy(0.0, length=4000), 2000
    expected = _reference(dataset, steps)
    with ShmDataLoader.from_dataset(dataset, batch_size=_BATCH, seed=_SEED,
                                    readers=AutoReaders(start=3, most=3)) as loader:
        first_pids = set(loader.diagnostics.reader_pids)
        for step, batch in zip(range(steps), loader):
            np.testing.assert_array_equal(batch["x"], expected[step], err_msg=f"step {step}")
            time.sleep(0.002)  # A training step far slower than a fill: the readers sit idle.
            if loader.stats()["reader_count"] < 3:
                break
        stats = loader.stats()
        assert stats["reader_count"] < 3, stats["reader_change"]
        assert stats["reader_change"]["to"] < stats["reader_change"]["from"]
        assert stats["reader_restarts"] == 0
        # A retired reader exits by itself, while the loader runs on.
        assert wait_until(lambda: any(not process_alive(pid) for pid in first_pids), timeout=5)
        assert next(iter(loader))["x"].shape == (_BATCH, 8)


def test_readers_join_and_leave_under_sigkill_and_every_batch_is_right(monkeypatch):
    monkeypatch.setattr(autotune.Tuner, "window_seconds", 1e9)  # Only this test's own changes.
    dataset, steps = Sleepy(0.003), 90
    expected = _reference(dataset, steps)
    killed = None
    with ShmDataLoader.from_dataset(dataset, batch_size=_BATCH, seed=_SEED, max_reader_restarts=1,
                                    readers=AutoReaders(start=2, most=3)) as loader:
        pool = loader._session.pool  # The elastic pool, driven by hand.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step, batch in zip(range(steps), loader):
                np.testing.assert_array_equal(batch["x"], expected[step], err_msg=f"step {step}")
                if step == 10:
                    leaving = pool.retire_reader()
                    assert leaving is not None
                    _kill(pool.processes[leaving].pid)  # Retired and killed: not restarted.
                    _add(loader)
                if step == 30:
                    _add(loader)
                    killed = pool.processes[pool.active()[0]].pid
                    _kill(killed)  # Active: restarted, as any reader.
                if step == 50:
                    assert pool.retire_reader() is not None
        stats = loader.stats()
        pids = loader.diagnostics.reader_pids
    restarted = [str(warning.message) for warning in caught if issubclass(warning.category, ReaderRestartWarning)]
    assert len(restarted) == 1 and f"pid {killed})" in restarted[0], restarted
    assert stats["reader_restarts"] == 1
    assert 1 <= stats["reader_count"] <= 3
    assert 0 not in pids
    assert wait_until(lambda: not our_shm_entries(os.getpid()), timeout=5), our_shm_entries(os.getpid())
    assert wait_until(lambda: not any(process_alive(pid) for pid in pids), timeout=5)


def test_a_seek_and_a_new_filler_with_a_reader_leaving_keep_the_batches_and_restart_nobody(monkeypatch):
    monkeypatch.setattr(autotune.Tuner, "window_seconds", 1e9)
    dataset, steps = Sleepy(0.003), 60
    expected = _reference(dataset, steps)
    with ShmDataLoader.from_dataset(dataset, batch_size=_BATCH, seed=_SEED,
                                    readers=AutoReaders(start=3, most=3)) as loader:
        pool, session = loader._session.pool, loader._session
        iterator = iter(loader)
        for step in range(10):
            np.testing.assert_array_equal(next(iterator)["x"], expected[step], err_msg=f"step {step}")
        assert pool.retire_reader() is not None
        loader.seek(3)  # Every slot taken back while a retired reader may still be finishing its step.
        for step in range(3, 20):
            np.testing.assert_array_equal(next(iterator)["x"], expected[step], err_msg=f"step {step}")
        assert pool.retire_reader() is not None
        session.use(loader.sampler)  # A new filler (as a resharded resume sends): the leaving reader is ended.
        loader.seek(20)
        _add(loader)
        for step in range(20, steps):
            np.testing.assert_array_equal(next(iterator)["x"], expected[step], err_msg=f"step {step}")
        stats = loader.stats()
        assert stats["reader_restarts"] == 0
        assert stats["reader_count"] == 2


def _add(loader) -> int:
    """add_reader as the tuner calls it, after the supervisor's check of the readers (which
    frees the record of a retired reader once it has exited); waits for a free record."""
    pool, request, added = loader._session.pool, loader._session.cursor.request, []
    assert wait_until(lambda: pool.check(request) or added.append(pool.add_reader()) or added[-1] is not None,
                      timeout=5), "no reader record came free"
    return added[-1]


def _kill(pid: int, number: int = signal.SIGKILL) -> None:
    """Signals reader `pid`, which may have exited by itself meanwhile (a retired one that had
    no step to finish, a killed one not yet replaced)."""
    assert pid > 0, pid  # os.kill(0, ...) would signal this test's whole process group.
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


_ACTIONS = ("add", "retire", "kill an active reader", "retire and kill it", "retire and stop it a moment")


@examples(2)
@given(schedule=st.lists(st.tuples(st.integers(0, 39), st.sampled_from(_ACTIONS)), min_size=1, max_size=6))
def test_any_schedule_of_joins_leaves_and_kills_delivers_the_same_batches(schedule):
    dataset, steps = Sleepy(0.002), 40
    expected = _reference_cached(dataset, steps)
    events = {}
    for step, action in schedule:
        events.setdefault(step, []).append(action)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReaderRestartWarning)
        with ShmDataLoader.from_dataset(dataset, batch_size=_BATCH, seed=_SEED, max_reader_restarts=10,
                                        readers=AutoReaders(start=2, most=3)) as loader:
            pool = loader._session.pool
            pool_tuner = loader._session.tuner
            pool_tuner.window_seconds = 1e9  # Only the schedule changes the readers.
            for step, batch in zip(range(steps), loader):
                np.testing.assert_array_equal(batch["x"], expected[step], err_msg=f"step {step}: {schedule}")
                for action in events.get(step, ()):
                    _act(pool, action)


def _act(pool, action: str) -> None:
    if action == "add":
        pool.add_reader()
    elif action == "retire":
        pool.retire_reader()
    elif action == "kill an active reader" and pool.active():
        _kill(pool.processes[pool.active()[0]].pid)
    elif action == "retire and kill it":
        leaving = pool.retire_reader()
        if leaving is not None:
            _kill(pool.processes[leaving].pid)
    elif action == "retire and stop it a moment":  # SIGSTOP mid-step, then SIGCONT: it finishes, then leaves.
        leaving = pool.retire_reader()
        if leaving is not None:
            pid = pool.processes[leaving].pid
            _kill(pid, signal.SIGSTOP)
            time.sleep(0.1)
            _kill(pid, signal.SIGCONT)

"""readers="auto"'s trials (readers/probe.py): where the readers wait off the CPU or for a
core, a change of the reader count is kept only where the delivered rate says so. The
Prober's rule on its own, the real Tuner driven by a modelled device whose best reader
count is drawn (it settles there and stays, trying each way now and then), and a real
loader whose readers serialise on a lock: it retires one on trial and every batch is right."""

from __future__ import annotations

import fcntl
import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

from conftest import examples

from shmloader import ShmDataLoader
from shmloader.plan.options import AutoReaders
from shmloader import session as session_module
from shmloader.readers import autotune, probe
from shmloader.readers.bottleneck import Reading, ReaderCounters
from shmloader.readers.probe import Prober


@pytest.fixture(autouse=True)
def budget_past_the_tests_readers(monkeypatch):
    """The trials' own behaviour is tested here, not the node's budget (test_node_budget.py)."""
    monkeypatch.setenv("SHMLOADER_CPU_BUDGET", "64")


# ---- The Prober's rule ------------------------------------------------------------------------


@examples(200)
@given(change=st.sampled_from([-1, 1, 2, 5]), ratio=st.floats(0.5, 2.0), before=st.integers(1, 8))
def test_a_trial_is_kept_only_where_the_rate_says_so(change, ratio, before):
    prober = Prober(1.0)
    prober.start(change, 100.0, before, now_s=10.0)
    undo, why = prober.judge(100.0 * ratio, now_s=12.0)
    kept = ratio >= 1 + probe.KEEP_GAIN if change > 0 else ratio >= 1 - probe.KEEP_LOSS
    assert undo == (0 if kept else -change)
    assert why.startswith("kept" if kept else "undone")
    assert f"{before + change} readers delivered" in why and f"what {before} did" in why
    direction = 1 if change > 0 else -1
    if kept or change > 1:  # A kept trial, or a large add halved, may be tried again at once.
        assert prober.may_try(direction, 12.0)
        assert prober.add_most == (None if kept else change // 2)
    else:
        assert not prober.may_try(direction, 12.0 + probe.BACKOFF_FIRST_SECONDS - 0.1)
        assert prober.may_try(direction, 12.0 + probe.BACKOFF_FIRST_SECONDS)
        assert prober.may_try(-direction, 12.0)  # The other direction is not held back.


def test_each_undone_trial_doubles_its_back_off_up_to_the_most_and_a_kept_one_starts_it_again():
    prober, now, waits = Prober(1.0), 0.0, []
    for _ in range(8):
        prober.start(-1, 100.0, 3, now)
        prober.judge(50.0, now + 2)
        waits.append(prober.next_try_s[-1] - (now + 2))
        now = prober.next_try_s[-1]
    assert waits == [min(probe.BACKOFF_MOST_SECONDS, probe.BACKOFF_FIRST_SECONDS * 2 ** k) for k in range(8)]
    prober.start(-1, 100.0, 3, now)
    assert prober.judge(99.0, now + 2)[0] == 0
    assert prober.backoff_s[-1] == probe.BACKOFF_FIRST_SECONDS


def test_a_trial_is_judged_after_its_windows_and_enough_fills_or_after_its_longest_wait():
    prober = Prober(1.0)
    prober.start(1, 100.0, 2, now_s=0.0)  # 3 readers on trial.
    enough = probe.PROBE_FILLS_MIN * 3
    assert not prober.due(1.9, enough)
    assert not prober.due(2.0, enough - 1)
    assert prober.due(2.0, enough)
    assert prober.due(probe.PROBE_WINDOWS_MOST, 0)  # Readers that fill nothing are judged too (and lose).


# ---- The Tuner on a modelled device ---------------------------------------------------------


class _ModelledPool:
    """What the Tuner uses of an ElasticPool: `count` records, the first `active_count` active."""

    def __init__(self, count: int, start: int, least: int) -> None:
        self.count, self.least, self.active_count, self.ring = count, least, start, object()

    def active(self) -> list[int]:
        return list(range(self.active_count))

    def starting_note(self) -> str:
        return ""

    def add_reader(self):
        if self.active_count >= self.count:
            return None
        self.active_count += 1
        return self.active_count - 1

    def retire_reader(self):
        if self.active_count <= self.least:
            return None
        self.active_count -= 1
        return self.active_count


class _Device:
    """A device the readers wait on (cause "off_cpu": each busy fill is 90% off the CPU, and
    a core is idle) or one they share cores on (cause "queued": half of each fill waiting for
    a core, none idle) or, cause "cpu", one whose readers hold a core each with one idle (no
    cause for a trial); `cause` may be a function of the reader count. It delivers rate(n)
    batches a second with n readers; the trainer always waits for it. Its clock is the Tuner's."""

    _SHARES = {"off_cpu": (0.1, 0.0, 1.5), "queued": (0.5, 0.5, 0.0), "cpu": (1.0, 0.0, 1.0)}  # cpu, queued, idle

    def __init__(self, pool: _ModelledPool, rates: list[float], cause) -> None:
        self.pool, self.rates, self.cause = pool, rates, cause
        self.now_ns, self.waited_ns, self.idle_ns, self.total_ns = 1, 0, 0, 0
        self.busy = [0] * pool.count
        self.batches = [0.0] * pool.count  # Fractions carried: a slow count's fills add up.
        self.cpu = [0] * pool.count
        self.queued = [0] * pool.count

    def run(self, seconds: float) -> None:
        n = self.pool.active_count
        cpu_share, queued_share, idle_cores = self._SHARES[self.cause(n) if callable(self.cause) else self.cause]
        for index in range(n):
            busy_ns = int(0.9 * seconds * 1e9)
            self.busy[index] += busy_ns
            self.batches[index] += self.rates[n - 1] * seconds / n
            self.cpu[index] += int(busy_ns * cpu_share)
            self.queued[index] += int(busy_ns * queued_share)
        self.waited_ns += int(0.95 * seconds * 1e9)
        self.total_ns += int(2 * seconds * 1e9)
        self.idle_ns += int(idle_cores * seconds * 1e9)
        self.now_ns += int(seconds * 1e9)

    def pause(self, seconds: float) -> None:
        """The trainer away from next() (an evaluation, a checkpoint): the ring is full, the
        readers fill nothing and wait for slots, and the trainer waits for none."""
        self.total_ns += int(2 * seconds * 1e9)
        self.idle_ns += int(1.5 * seconds * 1e9)
        self.now_ns += int(seconds * 1e9)

    def read(self) -> Reading:
        readers = tuple(ReaderCounters(1000 + index, self.busy[index], int(self.batches[index]), cpu_ns=self.cpu[index],
                                       queued_ns=self.queued[index]) for index in range(self.pool.count))
        return Reading(self.now_ns, self.waited_ns, readers, 4 * self.pool.count, 0, self.idle_ns, self.total_ns, 2)


@examples(60)
@given(most=st.integers(1, 6), data=st.data(), cause=st.sampled_from(["off_cpu", "queued"]),
       slope=st.floats(0.1, 0.3))
def test_the_tuner_settles_at_the_devices_best_count_and_stays_there_but_for_its_trials(most, data, cause, slope):
    """The rate falls by `slope` for each reader away from the best count (drawn).
    Readers that wait off the CPU climb to it; readers that wait for a core are never added
    to (no core is idle) and come down to it where they start above it."""
    best = data.draw(st.integers(1, most), label="best")
    start = data.draw(st.integers(1, most), label="start")
    rates = [500.0 * (1 - slope) ** abs(n - best) for n in range(1, most + 1)]
    pool = _ModelledPool(most, start, least=1)
    device = _Device(pool, rates, cause)
    tuner = autotune.Tuner(pool, device.read, clock=lambda: device.now_ns)
    expected = best if cause == "off_cpu" else min(start, best)
    counts = []
    for _ in range(1600):  # 400 s in steps of a quarter of a second.
        device.run(0.25)
        tuner.tune()
        counts.append(pool.active_count)
    last = counts[-800:]  # The last 200 s: at the best but for the trials' few seconds.
    assert last[-1] == expected or tuner.prober.trial is not None, (counts[::20], rates)
    assert sum(count == expected for count in last) >= 0.9 * len(last), (counts[::20], rates)


def test_a_pause_of_the_trainer_is_not_the_rate_a_retirement_on_trial_is_judged_against():
    """A trainer away from next() for a second (a checkpoint) leaves its readers idle on a
    full ring: what they filled then is not their rate. Three readers that wait for a core
    deliver more than two; a retirement judged against a rate that counted the pause would
    be kept, and with no core idle nothing adds the reader back."""
    pool = _ModelledPool(3, 3, least=1)
    device = _Device(pool, [300.0, 400.0, 500.0], "queued")
    tuner = autotune.Tuner(pool, device.read, clock=lambda: device.now_ns)
    counts = []
    for step in range(800):  # 200 s in steps of a quarter of a second, the pause after the first second.
        device.run(0.25)
        if step == 3:
            device.pause(1.25)
        tuner.tune()
        counts.append(pool.active_count)
    last = counts[-400:]
    assert sum(count == 3 for count in last) >= 0.9 * len(last), (counts[::10], tuner.prober.report())


def test_a_retirement_kept_on_trial_is_not_undone_by_an_add_the_cpu_judges():
    """Two readers wait for a core and deliver less than one (a cache each one's read-ahead
    evicts); one reader holds its core with another idle, where decide adds by the CPU alone.
    A retirement kept on trial was followed by that add at the next window, and the count
    swung between one and two every few seconds for good (a reader forked each time, 40% of
    the time at the worse count). After a retirement kept on trial, an add back to the count
    it left is a trial too."""
    pool = _ModelledPool(2, 2, least=1)
    device = _Device(pool, [500.0, 450.0], lambda count: "queued" if count >= 2 else "cpu")
    tuner = autotune.Tuner(pool, device.read, clock=lambda: device.now_ns)
    counts, changes = [], []
    for _ in range(800):  # 200 s in steps of a quarter of a second.
        device.run(0.25)
        tuner.tune()
        counts.append(pool.active_count)
        changes.append(tuner.changes)
    last = counts[-400:]
    assert sum(count == 1 for count in last) >= 0.9 * len(last), (counts[::10], tuner.last)
    assert changes[-1] - changes[-400] <= 4, (changes[-1] - changes[-400], tuner.last)


class _NoRoom:
    """A node budget record with no room for this loader's readers (the calls the Tuner makes
    of budget_record.NodeShare): every claim grants none, no reader is asked back, and the
    user's cap holds (no earned readers)."""

    now, error, capped, earned, earning = None, None, True, 0, False

    def pace(self, gap_seconds: float, fill_seconds: float = 0.0) -> None:
        pass

    def publish(self, held: int, wants: int = 0, spare: int = 0, give: bool = True):
        return None

    def claim(self, held: int, wanted: int) -> int:
        return 0

    def not_started(self, count: int) -> None:
        pass


def test_a_retirement_undone_where_the_budget_has_no_room_to_add_back_says_so():
    """Three readers deliver more than two, so a retirement on trial is undone; where the
    node's budget has no room for the reader meanwhile, two run on. The trial's report said
    "undone" all the same, beside a reader count of two."""
    pool = _ModelledPool(3, 3, least=1)
    device = _Device(pool, [300.0, 400.0, 500.0], "queued")
    tuner = autotune.Tuner(pool, device.read, share=_NoRoom(), clock=lambda: device.now_ns)
    for _ in range(80):  # 20 s: one retirement on trial and its end.
        device.run(0.25)
        tuner.tune()
        report = tuner.prober.report() or ""
        if report.startswith("undone"):
            break
    assert report.startswith("undone"), report
    assert pool.active_count == 2 and "no room" in report, (pool.active_count, report)
    assert tuner.report()["reader_trial"] == report


def test_readers_that_hold_the_cpu_with_an_idle_core_are_never_on_trial():
    window = autotune.Window(1.0, 0.5, 2, 1.9, readers_blocked=0.0, idle_cores=1.5, batches_per_second=100.0,
                             refaulted=0.0, readers_queued=0.05)
    assert window.trial_cause is None
    assert "wait for a core 40%" in autotune.Window(1.0, 0.5, 2, 1.9, 0.0, 0.0, 100.0, None, 0.4).trial_cause
    assert "off the CPU 80%" in autotune.Window(1.0, 0.5, 2, 1.9, 0.8, 0.0, 100.0, None, 0.0).trial_cause
    assert "30% of their reads refaulted" in autotune.Window(1.0, 0.5, 2, 1.9, 0.0, 0.0, 100.0, 0.3, 0.0).trial_cause


# ---- A real loader ------------------------------------------------------------------------------


class LockedDevice:
    """Samples read through one device that serves one reader at a time (a lock file held for
    each read): more readers only queue on it."""

    def __init__(self, path: str, seconds: float, length: int = 4000) -> None:
        self.path, self.seconds, self.length = path, seconds, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        with open(self.path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            time.sleep(self.seconds)
        return {"x": np.full(8, index, np.float32)}


def test_readers_queued_on_one_device_retire_on_trial_and_every_batch_is_right(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune.Tuner, "window_seconds", 0.2)
    monkeypatch.setattr(session_module, "_READER_CHECK_BATCHES", 8)
    dataset = LockedDevice(str(tmp_path / "device.lock"), 0.002)
    with ShmDataLoader.from_dataset(dataset, batch_size=4, seed=3, readers=1) as loader:
        expected = [batch["x"].copy() for _, batch in zip(range(600), loader)]
    trials = []
    with ShmDataLoader.from_dataset(dataset, batch_size=4, seed=3,
                                    readers=AutoReaders(start=3, least=1, most=3)) as loader:
        for step, batch in zip(range(600), loader):
            np.testing.assert_array_equal(batch["x"], expected[step], err_msg=f"step {step}")
            stats = loader.stats()
            change = stats["reader_change"]
            if change is not None and change["why"].startswith("trial") and change not in trials:
                trials.append(change)
        stats = loader.stats()
    assert trials, stats["reader_change"]
    assert trials[0]["from"] == 3 and trials[0]["to"] == 2
    # Off the CPU (the lock and the sleep) on a quiet host; on a loaded one their wake-ups wait
    # for a core as long, and the trial names that cause instead: either is a trial's.
    assert "wait off the CPU" in trials[0]["why"] or "wait for a core" in trials[0]["why"], trials[0]
    assert stats["reader_trial"] is not None and stats["reader_restarts"] == 0


@pytest.mark.parametrize("scale", [0.05, 0.5])
def test_readers_whose_fills_take_seconds_still_climb_to_the_best_count(scale):
    """A fill of seconds (a large batch from a slow store) gives a window of two seconds no
    rate to judge by: the trial's rate is then taken over PROBE_WINDOWS_MOST windows."""
    rates = [scale * n for n in range(1, 5)]  # Each reader adds as much: the best is the most.
    pool = _ModelledPool(4, 1, least=1)
    device = _Device(pool, rates, "off_cpu")
    tuner = autotune.Tuner(pool, device.read, clock=lambda: device.now_ns)
    counts = []
    for _ in range(2400):  # 600 s.
        device.run(0.25)
        tuner.tune()
        counts.append(pool.active_count)
    assert counts[-1] == 4, counts[::40]
    assert counts.index(4) < 1200, counts[::40]  # Within 300 s, at a fill every 20 s with one reader.


def test_a_trial_whose_readers_the_budget_changed_ends_unjudged_and_says_so():
    """The node's budget may take a reader on trial for another loader: the rate then measures
    neither count, so the trial ends unjudged, reader_trial says why, and nothing is undone."""
    rates = [500.0 * 0.8 ** abs(n - 1) for n in range(1, 4)]
    pool = _ModelledPool(3, 3, least=1)
    device = _Device(pool, rates, "queued")
    tuner = autotune.Tuner(pool, device.read, clock=lambda: device.now_ns)
    for _ in range(200):
        device.run(0.25)
        tuner.tune()
        if tuner.prober.trial is not None:
            break
    assert tuner.prober.trial is not None and pool.active_count == 2  # A retirement on trial, 3 -> 2.
    pool.retire_reader()  # The budget gives one to another loader meanwhile.
    for _ in range(8):
        device.run(0.25)
        tuner.tune()
    assert tuner.prober.trial is None  # At its least, with no core idle, nothing more to try.
    assert tuner.report()["reader_trial"] == "ended unjudged: the node's budget made the 2 readers on trial 1"
    assert pool.active_count == 1  # Nothing undone: no reader added back on a rate that measured neither count.

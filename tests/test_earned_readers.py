"""Earned readers (readers/earned.py): a loader runs a reader past the node's count budget where
a trial measured the idle CPU for it. The split's rules (earned readers take no room, make no
other loader give back, and an idle loader's count for nothing), the record's field and its
checks of what another process wrote, and two real Tuners sharing one real record on a
modelled node of 2 cores: the rank whose trainer waits earns a reader where it pays, gives it
back where it does not or where the node gets crowded, and one earned trial runs at a time."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
from hypothesis import given, strategies as st

from conftest import budget_entries, examples
from shmloader.errors import NodeBudgetError
from shmloader.plan import defaults
from shmloader.plan.options import AutoReaders
from shmloader.readers import autotune, probe
from shmloader.readers import budget_record as record
from shmloader.readers.bottleneck import Reading, ReaderCounters
from shmloader.readers.node_budget import Holding, grant, room, yields
from test_auto_trials import _ModelledPool
from test_node_budget_fairness import _loaders as _fairness_loaders

_BUDGET_VARIABLE = "SHMLOADER_TEST_NODE_BUDGET"


@pytest.fixture(autouse=True)
def node_budget_of_the_test(monkeypatch):
    """The node budget each test gives (_BUDGET_VARIABLE in the environment a share joins with;
    1 unset), as a node's cores and trainers would make it: SHMLOADER_CPU_BUDGET, the user's
    cap, forbids earning past it."""
    monkeypatch.setattr(record, "node_budget",
                        lambda environment=os.environ: int(environment.get(_BUDGET_VARIABLE, "1")))


def _environment(budget: str) -> dict:
    environment = {name: value for name, value in os.environ.items() if name != defaults.CPU_BUDGET_VARIABLE}
    return {**environment, _BUDGET_VARIABLE: budget}


# ---- The split, as pure functions ---------------------------------------------------------


def _loaders():
    """Loaders fixed or changing, idle or not, the changing ones with earned readers; the node
    may run past its budget."""
    return _fairness_loaders(earned=True)


def _without_earned(holding: Holding) -> Holding:
    """The loader as if its earned readers did not run: the reference the split must match."""
    return dataclasses.replace(holding, held=holding.held - holding.earned, earned=0)


@examples(400)
@given(holdings=_loaders(), budget=st.integers(1, 24), data=st.data())
def test_earned_readers_take_no_room_and_never_make_a_loader_give_back(holdings, budget, data):
    me = data.draw(st.integers(0, len(holdings) - 1))
    holdings[me] = dataclasses.replace(holdings[me], idle=False)  # The loader asking has just updated its entry.
    reference = [_without_earned(holding) for holding in holdings]
    assert room(budget, holdings) == room(budget, reference)
    for index in range(len(holdings)):
        if not holdings[index].idle:
            returning = data.draw(st.booleans())
            assert yields(budget, holdings, index, returning) == yields(budget, reference, index, returning)
    wanted = data.draw(st.integers(0, 10))
    mine = holdings[me]
    expected = grant(budget, reference, me, wanted)
    # Its own earned readers count towards its most (they are processes), and nothing else.
    assert grant(budget, holdings, me, wanted) == min(expected, max(0, mine.most - mine.held))


@examples(300)
@given(holdings=_loaders(), budget=st.integers(1, 24), data=st.data())
def test_an_idle_loaders_earned_readers_count_for_nothing_of_their_own(holdings, budget, data):
    idle = [index for index, holding in enumerate(holdings) if holding.idle and not holding.fixed]
    live = [index for index, holding in enumerate(holdings) if not holding.idle]
    if not live:
        return
    # The same node with every idle loader's earned readers made ordinary ones: nothing changes.
    reference = [dataclasses.replace(holding, earned=0) if index in idle else holding
                 for index, holding in enumerate(holdings)]
    assert room(budget, holdings) == room(budget, reference)
    assert room(budget, holdings) == budget - sum(holding.least if holding.idle else holding.held - holding.earned
                                                  for holding in holdings)
    me, wanted = data.draw(st.sampled_from(live)), data.draw(st.integers(0, 10))
    assert grant(budget, holdings, me, wanted) == grant(budget, reference, me, wanted)
    assert yields(budget, holdings, me) == yields(budget, reference, me)


def test_a_rank_with_an_earned_reader_past_a_taken_budget_is_asked_for_nothing():
    """The torchrun case's node: a budget of 1, each rank at its least; the rank that earned a
    reader keeps it while the other's trainer waits and asks."""
    earning, waiting = Holding(2, 1, 3, earned=1), Holding(1, 1, 3, wants=1)
    assert room(1, [earning, waiting]) == -1  # Past the budget by the two leasts, not by the earned reader.
    assert yields(1, [earning, waiting], 0) == 0
    assert yields(1, [Holding(2, 1, 3), waiting], 0) == 1  # The same reader within the budget is given back.


# ---- The record ------------------------------------------------------------------------------


def _record_with(entry: record._Entry) -> bytes:
    entries = [record._Entry() for _ in range(record.ENTRY_COUNT)]
    entries[3] = entry
    return record.pack(entries)


def test_the_records_earned_and_flags_fields_read_back_as_written():
    entry = record._Entry(pid=7, held=4, least=1, most=6, budget=2, token=5, earned=3, flags=record.FLAG_EARNING)
    assert record.parse(_record_with(entry), "record")[3] == entry
    assert record.RECORD_VERSION == 3 and f"-v{record.RECORD_VERSION}-" in record.record_path()


@pytest.mark.parametrize("fields, named", [
    ({"held": 3, "least": 2, "earned": 2}, "earned 2 of its 3 readers with a least of 2"),
    ({"held": 2, "least": 2, "most": 2, "earned": 1}, "earned 1 of its 2 readers"),
    ({"held": 3, "least": 1, "earned": 1, "flags": 6}, "flags 0x6: expected only FLAG_EARNING"),
    ({"held": 3, "least": 1, "earned": 0, "flags": record.FLAG_EARNING}, "FLAG_EARNING (an earned trial in flight) "
                                                                          "with earned 0"),
], ids=["earned past held less least", "a fixed loader earned", "unknown flags", "a trial without its reader"])
def test_a_record_whose_earned_field_breaks_its_rules_is_refused_naming_it(fields, named):
    entry = record._Entry(**{"pid": 7, "most": 6, "budget": 2, "token": 5, **fields})
    with pytest.raises(NodeBudgetError, match="not a record this shmloader wrote") as raised:
        record.parse(_record_with(entry), "/dev/shm/the-record")
    assert "/dev/shm/the-record: entry 3 (pid 7)" in str(raised.value) and named in str(raised.value)


def _share(held: int, budget: str = "1") -> record.NodeShare:
    return record.NodeShare.join(held=held, least=1, most=3, environment=_environment(budget))


def test_one_earned_trial_at_a_time_on_the_node_and_earned_readers_outside_the_count():
    first, second = _share(1), _share(1)
    try:
        assert first.earn(1) and first.earning and first.now.earned == 1
        assert first.now.room == -1  # The two leasts on a budget of 1: the earned reader is not counted.
        assert not second.earn(1) and second.now.earning_elsewhere  # The first's trial is in flight.
        assert [(entry.held, entry.earned, entry.flags) for entry in budget_entries()] == \
            [(2, 1, record.FLAG_EARNING), (1, 0, 0)]
        first.earning = False  # Its trial ended (the tuner's judge): the next update clears the flag.
        assert first.publish(2).yields == 0  # Past the budget, but an earned reader is never asked back.
        assert second.earn(1) and second.now.earned == 1
        second.earning = False
        second.publish(2)
        assert first.publish(1).earned == 0  # A retirement of its own: the earned reader goes first.
        assert [(entry.held, entry.earned, entry.flags) for entry in budget_entries()] == [(1, 0, 0), (2, 1, 0)]
    finally:
        first.close()
        second.close()
    assert not os.path.exists(record.record_path())


def test_readers_the_split_asks_back_are_never_the_earned_ones_and_an_earned_one_given_back_needs_no_turn():
    mine = _share(2, budget="2")  # Alone: both within the budget.
    try:
        assert mine.started == 2 and mine.earn(2) and mine.now.held == 3
        mine.earning = False
        assert mine.publish(2).earned == 0  # Its own retirement: the earned reader goes, the budget's two stay.
        assert mine.earn(2)
        mine.earning = False
        mine.publish(3)
        late = _share(1, budget="2")  # Joins with its least where there is no room: the node is past the budget.
        try:
            assert late.earn(1) and late.earning  # Its trial in flight...
            standing = mine.publish(3)
            assert (standing.yields, standing.held, standing.earned) == (1, 2, 1)  # ...a budget reader given.
            assert mine.publish(1).earned == 0  # Its own retirement of two: the earned one first.
            assert mine.earn(1, trial=False) and mine.now.earned == 1  # Given back after a trial: no turn needed.
        finally:
            late.close()
    finally:
        mine.close()
    assert not os.path.exists(record.record_path())


def test_a_loader_back_from_idle_has_no_earned_readers_and_gives_them_back_as_any(monkeypatch):
    monkeypatch.setattr(record, "IDLE_SECONDS_MIN", 0.05)
    mine, other = _share(1), _share(1)
    try:
        assert mine.earn(1)
        mine.earning = False
        mine.publish(2)
        time.sleep(0.2)  # Its trainer away: idle, counted as its least.
        assert other.publish(1).idle_loaders == 1
        standing = mine.publish(2)
        assert standing.returning and standing.earned == 0 and standing.yields == 1  # Its earned reader, given back.
        assert [(entry.held, entry.earned) for entry in budget_entries()] == [(1, 0), (1, 0)]
    finally:
        mine.close()
        other.close()
    assert not os.path.exists(record.record_path())


# ---- Two Tuners on a modelled node -----------------------------------------------------------

_CORES = 2
_TRAINER_CORES = 0.02  # A trainer that sleeps through a GPU step, and takes its batch.
_WINDOW_STEP_SECONDS = 0.25


class _Rank:
    """One rank of the modelled node: its trainer's step (0: it always waits), a batch's CPU
    and off-CPU time in a reader, and the most batches a second its readers deliver together
    (a lock they queue on; None: none). Its readings are those of bottleneck.ring_reading."""

    def __init__(self, node, step_s: float, cpu_s: float, off_cpu_s: float = 0.0, rate_most: float | None = None):
        self.node, self.step_s, self.cpu_s, self.off_cpu_s, self.rate_most = node, step_s, cpu_s, off_cpu_s, rate_most
        self.pool = _ModelledPool(3, 1, least=1)
        self.tuner: autotune.Tuner | None = None  # _start's.
        self.waited_ns = 0
        self.busy, self.batches, self.cpu, self.queued = ([0.0] * 3 for _ in range(4))
        self.rate = 0.0

    def wants_per_reader(self) -> float:
        """The share of a core each reader would use: all it can (cpu / (cpu + off-CPU)), less
        where the trainer or the lock takes fewer batches than that would fill."""
        readers = self.pool.active_count
        full = self.cpu_s / (self.cpu_s + self.off_cpu_s)
        needed = [1 / self.step_s if self.step_s else float("inf"), self.rate_most or float("inf")]
        return min(full, min(needed) * self.cpu_s / readers)

    def run(self, seconds: float, share: float) -> float:
        """Runs its readers `seconds` with `share` of a core each; the cores they used."""
        readers = self.pool.active_count
        self.rate = rate = readers * share / self.cpu_s
        demand_limited = self.step_s and rate >= 1 / self.step_s - 1e-9
        capped = self.rate_most is not None and rate >= self.rate_most - 1e-9
        for index in range(readers):
            on_cpu = share * seconds
            busy = (on_cpu + on_cpu * self.off_cpu_s / self.cpu_s) if demand_limited else seconds
            queued = 0.0 if demand_limited or capped else seconds - on_cpu - on_cpu * self.off_cpu_s / self.cpu_s
            self.busy[index] += busy
            self.cpu[index] += on_cpu
            self.queued[index] += max(0.0, queued)
            self.batches[index] += rate * seconds / readers
        wait = 0.0 if demand_limited else max(0.0, min(0.97, 1 - rate * self.step_s))
        self.waited_ns += int(wait * seconds * 1e9)
        return readers * share

    def read(self) -> Reading:
        readers = tuple(ReaderCounters(1000 + index, int(self.busy[index] * 1e9), int(self.batches[index]),
                                       cpu_ns=int(self.cpu[index] * 1e9), queued_ns=int(self.queued[index] * 1e9))
                        for index in range(3))
        node = self.node
        return Reading(node.now_ns, self.waited_ns, readers, 14, 0, node.idle_ns, node.total_ns, _CORES)


class _Node:
    """Cores shared by every rank's readers as a fair scheduler shares them: each reader gets
    an equal part, and what one does not want goes to the others (water-filling)."""

    def __init__(self) -> None:
        self.now_ns, self.idle_ns, self.total_ns = 1, 0, 0
        self.ranks: list[_Rank] = []

    def rank(self, *arguments, **keywords) -> _Rank:
        self.ranks.append(_Rank(self, *arguments, **keywords))
        return self.ranks[-1]

    def run(self, seconds: float) -> None:
        wants = {index: rank.wants_per_reader() for index, rank in enumerate(self.ranks)}
        shares, left = {}, float(_CORES)
        while wants:  # The readers that want less than an equal part get what they want.
            part = left / sum(self.ranks[index].pool.active_count for index in wants)
            small = {index: want for index, want in wants.items() if want <= part}
            if not small:
                shares.update({index: part for index in wants})
                break
            for index, want in small.items():
                shares[index] = want
                left -= want * self.ranks[index].pool.active_count
                del wants[index]
        used = sum(rank.run(seconds, shares[index]) for index, rank in enumerate(self.ranks))
        idle = max(0.0, _CORES - used - _TRAINER_CORES * len(self.ranks))
        self.idle_ns += int(idle * seconds * 1e9)
        self.total_ns += int(_CORES * seconds * 1e9)
        self.now_ns += int(seconds * 1e9)


def _start(node: _Node) -> list[autotune.Tuner]:
    """A Tuner for each rank, each with its own entry in the test run's real record, under the
    torchrun case's budget: 2 cores less 2 trainers, floored at 1."""
    for rank in node.ranks:
        share = record.NodeShare.join(held=1, least=1, most=3, environment=_environment("1"))
        rank.tuner = autotune.Tuner(rank.pool, rank.read, share=share, clock=lambda: node.now_ns)
    return [rank.tuner for rank in node.ranks]


def _run(node: _Node, tuners: list[autotune.Tuner], seconds: float, each=None) -> None:
    for _ in range(round(seconds / _WINDOW_STEP_SECONDS)):
        node.run(_WINDOW_STEP_SECONDS)
        for tuner in tuners:
            tuner.tune()
        if each is not None:
            each()


def _earned_trials_in_flight(tuners: list[autotune.Tuner]) -> int:
    trials = [tuner.prober.trial for tuner in tuners]
    in_flight = sum(trial is not None and trial.earned and trial.change > 0 for trial in trials)
    flagged = sum(bool(entry.flags & record.FLAG_EARNING) for entry in budget_entries())
    assert flagged == in_flight, (flagged, trials)
    return in_flight


@pytest.fixture
def node():
    """A modelled node whose ranks' entries leave the record with the test."""
    made = _Node()
    yield made
    for rank in made.ranks:
        if rank.tuner is not None:
            rank.tuner.share.close()
    assert not os.path.exists(record.record_path())


def test_the_rank_whose_trainer_waits_earns_a_reader_on_the_idle_cpu_and_keeps_it(node):
    """bench/autotune.py's torchrun case: rank A's trainer waits for its one busy reader, rank
    B's reader needs a third of a core for its 20 ms steps, and about 0.6 of a core is idle."""
    fast, slow = node.rank(0.0, 0.01), node.rank(0.02, 0.007)
    tuners = _start(node)
    rates = []
    _run(node, tuners, 60, each=lambda: rates.append(fast.rate))
    assert (fast.pool.active_count, slow.pool.active_count) == (2, 1), tuners[0].report()
    report = tuners[0].report()
    assert report["readers_earned"] == 1 and tuners[1].report()["readers_earned"] == 0
    why = report["reader_change"]["why"]
    assert why.startswith("earned trial") and "0.6 cores idle (at least 0.5)" in why, why
    assert report["reader_trial"].startswith("kept: 2 readers delivered")
    assert [(entry.held, entry.earned, entry.flags) for entry in budget_entries()] == [(2, 1, 0), (1, 0, 0)]
    assert rates[-1] > 1.5 * rates[0]
    _run(node, tuners, 120)  # And it stays: no core is idle now, and the readers hardly wait for one.
    assert (fast.pool.active_count, slow.pool.active_count) == (2, 1) and tuners[0].changes == 1


def test_an_earned_reader_that_does_not_pay_is_undone_and_tried_again_only_after_a_back_off(node):
    """Rank A's readers deliver no more together than one alone (a lock they queue on)."""
    fast, slow = node.rank(0.0, 0.01, rate_most=100.0), node.rank(0.02, 0.007)
    tuners = _start(node)
    counts = []
    _run(node, tuners, 200, each=lambda: counts.append(fast.pool.active_count))
    tried_s = [index * _WINDOW_STEP_SECONDS for index, (before, after) in enumerate(zip(counts, counts[1:]))
               if after > before]
    gaps = [later - earlier for earlier, later in zip(tried_s, tried_s[1:])]
    assert len(gaps) == 4, tried_s  # The fifth back-off (128 s) runs past the end.
    for undone, gap in enumerate(gaps):  # Each undone trial's back-off, doubled, and the trial's few seconds.
        backoff = probe.BACKOFF_FIRST_SECONDS * 2 ** undone
        assert backoff <= gap <= backoff + 2 * probe.PROBE_WINDOWS + 1, (undone, tried_s)
    assert sum(count == 1 for count in counts) >= 0.9 * len(counts), counts[::4]
    assert tuners[0].prober.last.startswith("undone: 2 readers delivered 1.00x what 1 did"), tuners[0].prober.last
    assert (fast.pool.active_count, slow.pool.active_count, tuners[0].report()["readers_earned"]) == (1, 1, 0)
    assert [(entry.held, entry.earned, entry.flags) for entry in budget_entries()] == [(1, 0, 0), (1, 0, 0)]


def test_an_earned_reader_goes_where_the_node_gets_crowded_and_does_not_come_back_while_no_cpu_is_idle(node):
    fast, slow = node.rank(0.0, 0.01), node.rank(0.02, 0.007)
    tuners = _start(node)
    _run(node, tuners, 60)
    assert tuners[0].report()["readers_earned"] == 1
    slow.cpu_s = 0.03  # Rank B's batches now cost more than a core at its step: all three readers want one.
    counts = []
    _run(node, tuners, 120, each=lambda: counts.append(fast.pool.active_count))
    retired = tuners[0].report()["reader_change"]
    assert fast.pool.active_count == 1 and tuners[0].report()["readers_earned"] == 0, retired
    assert "wait for a core" in retired["why"] and (retired["from"], retired["to"]) == (2, 1), retired
    assert "the earned reader is not added back: 0.0 cores idle" in tuners[0].report()["reader_trial"]
    assert sum(count == 1 for count in counts[-200:]) == 200, counts[::4]  # Not back while no CPU is idle.
    assert [(entry.held, entry.earned) for entry in budget_entries()] == [(1, 0), (1, 0)]


def test_one_earned_trial_runs_at_a_time_on_the_node(node):
    """Both ranks' trainers wait for readers that leave 0.3 of a core each idle (a third of
    each fill off the CPU): both could earn a reader at once."""
    node.rank(0.0, 0.007, off_cpu_s=0.003)
    node.rank(0.0, 0.007, off_cpu_s=0.003)
    tuners = _start(node)
    in_flight = []
    _run(node, tuners, 120, each=lambda: in_flight.append(_earned_trials_in_flight(tuners)))
    assert max(in_flight) == 1 and sum(in_flight) >= 4, in_flight  # A trial ran, and never two.
    assert sum(tuner.report()["readers_earned"] for tuner in tuners) >= 1


def test_a_budget_the_user_set_is_never_earned_past(monkeypatch):
    """SHMLOADER_CPU_BUDGET caps the node's readers, earned ones included: a loader under it
    earns none, and auto's most is the cap, not one past it."""
    share = record.NodeShare.join(held=1, least=1, most=3,
                                  environment={**os.environ, defaults.CPU_BUDGET_VARIABLE: "1"})
    try:
        assert share.capped and not share.earn(1)
        assert share.now is None or share.now.earned == 0
    finally:
        share.close()
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "3")
    assert AutoReaders().resolve()[2] == 3
    monkeypatch.delenv(defaults.CPU_BUDGET_VARIABLE)
    assert AutoReaders().resolve()[2] == defaults.node_budget() + 1

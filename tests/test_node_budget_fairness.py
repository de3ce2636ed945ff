"""The node's reader budget between loaders that do not all iterate, or that come late: an idle
loader's readers past its least are room for one that waits, and it gives them back when it
iterates again (batches unchanged); a loader whose steps are merely slow is never taken for
idle; loaders that join, at once or onto a budget already taken, start within it (their
least where there is no room, and the others give back); fixed loaders are counted, not cut.
The split's rules against a modelled node first, then real loaders and processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import budget_entries, child_environment, no_earned_readers, wait_until
from dataset_fixtures import Sleepy
from shmloader import ShmDataLoader
from shmloader import session as session_module
from shmloader.plan import defaults
from shmloader.plan.options import AutoReaders
from shmloader.readers import autotune
from shmloader.readers import budget_record as record
from shmloader.readers.node_budget import Holding, equal_part, grant, room, yields

# Children run here, outside the checkout: its source would shadow an installed package (CI).
HERE = os.path.dirname(os.path.abspath(__file__))

# ---- The split, as pure functions ---------------------------------------------------------


@st.composite
def _loaders(draw, count_max: int = 6, earned: bool = False):
    """Loaders fixed (readers=N) or changing, idle or not, with what they ask (and, with
    `earned`, readers earned past the budget: test_earned_readers.py); their readers may take
    the node past its budget (joins where there was no room, a loader back from idle)."""
    holdings = []
    for _ in range(draw(st.integers(1, count_max))):
        least = draw(st.integers(1, 3))
        most = draw(st.integers(least, least + 8))
        held = draw(st.integers(least, most))
        if draw(st.booleans()):
            holdings.append(Holding(held, held, held, idle=draw(st.booleans())))
        else:
            holdings.append(Holding(held, least, most, draw(st.integers(0, 8)), draw(st.integers(0, held - least)),
                                    idle=draw(st.booleans()),
                                    earned=draw(st.integers(0, held - least)) if earned else 0))
    return holdings


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(2, 24), waiting_held=st.integers(1, 4), idle_least=st.integers(1, 3),
       idle_surplus=st.integers(1, 8), asked=st.integers(1, 8))
def test_a_waiting_loader_grows_into_the_readers_an_idle_loader_holds_past_its_least(
        budget, waiting_held, idle_least, idle_surplus, asked):
    idle_held = budget - waiting_held  # The budget is taken.
    if idle_held < idle_least + 1:
        return
    idle_surplus = min(idle_surplus, idle_held - idle_least)
    waiting = Holding(waiting_held, 1, waiting_held + asked, wants=asked)
    asleep = Holding(idle_held, idle_least, idle_held + 2, wants=3)  # Its last wish is old news.
    assert grant(budget, [waiting, asleep], 0, asked) == 0  # While it iterates, its readers are its own.
    away = Holding(idle_held, idle_least, idle_held + 2, wants=3, idle=True)
    granted = grant(budget, [waiting, away], 0, asked)
    assert granted == min(asked, idle_held - idle_least)
    # Back in next(), it finds the node past its budget by what the other took, and gives that back.
    after = [Holding(waiting_held + granted, 1, waiting_held + asked), Holding(idle_held, idle_least, idle_held + 2)]
    assert yields(budget, after, 1, returning=True) == granted
    after[1] = Holding(idle_held - granted, idle_least, idle_held + 2)
    assert room(budget, after) == 0 and yields(budget, after, 0) == 0  # The other keeps what it grew into.


@settings(max_examples=400, deadline=None)
@given(holdings=_loaders(), budget=st.integers(1, 24), data=st.data())
def test_an_idle_loader_counts_as_its_least_as_if_it_were_fixed_there(holdings, budget, data):
    me = data.draw(st.integers(0, len(holdings) - 1))
    holdings[me] = Holding(holdings[me].held, holdings[me].least, holdings[me].most, holdings[me].wants,
                           holdings[me].spare)  # The loader asking has just updated its entry.
    reference = [Holding(holding.least, holding.least, holding.least) if holding.idle and not holding.fixed
                 else Holding(holding.held, holding.least, holding.most, holding.wants, holding.spare)
                 for holding in holdings]
    wanted = data.draw(st.integers(0, 10))
    assert room(budget, holdings) == budget - sum(holding.held for holding in reference)
    assert grant(budget, holdings, me, wanted) == grant(budget, reference, me, wanted)
    assert yields(budget, holdings, me) == yields(budget, reference, me)


@settings(max_examples=400, deadline=None)
@given(holdings=_loaders(), budget=st.integers(1, 24), order=st.randoms(use_true_random=False),
       returning=st.booleans())
def test_a_node_past_its_budget_is_back_within_it_after_each_loader_updates_once(holdings, budget, order, returning):
    """Each changing loader in turn updates (under the lock: it sees what those before gave):
    afterwards the node is within its budget, or every changing loader holds at most its
    equal part or its least; none goes below its least, and a fixed or idle one gives nothing."""
    turns = [index for index, holding in enumerate(holdings) if not holding.idle]  # An idle one makes no update.
    order.shuffle(turns)
    part = equal_part(budget, holdings)  # Depends on the fixed and idle loaders and the count only.
    for turn, me in enumerate(turns):
        mine, back = holdings[me], returning and turn == 0
        given_up = yields(budget, holdings, me, returning=back)
        assert 0 <= given_up <= mine.held - mine.least
        if mine.fixed:
            assert given_up == 0
        elif back and room(budget, holdings) < 0:  # Back from idle: the whole excess, down to its least.
            assert given_up == min(-room(budget, holdings), mine.held - mine.least)
        holdings[me] = Holding(mine.held - given_up, mine.least, mine.most, mine.wants, mine.spare)
        assert equal_part(budget, holdings) == part
    changing = [holding for holding in holdings if not holding.fixed and not holding.idle]
    assert room(budget, holdings) >= 0 or all(holding.held <= max(holding.least, part) for holding in changing)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(1, 16), joins=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 6)), min_size=1,
                                                  max_size=8))
def test_loaders_that_join_one_after_another_start_within_the_budget_or_with_their_least(budget, joins):
    """A join is one update under the lock: the loader's least, and as much of the rest of its
    start as the room gives (budget_record.NodeShare.join), one loader after the other."""
    holdings: list[Holding] = []
    for least, more in joins:
        before = sum(holding.held for holding in holdings)
        holdings.append(Holding(least, least, least + more + 2, wants=more))
        held = least + grant(budget, holdings, len(holdings) - 1, more)
        holdings[-1] = Holding(held, least, least + more + 2)
        assert least <= held <= least + more
        if before + least <= budget:
            assert before + held <= budget
        else:
            assert held == least  # No room: its least, and the others give back.


# ---- Real loaders and processes ------------------------------------------------------------


_entries = budget_entries


def _counted() -> int:
    """The readers the record counts against the budget now (an idle loader's least)."""
    now_ns = time.monotonic_ns()
    return sum(entry.holding(now_ns).counted for entry in _entries())


def _record_gone() -> bool:
    return not os.path.exists(record.record_path())


def _decide_often(monkeypatch, idle_seconds: float = 0.6) -> None:
    """Tuner windows of 0.2 s, a periodic check every 8 batches or 0.2 s, and loaders taken
    for idle after three windows: the production timings (1 s, 64 batches, 1 s, 3 s) divided
    by five, so that a test takes seconds."""
    monkeypatch.setattr(autotune.Tuner, "window_seconds", 0.2)
    monkeypatch.setattr(session_module, "_READER_CHECK_BATCHES", 8)
    monkeypatch.setattr(session_module, "_READER_CHECK_SECONDS", 0.2)
    monkeypatch.setattr(record, "IDLE_SECONDS_MIN", idle_seconds)


_SEED, _BATCH = 3, 4


def _reference(dataset, steps: int) -> list[np.ndarray]:
    with ShmDataLoader.from_dataset(dataset, batch_size=_BATCH, seed=_SEED, readers=1) as loader:
        return [batch["x"].copy() for _, batch in zip(range(steps), loader)]


def test_an_idle_loaders_readers_go_to_one_that_waits_and_come_back_when_it_iterates_again(monkeypatch):
    _decide_often(monkeypatch, idle_seconds=1.5)  # The training loader's entry stays fresh while validation starts.
    no_earned_readers(monkeypatch)
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "4")
    expected = _reference(Sleepy(0.0), 40)
    with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=_BATCH, seed=_SEED,
                                    readers=AutoReaders(start=2, most=4)) as validation, \
            ShmDataLoader.from_dataset(Sleepy(0.004), batch_size=_BATCH, readers=AutoReaders(start=2, most=4)) as train:
        assert validation.stats()["reader_count"] == 2 and train.stats()["reader_count"] == 2
        batches, deadline = iter(train), time.monotonic() + 60
        while train.stats()["reader_count"] < 3 and time.monotonic() < deadline:  # Validation is not iterated.
            next(batches)
            assert _counted() <= 4
        grown = train.stats()["reader_change"]
        assert train.stats()["reader_count"] == 3, grown  # 4 less validation's least; not 2 for good.
        assert train.stats()["node_budget"]["idle_loaders"] == 1
        assert validation.stats()["reader_count"] == 2  # Asleep beside its full ring, not stopped.
        # Validation iterates again: its first check finds the node past its budget, and gives back.
        batches = iter(validation)
        np.testing.assert_array_equal(next(batches)["x"], expected[0], err_msg="step 0")
        given = validation.stats()["reader_change"]
        assert validation.stats()["reader_count"] == 1, given
        assert "this loader was idle" in given["why"] and (given["from"], given["to"]) == (2, 1), given
        assert sum(entry.held for entry in _entries()) == 4
        for step in range(1, 40):  # The retired reader's step, and every other, as one reader fills them.
            np.testing.assert_array_equal(next(batches)["x"], expected[step], err_msg=f"step {step}")
            assert _counted() <= 4
        assert validation.stats()["reader_restarts"] == 0
    assert _record_gone()


def test_a_loader_whose_steps_are_slow_is_never_taken_for_idle(monkeypatch):
    """Its trainer calls next() once a second, past the least idle time (0.6 s here), and its
    readers fill its ring at once: the time between its updates tells the others how long it
    may go without one, so after its first slow step (the one its published pace was its
    fast first wait's) it is never taken for idle, nor made to give readers back as one (it
    may give spare readers to the loader that waits beside it, as any loader)."""
    _decide_often(monkeypatch)
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "3")
    with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=_BATCH, readers=AutoReaders(start=2, most=3)) as slow, \
            ShmDataLoader.from_dataset(Sleepy(0.004), batch_size=_BATCH, readers=AutoReaders(start=1, most=3)) as waits:
        slow_batches, waiting_batches = iter(slow), iter(waits)
        next(slow_batches)
        changes = []
        for step in range(6):  # One slow step a second; the other loader's trainer waits meanwhile.
            step_end = time.monotonic() + 1.0
            while time.monotonic() < step_end:
                next(waiting_batches)
                if step >= 1:  # Its first window after the first batch measures its pace.
                    now_ns = time.monotonic_ns()
                    assert not any(record.idle(entry, now_ns) for entry in _entries()), _entries()
                    assert _counted() <= 3
            next(slow_batches)
            changes.append(slow.stats()["reader_change"])
        later = [change for change in changes[1:] if change is not None and change != changes[0]]
        assert not any("was idle" in change["why"] for change in later), changes
        assert slow.stats()["node_budget"]["idle_loaders"] == 0
    assert _record_gone()


def test_the_idle_time_a_loader_publishes_is_the_longest_of_the_least_its_pace_and_its_rings_fill():
    share = record.NodeShare.join(held=1, least=1, most=2)
    try:
        for gap, fill, expected in ((0.1, 0.0, record.IDLE_SECONDS_MIN), (10.0, 2.0, 30.0), (0.5, 45.0, 45.0),
                                    (1e9, 0.0, 86_400.0)):
            share.pace(gap, fill)
            share.publish(1)
            assert [entry.idle_after_ms for entry in _entries()] == [int(expected * 1000)], (gap, fill)
        now_ns = time.monotonic_ns()
        entry = record._Entry(pid=1, held=2, least=1, most=2, budget=2, idle_after_ms=0, updated_ns=now_ns)
        assert not record.idle(entry, now_ns + int(record.IDLE_SECONDS_MIN * 1e9))  # 0 written: the least applies.
        assert record.idle(entry, now_ns + int(record.IDLE_SECONDS_MIN * 1e9) + 1)
    finally:
        share.close()
    assert _record_gone()


_JOINER = textwrap.dedent("""
    import os, sys, time
    from shmloader.readers.budget_record import NodeShare
    while not os.path.exists(sys.argv[1]):  # Every joiner waits here, then all join at once.
        time.sleep(0.001)
    share = NodeShare.join(held=3, least=1, most=4)
    print(share.started, flush=True)
    sys.stdin.readline()  # Its first window: the update gives back what the split asks.
    print(share.publish(share.started).held, flush=True)
    sys.stdin.read()  # Held until the test is done.
    share.close()
""")


def test_loaders_that_join_at_once_start_within_the_budget_or_with_their_least_and_settle_within_it(
        tmp_path, monkeypatch):
    """Six loaders start at once, each asking for three readers of a budget of eight: those
    that find room take it, the others their least (one), never a start on top of a budget
    already taken; at their first window those above the equal part give back."""
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "8")
    go = tmp_path / "go"
    children = [subprocess.Popen([sys.executable, "-c", _JOINER, str(go)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, cwd=HERE, env=child_environment())
                for _ in range(6)]
    try:
        time.sleep(0.5)  # Started and importing: the joins below come close together.
        go.write_text("")
        started = [int(child.stdout.readline()) for child in children]
        assert sorted(entry.held for entry in _entries()) == sorted(started)
        assert all(count >= 1 for count in started), started
        least_only = sum(1 for count in started if count == 1)
        assert sum(started) <= 8 + least_only, started  # Six starts of 3 on top of each other would be 18.
        settled = []
        for child in children:  # One update each, one after the other, as their windows come.
            child.stdin.write("\n")
            child.stdin.flush()
            settled.append(int(child.stdout.readline()))
        assert sorted(entry.held for entry in _entries()) == sorted(settled)
        assert sum(settled) <= 8 and all(count >= 1 for count in settled), (started, settled)
    finally:
        for child in children:
            child.stdin.close()
            child.wait(timeout=30)
    assert _record_gone()


_HOLDER = textwrap.dedent("""
    import sys
    from shmloader.readers.budget_record import NodeShare
    share = NodeShare.join(held=4, least=1, most=4)
    print(share.started, flush=True)
    for line in sys.stdin:  # One window's update per line: what the split asks it to give up.
        standing = share.publish(int(line))
        print(standing.yields, standing.past_budget, flush=True)
    share.close()
""")


def test_a_loader_that_comes_late_onto_a_taken_budget_starts_its_least_and_the_others_give_back(monkeypatch):
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "4")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=HERE, env=child_environment())
    try:
        assert holder.stdout.readline().strip() == "4"  # Alone: its whole start.
        with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=AutoReaders(start=3, most=4)) as late:
            assert late.stats()["reader_count"] == 1  # Its least: no room, and not its start of 3 on top.
            assert late.stats()["node_budget"]["node_readers"] == 5
            holder.stdin.write("4\n")
            holder.stdin.flush()
            assert holder.stdout.readline().split() == ["1", "True"]  # Past the budget: it gives one back.
            assert sorted(entry.held for entry in _entries()) == [1, 3]
            assert next(iter(late))["x"].shape == (4, 8)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert _record_gone()


def test_a_fixed_loader_joins_with_all_its_readers_past_a_taken_budget(monkeypatch):
    monkeypatch.setenv(defaults.CPU_BUDGET_VARIABLE, "2")
    taken = record.NodeShare.join(held=2, least=1, most=2)
    try:
        with ShmDataLoader.from_dataset(Sleepy(0.0), batch_size=4, readers=3) as fixed:
            assert fixed.stats()["reader_count"] == 3  # Counted, not cut.
            assert fixed.stats()["node_budget"]["node_readers"] == 5
            standing = taken.publish(2)
            assert (standing.yields, standing.held) == (1, 1)  # The changing one gives back to its least.
    finally:
        taken.close()
    assert _record_gone()

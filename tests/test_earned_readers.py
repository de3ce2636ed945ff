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
from hypothesis import given, settings, strategies as st

from conftest import budget_entries
from shmloader.errors import NodeBudgetError
from shmloader.plan import defaults
from shmloader.readers import budget_record as record
from shmloader.readers.node_budget import Holding, grant, room, yields

# ---- The split, as pure functions ---------------------------------------------------------


@st.composite
def _loaders(draw):
    """Loaders fixed or changing, idle or not, the changing ones with earned readers; the node
    may run past its budget."""
    holdings = []
    for _ in range(draw(st.integers(1, 6))):
        least = draw(st.integers(1, 3))
        most = draw(st.integers(least, least + 8))
        held = draw(st.integers(least, most))
        if draw(st.booleans()):
            holdings.append(Holding(held, held, held, idle=draw(st.booleans())))
        else:
            holdings.append(Holding(held, least, most, draw(st.integers(0, 8)), draw(st.integers(0, held - least)),
                                    draw(st.booleans()), earned=draw(st.integers(0, held - least))))
    return holdings


def _without_earned(holding: Holding) -> Holding:
    """The loader as if its earned readers did not run: the reference the split must match."""
    return dataclasses.replace(holding, held=holding.held - holding.earned, earned=0)


@settings(max_examples=400, deadline=None)
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


@settings(max_examples=300, deadline=None)
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
    return record.NodeShare.join(held=held, least=1, most=3,
                                 environment={**os.environ, defaults.CPU_BUDGET_VARIABLE: budget})


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

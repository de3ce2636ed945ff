"""Earned readers (readers/earned.py): a loader runs a reader past the node's count budget where
a trial measured the idle CPU for it. The split's rules (earned readers take no room, make no
other loader give back, and an idle loader's count for nothing), the record's field and its
checks of what another process wrote, and two real Tuners sharing one real record on a
modelled node of 2 cores: the rank whose trainer waits earns a reader where it pays, gives it
back where it does not or where the node gets crowded, and one earned trial runs at a time."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings, strategies as st

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

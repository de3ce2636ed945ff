"""The node's reader budget split by demand: how many readers a loader may add now (grant)
and how many it should give up for another loader of the node (yields), as pure functions of
what every live loader published in the budget record (readers/budget_record.py).

Each loader publishes a Holding: the readers it runs, its bounds, the readers its rule asked
for and did not get (`wants`), and those it could give up with its trainer not waiting
(`spare`). The record marks a changing loader `idle` that has not updated its entry for a
while (no next() for three of its own steps, three seconds at least, and for as long as its
readers take to fill its ring: budget_record.py says why). The rules, for a node budget of
`budget` readers:

- Counted: what a loader holds less its earned readers (below), and for an idle loader only
  its `least`: its readers past that sit asleep beside a full ring, and are room for the
  others' grants until it comes back. Its wants and spare are old news, and count for nothing.
- grant: an add only into the room the budget has left (budget less every loader's counted
  readers), so the counted readers never pass the budget through an add; where other
  loaders want too, the room is split in proportion to what each asks (demand, not 1/N),
  and a loader at or above the equal part takes none while one below it wants.
- yields, where the node is past its budget (a loader back from idle, one that joined with
  its least where there was no room, or fixed loaders): a loader back from idle gives back
  as much as the node is over, down to its least (the others grew into its readers while it
  was away); any other gives back as much of the excess as its spare readers, or those it
  holds past its equal part, cover, never going below its least. Each gives in its own
  update, under the record's lock, so the second sees what the first gave.
- yields, within the budget: while loaders want more than the room holds, a loader with
  spare readers gives them (its share of the shortfall, in proportion to its spare), so that
  a rank whose trainer waits gets readers from a rank whose readers idle; where none is
  spare, a loader above the equal part gives one a window to a loader below it that wants,
  which ends at an even split between ranks that all wait.
- A fixed loader (readers=N: least == most) counts against the budget and never changes;
  the equal part is what the fixed and idle ones leave, divided among the others.

Earned readers (readers/earned.py): readers a loader runs past the budget because a trial
measured that the node had idle CPU for them and its rate rose. They are room the measured CPU
made, not the budget's: they are not counted, so they take no room from the others, and no
rule here asks for them back (yields gives only readers within the budget, and the equal part
compares those); an earned reader that the CPU no longer carries goes through the earning
loader's own retirement trials (readers/probe.py). An idle loader's earned readers are
nothing of their own: it counts as its least, as ever.

A loader alone on the node has the whole budget's room to itself. Readers that fixed loaders
put past the budget are never taken away from them; the changing loaders give back (above)
until the node is within the budget again, or each holds its equal part or its least.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Holding:
    """One live loader's entry: `held` readers running, between `least` and `most`; `wants`,
    readers its rule asked to add at its last window that the budget did not give; `spare`,
    readers it could retire with its trainer not waiting; `idle`, whether it has not updated
    its entry for longer than its idle time (budget_record.py); `earned`, readers of `held`
    past the budget by a trial that measured the CPU for them (module note)."""

    held: int
    least: int
    most: int
    wants: int = 0
    spare: int = 0
    idle: bool = False
    earned: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.least <= self.most, (self.least, self.most)
        assert self.wants >= 0 and self.spare >= 0, (self.wants, self.spare)
        assert 0 <= self.earned <= max(0, self.held - self.least), (self.earned, self.held, self.least)

    @property
    def fixed(self) -> bool:
        return self.least == self.most

    @property
    def counted(self) -> int:
        """Readers counted against the budget: an idle loader's past its least are the others'
        room; a live one's earned readers are not the budget's."""
        return self.least if self.idle else self.held - self.earned

    @property
    def asking(self) -> int:
        """Readers it asks for: an idle loader's last wish is old news."""
        return 0 if self.idle else self.wants


def room(budget: int, holdings: list[Holding]) -> int:
    """Readers the node may still add (negative where it runs past the budget)."""
    return budget - sum(holding.counted for holding in holdings)


def _changing(holding: Holding) -> bool:
    """Whether the split may change its readers now: neither fixed nor idle."""
    return not holding.fixed and not holding.idle


def equal_part(budget: int, holdings: list[Holding]) -> int:
    """Each changing loader's part where all want more than there is: what the fixed and idle
    ones leave, in equal parts, at least one."""
    changing = sum(1 for holding in holdings if _changing(holding))
    left = budget - sum(holding.counted for holding in holdings if not _changing(holding))
    return max(1, left // max(1, changing))


def _below_part_wanting(budget: int, holdings: list[Holding], me: int) -> bool:
    """Whether another loader below the equal part wants readers."""
    part = equal_part(budget, holdings)
    return any(holding.asking > 0 and holding.counted < part for index, holding in enumerate(holdings) if index != me)


def _others_asking(holdings: list[Holding], me: int) -> int:
    return sum(holding.asking for index, holding in enumerate(holdings) if index != me)


def grant(budget: int, holdings: list[Holding], me: int, wanted: int) -> int:
    """How many of the `wanted` readers loader `me` may add now (module note)."""
    assert budget >= 1 and 0 <= me < len(holdings) and wanted >= 0, (budget, me, len(holdings), wanted)
    mine = holdings[me]
    assert not mine.idle, me  # The loader asking has just updated its entry.
    free = room(budget, holdings)
    if wanted == 0 or free <= 0 or mine.fixed:
        return 0
    others = _others_asking(holdings, me)
    if wanted + others <= free:  # Room for every loader that asks.
        return max(0, min(wanted, mine.most - mine.held))
    if mine.counted >= equal_part(budget, holdings) and _below_part_wanting(budget, holdings, me):
        return 0
    part = max(1, free * wanted // (wanted + others))
    return max(0, min(wanted, free, part, mine.most - mine.held))


def yields(budget: int, holdings: list[Holding], me: int, returning: bool = False) -> int:
    """How many readers loader `me` should retire now (module note); `returning`: its entry
    was idle until this update."""
    assert budget >= 1 and 0 <= me < len(holdings), (budget, me, len(holdings))
    mine = holdings[me]
    assert not mine.idle, me  # The loader asking has just updated its entry.
    # Only readers within the budget are given: earned ones are not the budget's to ask back.
    budgeted = mine.counted
    if mine.fixed or budgeted <= mine.least:
        return 0
    free = room(budget, holdings)
    givable = min(mine.spare, budgeted - mine.least)
    if free < 0:  # Past the budget.
        if returning:
            return min(-free, budgeted - mine.least)
        past_part = budgeted - max(mine.least, equal_part(budget, holdings))
        return min(-free, max(givable, past_part, 0))
    short = _others_asking(holdings, me) - free
    if short <= 0:
        return 0
    if givable > 0:
        spare_total = sum(min(holding.spare, holding.counted - holding.least) for holding in holdings
                          if _changing(holding) and holding.counted > holding.least)
        return min(givable, math.ceil(short * givable / spare_total))
    if budgeted > equal_part(budget, holdings) and _below_part_wanting(budget, holdings, me):
        return 1
    return 0

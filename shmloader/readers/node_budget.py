"""The node's reader budget split by demand: how many readers a loader may add now (grant)
and how many it should give up for another loader of the node (yields), as pure functions of
what every live loader published in the budget record (readers/budget_record.py).

Each loader publishes a Holding: the readers it runs, its bounds, the readers its rule asked
for and did not get (`wants`), and those it could give up with its trainer not waiting
(`spare`). The rules, for a node budget of `budget` readers:

- grant: an add only into the room the budget has left (budget less every loader's readers),
  so the node's readers never pass the budget through an add; where other loaders want too,
  the room is split in proportion to what each asks (demand, not 1/N), and a loader at or
  above the equal part takes none while one below it wants.
- yields: while loaders want more than the room holds, a loader with spare readers gives
  them (its share of the shortfall, in proportion to its spare), so that a rank whose
  trainer waits gets readers from a rank whose readers idle; where none is spare, a loader
  above the equal part gives one a window to a loader below it that wants, which ends at an
  even split between ranks that all wait.
- A fixed loader (readers=N: least == most) counts against the budget and never changes;
  the equal part is what the fixed ones leave, divided among the others.

A loader alone on the node has the whole budget's room to itself. Readers that fixed loaders
or explicit starts put past the budget are never taken away from them: no add follows until
the node is back within it.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Holding:
    """One live loader's entry: `held` readers running, between `least` and `most`; `wants`,
    readers its rule asked to add at its last window that the budget did not give; `spare`,
    readers it could retire with its trainer not waiting."""

    held: int
    least: int
    most: int
    wants: int = 0
    spare: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.least <= self.most, (self.least, self.most)
        assert self.wants >= 0 and self.spare >= 0, (self.wants, self.spare)

    @property
    def fixed(self) -> bool:
        return self.least == self.most


def room(budget: int, holdings: list[Holding]) -> int:
    """Readers the node may still add (negative where fixed loaders run past the budget)."""
    return budget - sum(holding.held for holding in holdings)


def equal_part(budget: int, holdings: list[Holding]) -> int:
    """Each changing loader's part where all want more than there is: what the fixed ones
    leave, in equal parts, at least one."""
    changing = sum(1 for holding in holdings if not holding.fixed)
    left = budget - sum(holding.held for holding in holdings if holding.fixed)
    return max(1, left // max(1, changing))


def _below_part_wanting(budget: int, holdings: list[Holding], me: int) -> bool:
    """Whether another loader below the equal part wants readers."""
    part = equal_part(budget, holdings)
    return any(holding.wants > 0 and holding.held < part for index, holding in enumerate(holdings) if index != me)


def grant(budget: int, holdings: list[Holding], me: int, wanted: int) -> int:
    """How many of the `wanted` readers loader `me` may add now (module note)."""
    assert budget >= 1 and 0 <= me < len(holdings) and wanted >= 0, (budget, me, len(holdings), wanted)
    mine = holdings[me]
    free = room(budget, holdings)
    if wanted == 0 or free <= 0 or mine.fixed:
        return 0
    others = sum(holding.wants for index, holding in enumerate(holdings) if index != me)
    if wanted + others <= free:  # Room for every loader that asks.
        return max(0, min(wanted, mine.most - mine.held))
    if mine.held >= equal_part(budget, holdings) and _below_part_wanting(budget, holdings, me):
        return 0
    part = max(1, free * wanted // (wanted + others))
    return max(0, min(wanted, free, part, mine.most - mine.held))


def yields(budget: int, holdings: list[Holding], me: int) -> int:
    """How many readers loader `me` should retire now for the loaders that want (module note)."""
    assert budget >= 1 and 0 <= me < len(holdings), (budget, me, len(holdings))
    mine = holdings[me]
    if mine.fixed or mine.held <= mine.least:
        return 0
    asked = sum(holding.wants for index, holding in enumerate(holdings) if index != me)
    short = asked - max(0, room(budget, holdings))
    if short <= 0:
        return 0
    givable = min(mine.spare, mine.held - mine.least)
    if givable > 0:
        spare_total = sum(min(holding.spare, holding.held - holding.least) for holding in holdings
                          if not holding.fixed and holding.held > holding.least)
        return min(givable, math.ceil(short * givable / spare_total))
    if mine.held > equal_part(budget, holdings) and _below_part_wanting(budget, holdings, me):
        return 1
    return 0

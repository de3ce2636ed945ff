"""Batches the trainer keeps past their slot's turn: each gets memory of its own when the ring needs its slot.

A batch's arrays view its slot, so a batch the user keeps (a list of labels, `list(loader)`,
a peek with next(iter(loader))) would hold its slot for good. When next() needs a slot a
batch still holds, or a seek needs every slot, the oldest held batches' pages become
private memory at the same address (Ring.detach_slot: an anonymous copy mremap'ed over
them), so their arrays, and any tensor or pointer made of them, keep their values; the
slots go back to the readers, mapped anew. Zero copy stays the normal case: a loop that
lets go of its batches never gets here.

Memory so kept is bounded (plan/defaults.kept_bytes_max): past the bound SlotsExhaustedError
names the batches, their bytes and the bound. Two cases keep the slot instead, and next()
waits hold_timeout for the batch to go (readers/supervision.py): under pin_memory, where
the device has the ring's pages registered (a copy to the device would read the readers'
new rows, not the batch's), and for a batch held when this process forked (the child maps
the same shared pages).

Lifetimes: the memory of a kept batch goes when the last array over it goes (the slot's
mapping from map_slot is a buffer with a finalizer), except for the first batch kept of
each slot, whose copy lies inside the ring's own mapping and goes with the ring: a ring's
worth at most. Nothing here refers to the cursor, the session or the loader (session.py's
lifetimes note): the cursor is passed to each call.
"""

from __future__ import annotations

import gc
import itertools
import weakref

from .errors import SlotsExhaustedError
from .lifecycle import Resources, interrupts_deferred
from .ring.slot_layout import SlotLayout

# Steps a message lists before "...".
_STEPS_SHOWN = 10


def _shown(steps) -> str:
    ordered = sorted(steps)
    return ", ".join(map(str, ordered[:_STEPS_SHOWN])) + (", ..." if len(ordered) > _STEPS_SHOWN else "")


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


class KeptBatches:
    """The batches of one loader given memory of their own, and the choice of which to give it.

    `ahead`: how many steps from next() on should be free for the readers once room is
    made: a held batch whose slot's next step falls within them is given memory of its
    own, oldest first. The ring less the trainer's own slots with readers, so that they
    stay busy while the trainer catches up (one copy per kept batch either way); 1 with
    readers=0, which fill only the step next() needs. `local`: readers=0's local reader,
    whose outputs over a slot are bound anew."""

    def __init__(self, resources: Resources, slot: SlotLayout, slots: int, ahead: int, bytes_max: int,
                 local=None) -> None:
        assert slots >= 1 and ahead >= 1, (slots, ahead)
        self.resources, self.slot, self.slots, self.ahead, self.local = resources, slot, slots, ahead, local
        self.bytes_max = bytes_max
        self.slot_bytes = resources.ring.layout.slot_stride  # What each kept batch takes: its slot's pages.
        # token -> step of each batch given memory of its own, until that memory goes.
        self._kept: dict[int, int] = {}
        self._tokens = itertools.count()

    # What is kept.

    @property
    def count(self) -> int:
        return len(self._kept)

    @property
    def kept_bytes(self) -> int:
        return len(self._kept) * self.slot_bytes

    def _remember(self, memory, step: int) -> None:
        """Counts the batch of `step`, whose pages in `memory` are its own now, until they go."""
        token = next(self._tokens)
        self._kept[token] = step
        if memory is not self.resources.ring.memory:  # The ring's own mapping goes with the ring only.
            weakref.finalize(memory, self._kept.pop, token, None)

    # Whether a batch may be given memory of its own.

    def refusal(self, slot: int, step: int) -> str | None:
        """Why the batch of `step` cannot keep `slot`'s pages, or None where it can."""
        if self.resources.pinned is not None:
            return (f"under pin_memory the device has the ring's pages registered, and a copy of batch {step} to the "
                    f"device would read the rows the readers write there next")
        if (slot, step) in self.resources.held_at_fork:
            return ("this process forked while it was held, and a child that has not exec'd shares its memory, "
                    "which the readers would fill anew")
        return None

    def check_detachable(self, slot: int, step: int) -> None:
        """Raises where the batch of `step` cannot keep `slot`'s pages (a seek's check)."""
        if self.resources.pinned is not None:
            raise RuntimeError(f"cannot seek while batch {step} is held under pin_memory; release every batch first")
        if (slot, step) in self.resources.held_at_fork:
            raise RuntimeError(f"cannot seek while batch {step} is held: {self.refusal(slot, step)}; release the "
                               f"batch (or copy what you keep) first")

    def check_room(self, count: int, step: int, held: dict[int, int]) -> None:
        """Raises SlotsExhaustedError where `count` more kept batches would pass the bound,
        after one collection (batches in reference cycles go with it)."""
        if self.kept_bytes + count * self.slot_bytes <= self.bytes_max:
            return
        gc.collect()
        if self.kept_bytes + count * self.slot_bytes <= self.bytes_max:
            return
        raise SlotsExhaustedError(
            f"step {step} needs a slot that batch {min(held.values())} still holds, and the batches this loader "
            f"already gave memory of their own take {_mib(self.kept_bytes)} ({self.count} batches of "
            f"{_mib(self.slot_bytes)}, steps {_shown(self._kept.values())}; still held by your code now: steps "
            f"{_shown(held.values())}): {count} more would pass the bound of {_mib(self.bytes_max)} "
            f"(plan/defaults.KEPT_MEMORY_SHARE of this machine's memory). Keep less of each batch: copy the part "
            f"you keep (np.array(batch['label']), tensor.clone()) and drop the batch, or drop batches once used.")

    # Giving memory of their own.

    def make_room(self, cursor, step: int) -> str | None:
        """next() found `step`'s slot held by a batch: gives it, and the other held batches
        whose slots' next steps lie within `ahead` of `step`, memory of their own, oldest
        first, and requests those steps. Returns None once `step`'s slot is requested, else
        why that batch cannot be given memory of its own (next() then waits as before).
        SlotsExhaustedError at the bound."""
        held = cursor.held()
        slot = step % self.slots
        if slot not in held:
            return None  # Let go meanwhile (next() looks again).
        reason = self.refusal(slot, held[slot])
        if reason is not None:
            return reason
        chosen = [(held_step, held_slot) for held_slot, held_step in held.items()
                  if held_step + self.slots < min(step + self.ahead, cursor.end_step)
                  and self.refusal(held_slot, held_step) is None]
        chosen.sort()
        try:
            self.check_room(len(chosen), step, held)
        except SlotsExhaustedError:
            self.check_room(1, step, held)  # At least the batch next() needs, where that still fits.
            chosen = [(held[slot], slot)]
        for held_step, held_slot in chosen:
            try:
                self.detach(cursor, held_slot, held_step)
            except OSError as error:
                raise SlotsExhaustedError(
                    f"step {step} needs slot {held_slot}, which batch {held_step} still holds, and giving that batch "
                    f"memory of its own failed ({error}) with {self.count} batches kept so far: each kept batch is "
                    f"one mapping (vm.max_map_count bounds them). Keep less of each batch: copy the part you keep "
                    f"and drop the batch.") from None
            cursor.request(held_slot, held_step + self.slots)
        return None

    def detach(self, cursor, slot: int, step: int) -> None:
        """Frees `slot`, which the batch of `step` holds: the batch keeps its pages as memory of
        its own (Ring.detach_slot), so its arrays, and tensors or arrays made of them, keep
        the rows they were given; the cursor, and the local reader with readers=0, take
        arrays over the slot's new mapping, and the slot is IDLE. The caller checked it may
        (refusal). A thread writing into the batch meanwhile may lose what it writes during
        the copy. Whatever can fail comes before the copy, and nothing interrupts what
        follows it: a slot whose pages went to the batch while the cursor kept arrays over
        them would deliver those rows again for later steps."""
        ring = self.resources.ring
        memory = ring.slot_memory(slot)[0]
        fresh = ring.map_slot(slot)
        views = self.slot.views(fresh, 0)
        bound = None if self.local is None else self.local.filler.bind(self.slot.views(fresh, 0))
        with interrupts_deferred():
            ring.detach_slot(slot, fresh)
            cursor.detach(slot, views)
            if bound is not None:
                self.local.outputs[slot] = bound
            self._remember(memory, step)

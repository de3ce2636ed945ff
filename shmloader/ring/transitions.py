"""The slot protocol's state machine: every change of a slot's state word, as one table.

A slot's state word holds the state in its low byte (SHM_STATE_MASK, ring.h) and the filling
reader's index above it (SHM_OWNER_SHIFT): FILLING, READY and FAILED carry the reader r
that claimed the slot ("FILLING|r"); IDLE, REQUESTED and HELD carry none. A new segment
is all zeros: every slot starts IDLE. FAILED is final within a pass: the trainer raises the
reader's error at that step, and nothing requests the slot again (Cursor.request refuses it);
only a new pass (the drop-in's next epoch) makes it IDLE, its reader replaced.

TRANSITIONS below lists each change with who makes it, the one function that does (in C,
Python or Zig) and its memory ordering, the same in every language. Each place in the
code that writes a state word says which of these it is, in a comment reading
"transition: FROM -> TO" (the Zig claim is read from its compare-and-swap);
tests/test_transitions.py finds every such write and checks that the code makes exactly
the changes listed here, each in the function named.

Every read of a state word that acts on it is an acquire load (Ring.state, step_state in
ring/_cursor.c, the claim's scan); the step word is read after it and written before the
store that publishes it. Semaphores only wake waiters; the state word is the truth. A
reader posts a slot's ready semaphore only when the trainer has armed the slot's waiter
flag (a sequentially consistent store of the flag, then a load of the state: a Dekker pair
with the publication's store of the state, then load of the flag), so a semaphore's count
stays within a few posts however long the readers run ahead.
"""

from __future__ import annotations

import dataclasses

from .layout import SlotState

IDLE, REQUESTED, FILLING = SlotState.IDLE, SlotState.REQUESTED, SlotState.FILLING
READY, HELD, FAILED = SlotState.READY, SlotState.HELD, SlotState.FAILED


@dataclasses.dataclass(frozen=True)
class Transition:
    """One change of a slot's state: `where` is "file: function" (file from shmloader/,
    or zig/), the one function whose code makes it."""

    source: SlotState
    target: SlotState
    who: str
    where: str
    ordering: str
    why: str


TRANSITIONS = (
    # The trainer requests a step: the step word and the request time first, then the state.
    Transition(IDLE, REQUESTED, "trainer", "ring/_cursor_type.c: cursor_request",
               "release store, after the step word", "the first ring of steps; after a seek"),
    Transition(READY, REQUESTED, "trainer", "ring/_cursor_type.c: cursor_request",
               "release store, after the step word", "a seek discards a filled step"),
    Transition(FILLING, REQUESTED, "trainer", "ring/_cursor_type.c: cursor_request",
               "release store, after the step word",
               "its reader r died (ReaderPool.retire), or r=0 is the trainer itself (readers=0, a fill that raised)"),
    Transition(HELD, REQUESTED, "trainer", "ring/_cursor.c: cursor_release",
               "release store, after the step word", "nothing refers to the batch any more: the slot's next step"),
    Transition(HELD, IDLE, "trainer", "ring/_cursor.c: cursor_release",
               "release store", "nothing refers to the batch, and the slot's next step is past a finite pass's end"),
    Transition(HELD, IDLE, "trainer", "ring/_cursor_type.c: cursor_detach",
               "release store", "a seek, or next() needing a slot a kept batch holds (kept.py), gives that batch "
               "memory of its own (Ring.detach_slot): the slot is free for the next steps"),
    Transition(FAILED, IDLE, "trainer", "ring/segment.py: Ring.renew_failed",
               "compare-and-swap, acq_rel", "a new pass after a reader failed: it is replaced "
               "(ReaderPool.renew_failed), as torch's DataLoader starts new workers for each epoch"),
    Transition(FILLING, IDLE, "trainer", "ring/segment.py: Ring.renew_failed",
               "compare-and-swap, acq_rel", "a new pass after a reader failed or died with the slot "
               "claimed (while taking the new pass's filler): it has exited, and is replaced"),
    # A reader claims the requested slot with the lowest step.
    Transition(REQUESTED, FILLING, "reader r", "zig/c_api.zig: shm_claim_lowest",
               "compare-and-swap, acq_rel", "two readers never both win a slot"),
    Transition(REQUESTED, FILLING, "reader r", "ring/segment.py: Ring.claim_own",
               "compare-and-swap, acq_rel", "a ring whose steps belong to readers (an IterableDataset's): "
               "reader r claims only steps k with k % readers == r"),
    Transition(FILLING, REQUESTED, "reader r", "ring/segment.py: Ring.claim_own",
               "compare-and-swap, acq_rel, then a post of the work semaphore",
               "the claim's check: the step won is not reader r's lowest requested one, or not its own (requests "
               "landed during its scan), and goes back to be claimed in order"),
    # The claimer publishes (a reader process; the trainer as r=0 with readers=0; the Ray bridge).
    Transition(FILLING, READY, "reader r", "ring/segment.py: Ring.publish",
               "seq_cst store after the data, then a seq_cst load of the waiter flag", "Publisher.publish"),
    Transition(FILLING, FAILED, "reader r", "ring/segment.py: Ring.publish",
               "the same, after the error report", "Publisher.fail"),
    Transition(READY, HELD, "trainer", "ring/_cursor.c: take",
               "relaxed store", "next() hands the batch out; only the trainer reads HELD, and it publishes nothing"),
    Transition(REQUESTED, IDLE, "trainer", "ring/segment.py: Ring.withdraw",
               "compare-and-swap, acq_rel", "a seek takes back a step no reader claimed (one may claim it first)"),
    Transition(FILLING, REQUESTED, "Ray bridge", "ring/segment.py: Ring.give_back",
               "compare-and-swap, acq_rel, then a post of the work semaphore",
               "the claimer hands back a lost actor's step"),
)

# (from, to) of every change the protocol makes, whoever makes it.
EDGES = frozenset((transition.source, transition.target) for transition in TRANSITIONS)

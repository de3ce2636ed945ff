"""readers=0's reader: reader record 0 filling steps synchronously in the trainer's thread,
and the loader's iterator that lets it fill each step just before the cursor takes it.

With readers=0 nothing fills in the background. The iterator's __next__ asks the cursor
what its next step's slot holds (Cursor.next_state); when the step is requested, the local
reader claims it (the lowest requested step, as every reader's claim) and fills and
publishes it by the path a reader process takes (filling.py); then the native next()
finds it READY and takes it as it takes a reader's. So next() never calls up to fill, and
supervision only supervises: the iterator asks it for one thing, the wait for a slot that
a batch from a ring ago still holds, which next() would ask for too.

A fill that raises hands its slot back (FILLING|0 -> REQUESTED, ring/transitions.py) and
its exception reaches the caller as raised, with its own type and traceback; the next
next() tries the same step again. A reader process publishes FAILED with its report
instead, which the trainer raises as a ReaderError: FAILED is final within a pass, and in
the trainer's own thread the user's exception itself, and a retry after fixing its cause,
are what help (PyTorch's num_workers=0 does the same).
"""

from __future__ import annotations

import contextlib
import os

from ..fill.global_seeds import global_states_kept, runs_user_code
from ..remote import step_deadline
from ..ring.batch import cursor_module
from ..ring.publishing import Publisher
from ..ring.segment import Ring
from ..ring.step_codes import StepCode
from .filling import fill_and_publish

# readers=0 starts no reader process: the local reader takes the ring's one record.
LOCAL_RECORD = 0

# Plain ints and the cursor's clock: __next__ compares and reads them once per batch.
_IN_FLIGHT, _HELD = int(StepCode.IN_FLIGHT), int(StepCode.HELD)
_now_ns = cursor_module.Cursor.now_ns


class LocalReader:
    """Reader record 0 in the trainer's process: its StepFiller bound to every slot (arrays
    of its own over them, apart from the cursor's, whose references tell whether a batch is
    held) and its record's counters (a Publisher, as a reader process keeps). It refers to
    no cursor: the iterator hands it the cursor for each fill."""

    def __init__(self, ring: Ring, filler, views_of) -> None:
        self.ring, self.views_of = ring, views_of
        self.slot_count = ring.layout.slot_count
        self.publisher = Publisher(ring, LOCAL_RECORD, os.getpid())
        self.filler = self.outputs = None
        self.use(filler)

    def use(self, filler) -> None:
        """Fills with `filler` from now on (a resharded resume's, a new pass's); the caller
        closes the one before. The records skipped so far stay counted, as a replaced
        reader's do (ReaderPool.reconfigure)."""
        self.filler = filler
        self.outputs = [filler.bind(self.views_of(slot)) for slot in range(self.slot_count)]
        # User code's fills seed the global generators: the trainer's own are put back after
        # each (a file loader's fills touch none, and pay nothing).
        self.kept_states = global_states_kept if runs_user_code(filler) else contextlib.nullcontext

    def fill(self, cursor, step: int, raise_if_closed) -> bool:
        """Claims `step`'s slot, the lowest requested, and fills and publishes it as a
        reader process does; returns whether the fill replaced records (on_error="skip").
        A fill that raises hands the slot back and propagates as raised.
        `raise_if_closed(cursor)` raises for a loader closed by another thread meanwhile, or
        in a child that a transform forked, which must not publish into its parent's ring."""
        slot = step % self.slot_count
        try:
            claimed = self.ring.claim(LOCAL_RECORD)
        except Exception:
            raise_if_closed(cursor)  # Closed by another thread just now: say so.
            raise
        assert claimed == slot, f"step {step}: claimed slot {claimed}, expected {slot} (the lowest requested)"
        known = len(self.publisher.skipped)
        try:
            # In the trainer, a file cut short since the last fill would be a SIGBUS here, which
            # no reader restart absorbs: its check comes first (the fill checks again after).
            self.filler.check_files()
            with self.kept_states():
                fill_and_publish(self.publisher, self.filler, step, self.outputs[slot], slot,
                                 after_fill=lambda: raise_if_closed(cursor))
        except BaseException as error:
            if cursor.active and os.getpid() == self.publisher.pid:
                cursor.request(slot, step)  # FILLING|0 -> REQUESTED, as for a dead reader's slot.
            elif isinstance(error, Exception):  # Closed by another thread, or a forked child: say which.
                try:
                    raise_if_closed(cursor)
                except RuntimeError as closed:
                    raise closed from error
            raise
        return len(self.publisher.skipped) > known

    def skipped(self) -> tuple[int, list]:
        """(count, records as dicts) of the records its fills replaced, every one."""
        return len(self.publisher.skipped), list(self.publisher.skipped)


class LocalIterator:
    """The loader's iterator with readers=0 (next(loader) reaches it from C, LoaderBase):
    the local reader fills the cursor's next step, then the cursor takes it. It refers to
    the cursor, so a loop keeps the ring alive as the cursor itself would (session.py);
    nothing the cursor refers to refers to it."""

    __slots__ = ("cursor", "reader", "supervisor", "_raise_if_closed")

    def __init__(self, cursor, reader: LocalReader, supervisor) -> None:
        self.cursor, self.reader, self.supervisor = cursor, reader, supervisor
        self._raise_if_closed = supervisor.raise_if_closed

    def __iter__(self) -> LocalIterator:
        return self

    def __next__(self):
        cursor = self.cursor
        # Held as next() holds it while the step fills: code the fill runs (a transform, a
        # finalizer, a gc callback) that calls next() or seek() is refused, instead of moving
        # the step under it, and a close from another thread waits for the fill to end.
        cursor.enter()
        try:
            state = cursor.next_state  # CLOSED once closed; READY where a fill was not taken yet.
            if state == _HELD:
                state = self._wait_for_slot(cursor)
            if state == _IN_FLIGHT:  # Requested: only the local reader claims it (nothing is past the end).
                started_ns = _now_ns()
                # Waits on a store keep step_timeout: no reader process to give up on here.
                with step_deadline(self.supervisor.step_timeout, cursor.next_step):
                    skipped = self.reader.fill(cursor, cursor.next_step, self._raise_if_closed)
                cursor.waiting_since_ns = started_ns  # The fill is next()'s wait for data: stats()["wait_s"].
                if skipped:
                    self.supervisor.warn_if_skipped()
        finally:
            cursor.leave()
        return next(cursor)  # Takes the step, raises what its slot holds instead, or ends the pass.

    def _wait_for_slot(self, cursor) -> int:
        """The next step's slot still holds the batch from a ring ago: hands back the slots
        nothing refers to (next()'s release pass, run first), else waits as next() would
        (the supervisor's held action: the batch gets memory of its own and the step is
        requested, or, under pin_memory or after a fork, SlotsExhaustedError past
        hold_timeout). Returns what
        the slot holds then; at a finite pass's end, HELD: there is nothing to fill, and
        next() ends the pass without waiting."""
        if cursor.next_step >= cursor.end_step:
            return _HELD
        cursor.release_unused()
        state = cursor.next_state
        while state == _HELD:  # Bounded: the held action frees the slot, or raises past hold_timeout.
            self.supervisor.supervise(cursor, _HELD, LOCAL_RECORD, cursor.next_step)
            state = cursor.next_state
        return state

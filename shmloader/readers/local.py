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
instead, which the trainer raises as a ReaderError: FAILED is final, and in the trainer's
own thread the user's exception itself, and a retry after fixing its cause, are what help
(PyTorch's num_workers=0 does the same).
"""

from __future__ import annotations

import os

from ..ring.publishing import Publisher
from ..ring.segment import Ring
from ..ring.step_codes import StepCode
from ..fill.global_seeds import global_states_kept
from ..ring.batch import cursor_module
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

    def __init__(self, ring: Ring, filler, views_of, record: int = LOCAL_RECORD) -> None:
        self.ring, self.views_of, self.record = ring, views_of, record
        self.slot_count = ring.layout.slot_count
        self.publisher = Publisher(ring, record, os.getpid())
        self.filler = self.outputs = None
        self.use(filler)

    def use(self, filler) -> None:
        """Fills with `filler` from now on (a resharded resume's, a new pass's); the caller
        closes the one before. The records skipped so far stay counted, as a replaced
        reader's do (ReaderPool.reconfigure)."""
        self.filler = filler
        self.outputs = [filler.bind(self.views_of(slot)) for slot in range(self.slot_count)]

    def claim(self, cursor, raise_if_closed) -> int | None:
        """The requested slot of lowest step, claimed for this record (None if none is)."""
        try:
            return self.ring.claim(self.record)
        except Exception:
            raise_if_closed(cursor)  # Closed by another thread just now: say so.
            raise

    def fill(self, cursor, slot: int, step: int, raise_if_closed) -> bool:
        """Fills and publishes `step` into `slot`, which this record claimed, as a reader
        process does; returns whether the fill replaced records (on_error="skip"). A fill
        that raises hands the slot back (FILLING -> REQUESTED, as for a dead reader's slot)
        and propagates as raised. `raise_if_closed(cursor)` raises for a loader closed by
        another thread meanwhile, or in a child that a transform forked, which must not
        publish into its parent's ring. The trainer's global generators (Python's, numpy's,
        torch's) are as they were: a dataset's fill seeds them for its samples."""
        known = len(self.publisher.skipped)
        try:
            with global_states_kept(getattr(self.filler, "dataset", None) is not None):
                fill_and_publish(self.publisher, self.filler, step, self.outputs[slot], slot,
                                 after_fill=lambda: raise_if_closed(cursor))
        except BaseException as error:
            if cursor.active and os.getpid() == self.publisher.pid:
                cursor.request(slot, step)
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
                step, slot = cursor.next_step, self.reader.claim(cursor, self._raise_if_closed)
                assert slot == step % self.reader.slot_count, f"step {step}: claimed slot {slot} (the lowest requested)"
                skipped = self.reader.fill(cursor, slot, step, self._raise_if_closed)
                cursor.waiting_since_ns = started_ns  # The fill is next()'s wait for data: stats()["wait_s"].
                if skipped:
                    self.supervisor.warn_if_skipped()
        finally:
            cursor.leave()
        return next(cursor)  # Takes the step, raises what its slot holds instead, or ends the pass.

    def _wait_for_slot(self, cursor) -> int:
        """The next step's slot still holds the batch from a ring ago: hands back the slots
        nothing refers to (next()'s release pass, run first), else waits as next() would
        (the supervisor's held action, SlotsExhaustedError past hold_timeout). Returns what
        the slot holds then; at a finite pass's end, HELD: there is nothing to fill, and
        next() ends the pass without waiting."""
        if cursor.next_step >= cursor.end_step:
            return _HELD
        cursor.release_unused()
        state = cursor.next_state
        while state == _HELD:  # Bounded: the held action raises past hold_timeout.
            self.supervisor.supervise(cursor, _HELD, LOCAL_RECORD, cursor.next_step)
            state = cursor.next_state
        return state


class HelpingIterator:
    """The loader's iterator with trainer_fills=True (next(loader) reaches it from C): when
    the cursor's next step is not ready yet, the trainer claims the lowest requested step,
    as a reader does, under a reader record of its own (`reader`, after the reader
    processes' and the remote readers'), fills and publishes it, and looks again; once its
    step is ready, or no step is left to claim, the cursor takes or waits as it would.

    A loader-bound trainer thus fills instead of sleeping, and the reader processes lose no
    core to its wake-ups: with readers = cores - 1 the trainer is the last core's filler.
    The step it fills may be a later one than its own (the readers claimed that), so next()
    may return up to one fill later than its step was ready; a compute-bound trainer finds
    its step ready and never fills.

    A fill that raises an Exception hands its slot back to the readers, and the trainer fills
    nothing more: the readers fill that step and report its error at that step, in order, as
    they report any (stats()["trainer_fills"] keeps the trainer's own error). BaseException
    (KeyboardInterrupt) propagates, its slot handed back."""

    __slots__ = ("cursor", "reader", "supervisor", "_raise_if_closed", "stopped")

    def __init__(self, cursor, reader: LocalReader, supervisor) -> None:
        self.cursor, self.reader, self.supervisor = cursor, reader, supervisor
        self._raise_if_closed = supervisor.raise_if_closed
        self.stopped = None  # The error that ended the trainer's fills ("Type: message"), or None.

    def __iter__(self) -> HelpingIterator:
        return self

    def __next__(self):
        cursor = self.cursor
        if self.stopped is None and cursor.next_state == _IN_FLIGHT:
            cursor.enter()  # As LocalIterator holds it while a step fills (see there).
            try:
                self._fill_while_in_flight(cursor)
            finally:
                cursor.leave()
        return next(cursor)

    def _fill_while_in_flight(self, cursor) -> None:
        reader, raise_if_closed = self.reader, self._raise_if_closed
        started_ns, skipped = _now_ns(), False
        while cursor.next_state == _IN_FLIGHT:
            slot = reader.claim(cursor, raise_if_closed)
            if slot is None:
                break
            try:
                skipped |= reader.fill(cursor, slot, reader.ring.step(slot), raise_if_closed)
            except Exception as error:
                if not cursor.active or reader.publisher.pid != os.getpid():
                    raise  # Closed meanwhile, or a forked child: fill() said which.
                self.stopped = f"{type(error).__name__}: {error}"
                break
        cursor.waiting_since_ns = started_ns  # The fills are next()'s wait for data: stats()["wait_s"].
        if skipped:
            self.supervisor.warn_if_skipped()

    def filled(self) -> int:
        """Steps the trainer filled."""
        return self.reader.publisher.batches

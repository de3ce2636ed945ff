"""What the trainer does about a step next() cannot deliver at once: the actions that
ring/step_codes.py's map (StepActions) sends each STEP code to.

Fill the step here (readers=0), raise (a failed reader's own error, a step in flight past
step_timeout, a slot a batch holds past hold_timeout, a reader dead past its budget), or
return for next() to look again, warning once when a step stays in flight long enough to
look like a hang. It also owns the one warning about records replaced under
on_error="skip".
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings

from ..errors import (
    ReaderStallWarning,
    SkippedRecordsWarning,
    SlotsExhaustedError,
    StepTimeoutError,
    user_stacklevel,
)
from ..ring.layout import POLL_INTERVAL_SECONDS, SlotState
from ..ring.publishing import Publisher, fill_and_publish
from ..ring.step_codes import StepActions

# next() warns once when one step stays in flight this long (a reader stopped by SIGSTOP,
# a file on a stalled network mount): silence would look like a hang.
STALL_WARNING_SECONDS = 10.0


def _cache_note() -> str:
    """The node cache's part in a slow step (remote.node.stall_note), capitalised for the
    warning; "" where this process uses no cache (the module is then not even imported)."""
    node = sys.modules.get("shmloader.remote.node")
    note = node.stall_note() if node is not None else ""
    return note[:1].upper() + note[1:]


class Supervisor(StepActions):
    """The trainer's actions for steps that are not READY, for one loader.

    `filler` and `outputs` are set for readers=0 only: the filler this process runs, bound
    to each slot's arrays. `step_timeout` None waits (warning after STALL_WARNING_SECONDS).
    """

    def __init__(self, pool, ring, slots: int, *, step_timeout: float | None, hold_timeout: float, on_error: str,
                 owner_pid: int, filler=None, outputs=()) -> None:
        self.pool, self.ring, self.slots, self.owner_pid = pool, ring, slots, owner_pid
        self.step_timeout, self.hold_timeout, self.on_error = step_timeout, hold_timeout, on_error
        self.filler, self.outputs = filler, list(outputs)
        self.skips_warned = False
        self._episode = None  # (step, batches) of the wait being timed, and since when.
        self._episode_since = 0.0
        self._stall_warned = False
        self._publisher = None  # readers=0: the record of the steps filled in this process.

    # The actions (ring/step_codes.py's table says which code gets which).

    def due(self, cursor, step: int) -> None:
        self._check(cursor, step, held=False)

    def failed(self, owner: int) -> None:
        self.pool.raise_reported(owner)

    def held(self, cursor, step: int) -> None:
        self._wait_for_holder(cursor, step, self._check(cursor, step, held=True))

    def in_flight(self, cursor, step: int) -> None:
        if self.filler is not None:
            self._fill_here(cursor, step)
            return
        waited_s = self._check(cursor, step, held=False)
        if self.step_timeout is not None and waited_s > self.step_timeout:
            found, filler = self.ring.state(step % self.slots)
            filling = found == SlotState.FILLING
            who = (f"{self.pool.describe(filler)} is filling it" if filling else "no reader claimed it"
                   ) + self.pool.waiting_note()
            raise StepTimeoutError(
                f"step {step} has been in flight for {waited_s:.1f} s, past step_timeout={self.step_timeout:g} s; "
                f"{who}. A transform that does not return, or a stalled file system, would do this. Close the "
                f"loader (its readers are killed) and look at that step with shmloader.transforms.compute_batch.",
                step, filler if filling else None, self.pool.pid(filler) if filling else None)
        if waited_s > STALL_WARNING_SECONDS and not self._stall_warned:
            self._stall_warned = True
            found, filler = self.ring.state(step % self.slots)
            who = self.pool.describe(filler) if found == SlotState.FILLING else "no reader"
            cause = _cache_note() or "A reader stopped (SIGSTOP, a debugger) or a stalled file system would do this"
            warnings.warn(
                f"step {step} has been {found.name.lower()} for {waited_s:.0f} s ({who} has it)"
                f"{self.pool.waiting_note()}; the loader keeps waiting. {cause}.",
                ReaderStallWarning,
                stacklevel=user_stacklevel(),
            )

    def _check(self, cursor, step: int, held: bool) -> float:
        """Checks the readers (restarting a dead one, raising past its budget) and warns of
        skipped records; returns how long next() has waited on this step (the episode: the
        same step, no batch delivered since)."""
        self.pool.check(cursor.request)
        self.warn_if_skipped()
        episode = (step, cursor.batches)
        if episode != self._episode:
            self._episode, self._episode_since, self._stall_warned = episode, time.monotonic(), False
            if held:
                gc.collect()  # Views caught in reference cycles: give them one chance to go.
        return time.monotonic() - self._episode_since

    def _fill_here(self, cursor, step: int) -> None:
        """readers=0: fills `step`'s requested slot in this process, as reader 0 would. An
        exception propagates as raised (the step is requested again for the next try)."""
        slot = step % self.slots
        try:
            claimed = self.ring.claim(0)
        except Exception:
            self.raise_if_closed(cursor)  # Closed by another thread just now: say so.
            raise
        assert claimed == slot, f"step {step}: claimed slot {claimed}, expected {slot} (the lowest requested)"
        if self._publisher is None:  # Reader 0's record, as a reader keeps its own: what `shmloader top` reads.
            self._publisher = Publisher(self.ring, 0, os.getpid())
        try:  # next() counts the time as waiting for data: stats()["wait_s"] is the filling.
            # A child forked by the transform returns here too: it must not publish into
            # its parent's ring (raise_if_closed names the owner).
            fill_and_publish(self._publisher, self.filler, step, self.outputs[slot], slot,
                             after_fill=lambda: self.raise_if_closed(cursor))
        except BaseException as error:
            if cursor.active and os.getpid() == self.owner_pid:
                cursor.request(slot, step)  # FILLING|0 -> REQUESTED, as for a dead reader's slot.
            elif isinstance(error, Exception):  # Closed by another thread, or a forked child: say which.
                try:
                    self.raise_if_closed(cursor)
                except RuntimeError as closed:
                    raise closed from error
            raise
        if self.filler.skipped:
            self.warn_if_skipped()

    def _wait_for_holder(self, cursor, step: int, waited_s: float) -> None:
        """The batch from `slots` steps ago still has views: wait a bounded time for them to go."""
        if cursor.release_unused():
            return
        if waited_s > self.hold_timeout:
            slot = step % self.slots
            raise SlotsExhaustedError(
                f"step {step} needs slot {slot}, which still holds step {step - self.slots}: views of that "
                f"batch (arrays, slices, tensors) are alive after {self.hold_timeout:.1f} s. Release batches "
                f"once used (batch.release(), `with batch:`, or drop the arrays), copy data you keep, or "
                f"raise slots (now {self.slots}). An iterator around the loader may keep the batch before the "
                f"current one (tqdm(zip(range(n), loader)) does): iterate the loader itself, or allow one more "
                f"slot per batch it keeps."
            )
        time.sleep(POLL_INTERVAL_SECONDS / 5)  # Another thread may drop its views meanwhile.

    def raise_if_closed(self, cursor) -> None:
        """Raises for a closed loader, or for one a forked child inherited."""
        if self.owner_pid != os.getpid():
            raise RuntimeError(f"this loader belongs to process {self.owner_pid}; a forked child cannot use it")
        if not cursor.active:
            raise RuntimeError("the loader is closed")

    def skipped(self) -> tuple[int, list]:
        """(count, records as dicts) of the records replaced under on_error="skip"."""
        if self.filler is not None:
            return len(self.filler.skipped), [record.to_dict() for record in self.filler.skipped]
        return self.pool.skipped()

    def warn_if_skipped(self) -> None:
        """The one SkippedRecordsWarning of a loader, once a record was skipped."""
        if self.on_error != "skip" or self.skips_warned:
            return
        count, records = self.skipped()
        if count:
            self.skips_warned = True
            first = records[0] if records else {}
            warnings.warn(f"on_error='skip' has replaced {count} record(s) so far (this warning comes once; "
                          f"stats()['skipped'] counts every one), the first at step "
                          f"{first.get('step')}: {first.get('where')} ({first.get('error')}); stats()['skipped'] "
                          f"lists them", SkippedRecordsWarning, stacklevel=user_stacklevel())

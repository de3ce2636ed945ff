"""What the trainer does about a step next() cannot deliver at once: the actions that
ring/step_codes.py's map (StepActions) sends each STEP code to.

Raise (a failed reader's own error, a step in flight past step_timeout, a slot a batch
holds past hold_timeout where that batch cannot be given memory of its own, a reader dead
past its budget), or return for next() to look again (a slot a batch holds is freed by
giving the batch memory of its own: kept.py), warning once when a step stays in flight long enough to look like a hang. It fills
nothing: with readers=0 the local reader does (local.py), like any reader. It also owns
the one warning about records replaced under on_error="skip".
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


# A batch slot of at least this many bytes can take the stall warning's time to fill by
# itself (cold rows read from disk, the slot's pages touched for the first time), so the
# warning names the batch's size before SIGSTOP or a stalled file system.
_LARGE_BATCH_BYTES = 256 << 20


def _stall_cause(slot_bytes: int, batches_delivered: int) -> str:
    """What a long wait for a step may mean, the batch size first where it is large."""
    usual = "a reader stopped (SIGSTOP, a debugger) or a stalled file system would do this"
    if slot_bytes < _LARGE_BATCH_BYTES:
        return usual[:1].upper() + usual[1:]
    first = "the first batches" if batches_delivered == 0 else "a batch"
    return (f"Each batch is {slot_bytes / 1e9:.2f} GB: filling {first} of that size (rows read from disk, the slot's "
            f"pages written for the first time) can take this long on its own, and a smaller batch_size fills "
            f"sooner; otherwise {usual}")


class Supervisor(StepActions):
    """The trainer's actions for steps that are not READY, for one loader.

    `step_timeout` None waits (warning after STALL_WARNING_SECONDS). `skipped`: where the
    records replaced under on_error="skip" are counted, the pool's readers by default
    (readers=0: the local reader's LocalReader.skipped).
    """

    def __init__(self, pool, ring, slots: int, *, step_timeout: float | None, hold_timeout: float, on_error: str,
                 owner_pid: int, skipped=None) -> None:
        self.pool, self.ring, self.slots, self.owner_pid = pool, ring, slots, owner_pid
        self.step_timeout, self.hold_timeout, self.on_error = step_timeout, hold_timeout, on_error
        self._skipped = pool.skipped if skipped is None else skipped
        self.skips_warned = False
        self._episode = None  # (step, batches) of the wait being timed, and since when.
        self._episode_since = 0.0
        self._stall_warned = self._start_warned = False
        self._start_waited_since = None  # When next() began waiting for a reader to start.
        self.timed_out = False  # A step timed out: the next iter() recovers (Session.recover).
        # An adapter's words for a batch kept too long (drop_in_hold_advice), else ShmDataLoader's.
        self.hold_advice = None
        # make_room(cursor, step) -> None once a held slot is freed (kept.KeptBatches), else why not.
        self.make_room = None
        # The session's bottleneck meter (readers/bottleneck.py), and a cheap reading of the
        # ring at the start of the wait being timed: the stall warning names what limited
        # the loader over that wait, in stats()["bottleneck"]'s words.
        self.meter = None
        self._episode_reading = None
        # readers="auto": the Tuner (readers/autotune.py) that decides, at most once a window,
        # from this periodic check and from next()'s waits.
        self.tuner = None
        # A fixed loader's entry in the node's reader budget (readers/budget_record.NodeShare)
        # whose join found the record's lock held past its wait: written at a later check.
        self.node_share = None

    # The actions (ring/step_codes.py's table says which code gets which).

    def due(self, cursor, step: int) -> None:
        self._check(cursor, step, held=False)
        if self.tuner is not None:
            self.tuner.tune()
        elif self.node_share is not None and self.node_share.last is None:
            # A fixed loader publishes once, at its join; one that found the lock held (a
            # loader stopped inside its update) would otherwise run uncounted for good, and
            # the others grow into the cores its readers use.
            self.node_share.publish(self.pool.count)

    def failed(self, owner: int) -> None:
        self.pool.raise_reported(owner)

    def held(self, cursor, step: int) -> None:
        """The batch from a ring ago still holds `step`'s slot: it gets memory of its own and
        the slot goes back to the readers (kept.py); where it cannot (pin_memory, a fork),
        next() waits a bounded time for it to go."""
        if cursor.release_unused():
            return
        if self.make_room is None:
            reason = "no session set make_room up"
        else:
            reason = self.make_room(cursor, step)
            if reason is None:
                return  # The slot is requested, or was let go meanwhile: next() looks again.
        self._wait_for_holder(cursor, step, self._check(cursor, step, held=True), reason)

    def in_flight(self, cursor, step: int) -> None:
        if self.pool.records == 0:
            # readers=0: the loader's iterator has the local reader fill each step before
            # next() looks (local.py); next() on the bare cursor has nobody to wait for.
            raise RuntimeError(f"step {step} is requested and no reader fills it: with readers=0 the loader's own "
                               f"iterator fills each step; iterate the loader (or iter(loader)), not its cursor")
        waited_s = self._check(cursor, step, held=False)
        if self._starting(step):
            return
        if self.tuner is not None:
            self.tuner.tune(waiting_s=waited_s)
        if self.meter is not None and (self._episode_reading is None or self._episode_reading[0] != self._episode):
            self._episode_reading = (self._episode, self.meter.read(processes=False))
        if self.step_timeout is not None and waited_s > self.step_timeout:
            found, filler = self.ring.state(step % self.slots)
            filling = found == SlotState.FILLING
            who = (f"{self.pool.describe(filler)} is filling it" if filling else "no reader claimed it"
                   ) + self.pool.waiting_note()
            self.timed_out = True
            raise StepTimeoutError(
                f"step {step} has been in flight for {waited_s:.1f} s, past step_timeout={self.step_timeout:g} s; "
                f"{who}. A transform that does not return, or a stalled file system, would do this. Close the "
                f"loader (its readers are killed) and look at that step with shmloader.transforms.compute_batch.",
                step, filler if filling else None, self.pool.pid(filler) if filling else None)
        if waited_s > STALL_WARNING_SECONDS and not self._stall_warned:
            self._stall_warned = True
            found, filler = self.ring.state(step % self.slots)
            who = self.pool.describe(filler) if found == SlotState.FILLING else "no reader"
            cause = _cache_note() or _stall_cause(self.ring.layout.slot_bytes, cursor.batches)
            line = "" if self._episode_reading is None else f" {self.meter.since(self._episode_reading[1])['line']}."
            warnings.warn(
                f"step {step} has been {found.name.lower()} for {waited_s:.0f} s ({who} has it)"
                f"{self.pool.waiting_note()}; the loader keeps waiting. {cause}.{line}",
                ReaderStallWarning,
                stacklevel=user_stacklevel(),
            )

    def _starting(self, step: int) -> bool:
        """Whether no reader has started yet (pool.starting_note): a reader's start (its
        imports, the dataset's load) is its own phase, bounded by the pool's start timeout,
        so step_timeout and the stall warning count from the moment one is ready. Warns
        once when the start itself takes long enough to look like a hang."""
        note = self.pool.starting_note()
        if not note:
            self._start_waited_since = None
            return False
        now = self._episode_since = time.monotonic()
        if self._start_waited_since is None:
            self._start_waited_since = now
        if not self._start_warned and now - self._start_waited_since > STALL_WARNING_SECONDS:
            self._start_warned = True
            warnings.warn(f"step {step} waits for the readers to start: {note}; the loader keeps waiting.",
                          ReaderStallWarning, stacklevel=user_stacklevel())
        return True

    def _check(self, cursor, step: int, held: bool) -> float:
        """Checks the readers (restarting a dead one, raising past its budget) and warns of
        skipped records; returns how long next() has waited on this step (the episode: the
        same step, no batch delivered since)."""
        self.pool.check(cursor.request, awaited=step)
        self.warn_if_skipped()
        episode = (step, cursor.batches)
        if episode != self._episode:
            self._episode, self._episode_since, self._stall_warned = episode, time.monotonic(), False
            if held:
                gc.collect()  # Views caught in reference cycles: give them one chance to go.
        return time.monotonic() - self._episode_since

    def _wait_for_holder(self, cursor, step: int, waited_s: float, reason: str | None) -> None:
        """The batch from `slots` steps ago still has views and cannot be given memory of its
        own (`reason`): wait a bounded time for them to go."""
        if cursor.release_unused():
            return
        if waited_s > self.hold_timeout:
            slot = step % self.slots
            if self.hold_advice is not None:
                raise SlotsExhaustedError(self.hold_advice(step, self.slots, self.hold_timeout, cursor.held(), reason))
            raise SlotsExhaustedError(
                f"step {step} needs slot {slot}, which still holds step {step - self.slots}: views of that "
                f"batch (arrays, slices, tensors) are alive after {self.hold_timeout:.1f} s, and that batch cannot "
                f"be given memory of its own: {reason}. Release batches once used (batch.release(), `with batch:`, "
                f"or drop the arrays), copy data you keep, or raise slots (now {self.slots}). An iterator around "
                f"the loader may keep the batch before the current one (tqdm(zip(range(n), loader)) does): iterate "
                f"the loader itself, or allow one more slot per batch it keeps."
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
        return self._skipped()

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


def drop_in_hold_advice(num_workers: int, prefetch_factor: int | None, trainer_slots: int):
    """SlotsExhaustedError's message in shmloader.torch.DataLoader's words: its knob is
    prefetch_factor, and what holds a slot is a batch (or a tensor made of one) the loop
    keeps; it has no batch.release() and no slots= setting. Only where the batch cannot be
    given memory of its own (`reason`: pin_memory, a fork)."""
    def advice(step: int, slots: int, hold_timeout: float, held: dict, reason: str | None) -> str:
        kept = sorted(held.values())
        shown = ", ".join(str(kept_step) for kept_step in kept[:10]) + (", ..." if len(kept) > 10 else "")
        factor = "None (the default)" if prefetch_factor is None else str(prefetch_factor)
        return (f"batch {step} cannot be filled: the loader holds {slots} batches at once (num_workers="
                f"{num_workers} x prefetch_factor={factor} + {trainer_slots} for the loop), and after "
                f"{hold_timeout:.1f} s batches {shown} of this epoch are still referenced, by your code or tensors "
                f"made from them (a list of batches, a tensor kept without .clone(), an iterator wrapper that keeps "
                f"the batch before), and they cannot be given memory of their own: {reason}. Keep fewer batches (del "
                f"them once used, .clone() what you keep), or raise prefetch_factor so that the batches you keep "
                f"fit.")
    return advice

"""The trainer's side of the slot protocol in Python: the one map from the STEP code the native
next() reports for a step it cannot hand out at once to what the trainer does about it.

The native next() (ring/_cursor.c) takes a READY step by itself. Otherwise, and every few
batches while steps are ready, it calls supervise(cursor, code, owner, step), which
StepActions.supervise answers by this table; a subclass (readers/supervision.py's
Supervisor) provides the actions:

    code        what next() found (ring/_cursor.h)               the trainer's action
    ----------  -----------------------------------------------  ---------------------------------------------
    (any)       first, whatever the code                         raise_if_closed: a closed loader, or one a
                                                                 forked child inherited, raises
    CLOSED      the loader is closed (or was never set up)       raise_if_closed raised already
    READY       ready, but the periodic reader check is due      due: check the readers (restart a dead one)
    IN_FLIGHT   requested, or being filled (next() waited a      in_flight: check the readers, time the wait
                poll interval for it first)                      (warn, then StepTimeoutError past step_timeout)
    HELD        a batch from a ring ago still holds the slot     held: hand unused slots back, give kept
                                                                 batches memory of their own (kept.py), else
                                                                 (pin_memory, a fork) wait, and raise
                                                                 SlotsExhaustedError past hold_timeout
    FAILED      its reader failed while filling it               failed: raise the reader's own error
    WRONG       a state or step this trainer never wrote there   SharedMemoryError naming the slot (here)

After an action returns, next() looks at the step again. No action fills a step: with
readers=0 the loader's iterator (readers/local.py) has its local reader fill the step before
next() looks, so that next() finds it READY; that iterator calls supervise with HELD itself
while a batch from a ring ago holds the slot it would fill (the held action requests it).
"""

from __future__ import annotations

import enum

from .._native import load_cursor
from ..errors import SharedMemoryError

cursor_module = load_cursor()

StepCode = enum.IntEnum(
    "StepCode",
    [(name.removeprefix("STEP_"), value) for name, value in vars(cursor_module).items() if name.startswith("STEP_")],
    module=__name__,
)
StepCode.__doc__ = "What next() found in a step's slot: ring/_cursor.h's StepState, named by the extension itself."

# Plain ints: supervise compares these first (every few batches while steps are ready).
_READY, _IN_FLIGHT, _HELD = int(StepCode.READY), int(StepCode.IN_FLIGHT), int(StepCode.HELD)
_FAILED, _WRONG, _CLOSED = int(StepCode.FAILED), int(StepCode.WRONG), int(StepCode.CLOSED)


class StepActions:
    """The map, as `supervise`, the callable the native cursor is built with.

    Subclasses set `ring` and `slots` (the slot count) and implement the actions. The
    cursor is passed to each call rather than kept: it holds `supervise`, and a reference
    back would keep an unclosed loader's ring alive past its last use (session.py)."""

    ring = None
    slots = 0

    def supervise(self, cursor, state: int, owner: int, step: int) -> None:
        """For `step`, in `state` (a StepCode) with `owner` the reader record the slot's state
        word names. Raises, or returns for next() to look again.

        Code may run inside this call and close the loader: a signal handler, and the
        collector (finalizers, gc callbacks), which since Python 3.12 runs at the eval
        breaker of any Python code, this call's included. The ring is then gone under the
        action, whose failure says nothing more than that the loader is closed."""
        self.raise_if_closed(cursor)
        try:
            self._act(cursor, state, owner, step)
            return
        except Exception:
            if cursor.active:
                raise
        self.raise_if_closed(cursor)

    def _act(self, cursor, state: int, owner: int, step: int) -> None:
        if state == _IN_FLIGHT:
            self.in_flight(cursor, step)
        elif state == _HELD:
            self.held(cursor, step)
        elif state == _READY:
            self.due(cursor, step)
        elif state == _FAILED:
            self.failed(owner)
        elif state == _WRONG:
            raise self.wrong_step(step)
        else:
            # CLOSED comes only with an inactive cursor, for which raise_if_closed raised.
            assert state == _CLOSED and not cursor.active, (state, cursor.active)

    def wrong_step(self, step: int) -> SharedMemoryError:
        """`step`'s slot holds a state or step this trainer never wrote there."""
        slot = step % self.slots
        found, _ = self.ring.state(slot)
        return SharedMemoryError(
            f"slot {slot} of ring {self.ring.names.segment} is {found.name} with step {self.ring.step(slot)} "
            f"while step {step} was expected; another process wrote to the ring"
        )

    # The actions.

    def raise_if_closed(self, cursor) -> None:
        """Raises for a closed loader, or for one a forked child inherited."""
        raise NotImplementedError

    def due(self, cursor, step: int) -> None:
        """`step` is ready, and the periodic check of the readers is due."""
        raise NotImplementedError

    def in_flight(self, cursor, step: int) -> None:
        """`step` is requested or being filled (next() waited a poll interval for it)."""
        raise NotImplementedError

    def held(self, cursor, step: int) -> None:
        """`step`'s slot still holds the batch from a ring ago."""
        raise NotImplementedError

    def failed(self, owner: int) -> None:
        """Reader record `owner` failed while filling the step: raises its error."""
        raise NotImplementedError

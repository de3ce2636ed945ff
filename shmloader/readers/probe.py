"""readers="auto"'s trials where the CPU cannot say whether a reader more or fewer helps: a
reader count is changed, the delivered rate measured, and the change kept only where it paid.

decide (autotune.py) reasons from the CPU: a waiting trainer, busy readers and an idle core
are worth a reader, and readers retire only while the trainer does not wait. Three cases it
cannot judge (autotune.Window.trial_cause): readers that wait off the CPU (a disk, a store, a
__getitem__ that sleeps: whether another overlaps its waits with theirs or only queues on the
same saturated device is the device's to say); readers that wait for a core (beside the
trainer and the kernel's own work on the node's cores: a reader fewer may lose nothing); and
readers whose reads are pages the cache could not keep (each one's read-ahead evicts the
others'). On a file read cold in a memory group on 2 cores, the readers waited for a core half
their fill time and one reader delivered more than two (bench/autotune.py's cold case), while
decide held two for good. So, while the trainer waits for readers in one of those cases:

- an add decide asks for is a trial: kept where the rate over the next PROBE_WINDOWS windows
  rose by KEEP_GAIN of the rate before it, else undone;
- where decide adds nothing (the readers at their most, the node's budget without room, or an
  add that did not pay and waits out its back-off) and the loader runs more than its least,
  one reader is retired as a trial: kept where the rate fell by at most KEEP_LOSS (the same
  rows for a reader's less CPU, seeks and cache), else the reader is added back.

An add on trial of several readers (decide asks for as many as would end the wait: a store's
latency may want many) that did not pay is followed by one of half as many, at once: the
count climbs towards the best one step at a time where the best is near. A trial of one
that was undone waits BACKOFF_FIRST_SECONDS before its direction is tried again,
twice as long after each further undo, at most BACKOFF_MOST_SECONDS (a trial that did not pay
costs its PROBE_WINDOWS at the worse count: a share of the time that shrinks as the back-off
grows); a kept one starts its direction's back-off again. Noise on a shared device can keep
a trial it should not have: the other direction's trial, later, corrects it. The count does
not wander: at a count where neither direction pays, each is tried once per back-off; and
after a retirement kept on trial, an add back to the count it left is a trial too, also
where the readers left have no cause of their own (a core idle once one fewer runs) and
decide would add it back by the CPU at once (add_cause).

Rates are batches filled per second by every reader record over the window (retired readers'
fills count to their end), which, while the trainer waits, are the batches it gets.
"""

from __future__ import annotations

import dataclasses

# A trial's measured window, in the tuner's windows (a second each): two, so that one slow
# read or one scheduler hiccup of a shared host does not decide it.
PROBE_WINDOWS = 2
# ... and at least this many fills per reader: a rate over a window that holds a fill or two
# (a __getitem__ of a tenth of a second, a large batch) says when a fill ended, not the rate.
PROBE_FILLS_MIN = 8
# A trial whose readers fill slower than that is judged on what it saw after this many windows.
PROBE_WINDOWS_MOST = 20
# An add kept where it delivered this much more: the noise of a 2 s window on a shared disk
# is a few percent, and a reader that wins less than this is worth its CPU to no one.
KEEP_GAIN = 0.05
# A retirement kept where the rate fell at most this much: fewer readers for about the same
# rows free a core and the device's queue, so the tie goes to fewer.
KEEP_LOSS = 0.03
BACKOFF_FIRST_SECONDS = 8.0
BACKOFF_MOST_SECONDS = 128.0


@dataclasses.dataclass(frozen=True)
class Trial:
    """A change on trial: `change` readers (+ added, - retired), `rate_before` the batches per
    second of the window it was decided on, `readers_before` the count before it; `earned`:
    the reader added or retired is an earned one, past the node's budget (readers/earned.py),
    so that its undo goes past the budget too."""

    change: int
    rate_before: float
    readers_before: int
    started_s: float
    earned: bool = False


class Prober:
    """The trials' state: the one in flight (`trial`), and when each direction (+1 add, -1
    retire) may be tried next and its back-off. Times are seconds on one monotonic clock,
    passed in, so that a model can drive it."""

    def __init__(self, window_seconds: float) -> None:
        assert window_seconds > 0, window_seconds
        self.probe_seconds = PROBE_WINDOWS * window_seconds  # A trial's, and the rate's it is judged against.
        self.trial: Trial | None = None
        self.next_try_s = {1: 0.0, -1: 0.0}
        self.backoff_s = {1: BACKOFF_FIRST_SECONDS, -1: BACKOFF_FIRST_SECONDS}
        self.last: str | None = None  # The last trial's outcome, in words.
        self.add_most: int | None = None  # The most readers the next add on trial adds (None: decide's).
        # The count a retirement kept on trial left (None: none since an add was kept): an add
        # back to it is a trial whatever the CPU says (add_cause).
        self.retired_from: int | None = None

    def may_try(self, direction: int, now_s: float) -> bool:
        return self.trial is None and now_s >= self.next_try_s[direction]

    def add_cause(self, window_cause: str | None, readers_after: int) -> str | None:
        """Why an add to `readers_after` is a trial, in words; None where the CPU judges it:
        the window's cause, or a retirement kept on trial from that count (retired_from).
        Without the second, readers whose cause goes with the retired reader (a core idle
        once one fewer runs) were added back by the CPU at the next window, retired on trial
        again, and the count swung for good."""
        if window_cause is not None:
            return window_cause
        left = self.retired_from
        if left is not None and readers_after >= left:
            return f"{left} readers delivered no more than {left - 1} on trial"
        return None

    def waits_why(self, direction: int, now_s: float) -> str:
        what = "an add" if direction > 0 else "a retirement"
        return f"{what} on trial did not pay; tried again in {self.next_try_s[direction] - now_s:.0f} s"

    def start(self, change: int, rate_before: float, readers_before: int, now_s: float, earned: bool = False) -> None:
        assert change != 0 and rate_before > 0 and self.trial is None, (change, rate_before, self.trial)
        assert not earned or abs(change) == 1, change  # Earned readers come and go one at a time.
        self.trial = Trial(change, rate_before, readers_before, now_s, earned)

    def due(self, now_s: float, filled: int) -> bool:
        """Whether the trial in flight, its readers having `filled` batches since it started,
        has run long enough to be judged."""
        trial = self.trial
        if trial is None:
            return False
        ran_s = now_s - trial.started_s
        readers = trial.readers_before + trial.change
        return (ran_s >= self.probe_seconds and filled >= PROBE_FILLS_MIN * readers
                or ran_s >= self.probe_seconds * PROBE_WINDOWS_MOST / PROBE_WINDOWS)

    def abandon(self, why: str) -> None:
        """Ends the trial in flight unjudged (its readers changed by other hands), saying `why`."""
        assert self.trial is not None
        self.trial, self.last = None, why

    def judge(self, rate_after: float, now_s: float) -> tuple[int, str]:
        """Ends the trial: (readers to change to undo it, 0 where it is kept; why)."""
        trial = self.trial
        assert trial is not None and rate_after >= 0
        self.trial = None
        direction = 1 if trial.change > 0 else -1
        ratio = rate_after / trial.rate_before
        kept = ratio >= 1 + KEEP_GAIN if direction > 0 else ratio >= 1 - KEEP_LOSS
        readers_after = trial.readers_before + trial.change
        said = (f"{readers_after} readers delivered {ratio:.2f}x what {trial.readers_before} did "
                f"({rate_after:.1f} against {trial.rate_before:.1f} batches/s)")
        if kept:
            self.backoff_s[direction] = BACKOFF_FIRST_SECONDS
            if direction > 0:
                self.add_most = self.retired_from = None
            else:
                self.retired_from = trial.readers_before
            self.last = f"kept: {said}"
            return 0, self.last
        self.last = f"undone: {said}"
        if trial.change > 1:  # Half as many next, at once.
            self.add_most = trial.change // 2
            return -trial.change, self.last
        self.next_try_s[direction] = now_s + self.backoff_s[direction]
        self.backoff_s[direction] = min(BACKOFF_MOST_SECONDS, 2 * self.backoff_s[direction])
        return -trial.change, self.last

    def report(self) -> str | None:
        """stats()'s "reader_trial": the trial in flight, or how the last one ended."""
        trial = self.trial
        if trial is None:
            return self.last
        earned = " (an earned reader)" if trial.earned else ""
        return (f"on trial: {trial.readers_before + trial.change} readers in place of {trial.readers_before}{earned}, "
                f"against {trial.rate_before:.1f} batches/s")

"""readers="auto"'s decisions: whether to add or retire readers, as a pure function of what the
loader did over a window (decide), and the Tuner that measures windows from the trainer's side
and acts on the ElasticPool (readers/elastic.py). (Past 450 lines: the rule, the window it
reads and the Tuner that applies it, with the hooks of its trials and earned readers, whose
own rules live in readers/probe.py and readers/earned.py.)

The rule, on one window (Window: at least Tuner.window_seconds of counters the trainer and
readers keep anyway; readers/bottleneck.py reads them):

- Add while the trainer waits (next() waited at least ADD_WAIT_SHARE of the window), the
  readers are what it waits for (each busy at least ADD_BUSY_SHARE of it: not a start-up,
  not batches the trainer holds), and another reader would run: a core is idle
  (IDLE_CORES_MIN), or the readers spend at least BLOCKED_SHARE_MIN of their fills off the
  CPU (sleeping, reading a disk: another overlaps those waits without a core of its own).
  As many as would end the wait, readers / (1 - wait) in all, at most one per idle core
  where they need cores, and never past `most`.
- Retire one while the trainer hardly waits (below RETIRE_WAIT_SHARE) and the readers left
  would be busy at most RETIRE_BUSY_SHARE of the time, on RETIRE_WINDOWS windows in a row.
- Else hold.

Where the trainer waits for readers that wait off the CPU, wait for a core, or read pages the
cache could not keep (Window.trial_cause), the CPU cannot say whether a reader more or fewer
helps: an add is a trial, kept only where the delivered rate rose, and where none can be
added, one fewer is tried and kept where the rate held (readers/probe.py).

Within the node's reader budget (readers/node_budget.py, through the record of
readers/budget_record.py, shared by the loaders of every rank on the node): an add is claimed
in the record first and goes only as far as the budget has room; each window publishes the
readers this loader could give up (spare_readers), and where another loader waits for
readers the budget cannot give, this one retires its share of them at once, without the
calm windows; so it does where the node runs past its budget (a loader back from idle whose
readers the others took meanwhile, one that joined where there was no room). Every window
updates the record, a window spent on readers that start too: a loader whose entry is not
updated for a while is taken for idle (readers/budget_record.py), and the time between its
windows tells the others how long that is for this loader (NodeShare.pace). Where half a
core is idle, a reader past the budget is tried (readers/earned.py).

Why it does not oscillate: after an add the readers' work is the same or more, so the
readers left after a retirement would be busier than RETIRE_BUSY_SHARE < ADD_BUSY_SHARE
allows; after a retirement the readers left are at most RETIRE_BUSY_SHARE busy, below
ADD_BUSY_SHARE, so no add follows until the work grows. Retiring waits RETIRE_WINDOWS
windows; adding acts on one, since a waiting trainer is the cost auto exists to cut.

The Tuner runs inside next(), at most once a window: from the supervisor's periodic reader
check (every 64 batches or every second, whichever comes first: session.py's
_READER_CHECK_BATCHES and _READER_CHECK_SECONDS) and from its waits (every poll interval,
50 ms, while next() waits longer than that). A loader is judged at least every window while
next() is called that often, and at each next() where its steps take longer. No thread of
its own, and not from stats(): that may be read
from a monitoring thread (metrics.register), while the pool's processes are changed only
on the thread in next(), where the supervisor checks them. Each window starts where the one
before ended, and again once a change was made.
"""

from __future__ import annotations

import dataclasses
import math
import time

from .bottleneck import QUEUED_SHARE_MIN, Reading, idle_cores_between, reader_change
from .earned import earned_trial, settle_trial
from .page_cache import REFAULT_SHARE_MIN, refaulted_share, shared_group
from .probe import PROBE_FILLS_MIN, PROBE_WINDOWS_MOST, Prober

# A trainer waiting a twentieth of its time loses that much of its step rate: worth a reader.
ADD_WAIT_SHARE = 0.05
# Readers less busy than this while the trainer waits are held back by something a reader
# more would not fix (their start, batches the trainer holds, a stall): bottleneck.py says what.
ADD_BUSY_SHARE = 0.6
# "A core is idle": /proc/stat's idle time over the window, in cores, less a tenth for the
# noise of one window's ticks.
IDLE_CORES_MIN = 0.9
# Readers off the CPU this share of their fills (bottleneck.BLOCKED_SHARE_MIN's meaning).
BLOCKED_SHARE_MIN = 0.5
# Below a fiftieth the trainer's waits are the ones any pipeline has (a first batch, a seek).
RETIRE_WAIT_SHARE = 0.02
# Below ADD_BUSY_SHARE, so that the readers left after a retirement do not ask for one more.
RETIRE_BUSY_SHARE = 0.5
# A retirement saves CPU, an add saves the trainer's time: the first can wait for proof.
RETIRE_WINDOWS = 3
# The most a window's wait share counts for: at a full wait (nothing delivered) readers /
# (1 - wait) has no bound; a tenth left makes it ten times the readers, capped by `most`.
_WAIT_SHARE_COUNTED_MAX = 0.9


@dataclasses.dataclass(frozen=True)
class Window:
    """What the loader did between two readings: `trainer_wait`, the share of the window
    next() waited; `readers`, the active readers; `readers_busy`, their fill time over the
    window, in readers (0 to `readers`); `readers_blocked`, the share of that fill time off a
    CPU and not waiting for one (None: unknown); `idle_cores`, cores this process may use
    that were idle, on average (None: unknown); `batches_per_second`, the batches every reader
    record filled (readers/probe.py's rate); `refaulted`, the share of the readers' reads from
    storage that their own memory group refaulted (page_cache.py; None: unknown, or a group
    other jobs share); `readers_queued`, the share of their fill time they were runnable and
    waiting for a core (None: unknown)."""

    seconds: float
    trainer_wait: float
    readers: int
    readers_busy: float
    readers_blocked: float | None = None
    idle_cores: float | None = None
    batches_per_second: float = 0.0
    refaulted: float | None = None
    readers_queued: float | None = None

    @property
    def readers_wanted(self) -> bool:
        """The trainer waits, and for its readers (decide's first condition for an add)."""
        return self.trainer_wait >= ADD_WAIT_SHARE and self.readers_busy >= ADD_BUSY_SHARE * self.readers

    @property
    def off_cpu(self) -> bool:
        """The readers wait off the CPU (BLOCKED_SHARE_MIN of their fills)."""
        return self.readers_blocked is not None and self.readers_blocked >= BLOCKED_SHARE_MIN

    @property
    def trial_cause(self) -> str | None:
        """Why a change of the reader count is a trial (readers/probe.py), in words; None where
        the CPU can judge it: the readers wait off the CPU (a device decides whether another
        helps), wait for a core (QUEUED_SHARE_MIN: beside a trainer and the kernel's own work
        on the node's cores, one fewer may do as much), or a quarter of their reads are pages
        the cache could not keep (each reader's read-ahead evicts the others')."""
        if self.off_cpu:
            return f"wait off the CPU {self.readers_blocked:.0%} of their fills"
        if self.readers_queued is not None and self.readers_queued >= QUEUED_SHARE_MIN:
            return f"wait for a core {self.readers_queued:.0%} of their fills"
        if self.refaulted is not None and self.refaulted >= REFAULT_SHARE_MIN:
            return f"read pages the cache could not keep ({self.refaulted:.0%} of their reads refaulted)"
        return None


@dataclasses.dataclass(frozen=True)
class Decision:
    """`change`: readers to add (> 0) or retire (< 0); `why`, in words; `calm`: windows in a
    row that asked for a retirement (the hysteresis' state, given to the next decide)."""

    change: int
    why: str
    calm: int = 0


def decide(window: Window, least: int, most: int, calm: int = 0) -> Decision:
    """The module's rule on one window, for a loader of `least` to `most` readers."""
    assert 1 <= least <= most and least <= window.readers <= most, (least, window.readers, most)
    readers, wait, busy = window.readers, window.trainer_wait, window.readers_busy
    if window.readers_wanted:
        if readers >= most:
            return Decision(0, f"the trainer waits {wait:.0%} of the time, and the readers are at their most ({most})")
        blocked = window.off_cpu
        idle = window.idle_cores if window.idle_cores is not None else 0.0
        if not blocked and idle < IDLE_CORES_MIN:
            return Decision(0, f"the trainer waits {wait:.0%} of the time, but no core is idle "
                               f"({idle:.1f}) for another reader")
        wanted = math.ceil(readers / (1.0 - min(wait, _WAIT_SHARE_COUNTED_MAX)) - 1e-9) - readers
        room = most - readers if blocked else int(idle + 1 - IDLE_CORES_MIN)
        change = max(1, min(wanted, room, most - readers))
        where = (f"readers wait off the CPU {window.readers_blocked:.0%} of their fills" if blocked
                 else f"{idle:.1f} cores idle")
        return Decision(change, f"the trainer waited {wait:.0%} of {window.seconds:.1f} s with {readers} readers "
                                f"{busy / readers:.0%} busy, {where}")
    if wait < RETIRE_WAIT_SHARE and readers > least and busy <= RETIRE_BUSY_SHARE * (readers - 1):
        calm += 1
        why = (f"the trainer waited {wait:.0%} with {readers} readers {busy / readers:.0%} busy: "
               f"{readers - 1} would do")
        if calm >= RETIRE_WINDOWS:
            return Decision(-1, why + f" ({calm} windows in a row)")
        return Decision(0, why + f" ({calm} of {RETIRE_WINDOWS} windows)", calm)
    return Decision(0, f"the trainer waits {wait:.0%} of the time with {readers} readers {busy / readers:.0%} busy")


def spare_readers(window: Window, least: int) -> int:
    """Readers the loader could give up now (readers/node_budget.py gives them to a loader of
    the node that waits): none while its trainer waits; else those past what its fills need
    at RETIRE_BUSY_SHARE each, down to `least` (decide's retirement, without the calm windows)."""
    if window.trainer_wait >= RETIRE_WAIT_SHARE:
        return 0
    needed = max(least, math.ceil(window.readers_busy / RETIRE_BUSY_SHARE - 1e-9))
    return max(0, window.readers - needed)


def ring_fill_seconds(reading: Reading, active: list[int], started_ns: int) -> float:
    """How long the `active` readers take to fill the whole ring at their usual fill time
    (their busy time per batch so far; before their first batch, at least the time since
    `started_ns`). After its trainer's last next(), a loader's readers sleep at the latest
    this long after: a loader is not taken for idle sooner (readers/budget_record.py)."""
    if not active:
        return 0.0
    busy_ns = sum(reading.readers[index].busy_ns for index in active)
    batches = sum(reading.readers[index].batches for index in active)
    batch_ns = busy_ns / batches if batches else max(0, reading.at_ns - started_ns)
    return reading.slots * batch_ns / len(active) / 1e9


def window_of(before: Reading, after: Reading, active: list[int]) -> Window:
    """The Window between two readings (readers/bottleneck.py's) over the `active` records."""
    window_ns = max(1, after.at_ns - before.at_ns)
    changes = [reader_change(old, new) for old, new in zip(before.readers, after.readers)]
    filled = sum(change["batches"] for change in changes)
    read_bytes = sum(change["storage_read_bytes"] or 0 for change in changes)
    refaulted = (None if after.memory is None or shared_group(after.memory.group)
                 else refaulted_share(before.memory, after.memory, read_bytes))
    busy_ns = cpu_ns = queued_ns = 0
    timed = True
    for index in active:
        change = changes[index]
        busy_ns += change["busy_ns"]
        if change["cpu_ns"] is None or change["queued_ns"] is None:
            timed = False
        else:
            cpu_ns, queued_ns = cpu_ns + change["cpu_ns"], queued_ns + change["queued_ns"]
    blocked = max(0.0, 1.0 - (cpu_ns + queued_ns) / busy_ns) if timed and busy_ns else None
    queued = min(1.0, queued_ns / busy_ns) if timed and busy_ns else None
    wait = min(1.0, max(0.0, (after.waited_ns - before.waited_ns) / window_ns))
    return Window(window_ns / 1e9, wait, len(active), min(float(len(active)), busy_ns / window_ns), blocked,
                  idle_cores_between(before, after), filled * 1e9 / window_ns, refaulted, queued)


class Tuner:
    """Adds and retires the readers of an ElasticPool by decide(), from readings taken by
    `read()` (bottleneck.ring_reading of the loader's ring) at most once a window. `last`,
    the last change as stats()["reader_change"] reports it; `decision`, the last decision."""

    # The shortest window decided on: long enough to hold several fills of a slow step, and
    # a reader's start (a fork and its imports, about a tenth of a second) is short beside it.
    window_seconds = 1.0

    def __init__(self, pool, read, share=None, clock=time.monotonic_ns, most: int | None = None) -> None:
        self.pool, self.read, self.share = pool, read, share  # share: readers/budget_record.NodeShare
        # The most it adds up to: the pool's records, or fewer where the ring's slots feed fewer.
        self.most = pool.count if most is None else most
        self.clock = clock  # CLOCK_MONOTONIC's ns, as the readings' at_ns (a model's own in tests).
        self.started_ns = self.tuned_ns = clock()  # tuned_ns: the last window's end.
        self.baseline: Reading | None = None
        self.calm = 0
        self.changes = 0
        self.decision: Decision | None = None
        self.last: dict | None = None
        self.add_failure: str | None = None  # Why the last reader that could not be started was not.
        self.prober = Prober(self.window_seconds)  # Trials where the CPU cannot judge (readers/probe.py).
        self.steady: list[Reading] = []  # Readings since the last change, for a trial's rate before.
        self.steady_idled = False  # Whether the last window's readers idled (its readings start no rate).
        self.trial_from: Reading | None = None  # Where the trial in flight is measured from.

    def tune(self, waiting_s: float = 0.0) -> None:
        """Decides on the window since the last decision once it is window_seconds long, and
        acts: the first call only takes the baseline (and updates the record, _keep_entry).
        `waiting_s`: how long next() has waited so far where it calls this while it waits. The
        ring counts a wait only when it ends (at the take), so a long fill (a first batch of
        seconds, a slow __getitem__) would show windows in which the trainer never waited and
        the readers did nothing, and retire a reader the trainer waits for; the reading counts
        the wait so far instead, and the wait's whole length, added at its take, then counts
        only its part after this window."""
        now_ns = self.clock()
        if self.baseline is not None and now_ns - self.baseline.at_ns < self.window_seconds * 1e9:
            return
        reading = self.read()
        if waiting_s > 0:
            reading = dataclasses.replace(reading, waited_ns=reading.waited_ns + int(waiting_s * 1e9))
        if self.share is not None:
            self.share.pace((now_ns - self.tuned_ns) / 1e9,
                            ring_fill_seconds(reading, self.pool.active(), self.started_ns))
        self.tuned_ns = now_ns
        if self.baseline is None or self.pool.ring is None or self.pool.starting_note():
            self.baseline = reading  # Nothing to judge while readers start: their waits are the start's.
            self.steady = [reading]
            if self.prober.trial is not None:  # A trial's readers are measured once they run.
                self.trial_from = reading
                self.prober.trial = dataclasses.replace(self.prober.trial, started_s=now_ns / 1e9)
            self._keep_entry(now_ns)
            return
        active = self.pool.active()
        window = window_of(self.baseline, reading, active)
        self.baseline = reading
        # Readers idle on a full ring (a trainer away from next()) fill at its pace, not theirs: a
        # rate that counted that time would keep a retirement on trial that loses a reader's work.
        idled = window.readers_busy < RETIRE_BUSY_SHARE * window.readers
        if idled or self.steady_idled:  # The window after an idle one starts in it too.
            self.steady = [reading]
        else:
            self._keep_steady(reading)
        self.steady_idled = idled
        if self.prober.trial is not None:
            self._judge_trial(reading, now_ns)
            return
        decision = self.decision = decide(window, self.pool.least, self.most, self.calm)
        self.calm = decision.calm
        rate_before, measurable = self._steady_rate(now_ns)
        add_cause = None if decision.change <= 0 else self.prober.add_cause(window.trial_cause,
                                                                             window.readers + decision.change)
        decision = self._add_on_trial(decision, add_cause, rate_before, measurable, now_ns)
        change, why = decision.change, decision.why
        if self.share is not None:
            change, why = self._within_budget(decision, window)
        on_trial = change > 0 and add_cause is not None and measurable  # rate_before is known.
        earned = False  # Whether a trial's reader is past the budget (readers/earned.py).
        if change == 0 and self._retire_on_trial(window, rate_before, now_ns):
            on_trial, change, why = True, -1, (f"trial: the trainer waits {window.trainer_wait:.0%} of the time for "
                                               f"{len(active)} readers that {window.trial_cause}, and none can be added; "
                                               f"{len(active) - 1} tried")
            earned = self.share is not None and self.share.earned > 0  # Earned ones retire first.
        elif change == 0:
            change, why = earned_trial(self, window, decision.change, rate_before, now_ns)
            on_trial = earned = change > 0
        done = self._act(change, why, now_ns, len(active))
        if done and on_trial:
            self.prober.start(done, rate_before, len(active), now_ns / 1e9, earned=earned)
            self.trial_from = self.baseline

    def _keep_steady(self, reading: Reading) -> None:
        """Adds a reading to those since the last change (the last PROBE_WINDOWS_MOST + 1);
        tune() starts them again where the readers idled on a full ring (a trainer away)."""
        self.steady = (self.steady + [reading])[-(PROBE_WINDOWS_MOST + 1):]

    def _steady_rate(self, now_ns: int) -> tuple[float | None, bool]:
        """(batches per second with the readers as they are, since the last change; whether a
        trial can be judged). The rate over the shortest recent window of at least
        probe_seconds and PROBE_FILLS_MIN fills a reader; where fills are slower than that
        (seconds each), over the last PROBE_WINDOWS_MOST windows once they have run, coarse
        but the same measure the trial is judged by (probe.Prober.due). (None, True): not run
        that long yet; (None, False): no fill in all that time, so no rate to judge by, and
        decide's add goes untried, as it did before trials."""
        if not self.steady:
            return None, True
        latest, enough = self.steady[-1], PROBE_FILLS_MIN * self.pool.active_count
        for reading in reversed(self.steady[:-1]):
            window = window_of(reading, latest, [])
            if (now_ns - reading.at_ns >= self.prober.probe_seconds * 1e9
                    and window.batches_per_second * window.seconds >= enough):
                return window.batches_per_second, True
        if len(self.steady) <= PROBE_WINDOWS_MOST:
            return None, True
        rate = window_of(self.steady[0], latest, []).batches_per_second
        return (rate, True) if rate > 0 else (None, False)

    def _add_on_trial(self, decision: Decision, cause: str | None, rate_before: float | None, measurable: bool,
                      now_ns: int) -> Decision:
        """decide's add, where the CPU cannot judge it (`cause`, Prober.add_cause): on trial
        (readers/probe.py), so held while that direction's back-off runs or before the rate it
        is judged against."""
        if decision.change <= 0 or cause is None or not measurable:
            return decision
        if not self.prober.may_try(1, now_ns / 1e9):
            return Decision(0, decision.why + "; " + self.prober.waits_why(1, now_ns / 1e9), decision.calm)
        if rate_before is None:
            return Decision(0, decision.why + f"; the rate of these readers is measured over {self.prober.probe_seconds:.0f} s "
                                              f"first, to judge the add against", decision.calm)
        most = self.prober.add_most
        if most is not None and decision.change > most:
            return Decision(most, decision.why + f"; {most} on trial (an add of {2 * most} or more did not pay)",
                            decision.calm)
        return decision

    def _retire_on_trial(self, window: Window, rate_before: float | None, now_ns: int) -> bool:
        """Whether to retire a reader on trial: the trainer waits for readers the CPU cannot
        judge (Window.trial_cause), none could be added, and fewer may deliver as much
        (readers/probe.py)."""
        return (window.trial_cause is not None and window.readers_wanted and rate_before is not None
                and self.pool.active_count > self.pool.least and self.prober.may_try(-1, now_ns / 1e9))

    def _judge_trial(self, reading: Reading, now_ns: int) -> None:
        """Ends the trial in flight once it has run probe_seconds: kept, or undone (an add
        given back; a retired reader added back as far as the node's budget has room, or an
        earned one as readers/earned.py says)."""
        trial, held = self.prober.trial, self.pool.active_count
        if held != trial.readers_before + trial.change:  # The budget took or gave readers meanwhile.
            self.prober.abandon(f"ended unjudged: the node's budget made the {trial.readers_before + trial.change} "
                                f"readers on trial {held}")
            if trial.earned and trial.change > 0:  # An earned reader stays only where a trial measured it.
                self.share.earning = False
                self._act(-1, "an earned reader's trial ended unjudged (the budget changed the readers)", now_ns, held)
            else:
                self._keep_entry(now_ns)
            return
        window = window_of(self.trial_from, reading, [])
        if not self.prober.due(now_ns / 1e9, round(window.batches_per_second * window.seconds)):
            self._keep_entry(now_ns)
            return
        undo, why = self.prober.judge(window.batches_per_second, now_ns / 1e9)
        if self.share is not None:
            undo, why = settle_trial(self, trial, held, window, undo, why)
        if not self._act(undo, why, now_ns, held):
            self.steady = [self.trial_from, reading]  # Kept: the trial measured the readers as they are.
            self._keep_entry(now_ns)

    def _keep_entry(self, now_ns: int) -> None:
        """A window with nothing to judge (the first, or readers that start) still updates the
        record, so that this loader is not taken for idle; where it finds the node past the
        budget and its readers have started, it gives back what the split asks."""
        if self.share is None:
            return
        ready = self.pool.ring is not None and not self.pool.starting_note()
        held = self.pool.active_count
        standing = self.share.publish(held, give=ready)
        if standing is not None and standing.yields:
            why = (self._past_budget_why(standing, held) if standing.past_budget else
                   f"a loader of this node below its equal part waits for readers: {standing.yields} given up")
            self._act(-standing.yields, why, now_ns, held)

    def _act(self, change: int, why: str, now_ns: int, active_count: int) -> int:
        """Adds (change > 0) or retires readers, records the change and its reason, and
        returns the readers added (or, negative, retired)."""
        done = 0
        for _ in range(change):
            try:
                done += self.pool.add_reader() is not None
            except OSError as error:  # No process to be had (a process or memory limit): training goes on.
                self.add_failure = f"adding a reader failed at {(now_ns - self.started_ns) / 1e9:.1f} s: {error}"
                break
        for _ in range(-change):
            if self.pool.retire_reader() is None:
                break
            done -= 1
        if self.share is not None and change > done >= 0:  # Claimed, not started: not a retirement of earned ones.
            self.share.not_started(change - done)
        recorded = None if self.share is None or self.share.now is None else self.share.now.held
        if recorded is not None and recorded != self.pool.active_count:  # What runs, not what was claimed.
            self.share.publish(self.pool.active_count, give=False)
        if done:
            self.changes += 1
            self.last = {"at_s": round((now_ns - self.started_ns) / 1e9, 3), "from": active_count,
                         "to": active_count + done, "why": why}
            self.baseline = self.read()  # The next window starts with the new readers.
            self.steady = [self.baseline]
        return done

    def _within_budget(self, decision: Decision, window: Window) -> tuple[int, str]:
        """The decision within the node's reader budget (readers/node_budget.py): an add only
        as far as the budget has room, claimed in the record before the readers start; and
        readers given up for another loader of the node whose trainer waits."""
        share, held = self.share, window.readers
        if decision.change > 0:
            granted = share.claim(held, decision.change)
            if granted >= decision.change:
                return decision.change, decision.why
            standing = share.now
            note = "" if standing is None else (f" ({standing.node_held} of {standing.budget} held by "
                                                f"{standing.loaders} loaders)")
            why = decision.why + f"; the node's reader budget gave {granted} of {decision.change}{note}"
            if granted == 0 and standing is not None and standing.yields:
                if standing.past_budget:
                    return -standing.yields, self._past_budget_why(standing, held)
                return -standing.yields, why + f": {standing.yields} given to a loader below its equal part"
            return granted, why
        standing = share.publish(held, 0, spare_readers(window, self.pool.least))
        if standing is None or not standing.yields or -decision.change > standing.yields:
            return decision.change, decision.why  # The record holds held - yields: this retires as many or more.
        if standing.past_budget:
            return -standing.yields, self._past_budget_why(standing, held)
        return -standing.yields, (f"another loader of this node waits for readers, and this one's trainer waited "
                                  f"{window.trainer_wait:.0%} with {held} readers "
                                  f"{window.readers_busy / max(1, held):.0%} busy: {standing.yields} given up "
                                  f"({standing.node_held} of the node's {standing.budget} held by "
                                  f"{standing.loaders} loaders)")

    @staticmethod
    def _past_budget_why(standing, held: int) -> str:
        """Why readers were given up where the node ran past its budget (node_budget.yields)."""
        cause = ("this loader was idle and others used its readers meanwhile" if standing.returning else
                 "a loader joined with its least where the budget had no room, or fixed loaders run past it")
        idle = f", {standing.idle_loaders} idle" if standing.idle_loaders else ""
        return (f"the node's readers ran past its budget of {standing.budget} ({cause}): {standing.yields} of this "
                f"loader's {held} given up ({standing.node_held + standing.yields} held by {standing.loaders} "
                f"loaders{idle} before)")

    def report(self) -> dict:
        """stats()'s part: the active readers, their bounds, the last change and its reason."""
        return {"reader_count": self.pool.active_count, "readers_least": self.pool.least,
                "readers_most": self.most, "reader_changes": self.changes, "reader_change": self.last,
                "reader_add_failure": self.add_failure, "reader_trial": self.prober.report(),
                "readers_earned": 0 if self.share is None else self.share.earned}

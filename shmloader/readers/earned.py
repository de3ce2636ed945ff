"""readers="auto"'s earned readers: a reader past the node's reader budget, added on trial where
the node's measured idle CPU says it could run, and kept only where the delivered rate rose.

The budget (plan/defaults.node_budget, split by readers/node_budget.py) counts: the node's
cores less a whole core for each trainer, and a whole core for each reader. A trainer whose
step is a GPU's (a sleep, to the CPU) leaves most of its core idle, and a reader that waits
for its batch to be taken leaves part of its own: on a node of 2 cores with 2 ranks the
budget is 1, both ranks run their least (1 reader each), and auto can never add, while more
than half a core is idle and one rank's trainer waits for its reader. /proc/stat's idle time
(Window.idle_cores) is what the node has; the trial (readers/probe.py) is what a reader more
does with it.

So, where the trainer waits for its readers (Window.readers_wanted) and the loader is below
its most, and the window shows at least EARN_IDLE_CORES_MIN idle cores, but
- decide (autotune.py) added none because no whole core is idle (IDLE_CORES_MIN), or
- the node's budget gave none of decide's add, and has no room left (other loaders hold it),
one reader is added on trial past the budget (budget_record.NodeShare.earn: one earned
trial in flight on the node at a time, through the record), judged as any add on trial (kept
where the rate rose KEEP_GAIN, else undone, with the add direction's back-off). A kept one
stays `earned` in the record: not counted against the budget, never asked back by another
loader (node_budget.py), and the first to go when this loader retires readers of its own
accord. Where the node gets crowded, its readers wait for a core and the retirement trials
(probe.py) try one fewer: the earned reader goes, and comes back (as earned: the budget has
no room for it, it was never the budget's) only where the rate says it paid and the trial's
window still shows EARN_IDLE_CORES_MIN idle cores. Where the CPU it freed was taken (another
loader's readers queued for it), it stays gone: the trial measured this loader's rate alone,
and an earned reader does not stay where the CPU it was earned on is gone.

Only with a usable record: one earned trial at a time on the node is the record's to say, and
a loader alone without it (the record refused) has no budget to earn past. Never past a
budget the user set (SHMLOADER_CPU_BUDGET): that caps the node's readers, earned or not.
"""

from __future__ import annotations

# Half a core idle over a window: a reader that fills while its trainer sleeps through a GPU
# step needs its CPU only part of the time, and on a node of a few cores that half is the
# room between a trainer counted as a whole core and one that sleeps. Below it, the idle time
# is a window's noise and the gaps between a reader's fills: a reader more would queue.
EARN_IDLE_CORES_MIN = 0.5


def earn_cause(window, decided: int, asked: int, most: int, standing) -> str | None:
    """Why an earned trial is due on `window` (an autotune.Window), in words, or None: the
    trainer waits for its readers, the loader is below `most`, at least EARN_IDLE_CORES_MIN
    cores are idle, and either decide added nothing (`decided`: there, below the most, it adds
    none only for want of a whole idle core), or the node's budget (`standing`, the update
    that claimed `asked`, decide's add after the trial rules) gave none and has no room."""
    idle = window.idle_cores
    if not window.readers_wanted or window.readers >= most or idle is None or idle < EARN_IDLE_CORES_MIN:
        return None
    if decided == 0:
        return f"{idle:.1f} cores idle (at least {EARN_IDLE_CORES_MIN}), though not a whole one"
    if asked > 0 and standing is not None and standing.granted == 0 and standing.room <= 0:
        return (f"{idle:.1f} cores idle (at least {EARN_IDLE_CORES_MIN}), though the node's budget of "
                f"{standing.budget} readers is taken ({standing.node_held} held by {standing.loaders} loaders)")
    return None


def earned_trial(tuner, window, asked: int, rate_before: float | None, now_ns: int) -> tuple[int, str]:
    """An earned trial for `tuner` (autotune.Tuner) where one is due and may start now: the
    reader claimed as earned in the record (not started: the caller's _act starts it);
    (1, why), or (0, why not; "" where none is due). `asked`: earn_cause's, and its
    `decided` is tuner.decision's (decide's own, on this window)."""
    share = tuner.share
    if share is None or share.error is not None or share.capped:  # A cap the user set holds.
        return 0, ""
    cause = earn_cause(window, tuner.decision.change, asked, tuner.most, share.now if asked > 0 else None)
    # Judged as any add on trial: against the rate measured first, and after the add direction's back-off.
    if cause is None or rate_before is None or not tuner.prober.may_try(1, now_ns / 1e9):
        return 0, ""
    readers = window.readers
    said = (f"the trainer waits {window.trainer_wait:.0%} of the time for {readers} readers "
            f"{window.readers_busy / readers:.0%} busy, {cause}")
    if not share.earn(readers):
        elsewhere = share.now is not None and share.now.earning_elsewhere
        return 0, said + ("; another loader of the node has an earned trial in flight" if elsewhere else "")
    return 1, f"earned trial: {said}: 1 tried past the node's reader budget"


def settle_trial(tuner, trial, held: int, window, undo: int, why: str) -> tuple[int, str]:
    """A trial of `tuner` (autotune.Tuner; probe.Trial) judged (`undo` and `why`,
    Prober.judge's), with the node's record: an earned trial's flag cleared (the next update
    writes it); a retired reader added back as far as the budget has room, or an earned one
    as earned_back says; (readers to add, or negative to retire, why)."""
    share = tuner.share
    if trial.earned and trial.change > 0:
        share.earning = False
        return undo, why
    if undo <= 0:
        return undo, why
    if not trial.earned:
        granted = share.claim(held, undo)
        if granted < undo:  # stats()'s "reader_trial" beside a count that is not the one before the trial.
            why = tuner.prober.last = f"{why}; the node's reader budget had no room to add back {undo - granted}"
        return granted, why
    undo, why = earned_back(share, held, window, why)
    tuner.prober.last = why  # stats()'s "reader_trial": how it ended, where no change says so.
    return undo, why


def earned_back(share, held: int, window, why: str) -> tuple[int, str]:
    """After a retirement trial of an earned reader that did not pay (`why`, the Prober's):
    the reader back past the budget (NodeShare.earn, not on trial) where the trial's `window`
    still shows EARN_IDLE_CORES_MIN idle cores, else none (the module note); (readers added, why)."""
    idle = window.idle_cores
    if idle is None or idle < EARN_IDLE_CORES_MIN:
        shown = "unknown" if idle is None else f"{idle:.1f}"
        return 0, why + f"; the earned reader is not added back: {shown} cores idle (the CPU it was earned on is gone)"
    return int(share.earn(held, trial=False)), why + f"; the earned reader added back ({idle:.1f} cores idle)"

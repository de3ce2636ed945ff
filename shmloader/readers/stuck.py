"""What the trainer says of a reader it replaces: one that died and is restarted
(warn_restarted), and one that does not hand back its slot when the trainer takes the
slots back (a seek, a new pass or epoch, a resume, the next pass after a step timed out):
what it was doing, from /proc, for the warning that says it was killed and replaced
(ReaderPool.replace_stuck).

The step it held belongs to the position being left, so nothing is lost by killing it: the
slot goes IDLE and the new position requests it again. Waiting longer only delays the new
pass (a SIGSTOPped reader never hands it back; a transform stuck in a call may not)."""

from __future__ import annotations

import dataclasses
import time
import warnings

from ..errors import ReaderRestartWarning, ReaderStallWarning, user_stacklevel

# What /proc/PID/stat's state letter means, in the warning's words.
_STATES = {
    "T": "stopped (SIGSTOP, Ctrl-Z or a debugger)",
    "t": "stopped by a debugger (traced)",
    "D": "in uninterruptible I/O (a stalled file system?)",
    "S": "asleep",
    "R": "running",
    "Z": "exited, not yet reaped",
}


def activity(pid: int) -> str:
    """What process `pid` is doing, as its /proc entry says ("asleep in futex_wait"), or
    "in an unknown state" where it cannot be read."""
    try:
        with open(f"/proc/{int(pid)}/stat") as handle:
            letter = handle.read().rsplit(") ", 1)[1].split()[0]
    except (OSError, IndexError, ValueError):
        return "in an unknown state"
    described = _STATES.get(letter, f"in state {letter!r}")
    if letter in ("S", "D"):
        try:
            with open(f"/proc/{int(pid)}/wchan") as handle:
                channel = handle.read().strip()
        except OSError:
            channel = ""
        if channel and channel != "0":
            described += f" in {channel}"
    return described


def rows_note(rows) -> str:
    """", rows [3, 9, 1]" for a step's dataset rows (at most 8 shown), or ""."""
    if rows is None:
        return ""
    rows = [int(row) for row in rows]
    shown = ", ".join(str(row) for row in rows[:8]) + (", ..." if len(rows) > 8 else "")
    return f", rows [{shown}]"


@dataclasses.dataclass
class Report:
    """What is known of a stuck reader before it is killed; warn() says it once replaced."""

    reader_index: int
    pid: int
    slot: int
    step: int
    waited_s: float
    why: str  # The caller's act: "a seek", "the start of the next epoch", ...
    doing: str  # activity(pid)
    requested_ns: int  # When the trainer requested the step (CLOCK_MONOTONIC), 0 if unknown.
    step_rows: object = None  # step -> its dataset rows, or None

    def warn(self, new_pid: int) -> None:
        rows = None
        if self.step_rows is not None:
            try:
                rows = self.step_rows(self.step)
            except Exception:
                rows = None  # Only the warning's detail.
        now_ns = time.monotonic_ns()
        since = (f" (requested {(now_ns - self.requested_ns) / 1e9:.1f} s ago)"
                 if 0 < self.requested_ns <= now_ns else "")
        warnings.warn(
            f"reader {self.reader_index} (pid {self.pid}) did not hand back slot {self.slot} within "
            f"{self.waited_s:.1f} s at {self.why}: it was {self.doing}, filling step {self.step}{rows_note(rows)}"
            f"{since}. It was killed and reader {self.reader_index} started anew (pid {new_pid}); the step belonged "
            f"to the position left, so nothing is lost.",
            ReaderStallWarning, stacklevel=user_stacklevel())


def warn_restarted(reader_index: int, pid: int, exited: str, step: int | None, new_pid: int, count: int,
                   max_restarts: int) -> None:
    """The warning of a dead reader's restart: its signal or exit code, the step it was
    filling, and its count against max_reader_restarts (past it, the loader raises)."""
    where = "" if step is None else f" while filling step {step} (filled again)"
    warnings.warn(f"reader {reader_index} (pid {pid}) {exited}{where}; restarted as pid {new_pid}, restart {count} of "
                  f"max_reader_restarts={max_restarts} for this reader (a death once it has had them all raises "
                  f"ReaderError)",
                  ReaderRestartWarning, stacklevel=user_stacklevel())

"""The node's reader budget record: one small file in /dev/shm through which the loaders of
every rank on the node share one reader budget (readers/node_budget.py splits it), with no
daemon: the first loader creates it, each writes its own entry, the last one removes it.
(Past 450 lines: the layout, its rules for dead, stopped and idle loaders, and the checks of
what another process wrote stay beside the one class that writes the file.)

Name: shml-budget-v{RECORD_VERSION}-u{uid}-n{pid namespace}[-{SHMLOADER_BUDGET_SCOPE}].
The uid keeps users apart, the pid namespace containers that share /dev/shm (a pid is only
judged alive in its own namespace), the version loaders of another layout (they keep their
own budget instead of misreading this one), and the scope, where set, jobs that must not
share (a test run).

Layout (little-endian; every update reads and writes the whole file under an exclusive
flock held for the update alone, so a loader killed -9 never leaves the lock taken):

    offset        size  field        meaning
    ------------  ----  -----------  ---------------------------------------------------
    0             8     magic        RECORD_MAGIC
    8             4     version      RECORD_VERSION
    12            4     entry_count  ENTRY_COUNT
    16            48    (zero)
    64 + i*64     64    entry i      one live loader, or all zero (free):
      +0          4       pid          its trainer's pid
      +4          4       held         readers it runs now
      +8          8       start_ticks  its trainer's start time (/proc/pid/stat field 22):
                                       a pid reused by another process differs
      +16         8       token        which loader of that process
      +24         4       least        the fewest readers it runs
      +28         4       most         the most it may run (least == most: fixed, readers=N)
      +32         4       wants        readers its rule asked for that the budget did not give
      +36         4       spare        readers it could give up with its trainer not waiting
      +40         4       budget       the node budget as this loader sees it
                                       (plan/defaults.node_budget); the smallest applies
      +44         4       idle_after_ms  how long after its last update the others take it
                                       for idle (below: never less than IDLE_SECONDS_MIN)
      +48         8       updated_ns   CLOCK_MONOTONIC of its last update
      +56         4       earned       readers of `held` past the budget by a trial that
                                       measured the CPU for them (readers/earned.py), the
                                       one on trial included; not counted against it;
                                       at most held - least (a fixed loader: none)
      +60         4       flags        FLAG_EARNING: an earned trial of this loader's is in
                                       flight (then earned >= 1); no other bit is set

Idle loaders. A loader acts only inside its own next() (readers/autotune.py), so one whose
trainer has stopped calling it (a validation loader between passes, one made before the
model) would hold its readers against the budget for good, though they sleep beside its full
ring. Its entry is idle once `updated_ns` is older than its `idle_after_ms`: then only its
`least` counts, and the rest is room for the others (node_budget.py). A loader updates its
entry once a tuner window (1 s) while next() is called that often, and at each next() where
its steps are slower (the cursor's periodic check is due by time too: session.py), and each
update publishes the longest of: IDLE_SECONDS_MIN (three windows: a window or two lost to a
pause of the process, a collection or a checkpoint's write, does not count); IDLE_GAPS times
the time since its previous window, so that a loader whose steps take 10 s is idle only
after 30 s without a next(); and the time its readers take to fill its whole ring, so that
by then they sleep (a loader whose readers are still busy filling keeps them). So idle
means: no next() for three of its own steps, three windows at least, and its ring full. One
that comes back publishes its time away once (its next window publishes its pace again), and
its first update finds the node past the budget where others grew into its readers: it
retires its own down to what is left (node_budget.yields; readers/elastic.py: no pause in
delivery, no batch changed). Its earned readers were earned on a CPU it has not measured
since: they are earned no more, and are given back as any (node_budget.py).

Earned trials. At most one loader of the node has an earned trial in flight (FLAG_EARNING):
an earned reader runs on idle CPU another loader could be measuring too, and two trials at
once would each judge the other's reader as their own. A loader claims the trial in the same
update that checks no other live, non-idle entry has the flag (an idle one's trial measures
nothing while its trainer is away: its flag is old news), and clears it in the update after
the trial ends. Where a loader retires readers of its own accord (its rule, a retirement
trial, an add undone) its earned readers go first; readers the split asks back (yields) are
never earned ones.

A loader killed -9 leaves its entry: every update first frees the entries whose trainer is
gone (no /proc entry, a zombie, or another start time), so its share comes back to the
others at their next window. The last loader to close finds no live entry and unlinks the
file while it holds the lock; a loader that opened the file before then sees, once it has the
lock, that its path names another file (or none), and opens again.

One killed during the write that makes the file leaves a record cut short at a page (the
kernel stops a write there for a fatal signal): whole entries after a right header are taken,
the missing ones free. One stopped (SIGSTOP, a debugger) inside its update keeps the lock:
another's update waits _LOCK_WAIT_SECONDS, then leaves the record alone for a back-off that
doubles while the lock stays taken. Liveness needs this pid namespace's /proc: where /proc
is another's (or none), a pid there names another process, and the loader keeps out.

Whatever is in the file is foreign input (another program, a damaged write): a file that is
not this user's regular file, or whose size, magic, version or entries are not what this
module writes, raises NodeBudgetError, and the loader runs without the budget.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import operator
import os
import re
import secrets
import stat
import struct
import time
import warnings

from ..errors import NodeBudgetError, NodeBudgetWarning
from ..plan.defaults import CPU_BUDGET_MAX, cpu_budget_cap, node_budget
from ..ring.layout import SHM_DIRECTORY
from . import node_budget as split
from .node_budget import Holding

RECORD_MAGIC = b"SHMLBDGT"
# 2: entries carry idle_after_ms, and loaders that do not update are taken for idle.
# 3: entries carry earned and flags (the bytes that were zero): a version 2 loader would count
# earned readers against the budget and ask them back, so the two keep apart (the name's version).
RECORD_VERSION = 3
# Loaders on one node at once: eight ranks with a few loaders each fit many times over.
ENTRY_COUNT = 256
_HEADER = struct.Struct("<8sII48x")
_ENTRY = struct.Struct("<IIQQIIIIIIQII")
# entry flags' bit: an earned trial of this loader's is in flight (the module note).
FLAG_EARNING = 1
_FREE_ENTRY = bytes(_ENTRY.size)
RECORD_BYTES = _HEADER.size + ENTRY_COUNT * _ENTRY.size
assert _HEADER.size == 64 and _ENTRY.size == 64

SCOPE_VARIABLE = "SHMLOADER_BUDGET_SCOPE"
_SCOPE_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# How long an update waits for another loader's (each holds the lock for one read and write
# of 16 KiB); one stopped (SIGSTOP) mid-update costs this loader one window's update.
_LOCK_WAIT_SECONDS = 0.5
_LOCK_POLL_SECONDS = 0.002
# After a wait that timed out, the record is left alone this long, doubled at each timeout in
# a row up to the most: the wait runs inside next(), and a loader stopped inside its update
# would otherwise cost every other trainer of the node half a second each window.
_LOCK_BACKOFF_SECONDS = 2.0
_LOCK_BACKOFF_MAX_SECONDS = 64.0
# The idle rule (module note): an entry not updated for IDLE_GAPS times the time between its
# last two updates, and at least three tuner windows, is idle.
IDLE_SECONDS_MIN = 3.0
IDLE_GAPS = 3
# The most idle_after_ms a loader publishes: a day, far past any training step.
_IDLE_AFTER_MS_MAX = 86_400_000
# Opens of a path whose file the last loader removed meanwhile: each retry finds a new file.
_REOPENS_MAX = 8


@dataclasses.dataclass
class _Entry:
    """One entry's fields, in the layout's order (the module note)."""

    pid: int = 0
    held: int = 0
    start_ticks: int = 0
    token: int = 0
    least: int = 0
    most: int = 0
    wants: int = 0
    spare: int = 0
    budget: int = 0
    idle_after_ms: int = 0
    updated_ns: int = 0
    earned: int = 0
    flags: int = 0

    def holding(self, now_ns: int) -> Holding:
        """Its Holding; a fixed loader has no tuner to update its entry, and is never idle."""
        changing = self.least < self.most
        return Holding(self.held, self.least, self.most, self.wants, self.spare, changing and idle(self, now_ns),
                       self.earned)

    def earning(self, now_ns: int) -> bool:
        """Whether its earned trial is in flight: an idle loader's flag is old news (module note)."""
        return bool(self.flags & FLAG_EARNING) and not idle(self, now_ns)


def idle(entry: _Entry, now_ns: int) -> bool:
    """Whether `entry`'s loader has not updated it for longer than its idle time (module
    note): at least IDLE_SECONDS_MIN, whatever a foreign writer put in idle_after_ms."""
    idle_after_ns = max(entry.idle_after_ms * 1_000_000, int(IDLE_SECONDS_MIN * 1e9))
    return now_ns - entry.updated_ns > idle_after_ns


# The fields in the layout's order, read at once: dataclasses.astuple copies each value deeply
# and made an update's pack of 256 entries take milliseconds, inside next().
_entry_fields = operator.attrgetter(*(field.name for field in dataclasses.fields(_Entry)))


@dataclasses.dataclass(frozen=True)
class Standing:
    """What an update found: the node's budget, its readers and loaders, this loader's
    readers, and what the split gave it (`granted`) or asks of it (`yields`)."""

    budget: int
    node_held: int
    loaders: int
    held: int
    granted: int = 0
    yields: int = 0
    idle_loaders: int = 0
    past_budget: bool = False  # Counted readers past the budget before this loader gave any.
    returning: bool = False  # This loader's entry was idle until this update.
    room: int = 0  # The budget less the node's counted readers, after this update (node_budget.room).
    earned: int = 0  # This loader's earned readers (module note), after this update.
    earned_added: int = 0  # The earned readers this update added (NodeShare.earn).
    earning_elsewhere: bool = False  # Another loader of the node has an earned trial in flight.


def record_path(environment=os.environ, directory: str = SHM_DIRECTORY) -> str:
    """The record's path for this user, pid namespace and scope (module note)."""
    scope = environment.get(SCOPE_VARIABLE, "")
    if scope and not _SCOPE_PATTERN.fullmatch(scope):
        raise ValueError(f"{SCOPE_VARIABLE}={scope!r}: expected 1-64 letters, digits, '_', '.' or '-' (loaders with "
                         f"the same scope share the node's reader budget); unset it to share with every loader")
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return os.path.join(directory, f"shml-budget-v{RECORD_VERSION}-u{os.geteuid()}-n{namespace}"
                                   + (f"-{scope}" if scope else ""))


def start_ticks(pid: int) -> int | None:
    """Process `pid`'s start time in clock ticks since boot; None where it is gone or a zombie
    (killed, not yet reaped: it runs no code again)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read(4096).decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it went between the open and the read.
        return None
    except OSError:
        return 0  # Not ours to read: alive as far as anyone can tell.
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19]) if fields[19].isdigit() else 0


def proc_problem() -> str | None:
    """Why /proc cannot say which loaders live (reclaim): none mounted, or another pid
    namespace's (a sandbox that made its own and kept the host's /proc), where a pid names
    another process and a killed loader's entry could look alive forever; None where it can."""
    try:
        shown = os.readlink("/proc/self")
    except OSError as error:
        return f"/proc/self cannot be read ({error}): /proc must say which loaders of the node live"
    if shown != str(os.getpid()):
        return (f"/proc is another pid namespace's (/proc/self is {shown}, this process is {os.getpid()}): it "
                f"cannot say which loaders of the node live; mount this namespace's /proc (unshare --mount-proc)")
    return None


def _alive(entry: _Entry) -> bool:
    ticks = start_ticks(entry.pid)
    return ticks is not None and (ticks == 0 or entry.start_ticks == 0 or ticks == entry.start_ticks)


def parse(data: bytes, path: str) -> list[_Entry]:
    """The entries of a record's bytes; NodeBudgetError where they are not a record this
    module writes. Empty bytes (a file its creator had not written yet) are a fresh record;
    bytes cut short after whole entries (its creator killed mid-write) have the rest free."""
    if not data:
        return [_Entry() for _ in range(ENTRY_COUNT)]
    if _HEADER.size <= len(data) < RECORD_BYTES and len(data) % _ENTRY.size == 0:
        data += bytes(RECORD_BYTES - len(data))  # Checked as a whole record below: the header too.
    if len(data) != RECORD_BYTES:
        raise NodeBudgetError(f"{path} holds {len(data):,} bytes, a node budget record of version {RECORD_VERSION} "
                              f"holds {RECORD_BYTES:,}: not a record this shmloader wrote")
    magic, version, count = _HEADER.unpack_from(data, 0)
    if magic != RECORD_MAGIC or version != RECORD_VERSION or count != ENTRY_COUNT:
        raise NodeBudgetError(f"{path} starts {magic!r}, version {version}, {count} entries; expected "
                              f"{RECORD_MAGIC!r}, version {RECORD_VERSION}, {ENTRY_COUNT}: not a record this "
                              f"shmloader wrote")
    entries = [_Entry(*_ENTRY.unpack_from(data, _HEADER.size + index * _ENTRY.size)) for index in range(ENTRY_COUNT)]
    for index, entry in enumerate(entries):
        if entry.pid and not (entry.least <= entry.held and entry.least <= entry.most <= CPU_BUDGET_MAX
                              and 1 <= entry.budget <= CPU_BUDGET_MAX and entry.held <= CPU_BUDGET_MAX):
            raise NodeBudgetError(f"{path}: entry {index} (pid {entry.pid}) holds {entry.held} readers between "
                                  f"{entry.least} and {entry.most} under a budget of {entry.budget}: not a record "
                                  f"this shmloader wrote")
        problem = _earned_problem(entry)
        if entry.pid and problem is not None:
            raise NodeBudgetError(f"{path}: entry {index} (pid {entry.pid}) {problem}: not a record this "
                                  f"shmloader wrote")
    return entries


def _earned_problem(entry: _Entry) -> str | None:
    """What is wrong with an entry's earned and flags fields (the layout's rules), or None."""
    if entry.earned > entry.held - entry.least:
        return (f"has earned {entry.earned} of its {entry.held} readers with a least of {entry.least}: expected "
                f"earned at most held - least ({entry.held - entry.least})")
    if entry.flags & ~FLAG_EARNING:
        return f"has flags {entry.flags:#x}: expected only FLAG_EARNING ({FLAG_EARNING:#x})"
    if entry.flags & FLAG_EARNING and entry.earned == 0:
        return "has flags FLAG_EARNING (an earned trial in flight) with earned 0: expected the trial's reader earned"
    return None


def pack(entries: list[_Entry]) -> bytes:
    assert len(entries) == ENTRY_COUNT, len(entries)
    return _HEADER.pack(RECORD_MAGIC, RECORD_VERSION, ENTRY_COUNT) + b"".join(
        _ENTRY.pack(*_entry_fields(entry)) if entry.pid else _FREE_ENTRY for entry in entries)


def reclaim(entries: list[_Entry], alive=_alive) -> int:
    """Frees the entries whose trainer is gone; how many."""
    freed = 0
    for index, entry in enumerate(entries):
        if entry.pid and not alive(entry):
            entries[index], freed = _Entry(), freed + 1
    return freed


def _lock(fd: int, path: str) -> None:
    deadline = time.monotonic() + _LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{path}'s lock was held past {_LOCK_WAIT_SECONDS} s")
        time.sleep(_LOCK_POLL_SECONDS)


def _open_locked(path: str) -> int:
    """The record's descriptor, locked, for the file its path names now (module note)."""
    for _ in range(_REOPENS_MAX):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        try:
            _lock(fd, path)
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or opened.st_uid != os.geteuid():
                raise NodeBudgetError(f"{path} is not a regular file of this user (uid {opened.st_uid}, mode "
                                      f"{stat.filemode(opened.st_mode)}): the node budget record cannot be kept there")
            try:
                named = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                named = None
            if named is not None and (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # Removed by the last loader meanwhile.
    raise NodeBudgetError(f"{path} was replaced {_REOPENS_MAX} times while this loader opened it")


def sweep(path: str) -> bool:
    """Removes the record at `path` where every entry's trainer is gone (the last loader was
    killed): what a test run does at its end. Whether it did; never raises."""
    if not os.path.lexists(path):
        return False
    try:
        fd = _open_locked(path)
    except (OSError, NodeBudgetError):
        return False
    try:
        entries = parse(os.pread(fd, RECORD_BYTES + 1, 0), path)
        reclaim(entries)
        if any(entry.pid for entry in entries):
            return False
        os.unlink(path)
        return True
    except (OSError, NodeBudgetError):
        return False
    finally:
        os.close(fd)


class NodeShare:
    """This loader's entry in the node's budget record: join() adds it, publish() and claim()
    update it (from the tuner's window, in next()), close() removes it and the record with
    the last entry. Where the record cannot be used, `error` says why and every call answers
    as if the loader were alone under no budget (claim grants what is asked)."""

    def __init__(self, path: str, budget: int, least: int, most: int) -> None:
        self.path, self.budget, self.least, self.most = path, budget, least, most
        self.pid, self.token = os.getpid(), secrets.randbits(63) | 1
        self.start_ticks = start_ticks(self.pid) or 0
        self.error: str | None = None
        self.closed = False
        self.opened = False  # Whether an update opened the record (and may have made the file).
        # The lock back-off (_LOCK_BACKOFF_SECONDS): no update before retry_at (monotonic).
        self.backoff_seconds, self.retry_at = 0.0, 0.0
        self.last: Standing | None = None  # The last update's that succeeded (report).
        self.now: Standing | None = None  # The latest call's: None where it made no update.
        self.gap_seconds = self.fill_seconds = 0.0  # pace()'s.
        self.started = 0  # The readers join() let this loader start.
        self.earned = 0  # Readers of this loader's past the budget by a trial (module note).
        self.earning = False  # Whether its earned trial is in flight (FLAG_EARNING); the tuner ends it.
        # SHMLOADER_CPU_BUDGET set: the user's cap on the node's readers, earned ones included.
        self.capped = False
        # The readers the record held for it after its last update: an update with fewer is a
        # retirement of its own, and takes its earned readers first (module note).
        self.written_held: int | None = None
        self.last_add_earned = False  # Whether the last update that added readers added an earned one.

    @classmethod
    def join(cls, held: int, least: int, most: int, environment=os.environ) -> NodeShare:
        """Adds this loader's entry for a start of `held` readers between `least` and `most`;
        `started` says how many it may start. A fixed loader (least == most) is counted as it
        is, past the budget or not. A changing one joins with its least and claims the rest of
        its start in the same update, as far as the room allows (node_budget.grant): a loader
        that restarts or comes late does not add its start on top of a budget already taken,
        and loaders that join at once do not each take the same room. Where there is none it
        still starts its least (at least one), and the others give back (node_budget.yields).
        A bad SHMLOADER_CPU_BUDGET or SHMLOADER_BUDGET_SCOPE raises ValueError naming it; a
        record that cannot be used does not raise (the class note)."""
        assert 0 <= least <= held <= most, (least, held, most)
        share = cls(record_path(environment), node_budget(environment), least, most)
        share.started, share.capped = held, cpu_budget_cap(environment) is not None
        problem = proc_problem()
        if problem is not None:
            share._fail(NodeBudgetError(problem))
            return share
        if least == most:
            share.publish(held)
        else:  # A lock held past the wait: the least, and the rest at a later window.
            share.started = least + share.claim(least, held - least)
        return share

    def pace(self, gap_seconds: float, fill_seconds: float = 0.0) -> None:
        """The time since this loader's previous window, and the time its readers take to fill
        its ring (readers/autotune.py): the others take it for idle after the longer of
        IDLE_GAPS of the first and the second, and IDLE_SECONDS_MIN at least (module note)."""
        assert gap_seconds >= 0 and fill_seconds >= 0, (gap_seconds, fill_seconds)
        self.gap_seconds, self.fill_seconds = gap_seconds, fill_seconds

    def _idle_after_ms(self) -> int:
        idle_after_seconds = max(IDLE_SECONDS_MIN, IDLE_GAPS * self.gap_seconds, self.fill_seconds)
        return min(_IDLE_AFTER_MS_MAX, int(idle_after_seconds * 1000))

    def publish(self, held: int, wants: int = 0, spare: int = 0, give: bool = True) -> Standing | None:
        """Writes this loader's readers, what it asks for and what it could give; the standing,
        with the readers it should give up (yields), or None where the record is not used.
        The record holds `held` less those: the caller retires them at once (or publishes
        again what runs). `give=False`: the caller cannot retire now (its readers start), and
        is asked for none."""
        return self._update(held, wants, spare, wanted=0, give=give)

    def claim(self, held: int, wanted: int) -> int:
        """Adds up to `wanted` readers to this loader's entry as far as the budget allows, in
        one update (no other loader can take the same room); how many."""
        standing = self._update(held, wanted, 0, wanted=wanted)
        if standing is None:  # Without the budget: what is asked; a lock held past the wait: none this time.
            return wanted if self.error is not None else 0
        return standing.granted

    def earn(self, held: int, trial: bool = True) -> bool:
        """Adds one earned reader to this loader's entry, past the budget (readers/earned.py),
        in one update: on trial (`trial`), only where no other live loader of the node has an
        earned trial in flight, and this one's is then (`earning`, until the tuner ends it);
        else one given back after a retirement trial that did not pay. Whether it was added:
        never without the record (one trial at a time on the node is the record's to say)."""
        assert held < self.most and not self.earning, (held, self.most, self.earning)
        if self.capped:  # SHMLOADER_CPU_BUDGET: the user's cap holds, earned readers included.
            return False
        standing = self._update(held, 0, 0, wanted=0, give=False, earn="trial" if trial else "back")
        return standing is not None and standing.earned_added > 0

    def not_started(self, count: int) -> None:
        """`count` readers the last claim or earn added did not start (no process to be had):
        the next update takes them off what that add was, not off the earned readers as it
        would a retirement."""
        assert count >= 0, count
        if self.written_held is not None:
            self.written_held -= count
        if self.last_add_earned and count:  # An earn adds one reader: the trial's, if any, never ran.
            self.earned = max(0, self.earned - count)
            self.earning = False

    def _keep_earned(self, held: int, returning: bool) -> None:
        """This loader's earned readers before an update of `held` readers (module note): none
        once it was idle; its own retirements take them first; never past held - least."""
        if returning:
            self.earned = 0
        elif self.written_held is not None and held < self.written_held:
            self.earned = max(0, self.earned - (self.written_held - held))
        self.earned = min(self.earned, max(0, held - self.least))
        self.earning = self.earning and self.earned > 0

    def _earn(self, entries: list[_Entry], mine: _Entry, now_ns: int, earn: str | None) -> tuple[int, bool]:
        """An earn's reader, added to `mine` (NodeShare.earn): (readers added, whether another
        loader's earned trial is in flight)."""
        elsewhere = any(entry.pid and entry is not mine and entry.earning(now_ns) for entry in entries)
        if earn is None or earn == "trial" and elsewhere:
            return 0, elsewhere
        self.earned += 1
        self.earning = self.earning or earn == "trial"
        mine.held, mine.earned = mine.held + 1, self.earned
        mine.flags = FLAG_EARNING if self.earning else 0
        return 1, elsewhere

    def _update(self, held: int, wants: int, spare: int, wanted: int, give: bool = True,
                earn: str | None = None) -> Standing | None:
        assert held >= 0 and wants >= 0 and spare >= 0, (held, wants, spare)
        assert earn in (None, "trial", "back") and not (earn and wanted), (earn, wanted)
        self.now = None
        if self.error is not None or self.closed or time.monotonic() < self.retry_at:
            return None
        self.opened = True
        try:
            fd = _open_locked(self.path)
        except TimeoutError:  # Another loader's update is stopped: this window goes without.
            self.backoff_seconds = min(_LOCK_BACKOFF_MAX_SECONDS, 2 * self.backoff_seconds or _LOCK_BACKOFF_SECONDS)
            self.retry_at = time.monotonic() + self.backoff_seconds
            return None
        except (OSError, NodeBudgetError) as error:
            return self._fail(error)
        self.backoff_seconds = 0.0
        try:
            entries = parse(os.pread(fd, RECORD_BYTES + 1, 0), self.path)
            reclaim(entries)
            index, now_ns = self._find(entries), time.monotonic_ns()
            returning = entries[index].token == self.token and idle(entries[index], now_ns)
            self._keep_earned(held, returning)
            mine = entries[index] = _Entry(self.pid, held, self.start_ticks, self.token, min(self.least, held),
                                           self.most, wants, spare, self.budget, self._idle_after_ms(), now_ns,
                                           self.earned, FLAG_EARNING if self.earning else 0)
            earned_added, earning_elsewhere = self._earn(entries, mine, now_ns, earn)
            live = [position for position, entry in enumerate(entries) if entry.pid]
            holdings = [entries[position].holding(now_ns) for position in live]
            me = live.index(index)
            budget = min(entries[position].budget for position in live)
            granted = split.grant(budget, holdings, me, wanted) if wanted else 0
            mine.held, mine.wants = mine.held + granted, max(0, wants - granted)
            holdings[me] = mine.holding(now_ns)
            past = split.room(budget, holdings) < 0
            given = split.yields(budget, holdings, me, returning) if give and not granted else 0
            mine.held -= given  # Retired by the caller at once: the others may take them now.
            holdings[me] = mine.holding(now_ns)
            standing = Standing(budget, sum(holding.held for holding in holdings), len(live), mine.held,
                                granted, given, sum(holding.idle for holding in holdings), past, returning,
                                split.room(budget, holdings), self.earned, earned_added, earning_elsewhere)
            os.pwrite(fd, pack(entries), 0)
        except (OSError, NodeBudgetError) as error:
            return self._fail(error)
        finally:
            os.close(fd)
        self.written_held = mine.held
        if granted or earned_added:
            self.last_add_earned = bool(earned_added)
        self.last = self.now = standing
        return standing

    def _find(self, entries: list[_Entry]) -> int:
        for index, entry in enumerate(entries):
            if entry.pid == self.pid and entry.token == self.token:
                return index
        for index, entry in enumerate(entries):  # A first update, or a record made anew since.
            if not entry.pid:
                return index
        raise NodeBudgetError(f"{self.path} is full: {ENTRY_COUNT} loaders of this node hold entries")

    def _fail(self, error: BaseException) -> None:
        self.error = f"{error} (the node's reader budget is not used by this loader)"
        warnings.warn(f"this loader runs without the node's reader budget: {error}", NodeBudgetWarning, stacklevel=3)
        return None  # Once: a share with an error makes no more updates.

    def close(self) -> None:
        """Removes this loader's entry, and the record where no live entry is left: also after
        an update failed (an entry it wrote before, or the empty file it made, would be left
        while its process lives); a record it refused stays as it is (parse refuses it again).
        Idempotent; never raises (teardown)."""
        if self.closed or os.getpid() != self.pid:
            return
        self.closed = True
        if self.error is not None and not (self.opened and os.path.lexists(self.path)):
            return  # Nothing of this loader's to take away: no lock to wait for.
        try:
            fd = _open_locked(self.path)
        except (OSError, NodeBudgetError):
            return  # The next loader frees this entry: its pid is gone by then.
        try:
            entries = parse(os.pread(fd, RECORD_BYTES + 1, 0), self.path)
            entries = [_Entry() if entry.pid == self.pid and entry.token == self.token else entry
                       for entry in entries]
            reclaim(entries)
            if not any(entry.pid for entry in entries):
                os.unlink(self.path)  # Under the lock: a loader waiting for it opens again.
            else:
                os.pwrite(fd, pack(entries), 0)
        except (OSError, NodeBudgetError):
            pass
        finally:
            os.close(fd)

    def report(self) -> dict:
        """stats()["node_budget"]: the budget, the node's readers and loaders at the last
        update (and how many of them idle), and this loader's; or the error that keeps it
        from the budget."""
        if self.error is not None:
            return {"error": self.error}
        last = self.last
        if last is None:
            return {"budget": self.budget}
        return {"budget": last.budget, "node_readers": last.node_held, "loaders": last.loaders,
                "idle_loaders": last.idle_loaders, "readers": last.held, "record": self.path}

"""readers="auto"'s pool: reader processes that join and leave a running ring (ElasticPool).

The ring keeps a reader record for each reader the loader may reach (`count`, the most
readers="auto" may take); `processes` stays indexed by record, as ReaderPool's loops expect,
and what stands in a record is one of:

    stand-in        the record's reader                          supervised by
    --------------  -------------------------------------------  ------------------------------
    a process       active: claims and fills steps               ReaderPool (restarted if it dies)
    _Leaving        retired: fills the step it claimed, exits 0  this module (_reap_leaving)
    _Vacant         none                                          nobody: never "exited"

Joining (add_reader): a reader starts in the lowest vacant record and is configured like any.
From its first claim it fills whatever step is requested: readers claim by compare-and-swap
on a slot's state word, and a step's contents depend only on the data, the seed, the step
and the shard, so a batch does not change with the reader that fills it.

Leaving (retire_reader): the trainer sends the reader RETIRE_MESSAGE on its pipe (channel.py);
the reader looks at its pipe after each claim, fills and publishes the step it claimed, if
any, and exits with 0. The record's stand-in becomes _Leaving at once, whose poll() says
"running" to ReaderPool's supervision whatever the process does, so a retired reader is never
taken for a dead one, restarted, or counted against max_reader_restarts. _reap_leaving,
called before each check, makes its record vacant once the process has exited; if it died
mid-step (SIGKILL) the step it was filling is requested again, as a dead reader's is. One
whose last step raised goes back to ReaderPool as a failed reader: its error is raised
the same way, and the reader that replaces it is active again.
"""

from __future__ import annotations

import subprocess

from .channel import RETIRE_MESSAGE, send_to_all
from .pool import ReaderPool

# How long retire_reader waits to write its seven bytes (a pipe holds 64 KiB; only a reader
# that has not drained a long filler line yet makes it wait).
_RETIRE_SEND_SECONDS = 0.5


class _Vacant:
    """What stands in a record no process uses: it never exits (ReaderPool would restart it),
    has no pipe, and its pid 0 is never signalled (Diagnostics.reader_pids leaves it out)."""

    pid = 0
    stdin = None

    def poll(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def kill(self) -> None:
        pass


class _Leaving:
    """A retired reader's process, as ReaderPool sees it until _reap_leaving takes it: running
    (poll() None) whatever it does; kill() and wait() reach the process itself, so that
    stop(), a take-back's replace_stuck and renew_failed end it like any reader."""

    def __init__(self, process) -> None:
        self.process, self.pid, self.stdin = process, process.pid, process.stdin

    def poll(self) -> None:
        return None

    def wait(self, timeout: float | None = None):
        return self.process.wait(timeout)

    def kill(self) -> None:
        self.process.kill()


class ElasticPool(ReaderPool):
    """A ReaderPool of `records` reader records that starts `start` readers and adds or
    retires them while the loader runs (add_reader, retire_reader), between `least` and
    `records`. The decisions are readers/autotune.py's."""

    def __init__(self, records: int, max_restarts: int, start: int, least: int = 1) -> None:
        assert 1 <= least <= start <= records, (least, start, records)
        super().__init__(records, max_restarts)
        self.start_count, self.least = start, least

    def start(self) -> None:
        """Starts `start` readers in the first records; the others are vacant."""
        if self.share_by_fork and self.forks is None:
            return
        while len(self.processes) < self.count:
            self.processes.append(self._spawn() if len(self.processes) < self.start_count else _Vacant())

    # What each record holds.

    def _vacant(self, reader_index: int) -> bool:
        return isinstance(self.processes[reader_index], _Vacant)

    def active(self) -> list[int]:
        """The records whose readers claim steps now."""
        return [index for index, process in enumerate(self.processes)
                if not isinstance(process, (_Vacant, _Leaving))]

    @property
    def active_count(self) -> int:
        return len(self.active())

    @property
    def pids(self) -> list[int]:
        """The active readers' pids (a retired one's while it finishes its step too)."""
        return [process.pid for process in self.processes if not isinstance(process, _Vacant)]

    def pid(self, reader_index: int) -> int:
        return self.processes[reader_index].pid

    # Joining and leaving.

    def add_reader(self) -> int | None:
        """Starts a reader in the lowest vacant record and configures it; its index, or None
        where every record is taken (a retired reader still finishing holds its record)."""
        free = [index for index in range(self.count) if self._vacant(index)]
        if not free or self.ring is None:
            return None
        reader_index = free[0]
        assert reader_index not in self._configured, reader_index  # Vacant: no reader was sent this record.
        self._restarts_by_reader[reader_index] = 0  # A new reader, not a restart: its own budget.
        self.processes[reader_index] = process = self._spawn()
        self._send_config(process, reader_index)
        return reader_index

    def retire_reader(self) -> int | None:
        """Asks the active reader of the highest record to leave (module note); its index, or
        None where only `least` are active. A reader whose pipe is gone is left to check(),
        which restarts it as the dead reader it is."""
        active = self.active()
        if len(active) <= self.least:
            return None
        reader_index = active[-1]
        process = self.processes[reader_index]
        assert process.stdin is not None, reader_index  # An active reader's pipe stays open for fillers.
        if send_to_all([process.stdin], RETIRE_MESSAGE.decode(), _RETIRE_SEND_SECONDS):
            return None
        self.processes[reader_index] = _Leaving(process)
        return reader_index

    def _reap_leaving(self, request) -> None:
        """Makes the record of every retired reader that has exited vacant: the step it was
        filling, if it died mid-step, is requested again; its statistics are kept. One that
        reported an error is handed back to ReaderPool as the failed reader it is."""
        for reader_index, stand_in in enumerate(self.processes):
            if not isinstance(stand_in, _Leaving) or stand_in.process.poll() is None:
                continue
            if self.ring.records.error(reader_index):
                self.processes[reader_index] = stand_in.process
                continue
            for slot in self.ring.slots_filled_by(reader_index):
                request(slot, self.ring.step(slot))
            self._vacate(reader_index, stand_in.process)

    def _vacate(self, reader_index: int, process) -> None:
        """The record of an exited (or SIGKILLed) reader becomes vacant, its statistics kept
        (report()). A killed one still in uninterruptible I/O is not waited for past
        join_timeout_seconds: it runs none of its own code again, so the record is free."""
        try:
            process.wait(self.join_timeout_seconds)
        except subprocess.TimeoutExpired:
            pass
        if process.stdin is not None and not process.stdin.closed:
            try:
                process.stdin.close()
            except OSError:
                pass
        self._keep_stats(reader_index)
        self._configured.discard(reader_index)
        self._configured_s.pop(reader_index, None)
        self.processes[reader_index] = _Vacant()

    # ReaderPool's supervision, told about vacant and leaving records.

    def check(self, request, settle: bool = False, awaited: int | None = None) -> None:
        if self.ring is not None:
            self._reap_leaving(request)
        super().check(request, settle, awaited)

    def _send_config(self, process, reader_index: int) -> None:
        if not isinstance(process, _Vacant):
            super()._send_config(process, reader_index)

    def _replace(self, reader_index: int):
        """A vacant record stays vacant (a new filler, renew_failed); a retired reader ended
        by the trainer (a take-back's replace_stuck, a new filler) leaves its record vacant
        instead of being replaced."""
        stand_in = self.processes[reader_index]
        if isinstance(stand_in, _Vacant):
            self.ring.records.clear_error(reader_index)
            return stand_in
        if isinstance(stand_in, _Leaving):
            stand_in.process.kill()
            self._vacate(reader_index, stand_in.process)
            return self.processes[reader_index]
        return super()._replace(reader_index)

    def _failed(self, reader_index: int) -> bool:
        return not self._vacant(reader_index) and super()._failed(reader_index)

    def reconfigure(self, filler) -> None:
        """Retired readers still finishing are ended first (every slot is taken back, so none
        is filling): a new filler after RETIRE_MESSAGE would be the newest message on their
        pipe, and they would stay."""
        for reader_index, stand_in in enumerate(self.processes):
            if isinstance(stand_in, _Leaving):
                stand_in.process.kill()
                self._vacate(reader_index, stand_in.process)
        super().reconfigure(filler)

    def starting_note(self) -> str:
        """ReaderPool's, over the records with a reader: vacant ones are not starting."""
        active = self.active()
        starting = [self._starting_s(index) for index in active]
        if not starting or any(seconds is None for seconds in starting):
            return ""
        readers = ", ".join(self.describe(index) for index in active)
        slowest = max(starting)
        return (f"{readers} {'is' if len(active) == 1 else 'are'} still starting (attaching the ring, loading the "
                f"dataset and its imports) for {slowest:.1f} s, at most start_timeout_seconds="
                f"{self.start_timeout_seconds:g} s")

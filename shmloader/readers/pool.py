"""The trainer's reader pool: starts, configures, watches, restarts and stops reader processes.

Shutdown, described once (ShmDataLoader.close, the loader's finalizer and interpreter exit
all come here, through lifecycle.Resources.close):

1. The trainer sets the ring's stop flag, then unlinks the ring's segment and semaphores
   at once: from here on nothing is left in /dev/shm, whatever interrupts what follows (a
   second Ctrl-C). Attached readers keep their mappings; a reader not yet attached fails
   to attach and exits.
2. ReaderPool.stop first stops the remote readers' bridge (its thread finishes the copy
   it is making; their actors are killed). It posts the work semaphore once per reader,
   so a reader asleep in its bounded wait wakes at once; a reader mid-fill finishes that
   batch and sees the flag.
   It sends any reader still waiting for its configuration channel.STOP_MESSAGE instead,
   and that reader exits at once (bare EOF would make it wait to judge its trainer dead);
   a configured reader's pipe is closed.
3. It joins every reader for at most join_timeout_seconds in all, then SIGKILLs and reaps
   whoever is left (a reader stopped by SIGSTOP, or stuck on a stalled file system); an
   exception in the join (Ctrl-C) kills and reaps the rest before it propagates.
4. The ring's handles are closed: the owner lock goes, and the mapping is unmapped once
   no batch array refers to it, which gives tmpfs its pages back.

Readers never unlink anything while their trainer lives; a reader whose trainer died or
exec'd (a pidfd on the trainer says so, or the ring's owner lock is free) unlinks the ring
itself, since nobody else will (reader.py). Each step is idempotent and never raises, so a
half-built loader tears down the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import posix_ipc

from ..errors import ReaderError, SlotsExhaustedError, reader_error_type
from ..readers import forkserver
from ..ring.layout import POLL_INTERVAL_SECONDS, SlotState
from ..ring.segment import Ring
from .channel import SIGNAL_GRACE_SECONDS, STOP_MESSAGE, ReaderConfig, send_line, send_to_all
from . import stuck
from .reader import EXIT_REPORTED_ERROR, EXIT_SERVER_GONE, ErrorReport

# Run as -c rather than -m: the package is already imported by then, and runpy warns
# about running a module of an imported package.
# SIGINT is ignored first: Ctrl-C reaches the whole process group, and a reader still
# importing (a few hundred ms) would die of it with a KeyboardInterrupt traceback; the
# trainer handles Ctrl-C and closes its readers.
_READER_BOOTSTRAP = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); import sys; "
                     "from shmloader.readers.reader import main; sys.exit(main(sys.argv))")
_PACKAGE_PARENT = str(pathlib.Path(__file__).resolve().parent.parent.parent)  # Where `import shmloader` finds it.


def describe_exit(exit_code: int) -> str:
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"was killed by {name} (exit code {exit_code})"
    if exit_code == EXIT_SERVER_GONE:
        return f"exited with code {exit_code} (its fork server died before it was tied to it)"
    return f"exited with code {exit_code}"


def reader_environment() -> dict[str, str]:
    """The environment a reader gets: the trainer's, with this package importable."""
    environment = dict(os.environ)
    # A reader is one thread of work: numpy's BLAS thread pools would only cost memory.
    for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        environment.setdefault(variable, "1")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT, environment.get("PYTHONPATH")]))
    return environment


def spawn_reader():
    """Starts a reader, which waits for its configuration on stdin: forked by this
    trainer's fork server where the system allows (forkserver.py), else a fresh
    interpreter. Either has pid, stdin, poll(), wait(timeout), kill()."""
    environment = reader_environment()
    if forkserver.available():
        return forkserver.start_reader(environment)
    return spawn_interpreter(environment)


def spawn_interpreter(environment: dict[str, str]) -> subprocess.Popen:
    """A reader in an interpreter of its own."""
    # A fresh interpreter, not a fork of the trainer (safe with threads) nor
    # multiprocessing's spawn (which re-imports the trainer's __main__): only this package
    # is imported.
    return subprocess.Popen(
        [sys.executable, "-c", _READER_BOOTSTRAP, str(os.getpid())],
        stdin=subprocess.PIPE,
        env=environment,
        close_fds=True,
        # `-c` puts the working directory first on sys.path; "/" keeps a source
        # checkout there from shadowing the package this trainer imported.
        cwd="/",
        # Its own session, so its own process group: a terminal's Ctrl-C (or a signal to
        # the trainer's group) reaches the trainer alone, which closes its readers. A
        # reader signalled before its bootstrap could ignore SIGINT died in `site` with a
        # "Fatal Python error" traceback. A dead trainer still ends its readers
        # (PR_SET_PDEATHSIG and their parent checks).
        start_new_session=True,
    )


class ReaderPool:
    """The reader processes of one loader, indexed 0..count-1 like their ring records.

    Readers are started before the ring exists, so that their start-up (a fork request,
    or an interpreter's imports) overlaps the trainer's validation of the files;
    `configure` hands each its JSON configuration once the ring is there.

    Its waits are attributes, so that tests can shorten them: how long stop() joins
    readers before killing them, how long a reader outlives a termination signal sent to
    it alone (then it exits and is restarted), and how long reconfigure waits for a reader
    to take a new filler (then it is replaced).
    """

    join_timeout_seconds = 2.0
    # How long reconfigure waits for a reader to take a new filler longer than its pipe holds
    # (one stopped, or stuck in a step past every timeout) before replacing it.
    reconfigure_timeout_seconds = 10.0
    # How long taking the slots back (a seek, a new pass, a resume) waits for a reader to
    # finish the step it fills before replacing it (replace_stuck); a step_timeout shorter
    # than this bounds it instead (Session.take_back_all).
    take_back_seconds = 10.0
    signal_grace_seconds = SIGNAL_GRACE_SECONDS
    # How long a reader may take to start, from its configuration to its first claim: it
    # attaches the ring, loads the dataset and imports what that needs (torch, which with
    # CUDA takes seconds on a GPU host). Its own phase: next()'s step_timeout and stall
    # warning count only once a reader is ready (starting_note), and check() raises for a
    # reader still starting past this bound (an import or a load that never returns).
    start_timeout_seconds = 120.0
    # Readers forked from the trainer's own image (readers/trainer_fork.py): set before
    # start(), which then starts none; configure() forks the trainer once the dataset is
    # planned (its readers find it in memory), and every reader comes from that fork.
    share_by_fork = False
    forks = None  # trainer_fork.ReaderForks, under share_by_fork once configured.

    def __init__(self, count: int, max_restarts: int, remote=None) -> None:
        self.max_restarts = max_restarts
        self.restarts = 0
        # Called with a reader's index before its replacement starts (the drop-in's Stateful
        # IterableDataset publishes the states it took, from which the replacement goes on).
        self.before_replace = None
        # The budget counts per reader: losing every reader at once (an OOM kill of the
        # group) costs each one restart, not the whole budget.
        self._restarts_by_reader = [0] * count
        self.processes: list = []  # subprocess.Popen or forkserver.ForkedReader
        self._configured: set[int] = set()  # Readers whose process has its configuration (channel.py).
        self._configured_s: dict[int, float] = {}  # When each was sent it (monotonic): its start's clock.
        self.ring: Ring | None = None
        self._config: ReaderConfig | None = None
        # Remote readers (shmloader.readers.ray.RayReaders): reader records count..records-1, fed
        # by their bridge, a thread of this process, once configured.
        self.remote_spec, self.remote = remote, None
        self.records = count + (0 if remote is None else remote.count)
        self._retired_busy_ns = [0] * count
        self._retired_batches = [0] * count
        self._retired_sleeps = [(0, 0, 0)] * self.records  # (starved_ns, sleeps, wakeups)
        self._retired_stages = [(0, 0, 0)] * self.records  # (user_ns, read_ns, fetch_ns)
        self._retired_skips: list[tuple[int, list]] = [(0, [])] * self.records  # (count, first records)
        self.count = count

    def start(self) -> None:
        """Starts the readers; they wait for configure(). One that fails to start leaves
        the others in self.processes, so that stop() reaps them. With share_by_fork, none
        yet (configure)."""
        if self.share_by_fork and self.forks is None:
            return
        while len(self.processes) < self.count:
            self.processes.append(self._spawn())

    def _spawn(self):
        """A new reader: forked from the trainer's fork under share_by_fork, else spawn_reader()."""
        if self.forks is not None:
            return self.forks.reader(reader_environment())
        return spawn_reader()

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def configure(self, ring: Ring, config: ReaderConfig) -> None:
        """Sends every started reader `config` with its own reader_index."""
        self.ring, self._config = ring, config
        self._filler_json = json.dumps(config.filler.to_dict())  # Once for every reader and restart.
        if self.share_by_fork and self.count:  # Forked now: the trainer has planned the dataset.
            from .trainer_fork import ReaderForks

            self.forks = ReaderForks()
            self.forks.start()
            self.start()
        for reader_index, process in enumerate(self.processes):
            self._send_config(process, reader_index)
        if self.remote_spec is not None:
            for record in range(self.count, self.records):
                ring.records.clear_error(record)
            self.remote = self.remote_spec.start(ring, self.count, config.filler)

    def reconfigure(self, filler) -> None:
        """Makes every reader fill with `filler` from now on (a finite pass started again
        under a new seed, a resharded resume's new sampler): a live reader takes it in place
        through its pipe (channel.py: the trainer has taken back every slot and requests
        none before this returns); a reader that died meanwhile is started with it. This is
        no restart (the budget is untouched)."""
        self._config = dataclasses.replace(self._config, filler=filler)
        self._filler_json = json.dumps(filler.to_dict())
        live = [reader_index for reader_index, process in enumerate(self.processes)
                if process.poll() is None and reader_index in self._configured]
        failed = send_to_all([self.processes[index].stdin for index in live], self._filler_json,
                             self.reconfigure_timeout_seconds)
        replaced = {live[position] for position in failed} | (set(range(len(self.processes))) - set(live))
        for reader_index in sorted(replaced):  # Dead, stuck or never configured: a fresh one gets the filler.
            process = self.processes[reader_index]
            if process.poll() is None:
                process.kill()
            process.wait()
            self._keep_stats(reader_index)
            self._replace(reader_index)
        if self.remote is not None:
            self.remote.stop()
            self.remote = None
            self.remote = self.remote_spec.start(self.ring, self.count, filler)

    def refork(self) -> None:
        """Ends every reader and the trainer's fork they came from (share_by_fork), once every
        slot is taken back: the reconfigure that follows forks the trainer again, as it is
        now, and starts new readers from it (the drop-in's epoch without persistent_workers,
        as torch forks new workers). Not counted as restarts."""
        assert self.forks is not None, "readers forked from the trainer"
        for process in self.processes:
            process.kill()
        for reader_index, process in enumerate(self.processes):
            process.wait()
            self._keep_stats(reader_index)
        self._configured.clear()
        self.forks.retire()  # The reconfigure that follows forks the trainer anew.

    @property
    def remote_restarts(self) -> int:
        return 0 if self.remote is None else self.remote.restarts

    def pid(self, reader_index: int) -> int:
        """The process of reader record `reader_index` (a remote one's as last reported, or 0)."""
        return self.pids[reader_index] if reader_index < self.count else self.ring.records.stats(reader_index)[0]

    def describe(self, reader_index: int) -> str:
        """"reader 2 (pid 123)", or the remote reader that has that record."""
        if reader_index >= self.count:
            return self.remote.describe(reader_index)
        return f"reader {reader_index} (pid {self.pid(reader_index)})"

    def waiting_note(self) -> str:
        """What a stall warning or step time-out adds about remote readers not yet placed."""
        return "" if self.remote is None else self.remote.waiting_note()

    def _send_config(self, process, reader_index: int) -> None:
        """Writes `process` its configuration as reader `reader_index`; its pipe stays open
        for new fillers (reconfigure)."""
        self.ring.records.clear_error(reader_index)
        self._configured.discard(reader_index)
        self._configured_s[reader_index] = time.monotonic()
        try:
            config = dataclasses.replace(self._config, reader_index=reader_index,
                                         signal_grace_seconds=self.signal_grace_seconds)
            send_line(process.stdin, config.to_json(self._filler_json))
            self._configured.add(reader_index)
        except BrokenPipeError:
            pass  # It died while starting: check() restarts it like any dead reader.

    # Supervision.

    def check(self, request, settle: bool = False, awaited: int | None = None) -> None:
        """Raises for a reader that reported an error or died past the restart budget;
        restarts any other dead reader. Raises what stopped the remote readers' bridge.
        `request(slot, step)` is the trainer's request (the cursor's): a dead reader's slot
        goes back through it. It is an argument, not kept, so that the pool (which the
        session's finalizer keeps) refers to no cursor. `awaited`: the step next() waits
        for; an error reported at a later step waits while that step is ready, so that it
        reaches the loop at its own step (the reader filled the awaited one, then failed on
        its next, between next()'s look at the slot and this check)."""
        if self.remote is not None:
            self.remote.check()
        for reader_index, process in enumerate(self.processes):
            exit_code = process.poll()
            if exit_code is None:
                self._raise_if_never_started(reader_index)
                continue
            if settle and self._failed(reader_index):
                continue  # A new pass: renewed once every slot is taken back (renew_failed).
            # A reader returns EXIT_REPORTED_ERROR once its report is written; the same code
            # without one is a death like any other (a transform's os._exit(3)).
            if self.ring.records.error(reader_index):
                error = self.reported_error(reader_index, exit_code)
                if awaited is not None and error.step is not None and error.step > awaited and \
                        self._ready_at(awaited):
                    continue
                raise error
            if self._restarts_by_reader[reader_index] >= self.max_restarts:
                step = self._filling_step(reader_index)
                where = "" if step is None else f" while filling step {step}"
                unreported = " without an error report (os._exit() in the transform or in a library it calls " \
                             "would do this)" if exit_code == EXIT_REPORTED_ERROR and step is not None else ""
                raise ReaderError(
                    f"reader {reader_index} (pid {process.pid}) {describe_exit(exit_code)}{where}{unreported}; it was "
                    f"restarted {self._restarts_by_reader[reader_index]} times already (max_reader_restarts="
                    f"{self.max_restarts}, counted per reader)",
                    reader_index=reader_index,
                    pid=process.pid,
                    exit_code=exit_code,
                    step=step,
                )
            step = self._filling_step(reader_index)
            self.restart(reader_index, request)
            stuck.warn_restarted(reader_index, process.pid, describe_exit(exit_code), step,
                                 self.processes[reader_index].pid, self._restarts_by_reader[reader_index],
                                 self.max_restarts)

    def _ready_at(self, step: int) -> bool:
        """Whether `step`'s slot holds it filled (READY), for next() to take."""
        slot = step % self.ring.layout.slot_count
        return self.ring.state(slot)[0] == SlotState.READY and self.ring.step(slot) == step

    def _ready(self, reader_index: int) -> bool:
        """Whether a live reader has started: it wrote its pid into its record as it began
        claiming steps (reader.Reader.run); a replaced reader's record is cleared (_keep_stats)."""
        pid = self.processes[reader_index].pid  # 0 for one its fork server never started.
        return pid != 0 and self.ring.records.stats(reader_index)[0] == pid

    def _starting_s(self, reader_index: int) -> float | None:
        """Seconds since a reader still starting was sent its configuration; None once ready."""
        since = self._configured_s.get(reader_index)
        return None if since is None or self._ready(reader_index) else time.monotonic() - since

    def starting_note(self) -> str:
        """"" once a reader can fill steps (one is ready, or remote readers are there); else
        which readers are still starting, for how long, and the bound on it."""
        if self.remote is not None or not self.processes:  # Threads (testing.simulation) start at once.
            return ""
        starting = [self._starting_s(reader_index) for reader_index in range(len(self.processes))]
        if any(seconds is None for seconds in starting):
            return ""
        readers = ", ".join(self.describe(reader_index) for reader_index in range(len(starting)))
        return (f"{readers} {'is' if len(starting) == 1 else 'are'} still starting (attaching the ring, loading the "
                f"dataset and its imports) for {max(starting):.1f} s, at most start_timeout_seconds="
                f"{self.start_timeout_seconds:g} s")

    def _raise_if_never_started(self, reader_index: int) -> None:
        seconds = self._starting_s(reader_index)
        if seconds is None or seconds <= self.start_timeout_seconds:
            return
        pid = self.processes[reader_index].pid
        raise ReaderError(
            f"reader {reader_index} (pid {pid}) has not started {seconds:.1f} s after it was sent its configuration, "
            f"past ReaderPool.start_timeout_seconds={self.start_timeout_seconds:g} s: it attaches the ring, then loads "
            f"the dataset and what that imports (torch, a transform's libraries) before it claims a step. An import "
            f"or a dataset load that does not return (a stalled file system, a lock held across a fork) would do "
            f"this; py-spy dump --pid {pid} shows where it is.",
            reader_index=reader_index, pid=pid)

    def _filling_step(self, reader_index: int) -> int | None:
        """The step a dead reader was filling (its slot still FILLING), or None."""
        slots = self.ring.slots_filled_by(reader_index)
        return self.ring.step(slots[0]) if slots else None

    def restart(self, reader_index: int, request) -> None:
        """Replaces a dead reader and hands the step it was filling to the readers again."""
        self.retire(reader_index, request)
        self._replace(reader_index)

    def _replace(self, reader_index: int):
        """Starts a reader in place of `reader_index`'s, which has exited, and configures it.
        The old one's pipe is closed here: dropped unclosed, it stayed open until collected
        (a descriptor per replaced reader, and a ResourceWarning)."""
        old = self.processes[reader_index]
        if old.stdin is not None and not old.stdin.closed:
            try:
                old.stdin.close()
            except OSError:  # Its reader is gone: what the buffer held goes with it.
                pass
        if self.before_replace is not None:
            self.before_replace(reader_index)
        self.processes[reader_index] = process = self._spawn()
        self._send_config(process, reader_index)
        return process

    def retire(self, reader_index: int, request) -> None:
        """Counts a dead reader's restart, keeps its statistics and requests again the step
        it was filling, so that its replacement starts clean."""
        self.restarts += 1
        self._restarts_by_reader[reader_index] += 1
        self._keep_stats(reader_index)
        for slot in self.ring.slots_filled_by(reader_index):
            request(slot, self.ring.step(slot))

    def _keep_stats(self, reader_index: int) -> None:
        """Adds a reader's statistics to its record's retired ones and clears them for the next."""
        ring = self.ring
        busy_ns, batches = ring.records.stats(reader_index)[1:]
        self._retired_busy_ns[reader_index] += busy_ns
        self._retired_batches[reader_index] += batches
        self._retired_sleeps[reader_index] = tuple(
            a + b for a, b in zip(self._retired_sleeps[reader_index], ring.records.sleeps(reader_index)))
        self._retired_stages[reader_index] = self.stages(reader_index)
        count, records = self._reader_skips(reader_index)
        self._retired_skips[reader_index] = (count, records)
        ring.records.write_stats(reader_index, 0, 0, 0, 0, 0, 0)
        ring.records.write_sleeps(reader_index, 0, 0, 0)
        ring.records.write_skips(reader_index, 0, b"")

    def _failed(self, reader_index: int) -> bool:
        """Whether a reader reported an error, or died past its restart budget."""
        if self.ring.records.error(reader_index):
            return True
        return self.processes[reader_index].poll() is not None and \
            self._restarts_by_reader[reader_index] >= self.max_restarts

    def any_failed(self) -> bool:
        """Whether a reader of this pool reported an error or died past its budget."""
        return self.ring is not None and any(self._failed(index) for index in range(self.count))

    def renew_failed(self) -> None:
        """A new pass (Session.use for Session.new_pass, the drop-in's next epoch), once
        every slot is taken back (take_back with `settle`): where a reader reported an error
        or died past its restart budget, every reader goes, as torch's DataLoader starts new
        workers for each epoch. Those that failed are waited for (killed after
        join_timeout_seconds), the others killed: one still loading the pass before's filler
        could report its failure after this, in the new pass. The slots they failed or held
        claimed go IDLE and their budgets start again; the reconfigure that follows starts
        new readers in their places, which clears their reports. Remote readers are not
        renewed (a dataset source has none)."""
        failed = {reader_index for reader_index in range(self.count) if self._failed(reader_index)}
        if not failed:
            return
        for reader_index, process in enumerate(self.processes):
            if reader_index not in failed:
                process.kill()
            try:
                process.wait(self.join_timeout_seconds)  # One that failed exits once its report is written.
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(self.join_timeout_seconds)
            for slot in range(self.ring.layout.slot_count):
                self.ring.renew_failed(slot, reader_index)
            self._restarts_by_reader[reader_index] = 0

    def raise_reported(self, reader_index: int) -> None:
        """Raises the error reader `reader_index` reported (it marked a slot FAILED)."""
        exit_code = None
        if reader_index >= self.count:
            raise self.reported_error(reader_index, None)
        try:
            exit_code = self.processes[reader_index].wait(self.join_timeout_seconds)
        except subprocess.TimeoutExpired:
            pass
        raise self.reported_error(reader_index, exit_code)

    def reported_error(self, reader_index: int, exit_code: int | None) -> ReaderError:
        remote = reader_index >= self.count
        report = ErrorReport.decode(self.ring.records.error(reader_index))
        if not report.type:  # A FAILED slot without a report (foreign input): say what is known.
            step = None if remote else self._filling_step(reader_index)
            exited = "failed" if exit_code is None else describe_exit(exit_code)
            return ReaderError(f"{self.describe(reader_index)} {exited}"
                               f"{'' if step is None else f' while filling step {step}'} without an error report",
                               reader_index=reader_index, pid=self.pid(reader_index), exit_code=exit_code, step=step)
        where = f" at step {report.step}" if report.step is not None else " while starting"
        message = (
            f"{self.describe(reader_index)} raised {report.type}{where}: "
            f"{report.message}\n--- {'actor' if remote else 'reader'} traceback ---\n{report.traceback}"
        )
        return reader_error_type(report.module, report.type)(
            message,
            reader_index=reader_index,
            pid=report.pid if remote else self.processes[reader_index].pid,
            exit_code=exit_code,
            step=report.step,
            original_type=report.type,
            traceback_text=report.traceback,
        )

    def take_back(self, slot: int, timeout_seconds: float, cursor, settle: bool = False, why: str = "a seek",
                  step_rows=None) -> None:
        """Takes a slot back from the readers (a seek): a requested one at once, one being
        filled once its reader is done, waiting at most `timeout_seconds` (the cursor's
        wait: the protocol's waits are ring/_cursor.c's alone); a reader of this pool that
        holds it longer is killed and replaced (replace_stuck), a remote one raises.
        `cursor.request` is check()'s. `settle` (a new pass): a slot a reader failed, or
        holds claimed while it fails, is left as it is for renew_failed instead of raising
        the pass before's error. `why` names the caller's act in the warning and error;
        `step_rows(step)`, a step's dataset rows, adds them to the warning."""
        ring = self.ring
        deadline = time.monotonic() + timeout_seconds
        while True:
            if not cursor.active:  # Closed by another thread meanwhile: the ring is gone.
                raise RuntimeError("the loader is closed")
            state, owner = ring.state(slot)
            if state == SlotState.FAILED:
                if settle and owner < self.count:
                    return
                self.raise_reported(owner)
            if state == SlotState.REQUESTED and not ring.withdraw(slot):
                continue  # A reader took it just now: wait for it to finish.
            if state != SlotState.FILLING or (settle and owner < self.count and self._failed(owner)):
                return
            if time.monotonic() > deadline:
                if owner < self.count:
                    self.replace_stuck(owner, slot, timeout_seconds, why, step_rows)
                    continue
                raise SlotsExhaustedError(f"slot {slot} stayed in filling ({self.describe(owner)}) for "
                                          f"{timeout_seconds:.1f} s during {why}")
            if not cursor.wait_filled(slot, POLL_INTERVAL_SECONDS):
                self.check(cursor.request, settle)

    def replace_stuck(self, reader_index: int, slot: int, waited_s: float, why: str, step_rows=None) -> None:
        """Kills reader `reader_index`, which held `slot` past the take-back's bound, turns the
        slots it held claimed IDLE (the position being left requested them; the new one
        requests again what it needs), and starts a new reader in its place, with a warning
        naming the reader, its pid, the step and what it was doing (readers/stuck.py). Not
        counted against max_reader_restarts: the trainer ended it, it did not die."""
        process, ring = self.processes[reader_index], self.ring
        report = stuck.Report(reader_index, process.pid, slot, ring.step(slot), waited_s, why,
                              stuck.activity(process.pid), ring.requested_ns(slot), step_rows)
        process.kill()  # SIGKILL ends a stopped process too.
        try:
            process.wait(self.join_timeout_seconds)
        except subprocess.TimeoutExpired:
            pass  # In uninterruptible I/O: it goes when that ends; its slot is not its own any more.
        for claimed in range(ring.layout.slot_count):
            ring.renew_failed(claimed, reader_index)
        self.restarts += 1
        self._keep_stats(reader_index)
        report.warn(self._replace(reader_index).pid)

    def replace_dead(self) -> None:
        """Starts a new reader in place of every one that has exited (a new position after a
        failure: the readers renew_failed ended)."""
        for reader_index, process in enumerate(self.processes):
            if process.poll() is not None:
                process.wait()
                self._keep_stats(reader_index)
                self._replace(reader_index)

    def _reader_skips(self, reader_index: int) -> tuple[int, list]:
        """The records reader `reader_index` skipped, with those of the readers it replaced."""
        count, raw = self.ring.records.skips(reader_index)
        try:
            records = json.loads(raw.decode()) if raw else []
        except ValueError:
            records = []  # Foreign input: the count still stands.
        retired_count, retired = self._retired_skips[reader_index]
        return retired_count + count, retired + (records if isinstance(records, list) else [])

    def skipped(self) -> tuple[int, list]:
        """Records skipped by every reader (on_error="skip"), and the first described."""
        total, records = 0, []
        for reader_index in range(self.records):
            count, described = self._reader_skips(reader_index)
            total, records = total + count, records + described
        return total, sorted(records, key=lambda record: (record.get("step", 0), record.get("position", 0)))

    def stages(self, reader_index: int) -> tuple[int, int, int]:
        """(user_ns, read_ns, fetch_ns) of a reader record (ring.h), the readers it replaced included."""
        return tuple(a + b for a, b in zip(self.ring.records.stages(reader_index), self._retired_stages[reader_index]))

    def report(self, elapsed_s: float) -> list[dict]:
        """Per reader, counting the readers it replaced: pid, batches filled, time busy,
        time asleep while a slot it then claimed was already requested (a starved
        pipeline), waits for work, wake-ups by a post, and batches filled per wake-up; of
        its busy time, the part in the user's code (user_s: a transform, a dataset's
        __getitem__), reading fields (read_s) and waiting for a store's pages (fetch_s).
        Remote readers (remote: True) follow, busy_s their actor's time filling."""
        readers = []
        for reader_index in range(self.records):
            pid, busy_ns, batches = self.ring.records.stats(reader_index)
            starved_ns, sleeps, wakeups = (a + b for a, b in zip(self.ring.records.sleeps(reader_index),
                                                                  self._retired_sleeps[reader_index]))
            if reader_index < self.count:
                batches += self._retired_batches[reader_index]
                busy_ns += self._retired_busy_ns[reader_index]
            busy_s = busy_ns / 1e9
            user_ns, read_ns, fetch_ns = self.stages(reader_index)
            readers.append({
                "index": reader_index,
                "remote": reader_index >= self.count,
                "pid": pid,
                "batches": batches,
                "busy_s": busy_s,
                "busy_fraction": busy_s / elapsed_s if elapsed_s else 0.0,
                "starved_s": starved_ns / 1e9,
                "starved_fraction": starved_ns / 1e9 / elapsed_s if elapsed_s else 0.0,
                "sleeps": sleeps,
                "wakeups": wakeups,
                "batches_per_wakeup": batches / wakeups if wakeups else float(batches),
                "user_s": user_ns / 1e9,
                "read_s": read_ns / 1e9,
                "fetch_s": fetch_ns / 1e9,
            })
        return readers

    # Shutdown: see the module docstring.

    def stop(self) -> None:
        """Stops and reaps every reader (steps 2 and 3 of the module's note). Idempotent;
        raises only what interrupts it (Ctrl-C), after every reader is reaped. The remote
        readers' bridge stops first, and kills its actors."""
        ring, processes = self.ring, self.processes
        if self.remote is not None:
            try:
                self.remote.stop()
            except Exception:
                pass  # Ray gone already: nothing of ours is left in it.
        if ring is not None and not ring.closed:
            for _ in processes:
                try:
                    ring.work_semaphore.release()
                except (posix_ipc.ExistentialError, OSError):
                    pass
        for reader_index, process in enumerate(processes):
            if process.stdin is not None and not process.stdin.closed:
                try:  # A reader still waiting for its configuration is told to leave, and exits at once.
                    if reader_index not in self._configured:
                        process.stdin.write(STOP_MESSAGE)
                    process.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + self.join_timeout_seconds
        try:
            for process in processes:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            if self.forks is not None:
                self.forks.retire()

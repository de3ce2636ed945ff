"""A reader process: attaches the ring, opens its own field files, and fills requested slots.

Forked by the trainer's fork server (forkserver.py), or started alone as `python -c
"...reader.main..."` (pool.py), it reads a ReaderConfig (channel.py) as JSON on the pipe
that is its stdin, which it then moves off fd 0, and takes new fillers from it later: only
names, paths and numbers cross the process boundary, each part serialised by its own
to_dict/from_dict. It exits when the loader sets the ring's stop flag, when its trainer is
gone, or after reporting an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import sys
import time
import traceback

import posix_ipc

from ..errors import TransformError
from ..fill.filler import FillerSpec
from ..plan.dataset import DatasetError
from ..ring.layout import POLL_INTERVAL_SECONDS, READER_ERROR_BYTES_MAX, RingNames
from ..ring.publishing import Publisher
from ..ring.segment import Ring, wait
from ..ring.stale import sweep_stale
from ..storage import checked_blocks
from .channel import RETIRE_MESSAGE, STOP_MESSAGE, ConfigChannel, ReaderConfig, enter_trainer_context
from .filling import fill_and_publish

# How long a reader whose steps are its own (Ring.claim_own) sleeps at most: the post for its
# step may wake another reader, which cannot take it. 200 looks a second cost an idle reader little.
OWN_STEPS_POLL_SECONDS = 0.005

# How long a reader that read no configuration waits to see whether its trainer died.
_ORPHAN_CHECK_SECONDS = 1.0
# How often, at most, a busy reader asks whether its trainer lives (Reader.run).
TRAINER_CHECK_SECONDS = 0.01
EXIT_REPORTED_ERROR = 3
EXIT_NO_RING = 4
# A process forked inside a transform that returned into the reader loop exits with this.
EXIT_FORKED_CHILD = 5
# A forked reader whose fork server died before the reader could ask for its death signal:
# nothing would end it with its trainer, so it leaves at once and is restarted.
EXIT_SERVER_GONE = 6
# Testing hook: "exit:STEP:MARKER" makes the reader os._exit(17) when it starts filling
# STEP, once: only while the file MARKER exists (it is deleted first). "raise:STEP:MARKER"
# makes it raise a RuntimeError whose message is larger than its error record.
FAULT_INJECTION_VARIABLE = "SHMLOADER_FAULT_INJECTION"
_FAULT_EXIT_CODE = 17


class _FaultInjection:
    def __init__(self, text: str | None) -> None:
        self.step = self.marker = None
        if text:
            kind, step, marker = text.split(":", 2)
            if kind not in ("exit", "raise"):
                raise ValueError(f"{FAULT_INJECTION_VARIABLE}: unknown fault kind {kind!r}")
            self.kind, self.step, self.marker = kind, int(step), marker

    def maybe_fire(self, step: int) -> None:
        if step != self.step:
            return
        try:
            os.unlink(self.marker)
        except FileNotFoundError:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at step {step}: " + "x" * (2 * READER_ERROR_BYTES_MAX))
        os._exit(_FAULT_EXIT_CODE)


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """What a reader that raised writes into its ring record for the trainer."""

    type: str
    message: str
    traceback: str
    step: int | None
    module: str = ""
    pid: int = 0

    @classmethod
    def of(cls, error: BaseException, step: int | None) -> ErrorReport:
        """A transform's exception is reported with its own type (TransformError adds the
        step and rows to its message): the trainer raises that type."""
        kind = type(error)
        if isinstance(error, TransformError) and isinstance(error.__cause__, Exception):
            kind = type(error.__cause__)
        return cls(
            type=kind.__name__,
            message=str(error),
            traceback="".join(traceback.format_exception(type(error), error, error.__traceback__)),
            step=step,
            module=kind.__module__,
            pid=os.getpid(),
        )

    def encode(self, bytes_max: int = READER_ERROR_BYTES_MAX) -> bytes:
        """As UTF-8 JSON of at most `bytes_max` bytes: an oversized report keeps its type,
        step and pid, the start of its message and the end of its traceback (where the
        error was raised), each cut with a marker that says so."""
        fields = dataclasses.asdict(self)
        encoded = json.dumps(fields).encode()
        budget = max(64, bytes_max - 512)  # Room for the other fields and JSON escapes.
        while len(encoded) > bytes_max and budget > 64:
            message_chars, traceback_chars = budget // 4, budget // 2
            if len(self.message) > message_chars:
                fields["message"] = self.message[:message_chars] + " [... message cut]"
            if len(self.traceback) > traceback_chars:
                fields["traceback"] = "[traceback cut ...]\n" + self.traceback[-traceback_chars:]
            encoded = json.dumps(fields).encode()
            budget //= 2
        return encoded[:bytes_max] if len(encoded) > bytes_max else encoded

    @classmethod
    def decode(cls, raw: bytes) -> ErrorReport:
        """Foreign input: anything unreadable becomes a report that says so."""
        if not raw:
            return cls("", "", "", None)
        try:
            data = json.loads(raw.decode())
            step = data.get("step")
            return cls(
                type=str(data["type"]),
                message=str(data.get("message", "")),
                traceback=str(data.get("traceback", "")),
                step=step if isinstance(step, int) else None,
                module=str(data.get("module", "")),
                pid=data.get("pid") if isinstance(data.get("pid"), int) else 0,
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls("unknown", f"unreadable error report {raw[:200]!r}", "", None)


def leave_if_forked(reader_pid: int) -> None:
    """Ends a process forked inside a transform that came back into the reader's code.

    It shares the reader's ring mapping and semaphores: left to run, it would publish a
    slot its parent also publishes (a step delivered twice, with another step's data),
    and, seeing its parent is not the reader's, could unlink the live ring. os._exit runs no
    handler and no `finally` that could touch the ring."""
    if os.getpid() != reader_pid:
        os._exit(EXIT_FORKED_CHILD)


class Reader:
    """The reader loop: claims requested slots, fills each with its StepFiller (given, in
    the simulation), publishes it, and keeps its statistics in its ring record."""

    def __init__(self, config: ReaderConfig, ring: Ring, filler=None, watch: TrainerWatch | None = None,
                 channel: ConfigChannel | None = None) -> None:
        self.pid = os.getpid()
        self.index = config.reader_index
        self.config, self.channel = config, channel
        self.watch = TrainerWatch(config.trainer_pid, os.getppid()) if watch is None else watch
        self.signal_grace_seconds = config.signal_grace_seconds
        self.ring = ring
        self.layout = ring.layout
        self.filler, self.outputs = None, []
        self._use_first(config.filler, filler)
        self.fault = _FaultInjection(os.environ.get(FAULT_INJECTION_VARIABLE))
        self.step = None
        self.publisher = Publisher(ring, self.index, os.getpid())
        self.starved_ns = self.sleeps = self.wakeups = 0
        self._slept = None  # (began, ended) of the last wait for work, until the next claim

    def _use_first(self, spec: FillerSpec, filler=None) -> None:
        """_use() of the configuration's filler, or of a newer one where the configuration's
        dataset is gone: a reader still starting when the trainer began a new epoch (the
        drop-in's persistent_workers=False) finds that epoch's filler on its pipe, since the
        trainer closes the pickle before only once it has written the new filler to every
        reader's pipe (shmloader.torch.dataloader.DataLoader._new_pass)."""
        try:
            self._use(spec, filler)
        except (FileNotFoundError, DatasetError):
            newer = None if self.channel is None or spec.dataset is None else self.channel.latest()
            if newer is None or newer == STOP_MESSAGE:
                raise
            self._use(FillerSpec.from_dict(json.loads(newer)))

    def _use(self, spec: FillerSpec, filler=None) -> None:
        """Fills with `spec`'s filler from now on (`filler`: built already), bound to every
        slot's arrays once."""
        if filler is None:
            filler = spec.build(share=(self.index, max(1, self.config.local_readers)))
        outputs = [filler.bind(spec.slot.views(self.ring.memory, self.layout.slot_offset(slot)))
                   for slot in range(self.layout.slot_count)]
        old, self.filler, self.outputs = self.filler, filler, outputs
        # A ring whose steps belong to readers (DatasetSpec.by_reader): this one claims its own.
        by_reader = spec.dataset is not None and spec.dataset.by_reader
        self.own_steps_of = max(1, self.config.local_readers) if by_reader else None
        if old is not None:
            old.close()

    def _take_new_filler(self) -> bool:
        """A new filler the trainer sent since the last claim (channel.py says why that is
        in time), applied before this reader fills anything with the old one. True where the
        trainer retired this reader instead (RETIRE_MESSAGE; it sends nothing after it)."""
        message = None if self.channel is None else self.channel.latest()
        if message == RETIRE_MESSAGE:
            return True
        if message is not None:
            self._use(FillerSpec.from_dict(json.loads(message)))
        return False

    def _retire(self) -> int:
        """Leaves the ring for good, once the step this reader claimed is published: the
        wake-up it may have taken from the work semaphore goes to another reader."""
        self.ring.work_semaphore.release()
        return 0

    def trainer_alive(self) -> bool:
        """The trainer's process lives and still holds the ring's owner lock (gone once it
        dies or execs another program)."""
        return not self.watch.exited() and self.ring.owner_alive()

    def fill(self, slot: int) -> None:
        self.step = self.ring.step(slot)
        self.fault.maybe_fire(self.step)
        # A transform that forked a child which came back here ends that child before it publishes.
        fill_and_publish(self.publisher, self.filler, self.step, self.outputs[slot], slot,
                         after_fill=lambda: leave_if_forked(self.pid))
        self.step = None

    def run(self) -> int:
        """Fills requested slots until the stop flag; checks its trainer before a batch
        once TRAINER_CHECK_SECONDS have passed since the last check, and at least every
        poll interval while idle (a loop bounded by those checks): that bounds how long a
        reader outlives a dead trainer. Not before every batch: the check is three system
        calls and a Python exception (a failed flock), a few percent of a small batch."""
        self.ring.records.write_stats(self.index, os.getpid(), 0, 0)
        checked = -TRAINER_CHECK_SECONDS
        while not self.ring.stopping:
            now = time.monotonic()
            if now - checked >= TRAINER_CHECK_SECONDS:
                checked = now
                alive = self.trainer_alive()
            if not alive:
                # Nobody else will clean up after a trainer that was killed.
                self.ring.names.unlink_all()
                return 0
            if _termination.since is not None and time.monotonic() - _termination.since > self.signal_grace_seconds:
                return 128 + _termination.signal  # Sent to this reader alone: the trainer restarts it.
            slot = self.ring.claim(self.index) if self.own_steps_of is None else \
                self.ring.claim_own(self.index, self.own_steps_of)
            if slot is None:
                if self._take_new_filler():  # Idle: a line longer than the pipe holds is drained as it comes.
                    return self._retire()
                self._sleep()
            else:
                retired = self._take_new_filler()
                self._count_starvation(slot)
                self.fill(slot)  # A step claimed is filled, retired or not: no other reader has it.
                if retired:
                    return self._retire()
        return 0

    def _sleep(self) -> None:
        began = time.monotonic_ns()
        woken = wait(self.ring.work_semaphore, POLL_INTERVAL_SECONDS if self.own_steps_of is None
                     else OWN_STEPS_POLL_SECONDS)
        self.sleeps += 1
        self.wakeups += woken
        self._slept = (began, time.monotonic_ns())

    def _count_starvation(self, slot: int) -> None:
        """The part of the last sleep after `slot` was requested: time the pipeline starved
        while this reader slept (a deferred or lost wake-up)."""
        if self._slept is None:
            return
        began, ended = self._slept
        self._slept = None
        self.starved_ns += max(0, ended - max(began, self.ring.requested_ns(slot)))
        self.ring.records.write_sleeps(self.index, self.starved_ns, self.sleeps, self.wakeups)

    def close(self) -> None:
        self.filler.close()


def yield_to_the_trainer() -> None:
    """SCHED_BATCH: the kernel's policy for non-interactive work. A reader the trainer
    wakes then waits for a free core or the end of the trainer's time slice instead of
    preempting it in the middle of next(), where a preemption costs the trainer a whole
    time slice. Its share of the CPU is unchanged: same nice value, same fairness."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass  # Not Linux, or not allowed: only the trainer's latency is affected.


class TrainerWatch:
    """Whether the trainer's process has exited: by a pidfd on it where the system has
    them, else by this reader's parent changing (then the parent is the trainer). The
    parent alone cannot tell for a forked reader: its parent is the fork server, which may
    die alone; the trainer then restarts its readers."""

    def __init__(self, trainer_pid: int, parent_pid: int) -> None:
        self.trainer_pid, self.parent_pid = trainer_pid, parent_pid
        self.fd = self._poll = None
        try:
            self.fd = os.pidfd_open(trainer_pid)
        except (AttributeError, OSError):
            return  # No pidfds here (or the trainer is gone already: the parent test says so).
        self._poll = select.poll()  # Registered once: asked before every batch.
        self._poll.register(self.fd, select.POLLIN)

    def exited(self) -> bool:
        if self._poll is None:
            return os.getppid() != self.parent_pid
        return bool(self._poll.poll(0))

    def exited_in_handler(self) -> bool:
        """exited() for a signal handler: a signal that arrives while exited() waits in
        poll() runs its handler inside that call, and a poll object refuses to be entered
        twice ("concurrent poll() invocation"), so the handler asks through one of its own."""
        if self._poll is None:
            return os.getppid() != self.parent_pid
        poll = select.poll()
        poll.register(self.fd, select.POLLIN)
        return bool(poll.poll(0))


class _Termination:
    """The first termination signal a reader received, and when; and what a reader whose
    trainer is gone must clean up (set once the reader has its configuration)."""

    since: float | None = None
    signal: int = 0
    watch: TrainerWatch | None = None
    names: RingNames | None = None
    reader_pid: int = 0

    @classmethod
    def note(cls, number: int, frame) -> None:
        if cls.since is None:
            cls.since, cls.signal = time.monotonic(), number
        # The trainer died (PR_SET_PDEATHSIG sends SIGTERM when the parent, the trainer or
        # its fork server, dies): a reader stuck in a transform never reaches its loop's
        # check, so it unlinks the ring here, since nobody else will, and leaves at once.
        if cls.watch is not None and os.getpid() == cls.reader_pid and cls.watch.exited_in_handler():
            if cls.names is not None:
                cls.names.unlink_all()
            os._exit(128 + number)


_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# What top and `ps -o comm` show for a reader (/proc/PID/comm, at most 15 bytes).
PROCESS_NAME = b"shml-reader"


def _prctl(option: int, argument) -> None:
    """Linux's prctl, best effort (elsewhere nothing happens)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(option, argument, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_process_name(name: bytes) -> None:
    """Sets /proc/self/comm (at most 15 bytes)."""
    import ctypes

    _prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]))


def _die_with_the_parent() -> None:
    """Asks the kernel for SIGTERM when this reader's parent (the trainer, or its fork
    server, which exits with it) dies, whatever the reader is doing then (Linux;
    elsewhere the loop's check remains)."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


_termination = _Termination


def main(argv: list[str]) -> int:
    # Ctrl-C in a terminal reaches the whole process group; the trainer handles it and
    # closes the readers, so a reader must not die of it first with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM, SIGHUP and SIGQUIT sent to every process at once (a service manager stopping
    # the whole cgroup, pkill; readers have their own process group, so the trainer's
    # group signals miss them) must not kill the readers with their trainer: then nobody
    # would unlink the ring. A reader outlives such a signal by at most its signal grace
    # (channel.SIGNAL_GRACE_SECONDS): it sees its trainer gone and cleans up, or, if the signal
    # was for it alone, exits and is restarted.
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, _termination.note)
    set_process_name(PROCESS_NAME)
    yield_to_the_trainer()
    _die_with_the_parent()
    # The process that started this reader (the trainer, or its fork server), as it said:
    # it may have died before this reader got here, so getppid() cannot tell it.
    parent = int(argv[1]) if len(argv) > 1 and argv[1].isdigit() else os.getppid()
    # The trainer's pipe moves off fd 0, which becomes /dev/null: a process the dataset or a
    # transform starts inherits fd 0 (ffmpeg without -nostdin reads it), and would eat the
    # fillers the trainer sends later (channel.py), or wait on it for input.
    channel = ConfigChannel(os.dup(0))  # Not inherited (os.dup's descriptors are not).
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    text = channel.first()  # The loader writes the configuration once the ring exists.
    if text == STOP_MESSAGE:
        return 0
    if not text:
        # The loader gave up before configuring this reader, or its trainer died: then the
        # ring it may have created has no owner, and nobody else would unlink it now. A
        # dying trainer closes its descriptors (EOF here) before the kernel reparents its
        # children, so wait a bounded time for the parent to change: once it has, the
        # trainer's owner lock is gone too and the sweep can judge its ring.
        deadline = time.monotonic() + _ORPHAN_CHECK_SECONDS
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.getppid() != parent:
            sweep_stale()
        return 0
    config = ReaderConfig.from_json(text)
    # Set after the death signal was asked for: a trainer that died before this check is
    # seen here, one that dies after it sends the signal.
    watch = TrainerWatch(config.trainer_pid, parent)
    _termination.watch, _termination.names, _termination.reader_pid = watch, config.names, os.getpid()
    if watch.exited():
        config.names.unlink_all()
        return 0
    if parent != config.trainer_pid and os.getppid() != parent:
        return EXIT_SERVER_GONE
    try:
        ring = Ring.attach(config.names, config.layout, config.trainer_pid)
    except posix_ipc.ExistentialError:
        return EXIT_NO_RING  # The loader closed (and unlinked the ring) while this reader started.
    except OSError as error:
        print(f"shmloader reader {config.reader_index}: cannot attach the ring: {error}", file=sys.stderr)
        return EXIT_NO_RING
    # The loader's record of checked blocks, before any field opens (this process serves one ring).
    checked_blocks.attach(ring.memory, config.layout.checked_offset, config.layout.checked_pages)
    reader, pid = None, os.getpid()
    try:
        enter_trainer_context(config)  # Before the dataset or transform loads: it may open relative paths.
        reader = Reader(config, ring, watch=watch, channel=channel)
        return reader.run()
    except BaseException as error:  # SystemExit or KeyboardInterrupt raised in a transform too: reported, not "code 0".
        leave_if_forked(pid)  # A transform's forked child that raised: the ring is not its to report on.
        step = reader.step if reader is not None else None
        publisher = reader.publisher if reader is not None else Publisher(ring, config.reader_index, pid)
        filling = ring.slots_filled_by(config.reader_index) if step is not None else ()
        publisher.fail(ErrorReport.of(error, step).encode(), filling)
        return EXIT_REPORTED_ERROR
    finally:
        leave_if_forked(pid)
        if reader is not None:
            reader.close()
        ring.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))

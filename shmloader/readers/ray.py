"""Readers on other machines: Ray actors that run the loader's step filler, and the bridge
that puts their results into the ring.

    import ray
    from shmloader.readers.ray import RayReaders
    loader = ShmDataLoader(fields, readers=4, remote=RayReaders(actors=16), transform=...)

Each actor builds the same StepFiller as a reader process, from the same FillerSpec (paths
every node can read), fills a step into its own buffer and returns it through Ray's
object store. The bridge, a thread of the trainer, takes part in the ring's protocol like
a reader: it claims requested slots (each actor has its own reader record, after the
local readers'), keeps at most `in_flight` steps queued per actor, copies each result
into its slot (one copy, from the object store's shared memory: Ray hands numpy arrays
over out of band, never pickled) and publishes it. Batch k is the same whoever fills it.

Steps go only to actors that Ray has placed (their first call answered): an actor that
cannot be scheduled (a cluster without the CPUs or resources it asks for) is never dealt a
step, so the other actors and the local readers fill everything meanwhile, and the
trainer's stall warning and step time-out name it with what it asked for. A lost actor
(its process killed, its node gone) is replaced, and the steps it held are handed back to
the ring as requested, for whichever reader or placed actor claims them first: it costs
time, never a batch. An exception in an actor is reported in its reader
record and its slot marked FAILED, so that the trainer raises it at that step as it
would a reader's. Closing the loader stops the bridge and kills its actors.

Ray is an optional extra (pip install "shmloader[ray]"); only this module imports it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import threading
import time
import warnings

import numpy as np
import ray
import ray.exceptions

from ..errors import ReaderError
from ..plan.options import ACTORS_MAX
from ..fill.filler import FillerSpec
from ..ring.layout import POLL_INTERVAL_SECONDS
from ..ring.publishing import Publisher
from ..ring.segment import Ring, wait
from .reader import ErrorReport, yield_to_the_trainer

# While the bridge could send more steps than it has in flight, it looks for requested
# slots this often; with every actor's queue full it waits for a result (at most a poll
# interval, to see the loader stop).
_CLAIM_INTERVAL_SECONDS = 0.002

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # shmloader/


def _driver_paths() -> list[str]:
    """The directories Ray puts first on its workers' sys.path: the driver's working
    directory (and script directory) when it called ray.init. Read from the job's config,
    a private part of Ray; the working directory now if that is not there."""
    try:
        return list(ray._private.worker.global_worker.core_worker.get_job_config().py_driver_sys_path)
    except Exception:  # noqa: BLE001 (another Ray version): the likeliest answer.
        return [os.getcwd()]


def _check_not_shadowed() -> None:
    """A source checkout of shmloader in one of those directories, not the package this
    trainer imported and with no native library built, is what actors would import:
    refuse with the reason rather than lose every actor as it starts."""
    for directory in _driver_paths():
        shadow = os.path.join(directory, "shmloader")
        if not os.path.isdir(shadow) or os.path.realpath(shadow) == os.path.realpath(_PACKAGE):
            continue
        if not glob.glob(os.path.join(shadow, "_shmloader_native*")):
            raise RuntimeError(
                f"Ray actors would import shmloader from {shadow} (Ray puts {directory}, where ray.init was called, "
                f"first on its workers' sys.path), a source checkout without its native library, not the installed "
                f"package this trainer uses ({_PACKAGE}). Call ray.init from another directory, or install the "
                f"checkout for development (pip install -e .)")


# What a lost actor looks like to the caller of ray.get: its process died, its node
# left, or it cannot be reached. A replacement gets its steps.
_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.WorkerCrashedError,
         ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError)


class _FillActor:
    """A Ray actor that fills steps with the loader's step filler into one buffer laid
    out as a slot. Any error, building the filler included, is returned as the report a
    reader writes into its record, so that it reaches the trainer with its step."""

    def __init__(self, filler: dict) -> None:
        yield_to_the_trainer()  # As a local reader does: on the trainer's node it must not preempt it.
        self.pid, self.node = os.getpid(), ray.util.get_node_ip_address()
        self.filler = self.outputs = self.failure = None
        try:
            spec = FillerSpec.from_dict(filler)
            self.filler = spec.build()
            self.buffer = np.zeros(spec.slot.nbytes, np.uint8)
            self.outputs = self.filler.bind(spec.slot.views(self.buffer, 0))
        except Exception as error:
            self.failure = error

    def where(self) -> tuple[int, str]:
        return self.pid, self.node

    def fill(self, step: int) -> tuple:
        """(slot bytes, busy ns, records skipped now, pid, error report or b"")."""
        started = time.perf_counter_ns()
        if self.failure is not None:
            return None, 0, [], self.pid, ErrorReport.of(self.failure, step).encode()
        known = len(self.filler.skipped)
        try:
            self.filler.fill(step, self.outputs)
        except BaseException as error:  # SystemExit or KeyboardInterrupt from a transform too: reported.
            return None, 0, [], self.pid, ErrorReport.of(error, step).encode()
        skipped = [record.to_dict() for record in self.filler.skipped[known:]]
        # Ray copies the returned array into its object store before the next call runs.
        return self.buffer, time.perf_counter_ns() - started, skipped, self.pid, b""


@dataclasses.dataclass
class RayReaders:
    """Ray actors that fill steps for a loader (`ShmDataLoader(..., remote=RayReaders(...))`).

    actors: how many. in_flight: steps queued per actor (two hide the round trip).
    max_restarts: how many times each actor may be lost and replaced before the loader
    raises. num_cpus and `options` (resources, scheduling_strategy, runtime_env, ...) go
    to Ray's actor options. Ray must be initialised (ray.init) or is initialised with its
    defaults. A RayReaders describes actors; each loader given it starts its own.
    """

    actors: int = 1
    in_flight: int = 2
    max_restarts: int = 3
    num_cpus: float = 1
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, low in (("actors", 1), ("in_flight", 1), ("max_restarts", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"RayReaders: {name} must be an integer >= {low}, got {value!r}")
        if self.actors > ACTORS_MAX:
            raise ValueError(f"RayReaders: actors must be at most {ACTORS_MAX}, got {self.actors}")

    @property
    def count(self) -> int:
        """Reader records the actors take in the ring."""
        return self.actors

    @property
    def capacity(self) -> int:
        """Steps the actors may have in flight at once."""
        return self.actors * self.in_flight

    def start(self, ring: Ring, first_record: int, filler: FillerSpec) -> RayBridge:
        if not ray.is_initialized():
            ray.init()
        _check_not_shadowed()
        return RayBridge(self, ring, first_record, filler)


@dataclasses.dataclass
class _Job:
    actor: int
    handle: object  # the actor the step was sent to (a replaced one's steps go to its successor)
    slot: int
    step: int


class RayBridge:
    """The trainer's thread that feeds the ring from one loader's actors (see the module)."""

    def __init__(self, spec: RayReaders, ring: Ring, first_record: int, filler: FillerSpec) -> None:
        self.spec, self.ring, self.first = spec, ring, first_record
        self.count = spec.actors
        self._slot_bytes = filler.slot.nbytes
        self._filler = filler.to_dict()
        self._class = ray.remote(_FillActor)
        self._pending: dict = {}  # ObjectRef -> _Job
        self._queued = [0] * self.count
        self._failed: set[int] = set()  # actors that reported an error: sent nothing more
        self.restarts = 0
        self._restarts_by_actor = [0] * self.count
        # Each actor's record: its counters and the protocol's order of writes (ring/publishing.py).
        self._publishers = [Publisher(ring, first_record + actor, 0) for actor in range(self.count)]
        self._where: list[tuple[int, str]] = [(0, "")] * self.count
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        # Placement: an actor is dealt steps once its where() has answered.
        self._placing: dict = {}  # ObjectRef of where() -> (actor index, handle)
        self._placed = [False] * self.count
        self._asked_at = [time.monotonic()] * self.count
        self.actors: list = [None] * self.count
        try:
            for actor in range(self.count):
                self._start_actor(actor)
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._run, name="shmloader-ray-bridge", daemon=True)
        self._thread.start()

    def _start_actor(self, actor: int) -> None:
        """Asks Ray for actor `actor` (a first one or a replacement); it is dealt no step
        until Ray has placed it and its where() answered."""
        options = {"num_cpus": self.spec.num_cpus, **self.spec.options}
        handle = self._class.options(**options).remote(self._filler)
        self.actors[actor] = handle
        self._placed[actor], self._asked_at[actor] = False, time.monotonic()
        self._placing[handle.where.remote()] = (actor, handle)

    def unplaced(self) -> list[tuple[int, float]]:
        """(actor index, seconds since it was asked for) of the actors Ray has not placed yet."""
        now = time.monotonic()
        return [(actor, now - self._asked_at[actor]) for actor in range(self.count) if not self._placed[actor]]

    # The thread.

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self.ring.stopping:
                self._send_claimed()
                refs = [*self._pending, *self._placing]
                if not refs:
                    wait(self.ring.work_semaphore, POLL_INTERVAL_SECONDS)
                    continue
                room = bool(self._open_actors())
                done, _ = ray.wait(refs, num_returns=1, timeout=_CLAIM_INTERVAL_SECONDS if room else POLL_INTERVAL_SECONDS)
                if done:
                    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                for ref in done:
                    if ref in self._placing:
                        self._placed_now(ref)
                    else:
                        self._finish(ref)
        except BaseException as error:  # The trainer raises it at its next check (check()).
            self.failure = error

    def _open_actors(self) -> list[int]:
        """Placed actors that have not failed and have room for another step."""
        return [actor for actor in range(self.count) if self._placed[actor] and actor not in self._failed
                and self._queued[actor] < self.spec.in_flight]

    def _placed_now(self, ref) -> None:
        actor, handle = self._placing.pop(ref)
        try:
            where = ray.get(ref)
        except _LOST as error:  # Died while starting: replaced within its budget.
            if handle is self.actors[actor]:
                self._replace_actor(actor, handle, error, step=None)
            return
        if handle is self.actors[actor]:  # Not an actor replaced meanwhile.
            self._where[actor], self._placed[actor] = where, True

    def _send_claimed(self) -> None:
        """Claims requested slots while a placed actor has room, the least busy actor first."""
        while not self._stop.is_set():
            open_actors = self._open_actors()
            if not open_actors:
                return
            actor = min(open_actors, key=lambda a: self._queued[a])
            slot = self.ring.claim(self.first + actor)
            if slot is None:
                return
            self._send(actor, slot, self.ring.step(slot))

    def _send(self, actor: int, slot: int, step: int) -> None:
        handle = self.actors[actor]
        self._pending[handle.fill.remote(step)] = _Job(actor, handle, slot, step)
        self._queued[actor] += 1

    def _finish(self, ref) -> None:
        job = self._pending.pop(ref)
        self._queued[job.actor] -= 1
        try:
            data, busy_ns, skipped, pid, report = ray.get(ref)
        except _LOST as error:
            self._replace(job, error)
            return
        del ref
        record = self.first + job.actor
        publisher = self._publishers[job.actor]
        publisher.pid = pid  # The actor's process of the moment (a replacement has its own).
        if report:
            self._failed.add(job.actor)
            publisher.fail(report, (job.slot,))
            return
        # The slot's bytes, as one array to copy the result into; asked for each time, since a
        # batch kept past its slot's turn has it mapped anew (Ring.detach_slot).
        target = np.ndarray((self._slot_bytes,), np.uint8, *self.ring.slot_memory(job.slot))
        problem = _result_problem(data, target)
        if problem is not None:  # Never broadcast or cast into a slot: the step fails, naming the actor.
            self._failed.add(job.actor)
            error = ReaderError(f"Ray actor {job.actor} (pid {pid}) returned {problem} for step {job.step}, where "
                                f"a slot of {target.nbytes} uint8 bytes was expected: is every node running the same "
                                f"shmloader?", reader_index=record, step=job.step)
            publisher.fail(ErrorReport.of(error, job.step).encode(), (job.slot,))
            return
        np.copyto(target, data)
        del data  # The object store's copy goes once nothing refers to it.
        publisher.publish(job.slot, busy_ns, skipped)

    def _replace(self, job: _Job, error: Exception) -> None:
        """A lost actor: replaced at the first news of it (within its restart budget), and
        each of its steps handed back to the ring for any reader or placed actor (its
        replacement may wait long for Ray to place it)."""
        if job.handle is self.actors[job.actor]:
            self._replace_actor(job.actor, job.handle, error, step=job.step)
        self._give_back(job)

    def _replace_actor(self, actor: int, handle, error: Exception, step: int | None) -> None:
        if self._restarts_by_actor[actor] >= self.spec.max_restarts:
            at = f" at step {step}" if step is not None else " while starting"
            raise ReaderError(
                f"Ray actor {actor} (reader record {self.first + actor}) was lost{at} and had been "
                f"replaced {self._restarts_by_actor[actor]} times already (RayReaders.max_restarts="
                f"{self.spec.max_restarts}): {type(error).__name__}: {error}",
                reader_index=self.first + actor, step=step)
        self._restarts_by_actor[actor] += 1
        self.restarts += 1
        try:
            ray.kill(handle)
        except Exception:
            pass  # Already gone.
        self._start_actor(actor)

    def _give_back(self, job: _Job) -> None:
        """FILLING by this actor's record -> REQUESTED, the step word unchanged, and the
        readers woken: only the claimer writes a FILLING slot's state, so the swap cannot
        race another writer (the ring's transition table, ring/transitions.py)."""
        record = self.first + job.actor
        if not self.ring.give_back(job.slot, record):
            raise ReaderError(f"slot {job.slot} (step {job.step}) was not filling by Ray actor {job.actor} when the "
                              f"bridge handed it back: another process wrote to the ring", reader_index=record,
                              step=job.step)

    # The trainer's side.

    def check(self) -> None:
        """Raises what stopped the bridge's thread (an actor lost too often, a Ray failure)."""
        if self.failure is not None:
            if isinstance(self.failure, ReaderError):
                raise self.failure
            raise ReaderError(f"the Ray bridge stopped: {type(self.failure).__name__}: {self.failure}") from self.failure

    def describe(self, record: int) -> str:
        """How the trainer's messages name an actor; one that never delivered a step may not
        have been placed (Ray waits for the resources it asks for)."""
        actor = record - self.first
        pid = self.ring.records.stats(record)[0]
        if not self._placed[actor]:
            state = (f"not placed by Ray after {time.monotonic() - self._asked_at[actor]:.0f} s: Ray may lack the "
                     f"resources it asks for (num_cpus={self.spec.num_cpus}, options={self.spec.options})")
        else:
            state = f"pid {pid}" if pid else "placed, no step delivered yet"
        return f"Ray actor {actor} (reader record {record}, {state})"

    def waiting_note(self) -> str:
        """What the trainer's stall warning and time-out add while actors are unplaced."""
        unplaced = self.unplaced()
        if not unplaced:
            return ""
        names = ", ".join(f"{actor} ({waited_s:.0f} s)" for actor, waited_s in unplaced)
        return (f"; Ray has not placed actor(s) {names}: they ask for num_cpus={self.spec.num_cpus}, "
                f"options={self.spec.options}, and are dealt no step until placed (Ray may lack the resources)")

    def stop(self) -> None:
        """Stops the thread (it finishes the result it is copying) and kills the actors;
        steps still in flight are dropped with them. Idempotent, and bounded: with Ray's
        head gone, ray.kill blocks (until Ray's own abort ends the process, about a
        minute later), so the kills run in a thread of their own and are given up on
        after _STOP_SECONDS with a warning."""
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_SECONDS)  # ray.wait returns within a poll interval; ray.get may not.
        self._pending.clear()
        self._placing.clear()
        handles, self.actors = [handle for handle in self.actors if handle is not None], []
        if not handles:
            return
        killer = threading.Thread(target=_kill_all, args=(handles,), name="shmloader-ray-kill", daemon=True)
        killer.start()
        killer.join(_STOP_SECONDS)
        if killer.is_alive() or (thread is not None and thread.is_alive()):
            warnings.warn(f"Ray did not answer within {_STOP_SECONDS:g} s while the loader closed (is the Ray "
                          f"head or its GCS gone?); its {len(handles)} actor(s) may outlive the loader until Ray "
                          f"ends them", RuntimeWarning, stacklevel=2)


# How long close() waits for the bridge's thread, then for Ray to kill the actors.
_STOP_SECONDS = 5.0


def _kill_all(handles: list) -> None:
    for handle in handles:
        try:
            ray.kill(handle)
        except Exception:
            pass  # Already gone, or Ray was shut down first.


def _result_problem(data, target: np.ndarray) -> str | None:
    """What is wrong with an actor's result for a slot like `target`, or None: it must be
    a 1-D uint8 array of exactly the slot's bytes (np.copyto would broadcast one byte over
    the slot, or cast another dtype, without a word)."""
    if not isinstance(data, np.ndarray):
        return f"a {type(data).__name__}"
    if data.dtype != np.uint8 or data.shape != target.shape:
        return f"an array of shape {data.shape} and dtype {data.dtype}"
    return None


"""ShmDataLoader: the trainer's side of the ring: starts readers, hands out zero-copy batches."""

from __future__ import annotations

import collections.abc
import gc
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings
import weakref

import numpy as np
import posix_ipc

from . import convert as _convert
from ._native import load_cursor
from .errors import PerformanceWarning, ReaderError, SharedMemoryError, SlotsExhaustedError, StorageError
from .reader import EXIT_REPORTED_ERROR
from .ring import HELD_WORD, STATE_MASK, Ring, SlotState, layout_for, sweep_stale, wait
from .sampler import Sampler, check_integer
from .storage import FieldSpec, describe_field

cursor_module = load_cursor()

# How long one wait for a batch lasts before the trainer checks that its readers live:
# a dead reader is noticed within about this long.
_POLL_SECONDS = 0.05
# The trainer also checks its readers every this many batches when it never has to wait.
_READER_CHECK_BATCHES = 64
_JOIN_TIMEOUT_SECONDS = 2.0
# Run as -c rather than -m: the package is already imported by then, and runpy warns
# about running a module of an imported package.
_READER_BOOTSTRAP = "import sys; from shmloader.reader import main; sys.exit(main(sys.argv))"
_PACKAGE_PARENT = str(pathlib.Path(__file__).resolve().parent.parent)


def _default_readers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def _wake_after(slots: int) -> int:
    """How many slots the trainer hands back before it wakes the readers while they are
    ahead (see release_unused in _cursor.c). Half the ring: they are woken at once whenever
    the batch after the one being delivered is not ready, so deferring costs no waiting."""
    return max(1, slots // 2)


def _normalise_fields(fields, label_path) -> dict[str, str]:
    if isinstance(fields, collections.abc.Mapping):
        if label_path is not None:
            raise TypeError("label_path goes with a single data path, not with a mapping of fields")
        mapping = dict(fields)
    elif isinstance(fields, (str, os.PathLike)):
        mapping = {"data": fields}
        if label_path is not None:
            mapping["label"] = label_path
    else:
        raise TypeError(f"fields must be a path or a mapping of field name to path, got {type(fields).__name__}")
    if not mapping:
        raise ValueError("fields is empty; give at least one field name -> path")
    for name, path in mapping.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"field names must be non-empty strings, got {name!r}")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"field {name!r}: path must be a string or PathLike, got {type(path).__name__}")
    return {name: os.fspath(path) for name, path in mapping.items()}


class Batch(cursor_module.BatchBase, collections.abc.Mapping):
    """One batch: a mapping of field name to a numpy array that views a shared-memory slot.

    `step` is the step it is, `indices` its row indices (uint64). Lifetime: the slot is
    reserved for this batch while the Batch (until released) or any array of it or view of
    one (slices, np.asarray, torch.from_numpy tensors) is alive; the loader hands it back to
    the readers at the first next() after the last of them is gone. `release()` or leaving
    `with batch:` gives up the Batch's own references. A view kept longer keeps the slot:
    it is never overwritten under you, but a loader whose every slot is kept this way
    raises SlotsExhaustedError. Copy what you need to keep (np.array(batch["x"])).

    The arrays are built once per slot and handed out again for later steps in that slot,
    so a batch costs no allocation; an array changed in place (its shape, dtype, strides or
    writeable flag) is replaced by a fresh one before its slot is handed out again.
    """

    __slots__ = ()

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def __repr__(self) -> str:
        if self.released:
            return f"Batch(step={self.step}, released)"
        fields = ", ".join(f"{name}: {array.dtype}{list(array.shape)}" for name, array in self.items())
        return f"Batch(step={self.step}, {fields})"


class _Resources:
    """Everything the loader must give back, without a reference to the loader itself, so
    that weakref.finalize can clean up a loader that was never closed."""

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.ring: Ring | None = None
        self.processes: list[subprocess.Popen] = []
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.owner_pid:
            return  # A forked child inherited this object: the ring is its parent's.
        ring = self.ring
        if ring is not None:
            ring.set_stopping()
            for _ in self.processes:
                try:
                    ring.work.release()
                except (posix_ipc.ExistentialError, OSError):
                    pass
        for process in self.processes:
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()  # A reader still waiting for its configuration exits.
        deadline = time.monotonic() + _JOIN_TIMEOUT_SECONDS
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if ring is not None:
            ring.names.unlink_all()
            ring.close()


_live_loaders: weakref.WeakSet = weakref.WeakSet()


def _forget_loaders_in_child() -> None:
    """A forked child inherits its parent's loaders, whose rings and readers it must not touch."""
    for loader in list(_live_loaders):
        loader._closed = True
        loader._deactivate()


os.register_at_fork(after_in_child=_forget_loaders_in_child)


class ShmDataLoader(cursor_module.Cursor):
    """An endless, step-based loader that fills batches in shared memory from reader processes.

    ShmDataLoader(fields, label_path=None, *, batch_size=256, mode="shuffle", seed=0,
                  readers=None, slots=None, start_step=0, shard_index=0, shard_count=1,
                  max_reader_restarts=3, hold_timeout=5.0, warn_layout=True)

    `fields` maps field names to .b2nd or .npy files with the same number of rows; a single
    path is the field "data", and `ShmDataLoader(data_path, label_path)` gives "data" and
    "label". Batch k depends only on the files, seed, k and the shard, so a loader built
    with start_step=k (or load_state_dict) continues exactly. Iterate it; see Batch for
    how long each batch's zero-copy arrays stay valid. Close it, or use `with`.
    """

    def __init__(
        self,
        fields,
        label_path=None,
        *,
        batch_size: int = 256,
        mode: str = "shuffle",
        seed: int = 0,
        readers: int | None = None,
        slots: int | None = None,
        start_step: int = 0,
        shard_index: int = 0,
        shard_count: int = 1,
        max_reader_restarts: int = 3,
        hold_timeout: float = 5.0,
        warn_layout: bool = True,
    ) -> None:
        self._resources = _Resources()
        self._finalizer = weakref.finalize(self, self._resources.close)
        self._closed = True  # Until construction succeeds.
        paths = _normalise_fields(fields, label_path)
        self.batch_size = check_integer("batch_size", batch_size, 1, 1 << 24)
        self.readers = check_integer("readers", _default_readers() if readers is None else readers, 1, 256)
        # Two slots per reader to fill, plus two for the trainer: the batch in use and the
        # one a `for` loop's variable still refers to while next() runs.
        default_slots = 2 * self.readers + 2
        self.slots = check_integer("slots", default_slots if slots is None else slots, 2, 4096)
        self.max_reader_restarts = check_integer("max_reader_restarts", max_reader_restarts, 0, 1 << 20)
        if isinstance(hold_timeout, bool) or not isinstance(hold_timeout, (int, float)) or not hold_timeout > 0:
            raise ValueError(f"hold_timeout must be a positive number of seconds, got {hold_timeout!r}")
        self.hold_timeout = float(hold_timeout)
        start_step = check_integer("start_step", start_step, 0, (1 << 64) - 1)
        # The sampler's own checks, early: no reader is started for settings it would refuse.
        Sampler(1, self.batch_size, mode, seed, shard_index, shard_count)
        # Readers start now and wait for their configuration on stdin: their interpreter
        # start-up overlaps the validation of the files below instead of following it.
        try:
            for _ in range(self.readers):
                self._resources.processes.append(self._spawn())
            self._prepare(paths, mode, seed, shard_index, shard_count, warn_layout, start_step)
        except BaseException:
            self._finalizer()  # A half-built loader gives back what it took before raising.
            raise

    def _prepare(self, paths, mode, seed, shard_index, shard_count, warn_layout, start_step) -> None:
        """Validates the files and settings, then creates the ring and configures the readers."""
        self.specs = self._describe(paths)
        self.field_names = tuple(self.specs)
        row_count = self._check_row_counts()
        self.sampler = Sampler(row_count, self.batch_size, mode, seed, shard_index, shard_count)
        if warn_layout:
            self._warn_poor_layouts()
        sweep_stale()
        self._start(start_step)

    def _start(self, start_step: int) -> None:
        """Creates the ring, requests the first steps and starts the readers."""
        layout = layout_for(self.slots, self.readers, self.batch_size, list(self.specs.values()))
        self._layout = layout
        self._ring = self._resources.ring = Ring.create(layout, os.getpid())
        self._field_geometry = [
            (offset, spec.numpy_dtype, (self.batch_size, *spec.row_shape))
            for spec, offset in zip(self.specs.values(), layout.field_offsets)
        ]
        self._field_geometry.append((layout.indices_offset, np.dtype(np.uint64), (self.batch_size,)))
        self._restarts = 0
        self._retired_busy_ns = [0] * self.readers
        self._retired_batches = [0] * self.readers
        state_addresses, step_addresses = self._ring.slot_word_addresses()
        self._cursor_setup(
            state_addresses=state_addresses,
            step_addresses=step_addresses,
            work_semaphore=self._ring.names.work,
            ready_semaphores=tuple(self._ring.names.ready),
            names=tuple(sys.intern(name) for name in self.field_names),
            batch_type=Batch,
            views=tuple(self._slot_views(slot) for slot in range(self.slots)),
            next_step=start_step,
            check_every=_READER_CHECK_BATCHES,
            wake_after=_wake_after(self.slots),
            reader_count=self.readers,
            wait_ns_max=int(_POLL_SECONDS * 1e9),
            ready=int(SlotState.READY),
            held_word=HELD_WORD,
            requested=int(SlotState.REQUESTED),
            filling=int(SlotState.FILLING),
            state_mask=STATE_MASK,
        )
        _live_loaders.add(self)
        self._request_from(start_step)
        for reader_index, process in enumerate(self._resources.processes):
            self._configure(process, reader_index)
        self._closed = False

    # Construction helpers.

    def _describe(self, paths: dict[str, str]) -> dict[str, FieldSpec]:
        specs = {}
        for name, path in paths.items():
            try:
                specs[name] = describe_field(path)
            except FileNotFoundError as error:
                raise FileNotFoundError(f"field {name!r}: {error}") from None
            except StorageError as error:
                raise StorageError(f"field {name!r}: {error}") from None
        return specs

    def _check_row_counts(self) -> int:
        (first_name, first), *others = self.specs.items()
        for name, spec in others:
            if spec.row_count != first.row_count:
                raise StorageError(
                    f"fields must have the same number of rows: field {first_name!r} ({first.path}) has "
                    f"{first.row_count}, field {name!r} ({spec.path}) has {spec.row_count}"
                )
        return first.row_count

    def _warn_poor_layouts(self) -> None:
        for name, spec in self.specs.items():
            if _convert.poor_layout(spec):
                warnings.warn(
                    f"field {name!r} ({spec.path}): its Blosc2 layout (chunks {spec.chunks}, blocks "
                    f"{spec.blocks}, {spec.codec}) costs about {_convert.estimate_row_cost_us(spec):.0f} us per "
                    f"random row, against about {_convert.row_friendly_cost_us(spec):.0f} us for a row-friendly "
                    f"file. Re-lay it out once with: {_convert.convert_command(spec)}",
                    PerformanceWarning,
                    stacklevel=3,
                )

    def _reader_config(self, reader_index: int) -> str:
        layout = self._layout
        return json.dumps({
            "reader_index": reader_index,
            "trainer_pid": os.getpid(),
            "names": self._ring.names.to_dict(),
            "layout": {
                "slot_count": layout.slot_count,
                "reader_count": layout.reader_count,
                "batch_size": layout.batch_size,
                "field_row_bytes": list(layout.field_row_bytes),
            },
            "sampler": self.sampler.describe(),
            "fields": [spec.to_dict() for spec in self.specs.values()],
        })

    def _spawn(self) -> subprocess.Popen:
        """Starts a reader interpreter; it waits for its configuration (see _configure)."""
        # A fresh interpreter, not fork (safe with threads) nor multiprocessing's spawn
        # (which re-imports the trainer's __main__): only this package is imported.
        environment = dict(os.environ)
        # A reader is one thread of work: numpy's BLAS thread pools would only cost memory.
        for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            environment.setdefault(variable, "1")
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT, environment.get("PYTHONPATH")]))
        return subprocess.Popen(
            [sys.executable, "-c", _READER_BOOTSTRAP],
            stdin=subprocess.PIPE,
            env=environment,
            close_fds=True,
            # `-c` puts the working directory first on sys.path; "/" keeps a source
            # checkout there from shadowing the package this trainer imported.
            cwd="/",
        )

    def _configure(self, process: subprocess.Popen, reader_index: int) -> None:
        """Sends a started reader its index, the ring's names and the field descriptions."""
        self._ring.clear_reader_error(reader_index)
        try:
            process.stdin.write(self._reader_config(reader_index).encode())
            process.stdin.close()
        except BrokenPipeError:
            pass  # It died while starting: supervision restarts it like any dead reader.

    def _request_from(self, step: int) -> None:
        for step_k in range(step, step + self.slots):
            self._ring.request(step_k % self.slots, step_k)

    # Slot arrays.

    def _slot_views(self, slot: int) -> tuple[np.ndarray, ...]:
        """Slot `slot`'s arrays: one per field, then the indices. Their base is the mapping
        itself, so numpy makes every view of them refer to them (see Batch)."""
        memory, base = self._ring.memory, self._layout.slot_offset(slot)
        return tuple(np.ndarray(shape, dtype, memory, base + offset) for offset, dtype, shape in self._field_geometry)

    def _rebuild_views(self, slot: int) -> None:
        """Called by the native next() when a user changed one of the slot's arrays in place."""
        self._set_views(slot, self._slot_views(slot))

    # Iteration. next() itself is native (Cursor.__next__ in _cursor.c): it hands back
    # unused slots and delivers a ready batch without running Python; anything else comes here.

    def __iter__(self) -> ShmDataLoader:
        return self

    def _raise_if_closed(self) -> None:
        if self._resources.owner_pid != os.getpid():
            raise RuntimeError(f"this loader belongs to process {self._resources.owner_pid}; a forked child cannot use it")
        if self._closed:
            raise RuntimeError("the loader is closed")

    def _next_slow(self) -> Batch:
        started = self._now_ns()
        self._raise_if_closed()
        self._release_unused()  # Also wakes the readers for every slot handed back so far.
        self._check_readers()
        step = self._next_step
        self._wait_ready(step % self.slots, step)
        return self._take(started)

    def _raise_wrong_step(self, slot: int, step: int) -> None:
        raise SharedMemoryError(
            f"slot {slot} of ring {self._ring.names.segment} holds step {self._ring.step(slot)} while step "
            f"{step} was expected; the ring was modified by another process"
        )

    def _wait_ready(self, slot: int, step: int) -> None:
        ring = self._ring
        hold_deadline = None
        while True:
            self._raise_if_closed()  # Another thread may close the loader while this one waits.
            state, owner = ring.state(slot)
            if state == SlotState.READY:
                if ring.step(slot) != step:
                    self._raise_wrong_step(slot, step)
                return
            if state == SlotState.FAILED:
                self._raise_reported(owner)
            if state == SlotState.HELD:
                # The batch from `slots` steps ago may still be referred to: hand back what is
                # unused, give the garbage collector one chance (cycles), then wait a bounded
                # time for another thread to let go.
                if self._release_unused():
                    continue
                if hold_deadline is None:
                    gc.collect()
                    hold_deadline = time.monotonic() + self.hold_timeout
                    continue
                if time.monotonic() > hold_deadline:
                    raise SlotsExhaustedError(
                        f"step {step} needs slot {slot}, which still holds step {ring.step(slot)}: views of that "
                        f"batch (arrays, slices, tensors) are alive after {self.hold_timeout:.1f} s. Release batches "
                        f"once used (batch.release(), `with batch:`, or drop the arrays), copy data you keep, or "
                        f"raise slots (now {self.slots})."
                    )
            if state in (SlotState.REQUESTED, SlotState.FILLING):
                waited = self._wait_in_flight()  # Native, without the GIL; as next() itself waits.
            else:
                waited = wait(ring.ready[slot], _POLL_SECONDS)
            if not waited:
                self._check_readers()

    # Reader supervision.

    def _reported_error(self, reader_index: int, exit_code: int | None) -> ReaderError:
        process = self._resources.processes[reader_index]
        raw = self._ring.reader_error(reader_index)
        try:
            report = json.loads(raw.decode()) if raw else {}
            if not isinstance(report, dict):
                raise ValueError("not an object")
        except ValueError:
            report = {"type": "unknown", "message": f"unreadable error report {raw[:200]!r}"}
        step = report.get("step")
        where = f" at step {step}" if step is not None else " while starting"
        message = (
            f"reader {reader_index} (pid {process.pid if process else '?'}) raised {report.get('type')}{where}: "
            f"{report.get('message')}\n--- reader traceback ---\n{report.get('traceback', '')}"
        )
        return ReaderError(
            message,
            reader_index=reader_index,
            pid=process.pid if process else None,
            exit_code=exit_code,
            step=step,
            original_type=report.get("type"),
            traceback_text=report.get("traceback", ""),
        )

    def _raise_reported(self, reader_index: int) -> None:
        process = self._resources.processes[reader_index]
        exit_code = None
        if process is not None:
            try:
                exit_code = process.wait(_JOIN_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        raise self._reported_error(reader_index, exit_code)

    def _check_readers(self) -> None:
        self._raise_if_closed()  # Readers that a close() stops are not restarted.
        for reader_index, process in enumerate(self._resources.processes):
            exit_code = process.poll()
            if exit_code is None:
                continue
            if exit_code == EXIT_REPORTED_ERROR:
                raise self._reported_error(reader_index, exit_code)
            if self._restarts >= self.max_reader_restarts:
                raise ReaderError(
                    f"reader {reader_index} (pid {process.pid}) {_describe_exit(exit_code)}; "
                    f"{self._restarts} reader restarts already used (max_reader_restarts={self.max_reader_restarts})",
                    reader_index=reader_index,
                    pid=process.pid,
                    exit_code=exit_code,
                )
            self._restart(reader_index)

    def _restart(self, reader_index: int) -> None:
        """Replaces a dead reader and hands the step it was filling to the readers again."""
        self._restarts += 1
        busy_ns, batches = self._ring.reader_stats(reader_index)[1:]
        self._retired_busy_ns[reader_index] += busy_ns
        self._retired_batches[reader_index] += batches
        self._ring.write_reader_stats(reader_index, 0, 0, 0)
        for slot in range(self.slots):
            state, owner = self._ring.state(slot)
            if state == SlotState.FILLING and owner == reader_index:
                self._ring.request(slot, self._ring.step(slot))
        process = self._spawn()
        self._resources.processes[reader_index] = process
        self._configure(process, reader_index)

    # State and statistics.

    @property
    def reader_pids(self) -> list[int]:
        return [process.pid for process in self._resources.processes]

    @property
    def shared_memory_bytes(self) -> int:
        return self._layout.total_bytes

    def state_dict(self) -> dict:
        """What a checkpoint needs: the next step to deliver, and the settings it depends on."""
        return {"step": self._next_step, **{key: value for key, value in self.sampler.describe().items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continues from `state` (from state_dict()): the next batch is exactly the one recorded."""
        expected = self.sampler.describe()
        mismatched = {key: (state.get(key), value) for key, value in expected.items() if state.get(key, value) != value}
        if mismatched:
            details = ", ".join(f"{key}: checkpoint {saved!r}, loader {mine!r}" for key, (saved, mine) in mismatched.items())
            raise ValueError(f"the checkpoint was made with other settings ({details}); its batches would differ")
        self.seek(check_integer("step", state.get("step"), 0, (1 << 64) - 1))

    def seek(self, step: int) -> None:
        """Makes `step` the next batch. Every batch must have been released first."""
        self._raise_if_closed()
        step = check_integer("step", step, 0, (1 << 64) - 1)
        ring = self._ring
        self._release_unused()
        gc.collect()
        self._release_unused()
        held = self._held()
        if held:
            raise RuntimeError(f"cannot seek while batch {min(held.values())} is held; release every batch first")
        for slot in range(self.slots):
            deadline = time.monotonic() + self.hold_timeout
            while True:
                state, owner = ring.state(slot)
                if state == SlotState.HELD:
                    raise RuntimeError(f"cannot seek while batch {ring.step(slot)} is held; release every batch first")
                if state == SlotState.FAILED:
                    self._raise_reported(owner)
                if state == SlotState.REQUESTED and not ring.compare_swap_state(slot, SlotState.REQUESTED, SlotState.IDLE):
                    continue  # A reader took it just now: wait for it to finish.
                if state != SlotState.FILLING:
                    break
                if time.monotonic() > deadline:
                    raise ReaderError(f"slot {slot} stayed in filling for {self.hold_timeout:.1f} s during seek")
                if not wait(ring.ready[slot], _POLL_SECONDS):
                    self._check_readers()
        self._next_step = step
        self._request_from(step)

    def stats(self) -> dict:
        """Batches delivered, rates, the share of time the trainer waited, and reader busy time."""
        now = self._now_ns()
        elapsed_s = (now - self._first_next_ns) / 1e9 if self._first_next_ns else 0.0
        rows = self._batches * self.batch_size
        row_bytes = sum(spec.row_bytes for spec in self.specs.values())
        readers = []
        for reader_index in range(self.readers):
            pid, busy_ns, batches = self._ring.reader_stats(reader_index) if not self._closed else (0, 0, 0)
            busy_s = (busy_ns + self._retired_busy_ns[reader_index]) / 1e9
            readers.append({
                "index": reader_index,
                "pid": pid,
                "batches": batches + self._retired_batches[reader_index],
                "busy_s": busy_s,
                "busy_fraction": busy_s / elapsed_s if elapsed_s else 0.0,
            })
        return {
            "batches": self._batches,
            "rows": rows,
            "elapsed_s": elapsed_s,
            "rows_per_s": rows / elapsed_s if elapsed_s else 0.0,
            "batches_per_s": self._batches / elapsed_s if elapsed_s else 0.0,
            "bytes_per_s": rows * row_bytes / elapsed_s if elapsed_s else 0.0,
            "wait_s": self._wait_ns / 1e9,
            "wait_fraction": self._wait_ns / 1e9 / elapsed_s if elapsed_s else 0.0,
            "reader_restarts": self._restarts,
            "shared_memory_bytes": self.shared_memory_bytes,
            "readers": readers,
        }

    # Lifecycle.

    def close(self) -> None:
        """Stops and joins the readers (killing stragglers) and unlinks the ring. Idempotent.

        Arrays of batches still alive keep pointing at valid memory (the mapping lives
        until they are gone) but are no longer refilled.
        """
        self._closed = True
        self._deactivate()
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ShmDataLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"next step {self._next_step}"
        return (
            f"ShmDataLoader(fields={list(self.field_names)}, batch_size={self.batch_size}, "
            f"mode={self.sampler.mode!r}, readers={self.readers}, slots={self.slots}, {state})"
        )


def _describe_exit(exit_code: int) -> str:
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"was killed by {name} (exit code {exit_code})"
    return f"exited with code {exit_code}"

"""ShmDataLoader: the trainer's side of the ring: validates, wires the ring, iterates, resumes, reports."""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import weakref

import numpy as np

from .device import (
    DeviceIterator,
    PinnedRing,
    TorchCudaBackend,
    cpu_tensors,
    pin_backend,
)
from .fill.filler import FillerSpec
from .lifecycle import Resources, live_loaders
from .plan.checkpoint import PASS_ENDED, Resume, position_of, state_of, step_to_resume
from .plan.defaults import TRAINER_SLOTS, default_readers, default_slots, wake_after
from .plan.localize import localize
from .plan.options import LoaderOptions, check_integer
from .plan.passes import ENDLESS, FinitePass
from .plan.planner import LoaderPlan, plan_loader, warn_poor_layouts, warn_window_memory
from .plan.sampler import Sampler, global_position
from .readers.pool import ReaderPool
from .readers.reader import ReaderConfig
from .readers.supervision import Supervisor
from .remote.pages import COUNTERS
from .ring.batch import Batch, CursorConfig, cursor_module, weak_method
from .ring.layout import POLL_INTERVAL_SECONDS, RingLayout, SlotState
from .ring.segment import Ring
from .ring.stale import sweep_stale
from .transforms.core import resolve as resolve_transform

# The trainer also checks its readers every this many batches when it never has to wait.
_READER_CHECK_BATCHES = 64


# How long seek() waits for a reader to finish the step it is filling, without a step_timeout.
_SEEK_FILL_SECONDS = 60.0


class ShmDataLoader(cursor_module.Cursor):
    """An endless, step-based loader that fills batches in shared memory from reader processes.

    `fields` maps field names to .b2nd/.npy files (or lists, globs, Padded/Packed/Windows of
    them) with the same number of rows; a single path is the field "data", and
    `ShmDataLoader(data_path, label_path)` gives "data" and "label"; a list of Sources is a
    mixture. Batch k depends only on the files, seed, k and the shard, so a loader built
    with start_step=k (or load_state_dict) continues exactly. Iterate it (see Batch for how
    long a batch's zero-copy arrays stay valid); close it, or use `with`.

    readers: processes filling steps (None: the cores, at most 8; 0: the trainer fills each
    step itself when next() needs it). slots: steps the ring holds (plan/defaults.default_slots).
    verify: readers check each Blosc2 chunk's CRC-32 the first time they read it (files
    from `shmloader convert` carry them). pin_memory: page-lock the ring with CUDA once, for
    to_device(). transform, transform_args: see shmloader.transforms. shuffle_window (rows,
    mode="shuffle"): the block-local shuffle for data larger than memory (README). step_timeout
    (seconds; None waits, warning after 10 s): next() raises StepTimeoutError for a step in
    flight that long. hold_timeout: how long next() waits for a slot a batch still holds.
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
        verify: bool = False,
        pin_memory=False,
        transform=None,
        transform_args: dict | None = None,
        shuffle_window: int | None = None,
        step_timeout: float | None = None,
        epochs: int | None = None,
        drop_last: bool = False,
        on_error: str = "raise",
        remote=None,
        cache_dir=None,
        cache_bytes: int | None = None,
        storage_options: dict | None = None,
    ) -> None:
        options = LoaderOptions(
            batch_size=batch_size, mode=mode, seed=seed, readers=readers, slots=slots, start_step=start_step,
            shard_index=shard_index, shard_count=shard_count, max_reader_restarts=max_reader_restarts,
            hold_timeout=hold_timeout, warn_layout=warn_layout, verify=verify, pin_memory=pin_memory,
            transform=transform, transform_args=transform_args, shuffle_window=shuffle_window,
            step_timeout=step_timeout, epochs=epochs, drop_last=drop_last, on_error=on_error, remote=remote,
            cache_dir=cache_dir, cache_bytes=cache_bytes, storage_options=storage_options)
        self.options = options
        self._resources = Resources()
        self._node_cache, self._cache_final = None, {}
        self._finalizer = weakref.finalize(self, self._resources.close)
        self.batch_size = options.batch_size
        # readers=0: the trainer fills each step itself when next() needs it (debugging).
        self.readers = default_readers() if options.readers is None else options.readers
        self.slots = options.slots  # None: plan/defaults.default_slots, once the slot's size is known.
        self.max_reader_restarts = options.max_reader_restarts
        self.hold_timeout, self.step_timeout, self.verify = options.hold_timeout, options.step_timeout, options.verify
        self._epochs, self.drop_last, self.on_error = options.epochs, options.drop_last, options.on_error
        self.remote = remote
        self._pin_backend = pin_backend(pin_memory)  # No CUDA is an error before any reader starts.
        # Readers start now and wait for their configuration on stdin: their start-up
        # overlaps the validation of the files below instead of following it.
        try:
            self._pool = self._resources.pool = self._make_pool(self.readers, self.max_reader_restarts, remote)
            self._pool.start()
            # Fields in a store (s3://): their copies in the node cache, headers fetched.
            fields, label_path, localizer = localize(fields, label_path, cache_dir, cache_bytes, storage_options)
            if localizer is not None:
                self._node_cache = self._resources.node_cache = localizer.cache
                self._cache_counters = self._node_cache.counters()
            try:
                spec = None if transform is None else resolve_transform(transform, transform_args, self.batch_size)
                plan = plan_loader(fields, label_path, options, spec)
            except Exception as error:
                renamed = error if localizer is None else localizer.renamed(error)
                if renamed is error:
                    raise
                raise renamed from None  # Objects named by their URLs, not by their cache paths.
            self._prepare(plan, options.warn_layout, options.start_step)
        except BaseException:
            self._finalizer()  # A half-built loader gives back what it took before raising.
            raise

    def _make_pool(self, count: int, max_restarts: int, remote) -> ReaderPool:
        return ReaderPool(count, max_restarts, remote)  # Replaced by shmloader.testing.simulation's threads.

    @property
    def _fillers(self) -> int:
        """Steps filled at once: one per reader, and the remote readers' steps in flight."""
        return self.readers + (0 if self.remote is None else self.remote.capacity)

    def _prepare(self, plan: LoaderPlan, warn_layout: bool, start_step: int) -> None:
        """Takes the validated plan, then creates the ring and configures the readers."""
        self.plan = plan
        self.plans, self.slot, self.sampler, self.transform = plan.plans, plan.slot, plan.sampler, plan.transform
        self.mixture, self.field_names, self.sources = plan.mixture, plan.slot.names, plan.sources
        if self.slots is None:
            self.slots = default_slots(self._fillers, self.slot.nbytes)
        self.finite = None if self._epochs is None else FinitePass.of(self.sampler, self._epochs, self.drop_last)
        self._end_step = ENDLESS if self.finite is None else self.finite.steps
        self._short_rows = 0  # rows the partial batches of a finite pass (or a resumed first step) left out
        self._resume = None  # an elastic resume's position, until its first step is delivered
        # The whole first ring of steps must be steps the sampler can compute.
        check_integer("start_step", start_step, 0, min(self.sampler.step_max - self.slots, self._end_step))
        if warn_layout:
            warn_poor_layouts(self.plans)
        warn_window_memory(self.plans, self.sampler)
        sweep_stale()
        self._start(start_step)

    def _start(self, start_step: int) -> None:
        """Creates the ring, sets up the native cursor, requests the first steps and
        configures the readers (or, with readers=0, this process's filler)."""
        self._layout = RingLayout(self.slots, max(1, self._pool.records), self.batch_size, self.slot.nbytes,
                                  len(self.slot.regions))
        self._ring = self._resources.ring = Ring.create(self._layout, os.getpid())
        if self._pin_backend is not None:
            self._resources.pinned = PinnedRing(self._pin_backend, self._ring.base_address, self._layout.total_bytes)
        filler, outputs = None, ()
        if self._fillers == 0:  # Its own arrays over the slots: the cursor judges a slot held by its views' references.
            filler = self._resources.filler = self._filler_spec().build()
            outputs = [filler.bind(self._slot_views(slot)) for slot in range(self.slots)]
        self._supervisor = Supervisor(self._pool, self._ring, self.slots, step_timeout=self.step_timeout,
                                      hold_timeout=self.hold_timeout, on_error=self.on_error, filler=filler,
                                      outputs=outputs)
        self._cursor_setup(CursorConfig(
            control_table_address=self._ring.control_table_address,
            slot_count=self.slots,
            work_semaphore=self._ring.names.work,
            ready_semaphores=self._ring.names.ready,
            field_names=tuple(sys.intern(name) for name in self.field_names),
            batch_type=Batch,
            views=tuple(self._slot_views(slot) for slot in range(self.slots)),
            next_step=start_step,
            check_every_batches=_READER_CHECK_BATCHES,
            wake_after_slots=wake_after(self.slots),
            reader_count=self._fillers,
            trainer_slots=TRAINER_SLOTS,
            poll_interval_ns=int(POLL_INTERVAL_SECONDS * 1e9),
            end_step=self._end_step,
            partial_from=ENDLESS if self.finite is None else self.finite.partial_from,
            supervise=type(self)._supervise,
            rebuild_views=type(self)._rebuild_views,
            partial=type(self)._partial,
        ))
        live_loaders.add(self)
        self._request_from(start_step)
        self._pool.configure(self._ring, weak_method(self, type(self)._request), ReaderConfig(
            reader_index=0,
            trainer_pid=os.getpid(),
            names=self._ring.names,
            layout=self._layout,
            filler=self._filler_spec(),
            local_readers=self.readers,
        ))

    def _filler_spec(self) -> FillerSpec:
        return FillerSpec(self.slot, self.sampler, self.plan.fields, self.verify, self.transform,
                          tuple(os.path.abspath(entry) for entry in sys.path) if self.transform else (), self.on_error)

    def _request_from(self, step: int) -> None:
        for step_k in range(step, min(step + self.slots, self._end_step)):
            self._request(step_k % self.slots, step_k)

    # Slot arrays.

    def _slot_views(self, slot: int) -> tuple[np.ndarray, ...]:
        """Slot `slot`'s arrays in SlotLayout view order (regions, then the indices)."""
        return self.slot.views(self._ring.memory, self._layout.slot_offset(slot))

    def _partial(self, batch: Batch) -> Batch:
        """Called by the native next() for a step that keeps fewer rows: of a finite pass
        (the last, or an empty one on a shard whose part ended), or the first step of a
        checkpoint continued under another batch size or shard count (the rows before its
        position were delivered before it). The batch over its rows only."""
        rows = self.batch_size if self.finite is None else self.finite.rows(batch.step)
        first = 0
        if self._resume is not None and batch.step == self._resume.step:
            sampler = self.sampler
            start = batch.step * self.batch_size if getattr(sampler, "shard_blocks", False) else \
                global_position(batch.step, self.batch_size, sampler.shard_index, sampler.shard_count)
            first = max(0, min(self.batch_size, self._resume.position - start))
            self._resume = None
            self._partial_from = ENDLESS if self.finite is None else self.finite.partial_from
        elif self.finite is None or batch.step < self.finite.partial_from:
            return batch
        self._short_rows += self.batch_size - max(0, rows - first)
        if first == 0 and rows == self.batch_size:
            return batch
        views = self.slot.views_of(batch)
        return self._batch_of(self.slot.cut(views, rows, first), batch.step)

    def __len__(self) -> int:
        """The steps of a finite pass (epochs=...); an endless loader has no length."""
        if self.finite is None:
            raise TypeError("an endless loader (epochs=None) has no length; give epochs=N for a finite pass")
        return self.finite.steps

    def __bool__(self) -> bool:
        return True

    def _rebuild_views(self, slot: int) -> None:
        """Called by the native next() when a user changed one of the slot's arrays in place."""
        self._set_views(slot, self._slot_views(slot))

    # Iteration. next() is native (_cursor.c decides what the step's slot holds, takes it
    # or waits for it); it calls _supervise only to check readers and raise errors.

    def __iter__(self) -> ShmDataLoader:
        """The loader itself. A finite pass that has ended is not restarted and does not
        iterate as empty: it raises, saying how to get another pass."""
        if self.finite is not None and self._next_step >= self.finite.steps and self._active:
            raise RuntimeError(
                f"this loader's pass (epochs={self.finite.epochs}, {self.finite.steps} steps) has ended; a pass is not "
                f"restarted, since its order would repeat. For more passes give epochs=N up front (each epoch in "
                f"its own order), or an endless loader (epochs=None) with your own step count; seek(0) replays "
                f"this pass knowingly")
        return self

    def _raise_if_closed(self) -> None:
        if self._resources.owner_pid != os.getpid():
            raise RuntimeError(f"this loader belongs to process {self._resources.owner_pid}; a forked child cannot use it")
        if not self._active:
            raise RuntimeError("the loader is closed")

    def _supervise(self, state: int, owner: int, step: int) -> None:
        """Called by the native next() for a step it cannot deliver at once (readers/supervision.py)."""
        self._raise_if_closed()
        self._supervisor.supervise(self, state, owner, step)

    # The GPU hop.

    def to_device(self, device="cuda", prefetch: int = 2, backend=None) -> DeviceIterator:
        """An iterator of dicts of device tensors: each batch copied asynchronously on a side
        stream, `prefetch` batches ahead, its slot kept until that copy has completed (see
        device.DeviceIterator). With pin_memory the copies read page-locked memory; without,
        they are plain pageable copies. `backend` defaults to PyTorch's CUDA runtime.
        `device="cpu"` copies nothing: dicts of torch.from_numpy views of each batch (the
        batch lifetime rule applies to them)."""
        self._raise_if_closed()
        iter(self)  # A finished pass raises here, as a loop over the loader would.
        if backend is None and str(device) == "cpu":
            return cpu_tensors(self)
        if backend is None:
            backend = self._pin_backend if self._pin_backend is not None else TorchCudaBackend(device)
        iterator = DeviceIterator(self, backend, prefetch)
        self._resources.device_iterators.add(iterator)
        return iterator

    # State and statistics.

    @property
    def reader_pids(self) -> list[int]:
        return self._pool.pids

    @property
    def remote_actors(self) -> list:
        """The remote readers' live handles (Ray actors, in reader-record order after the
        local readers), [] without remote readers."""
        remote = self._pool.remote
        return [] if remote is None else list(remote.actors)

    @property
    def shared_memory_bytes(self) -> int:
        return self._layout.total_bytes

    @property
    def ring_name(self) -> str:
        """The POSIX name of the ring's segment (/dev/shm/<name>; its semaphores are named
        after it): what to look for when judging a leak."""
        return self._ring.names.segment

    def held_steps(self) -> dict[int, int]:
        """{slot: step} of the slots that batches (or views of them) still hold."""
        return self._held()

    def slot_states(self) -> list[tuple[str, int]]:
        """(state, step) of every slot, as the ring's control table says now (diagnostics)."""
        return [(self._ring.state(slot)[0].name, self._ring.step(slot)) for slot in range(self.slots)]

    def state_dict(self) -> dict:
        """What a checkpoint needs: the next step to deliver, the settings it depends on,
        and a description of the sources (file lists as digests, rows, weights, fractions)."""
        position = None if self._resume is None else self._resume.position
        return state_of(self._next_step, self.sampler, self.sources, self.transform, self.finite, position)

    def load_state_dict(self, state: dict) -> None:
        """Continues from `state` (from state_dict()): the next batch is exactly the one
        recorded. A checkpoint of other sources or settings is refused, saying what changed;
        one that lacks them (a bare {"step": n}) too: seek(n) says the same thing knowingly.

        Taken under another batch_size or shard_count (elastic resume), it continues the
        stream from the position it names: every row the interrupted run had not delivered
        comes once across the new shards, and later epochs are whole. Where the position is
        not the start of a new global batch, the first step (`state_dict()["step"]` of the
        checkpoint's position in the new numbering) is cut to the rows from it: on the shard
        that holds the position a shorter batch, on those before it an empty one."""
        resume, transition = step_to_resume(state, self.sampler, self.sources, self.transform, self.finite)
        sampler, finite = self.sampler, self.finite
        if transition != self.sampler.transition:  # Checked whole before anything changes.
            sampler = self.sampler.with_transition(transition)
            finite = None if self._epochs is None else FinitePass.of(sampler, self._epochs, self.drop_last)
        end = ENDLESS if finite is None else finite.steps
        if resume is PASS_ENDED or (isinstance(resume, Resume) and finite is not None and
                                    resume.position >= finite.positions):
            resume = end  # The checkpoint's pass had ended (its last global batch ran past it): so has this one.
        step = resume.step if isinstance(resume, Resume) else resume
        check_integer("the checkpoint's step", step, 0, min(sampler.step_max - self.slots, end))
        if sampler is not self.sampler:
            self._use_sampler(sampler, finite)
        if not isinstance(resume, Resume):
            self.seek(resume)
            return
        self.seek(resume.step)
        if resume.position > position_of(self.sampler, resume.step)[0]:
            self._resume = resume
            self._partial_from = resume.step

    def seek(self, step: int) -> None:
        """Makes `step` the next batch.

        The caller must first drop every batch and every view of one (or call release() on
        the batches and drop the arrays taken from them): seek hands back every slot that
        nothing refers to, after one garbage collection, and raises RuntimeError naming the
        step of any batch still referenced. Batches already filled for other steps are
        discarded; readers in the middle of one finish it first.
        """
        self._raise_if_closed()
        step = check_integer("step", step, 0, min(self.sampler.step_max - self.slots, self._end_step))
        self._take_back_all()
        self._next_step = step
        self._resume = None  # A seek names its step knowingly: no resumed position to cut at.
        self._partial_from = ENDLESS if self.finite is None else self.finite.partial_from
        self._request_from(step)

    def _take_back_all(self) -> None:
        """Takes every slot back from the readers (seek's first half): raises, changing
        nothing, while a batch is held or a reader does not finish its step in time."""
        self._release_unused()
        gc.collect()
        self._release_unused()
        held = self._held()
        if held:
            raise RuntimeError(f"cannot seek while batch {min(held.values())} is held; release every batch first")
        # A reader in the middle of a step finishes it first: as long as a step may take
        # (step_timeout, else a minute), not the hold timeout of a batch a user keeps.
        fill_timeout = self.step_timeout if self.step_timeout is not None else max(self.hold_timeout, _SEEK_FILL_SECONDS)
        taken = []
        try:
            for slot in range(self.slots):
                self._pool.take_back(slot, fill_timeout)
                taken.append(slot)
        except BaseException:
            # Nothing changed, as far as the caller can tell: the slots taken back so far
            # are requested again for the steps they held, and the loader goes on as before.
            for slot in taken:
                if self._ring.state(slot)[0] == SlotState.IDLE:
                    old = self._next_step + (slot - self._next_step) % self.slots
                    if old < self._end_step:
                        self._request(slot, old)
            raise

    def _use_sampler(self, sampler: Sampler, finite: FinitePass | None) -> None:
        """Fills with `sampler` (and its pass, `finite`) from now on: a resharded checkpoint's
        dealing (plan/reshard.py), or none again. Readers build their sampler from their
        configuration, so they are replaced once every slot is taken back (the caller seeks
        next). Raises, changing nothing, while a batch is held."""
        self._raise_if_closed()
        self._take_back_all()
        self.sampler, self.plan, self.finite = sampler, dataclasses.replace(self.plan, sampler=sampler), finite
        self._end_step = ENDLESS if finite is None else finite.steps
        spec = self._filler_spec()
        if self._fillers == 0:  # readers=0: this process's filler, bound to the slots anew.
            old, filler = self._resources.filler, spec.build()
            self._resources.filler = self._supervisor.filler = filler
            self._supervisor.outputs = [filler.bind(self._slot_views(slot)) for slot in range(self.slots)]
            old.close()
        self._pool.reconfigure(spec)

    def stats(self) -> dict:
        """Batches delivered, rates, the share of time the trainer waited, and per reader its
        busy time, the time it slept while a slot was waiting for it (starved_s; what must
        go to zero while the trainer waits), its wake-ups and batches per wake-up."""
        if self._active:
            self._supervisor.warn_if_skipped()
        now = self._now_ns()
        elapsed_s = (now - self._first_next_ns) / 1e9 if self._first_next_ns else 0.0
        rows = self._batches * self.batch_size - self._short_rows
        row_bytes = self.slot.row_bytes
        return {
            "batches": self._batches,
            "rows": rows,
            "elapsed_s": elapsed_s,
            "rows_per_s": rows / elapsed_s if elapsed_s else 0.0,
            "batches_per_s": self._batches / elapsed_s if elapsed_s else 0.0,
            "bytes_per_s": rows * row_bytes / elapsed_s if elapsed_s else 0.0,
            "wait_s": self._wait_ns / 1e9,
            "wait_fraction": self._wait_ns / 1e9 / elapsed_s if elapsed_s else 0.0,
            "reader_restarts": self._pool.restarts + self._pool.remote_restarts,
            "skipped": dict(zip(("count", "records"), self._supervisor.skipped())) if self._active else {"count": 0, "records": []},
            "shared_memory_bytes": self.shared_memory_bytes,
            "readers": self._pool.report(elapsed_s) if self._active else [],
            **({} if self._node_cache is None else {"cache": self._cache_stats()}),
        }

    def _cache_stats(self) -> dict:
        """The node cache's budget and bytes held now, and its requests, bytes fetched,
        retries and pages evicted since this loader started (by every process of the node
        that uses the cache); the last figures once the loader is closed."""
        if self._resources.node_cache is None:
            return self._cache_final
        now = self._node_cache.counters()
        return {**now, **{name: now[name] - self._cache_counters[name] for name in COUNTERS}}

    # Lifecycle.

    def close(self) -> None:
        """Stops and joins the readers (killing stragglers) and unlinks the ring, as the
        shutdown note in readers/pool.py describes. Idempotent.

        Arrays of batches still alive keep pointing at valid memory (the mapping lives
        until they are gone) but are no longer refilled.
        """
        if self._active:
            self._supervisor.warn_if_skipped()  # The one warning, if next() never had a moment to give it.
        self._deactivate()
        if self._resources.node_cache is not None:
            self._cache_final = self._cache_stats()  # stats() after close still says what the run cost.
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._active

    def __enter__(self) -> ShmDataLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"next step {self._next_step}"
        return (
            f"ShmDataLoader(fields={list(self.field_names)}, batch_size={self.batch_size}, "
            f"mode={self.sampler.mode!r}, readers={self.readers}, slots={self.slots}, {state})"
        )

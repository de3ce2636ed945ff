"""ShmDataLoader: the trainer's facade: checks the settings, plans, iterates, resumes, reports.

It holds its options, its Session (session.py: the plan it fills with, the ring, its
readers, the native cursor) and what the user may read off it (batch_size, readers, slots,
field_names, diagnostics); where a checkpoint continues is plan/resume.py's."""

from __future__ import annotations

import dataclasses

from .device import (
    DeviceIterator,
    TorchCudaBackend,
    cpu_tensors,
    pin_backend,
)
from .lifecycle import Resources
from .plan.checkpoint import position_of, state_of
from .plan.dataset import plan_dataset, refuse_a_loader_in_the_scripts_import
from .plan.defaults import default_readers
from .plan.localize import localize
from .plan.options import AutoReaders, LoaderOptions, check_integer
from .plan.planner import plan_dataset_loader, plan_loader
from .plan.resume import continuation
from .readers.budget_record import NodeShare
from .readers.elastic import ElasticPool
from .readers.fork_call import call_in_fork
from .readers.pool import ReaderPool
from .remote.node import CacheUse
from .ring.batch import cursor_module
from .session import Diagnostics, Session
from .transforms.core import resolve as resolve_transform


# Read off the loader until the seventeenth session; now where this says.
_MOVED = {**dict.fromkeys(("reader_pids", "remote_actors", "shared_memory_bytes", "ring_name", "held_steps",
                           "slot_states"), "diagnostics"),
          **dict.fromkeys(("plans", "slot", "transform", "mixture", "sources"), "plan"),
          **dict.fromkeys(("verify", "hold_timeout", "step_timeout", "drop_last", "on_error", "max_reader_restarts",
                           "remote"), "options")}


class ShmDataLoader(cursor_module.LoaderBase):
    """An endless, step-based loader that fills batches in shared memory from reader processes.

    `fields` maps field names to .b2nd/.npy files (or lists, globs, Padded/Packed/Windows of
    them) with the same number of rows; a single path is the field "data", and
    `ShmDataLoader(data_path, label_path)` gives "data" and "label"; a list of Sources is a
    mixture. Batch k depends only on the files, seed, k and the shard, so a loader built
    with start_step=k (or load_state_dict) continues exactly. Iterate it (see Batch for how
    long a batch's zero-copy arrays stay valid); close it, or use `with`.

    readers: processes filling steps (None, the default, is "auto": AutoReaders(start, least,
    most), as many as keep the trainer from waiting while cores are idle, added and retired
    as the loader runs, readers/autotune.py; `loader.readers` is then the most it may reach
    and stats()["reader_count"] those running; with remote readers, the cores, at most 8; a
    number fixes them; 0: the trainer fills each step itself when next() needs it). slots:
    steps the ring holds (None: plan/defaults.default_slots; "auto": sized from the batch's
    bytes, the most readers and the memory, auto_slots).
    verify (on by default): readers check what they read of a Blosc2 file against its
    checksums the first time they read it, each block and its chunk's head where the file
    carries block digests (`shmloader convert` writes them; a block one reader checked, the
    loader's other readers do not check again), else each whole chunk's CRC-32
    (files converted before block digests); files without checksums load unchecked. False
    skips the checks. pin_memory: page-lock the ring with CUDA once, for
    to_device(). transform, transform_args: see shmloader.transforms. shuffle_window (rows,
    mode="shuffle"): the block-local shuffle for data larger than memory (README). step_timeout
    (seconds; None waits, warning after 10 s): next() raises StepTimeoutError for a step in
    flight that long. hold_timeout: how long next() waits for a slot a batch still holds
    where that batch cannot be given memory of its own (pin_memory, held across a fork;
    shmloader/kept.py), before SlotsExhaustedError.
    """

    def __init__(
        self,
        fields,
        label_path=None,
        *,
        batch_size: int = 256,
        mode: str = "shuffle",
        seed: int = 0,
        readers: int | str | AutoReaders | None = None,
        slots: int | str | None = None,
        start_step: int = 0,
        shard_index: int = 0,
        shard_count: int = 1,
        max_reader_restarts: int = 3,
        hold_timeout: float = 5.0,
        warn_layout: bool = True,
        verify: bool = True,
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
        audit_log=None,
    ) -> None:
        options = LoaderOptions(
            batch_size=batch_size, mode=mode, seed=seed, readers=readers, slots=slots, start_step=start_step,
            shard_index=shard_index, shard_count=shard_count, max_reader_restarts=max_reader_restarts,
            hold_timeout=hold_timeout, warn_layout=warn_layout, verify=verify, pin_memory=pin_memory,
            transform=transform, transform_args=transform_args, shuffle_window=shuffle_window,
            step_timeout=step_timeout, epochs=epochs, drop_last=drop_last, on_error=on_error, remote=remote,
            cache_dir=cache_dir, cache_bytes=cache_bytes, storage_options=storage_options, audit_log=audit_log)
        refuse_a_loader_in_the_scripts_import()
        # The facade holds its options, its session, and what the user may read off it.
        self.options = options
        resources = self._resources = Resources()
        self._cache_use = None  # Fields in a store: this loader's use of the node cache.
        self._dataset = None  # from_dataset: the trainer's handle on the dataset (plan/dataset.py).
        self.batch_size = options.batch_size
        # readers=0: the trainer fills each step itself when next() needs it (debugging).
        # readers="auto": self.readers is the most it may reach (the ring's reader records).
        self.readers = start = least = default_readers() if options.readers is None else options.readers
        if isinstance(options.readers, AutoReaders):
            start, least, self.readers = options.readers.resolve()
        self._pin_backend = pin_backend(pin_memory)  # No CUDA is an error before any reader starts.
        # Readers start now and wait for their configuration on stdin: their start-up
        # overlaps the validation of the files below instead of following it.
        try:
            if self._pool_type is ReaderPool and remote is None and self.readers:  # Counted in the node's budget.
                # An auto loader starts what the budget has room for (its least where none).
                resources.node_share = NodeShare.join(start, least, self.readers)
                start = resources.node_share.started
            if not isinstance(options.readers, AutoReaders):
                pool = self._pool_type(self.readers, options.max_reader_restarts, remote)
            elif self._pool_type is ReaderPool:
                pool = ElasticPool(self.readers, options.max_reader_restarts, start, least)
            else:  # The simulation's threads (testing/simulation.py) neither join nor leave: its start, fixed.
                pool, self.readers = self._pool_type(start, options.max_reader_restarts, remote), start
            resources.pool = pool
            if isinstance(fields, _DatasetSource) and fields.share_by_fork:
                pool.share_by_fork = True  # Its readers are forked once the dataset is planned.
            pool.start()
            if isinstance(fields, _DatasetSource):  # from_dataset: no files to plan.
                self._dataset = resources.dataset = fields.plan(self.readers, remote, options.seed)
                if isinstance(pool, ElasticPool) and self._dataset.spec.by_reader:
                    raise ValueError("readers='auto' needs steps any reader may fill; this dataset's steps each "
                                     "belong to one reader (an IterableDataset): give readers= a number")
                self._open(plan_dataset_loader(self._dataset.spec, options, fields.index_table))
                return
            # Fields in a store (s3://): their copies in the node cache, headers fetched.
            fields, label_path, localizer = localize(fields, label_path, cache_dir, cache_bytes, storage_options)
            if localizer is not None:
                resources.node_cache = localizer.cache
                self._cache_use = CacheUse(localizer.cache)
            try:
                spec = None if transform is None else resolve_transform(transform, transform_args, self.batch_size)
                plan = plan_loader(fields, label_path, options, spec)
            except Exception as error:
                renamed = error if localizer is None else localizer.renamed(error)
                if renamed is error:
                    raise
                raise renamed from None  # Objects named by their URLs, not by their cache paths.
            self._open(plan)
        except BaseException:
            resources.close()  # A half-built loader gives back what it took before raising.
            raise

    # Replaced by shmloader.testing.simulation's threads.
    _pool_type = ReaderPool

    def __getattr__(self, name: str):
        """Only for names that are not there: those that moved say where."""
        if name in _MOVED:
            raise AttributeError(f"ShmDataLoader.{name} is now loader.{_MOVED[name]}.{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _open(self, plan) -> None:
        session = self._session = Session.open(
            self._resources, plan, self.options, readers=self.readers, pin_backend=self._pin_backend,
            dataset_spec=None if self._dataset is None else self._dataset.spec)
        self.slots, self.field_names = session.slots, plan.slot.names
        self.diagnostics = Diagnostics(session)
        self._cursor = session.iterator  # What next(loader) forwards to, in C (ring/_cursor_module.c).
        self._placed_after = 0  # cursor.batches when a seek or checkpoint last placed the loader (__iter__).

    @classmethod
    def from_dataset(cls, dataset, *, outputs=None, dataset_args=None, index_table=None, reader_hook=None,
                     probe_view=None, share_by_fork: bool = False, **settings) -> ShmDataLoader:
        """A loader whose rows are a map-style dataset's samples: any object with __len__
        and __getitem__ (a torch.utils.data.Dataset as it is), or "module:function" that
        builds one in each reader from `dataset_args` (for a dataset that cannot be pickled).

        Readers call dataset[index] for the sampler's indices, with Python's, numpy's and
        torch's global generators seeded from (seed, stream position) (the first two once
        the dataset is seen drawing from them: fill/global_seeds.py), and write each
        sample's leaves straight into the slot: batch["image"], batch["label"] for dict
        samples, batch["0"], batch["1"] for tuples, batch["data"] for a bare array
        (plan/dataset.py; rebuild_batch gives the samples' structure back). `outputs`
        declares a leaf's (shape, dtype), or for a varying first dimension Ragged(max_length)
        (padded) or PackedRagged(max_items) (back to back, with offsets); the others come
        from dataset[0]. `index_table` (plan/index_table.py; its width the batch_size, one
        epoch): a caller's own order instead of the loader's. `reader_hook`: ("module:function",
        argument), called in each reader once it has loaded the dataset (DatasetSpec.reader_hook;
        the drop-in's worker view); `probe_view(dataset)`, the context the probe of dataset[0]
        runs in (plan/probe.py). `share_by_fork`: readers are forked from this process once
        the dataset is planned (readers/trainer_fork.py), and find it in memory, nothing
        pickled, and dataset[0] is read in a fork of its own (readers/fork_call.py); the caller
        checks that forking is safe. `settings` are the loader's (batch_size,
        mode, seed, readers, epochs, drop_last, on_error, shard_index, ...); shuffle_window,
        transform and remote readers do not apply."""
        return cls(_DatasetSource(dataset, outputs, dataset_args, index_table, reader_hook, probe_view, share_by_fork),
                   **settings)

    @property
    def plan(self):
        """The validated plan: fields, slot layout, transform, and the sampler batches come
        from (a resharded resume's dealing included)."""
        return self._session.plan

    @property
    def sampler(self):
        """The sampler batches come from (a resharded resume's dealing included)."""
        return self._session.cuts.sampler

    @property
    def finite(self):
        """The finite pass (epochs=N), or None for the endless loader."""
        return self._session.cuts.finite

    def __len__(self) -> int:
        """The steps of a finite pass (epochs=...); an endless loader has no length."""
        if self.finite is None:
            raise TypeError("an endless loader (epochs=None) has no length; give epochs=N for a finite pass")
        return self.finite.steps

    def __bool__(self) -> bool:
        return True

    # Iteration: the session's native cursor (ring/_cursor.c) decides what the step's slot holds,
    # takes it or waits for it, and calls its supervisor only to check readers and raise; with
    # readers=0 the session's iterator has the local reader fill the step first (readers/local.py).
    # next(loader) reaches that iterator through LoaderBase, in C; a loop iterates it itself.

    def __iter__(self):
        """The session's iterator: the native cursor over the ring, or with readers=0 the
        local reader's iterator over it (either keeps the ring alive as long as a loop
        runs). A finite pass that has ended is not restarted and does not iterate as empty:
        it raises, saying how to get another pass."""
        cursor = self._session.cursor
        if self.finite is not None and cursor.next_step >= self.finite.steps and cursor.active:
            if cursor.batches == self._placed_after:  # Put there by start_step, seek or a checkpoint, not iterated.
                raise RuntimeError(
                    f"this loader's pass (epochs={self.finite.epochs}, {self.finite.steps} steps) has ended where "
                    f"start_step, seek() or load_state_dict() put it (step {cursor.next_step}), before it delivered "
                    f"a batch: nothing of the pass is left to deliver (a checkpoint taken at its end delivers "
                    f"nothing more). seek(0) replays the pass knowingly")
            raise RuntimeError(
                f"this loader's pass (epochs={self.finite.epochs}, {self.finite.steps} steps) has ended; a pass is not "
                f"restarted, since its order would repeat. For more passes give epochs=N up front (each epoch in "
                f"its own order), or an endless loader (epochs=None) with your own step count; seek(0) replays "
                f"this pass knowingly")
        self._session.recover()  # After a step failed or timed out: healthy readers, a clean ring.
        return self._session.iterator

    # The GPU hop.

    def to_device(self, device="cuda", prefetch: int = 2, backend=None) -> DeviceIterator:
        """An iterator of dicts of device tensors: each batch copied asynchronously on a side
        stream, `prefetch` batches ahead, its slot kept until that copy has completed (see
        device.DeviceIterator). With pin_memory the copies read page-locked memory; without,
        they are plain pageable copies. `backend` defaults to PyTorch's CUDA runtime.
        `device="cpu"` copies nothing: dicts of torch.from_numpy views of each batch (the
        batch lifetime rule applies to them)."""
        self._session.check_open()
        iter(self)  # A finished pass raises here, as a loop over the loader would.
        if backend is None and str(device) == "cpu":
            return cpu_tensors(self)
        if backend is None:
            backend = self._pin_backend if self._pin_backend is not None else TorchCudaBackend(device)
        iterator = DeviceIterator(self, backend, prefetch)
        self._resources.device_iterators.add(iterator)
        return iterator

    # State and statistics.

    def state_dict(self) -> dict:
        """What a checkpoint needs: the next step to deliver, the settings it depends on,
        and a description of the sources (file lists as digests, rows, weights, fractions)."""
        resume, plan = self._session.cuts.resume, self.plan
        return state_of(self._session.cursor.next_step, self.sampler, plan.sources, plan.transform, self.finite,
                        None if resume is None else resume.position)

    def load_state_dict(self, state: dict) -> None:
        """Continues from `state` (from state_dict()): the next batch is exactly the one
        recorded. A checkpoint of other sources or settings is refused, saying what changed;
        one that lacks them (a bare {"step": n}) too: seek(n) says the same thing knowingly.

        Taken under another batch_size or shard_count (elastic resume), it continues the
        stream from the position it names: every row the interrupted run had not delivered
        comes once across the new shards, and later epochs are whole. Where the position is
        not the start of a new global batch, the stream is shifted (Sampler.start_position)
        so that the resumed step (`state_dict()["step"]` of the position in the new
        numbering) starts at it: every shard's batch is whole, none empty. A mixture's steps
        cannot be shifted: its resumed step is cut, on the shard that holds the position to
        the rows from it, on those before it to none. A finite pass's last steps are dealt
        evenly among the shards (plan/passes.py): the same number of steps on every shard,
        none empty. (Where: plan/resume.py.)"""
        session, options = self._session, self.options
        going = continuation(state, self.sampler, self.finite, self.plan.sources, self.plan.transform, options.epochs,
                             options.drop_last)
        check_integer("the checkpoint's step", going.step, 0, session.last_step(going.sampler, going.end_step))
        if going.sampler is not self.sampler:
            session.use(going.sampler)
        # The audit log's segment starts where the checkpoint stood: what was delivered from
        # there before this resume is replayed (tools/audit.py).
        session.seek(going.step, "a resume (load_state_dict)", _checkpoint_position(state, self.sampler))
        self._placed_after = session.cursor.batches
        resume = going.resume
        if resume is not None and resume.position > position_of(self.sampler, resume.step)[0]:
            session.resume_at(resume)

    def seek(self, step: int) -> None:
        """Makes `step` the next batch.

        A batch still referenced keeps its values: its slot's pages become memory of its
        own (a slot's worth while it lives; the first of each slot until the loader
        closes; bounded, shmloader/kept.py) and the slot is mapped anew for the readers. Under pin_memory (the device
        has the ring's pages registered), and for a batch held when the process forked (a
        child may share its pages), seek instead raises RuntimeError naming its step,
        after one garbage collection: drop every batch and view of one first. Batches
        already filled for other steps are discarded; readers in the middle of one finish
        it first.
        """
        self._session.seek(step)
        self._placed_after = self._session.cursor.batches

    def stats(self) -> dict:
        """Batches delivered, rates, the share of time the trainer waited, and per reader its
        busy time, the time it slept while a slot was waiting for it (starved_s; what must
        go to zero while the trainer waits), its wake-ups and batches per wake-up.

        "skipped" (on_error="skip"): "count", the records replaced in the rows of the steps
        filled so far, each once; "records", each one's step, position, row, source, where
        it is stored and its own error, by step. The rows a finite pass's last step
        computes past its cut are not counted. Counted although not delivered: the steps
        readers fill ahead of next() (up to `slots`) or filled before a seek() or
        load_state_dict(), and an elastic resume's first step's rows before the checkpoint's
        position (readers=0 fills only the steps next() asks for). The list is cut where a
        reader's records outgrow its 2 KiB report in the ring (a dozen or so per reader;
        readers=0 lists all): count is then larger than len(records), which holds the
        first ones each reader skipped. "kept_batches", "kept_bytes": the batches your code
        kept past their slot's turn, given memory of their own (shmloader/kept.py), and their
        bytes; "kept_bytes_max" the bound on those bytes.

        "reader_count": the readers filling now; under readers="auto" (readers/autotune.py) also
        "readers_least", "readers_most", "reader_changes" and "reader_change", the last change
        ({"at_s", "from", "to", "why"}; None before one), "reader_trial", the trial in flight
        or how the last ended (readers/probe.py; None before one), and "readers_earned", those of
        its readers past the node's budget that a trial earned on idle CPU (readers/earned.py),
        else "reader_change" None.
        "node_budget" (local readers; readers/budget_record.py): the readers every loader of the
        node may run ("budget"), those they ran and how many loaders (and "idle_loaders", whose
        readers past their least others may use) at this loader's last update, and this
        loader's; {"error": why} where it runs without; None without readers.

        "bottleneck" (readers/bottleneck.py): what limited the loader since the stats()
        call before (the first: since the start; called often, about the last 10 s):
        "stage" (trainer, held, stalled, link, cache, user_code, disk, decompression,
        reader_cpu), its "utilisation", the one change that would help ("advice"), all of
        it as one "line", and the figures it was judged on ("detail")."""
        session, cursor = self._session, self._session.cursor
        active = cursor.active
        if active:
            session.supervisor.warn_if_skipped()
        elapsed_s = (cursor.now_ns() - cursor.first_next_ns) / 1e9 if cursor.first_next_ns else 0.0
        batches, wait_s = cursor.batches, cursor.wait_ns / 1e9
        rows = batches * self.batch_size - session.cuts.short_rows
        row_bytes = self.plan.slot.row_bytes
        return {
            "batches": batches,
            "rows": rows,
            "elapsed_s": elapsed_s,
            "rows_per_s": rows / elapsed_s if elapsed_s else 0.0,
            "batches_per_s": batches / elapsed_s if elapsed_s else 0.0,
            "bytes_per_s": rows * row_bytes / elapsed_s if elapsed_s else 0.0,
            "wait_s": wait_s,
            "wait_fraction": wait_s / elapsed_s if elapsed_s else 0.0,
            "reader_restarts": session.pool.restarts + session.pool.remote_restarts,
            "skipped": dict(zip(("count", "records"), session.supervisor.skipped())) if active else {"count": 0, "records": []},
            "shared_memory_bytes": session.layout.total_bytes,
            # Batches kept past their slot's turn, in memory of their own (kept.py), and its bound.
            "kept_batches": session.kept.count,
            "kept_bytes": session.kept.kept_bytes,
            "kept_bytes_max": session.kept.bytes_max,
            "readers": session.pool.report(elapsed_s) if active else [],
            # The readers now and, under readers="auto", their bounds and the last change and why.
            **({"reader_count": session.pool.count, "reader_change": None} if session.tuner is None
               else session.tuner.report()),
            "node_budget": None if session.resources.node_share is None else session.resources.node_share.report(),
            "bottleneck": session.meter.diagnosis() if active else session.meter.last,
            **({} if self._cache_use is None else {"cache": self._cache_use.stats()}),
        }

    # Lifecycle.

    def close(self) -> None:
        """Stops and joins the readers (killing stragglers) and unlinks the ring, as the
        shutdown note in readers/pool.py describes. Idempotent.

        Arrays of batches still alive keep pointing at valid memory (the mapping lives
        until they are gone) but are no longer refilled.
        """
        if "_session" not in self.__dict__:
            return  # Never built (ShmDataLoader.__new__ alone): nothing to give back.
        if self._cache_use is not None:
            self._cache_use.freeze()
        self._session.close()

    @property
    def closed(self) -> bool:
        return not self._session.cursor.active

    def __enter__(self) -> ShmDataLoader:
        if self.closed:  # `with` on a closed loader would run its block over nothing and hide why.
            raise RuntimeError("`with loader:` on a closed loader: it was closed (close(), or the end of an earlier "
                               "`with` block) and cannot be reopened; build a new ShmDataLoader")
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        if "_session" not in self.__dict__:
            return "ShmDataLoader(not set up)"
        state = "closed" if self.closed else f"next step {self._session.cursor.next_step}"
        return (
            f"ShmDataLoader(fields={list(self.field_names)}, batch_size={self.batch_size}, "
            f"mode={self.sampler.mode!r}, readers={self.readers}, slots={self.slots}, {state})"
        )


def _checkpoint_position(state: dict, sampler) -> int | None:
    """The stream position a (validated) checkpoint stood at, for the audit log."""
    position = state.get("position")
    if isinstance(position, int) and not isinstance(position, bool):
        return position
    step = state.get("step")
    return None if not isinstance(step, int) else position_of(sampler, step)[0]


class _DatasetSource:
    """What from_dataset hands the constructor in place of fields."""

    def __init__(self, dataset, outputs, dataset_args, index_table=None, reader_hook=None, probe_view=None,
                 share_by_fork=False) -> None:
        self.dataset, self.outputs, self.dataset_args = dataset, outputs, dataset_args
        self.index_table, self.reader_hook, self.probe_view = index_table, reader_hook, probe_view
        self.share_by_fork = bool(share_by_fork) and not isinstance(dataset, str)

    def plan(self, readers: int, remote, seed: int):
        if remote is not None:
            raise ValueError("remote readers take files every node can read; a dataset source runs in local readers "
                             "only: give remote=None")
        return plan_dataset(self.dataset, self.outputs, self.dataset_args, readers=readers,
                            reader_hook=self.reader_hook, probe_view=self.probe_view,
                            share_by_fork=self.share_by_fork, seed=seed, fork_call=call_in_fork)

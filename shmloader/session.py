"""A loader's session: the ring, its readers and the native cursor over the ring.

ShmDataLoader (loader.py) checks the settings, plans and answers the user; its Session
runs what the plan needs. The session creates the ring, builds the cursor (ring/_cursor.c)
from plain settings and callables, configures the readers (with readers=0, the local
reader in this process, readers/local.py), requests steps, takes every slot back for a
seek, gives the readers another filler, and tears it all down.

Lifetimes. The session's `iterator` is the loader's: the cursor itself, or with readers=0
the LocalIterator that has the local reader fill each step before the cursor takes it,
which refers to the cursor. `for batch in ShmDataLoader(...)` keeps only that iterator once
the temporary loader is gone. So the teardown (lifecycle.Resources) follows the cursor: a
weakref.finalize on the cursor runs Resources.close. Nothing the cursor refers to refers
back to it, to the iterator, to the session or to the loader. The supervisor, the step cuts
and the local reader are handed the cursor when they act on it, and the pool its request.
An unclosed loader is therefore torn down as soon as neither it nor a loop over it is
left, without waiting for the garbage collector.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import sys
import time
import weakref

from .audit_log import AuditIterator, begin_segment, open_writer
from .device import PinnedRing
from .fill.filler import FillerSpec, fetch_first_steps
from .kept import KeptBatches
from .lifecycle import Resources, live_resources
from .plan.fields import part_name
from .plan.defaults import (TRAINER_SLOTS, auto_readers_most, auto_slots, default_ring_bytes, default_slots,
                             kept_bytes_max, ring_budget_bytes, wake_after)
from .plan.options import LoaderOptions, check_integer
from .plan.passes import ENDLESS, FinitePass
from .plan.planner import warn_poor_layouts, warn_window_memory
from .readers.local import LocalIterator, LocalReader
from .readers.autotune import Tuner
from .readers.bottleneck import Meter, header_words, plan_context, ring_reading, zero_reading
from .readers.disk_device import disks_of_paths
from .readers.elastic import ElasticPool
from .readers.channel import ReaderConfig, trainer_context
from .readers.supervision import Supervisor
from .ring.batch import Batch, batch_type_of, cursor_module
from .ring.layout import POLL_INTERVAL_SECONDS, WAIT_AHEAD_SPAN_SECONDS, RingLayout, SlotState
from .ring.segment import Ring
from .ring.slot_layout import SlotLayout
from .ring.stale import sweep_stale
from .storage import checked_blocks

# The trainer also checks its readers every this many batches when it never has to wait...
_READER_CHECK_BATCHES = 64
# ...or at the first next() this long after the last check: a loader whose steps are slow
# runs its tuner (readers="auto") once a window, and so keeps its entry in the node's reader
# budget record fresh (readers/budget_record.py takes a loader that does not for idle).
_READER_CHECK_SECONDS = 1.0


class StepCuts:
    """Which delivered steps keep fewer rows than a batch, and which rows: the partial steps
    of a finite pass (the last, or an empty one on a shard whose part ended), and the first
    step of a checkpoint continued under another batch size or shard count (the rows before
    its position were delivered before it). The cursor hands it every step from its
    partial_from on. It also owns the loader's sampler and pass, which decide both."""

    def __init__(self, slot: SlotLayout, batch_size: int, sampler, finite: FinitePass | None) -> None:
        self.slot, self.batch_size, self.sampler, self.finite = slot, batch_size, sampler, finite
        self.resume = None  # An elastic resume's position, until its first step is delivered.
        self.short_rows = 0  # Rows the cut steps left out.

    @property
    def end_step(self) -> int:
        return ENDLESS if self.finite is None else self.finite.steps

    @property
    def partial_from(self) -> int:
        """The first step to cut, with no resumed step pending."""
        return ENDLESS if self.finite is None else self.finite.partial_from

    def partial(self, cursor, batch: Batch) -> Batch:
        """`batch` cut to the rows its step keeps (called by the native next())."""
        rows = self.batch_size if self.finite is None else self.finite.rows(batch.step)
        first = 0
        if self.resume is not None and batch.step == self.resume.step:
            start = self.sampler.first_position(batch.step)
            first = max(0, min(self.batch_size, self.resume.position - start))
            self.resume = None
            cursor.partial_from = self.partial_from
        elif self.finite is None or batch.step < self.finite.partial_from:
            return batch
        self.short_rows += self.batch_size - max(0, rows - first)
        if first == 0 and rows == self.batch_size:
            return batch
        views = self.slot.views_of(batch)
        return cursor.batch_of(self.slot.cut(views, rows, first), batch.step)


def last_step(sampler, slots: int, end_step: int) -> int:
    """The last step a run may start at: its pass's end, and short of the stream's last step
    by the ring's `slots` (the readers fill that far ahead of it)."""
    return min(sampler.step_max - slots, end_step)


def _slot_count(setting, fillers: int, pool, slot_bytes: int) -> int:
    """The ring's slots: `setting` where a number; "auto" (auto_slots); the default
    (default_slots, within default_ring_bytes), which under readers="auto" (an ElasticPool)
    is sized for the readers it starts with a slot for each of the `fillers` it may reach."""
    if setting == "auto":
        return auto_slots(fillers, slot_bytes, ring_budget_bytes())
    if setting is not None:
        return setting
    room = default_ring_bytes()
    if isinstance(pool, ElasticPool):
        return default_slots(pool.start_count, slot_bytes, fillers, room)
    return default_slots(fillers, slot_bytes, ring_bytes=room)


def _pass_of(sampler, options: LoaderOptions) -> FinitePass | None:
    """The finite pass (epochs=N) of `sampler`, or None for an endless loader."""
    return None if options.epochs is None else FinitePass.of(sampler, options.epochs, options.drop_last)


def _from_store(plan) -> bool:
    """Whether a field of the plan reads a copy of an object in a store."""
    return any(part_name(part) != getattr(part, "path", None) for field in plan.fields for part in field.parts)


def _disks(plan) -> tuple[str, ...]:
    """The disks the plan's files are on (readers/disk_device.py): the disk verdict's reference."""
    return disks_of_paths(spec.path for field in plan.fields for spec in field.stored_files())


def _views_function(slot: SlotLayout, ring: Ring, layout: RingLayout):
    """views_of(slot) -> that slot's arrays in SlotLayout view order, built afresh: the
    cursor's, referring to the ring but to no session."""
    return lambda index: slot.views(*ring.slot_memory(index))


class Session:
    """The ring, its readers (`pool`) and the cursor over the ring, for one loader, and what
    they fill with: the plan (its sampler a resharded dealing's or a new pass's once use()
    has given one), its pass and step cuts, the slots' count and the step bound.

    Built by open(). `resources` already holds the started pool (readers start before the
    plan exists, so that their start-up overlaps the validation of the files); from here on
    it is closed when the cursor goes (or by close()). `fillers`: the steps filled at once
    (local readers plus the remote readers' capacity); 0 fills each step in this process
    when next() needs it, by the local reader (`local`) that the loader's `iterator` drives."""

    @classmethod
    def open(cls, resources: Resources, plan, options: LoaderOptions, *, readers: int, pin_backend,
             dataset_spec=None) -> Session:
        """The session for the validated `plan`: its pass (epochs=N), the slots' count
        (plan/defaults.default_slots unless set), the step cuts, the first step checked
        against the bound, the layout warnings; then the ring, its cursor and the readers'
        configuration (or, with readers=0, the local reader in this process)."""
        if options.epochs is not None:  # A sampler deals its pass's tail (passes.py); a mixture's is cut.
            plan = dataclasses.replace(plan, sampler=plan.sampler.with_pass(options.epochs, options.drop_last))
        # Steps filled at once: one per reader, and the remote readers' steps in flight.
        fillers = readers + (0 if options.remote is None else options.remote.capacity)
        slots = _slot_count(options.slots, fillers, resources.pool, plan.slot.nbytes)
        cuts = StepCuts(plan.slot, options.batch_size, plan.sampler, _pass_of(plan.sampler, options))
        # The whole first ring of steps must be steps the sampler can compute.
        check_integer("start_step", options.start_step, 0, last_step(plan.sampler, slots, cuts.end_step))
        if options.warn_layout:
            warn_poor_layouts(plan.plans, options.batch_size)
        warn_window_memory(plan.plans, plan.sampler)
        sweep_stale()
        return cls(resources, plan, options, slots, cuts, readers=readers, fillers=fillers, pin_backend=pin_backend,
                   dataset_spec=dataset_spec)

    def __init__(self, resources: Resources, plan, options: LoaderOptions, slots: int, cuts: StepCuts, *,
                 readers: int, fillers: int, pin_backend, dataset_spec=None) -> None:
        pool, slot, start_step = resources.pool, plan.slot, options.start_step
        self.resources, self.pool, self.plan, self.options = resources, pool, plan, options
        self.slot, self.slots, self.cuts, self.dataset_spec = slot, slots, cuts, dataset_spec
        self.fillers, self.step_timeout, self.hold_timeout = fillers, options.step_timeout, options.hold_timeout
        filler = self.filler_spec(plan.sampler)
        # The readers' shared record of checked blocks (none with readers=0: one filler checks).
        checked_specs = checked_blocks.shared_specs(plan.fields) if options.verify and fillers else []
        self.layout = RingLayout(slots, max(1, pool.records), options.batch_size, slot.nbytes, len(slot.regions),
                                 checked_blocks.record_pages(checked_specs))
        ring = self.ring = resources.ring = Ring.create(self.layout, os.getpid(), watched=pool.count > 0)
        checked_blocks.write_record(ring.memory, self.layout.checked_offset, self.layout.checked_pages, checked_specs)
        live_resources.add(resources)
        if pin_backend is not None:
            resources.pinned = PinnedRing(pin_backend, ring.base_address, self.layout.total_bytes)
        views_of = _views_function(slot, ring, self.layout)
        self.local = None
        if fillers == 0:  # readers=0: reader 0 is this process's; Resources closes its filler.
            resources.filler = filler.build()
            self.local = LocalReader(ring, resources.filler, views_of)
        self.supervisor = Supervisor(pool, ring, slots, step_timeout=options.step_timeout,
                                     hold_timeout=options.hold_timeout, on_error=options.on_error,
                                     owner_pid=resources.owner_pid,
                                     skipped=None if self.local is None else self.local.skipped)
        # What limits the loader, from the ring's counters (stats()["bottleneck"], the stall warning).
        disks = _disks(plan)
        # readers="auto": the most it adds up to, the readers its slots feed (the advice's too).
        auto_most = auto_readers_most(pool.count, pool.start_count, slots) if isinstance(pool, ElasticPool) else None
        context = plan_context(plan, dataset_spec is not None, pool.count, auto_most)
        ring.describe_work(*header_words(context))  # For top, which sees only the ring.
        self.meter = self.supervisor.meter = Meter(
            functools.partial(ring_reading, ring, pool.count, resources.node_cache, disks=disks),
            context, zero_reading(time.monotonic_ns(), slots, self.layout.reader_count, disks))
        self.tuner = self.supervisor.tuner = None if auto_most is None else \
            Tuner(pool, functools.partial(ring_reading, ring, pool.count), resources.node_share, most=auto_most)
        if self.tuner is None:
            self.supervisor.node_share = resources.node_share
        self.cursor = cursor_module.Cursor(
            control_table_address=ring.control_table_address,
            slot_count=slots,
            work_semaphore=ring.names.work,
            ready_semaphores=ring.names.ready,
            field_names=tuple(sys.intern(name) for name in slot.names),
            batch_type=batch_type_of(cuts),
            views=tuple(views_of(index) for index in range(slots)),
            next_step=start_step,
            check_every_batches=_READER_CHECK_BATCHES,
            check_every_ns=int(_READER_CHECK_SECONDS * 1e9),
            wake_after_slots=wake_after(slots),
            reader_count=fillers,
            trainer_slots=TRAINER_SLOTS,
            poll_interval_ns=int(POLL_INTERVAL_SECONDS * 1e9),
            wait_ahead_span_ns=int(WAIT_AHEAD_SPAN_SECONDS * 1e9),
            end_step=cuts.end_step,
            partial_from=cuts.partial_from,
            supervise=self.supervisor.supervise,
            views_of=views_of,
            partial=cuts.partial,
        )
        # Batches kept past their slot's turn get memory of their own (kept.py): next() asks
        # through the supervisor, which must not refer to the session (the lifetimes note).
        self.kept = KeptBatches(resources, slot, slots, max(1, slots - TRAINER_SLOTS) if fillers else 1,
                                kept_bytes_max(), self.local)
        self.supervisor.make_room = self.kept.make_room
        self.iterator = self.cursor if self.local is None else LocalIterator(self.cursor, self.local, self.supervisor)
        if options.audit_log is not None:  # Each delivered batch recorded (audit_log.py).
            resources.audit = open_writer(options.audit_log, plan.sampler)
            self.iterator = AuditIterator(self.iterator, resources.audit)
            self.audit_begin(start_step, "start")
        resources.cursor = weakref.ref(self.cursor)
        self.finalizer = weakref.finalize(self.cursor, resources.close)
        self.request_from(start_step)
        pool.configure(ring, ReaderConfig(
            reader_index=0,
            trainer_pid=os.getpid(),
            names=ring.names,
            layout=self.layout,
            filler=filler,
            local_readers=readers,
            **trainer_context(),
        ))
        if readers and _from_store(plan):  # The readers' first steps' pages, asked for while they start.
            fetch_first_steps(filler, start_step, readers)

    def views(self, slot: int):
        """Slot `slot`'s arrays in SlotLayout view order (regions, then the indices)."""
        return self.slot.views(*self.ring.slot_memory(slot))

    def request_from(self, step: int) -> None:
        """Requests the ring's worth of steps from `step` (up to a finite pass's end)."""
        for step_k in range(step, min(step + self.slots, self.cursor.end_step)):
            self.cursor.request(step_k % self.slots, step_k)

    def check_open(self) -> None:
        self.supervisor.raise_if_closed(self.cursor)

    def last_step(self, sampler=None, end_step: int | None = None) -> int:
        """The last step a run may start at (with `sampler` and its pass's `end_step`, by
        default the session's)."""
        sampler = self.cuts.sampler if sampler is None else sampler
        return last_step(sampler, self.slots, self.cuts.end_step if end_step is None else end_step)

    def filler_spec(self, sampler) -> FillerSpec:
        """What every filler of this session is built from, with `sampler`."""
        plan, options = self.plan, self.options
        return FillerSpec(plan.slot, sampler, plan.fields, options.verify, plan.transform,
                          tuple(os.path.abspath(entry) for entry in sys.path) if plan.transform else (),
                          options.on_error, options.epochs, options.drop_last, self.dataset_spec, self.slots)

    def audit_begin(self, step: int, why: str, position: int | None = None) -> None:
        """With audit_log: the deliveries from `step` on are a new segment, which starts at
        stream `position` (a resume's checkpoint position; by default where `step` starts)."""
        if self.resources.audit is not None:
            begin_segment(self.resources.audit, self.cuts.sampler, self.cuts.finite, self.plan.sources, step, why,
                          position)

    def seek(self, step: int, why: str = "a seek", position: int | None = None) -> None:
        """Makes `step` the next batch, checked against the bound: every slot taken back first
        (a reader that failed, or holds its slot past the bound, replaced: settle_readers).
        With audit_log the steps from there are a new segment starting at `position`
        (audit_begin)."""
        self.check_open()
        check_integer("step", step, 0, self.last_step())
        self.cursor.enter()  # Refused inside next() (another thread, a finalizer): it would move the step under it.
        try:
            self.settle_readers(why)
            self.cursor.next_step = step
            self.cuts.resume = None  # A seek names its step knowingly: no resumed position to cut at.
            self.cursor.partial_from = self.cuts.partial_from
            self.request_from(step)
            self.audit_begin(step, why, position)
        finally:
            self.cursor.leave()

    def resume_at(self, resume) -> None:
        """The next step (a resumed checkpoint's) keeps only the rows from resume.position."""
        self.cuts.resume = resume
        self.cursor.partial_from = resume.step

    def settle_readers(self, why: str) -> None:
        """Takes every slot back and leaves healthy readers behind: one that failed is
        replaced (ReaderPool.renew_failed, replace_dead), one that holds its slot past the
        bound too (take_back_all). A new position's first half (seek, the next iter() after
        a step failed or timed out)."""
        self.take_back_all(settle=True, why=why)
        self.pool.renew_failed()
        self.pool.replace_dead()
        # The timed-out step's wait starts again: the replaced reader's time is not the new one's.
        self.supervisor.timed_out, self.supervisor._episode = False, None

    def recover(self) -> None:
        """The next iter() after a step timed out or a reader failed: the step next() was on
        is requested again of healthy readers (a clean ring), as torch's DataLoader starts
        new workers for its next epoch. Nothing else moves: the same step comes next."""
        if not (self.supervisor.timed_out or self.pool.any_failed()):
            return
        self.check_open()
        self.cursor.enter()
        try:
            self.settle_readers("the next iteration after a failed step")
            self.request_from(self.cursor.next_step)
        finally:
            self.cursor.leave()

    def take_back_bound(self) -> float:
        """How long taking the slots back waits for a reader's step before replacing the
        reader: ReaderPool.take_back_seconds, or the step_timeout where that is shorter."""
        bound = self.pool.take_back_seconds
        return bound if self.step_timeout is None else min(bound, self.step_timeout)

    def step_rows(self, step: int):
        """The dataset rows of `step` in the current pass (for a warning)."""
        return self.cuts.sampler.fill(step)

    def take_back_all(self, settle: bool = False, why: str = "a seek") -> None:
        """Takes every slot back from the readers (a seek's first half): a reader that does
        not finish its step within take_back_bound() is killed and replaced, with a warning
        naming `why` (ReaderPool.take_back); raises, changing nothing, where a slot still
        cannot be taken back (`settle`: see ReaderPool.take_back). A batch still held keeps
        its values: once the readers are done, its pages become memory of its own and its
        slot is mapped anew (kept.py); where that cannot be (pin_memory, a fork) or the
        memory so kept would pass its bound, it raises first, naming the batch."""
        cursor, resources = self.cursor, self.resources
        cursor.release_unused()
        held = cursor.held()
        if held and (resources.pinned is not None or resources.held_at_fork & set(held.items())):
            gc.collect()  # Views in reference cycles: one collection to let them go.
            cursor.release_unused()
            held = cursor.held()
        resources.held_at_fork &= set(held.items())  # Forgotten once let go.
        for slot, step in sorted(held.items()):
            self.kept.check_detachable(slot, step)
        if held:
            self.kept.check_room(len(held), cursor.next_step, held)
        # A reader in the middle of a step finishes it first, within the bound; not the hold
        # timeout of a batch a user keeps. Its step belongs to the position being left.
        fill_timeout = self.take_back_bound()
        try:
            for slot in range(self.slots):
                self.pool.take_back(slot, fill_timeout, cursor, settle, why, self.step_rows)  # A held slot: at once.
            for slot, step in sorted(held.items()):
                self.kept.detach(cursor, slot, step)
        except BaseException:
            if not cursor.active:
                raise  # Closed meanwhile: nothing to go on with.
            # Nothing changed, as far as the caller can tell: the slots taken back so far
            # (and those of a reader killed in a replacement that then failed) are requested
            # again for the steps they held, and the loader goes on as before.
            for slot in range(self.slots):
                if self.ring.state(slot)[0] == SlotState.IDLE:
                    old = cursor.next_step + (slot - cursor.next_step) % self.slots
                    if old < cursor.end_step:
                        cursor.request(slot, old)
            raise

    def use(self, sampler, new_pass: bool = False, why: str = "a resume (load_state_dict)") -> None:
        """Fills with `sampler` (and its pass) from now on: a resharded checkpoint's dealing
        (plan/reshard.py), a new pass's seed, or none again; readers take the new filler
        once every slot is taken back (readers/channel.py). The caller seeks next. Raises,
        changing nothing, where a slot cannot be taken back. A `new_pass` does not raise
        what the readers failed in the pass before: those readers are replaced, started
        with the new filler (ReaderPool.renew_failed, then reconfigure)."""
        self.check_open()
        filler = self.filler_spec(sampler)
        self.cursor.enter()
        try:
            self.take_back_all(settle=new_pass, why=why)
            if new_pass:
                self.pool.renew_failed()
            self.cuts.sampler, self.cuts.finite = sampler, _pass_of(sampler, self.options)
            self.cursor.end_step = self.cuts.end_step
            if self.local is not None:  # readers=0: the local reader's filler, bound to the slots anew.
                old, self.resources.filler = self.resources.filler, filler.build()
                self.local.use(self.resources.filler)
                old.close()
            self.pool.reconfigure(filler)
            self.plan = dataclasses.replace(self.plan, sampler=sampler)
        finally:
            self.cursor.leave()

    def new_pass(self, seed: int, why: str = "the start of the next epoch") -> None:
        """Starts this finite pass again under `seed`, at step 0, with the same readers (one
        whose error ended the pass before replaced): the next epoch of an adapter that runs
        one pass per epoch (shmloader.torch.DataLoader). Batches still held keep their
        values (as for seek)."""
        if self.cuts.finite is None:
            raise RuntimeError("a new pass needs a finite loader (epochs=N)")
        data = {key: value for key, value in self.plan.sampler.to_dict().items()
                if key not in ("transition", "start_position")}
        sampler = type(self.plan.sampler).from_dict({**data, "seed": seed})  # options.seed stays the loader's.
        self.use(sampler, new_pass=True, why=why)
        self.seek(0, why)

    def refork(self, why: str = "the start of the next epoch") -> None:
        """Readers forked from the trainer anew, as it is now (ReaderPool.refork), once every
        slot is taken back; the next use() starts them. Raises, changing nothing, where a
        slot cannot be taken back."""
        self.check_open()
        self.cursor.enter()
        try:
            self.take_back_all(settle=True, why=why)
            self.pool.refork()
        finally:
            self.cursor.leave()

    def slot_states(self) -> list[tuple[str, int]]:
        """(state, step) of every slot, as the ring's control table says now (diagnostics)."""
        self.check_open()
        return [(self.ring.state(slot)[0].name, self.ring.step(slot)) for slot in range(self.slots)]

    def close(self) -> None:
        """Stops the cursor, then gives everything back (lifecycle.Resources). Idempotent."""
        if self.cursor.active:
            self.supervisor.warn_if_skipped()  # The one warning, if next() never had a moment to give it.
        self.cursor.deactivate()
        self.finalizer()


class Diagnostics:
    """What a loader's session looks like from outside, for debugging and leak checks:
    `loader.diagnostics`."""

    def __init__(self, session: Session) -> None:
        self._session = session

    @property
    def reader_pids(self) -> list[int]:
        return self._session.pool.pids

    @property
    def remote_actors(self) -> list:
        """The remote readers' live handles (Ray actors, in reader-record order after the
        local readers), [] without remote readers."""
        remote = self._session.pool.remote
        return [] if remote is None else list(remote.actors)

    @property
    def shared_memory_bytes(self) -> int:
        return self._session.layout.total_bytes

    @property
    def ring_name(self) -> str:
        """The POSIX name of the ring's segment (/dev/shm/<name>; its semaphores are named
        after it): what to look for when judging a leak."""
        return self._session.ring.names.segment

    def held_steps(self) -> dict[int, int]:
        """{slot: step} of the slots that batches (or views of them) still hold."""
        return self._session.cursor.held()

    def slot_states(self) -> list[tuple[str, int]]:
        """(state, step) of every slot, as the ring's control table says now."""
        return self._session.slot_states()

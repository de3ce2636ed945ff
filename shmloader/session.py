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

import gc
import os
import sys
import weakref

from .device import PinnedRing
from .fill.filler import FillerSpec
from .lifecycle import Resources, live_resources
from .plan.defaults import TRAINER_SLOTS, wake_after
from .plan.options import LoaderOptions
from .plan.passes import ENDLESS, FinitePass
from .readers.local import LocalIterator, LocalReader
from .readers.reader import ReaderConfig
from .readers.supervision import Supervisor
from .ring.batch import Batch, cursor_module
from .ring.layout import POLL_INTERVAL_SECONDS, RingLayout, SlotState
from .ring.segment import Ring
from .ring.slot_layout import SlotLayout

# The trainer also checks its readers every this many batches when it never has to wait.
_READER_CHECK_BATCHES = 64

# How long a seek waits for a reader to finish the step it is filling, without a step_timeout.
_SEEK_FILL_SECONDS = 60.0


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


def _views_function(slot: SlotLayout, ring: Ring, layout: RingLayout):
    """views_of(slot) -> that slot's arrays in SlotLayout view order, built afresh: the
    cursor's, referring to the ring but to no session."""
    return lambda index: slot.views(ring.memory, layout.slot_offset(index))


class Session:
    """The ring, its readers (`pool`) and the cursor over the ring, for one loader.

    `resources` already holds the started pool; from here on it is closed when the cursor
    goes (or by close()). `fillers`: the steps filled at once (local readers plus the remote
    readers' capacity); 0 fills each step in this process when next() needs it, by the
    local reader (`local`) that the loader's `iterator` drives."""

    def __init__(self, resources: Resources, slot: SlotLayout, slots: int, cuts: StepCuts, filler: FillerSpec,
                 options: LoaderOptions, *, start_step: int, readers: int, fillers: int, pin_backend) -> None:
        pool = resources.pool
        self.resources, self.pool, self.slot, self.slots, self.cuts = resources, pool, slot, slots, cuts
        self.fillers, self.step_timeout, self.hold_timeout = fillers, options.step_timeout, options.hold_timeout
        self.layout = RingLayout(slots, max(1, pool.records), options.batch_size, slot.nbytes, len(slot.regions))
        ring = self.ring = resources.ring = Ring.create(self.layout, os.getpid(), watched=pool.count > 0)
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
        self.cursor = cursor_module.Cursor(
            control_table_address=ring.control_table_address,
            slot_count=slots,
            work_semaphore=ring.names.work,
            ready_semaphores=ring.names.ready,
            field_names=tuple(sys.intern(name) for name in slot.names),
            batch_type=Batch,
            views=tuple(views_of(index) for index in range(slots)),
            next_step=start_step,
            check_every_batches=_READER_CHECK_BATCHES,
            wake_after_slots=wake_after(slots),
            reader_count=fillers,
            trainer_slots=TRAINER_SLOTS,
            poll_interval_ns=int(POLL_INTERVAL_SECONDS * 1e9),
            end_step=cuts.end_step,
            partial_from=cuts.partial_from,
            supervise=self.supervisor.supervise,
            views_of=views_of,
            partial=cuts.partial,
        )
        self.iterator = self.cursor if self.local is None else LocalIterator(self.cursor, self.local, self.supervisor)
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
        ))

    def views(self, slot: int):
        """Slot `slot`'s arrays in SlotLayout view order (regions, then the indices)."""
        return self.slot.views(self.ring.memory, self.layout.slot_offset(slot))

    def request_from(self, step: int) -> None:
        """Requests the ring's worth of steps from `step` (up to a finite pass's end)."""
        for step_k in range(step, min(step + self.slots, self.cursor.end_step)):
            self.cursor.request(step_k % self.slots, step_k)

    def check_open(self) -> None:
        self.supervisor.raise_if_closed(self.cursor)

    def seek(self, step: int) -> None:
        """Makes `step` the next batch (the loader checked it): every slot taken back first."""
        self.cursor.enter()  # Refused inside next() (another thread, a finalizer): it would move the step under it.
        try:
            self.take_back_all()
            self.cursor.next_step = step
            self.cuts.resume = None  # A seek names its step knowingly: no resumed position to cut at.
            self.cursor.partial_from = self.cuts.partial_from
            self.request_from(step)
        finally:
            self.cursor.leave()

    def resume_at(self, resume) -> None:
        """The next step (a resumed checkpoint's) keeps only the rows from resume.position."""
        self.cuts.resume = resume
        self.cursor.partial_from = resume.step

    def take_back_all(self) -> None:
        """Takes every slot back from the readers (a seek's first half): raises, changing
        nothing, while a batch is held or a reader does not finish its step in time."""
        cursor = self.cursor
        cursor.release_unused()
        held = cursor.held()
        if held:  # Views caught in reference cycles: one collection (costly in a large process) to let them go.
            gc.collect()
            cursor.release_unused()
            held = cursor.held()
        if held:
            raise RuntimeError(f"cannot seek while batch {min(held.values())} is held; release every batch first")
        # A reader in the middle of a step finishes it first: as long as a step may take
        # (step_timeout, else a minute), not the hold timeout of a batch a user keeps.
        fill_timeout = self.step_timeout if self.step_timeout is not None else max(self.hold_timeout, _SEEK_FILL_SECONDS)
        taken = []
        try:
            for slot in range(self.slots):
                self.pool.take_back(slot, fill_timeout, cursor)
                taken.append(slot)
        except BaseException:
            if not cursor.active:
                raise  # Closed meanwhile: nothing to go on with.
            # Nothing changed, as far as the caller can tell: the slots taken back so far
            # are requested again for the steps they held, and the loader goes on as before.
            for slot in taken:
                if self.ring.state(slot)[0] == SlotState.IDLE:
                    old = cursor.next_step + (slot - cursor.next_step) % self.slots
                    if old < cursor.end_step:
                        cursor.request(slot, old)
            raise

    def use(self, sampler, finite: FinitePass | None, filler: FillerSpec) -> None:
        """Fills with `sampler` (and its pass, `finite`) from now on: a resharded checkpoint's
        dealing (plan/reshard.py), or none again. Readers build their sampler from their
        configuration, so they are replaced once every slot is taken back (the caller seeks
        next). Raises, changing nothing, while a batch is held."""
        self.check_open()
        self.cursor.enter()
        try:
            self.take_back_all()
            self.cuts.sampler, self.cuts.finite = sampler, finite
            self.cursor.end_step = self.cuts.end_step
            if self.local is not None:  # readers=0: the local reader's filler, bound to the slots anew.
                old, self.resources.filler = self.resources.filler, filler.build()
                self.local.use(self.resources.filler)
                old.close()
            self.pool.reconfigure(filler)
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

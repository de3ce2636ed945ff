"""The step filler: the one place a step's slot is filled, whoever fills it.

fill(step, outputs) writes the step's row indices (and a mixture's source ids) from the
sampler, then every field's regions, or, under a transform, reads the fields into this
process's buffers and runs the transform into the slot. Reader processes (readers/reader.py), the
trainer itself with readers=0 (readers/local.py), and compute_batch / check_determinism
(tools/local_batch.py) all call it, so batch k is the same array whoever computes it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import time

import numpy as np

from .._native import ffi
from ..errors import RemoteError, ShmLoaderError, TransformError
from ..plan.dataset import DatasetSpec
from ..plan.fields import FieldPlan
from ..plan.index_table import TableSampler
from ..plan.options import ON_ERROR
from ..plan.passes import FinitePass
from ..plan.sampler import Sampler
from ..plan.sources import MixtureSampler
from ..ring.publishing import NO_STAGES
from ..ring.slot_layout import SlotLayout
from ..storage.readahead import PENDING_MAX, Advisor, InOrder, ReadAhead, StepAhead, fetch_remote
from ..transforms.core import TransformRunner, TransformSpec
from .field_readers import FieldReader, SlotOutput
from .dataset_runner import DatasetRunner
from .inputs import InputBuffers, field_reader

# StepFiller.stage_ns's entries, in ring.h's order (user_ns, read_ns, fetch_ns).
_USER, _READ, _FETCH = 0, 1, 2
# A batch with more failing records than this fails for another reason than its records.
BAD_RECORDS_MAX = 8
# A skipped record's error text is cut to this many characters: a reader's skip report
# (2 KiB, ring.h) then describes several records, not one long message.
SKIPPED_ERROR_CHARACTERS_MAX = 300


@dataclasses.dataclass(frozen=True)
class SkippedRecord:
    """A record replaced under on_error="skip": its step, batch position, row, source,
    where it is stored, and the error it raised."""

    step: int
    position: int
    row: int
    source: int | None
    where: str
    error: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _roomy(plan: FieldPlan, batch_size: int) -> FieldPlan:
    """`plan` with a packed region that holds batch_size of its longest records."""
    if plan.kind != "packed":
        return plan
    capacity = batch_size * max(part.length_max for part in plan.parts)
    values = dataclasses.replace(plan.regions[0], shape=(capacity,))
    return dataclasses.replace(plan, regions=(values, *plan.regions[1:]), options={**plan.options, "capacity": capacity})


def _roomy_region(region, batch_size: int):
    """A dataset's packed region with room for batch_size samples of max_items each (a
    sample longer than max_items fails on its own, so none needs more)."""
    if region.cut != "packed":
        return region
    return dataclasses.replace(region, shape=(region.shape[0] * batch_size, *region.shape[1:]))


def _naming(error: Exception, text: str) -> Exception:
    """`error` with `text` added: in the message for the package's own errors (their type
    and cause kept), as a note on others."""
    if isinstance(error, ShmLoaderError):
        named = type(error)(f"{error}; {text}")
        named.__cause__ = error.__cause__ if error.__cause__ is not None else error
        return named
    if hasattr(error, "add_note"):
        error.add_note(text)
    return error


def _error_text(error: Exception) -> str:
    """A skipped record's error: the user's own exception where a transform raised it (the
    record, step and rows are the SkippedRecord's other fields), cut to a bound."""
    if isinstance(error, TransformError) and error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}"[:SKIPPED_ERROR_CHARACTERS_MAX]


@dataclasses.dataclass(frozen=True)
class FillerSpec:
    """What a step filler is built from, as data: a reader process gets it in its
    ReaderConfig (JSON on stdin), a Ray actor as its constructor's argument, and the
    trainer builds its own (readers=0) from it, so every filler of a loader is the same."""

    slot: SlotLayout
    sampler: Sampler | MixtureSampler
    fields: tuple[FieldPlan, ...]
    verify: bool = True
    transform: TransformSpec | None = None
    sys_path: tuple[str, ...] = ()  # The trainer's, where a transform is imported from.
    on_error: str = "raise"
    # The loader's finite pass (None: endless): its last step is computed whole but
    # delivered cut, and a record past the cut is no record of the pass (see _recover).
    epochs: int | None = None
    drop_last: bool = False
    dataset: DatasetSpec | None = None  # A map-style dataset as the source, instead of fields.
    # The ring's slots: the steps requested at one time lie within so many of each other (an
    # IterableDataset's reader keeps the batches it made ahead only within them: DatasetRunner).
    ring_slots: int = 0

    def build(self, read_ahead: bool = True, share: tuple[int, int] = (0, 1)) -> StepFiller:
        """The filler; a transform's module is looked for on the trainer's sys.path too.
        `share`: (reader index, readers on this machine), see ReadAhead."""
        if self.transform is not None:
            sys.path.extend(entry for entry in self.sys_path if entry not in sys.path)
        finite = None if self.epochs is None else FinitePass.of(self.sampler, self.epochs, self.drop_last)
        dataset = None if self.dataset is None else DatasetRunner(self.dataset, self.slot.batch_size, self.sampler,
                                                                  share, self.ring_slots)
        return StepFiller(self.fields, self.slot, self.sampler, self.transform, self.verify, read_ahead, self.on_error,
                          share, finite, dataset)

    def to_dict(self) -> dict:
        return {
            "slot": self.slot.to_dict(),
            "sampler": self.sampler.to_dict(),
            "fields": [plan.to_dict() for plan in self.fields],
            "verify": self.verify,
            "transform": None if self.transform is None else self.transform.to_dict(),
            "sys_path": list(self.sys_path),
            "on_error": self.on_error,
            "epochs": self.epochs,
            "drop_last": self.drop_last,
            "dataset": None if self.dataset is None else self.dataset.to_dict(),
            "ring_slots": self.ring_slots,
        }

    @classmethod
    def from_dict(cls, data: dict) -> FillerSpec:
        sampler = data["sampler"]
        return cls(
            slot=SlotLayout.from_dict(data["slot"]),
            sampler=_sampler_of(sampler),
            fields=tuple(FieldPlan.from_dict(plan) for plan in data["fields"]),
            verify=bool(data["verify"]),
            transform=None if data["transform"] is None else TransformSpec.from_dict(data["transform"]),
            sys_path=tuple(data["sys_path"]),
            on_error=data["on_error"],
            epochs=data["epochs"],
            drop_last=bool(data["drop_last"]),
            dataset=None if data.get("dataset") is None else DatasetSpec.from_dict(data["dataset"]),
            ring_slots=int(data.get("ring_slots", 0)),
        )


def _sampler_of(data: dict):
    """The sampler `data` (a sampler's to_dict()) describes."""
    kind = data.get("kind")
    if kind == "mixture":
        return MixtureSampler.from_dict(data)
    return TableSampler.from_dict(data) if kind == "index_table" else Sampler.from_dict(data)


class _NoInputs:
    """A dataset's filler reads no fields: its runner gets no inputs."""

    readers: list = []

    def fill(self, step: int, indices, index_pointer, sources) -> dict:
        return {}

    def close(self) -> None:
        pass


class SlotOutputs:
    """One slot's arrays as the filler writes them, with their native pointers: built once
    per slot (StepFiller.bind), so that a step costs no cffi call to find its memory."""

    __slots__ = ("indices", "index_pointer", "sources", "source_pointer", "fields", "out")

    def __init__(self, indices: np.ndarray, sources: np.ndarray | None, fields: list, out: dict) -> None:
        self.indices, self.index_pointer = indices, ffi.from_buffer("uint64_t[]", indices)
        self.sources = sources
        self.source_pointer = None if sources is None else ffi.from_buffer("uint32_t[]", sources)
        self.fields, self.out = fields, out  # Per field its SlotOutputs (no transform); else the transform's arrays.


class StepFiller:
    """Fills steps of one plan: its fields' readers (or the transform's runner and input
    buffers), the sampler, and the block-local shuffle's read-ahead where the sampler has
    windows (read_ahead=False for a one-off computation). `finite`: the loader's finite
    pass, whose cut steps deliver only their first rows (None: every step delivers all)."""

    def __init__(self, fields: tuple[FieldPlan, ...], slot: SlotLayout, sampler, transform: TransformSpec | None,
                 verify: bool, read_ahead: bool = True, on_error: str = "raise",
                 share: tuple[int, int] = (0, 1), finite: FinitePass | None = None, dataset=None,
                 roomy: bool = False) -> None:
        assert on_error in ON_ERROR, on_error  # Checked by options.LoaderOptions.
        self.slot, self.sampler, self.transform, self.on_error = slot, sampler, transform, on_error
        self.finite = finite
        self._step_max = sampler.step_max  # The last step the sampler computes (asserted per fill).
        # Every record of a delivered row replaced so far, once each, in the order filled.
        self.skipped: list[SkippedRecord] = []
        # Time by stage, summed over fills: (the user's code, reading fields, waiting for a
        # store's pages) in ns, which a publisher writes to its reader record (ring.h) and
        # stats()["bottleneck"] reads. Two clock reads per stage and fill: nothing per row.
        # A fill of local fields alone is all reading: it keeps none (NO_STAGES, set below),
        # and its busy time is its read time (readers/bottleneck.py).
        self.stage_ns = [0, 0, 0]
        self.verify = verify
        # close() from another thread during a fill (readers=0: the trainer fills while a
        # thread closes the loader) waits for the fill to end: the native gathers read the
        # fields' mappings without the GIL. The filling thread releases them then.
        self._filling = self._close_requested = self._released = False
        self._release_lock = threading.Lock()
        self._probe = self._probe_outputs = None  # a filler with room to spare, for finding bad records
        self.plans = tuple(fields)
        batch = slot.batch_size
        self.mixture = sampler.has_sources
        if self.mixture != slot.mixture:
            raise ValueError("a mixture's sampler needs a slot with a source region, and only it")
        self.fields, self.runner, self.inputs, self.dataset = [], None, None, dataset
        if dataset is not None:  # dataset[index] for each row, straight into the slot (fill/dataset_runner.py).
            self.runner, self.inputs = dataset, _NoInputs()
            expected = list(dataset.spec.regions(batch))
            if roomy:  # The probe for bad records (_fails).
                expected = [_roomy_region(region, batch) for region in expected]
        elif transform is None:
            self.fields = [field_reader(plan, batch, verify, sampler) for plan in self.plans]
            expected = [region for plan in self.plans for region in plan.regions]
        else:  # The fields fill this process's own buffers; the transform fills the slot.
            self.runner = TransformRunner(transform, batch, sampler)
            self.inputs = InputBuffers(self.plans, batch, verify, sampler)
            expected = list(transform.regions(batch))
        found = list(slot.regions[:-1] if self.mixture else slot.regions)
        if found != expected:
            raise ValueError(f"the slot's regions {[r.name for r in found]} are not the plan's {[r.name for r in expected]}")
        # The block-local shuffle reads windows ahead: one ReadAhead, or one per source of a
        # mixture, all through one advisor thread.
        views = sampler.window_views() if read_ahead else []
        stored_bytes = sum(plan.stored_bytes for plan in self.plans)
        self.remote = any(reader.remote for reader in self.field_readers)
        if read_ahead and not views and self.plans and not self.remote and _in_order(sampler):
            # Rows in order get the same read-ahead in blocks of steps (a store's own read-ahead,
            # StepAhead, fetches the next steps' pages).
            views = [InOrder(sampler, stored_bytes)]
        self.advisor = Advisor(PENDING_MAX * len(views)) if views else None
        self.read_ahead = [ReadAhead(view, self.field_readers, stored_bytes, getattr(view, "source", 0), self.advisor,
                                     share) for view in views]
        # Fields from a store: each fill pins its pages (fetching what is missing), and
        # without windows to read ahead, the next steps' pages are fetched ahead of them.
        for reader in self.field_readers:  # Whether all the data fits the node cache decides what a fill fetches.
            reader.stored_total = stored_bytes
        self.step_ahead = StepAhead(self, share[1]) if self.remote and read_ahead and not views else None
        if self.runner is None and not self.remote:
            self.stage_ns = NO_STAGES

    @property
    def field_readers(self) -> list[FieldReader]:
        return self.fields or self.inputs.readers

    @functools.cached_property
    def _watching(self) -> list[FieldReader]:
        return [reader for reader in self.field_readers if reader.watch]

    def bind(self, views: tuple[np.ndarray, ...]) -> SlotOutputs:
        """The outputs over one slot's arrays, in SlotLayout view order (regions, indices)."""
        regions, indices = SlotLayout.split_views(views)
        sources = regions[-1] if self.mixture else None
        if self.mixture:
            regions = regions[:-1]
        if self.runner is not None:
            return SlotOutputs(indices, sources, [], dict(zip(self.runner.shapes, regions)))
        per_field, first = [], 0
        for plan in self.plans:
            per_field.append([SlotOutput(array) for array in regions[first:first + len(plan.regions)]])
            first += len(plan.regions)
        return SlotOutputs(indices, sources, per_field, {})

    def fill(self, step: int, outputs: SlotOutputs, salt: int = 0) -> None:
        """Fills `outputs` with step `step` (`salt` reseeds the global generators differently:
        check_determinism's second run). A batch that fails is searched for the records
        that fail it; on_error="skip" replaces them, "raise" names them in the error."""
        self._filling = True  # Before the close flag is read (close() writes it, then reads this).
        try:
            if self._close_requested:
                raise RuntimeError("the loader is closed")
            self._fill(step, outputs, salt)
        finally:
            self._filling = False
            if self._close_requested:
                self._release()

    def _fill(self, step: int, outputs: SlotOutputs, salt: int) -> None:
        assert 0 <= step <= self._step_max, step
        assert outputs.index_pointer is not None and (outputs.source_pointer is not None) == self.mixture, outputs
        for ahead in self.read_ahead:
            ahead.note(step)
        if self.step_ahead is not None:
            started = time.perf_counter_ns()
            self.step_ahead.note(step)  # Asking for the next steps' pages: the store's part of the fill.
            self.stage_ns[_FETCH] += time.perf_counter_ns() - started
        if self.mixture:
            self.sampler.fill_unchecked(step, outputs.index_pointer, outputs.source_pointer)
        else:
            self.sampler.fill_unchecked(step, outputs.index_pointer)
        try:
            self._fill_rows(step, outputs, salt)
        except RemoteError:
            raise  # A store that refuses or an object that changed: no record of the batch is at fault.
        except Exception as error:
            self.check_files()  # A file written meanwhile is the cause, not the batch's records.
            if getattr(self.runner, "collates", False):
                raise  # One collate_fn call made the batch: no record of it fails on its own.
            self._recover(step, outputs, salt, error)
        self.check_files()  # After the rows: what they were read from is still the described files.

    def check_files(self) -> None:
        """Raises StorageError when a watched field file was written in place since it was
        described (FieldReader.check_unchanged): a fill followed by this check read only the
        described bytes. Before a fill, it also keeps a file cut short meanwhile from being
        read (a SIGBUS, where the trainer fills with readers=0)."""
        for reader in self._watching:
            reader.check_unchanged()

    def _fill_rows(self, step: int, outputs: SlotOutputs, salt: int = 0) -> None:
        """Fills the regions from the rows already in outputs.indices (and sources); from a
        store, with the pages they read kept in the node cache while they are read: read
        unpinned where they are all there (CachedObject.pin), and read again, pinned, where
        an eviction may have taken some meanwhile (what it read then, and any error that
        raised, is not the batch's)."""
        if not self.remote:
            self._fill_pinned(step, outputs, salt)
            return
        # From a store, all but the reading and the user's code is the cache's and the
        # store's: pins, fetches, unpins, a read again after an eviction.
        stage_ns, started = self.stage_ns, time.perf_counter_ns()
        others_ns = stage_ns[_USER] + stage_ns[_READ]
        try:
            if not self._fill_cached(step, outputs, salt, unpinned=True):
                self._fill_cached(step, outputs, salt, unpinned=False)
        finally:
            stage_ns[_FETCH] += time.perf_counter_ns() - started - (stage_ns[_USER] + stage_ns[_READ] - others_ns)

    def _fill_cached(self, step: int, outputs: SlotOutputs, salt: int, unpinned: bool) -> bool:
        """One try of _fill_rows from the node cache; False where it read unpinned pages
        that an eviction may have overlapped."""
        cached_objects = []
        try:
            for reader in self.field_readers:
                for field, offsets, sizes in reader.extents(outputs.indices, outputs.sources):
                    cached_objects.append(field.remote)
                    field.remote.pin(offsets, sizes, field.unit_pages, unpinned=unpinned)
            self._fill_pinned(step, outputs, salt)
        except Exception:
            if _unpin(cached_objects) or not unpinned:
                raise
            return False  # An error from bytes an eviction overlapped: read again, pinned.
        except BaseException:
            _unpin(cached_objects)
            raise
        return _unpin(cached_objects)

    def _fill_pinned(self, step: int, outputs: SlotOutputs, salt: int = 0) -> None:
        indices, sources = outputs.indices, outputs.sources
        stage_ns = self.stage_ns
        if stage_ns is NO_STAGES:
            for field, field_outputs in zip(self.fields, outputs.fields):
                field.fill(step, indices, outputs.index_pointer, field_outputs, sources)
            return
        started = time.perf_counter_ns()
        if self.runner is None:
            for field, field_outputs in zip(self.fields, outputs.fields):
                field.fill(step, indices, outputs.index_pointer, field_outputs, sources)
            stage_ns[_READ] += time.perf_counter_ns() - started
        else:
            inputs = self.inputs.fill(step, indices, outputs.index_pointer, sources)
            read = time.perf_counter_ns()
            stage_ns[_READ] += read - started
            if self.dataset is not None:  # __getitem__ once per delivered sample: not for the rows a cut step drops.
                indices = indices[:self.delivered_rows(step)]
            self.runner.run(step, indices, sources, inputs, outputs.out, salt)
            stage_ns[_USER] += time.perf_counter_ns() - read

    # Bad records.

    def _fails(self, step: int, rows: np.ndarray, sources, positions: list[int]) -> Exception | None:
        """What a batch made of the records at `positions` alone (repeated to fill it)
        raises, or None: the probe of the search for bad records, in scratch arrays."""
        if self._probe is None:
            # Records repeated to fill a probe can hold more elements than the batch's
            # packed regions are sized for: the probe's regions hold every row at its longest.
            plans = tuple(_roomy(plan, self.slot.batch_size) for plan in self.plans)
            if self.dataset is not None:  # A dataset's packed outputs: batch_size samples at their longest.
                regions = [_roomy_region(region, self.slot.batch_size) for region in self.slot.regions]
                slot = SlotLayout.of(self.slot.batch_size, regions, self.mixture)
            elif self.runner is not None:
                slot = self.slot
            else:
                slot = SlotLayout.of(self.slot.batch_size, [region for plan in plans for region in plan.regions],
                                     self.mixture)
            self._probe = StepFiller(plans, slot, self.sampler, self.transform, self.verify, read_ahead=False,
                                     dataset=self.dataset, roomy=True)
            self._probe_outputs = self._probe.bind(slot.allocate())
        probe, take = self._probe_outputs, np.resize(np.asarray(positions), len(rows))
        probe.indices[:] = rows[take]
        if sources is not None:
            probe.sources[:] = sources[take]
        try:
            self._probe._fill_rows(step, probe)
        except Exception as error:
            return error
        return None

    def _bad_positions(self, step: int, rows: np.ndarray, sources, positions: list[int]) -> dict[int, Exception] | None:
        """The positions whose records fail on their own, each with the error it raises
        alone, by halving: about 2 log2(B) probes per bad record, deterministic (it depends
        only on the batch's records). None when more than BAD_RECORDS_MAX fail: then the
        failure is not the records' (a file replaced, a transform that fails on every
        batch) and the search stops early."""
        if len(positions) == 1:
            error = self._fails(step, rows, sources, positions)
            return {} if error is None else {positions[0]: error}
        half = len(positions) // 2
        found = {}
        for part in (positions[:half], positions[half:]):
            if self._fails(step, rows, sources, part) is not None:
                more = self._bad_positions(step, rows, sources, part)
                if more is None or len(found) + len(more) > BAD_RECORDS_MAX:
                    return None
                found.update(more)
        return found

    def delivered_rows(self, step: int) -> int:
        """How many of step `step`'s rows reach the trainer: all, but for a finite pass's
        cut steps, whose rows past these are computed (the batch has a fixed size) and
        never delivered."""
        return self.slot.batch_size if self.finite is None else self.finite.rows(step)

    def _good_record_near(self, step: int) -> tuple[int, int | None] | None:
        """(row, source) of a record that reads on its own, from the steps before `step`
        (nearest first; then those after it), at most BAD_RECORDS_MAX distinct records
        tried; None if none does. Deterministic: it depends only on the step and the records."""
        rows = np.empty(self.slot.batch_size, dtype=np.uint64)
        sources = np.empty(self.slot.batch_size, dtype=np.uint32) if self.mixture else None
        pointers = (ffi.from_buffer("uint64_t[]", rows),) + \
            (() if sources is None else (ffi.from_buffer("uint32_t[]", sources),))
        others = [*range(step - 1, max(-1, step - 1 - BAD_RECORDS_MAX), -1)]
        others += range(step + 1, step + 1 + BAD_RECORDS_MAX - len(others))
        tried = set()
        for other in others:
            self.sampler.fill_unchecked(other, *pointers)
            for position in range(len(rows)):
                record = (int(rows[position]), None if sources is None else int(sources[position]))
                if record in tried:
                    continue
                if len(tried) == BAD_RECORDS_MAX:
                    return None
                tried.add(record)
                if self._fails(step, rows, sources, [position]) is None:
                    return record
        return None

    def _recover(self, step: int, outputs: SlotOutputs, salt: int, error: Exception) -> None:
        rows = outputs.indices.copy()
        sources = None if outputs.sources is None else outputs.sources.copy()
        # The search runs over distinct records: a cut step's computed rows repeat its
        # delivered ones, and a record repeated is one bad record, not many.
        records = list(zip(rows.tolist(), [0] * len(rows) if sources is None else sources.tolist()))
        first = {}
        for position, record in enumerate(records):
            first.setdefault(record, position)
        found = self._bad_positions(step, rows, sources, list(first.values())) or {}
        bad = {i: found[first[record]] for i, record in enumerate(records) if first[record] in found}
        if not bad:
            raise error
        nearby = None
        if len(bad) == len(rows):
            # No good record in the batch: a short batch, or a cut last step whose computed
            # rows repeat its delivered ones. One from the steps beside it replaces them,
            # unless those fail too: then the step fails whatever its records are.
            nearby = self._good_record_near(step)
            if nearby is None:
                what = "the dataset" if self.dataset is not None else \
                    "the transform" if self.runner is not None else "reading its fields"
                raise _naming(error, f"every record of step {step}'s batch fails on its own ({len(rows)} of "
                                     f"{len(rows)}), and so do the records of the steps beside it: {what} "
                                     f"fails on every record, not on a few bad ones, so on_error='skip' cannot "
                                     f"replace them")
        # A bad record past the delivered rows is no record of the pass: it is replaced
        # (so that the delivered rows can be computed), never reported nor counted.
        delivered = self.delivered_rows(step)
        skipped = [SkippedRecord(step, i, int(rows[i]), None if sources is None else int(sources[i]),
                                 self.describe(int(rows[i]), 0 if sources is None else int(sources[i])),
                                 _error_text(bad[i])) for i in sorted(bad) if i < delivered]
        if self.on_error == "raise" and skipped:
            named = [record.where for record in skipped]
            raise _naming(error, f"the batch fails on record(s) {', '.join(named[:4])}"
                                 f"{' and more' if len(named) > 4 else ''} (on_error='skip' replaces them)")
        # Each bad record is replaced by the next good one of its delivered rows
        # (cyclically; of the whole batch where every delivered row is bad; the record
        # found beside the step where every row is bad): the same whatever the reader count,
        # and on resume.
        good = [i for i in range(len(rows)) if i not in bad]
        candidates = [i for i in good if i < delivered] or good
        for i in sorted(bad):
            if nearby is not None:
                outputs.indices[i], source = nearby
            else:
                j = next((k for k in candidates if k > i), candidates[0])
                outputs.indices[i], source = rows[j], None if sources is None else sources[j]
            if sources is not None:
                outputs.sources[i] = source
        self._fill_rows(step, outputs, salt)
        # Counted once the step is filled: a fill that fails after all (and is tried again,
        # as readers=0 does on the next next()) counts its records once.
        self.skipped += skipped

    def describe(self, row: int, source: int = 0) -> str:
        """Where record `row` (of `source`) is stored, with its original file where the
        converter kept one (readers' error messages name it)."""
        if self.dataset is not None:
            return f"dataset[{row}]"
        return self.field_readers[0].describe_row(row, source)

    def close(self) -> None:
        """Releases the fields, at once or, while a fill runs in another thread, when it ends."""
        self._close_requested = True
        if not self._filling:
            self._release()

    def _release(self) -> None:
        with self._release_lock:  # Both threads may come here; one releases.
            if self._released:
                return
            self._released = True
        if self._probe is not None:
            self._probe.close()
            self._probe = self._probe_outputs = None
        self.read_ahead = []
        if self.step_ahead is not None:
            self.step_ahead.close()
            self.step_ahead = None
        if self.advisor is not None:
            self.advisor.close()
            self.advisor = None
        for field in self.fields:
            field.close()
        if self.inputs is not None:
            self.inputs.close()


def fetch_first_steps(spec: FillerSpec, first: int, count: int) -> None:
    """Asks the node cache for the pages of steps first .. first + count - 1 (the readers'
    first steps), from the trainer as its readers start: a store's link otherwise idles
    for the readers' start-up (a fifth of a second where each is a new process), and their
    first fills find the pages claimed and wait for them (the cache's FETCH locks). Only
    fields of fixed-shape rows, through their readers alone (no transform imported, no
    ragged field's offsets read here), and at most IN_FLIGHT requests (prefetch, not
    throttled), which the node cache's threads make at once and a loader's close may
    outlive; nothing is filled or pinned. Errors are left to the readers, which report them."""
    plans = [plan for plan in spec.fields if plan.kind == "rows"]
    if not plans:
        return
    batch, sampler = spec.slot.batch_size, spec.sampler
    readers = []
    try:
        readers = [field_reader(plan, batch, False, sampler) for plan in plans]
        stored = sum(plan.stored_bytes for plan in spec.fields)
        for reader in readers:  # As a filler sets it: whether all the data fits decides the fetch unit.
            reader.stored_total = stored
        indices = np.zeros(batch, dtype=np.uint64)
        sources = np.zeros(batch, dtype=np.uint32) if sampler.has_sources else None
        pointers = [ffi.from_buffer("uint64_t[]", indices)]
        if sources is not None:
            pointers.append(ffi.from_buffer("uint32_t[]", sources))
        ranges = []
        for step in range(first, min(first + count, sampler.step_max + 1)):
            sampler.fill_unchecked(step, *pointers)
            ranges += [extent for reader in readers for extent in reader.extents(indices, sources, False)]
        fetch_remote(ranges, throttled=False)
    except Exception:  # noqa: BLE001 - the readers open the same plan and say what is wrong.
        pass
    finally:
        for reader in readers:
            reader.close()


def _in_order(sampler) -> bool:
    """Whether the sampler reads rows in order (sequential mode), which InOrder reads ahead."""
    return getattr(sampler, "mode", None) == "sequential"


def _unpin(cached_objects: list) -> bool:
    """Unpins every object (one listed twice: the second call does nothing); whether
    what was read from them unpinned held (CachedObject.unpin)."""
    held = True
    for cached in cached_objects:
        held = cached.unpin() and held
    return held

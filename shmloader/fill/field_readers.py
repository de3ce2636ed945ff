"""The readers' side of the field plans: a FieldReader opens a FieldPlan's files and fills
its regions of a slot for one step's rows (the records' readers: record_readers.py; the
reader of each kind, and a transform's input buffers: inputs.py). Files open on first
touch, in the process that fills (a reader, or the trainer with readers=0).
"""

from __future__ import annotations

import os

import numpy as np

from .._native import ffi, lib
from ..plan.fields import FieldPlan, part_name
from ..remote.cache import set_fetch_unit
from ..storage.blosc import CombinedBlosc
from ..storage.opening import open_field
from ..storage.ragged import RaggedField, describe_ragged, is_ragged
from ..storage.rows import check_gather
from ..storage.rows import u64 as _u64
from ..storage.spec import FieldSpec


def original_file(path: str, record: int) -> str | None:
    """The source file of record `record` of a converted field `path` (STEM.image, ...), from
    the STEM.path ragged field of UTF-8 paths that convert-images writes beside it."""
    stem, _ = os.path.splitext(path)
    sibling = stem + ".path"
    if sibling == path or not is_ragged(sibling):
        return None
    try:
        field = RaggedField(describe_ragged(sibling))
        try:
            starts, lengths = field.starts_and_lengths(np.array([record], dtype=np.uint64))
            text = np.zeros(int(lengths[0]), dtype=np.uint8)
            field.values.gather_ranges(starts, lengths, np.zeros(1, dtype=np.uint64),
                                       ffi.from_buffer("uint8_t[]", text), text.nbytes)
        finally:
            field.close()
        return bytes(text).decode("utf-8", errors="replace")
    except Exception:  # Naming the file is a courtesy: never a second error.
        return None


# The most files of one field whose descriptors a filler keeps open to watch them.
WATCHED_FILES_MAX = 64


class SlotOutput:
    """A region of one slot as the reader sees it: an array over the ring and its pointer."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.pointer = ffi.from_buffer("uint8_t[]", array.reshape(-1).view(np.uint8))
        self.nbytes = array.nbytes


class FieldReader:
    """Fills one field's regions of a slot; opened in the process that fills. One subclass
    per kind of field (rows, windows, padded, packed), chosen by field_reader() from the
    plan. Its files (parts) open on first touch: a field of thousands of shards costs
    nothing for those a reader never reads, and a mapped file keeps no descriptor open."""

    def __init__(self, plan: FieldPlan, batch_size: int, verify: bool, sampler) -> None:
        self.plan, self.batch_size, self.sampler, self.verify = plan, batch_size, sampler, verify
        # How the kernel reads ahead of page faults (storage/opening.open_field): ahead of them in
        # sequential order, not at all for rows in random order; the block-local shuffle keeps
        # the read-around: a fault ahead of its read-ahead then reads the block around the row
        # in one go instead of page by page.
        self.access = "sequential" if sampler.mode == "sequential" else "blocks" if sampler.blocks_per_window else \
            "random"
        self.random_access = self.access == "random"
        self._opened: dict[int, object] = {}
        # Read from a store through the node cache: every fill pins its pages first (extents).
        self.remote = any(spec.remote for spec in plan.stored_files())
        self.stored_total = plan.stored_bytes  # The loader's, once StepFiller knows every field.
        # A field of a few local files keeps their descriptors, and every fill asks whether
        # one was written in place since it was described (check_unchanged): the rows read
        # would be other rows. A field of more files is checked when a reader opens them.
        self.watch = not self.remote and len(plan.parts) <= WATCHED_FILES_MAX
        self._watched: list = []
        self.itemsize = np.dtype(plan.regions[0].dtype).itemsize
        self.single = len(plan.parts) == 1
        # Per source: the range of its parts and their first rows, for the row -> part search.
        self._source_parts = {}
        for source in sorted(set(plan.part_sources)):
            members = [k for k, owner in enumerate(plan.part_sources) if owner == source]
            self._source_parts[source] = (members[0], np.asarray([plan.part_starts[k] for k in members], np.uint64))

    def fill(self, step: int, indices: np.ndarray, index_pointer, outputs: list[SlotOutput], sources=None) -> None:
        """Fills the field's regions (`outputs`, in the plan's region order) with the rows
        `indices` of step `step` (`sources`: a mixture's source of each row, else None)."""
        raise NotImplementedError

    def describe_row(self, row: int, source: int = 0) -> str:
        """Where row `row` of `source` is stored: its file and record, and the file it was
        converted from where the converter kept one beside it (convert-images' OUT.path)."""
        first, starts = self._source_parts[source]
        k = int(np.searchsorted(starts, np.uint64(row), side="right")) - 1
        part, local = self.plan.parts[first + k], row - int(starts[k])
        stored = f"{part_name(part)} record {local}"
        original = original_file(part.path, local)
        return f"{original} ({stored})" if original else stored

    def byte_ranges(self, first_row: int, row_count: int, source: int = 0) -> list[tuple]:
        """(opened file, file offset, bytes) of what rows [first_row, first_row + row_count) of
        `source` are stored in: what the block-local shuffle reads ahead (storage/readahead.py).
        Opens the parts it touches; a layout that cannot say (Blosc2 read through the
        Python API) gives nothing."""
        first_part, starts = self._source_parts[source]
        end_row = first_row + row_count
        result = []
        index = int(np.searchsorted(starts, np.uint64(first_row), side="right")) - 1
        while index < len(starts) and first_row < end_row:
            part_start = int(starts[index])
            part_end = int(starts[index + 1]) if index + 1 < len(starts) else end_row
            local, count = first_row - part_start, min(end_row, part_end) - first_row
            field = self.part(first_part + index)
            if self.plan.kind == "windows":  # Row i holds elements [i * length, (i + 1) * length].
                length = self.plan.options["length"]
                local, count = local * length, count * length + 1
            if isinstance(field, RaggedField):
                offsets = field.offsets
                last = min(local + count, len(offsets) - 1)
                field, local, count = field.values, int(offsets[local]), int(offsets[last] - offsets[local])
            ranges = field.byte_ranges(local, count) if hasattr(field, "byte_ranges") else []
            result.extend((field, offset, size) for offset, size in ranges if size > 0)
            first_row, index = min(end_row, part_end), index + 1
        return result

    def extents(self, indices: np.ndarray, sources: np.ndarray | None, wait: bool = True) -> list[tuple]:
        """(opened file, file offsets, bytes) of everything rows `indices` (of `sources`) are
        read from, or more: what a fill from a store pins first (remote/cache.py), and what
        the read-ahead fetches (`wait` False: nothing is fetched to find out)."""
        result = []
        for part, _, local in self.groups(indices, sources):
            field = self.part(part)
            values, starts, counts = self._element_ranges(field, local)
            if values.remote is not None:
                result.append((values, *values.extents(starts, counts, wait)))
        return result

    def _element_ranges(self, field, local: np.ndarray) -> tuple:
        """(stored field, element starts, element counts) that rows `local` of a part read."""
        if isinstance(field, RaggedField):
            starts, lengths = field.starts_and_lengths(local)
            return field.values, starts, lengths
        return field, local, np.ones(len(local), dtype=np.uint64)

    def part(self, index: int):
        field = self._opened.get(index)
        if field is None:
            spec = self.plan.parts[index]
            field = open_field(spec, batch_size_max=self.batch_size, verify=self.verify,
                               access=self.access, watch=self.watch) if isinstance(spec, FieldSpec) \
                else RaggedField(spec, verify=self.verify, access=self.access, watch=self.watch)
            if self.watch:
                self._watched.append(field)
            stored = field.values if isinstance(field, RaggedField) else field
            if stored.remote is not None:
                set_fetch_unit(stored, self.random_access, self.stored_total)
            self._opened[index] = field
        return field

    def groups(self, indices: np.ndarray, sources: np.ndarray | None) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(part, batch positions, rows within the part) for every part this batch reads."""
        if sources is None and self.single:
            return [(0, None, indices)]
        parts = np.empty(len(indices), dtype=np.int64)
        for source, (first, starts) in self._source_parts.items():
            positions = slice(None) if sources is None else np.flatnonzero(sources == source)
            parts[positions] = first + np.searchsorted(starts, indices[positions], side="right") - 1
        order = np.argsort(parts, kind="stable")
        boundaries = np.flatnonzero(np.diff(parts[order])) + 1
        result = []
        for positions in np.split(order, boundaries):
            part = int(parts[positions[0]])
            local = indices[positions] - np.uint64(self.plan.part_starts[part])
            result.append((part, positions.astype(np.uint64), np.ascontiguousarray(local, dtype=np.uint64)))
        return result

    def _records(self, groups, count: int):
        """Every row's (start in its part's values, length, shape, part), in batch order."""
        starts = np.empty(count, dtype=np.uint64)
        lengths = np.empty(count, dtype=np.uint64)
        parts = np.empty(count, dtype=np.int64)
        ndim = self.plan.parts[0].record_ndim
        shapes = np.empty((count, ndim), dtype=np.uint64) if ndim else None
        for part, positions, local in groups:
            where = slice(None) if positions is None else positions
            field = self.part(part)
            starts[where], lengths[where] = field.starts_and_lengths(local)
            parts[where] = part
            if shapes is not None:
                shapes[where] = field.shapes[local]
        return starts, lengths, (shapes if shapes is not None else lengths[:, None]), parts

    def _gather_by_part(self, range_parts, starts, counts, destinations, output: SlotOutput) -> None:
        for part in np.unique(range_parts).tolist():
            mask = range_parts == part
            self.part(part).values.gather_ranges(np.ascontiguousarray(starts[mask]), np.ascontiguousarray(counts[mask]),
                                                 np.ascontiguousarray(destinations[mask]), output.pointer, output.nbytes)

    def check_unchanged(self) -> None:
        """Raises StorageError when a watched file was written since it was described."""
        for field in self._watched:
            field.check_unchanged()

    def close(self) -> None:
        for field in self._opened.values():
            field.close()
        self._opened.clear()
        self._watched.clear()


class RowsReader(FieldReader):
    """Fixed-shape rows: one native gather per file, or per source over many files."""

    def __init__(self, plan: FieldPlan, batch_size: int, verify: bool, sampler) -> None:
        super().__init__(plan, batch_size, verify, sampler)
        self._failure = ffi.new("shm_gather_error *")
        # Rows of many raw files go through one native call per source: every part of the
        # source is mapped at the first batch, and their addresses form its table.
        all_raw = not self.single and all(
            isinstance(part, FieldSpec) and part.kind == "npy" and part.row_bytes > 0 for part in plan.parts)
        self._raw_tables: dict[int, tuple] = {}
        # Rows of many row-friendly .b2nd files of one layout: one joined chunk table per
        # source, checked natively where every file carries block digests (files checked
        # chunk by chunk against CRC-32s go file by file: their checksums are per file).
        checked_natively = not verify or all(isinstance(part, FieldSpec) and part.block_digests for part in plan.parts)
        all_blosc = not self.single and checked_natively and all(
            isinstance(part, FieldSpec) and part.kind == "b2nd" and part.row_contiguous and part.row_bytes > 0
            and (part.chunk_rows, part.block_rows) == (plan.parts[0].chunk_rows, plan.parts[0].block_rows)
            for part in plan.parts)
        self._combined: dict[int, CombinedBlosc] = {}
        self._fill = self._fill_raw_parts if all_raw else self._fill_blosc_parts if all_blosc else self._fill_groups

    def fill(self, step: int, indices: np.ndarray, index_pointer, outputs: list[SlotOutput], sources=None) -> None:
        self._fill(indices, index_pointer, sources, outputs[0])

    def _raw_table(self, source: int) -> tuple:
        table = self._raw_tables.get(source)
        if table is None:
            first, starts = self._source_parts[source]
            addresses = np.array([int(ffi.cast("uintptr_t", self.part(first + k)._table)) for k in range(len(starts))],
                                 dtype=np.uint64)
            # The pointers are made once: they keep their arrays alive with them.
            table = self._raw_tables[source] = (_u64(addresses), _u64(starts), len(starts), self.plan.row_counts[source])
        return table

    def _fill_raw_parts(self, indices: np.ndarray, index_pointer, sources, output: SlotOutput) -> None:
        row_bytes = output.nbytes // self.batch_size
        if sources is None:  # The slot's own indices, in batch order: nothing to convert.
            batches = [(0, indices, index_pointer, ffi.NULL)]
        else:
            batches = []
            for source in np.unique(sources).tolist():
                positions = np.flatnonzero(sources == source).astype(np.uint64)
                wanted = np.ascontiguousarray(indices[positions])
                batches.append((source, wanted, _u64(wanted), _u64(positions * np.uint64(row_bytes))))
        for source, wanted, wanted_pointer, destinations in batches:
            addresses, starts, part_count, rows = self._raw_table(source)
            status = lib.shm_gather_parts_raw(
                addresses, starts, part_count, rows, row_bytes, wanted_pointer, destinations, len(wanted),
                output.pointer, output.nbytes, self._failure,
            )
            check_gather(status, self._failure, f"field {self.plan.name!r}",
                         lambda k: f"row {int(wanted[k])} of source {source} ({rows} rows)", None)

    def _fill_blosc_parts(self, indices: np.ndarray, index_pointer, sources, output: SlotOutput) -> None:
        present = [0] if sources is None else np.unique(sources).tolist()
        for source in present:
            first, starts = self._source_parts[source]
            combined = self._combined.get(source)
            if combined is None:
                parts = [self.part(first + k) for k in range(len(starts))]
                combined = self._combined[source] = CombinedBlosc(parts, self.batch_size)
            positions = None if sources is None else np.flatnonzero(sources == source)
            rows = indices if positions is None else indices[positions]
            parts = np.searchsorted(starts, rows, side="right") - 1
            virtual = combined.virtual_rows(parts, rows - starts[parts])
            if positions is None:
                combined.gather_into(virtual, output.pointer, output.nbytes)
            else:  # A mixture's rows of this source, gathered together, then put in place.
                staged = np.empty((len(positions), *output.array.shape[1:]), dtype=output.array.dtype)
                combined.gather_into(virtual, ffi.from_buffer("uint8_t[]", staged.reshape(-1).view(np.uint8)),
                                          staged.nbytes)
                output.array[positions] = staged

    def _fill_groups(self, indices: np.ndarray, index_pointer, sources, output: SlotOutput) -> None:
        groups = self.groups(indices, sources)
        if len(groups) == 1 and groups[0][1] is None:  # One file, rows in batch order.
            self.part(0).gather_into(indices, index_pointer, output.pointer, output.nbytes)
            return
        row_bytes = output.nbytes // self.batch_size
        ones = np.ones(self.batch_size, dtype=np.uint64)
        for part, positions, local in groups:  # A row is one element of row_bytes: a range of one.
            self.part(part).gather_ranges(local, ones[:len(local)], positions * np.uint64(row_bytes), output.pointer,
                                          output.nbytes)



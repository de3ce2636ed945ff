"""The readers of records longer than a row: windows over a token stream or over documents,
and ragged records padded or packed into the slot (Padded, Packed, Windows)."""

from __future__ import annotations

import math

import numpy as np

from .._native import lib
from ..errors import StorageError
from ..plan.fields import FieldPlan
from ..storage.rows import u64 as _u64
from .field_readers import FieldReader, SlotOutput


def _window_starts(seed: int, step: int, stream: int, count: int, room: np.ndarray) -> np.ndarray:
    """A start in [0, room[i]] for each of `count` rows, a pure function of (seed, step,
    stream, row) computed in Zig (sampler.boundedDraws), the same in every reader."""
    bounds = np.ascontiguousarray(room[:count], dtype=np.uint64)
    out = np.empty(count, dtype=np.uint64)
    lib.shm_bounded_draws(seed, step, stream, _u64(bounds), _u64(out), count)
    return out


class WindowsReader(FieldReader):
    """Rows of length + 1 consecutive elements of a 1-D stream: one range per row."""

    def __init__(self, plan: FieldPlan, batch_size: int, verify: bool, sampler) -> None:
        super().__init__(plan, batch_size, verify, sampler)
        self.length = plan.options["length"]
        self._counts = np.full(batch_size, self.length + 1, dtype=np.uint64)
        self._destinations = np.arange(batch_size, dtype=np.uint64) * np.uint64((self.length + 1) * self.itemsize)

    def _element_ranges(self, field, local: np.ndarray) -> tuple:
        return field, local * np.uint64(self.length), self._counts[:len(local)]

    def fill(self, step: int, indices: np.ndarray, index_pointer, outputs: list[SlotOutput], sources=None) -> None:
        output, length = outputs[0], np.uint64(self.length)
        groups = self.groups(indices, sources)
        if len(groups) == 1 and groups[0][1] is None:
            self.part(0).gather_ranges(indices * length, self._counts, self._destinations, output.pointer, output.nbytes)
            return
        row_bytes = np.uint64(output.nbytes // self.batch_size)
        for part, positions, local in groups:
            self.part(part).gather_ranges(local * length, self._counts[:len(local)], positions * row_bytes,
                                          output.pointer, output.nbytes)


class DocumentWindowsReader(FieldReader):
    """Windows over ragged documents back to back (a separator after each where one is
    given): each row's pieces of documents are gathered in one native call per batch, the
    separators and the segment ids written by numpy."""

    def __init__(self, plan: FieldPlan, batch_size: int, verify: bool, sampler) -> None:
        super().__init__(plan, batch_size, verify, sampler)
        self.length, self.separator = plan.options["length"], plan.options["separator"]
        self._stream_starts = None  # each document's first stream position, once its offsets are read

    def _starts(self) -> np.ndarray:
        if self._stream_starts is None:
            offsets = self.part(0).offsets.astype(np.int64)
            gap = np.arange(len(offsets), dtype=np.int64) if self.separator is not None else 0
            self._stream_starts = offsets + gap  # entry d: where document d starts; the last: the end
        return self._stream_starts

    def fill(self, step: int, indices: np.ndarray, index_pointer, outputs: list[SlotOutput], sources=None) -> None:
        starts_of, offsets = self._starts(), self.part(0).offsets.astype(np.int64)
        width, itemsize = self.length + 1, self.itemsize
        tokens, segments = outputs[0].array, outputs[1].array
        pieces_start, pieces_count, pieces_destination = [], [], []
        separators = []  # (row, column) of each separator
        for row, index in enumerate(indices.tolist()):
            first, end = index * self.length, index * self.length + width
            document = int(np.searchsorted(starts_of, first, side="right")) - 1
            segment_row = segments[row]
            segment_row[:] = 0
            position, segment = first, 0
            while position < end:
                doc_start, doc_values = int(starts_of[document]), int(offsets[document])
                doc_length = int(offsets[document + 1]) - doc_values
                if position >= doc_start + doc_length + (self.separator is not None):
                    document += 1
                    continue
                if position > first and position == doc_start:  # A document begins inside the row.
                    segment += 1
                    segment_row[position - first:] = segment
                inside = position - doc_start
                if inside < doc_length:
                    count = min(doc_length - inside, end - position)
                    pieces_start.append(doc_values + inside)
                    pieces_count.append(count)
                    pieces_destination.append((row * width + position - first) * itemsize)
                    position += count
                else:  # The separator after the document.
                    separators.append((row, position - first))
                    position += 1
        if pieces_start:
            self.part(0).values.gather_ranges(np.asarray(pieces_start, np.uint64), np.asarray(pieces_count, np.uint64),
                                              np.asarray(pieces_destination, np.uint64), outputs[0].pointer,
                                              outputs[0].nbytes)
        if separators:
            rows, columns = np.asarray(separators).T
            tokens[rows, columns] = self.separator

    def _element_ranges(self, field, local: np.ndarray) -> tuple:
        """Each row's documents' values, from the first document it starts in to the last it reaches."""
        starts_of, offsets = self._starts(), field.offsets.astype(np.int64)
        first = local.astype(np.int64) * self.length
        documents = np.searchsorted(starts_of, np.stack([first, first + self.length]), side="right") - 1
        documents = np.minimum(documents, len(offsets) - 2)
        low, high = offsets[documents[0]], offsets[documents[1] + 1]
        return field.values, low, high - low

    def byte_ranges(self, first_row: int, row_count: int, source: int = 0) -> list[tuple]:
        """The stored values under rows [first_row, first_row + row_count) (their documents'
        values, separators aside): what the block-local shuffle reads ahead."""
        field, starts_of = self.part(0), self._starts()
        first = first_row * self.length
        end = (first_row + row_count) * self.length + 1
        documents = np.searchsorted(starts_of, [first, end], side="right") - 1
        offsets = field.offsets
        low = int(offsets[min(int(documents[0]), len(offsets) - 1)])
        high = int(offsets[min(int(documents[1]) + 1, len(offsets) - 1)])
        ranges = field.values.byte_ranges(low, high - low) if hasattr(field.values, "byte_ranges") else []
        return [(field.values, offset, size) for offset, size in ranges if size > 0]


class PaddedReader(FieldReader):
    """Ragged records padded to the maximum shape, with their lengths (or shapes)."""

    def __init__(self, plan: FieldPlan, batch_size: int, verify: bool, sampler) -> None:
        super().__init__(plan, batch_size, verify, sampler)
        # One file of 1-D records, cut at their start or refused: the least work per batch.
        self._simple = self.single and plan.parts[0].record_ndim == 0 and plan.options["overflow"] != "random"
        if self._simple:
            row_bytes = plan.options["max_shape"][0] * self.itemsize
            self._row_destinations = np.arange(batch_size, dtype=np.uint64) * np.uint64(row_bytes)

    def fill(self, step: int, indices: np.ndarray, index_pointer, outputs: list[SlotOutput], sources=None) -> None:
        if self._simple:
            self._fill_padded_simple(step, indices, outputs)
        else:
            self._fill_padded(step, indices, self.groups(indices, sources), outputs)

    def _too_long(self, step: int, indices: np.ndarray, row: int, part: int, found, limit) -> StorageError:
        return StorageError(
            f"field {self.plan.name!r} ({self.plan.parts[part].path}): record {int(indices[row])} (step {step}, "
            f"batch row {row}) has {found}, more than {limit}; raise it, or choose overflow='truncate' or 'random' "
            f"(Padded)"
        )

    def _fill_padded_simple(self, step: int, indices: np.ndarray, outputs: list[SlotOutput]) -> None:
        """One file of 1-D records, cut at their start or refused: each record is one range
        to its row, the least work per batch (the general path below costs more in numpy
        than the gather itself on short records)."""
        field, limit = self.part(0), self.plan.options["max_shape"][0]
        starts, lengths = field.starts_and_lengths(indices)
        if self.plan.options["overflow"] == "error" and int(lengths.max()) > limit:
            row = int(np.argmax(lengths > limit))
            raise self._too_long(step, indices, row, 0, f"{int(lengths[row])} elements", f"max_length={limit}")
        kept = np.minimum(lengths, np.uint64(limit))
        outputs[0].array[...] = self.plan.options["pad"]
        outputs[1].array[...] = kept
        field.values.gather_ranges(starts, kept, self._row_destinations, outputs[0].pointer, outputs[0].nbytes)

    def _fill_padded(self, step: int, indices: np.ndarray, groups, outputs: list[SlotOutput]) -> None:
        starts, lengths, shapes, parts = self._records(groups, len(indices))
        max_shape = np.array(self.plan.options["max_shape"], dtype=np.uint64)
        overflow = self.plan.options["overflow"]
        n_dimensional = self.plan.parts[0].record_ndim > 0
        over = shapes > max_shape
        if overflow == "error" and over.any():
            row = int(np.flatnonzero(over.any(axis=1))[0])
            found = f"shape {tuple(int(x) for x in shapes[row])}" if n_dimensional else f"{int(lengths[row])} elements"
            limit = f"max_length={tuple(int(x) for x in max_shape) if len(max_shape) > 1 else int(max_shape[0])}"
            raise self._too_long(step, indices, row, int(parts[row]), found, limit)
        kept = np.minimum(shapes, max_shape)
        crop = np.zeros_like(shapes)
        if overflow == "random" and over.any():
            for axis in range(shapes.shape[1]):
                room = shapes[:, axis] - kept[:, axis]
                crop[:, axis] = _window_starts(self.sampler.seed, step, self.sampler.shard_index * shapes.shape[1]
                                               + axis, len(indices), room)
        outputs[0].array[...] = self.plan.options["pad"]
        outputs[1].array[...] = kept if n_dimensional else kept[:, 0]
        sources, counts, destinations, rows = self._padded_ranges(starts, shapes, kept, crop, max_shape)
        self._gather_by_part(parts[rows], sources, counts, destinations, outputs[0])

    def _padded_ranges(self, starts, shapes, kept, crop, max_shape):
        """Element ranges of each record's kept part, their byte offsets in the padded
        region and their batch rows: one range per 1-D record, one per line of the last
        axis of an N-D record."""
        itemsize = np.uint64(self.itemsize)
        slot_elements = np.uint64(math.prod(int(x) for x in max_shape))
        rows = np.arange(len(starts), dtype=np.uint64)
        if shapes.shape[1] == 1:
            return starts + crop[:, 0], kept[:, 0], rows * slot_elements * itemsize, rows.astype(np.int64)
        sources, counts, destinations, owners = [], [], [], []
        for row in range(len(starts)):
            shape, keep, offset = shapes[row].astype(np.int64), kept[row].astype(np.int64), crop[row].astype(np.int64)
            lines = np.indices(keep[:-1]).reshape(len(keep) - 1, -1).T  # Every index of the leading axes.
            source_strides = np.cumprod(np.r_[shape[1:], 1][::-1])[::-1]
            target_strides = np.cumprod(np.r_[max_shape[1:].astype(np.int64), 1][::-1])[::-1]
            sources.append(int(starts[row]) + (lines + offset[:-1]) @ source_strides[:-1] + offset[-1])
            destinations.append((row * int(slot_elements) + lines @ target_strides[:-1]) * int(itemsize))
            counts.append(np.full(len(lines), keep[-1]))
            owners.append(np.full(len(lines), row))
        return (np.concatenate(sources).astype(np.uint64), np.concatenate(counts).astype(np.uint64),
                np.concatenate(destinations).astype(np.uint64), np.concatenate(owners).astype(np.int64))


class PackedReader(FieldReader):
    """Ragged records back to back, with their offsets (and shapes)."""

    def fill(self, step: int, indices: np.ndarray, index_pointer, outputs: list[SlotOutput], sources=None) -> None:
        self._fill_packed(step, indices, self.groups(indices, sources), outputs)

    def _fill_packed(self, step: int, indices: np.ndarray, groups, outputs: list[SlotOutput]) -> None:
        starts, lengths, shapes, parts = self._records(groups, len(indices))
        ends = np.cumsum(lengths)  # uint64: checked before it is written as the offsets' dtype.
        capacity = self.plan.options["capacity"]
        if len(ends) and int(ends[-1]) > capacity:
            raise StorageError(
                f"field {self.plan.name!r} ({self.plan.parts[0].path}): step {step}'s {len(indices)} records hold "
                f"{int(ends[-1])} elements, more than the packed region's {capacity} (max_elements); raise "
                f"max_elements or leave it unset (sized for the longest records)"
            )
        offsets = outputs[1].array
        offsets[0] = 0
        offsets[1:] = ends
        if self.plan.parts[0].record_ndim:
            outputs[2].array[...] = shapes
        starts_in_output = np.concatenate([[0], ends[:-1]]).astype(np.uint64) * np.uint64(self.itemsize)
        self._gather_by_part(parts, starts, lengths, starts_in_output, outputs[0])

"""The output spec: which arrays a slot holds, computed once from the fields and their slot
layouts (plain rows, Padded, Packed, Windows), and how a reader fills each of them.

The trainer turns each field into a FieldPlan (plan_field): its source file's description
and the regions it writes, named as they appear in a batch: "tokens", plus auxiliary
arrays such as "tokens.lengths" or "tokens.offsets". Plans cross to readers as small
dicts; a reader opens each one (open_plan) and fills its regions straight in the slot.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from ._native import ffi
from .errors import StorageError
from .ragged import RaggedField, RaggedSpec, describe_ragged, is_ragged, record_lengths
from .storage import FieldSpec, describe_field, open_field

OVERFLOWS = ("error", "truncate", "random")


@dataclasses.dataclass(frozen=True)
class Padded:
    """A ragged field as a padded batch: `name` is (B, max_length) (or (B, *max_shape) for
    N-D records) filled with `pad` past each record, `name.lengths` (B,) uint32 gives each
    record's length (`name.shapes` (B, k) uint32 its shape for N-D records). A record
    longer than the maximum raises (overflow="error"), is cut to its start ("truncate"),
    or to a window at a position that depends only on (seed, step, shard, row) ("random").
    max_length=None sizes it for the longest record."""

    path: str | os.PathLike
    max_length: int | tuple[int, ...] | None = None
    pad: int | float = 0
    overflow: str = "error"


@dataclasses.dataclass(frozen=True)
class Packed:
    """A ragged field packed back to back: `name` is a flat array, `name.offsets` (B+1,)
    uint64 where record i is name[offsets[i]:offsets[i+1]] (the cu_seqlens convention;
    N-D records add `name.shapes`). Sized so that no batch overflows it (the B longest
    records), unless `max_elements` says less; a batch that does not fit then raises,
    naming its step. Elements past offsets[-1] are left as they were."""

    path: str | os.PathLike
    max_elements: int | None = None


@dataclasses.dataclass(frozen=True)
class Windows:
    """A 1-D field (a token stream, .npy or .b2nd) read as rows of `length` + 1 elements:
    row i is stream[i*length : i*length + length + 1], inputs and shifted targets of
    language-model pre-training with no padding."""

    path: str | os.PathLike
    length: int


@dataclasses.dataclass(frozen=True)
class Region:
    """One array of a slot: its name in the batch, its shape per batch and its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: dict) -> Region:
        return cls(data["name"], tuple(data["shape"]), data["dtype"])


@dataclasses.dataclass(frozen=True)
class FieldPlan:
    """One field: its source (a FieldSpec or RaggedSpec), the regions it fills and how."""

    name: str
    kind: str  # "rows", "windows", "padded" or "packed"
    source: FieldSpec | RaggedSpec
    regions: tuple[Region, ...]
    row_count: int
    options: dict

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "source": self.source.to_dict(),
                "regions": [region.to_dict() for region in self.regions], "row_count": self.row_count,
                "options": self.options}

    @classmethod
    def from_dict(cls, data: dict) -> FieldPlan:
        source_type = FieldSpec if data["kind"] in ("rows", "windows") else RaggedSpec
        return cls(data["name"], data["kind"], source_type.from_dict(data["source"]),
                   tuple(Region.from_dict(region) for region in data["regions"]), data["row_count"], data["options"])


def declared_path(declaration) -> str:
    return os.fspath(declaration.path if isinstance(declaration, (Padded, Packed, Windows)) else declaration)


def plan_field(name: str, declaration, batch_size: int) -> FieldPlan:
    """The trainer's side: validates the field's file(s) and lays out its regions."""
    if isinstance(declaration, Windows):
        return _plan_windows(name, declaration, batch_size)
    if isinstance(declaration, (Padded, Packed)):
        spec = describe_ragged(declaration.path)
        if isinstance(declaration, Padded):
            return _plan_padded(name, declaration, spec, batch_size)
        return _plan_packed(name, declaration, spec, batch_size)
    if is_ragged(declaration):
        raise StorageError(
            f"field {name!r}: {os.fspath(declaration)} holds records of every length; declare how they fill a slot: "
            f"Padded(path, max_length=...) or Packed(path)"
        )
    spec = describe_field(declaration)
    region = Region(name, (batch_size, *spec.row_shape), spec.dtype)
    return FieldPlan(name, "rows", spec, (region,), spec.row_count, {})


def _plan_windows(name: str, declaration: Windows, batch_size: int) -> FieldPlan:
    length = declaration.length
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"field {name!r}: Windows length must be a positive integer, got {length!r}")
    spec = describe_field(declaration.path)
    if spec.row_shape != ():
        raise StorageError(f"field {name!r}: Windows needs a 1-D stream, {spec.path} has rows of shape {spec.row_shape}")
    rows = (spec.row_count - 1) // length
    if rows < 1:
        raise StorageError(f"field {name!r}: {spec.path} holds {spec.row_count} elements, fewer than one window of "
                           f"{length} + 1")
    region = Region(name, (batch_size, length + 1), spec.dtype)
    return FieldPlan(name, "windows", spec, (region,), rows, {"length": length})


def _plan_padded(name: str, declaration: Padded, spec: RaggedSpec, batch_size: int) -> FieldPlan:
    if declaration.overflow not in OVERFLOWS:
        raise ValueError(f"field {name!r}: overflow must be one of {OVERFLOWS}, got {declaration.overflow!r}")
    dims = max(spec.record_ndim, 1)
    maximum = declaration.max_length
    if maximum is None:
        maximum = _largest_shape(spec) if spec.record_ndim else spec.length_max
    shape = (maximum,) if isinstance(maximum, int) else tuple(maximum)
    if len(shape) != dims or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in shape):
        raise ValueError(f"field {name!r}: max_length must be {dims} positive integer(s) for {spec.path}'s "
                         f"{dims}-D records, got {maximum!r}")
    try:
        np.array(declaration.pad, dtype=spec.numpy_dtype)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"field {name!r}: pad {declaration.pad!r} is not a {spec.dtype} value") from None
    aux = Region(f"{name}.shapes", (batch_size, dims), "<u4") if spec.record_ndim else \
        Region(f"{name}.lengths", (batch_size,), "<u4")
    regions = (Region(name, (batch_size, *shape), spec.dtype), aux)
    options = {"max_shape": list(shape), "pad": declaration.pad, "overflow": declaration.overflow}
    return FieldPlan(name, "padded", spec, regions, spec.record_count, options)


def _largest_shape(spec: RaggedSpec) -> tuple[int, ...]:
    from .ragged import _read_all

    return tuple(int(x) for x in _read_all(spec.shapes).max(axis=0))


def _plan_packed(name: str, declaration: Packed, spec: RaggedSpec, batch_size: int) -> FieldPlan:
    lengths = record_lengths(spec)
    longest = np.sort(lengths)[-min(batch_size, lengths.size):]
    capacity = int(longest.sum()) + int(lengths.max()) * max(0, batch_size - lengths.size)
    if declaration.max_elements is not None:
        if isinstance(declaration.max_elements, bool) or not isinstance(declaration.max_elements, int) \
                or declaration.max_elements < int(lengths.max()):
            raise ValueError(f"field {name!r}: max_elements must be an integer of at least the longest record "
                             f"({int(lengths.max())}), got {declaration.max_elements!r}")
        capacity = min(capacity, declaration.max_elements)
    regions = [Region(name, (capacity,), spec.dtype), Region(f"{name}.offsets", (batch_size + 1,), "<u8")]
    if spec.record_ndim:
        regions.append(Region(f"{name}.shapes", (batch_size, spec.record_ndim), "<u4"))
    return FieldPlan(name, "packed", spec, tuple(regions), spec.record_count, {"capacity": capacity})


# ---- The reader's side -------------------------------------------------------------------


def _window_starts(seed: int, step: int, shard: int, count: int, room: np.ndarray) -> np.ndarray:
    """A start in [0, room] for each of `count` rows, a pure function of (seed, step, shard,
    row): splitmix64 of a counter, the same in every reader."""
    with np.errstate(over="ignore"):
        key = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(step) * np.uint64(0xBF58476D1CE4E5B9)
               + np.uint64(shard) * np.uint64(0x94D049BB133111EB))
        value = key + np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        value = (value ^ (value >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        value = (value ^ (value >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        value = value ^ (value >> np.uint64(31))
    return value % (room.astype(np.uint64) + np.uint64(1))


class _Output:
    """A region of one slot as the reader sees it: an array over the ring and its pointer."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.pointer = ffi.from_buffer("uint8_t[]", array.reshape(-1).view(np.uint8))
        self.nbytes = array.nbytes


def make_outputs(memory, offset: int, regions: tuple[Region, ...], region_offsets) -> list[_Output]:
    return [_Output(np.ndarray(region.shape, np.dtype(region.dtype), memory, offset + region_offset))
            for region, region_offset in zip(regions, region_offsets)]


class PlanReader:
    """Fills one field's regions of a slot; opened in the reader process."""

    def __init__(self, plan: FieldPlan, batch_size: int, verify: bool, sampler) -> None:
        self.plan, self.batch_size, self.sampler = plan, batch_size, sampler
        if plan.kind in ("rows", "windows"):
            self.field = open_field(plan.source, batch_size_max=batch_size, verify=verify)
        else:
            self.field = RaggedField(plan.source, verify=verify)
        self.itemsize = np.dtype(plan.regions[0].dtype).itemsize
        if plan.kind == "windows":
            length = plan.options["length"]
            self._counts = np.full(batch_size, length + 1, dtype=np.uint64)
            self._destinations = np.arange(batch_size, dtype=np.uint64) * np.uint64((length + 1) * self.itemsize)

    def fill(self, step: int, indices: np.ndarray, index_pointer, outputs: list[_Output]) -> None:
        kind = self.plan.kind
        if kind == "rows":
            self.field.gather_unchecked(indices, index_pointer, outputs[0].pointer, outputs[0].nbytes)
        elif kind == "windows":
            starts = indices * np.uint64(self.plan.options["length"])
            self.field.gather_ranges(starts, self._counts, self._destinations, outputs[0].pointer, outputs[0].nbytes)
        elif kind == "padded":
            self._fill_padded(step, indices, outputs)
        else:
            self._fill_packed(step, indices, outputs)

    def _too_long(self, step: int, indices: np.ndarray, row: int, found, limit) -> StorageError:
        return StorageError(
            f"field {self.plan.name!r} ({self.plan.source.path}): record {int(indices[row])} (step {step}, batch row "
            f"{row}) has {found}, more than {limit}; raise it, or choose overflow='truncate' or 'random' (Padded)"
        )

    def _fill_padded(self, step: int, indices: np.ndarray, outputs: list[_Output]) -> None:
        starts, lengths = self.field.starts_and_lengths(indices)
        max_shape = np.array(self.plan.options["max_shape"], dtype=np.uint64)
        overflow = self.plan.options["overflow"]
        shapes = self.field.shapes[indices] if self.field.shapes is not None else lengths[:, None]
        over = shapes > max_shape
        if overflow == "error" and over.any():
            row = int(np.flatnonzero(over.any(axis=1))[0])
            found = f"shape {tuple(int(x) for x in shapes[row])}" if self.field.shapes is not None else \
                f"{int(lengths[row])} elements"
            limit = f"max_length={tuple(int(x) for x in max_shape) if len(max_shape) > 1 else int(max_shape[0])}"
            raise self._too_long(step, indices, row, found, limit)
        kept = np.minimum(shapes, max_shape)
        crop = np.zeros_like(shapes)
        if overflow == "random" and over.any():
            for axis in range(shapes.shape[1]):
                room = shapes[:, axis] - kept[:, axis]
                crop[:, axis] = _window_starts(self.sampler.seed, step, self.sampler.shard_index * shapes.shape[1]
                                               + axis, len(indices), room)
        outputs[0].array[...] = self.plan.options["pad"]
        outputs[1].array[...] = kept if self.field.shapes is not None else kept[:, 0]
        source, counts, destinations = self._padded_ranges(starts, shapes, kept, crop, max_shape)
        self.field.values.gather_ranges(source, counts, destinations, outputs[0].pointer, outputs[0].nbytes)

    def _padded_ranges(self, starts, shapes, kept, crop, max_shape):
        """Element ranges of each record's kept part and their byte offsets in the padded
        region: one range per record for 1-D records, one per line of the last axis else."""
        itemsize = np.uint64(self.itemsize)
        slot_elements = np.uint64(math.prod(int(x) for x in max_shape))
        rows = np.arange(len(starts), dtype=np.uint64)
        if shapes.shape[1] == 1:
            return starts + crop[:, 0], kept[:, 0], rows * slot_elements * itemsize
        sources, counts, destinations = [], [], []
        for row in range(len(starts)):
            shape, keep, offset = shapes[row].astype(np.int64), kept[row].astype(np.int64), crop[row].astype(np.int64)
            lines = np.indices(keep[:-1]).reshape(len(keep) - 1, -1).T  # Every index of the leading axes.
            source_strides = np.cumprod(np.r_[shape[1:], 1][::-1])[::-1]
            target_strides = np.cumprod(np.r_[max_shape[1:].astype(np.int64), 1][::-1])[::-1]
            sources.append(int(starts[row]) + (lines + offset[:-1]) @ source_strides[:-1] + offset[-1])
            destinations.append((row * int(slot_elements) + lines @ target_strides[:-1]) * int(itemsize))
            counts.append(np.full(len(lines), keep[-1]))
        return (np.concatenate(sources).astype(np.uint64), np.concatenate(counts).astype(np.uint64),
                np.concatenate(destinations).astype(np.uint64))

    def _fill_packed(self, step: int, indices: np.ndarray, outputs: list[_Output]) -> None:
        starts, lengths = self.field.starts_and_lengths(indices)
        offsets = outputs[1].array
        offsets[0] = 0
        np.cumsum(lengths, out=offsets[1:])
        capacity = self.plan.options["capacity"]
        if int(offsets[-1]) > capacity:
            raise StorageError(
                f"field {self.plan.name!r} ({self.plan.source.path}): step {step}'s {len(indices)} records hold "
                f"{int(offsets[-1])} elements, more than the packed region's {capacity} (max_elements); raise "
                f"max_elements or leave it unset (sized for the longest records)"
            )
        if self.field.shapes is not None:
            outputs[2].array[...] = self.field.shapes[indices]
        destinations = offsets[:-1] * np.uint64(self.itemsize)
        self.field.values.gather_ranges(starts, lengths, destinations, outputs[0].pointer, outputs[0].nbytes)

    def close(self) -> None:
        self.field.close()

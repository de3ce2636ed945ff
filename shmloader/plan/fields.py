"""Field declarations and their plans: Padded, Packed and Windows as the user writes them, and
each field's FieldPlan (its files, kind, regions and options), the pure data readers open."""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings

import numpy as np

from ..errors import PerformanceWarning, StorageError
from ..ring.slot_layout import Region
from ..storage.ragged import (
    RaggedSpec,
    describe_ragged,
    is_ragged,
    read_all,
    record_lengths,
)
from ..storage.spec import FieldSpec, describe_field

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
    where record i is name[offsets[i]:offsets[i+1]] (the cu_seqlens convention; N-D records
    add `name.shapes`). `offsets` is their dtype: "int64" (what torch's ops take), or
    "int32" (flash-attention's cu_seqlens; the packed region must then hold under 2**31
    elements). Sized so that no batch overflows it (the B longest records), unless
    `max_elements` says less; a batch that does not fit then raises, naming its step.
    Elements past offsets[-1] are left as they were (a partial batch cuts them off)."""

    path: str | os.PathLike
    max_elements: int | None = None
    offsets: str = "int64"


@dataclasses.dataclass(frozen=True)
class Windows:
    """A 1-D field (a token stream, .npy or .b2nd) read as rows of `length` + 1 elements:
    row i is stream[i*length : i*length + length + 1], inputs and shifted targets of
    language-model pre-training with no padding.

    Over a ragged field of 1-D documents the stream is the documents back to back, each
    followed by `separator` where one is given (an end-of-document token), so that a row
    may span documents; `name.segments` (B, length + 1) int32 numbers the documents inside
    each row from 0 (a separator belongs to the document it ends): what intra-document
    attention masks are built from (Megatron's GPTDataset layout)."""

    path: str | os.PathLike
    length: int
    separator: int | float | None = None


@dataclasses.dataclass(frozen=True)
class FieldPlan:
    """One field: the files it reads (parts, in order: source 0's files, then source 1's,
    ...), the regions it fills and how. A part's rows follow the rows of the parts before
    it in the same source; `row_counts` gives each source's total."""

    name: str
    kind: str  # "rows", "windows", "documents" (Windows over ragged documents), "padded" or "packed"
    parts: tuple[FieldSpec | RaggedSpec, ...]
    part_starts: tuple[int, ...]
    part_sources: tuple[int, ...]
    regions: tuple[Region, ...]
    row_counts: tuple[int, ...]
    options: dict

    @property
    def row_count(self) -> int:
        return self.row_counts[0]

    @property
    def first_part(self) -> FieldSpec | RaggedSpec:
        return self.parts[0]

    @property
    def stored_bytes(self) -> int:
        """The bytes of its files on disk (a ragged field's values; compressed where they are)."""
        return self.source_bytes(None)

    def source_bytes(self, source: int | None) -> int:
        """stored_bytes of one source's files (all with None)."""
        total = 0
        for part, owner in zip(self.parts, self.part_sources):
            if source is None or owner == source:
                spec = part if isinstance(part, FieldSpec) else part.values
                total += spec.compressed_bytes or spec.uncompressed_bytes
        return total

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "parts": [part.to_dict() for part in self.parts],
                "part_starts": list(self.part_starts), "part_sources": list(self.part_sources),
                "regions": [region.to_dict() for region in self.regions], "row_counts": list(self.row_counts),
                "options": self.options}

    @classmethod
    def from_dict(cls, data: dict) -> FieldPlan:
        part_type = FieldSpec if data["kind"] in ("rows", "windows") else RaggedSpec
        return cls(data["name"], data["kind"], tuple(part_type.from_dict(part) for part in data["parts"]),
                   tuple(data["part_starts"]), tuple(data["part_sources"]),
                   tuple(Region.from_dict(region) for region in data["regions"]), tuple(data["row_counts"]),
                   data["options"])

    def stored_files(self) -> list[FieldSpec]:
        """Every file the field reads (a ragged part's values, offsets and shapes)."""
        files = []
        for part in self.parts:
            files.extend([part] if isinstance(part, FieldSpec) else
                         [spec for spec in (part.values, part.offsets, part.shapes) if spec is not None])
        return files

    def describe_files(self) -> list:
        """(path, rows) of every part: what a checkpoint's batches depend on (an object in a
        store by its URL: its copy's path depends on the cache directory)."""
        return [[part_name(part), getattr(part, "row_count", None) or getattr(part, "record_count", None)]
                for part in self.parts]


def part_name(part) -> str:
    """A part's path, or the URL of the object (or ragged prefix) in a store it is a copy of."""
    values = getattr(part, "values", None)
    if values is not None and values.remote:
        return values.remote.rsplit("/", 1)[0]
    return getattr(part, "remote", "") or part.path


def expand_paths(name: str, paths) -> list[str]:
    """A path, a list of paths, or a glob pattern, as a sorted list of absolute paths."""
    if isinstance(paths, (list, tuple)):
        expanded = [os.fspath(path) for path in paths]
    else:
        path = os.fspath(paths)
        if glob.has_magic(path):
            expanded = sorted(glob.glob(path))
            if not expanded:
                raise FileNotFoundError(f"field {name!r}: no file matches {path}")
        else:
            expanded = [path]
    if not expanded:
        raise ValueError(f"field {name!r}: an empty list of files")
    return [os.path.abspath(path) for path in expanded]


def plan_field(name: str, declaration, batch_size: int, ragged_packed: bool = False) -> FieldPlan:
    """The trainer's side, for one source: validates the field's file(s) and lays out its
    regions. With `ragged_packed` (a transform's input), a bare path of ragged records is
    read as Packed."""
    paths = expand_paths(name, declaration.path if isinstance(declaration, (Padded, Packed, Windows)) else declaration)
    if ragged_packed and not isinstance(declaration, (Padded, Packed, Windows)) and is_ragged(paths[0]):
        declaration = Packed(declaration)
    if isinstance(declaration, Windows):
        if len(paths) != 1:
            raise ValueError(f"field {name!r}: Windows reads one stream file, got {len(paths)} files")
        return _plan_windows(name, declaration, paths[0], batch_size)
    if isinstance(declaration, (Padded, Packed)):
        parts = [describe_ragged(path) for path in paths]
        _check_parts_alike(name, parts, lambda part: (part.dtype, part.record_ndim), "dtype and record dimensions")
        counts = [part.record_count for part in parts]
        if isinstance(declaration, Padded):
            return _plan_padded(name, declaration, parts, counts, batch_size)
        return _plan_packed(name, declaration, parts, counts, batch_size)
    for path in paths:
        if is_ragged(path):
            raise StorageError(
                f"field {name!r}: {path} holds records of every length; declare how they fill a slot: "
                f"Padded(path, max_length=...) or Packed(path)"
            )
    parts = [describe_field(path) for path in paths]
    _check_parts_alike(name, parts, lambda part: (part.row_shape, part.dtype), "row shape and dtype")
    counts = [part.row_count for part in parts]
    region = Region(name, (batch_size, *parts[0].row_shape), parts[0].dtype)
    return _plan(name, "rows", parts, counts, (region,), {})


def _plan(name: str, kind: str, parts: list, counts: list[int], regions, options: dict) -> FieldPlan:
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    return FieldPlan(name, kind, tuple(parts), tuple(starts), (0,) * len(parts), tuple(regions), (sum(counts),), options)


def _check_parts_alike(name: str, parts: list, key, what: str) -> None:
    for part in parts[1:]:
        if key(part) != key(parts[0]):
            raise StorageError(f"field {name!r}: {part.path} has {what} {key(part)}, but {parts[0].path} has "
                               f"{key(parts[0])}; every file of a field must match")


def merge_sources(plans: list[FieldPlan]) -> FieldPlan:
    """One field across the sources of a mixture: the same kind, the same arrays (padded
    maxima and packed capacities grow to fit every source)."""
    first = plans[0]
    regions, options = list(first.regions), dict(first.options)
    for index, plan in enumerate(plans[1:], start=1):
        if plan.kind != first.kind or [r.dtype for r in plan.regions] != [r.dtype for r in first.regions]:
            raise StorageError(f"field {first.name!r}: source {index} gives {plan.kind} {plan.regions[0].dtype} "
                               f"records, source 0 gives {first.kind} {first.regions[0].dtype}; sources must match")
        if first.kind == "padded":
            options["max_shape"] = [max(a, b) for a, b in zip(options["max_shape"], plan.options["max_shape"])]
        elif first.kind == "packed":
            options["capacity"] = max(options["capacity"], plan.options["capacity"])
        elif [r.shape for r in plan.regions] != [r.shape for r in first.regions]:
            raise StorageError(f"field {first.name!r}: source {index} has rows of shape {plan.regions[0].shape[1:]}, "
                               f"source 0 {first.regions[0].shape[1:]}; sources must match")
    if first.kind == "padded":
        regions[0] = Region(first.name, (regions[0].shape[0], *options["max_shape"]), regions[0].dtype)
    elif first.kind == "packed":
        regions[0] = Region(first.name, (options["capacity"],), regions[0].dtype, "packed")
    parts = tuple(part for plan in plans for part in plan.parts)
    starts = tuple(start for plan in plans for start in plan.part_starts)
    owners = tuple(index for index, plan in enumerate(plans) for _ in plan.parts)
    return FieldPlan(first.name, first.kind, parts, starts, owners, tuple(regions),
                     tuple(plan.row_count for plan in plans), options)


def _plan_windows(name: str, declaration: Windows, path: str, batch_size: int) -> FieldPlan:
    length = declaration.length
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"field {name!r}: Windows length must be a positive integer, got {length!r}")
    if is_ragged(path):
        return _plan_document_windows(name, declaration, path, batch_size)
    if declaration.separator is not None:
        raise ValueError(f"field {name!r}: a separator goes between documents: give Windows a ragged field of "
                         f"documents, {path} is one stream")
    spec = describe_field(path)
    if spec.row_shape != ():
        raise StorageError(f"field {name!r}: Windows needs a 1-D stream, {spec.path} has rows of shape {spec.row_shape}")
    rows = (spec.row_count - 1) // length
    if rows < 1:
        raise StorageError(f"field {name!r}: {spec.path} holds {spec.row_count} elements, fewer than one window of "
                           f"{length} + 1")
    region = Region(name, (batch_size, length + 1), spec.dtype)
    return _plan(name, "windows", [spec], [rows], (region,), {"length": length})


def _plan_document_windows(name: str, declaration: Windows, path: str, batch_size: int) -> FieldPlan:
    spec = describe_ragged(path)
    if spec.record_ndim:
        raise StorageError(f"field {name!r}: Windows over documents needs 1-D records, {path} holds "
                           f"{spec.record_ndim}-D ones")
    separator = declaration.separator
    if separator is not None:
        try:
            if np.array(separator, dtype=spec.numpy_dtype) != separator:
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"field {name!r}: separator {separator!r} is not a {spec.dtype} value") from None
    stream = spec.values.row_count + (spec.record_count if separator is not None else 0)
    rows = (stream - 1) // declaration.length
    if rows < 1:
        raise StorageError(f"field {name!r}: {path} holds {stream} stream elements, fewer than one window of "
                           f"{declaration.length} + 1")
    regions = (Region(name, (batch_size, declaration.length + 1), spec.dtype),
               Region(f"{name}.segments", (batch_size, declaration.length + 1), "<i4"))
    return _plan(name, "documents", [spec], [rows], regions, {"length": declaration.length, "separator": separator})


def _plan_padded(name: str, declaration: Padded, parts: list[RaggedSpec], counts: list[int],
                 batch_size: int) -> FieldPlan:
    spec = parts[0]
    if declaration.overflow not in OVERFLOWS:
        raise ValueError(f"field {name!r}: overflow must be one of {OVERFLOWS}, got {declaration.overflow!r}")
    dims = max(spec.record_ndim, 1)
    maximum = declaration.max_length
    if maximum is None:
        maximum = tuple(max(values) for values in zip(*(_largest_shape(part) for part in parts))) \
            if spec.record_ndim else max(part.length_max for part in parts)
        if not spec.record_ndim:
            _warn_if_one_record_sizes_the_batch(name, parts, maximum, batch_size)
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
    return _plan(name, "padded", parts, counts, regions, options)


# Padded(max_length=None) warns when the longest record makes a batch's padded array this
# large while it is this many times the 99th percentile's: every slot holds it, in /dev/shm.
_PADDED_WARNING_BYTES = 64 << 20
_PADDED_WARNING_RATIO = 4


def _warn_if_one_record_sizes_the_batch(name: str, parts: list[RaggedSpec], longest: int, batch_size: int) -> None:
    lengths = np.concatenate([record_lengths(part) for part in parts])
    region_bytes = batch_size * longest * np.dtype(parts[0].dtype).itemsize
    typical = int(np.percentile(lengths, 99))
    if region_bytes > _PADDED_WARNING_BYTES and longest > _PADDED_WARNING_RATIO * max(typical, 1):
        record = int(np.argmax(lengths))
        warnings.warn(
            f"field {name!r}: Padded(max_length=None) pads every row to the longest record, record {record} of "
            f"{longest:,} elements: {region_bytes / 2**20:,.0f} MiB per batch in every slot of /dev/shm, while 99% of "
            f"records hold at most {typical:,}. Give max_length (e.g. {typical}) with overflow='truncate' or "
            f"'random', or read the field as Packed.",
            PerformanceWarning, stacklevel=4,
        )


def _largest_shape(spec: RaggedSpec) -> tuple[int, ...]:
    return tuple(int(x) for x in read_all(spec.shapes).max(axis=0))


def records_repeated_max(sampler) -> int:
    """The most times one record can appear in one batch of `sampler`. A shuffle or
    sequential stream is a run of epochs, each holding every row of its epoch once, so a
    batch of B positions meets a row at most once per epoch it spans: ceil(B / epoch) + 1
    times. Draws with replacement (mode "random") and mixtures (whose sources' epochs
    interleave in one batch) may repeat a record up to B times."""
    batch_size = sampler.batch_size
    if sampler.has_sources or sampler.mode == "random":
        return batch_size
    return min(batch_size, -(-batch_size // max(1, sampler.epoch_length)) + 1)


def packed_capacity(lengths: np.ndarray, batch_size: int, repeats: int) -> int:
    """Elements that hold any batch of `batch_size` records, each record at most `repeats`
    times: the longest records, each counted up to `repeats` times, until the batch is full."""
    longest = np.sort(lengths)[::-1][:batch_size].astype(np.int64)
    counted = np.minimum(repeats, np.maximum(0, batch_size - repeats * np.arange(len(longest))))
    return int((longest * counted).sum())


def packed_for_repeats(plan: FieldPlan, batch_size: int, repeats: int) -> FieldPlan:
    """A Packed plan sized for its sampler (see records_repeated_max), unless its
    max_elements fixed the size."""
    if plan.kind != "packed" or plan.options.get("max_elements") is not None or repeats <= 1:
        return plan
    lengths = np.concatenate([record_lengths(part) for part in plan.parts])
    capacity = packed_capacity(lengths, batch_size, repeats)
    if capacity <= plan.options["capacity"]:
        return plan
    if plan.regions[1].dtype == "<i4" and capacity >= 1 << 31:
        raise ValueError(f"field {plan.name!r}: int32 offsets hold under 2**31 elements, but a batch of the "
                         f"{batch_size} longest records (a record may come {repeats} times in one batch) holds "
                         f"{capacity}; give max_elements below 2**31 or use int64 offsets")
    values = dataclasses.replace(plan.regions[0], shape=(capacity,))
    return dataclasses.replace(plan, regions=(values, *plan.regions[1:]), options={**plan.options, "capacity": capacity})


def _plan_packed(name: str, declaration: Packed, parts: list[RaggedSpec], counts: list[int],
                 batch_size: int) -> FieldPlan:
    spec = parts[0]
    lengths = np.concatenate([record_lengths(part) for part in parts])
    capacity = packed_capacity(lengths, batch_size, 1) + int(lengths.max()) * max(0, batch_size - lengths.size)
    if declaration.max_elements is not None:
        if isinstance(declaration.max_elements, bool) or not isinstance(declaration.max_elements, int) \
                or declaration.max_elements < int(lengths.max()):
            raise ValueError(f"field {name!r}: max_elements must be an integer of at least the longest record "
                             f"({int(lengths.max())}), got {declaration.max_elements!r}")
        capacity = min(capacity, declaration.max_elements)
    offsets_dtype = {"int64": "<i8", "int32": "<i4"}.get(declaration.offsets)
    if offsets_dtype is None:
        raise ValueError(f"field {name!r}: Packed offsets must be 'int64' or 'int32', got {declaration.offsets!r}")
    if offsets_dtype == "<i4" and capacity >= 1 << 31:
        raise ValueError(f"field {name!r}: int32 offsets hold under 2**31 elements, but a batch of the {batch_size} "
                         f"longest records holds {capacity}; give max_elements below 2**31 or use int64 offsets")
    regions = [Region(name, (capacity,), spec.dtype, "packed"),
               Region(f"{name}.offsets", (batch_size + 1,), offsets_dtype, "offsets")]
    if spec.record_ndim:
        regions.append(Region(f"{name}.shapes", (batch_size, spec.record_ndim), "<u4"))
    return _plan(name, "packed", parts, counts, regions,
                 {"capacity": capacity, "max_elements": declaration.max_elements})

"""Planning: what a loader's batches are made of, decided once in the trainer, as pure data.

The declarations (Padded, Packed, Windows; Source in sources.py), each field's FieldPlan
(its files, kind, regions and options), the slot's SlotLayout, the sampler and the
transform: plan_loader validates every file and setting and returns them as a LoaderPlan.
Nothing here starts a process or maps the ring; readers receive the plans as dicts, and
fields.py opens them on their side.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import glob
import hashlib
import json
import os
import warnings

import numpy as np

from ..errors import PerformanceWarning, StorageError, user_stacklevel
from ..ring.slot_layout import RESERVED_NAMES, Region, SlotLayout
from ..storage import layout as blosc_layout
from ..storage.ragged import (
    RaggedSpec,
    describe_ragged,
    is_ragged,
    read_all,
    record_lengths,
)
from ..storage.readahead import LOOKAHEAD_BLOCKS, memory_limit_bytes
from ..storage.spec import FieldSpec, describe_field
from .naming import loader_name_problem
from .options import LoaderOptions
from .sampler import Sampler
from .sources import MixtureSampler, Source

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
    if isinstance(sampler, MixtureSampler) or sampler.mode == "random":
        return batch_size
    return min(batch_size, -(-batch_size // max(1, sampler.epoch_length)) + 1)


def packed_capacity(lengths: np.ndarray, batch_size: int, repeats: int) -> int:
    """Elements that hold any batch of `batch_size` records, each record at most `repeats`
    times: the longest records, each counted up to `repeats` times, until the batch is full."""
    longest = np.sort(lengths)[::-1][:batch_size].astype(np.int64)
    counted = np.minimum(repeats, np.maximum(0, batch_size - repeats * np.arange(len(longest))))
    return int((longest * counted).sum())


def _packed_for_repeats(plan: FieldPlan, batch_size: int, repeats: int) -> FieldPlan:
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


def _normalise_fields(fields, label_path) -> list[Source]:
    """The loader's sources: one for a mapping or a path, or the Sources of a mixture."""
    if isinstance(fields, (list, tuple)) and fields and all(isinstance(item, Source) for item in fields):
        if label_path is not None:
            raise TypeError("label_path goes with a single data path, not with a list of Sources")
        sources = [source.checked(index) for index, source in enumerate(fields)]
        return [dataclasses.replace(source, fields=_check_mapping(source.fields, f"source {index}: "))
                for index, source in enumerate(sources)]
    if isinstance(fields, collections.abc.Mapping):
        if label_path is not None:
            raise TypeError("label_path goes with a single data path, not with a mapping of fields")
        mapping = dict(fields)
    elif isinstance(fields, (str, os.PathLike)):
        mapping = {"data": fields}
        if label_path is not None:
            mapping["label"] = label_path
    else:
        raise TypeError(f"fields must be a path, a mapping of field name to path, or a list of Source, got "
                        f"{type(fields).__name__}")
    return [Source(_check_mapping(mapping, ""))]


def _check_mapping(mapping, where: str) -> dict:
    if not mapping:
        raise ValueError(f"{where}fields is empty; give at least one field name -> path")
    for name, declaration in mapping.items():
        problem = loader_name_problem(name)
        if problem is not None:
            raise TypeError(f"{where}field names must be non-empty strings without '.', and not one of "
                            f"{sorted(RESERVED_NAMES)}: {name!r} {problem}")
        if isinstance(declaration, (Padded, Packed, Windows)):
            declaration = declaration.path
        if isinstance(declaration, (list, tuple)):
            declaration = declaration[0] if declaration else None
        if not isinstance(declaration, (str, os.PathLike)):
            raise TypeError(f"{where}field {name!r}: expected a path, a list or glob of paths, or Padded/Packed/"
                            f"Windows of one, got {type(declaration).__name__}")
    return dict(mapping)


def _plan_fields(sources: list[Source], batch_size: int, ragged_packed: bool = False) -> dict[str, FieldPlan]:
    """Describes every field's files and lays out its regions, naming the field (and the
    source) in any error; within a source all fields must have as many rows."""
    per_source = []
    for index, source in enumerate(sources):
        where = f"source {index}: " if len(sources) > 1 else ""
        if per_source and set(source.fields) != set(per_source[0]):
            raise StorageError(f"{where}fields {sorted(source.fields)} differ from source 0's {sorted(per_source[0])}; "
                               f"every source must give the same fields")
        plans = {}
        for name, declaration in source.fields.items():
            try:
                plans[name] = plan_field(name, declaration, batch_size, ragged_packed)
            except FileNotFoundError as error:
                raise FileNotFoundError(f"{where}{_name_field(name, error)}") from None
            except StorageError as error:
                raise StorageError(f"{where}{_name_field(name, error)}") from None
        (first_name, first), *others = plans.items()
        for name, plan in others:
            if plan.row_count != first.row_count:
                raise StorageError(
                    f"{where}fields must have the same number of rows: field {first_name!r} ({first.first_part.path}) "
                    f"has {first.row_count}, field {name!r} ({plan.first_part.path}) has {plan.row_count}"
                )
        per_source.append(plans)
    return {name: merge_sources([plans[name] for plans in per_source]) for name in per_source[0]}


def _name_field(name: str, error: Exception) -> str:
    message = str(error)
    return message if message.startswith(f"field {name!r}") else f"field {name!r}: {message}"


def _sources_description(sources: list[Source], plans: dict[str, FieldPlan]) -> list[dict]:
    """Per source, what its batches depend on (a checkpoint keeps it to refuse other data)."""
    described, files_by_plan = [], [(plan, plan.describe_files()) for plan in plans.values()]
    for index, source in enumerate(sources):
        files = [files[k] for plan, files in files_by_plan for k, owner in enumerate(plan.part_sources)
                 if owner == index]
        digest = hashlib.blake2b(json.dumps(files).encode(), digest_size=8).hexdigest()
        rows = next(iter(plans.values())).row_counts[index]
        described.append({"files": len(files), "files_digest": digest, "rows": rows, "weight": source.weight,
                          "fraction": source.fraction, "fixed": source.fixed})
    return described


@dataclasses.dataclass(frozen=True)
class LoaderPlan:
    """What a loader's batches are made of: its fields' plans, the slot's layout, the
    sampler, the transform (None without one) and a description of the sources (what a
    checkpoint's batches depend on)."""

    plans: dict[str, FieldPlan]
    slot: SlotLayout
    sampler: Sampler | MixtureSampler
    transform: object  # transforms.core.TransformSpec, or None
    sources: list[dict]

    @property
    def mixture(self) -> bool:
        return self.slot.mixture

    @property
    def fields(self) -> tuple[FieldPlan, ...]:
        return tuple(self.plans.values())


# The block-local shuffle reads blocks of about this many bytes per row of all fields: a
# read this long costs many times a random read's latency on a disk or a network volume,
# so the disk streams (a virtual disk measured here read random 16 MiB pieces slower than
# in order, 32 MiB ones as fast: bench/disk_blocks.py), while the label mix of a batch
# depends on the window's rows, not on how many blocks hold them
# (bench/window_randomness.py).
_SHUFFLE_BLOCK_BYTES = 32 << 20


# A window deals at least this many blocks, so that a batch draws its rows from that many
# places of the file even when the window is small.
_WINDOW_BLOCKS_MIN = 8


def shuffle_block_rows(plans: dict[str, FieldPlan], shuffle_window: int, source: int = 0) -> int:
    """Rows per block of the block-local shuffle for `source` (0 unless a mixture's): about
    _SHUFFLE_BLOCK_BYTES of all its fields together, at most a _WINDOW_BLOCKS_MIN-th of the
    window, rounded up to whole chunks of its coarsest Blosc2 field (a chunk is the unit
    that field decompresses, so a block that split one would read it twice)."""
    row_count = next(iter(plans.values())).row_counts[source]
    stored_bytes = sum(plan.source_bytes(source) for plan in plans.values())
    chunk_rows = max([1] + [part.chunk_rows for plan in plans.values() if plan.kind == "rows"
                            for part, owner in zip(plan.parts, plan.part_sources) if owner == source])
    block_rows = max(1, min(_SHUFFLE_BLOCK_BYTES * row_count // max(1, stored_bytes),
                            shuffle_window // _WINDOW_BLOCKS_MIN))
    return min(row_count, -(-block_rows // chunk_rows) * chunk_rows)


def plan_loader(fields, label_path, options: LoaderOptions, spec=None) -> LoaderPlan:
    """Validates the files against the settings (`options`, checked already) and lays out
    the slot: the loader's plan, also used in one process by shmloader.transforms.compute_batch.
    `spec`: options.transform resolved (transforms.core.resolve) by the caller, the plan's
    only view of the transform being what it declares (its regions, and that one is given)."""
    batch_size, mode, seed, shuffle_window = options.batch_size, options.mode, options.seed, options.shuffle_window
    shard_index, shard_count = options.shard_index, options.shard_count
    sources = _normalise_fields(fields, label_path)
    mixture = len(sources) > 1 or isinstance(fields, (list, tuple))
    if mixture and mode != "shuffle":
        raise ValueError(f"a mixture of Sources runs each source's own shuffle epochs: mode must be 'shuffle', "
                         f"got {mode!r}")
    plans = _plan_fields(sources, batch_size, ragged_packed=spec is not None)
    row_counts = next(iter(plans.values())).row_counts
    if mixture:
        block_rows = None if shuffle_window is None else [shuffle_block_rows(plans, shuffle_window, index)
                                                           for index in range(len(sources))]
        sampler = MixtureSampler(list(row_counts), [source.weight for source in sources],
                                 [source.fraction for source in sources], [source.fixed for source in sources],
                                 batch_size, seed, shard_index, shard_count, shuffle_window, block_rows)
    else:
        block_rows = 1 if shuffle_window is None else shuffle_block_rows(plans, shuffle_window)
        sampler = Sampler(row_counts[0], batch_size, mode, seed, shard_index, shard_count, shuffle_window, block_rows)
    repeats = records_repeated_max(sampler)
    plans = {name: _packed_for_repeats(plan, batch_size, repeats) for name, plan in plans.items()}
    if spec is None:
        regions = tuple(region for plan in plans.values() for region in plan.regions)
    else:  # The slot holds the transform's outputs only; its inputs stay in the readers.
        regions = spec.regions(batch_size)
    return LoaderPlan(plans, SlotLayout.of(batch_size, regions, mixture), sampler, spec,
                      _sources_description(sources, plans))


def warn_window_memory(plans: dict[str, FieldPlan], sampler, limit_bytes: int | None = None) -> None:
    """A PerformanceWarning when the block-local shuffle's blocks in memory (a window and the
    blocks read ahead of it, readahead.py) take more than half the memory this process may
    use for the page cache, while the data does not fit in it: the kernel then reclaims
    pages read ahead before they are used, and the disk is read again row by row."""
    views = sampler.window_views()
    if not views:
        return
    limit = memory_limit_bytes() if limit_bytes is None else limit_bytes
    if sum(plan.stored_bytes for plan in plans.values()) <= limit // 2:
        return  # It all stays cached after the first epoch: blocks are never let go.
    needed, ahead, row_bytes = 0, 0, 0.0
    for view in views:
        source = getattr(view, "source", 0)
        source_bytes = sum(plan.source_bytes(source) for plan in plans.values())
        source_row_bytes = source_bytes / max(1, view.length)
        needed += view.block_rows * (view.blocks_per_window + LOOKAHEAD_BLOCKS) * source_row_bytes
        ahead += view.block_rows * LOOKAHEAD_BLOCKS * source_row_bytes
        row_bytes = max(row_bytes, source_row_bytes)
    if needed > limit / 2:
        fits = int((limit / 2 - ahead) / len(views) / max(row_bytes, 1.0))
        smallest = max(view.block_rows for view in views)  # A window holds at least one block.
        advice = (f"A shuffle_window of at most about {fits:,} rows keeps them under half of it." if fits >= smallest
                  else f"The blocks read ahead alone take {ahead / 2**30:.2f} GiB, so no window fits: give the "
                       f"process more memory, or use the global shuffle (no shuffle_window) on data that fits.")
        warnings.warn(
            f"shuffle_window={sampler.shuffle_window:,}: the window and the blocks read ahead of it take about "
            f"{needed / 2**30:.2f} GiB of page cache, more than half of the {limit / 2**30:.2f} GiB this process may "
            f"use (its memory limit or cgroup), and the data is larger: pages read ahead would be reclaimed before "
            f"use. {advice}",
            PerformanceWarning,
            stacklevel=user_stacklevel(),
        )


def warn_poor_layouts(plans: dict[str, FieldPlan]) -> None:
    """A PerformanceWarning per Blosc2 field whose layout makes random rows costly."""
    for name, plan in plans.items():
        spec = plan.first_part
        if plan.kind == "rows" and blosc_layout.poor_layout(spec):
            warnings.warn(
                f"field {name!r} ({spec.name}): its Blosc2 layout (chunks {spec.chunks}, blocks "
                f"{spec.blocks}, {spec.codec}) costs about {blosc_layout.estimate_row_cost_us(spec):.0f} us per "
                f"random row, against about {blosc_layout.row_friendly_cost_us(spec):.0f} us for a row-friendly "
                f"file. Re-lay it out once with: {blosc_layout.convert_command(spec)}",
                PerformanceWarning,
                stacklevel=user_stacklevel(),
            )


# ---- Sizing the ring ----------------------------------------------------------------------


# Environment variables that say how many trainer processes share this node, in order:
# torchrun's, then Slurm's (a launcher that sets neither can set LOCAL_WORLD_SIZE itself).
LOCAL_TRAINERS_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


def local_trainers(environment=os.environ) -> int:
    """How many trainers share this node (1 when no launcher says)."""
    for variable in LOCAL_TRAINERS_VARIABLES:
        value = environment.get(variable, "")
        if not value.strip():
            continue
        text = value.split("(")[0].strip()  # Slurm may write "4(x2)".
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{variable}={value!r}: expected a positive integer (the trainers on this node, as a "
                             f"launcher sets it); fix or unset it, or give readers= explicitly")
        return int(text)
    return 1


def default_readers(environment=os.environ) -> int:
    """The cores this process may use, divided among the node's trainers (each one starts
    its own loader: eight ranks with a reader per core each would run 8x the cores), at
    least one and at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    # A rank pinned to its own cores (affinity already divided) keeps them all.
    share = cores if cores < (os.cpu_count() or cores) else cores // local_trainers(environment)
    return max(1, min(share, 8))


# Slots a trainer's own references may hold at once: the batch in use, and the one a `for`
# loop's variable still holds while next() runs (_cursor.c's readers_ahead counts them too).
TRAINER_SLOTS = 2
# The default ring stays under this many bytes where the readers' share allows (see default_slots).
_DEFAULT_RING_BYTES = 1 << 30


def default_slots(readers: int, slot_bytes: int) -> int:
    """Four slots per reader plus two for the trainer (the batch in use and the one a `for`
    loop's variable still holds while next() runs). A step filled slowly holds the
    trainer while the other readers run ahead: with two per reader they ran out of
    requested slots and slept, with four they stayed busy (bench/protocol.py --slots).
    Fewer where that passes _DEFAULT_RING_BYTES, but never under two per reader. With
    readers=0, one slot beyond the trainer's: the step it fills next."""
    affordable = _DEFAULT_RING_BYTES // max(1, slot_bytes)
    if readers == 0:
        return TRAINER_SLOTS + 1
    return max(2 * readers + TRAINER_SLOTS, min(4 * readers + TRAINER_SLOTS, affordable))


def wake_after(slots: int) -> int:
    """How many slots the trainer hands back before it wakes the readers while they are
    ahead (see release_unused in _cursor.c). Half the ring: they are woken at once whenever
    the batch after the one being delivered is not ready, so deferring costs no waiting."""
    return max(1, slots // 2)

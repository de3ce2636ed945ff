"""Planning: what a loader's batches are made of, decided once in the trainer, as pure data.

The fields' plans (fields.py), the slot's SlotLayout, the sampler and the transform:
plan_loader validates every file and setting and returns them as a LoaderPlan.
Nothing here starts a process or maps the ring; readers receive the plans as dicts, and
fill/field_readers.py opens them on their side.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import os
import warnings

from ..errors import PerformanceWarning, StorageError, user_stacklevel
from ..ring.slot_layout import RESERVED_NAMES, SlotLayout
from ..storage import layout as blosc_layout
from ..storage import layout_advice
from ..storage.readahead import LOOKAHEAD_BLOCKS
from .defaults import memory_limit_bytes
from .fields import (
    FieldPlan,
    Packed,
    Padded,
    Windows,
    merge_sources,
    packed_for_repeats,
    plan_field,
    records_repeated_max,
)
from .index_table import TableSampler
from .naming import loader_name_problem
from .options import LoaderOptions
from .sampler import Sampler
from .sources import MixtureSampler, Source


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
            if not declaration:
                raise ValueError(f"{where}field {name!r}: an empty list of files; expected at least one path")
            declaration = declaration[0]
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
        warn_batch_past_epoch(batch_size, row_counts[0] // shard_count, mode, options.epochs)
    repeats = records_repeated_max(sampler)
    plans = {name: packed_for_repeats(plan, batch_size, repeats) for name, plan in plans.items()}
    if spec is None:
        regions = tuple(region for plan in plans.values() for region in plan.regions)
    else:  # The slot holds the transform's outputs only; its inputs stay in the readers.
        regions = spec.regions(batch_size)
    return LoaderPlan(plans, SlotLayout.of(batch_size, regions, mixture), sampler, spec,
                      _sources_description(sources, plans))


def _data_structure(structure):
    """`structure` as a checkpoint names the data (plan_dataset_loader's digest): without the
    class of a Mapping that is no dict ("named" beside "dict"), which decides only what the
    trainer rebuilds. Samples of a dict subclass (an OrderedDict) were planned as dicts
    before their class was kept, so their checkpoints resume, and a dict and an OrderedDict
    of the same arrays are the same data."""
    if isinstance(structure, list):
        return [_data_structure(item) for item in structure]
    if not isinstance(structure, dict):
        return structure
    mapping_class = "named" if "dict" in structure else None
    return {key: _data_structure(item) for key, item in structure.items() if key != mapping_class}


def plan_dataset_loader(spec, options: LoaderOptions, index_table=None) -> LoaderPlan:
    """The plan of a loader whose source is a map-style dataset (plan/dataset.py): no
    fields, the slot from the samples' outputs, the sampler over len(dataset), or over
    `index_table`'s batches (a caller's own order: plan/index_table.py)."""
    if options.shuffle_window is not None:
        raise ValueError("shuffle_window reads a file's rows in blocks; a dataset's rows come from __getitem__, "
                         "so the global shuffle (no shuffle_window) costs it nothing more: drop shuffle_window")
    if options.transform is not None:
        raise ValueError("a dataset source does its own work in __getitem__: give no transform")
    if index_table is None:
        sampler = Sampler(spec.length, options.batch_size, options.mode, options.seed, options.shard_index,
                          options.shard_count, None, 1)
    else:
        assert index_table.width == options.batch_size, (index_table.width, options.batch_size)
        sampler = TableSampler(index_table, options.seed)
    digest = hashlib.blake2b(json.dumps([spec.name, _data_structure(spec.structure)]).encode(),
                             digest_size=8).hexdigest()
    sources = [{"files": 0, "files_digest": digest, "rows": spec.length, "weight": 1, "fraction": 1.0,
                "fixed": False}]
    return LoaderPlan({}, SlotLayout.of(options.batch_size, spec.regions(options.batch_size), False), sampler, None,
                      sources)


def warn_window_memory(plans: dict[str, FieldPlan], sampler, limit_bytes: int | None = None) -> None:
    """A PerformanceWarning when the block-local shuffle's blocks in memory (a window and the
    blocks read ahead of it, storage/readahead.py) take more than half the memory this process may
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


def warn_batch_past_epoch(batch_size: int, epoch_rows: int, mode: str, epochs: int | None) -> None:
    """A UserWarning where an endless shuffle's batch is larger than an epoch: the batch then
    spans epochs and holds rows twice. Not refused: the stream stays what it is everywhere
    (every row once per epoch), and epochs=N gives one short batch per pass instead."""
    if mode != "shuffle" or epochs is not None or batch_size <= epoch_rows:
        return
    warnings.warn(
        f"batch_size={batch_size:,} is larger than an epoch's {epoch_rows:,} rows (per shard): in the endless shuffle "
        f"stream (epochs=None) each batch spans more than one epoch and holds some rows twice. For one short batch "
        f"per epoch, as PyTorch's DataLoader gives, pass epochs=N; for distinct rows, use batch_size <= {epoch_rows:,}",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def warn_poor_layouts(plans: dict[str, FieldPlan], batch_size: int) -> None:
    """A PerformanceWarning per Blosc2 field that `shmloader convert` would make at least
    1.5x faster: the cost model picks the files worth measuring, and a measurement of a
    sample against convert's layout, in batches of `batch_size`, decides (storage/layout_advice.py)."""
    for name, plan in plans.items():
        spec = plan.first_part
        if plan.kind != "rows" or not blosc_layout.poor_layout(spec):
            continue
        advice = layout_advice.advice_for(spec, batch_size)
        if advice is not None and advice.worth_it:
            warnings.warn(f"field {name!r} ({spec.name}): {advice.message()}", PerformanceWarning,
                          stacklevel=user_stacklevel())



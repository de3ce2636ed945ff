"""What one slot of the ring holds: every array, its name, dtype, shape and byte offset.

SlotLayout is the one owner of a slot's layout. The plan builds it once (plan/planner.plan_loader);
it crosses to readers as data (to_dict); the trainer's batch arrays and the readers'
outputs are both its views(). In a batch (view order) the regions come first (each
field's arrays, or a transform's outputs; then "source" for a mixture) and the step's row
indices last; in memory the indices come first, at offset 0, and every region starts on a
REGION_ALIGNMENT boundary.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

REGION_ALIGNMENT = 64
INDICES = "indices"
SOURCE = "source"
# Names a batch gives its own arrays: no field or transform output may take them.
RESERVED_NAMES = (INDICES, SOURCE)


def align(value: int, alignment: int) -> int:
    """`value` rounded up to a multiple of `alignment` (the ring's offsets use it too)."""
    return (value + alignment - 1) // alignment * alignment


# How a region is cut to the rows of a partial batch (the end of a finite pass): its first
# axis is the batch ("rows"), it holds batch_size + 1 offsets ("offsets"), or it holds a
# Packed field's values, cut where its offsets say the kept rows end ("packed"), or it
# holds the batch as a whole, whatever its rows ("whole": a collate_fn's, plan/collated.py).
CUTS = ("rows", "offsets", "packed", "whole")


@dataclasses.dataclass(frozen=True)
class Region:
    """One array of a slot: its name in the batch, its shape per batch, its dtype and how a
    partial batch cuts it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    cut: str = "rows"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "cut": self.cut}

    @classmethod
    def from_dict(cls, data: dict) -> Region:
        return cls(data["name"], tuple(data["shape"]), data["dtype"], data["cut"])


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """A slot's regions in batch order (the indices excluded: they are implicit, last in
    view order and first in memory)."""

    batch_size: int
    regions: tuple[Region, ...]

    @classmethod
    def of(cls, batch_size: int, regions, mixture: bool) -> SlotLayout:
        """The layout of `regions`, with a mixture's per-row source ids after them."""
        regions = tuple(regions) + ((Region(SOURCE, (batch_size,), "<u4"),) if mixture else ())
        names = [region.name for region in regions]
        if len(set(names)) != len(names) or INDICES in names:
            raise ValueError(f"a slot's regions need distinct names other than {INDICES!r}, got {names}")
        return cls(batch_size, regions)

    @property
    def names(self) -> tuple[str, ...]:
        """The batch's keys, in view order (the indices are Batch.indices, not a key)."""
        return tuple(region.name for region in self.regions)

    @property
    def mixture(self) -> bool:
        return any(region.name == SOURCE for region in self.regions)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Each region's byte offset from the start of the slot."""
        offsets, cursor = [], align(8 * self.batch_size, REGION_ALIGNMENT)
        for region in self.regions:
            offsets.append(cursor)
            cursor = align(cursor + region.nbytes, REGION_ALIGNMENT)
        return tuple(offsets)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes from the slot's start to the end of its last array."""
        if not self.regions:
            return 8 * self.batch_size
        return self.offsets[-1] + self.regions[-1].nbytes

    @property
    def row_bytes(self) -> float:
        """Bytes of the regions per row of a batch (what a batch delivers)."""
        return sum(region.nbytes for region in self.regions) / self.batch_size

    def views(self, memory, base: int) -> tuple[np.ndarray, ...]:
        """The slot at byte `base` of `memory` as arrays in view order: each region, then
        the indices (uint64). Their base is `memory` itself, so numpy makes every view of
        them refer to them (the batch lifetime rule rests on it)."""
        arrays = [np.ndarray(region.shape, np.dtype(region.dtype), memory, base + offset)
                  for region, offset in zip(self.regions, self.offsets)]
        arrays.append(np.ndarray((self.batch_size,), np.uint64, memory, base))
        return tuple(arrays)

    # The view order, known here alone (the C cursor's views tuple and its Batch take it too):
    # each region, then the indices.

    @property
    def view_names(self) -> tuple[str, ...]:
        """The names of the views, in view order."""
        return (*self.names, INDICES)

    @staticmethod
    def split_views(views: tuple) -> tuple[tuple, np.ndarray]:
        """(the regions' arrays, the indices) of views in view order."""
        return tuple(views[:-1]), views[-1]

    def views_of(self, batch) -> tuple:
        """A batch's arrays in view order."""
        return tuple(batch[name] for name in self.names) + (batch.indices,)

    def cut(self, views: tuple[np.ndarray, ...], rows: int, first: int = 0) -> tuple[np.ndarray, ...]:
        """`views` (view order) cut to rows [first, rows): a partial batch's arrays, views of
        the slot's (they keep it, as any view does), but for offsets that must start at 0
        again once rows before `first` are cut (then a small new array)."""
        first = min(first, rows)
        by_name = dict(zip(self.names, views))
        cut = []
        for region, view in zip(self.regions, views):
            if region.cut == "offsets":
                kept = view[first:rows + 1]
                cut.append(kept if first == 0 else kept - kept[0])
            elif region.cut == "packed":
                offsets = by_name[f"{region.name}.offsets"]
                cut.append(view[int(offsets[first]):int(offsets[rows])])
            elif region.cut == "whole":
                cut.append(view)
            else:
                cut.append(view[first:rows])
        cut.append(views[-1][first:rows])
        return tuple(cut)

    def allocate(self) -> tuple[np.ndarray, ...]:
        """Fresh zeroed arrays in view order, for a step filled outside the ring."""
        return self.views(bytearray(self.nbytes), 0)

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, "regions": [region.to_dict() for region in self.regions]}

    @classmethod
    def from_dict(cls, data: dict) -> SlotLayout:
        return cls(data["batch_size"], tuple(Region.from_dict(region) for region in data["regions"]))

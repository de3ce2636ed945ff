"""Ragged fields: records of every length (token documents, encoded images), stored as a
directory of plain Blosc2 arrays that Blosc2's own API reads without shmloader.

    NAME.ragged/values.b2nd    1-D, the element dtype: every record, back to back
    NAME.ragged/offsets.b2nd   1-D uint64, N+1 entries: record r is values[offsets[r]:offsets[r+1]]
    NAME.ragged/shapes.b2nd    optional, (N, k) uint64: record r's shape, for N-D records

Reading a record decompresses only the blocks of values.b2nd that hold it, straight into
a slot (storage/blosc.BloscField.gather_ranges); readers keep the offsets in memory (8 bytes a
record), the values stay in the mapped file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np

from ..errors import StorageError
from .opening import open_field
from .spec import FieldSpec, describe_field

VALUES_NAME = "values.b2nd"
OFFSETS_NAME = "offsets.b2nd"
SHAPES_NAME = "shapes.b2nd"
# Readers load the offsets in pieces of this many entries.
_OFFSET_PIECE = 1 << 16


@dataclasses.dataclass(frozen=True)
class RaggedSpec:
    """What a reader needs to open a ragged field (refers to the files, never carries data)."""

    path: str
    record_count: int
    dtype: str
    record_ndim: int  # 0: flat records; k: each record has a k-dimensional shape (shapes.b2nd)
    length_max: int  # elements in the longest record
    values: FieldSpec
    offsets: FieldSpec
    shapes: FieldSpec | None

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def to_dict(self) -> dict:
        data = {key: getattr(self, key) for key in ("path", "record_count", "dtype", "record_ndim", "length_max")}
        data.update(values=self.values.to_dict(), offsets=self.offsets.to_dict(),
                    shapes=self.shapes.to_dict() if self.shapes else None)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> RaggedSpec:
        return cls(**{**data, "values": FieldSpec.from_dict(data["values"]),
                      "offsets": FieldSpec.from_dict(data["offsets"]),
                      "shapes": FieldSpec.from_dict(data["shapes"]) if data["shapes"] else None})


def is_ragged(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, VALUES_NAME))
            and os.path.isfile(os.path.join(path, OFFSETS_NAME)))


def read_all(spec: FieldSpec) -> np.ndarray:
    """A whole small .b2nd (offsets, shapes) into memory, through the native gather."""
    field = open_field(spec, batch_size_max=_OFFSET_PIECE)
    try:
        out = np.empty((spec.row_count, *spec.row_shape), dtype=spec.numpy_dtype)
        # An object from a store: its whole copy is pinned (fetched where it was evicted).
        with contextlib.nullcontext() if field.remote is None else field.remote.pinned([(0, field.remote.size)]):
            for start in range(0, spec.row_count, _OFFSET_PIECE):
                stop = min(start + _OFFSET_PIECE, spec.row_count)
                field.gather(np.arange(start, stop, dtype=np.uint64), out[start:stop])
        return out
    finally:
        field.close()


def describe_ragged(path: str | os.PathLike) -> RaggedSpec:
    """Validates a ragged directory once (offsets, shapes, sizes) and describes it."""
    path = os.path.abspath(os.fspath(path))
    if not is_ragged(path):
        raise StorageError(f"{path}: not a ragged field directory (expected {VALUES_NAME} and {OFFSETS_NAME} in it)")
    values = describe_field(os.path.join(path, VALUES_NAME), allow_empty=True)  # Every record may be empty.
    offsets_spec = describe_field(os.path.join(path, OFFSETS_NAME))
    if values.row_shape != ():
        raise StorageError(f"{values.path}: values must be one-dimensional, got rows of shape {values.row_shape}")
    if offsets_spec.row_shape != () or offsets_spec.numpy_dtype != np.uint64:
        raise StorageError(f"{offsets_spec.path}: offsets must be a 1-D uint64 array of records + 1 entries")
    offsets = read_all(offsets_spec)
    record_count = offsets.size - 1
    lengths = _check_offsets(path, offsets, values.row_count)
    shapes_spec, record_ndim = None, 0
    if os.path.exists(os.path.join(path, SHAPES_NAME)):
        shapes_spec = describe_field(os.path.join(path, SHAPES_NAME))
        if len(shapes_spec.row_shape) != 1 or shapes_spec.row_count != record_count:
            raise StorageError(f"{shapes_spec.path}: expected shapes of {record_count} records, (records, dims), "
                               f"got ({shapes_spec.row_count}, {shapes_spec.row_shape})")
        _check_shapes(path, read_all(shapes_spec), lengths)
        record_ndim = shapes_spec.row_shape[0]
    return RaggedSpec(path=path, record_count=record_count, dtype=values.dtype, record_ndim=record_ndim,
                      length_max=int(lengths.max()), values=values, offsets=offsets_spec, shapes=shapes_spec)


def _check_offsets(path: str, offsets: np.ndarray, value_count: int) -> np.ndarray:
    if offsets.size < 2:
        raise StorageError(f"{path}: no records (offsets holds {offsets.size} entries, expected records + 1 >= 2)")
    if offsets[0] != 0:
        raise StorageError(f"{path}: offsets must start at 0, got {int(offsets[0])}")
    # Compared as uint64: a difference taken in int64 wraps past 2**63 and hides a decrease.
    decreasing = np.flatnonzero(offsets[1:] < offsets[:-1])
    if decreasing.size:
        record = int(decreasing[0])
        raise StorageError(f"{path}: offsets decrease at record {record} ({int(offsets[record])} then "
                           f"{int(offsets[record + 1])}); they must not")
    lengths = np.diff(offsets)  # Empty records (length 0) are records too.
    if int(offsets[-1]) != value_count:
        raise StorageError(f"{path}: the last offset is {int(offsets[-1])}, but {VALUES_NAME} holds {value_count} "
                           f"values (truncated or mismatched files)")
    return lengths


# Batches carry each record's extents as uint32 (Padded's and Packed's `.shapes`).
_EXTENT_MAX = (1 << 32) - 1


def _check_shapes(path: str, shapes: np.ndarray, lengths: np.ndarray) -> None:
    """Each record's shape must be non-negative, fit uint32 and hold exactly its length:
    the product is checked for 64-bit overflow axis by axis, since a wrapped product can
    equal the length ((8, 2**63 + 1) holds "8" elements in uint64 arithmetic)."""
    if shapes.dtype.kind not in "iu":
        raise StorageError(f"{path}: {SHAPES_NAME} must hold integers, got {shapes.dtype}")
    if shapes.dtype.kind == "i":
        negative = np.flatnonzero((shapes < 0).any(axis=1))
        if negative.size:
            record = int(negative[0])
            raise StorageError(f"{path}: record {record} has a negative extent in its shape "
                               f"{tuple(int(x) for x in shapes[record])}")
    shapes = shapes.astype(np.uint64)
    too_large = np.flatnonzero((shapes > _EXTENT_MAX).any(axis=1))
    if too_large.size:
        record = int(too_large[0])
        raise StorageError(f"{path}: record {record} has shape {tuple(int(x) for x in shapes[record])}; each extent "
                           f"must be at most {_EXTENT_MAX}")
    # Extents below 2**32: a product of two never overflows, so check before each multiply.
    products = np.ones(len(shapes), dtype=np.uint64)
    overflow = np.zeros(len(shapes), dtype=bool)
    limit = np.uint64((1 << 64) - 1)
    for axis in range(shapes.shape[1]):
        extent = shapes[:, axis]
        overflow |= (extent > 0) & (products > limit // np.maximum(extent, np.uint64(1)))
        products = products * extent
    bad = np.flatnonzero(overflow | (products != lengths))
    if bad.size:
        record = int(bad[0])
        holds = "more than 2**64" if overflow[record] else str(int(products[record]))
        raise StorageError(f"{path}: record {record} has shape {tuple(int(x) for x in shapes[record])}, "
                           f"which holds {holds} elements, but its offsets give {int(lengths[record])}")


def record_lengths(spec: RaggedSpec) -> np.ndarray:
    """Elements per record (the trainer's, to size slots)."""
    return np.diff(read_all(spec.offsets)).astype(np.uint64)


class RaggedField:
    """A ragged field opened in a reader: offsets in memory, values gathered natively."""

    def __init__(self, spec: RaggedSpec, verify: bool = False, access: str = "blocks", watch: bool = False) -> None:
        self.spec = spec
        self.offsets = read_all(spec.offsets)  # Read whole now: a later write to the file is not read.
        self.shapes = read_all(spec.shapes).astype(np.uint64) if spec.shapes else None
        self.values = open_field(spec.values, verify=verify, access=access, watch=watch)

    def check_unchanged(self) -> None:
        self.values.check_unchanged()

    def starts_and_lengths(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        bad = np.flatnonzero(indices >= self.spec.record_count)
        if bad.size:
            raise IndexError(f"{self.spec.path}: record {int(indices[bad[0]])} is out of range for "
                             f"{self.spec.record_count} records")
        starts = self.offsets[indices]
        return starts, self.offsets[indices + 1] - starts

    def close(self) -> None:
        self.values.close()

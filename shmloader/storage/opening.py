"""A FieldSpec opened for gathering (the readers' side): the Field protocol and open_field,
which picks the gather for the file and, for fields in a store, maps the node cache's copy."""

from __future__ import annotations

import mmap
import typing

import numpy as np

from ..errors import StorageError
from .blosc import BloscField
from .blosc_python import BloscPythonField
from .rows import EmptyRowsField, NpyField
from .spec import FieldSpec


class Field(typing.Protocol):
    """What an opened field offers its readers (NpyField, BloscField, BloscPythonField,
    EmptyRowsField; ragged.RaggedField wraps one for its values). Rows and elements are
    uint64; `out_pointer` is a cffi pointer to `out_bytes` writable bytes."""

    spec: FieldSpec

    def gather(self, indices, out) -> None:
        """Rows `indices` into `out`, every argument checked (the public, slow path)."""

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        """Rows `indices` (uint64, contiguous; `index_pointer` to them, or None) into a buffer
        the caller checked once: a slot's region. Bad rows still raise."""

    def gather_ranges(self, starts: np.ndarray, counts: np.ndarray, destinations: np.ndarray, out_pointer,
                      out_bytes: int) -> None:
        """Element ranges [starts, starts + counts) to byte offsets `destinations` of the output."""

    def close(self) -> None:
        """Drops this process's mapping and native state (idempotent)."""


# What the kernel is told of each way of reading (open_field's `access`).
_ACCESS = {"random": mmap.MADV_RANDOM, "sequential": mmap.MADV_SEQUENTIAL, "blocks": None}

def open_field(spec: FieldSpec, batch_size_max: int = 1 << 16, verify: bool = False,
               access: str = "blocks", watch: bool = False) -> Field:
    """Opens a described field for gathering, in whichever process calls it; `verify`
    checks each Blosc2 chunk's CRC-32 the first time it is read (files that carry them).
    `access` tells the kernel how the rows are read (madvise):
      - "random": no read-ahead around a page fault (MADV_RANDOM): for rows read in random
        order, a fault's read-around (read_ahead_kb, up to megabytes) is mostly other rows,
        read for nothing and evicting the cache;
      - "sequential" (MADV_SEQUENTIAL): a fault reads ahead of itself, not around it (half
        of a read-around is pages already read), and asynchronously again before the
        pages read ahead run out; the pages are reclaimed first under memory pressure
        (data larger than memory is read once per pass). Cold, it served more rows than
        the read-around in most alternated rounds (bench/RESULTS.md, sixteenth session).
        Sequential mode also reads ahead itself (readahead.InOrder): the kernel's read-ahead
        of a fault serves where that is behind;
      - "blocks" (the kernel's default read-around): the block-local shuffle, which also
        reads ahead itself (readahead.py).
    `watch`: the field's file descriptor stays open for check_unchanged() (a few files' worth)."""
    if spec.row_bytes == 0 or spec.row_count == 0:
        return EmptyRowsField(spec)
    if spec.remote:
        return open_cached(spec, batch_size_max, verify, access)
    if spec.kind == "npy":
        field = NpyField(spec, watch=watch)
    elif spec.row_contiguous:
        field = BloscField(spec, batch_size_max, verify=verify, watch=watch)
    else:
        return BloscPythonField(spec, watch=watch)
    _advise(field, access)
    return field


def _advise(field, access: str) -> None:
    assert access in _ACCESS, access
    if _ACCESS[access] is not None:
        field._mapping.advise(_ACCESS[access])


def open_cached(spec: FieldSpec, batch_size_max: int, verify: bool, access: str) -> Field:
    """A field over an object's copy in the node cache: opened with its header pages pinned;
    its gathers are pinned by their caller (StepFiller) through `field.remote`."""
    from ..remote.cache import cached_object

    if spec.kind == "b2nd" and not spec.row_contiguous:
        raise StorageError(f"{spec.remote}: layout {spec.chunks}/{spec.blocks} is not row-contiguous, which a cached "
                           f"object needs; re-save it with `shmloader convert` before uploading it")
    cached = cached_object(spec.path, spec.remote, spec.access)
    with cached.reading_header():
        field = NpyField(spec) if spec.kind == "npy" else BloscField(spec, batch_size_max, verify=verify)
    field.remote = cached
    _advise(field, access)
    return field

"""The Python fallback for Blosc2 layouts the Zig gather cannot read (rows split across
chunks, the DELTA filter, ZSTD dictionaries): correct through blosc2's own API, but slow,
and a warning says so when a loader opens one (storage/opening.py)."""

from __future__ import annotations

import os

import numpy as np

from .._native import ffi
from ..errors import StorageError
from .rows import check_indices, checked_out_pointer, raise_index_error
from .spec import FieldSpec, check_identity


class BloscPythonField:
    """Any other Blosc2 layout, through blosc2's Python API: correct but slow (a warning says so)."""

    remote = None  # The node cache's object, for a field read from a store (open_cached).
    unit_pages = 1  # What its fills fetch around a needed page (remote.cache.set_fetch_unit).

    def __init__(self, spec: FieldSpec, watch: bool = False) -> None:
        import blosc2

        self.spec, self.watch = spec, watch
        check_identity(spec, os.stat(spec.path))
        self._array = blosc2.open(spec.path, mode="r")
        check_identity(spec, os.stat(spec.path))
        if spec.whole_chunks and tuple(spec.chunks[1:]) != tuple(spec.row_shape):
            raise StorageError(f"{spec.name}: its chunks decode right only whole (the DELTA filter or a ZSTD "
                               f"dictionary) and split rows; re-save it with `shmloader convert`")

    def check_unchanged(self) -> None:
        """Raises StorageError when the file at its path is not the described one (watch=True):
        blosc2 reads it by path, so a file replaced there counts too."""
        if self.watch:
            check_identity(self.spec, os.stat(self.spec.path))

    def _rows(self, unique: np.ndarray) -> np.ndarray:
        """Rows `unique` (sorted), through blosc2: whole chunks where only those decode right."""
        if not self.spec.whole_chunks:
            return np.stack([self._array[int(index)] for index in unique])
        rows = np.empty((len(unique), *self.spec.row_shape), dtype=self.spec.numpy_dtype)
        chunk_of = unique // self.spec.chunk_rows
        for chunk in np.unique(chunk_of).tolist():
            where = np.flatnonzero(chunk_of == chunk)
            data = np.frombuffer(self._array.schunk.decompress_chunk(chunk), dtype=self.spec.numpy_dtype)
            data = data.reshape(-1, *self.spec.row_shape)
            rows[where] = data[unique[where] - chunk * self.spec.chunk_rows]
        return rows

    def gather(self, indices, out) -> None:
        indices = check_indices(self.spec, indices)
        out_pointer = checked_out_pointer(self.spec, out, len(indices))
        self.gather_into(indices, None, out_pointer, len(out_pointer))

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        out = ffi.buffer(out_pointer, out_bytes)
        bad = np.flatnonzero(indices >= self.spec.row_count)
        if bad.size:
            raise_index_error(self.spec, indices, int(bad[0]))
        target = np.frombuffer(out, dtype=self.spec.numpy_dtype).reshape(len(indices), *self.spec.row_shape)
        unique, inverse = np.unique(indices, return_inverse=True)
        try:
            rows = self._rows(unique) if unique.size else None
        except Exception as error:
            raise StorageError(f"{self.spec.name}: reading rows failed ({type(error).__name__}: {error})") from None
        if rows is not None:
            np.take(rows, inverse, axis=0, out=target)

    def gather_ranges(self, starts, counts, destinations, out_pointer, out_bytes: int) -> None:
        """Rows (ranges of one row each) to byte offsets of `out`, through a staging buffer."""
        if np.any(counts != 1):
            raise ValueError(f"{self.spec.name}: this layout reads whole rows only")
        staged = np.empty((len(starts), *self.spec.row_shape), dtype=self.spec.numpy_dtype)
        pointer = ffi.from_buffer("uint8_t[]", staged.reshape(-1).view(np.uint8))
        self.gather_into(np.ascontiguousarray(starts, dtype=np.uint64), None, pointer, staged.nbytes)
        out = np.frombuffer(ffi.buffer(out_pointer, out_bytes), dtype=np.uint8)
        row_bytes = self.spec.row_bytes
        flat = staged.reshape(len(starts), -1).view(np.uint8)
        for row, destination in enumerate(destinations.tolist()):
            out[destination: destination + row_bytes] = flat[row]

    def close(self) -> None:
        self._array = None

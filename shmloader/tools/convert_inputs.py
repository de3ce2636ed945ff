"""What `shmloader convert` reads besides plain .npy and contiguous .b2nd files: sparse
Blosc2 frames (directories) and arrays of a structured dtype, split into one file per field."""

from __future__ import annotations

import os
import re

import numpy as np

from ..errors import StorageError
from ..storage.spec import NPY_MAGIC, describe_field, is_sparse_frame


def open_input(path: str):
    """The input as an array-like that supports row slicing, read lazily: a .npy (memory-
    mapped), a contiguous or sparse Blosc2 frame, structured or not."""
    import blosc2

    if os.path.isdir(path):
        if not is_sparse_frame(path):
            describe_field(path)  # Raises, naming what a directory is not.
        return _opened(blosc2, path)
    with open(path, "rb") as handle:
        head = handle.read(16)
    if head.startswith(NPY_MAGIC):
        return np.load(path, mmap_mode="r")
    try:
        describe_field(path)  # Validates, and raises a clear error for anything else.
    except StorageError:
        array = _opened(blosc2, path, quiet=True)
        if array is None or np.dtype(array.dtype).fields is None:
            raise
        return array  # Structured: convert splits it into fields.
    return _opened(blosc2, path)


def _opened(blosc2, path: str, quiet: bool = False):
    try:
        array = blosc2.open(path, mode="r")
    except Exception as error:  # blosc2 raises many types for a bad file.
        if quiet:
            return None
        raise StorageError(f"{path}: not a readable Blosc2 frame ({type(error).__name__}: {error})") from None
    if not hasattr(array, "shape") or not hasattr(array, "chunks"):
        if quiet:
            return None
        raise StorageError(f"{path}: a Blosc2 super-chunk but not an NDArray; write it with blosc2.asarray")
    return array


class Member:
    """One field of a structured array-like, sliced by rows like an array (what convert
    reads a field from, a piece at a time)."""

    def __init__(self, array, name: str) -> None:
        self.array, self.name = array, name
        field = np.dtype(array.dtype).fields[name][0]
        self.dtype = field.base
        self.shape = (int(array.shape[0]), *array.shape[1:], *field.shape)
        self.chunks = getattr(array, "chunks", None)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return np.asarray(self.array[rows])[self.name]


def member_outputs(output: str, names: tuple[str, ...]) -> dict[str, str]:
    """OUT.b2nd -> OUT.<field>.b2nd per field; characters a file name should not carry
    become '_', and names made equal that way are refused."""
    stem = re.sub(r"\.b2nd$", "", os.fspath(output))
    paths: dict[str, str] = {}
    for name in names:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "field"
        path = f"{stem}.{safe}.b2nd"
        if path in paths.values():
            raise StorageError(f"{output}: the fields {names} give the same file name {path}; rename them first")
        paths[name] = path
    return paths

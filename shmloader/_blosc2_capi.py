"""Binds the few libblosc2 C functions the readers need, from the copy inside the blosc2 wheel.

Readers load the C library directly instead of importing the blosc2 Python package: it
keeps reader start-up short, and the Zig gather calls `blosc2_getitem_ctx` by address.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

DPARAMS_FIELDS = ("nthreads", "schunk", "postfilter", "postparams", "typesize")


def blosc2_package_dir() -> pathlib.Path:
    """Where the blosc2 package lives, found without importing it."""
    spec = importlib.util.find_spec("blosc2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the blosc2 package is not installed: pip install blosc2")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def library_path() -> pathlib.Path:
    lib_dir = blosc2_package_dir() / "lib"
    for name in ("libblosc2.so", "libblosc2.dylib"):
        if (lib_dir / name).exists():
            return lib_dir / name
    candidates = sorted(lib_dir.glob("libblosc2.so*"))
    if not candidates:
        raise ImportError(f"libblosc2 is not in {lib_dir}; reinstall blosc2 (pip install --force-reinstall blosc2)")
    return candidates[0]


@functools.cache
def load():
    """(ffi, lib) for libblosc2, initialised once per process."""
    from ._native import ffi  # Declared in _declarations.BLOSC2_CDEF.

    lib = ffi.dlopen(str(library_path()))
    lib.blosc2_init()
    return ffi, lib

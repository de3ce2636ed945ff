"""Binds the few libblosc2 C functions the readers need, from the copy inside the blosc2 wheel.

Readers load the C library directly instead of importing the blosc2 Python package: it
keeps reader start-up short, and the Zig gather calls `blosc2_getitem_ctx` by address.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import cffi

# Declared as in blosc2/include/blosc2.h; tests/test_storage.py compares this struct with
# the header shipped in the installed wheel, because it is passed by value.
CDEF = """
typedef struct blosc2_context_s blosc2_context;
typedef struct blosc2_schunk blosc2_schunk;
typedef struct {
    int16_t nthreads;
    void *schunk;
    void *postfilter;
    void *postparams;
    int32_t typesize;
} blosc2_dparams;

void blosc2_init(void);
blosc2_context *blosc2_create_dctx(blosc2_dparams dparams);
void blosc2_free_ctx(blosc2_context *context);
int blosc2_getitem_ctx(blosc2_context *context, const void *src, int32_t srcsize,
                       int start, int nitems, void *dest, int32_t destsize);
blosc2_schunk *blosc2_schunk_open(const char *urlpath);
int blosc2_schunk_free(blosc2_schunk *schunk);
int64_t *blosc2_frame_get_offsets(blosc2_schunk *schunk);
int blosc2_schunk_get_chunk(blosc2_schunk *schunk, int64_t nchunk, uint8_t **chunk, bool *needs_free);
int blosc2_vlmeta_get(blosc2_schunk *schunk, const char *name, uint8_t **content, int32_t *content_len);
void free(void *pointer);
"""

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
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    lib = ffi.dlopen(str(library_path()))
    lib.blosc2_init()
    return ffi, lib

"""Loads the native parts: the Zig library (built from zig/) through cffi in ABI mode, with its
API declared here, and the trainer's next() (the CPython extension built from _cursor.c)."""

from __future__ import annotations

import enum
import importlib.machinery
import pathlib
import re

import cffi

# The declarations below mirror zig/c_api.zig; tests/test_native.py checks sizes, the
# status enum and the ABI version against the library, so a drift fails loudly.
ABI_VERSION = 11
# The slot protocol's constants and structs (ring.h) are declared from the header itself.
RING_HEADER = pathlib.Path(__file__).resolve().parent / "ring.h"
_NOT_FOR_CFFI = re.compile(r"^\s*#\s*(?:if|ifndef|ifdef|endif|include|define\s+SHMLOADER_RING_H\b)")

CDEF = """
typedef struct {
    uint64_t length;
    uint64_t batch_size;
    uint64_t seed;
    uint32_t mode;
    uint32_t shard_index;
    uint32_t shard_count;
    uint32_t flags;
    uint64_t block_rows;
    uint64_t window_blocks;
} shm_sampler_config;

typedef struct {
    uint64_t position;
    int64_t code;
} shm_gather_error;

typedef struct {
    void *getitem;
    void *context;
    const uint64_t *chunk_addresses;
    const uint64_t *chunk_bytes;
    uint64_t chunk_count;
    uint64_t row_count;
    uint64_t rows_per_chunk;
    uint64_t rows_per_block;
    uint64_t row_bytes;
    uint8_t *block_buffer;
    uint64_t block_buffer_bytes;
    void *order_buffer;
    uint64_t order_buffer_count;
} shm_blosc_layout;

typedef struct {
    uint64_t length;
    uint64_t take;
    uint64_t weight;
    uint64_t seed;
    uint32_t fixed;
    uint32_t reserved;
    uint64_t block_rows;
    uint64_t window_blocks;
} shm_mixture_source;

typedef struct {
    const shm_mixture_source *sources;
    uint64_t source_count;
    const uint32_t *pattern_sources;
    const uint64_t *pattern_ranks;
    uint64_t block;
    uint64_t batch_size;
    uint32_t shard_index;
    uint32_t shard_count;
} shm_mixture_config;

uint32_t shm_abi_version(void);
uint64_t shm_sizeof_mixture_source(void);
uint64_t shm_sizeof_mixture_config(void);
int shm_mixture_check(const shm_mixture_config *config);
int shm_mixture_fill(const shm_mixture_config *config, uint64_t step, uint64_t *rows, uint32_t *sources, uint64_t count);
int shm_mixture_places(const shm_mixture_config *config, uint64_t source, uint64_t q, uint64_t *opened,
                       uint64_t *closed, uint64_t *total);
int shm_mixture_place_blocks(const shm_mixture_config *config, uint64_t source, uint64_t epoch, uint64_t first,
                             uint64_t *out, uint64_t count);
uint64_t shm_sizeof_sampler_config(void);
uint64_t shm_sizeof_blosc_layout(void);
uint64_t shm_sizeof_gather_error(void);
const char *shm_status_name(int value);

int shm_sampler_check(const shm_sampler_config *config);
int shm_sampler_fill(const shm_sampler_config *config, uint64_t step, uint64_t *out, uint64_t out_count);
void shm_bounded_draws(uint64_t seed, uint64_t step, uint64_t stream, const uint64_t *bounds, uint64_t *out,
                       uint64_t count);
int shm_sampler_places(const shm_sampler_config *config, uint64_t position, uint64_t *opened, uint64_t *closed,
                       uint64_t *total);
int shm_sampler_place_blocks(const shm_sampler_config *config, uint64_t epoch, uint64_t first, uint64_t *out,
                             uint64_t count);

int shm_gather_rows(const uint8_t *table, uint64_t row_count, uint64_t row_bytes,
                    const uint64_t *indices, uint64_t index_count,
                    uint8_t *out, uint64_t out_bytes, shm_gather_error *failure);
int shm_gather_blosc(const shm_blosc_layout *layout, const uint64_t *indices, uint64_t index_count,
                     uint8_t *out, uint64_t out_bytes, shm_gather_error *failure);

int shm_gather_parts_raw(const uint64_t *part_tables, const uint64_t *part_starts, uint64_t part_count,
                         uint64_t total_rows, uint64_t row_bytes, const uint64_t *indices,
                         const uint64_t *destinations, uint64_t index_count, uint8_t *out, uint64_t out_bytes,
                         shm_gather_error *failure);
int shm_gather_ranges_raw(const uint8_t *table, uint64_t element_count, uint64_t element_bytes,
                          const uint64_t *starts, const uint64_t *counts, const uint64_t *destinations,
                          uint64_t range_count, uint8_t *out, uint64_t out_bytes, shm_gather_error *failure);
int shm_gather_ranges_blosc(const shm_blosc_layout *layout, const uint64_t *starts, const uint64_t *counts,
                            const uint64_t *destinations, uint64_t range_count, uint8_t *out, uint64_t out_bytes,
                            shm_gather_error *failure);
uint64_t shm_state_load(const uint64_t *address);
void shm_state_store(uint64_t *address, uint64_t value);
uint64_t shm_state_compare_swap(uint64_t *address, uint64_t expected, uint64_t desired);
uint64_t shm_publish(shm_control_line *line, uint64_t word);
uint64_t shm_arm_waiter(shm_control_line *line);
int64_t shm_claim_lowest(shm_control_line *table, uint64_t slot_count, uint64_t reader_index);
"""


class Status(enum.IntEnum):
    """Mirrors zig/status.zig value for value."""

    OK = 0
    INVALID_LENGTH = 1
    INVALID_BATCH_SIZE = 2
    INVALID_MODE = 3
    INVALID_SHARD = 4
    OVERFLOW = 5
    OUTPUT_SIZE_MISMATCH = 6
    INDEX_OUT_OF_RANGE = 7
    DECOMPRESS_FAILED = 8
    INVALID_LAYOUT = 9
    CHUNK_SIZE_INVALID = 10
    ITEM_MISALIGNED = 11
    ITEM_COUNT_TOO_LARGE = 12
    DECOMPRESSED_SHORT = 13


PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
LIBRARY_STEM = "_shmloader_native"
# zig translate-c writes ring.h's Zig form here at build time (setup.py); not a source.
GENERATED_ZIG_HEADER = "ring_h.zig"
REBUILD_HINT = (
    "Rebuild it from the project's root with `pip install .` (or `pip install -e .` for a "
    "development checkout); the Zig compiler comes from the PyPI package `ziglang`."
)


class NativeLibraryError(ImportError):
    """A native part is missing, stale, or built from other sources."""


def library_path() -> pathlib.Path:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = PACKAGE_DIR / f"{LIBRARY_STEM}{suffix}"
        if candidate.exists():
            return candidate
    raise NativeLibraryError(
        f"shmloader's native library {LIBRARY_STEM}*.so is not in {PACKAGE_DIR}. {REBUILD_HINT}"
    )


def _check_fresh(path: pathlib.Path, sources: list[pathlib.Path]) -> None:
    """In a source checkout (sources beside the package), refuse a build older than its sources."""
    if not sources:
        return  # An installed wheel: no sources to compare with.
    built_ns = path.stat().st_mtime_ns
    newer = sorted(source.name for source in sources if source.stat().st_mtime_ns > built_ns)
    if newer:
        raise NativeLibraryError(
            f"{path.name} is stale: {', '.join(newer)} in {sources[0].parent} changed after "
            f"it was built. {REBUILD_HINT}"
        )


def ring_header_cdef(text: str) -> str:
    """ring.h as cffi's parser takes it: without the include and guard lines."""
    return "\n".join(line for line in text.splitlines() if not _NOT_FOR_CFFI.match(line))


def zig_sources() -> list[pathlib.Path]:
    """The files the Zig library is built from, in a source checkout (none in a wheel)."""
    zig_dir = PACKAGE_DIR.parent / "zig"
    sources = [path for path in zig_dir.glob("*.zig") if path.name != GENERATED_ZIG_HEADER]
    return [*sources, RING_HEADER] if sources else []


def _load():
    ffi = cffi.FFI()
    ffi.cdef(ring_header_cdef(RING_HEADER.read_text()))
    ffi.cdef(CDEF)
    path = library_path()
    _check_fresh(path, zig_sources())
    try:
        lib = ffi.dlopen(str(path))
    except OSError as error:
        raise NativeLibraryError(f"cannot load {path}: {error}. {REBUILD_HINT}") from None
    if lib.shm_abi_version() != ABI_VERSION:
        raise NativeLibraryError(
            f"{path.name} has ABI version {lib.shm_abi_version()}, this Python code expects "
            f"{ABI_VERSION}. {REBUILD_HINT}"
        )
    return ffi, lib


ffi, lib = _load()


def load_cursor():
    """The CPython extension compiled from _cursor.c (the trainer's next(); readers skip it)."""
    try:
        from . import _cursor
    except ImportError as error:
        raise NativeLibraryError(f"cannot import shmloader._cursor ({error}). {REBUILD_HINT}") from None
    # Only a source checkout (zig/ beside the package) has sources to compare with: an
    # installed package may carry _cursor.c and ring.h as data, copied after the build.
    in_checkout = (PACKAGE_DIR.parent / "zig").is_dir()
    _check_fresh(pathlib.Path(_cursor.__file__), [PACKAGE_DIR / "_cursor.c", RING_HEADER] if in_checkout else [])
    return _cursor


def status_name(code: int) -> str:
    return ffi.string(lib.shm_status_name(code)).decode()

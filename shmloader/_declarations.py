"""The C declarations shmloader calls through cffi, in one place, and the builder of the
module cffi generates from them at build time (setup.py writes shmloader/_ffi.py).

Parsing C declarations at run time needs pycparser, about a fifth of a reader's start-up;
the generated module carries them already parsed. This module imports nothing of the
package: setup.py loads it by path before the package is built.
"""

from __future__ import annotations

import re

# The version of zig/c_api.zig's exports these declarations describe: _native.py refuses a
# library of another (its shm_abi_version()). It is written here, by hand, on purpose: the
# declarations below are hand-written too, and a number derived from the Zig source would
# agree with any library and check nothing. Bump both sides together.
ABI_VERSION = 25

# Mirrors zig/c_api.zig's exports and their structs (sampler.zig, mixture.zig, gather.zig); tests/test_native.py checks the struct sizes against the library,
# so a drift fails loudly. Status codes are not mirrored: _native.py reads their names from
# the library. The slot protocol's constants and structs come from ring.h itself
# (ring_header_cdef).
NATIVE_CDEF = """
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
    const uint32_t *digests;
    uint64_t digest_stride;
    uint64_t *digests_checked;
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

uint64_t shm_step_max(uint64_t batch_size, uint64_t shard_index, uint64_t shard_count);
int shm_global_position(uint64_t step, uint64_t batch_size, uint64_t shard_index, uint64_t shard_count,
                        uint64_t *out);
uint64_t shm_share_length(const shm_sampler_config *config);
uint64_t shm_length_max(void);
uint64_t shm_sources_max(void);
int shm_sampler_check(const shm_sampler_config *config);
int shm_sampler_fill(const shm_sampler_config *config, uint64_t step, uint64_t *out, uint64_t out_count);
int shm_sampler_fill_positions(const shm_sampler_config *config, uint64_t first, uint64_t *out, uint64_t out_count);
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

int shm_page_digests(const uint8_t *data, uint64_t data_bytes, uint64_t page_bytes, uint32_t *out, uint64_t out_count);
int shm_page_digests_at(const uint8_t *data, uint64_t data_bytes, uint64_t page_bytes, const uint64_t *pages,
                        uint64_t page_count, uint32_t *out);
int shm_chunk_digests(const uint8_t *chunk, uint64_t chunk_bytes, uint32_t *out, uint64_t out_count,
                      uint64_t *parts);
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
int32_t shm_file_unchanged(int32_t fd, uint64_t size, int64_t mtime_ns);
int32_t shm_private_copy(uint8_t *address, uint64_t length);
int64_t shm_map_shared(int32_t fd, uint64_t offset, uint64_t length);
int32_t shm_unmap(uint8_t *address, uint64_t length);
int64_t shm_claim_lowest(shm_control_line *table, uint64_t slot_count, uint64_t reader_index);
"""

# The few libblosc2 functions the readers call, declared as in blosc2/include/blosc2.h;
# tests/test_storage.py compares the struct with the header shipped in the installed wheel,
# because it is passed by value.
BLOSC2_CDEF = """
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

# libc's mapping calls (_filemap.py).
LIBC_CDEF = """
char *mmap(void *address, size_t length, int protection, int flags, int descriptor, long offset);
int munmap(void *address, size_t length);
int madvise(void *address, size_t length, int advice);
"""

_NOT_FOR_CFFI = re.compile(r"^\s*#\s*(?:if|ifndef|ifdef|endif|include|define\s+SHMLOADER_RING_H\b)")
GENERATED_MODULE = "shmloader._ffi"


def ring_header_cdef(text: str) -> str:
    """ring.h as cffi's parser takes it: without the include and guard lines."""
    return "\n".join(line for line in text.splitlines() if not _NOT_FOR_CFFI.match(line))


def ffi_builder(ring_header_text: str):
    """A cffi.FFI holding every declaration, set up to emit GENERATED_MODULE (ABI mode,
    out of line: no C compiler is involved, the module is Python)."""
    import cffi

    builder = cffi.FFI()
    builder.cdef(ring_header_cdef(ring_header_text))
    builder.cdef(NATIVE_CDEF)
    builder.cdef(BLOSC2_CDEF)
    builder.cdef(LIBC_CDEF)
    builder.set_source(GENERATED_MODULE, None)
    return builder

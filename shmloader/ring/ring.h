/*
 * The slot protocol of the shared-memory ring, defined once for all three languages:
 * _cursor.h (beside it in shmloader/ring/) includes this file, the Zig build translates it
 * (zig translate-c, the successor of @cImport) into zig/ring_h.zig, and the build hands it
 * to cffi (setup.py writes shmloader/_ffi.py from _declarations.py), so ring/layout.py
 * reads every value below as lib.SHM_... . tests/test_ring.py checks that ring/layout.py's
 * layout agrees with the structs here. Who changes which state, where, and with which
 * memory ordering, is tabled in ring/transitions.py (checked against the code by
 * tests/test_transitions.py).
 *
 * Only what cffi's parser accepts may appear between the guard lines: integer #defines
 * and plain structs of fixed-size integers (the include and guard lines are dropped).
 */
#ifndef SHMLOADER_RING_H
#define SHMLOADER_RING_H
#include <stdint.h>

/* "SHMLRING" read as a little-endian u64, at offset 0 of the segment. */
#define SHM_RING_MAGIC 0x474E49524C4D4853
/* Bumped whenever the layout or the protocol changes; a reader refuses any other.
 * 4: when a slot was requested, and the readers' sleep counters, for stats().
 * 5: the records a reader skipped.
 * 6: next()'s waits per slot, and the readers' time by stage, for stats()["bottleneck"].
 * 7: the record of checked blocks after the slots (checked_pages, was reserved).
 * 8: what the readers run (row_bytes_bits, runs, auto_most), for `shmloader top`'s verdict. */
#define SHM_RING_VERSION 8

/* A slot's state word: the state in the low byte, the filling reader's index above it. */
#define SHM_SLOT_IDLE 0
#define SHM_SLOT_REQUESTED 1
#define SHM_SLOT_FILLING 2
#define SHM_SLOT_READY 3
#define SHM_SLOT_HELD 4
#define SHM_SLOT_FAILED 5
#define SHM_STATE_MASK 0xFF
#define SHM_OWNER_SHIFT 8

/* The segment's first bytes. */
typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t slot_count;
    uint32_t reader_count;
    uint32_t field_count;
    uint32_t trainer_pid;
    uint32_t checked_pages; /* 4 KiB pages of the checked-blocks record after the slots */
    uint64_t batch_size;
    uint64_t slot_stride;
    uint64_t slots_offset;
    uint64_t stop;
    /* What the readers run, which the counters cannot say: the trainer writes it once, as it
     * makes the ring (no reader reads it), so that `shmloader top` judges a stall as the loader's stats() do
     * (readers/bottleneck.py's Context). `row_bytes_bits`: the stored bytes of a row the
     * readers deliver, an average, as the bits of an IEEE 754 double (0, that is 0.0: unknown,
     * a dataset's rows); `runs`: SHM_RUNS_* bits; `auto_most`: under readers="auto" the most
     * readers it may reach, else 0. */
    uint64_t row_bytes_bits;
    uint32_t runs;
    uint32_t auto_most;
    uint64_t reserved[6]; /* Two cache lines in all: reader records start on a line of their own. */
} shm_ring_header;

/* shm_ring_header.runs: a field is compressed (reading it is decompression); the readers run
 * a transform; they run a dataset's __getitem__ (or its collate_fn). */
#define SHM_RUNS_COMPRESSED 1
#define SHM_RUNS_TRANSFORM 2
#define SHM_RUNS_DATASET 4

/* One slot's control line: one cache line, so that no two slots share one. The lines sit
 * together in one table apart from the data, so that a scan of them reads one page.
 * `waiter` is nonzero while the trainer waits on the slot's ready semaphore: a reader
 * posts the semaphore only then, so its count stays bounded (a Dekker pair of sequentially
 * consistent accesses: the trainer stores waiter then loads state, a reader stores state
 * then loads waiter, so at least one of them sees the other). `waited_ns` sums how long
 * next() waited for the steps this slot delivered: the trainer's alone to write, at the
 * take it writes the line for anyway, so that `shmloader top` reads the trainer's wait
 * share (the sum over the slots) from the ring. */
typedef struct {
    uint64_t state;
    uint64_t step;
    uint64_t waiter;
    uint64_t requested_ns; /* CLOCK_MONOTONIC when the trainer requested the slot */
    uint64_t waited_ns;
    uint64_t reserved[3];
} shm_control_line;

/* The fixed head of a reader's record; SHM_READER_SKIP_BYTES of UTF-8 JSON describing the
 * first records it skipped (on_error="skip") follow, then its UTF-8 JSON error report.
 * starved_ns: time the reader slept while a slot it then claimed was already requested;
 * sleeps and wakeups: waits for work begun, and ended by a post rather than the time-out;
 * skipped: records it replaced. The time of its fills (busy_ns) by stage: user_ns in the
 * user's code (a transform, a dataset's __getitem__), read_ns reading fields (decompression
 * or copies, and the page faults of a cold file), fetch_ns waiting for a store's pages in
 * the node cache; the rest is the sampler's and the protocol's. */
#define SHM_READER_SKIP_BYTES 2048
typedef struct {
    uint64_t pid;
    uint64_t busy_ns;
    uint64_t batches;
    uint32_t error_bytes;
    uint32_t skip_bytes;
    uint64_t starved_ns;
    uint64_t sleeps;
    uint64_t wakeups;
    uint64_t skipped;
    uint64_t user_ns;
    uint64_t read_ns;
    uint64_t fetch_ns;
} shm_reader_record;

#endif

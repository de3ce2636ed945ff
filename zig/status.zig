//! The status codes every exported function returns; stable numbers shared with Python.
//! They are this library's own: libblosc2's error codes travel apart, in GatherError.code.

/// Append only (a value's number is the ABI). Python names them through shm_status_name.
pub const Status = enum(c_int) {
    ok = 0,
    invalid_length = 1,
    invalid_batch_size = 2,
    invalid_mode = 3,
    invalid_shard = 4,
    overflow = 5,
    /// The output buffer is not exactly index_count * row_bytes (smaller or larger).
    output_size_mismatch = 6,
    index_out_of_range = 7,
    decompress_failed = 8,
    invalid_layout = 9,
    /// A chunk's recorded size is below a Blosc header or above what libblosc2 takes.
    chunk_size_invalid = 10,
    /// A row's bytes do not start and end on the chunk's item boundaries.
    item_misaligned = 11,
    /// A row spans more items than libblosc2's getitem can count (a C int).
    item_count_too_large = 12,
    /// libblosc2 returned fewer bytes than asked for, without an error code.
    decompressed_short = 13,
    /// A mixture's pattern does not give each source its weight's offsets, ranked 0, 1, ...
    /// in the order they come (the caller's interleave is wrong).
    invalid_pattern = 14,
    /// A sampler's derived geometry breaks one of its invariants (a permutation's domain,
    /// the phases of a sliding shuffle, a window's places): a defect in this library,
    /// checked once per call where a release build must still refuse it.
    invariant_broken = 15,
    /// A part of a chunk (its head or a block) does not match the digest its file stores:
    /// GatherError.code is chunk * digest_stride + part (part 0: the head, 1 + b: block b).
    checksum_mismatch = 16,
};

/// The highest value; update it when appending.
pub const status_last = Status.checksum_mismatch;

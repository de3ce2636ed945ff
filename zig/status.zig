//! The status codes every exported function returns; stable numbers shared with Python.

/// Append only: Python's shmloader/_native.py mirrors these values and a test compares.
pub const Status = enum(c_int) {
    ok = 0,
    invalid_length = 1,
    invalid_batch_size = 2,
    invalid_mode = 3,
    invalid_shard = 4,
    overflow = 5,
    output_too_small = 6,
    index_out_of_range = 7,
    decompress_failed = 8,
    invalid_layout = 9,
};

/// The highest value; update it when appending.
pub const status_last = Status.invalid_layout;

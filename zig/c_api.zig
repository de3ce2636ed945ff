//! Every symbol Python calls, all prefixed `shm_`, with stable status codes. The cffi
//! declarations in shmloader/_native.py mirror this file; a test checks the two agree.

const std = @import("std");
const sampler = @import("sampler.zig");
const gather = @import("gather.zig");
const status = @import("status.zig");
const Status = status.Status;

/// Bumped whenever an exported signature, struct or status value changes, so that Python
/// refuses a library built from other sources instead of corrupting memory.
const abi_version: u32 = 1;

export fn shm_abi_version() u32 {
    return abi_version;
}

export fn shm_sizeof_sampler_config() u64 {
    return @sizeOf(sampler.SamplerConfig);
}

export fn shm_sizeof_blosc_layout() u64 {
    return @sizeOf(gather.BloscLayout);
}

export fn shm_sizeof_gather_error() u64 {
    return @sizeOf(gather.GatherError);
}

/// The name of a status value (empty past the last one), so that Python can check that
/// its copy of the enum matches this one value for value.
export fn shm_status_name(value: c_int) [*:0]const u8 {
    if (value < 0 or value > @intFromEnum(status.status_last)) return "";
    const named: Status = @enumFromInt(value);
    return @tagName(named);
}

export fn shm_sampler_check(config: *const sampler.SamplerConfig) Status {
    return sampler.check(config);
}

export fn shm_sampler_fill(config: *const sampler.SamplerConfig, step: u64, out: [*]u64, out_count: u64) Status {
    return sampler.fill(config, step, out[0..out_count]);
}

export fn shm_gather_rows(
    table: [*]const u8,
    row_count: u64,
    row_bytes: u64,
    indices: [*]const u64,
    index_count: u64,
    out: [*]u8,
    out_bytes: u64,
    failure: *gather.GatherError,
) Status {
    return gather.gatherRows(table, row_count, row_bytes, indices[0..index_count], out[0..out_bytes], failure);
}

export fn shm_gather_blosc(
    layout: *const gather.BloscLayout,
    indices: [*]const u64,
    index_count: u64,
    out: [*]u8,
    out_bytes: u64,
    failure: *gather.GatherError,
) Status {
    return gather.gatherBlosc(layout, indices[0..index_count], out[0..out_bytes], failure);
}

// Atomics on shared memory. Python has none, and the ring's slot states are changed by
// several processes at once; sequentially consistent ordering keeps the protocol simple.

export fn shm_atomic_load(address: *const u64) u64 {
    return @atomicLoad(u64, address, .seq_cst);
}

export fn shm_atomic_store(address: *u64, value: u64) void {
    @atomicStore(u64, address, value, .seq_cst);
}

/// Returns the value found: equal to `expected` exactly when the swap happened.
export fn shm_atomic_compare_swap(address: *u64, expected: u64, desired: u64) u64 {
    return @cmpxchgStrong(u64, address, expected, desired, .seq_cst, .seq_cst) orelse expected;
}

export fn shm_atomic_add(address: *u64, value: u64) u64 {
    return @atomicRmw(u64, address, .Add, value, .seq_cst);
}

test {
    _ = sampler;
    _ = gather;
}

test "atomics" {
    var word: u64 = 5;
    try std.testing.expectEqual(@as(u64, 5), shm_atomic_compare_swap(&word, 5, 9));
    try std.testing.expectEqual(@as(u64, 9), shm_atomic_compare_swap(&word, 5, 1));
    try std.testing.expectEqual(@as(u64, 9), shm_atomic_add(&word, 1));
    try std.testing.expectEqual(@as(u64, 10), shm_atomic_load(&word));
}

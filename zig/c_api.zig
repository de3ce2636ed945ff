//! Every symbol Python calls, all prefixed `shm_`, with stable status codes. The cffi
//! declarations in shmloader/_native.py mirror this file; a test checks the two agree.

const std = @import("std");
const sampler = @import("sampler.zig");
const gather = @import("gather.zig");
const status = @import("status.zig");
const Status = status.Status;

/// Bumped whenever an exported signature, struct or status value changes, so that Python
/// refuses a library built from other sources instead of corrupting memory.
const abi_version: u32 = 2; // 2: shm_claim_lowest.

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

/// A reader's claim on the ring's slot table (`slot_count` control lines of `line_words`
/// u64 each: the state word, then the step): takes the slot whose state's low byte is
/// `requested` with the lowest step, by compare-and-swap of its whole state word (a
/// requested slot has no owner bits) to `filling_word`. Returns the slot, or -1 if none is
/// requested. Lost races rescan; each rescan follows another reader's successful claim.
export fn shm_claim_lowest(table: [*]u64, slot_count: u64, line_words: u64, requested: u64, filling_word: u64) i64 {
    while (true) {
        var best: ?u64 = null;
        var best_step: u64 = 0;
        var slot: u64 = 0;
        while (slot < slot_count) : (slot += 1) {
            const line = table + slot * line_words;
            if (@atomicLoad(u64, &line[0], .acquire) & 0xFF != requested) continue;
            const step = @atomicLoad(u64, &line[1], .monotonic);
            if (best == null or step < best_step) {
                best = slot;
                best_step = step;
            }
        }
        const chosen = best orelse return -1;
        const state = &(table + chosen * line_words)[0];
        if (@cmpxchgStrong(u64, state, requested, filling_word, .acq_rel, .monotonic) == null) {
            return @intCast(chosen);
        }
    }
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

test "claim takes the requested slot with the lowest step, once" {
    const requested: u64 = 1;
    const filling: u64 = 2 | (5 << 8);
    // Four control lines of 8 words: states and steps.
    var table: [32]u64 = @splat(0);
    table[0 * 8] = 3; // ready
    table[1 * 8] = requested;
    table[1 * 8 + 1] = 9;
    table[2 * 8] = requested;
    table[2 * 8 + 1] = 6;
    table[3 * 8] = 2 | (1 << 8); // filling by reader 1
    table[3 * 8 + 1] = 5;
    try std.testing.expectEqual(@as(i64, 2), shm_claim_lowest(&table, 4, 8, requested, filling));
    try std.testing.expectEqual(filling, table[2 * 8]);
    try std.testing.expectEqual(@as(i64, 1), shm_claim_lowest(&table, 4, 8, requested, filling));
    try std.testing.expectEqual(@as(i64, -1), shm_claim_lowest(&table, 4, 8, requested, filling));
}

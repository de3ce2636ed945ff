//! Every symbol Python calls, all prefixed `shm_`, with stable status codes. The cffi
//! declarations in shmloader/_declarations.py mirror this file; a test checks the two agree.

const std = @import("std");
const builtin = @import("builtin");
const sampler = @import("sampler.zig");
const gather = @import("gather.zig");
const block_digests = @import("block_digests.zig");
const mixture = @import("mixture.zig");
const status = @import("status.zig");
const Status = status.Status;
/// Generated from shmloader/ring/ring.h by `zig translate-c` at build time (setup.py).
const ring = @import("ring_h.zig");

/// Bumped whenever an exported signature, struct or status value changes, so that Python
/// refuses a library built from other sources instead of corrupting memory.
// 25: shm_page_digests, shm_page_digests_at. 24: shm_seed_mt19937 removed (ring/_cursor_seeds.c). 23: shm_seed_mt19937 sets torch's state too. 22: shm_seed_mt19937 (Python's and numpy's).
// 21: block digests (shm_chunk_digests, shm_blosc_layout's digests, status checksum_mismatch).
// 20: shm_private_copy, shm_map_shared, shm_unmap.
// 19: shm_file_unchanged. 18: statuses invalid_pattern and invariant_broken. 17: shm_step_max (Python
// mirrored it). 16: shm_arm_waiter removed (the trainer's waits are _cursor.c's). 15: shm_sources_max.
// 14: shm_length_max. 13: shm_sampler_fill_positions. 12: shm_global_position, shm_share_length
// (Python mirrors neither). 11: the sliding block-local shuffle (shm_sampler_places,
// shm_sampler_place_blocks, shm_mixture_places, shm_mixture_place_blocks replace the window calls).
// 10: windowed mixture sources (shm_mixture_window_blocks). 9: shm_bounded_draws. 8: the block-local
// shuffle (shm_sampler_window_blocks).
const abi_version: u32 = 25;

export fn shm_abi_version() u32 {
    return abi_version;
}

/// The most rows a sampler indexes (sampler.length_max): Python's limit is this one.
export fn shm_length_max() u64 {
    return sampler.length_max;
}

/// The most sources a mixture has (mixture.sources_max): Python's limit is this one.
export fn shm_sources_max() u64 {
    return mixture.sources_max;
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

/// Where shard `shard_index`'s part of `step` starts in the global stream (sampler.globalPosition).
export fn shm_global_position(step: u64, batch_size: u64, shard_index: u64, shard_count: u64, out: *u64) Status {
    out.* = sampler.globalPosition(step, batch_size, shard_index, shard_count) orelse return .overflow;
    return .ok;
}

/// The last step with a position in the 64-bit stream (sampler.stepMax).
export fn shm_step_max(batch_size: u64, shard_index: u64, shard_count: u64) u64 {
    return sampler.stepMax(batch_size, shard_index, shard_count);
}

/// Rows in a shard's share of an epoch when each shard reads its own blocks (sampler.ShardShare).
export fn shm_share_length(config: *const sampler.SamplerConfig) u64 {
    return sampler.ShardShare.init(config, 0).length;
}

export fn shm_sampler_check(config: *const sampler.SamplerConfig) Status {
    return sampler.check(config);
}

export fn shm_sampler_fill(config: *const sampler.SamplerConfig, step: u64, out: [*]u64, out_count: u64) Status {
    return sampler.fill(config, step, out[0..out_count]);
}

export fn shm_sampler_fill_positions(config: *const sampler.SamplerConfig, first: u64, out: [*]u64, out_count: u64) Status {
    return sampler.fillPositions(config, first, out[0..out_count]);
}

export fn shm_sampler_places(config: *const sampler.SamplerConfig, position: u64, opened: *u64, closed: *u64,
    total: *u64) Status {
    return sampler.places(config, position, opened, closed, total);
}

export fn shm_sampler_place_blocks(config: *const sampler.SamplerConfig, epoch: u64, first: u64, out: [*]u64,
    count: u64) Status {
    return sampler.placeBlocks(config, epoch, first, out[0..count]);
}

export fn shm_bounded_draws(seed: u64, step: u64, stream: u64, bounds: [*]const u64, out: [*]u64, count: u64) void {
    sampler.boundedDraws(seed, step, stream, bounds[0..count], out[0..count]);
}

export fn shm_sizeof_mixture_source() u64 {
    return @sizeOf(mixture.MixtureSource);
}

export fn shm_sizeof_mixture_config() u64 {
    return @sizeOf(mixture.MixtureConfig);
}

export fn shm_mixture_check(config: *const mixture.MixtureConfig) Status {
    return mixture.check(config);
}

export fn shm_mixture_fill(config: *const mixture.MixtureConfig, step: u64, rows: [*]u64, sources: [*]u32, count: u64) Status {
    return mixture.fill(config, step, rows[0..count], sources[0..count]);
}

export fn shm_mixture_places(config: *const mixture.MixtureConfig, source: u64, q: u64, opened: *u64, closed: *u64,
    total: *u64) Status {
    return mixture.places(config, source, q, opened, closed, total);
}

export fn shm_mixture_place_blocks(config: *const mixture.MixtureConfig, source: u64, epoch: u64, first: u64,
    out: [*]u64, count: u64) Status {
    return mixture.placeBlocks(config, source, epoch, first, out[0..count]);
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

/// The part digests of one stored chunk (block_digests.zig), head first, into `out`
/// (`out_count` entries, the rest zeroed); `parts` receives how many the chunk has.
/// .invalid_layout: its header or block table is unreadable, or it has more parts.
export fn shm_chunk_digests(chunk: [*]const u8, chunk_bytes: u64, out: [*]u32, out_count: u64, parts: *u64) Status {
    parts.* = block_digests.chunkDigests(chunk, chunk_bytes, out[0..out_count]) orelse return .invalid_layout;
    return .ok;
}

/// The digest (block_digests.digest) of each `page_bytes` page of `data` (`data_bytes`
/// bytes; the last page may be shorter) into `out`, one entry per page (`out_count`).
/// .invalid_length: `page_bytes` is 0, or `out_count` is not the number of pages.
export fn shm_page_digests(data: [*]const u8, data_bytes: u64, page_bytes: u64, out: [*]u32, out_count: u64) Status {
    if (!block_digests.pageDigests(data[0..data_bytes], page_bytes, out[0..out_count])) return .invalid_length;
    return .ok;
}

/// The digest of each page of `data` that `pages` lists (`page_count` indices) into `out`:
/// block_digests.pageDigestsAt. .index_out_of_range: a page lies past `data_bytes`, or
/// `page_bytes` is 0.
export fn shm_page_digests_at(data: [*]const u8, data_bytes: u64, page_bytes: u64, pages: [*]const u64, page_count: u64,
    out: [*]u32) Status {
    if (!block_digests.pageDigestsAt(data[0..data_bytes], page_bytes, pages[0..page_count], out[0..page_count])) {
        return .index_out_of_range;
    }
    return .ok;
}

export fn shm_gather_parts_raw(
    part_tables: [*]const u64,
    part_starts: [*]const u64,
    part_count: u64,
    total_rows: u64,
    row_bytes: u64,
    indices: [*]const u64,
    destinations: ?[*]const u64,
    index_count: u64,
    out: [*]u8,
    out_bytes: u64,
    failure: *gather.GatherError,
) Status {
    const targets: []const u64 = if (destinations) |pointer| pointer[0..index_count] else &.{};
    return gather.gatherPartsRaw(part_tables[0..part_count], part_starts[0..part_count], total_rows, row_bytes, indices[0..index_count], targets, out[0..out_bytes], failure);
}

export fn shm_gather_ranges_raw(
    table: [*]const u8,
    element_count: u64,
    element_bytes: u64,
    starts: [*]const u64,
    counts: [*]const u64,
    destinations: [*]const u64,
    range_count: u64,
    out: [*]u8,
    out_bytes: u64,
    failure: *gather.GatherError,
) Status {
    return gather.gatherRangesRaw(table, element_count, element_bytes, starts[0..range_count], counts[0..range_count], destinations[0..range_count], out[0..out_bytes], failure);
}

export fn shm_gather_ranges_blosc(
    layout: *const gather.BloscLayout,
    starts: [*]const u64,
    counts: [*]const u64,
    destinations: [*]const u64,
    range_count: u64,
    out: [*]u8,
    out_bytes: u64,
    failure: *gather.GatherError,
) Status {
    return gather.gatherRangesBlosc(layout, starts[0..range_count], counts[0..range_count], destinations[0..range_count], out[0..out_bytes], failure);
}

// The slot protocol's atomics (Python has none). The orderings are the ones tabled in
// shmloader/ring/segment.py: a store that publishes a state releases what was written before it
// (the step, the slot's data), a load that acts on a state acquires it, and a claim or a
// withdrawal is a compare-and-swap, so that two processes never both win a slot.

export fn shm_state_load(address: *const u64) u64 {
    return @atomicLoad(u64, address, .acquire);
}

export fn shm_state_store(address: *u64, value: u64) void {
    @atomicStore(u64, address, value, .release);
}

/// Returns the value found: equal to `expected` exactly when the swap happened.
export fn shm_state_compare_swap(address: *u64, expected: u64, desired: u64) u64 {
    return @cmpxchgStrong(u64, address, expected, desired, .acq_rel, .acquire) orelse expected;
}

/// Whether the open file `fd` still has `size` bytes and modification time `mtime_ns`
/// (what the loader described): 1 if so, 0 if not, -errno where statx fails. A fill asks
/// after reading a field's rows, per file, so it costs one system call and no Python
/// object (os.fstat builds a stat_result). Only where the kernel reports both.
export fn shm_file_unchanged(fd: i32, size: u64, mtime_ns: i64) i32 {
    if (builtin.os.tag != .linux) return -@as(i32, @intFromEnum(std.posix.E.NOSYS));
    const linux = std.os.linux;
    var found: linux.Statx = undefined;
    const result = linux.statx(fd, "", linux.AT.EMPTY_PATH, .{ .SIZE = true, .MTIME = true }, &found);
    switch (linux.errno(result)) {
        .SUCCESS => {},
        else => |code| return -@as(i32, @intFromEnum(code)),
    }
    if (!found.mask.SIZE or !found.mask.MTIME) return -@as(i32, @intFromEnum(linux.E.NOSYS));
    const found_ns = found.mtime.sec * 1_000_000_000 + @as(i64, found.mtime.nsec);
    return @intFromBool(found.size == size and found_ns == mtime_ns);
}

/// Gives the `length` bytes at `address` (page-aligned: a held slot of the trainer's mapping
/// of the ring) memory of their own, holding the same bytes, at the same address: every
/// view of them, and every pointer into them, keeps its values while the ring's shared
/// pages, mapped elsewhere, are filled anew (Ring.detach_slot). mremap replaces the
/// shared pages with the copy in one step, so no thread sees the range unmapped. 0, or
/// -errno with nothing changed.
export fn shm_private_copy(address: [*]u8, length: u64) i32 {
    if (builtin.os.tag != .linux) return -@as(i32, @intFromEnum(std.posix.E.NOSYS));
    const linux = std.os.linux;
    const private: linux.MAP = .{ .TYPE = .PRIVATE, .ANONYMOUS = true };
    const made = linux.mmap(null, length, .{ .READ = true, .WRITE = true }, private, -1, 0);
    switch (linux.errno(made)) {
        .SUCCESS => {},
        else => |code| return -@as(i32, @intFromEnum(code)),
    }
    const copy: [*]u8 = @ptrFromInt(made);
    @memcpy(copy[0..length], address[0..length]);
    const moved = linux.mremap(copy, length, length, .{ .MAYMOVE = true, .FIXED = true }, address);
    switch (linux.errno(moved)) {
        .SUCCESS => return 0,
        else => |code| {
            _ = linux.munmap(copy, length);
            return -@as(i32, @intFromEnum(code));
        },
    }
}

/// Maps `length` bytes of `fd` from `offset` (page-aligned: a slot of the ring), shared,
/// read-write and populated: a held slot's new mapping (Ring.detach_slot). Unlike Python's
/// mmap, which keeps a duplicate of the descriptor for as long as the mapping lives, it
/// holds none, so that batches kept across many seeks cost no descriptors. The address,
/// or -errno.
export fn shm_map_shared(fd: i32, offset: u64, length: u64) i64 {
    if (builtin.os.tag != .linux) return -@as(i64, @intFromEnum(std.posix.E.NOSYS));
    const linux = std.os.linux;
    const shared: linux.MAP = .{ .TYPE = .SHARED, .POPULATE = true };
    const made = linux.mmap(null, length, .{ .READ = true, .WRITE = true }, shared, fd, @intCast(offset));
    switch (linux.errno(made)) {
        .SUCCESS => return @intCast(made),
        else => |code| return -@as(i64, @intFromEnum(code)),
    }
}

/// Unmaps what shm_map_shared mapped (its owner's finalizer): 0, or -errno.
export fn shm_unmap(address: [*]u8, length: u64) i32 {
    const linux = std.os.linux;
    switch (linux.errno(linux.munmap(address, length))) {
        .SUCCESS => return 0,
        else => |code| return -@as(i32, @intFromEnum(code)),
    }
}

/// A reader publishes a slot's new state word (READY or FAILED) and learns whether the
/// trainer waits on the slot's semaphore: sequentially consistent, so that with the
/// trainer's arming of the flag (cursor_wait in ring/_cursor.c) at least one side sees the other (ring.h). Returns the flag.
export fn shm_publish(line: *ring.shm_control_line, word: u64) u64 {
    @atomicStore(u64, &line.state, word, .seq_cst);
    return @atomicLoad(u64, &line.waiter, .seq_cst);
}

/// Reader `reader_index` takes, among the `slot_count` control lines of `table`, the
/// requested slot with the lowest step: REQUESTED -> FILLING | reader << OWNER_SHIFT by
/// compare-and-swap of the whole state word (a requested slot has no owner bits).
/// Returns the slot, or -1 if none is requested. A lost race rescans; each rescan follows
/// another reader's successful claim, so the loop ends within slot_count rescans.
export fn shm_claim_lowest(table: [*]ring.shm_control_line, slot_count: u64, reader_index: u64) i64 {
    const requested: u64 = ring.SHM_SLOT_REQUESTED;
    const filling_word: u64 = ring.SHM_SLOT_FILLING | (reader_index << ring.SHM_OWNER_SHIFT);
    var rescans: u64 = 0;
    while (rescans <= slot_count) : (rescans += 1) {
        var best: ?u64 = null;
        var best_step: u64 = 0;
        var slot: u64 = 0;
        while (slot < slot_count) : (slot += 1) {
            const line = &table[slot];
            if (@atomicLoad(u64, &line.state, .acquire) & ring.SHM_STATE_MASK != requested) continue;
            // Ordered by the acquire above: the trainer writes the step before the state.
            const step = @atomicLoad(u64, &line.step, .monotonic);
            if (best == null or step < best_step) {
                best = slot;
                best_step = step;
            }
        }
        const chosen = best orelse return -1;
        if (@cmpxchgStrong(u64, &table[chosen].state, requested, filling_word, .acq_rel, .monotonic) == null) {
            return @intCast(chosen);
        }
    }
    return -1; // Every rescan lost a race: the caller waits and tries again.
}

comptime {
    // The header's structs are the ring's layout: their sizes are part of the protocol.
    std.debug.assert(@sizeOf(ring.shm_control_line) == 64);
    std.debug.assert(@sizeOf(ring.shm_ring_header) == 128);
}

test {
    _ = @import("permutation.zig");
    _ = @import("sampler_test.zig");
    _ = @import("gather_test.zig");
    _ = @import("block_digests_test.zig");
    _ = @import("mixture_test.zig");
}

test "state atomics" {
    var word: u64 = 5;
    try std.testing.expectEqual(@as(u64, 5), shm_state_compare_swap(&word, 5, 9));
    try std.testing.expectEqual(@as(u64, 9), shm_state_compare_swap(&word, 5, 1));
    shm_state_store(&word, 10);
    try std.testing.expectEqual(@as(u64, 10), shm_state_load(&word));
}

test "publish reports the waiter flag the trainer armed" {
    var line = std.mem.zeroes(ring.shm_control_line);
    line.state = ring.SHM_SLOT_FILLING;
    try std.testing.expectEqual(@as(u64, 0), shm_publish(&line, ring.SHM_SLOT_READY));
    line.waiter = 1; // The trainer's side (cursor_wait in ring/_cursor.c): a seq_cst store, then a load of the state.
    try std.testing.expectEqual(@as(u64, 1), shm_publish(&line, ring.SHM_SLOT_FAILED));
}

test "claim takes the requested slot with the lowest step, once" {
    const requested: u64 = ring.SHM_SLOT_REQUESTED;
    const filling: u64 = ring.SHM_SLOT_FILLING | (5 << ring.SHM_OWNER_SHIFT);
    var table: [4]ring.shm_control_line = undefined;
    for (&table) |*line| line.* = std.mem.zeroes(ring.shm_control_line);
    table[0].state = ring.SHM_SLOT_READY;
    table[1].state = requested;
    table[1].step = 9;
    table[2].state = requested;
    table[2].step = 6;
    table[3].state = ring.SHM_SLOT_FILLING | (1 << ring.SHM_OWNER_SHIFT);
    table[3].step = 5;
    try std.testing.expectEqual(@as(i64, 2), shm_claim_lowest(&table, 4, 5));
    try std.testing.expectEqual(filling, table[2].state);
    try std.testing.expectEqual(@as(i64, 1), shm_claim_lowest(&table, 4, 5));
    try std.testing.expectEqual(@as(i64, -1), shm_claim_lowest(&table, 4, 5));
}

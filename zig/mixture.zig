//! Weighted mixtures of sources: a pure function from (mixture, step) to a batch of
//! (source, row) pairs, so that resume stays exact at any step and any reader count.
//!
//! Position p of the global stream (p = step * batch * shards + shard * batch + i) lies in
//! block p / W, at offset p % W, where W is the sum of the weights. A fixed pattern (one
//! source per offset, each source exactly `weight` times, spread evenly: computed by the
//! caller) says which source the offset draws from and how many earlier offsets of the
//! block drew from it (its rank). Source j's own position is then q = block * w_j + rank:
//! each source runs its own shuffle epochs of `take` rows (a fraction of its rows), so a
//! small source repeats while a large one is still in its first pass.

const std = @import("std");
const sampler = @import("sampler.zig");
const Status = @import("status.zig").Status;

/// Mirrors `shm_mixture_source` in shmloader/_native.py.
pub const MixtureSource = extern struct {
    /// Rows of the source.
    length: u64,
    /// Rows one source epoch uses: ceil(fraction * length), at most length.
    take: u64,
    weight: u64,
    seed: u64,
    /// 1: one fixed subset of `take` rows for every epoch; 0: a fresh subset per epoch.
    fixed: u32,
    reserved: u32,
};

/// Mirrors `shm_mixture_config` in shmloader/_native.py.
pub const MixtureConfig = extern struct {
    sources: [*]const MixtureSource,
    source_count: u64,
    /// W entries each: the source an offset of a block draws from, and its rank there.
    pattern_sources: [*]const u32,
    pattern_ranks: [*]const u64,
    block: u64,
    batch_size: u64,
    shard_index: u32,
    shard_count: u32,
};

/// The most sources a mixture may have: their caches live on the stack of one fill.
pub const sources_max = 256;

/// One source's permutations for the epoch last used: a batch's positions of a source are
/// consecutive, so an epoch's permutation is built once per batch, not once per row.
const SourceCache = struct {
    epoch: u64 = 0,
    valid: bool = false,
    subset: sampler.EpochPermutation = undefined,
    order: sampler.EpochPermutation = undefined,
};

pub fn check(config: *const MixtureConfig) Status {
    if (config.source_count == 0 or config.source_count > sources_max or config.block == 0) return .invalid_length;
    if (config.batch_size == 0) return .invalid_batch_size;
    if (config.shard_count == 0 or config.shard_index >= config.shard_count) return .invalid_shard;
    var weights: u64 = 0;
    for (config.sources[0..config.source_count]) |source| {
        if (source.length == 0 or source.length > sampler.length_max) return .invalid_length;
        if (source.take == 0 or source.take > source.length or source.weight == 0) return .invalid_length;
        weights = std.math.add(u64, weights, source.weight) catch return .overflow;
    }
    if (weights != config.block) return .invalid_length;
    for (config.pattern_sources[0..config.block], config.pattern_ranks[0..config.block]) |source, rank| {
        if (source >= config.source_count) return .invalid_length;
        if (rank >= config.sources[source].weight) return .invalid_length;
    }
    _ = std.math.mul(u64, config.batch_size, config.shard_count) catch return .overflow;
    return .ok;
}

/// The row of source `source` at its own stream position `q`.
fn sourceRow(source: *const MixtureSource, cache: *SourceCache, q: u64) u64 {
    const epoch = q / source.take;
    const offset = q % source.take;
    if (!cache.valid or cache.epoch != epoch) {
        // A fresh subset: the first `take` offsets of this epoch's permutation of all rows.
        // A fixed one: the first `take` offsets of epoch 0's, visited in an order of its own.
        cache.subset = sampler.EpochPermutation.init(source.length, source.seed, if (source.fixed != 0) 0 else epoch);
        if (source.fixed != 0) cache.order = sampler.EpochPermutation.init(source.take, source.seed ^ 0x6f72646572, epoch); // "order"
        cache.epoch = epoch;
        cache.valid = true;
    }
    if (source.fixed != 0) return cache.subset.apply(cache.order.apply(offset));
    return cache.subset.apply(offset);
}

/// Fills `rows` and `sources` (batch_size entries each) for `step`.
pub fn fill(config: *const MixtureConfig, step: u64, rows: []u64, sources: []u32) Status {
    const status = check(config);
    if (status != .ok) return status;
    if (rows.len != config.batch_size or sources.len != config.batch_size) return .output_size_mismatch;
    var caches: [sources_max]SourceCache = @splat(.{});
    const global_batch = config.batch_size * config.shard_count;
    const step_start = std.math.mul(u64, step, global_batch) catch return .overflow;
    const first = std.math.add(u64, step_start, config.batch_size * config.shard_index) catch return .overflow;
    _ = std.math.add(u64, first, config.batch_size) catch return .overflow;
    for (rows, sources, 0..) |*row, *source_out, i| {
        const position = first + i;
        const block = position / config.block;
        const offset = position % config.block;
        const source_index = config.pattern_sources[offset];
        const source = &config.sources[source_index];
        const q = std.math.add(u64, std.math.mul(u64, block, source.weight) catch return .overflow, config.pattern_ranks[offset]) catch return .overflow;
        row.* = sourceRow(source, &caches[source_index], q);
        source_out.* = source_index;
    }
    return .ok;
}

const testing = std.testing;

test "every block holds each source's exact share and each source covers its rows once per epoch" {
    // Weights 2 and 1: pattern A B A; source A has 4 rows, source B 3 (a half fraction: 2).
    const source_list = [_]MixtureSource{
        .{ .length = 4, .take = 4, .weight = 2, .seed = 1, .fixed = 0, .reserved = 0 },
        .{ .length = 3, .take = 2, .weight = 1, .seed = 2, .fixed = 1, .reserved = 0 },
    };
    const pattern_sources = [_]u32{ 0, 1, 0 };
    const pattern_ranks = [_]u64{ 0, 0, 1 };
    const config = MixtureConfig{
        .sources = &source_list,
        .source_count = 2,
        .pattern_sources = &pattern_sources,
        .pattern_ranks = &pattern_ranks,
        .block = 3,
        .batch_size = 3,
        .shard_index = 0,
        .shard_count = 1,
    };
    var rows: [3]u64 = undefined;
    var sources: [3]u32 = undefined;
    var seen_a: [4]u32 = @splat(0);
    var subset_b: [3]u32 = @splat(0);
    var step: u64 = 0;
    while (step < 8) : (step += 1) { // 8 blocks: source A's epochs 0..3, B's positions 0..7.
        try testing.expectEqual(Status.ok, fill(&config, step, &rows, &sources));
        try testing.expectEqualSlices(u32, &pattern_sources, &sources);
        seen_a[rows[0]] += 1;
        seen_a[rows[2]] += 1;
        subset_b[rows[1]] += 1;
    }
    for (seen_a) |count| try testing.expectEqual(@as(u32, 4), count);
    // A fixed subset of 2 of B's 3 rows, each used once per B epoch of 2 positions.
    var used: u32 = 0;
    for (subset_b) |count| {
        if (count > 0) {
            try testing.expectEqual(@as(u32, 4), count);
            used += 1;
        }
    }
    try testing.expectEqual(@as(u32, 2), used);
}

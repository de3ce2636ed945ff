//! Weighted mixtures of sources: a pure function from (mixture, step) to a batch of
//! (source, row) pairs, so that resume stays exact at any step and any reader count.
//! Its tests: mixture_test.zig.
//!
//! Position p of the global stream (p = step * batch * shards + shard * batch + i) lies in
//! block p / W, at offset p % W, where W is the sum of the weights. A fixed pattern (one
//! source per offset, each source exactly `weight` times, spread evenly: computed by the
//! caller) says which source the offset draws from and how many earlier offsets of the
//! block drew from it (its rank). Source j's own position is then q = block * w_j + rank:
//! each source runs its own shuffle epochs of `take` rows (a fraction of its rows), so a
//! small source repeats while a large one is still in its first pass.
//!
//! A source with window_blocks > 0 runs the block-local shuffle (permutation.zig, SlidingShuffle)
//! instead of the global one: a fresh subset is then the first `take` offsets of its
//! epoch's sliding order (a fixed subset with a window is refused: its own order would
//! read the subset's blocks at random).

const std = @import("std");
const sampler = @import("sampler.zig");
const permutations = @import("permutation.zig");
const Status = @import("status.zig").Status;

/// Mirrors `shm_mixture_source` in shmloader/_declarations.py.
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
    /// The block-local shuffle when window_blocks > 0 (see sampler.SamplerConfig).
    block_rows: u64,
    window_blocks: u64,
};

/// Mirrors `shm_mixture_config` in shmloader/_declarations.py.
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

/// One source's place in its own stream during a fill: a source's positions within a batch
/// are consecutive in its stream (q, q + 1, ...), so after the first one each costs an
/// increment instead of divisions, and an epoch's permutation is built once per batch.
const SourceCursor = struct {
    started: bool = false,
    epoch: u64 = 0,
    offset: u64 = 0,
    subset: permutations.EpochPermutation = undefined,
    order: permutations.EpochPermutation = undefined,
    /// A windowed source: its epoch's shuffle, and the phase last used (an empty range
    /// until the first row of the epoch).
    sliding: permutations.SlidingShuffle = undefined,
    phase: permutations.SlidingShuffle.Phase = undefined,

    fn begin(self: *SourceCursor, source: *const MixtureSource, q: u64) void {
        self.started = true;
        self.epoch = q / source.take;
        self.offset = q % source.take;
        self.buildEpoch(source);
    }

    fn advance(self: *SourceCursor, source: *const MixtureSource) void {
        self.offset += 1;
        if (self.offset == source.take) {
            self.offset = 0;
            self.epoch += 1;
            self.buildEpoch(source);
        }
    }

    /// A fresh subset: the first `take` offsets of this epoch's permutation of all rows.
    /// A fixed one: the first `take` offsets of epoch 0's, visited in an order of its own.
    fn buildEpoch(self: *SourceCursor, source: *const MixtureSource) void {
        if (source.window_blocks != 0) {
            self.sliding = permutations.SlidingShuffle.init(source.length, source.block_rows, source.window_blocks, source.seed, self.epoch);
            self.phase.start = 0;
            self.phase.end = 0;
            return;
        }
        self.subset = permutations.EpochPermutation.init(source.length, source.seed, if (source.fixed != 0) 0 else self.epoch);
        if (source.fixed != 0) self.order = permutations.EpochPermutation.init(source.take, source.seed ^ 0x6f72646572, self.epoch); // "order"
    }

    /// The row at the cursor's position, one at a time (the windowed fill).
    fn row(self: *SourceCursor, source: *const MixtureSource) u64 {
        if (source.window_blocks == 0) return self.subset.apply(self.subsetOffset(source));
        if (self.offset < self.phase.start or self.offset >= self.phase.end) {
            self.phase = if (self.offset == self.phase.end and self.phase.end != 0)
                self.sliding.nextPhase(&self.phase)
            else
                self.sliding.phaseOf(self.offset);
        }
        return self.sliding.row(&self.phase, self.offset);
    }

    /// The offset into `subset` of the cursor's position (before the subset's permutation).
    fn subsetOffset(self: *const SourceCursor, source: *const MixtureSource) u64 {
        if (source.fixed != 0) return self.order.apply(self.offset);
        return self.offset;
    }
};

/// Positions whose subset permutations run together: independent Feistel chains overlap
/// in the pipeline, as in the plain shuffle.
const lanes_max = 8;

const Lanes = struct {
    permutations: [lanes_max]*const permutations.EpochPermutation = undefined,
    values: [lanes_max]u64 = undefined,
    outputs: [lanes_max]usize = undefined,
    count: usize = 0,

    fn flush(self: *Lanes, rows: []u64) void {
        var permuted: [lanes_max]u64 = undefined;
        inline for (0..lanes_max) |lane| {
            if (lane < self.count) permuted[lane] = self.permutations[lane].permuteDomain(self.values[lane]);
        }
        for (0..self.count) |lane| {
            var value = permuted[lane];
            const permutation = self.permutations[lane];
            // The domain exceeds the length by less than 2^low_bits: walks are rare and short.
            while (value >= permutation.length) value = permutation.permuteDomain(value);
            rows[self.outputs[lane]] = value;
        }
        self.count = 0;
    }
};

pub fn check(config: *const MixtureConfig) Status {
    if (config.source_count == 0 or config.source_count > sources_max or config.block == 0) return .invalid_length;
    if (config.batch_size == 0) return .invalid_batch_size;
    if (config.shard_count == 0 or config.shard_index >= config.shard_count) return .invalid_shard;
    var weights: u64 = 0;
    for (config.sources[0..config.source_count]) |source| {
        if (source.length == 0 or source.length > sampler.length_max) return .invalid_length;
        if (source.take == 0 or source.take > source.length or source.weight == 0) return .invalid_length;
        if (source.window_blocks != 0) {
            if (source.block_rows == 0 or source.block_rows > source.length) return .invalid_length;
            if (source.fixed != 0 and source.take != source.length) return .invalid_mode;
            _ = std.math.mul(u64, source.block_rows, source.window_blocks) catch return .overflow;
            if (source.window_blocks >= 1 << 32) return .invalid_length; // See permutation.floorSum.
        }
        weights = std.math.add(u64, weights, source.weight) catch return .overflow;
    }
    if (weights != config.block) return .invalid_length;
    // The pattern gives source j exactly weight_j offsets of a block, ranked 0, 1, ... in
    // the order they come: source j's stream positions q = block * w_j + rank then cover
    // its stream once, none drawn twice or skipped. The caller computes it (plan/sources.py
    // interleave); this is the loop check() makes over it anyway. Ranks in order and below
    // the weight give each source at most its weight, and the weights sum to the block:
    // so exactly its weight.
    var seen: [sources_max]u64 = undefined;
    @memset(seen[0..config.source_count], 0);
    for (config.pattern_sources[0..config.block], config.pattern_ranks[0..config.block]) |source, rank| {
        if (source >= config.source_count) return .invalid_length;
        if (rank >= config.sources[source].weight) return .invalid_length;
        if (rank != seen[source]) return .invalid_pattern;
        seen[source] += 1;
    }
    _ = std.math.mul(u64, config.batch_size, config.shard_count) catch return .overflow;
    return .ok;
}

/// Up to this many sources, a fill draws each source's run of positions on its own (one
/// scan of the batch per source, its permutations in lanes over consecutive offsets, as
/// the plain shuffle does); past it, one pass over the batch serves every source.
const per_source_passes_max = 16;

/// Fills `rows` and `sources` (batch_size entries each) for `step`.
pub fn fill(config: *const MixtureConfig, step: u64, rows: []u64, sources: []u32) Status {
    const status = check(config);
    if (status != .ok) return status;
    if (rows.len != config.batch_size or sources.len != config.batch_size) return .output_size_mismatch;
    const first = sampler.globalPosition(step, config.batch_size, config.shard_index, config.shard_count) orelse
        return .overflow;
    // Where each source's run starts in its own stream, and how long it is in this batch.
    var firsts: [sources_max]u64 = undefined;
    var counts: [sources_max]u64 = undefined;
    @memset(counts[0..config.source_count], 0);
    var block = first / config.block;
    var offset = first % config.block;
    for (sources) |*source_out| {
        const source_index = config.pattern_sources[offset];
        if (counts[source_index] == 0) {
            const weight = config.sources[source_index].weight;
            firsts[source_index] = std.math.add(u64, std.math.mul(u64, block, weight) catch return .overflow, config.pattern_ranks[offset]) catch return .overflow;
        }
        counts[source_index] += 1;
        source_out.* = source_index;
        offset += 1;
        if (offset == config.block) {
            offset = 0;
            block += 1;
        }
    }
    for (config.sources[0..config.source_count]) |source| {
        if (source.window_blocks != 0) {
            fillOneByOne(config, firsts[0..config.source_count], sources, rows);
            return .ok;
        }
    }
    if (config.source_count <= per_source_passes_max) {
        for (0..config.source_count) |source_index| {
            if (counts[source_index] > 0) fillSource(config, @intCast(source_index), firsts[source_index], sources, rows);
        }
        return .ok;
    }
    fillInterleaved(config, firsts[0..config.source_count], sources, rows);
    return .ok;
}

/// Source `source_index`'s rows of the batch, from its stream position `q_first` on.
/// Its consecutive offsets go through one permutation eight at a time, held in a local
/// copy so that its keys stay in registers, as in the plain shuffle.
fn fillSource(config: *const MixtureConfig, source_index: u32, q_first: u64, sources: []const u32, rows: []u64) void {
    const source = &config.sources[source_index];
    var cursor = SourceCursor{};
    cursor.begin(source, q_first);
    var values: [lanes_max]u64 = undefined;
    var outputs: [lanes_max]usize = undefined;
    var count: usize = 0;
    var started = false;
    for (sources, 0..) |owner, position| {
        if (owner != source_index) continue;
        if (started) {
            // A new epoch rebuilds the cursor's permutations: finish the pending lanes first.
            if (cursor.offset + 1 == source.take) {
                permuteLanes(cursor.subset, values[0..count], outputs[0..count], rows);
                count = 0;
            }
            cursor.advance(source);
        }
        started = true;
        values[count] = cursor.subsetOffset(source);
        outputs[count] = position;
        count += 1;
        if (count == lanes_max) {
            permuteLanes(cursor.subset, values[0..count], outputs[0..count], rows);
            count = 0;
        }
    }
    permuteLanes(cursor.subset, values[0..count], outputs[0..count], rows);
}

fn permuteLanes(permutation: permutations.EpochPermutation, values: []const u64, outputs: []const usize, rows: []u64) void {
    if (values.len == lanes_max) {
        var permuted: [lanes_max]u64 = undefined;
        inline for (&permuted, 0..) |*value, lane| value.* = permutation.permuteDomain(values[lane]);
        inline for (permuted, 0..) |value, lane| {
            var walked = value;
            while (walked >= permutation.length) walked = permutation.permuteDomain(walked);
            rows[outputs[lane]] = walked;
        }
        return;
    }
    for (values, outputs) |value, output| rows[output] = permutation.apply(value);
}

/// Every source in one pass over the batch (many sources).
pub fn fillInterleaved(config: *const MixtureConfig, firsts: []const u64, sources: []const u32, rows: []u64) void {
    var cursors: [sources_max]SourceCursor = undefined;
    for (cursors[0..config.source_count]) |*cursor| cursor.* = .{};
    var lanes = Lanes{};
    for (sources, 0..) |source_index, position| {
        const source = &config.sources[source_index];
        const cursor = &cursors[source_index];
        if (cursor.started) {
            if (cursor.offset + 1 == source.take) lanes.flush(rows);
            cursor.advance(source);
        } else {
            cursor.begin(source, firsts[source_index]);
        }
        lanes.permutations[lanes.count] = &cursor.subset;
        lanes.values[lanes.count] = cursor.subsetOffset(source);
        lanes.outputs[lanes.count] = position;
        lanes.count += 1;
        if (lanes.count == lanes_max) lanes.flush(rows);
    }
    lanes.flush(rows);
}

/// Every source in one pass, one row at a time: with windowed sources, whose rows come
/// from a window's permutation rather than the epoch's.
fn fillOneByOne(config: *const MixtureConfig, firsts: []const u64, sources: []const u32, rows: []u64) void {
    var cursors: [sources_max]SourceCursor = undefined;
    for (cursors[0..config.source_count]) |*cursor| cursor.* = .{};
    for (sources, rows) |source_index, *row| {
        const source = &config.sources[source_index];
        const cursor = &cursors[source_index];
        if (cursor.started) cursor.advance(source) else cursor.begin(source, firsts[source_index]);
        row.* = cursor.row(source);
    }
}

/// Source `source_index`'s stream position `q`, as sampler.places for a plain sampler:
/// the places of q's epoch dealt from by q, those all dealt before it, and those the
/// epoch deals from (its first `take` offsets).
pub fn places(config: *const MixtureConfig, source_index: u64, q: u64, opened: *u64, closed: *u64, total: *u64) Status {
    const source = switch (windowedSource(config, source_index)) {
        .source => |source| source,
        .status => |status| return status,
    };
    const shuffle = permutations.SlidingShuffle.init(source.length, source.block_rows, source.window_blocks, source.seed, q / source.take);
    if (!shuffle.valid()) return .invariant_broken;
    opened.* = shuffle.opened(q % source.take);
    closed.* = shuffle.closed(q % source.take);
    total.* = shuffle.opened(source.take - 1);
    return sampler.checkPlaces(opened.*, closed.*, total.*, shuffle.full_blocks + 1);
}

/// The blocks at places first .. first + out.len of source `source_index`'s epoch `epoch`.
pub fn placeBlocks(config: *const MixtureConfig, source_index: u64, epoch: u64, first: u64, out: []u64) Status {
    const source = switch (windowedSource(config, source_index)) {
        .source => |source| source,
        .status => |status| return status,
    };
    const shuffle = permutations.SlidingShuffle.init(source.length, source.block_rows, source.window_blocks, source.seed, epoch);
    if (!shuffle.valid()) return .invariant_broken;
    const total = shuffle.opened(source.take - 1);
    if (first > total or out.len > total - first) return .output_size_mismatch;
    for (out, first..) |*block, place| block.* = shuffle.placeBlock(place);
    return .ok;
}

/// Source `source_index` of a valid config, if it has a window; else why not.
fn windowedSource(config: *const MixtureConfig, source_index: u64) union(enum) { source: *const MixtureSource, status: Status } {
    const status = check(config);
    if (status != .ok) return .{ .status = status };
    if (source_index >= config.source_count) return .{ .status = .invalid_length };
    const source = &config.sources[source_index];
    if (source.window_blocks == 0) return .{ .status = .invalid_mode };
    return .{ .source = source };
}

//! The sampler: a pure function from (config, step) to a batch of row indices.
//!
//! Nothing here allocates or keeps state, so batch k depends only on the config and k:
//! that is what makes resume exact and lets any reader process compute any step.

const std = @import("std");
const Status = @import("status.zig").Status;
const permutations = @import("permutation.zig");
pub const EpochPermutation = permutations.EpochPermutation;
pub const SlidingShuffle = permutations.SlidingShuffle;
const golden = permutations.golden;
const hash2 = permutations.hash2;
const mix64 = permutations.mix64;

pub const Mode = enum(u32) {
    sequential = 0,
    random = 1,
    shuffle = 2,
};

/// Mirrors `shm_sampler_config` in shmloader/_declarations.py; tests/test_native.py checks its size.
pub const SamplerConfig = extern struct {
    length: u64,
    batch_size: u64,
    seed: u64,
    mode: u32,
    shard_index: u32,
    shard_count: u32,
    /// Bit 0 (shard_blocks), with a window and shard_count > 1: each shard reads only its
    /// share of the blocks (see ShardShare); the shard's batches then depend on shard_count.
    flags: u32,
    /// Shuffle mode only: the block-local shuffle (data larger than memory) when
    /// window_blocks > 0: rows are read in blocks of `block_rows` consecutive rows, and
    /// each phase mixes `window_blocks` of them (SlidingShuffle). Zero keeps the global
    /// shuffle.
    block_rows: u64,
    window_blocks: u64,
};

/// The most rows a sampler indexes (permutation.length_max: the Feistel domain's bound).
pub const length_max = permutations.length_max;

/// Draws out[i] in [0, bounds[i]], a pure function of (seed, step, stream, i): splitmix64
/// of a counter keyed by the three. Padded(overflow="random") crops with it, so that a
/// record's window is the same in every reader and on resume.
pub fn boundedDraws(seed: u64, step: u64, stream: u64, bounds: []const u64, out: []u64) void {
    const key = seed *% golden +% step *% 0xbf58476d1ce4e5b9 +% stream *% 0x94d049bb133111eb;
    for (out, bounds, 0..) |*draw, bound, i| {
        const value = mix64(key +% (@as(u64, i) +% 1) *% golden);
        draw.* = if (bound == std.math.maxInt(u64)) value else value % (bound + 1);
    }
}

pub fn check(config: *const SamplerConfig) Status {
    if (config.length == 0 or config.length > length_max) return .invalid_length;
    if (config.batch_size == 0) return .invalid_batch_size;
    if (config.shard_count == 0 or config.shard_index >= config.shard_count) return .invalid_shard;
    if (config.mode > @intFromEnum(Mode.shuffle)) return .invalid_mode;
    _ = std.math.mul(u64, config.batch_size, config.shard_count) catch return .overflow;
    if (config.window_blocks != 0) {
        if (config.mode != @intFromEnum(Mode.shuffle)) return .invalid_mode;
        if (config.block_rows == 0) return .invalid_length;
        // The sliding shuffle's floor sums stay within 64 bits (floorSum).
        if (config.window_blocks >= 1 << 32) return .invalid_length;
        _ = std.math.mul(u64, config.block_rows, std.math.add(u64, config.window_blocks, 1) catch return .overflow) catch return .overflow;
    }
    if (config.flags & ~flag_shard_blocks != 0) return .invalid_mode;
    if (shardBlocks(config)) {
        if (config.window_blocks == 0) return .invalid_mode;
        if (ShardShare.init(config, 0).length == 0) return .invalid_length; // More shards than blocks.
    }
    return .ok;
}

/// Where shard `shard_index`'s part of `step` starts in the global stream of positions: a
/// step's global batch holds batch_size * shard_count positions and shard h takes its h-th
/// block of batch_size. Null when a position of that part would overflow. The one
/// definition: the mixture's fill and Python (shm_global_position) use it too.
pub fn globalPosition(step: u64, batch_size: u64, shard_index: u64, shard_count: u64) ?u64 {
    const global_batch = std.math.mul(u64, batch_size, shard_count) catch return null;
    const step_start = std.math.mul(u64, step, global_batch) catch return null;
    const shard_offset = std.math.mul(u64, batch_size, shard_index) catch return null;
    const first = std.math.add(u64, step_start, shard_offset) catch return null;
    // The last position must fit as well.
    _ = std.math.add(u64, first, batch_size) catch return null;
    return first;
}

/// The global position of the first row this shard takes at `step`, or null on overflow.
fn firstPosition(config: *const SamplerConfig, step: u64) ?u64 {
    return globalPosition(step, config.batch_size, config.shard_index, config.shard_count);
}

pub const flag_shard_blocks: u32 = 1;

fn shardBlocks(config: *const SamplerConfig) bool {
    return config.flags & flag_shard_blocks != 0 and config.shard_count > 1;
}

/// The position in the shard's own stream where `step` starts (shard_blocks), or null.
fn shardFirstPosition(config: *const SamplerConfig, step: u64) ?u64 {
    const first = std.math.mul(u64, step, config.batch_size) catch return null;
    _ = std.math.add(u64, first, config.batch_size) catch return null;
    return first;
}

pub fn fill(config: *const SamplerConfig, step: u64, out: []u64) Status {
    const status = check(config);
    if (status != .ok) return status;
    if (out.len < config.batch_size) return .output_size_mismatch;
    const first = (if (shardBlocks(config)) shardFirstPosition(config, step) else firstPosition(config, step)) orelse
        return .overflow;
    fillStream(config, first, out[0..config.batch_size]);
    return .ok;
}

/// The rows at positions first .. first + out.len of the stream this config reads: the
/// shard's own stream (shard_blocks), else the global one. A resharded resume deals the
/// old shards' unread positions through it (shmloader/plan/reshard.py); fill is its batch case.
pub fn fillPositions(config: *const SamplerConfig, first: u64, out: []u64) Status {
    const status = check(config);
    if (status != .ok) return status;
    _ = std.math.add(u64, first, out.len) catch return .overflow;
    if (out.len > 0) fillStream(config, first, out);
    return .ok;
}

fn fillStream(config: *const SamplerConfig, first: u64, out: []u64) void {
    if (shardBlocks(config)) return fillSliding(config, first, out, true);
    switch (@as(Mode, @enumFromInt(config.mode))) {
        .sequential => fillSequential(config.length, first, out),
        .random => fillRandom(config.length, config.seed, first, out),
        .shuffle => if (config.window_blocks == 0)
            fillShuffle(config.length, config.seed, first, out)
        else
            fillSliding(config, first, out, false),
    }
}

/// What a reader reads ahead for the block-local shuffle at global stream `position`
/// (see SlidingShuffle): `opened`, the places of the position's epoch dealt from by then;
/// `closed`, the places whose rows are all dealt before it; `total`, the places the epoch
/// deals from (the tail block, past the last full block, is the last place).
pub fn places(config: *const SamplerConfig, position: u64, opened: *u64, closed: *u64, total: *u64) Status {
    const status = check(config);
    if (status != .ok) return status;
    if (config.window_blocks == 0) return .invalid_mode;
    const length = epochLength(config);
    const shuffle = SlidingShuffle.init(length, config.block_rows, config.window_blocks, config.seed, position / length);
    opened.* = shuffle.opened(position % length);
    closed.* = shuffle.closed(position % length);
    total.* = shuffle.opened(length - 1);
    return .ok;
}

/// The dataset blocks at places first .. first + out.len of `epoch` (see places): what a
/// reader advises the kernel of, or lets go of. Block id length / block_rows is the tail.
pub fn placeBlocks(config: *const SamplerConfig, epoch: u64, first: u64, out: []u64) Status {
    const status = check(config);
    if (status != .ok) return status;
    if (config.window_blocks == 0) return .invalid_mode;
    const length = epochLength(config);
    const shuffle = SlidingShuffle.init(length, config.block_rows, config.window_blocks, config.seed, epoch);
    const total = shuffle.opened(length - 1);
    if (first > total or out.len > total - first) return .output_size_mismatch;
    const share = if (shardBlocks(config)) ShardShare.init(config, epoch) else null;
    for (out, first..) |*block, place| {
        const virtual = shuffle.placeBlock(place);
        block.* = if (share) |s| s.blockOf(virtual) else virtual;
    }
    return .ok;
}

/// Rows in one epoch of this shard's stream: the dataset's, or its share of the blocks.
fn epochLength(config: *const SamplerConfig) u64 {
    return if (shardBlocks(config)) ShardShare.init(config, 0).length else config.length;
}

/// A shard's share of one epoch (shard_blocks): the full blocks whose slot in the epoch's
/// block permutation is the shard's index modulo the shard count, and the tail rows (past
/// the last full block) for the shard next in that round. Seen as a dataset of its own
/// (virtual rows 0..length), it gets its own block-local shuffle; a virtual row maps back
/// through its block. The shards' shares of an epoch partition its rows, so across shards
/// every row comes once per epoch, and each host reads only its share of the bytes. A
/// shard's position is its own: step * batch_size (so shards whose shares differ by a block
/// cross epochs a little apart).
pub const ShardShare = struct {
    length: u64,
    block_rows: u64,
    full_blocks: u64,
    share_blocks: u64,
    shard_index: u64,
    shard_count: u64,
    all_blocks: EpochPermutation,

    pub fn init(config: *const SamplerConfig, epoch: u64) ShardShare {
        const block_rows = config.block_rows;
        const full_blocks = config.length / block_rows;
        const shard_count: u64 = config.shard_count;
        const shard_index: u64 = config.shard_index;
        const share_blocks = full_blocks / shard_count + @intFromBool(shard_index < full_blocks % shard_count);
        const tail_rows = config.length - full_blocks * block_rows;
        const owns_tail = shard_index == full_blocks % shard_count;
        return .{
            .length = share_blocks * block_rows + (if (owns_tail) tail_rows else 0),
            .block_rows = block_rows,
            .full_blocks = full_blocks,
            .share_blocks = share_blocks,
            .shard_index = shard_index,
            .shard_count = shard_count,
            // The same permutation for every shard of an epoch: their shares partition it.
            .all_blocks = EpochPermutation.init(@max(1, full_blocks), hash2(config.seed, 0x7368617265), epoch), // "share"
        };
    }

    /// The dataset row of virtual block `block` (the tail past share_blocks) and `offset`.
    pub fn rowOf(self: *const ShardShare, block: u64, offset: u64) u64 {
        if (block < self.share_blocks) {
            return self.all_blocks.apply(self.shard_index + block * self.shard_count) * self.block_rows + offset;
        }
        return self.full_blocks * self.block_rows + offset;
    }

    pub fn blockOf(self: *const ShardShare, block: u64) u64 {
        return if (block < self.share_blocks) self.all_blocks.apply(self.shard_index + block * self.shard_count) else self.full_blocks;
    }
};

/// The block-local shuffle from stream position `first`: over the dataset, or (shard_blocks)
/// over this shard's share of the blocks, whose virtual rows map back through their block.
fn fillSliding(config: *const SamplerConfig, first: u64, out: []u64, comptime sharded: bool) void {
    const length = epochLength(config); // The same for every epoch.
    var epoch = first / length;
    var offset = first % length;
    var share = if (sharded) ShardShare.init(config, epoch) else {};
    var shuffle = SlidingShuffle.init(length, config.block_rows, config.window_blocks, config.seed, epoch);
    var phase = shuffle.phaseOf(offset);
    for (out, 0..) |*slot, i| {
        const virtual = shuffle.row(&phase, offset);
        slot.* = if (sharded) share.rowOf(virtual / config.block_rows, virtual % config.block_rows) else virtual;
        if (i + 1 == out.len) break;
        offset += 1;
        if (offset == length) {
            offset = 0;
            epoch += 1;
            if (sharded) share = ShardShare.init(config, epoch);
            shuffle = SlidingShuffle.init(length, config.block_rows, config.window_blocks, config.seed, epoch);
            phase = shuffle.phaseOf(0);
        } else if (offset == phase.end) {
            phase = shuffle.nextPhase(&phase);
        }
    }
}

fn fillSequential(length: u64, first: u64, out: []u64) void {
    var offset = first % length;
    for (out) |*slot| {
        slot.* = offset;
        offset += 1;
        if (offset == length) offset = 0;
    }
}

/// Uniform draws with replacement. Lemire's multiply-shift with rejection keeps the draw
/// unbiased for any length; the counter (position, attempt) makes it stateless.
fn fillRandom(length: u64, seed: u64, first: u64, out: []u64) void {
    const seed_key = hash2(seed, 0x72616e646f6d); // "random"
    const threshold = (0 -% length) % length;
    for (out, 0..) |*slot, i| {
        const position_key = hash2(seed_key, first + i);
        var attempt: u64 = 0;
        while (true) : (attempt += 1) {
            const product = std.math.mulWide(u64, mix64(position_key +% attempt *% golden), length);
            const low: u64 = @truncate(product);
            if (low >= threshold) {
                slot.* = @truncate(product >> 64);
                break;
            }
        }
    }
}

/// Offsets permuted together: independent Feistel chains interleave in the pipeline, so
/// a group costs little more than one chain's latency.
const shuffle_lanes = 8;

fn fillShuffle(length: u64, seed: u64, first: u64, out: []u64) void {
    var epoch = first / length;
    var offset = first % length;
    var permutation = EpochPermutation.init(length, seed, epoch);
    var position: usize = 0;
    while (position < out.len) {
        const lanes_left = out.len - position;
        const epoch_left = length - offset;
        if (lanes_left >= shuffle_lanes and epoch_left >= shuffle_lanes) {
            var values: [shuffle_lanes]u64 = undefined;
            inline for (&values, 0..) |*value, lane| value.* = permutation.permuteDomain(offset + lane);
            inline for (values, 0..) |value, lane| {
                var walked = value;
                while (walked >= length) walked = permutation.permuteDomain(walked);
                out[position + lane] = walked;
            }
            position += shuffle_lanes;
            offset += shuffle_lanes;
        } else {
            out[position] = permutation.apply(offset);
            position += 1;
            offset += 1;
        }
        if (offset == length) {
            offset = 0;
            epoch += 1;
            permutation = EpochPermutation.init(length, seed, epoch);
        }
    }
}

const testing = std.testing;

fn testConfig(length: u64, batch_size: u64, mode: Mode) SamplerConfig {
    return .{
        .length = length,
        .batch_size = batch_size,
        .seed = 7,
        .mode = @intFromEnum(mode),
        .shard_index = 0,
        .shard_count = 1,
        .flags = 0,
        .block_rows = 0,
        .window_blocks = 0,
    };
}

test "bounded draws stay within their bounds and depend on every key" {
    const bounds = [_]u64{ 0, 1, 7, 1000, std.math.maxInt(u64) };
    var first: [5]u64 = undefined;
    var again: [5]u64 = undefined;
    var other: [5]u64 = undefined;
    boundedDraws(3, 9, 2, &bounds, &first);
    boundedDraws(3, 9, 2, &bounds, &again);
    boundedDraws(3, 10, 2, &bounds, &other);
    try std.testing.expectEqualSlices(u64, &first, &again);
    try std.testing.expect(first[4] != other[4]);
    for (first, bounds) |draw, bound| try std.testing.expect(draw <= bound);
    try std.testing.expectEqual(@as(u64, 0), first[0]);
}

test "shuffle covers every row once per epoch across batch boundaries" {
    const length = 1000;
    var seen: [length]u8 = @splat(0);
    const config = testConfig(length, 7, .shuffle);
    var out: [7]u64 = undefined;
    // Positions 3000..3999 are exactly epoch 3; steps straddle its edges.
    var step: u64 = 3000 / 7;
    while (step <= 4000 / 7) : (step += 1) {
        try testing.expectEqual(Status.ok, fill(&config, step, &out));
        for (out, 0..) |index, i| {
            const position = step * 7 + i;
            if (position >= 3000 and position < 4000) seen[index] += 1;
        }
    }
    for (seen) |count| try testing.expectEqual(@as(u8, 1), count);
}

fn windowConfig(length: u64, batch_size: u64, block_rows: u64, window_blocks: u64) SamplerConfig {
    var config = testConfig(length, batch_size, .shuffle);
    config.block_rows = block_rows;
    config.window_blocks = window_blocks;
    return config;
}

test "the block-local shuffle covers every row once per epoch, for tails and single windows" {
    // Besides the cases below: one block a window (a block shuffle), and blocks of one row.
    // (length, block rows, blocks per window): a tail, no tail, fewer rows than a block,
    // fewer blocks than a window, a last window of a single block plus the tail.
    const cases = [_][3]u64{ .{ 1000, 16, 4 }, .{ 1024, 16, 4 }, .{ 10, 16, 4 }, .{ 1000, 16, 100 }, .{ 1000, 16, 62 }, .{ 1000, 16, 1 }, .{ 1000, 1, 9 }, .{ 1000, 3, 7 } };
    for (cases) |case| {
        const length = case[0];
        const config = windowConfig(length, 7, case[1], case[2]);
        var seen: [1024]u8 = @splat(0);
        var out: [7]u64 = undefined;
        var step: u64 = 2 * length / 7;
        while (step <= 3 * length / 7 + 1) : (step += 1) {
            try testing.expectEqual(Status.ok, fill(&config, step, &out));
            for (out, 0..) |index, i| {
                try testing.expect(index < length);
                const position = step * 7 + i;
                if (position >= 2 * length and position < 3 * length) seen[index] += 1;
            }
        }
        for (seen[0..length]) |count| try testing.expectEqual(@as(u8, 1), count);
    }
}

test "each row comes from a place open at its position, and a full phase mixes B blocks" {
    // (length, block rows, blocks per window): a tail, more blocks than rows, one block.
    const cases = [_][3]u64{ .{ 1000, 16, 4 }, .{ 1000, 3, 7 }, .{ 1000, 16, 1 }, .{ 37, 16, 8 } };
    for (cases) |case| {
        const length = case[0];
        const config = windowConfig(length, 10, case[1], case[2]);
        var out: [10]u64 = undefined;
        var blocks: [1024]u64 = undefined;
        var opened: u64 = 0;
        var closed: u64 = 0;
        var total: u64 = 0;
        var step: u64 = 0;
        while (step * 10 < 2 * length) : (step += 1) {
            try testing.expectEqual(Status.ok, fill(&config, step, &out));
            for (out, 0..) |row, i| {
                const position = step * 10 + i;
                try testing.expectEqual(Status.ok, places(&config, position, &opened, &closed, &total));
                try testing.expectEqual(length / case[1] + @intFromBool(length % case[1] != 0), total);
                try testing.expect(closed < opened and opened <= total);
                try testing.expect(opened - closed <= case[2] + 1);
                try testing.expectEqual(Status.ok, placeBlocks(&config, position / length, closed, blocks[0 .. opened - closed]));
                var found = false;
                for (blocks[0 .. opened - closed]) |block| found = found or row / case[1] == block;
                try testing.expect(found);
            }
        }
    }
    // Where the window is full, a phase of R = 16 rows takes 4 rows from each of 4 blocks.
    const shuffle = SlidingShuffle.init(1000, 16, 4, 7, 0);
    var phase = shuffle.phaseOf(shuffle.phaseStart(10));
    try testing.expectEqual(@as(u64, 10), phase.index);
    try testing.expectEqual(@as(u64, 16), phase.end - phase.start);
    var counts: [63]u8 = @splat(0);
    for (phase.start..phase.end) |offset| counts[shuffle.row(&phase, offset) / 16] += 1;
    var blocks_seen: u64 = 0;
    for (counts) |count| {
        if (count != 0) try testing.expectEqual(@as(u8, 4), count);
        blocks_seen += @intFromBool(count != 0);
    }
    try testing.expectEqual(@as(u64, 4), blocks_seen);
    phase = shuffle.nextPhase(&phase);
    try testing.expectEqual(@as(u64, 11), phase.index);
}

test "window settings outside the shuffle are refused" {
    var config = windowConfig(100, 4, 16, 4);
    config.mode = @intFromEnum(Mode.sequential);
    try testing.expectEqual(Status.invalid_mode, check(&config));
    config = windowConfig(100, 4, 0, 4);
    try testing.expectEqual(Status.invalid_length, check(&config));
}

test "shards reading their own blocks together cover every row once per epoch" {
    for ([_]u64{ 1000, 1024, 997 }) |length| {
        for ([_]u32{ 2, 3 }) |shard_count| {
            var seen: [1024]u8 = @splat(0);
            var shard: u32 = 0;
            while (shard < shard_count) : (shard += 1) {
                var config = windowConfig(length, 10, 16, 4);
                config.shard_count = shard_count;
                config.shard_index = shard;
                config.flags = flag_shard_blocks;
                try testing.expectEqual(Status.ok, check(&config));
                const share = ShardShare.init(&config, 0).length;
                var out: [10]u64 = undefined;
                var step: u64 = 0;
                // The shard's second epoch: positions share .. 2 * share.
                while (step * 10 < 2 * share) : (step += 1) {
                    try testing.expectEqual(Status.ok, fill(&config, step, &out));
                    for (out, 0..) |row, i| {
                        const position = step * 10 + i;
                        if (position >= share and position < 2 * share) seen[row] += 1;
                    }
                }
            }
            for (seen[0..length]) |times| try testing.expectEqual(@as(u8, 1), times);
        }
    }
}

test "rows from any stream position are the batches' rows, for every mode and a shard's own stream" {
    var configs = [_]SamplerConfig{ testConfig(97, 8, .sequential), testConfig(97, 8, .random), testConfig(97, 8, .shuffle), windowConfig(1000, 8, 16, 4), windowConfig(1000, 8, 16, 4) };
    configs[4].shard_count = 3;
    configs[4].shard_index = 2;
    configs[4].flags = flag_shard_blocks;
    for (&configs) |*config| {
        var batches: [8 * 40]u64 = undefined;
        var step: u64 = 0;
        while (step < 40) : (step += 1) try testing.expectEqual(Status.ok, fill(config, step, batches[step * 8 ..][0..8]));
        // Ranges that start and end off the batch boundaries, across epochs.
        for ([_][2]u64{ .{ 0, 1 }, .{ 3, 29 }, .{ 7, 313 }, .{ 150, 170 } }) |range| {
            var out: [320]u64 = undefined;
            const rows = out[0 .. range[1] - range[0]];
            try testing.expectEqual(Status.ok, fillPositions(config, range[0], rows));
            try testing.expectEqualSlices(u64, batches[range[0]..range[1]], rows);
        }
    }
    var out: [2]u64 = undefined;
    try testing.expectEqual(Status.overflow, fillPositions(&configs[0], std.math.maxInt(u64), &out));
}

test "sequential wraps around" {
    const config = testConfig(5, 4, .sequential);
    var out: [4]u64 = undefined;
    try testing.expectEqual(Status.ok, fill(&config, 1, &out));
    try testing.expectEqualSlices(u64, &[_]u64{ 4, 0, 1, 2 }, &out);
}

test "random stays in range and huge lengths work" {
    var config = testConfig((1 << 48) + 3, 64, .random);
    var out: [64]u64 = undefined;
    try testing.expectEqual(Status.ok, fill(&config, 123456789, &out));
    for (out) |index| try testing.expect(index < config.length);
    config.mode = @intFromEnum(Mode.shuffle);
    try testing.expectEqual(Status.ok, fill(&config, 123456789, &out));
    for (out) |index| try testing.expect(index < config.length);
}

test "invalid configs are rejected" {
    var config = testConfig(0, 4, .shuffle);
    var out: [4]u64 = undefined;
    try testing.expectEqual(Status.invalid_length, fill(&config, 0, &out));
    config = testConfig(10, 4, .shuffle);
    config.shard_index = 1;
    try testing.expectEqual(Status.invalid_shard, fill(&config, 0, &out));
    config = testConfig(10, 4, .shuffle);
    config.mode = 9;
    try testing.expectEqual(Status.invalid_mode, fill(&config, 0, &out));
    config = testConfig(10, 8, .shuffle);
    try testing.expectEqual(Status.output_size_mismatch, fill(&config, 0, &out));
    config = testConfig(10, 4, .shuffle);
    try testing.expectEqual(Status.overflow, fill(&config, std.math.maxInt(u64) / 2, &out));
}

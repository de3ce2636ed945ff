//! The sampler: a pure function from (config, step) to a batch of row indices.
//!
//! Nothing here allocates or keeps state, so batch k depends only on the config and k:
//! that is what makes resume exact and lets any reader process compute any step.
//! Its tests: sampler_test.zig.

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

/// The last step for which globalPosition has a position: past it, a shard's part of the
/// stream would overflow 64 bits. 0 when even step 0 has none (a shape the limits refuse).
pub fn stepMax(batch_size: u64, shard_index: u64, shard_count: u64) u64 {
    const global_batch = std.math.mul(u64, batch_size, shard_count) catch return 0;
    const part_end = std.math.mul(u64, batch_size, shard_index + 1) catch return 0;
    if (global_batch == 0) return 0;
    return (std.math.maxInt(u64) - part_end) / global_batch;
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
    const geometry = checkGeometry(config, first / epochLength(config));
    if (geometry != .ok) return geometry;
    fillStream(config, first, out[0..config.batch_size]);
    return .ok;
}

/// The invariants the fill of `epoch` stands on, checked once per call, never per row: a
/// shard's share within the data, and the epoch's permutation or sliding shuffle valid
/// (their `valid`), so that every row a fill writes lies within the data;
/// `.invariant_broken` otherwise. An explicit check, not std.debug.assert: setup.py builds
/// the library ReleaseFast, where a failed assert is not caught but undefined behaviour.
/// The per-row paths keep their std.debug.asserts, which `zig test -ODebug` checks.
fn checkGeometry(config: *const SamplerConfig, epoch: u64) Status {
    if (config.window_blocks == 0) {
        if (config.mode != @intFromEnum(Mode.shuffle)) return .ok; // Sequential and random draw within length by construction.
        return if (EpochPermutation.init(config.length, config.seed, epoch).valid()) .ok else .invariant_broken;
    }
    if (shardBlocks(config)) {
        const share = ShardShare.init(config, epoch);
        if (!share.valid(config)) return .invariant_broken;
    }
    const shuffle = SlidingShuffle.init(epochLength(config), config.block_rows, config.window_blocks, config.seed, epoch);
    return if (shuffle.valid()) .ok else .invariant_broken;
}

/// What `places` answers must hold, checked in release builds: places close after they
/// open and open among the epoch's, which are its full blocks and the tail block at most.
pub fn checkPlaces(opened: u64, closed: u64, total: u64, places_max: u64) Status {
    if (closed > opened or opened > total or total > places_max) return .invariant_broken;
    return .ok;
}

/// The rows at positions first .. first + out.len of the stream this config reads: the
/// shard's own stream (shard_blocks), else the global one. A resharded resume deals the
/// old shards' unread positions through it (shmloader/plan/reshard.py); fill is its batch case.
pub fn fillPositions(config: *const SamplerConfig, first: u64, out: []u64) Status {
    const status = check(config);
    if (status != .ok) return status;
    _ = std.math.add(u64, first, out.len) catch return .overflow;
    if (out.len == 0) return .ok;
    const geometry = checkGeometry(config, first / epochLength(config));
    if (geometry != .ok) return geometry;
    fillStream(config, first, out);
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
    if (!shuffle.valid()) return .invariant_broken;
    opened.* = shuffle.opened(position % length);
    closed.* = shuffle.closed(position % length);
    total.* = shuffle.opened(length - 1);
    return checkPlaces(opened.*, closed.*, total.*, shuffle.full_blocks + 1);
}

/// The dataset blocks at places first .. first + out.len of `epoch` (see places): what a
/// reader advises the kernel of, or lets go of. Block id length / block_rows is the tail.
pub fn placeBlocks(config: *const SamplerConfig, epoch: u64, first: u64, out: []u64) Status {
    const status = check(config);
    if (status != .ok) return status;
    if (config.window_blocks == 0) return .invalid_mode;
    const length = epochLength(config);
    const shuffle = SlidingShuffle.init(length, config.block_rows, config.window_blocks, config.seed, epoch);
    if (!shuffle.valid()) return .invariant_broken;
    const total = shuffle.opened(length - 1);
    if (first > total or out.len > total - first) return .output_size_mismatch;
    const share = if (shardBlocks(config)) ShardShare.init(config, epoch) else null;
    if (share) |s| if (!s.valid(config)) return .invariant_broken;
    // A place's block is one of the data's: its full blocks, then the tail (id F).
    const blocks_max = config.length / config.block_rows;
    for (out, first..) |*block, place| {
        const virtual = shuffle.placeBlock(place);
        block.* = if (share) |s| s.blockOf(virtual) else virtual;
        if (block.* > blocks_max) return .invariant_broken; // Per place (a block of rows), not per row.
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

    /// Whether the share lies within `config`'s data: some of its full blocks, at most
    /// their 1/shard_count share rounded up, and the tail rows at most; the block
    /// permutation valid.
    pub fn valid(self: *const ShardShare, config: *const SamplerConfig) bool {
        if (self.full_blocks != config.length / config.block_rows or self.block_rows != config.block_rows) return false;
        if (self.share_blocks > (self.full_blocks + self.shard_count - 1) / self.shard_count) return false;
        const tail_rows = config.length - self.full_blocks * self.block_rows;
        if (self.length > self.share_blocks * self.block_rows + tail_rows) return false;
        return self.shard_index < self.shard_count and self.all_blocks.valid();
    }

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

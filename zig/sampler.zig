//! The sampler: a pure function from (config, step) to a batch of row indices.
//!
//! Nothing here allocates or keeps state, so batch k depends only on the config and k:
//! that is what makes resume exact and lets any reader process compute any step.

const std = @import("std");
const Status = @import("status.zig").Status;

pub const Mode = enum(u32) {
    sequential = 0,
    random = 1,
    shuffle = 2,
};

/// Mirrors `shm_sampler_config` in shmloader/_native.py; a test there checks the layout.
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
    /// window_blocks > 0: rows are read in blocks of `block_rows` consecutive rows, and a
    /// window deals out `window_blocks` blocks. Zero keeps the global shuffle.
    block_rows: u64,
    window_blocks: u64,
};

/// Row counts above this would make the Feistel domain (one bit above N) overflow the
/// 64-bit arithmetic of the round function's masks; 2^62 rows is far past any dataset.
pub const length_max: u64 = 1 << 62;

/// Rounds of the Feistel network, two per half: four rounds with a strong round function
/// give a pseudo-random permutation (Luby-Rackoff); more would only cost time.
const feistel_rounds = 4;

const golden: u64 = 0x9e3779b97f4a7c15;

/// The splitmix64 finaliser: a cheap, well-mixed 64-bit bijection.
fn mix64(value: u64) u64 {
    var x = value;
    x ^= x >> 30;
    x *%= 0xbf58476d1ce4e5b9;
    x ^= x >> 27;
    x *%= 0x94d049bb133111eb;
    x ^= x >> 31;
    return x;
}

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

fn hash2(a: u64, b: u64) u64 {
    return mix64(a ^ mix64(b +% golden));
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
        _ = std.math.mul(u64, config.block_rows, config.window_blocks) catch return .overflow;
    }
    if (config.flags & ~flag_shard_blocks != 0) return .invalid_mode;
    if (shardBlocks(config)) {
        if (config.window_blocks == 0) return .invalid_mode;
        if (ShardShare.init(config, 0).length == 0) return .invalid_length; // More shards than blocks.
    }
    return .ok;
}

/// The global position of the first row this shard takes at `step`, or null on overflow.
fn firstPosition(config: *const SamplerConfig, step: u64) ?u64 {
    const global_batch = std.math.mul(u64, config.batch_size, config.shard_count) catch return null;
    const step_start = std.math.mul(u64, step, global_batch) catch return null;
    const shard_offset = config.batch_size * config.shard_index;
    const first = std.math.add(u64, step_start, shard_offset) catch return null;
    // The last position must fit as well.
    _ = std.math.add(u64, first, config.batch_size) catch return null;
    return first;
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
    if (shardBlocks(config)) {
        const local = shardFirstPosition(config, step) orelse return .overflow;
        fillShardWindowShuffle(config, local, out[0..config.batch_size]);
        return .ok;
    }
    const first = firstPosition(config, step) orelse return .overflow;
    const batch = out[0..config.batch_size];
    switch (@as(Mode, @enumFromInt(config.mode))) {
        .sequential => fillSequential(config.length, first, batch),
        .random => fillRandom(config.length, config.seed, first, batch),
        .shuffle => if (config.window_blocks == 0)
            fillShuffle(config.length, config.seed, first, batch)
        else
            fillWindowShuffle(config, first, batch),
    }
    return .ok;
}

/// The blocks of the window that holds global stream `position` (block-local shuffle),
/// in the order the window deals them, the tail block (rows past the last full block)
/// last where the window holds it: what a reader reads ahead. Writes how many to `count`
/// and the window's number in its epoch to `window_out`; `out` must hold window_blocks + 1.
pub fn windowBlocks(config: *const SamplerConfig, position: u64, out: []u64, count: *u64, window_out: *u64) Status {
    const status = check(config);
    if (status != .ok) return status;
    if (config.window_blocks == 0) return .invalid_mode;
    if (out.len < config.window_blocks + 1) return .output_size_mismatch;
    if (shardBlocks(config)) return shardWindowBlocks(config, position, out, count, window_out);
    const shuffle = WindowShuffle.init(config.length, config.block_rows, config.window_blocks, config.seed,
        position / config.length);
    const window = shuffle.windowOf(position % config.length);
    count.* = shuffle.blocksOf(window, out);
    window_out.* = window;
    return .ok;
}

/// The block-local shuffle of one epoch, for data larger than memory: the epoch's full
/// blocks of `block_rows` consecutive rows are permuted, dealt in order into windows of
/// `window_blocks` blocks, and the rows of each window permuted; the rows past the last
/// full block (fewer than block_rows) join the last window. Each window's rows are a
/// bijection of its blocks' rows and the windows partition the blocks, so every epoch
/// still covers every row once; a reader that reads a window's blocks ahead of use reads
/// the disk in block-sized runs instead of one random row at a time.
pub const WindowShuffle = struct {
    length: u64,
    block_rows: u64,
    window_blocks: u64,
    window_rows: u64,
    full_blocks: u64,
    last_window: u64,
    last_start: u64,
    seed: u64,
    epoch: u64,
    blocks: EpochPermutation,

    pub fn init(length: u64, block_rows: u64, window_blocks: u64, seed: u64, epoch: u64) WindowShuffle {
        std.debug.assert(length > 0);
        std.debug.assert(block_rows > 0);
        std.debug.assert(window_blocks > 0);
        const full_blocks = length / block_rows;
        const window_rows = block_rows * window_blocks;
        const windows = @max(1, (full_blocks + window_blocks - 1) / window_blocks);
        return .{
            .length = length,
            .block_rows = block_rows,
            .window_blocks = window_blocks,
            .window_rows = window_rows,
            .full_blocks = full_blocks,
            .last_window = windows - 1,
            .last_start = (windows - 1) * window_rows,
            .seed = seed,
            .epoch = epoch,
            // Keyed apart from the global shuffle's and the windows' permutations.
            .blocks = EpochPermutation.init(@max(1, full_blocks), hash2(seed, 0x626c6f636b73), epoch), // "blocks"
        };
    }

    pub fn windowOf(self: *const WindowShuffle, offset: u64) u64 {
        std.debug.assert(offset < self.length);
        return if (offset >= self.last_start) self.last_window else offset / self.window_rows;
    }

    pub fn windowStart(self: *const WindowShuffle, window: u64) u64 {
        return window * self.window_rows;
    }

    pub fn windowSize(self: *const WindowShuffle, window: u64) u64 {
        return if (window == self.last_window) self.length - self.last_start else self.window_rows;
    }

    pub fn rowsPermutation(self: *const WindowShuffle, window: u64) EpochPermutation {
        return EpochPermutation.init(self.windowSize(window), hash2(hash2(self.seed, 0x77696e646f77), window), // "window"
            self.epoch);
    }

    /// The blocks `window` deals, in order, the tail block (id full_blocks, the rows past
    /// the last full block) last where the window holds it; returns how many it wrote
    /// (`out` holds window_blocks + 1).
    pub fn blocksOf(self: *const WindowShuffle, window: u64, out: []u64) u64 {
        var written: u64 = 0;
        var slot = window * self.window_blocks;
        const slot_end = @min(slot + self.window_blocks, self.full_blocks);
        while (slot < slot_end) : (slot += 1) {
            out[written] = self.blocks.apply(slot);
            written += 1;
        }
        if (window == self.last_window and self.length > self.full_blocks * self.block_rows) {
            out[written] = self.full_blocks;
            written += 1;
        }
        return written;
    }

    /// The row at `offset` of the epoch, given the permutation of its window's rows.
    pub fn row(self: *const WindowShuffle, window: u64, rows: *const EpochPermutation, offset: u64) u64 {
        const within = rows.apply(offset - self.windowStart(window));
        const slot = window * self.window_blocks + within / self.block_rows;
        if (slot < self.full_blocks) return self.blocks.apply(slot) * self.block_rows + within % self.block_rows;
        // The tail: rows after the last full block, in the last window after its blocks.
        const tail_first = (self.full_blocks - window * self.window_blocks) * self.block_rows;
        return self.full_blocks * self.block_rows + (within - tail_first);
    }
};

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

fn fillShardWindowShuffle(config: *const SamplerConfig, first: u64, out: []u64) void {
    const length = ShardShare.init(config, 0).length; // The same for every epoch.
    var epoch = first / length;
    var offset = first % length;
    var share = ShardShare.init(config, epoch);
    var shuffle = WindowShuffle.init(length, config.block_rows, config.window_blocks, config.seed, epoch);
    var window = shuffle.windowOf(offset);
    var rows = shuffle.rowsPermutation(window);
    for (out) |*slot| {
        const virtual = shuffle.row(window, &rows, offset);
        slot.* = share.rowOf(virtual / config.block_rows, virtual % config.block_rows);
        offset += 1;
        if (offset == length) {
            offset = 0;
            epoch += 1;
            share = ShardShare.init(config, epoch);
            shuffle = WindowShuffle.init(length, config.block_rows, config.window_blocks, config.seed, epoch);
        }
        if (offset == 0 or shuffle.windowOf(offset) != window) {
            window = shuffle.windowOf(offset);
            rows = shuffle.rowsPermutation(window);
        }
    }
}

fn shardWindowBlocks(config: *const SamplerConfig, position: u64, out: []u64, count: *u64, window_out: *u64) Status {
    const length = ShardShare.init(config, 0).length;
    const epoch = position / length;
    const share = ShardShare.init(config, epoch);
    const shuffle = WindowShuffle.init(length, config.block_rows, config.window_blocks, config.seed, epoch);
    const window = shuffle.windowOf(position % length);
    const written = shuffle.blocksOf(window, out);
    // The share's blocks, as dataset blocks (the virtual tail: the share's tail, or a block).
    for (out[0..written]) |*block| block.* = share.blockOf(block.*);
    count.* = written;
    window_out.* = window;
    return .ok;
}

fn fillWindowShuffle(config: *const SamplerConfig, first: u64, out: []u64) void {
    const length = config.length;
    var epoch = first / length;
    var offset = first % length;
    var shuffle = WindowShuffle.init(length, config.block_rows, config.window_blocks, config.seed, epoch);
    var window = shuffle.windowOf(offset);
    var rows = shuffle.rowsPermutation(window);
    for (out) |*slot| {
        slot.* = shuffle.row(window, &rows, offset);
        offset += 1;
        if (offset == length) {
            offset = 0;
            epoch += 1;
            shuffle = WindowShuffle.init(length, config.block_rows, config.window_blocks, config.seed, epoch);
        }
        if (offset == 0 or shuffle.windowOf(offset) != window) {
            window = shuffle.windowOf(offset);
            rows = shuffle.rowsPermutation(window);
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

/// A seeded bijection of [0, length) for one epoch: a mixed-radix Feistel network.
///
/// An offset x is split into low = x mod 2^h and high = x div 2^h, with high in
/// [0, high_count) and high_count = ceil(length / 2^h), so the domain exceeds `length` by
/// less than 2^h (about sqrt(length)) instead of up to 2x for a power-of-two domain. Rounds
/// alternately add a keyed hash of one half to the other, modulo that half's range; each
/// round is invertible, so the whole is a bijection of the domain, and cycle walking maps
/// the rare values past `length` back into range.
pub const EpochPermutation = struct {
    keys: [feistel_rounds]u64,
    multipliers: [feistel_rounds]u64,
    low_bits: u6,
    high_count: u64,
    length: u64,

    pub fn init(length: u64, seed: u64, epoch: u64) EpochPermutation {
        std.debug.assert(length > 0);
        std.debug.assert(length <= length_max);
        // At least two bits, so that both halves are non-trivial.
        const domain_bits: u7 = @max(2, 64 - @as(u7, @clz(length - 1)));
        const low_bits: u6 = @intCast(domain_bits / 2);
        var permutation = EpochPermutation{
            .keys = undefined,
            .multipliers = undefined,
            .low_bits = low_bits,
            .high_count = (length + (@as(u64, 1) << low_bits) - 1) >> low_bits,
            .length = length,
        };
        const epoch_key = hash2(hash2(seed, 0x73687566666c65), epoch); // "shuffle"
        for (&permutation.keys, &permutation.multipliers, 0..) |*key, *multiplier, round| {
            key.* = hash2(epoch_key, round);
            multiplier.* = hash2(epoch_key, round + feistel_rounds) | 1;
        }
        return permutation;
    }

    /// One 64x64->128-bit multiply folded to 64 bits (the "mum" mix of wyhash): every
    /// output bit depends on every input bit, at a fraction of mix64's latency.
    fn roundFunction(half: u64, key: u64, multiplier: u64) u64 {
        const product = std.math.mulWide(u64, half ^ key, multiplier);
        return @as(u64, @truncate(product)) ^ @as(u64, @truncate(product >> 64));
    }

    /// A bijection of [0, high_count << low_bits).
    pub fn permuteDomain(self: *const EpochPermutation, value: u64) u64 {
        const low_mask = (@as(u64, 1) << self.low_bits) - 1;
        var low = value & low_mask;
        var high = value >> self.low_bits;
        std.debug.assert(high < self.high_count);
        var round: usize = 0;
        while (round < feistel_rounds) : (round += 2) {
            low = (low +% roundFunction(high, self.keys[round], self.multipliers[round])) & low_mask;
            // Lemire's multiply-shift maps the hash into [0, high_count) without a division.
            const step = @as(u64, @truncate(std.math.mulWide(
                u64,
                roundFunction(low, self.keys[round + 1], self.multipliers[round + 1]),
                self.high_count,
            ) >> 64));
            high += step;
            if (high >= self.high_count) high -= self.high_count;
        }
        return (high << self.low_bits) | low;
    }

    pub fn apply(self: *const EpochPermutation, offset: u64) u64 {
        std.debug.assert(offset < self.length);
        var value = self.permuteDomain(offset);
        // The domain exceeds the length by less than 2^low_bits, so walks are rare and
        // short; a bijection's cycle through `offset` always comes back into range.
        while (value >= self.length) value = self.permuteDomain(value);
        return value;
    }
};

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

test "shuffle permutation is a bijection for small and odd lengths" {
    for ([_]u64{ 1, 2, 3, 5, 17, 64, 65, 1023 }) |length| {
        const permutation = EpochPermutation.init(length, 11, 2);
        var seen: [1024]bool = @splat(false);
        var offset: u64 = 0;
        while (offset < length) : (offset += 1) {
            const value = permutation.apply(offset);
            try testing.expect(value < length);
            try testing.expect(!seen[value]);
            seen[value] = true;
        }
    }
}

fn windowConfig(length: u64, batch_size: u64, block_rows: u64, window_blocks: u64) SamplerConfig {
    var config = testConfig(length, batch_size, .shuffle);
    config.block_rows = block_rows;
    config.window_blocks = window_blocks;
    return config;
}

test "the block-local shuffle covers every row once per epoch, for tails and single windows" {
    // (length, block rows, blocks per window): a tail, no tail, fewer rows than a block,
    // fewer blocks than a window, a last window of a single block plus the tail.
    const cases = [_][3]u64{ .{ 1000, 16, 4 }, .{ 1024, 16, 4 }, .{ 10, 16, 4 }, .{ 1000, 16, 100 }, .{ 1000, 16, 62 } };
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

test "a window's rows come from its own blocks only" {
    const config = windowConfig(1000, 10, 16, 4);
    var blocks: [5]u64 = undefined;
    var count: u64 = 0;
    var window: u64 = 0;
    var out: [10]u64 = undefined;
    var step: u64 = 0;
    while (step < 100) : (step += 1) {
        try testing.expectEqual(Status.ok, fill(&config, step, &out));
        for (out, 0..) |index, i| {
            try testing.expectEqual(Status.ok, windowBlocks(&config, step * 10 + i, &blocks, &count, &window));
            try testing.expectEqual((step * 10 + i) / 64, window);
            var found = false;
            for (blocks[0..count]) |block| found = found or index / 16 == block;
            try testing.expect(found);
        }
    }
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

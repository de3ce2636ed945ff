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
/// old shards' unread positions through it (shmloader/reshard.py); fill is its batch case.
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

/// sum over i in [0, n) of floor((a * i + b) / m): the floor sum, by the Euclidean-like
/// reduction (each round swaps the roles of a and m, so it takes O(log m) rounds). With
/// m = B < 2^32, n < B and a = b = R (check), every term stays within 64 bits.
fn floorSum(count: u64, modulus: u64, slope: u64, intercept: u64) u64 {
    var n = count;
    var m = modulus;
    var a = slope;
    var b = intercept;
    var sum: u64 = 0;
    while (n > 0) {
        if (a >= m) {
            sum += n * (n - 1) / 2 * (a / m);
            a %= m;
        }
        if (b >= m) {
            sum += n * (b / m);
            b %= m;
        }
        const y_max = a * n + b;
        if (y_max < m) break;
        n = y_max / m;
        b = y_max % m;
        const swapped = m;
        m = a;
        a = swapped;
    }
    return sum;
}

/// The block-local shuffle of one epoch, for data larger than memory: a sliding window.
///
/// The epoch's full blocks (R = block_rows consecutive rows each) are permuted into places
/// 0..F-1. The block at place c is dealt over the B = window_blocks phases c .. c+B-1, a
/// 1/B share of its rows in each: phase p mixes the rows of the B blocks at places
/// p-B+1 .. p (fewer in the first and last B-1 phases, where the window fills and drains),
/// and its rows are permuted together. A block's order is a permutation of 0..R-1 (one per
/// epoch, rotated per place); its share k (k = p - c) is that order's q in [C(k-1), C(k)),
/// C(k) = floor((k+1) R / B). The rows past the last full block (the tail, T < R rows) are
/// dealt in the last B - 1 phases, where the window drains, floor((i+1) T / (B-1)) -
/// floor(i T / (B-1)) of them in the i-th, so that the epoch's last batches still mix
/// several blocks (with B = 1 or no full block they come last, permuted among themselves).
///
/// So every epoch covers every row once, a position maps to its row in O(1) once its phase
/// is known (a binary search over the phases' starts, each a floor sum), and a reader holds
/// about B blocks (one window) at a time: one block opens and one closes per phase, so the
/// disk streams one block per R rows served, and nothing is read twice in an epoch. Phases
/// are R rows where the window is full: a batch draws from B blocks; the first and last
/// B-1 phases of an epoch draw from fewer.
pub const SlidingShuffle = struct {
    length: u64,
    block_rows: u64,
    window_blocks: u64,
    full_blocks: u64,
    full_rows: u64,
    /// Phases with full-block rows: F + B - 1 (none without a full block). The tail's rows
    /// are dealt in the last B - 1 of them, or (tail_phase) make phase `phase_count`.
    phase_count: u64,
    tail_rows: u64,
    tail_phase: bool,
    tail_rotation: u64,
    /// Where phase B - 1 starts: the rows of the phases where the window fills. From there
    /// to phase F, phases are R rows each.
    ramp_rows: u64,
    phase_key: u64,
    epoch: u64,
    blocks: EpochPermutation,
    within: EpochPermutation,
    rotation_key: u64,

    /// One phase: its offsets [start, end) of the epoch deal its blocks' shares q in
    /// [first_q, first_q + block_part) and tail rows tail_first.. after them, in the order
    /// `rows` permutes them.
    pub const Phase = struct {
        index: u64,
        start: u64,
        end: u64,
        first_q: u64,
        block_part: u64,
        tail_first: u64,
        rows: EpochPermutation,
    };

    pub fn init(length: u64, block_rows: u64, window_blocks: u64, seed: u64, epoch: u64) SlidingShuffle {
        std.debug.assert(length > 0);
        std.debug.assert(block_rows > 0);
        std.debug.assert(window_blocks > 0);
        const full_blocks = length / block_rows;
        const within_key = hash2(seed, 0x77697468696e); // "within"
        const ramp_rows = floorSum(window_blocks - 1, window_blocks, block_rows, block_rows);
        const tail_rows = length - full_blocks * block_rows;
        return .{
            .ramp_rows = ramp_rows,
            .tail_rows = tail_rows,
            .tail_phase = tail_rows > 0 and (full_blocks == 0 or window_blocks == 1),
            .tail_rotation = if (tail_rows == 0) 0 else hash2(hash2(seed, 0x7461696c), epoch) % tail_rows, // "tail"
            .length = length,
            .block_rows = block_rows,
            .window_blocks = window_blocks,
            .full_blocks = full_blocks,
            .full_rows = full_blocks * block_rows,
            .phase_count = if (full_blocks == 0) 0 else full_blocks + window_blocks - 1,
            .phase_key = hash2(seed, 0x7068617365), // "phase"
            .epoch = epoch,
            // Keyed apart from the global shuffle's permutation.
            .blocks = EpochPermutation.init(@max(1, full_blocks), hash2(seed, 0x626c6f636b73), epoch), // "blocks"
            .within = EpochPermutation.init(block_rows, within_key, epoch),
            .rotation_key = hash2(within_key, epoch),
        };
    }

    /// C(k): how many of a block's rows its first k + 1 phases deal (R from k = B - 1 on).
    fn dealt(self: *const SlidingShuffle, k: u64) u64 {
        if (k + 1 >= self.window_blocks) return self.block_rows;
        return @intCast(@as(u128, k + 1) * self.block_rows / self.window_blocks);
    }

    /// The sum of C(i) for i in [0, n).
    fn dealtSum(self: *const SlidingShuffle, n: u64) u64 {
        if (n + 1 < self.window_blocks) return floorSum(n, self.window_blocks, self.block_rows, self.block_rows);
        return self.ramp_rows + (n + 1 - self.window_blocks) * self.block_rows;
    }

    /// Tail rows dealt before phase p (p <= phase_count; none with a tail phase).
    fn tailBefore(self: *const SlidingShuffle, p: u64) u64 {
        if (self.tail_phase or p <= self.full_blocks) return 0;
        const drain = self.window_blocks - 1;
        return @intCast(@as(u128, @min(p - self.full_blocks, drain)) * self.tail_rows / drain);
    }

    /// The offset where phase p starts (p <= phase_count): the shares of places up to p
    /// dealt before it, less those of the places before p - F (which do not exist), and
    /// the tail rows before it.
    fn phaseStart(self: *const SlidingShuffle, p: u64) u64 {
        return self.dealtSum(p) - self.dealtSum(p -| self.full_blocks) + self.tailBefore(p);
    }

    fn phaseAt(self: *const SlidingShuffle, p: u64, start: u64) Phase {
        if (self.tail_phase and p == self.phase_count) {
            return .{ .index = p, .start = self.full_rows, .end = self.length, .first_q = 0, .block_part = 0,
                .tail_first = 0, .rows = EpochPermutation.init(self.tail_rows, hash2(self.phase_key, 0x7461696c), self.epoch) }; // "tail"
        }
        const first_q = if (p >= self.full_blocks) self.dealt(p - self.full_blocks) else 0;
        const block_part = self.dealt(p) - first_q;
        const tail_first = self.tailBefore(p);
        const end = start + block_part + self.tailBefore(p + 1) - tail_first;
        return .{ .index = p, .start = start, .end = end, .first_q = first_q, .block_part = block_part,
            .tail_first = tail_first, .rows = EpochPermutation.init(@max(1, end - start), hash2(self.phase_key, p), self.epoch) };
    }

    /// The phase holding `offset` (< length).
    pub fn phaseOf(self: *const SlidingShuffle, offset: u64) Phase {
        const index = self.phaseIndex(offset);
        return self.phaseAt(index, if (self.tail_phase and index == self.phase_count) self.full_rows else self.phaseStart(index));
    }

    /// The index of the phase holding `offset` (< length).
    fn phaseIndex(self: *const SlidingShuffle, offset: u64) u64 {
        std.debug.assert(offset < self.length);
        if (self.tail_phase and offset >= self.full_rows) return self.phase_count;
        // Where the window is full (phases B - 1 .. F - 1), phases are R rows each.
        if (offset >= self.ramp_rows and self.full_blocks + 1 >= self.window_blocks) {
            const phase = self.window_blocks - 1 + (offset - self.ramp_rows) / self.block_rows;
            if (phase < self.full_blocks) return phase;
        }
        // The last phase starting at or before offset: empty phases start where the next
        // one does, so it is the one that holds it.
        var low: u64 = 0;
        var high: u64 = self.phase_count;
        while (high - low > 1) {
            const middle = low + (high - low) / 2;
            if (self.phaseStart(middle) <= offset) low = middle else high = middle;
        }
        return low;
    }

    /// The phase after `phase` that holds at least one row (phase.end < length).
    pub fn nextPhase(self: *const SlidingShuffle, phase: *const Phase) Phase {
        var next = self.phaseAt(phase.index + 1, phase.end);
        while (next.end == next.start) next = self.phaseAt(next.index + 1, next.end);
        return next;
    }

    /// The row at `offset`, which `phase` holds.
    pub fn row(self: *const SlidingShuffle, phase: *const Phase, offset: u64) u64 {
        const within_phase = phase.rows.apply(offset - phase.start);
        if (self.tail_phase and phase.index == self.phase_count) return self.full_rows + within_phase;
        if (within_phase >= phase.block_part) {
            // A tail row, rotated per epoch so that each drain phase gets other tail rows.
            var tail = phase.tail_first + (within_phase - phase.block_part) + self.tail_rotation;
            if (tail >= self.tail_rows) tail -= self.tail_rows;
            return self.full_rows + tail;
        }
        const dealt_index = phase.first_q + within_phase;
        // The share k that dealt index q belongs to: the least k with (q + 1) B <= (k + 1) R.
        const share = ((dealt_index + 1) * self.window_blocks - 1) / self.block_rows;
        const place = phase.index - share;
        // The place's rotation, mapped into [0, R) by Lemire's multiply-shift (no division).
        const rotation: u64 = @truncate(std.math.mulWide(u64, mix64(self.rotation_key ^ place), self.block_rows) >> 64);
        var within = self.within.apply(dealt_index) + rotation;
        if (within >= self.block_rows) within -= self.block_rows;
        return self.blocks.apply(place) * self.block_rows + within;
    }

    /// Places dealt from at or before `offset`: up to its phase's, the tail (place F)
    /// from the first drain phase on, or in its own phase.
    pub fn opened(self: *const SlidingShuffle, offset: u64) u64 {
        const phase = self.phaseIndex(offset);
        const tail_open = self.tail_rows > 0 and phase >= self.full_blocks;
        return @min(phase + 1, self.full_blocks) + @intFromBool(tail_open);
    }

    /// Places whose rows are all dealt before `offset`'s phase (the tail closes with the
    /// epoch).
    pub fn closed(self: *const SlidingShuffle, offset: u64) u64 {
        return @min(self.phaseIndex(offset) -| (self.window_blocks - 1), self.full_blocks);
    }

    /// The block at `place` (the tail block, id F, at place F).
    pub fn placeBlock(self: *const SlidingShuffle, place: u64) u64 {
        return if (place < self.full_blocks) self.blocks.apply(place) else self.full_blocks;
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

test "the floor sum equals the sum it stands for" {
    for ([_]u64{ 1, 2, 3, 7, 16, 100 }) |modulus| {
        for ([_]u64{ 0, 1, 5, 16, 99, 1000 }) |slope| {
            var count: u64 = 0;
            var expected: u64 = 0;
            while (count < 50) : (count += 1) {
                try testing.expectEqual(expected, floorSum(count, modulus, slope, slope));
                expected += (slope * count + slope) / modulus;
            }
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

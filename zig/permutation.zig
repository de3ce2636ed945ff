//! The seeded permutations the samplers are built from: the mixing functions, one epoch's
//! bijection of [0, length) (EpochPermutation), and the sliding block-local shuffle
//! (SlidingShuffle) with its floor sums. Pure functions of their keys, allocation-free.

const std = @import("std");

/// Row counts above this would make the Feistel domain (one bit above N) overflow the
/// 64-bit arithmetic of the round function's masks; 2^62 rows is far past any dataset.
pub const length_max: u64 = 1 << 62;

/// Rounds of the Feistel network, two per half: four rounds with a strong round function
/// give a pseudo-random permutation (Luby-Rackoff); more would only cost time.
const feistel_rounds = 4;

pub const golden: u64 = 0x9e3779b97f4a7c15;

/// The splitmix64 finaliser: a cheap, well-mixed 64-bit bijection.
pub fn mix64(value: u64) u64 {
    var x = value;
    x ^= x >> 30;
    x *%= 0xbf58476d1ce4e5b9;
    x ^= x >> 27;
    x *%= 0x94d049bb133111eb;
    x ^= x >> 31;
    return x;
}

pub fn hash2(a: u64, b: u64) u64 {
    return mix64(a ^ mix64(b +% golden));
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
        std.debug.assert(permutation.valid());
        return permutation;
    }

    /// The invariant apply() stands on: the domain [0, high_count << low_bits) covers
    /// [0, length) and exceeds it by less than 2^low_bits, so that a cycle walk returns
    /// within length in a few steps and every value stays within it.
    pub fn valid(self: *const EpochPermutation) bool {
        if (self.length == 0 or self.length > length_max) return false;
        if (self.high_count == 0 or self.high_count > (length_max >> self.low_bits) + 1) return false;
        const domain = self.high_count << self.low_bits;
        return domain >= self.length and domain - self.length < @as(u64, 1) << self.low_bits;
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

/// sum over i in [0, n) of floor((a * i + b) / m): the floor sum, by the Euclidean-like
/// reduction (each round swaps the roles of a and m, so it takes O(log m) rounds). With
/// m = B < 2^32, n < B and a = b = R (check), every term stays within 64 bits.
pub fn floorSum(count: u64, modulus: u64, slope: u64, intercept: u64) u64 {
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

    /// Whether the shuffle's geometry holds: its rows are the full blocks' and the tail's,
    /// the tail shorter than a block; F + B - 1 phases (none without a full block), whose
    /// starts reach the tail's phase, or the epoch's end, exactly (every row dealt once);
    /// the rows of the phases where the window fills; and both its permutations valid. O(log)
    /// floor sums: checked once per call, never per row.
    pub fn valid(self: *const SlidingShuffle) bool {
        if (self.length == 0 or self.block_rows == 0 or self.window_blocks == 0) return false;
        if (self.full_rows != self.full_blocks * self.block_rows) return false;
        if (self.full_rows + self.tail_rows != self.length or self.tail_rows >= self.block_rows) return false;
        const phases = if (self.full_blocks == 0) 0 else self.full_blocks + self.window_blocks - 1;
        if (self.phase_count != phases) return false;
        // The rows dealt while the window fills (phaseIndex's shortcut from phase B - 1 on)
        // are the floor sum of the shares C(0) .. C(B - 2).
        const ramp = if (self.window_blocks == 1) 0 else self.dealtSum(self.window_blocks - 2) + self.dealt(self.window_blocks - 2);
        if (self.ramp_rows != ramp) return false;
        const dealt_end = if (self.tail_phase) self.full_rows else self.length;
        if (self.phaseStart(self.phase_count) != dealt_end) return false;
        return self.blocks.valid() and self.within.valid();
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
    pub fn phaseStart(self: *const SlidingShuffle, p: u64) u64 {
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

const testing = std.testing;

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

test "a permutation whose domain no longer covers its length, or exceeds it by a half, is not valid" {
    for ([_]u64{ 1, 2, 100, 1 << 40, length_max }) |length| {
        var permutation = EpochPermutation.init(length, 3, 1);
        try testing.expect(permutation.valid());
        permutation.high_count -= 1; // The last values of [0, length) would fall outside the domain.
        try testing.expect(!permutation.valid());
        permutation.high_count += 2; // A walk past length could take 2^low_bits steps.
        try testing.expect(!permutation.valid());
    }
    var empty = EpochPermutation.init(5, 3, 1);
    empty.length = 0;
    try testing.expect(!empty.valid());
}

test "a sliding shuffle whose phases do not deal its epoch exactly is not valid" {
    // Full windows, a tail dealt while the window drains, no tail, one block per window, no full block.
    for ([_][3]u64{ .{ 1000, 64, 4 }, .{ 1024, 64, 4 }, .{ 1000, 64, 1 }, .{ 50, 64, 4 }, .{ 7, 1, 3 } }) |shape| {
        const shuffle = SlidingShuffle.init(shape[0], shape[1], shape[2], 9, 2);
        try testing.expect(shuffle.valid());
        var broken = shuffle;
        broken.phase_count += 1;
        try testing.expect(!broken.valid());
        broken = shuffle;
        broken.tail_rows += shape[1]; // A tail as long as a block.
        try testing.expect(!broken.valid());
        broken = shuffle;
        broken.length += 1; // A row no phase deals.
        try testing.expect(!broken.valid());
        if (shape[2] > 1 and shape[0] >= shape[1]) {
            broken = shuffle;
            broken.ramp_rows += 1; // Phase starts that overrun the epoch.
            try testing.expect(!broken.valid());
        }
        broken = shuffle;
        broken.within.high_count = 0;
        try testing.expect(!broken.valid());
    }
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

//! The tests of sampler.zig (run by `zig test zig/c_api.zig`), apart so that the module reads as
//! what it computes.

const std = @import("std");
const Status = @import("status.zig").Status;
const sampler = @import("sampler.zig");
const SlidingShuffle = sampler.SlidingShuffle;
const Mode = sampler.Mode;
const SamplerConfig = sampler.SamplerConfig;
const boundedDraws = sampler.boundedDraws;
const check = sampler.check;
const flag_shard_blocks = sampler.flag_shard_blocks;
const fill = sampler.fill;
const fillPositions = sampler.fillPositions;
const places = sampler.places;
const placeBlocks = sampler.placeBlocks;
const ShardShare = sampler.ShardShare;
const stepMax = sampler.stepMax;
const globalPosition = sampler.globalPosition;

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

test "stepMax is the last step with a position, for any shape" {
    var prng = std.Random.DefaultPrng.init(11);
    const random = prng.random();
    for (0..2000) |turn| {
        const batch_size = if (turn % 3 == 0) random.int(u64) >> random.uintLessThan(u6, 63) | 1 else random.intRangeAtMost(u64, 1, 1 << 24);
        const shard_count = random.intRangeAtMost(u64, 1, if (turn % 5 == 0) 1 << 20 else 64);
        const shard_index = random.uintLessThan(u64, shard_count);
        const last = stepMax(batch_size, shard_index, shard_count);
        if (globalPosition(0, batch_size, shard_index, shard_count) == null) {
            try testing.expectEqual(@as(u64, 0), last);
            continue;
        }
        try testing.expect(globalPosition(last, batch_size, shard_index, shard_count) != null);
        if (last < std.math.maxInt(u64)) {
            try testing.expect(globalPosition(last + 1, batch_size, shard_index, shard_count) == null);
        }
    }
}

test "places that close before they open, or open past the epoch's places, are an invariant broken" {
    try testing.expectEqual(Status.ok, sampler.checkPlaces(3, 2, 5, 6));
    try testing.expectEqual(Status.ok, sampler.checkPlaces(6, 6, 6, 6));
    try testing.expectEqual(Status.invariant_broken, sampler.checkPlaces(2, 3, 5, 6)); // Closed before opened.
    try testing.expectEqual(Status.invariant_broken, sampler.checkPlaces(5, 2, 4, 6)); // Opened past the epoch's.
    try testing.expectEqual(Status.invariant_broken, sampler.checkPlaces(4, 2, 7, 6)); // More places than blocks.
}

test "a shard's share that reaches past its data is not valid" {
    var config = windowConfig(1000, 10, 16, 4);
    config.shard_count = 3;
    config.shard_index = 1;
    config.flags = flag_shard_blocks;
    const share = ShardShare.init(&config, 2);
    try testing.expect(share.valid(&config));
    var broken = share;
    broken.share_blocks = share.full_blocks; // Every block, on one shard of three.
    try testing.expect(!broken.valid(&config));
    broken = share;
    broken.length += config.block_rows; // A block more than its share holds.
    try testing.expect(!broken.valid(&config));
    broken = share;
    broken.shard_index = 3;
    try testing.expect(!broken.valid(&config));
    broken = share;
    broken.full_blocks += 1; // Blocks the data does not have.
    try testing.expect(!broken.valid(&config));
}

test "every entry's geometry check passes for the shapes the sampler accepts" {
    var configs = [_]SamplerConfig{ testConfig(1, 1, .shuffle), testConfig(97, 8, .shuffle), windowConfig(1000, 8, 16, 4), windowConfig(1000, 8, 16, 1), windowConfig(7, 2, 16, 4), windowConfig(1000, 8, 16, 4) };
    configs[5].shard_count = 3;
    configs[5].shard_index = 2;
    configs[5].flags = flag_shard_blocks;
    var out: [8]u64 = undefined;
    var opened: u64 = 0;
    var closed: u64 = 0;
    var total: u64 = 0;
    for (&configs) |*config| {
        for ([_]u64{ 0, 3, 125, 1 << 20 }) |step| {
            try testing.expectEqual(Status.ok, fill(config, step, out[0..config.batch_size]));
            try testing.expectEqual(Status.ok, fillPositions(config, step * 7 + 1, out[0..5]));
            if (config.window_blocks == 0) continue;
            try testing.expectEqual(Status.ok, places(config, step * 11, &opened, &closed, &total));
            try testing.expect(closed <= opened and opened <= total);
            try testing.expectEqual(Status.ok, placeBlocks(config, step, closed, out[0..@min(8, opened - closed)]));
        }
    }
}

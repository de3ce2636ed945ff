//! The tests of mixture.zig (run by `zig test zig/c_api.zig`), apart so that the module reads as
//! what it computes.

const std = @import("std");
const Status = @import("status.zig").Status;
const mixture = @import("mixture.zig");
const MixtureSource = mixture.MixtureSource;
const MixtureConfig = mixture.MixtureConfig;
const fill = mixture.fill;
const fillInterleaved = mixture.fillInterleaved;
const places = mixture.places;
const placeBlocks = mixture.placeBlocks;

const testing = std.testing;

/// A mixture of `source_list`, whose blocks are the pattern's length, for the tests.
fn testConfig(source_list: []const MixtureSource, pattern_sources: []const u32, pattern_ranks: []const u64,
    batch_size: u64, shard_index: u32, shard_count: u32) MixtureConfig {
    return .{
        .sources = source_list.ptr,
        .source_count = source_list.len,
        .pattern_sources = pattern_sources.ptr,
        .pattern_ranks = pattern_ranks.ptr,
        .block = pattern_sources.len,
        .batch_size = batch_size,
        .shard_index = shard_index,
        .shard_count = shard_count,
    };
}

test "every block holds each source's exact share and each source covers its rows once per epoch" {
    // Weights 2 and 1: pattern A B A; source A has 4 rows, source B 3 (a half fraction: 2).
    const source_list = [_]MixtureSource{
        .{ .length = 4, .take = 4, .weight = 2, .seed = 1, .fixed = 0, .reserved = 0, .block_rows = 0, .window_blocks = 0 },
        .{ .length = 3, .take = 2, .weight = 1, .seed = 2, .fixed = 1, .reserved = 0, .block_rows = 0, .window_blocks = 0 },
    };
    const pattern_sources = [_]u32{ 0, 1, 0 };
    const pattern_ranks = [_]u64{ 0, 0, 1 };
    const config = testConfig(&source_list, &pattern_sources, &pattern_ranks, 3, 0, 1);
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

test "the per-source and the interleaved fills agree" {
    const source_list = [_]MixtureSource{
        .{ .length = 1000, .take = 1000, .weight = 5, .seed = 1, .fixed = 0, .reserved = 0, .block_rows = 0, .window_blocks = 0 },
        .{ .length = 37, .take = 12, .weight = 2, .seed = 2, .fixed = 1, .reserved = 0, .block_rows = 0, .window_blocks = 0 },
        .{ .length = 9, .take = 5, .weight = 1, .seed = 3, .fixed = 0, .reserved = 0, .block_rows = 0, .window_blocks = 0 },
    };
    const pattern_sources = [_]u32{ 0, 1, 0, 2, 0, 1, 0, 0 };
    const pattern_ranks = [_]u64{ 0, 0, 1, 0, 2, 1, 3, 4 };
    const config = testConfig(&source_list, &pattern_sources, &pattern_ranks, 29, 1, 2);
    var rows: [29]u64 = undefined;
    var sources: [29]u32 = undefined;
    var step: u64 = 0;
    while (step < 40) : (step += 1) {
        try testing.expectEqual(Status.ok, fill(&config, step, &rows, &sources));
        // The interleaved pass, from the same starting positions.
        var firsts: [3]u64 = undefined;
        var seen = [_]bool{ false, false, false };
        const first = step * 29 * 2 + 29;
        for (0..29) |i| {
            const position = first + i;
            const offset = position % 8;
            const source_index = pattern_sources[offset];
            if (!seen[source_index]) {
                firsts[source_index] = (position / 8) * source_list[source_index].weight + pattern_ranks[offset];
                seen[source_index] = true;
            }
        }
        var other: [29]u64 = undefined;
        fillInterleaved(&config, &firsts, &sources, &other);
        try testing.expectEqualSlices(u64, &rows, &other);
    }
}

test "a windowed source covers its rows once per epoch, phase by phase, beside a plain one" {
    // Source A: 103 rows in blocks of 4, windows of 3 blocks; B: 10 rows, global shuffle.
    const source_list = [_]MixtureSource{
        .{ .length = 103, .take = 103, .weight = 3, .seed = 5, .fixed = 0, .reserved = 0, .block_rows = 4, .window_blocks = 3 },
        .{ .length = 10, .take = 10, .weight = 1, .seed = 6, .fixed = 0, .reserved = 0, .block_rows = 0, .window_blocks = 0 },
    };
    const pattern_sources = [_]u32{ 0, 1, 0, 0 };
    const pattern_ranks = [_]u64{ 0, 0, 1, 2 };
    const config = testConfig(&source_list, &pattern_sources, &pattern_ranks, 8, 0, 1);
    var rows: [8]u64 = undefined;
    var sources: [8]u32 = undefined;
    var a_rows: [206]u64 = undefined;
    var a_count: usize = 0;
    var step: u64 = 0;
    // 2 epochs of A (206 positions) = 68.67 blocks of 4 positions: 35 steps of 8 cover them.
    while (step < 35) : (step += 1) {
        try testing.expectEqual(Status.ok, fill(&config, step, &rows, &sources));
        for (rows, sources) |row, source| {
            if (source == 0 and a_count < 206) {
                a_rows[a_count] = row;
                a_count += 1;
            }
            if (source == 1) try testing.expect(row < 10);
        }
    }
    try testing.expectEqual(@as(usize, 206), a_count);
    // Every row once per epoch.
    var epoch_seen: [103]u32 = @splat(0);
    for (a_rows[0..103]) |row| epoch_seen[row] += 1;
    for (epoch_seen) |count| try testing.expectEqual(@as(u32, 1), count);
    // Each row comes from a place open at its position (places, placeBlocks).
    var blocks: [4]u64 = undefined;
    var opened: u64 = 0;
    var closed: u64 = 0;
    var total: u64 = 0;
    for (a_rows[0..103], 0..) |row, q| {
        try testing.expectEqual(Status.ok, places(&config, 0, q, &opened, &closed, &total));
        try testing.expectEqual(@as(u64, 26), total); // 25 full blocks and the tail (rows 100..102).
        try testing.expect(closed < opened and opened - closed <= 3);
        try testing.expectEqual(Status.ok, placeBlocks(&config, 0, 0, closed, blocks[0 .. opened - closed]));
        var found = false;
        for (blocks[0 .. opened - closed]) |block| found = found or row / 4 == block;
        try testing.expect(found);
    }
    try testing.expectEqual(Status.invalid_mode, places(&config, 1, 0, &opened, &closed, &total));
}

test "a pattern that ranks a source's offsets out of order, or twice, is refused" {
    const source_list = [_]MixtureSource{
        .{ .length = 4, .take = 4, .weight = 2, .seed = 1, .fixed = 0, .reserved = 0, .block_rows = 0, .window_blocks = 0 },
        .{ .length = 3, .take = 3, .weight = 1, .seed = 2, .fixed = 0, .reserved = 0, .block_rows = 0, .window_blocks = 0 },
    };
    const pattern_sources = [_]u32{ 0, 1, 0 };
    var rows: [3]u64 = undefined;
    var sources: [3]u32 = undefined;
    const good = [_]u64{ 0, 0, 1 };
    try testing.expectEqual(Status.ok, mixture.check(&testConfig(&source_list, &pattern_sources, &good, 3, 0, 1)));
    const swapped = [_]u64{ 1, 0, 0 }; // Source 0's second position drawn first: q would step back.
    const twice = [_]u64{ 0, 0, 0 }; // Source 0's position 0 drawn twice a block, position 1 never.
    for ([_][3]u64{ swapped, twice }) |ranks| {
        const config = testConfig(&source_list, &pattern_sources, &ranks, 3, 0, 1);
        try testing.expectEqual(Status.invalid_pattern, mixture.check(&config));
        try testing.expectEqual(Status.invalid_pattern, fill(&config, 0, &rows, &sources));
    }
}

//! The tests of gather.zig (run by `zig test zig/c_api.zig`), apart so that the module reads as
//! what it computes.

const std = @import("std");
const Status = @import("status.zig").Status;
const gather = @import("gather.zig");
const GatherError = gather.GatherError;
const gatherRows = gather.gatherRows;
const BloscLayout = gather.BloscLayout;
const chunk_header_bytes = gather.chunk_header_bytes;
const singleBlockSplit = gather.singleBlockSplit;
const gatherBlosc = gather.gatherBlosc;
const gatherPartsRaw = gather.gatherPartsRaw;
const partOf = gather.partOf;
const gatherRangesRaw = gather.gatherRangesRaw;
const gatherRangesBlosc = gather.gatherRangesBlosc;

const testing = std.testing;

test "gatherRows copies rows in index order and rejects bad indices" {
    const table = [_]u8{ 0, 1, 10, 11, 20, 21 };
    var out: [6]u8 = undefined;
    var failure: GatherError = undefined;
    try testing.expectEqual(Status.ok, gatherRows(&table, 3, 2, &[_]u64{ 2, 0, 2 }, &out, &failure));
    try testing.expectEqualSlices(u8, &[_]u8{ 20, 21, 0, 1, 20, 21 }, &out);
    try testing.expectEqual(Status.index_out_of_range, gatherRows(&table, 3, 2, &[_]u64{ 0, 3, 1 }, &out, &failure));
    try testing.expectEqual(@as(u64, 1), failure.position);
}

/// A stand-in for blosc2_getitem_ctx over "chunks" that are stored uncompressed after a
/// 32-byte header, so that the block logic can be tested without libblosc2.
fn fakeGetItem(
    context: ?*anyopaque,
    source: ?*const anyopaque,
    source_bytes: i32,
    start_item: c_int,
    item_count: c_int,
    destination: ?*anyopaque,
    destination_bytes: i32,
) callconv(.c) c_int {
    const calls: *u64 = @ptrCast(@alignCast(context.?));
    calls.* += 1;
    const chunk: [*]const u8 = @ptrCast(source.?);
    const start: usize = @intCast(start_item);
    const count: usize = @intCast(item_count);
    if (start + count > @as(usize, @intCast(source_bytes)) - chunk_header_bytes) return -1;
    if (count > @as(usize, @intCast(destination_bytes))) return -1;
    const target: [*]u8 = @ptrCast(destination.?);
    @memcpy(target[0..count], chunk[chunk_header_bytes + start ..][0..count]);
    return item_count;
}

/// Two stand-in chunks of 4 one-byte rows holding 0..3 and 4..7 (header byte 3 is the
/// typesize, 1), for the fakeGetItem tests.
const FakeChunks = struct {
    a: [36]u8,
    b: [36]u8,

    fn init() FakeChunks {
        var chunks = FakeChunks{ .a = @splat(0), .b = @splat(0) };
        chunks.a[3] = 1;
        chunks.b[3] = 1;
        for (0..4) |row| {
            chunks.a[32 + row] = @intCast(row);
            chunks.b[32 + row] = @intCast(4 + row);
        }
        return chunks;
    }

    fn addresses(chunks: *const FakeChunks) [2]u64 {
        return .{ @intFromPtr(&chunks.a), @intFromPtr(&chunks.b) };
    }

    /// A layout over `addresses` of one-byte rows, 4 per chunk, read through fakeGetItem.
    fn layout(chunk_addresses: *const [2]u64, calls: *u64, row_count: u64, rows_per_block: u64, block_buffer: []u8, order_buffer: []u128) BloscLayout {
        const sizes = struct {
            const both = [_]u64{ 36, 36 };
        };
        return .{
            .getitem = fakeGetItem,
            .context = calls,
            .chunk_addresses = chunk_addresses,
            .chunk_bytes = &sizes.both,
            .chunk_count = 2,
            .row_count = row_count,
            .rows_per_chunk = 4,
            .rows_per_block = rows_per_block,
            .row_bytes = 1,
            .block_buffer = block_buffer.ptr,
            .block_buffer_bytes = block_buffer.len,
            .order_buffer = order_buffer.ptr,
            .order_buffer_count = order_buffer.len,
            .digests = null,
            .digest_stride = 0,
            .digests_checked = null,
        };
    }
};

test "gatherBlosc decompresses each shared block once and keeps batch order" {
    // Blocks of 2 rows over the two chunks of 4.
    const chunks = FakeChunks.init();
    const addresses = chunks.addresses();
    var calls: u64 = 0;
    var block_buffer: [2]u8 = undefined;
    var order_buffer: [5]u128 = undefined;
    const layout = FakeChunks.layout(&addresses, &calls, 7, 2, &block_buffer, &order_buffer);
    var out: [5]u8 = undefined;
    var failure: GatherError = undefined;
    try testing.expectEqual(Status.ok, gatherBlosc(&layout, &[_]u64{ 5, 0, 1, 4, 6 }, &out, &failure));
    try testing.expectEqualSlices(u8, &[_]u8{ 5, 0, 1, 4, 6 }, &out);
    // Blocks {0,1}, {4,5} and {6}: three decompressions for five rows.
    try testing.expectEqual(@as(u64, 3), calls);
    try testing.expectEqual(Status.index_out_of_range, gatherBlosc(&layout, &[_]u64{ 7, 0, 0, 0, 0 }, &out, &failure));
}

test "singleBlockSplit cuts exactly the ranges libblosc2's getitem misreads" {
    // A chunk of 10,000 bytes in blocks of 4,096: two full blocks and a last one of 1,808.
    var header: [chunk_header_bytes]u8 = @splat(0);
    std.mem.writeInt(u32, header[4..8], 10_000, .little);
    std.mem.writeInt(u32, header[8..12], 4096, .little);
    // Aligned starts, ranges inside one block, and other lengths are read in one call.
    try testing.expectEqual(@as(u64, 0), singleBlockSplit(&header, 0, 4096));
    try testing.expectEqual(@as(u64, 0), singleBlockSplit(&header, 4096, 4096));
    try testing.expectEqual(@as(u64, 0), singleBlockSplit(&header, 100, 3996));
    try testing.expectEqual(@as(u64, 0), singleBlockSplit(&header, 100, 4095));
    try testing.expectEqual(@as(u64, 0), singleBlockSplit(&header, 100, 4097));
    // A block-long range from inside a block is cut at the boundary.
    try testing.expectEqual(@as(u64, 3996), singleBlockSplit(&header, 100, 4096));
    // So is one as long as the last block that reaches it.
    try testing.expectEqual(@as(u64, 1192), singleBlockSplit(&header, 7000, 1808));
    // A header without a block size (the stand-in chunks below) is never cut.
    var bare: [chunk_header_bytes]u8 = @splat(0);
    try testing.expectEqual(@as(u64, 0), singleBlockSplit(&bare, 100, 4096));
}

test "gatherRangesRaw copies element ranges to their destinations and checks them first" {
    const table = [_]u8{ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 };
    var out: [8]u8 = @splat(0xAA);
    var failure: GatherError = undefined;
    try testing.expectEqual(Status.ok, gatherRangesRaw(&table, 10, 1, &[_]u64{ 7, 2 }, &[_]u64{ 3, 2 }, &[_]u64{ 0, 5 }, &out, &failure));
    try testing.expectEqualSlices(u8, &[_]u8{ 7, 8, 9, 0xAA, 0xAA, 2, 3, 0xAA }, &out);
    try testing.expectEqual(Status.index_out_of_range, gatherRangesRaw(&table, 10, 1, &[_]u64{ 1, 8 }, &[_]u64{ 1, 3 }, &[_]u64{ 0, 1 }, &out, &failure));
    try testing.expectEqual(@as(u64, 1), failure.position);
    try testing.expectEqual(Status.output_size_mismatch, gatherRangesRaw(&table, 10, 1, &[_]u64{0}, &[_]u64{4}, &[_]u64{6}, &out, &failure));
}

test "gatherRangesBlosc splits a range at chunk boundaries" {
    const chunks = FakeChunks.init();
    const addresses = chunks.addresses();
    var calls: u64 = 0;
    const layout = FakeChunks.layout(&addresses, &calls, 8, 1, &.{}, &.{});
    var out: [7]u8 = @splat(0);
    var failure: GatherError = undefined;
    try testing.expectEqual(Status.ok, gatherRangesBlosc(&layout, &[_]u64{ 2, 6 }, &[_]u64{ 5, 2 }, &[_]u64{ 0, 5 }, &out, &failure));
    try testing.expectEqualSlices(u8, &[_]u8{ 2, 3, 4, 5, 6, 6, 7 }, &out);
    try testing.expectEqual(@as(u64, 3), calls); // 2..3, 4..6, then 6..7.
    try testing.expectEqual(Status.index_out_of_range, gatherRangesBlosc(&layout, &[_]u64{7}, &[_]u64{2}, &[_]u64{0}, &out, &failure));
}

test "gatherPartsRaw finds each row's part at every boundary" {
    const part_a = [_]u8{ 0, 1, 2 };
    const part_b = [_]u8{3};
    const part_c = [_]u8{ 4, 5 };
    const tables = [_]u64{ @intFromPtr(&part_a), @intFromPtr(&part_b), @intFromPtr(&part_c) };
    const starts = [_]u64{ 0, 3, 4 };
    var out: [6]u8 = undefined;
    var failure: GatherError = undefined;
    try testing.expectEqual(Status.ok, gatherPartsRaw(&tables, &starts, 6, 1, &[_]u64{ 5, 3, 2, 4, 0, 1 }, &.{}, &out, &failure));
    try testing.expectEqualSlices(u8, &[_]u8{ 5, 3, 2, 4, 0, 1 }, &out);
    var scattered: [4]u8 = @splat(9);
    try testing.expectEqual(Status.ok, gatherPartsRaw(&tables, &starts, 6, 1, &[_]u64{ 4, 2 }, &[_]u64{ 3, 0 }, &scattered, &failure));
    try testing.expectEqualSlices(u8, &[_]u8{ 2, 9, 9, 4 }, &scattered);
    try testing.expectEqual(Status.index_out_of_range, gatherPartsRaw(&tables, &starts, 6, 1, &[_]u64{6}, &.{}, out[0..1], &failure));
}

test "partOf finds the part of every row, for even and skewed parts" {
    const even = [_]u64{ 0, 10, 20, 30, 40 };
    const skewed = [_]u64{ 0, 1, 2, 3, 1000 };
    var index: u64 = 0;
    while (index < 1010) : (index += 1) {
        if (index < 50) try testing.expectEqual(@as(usize, @intCast(index / 10)), partOf(&even, 50, index));
        const expected: usize = if (index >= 1000) 4 else @intCast(@min(index, 3));
        try testing.expectEqual(expected, partOf(&skewed, 1010, index));
    }
}

//! The tests of block_digests.zig (run by `zig test zig/c_api.zig`): which bytes each part
//! covers, and that a changed byte is found in the part a read touches, once.

const std = @import("std");
const block_digests = @import("block_digests.zig");
const xxh3 = @import("xxh3.zig");
const testing = std.testing;

/// A chunk of 3 blocks of 4 bytes, stored out of order (block 1 first) after a header and
/// a table of block starts, as several compression threads leave them.
fn tableChunk() [68]u8 {
    var chunk: [68]u8 = @splat(0);
    chunk[3] = 1;
    std.mem.writeInt(u32, chunk[4..8], 12, .little); // Uncompressed bytes.
    std.mem.writeInt(u32, chunk[8..12], 4, .little); // Block bytes.
    std.mem.writeInt(u32, chunk[12..16], 68, .little); // Stored bytes.
    for ([_]u32{ 52, 44, 60 }, 0..) |start, block| std.mem.writeInt(u32, chunk[32 + 4 * block ..][0..4], start, .little);
    for (44..68) |at| chunk[at] = @intCast(at);
    return chunk;
}

test "the parts of a chunk tile its stored bytes, blocks in any stored order" {
    const chunk = tableChunk();
    const blocks = block_digests.blocksOf(&chunk, chunk.len).?;
    try testing.expectEqual(@as(u64, 3), blocks.count);
    const expected = [_][2]u64{ .{ 0, 44 }, .{ 52, 60 }, .{ 44, 52 }, .{ 60, 68 } };
    for (expected, 0..) |bounds, part| {
        const extent = block_digests.partExtent(&chunk, blocks, part).?;
        try testing.expectEqual(bounds[0], extent.start);
        try testing.expectEqual(bounds[1], extent.end);
    }
    var digests: [5]u32 = undefined;
    try testing.expectEqual(@as(?u64, 4), block_digests.chunkDigests(&chunk, chunk.len, &digests));
    try testing.expectEqual(block_digests.digest(chunk[52..60]), digests[1]);
    try testing.expectEqual(@as(u32, 0), digests[4]);
    // A table that points into itself or past the chunk is refused, not followed.
    var bad = chunk;
    std.mem.writeInt(u32, bad[32..36], 40, .little);
    try testing.expectEqual(@as(?u64, null), block_digests.chunkDigests(&bad, bad.len, &digests));
    std.mem.writeInt(u32, bad[32..36], 68, .little);
    try testing.expectEqual(@as(?u64, null), block_digests.chunkDigests(&bad, bad.len, &digests));
}

test "a chunk of one repeated value is all head" {
    var chunk: [40]u8 = @splat(0);
    std.mem.writeInt(u32, chunk[4..8], 4096, .little);
    std.mem.writeInt(u32, chunk[8..12], 1024, .little);
    std.mem.writeInt(u32, chunk[12..16], 40, .little);
    chunk[31] = 0x10; // A special chunk: its value follows the header.
    var digests: [3]u32 = undefined;
    try testing.expectEqual(@as(?u64, 1), block_digests.chunkDigests(&chunk, chunk.len, &digests));
    try testing.expectEqual(block_digests.digest(&chunk), digests[0]);
}

test "a read checks the head and the blocks under it once, and finds a changed byte there" {
    var chunk = tableChunk();
    var digests: [4]u32 = undefined;
    _ = block_digests.chunkDigests(&chunk, chunk.len, &digests).?;
    var checked: [1]u64 = .{0};
    const checker: block_digests.Checker = .{ .digests = &digests, .stride = 4, .checked = &checked, .chunk_count = 1 };
    chunk[50] ^= 1; // In block 1's stored bytes.
    // Bytes 0..8 lie in blocks 0 and 1 (uncompressed): block 1 is found.
    try testing.expectEqual(@as(?u64, 2), checker.checkRange(0, &chunk, chunk.len, 0, 8));
    try testing.expectEqual(@as(u64, 0b11), checked[0]); // The head and block 0 matched.
    // Block 2 alone reads none of block 1's bytes.
    try testing.expectEqual(@as(?u64, null), checker.checkRange(0, &chunk, chunk.len, 8, 4));
    chunk[50] ^= 1;
    try testing.expectEqual(@as(?u64, null), checker.checkRange(0, &chunk, chunk.len, 4, 4));
    try testing.expectEqual(@as(u64, 0b1111), checked[0]);
    // A changed header is the head's: found before any block is trusted.
    checked[0] = 0;
    chunk[8] ^= 1;
    try testing.expectEqual(@as(?u64, 0), checker.checkRange(0, &chunk, chunk.len, 0, 4));
}

test "the digest is XXH3-64's low half at every length, its vector loop included" {
    var bytes: [5000]u8 = undefined;
    for (&bytes, 0..) |*byte, at| byte.* = @truncate(at *% 2654435761 >> 11);
    // Around the short/long switch (240), a scramble (1024) and the overlapping last stripe.
    // Every loop: 512-bit and 256-bit where this CPU has AVX-512 or AVX2 and the build is
    // LLVM's (zig test -OReleaseFast), and the 128-bit one.
    defer xxh3.avx2_allowed = true;
    defer xxh3.avx512_allowed = true;
    for ([_][2]bool{ .{ true, true }, .{ true, false }, .{ false, false } }) |allowed| {
        xxh3.avx2_allowed, xxh3.avx512_allowed = allowed;
        for ([_]usize{ 0, 1, 32, 240, 241, 255, 1023, 1024, 1025, 1088, 3072, 4999, 5000 }) |length| {
            const expected: u32 = @truncate(std.hash.XxHash3.hash(0, bytes[0..length]));
            try testing.expectEqual(expected, block_digests.digest(bytes[0..length]));
        }
    }
}

test "a block ends at the next stored start, found four at a time past a table's first quad" {
    // 9 blocks of 8 bytes stored in a shuffled order after a 68-byte head.
    const order = [_]u32{ 5, 0, 8, 2, 7, 1, 6, 3, 4 };
    var chunk: [68 + 72]u8 = @splat(0);
    std.mem.writeInt(u32, chunk[4..8], 72, .little);
    std.mem.writeInt(u32, chunk[8..12], 8, .little);
    std.mem.writeInt(u32, chunk[12..16], chunk.len, .little);
    for (order, 0..) |slot, block| std.mem.writeInt(u32, chunk[32 + 4 * block ..][0..4], 68 + 8 * slot, .little);
    const blocks = block_digests.blocksOf(&chunk, chunk.len).?;
    try testing.expectEqual(@as(u64, 9), blocks.count);
    for (order, 0..) |slot, block| {
        const extent = block_digests.partExtent(&chunk, blocks, 1 + block).?;
        try testing.expectEqual(@as(u64, 68 + 8 * slot), extent.start);
        try testing.expectEqual(@as(u64, 68 + 8 * slot + 8), extent.end);
    }
}

test "a chunk whose table lists its blocks in order has its blocks checked from their neighbours' starts" {
    // The chunk of the first test with its blocks stored in table order.
    var chunk = tableChunk();
    for ([_]u32{ 44, 52, 60 }, 0..) |start, block| std.mem.writeInt(u32, chunk[32 + 4 * block ..][0..4], start, .little);
    var digests: [4]u32 = undefined;
    _ = block_digests.chunkDigests(&chunk, chunk.len, &digests).?;
    var checked: [1]u64 = .{0};
    const checker: block_digests.Checker = .{ .digests = &digests, .stride = 4, .checked = &checked, .chunk_count = 1 };
    try testing.expectEqual(@as(?u64, null), checker.checkRange(0, &chunk, chunk.len, 0, 12));
    try testing.expectEqual(@as(u64, 0b11111), checked[0]); // Every part, and the in-order bit.
    checked[0] = 0;
    chunk[61] ^= 1; // In block 2, the last: it ends at the chunk's end.
    try testing.expectEqual(@as(?u64, 3), checker.checkRange(0, &chunk, chunk.len, 8, 4));
}

test "page digests are each page's digest, the last page short, and refuse a wrong count" {
    var data: [100]u8 = undefined;
    for (&data, 0..) |*byte, at| byte.* = @truncate(at * 7);
    var digests: [4]u32 = undefined;
    try testing.expect(block_digests.pageDigests(&data, 32, &digests));
    for (0..4) |page| {
        try testing.expectEqual(block_digests.digest(data[page * 32 .. @min(100, page * 32 + 32)]), digests[page]);
    }
    try testing.expect(!block_digests.pageDigests(&data, 32, digests[0..3]));
    try testing.expect(!block_digests.pageDigests(&data, 0, &digests));
    try testing.expect(block_digests.pageDigests(data[0..0], 32, digests[0..0]));
}

test "page digests at listed pages are those pages' digests, and refuse a page past the data" {
    var data: [100]u8 = undefined;
    for (&data, 0..) |*byte, at| byte.* = @truncate(at * 13);
    var all: [4]u32 = undefined;
    try testing.expect(block_digests.pageDigests(&data, 32, &all));
    const pages = [_]u64{ 3, 0, 3, 1 };
    var digests: [4]u32 = undefined;
    try testing.expect(block_digests.pageDigestsAt(&data, 32, &pages, &digests));
    for (pages, digests) |page, value| try testing.expectEqual(all[page], value);
    try testing.expect(!block_digests.pageDigestsAt(&data, 32, &[_]u64{4}, digests[0..1]));
    try testing.expect(!block_digests.pageDigestsAt(&data, 32, &pages, digests[0..3]));
}

//! Block digests of Blosc2 chunks: which bytes of a chunk each digest covers, the digests
//! `shmloader convert` stores, and the check a gather makes before it decompresses a block.
//!
//! A chunk splits into parts that tile its stored bytes: part 0, its head (the 32-byte
//! header, the table of block starts and a dictionary if any: every byte before the first
//! block), then part 1 + b, block b's stored bytes (from its start to the next stored
//! block's start, or the chunk's end). A gather that reads block b of a chunk reads that
//! chunk's head and block b alone, so checking those two parts the first time it reads
//! them vouches for every byte it decompresses, and costs a hash of bytes it reads anyway
//! (the whole-chunk CRC-32 costs every block of a chunk at its first row).
//! Its tests: block_digests_test.zig.

const std = @import("std");

pub const chunk_header_bytes = 32;

/// The digest of one part: the low 32 bits of XXH64 with seed 0 (as the `xxhash` package
/// computes it, which the tests use as the reference). XXH64 runs at several GB/s on the
/// baseline x86-64 and ARM64 this library is built for, with no CPU feature to dispatch on.
pub fn digest(bytes: []const u8) u32 {
    return @truncate(std.hash.XxHash64.hash(0, bytes));
}

pub const Extent = struct { start: u64, end: u64 };

/// How a chunk's header lays its blocks out (read from bytes no digest has vouched for
/// yet: every field is bounded before it is used).
pub const Blocks = struct {
    /// Blocks stored (0 for a chunk Blosc2 makes of one value: its head is all of it).
    count: u64,
    /// Uncompressed bytes per block.
    block_bytes: u64,
    /// The chunk's stored bytes, as its header says (at most what the caller knows of).
    stored_bytes: u64,
    /// Blocks stored as they are, one after another after the header.
    copied: bool,
};

/// The block layout of `chunk` (`chunk_bytes` bytes are readable), or null where the
/// header contradicts itself or the bytes it lies in.
pub fn blocksOf(chunk: [*]const u8, chunk_bytes: u64) ?Blocks {
    if (chunk_bytes < chunk_header_bytes) return null;
    const uncompressed: u64 = std.mem.readInt(u32, chunk[4..8], .little);
    const block_bytes: u64 = std.mem.readInt(u32, chunk[8..12], .little);
    const stored: u64 = std.mem.readInt(u32, chunk[12..16], .little);
    if (stored < chunk_header_bytes or stored > chunk_bytes) return null;
    const flags = chunk[2];
    const flags2 = chunk[31];
    const special = (flags2 >> 4) & 0x7 != 0; // Zeros, NaNs, uninitialised, a repeated value.
    if (special or uncompressed == 0 or block_bytes == 0) {
        return .{ .count = 0, .block_bytes = block_bytes, .stored_bytes = stored, .copied = false };
    }
    const count = (uncompressed + block_bytes - 1) / block_bytes;
    const copied = flags & 0x2 != 0; // BLOSC_MEMCPYED.
    if (copied) {
        if (chunk_header_bytes + uncompressed > stored) return null;
    } else if (chunk_header_bytes + 4 * count > stored) return null;
    return .{ .count = count, .block_bytes = block_bytes, .stored_bytes = stored, .copied = copied };
}

fn blockStart(chunk: [*]const u8, block: u64) u64 {
    const at = chunk_header_bytes + 4 * block;
    return std.mem.readInt(u32, chunk[at..][0..4], .little);
}

/// The bytes part `part` of a chunk covers (0: the head; 1 + b: block b), or null where
/// the chunk's table of block starts points outside it. `blocks` is blocksOf(chunk).
pub fn partExtent(chunk: [*]const u8, blocks: Blocks, part: u64) ?Extent {
    std.debug.assert(part <= blocks.count);
    const stored = blocks.stored_bytes;
    if (blocks.count == 0) return .{ .start = 0, .end = stored };
    if (blocks.copied) {
        if (part == 0) return .{ .start = 0, .end = chunk_header_bytes };
        const uncompressed_end = @min(part * blocks.block_bytes, stored - chunk_header_bytes);
        return .{ .start = chunk_header_bytes + (part - 1) * blocks.block_bytes, .end = chunk_header_bytes + uncompressed_end };
    }
    const table_end = chunk_header_bytes + 4 * blocks.count;
    if (part == 0) {
        // Bounded by the table's length: each start is read once.
        var first: u64 = stored;
        for (0..blocks.count) |block| first = @min(first, blockStart(chunk, block));
        if (first < table_end) return null;
        return .{ .start = 0, .end = first };
    }
    const start = blockStart(chunk, part - 1);
    if (start < table_end or start >= stored) return null;
    // Blocks compressed by several threads are stored in the order they finished: a block
    // ends where the next stored one starts, whichever block that is.
    var end: u64 = stored;
    for (0..blocks.count) |block| {
        const other = blockStart(chunk, block);
        if (other > start and other < end) end = other;
    }
    return .{ .start = start, .end = end };
}

/// Every part's digest of one chunk (head first), written to `out`; the rest of `out` is
/// zeroed. Returns the parts written, or null where the chunk's layout is unreadable or
/// has more parts than `out` holds.
pub fn chunkDigests(chunk: [*]const u8, chunk_bytes: u64, out: []u32) ?u64 {
    const blocks = blocksOf(chunk, chunk_bytes) orelse return null;
    if (1 + blocks.count > out.len) return null;
    @memset(out, 0);
    for (0..1 + blocks.count) |part| {
        const extent = partExtent(chunk, blocks, part) orelse return null;
        out[part] = digest(chunk[extent.start..extent.end]);
    }
    return 1 + blocks.count;
}

/// What a gather checks before it reads a chunk's bytes: each part's stored digest
/// (`stride` per chunk, head first) and one bit per part, set once the part matched in
/// this process (a part is checked the first time a gather reads it, never again).
pub const Checker = struct {
    digests: [*]const u32,
    stride: u64,
    checked: [*]u64,

    fn isChecked(self: Checker, index: u64) bool {
        return self.checked[index / 64] & (@as(u64, 1) << @intCast(index % 64)) != 0;
    }

    fn markChecked(self: Checker, index: u64) void {
        self.checked[index / 64] |= @as(u64, 1) << @intCast(index % 64);
    }

    /// Checks the parts of chunk `chunk_index` that uncompressed bytes [byte_start,
    /// byte_start + byte_count) are read from: its head, then the blocks under the range.
    /// Returns null when they all match, else the first part that does not (0: the head).
    pub fn checkRange(self: Checker, chunk_index: u64, chunk: [*]const u8, chunk_bytes: u64, byte_start: u64, byte_count: u64) ?u64 {
        const first_index = chunk_index * self.stride;
        // Read from bytes not vouched for yet, but bounded; once the head matches, they are
        // the header and table as written.
        const blocks = blocksOf(chunk, chunk_bytes) orelse return 0;
        if (!self.isChecked(first_index)) {
            // The head first: it holds the header and table the block extents come from.
            if (1 + blocks.count > self.stride) return 0;
            const extent = partExtent(chunk, blocks, 0) orelse return 0;
            if (digest(chunk[extent.start..extent.end]) != self.digests[first_index]) return 0;
            self.markChecked(first_index);
        }
        if (blocks.count == 0 or byte_count == 0) return null;
        const first_block = byte_start / blocks.block_bytes;
        const last_block = @min((byte_start + byte_count - 1) / blocks.block_bytes, blocks.count - 1);
        var block = first_block;
        while (block <= last_block) : (block += 1) {
            const index = first_index + 1 + block;
            if (self.isChecked(index)) continue;
            // Loaded first: its cache miss then overlaps the hash instead of following it.
            const expected = @as(*volatile const u32, &self.digests[index]).*;
            const extent = partExtent(chunk, blocks, 1 + block) orelse return 1 + block;
            if (digest(chunk[extent.start..extent.end]) != expected) return 1 + block;
            self.markChecked(index);
        }
        return null;
    }
};

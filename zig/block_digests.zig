//! Block digests of Blosc2 chunks: which bytes of a chunk each digest covers, the digests
//! `shmloader convert` stores, and the checks a gather makes around libblosc2's read of a
//! block (its chunk's head before, the block after, while its bytes are in cache).
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
const xxh3 = @import("xxh3.zig");

pub const chunk_header_bytes = 32;

/// The digest of one part: the low 32 bits of XXH3-64 with seed 0 (as the `xxhash` package
/// computes it, which the tests use as the reference).
pub fn digest(bytes: []const u8) u32 {
    return @truncate(xxh3.hash(bytes));
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
    if (stored < chunk_header_bytes or stored > chunk_bytes or stored > std.math.maxInt(i32)) return null;
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

const table_start = chunk_header_bytes;

/// The smallest of `count` little-endian block starts at `table` above `start`, or
/// `stored` when none is. Four at a time: a gather asks once per block it reads. Starts
/// and `stored` fit an i32 (a chunk is at most 2 GiB: blocksOf and the gather check),
/// whose compares the baseline CPU has in vectors.
fn nextStart(table: [*]const u8, count: u64, start: u64, stored: u64) u64 {
    std.debug.assert(stored <= std.math.maxInt(i32) and start < stored);
    const Quad = @Vector(4, i32);
    const above: Quad = @splat(@intCast(start));
    var smallest: Quad = @splat(@intCast(stored));
    var block: u64 = 0;
    while (block + 4 <= count) : (block += 4) {
        var starts = @as(*align(1) const Quad, @ptrCast(table + 4 * block)).*;
        if (@import("builtin").cpu.arch.endian() != .little) starts = @byteSwap(starts);
        smallest = @select(i32, starts > above, @min(smallest, starts), smallest);
    }
    var end: u64 = @intCast(@reduce(.Min, smallest));
    while (block < count) : (block += 1) {
        const other: u64 = std.mem.readInt(u32, table[4 * block ..][0..4], .little);
        if (other > start and other < end) end = other;
    }
    return end;
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
    return .{ .start = start, .end = nextStart(chunk + table_start, blocks.count, start, stored) };
}

/// partExtent of block part `part` of a chunk whose table lists its blocks in stored order
/// (strictly increasing starts, which Checker.checkHead found): the block ends where the
/// next one in the table starts, one entry away, instead of at the smallest start above it.
fn inOrderBlockExtent(chunk: [*]const u8, blocks: Blocks, part: u64) Extent {
    std.debug.assert(part >= 1 and part <= blocks.count and !blocks.copied);
    const start = blockStart(chunk, part - 1);
    const end = if (part < blocks.count) blockStart(chunk, part) else blocks.stored_bytes;
    return .{ .start = start, .end = end };
}

/// Whether a chunk's table lists its blocks in stored order, each start inside the chunk
/// past the table.
fn tableInOrder(chunk: [*]const u8, blocks: Blocks) bool {
    if (blocks.copied or blocks.count == 0) return false;
    var previous: u64 = chunk_header_bytes + 4 * blocks.count - 1;
    for (0..blocks.count) |block| {
        const start = blockStart(chunk, block);
        if (start <= previous) return false;
        previous = start;
    }
    return previous < blocks.stored_bytes;
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

/// The digest of each `page_bytes` page of `data` (the last one may be shorter) into
/// `out`, which holds exactly one entry per page: the node cache's page digests
/// (shmloader/remote/pages.py), taken as a download hands its bytes over. False where
/// `page_bytes` is 0 or `out` has another length.
pub fn pageDigests(data: []const u8, page_bytes: u64, out: []u32) bool {
    if (page_bytes == 0) return false;
    const pages = (data.len + page_bytes - 1) / page_bytes;
    if (pages != out.len) return false;
    for (out, 0..) |*value, page| {
        const start = page * page_bytes;
        value.* = digest(data[start..@min(data.len, start + page_bytes)]);
    }
    return true;
}

/// The digest of the `page_bytes` pages of `data` that `pages` lists (by index, in any
/// order; the object's last page may be shorter) into `out`, one entry each: the pages a
/// node cache's reader checks before it serves them, read in place from its mapping of the
/// copy. False where `page_bytes` is 0, `out` has another length, or a page lies past `data`.
pub fn pageDigestsAt(data: []const u8, page_bytes: u64, pages: []const u64, out: []u32) bool {
    if (page_bytes == 0 or pages.len != out.len) return false;
    const page_count = (data.len + page_bytes - 1) / page_bytes;
    for (pages, out) |page, *value| {
        if (page >= page_count) return false;
        const start = page * page_bytes;
        value.* = digest(data[start..@min(data.len, start + page_bytes)]);
    }
    return true;
}

/// What a gather checks when it reads a chunk's bytes: each part's stored digest
/// (`stride` per chunk, head first) and one bit per part, set once the part matched (a
/// part is checked the first time a gather reads it, never again); then one bit per chunk
/// (of `chunk_count`), set with its head's where its table lists its blocks in stored
/// order. The bits may be shared by the readers of one loader (in its ring: storage/
/// checked_blocks.py), each of which maps the same file. A bit is only ever set after its
/// part matched, so a reader that sees a bit set sees a part some reader of the loader
/// checked in the same file's bytes; each word is loaded and stored whole (atomically),
/// never locked, so two readers that set bits of one word at once may lose one of them:
/// that part is checked again later, never trusted unchecked.
pub const Checker = struct {
    digests: [*]const u32,
    stride: u64,
    checked: [*]u64,
    chunk_count: u64,

    fn inOrderIndex(self: Checker, chunk_index: u64) u64 {
        return self.chunk_count * self.stride + chunk_index;
    }

    fn isChecked(self: Checker, index: u64) bool {
        // Monotonic: the bits order nothing else (the bytes they vouch for are the file's,
        // which no reader writes); a bit another reader sets later is only a check redone.
        const word = @atomicLoad(u64, &self.checked[index / 64], .monotonic);
        return word & (@as(u64, 1) << @intCast(index % 64)) != 0;
    }

    fn markChecked(self: Checker, index: u64) void {
        // A load and a store, not a locked OR: a locked instruction waits for every store
        // before it to drain, and a block's check comes right after libblosc2 wrote the
        // block's rows out. A bit another reader sets between the two may be lost (above).
        const bit = @as(u64, 1) << @intCast(index % 64);
        @atomicStore(u64, &self.checked[index / 64], @atomicLoad(u64, &self.checked[index / 64], .monotonic) | bit, .monotonic);
    }

    /// Asks for the cache lines of the bits a read of block `block` of chunk `chunk_index`
    /// tests first (a hint: nothing is read or faults).
    pub fn prefetch(self: Checker, chunk_index: u64, block: u64) void {
        @prefetch(&self.checked[(chunk_index * self.stride + 1 + block) / 64], .{});
        @prefetch(&self.checked[self.inOrderIndex(chunk_index) / 64], .{});
    }

    /// Checks chunk `chunk_index`'s head (its header and table of block starts, which say
    /// where its blocks lie) unless it matched before. Returns null when it matches, else
    /// 0 (the head's part).
    pub fn checkHead(self: Checker, chunk_index: u64, chunk: [*]const u8, chunk_bytes: u64) ?u64 {
        const index = chunk_index * self.stride;
        if (self.isChecked(index)) return null;
        // Read from bytes not vouched for yet, but bounded.
        const blocks = blocksOf(chunk, chunk_bytes) orelse return 0;
        if (1 + blocks.count > self.stride) return 0;
        const extent = partExtent(chunk, blocks, 0) orelse return 0;
        if (digest(chunk[extent.start..extent.end]) != self.digests[index]) return 0;
        // The table was just read whole: whether its blocks lie in order is known once
        // here, and spares each block read a search of the table for its end.
        if (tableInOrder(chunk, blocks)) self.markChecked(self.inOrderIndex(chunk_index));
        self.markChecked(index);
        return null;
    }

    /// Checks the blocks of chunk `chunk_index` (whose head matched) that uncompressed
    /// bytes [byte_start, byte_start + byte_count) are read from, unless they matched
    /// before. Returns null when they all match, else the first part that does not (1 + b).
    pub fn checkBlocks(self: Checker, chunk_index: u64, chunk: [*]const u8, chunk_bytes: u64, byte_start: u64, byte_count: u64) ?u64 {
        const first_index = chunk_index * self.stride;
        std.debug.assert(self.isChecked(first_index));
        // The head matched: the header is as written. Once its blocks are checked (most
        // reads of a long run), a read costs one division and a bit test.
        const block_bytes: u64 = std.mem.readInt(u32, chunk[8..12], .little);
        const special = (chunk[31] >> 4) & 0x7 != 0;
        if (byte_count == 0 or block_bytes == 0 or special or self.stride < 2) return null;
        const first_block = byte_start / block_bytes;
        const inside_one = byte_start % block_bytes + byte_count <= block_bytes;
        const last_block = @min(if (inside_one) first_block else (byte_start + byte_count - 1) / block_bytes, self.stride - 2);
        var block = first_block;
        while (block <= last_block and self.isChecked(first_index + 1 + block)) block += 1;
        if (block > last_block) return null;
        const blocks = blocksOf(chunk, chunk_bytes).?;
        if (blocks.count == 0) return null;
        const in_order = self.isChecked(self.inOrderIndex(chunk_index));
        while (block <= @min(last_block, blocks.count - 1)) : (block += 1) {
            const index = first_index + 1 + block;
            if (self.isChecked(index)) continue;
            const extent = if (in_order) inOrderBlockExtent(chunk, blocks, 1 + block) else
                partExtent(chunk, blocks, 1 + block) orelse return 1 + block;
            if (digest(chunk[extent.start..extent.end]) != self.digests[index]) return 1 + block;
            self.markChecked(index);
        }
        return null;
    }

    /// checkHead, then checkBlocks.
    pub fn checkRange(self: Checker, chunk_index: u64, chunk: [*]const u8, chunk_bytes: u64, byte_start: u64, byte_count: u64) ?u64 {
        if (self.checkHead(chunk_index, chunk, chunk_bytes)) |part| return part;
        return self.checkBlocks(chunk_index, chunk, chunk_bytes, byte_start, byte_count);
    }
};

//! Row gathers: copy or decompress the rows named by an index batch straight into a
//! caller's buffer (a shared-memory slot), in index order.
//! Its tests: gather_test.zig. Past 450 lines: the raw and Blosc2 gathers share their range
//! checks and prefetching here; the Blosc2 reads (getBytes and below) would move out first.

const std = @import("std");
const Status = @import("status.zig").Status;
const block_digests = @import("block_digests.zig");

/// Where a failed gather stopped: which batch position, and libblosc2's own error code
/// when the status is .decompress_failed, which digest failed when .checksum_mismatch
/// (chunk * digest_stride + part), 0 otherwise.
pub const GatherError = extern struct {
    position: u64,
    code: i64,
};

/// Rows of a raw, C-contiguous table (a memory-mapped .npy): plain copies.
pub fn gatherRows(
    table: [*]const u8,
    row_count: u64,
    row_bytes: u64,
    indices: []const u64,
    out: []u8,
    failure: *GatherError,
) Status {
    if (out.len != indices.len * row_bytes) return .output_size_mismatch;
    // Check every index first, so that a bad batch writes nothing.
    for (indices, 0..) |index, position| {
        if (index >= row_count) {
            failure.* = .{ .position = position, .code = 0 };
            return .index_out_of_range;
        }
    }
    for (indices, 0..) |index, position| {
        // Rows at scattered addresses (a shuffle) each start with a cache and TLB miss:
        // asking for a later row's first line now overlaps its miss with this copy.
        if (position + prefetch_distance < indices.len) {
            @prefetch(table + indices[position + prefetch_distance] * row_bytes, .{});
        }
        const source = table[index * row_bytes ..][0..row_bytes];
        @memcpy(out[position * row_bytes ..][0..row_bytes], source);
    }
    return .ok;
}

/// How many rows (or ranges) ahead a raw gather asks for one's first cache line.
const prefetch_distance = 4;

/// `blosc2_getitem_ctx` from libblosc2, passed in by address so that this library does
/// not link against the copy inside the blosc2 wheel.
pub const GetItemFn = *const fn (
    context: ?*anyopaque,
    source: ?*const anyopaque,
    source_bytes: i32,
    start_item: c_int,
    item_count: c_int,
    destination: ?*anyopaque,
    destination_bytes: i32,
) callconv(.c) c_int;

/// A Blosc2 NDArray whose chunks and blocks span whole rows, so that row r of a chunk is
/// bytes [r*row_bytes, (r+1)*row_bytes) of that chunk once decompressed. Mirrors
/// `shm_blosc_layout` in shmloader/_declarations.py.
pub const BloscLayout = extern struct {
    getitem: ?GetItemFn,
    context: ?*anyopaque,
    /// Addresses and compressed sizes of every chunk (in the mapped file, or in memory).
    chunk_addresses: [*]const u64,
    chunk_bytes: [*]const u64,
    chunk_count: u64,
    row_count: u64,
    rows_per_chunk: u64,
    rows_per_block: u64,
    row_bytes: u64,
    /// One decompressed block, reused for every block of every batch.
    block_buffer: [*]u8,
    block_buffer_bytes: u64,
    /// `batch_size` entries, used to visit the rows of a batch in block order.
    order_buffer: [*]u128,
    order_buffer_count: u64,
    /// Each chunk's part digests (block_digests.zig), `digest_stride` per chunk, head
    /// first; null: nothing is checked. A part is checked before it is first decompressed.
    digests: ?[*]const u32,
    digest_stride: u64,
    /// One bit per digest, set once its part matched (in this process, or in any reader of
    /// the loader where the bits are its ring's record: storage/checked_blocks.py), then
    /// one per chunk (block_digests.Checker): chunk_count * (digest_stride + 1) bits.
    digests_checked: ?[*]u64,
};

pub const chunk_header_bytes = 32;

fn itemSize(chunk: [*]const u8) u64 {
    // Byte 3 of a Blosc chunk header is the typesize the chunk records (1 when the real
    // typesize was too large to store); getitem counts in those items.
    return @max(1, chunk[3]);
}

/// Decompresses `byte_count` bytes at `byte_start` of a chunk into `destination`. On
/// .decompress_failed, `library_code` holds libblosc2's (negative) error code.
///
/// libblosc2's getitem (`_blosc_getitem` in blosc/blosc2.c, still so in its August 2026
/// sources) decompresses a block straight into the destination when that block starts at
/// or after the range's start and is exactly as long as the whole range
/// (`get_single_block`). That is right only when the block is the range's first: a range
/// that starts inside one block and is exactly as long as a later block it reaches (a
/// full block, or the chunk's shorter last block) comes back as that later block, with
/// no error. Such a range is read in two calls split at its first block boundary: the
/// first lies inside one block, the second starts on a boundary, and neither can meet
/// the condition. tests/test_upstream_blosc2.py keeps the fault's minimal reproduction.
fn getBytes(
    layout: *const BloscLayout,
    chunk_index: u64,
    byte_start: u64,
    byte_count: u64,
    destination: [*]u8,
    library_code: *i64,
) Status {
    const chunk_bytes = layout.chunk_bytes[chunk_index];
    if (chunk_bytes < chunk_header_bytes or chunk_bytes > std.math.maxInt(i32)) return .chunk_size_invalid;
    const chunk: [*]const u8 = @ptrFromInt(layout.chunk_addresses[chunk_index]);
    const checker = checkerOf(layout);
    if (checker) |check| {
        // The head before libblosc2 reads the chunk: its header and table say where the
        // blocks lie, and libblosc2 must not follow a changed one.
        if (check.checkHead(chunk_index, chunk, chunk_bytes)) |part| {
            library_code.* = @intCast(chunk_index * layout.digest_stride + part);
            return .checksum_mismatch;
        }
    }
    const got = getRange(layout, chunk, chunk_index, byte_start, byte_count, destination, library_code);
    if (checker) |check| {
        // The blocks after: libblosc2 has just read their bytes, which are in cache now (a
        // pass before it would fetch them from memory alone), and decodes a changed block
        // safely (LZ4's safe decoder). The rows it wrote are never delivered when a block
        // fails: the gather fails, with the checksum's status even where decoding failed.
        if (check.checkBlocks(chunk_index, chunk, chunk_bytes, byte_start, byte_count)) |part| {
            library_code.* = @intCast(chunk_index * layout.digest_stride + part);
            return .checksum_mismatch;
        }
    }
    return got;
}

/// The layout's digest checks, or null where it has none.
fn checkerOf(layout: *const BloscLayout) ?block_digests.Checker {
    const digests = layout.digests orelse return null;
    return .{ .digests = digests, .stride = layout.digest_stride, .checked = layout.digests_checked.?, .chunk_count = layout.chunk_count };
}

fn getRange(
    layout: *const BloscLayout,
    chunk: [*]const u8,
    chunk_index: u64,
    byte_start: u64,
    byte_count: u64,
    destination: [*]u8,
    library_code: *i64,
) Status {
    const split = singleBlockSplit(chunk, byte_start, byte_count);
    if (split == 0) return getItems(layout, chunk_index, byte_start, byte_count, destination, library_code);
    std.debug.assert(split < byte_count);
    const first = getItems(layout, chunk_index, byte_start, split, destination, library_code);
    if (first != .ok) return first;
    return getItems(layout, chunk_index, byte_start + split, byte_count - split, destination + split, library_code);
}

/// Where a range must be cut so that libblosc2's getitem reads it right (see getBytes):
/// the bytes up to its first block boundary, or 0 when it can be read in one call.
pub fn singleBlockSplit(chunk: [*]const u8, byte_start: u64, byte_count: u64) u64 {
    // Bytes 4-7 of a Blosc chunk header are the uncompressed size, 8-11 the block size.
    const chunk_uncompressed = std.mem.readInt(u32, chunk[4..8], .little);
    const block_bytes: u64 = std.mem.readInt(u32, chunk[8..12], .little);
    if (block_bytes == 0) return 0;
    const offset_in_block = byte_start % block_bytes;
    if (offset_in_block == 0) return 0;
    const to_boundary = block_bytes - offset_in_block;
    if (byte_count <= to_boundary) return 0; // Inside one block.
    const last_block_bytes = chunk_uncompressed % block_bytes;
    if (byte_count != block_bytes and byte_count != last_block_bytes) return 0;
    return to_boundary;
}

/// One call of libblosc2's getitem over `byte_count` bytes at `byte_start` of a chunk.
fn getItems(
    layout: *const BloscLayout,
    chunk_index: u64,
    byte_start: u64,
    byte_count: u64,
    destination: [*]u8,
    library_code: *i64,
) Status {
    const chunk_bytes = layout.chunk_bytes[chunk_index];
    const chunk: [*]const u8 = @ptrFromInt(layout.chunk_addresses[chunk_index]);
    const item_bytes = itemSize(chunk);
    if (byte_start % item_bytes != 0 or byte_count % item_bytes != 0) return .item_misaligned;
    const start_item = byte_start / item_bytes;
    const item_count = byte_count / item_bytes;
    if (start_item > std.math.maxInt(c_int) or item_count > std.math.maxInt(c_int)) return .item_count_too_large;
    if (byte_count > std.math.maxInt(i32)) return .item_count_too_large;
    const written = layout.getitem.?(
        layout.context,
        chunk,
        @intCast(chunk_bytes),
        @intCast(start_item),
        @intCast(item_count),
        destination,
        @intCast(byte_count),
    );
    if (written < 0) {
        library_code.* = written;
        return .decompress_failed;
    }
    if (written != @as(c_int, @intCast(byte_count))) return .decompressed_short;
    return .ok;
}

pub fn checkLayout(layout: *const BloscLayout, batch_size: u64) Status {
    if (layout.getitem == null) return .invalid_layout;
    if (layout.rows_per_chunk == 0 or layout.rows_per_block == 0) return .invalid_layout;
    if (layout.row_bytes == 0) return .invalid_layout;
    const chunks_needed = (layout.row_count + layout.rows_per_chunk - 1) / layout.rows_per_chunk;
    if (layout.chunk_count != chunks_needed) return .invalid_layout;
    const block_bytes = std.math.mul(u64, layout.rows_per_block, layout.row_bytes) catch return .invalid_layout;
    if (layout.rows_per_block > 1 and layout.block_buffer_bytes < block_bytes) return .invalid_layout;
    if (layout.rows_per_block > 1 and layout.order_buffer_count < batch_size) return .invalid_layout;
    return checkDigests(layout);
}

fn checkDigests(layout: *const BloscLayout) Status {
    if (layout.digests == null) return .ok;
    if (layout.digests_checked == null or layout.digest_stride == 0) return .invalid_layout;
    return .ok;
}

/// Gathers rows of a Blosc2 array. With one row per block each row is decompressed
/// straight into `out`; otherwise the batch is visited in block order so that rows
/// sharing a block cost one decompression, and rows are copied out of `block_buffer`.
pub fn gatherBlosc(
    layout: *const BloscLayout,
    indices: []const u64,
    out: []u8,
    failure: *GatherError,
) Status {
    const status = checkLayout(layout, indices.len);
    if (status != .ok) return status;
    const row_bytes = layout.row_bytes;
    if (out.len != indices.len * row_bytes) return .output_size_mismatch;
    for (indices, 0..) |index, position| {
        if (index >= layout.row_count) {
            failure.* = .{ .position = position, .code = 0 };
            return .index_out_of_range;
        }
    }
    if (layout.rows_per_block == 1) {
        for (indices, 0..) |index, position| {
            // A row at random starts with misses on its block's entry in its chunk's table,
            // then on its block (a digest check or libblosc2 reads it first): asking for
            // them a row or two ahead overlaps those misses with this row's work.
            if (position + row_prefetch_distance < indices.len) prefetchRow(layout, indices[position + row_prefetch_distance], false);
            if (position + block_prefetch_distance < indices.len) prefetchRow(layout, indices[position + block_prefetch_distance], true);
            const chunk_index = index / layout.rows_per_chunk;
            const row_in_chunk = index % layout.rows_per_chunk;
            var library_code: i64 = 0;
            const got = getBytes(layout, chunk_index, row_in_chunk * row_bytes, row_bytes, out[position * row_bytes ..].ptr, &library_code);
            if (got != .ok) {
                failure.* = .{ .position = position, .code = library_code };
                return got;
            }
        }
        return .ok;
    }
    return gatherByBlock(layout, indices, out, failure);
}

/// How many rows ahead a Blosc2 gather of one row per block asks for a row's chunk header
/// and table entry, and for its block (which needs the entry, so it comes later): a row's
/// decompression takes several times a miss to memory, so a row or two of lead hides them.
const row_prefetch_distance = 4;
const block_prefetch_distance = 2;

/// Prefetches the header and table entry of row `index`'s block (one row per block), or with `block`
/// the block's first lines and its digest, reading the entry (prefetched before). Only
/// hints: an entry is read only inside its chunk, and a prefetch never faults.
fn prefetchRow(layout: *const BloscLayout, index: u64, block: bool) void {
    if (index >= layout.row_count) return;
    const chunk_index = index / layout.rows_per_chunk;
    const block_in_chunk = index % layout.rows_per_chunk;
    const chunk: [*]const u8 = @ptrFromInt(layout.chunk_addresses[chunk_index]);
    const entry = chunk_header_bytes + 4 * block_in_chunk;
    if (entry + 4 > layout.chunk_bytes[chunk_index]) return;
    if (!block) {
        @prefetch(chunk, .{});
        @prefetch(chunk + entry, .{});
        return;
    }
    const start = std.mem.readInt(u32, chunk[entry..][0..4], .little);
    inline for (0..4) |line| @prefetch(chunk + start + 64 * line, .{});
    if (layout.digests) |digests| {
        @prefetch(digests + chunk_index * layout.digest_stride + 1 + block_in_chunk, .{});
        if (block_in_chunk + 1 < layout.digest_stride) checkerOf(layout).?.prefetch(chunk_index, block_in_chunk);
    }
}

fn orderLessThan(_: void, a: u128, b: u128) bool {
    return a < b;
}

fn gatherByBlock(
    layout: *const BloscLayout,
    indices: []const u64,
    out: []u8,
    failure: *GatherError,
) Status {
    const row_bytes = layout.row_bytes;
    const rows_per_block = layout.rows_per_block;
    // Sort (global block, batch position) pairs; the block number fits 64 bits and the
    // position 32 (a batch has fewer than 2^32 rows).
    std.debug.assert(indices.len < (1 << 32));
    const order = layout.order_buffer[0..indices.len];
    const blocks_per_chunk = (layout.rows_per_chunk + rows_per_block - 1) / rows_per_block;
    for (indices, order, 0..) |index, *entry, position| {
        const chunk_index = index / layout.rows_per_chunk;
        const block_in_chunk = (index % layout.rows_per_chunk) / rows_per_block;
        const block = chunk_index * blocks_per_chunk + block_in_chunk;
        entry.* = (@as(u128, block) << 64) | position;
    }
    std.sort.pdq(u128, order, {}, orderLessThan);
    const block_bytes = rows_per_block * row_bytes;
    var cached_block: ?u64 = null;
    for (order) |entry| {
        const block: u64 = @truncate(entry >> 64);
        const position: u64 = @truncate(entry);
        const chunk_index = block / blocks_per_chunk;
        const block_in_chunk = block % blocks_per_chunk;
        if (cached_block != block) {
            var library_code: i64 = 0;
            const got = getBytes(layout, chunk_index, block_in_chunk * block_bytes, block_bytes, layout.block_buffer, &library_code);
            if (got != .ok) {
                failure.* = .{ .position = position, .code = library_code };
                return got;
            }
            cached_block = block;
        }
        const row_in_block = (indices[position] % layout.rows_per_chunk) % rows_per_block;
        const source = layout.block_buffer[row_in_block * row_bytes ..][0..row_bytes];
        @memcpy(out[position * row_bytes ..][0..row_bytes], source);
    }
    return .ok;
}

/// Rows of a field split over many raw, memory-mapped files (shards of .npy): global row
/// r lies in the last part whose first row is <= r (a binary search over `part_starts`,
/// which begins at 0 and increases), at local row r - part_starts[part]. Row i goes to
/// byte destinations[i] of `out`, or to i * row_bytes when `destinations` is empty.
pub fn gatherPartsRaw(
    part_tables: []const u64,
    part_starts: []const u64,
    total_rows: u64,
    row_bytes: u64,
    indices: []const u64,
    destinations: []const u64,
    out: []u8,
    failure: *GatherError,
) Status {
    if (part_tables.len != part_starts.len or part_starts.len == 0 or part_starts[0] != 0) return .invalid_layout;
    if (destinations.len != 0 and destinations.len != indices.len) return .output_size_mismatch;
    if (destinations.len == 0 and out.len != indices.len * row_bytes) return .output_size_mismatch;
    for (indices, 0..) |index, position| {
        const destination = rowDestination(destinations, row_bytes, position);
        if (index >= total_rows) {
            failure.* = .{ .position = position, .code = 0 };
            return .index_out_of_range;
        }
        if (destination > out.len or out.len - destination < row_bytes) {
            failure.* = .{ .position = position, .code = 0 };
            return .output_size_mismatch;
        }
    }
    // Each row's address is found once, prefetch_distance rows before it is copied (as in
    // gatherRows), and kept in a ring until then.
    var sources: [prefetch_distance][*]const u8 = undefined;
    const ahead = @min(prefetch_distance, indices.len);
    for (0..ahead) |position| sources[position] = partRow(part_tables, part_starts, total_rows, row_bytes, indices[position]);
    for (indices, 0..) |_, position| {
        const source = sources[position % prefetch_distance];
        if (position + prefetch_distance < indices.len) {
            const later = partRow(part_tables, part_starts, total_rows, row_bytes, indices[position + prefetch_distance]);
            @prefetch(later, .{});
            sources[position % prefetch_distance] = later;
        }
        const destination = rowDestination(destinations, row_bytes, position);
        @memcpy(out[destination..][0..row_bytes], source[0..row_bytes]);
    }
    return .ok;
}

/// The address of row `index` of a field of parts.
fn partRow(part_tables: []const u64, part_starts: []const u64, total_rows: u64, row_bytes: u64, index: u64) [*]const u8 {
    const part = partOf(part_starts, total_rows, index);
    const table: [*]const u8 = @ptrFromInt(part_tables[part]);
    return table + (index - part_starts[part]) * row_bytes;
}

/// Where row `position` of a batch goes: its own offset, or packed in batch order.
fn rowDestination(destinations: []const u64, row_bytes: u64, position: usize) u64 {
    return if (destinations.len == 0) position * row_bytes else destinations[position];
}

/// The last part whose first row is <= `index` (part_starts[0] == 0, increasing, and
/// index < total_rows). Shards are usually of similar sizes, so the search starts where
/// the index would fall with equal parts and gallops outwards from there: one or two
/// probes for even shards, a logarithmic number for any others.
pub fn partOf(part_starts: []const u64, total_rows: u64, index: u64) usize {
    const count = part_starts.len;
    const guess: usize = @intCast(@min(count - 1, std.math.mulWide(u64, index, count) / total_rows));
    var low: usize = 0; // The answer is in [low, high).
    var high: usize = count;
    var stride: usize = 1;
    if (part_starts[guess] <= index) {
        low = guess;
        while (low + stride < count and part_starts[low + stride] <= index) : (stride *= 2) low += stride;
        high = @min(count, low + stride);
    } else {
        high = guess;
        while (high > stride and part_starts[high - stride] > index) : (stride *= 2) high -= stride;
        low = if (high > stride) high - stride else 0;
    }
    while (high - low > 1) {
        const middle = low + (high - low) / 2;
        if (part_starts[middle] <= index) low = middle else high = middle;
    }
    return low;
}

/// Byte ranges of a 1-D array (a ragged field's values, a token stream): element range i
/// is [starts[i], starts[i] + counts[i]), written at byte offset destinations[i] of `out`.
/// Every range is checked first, so that a bad one writes nothing.
fn checkRanges(
    element_count: u64,
    element_bytes: u64,
    starts: []const u64,
    counts: []const u64,
    destinations: []const u64,
    out_bytes: u64,
    failure: *GatherError,
) Status {
    for (starts, counts, destinations, 0..) |start, count, destination, position| {
        const end = std.math.add(u64, start, count) catch element_count + 1;
        const bytes = std.math.mul(u64, count, element_bytes) catch out_bytes + 1;
        const last = std.math.add(u64, destination, bytes) catch out_bytes + 1;
        if (end > element_count) {
            failure.* = .{ .position = position, .code = 0 };
            return .index_out_of_range;
        }
        if (last > out_bytes) {
            failure.* = .{ .position = position, .code = 0 };
            return .output_size_mismatch;
        }
    }
    return .ok;
}

/// Element ranges of a raw, memory-mapped 1-D array (a .npy token stream): plain copies.
pub fn gatherRangesRaw(
    table: [*]const u8,
    element_count: u64,
    element_bytes: u64,
    starts: []const u64,
    counts: []const u64,
    destinations: []const u64,
    out: []u8,
    failure: *GatherError,
) Status {
    const status = checkRanges(element_count, element_bytes, starts, counts, destinations, out.len, failure);
    if (status != .ok) return status;
    for (starts, counts, destinations, 0..) |start, count, destination, position| {
        if (position + prefetch_distance < starts.len) {
            @prefetch(table + starts[position + prefetch_distance] * element_bytes, .{});
        }
        const bytes = count * element_bytes;
        @memcpy(out[destination..][0..bytes], table[start * element_bytes ..][0..bytes]);
    }
    return .ok;
}

/// Element ranges of a 1-D Blosc2 array (`layout.row_bytes` is the element size): each
/// range is decompressed chunk by chunk straight into `out`; libblosc2's getitem
/// decompresses only the blocks that overlap it.
pub fn gatherRangesBlosc(
    layout: *const BloscLayout,
    starts: []const u64,
    counts: []const u64,
    destinations: []const u64,
    out: []u8,
    failure: *GatherError,
) Status {
    if (layout.getitem == null or layout.rows_per_chunk == 0 or layout.row_bytes == 0) return .invalid_layout;
    if (checkDigests(layout) != .ok) return .invalid_layout;
    const element_bytes = layout.row_bytes;
    const status = checkRanges(layout.row_count, element_bytes, starts, counts, destinations, out.len, failure);
    if (status != .ok) return status;
    for (starts, counts, destinations, 0..) |start, count, destination, position| {
        var element = start;
        var written = destination;
        const end = start + count;
        // Bounded: each turn consumes at least one element (a chunk's worth at most).
        while (element < end) {
            const chunk_index = element / layout.rows_per_chunk;
            const in_chunk = element % layout.rows_per_chunk;
            const take = @min(end - element, layout.rows_per_chunk - in_chunk);
            var library_code: i64 = 0;
            const got = getBytes(layout, chunk_index, in_chunk * element_bytes, take * element_bytes, out[written..].ptr, &library_code);
            if (got != .ok) {
                failure.* = .{ .position = position, .code = library_code };
                return got;
            }
            element += take;
            written += take * element_bytes;
        }
    }
    return .ok;
}

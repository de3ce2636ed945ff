//! Row gathers: copy or decompress the rows named by an index batch straight into a
//! caller's buffer (a shared-memory slot), in index order.

const std = @import("std");
const Status = @import("status.zig").Status;

/// Where a failed gather stopped: which batch position, and libblosc2's own error code
/// when the status is .decompress_failed (0 otherwise).
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
};

const chunk_header_bytes = 32;

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
    const split = singleBlockSplit(chunk, byte_start, byte_count);
    if (split == 0) return getItems(layout, chunk_index, byte_start, byte_count, destination, library_code);
    std.debug.assert(split < byte_count);
    const first = getItems(layout, chunk_index, byte_start, split, destination, library_code);
    if (first != .ok) return first;
    return getItems(layout, chunk_index, byte_start + split, byte_count - split, destination + split, library_code);
}

/// Where a range must be cut so that libblosc2's getitem reads it right (see getBytes):
/// the bytes up to its first block boundary, or 0 when it can be read in one call.
fn singleBlockSplit(chunk: [*]const u8, byte_start: u64, byte_count: u64) u64 {
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
fn partOf(part_starts: []const u64, total_rows: u64, index: u64) usize {
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

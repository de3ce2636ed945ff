//! XXH3-64 with seed 0 (xxhash.h's XXH3_64bits), what block digests hash with: its long-input
//! loop on 128-bit vectors, and on 256-bit ones where the CPU has AVX2.
//! Its tests: block_digests_test.zig (against std.hash.XxHash3) and tests/test_checksums.py
//! (against the xxhash package).

const std = @import("std");

// XXH3-64's long-input path (xxhash.h, XXH3_hashLong_64b with the default secret), on
// 128-bit vectors: the baseline x86-64 (SSE2) and ARM64 (NEON) this library is built for
// have them, so it needs no CPU feature to dispatch on. std.hash.XxHash3 computes the same
// values, but its build of this loop reads each 64-byte stripe byte by byte, many times
// slower (bench/RESULTS.md); shorter inputs, which never reach this loop, stay with it.
const short_max = 240;
const xxh3_secret: [192]u8 = .{
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
const stripe_bytes = 64;
const stripes_per_block = (xxh3_secret.len - stripe_bytes) / 8;
const prime32_1: u64 = 0x9E3779B1;
const prime32_2: u64 = 0x85EBCA77;
const prime32_3: u64 = 0xC2B2AE3D;
const prime64_1: u64 = 0x9E3779B185EBCA87;
const prime64_2: u64 = 0xC2B2AE3D27D4EB4F;
const prime64_3: u64 = 0x165667B19E3779F9;
const prime64_4: u64 = 0x85EBCA77C2B2AE63;
const prime64_5: u64 = 0x27D4EB2F165667C5;

const Lanes = @Vector(2, u64);

fn loadLanes(bytes: [*]const u8) Lanes {
    // Through a pointer, not a [16]u8 bitcast (which loads byte by byte): one unaligned load.
    const lanes = @as(*align(1) const Lanes, @ptrCast(bytes)).*;
    return if (@import("builtin").cpu.arch.endian() == .little) lanes else @byteSwap(lanes);
}

/// One 64-byte stripe into the accumulators: acc[i] += lo32(key) * hi32(key), and each
/// lane's pair gets the other's input word (XXH3_accumulate_512).
fn accumulateStripe(accumulators: *[4]Lanes, input: [*]const u8, secret: [*]const u8) void {
    inline for (accumulators, 0..) |*accumulator, lane| {
        const data = loadLanes(input + 16 * lane);
        const key = data ^ loadLanes(secret + 16 * lane);
        const low: Lanes = @as(@Vector(2, u32), @truncate(key));
        const high: Lanes = @as(@Vector(2, u32), @truncate(key >> @splat(32)));
        accumulator.* +%= low *% high;
        accumulator.* +%= @shuffle(u64, data, undefined, [_]i32{ 1, 0 });
    }
}

fn scramble(accumulators: *[4]Lanes, secret: [*]const u8) void {
    inline for (accumulators, 0..) |*accumulator, lane| {
        var value = accumulator.*;
        value ^= value >> @splat(47);
        value ^= loadLanes(secret + 16 * lane);
        accumulator.* = value *% @as(Lanes, @splat(prime32_1));
    }
}

/// Stripes through accumulateStripe, or through the same sums on 256-bit vectors where
/// the CPU has AVX2 (about twice the bytes per cycle; the library is built for the
/// baseline CPU, so that loop is assembly, chosen at run time).
fn accumulateStripes(accumulators: *[4]Lanes, input: [*]const u8, secret: [*]const u8, stripes: u64) void {
    if (stripes == 0) return;
    if (avx2_assembly and hasAvx2()) return accumulateStripesAvx2(accumulators, input, secret, stripes);
    for (0..stripes) |stripe| accumulateStripe(accumulators, input + stripe * stripe_bytes, secret + stripe * 8);
}

// LLVM assembles the loop; Zig's own x86-64 backend (Debug builds) takes a subset of AT&T
// syntax without it, and runs the 128-bit loop.
const avx2_assembly = @import("builtin").cpu.arch == .x86_64 and @import("builtin").zig_backend == .stage2_llvm;

/// XXH3_accumulate_512 as xxhash.h's AVX2 path computes it: the two halves of the
/// accumulators in ymm0 and ymm1, a stripe's two 32-byte halves against them.
fn accumulateStripesAvx2(accumulators: *[4]Lanes, input: [*]const u8, secret: [*]const u8, stripes: u64) void {
    std.debug.assert(stripes > 0);
    var input_at = @intFromPtr(input);
    var secret_at = @intFromPtr(secret);
    var left = stripes;
    asm volatile (
        \\ vmovdqu (%[acc]), %%ymm0
        \\ vmovdqu 32(%[acc]), %%ymm1
        \\ 1:
        \\ vmovdqu (%[input]), %%ymm2
        \\ vpxor (%[secret]), %%ymm2, %%ymm3
        \\ vpshufd $0x31, %%ymm3, %%ymm4
        \\ vpmuludq %%ymm4, %%ymm3, %%ymm4
        \\ vpshufd $0x4e, %%ymm2, %%ymm2
        \\ vpaddq %%ymm2, %%ymm0, %%ymm0
        \\ vpaddq %%ymm4, %%ymm0, %%ymm0
        \\ vmovdqu 32(%[input]), %%ymm2
        \\ vpxor 32(%[secret]), %%ymm2, %%ymm3
        \\ vpshufd $0x31, %%ymm3, %%ymm4
        \\ vpmuludq %%ymm4, %%ymm3, %%ymm4
        \\ vpshufd $0x4e, %%ymm2, %%ymm2
        \\ vpaddq %%ymm2, %%ymm1, %%ymm1
        \\ vpaddq %%ymm4, %%ymm1, %%ymm1
        \\ add $64, %[input]
        \\ add $8, %[secret]
        \\ dec %[left]
        \\ jnz 1b
        \\ vmovdqu %%ymm0, (%[acc])
        \\ vmovdqu %%ymm1, 32(%[acc])
        \\ vzeroupper
        : [input] "+r" (input_at),
          [secret] "+r" (secret_at),
          [left] "+r" (left),
        : [acc] "r" (@intFromPtr(accumulators)),
        // The xmm names too: built for the baseline CPU, LLVM knows no ymm registers and
        // would drop their clobbers, keeping its own values in xmm1-4 across the loop.
        : .{ .memory = true, .cc = true, .xmm0 = true, .xmm1 = true, .xmm2 = true, .xmm3 = true, .xmm4 = true, .ymm0 = true, .ymm1 = true, .ymm2 = true, .ymm3 = true, .ymm4 = true });
}

/// 0: not asked yet, 1: no AVX2, 2: AVX2. Asked once per process; a race asks twice and
/// stores the same answer.
var avx2_known: u8 = 0;
/// Forces the 128-bit loop (the tests compare both).
pub var avx2_allowed: bool = true;

fn hasAvx2() bool {
    if (!avx2_allowed) return false;
    var known = @atomicLoad(u8, &avx2_known, .monotonic);
    if (known == 0) {
        known = if (cpuHasAvx2()) 2 else 1;
        @atomicStore(u8, &avx2_known, known, .monotonic);
    }
    return known == 2;
}

const CpuidLeaf = struct { eax: u32, ebx: u32, ecx: u32 };

fn cpuid(leaf: u32, subleaf: u32) CpuidLeaf {
    var eax: u32 = undefined;
    var ebx: u32 = undefined;
    var ecx: u32 = undefined;
    var edx: u32 = undefined;
    asm volatile ("cpuid"
        : [_] "={eax}" (eax),
          [_] "={ebx}" (ebx),
          [_] "={ecx}" (ecx),
          [_] "={edx}" (edx),
        : [_] "{eax}" (leaf),
          [_] "{ecx}" (subleaf),
    );
    return .{ .eax = eax, .ebx = ebx, .ecx = ecx };
}

/// AVX2 in the CPU (CPUID 7.0 EBX bit 5), and YMM state saved by the OS (OSXSAVE, then
/// XCR0 bits 1 and 2): both are needed to run the loop above.
fn cpuHasAvx2() bool {
    if (cpuid(0, 0).eax < 7) return false;
    const features = cpuid(1, 0).ecx;
    const osxsave = features & (1 << 27) != 0;
    const avx = features & (1 << 28) != 0;
    if (!osxsave or !avx) return false;
    const xcr0 = asm volatile (
        \\ xor %%ecx, %%ecx
        \\ xgetbv
        : [_] "={eax}" (-> u32),
        :
        : .{ .edx = true, .ecx = true });
    if (xcr0 & 0x6 != 0x6) return false;
    return cpuid(7, 0).ebx & (1 << 5) != 0;
}

fn fold128(a: u64, b: u64) u64 {
    const product = @as(u128, a) * b;
    return @as(u64, @truncate(product)) ^ @as(u64, @truncate(product >> 64));
}

pub fn hash(input: []const u8) u64 {
    if (input.len <= short_max) return std.hash.XxHash3.hash(0, input);
    return hashLong(input);
}

fn hashLong(input: []const u8) u64 {
    std.debug.assert(input.len > short_max);
    var accumulators: [4]Lanes = .{ .{ prime32_3, prime64_1 }, .{ prime64_2, prime64_3 }, .{ prime64_4, prime32_2 }, .{ prime64_5, prime32_1 } };
    const secret: [*]const u8 = &xxh3_secret;
    const block_bytes = stripe_bytes * stripes_per_block;
    const blocks = (input.len - 1) / block_bytes;
    for (0..blocks) |block| {
        accumulateStripes(&accumulators, input.ptr + block * block_bytes, secret, stripes_per_block);
        scramble(&accumulators, secret + xxh3_secret.len - stripe_bytes);
    }
    const stripes = (input.len - 1 - blocks * block_bytes) / stripe_bytes;
    accumulateStripes(&accumulators, input.ptr + blocks * block_bytes, secret, stripes);
    // The last stripe, overlapping the previous one where the length is not a multiple of 64.
    accumulateStripe(&accumulators, input.ptr + input.len - stripe_bytes, secret + xxh3_secret.len - stripe_bytes - 7);
    var result: u64 = @as(u64, input.len) *% prime64_1;
    inline for (accumulators, 0..) |accumulator, lane| {
        const key = xxh3_secret[11 + 16 * lane ..];
        result +%= fold128(accumulator[0] ^ std.mem.readInt(u64, key[0..8], .little), accumulator[1] ^ std.mem.readInt(u64, key[8..16], .little));
    }
    result ^= result >> 37;
    result *%= 0x165667919E3779F9;
    return result ^ (result >> 32);
}

//! XXH3-64 with seed 0 (xxhash.h's XXH3_64bits), what block digests hash with: its long-input
//! loop on 128-bit vectors, and on 256-bit or 512-bit ones where the CPU has AVX2 or AVX-512.
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

/// Stripes through accumulateStripe: the 128-bit loop, where the CPU has neither AVX2 nor
/// AVX-512 (hashLong takes accumulateLongAvx2 or accumulateLongAvx512 where it has).
fn accumulateStripes(accumulators: *[4]Lanes, input: [*]const u8, secret: [*]const u8, stripes: u64) void {
    for (0..stripes) |stripe| accumulateStripe(accumulators, input + stripe * stripe_bytes, secret + stripe * 8);
}

// LLVM assembles the wide loops; Zig's own x86-64 backend (Debug builds) takes a subset of
// AT&T syntax without it, and runs the 128-bit loop. The library is built for the baseline
// CPU, so the wide loops are assembly, chosen at run time.
const avx2_assembly = @import("builtin").cpu.arch == .x86_64 and @import("builtin").zig_backend == .stage2_llvm;

/// One stripe on 256-bit vectors (XXH3_accumulate_512 as xxhash.h's AVX2 path computes it):
/// its two 32-byte halves at %[input] against the secret at %[key], their products into
/// ymm0 and ymm1. Each lane also gets its pair's input word; as that swap is a permutation,
/// the input is summed unswapped into ymm6 and ymm7 and swapped once, by avx2Fold, before
/// a scramble or the end reads the accumulators: one shuffle less per half-stripe.
const avx2_stripe =
    \\
    \\ vmovdqu (%[input]), %%ymm2
    \\ vpxor (%[key]), %%ymm2, %%ymm3
    \\ vpsrlq $32, %%ymm3, %%ymm4
    \\ vpmuludq %%ymm4, %%ymm3, %%ymm4
    \\ vpaddq %%ymm4, %%ymm0, %%ymm0
    \\ vpaddq %%ymm2, %%ymm6, %%ymm6
    \\ vmovdqu 32(%[input]), %%ymm2
    \\ vpxor 32(%[key]), %%ymm2, %%ymm3
    \\ vpsrlq $32, %%ymm3, %%ymm4
    \\ vpmuludq %%ymm4, %%ymm3, %%ymm4
    \\ vpaddq %%ymm4, %%ymm1, %%ymm1
    \\ vpaddq %%ymm2, %%ymm7, %%ymm7
    \\
;

/// The input sums into the accumulators, each lane's to its pair, and the sums zeroed.
const avx2_fold =
    \\
    \\ vpshufd $0x4e, %%ymm6, %%ymm6
    \\ vpaddq %%ymm6, %%ymm0, %%ymm0
    \\ vpshufd $0x4e, %%ymm7, %%ymm7
    \\ vpaddq %%ymm7, %%ymm1, %%ymm1
    \\ vpxor %%ymm6, %%ymm6, %%ymm6
    \\ vpxor %%ymm7, %%ymm7, %%ymm7
    \\
;

/// A scramble (XXH3_scrambleAcc) of the accumulators half in `half` against the secret's
/// bytes at `at`: acc ^= acc >> 47, ^= the secret, *= PRIME32_1 as two 32-bit products.
fn avx2Scramble(comptime half: []const u8, comptime at: []const u8) []const u8 {
    return "\n vpsrlq $47, %%" ++ half ++ ", %%ymm2\n vpxor %%ymm2, %%" ++ half ++ ", %%" ++ half ++
        "\n vpxor " ++ at ++ "(%[secret]), %%" ++ half ++ ", %%" ++ half ++
        "\n vpsrlq $32, %%" ++ half ++ ", %%ymm2\n vpmuludq %%ymm5, %%" ++ half ++ ", %%ymm3" ++
        "\n vpmuludq %%ymm5, %%ymm2, %%ymm2\n vpsllq $32, %%ymm2, %%ymm2\n vpaddq %%ymm2, %%ymm3, %%" ++ half ++ "\n";
}

/// accumulateLongAvx512's work on 256-bit vectors: the accumulators in ymm0 and ymm1 from
/// the first stripe to the last.
fn accumulateLongAvx2(accumulators: *[4]Lanes, input: []const u8, blocks: u64, stripes: u64) void {
    std.debug.assert(input.len > short_max and stripes < stripes_per_block);
    var input_at = @intFromPtr(input.ptr);
    var key_at: usize = undefined;
    var blocks_left = blocks;
    var stripes_left: u64 = undefined;
    asm volatile (
        \\ vmovdqa (%[initial]), %%ymm0
        \\ vmovdqa 32(%[initial]), %%ymm1
        \\ vmovq %[prime], %%xmm5
        \\ vpbroadcastq %%xmm5, %%ymm5
        \\ vpxor %%ymm6, %%ymm6, %%ymm6
        \\ vpxor %%ymm7, %%ymm7, %%ymm7
        \\ test %[blocks], %[blocks]
        \\ jz 3f
        \\ 2:
        \\ mov %[secret], %[key]
        \\ mov $16, %[left]
        \\ 1:
    ++ avx2_stripe ++
        \\ add $64, %[input]
        \\ add $8, %[key]
        \\ dec %[left]
        \\ jnz 1b
    ++ avx2_fold ++ avx2Scramble("ymm0", "128") ++ avx2Scramble("ymm1", "160") ++
        \\ dec %[blocks]
        \\ jnz 2b
        \\ 3:
        \\ mov %[secret], %[key]
        \\ mov %[stripes], %[left]
        \\ test %[left], %[left]
        \\ jz 5f
        \\ 4:
    ++ avx2_stripe ++
        \\ add $64, %[input]
        \\ add $8, %[key]
        \\ dec %[left]
        \\ jnz 4b
        \\ 5:
        \\ mov %[last], %[input]
        \\ lea 121(%[secret]), %[key]
    ++ avx2_stripe ++ avx2_fold ++
        \\ vmovdqu %%ymm0, (%[acc])
        \\ vmovdqu %%ymm1, 32(%[acc])
        \\ vzeroupper
        : [input] "+&r" (input_at),
          [key] "=&r" (key_at),
          [blocks] "+&r" (blocks_left),
          [left] "=&r" (stripes_left),
        : [acc] "r" (@intFromPtr(accumulators)),
          [initial] "r" (@intFromPtr(&initial_accumulators)),
          [secret] "r" (@intFromPtr(&xxh3_secret)),
          [stripes] "r" (stripes),
          [last] "r" (@intFromPtr(input.ptr) + input.len - stripe_bytes),
          [prime] "r" (prime32_1),
        // The xmm names too: built for the baseline CPU, LLVM knows no ymm registers and
        // would drop their clobbers, keeping its own values in xmm0-7 across the loop.
        : .{ .memory = true, .cc = true, .xmm0 = true, .xmm1 = true, .xmm2 = true, .xmm3 = true, .xmm4 = true, .xmm5 = true, .xmm6 = true, .xmm7 = true, .ymm0 = true, .ymm1 = true, .ymm2 = true, .ymm3 = true, .ymm4 = true, .ymm5 = true, .ymm6 = true, .ymm7 = true });
}

/// One stripe on 512-bit vectors (XXH3_accumulate_512 as xxhash.h's AVX-512 path computes
/// it), the stripe at %[input] against the secret at %[key], its products into zmm0 and its
/// input, unswapped, into zmm6 (as in avx2_stripe; avx512_fold swaps and adds it).
const avx512_stripe =
    \\
    \\ vmovdqu64 (%[input]), %%zmm2
    \\ vpxorq (%[key]), %%zmm2, %%zmm3
    \\ vpsrlq $32, %%zmm3, %%zmm4
    \\ vpmuludq %%zmm4, %%zmm3, %%zmm4
    \\ vpaddq %%zmm4, %%zmm0, %%zmm0
    \\ vpaddq %%zmm2, %%zmm6, %%zmm6
    \\
;

const avx512_fold =
    \\
    \\ vpshufd $0x4e, %%zmm6, %%zmm6
    \\ vpaddq %%zmm6, %%zmm0, %%zmm0
    \\ vpxorq %%zmm6, %%zmm6, %%zmm6
    \\
;

/// hashLong's first accumulators (XXH3_INIT_ACC), read by the wide loops in one load (from
/// the accumulators' own 128-bit stores, the CPU could not forward it).
const initial_accumulators: [4]Lanes align(64) = .{ .{ prime32_3, prime64_1 }, .{ prime64_2, prime64_3 }, .{ prime64_4, prime32_2 }, .{ prime64_5, prime32_1 } };

/// The whole of hashLong's accumulation on 512-bit vectors, in one piece of assembly: the
/// accumulators stay in zmm0 from the first stripe to the last (where the 128-bit loops
/// meet between calls through memory, whose wide loads of narrower stores the CPU cannot
/// forward: a third of a 3 KB block's hash), `blocks` blocks of 16 stripes each followed
/// by a scramble (XXH3_scrambleAcc: acc ^= acc >> 47, ^= the secret's last 64 bytes,
/// *= PRIME32_1 as two 32-bit products), then `stripes` stripes, then the last 64 bytes
/// against the secret 7 bytes before its end.
fn accumulateLongAvx512(accumulators: *[4]Lanes, input: []const u8, blocks: u64, stripes: u64) void {
    std.debug.assert(input.len > short_max and stripes < stripes_per_block);
    var input_at = @intFromPtr(input.ptr);
    var key_at: usize = undefined;
    var blocks_left = blocks;
    var stripes_left: u64 = undefined;
    asm volatile (
        \\ vmovdqa64 (%[initial]), %%zmm0
        \\ vpbroadcastq %[prime], %%zmm5
        \\ vpxorq %%zmm6, %%zmm6, %%zmm6
        \\ test %[blocks], %[blocks]
        \\ jz 3f
        \\ 2:
        \\ mov %[secret], %[key]
        \\ mov $16, %[left]
        \\ 1:
    ++ avx512_stripe ++
        \\ add $64, %[input]
        \\ add $8, %[key]
        \\ dec %[left]
        \\ jnz 1b
    ++ avx512_fold ++
        \\ vpsrlq $47, %%zmm0, %%zmm1
        \\ vpternlogq $0x96, 128(%[secret]), %%zmm1, %%zmm0
        \\ vpsrlq $32, %%zmm0, %%zmm1
        \\ vpmuludq %%zmm5, %%zmm0, %%zmm2
        \\ vpmuludq %%zmm5, %%zmm1, %%zmm1
        \\ vpsllq $32, %%zmm1, %%zmm1
        \\ vpaddq %%zmm1, %%zmm2, %%zmm0
        \\ dec %[blocks]
        \\ jnz 2b
        \\ 3:
        \\ mov %[secret], %[key]
        \\ mov %[stripes], %[left]
        \\ test %[left], %[left]
        \\ jz 5f
        \\ 4:
    ++ avx512_stripe ++
        \\ add $64, %[input]
        \\ add $8, %[key]
        \\ dec %[left]
        \\ jnz 4b
        \\ 5:
        \\ mov %[last], %[input]
        \\ lea 121(%[secret]), %[key]
    ++ avx512_stripe ++ avx512_fold ++
        \\ vmovdqu64 %%zmm0, (%[acc])
        \\ vzeroupper
        : [input] "+&r" (input_at),
          [key] "=&r" (key_at),
          [blocks] "+&r" (blocks_left),
          [left] "=&r" (stripes_left),
        : [acc] "r" (@intFromPtr(accumulators)),
          [initial] "r" (@intFromPtr(&initial_accumulators)),
          [secret] "r" (@intFromPtr(&xxh3_secret)),
          [stripes] "r" (stripes),
          [last] "r" (@intFromPtr(input.ptr) + input.len - stripe_bytes),
          [prime] "r" (prime32_1),
        // Every width's name, for the reason given in accumulateLongAvx2.
        : .{ .memory = true, .cc = true, .xmm0 = true, .xmm1 = true, .xmm2 = true, .xmm3 = true, .xmm4 = true, .xmm5 = true, .xmm6 = true, .ymm0 = true, .ymm1 = true, .ymm2 = true, .ymm3 = true, .ymm4 = true, .ymm5 = true, .ymm6 = true, .zmm0 = true, .zmm1 = true, .zmm2 = true, .zmm3 = true, .zmm4 = true, .zmm5 = true, .zmm6 = true });
}

/// The widest loop this CPU runs (and the tests allow); .unknown until asked, once per
/// process (a race asks twice and stores the same answer).
const VectorLoop = enum(u8) { unknown = 0, lanes128 = 1, avx2 = 2, avx512 = 3 };
var vector_loop_known: u8 = @intFromEnum(VectorLoop.unknown);
/// Force narrower loops (the tests compare them all).
pub var avx2_allowed: bool = true;
pub var avx512_allowed: bool = true;

fn vectorLoop() VectorLoop {
    var known: VectorLoop = @enumFromInt(@atomicLoad(u8, &vector_loop_known, .monotonic));
    if (known == .unknown) {
        const features = cpuVectorFeatures();
        known = if (features.avx512) .avx512 else if (features.avx2) .avx2 else .lanes128;
        @atomicStore(u8, &vector_loop_known, @intFromEnum(known), .monotonic);
    }
    if (known == .avx512 and !avx512_allowed) known = .avx2;
    if (known == .avx2 and !avx2_allowed) known = .lanes128;
    return known;
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

/// AVX2 in the CPU (CPUID 7.0 EBX bit 5) with YMM state saved by the OS (OSXSAVE, then
/// XCR0 bits 1 and 2); AVX-512 Foundation (EBX bit 16, every instruction of its loop) with
/// the opmask and ZMM state saved too (XCR0 bits 5-7). Each is needed to run its loop.
const VectorFeatures = struct { avx2: bool, avx512: bool };

fn cpuVectorFeatures() VectorFeatures {
    const none: VectorFeatures = .{ .avx2 = false, .avx512 = false };
    if (cpuid(0, 0).eax < 7) return none;
    const features = cpuid(1, 0).ecx;
    const osxsave = features & (1 << 27) != 0;
    const avx = features & (1 << 28) != 0;
    if (!osxsave or !avx) return none;
    const xcr0 = asm volatile (
        \\ xor %%ecx, %%ecx
        \\ xgetbv
        : [_] "={eax}" (-> u32),
        :
        : .{ .edx = true, .ecx = true });
    if (xcr0 & 0x6 != 0x6) return none;
    const extended = cpuid(7, 0).ebx;
    const avx2 = extended & (1 << 5) != 0;
    return .{ .avx2 = avx2, .avx512 = avx2 and extended & (1 << 16) != 0 and xcr0 & 0xE6 == 0xE6 };
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
    var accumulators: [4]Lanes = initial_accumulators;
    const secret: [*]const u8 = &xxh3_secret;
    const block_bytes = stripe_bytes * stripes_per_block;
    const blocks = (input.len - 1) / block_bytes;
    const stripes = (input.len - 1 - blocks * block_bytes) / stripe_bytes;
    const loop = if (avx2_assembly) vectorLoop() else .lanes128;
    if (loop == .avx512) {
        accumulateLongAvx512(&accumulators, input, blocks, stripes);
    } else if (loop == .avx2) {
        accumulateLongAvx2(&accumulators, input, blocks, stripes);
    } else {
        for (0..blocks) |block| {
            accumulateStripes(&accumulators, input.ptr + block * block_bytes, secret, stripes_per_block);
            scramble(&accumulators, secret + xxh3_secret.len - stripe_bytes);
        }
        accumulateStripes(&accumulators, input.ptr + blocks * block_bytes, secret, stripes);
        // The last stripe, overlapping the previous one where the length is not a multiple of 64.
        accumulateStripe(&accumulators, input.ptr + input.len - stripe_bytes, secret + xxh3_secret.len - stripe_bytes - 7);
    }
    var result: u64 = @as(u64, input.len) *% prime64_1;
    inline for (accumulators, 0..) |accumulator, lane| {
        const key = xxh3_secret[11 + 16 * lane ..];
        result +%= fold128(accumulator[0] ^ std.mem.readInt(u64, key[0..8], .little), accumulator[1] ^ std.mem.readInt(u64, key[8..16], .little));
    }
    result ^= result >> 37;
    result *%= 0x165667919E3779F9;
    return result ^ (result >> 32);
}

//! The state of a Mersenne Twister (MT19937) for a dataset sample: Python's `random`,
//! numpy's legacy `np.random` and torch's CPU generator are all MT19937, and a reader sets
//! each to a state that is a function of the sample's seed before every `__getitem__`
//! (shmloader/fill/global_seeds.py).
//!
//! Why not the generators' own seeding: `random.seed` runs MT's init_by_array, about 1,900
//! steps each waiting on the one before (a few microseconds a sample, more than many
//! datasets' `__getitem__`), numpy's and torch's init_genrand 624 of them. Here the 624 words are
//! splitmix64 outputs, each independent of the others, so the CPU overlaps them. The
//! definition is simple enough to rebuild in a few lines of Python (tests do, and set the
//! state through the generators' public setstate/set_state).

const permutation = @import("permutation.zig");

pub const words = 624;

/// Fills `out` with the MT19937 state for (`seed`, `domain`): splitmix64's sequence from
/// mix64(seed ^ domain), word 2j the low half of its j-th output and 2j+1 the high half;
/// word 0 is then 0x80000000, as CPython's init_by_array leaves it, so that the state is
/// never the all-zero one MT cannot leave (only word 0's top bit counts in MT).
pub fn fill(seed: u64, domain: u64, out: *[words]u32) void {
    const base = permutation.mix64(seed ^ domain);
    var j: usize = 0;
    while (j < words / 2) : (j += 1) {
        const z = permutation.mix64(base +% (@as(u64, j) + 1) *% permutation.golden);
        out[2 * j] = @truncate(z);
        out[2 * j + 1] = @truncate(z >> 32);
    }
    out[0] = 0x80000000;
}

/// The domains: the two generators get different states from one seed (the same words in
/// both would make random.random() equal np.random.random_sample()).
pub const python_domain: u64 = 0x7079_7468_6f6e_0001; // "python" + 1
pub const numpy_domain: u64 = 0x6e75_6d70_7900_0002; // "numpy" + 2
pub const torch_domain: u64 = 0x746f_7263_6800_0003; // "torch" + 3

test "the state is splitmix64's sequence with word 0 fixed" {
    const std = @import("std");
    var state: [words]u32 = undefined;
    fill(5, python_domain, &state);
    const base = permutation.mix64(5 ^ python_domain);
    const second = permutation.mix64(base +% 2 *% permutation.golden);
    try std.testing.expectEqual(@as(u32, 0x80000000), state[0]);
    try std.testing.expectEqual(@as(u32, @truncate(second)), state[2]);
    try std.testing.expectEqual(@as(u32, @truncate(second >> 32)), state[3]);
    var other: [words]u32 = undefined;
    fill(5, numpy_domain, &other);
    try std.testing.expect(!std.mem.eql(u32, state[1..], other[1..]));
}

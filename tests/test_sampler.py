"""The sampler is a pure, sharded function of the step: coverage, disjointness, uniformity, errors."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from shmloader import Sampler

HERE = pathlib.Path(__file__).resolve().parent


def positions(sampler: Sampler, steps) -> np.ndarray:
    return np.concatenate([sampler.fill(step) for step in steps])


@pytest.mark.parametrize("length,batch_size", [(1, 1), (7, 3), (10, 25), (100, 32), (1000, 7), (4096, 256)])
def test_shuffle_covers_every_row_once_per_epoch(length, batch_size):
    sampler = Sampler(length, batch_size, "shuffle", seed=5)
    epochs = 3
    steps = range(0, (epochs * length) // batch_size + 2)
    flat = positions(sampler, steps)
    for epoch in range(epochs):
        chunk = flat[epoch * length:(epoch + 1) * length]
        assert np.array_equal(np.sort(chunk), np.arange(length)), f"epoch {epoch}"


def test_shuffle_epochs_differ_and_are_not_identity():
    sampler = Sampler(1000, 100, "shuffle", seed=1)
    flat = positions(sampler, range(30))
    first, second, third = flat[:1000], flat[1000:2000], flat[2000:3000]
    assert not np.array_equal(first, second)
    assert not np.array_equal(second, third)
    assert not np.array_equal(first, np.arange(1000))


def test_seeds_give_different_orders():
    assert not np.array_equal(Sampler(1000, 64, seed=1).fill(0), Sampler(1000, 64, seed=2).fill(0))


@pytest.mark.parametrize("mode", ["sequential", "random", "shuffle"])
@pytest.mark.parametrize("shards", [2, 3, 8])
def test_shards_are_disjoint_blocks_of_the_global_batch(mode, shards):
    length, batch_size = 1000, 16
    whole = Sampler(length, batch_size * shards, mode, seed=9)
    for step in (0, 5, 63, 64, 1000):
        parts = [Sampler(length, batch_size, mode, seed=9, shard_index=h, shard_count=shards).fill(step) for h in range(shards)]
        assert np.array_equal(np.concatenate(parts), whole.fill(step))
        if mode != "random":
            assert len(np.unique(np.concatenate(parts))) == batch_size * shards


def test_shuffle_shards_cover_each_row_once_per_epoch():
    length, batch_size, shards = 960, 16, 4
    steps = length // (batch_size * shards)
    seen = np.concatenate([
        Sampler(length, batch_size, "shuffle", seed=2, shard_index=h, shard_count=shards).fill(step)
        for step in range(steps) for h in range(shards)
    ])
    assert np.array_equal(np.sort(seen), np.arange(length))


def test_sequential_is_a_circular_sliding_window():
    sampler = Sampler(10, 4, "sequential")
    assert sampler.fill(0).tolist() == [0, 1, 2, 3]
    assert sampler.fill(2).tolist() == [8, 9, 0, 1]
    assert sampler.fill(5).tolist() == [0, 1, 2, 3]


def test_random_is_uniform_for_a_length_that_is_not_a_power_of_two():
    length, draws = 37, 37 * 4000
    sampler = Sampler(length, 1000, "random", seed=3)
    counts = np.bincount(positions(sampler, range(draws // 1000)), minlength=length)
    expected = draws / length
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    # 36 degrees of freedom: the 99.9% quantile is 67.99.
    assert chi_square < 67.99, chi_square
    assert counts.min() > 0


def test_huge_lengths_need_no_memory_proportional_to_n():
    for length in (1 << 48, (1 << 48) + 12345, (1 << 62)):
        for mode in ("random", "shuffle", "sequential"):
            batch = Sampler(length, 1024, mode, seed=4).fill(10**9)
            assert batch.dtype == np.uint64 and int(batch.max()) < length
            if mode != "random":
                assert len(np.unique(batch)) == 1024


def test_same_arguments_give_the_same_batches_in_a_fresh_process():
    here = [Sampler(10007, 64, mode, seed=11, shard_index=1, shard_count=3).fill(123).tolist() for mode in ("random", "shuffle")]
    code = (
        "from shmloader import Sampler;"
        "print([Sampler(10007, 64, m, seed=11, shard_index=1, shard_count=3).fill(123).tolist() for m in ('random', 'shuffle')])"
    )
    # cwd: a source checkout in the working directory would shadow the installed package.
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=HERE).stdout
    assert eval(there) == here


def test_fill_writes_into_out_and_iterates_from_any_step():
    sampler = Sampler(50, 5, seed=1)
    out = np.zeros(5, dtype=np.uint64)
    assert sampler.fill(3, out=out) is out
    iterator = sampler.iterate(3)
    assert np.array_equal(next(iterator), out)
    assert np.array_equal(next(iterator), sampler.fill(4))


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"length": 0, "batch_size": 1}, ValueError, "length"),
        ({"length": 10, "batch_size": 0}, ValueError, "batch_size"),
        ({"length": 10, "batch_size": 1, "mode": "epoch"}, ValueError, "mode"),
        ({"length": 10, "batch_size": 1, "shard_index": 2, "shard_count": 2}, ValueError, "shard_index"),
        ({"length": 10, "batch_size": 1, "seed": -1}, ValueError, "seed"),
        ({"length": 10.0, "batch_size": 1}, TypeError, "length"),
        ({"length": True, "batch_size": 1}, TypeError, "length"),
        ({"length": 10, "batch_size": "4"}, TypeError, "batch_size"),
        ({"length": 10, "batch_size": 1, "shard_count": 0}, ValueError, "shard_count"),
    ],
    ids=["length-0", "batch-0", "unknown-mode", "shard-index", "negative-seed", "float", "bool", "string", "shards-0"],
)
def test_invalid_arguments_name_the_argument(kwargs, error, words):
    with pytest.raises(error, match=words):
        Sampler(**kwargs)


def test_invalid_steps_and_outputs():
    sampler = Sampler(10, 4)
    with pytest.raises(ValueError, match="step"):
        sampler.fill(-1)
    with pytest.raises(ValueError, match="out"):
        sampler.fill(0, out=np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="step too large"):
        sampler.fill((1 << 64) - 1)


@pytest.mark.parametrize("length", [10007, 1 << 16, 1_281_167])
def test_shuffle_order_shows_no_structure(length):
    """Early positions spread over all rows; neighbours and positions are uncorrelated."""
    sampler = Sampler(length, 2000, "shuffle", seed=8)
    batch = sampler.fill(0).astype(np.float64)
    counts = np.histogram(batch, bins=20, range=(0, length))[0]
    expected = len(batch) / 20
    # 19 degrees of freedom: the 99.9% quantile is 43.82.
    assert float(((counts - expected) ** 2 / expected).sum()) < 43.82
    assert abs(np.corrcoef(batch[:-1], batch[1:])[0, 1]) < 0.1
    assert abs(np.corrcoef(np.arange(len(batch)), batch)[0, 1]) < 0.1
    next_epoch = Sampler(length, 2000, "shuffle", seed=8).fill(-(-length // 2000) * 1)  # Starts in epoch 1.
    assert abs(np.corrcoef(batch, next_epoch)[0, 1]) < 0.1


def test_step_max_is_the_last_step_the_stream_holds_for_samplers_and_mixtures():
    """step_max comes from the Zig sampler (stepMax), beside the position it bounds: the
    last step has a position and fills, the next one is refused, for drawn shapes."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from shmloader.plan.options import BATCH_SIZE_MAX
    from shmloader.plan.sampler import global_position
    from shmloader.plan.sources import MixtureSampler

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, BATCH_SIZE_MAX), st.integers(1, 1 << 16), st.data())
    def check(batch_size, shard_count, data):
        shard_index = data.draw(st.integers(0, shard_count - 1))
        for sampler in (Sampler(1000, batch_size, "sequential", shard_index=shard_index, shard_count=shard_count),
                        MixtureSampler([700, 300], [2, 1], [1.0, 1.0], [False, False], batch_size,
                                       shard_index=shard_index, shard_count=shard_count)):
            last = sampler.step_max
            first = global_position(last, batch_size, shard_index, shard_count)
            assert first + batch_size <= 2**64 - 1
            with pytest.raises(ValueError, match="past the 64-bit stream"):
                global_position(last + 1, batch_size, shard_index, shard_count)
        if batch_size <= 4096:  # One fill at the edge (a large batch is only memory).
            assert len(Sampler(1000, batch_size, shard_index=shard_index, shard_count=shard_count).fill(last)) == batch_size

    check()

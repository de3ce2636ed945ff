"""Stream geometry (plan/geometry.py): both samplers answer the whole interface, and its
answers (a step's first position, an epoch's positions) agree with counting what the
samplers fill, over shapes the test did not pick."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from conftest import examples
from hypothesis import given
from hypothesis import strategies as st

from shmloader.plan.geometry import StreamGeometry
from shmloader.plan.sampler import Sampler
from shmloader.plan.sources import MixtureSampler


def _interface_members() -> set[str]:
    """Every attribute, property and method StreamGeometry declares."""
    declared = set(StreamGeometry.__annotations__)
    declared |= {name for name in vars(StreamGeometry) if not name.startswith("_")}
    return declared


@pytest.mark.parametrize("sampler", [
    pytest.param(Sampler(1000, 8), id="one source"),
    pytest.param(Sampler(1000, 8, shuffle_window=100, block_rows=10, shard_index=1, shard_count=3),
                 id="a window split among shards"),
    pytest.param(Sampler(1000, 8, shuffle_window=100, block_rows=10, start_position=13).with_pass(2, False),
                 id="a resumed pass"),
    pytest.param(MixtureSampler([700, 300], [2, 1], [1.0, 0.5], [False, False], 8, shard_count=2), id="a mixture"),
])
def test_every_sampler_answers_every_question_of_the_interface(sampler):
    missing = sorted(name for name in _interface_members() if not hasattr(sampler, name))
    assert not missing, f"{type(sampler).__name__} lacks {missing}"
    assert sampler.with_pass(2, False).pass_positions(2, sampler.shard_index) == sampler.pass_positions(2, sampler.shard_index)


@examples(40)
@given(st.integers(1, 64), st.integers(1, 9), st.integers(0, 1 << 20), st.data())
def test_a_steps_first_position_is_where_its_sequential_rows_start(batch_size, shard_count, step, data):
    """Sequential rows are their positions (modulo a length larger than any here): a
    shard's first row of a step is its first position, and shard 0's the step's."""
    shard_index = data.draw(st.integers(0, shard_count - 1))
    sampler = Sampler(1 << 40, batch_size, "sequential", shard_index=shard_index, shard_count=shard_count)
    assert sampler.first_position(step) == int(sampler.fill(step)[0])
    assert sampler.first_position(step) == (step * shard_count + shard_index) * batch_size
    first_shard = Sampler(1 << 40, batch_size, "sequential", shard_count=shard_count)
    assert sampler.step_position(step) == int(first_shard.fill(step)[0]) == step * sampler.global_batch


@examples(30)
@given(st.integers(2, 4), st.integers(1, 8), st.integers(20, 120), st.integers(1, 40), st.integers(0, 2**32))
def test_the_shards_epochs_of_a_split_window_hold_every_row_once(shard_count, block_rows, length, window, seed):
    """Each shard's epoch_positions, filled from its own stream, and all shards' together
    are the data's rows, each once."""
    if length // block_rows < shard_count or window >= length:
        return  # A shard without a block is refused; a window that covers the data splits nothing.
    rows = []
    for index in range(shard_count):
        sampler = Sampler(length, 1, seed=seed, shard_index=index, shard_count=shard_count, shuffle_window=window,
                          block_rows=block_rows)
        assert sampler.shard_blocks and sampler.epoch_positions() == sampler.epoch_positions(index)
        assert sampler.epoch_positions((index + 1) % shard_count) == \
            Sampler.from_dict({**sampler.to_dict(), "shard_index": (index + 1) % shard_count}).epoch_positions()
        rows.append(np.concatenate([sampler.fill(step) for step in range(sampler.epoch_positions())]))
    assert np.array_equal(np.sort(np.concatenate(rows)), np.arange(length))


@examples(30)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 4), st.sampled_from([1.0, 0.5, 0.3])),
                min_size=1, max_size=3), st.integers(0, 2**32))
def test_a_mixtures_epoch_is_the_fewest_blocks_in_which_every_source_delivers_its_rows(sources, seed):
    """Counted from the source ids the mixture fills: by epoch_positions every source has
    drawn at least its take (ceil(fraction * rows)); one interleave block earlier, one has not."""
    lengths, weights, fractions = (list(column) for column in zip(*sources))
    block = sum(weights)
    mixture = MixtureSampler(lengths, weights, fractions, [False] * len(lengths), block, seed=seed)
    epoch = mixture.epoch_positions()
    assert epoch % block == 0
    drawn = np.concatenate([mixture.fill(step)[1] for step in range(epoch // block)])
    takes = [int(np.ceil(fraction * rows)) for rows, fraction in zip(lengths, fractions)]
    counts = collections.Counter(drawn.tolist())
    assert all(counts[source] >= take for source, take in enumerate(takes))
    earlier = collections.Counter(drawn[:epoch - block].tolist())
    assert any(earlier[source] < take for source, take in enumerate(takes))
    assert mixture.pass_positions(3, 0) == 3 * epoch and mixture.pass_tail(3, False) is None

"""Finite passes: how many steps `epochs` epochs take, and how many rows each step keeps.

The loader stays a function of the step: a pass of E epochs is the first E epochs of the
same stream of positions, cut. With shard_count hosts, a step's global batch is
batch_size * shard_count positions and host h takes block h of it (sampler.py), so the
pass's positions end inside one global batch: every host gets the same number of steps,
and the last step keeps on host h the positions of its block that are still in the pass
(batch_size, fewer, or none: an empty batch, so that collective operations stay in step).
With drop_last the pass ends at the last global batch that is full on every host.

Epoch lengths: a single source's epoch is its rows (its share of the blocks, for a
shuffle window split among shards); a mixture's epoch is the fewest whole interleave
blocks in which every source has delivered at least its epoch's rows
(ceil(fraction * rows)): W * max_i ceil(take_i / w_i) positions, W = sum of the weights.
"""

from __future__ import annotations

import dataclasses
import math

from .options import EPOCHS_MAX
from .sampler import Sampler, global_position
from .sources import MixtureSampler

ENDLESS = (1 << 64) - 1


def epoch_positions(sampler, shard_index: int | None = None) -> int:
    """Positions in one epoch of the stream that shard `shard_index` reads (the global
    stream where shards share it)."""
    if isinstance(sampler, MixtureSampler):
        takes = [math.ceil(fraction * rows) for fraction, rows in zip(sampler.fractions, sampler.lengths)]
        blocks = max(-(-take // weight) for take, weight in zip(takes, sampler.weights))
        return sum(sampler.weights) * blocks
    if sampler.shard_blocks:
        index = sampler.shard_index if shard_index is None else shard_index
        return Sampler(sampler.length, sampler.batch_size, sampler.mode, sampler.seed, index, sampler.shard_count,
                       sampler.shuffle_window, sampler.block_rows).epoch_length
    return sampler.length


def pass_positions(sampler, epochs: int, shard_index: int) -> int:
    """The positions of shard `shard_index`'s own stream in a pass of `epochs` epochs: whole
    epochs, or after a resharded resume (reshard.py) the dealing's piece, then the epochs
    after the last one it completes."""
    transition = sampler.transition
    if transition is None:
        return epochs * epoch_positions(sampler, shard_index)
    own = sampler.of_shard(shard_index, sampler.shard_count)
    each, extra = divmod(sampler.dealing.total_rows, sampler.shard_count)
    piece = each + (shard_index < extra)
    later = max(0, epochs - (transition.through_epoch + 1))
    return transition.start + piece + later * own.epoch_length


@dataclasses.dataclass(frozen=True)
class FinitePass:
    """`epochs` epochs of `sampler`'s stream: `steps` steps (the same on every shard), step
    k keeping rows(k) rows on this shard."""

    epochs: int
    drop_last: bool
    batch_size: int
    steps: int
    positions: int  # this shard's stream positions in the pass (the global ones where shards share it)
    shard_blocks: bool
    shard_index: int
    shard_count: int

    @classmethod
    def of(cls, sampler, epochs: int, drop_last: bool) -> FinitePass:
        assert 1 <= epochs <= EPOCHS_MAX, epochs  # Checked by options.LoaderOptions.
        batch, shards = sampler.batch_size, sampler.shard_count
        shard_blocks = bool(getattr(sampler, "own_streams", False))
        if shard_blocks:  # Each shard reads its own stream: the pass ends where the longest one does.
            totals = [pass_positions(sampler, epochs, index) for index in range(shards)]
            steps = min(t // batch for t in totals) if drop_last else max(-(-t // batch) for t in totals)
            positions = totals[sampler.shard_index]
        else:
            positions = epochs * epoch_positions(sampler)
            steps = positions // (batch * shards) if drop_last else -(-positions // (batch * shards))
        if steps < 1 and getattr(sampler, "transition", None) is None:  # A resumed dealing may have none left.
            raise ValueError(f"the pass of {epochs} epoch(s) holds {positions} positions, fewer than one batch of "
                             f"{batch * shards} rows across shards, and drop_last=True drops it: nothing to deliver")
        return cls(epochs, bool(drop_last), batch, steps, positions, shard_blocks, sampler.shard_index, shards)

    def rows(self, step: int) -> int:
        """The rows step `step` keeps on this shard: batch_size, fewer at the end, or 0."""
        first = step * self.batch_size if self.shard_blocks else \
            global_position(step, self.batch_size, self.shard_index, self.shard_count)
        return max(0, min(self.batch_size, self.positions - first))

    @property
    def partial_from(self) -> int:
        """The first step that keeps fewer than batch_size rows (steps when none does)."""
        first_short = self.steps
        while first_short > 0 and self.rows(first_short - 1) < self.batch_size:
            first_short -= 1
        return first_short

    def to_dict(self) -> dict:
        return {"epochs": self.epochs, "drop_last": self.drop_last}

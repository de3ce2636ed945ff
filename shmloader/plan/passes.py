"""Finite passes: how many steps `epochs` epochs take, and which rows each step keeps.

The loader stays a function of the step: a pass of E epochs is the first E epochs of the
same stream of positions, cut. With shard_count hosts, a step's global batch is
batch_size * shard_count positions and host h takes block h of it (sampler.py), or with a
shuffle window split among shards (or after a resharded resume) each host reads its own
stream, whose passes differ in length by a few blocks.

Every host gets the same number of steps, and no host an empty batch (an empty batch is a
NaN loss that DDP averages into every rank, and BatchNorm fails on it). The steps in
which every host still has a whole batch of its own are delivered as they are; the rows
left after them (the *tail*: the global stream's last positions, or each host's rest of
its own stream, host after host) are dealt evenly, in order, over the fewest steps that
hold them: step first_step + k gives host j chunk k * shard_count + j of the tail, every
chunk of tail_rows // chunks rows or one more (Tail). Each row of the pass still comes
once. With drop_last the tail keeps only whole global batches (batch_size rows on every
host), so it drops what does not divide (fewer than batch_size * shard_count rows), never
a whole global batch. Without it every row comes once: where the rows left are fewer
than the chunks (some host would get none), the tail takes in one more step (every chunk
then has at least batch_size / 2 rows), and where it cannot (batch_size 1, a pass smaller
than shard_count rows, or a tail that would reach before a resumed run's first step,
Sampler.start_position) a chunk past the rows repeats one of them, one row marked as
padding (FinitePass.padding, Batch.padding): a host's batch is never empty, and the rows
not marked padding are each row once. A checkpoint taken inside
a tail continues only under its own shard count and batch size (checkpoint.py). A
mixture's pass is cut as before (its last step may be empty on some hosts): its sampler
has no position lookup to deal a tail with.

Where each stream ends and its tail are the sampler's to say (geometry.StreamGeometry:
epoch_positions, pass_positions, pass_tail; the tail's arithmetic is tail.py's): a single
source's epoch is its rows (its share of the blocks, for a shuffle window split among
shards); a mixture's epoch is the fewest whole interleave blocks in which every source
has delivered at least its epoch's rows (MixtureSampler.epoch_positions).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .geometry import StreamGeometry, global_position
from .options import EPOCHS_MAX
from .tail import Tail

ENDLESS = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class FinitePass:
    """`epochs` epochs of `sampler`'s stream: `steps` steps (the same on every shard), step
    k keeping rows(k) rows on this shard (none empty where `tail` deals the last steps)."""

    epochs: int
    drop_last: bool
    batch_size: int
    steps: int
    positions: int  # this shard's stream positions in the pass (the global ones where shards share it)
    own_streams: bool  # each shard reads its own stream (StreamGeometry.own_streams)
    shard_index: int
    shard_count: int
    tail: Tail | None = None  # None for a mixture, whose last step is cut as it falls

    @classmethod
    def of(cls, sampler: StreamGeometry, epochs: int, drop_last: bool) -> FinitePass:
        assert 1 <= epochs <= EPOCHS_MAX, epochs  # Checked by options.LoaderOptions.
        batch, shards, own_streams = sampler.batch_size, sampler.shard_count, sampler.own_streams
        tail = sampler.pass_tail(epochs, drop_last)
        if tail is None:  # A mixture's: its last step is cut as it falls.
            positions = sampler.pass_positions(epochs, sampler.shard_index)
            steps = positions // (batch * shards) if drop_last else -(-positions // (batch * shards))
        elif own_streams:  # Each shard reads its own stream: the full steps end where the shortest one does.
            steps, positions = tail.end_step, sampler.pass_positions(epochs, sampler.shard_index)
        else:
            steps = tail.end_step
            positions = sampler.offset + tail.first_step * batch * shards + tail.rows  # Past it, the rows left out.
        if steps < 1 and sampler.transition is None:  # A resumed dealing may have none left.
            why = (f"fewer than one batch of {batch * shards} rows across shards (batch_size={batch} on "
                   f"{shards} shard(s)) with drop_last=True" if drop_last else "no row")
            raise ValueError(f"the pass of {epochs} epoch(s) holds {positions} positions from its start: {why}, "
                             f"nothing to deliver")
        return cls(epochs, bool(drop_last), batch, steps, positions, own_streams, sampler.shard_index, shards, tail)

    def rows(self, step: int) -> int:
        """The rows step `step` keeps on this shard: batch_size, a tail's chunk (padding
        included), or 0 past the end."""
        if self.tail is not None:
            if step < self.tail.first_step:
                return self.batch_size
            return self.tail.chunk(step, self.shard_index)[1] if step < self.tail.end_step else 0
        first = global_position(step, self.batch_size, self.shard_index, self.shard_count)
        return max(0, min(self.batch_size, self.positions - first))  # A mixture's: cut as it falls.

    @property
    def pads(self) -> bool:
        """Whether some shard's step of this pass repeats a row (the same answer on every shard)."""
        return self.tail is not None and self.tail.padded > 0

    def padding(self, step: int) -> int:
        """How many of step `step`'s last rows on this shard repeat a row of the pass (a
        tail's chunk past its rows, see tail.Tail.chunk): 0 or 1."""
        tail = self.tail
        if tail is None or not tail.padded or not tail.first_step <= step < tail.end_step:
            return 0
        return int(tail.chunk(step, self.shard_index)[2])

    def padding_mask(self, step: int, rows: int):
        """Batch.padding of a step that holds `rows` rows: True for each repeated row."""
        mask = np.zeros(rows, dtype=bool)
        padded = self.padding(step)
        if padded:
            mask[max(0, rows - padded):] = True
        return mask

    @property
    def partial_from(self) -> int:
        """The first step that keeps fewer than batch_size rows (steps when none does)."""
        first_short = self.steps
        while first_short > 0 and self.rows(first_short - 1) < self.batch_size:
            first_short -= 1
        return first_short

    def in_tail(self, step: int) -> bool:
        """Whether `step` is a dealt tail's step after its first: part of the tail was
        delivered before it, so no single stream position says where the pass stands."""
        return self.tail is not None and self.tail.first_step < step < self.tail.end_step

    def to_dict(self) -> dict:
        return {"epochs": self.epochs, "drop_last": self.drop_last}

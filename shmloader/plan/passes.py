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
a whole global batch. Without it, fewer rows than hosts cannot be dealt so that each host
has one: the tail then takes in one more step (every chunk has at least batch_size / 2
rows), and where it cannot (batch_size 1, a pass smaller than shard_count rows, or a tail
that would reach before a resumed run's first step, Sampler.start_position) those rows,
fewer than shard_count, are left out, the same on every host. A checkpoint taken inside
a tail continues only under its own shard count and batch size (checkpoint.py). A
mixture's pass is cut as before (its last step may be empty on some hosts): its sampler
has no position lookup to deal a tail with.

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
class Tail:
    """The last steps of a pass, whose rows are dealt evenly among the shards (see the
    module docstring). The tail is one sequence of `rows` rows: the global stream from
    `first_step` * batch_size * shard_count, or with own streams shard 0's stream from
    first_step * batch_size (`remainders[0]` rows), then shard 1's, and so on."""

    first_step: int
    steps: int
    rows: int
    batch_size: int
    shard_count: int
    own_streams: bool
    remainders: tuple[int, ...]  # own streams: each shard's rows from first_step * batch_size on
    offset: int = 0  # the streams' shift (Sampler.offset)

    @property
    def end_step(self) -> int:
        return self.first_step + self.steps

    def chunk(self, step: int, shard_index: int) -> tuple[int, int]:
        """(offset in the tail, rows) of shard `shard_index`'s part of `step`."""
        assert self.first_step <= step < self.end_step, (step, self.first_step, self.end_step)
        chunks = self.steps * self.shard_count
        each, extra = divmod(self.rows, chunks)
        index = (step - self.first_step) * self.shard_count + shard_index
        return index * each + min(index, extra), each + (index < extra)

    def segments(self, step: int, shard_index: int):
        """(shard or None, stream position, rows) runs of a chunk: positions of shard h's
        own stream, or (None) of the global stream."""
        offset, rows = self.chunk(step, shard_index)
        if not self.own_streams:
            yield None, self.offset + self.first_step * self.batch_size * self.shard_count + offset, rows
            return
        first = self.first_step * self.batch_size + self.offset
        for shard, remainder in enumerate(self.remainders):
            if rows and offset < remainder:
                taken = min(rows, remainder - offset)
                yield shard, first + offset, taken
                offset, rows = remainder, rows - taken
            offset -= remainder
        assert rows == 0, rows


def tail_of(ends: list[int], batch_size: int, shard_count: int, own_streams: bool, drop_last: bool, offset: int = 0,
            start_step: int = 0) -> Tail:
    """The tail of a pass whose streams (each shard's own, or the one global stream) end at
    `ends` (positions after the shift `offset`): from the first step that is not whole on
    every shard, but no earlier than `start_step`, the first step of a resumed run."""
    unit = batch_size if own_streams else batch_size * shard_count
    global_batch = batch_size * shard_count
    first_step = max(start_step, min(end // unit for end in ends))

    def remainders_from(step: int) -> list[int]:
        return [max(0, end - step * unit) for end in ends]

    remainders = remainders_from(first_step)
    rows = sum(remainders)
    if drop_last:
        rows -= rows % global_batch
    elif rows < -(-rows // global_batch) * shard_count:  # Some chunk would be empty.
        if first_step > start_step and batch_size > 1:  # Over one more step every chunk has >= batch_size / 2 rows.
            first_step -= 1
            remainders = remainders_from(first_step)
            rows = sum(remainders)
        else:  # Fewer than shard_count rows cannot give every shard one.
            rows -= rows % shard_count
    steps = -(-rows // global_batch)
    assert rows >= steps * shard_count, (rows, steps, shard_count)  # No empty chunk.
    return Tail(first_step, steps, rows, batch_size, shard_count, own_streams, tuple(remainders), offset)


@dataclasses.dataclass(frozen=True)
class FinitePass:
    """`epochs` epochs of `sampler`'s stream: `steps` steps (the same on every shard), step
    k keeping rows(k) rows on this shard (none empty where `tail` deals the last steps)."""

    epochs: int
    drop_last: bool
    batch_size: int
    steps: int
    positions: int  # this shard's stream positions in the pass (the global ones where shards share it)
    shard_blocks: bool
    shard_index: int
    shard_count: int
    tail: Tail | None = None  # None for a mixture, whose last step is cut as it falls

    @classmethod
    def of(cls, sampler, epochs: int, drop_last: bool) -> FinitePass:
        assert 1 <= epochs <= EPOCHS_MAX, epochs  # Checked by options.LoaderOptions.
        batch, shards = sampler.batch_size, sampler.shard_count
        shard_blocks = bool(getattr(sampler, "own_streams", False))
        tail = None
        # A resumed stream's shift and first step (Sampler.start_position): the tail never
        # reaches before that step, whose rows the interrupted run delivered.
        start_step, offset = getattr(sampler, "start_step", 0), getattr(sampler, "offset", 0)
        transition = getattr(sampler, "transition", None)
        if transition is not None:  # The resumed step (the dealing's start) also bounds it where nothing was shifted.
            start_step = max(start_step, transition.start // batch)
        if shard_blocks:  # Each shard reads its own stream: the full steps end where the shortest one does.
            totals = [pass_positions(sampler, epochs, index) for index in range(shards)]
            tail = tail_of([max(0, total - offset) for total in totals], batch, shards, True, drop_last, offset,
                           start_step)
            steps, positions = tail.end_step, totals[sampler.shard_index]
        else:
            positions = epochs * epoch_positions(sampler)
            if isinstance(sampler, MixtureSampler):
                steps = positions // (batch * shards) if drop_last else -(-positions // (batch * shards))
            else:
                tail = tail_of([max(0, positions - offset)], batch, shards, False, drop_last, offset, start_step)
                steps = tail.end_step
                positions = offset + tail.first_step * batch * shards + tail.rows  # Past it, the rows left out.
        if steps < 1 and getattr(sampler, "transition", None) is None:  # A resumed dealing may have none left.
            raise ValueError(f"the pass of {epochs} epoch(s) holds {positions} positions, fewer than one batch of "
                             f"{batch * shards} rows across shards with drop_last=True, or fewer rows than shards: "
                             f"nothing to deliver")
        return cls(epochs, bool(drop_last), batch, steps, positions, shard_blocks, sampler.shard_index, shards, tail)

    def rows(self, step: int) -> int:
        """The rows step `step` keeps on this shard: batch_size, a tail's chunk, or 0 past the end."""
        if self.tail is not None:
            if step < self.tail.first_step:
                return self.batch_size
            return self.tail.chunk(step, self.shard_index)[1] if step < self.tail.end_step else 0
        first = global_position(step, self.batch_size, self.shard_index, self.shard_count)
        return max(0, min(self.batch_size, self.positions - first))  # A mixture's: cut as it falls.

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

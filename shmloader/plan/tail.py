"""A finite pass's tail: its last steps' rows dealt evenly among the shards, as arithmetic
on where each shard's stream ends (passes.py says why; a sampler says where, pass_tail).
Where the rows left are fewer than the chunks that give every shard one per step, the
chunks past them repeat a row of the tail, marked padding (FinitePass.padding)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tail:
    """The last steps of a pass, whose rows are dealt evenly among the shards (see
    passes.py's docstring). The tail is one sequence of `rows` rows: the global stream from
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

    def __post_init__(self) -> None:
        # Checked once, where a tail is made (tail_of): what chunk() and segments() rely on.
        global_batch = self.batch_size * self.shard_count
        held = sum(self.remainders)
        assert len(self.remainders) == (self.shard_count if self.own_streams else 1), (self.remainders,
                                                                                       self.shard_count)
        assert all(remainder >= 0 for remainder in self.remainders), self.remainders
        # The tail's rows are the streams' (less what drop_last or an even deal leaves out,
        # under one global batch).
        assert 0 <= self.rows <= held, (self.rows, held)
        assert held - self.rows < global_batch, (self.rows, held, global_batch)
        # As many steps as the rows fill; a chunk past the rows repeats one of them (padded).
        assert self.steps == -(-self.rows // global_batch), (self.steps, self.rows, global_batch)
        assert 0 <= self.padded < self.steps * self.shard_count or self.steps == 0, (self.rows, self.steps)

    @property
    def padded(self) -> int:
        """Chunks that hold no row of their own, so repeat one (fewer rows than chunks)."""
        return max(0, self.steps * self.shard_count - self.rows)

    @property
    def end_step(self) -> int:
        return self.first_step + self.steps

    def chunk(self, step: int, shard_index: int) -> tuple[int, int, bool]:
        """(offset in the tail, rows, padding) of shard `shard_index`'s part of `step`: its
        rows of the tail, or (padding, where the tail has fewer rows than chunks) one row of
        it repeated, so that no shard's batch is empty."""
        assert self.first_step <= step < self.end_step, (step, self.first_step, self.end_step)
        assert 0 <= shard_index < self.shard_count, (shard_index, self.shard_count)
        chunks = self.steps * self.shard_count
        index = (step - self.first_step) * self.shard_count + shard_index
        if self.rows < chunks:  # One row per chunk while they last, then repeats of them.
            return (index, 1, False) if index < self.rows else (index % self.rows, 1, True)
        each, extra = divmod(self.rows, chunks)
        offset, rows = index * each + min(index, extra), each + (index < extra)
        # The chunks cut the tail exactly, in order, none empty (each >= 1 here).
        assert rows > 0, (step, shard_index, self)
        assert offset + rows <= self.rows, (offset, rows, self.rows)
        return offset, rows, False

    def segments(self, step: int, shard_index: int):
        """(shard or None, stream position, rows) runs of a chunk: positions of shard h's
        own stream, or (None) of the global stream."""
        offset, rows, _ = self.chunk(step, shard_index)
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
        assert rows == 0, rows  # The chunk lies within the streams' remainders.


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
        # Otherwise (batch_size 1, a pass smaller than shard_count rows, a tail that would
        # reach before a resumed run's first step) the chunks past the rows are padding.
    steps = -(-rows // global_batch)
    return Tail(first_step, steps, rows, batch_size, shard_count, own_streams, tuple(remainders), offset)

"""Resharding a shuffle window split among shards: a checkpoint continued under another
shard count, every row of the interrupted epoch still delivered once (elastic resume).

With a shuffle window and several shards, each shard reads its own stream over its share
of the blocks (ShardShare in zig/sampler.zig), so a step's rows depend on the shard count
and a new count cannot simply continue the position. What it continues instead is a
*dealing* (`Transition`), a pure function of the checkpoint and the new shard count:

- Each old shard h stands at position P_h of its own stream (every shard of a checkpoint
  stands at the same step). Its unread positions up to the end of epoch E, the last epoch
  any old shard has begun, are its remainder R_h: the shares of every epoch up to E are
  then complete, and since the shares of one epoch partition the rows, so is the epoch.
- The remainders, old shard after old shard, make one sequence T of R = sum R_h rows,
  cut into new_count contiguous pieces of R // new_count rows (the first R % new_count
  one more). New shard j reads its piece in the old order, block-local as the old streams
  were, so a host still reads only about 1/new_count of the remaining bytes.
- After its piece, new shard j reads its own stream of the new shard count from epoch
  E + 1, whole.

A new shard's stream positions are its own as before (step * batch_size): the piece
occupies positions `start` .. `start + len(piece)`, where `start` is the first position of
the resumed step; positions before `start` are the new shard count's own stream.

A checkpoint records the Transition with its `Origin` (the checkpoint it was dealt from:
position, shard count, its own dealing, the resumed batch size), so that loading it deals
the transition again from the origin and refuses one whose keys differ (checkpoint.py).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from .._native import check, lib


_TRANSITION_KEYS = ("shard_count", "positions", "through_epoch", "start")
_ORIGIN_KEYS = ("position", "shard_count", "batch_size", "transition")


@dataclasses.dataclass(frozen=True)
class Origin:
    """The checkpoint a dealing continues, recorded so that a checkpoint's transition can
    be dealt again from it and compared (checkpoint.py): its position in its run's own
    streams, its run's shard count and dealing (without that dealing's origin: one level
    is enough to derive the positions, and keeps a checkpoint's size bounded however
    often the shard count changes), and the batch size the new run resumed with."""

    position: int
    shard_count: int
    batch_size: int
    transition: Transition | None

    def to_dict(self) -> dict:
        return {"position": self.position, "shard_count": self.shard_count, "batch_size": self.batch_size,
                "transition": None if self.transition is None else self.transition.to_dict()}

    @classmethod
    def from_dict(cls, data) -> Origin:
        if not isinstance(data, dict) or set(data) != set(_ORIGIN_KEYS):
            raise ValueError(f"the checkpoint's transition.origin must be a dict with {', '.join(_ORIGIN_KEYS)} (as "
                             f"state_dict() wrote it), got {data!r}")
        for key in ("position", "shard_count", "batch_size"):
            if not _is_int(data[key]) or data[key] < (0 if key == "position" else 1):
                raise ValueError(f"the checkpoint's transition.origin.{key} must be an integer >= "
                                 f"{0 if key == 'position' else 1}, got {data[key]!r}")
        earlier = data["transition"]
        if earlier is not None and (not isinstance(earlier, dict) or "origin" in earlier):
            raise ValueError(f"the checkpoint's transition.origin.transition must be None or a transition without an "
                             f"origin, got {earlier!r}")
        earlier = None if earlier is None else Transition.from_dict(earlier)
        return cls(data["position"], data["shard_count"], data["batch_size"], earlier)


@dataclasses.dataclass(frozen=True)
class Transition:
    """The dealing of an earlier shard count's unread rows (see the module docstring)."""

    shard_count: int  # the shards of the run the checkpoint came from
    positions: tuple[int, ...]  # each old shard's position in its own stream at the checkpoint
    through_epoch: int  # the old streams are read to the end of this epoch (-1: none was begun)
    start: int  # where in each new shard's stream its piece begins
    origin: Origin | None = None  # what it was dealt from (transition_of), None where made by hand

    def to_dict(self) -> dict:
        return {"shard_count": self.shard_count, "positions": list(self.positions),
                "through_epoch": self.through_epoch, "start": self.start,
                **({} if self.origin is None else {"origin": self.origin.to_dict()})}

    def without_origin(self) -> Transition:
        return dataclasses.replace(self, origin=None)

    @classmethod
    def from_dict(cls, data) -> Transition:
        """Refuses what a checkpoint could not have written, naming the key; whether the
        values agree with one another and with the checkpoint is checkpoint.py's."""
        keys = set(_TRANSITION_KEYS)
        if not isinstance(data, dict) or not keys <= set(data) or not set(data) <= keys | {"origin"}:
            raise ValueError(f"the checkpoint's transition must be a dict with {', '.join(_TRANSITION_KEYS)} and "
                             f"origin (as state_dict() wrote it), got {data!r}")
        shard_count, positions = data["shard_count"], data["positions"]
        if not _is_int(shard_count) or shard_count < 1 or not isinstance(positions, list) or \
                len(positions) != shard_count or not all(_is_int(p) and p >= 0 for p in positions):
            raise ValueError(f"the checkpoint's transition.positions must hold one non-negative integer position per "
                             f"old shard (transition.shard_count={shard_count!r}), got {positions!r}")
        if not _is_int(data["through_epoch"]) or data["through_epoch"] < -1 or not _is_int(data["start"]) or \
                data["start"] < 0:
            raise ValueError(f"the checkpoint's transition has through_epoch {data['through_epoch']!r} and "
                             f"start {data['start']!r}; expected integers >= -1 and >= 0")
        origin = data.get("origin")
        if "origin" in data and origin is None:
            raise ValueError("the checkpoint's transition.origin is None; a transition state_dict() writes records "
                             "the checkpoint it was dealt from")
        return cls(shard_count, tuple(positions), data["through_epoch"], data["start"],
                   None if origin is None else Origin.from_dict(origin))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def transition_from(sampler, positions: list[int], start: int, epochs: int | None) -> Transition:
    """The dealing that continues old shards standing at `positions` (their own streams'),
    for `sampler`'s data; within a finite pass of `epochs`, no old stream past its end."""
    lengths = [sampler.of_shard(h, len(positions)).epoch_length for h in range(len(positions))]
    if epochs is not None:
        positions = [min(p, epochs * length) for p, length in zip(positions, lengths)]
    # The last epoch an old shard has begun: one that stands at an epoch's start has begun none of it.
    through = max((p - 1) // length if p else -1 for p, length in zip(positions, lengths))
    return Transition(len(positions), tuple(positions), through, start)


def transition_of(sampler, origin: Origin, epochs: int | None) -> Transition:
    """The dealing of `origin`'s unread rows among `sampler`'s shards (batch_size the
    origin's): a pure function of the two, which a checkpoint's transition is compared
    with. Raises ValueError where the origin's run was still dealing an earlier one."""
    assert sampler.batch_size == origin.batch_size, (sampler.batch_size, origin.batch_size)
    dealt, position = origin.transition, origin.position
    if dealt is None:  # Every old shard stands at the same position of its own stream.
        positions = [position] * origin.shard_count
    elif position <= dealt.start:  # Its run had not begun its own dealing: deal the same rows anew.
        positions = list(dealt.positions)
    else:
        dealings = [sampler.of_shard(index, origin.shard_count).with_transition(dealt).dealing
                    for index in range(origin.shard_count)]
        positions = [dealing.own_position(position) for dealing in dealings]
        if None in positions:
            end = max(dealing.piece_end_position for dealing in dealings)
            raise ValueError(
                f"the checkpoint was taken at position {position}, while its run (shard_count={origin.shard_count}) "
                f"was still dealing the rows an earlier shard count ({dealt.shard_count}) had left (until position "
                f"{end}); a dealing is not dealt again. Resume it with shard_count={origin.shard_count}, or change "
                f"the shard count at a checkpoint from position {end} on")
    start = position // origin.batch_size * origin.batch_size  # The first position of the resumed step.
    return dataclasses.replace(transition_from(sampler, positions, start, epochs), origin=origin)


class Dealing:
    """One new shard's view of a Transition: which rows its stream positions hold."""

    def __init__(self, sampler, transition: Transition) -> None:
        self.sampler, self.transition = sampler, transition
        old_count = transition.shard_count
        self._old = {}  # old shard -> its Sampler, made for the pieces this shard reads
        # Where each old stream's remainder ends: the end of epoch through_epoch of its own stream.
        self._ends = [(transition.through_epoch + 1) * self._old_length(h) for h in range(old_count)]
        # Every old shard stands within the epochs dealt (through_epoch is the last one any
        # has begun): a remainder is never negative, so T's starts below are monotone.
        for h, (end, position) in enumerate(zip(self._ends, transition.positions)):
            if not 0 <= position <= end:  # A checkpoint's own numbers (an edited one): refused, not asserted.
                raise ValueError(f"transition.positions[{h}] is {position}, outside old shard {h}'s stream "
                                 f"through epoch {transition.through_epoch} (0..{end})")
        remainders = [end - p for end, p in zip(self._ends, transition.positions)]
        self._cumulative = np.cumsum([0] + remainders).tolist()  # where each old remainder starts in T
        self.total_rows = self._cumulative[-1]
        j = sampler.shard_index
        self.piece_start = self.piece_start_of(j)  # in T
        self.piece_rows = self.piece_rows_of(j)
        self.piece_end_position = transition.start + self.piece_rows  # in this shard's stream
        # The own stream from epoch through_epoch + 1, which follows the piece.
        self.own_offset = (transition.through_epoch + 1) * sampler.epoch_length - self.piece_end_position
        self._assert_pieces()

    def _assert_pieces(self) -> None:
        """The new shards' pieces cut T exactly: each starts where the one before ends, the
        last ends at T's end (they sum to the total), and this shard's lies within T."""
        count = self.sampler.shard_count
        assert self.piece_start_of(0) == 0, self.piece_start_of(0)
        last = self.piece_start_of(count - 1) + self.piece_rows_of(count - 1)
        assert last == self.total_rows, (last, self.total_rows, count)
        assert 0 <= self.piece_start, self.piece_start
        assert self.piece_start + self.piece_rows <= self.total_rows, (self.piece_start, self.piece_rows,
                                                                       self.total_rows)

    def piece_start_of(self, shard_index: int) -> int:
        """Where new shard `shard_index`'s piece starts in T, the old remainders in order."""
        each, extra = divmod(self.total_rows, self.sampler.shard_count)
        return shard_index * each + min(shard_index, extra)

    def piece_rows_of(self, shard_index: int) -> int:
        """The rows of T new shard `shard_index` reads first: R // new_count, or one more."""
        each, extra = divmod(self.total_rows, self.sampler.shard_count)
        return each + (shard_index < extra)

    def _old_length(self, h: int) -> int:
        return self._old_sampler(h).epoch_length

    def _old_sampler(self, h: int):
        found = self._old.get(h)
        if found is None:
            found = self._old[h] = self.sampler.of_shard(h, self.transition.shard_count)
        return found

    def segments(self, first: int, count: int):
        """(sampler, stream position, rows, old shard or None) runs covering this shard's
        positions first .. first + count, in order: its own stream before and after the
        piece (old shard None), the old streams within it."""
        position, end = first, first + count
        start = self.transition.start
        while position < end:
            if position < start:
                run = self.sampler, position, min(end, start) - position, None
            elif position < self.piece_end_position:
                t = self.piece_start + position - start
                h = bisect.bisect_right(self._cumulative, t) - 1
                rows = min(end, self.piece_end_position, start + self._cumulative[h + 1] - self.piece_start) - position
                old_position = self.transition.positions[h] + t - self._cumulative[h]
                # Within old shard h's remainder: from where it stood to the dealt epochs' end.
                assert self.transition.positions[h] <= old_position, (h, old_position, self.transition.positions)
                assert old_position + rows <= self._ends[h], (h, old_position, rows, self._ends[h])
                run = self._old_sampler(h), old_position, rows, h
            else:
                run = self.sampler, position + self.own_offset, end - position, None
            # Every run moves forward: positions are monotone and the loop ends within count runs.
            assert run[2] > 0, (first, count, position, run[2])
            yield run
            position += run[2]

    def fill(self, first: int, count: int, pointer) -> None:
        """Writes the rows of positions first .. first + count to the cffi uint64_t pointer."""
        offset = 0
        for sampler, position, rows, _ in self.segments(first, count):
            check(lib.shm_sampler_fill_positions(sampler._config, position, pointer + offset, rows),
                  f"cannot fill positions {position} .. {position + rows}")
            offset += rows
        assert offset == count, (first, count, offset)  # The runs cover the positions exactly.

    def keys(self, first: int, count: int) -> np.ndarray:
        """Each row's transform key (ctx.positions): the one the old run gave it within the
        piece (its position there interleaved with the old shards'), else this shard's."""
        keys = np.empty(count, dtype=np.uint64)
        offset = 0
        for sampler, position, rows, old in self.segments(first, count):
            shards, index = (self.sampler.shard_count, self.sampler.shard_index) if old is None else \
                (self.transition.shard_count, old)
            keys[offset:offset + rows] = np.arange(position, position + rows, dtype=np.uint64) * np.uint64(shards) + \
                np.uint64(index)
            offset += rows
        return keys

    def stream_at(self, position: int):
        """(key, sampler, its stream position) of `position`: what the read-ahead follows."""
        sampler, found, _, old = next(self.segments(position, 1))
        return ("old", old) if old is not None else ("own", position < self.transition.start), sampler, found

    def own_position(self, position: int) -> int | None:
        """This shard's own-stream position at `position` once its piece is read, None
        before the piece ends (the rows left then are the piece's)."""
        return None if position < self.piece_end_position else position + self.own_offset

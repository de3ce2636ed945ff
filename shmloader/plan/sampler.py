"""The Python face of the Zig sampler: a step number in, a batch of uint64 row indices out."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from .._native import check, ffi, lib
from .geometry import GLOBAL_ORDER, SHUFFLE_ORDER, StreamShape, global_position
from .options import (
    EPOCHS_MAX,
    LENGTH_MAX,
    MODES,
    U64_MAX,
    check_integer,
    check_mode,
    check_window,
)
from .reshard import Dealing, Transition
from .tail import Tail, tail_of


class Places(NamedTuple):
    """A stream position in its epoch's block-local shuffle (zig/permutation.zig, SlidingShuffle):
    the epoch deals from `total` places (blocks, the tail last), `opened` of them by the
    position, all rows of the first `closed` before it. A reader needs places [closed,
    opened) now and the following ones next."""

    epoch: int
    opened: int
    closed: int
    total: int


def read_places(epoch: int, function, *arguments) -> Places:
    """Places from the native `function` (shm_sampler_places or shm_mixture_places)."""
    opened, closed, total = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
    check(function(*arguments, opened, closed, total), f"cannot find the places of position {arguments[-1]}")
    return Places(epoch, int(opened[0]), int(closed[0]), int(total[0]))


def read_place_blocks(function, *arguments) -> np.ndarray:
    """The blocks at places [first, first + count) of an epoch, from the native `function`
    (shm_sampler_place_blocks or shm_mixture_place_blocks; arguments end epoch, first, count)."""
    count = arguments[-1]
    out = np.empty(count, dtype=np.uint64)
    check(function(*arguments[:-1], ffi.from_buffer("uint64_t[]", out), count),
          f"cannot list places {arguments[-2]} to {arguments[-2] + count} of epoch {arguments[-3]}")
    return out


def window_blocks_of(shuffle_window: int, block_rows: int, length: int) -> int:
    """Blocks a phase of the block-local shuffle mixes: ceil(shuffle_window / block_rows),
    but no more than the data has (a larger window orders rows no differently)."""
    return max(1, min(-(-shuffle_window // block_rows), length // block_rows + 1))


def block_runs(block: int, block_rows: int, length: int) -> list[tuple[int, int]]:
    """(first row, rows) of block `block` of `block_rows` rows (the last one shorter)."""
    first = block * block_rows
    return [(first, min(block_rows, length - first))]


def derive_seed(*parts) -> int:
    """A 64-bit value keyed by `parts` (their text joined by "/"): every seed the loader
    derives (a mixture's per-source seeds, transform names, the global generators'
    reseeding) comes from here."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def sample_seeds(seed: int, positions: np.ndarray) -> list[int]:
    """The 64-bit seeds of the samples at stream `positions`: splitmix64's finaliser of
    key + position * 2^64/phi, the key derive_seed(seed, "sample"). One numpy pass per batch
    (a hash per sample cost as much as seeding a generator)."""
    key = np.uint64(derive_seed(seed, "sample"))
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as splitmix64's does.
        z = key + np.asarray(positions, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z.tolist()


class Sampler(StreamShape):
    """Maps a step to the row indices of that step's batch, as a pure function.

    The batch for `step` depends only on (length, batch_size, mode, seed, shard_index,
    shard_count, step), so any process can compute any step and resuming is exact.

    Modes:
      - "sequential": position p = step*B + i (global), index p mod length.
      - "random": independent uniform draws with replacement, unbiased.
      - "shuffle": without replacement; epoch p // length is a seeded permutation of all
        rows, so every epoch covers every row once, and batches cross epochs seamlessly.

      - "shuffle" with `shuffle_window` (rows): the block-local shuffle, for data larger
        than memory. Each epoch permutes blocks of `block_rows` consecutive rows and deals
        them out as a sliding window: each block's rows are spread over B = ceil(
        shuffle_window / block_rows) consecutive phases of block_rows positions, so a
        phase mixes the rows of B blocks, one block opens and one closes per phase, and
        the rows of a phase are permuted (the rows past the last full block come last).
        Every epoch still covers every row once; readers read whole blocks ahead, about
        one window's worth of them at a time, instead of random rows.

    Sharding: the global batch of a step has batch_size * shard_count positions; shard h
    takes the h-th block of batch_size. Shards of one step are disjoint and together they
    form the global batch. With a shuffle window, each shard instead reads only its share
    of the blocks, so that each host reads about 1/shard_count of the bytes: the full
    blocks whose slot in the epoch's block permutation is h modulo shard_count (and the tail
    rows for the shard next in that round), shuffled as a dataset of its own, at
    the shard's own positions step * batch_size. The shards' shares of an epoch partition
    it (every row once per epoch across shards), but a shard's batches now depend on
    shard_count, and shards whose shares differ by a block cross epochs a little apart.
    """

    fills_positions = True  # Any run of positions (shm_sampler_fill_positions): a pass's tail, a shifted resume.
    has_sources = False

    def __init__(
        self,
        length: int,
        batch_size: int,
        mode: str = "shuffle",
        seed: int = 0,
        shard_index: int = 0,
        shard_count: int = 1,
        shuffle_window: int | None = None,
        block_rows: int = 1,
        transition=None,
        epochs: int | None = None,
        drop_last: bool = False,
        start_position: int = 0,
    ) -> None:
        # The loader's settings came through options.LoaderOptions; these are the same
        # checks, against the same limits, for a sampler built from a dict in a reader.
        self.length = check_integer("length", length, 1, LENGTH_MAX)
        self._check_shape(batch_size, seed, shard_index, shard_count)
        self.mode = check_mode(mode)
        self.shuffle_window = check_window(shuffle_window, mode)
        self.block_rows = check_integer("block_rows", block_rows, 1, LENGTH_MAX)
        window_blocks = 0
        if shuffle_window is not None:
            # A window that covers the data holds all of it at once: the global shuffle is
            # then its order (a block-local one would keep the block order as its only
            # locality, and a batch of sorted data far fewer labels than the global one).
            if shuffle_window < self.length:
                window_blocks = window_blocks_of(shuffle_window, self.block_rows, self.length)
        self.blocks_per_window = window_blocks
        # Each shard reads only its share of the blocks (see the class docstring).
        self.shard_blocks = bool(window_blocks) and self.shard_count > 1
        self._config = ffi.new("shm_sampler_config *")
        self._config.flags = 1 if self.shard_blocks else 0
        self._config.block_rows = self.block_rows
        self._config.window_blocks = window_blocks
        self._config.length = self.length
        self._config.batch_size = self.batch_size
        self._config.seed = self.seed
        self._config.mode = MODES[mode]
        self._config.shard_index = self.shard_index
        self._config.shard_count = self.shard_count
        # Rows in this shard's share of an epoch (zig/sampler.zig ShardShare), or all of them.
        self.epoch_length = int(lib.shm_share_length(self._config)) if self.shard_blocks else self.length
        if self.epoch_length == 0:
            raise ValueError(f"shard {self.shard_index} of {self.shard_count} gets no rows: {self.length} rows make "
                             f"{self.length // self.block_rows} blocks of {self.block_rows}; use fewer shards or a "
                             f"smaller shuffle_window (blocks are at most an eighth of it)")
        # fill() remembers the last `out` it checked, since callers reuse one buffer.
        self._last_out = self._last_shape = self._last_pointer = None
        check(lib.shm_sampler_check(self._config), "invalid sampler configuration")
        # A resumed checkpoint of another shard count: its unread rows dealt first (reshard.py).
        if transition is not None and not isinstance(transition, Transition):
            transition = Transition.from_dict(transition)
        if transition is not None and not window_blocks:
            raise ValueError("a transition (a resharded checkpoint's dealing) needs a shuffle_window smaller than "
                             "the data")
        self.transition = transition
        self.dealing = None if transition is None else Dealing(self, transition)
        # The loader's finite pass, whose last steps deal their rows evenly among the shards
        # (passes.py Tail): every filler computes the same tail from these.
        self.epochs = None if epochs is None else check_integer("epochs", epochs, 1, EPOCHS_MAX)
        self.drop_last = bool(drop_last)
        self._tail, self._tail_known, self._tail_streams = None, epochs is None, {}
        # An elastic resume's position: the stream is shifted by `offset` (its distance from
        # the start of the step that holds it), so that that step, start_step, starts at the
        # position and is whole on every shard (no shard's part of it lies before the
        # position: no empty batch, nothing to cut). A pass's tail never reaches before it.
        self.start_position = check_integer("start_position", start_position, 0, U64_MAX)
        self.start_step, self.offset = divmod(self.start_position, self.global_batch)

    def fill(self, step: int, out: np.ndarray | None = None) -> np.ndarray:
        """Returns the indices of `step` (uint64, batch_size of them), written into `out` if given."""
        step = check_integer("step", step, 0, U64_MAX)
        if out is None:
            out = np.empty(self.batch_size, dtype=np.uint64)
        if out is self._last_out and out.shape == self._last_shape:
            pointer = self._last_pointer  # The same buffer again: skip the checks.
        elif (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint64
            or out.shape != (self.batch_size,)
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise ValueError(
                f"out must be a writable, C-contiguous uint64 array of shape ({self.batch_size},)"
            )
        else:
            pointer = ffi.from_buffer("uint64_t[]", out)
            self._last_out, self._last_shape, self._last_pointer = out, out.shape, pointer
        self.fill_unchecked(step, pointer)
        return out

    @property
    def tail(self) -> Tail | None:
        """The dealt tail of the loader's finite pass (pass_tail), None for an endless loader."""
        if not self._tail_known:
            self._tail, self._tail_known = self.pass_tail(self.epochs, self.drop_last), True
        return self._tail

    def _in_tail(self, step: int):
        tail = self.tail
        return tail if tail is not None and tail.first_step <= step < tail.end_step else None

    def _tail_stream(self, shard: int | None) -> Sampler:
        """The sampler whose positions a tail's segment names: this one (the global stream),
        or shard `shard`'s own stream (its dealing included)."""
        if shard is None:
            return self
        found = self._tail_streams.get(shard)
        if found is None:
            found = self._tail_streams[shard] = self.of_shard(shard, self.shard_count).with_transition(self.transition)
        return found

    def _fill_tail(self, tail: Tail, step: int, pointer) -> None:
        """A tail step's chunk (tail.Tail), then copies of its first row up to batch_size:
        those are computed (a batch has a fixed size) and cut, never delivered."""
        offset = 0
        for shard, position, rows in tail.segments(step, self.shard_index):
            stream = self._tail_stream(shard)
            if stream.dealing is not None:
                stream.dealing.fill(position, rows, pointer + offset)
            else:
                check(lib.shm_sampler_fill_positions(stream._config, position, pointer + offset, rows),
                      f"cannot fill positions {position} .. {position + rows}")
            offset += rows
        assert 0 < offset <= self.batch_size, (step, offset)  # A chunk is never empty, never more than a batch.
        batch = np.frombuffer(ffi.buffer(pointer, self.batch_size * 8), dtype=np.uint64)
        batch[offset:] = batch[0]

    def fill_unchecked(self, step: int, pointer) -> None:
        """fill() into a cffi uint64_t pointer to batch_size entries, for callers that checked it."""
        assert 0 <= step <= U64_MAX, step
        tail = self._in_tail(step)
        if tail is not None:
            self._fill_tail(tail, step, pointer)
            return
        if self.dealing is not None:
            self.dealing.fill(step * self.batch_size + self.offset, self.batch_size, pointer)
            return
        if self.offset:  # The shifted stream: this shard's batch_size positions from there.
            position = self.stream_position(step)
            check(lib.shm_sampler_fill_positions(self._config, position, pointer, self.batch_size),
                  f"cannot fill step {step} (positions from {position})")
            return
        check(lib.shm_sampler_fill(self._config, step, pointer, self.batch_size),
              f"cannot fill step {step} (step too large?)")

    def stream_position(self, step: int) -> int:
        """Where `step` starts in the stream this shard reads (first_position), shifted."""
        return self.first_position(step) + self.offset

    @property
    def shuffle_order(self) -> str:
        """The block-local shuffle's sliding order, or the global shuffle a window covers."""
        return SHUFFLE_ORDER if self.blocks_per_window else GLOBAL_ORDER

    def epoch_positions(self, shard_index: int | None = None) -> int:
        """Rows in one epoch of shard `shard_index`'s stream (None: this shard's): its share
        of the blocks (shm_share_length), or all of them where shards share the stream."""
        if shard_index is None or shard_index == self.shard_index:
            return self.epoch_length
        return self.of_shard(shard_index, self.shard_count).epoch_length

    def pass_positions(self, epochs: int, shard_index: int) -> int:
        """The positions of shard `shard_index`'s stream in a pass of `epochs` epochs: whole
        epochs, or after a resharded resume (reshard.py) the dealing's piece, then the epochs
        after the last one it completes."""
        epoch = self.epoch_positions(shard_index)
        if self.transition is None:
            return epochs * epoch
        later = max(0, epochs - (self.transition.through_epoch + 1))
        return self.transition.start + self.dealing.piece_rows_of(shard_index) + later * epoch

    def pass_tail(self, epochs: int | None, drop_last: bool) -> Tail | None:
        """The dealt tail of a pass of `epochs` epochs (None: endless, no tail): from the
        first step not whole on every shard, never before the resumed run's first step,
        whose rows the interrupted run delivered (start_step, or where a dealing starts)."""
        if epochs is None:
            return None
        first_step = self.start_step
        if self.transition is not None:  # The resumed step also bounds it where nothing was shifted.
            first_step = max(first_step, self.transition.start // self.batch_size)
        shards = range(self.shard_count) if self.own_streams else [self.shard_index]
        ends = [max(0, self.pass_positions(epochs, index) - self.offset) for index in shards]
        return tail_of(ends, self.batch_size, self.shard_count, self.own_streams, drop_last, self.offset, first_step)

    @property
    def deals_on_reshard(self) -> bool:
        """Whether another shard count deals this stream's unread rows (reshard.py): with a
        window smaller than the data, whose shards (where there are several) read their own
        blocks. Otherwise a changed shard count continues the global position."""
        return bool(self.blocks_per_window)

    def with_transition(self, transition: Transition | None) -> Sampler:
        """This sampler, dealing `transition` first (or not at all: None)."""
        data = {key: value for key, value in self.to_dict().items() if key != "transition"}
        return Sampler(**data, transition=transition)

    def with_start(self, start_position: int) -> Sampler:
        """This sampler resumed at stream position `start_position` (see __init__)."""
        return Sampler(**{**self.to_dict(), "start_position": start_position})

    def with_pass(self, epochs: int | None, drop_last: bool) -> Sampler:
        """This sampler within a finite pass of `epochs` (None: endless), whose tail it deals."""
        data = {key: value for key, value in self.to_dict().items() if key not in ("epochs", "drop_last")}
        return Sampler(**data, **({} if epochs is None else {"epochs": epochs, "drop_last": drop_last}))

    def of_shard(self, shard_index: int, shard_count: int) -> Sampler:
        """The stream of shard `shard_index` of `shard_count` over this sampler's data (batch 1)."""
        return Sampler(self.length, 1, self.mode, self.seed, shard_index, shard_count, self.shuffle_window,
                       self.block_rows)

    def row_keys(self, step: int, count: int) -> np.ndarray:
        """Each row's key for a transform's ctx.rng: its global position, or where each shard
        reads its own stream, its position there interleaved with the other shards'
        (independent of batch_size, which a resume may change)."""
        tail = self._in_tail(step)
        if tail is not None:
            return self._tail_keys(tail, step, count)
        if self.dealing is not None:
            return self.dealing.keys(step * count + self.offset, count)
        if self.shard_blocks:
            own = np.arange(step * count + self.offset, (step + 1) * count + self.offset, dtype=np.uint64)
            return own * np.uint64(self.shard_count) + np.uint64(self.shard_index)
        first = global_position(step, count, self.shard_index, self.shard_count) + self.offset
        return np.arange(first, first + count, dtype=np.uint64)

    def _tail_keys(self, tail, step: int, count: int) -> np.ndarray:
        """row_keys of a tail step: each row keyed as its own stream keys it."""
        keys = np.empty(count, dtype=np.uint64)
        offset = 0
        for shard, position, rows in tail.segments(step, self.shard_index):
            stream = self._tail_stream(shard)
            if shard is None:
                keys[offset:offset + rows] = np.arange(position, position + rows, dtype=np.uint64)
            elif stream.dealing is not None:
                keys[offset:offset + rows] = stream.dealing.keys(position, rows)
            else:
                keys[offset:offset + rows] = np.arange(position, position + rows, dtype=np.uint64) * \
                    np.uint64(self.shard_count) + np.uint64(shard)
            offset += rows
        keys[offset:] = keys[0]
        return keys

    def window_stream(self, step: int) -> tuple:
        """(key, sampler, position): the stream whose blocks `step` reads, for the read-ahead
        (its places and place_blocks), and a key that changes when the stream does."""
        tail = self._in_tail(step)
        if tail is not None:
            shard, position, _ = next(tail.segments(step, self.shard_index))
            stream = self._tail_stream(shard)
            if shard is None:
                return None, self, position
            if stream.dealing is not None:
                key, sampler, found = stream.dealing.stream_at(position)
                return ("tail", shard, key), sampler, found
            return ("tail", shard), stream, position
        if self.dealing is not None:
            return self.dealing.stream_at(step * self.batch_size + self.offset)
        return None, self, self.stream_position(step)

    def places(self, position: int) -> Places:
        """Where stream `position` (see stream_position) stands in its epoch's block-local
        shuffle: what a reader reads ahead and lets go of (storage/readahead.py)."""
        position = check_integer("position", position, 0, U64_MAX)
        return read_places(position // self.epoch_length, lib.shm_sampler_places, self._config, position)

    def place_blocks(self, epoch: int, first: int, count: int) -> np.ndarray:
        """The block ids (row // block_rows) at places first .. first + count of `epoch`."""
        return read_place_blocks(lib.shm_sampler_place_blocks, self._config, epoch, first, count)

    def step_runs(self, step: int) -> list[tuple[int, int]] | None:
        """(first row, rows) of the runs of `step`'s rows in mode "sequential" away from a
        finite pass's tail, from its stream position (the rows are the positions modulo the
        length, see the class docstring); None where only fill() says (other modes, a
        tail's steps): what an in-order read-ahead asks for (storage/readahead.InOrder)."""
        if self.mode != "sequential" or self.dealing is not None or self._in_tail(step) is not None:
            return None
        if self.batch_size >= self.length:
            return [(0, self.length)]
        position = self.stream_position(step)
        if position + self.batch_size > U64_MAX + 1:  # As fill() does: past the 64-bit stream.
            raise ValueError(f"step {step}: positions from {position} run past the 64-bit stream")
        first = position % self.length
        count = min(self.batch_size, self.length - first)
        return [(first, count)] + ([(0, self.batch_size - count)] if count < self.batch_size else [])

    def row_runs(self, block: int) -> list[tuple[int, int]]:
        """(first row, rows) of block `block`: what the read-ahead reads for it."""
        return block_runs(block, self.block_rows, self.length)

    def window_views(self) -> list[Sampler]:
        """What reads ahead for this sampler's windows (storage/readahead.py): itself, or nothing
        without a shuffle window. A mixture gives one per source."""
        return [self] if self.blocks_per_window else []

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.iterate(0)

    def iterate(self, start_step: int = 0) -> Iterator[np.ndarray]:
        """Yields the batches of steps start_step, start_step + 1, ... forever (new arrays)."""
        step = check_integer("start_step", start_step, 0, U64_MAX)
        while True:
            yield self.fill(step)
            step += 1

    def to_dict(self) -> dict:
        """The small description that crosses a process boundary to rebuild this sampler
        (Sampler.from_dict), and that a checkpoint records."""
        return {
            "length": self.length,
            "batch_size": self.batch_size,
            "mode": self.mode,
            "seed": self.seed,
            "shard_index": self.shard_index,
            "shard_count": self.shard_count,
            "shuffle_window": self.shuffle_window,
            "block_rows": self.block_rows,
            **({} if self.transition is None else {"transition": self.transition.to_dict()}),
            **({} if self.epochs is None else {"epochs": self.epochs, "drop_last": self.drop_last}),
            **({"start_position": self.start_position} if self.start_position else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Sampler:
        return cls(**data)

    def __repr__(self) -> str:
        arguments = ", ".join(f"{key}={value!r}" for key, value in self.to_dict().items())
        return f"Sampler({arguments})"

"""Sources and weighted mixtures: position -> (source, row), statelessly, in Zig.

`Source(fields, weight, fraction, fixed)` declares one data set; a loader given a list of
them draws every block of sum(weights) consecutive positions with each source's exact
share, in a fixed interleave, and each source runs its own shuffle epochs over
ceil(fraction * rows) rows (a fresh subset each epoch, or one fixed subset). With a
shuffle window each source runs the block-local shuffle instead (its own blocks, sized to
its own rows), and each reads ahead for its own windows (SourceWindows).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .._native import check, ffi, lib
from .geometry import GLOBAL_ORDER, SHUFFLE_ORDER, StreamShape
from .options import (
    SOURCES_MAX,
    U32_MAX,
    U64_MAX,
    check_integer,
    check_window,
)
from .sampler import (
    Places,
    block_runs,
    derive_seed,
    read_place_blocks,
    read_places,
    window_blocks_of,
)

# A block of sum(weights) positions is laid out once, in memory: bound its size.
_BLOCK_MAX = 1 << 20


@dataclasses.dataclass(frozen=True)
class Source:
    """One data set of a mixture: `fields` maps the same field names as every other source
    to paths (a path, a list or a glob of files, or Padded/Packed/Windows of them).
    `weight` (a positive integer) is its share of every block of sum(weights) positions;
    `fraction` the share of its rows used per source epoch (a fresh subset each epoch, or
    one fixed subset with fixed=True): up-sampling is a weight, down-sampling a fraction."""

    fields: dict
    weight: int = 1
    fraction: float = 1.0
    fixed: bool = False

    def checked(self, index: int) -> Source:
        if not isinstance(self.fields, dict) or not self.fields:
            raise TypeError(f"source {index}: fields must be a non-empty mapping of field name to path")
        check_integer(f"source {index} weight", self.weight, 1, U32_MAX)
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, numbers.Real) or not 0 < self.fraction <= 1:
            raise ValueError(f"source {index}: fraction must be a number in (0, 1], got {self.fraction!r}")
        if not isinstance(self.fixed, (bool, np.bool_)):
            raise TypeError(f"source {index}: fixed must be True or False, got {self.fixed!r}")
        return dataclasses.replace(self, fraction=float(self.fraction), fixed=bool(self.fixed))


def interleave(weights: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The fixed pattern of one block: for each offset, its source and that source's rank
    among the block's earlier offsets. Smooth weighted round-robin: each source appears
    exactly `weight` times, spread as evenly as the weights allow."""
    block = sum(weights)
    if block > _BLOCK_MAX:
        raise ValueError(f"the weights sum to {block}; at most {_BLOCK_MAX} (divide them by a common factor)")
    current = np.zeros(len(weights), dtype=np.int64)
    weight_array = np.asarray(weights, dtype=np.int64)
    sources = np.empty(block, dtype=np.uint32)
    ranks = np.empty(block, dtype=np.uint64)
    counts = np.zeros(len(weights), dtype=np.uint64)
    for offset in range(block):
        current += weight_array
        chosen = int(np.argmax(current))
        current[chosen] -= block
        sources[offset], ranks[offset] = chosen, counts[chosen]
        counts[chosen] += 1
    return sources, ranks


class MixtureSampler(StreamShape):
    """Maps a step to (source-local rows, source ids) of that step's batch, as a pure
    function of (source sizes, weights, fractions, fixed, batch size, seed, shard, step).
    Its shards always share one global stream (a window is each source's, read by every
    shard), so a changed shard count continues its position: there is no dealing. It fills
    whole steps only: its pass's last step is cut, and so is a resumed one (StreamGeometry)."""

    deals_on_reshard = False
    fills_positions = False
    has_sources = True

    def __init__(self, lengths: list[int], weights: list[int], fractions: list[float], fixed: list[bool],
                 batch_size: int, seed: int = 0, shard_index: int = 0, shard_count: int = 1,
                 shuffle_window: int | None = None, block_rows: list[int] | None = None) -> None:
        if not 1 <= len(lengths) <= SOURCES_MAX:
            raise ValueError(f"a mixture has 1 to {SOURCES_MAX} sources, got {len(lengths)}")
        self.lengths, self.weights = [int(x) for x in lengths], [int(x) for x in weights]
        self.fractions, self.fixed = [float(x) for x in fractions], [bool(x) for x in fixed]
        self._check_shape(batch_size, seed, shard_index, shard_count)
        self.mode = "shuffle"
        self.takes = [max(1, math.ceil(fraction * length)) for fraction, length in zip(self.fractions, self.lengths)]
        self.shuffle_window, self.block_rows = shuffle_window, None
        self.window_blocks = [0] * len(lengths)
        if check_window(shuffle_window, self.mode) is not None:
            if block_rows is None or len(block_rows) != len(lengths):
                raise ValueError(f"a mixture with a shuffle_window needs block_rows for each of its {len(lengths)} "
                                 f"sources, got {block_rows!r}")
            self.block_rows = [check_integer(f"source {index} block_rows", rows, 1, length)
                               for index, (rows, length) in enumerate(zip(block_rows, self.lengths))]
            for index, (fixed_subset, take, length) in enumerate(zip(self.fixed, self.takes, self.lengths)):
                if fixed_subset and take < length:
                    raise ValueError(f"source {index}: a fixed subset (fixed=True, fraction < 1) is not supported with "
                                     f"shuffle_window yet (its own order would read its windows at random); use "
                                     f"fixed=False, fraction=1, or no shuffle_window")
            # A source the window covers runs the global shuffle (see Sampler).
            self.window_blocks = [window_blocks_of(shuffle_window, rows, length) if shuffle_window < length else 0
                                  for rows, length in zip(self.block_rows, self.lengths)]
        # Nonzero with a window: the field readers then keep the kernel's read-around.
        self.blocks_per_window = max(self.window_blocks)
        self._pattern_sources, self._pattern_ranks = interleave(self.weights)
        # Per source, the block offsets it draws from, in order (its q within a block is their index).
        self._offsets_of = [np.flatnonzero(self._pattern_sources == index) for index in range(len(lengths))]
        self._sources = ffi.new("shm_mixture_source[]", len(lengths))
        for index, (length, take, weight, fixed) in enumerate(zip(self.lengths, self.takes, self.weights, self.fixed)):
            source = self._sources[index]
            source.length, source.take, source.weight, source.fixed = length, take, weight, int(fixed)
            source.window_blocks = self.window_blocks[index]
            source.block_rows = self.block_rows[index] if self.block_rows else 0
            # Each source's own shuffle, from the loader's seed and its position in the list.
            source.seed = derive_seed(self.seed, index)
        self._config = ffi.new("shm_mixture_config *")
        self._config.sources, self._config.source_count = self._sources, len(lengths)
        self._config.pattern_sources = ffi.cast("uint32_t *", self._pattern_sources.ctypes.data)
        self._config.pattern_ranks = ffi.cast("uint64_t *", self._pattern_ranks.ctypes.data)
        self._config.block, self._config.batch_size = len(self._pattern_sources), self.batch_size
        self._config.shard_index, self._config.shard_count = self.shard_index, self.shard_count
        check(lib.shm_mixture_check(self._config), "invalid mixture")

    def fill(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, sources) of `step`, as new arrays."""
        rows = np.empty(self.batch_size, dtype=np.uint64)
        sources = np.empty(self.batch_size, dtype=np.uint32)
        self.fill_unchecked(check_integer("step", step, 0, U64_MAX), ffi.from_buffer("uint64_t[]", rows),
                            ffi.from_buffer("uint32_t[]", sources))
        return rows, sources

    def fill_unchecked(self, step: int, rows_pointer, sources_pointer) -> None:
        check(lib.shm_mixture_fill(self._config, step, rows_pointer, sources_pointer, self.batch_size),
              f"cannot fill step {step} (step too large?)")

    @property
    def shuffle_order(self) -> str:
        """Sliding, but the global shuffle for the sources a window covers (Sampler's)."""
        covered = [index for index, blocks in enumerate(self.window_blocks) if not blocks]
        if not covered:
            return SHUFFLE_ORDER
        return f"{SHUFFLE_ORDER}, {GLOBAL_ORDER} for sources {covered}"

    def epoch_positions(self, shard_index: int | None = None) -> int:
        """The fewest whole interleave blocks in which every source has delivered at least
        its epoch's rows (its take, ceil(fraction * rows)): W * max_i ceil(take_i / w_i)
        positions of the global stream every shard shares, W = sum of the weights."""
        blocks = max(-(-take // weight) for take, weight in zip(self.takes, self.weights))
        return sum(self.weights) * blocks

    def pass_positions(self, epochs: int, shard_index: int) -> int:
        """The global stream's positions in a pass of `epochs` epochs (no dealing)."""
        return epochs * self.epoch_positions()

    def pass_tail(self, epochs: int | None, drop_last: bool) -> None:
        """None: a mixture's pass is cut as it falls (it fills no run of positions)."""
        return None

    def with_pass(self, epochs: int | None, drop_last: bool) -> MixtureSampler:
        """Itself: a pass is cut where it ends, so the sampler needs nothing of it."""
        return self

    def row_keys(self, step: int, count: int) -> None:
        """None: a mixture's rows have no stream position of their own (StreamGeometry)."""
        return None

    def source_position(self, step: int, source: int) -> int:
        """Source `source`'s own stream position at its first draw in `step` or after."""
        first = self.first_position(step)
        block, offset = divmod(first, len(self._pattern_sources))
        offsets = self._offsets_of[source]
        index = int(np.searchsorted(offsets, offset))
        if index == len(offsets):
            return (block + 1) * self.weights[source]
        return block * self.weights[source] + index

    def window_views(self) -> list[SourceWindows]:
        """Each source's windows, for reading ahead (none without a shuffle window)."""
        return [SourceWindows(self, index) for index in range(len(self.lengths)) if self.window_blocks[index]]

    def to_dict(self) -> dict:
        return {"kind": "mixture", "lengths": self.lengths, "weights": self.weights, "fractions": self.fractions,
                "fixed": self.fixed, "batch_size": self.batch_size, "seed": self.seed,
                "shard_index": self.shard_index, "shard_count": self.shard_count,
                "shuffle_window": self.shuffle_window, "block_rows": self.block_rows}

    @classmethod
    def from_dict(cls, data: dict) -> MixtureSampler:
        return cls(**{key: value for key, value in data.items() if key != "kind"})


class SourceWindows:
    """One source of a windowed mixture, seen as storage/readahead.ReadAhead sees a sampler: its
    stream position at a step, and the places and blocks of its block-local shuffle."""

    def __init__(self, mixture: MixtureSampler, source: int) -> None:
        self.mixture, self.source = mixture, source
        self.length = mixture.lengths[source]
        self.epoch_length = mixture.takes[source]
        self.block_rows = mixture.block_rows[source]
        self.blocks_per_window = mixture.window_blocks[source]

    def stream_position(self, step: int) -> int:
        return self.mixture.source_position(step, self.source)

    def window_stream(self, step: int) -> tuple:
        """(key, sampler, position) as Sampler.window_stream gives them: a source has one stream."""
        return None, self, self.stream_position(step)

    def places(self, position: int) -> Places:
        """The source's `position` in its epoch's block-local shuffle (Sampler.places)."""
        return read_places(position // self.epoch_length, lib.shm_mixture_places, self.mixture._config, self.source,
                           position)

    def row_runs(self, block: int) -> list[tuple[int, int]]:
        """(first row, rows) of the source's block `block` (Sampler.row_runs)."""
        return block_runs(block, self.block_rows, self.length)

    def place_blocks(self, epoch: int, first: int, count: int) -> np.ndarray:
        return read_place_blocks(lib.shm_mixture_place_blocks, self.mixture._config, self.source, epoch, first, count)

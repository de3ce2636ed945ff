"""Sources and weighted mixtures: position -> (source, row), statelessly, in Zig.

`Source(fields, weight, fraction, fixed)` declares one data set; a loader given a list of
them draws every block of sum(weights) consecutive positions with each source's exact
share, in a fixed interleave, and each source runs its own shuffle epochs over
ceil(fraction * rows) rows (a fresh subset each epoch, or one fixed subset).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from ._native import Status, ffi, lib, status_name
from .sampler import check_integer, derive_seed, step_max

# The most sources a mixture may have (zig/mixture.zig keeps a cache per source on its stack).
SOURCES_MAX = 256
# A block of sum(weights) positions is laid out once, in memory: bound its size.
_BLOCK_MAX = 1 << 20
_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1


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
        check_integer(f"source {index} weight", self.weight, 1, _U32_MAX)
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


class MixtureSampler:
    """Maps a step to (source-local rows, source ids) of that step's batch, as a pure
    function of (source sizes, weights, fractions, fixed, batch size, seed, shard, step)."""

    def __init__(self, lengths: list[int], weights: list[int], fractions: list[float], fixed: list[bool],
                 batch_size: int, seed: int = 0, shard_index: int = 0, shard_count: int = 1) -> None:
        if not 1 <= len(lengths) <= SOURCES_MAX:
            raise ValueError(f"a mixture has 1 to {SOURCES_MAX} sources, got {len(lengths)}")
        self.lengths, self.weights = [int(x) for x in lengths], [int(x) for x in weights]
        self.fractions, self.fixed = [float(x) for x in fractions], [bool(x) for x in fixed]
        self.batch_size = check_integer("batch_size", batch_size, 1, _U32_MAX)
        self.seed = check_integer("seed", seed, 0, _U64_MAX)
        self.shard_count = check_integer("shard_count", shard_count, 1, _U32_MAX)
        self.shard_index = check_integer("shard_index", shard_index, 0, self.shard_count - 1)
        self.mode = "shuffle"
        self.takes = [max(1, math.ceil(fraction * length)) for fraction, length in zip(self.fractions, self.lengths)]
        self._pattern_sources, self._pattern_ranks = interleave(self.weights)
        self._sources = ffi.new("shm_mixture_source[]", len(lengths))
        for index, (length, take, weight, fixed) in enumerate(zip(self.lengths, self.takes, self.weights, self.fixed)):
            source = self._sources[index]
            source.length, source.take, source.weight, source.fixed = length, take, weight, int(fixed)
            # Each source's own shuffle, from the loader's seed and its position in the list.
            source.seed = derive_seed(self.seed, index)
        self._config = ffi.new("shm_mixture_config *")
        self._config.sources, self._config.source_count = self._sources, len(lengths)
        self._config.pattern_sources = ffi.cast("uint32_t *", self._pattern_sources.ctypes.data)
        self._config.pattern_ranks = ffi.cast("uint64_t *", self._pattern_ranks.ctypes.data)
        self._config.block, self._config.batch_size = len(self._pattern_sources), self.batch_size
        self._config.shard_index, self._config.shard_count = self.shard_index, self.shard_count
        status = lib.shm_mixture_check(self._config)
        if status != Status.OK:
            raise ValueError(f"invalid mixture: {status_name(status)}")

    @property
    def step_max(self) -> int:
        return step_max(self.batch_size, self.shard_index, self.shard_count)

    def fill(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, sources) of `step`, as new arrays."""
        rows = np.empty(self.batch_size, dtype=np.uint64)
        sources = np.empty(self.batch_size, dtype=np.uint32)
        self.fill_unchecked(check_integer("step", step, 0, _U64_MAX), ffi.from_buffer("uint64_t[]", rows),
                            ffi.from_buffer("uint32_t[]", sources))
        return rows, sources

    def fill_unchecked(self, step: int, rows_pointer, sources_pointer) -> None:
        status = lib.shm_mixture_fill(self._config, step, rows_pointer, sources_pointer, self.batch_size)
        if status != Status.OK:
            raise ValueError(f"cannot fill step {step}: {status_name(status)} (step too large?)")

    def to_dict(self) -> dict:
        return {"kind": "mixture", "lengths": self.lengths, "weights": self.weights, "fractions": self.fractions,
                "fixed": self.fixed, "batch_size": self.batch_size, "seed": self.seed,
                "shard_index": self.shard_index, "shard_count": self.shard_count}

    @classmethod
    def from_dict(cls, data: dict) -> MixtureSampler:
        return cls(**{key: value for key, value in data.items() if key != "kind"})

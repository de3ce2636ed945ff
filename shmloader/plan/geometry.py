"""Stream geometry: the one interface through which passes, checkpoints, resharding, the
session and the loader ask a sampler which positions its steps, epochs and passes hold.

Sampler (sampler.py) and MixtureSampler (sources.py) implement it, what they answer
alike in StreamShape below; nothing above them re-derives a quantity or tells them
apart. Each answer is a call into the Zig library (shm_global_position, shm_share_length,
shm_step_max) or arithmetic on such calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .._native import check, ffi, lib
from .options import BATCH_SIZE_MAX, SEED_MAX, check_integer, check_shard

if TYPE_CHECKING:
    from .reshard import Transition
    from .tail import Tail

# The block-local shuffle's order, recorded by a checkpoint with a shuffle_window:
# "sliding" since the order that dealt whole windows one after another (checkpoints
# without the key) was replaced; such a checkpoint's steps name other rows.
SHUFFLE_ORDER = "sliding"
# Where a window covers the data (or a mixture's source), the global shuffle.
GLOBAL_ORDER = "global"


def global_position(step: int, batch_size: int, shard_index: int, shard_count: int) -> int:
    """Where shard `shard_index`'s part of step `step` starts in the global stream of
    positions: a step's global batch holds batch_size * shard_count positions, and shard h
    takes its h-th block of batch_size. Computed by the sampler's own Zig function (one
    definition for the sampler, mixtures, passes, checkpoints and transforms)."""
    out = ffi.new("uint64_t *")
    check(lib.shm_global_position(step, batch_size, shard_index, shard_count, out),
          f"step {step} of batch_size {batch_size} and shard {shard_index} of {shard_count} is past the 64-bit "
          f"stream of positions")
    return int(out[0])


class StreamGeometry(Protocol):
    """What a sampler's stream is shaped like: shard `shard_index` of `shard_count` reads
    batch_size positions per step, of the global stream (block h of each step's global
    batch) or, where `shard_blocks`, of a stream of its own over its share of the blocks."""

    batch_size: int
    shard_index: int
    shard_count: int
    mode: str
    shuffle_window: int | None
    # Blocks a phase of the block-local shuffle mixes (a mixture's: its sources' largest); 0 without one.
    blocks_per_window: int
    # Each shard reads its own share of the blocks: positions count the shard's own stream.
    shard_blocks: bool
    # A resharded checkpoint's dealing, dealt first (reshard.py); None where there is none.
    transition: Transition | None
    # An elastic resume's position (Sampler.start_position), the step holding it and its
    # distance from that step's start, by which the stream is shifted; 0 where none.
    start_position: int
    start_step: int
    offset: int
    # Whether another shard count deals this stream's unread rows (reshard.py), rather than
    # continue its position.
    deals_on_reshard: bool
    # Whether any run of positions can be filled (shm_sampler_fill_positions): what dealing a
    # pass's tail and shifting a resumed stream to start anywhere need. A mixture fills
    # whole steps only: its pass's last step is cut, and so is its resumed one.
    fills_positions: bool
    # Whether each row of a step comes from one of several sources (a source id per row in
    # the slot; a record may repeat within a batch as the sources' epochs interleave).
    has_sources: bool

    def row_keys(self, step: int, count: int):
        """Each row's key for ctx.rng and a dataset's per-sample seeds (uint64 array), or
        None where rows have no stream position of their own (a mixture)."""

    @property
    def own_streams(self) -> bool:
        """Whether each shard reads a stream of its own (positions step * batch_size): its
        share of the blocks, or a resharded dealing."""

    @property
    def global_batch(self) -> int:
        """Positions one step advances the stream a checkpoint counts in: batch_size where
        each shard reads its own blocks, else batch_size * shard_count."""

    @property
    def step_max(self) -> int:
        """The last step whose positions fit the 64-bit stream (shm_step_max)."""

    @property
    def shuffle_order(self) -> str:
        """The order a windowed stream deals (SHUFFLE_ORDER, GLOBAL_ORDER), which a
        checkpoint records."""

    def first_position(self, step: int) -> int:
        """Where this shard's part of `step` starts in the stream it reads, unshifted: its
        block of the global batch (shm_global_position), or step * batch_size of its own."""

    def step_position(self, step: int) -> int:
        """Where `step` starts, the same on every shard, shifted by `offset`: the first
        position of its global batch, or of each shard's own batch."""

    def epoch_positions(self, shard_index: int | None = None) -> int:
        """Positions in one epoch of the stream shard `shard_index` (None: this one) reads."""

    def pass_positions(self, epochs: int, shard_index: int) -> int:
        """Positions of shard `shard_index`'s stream in a pass of `epochs` epochs."""

    def pass_tail(self, epochs: int, drop_last: bool) -> Tail | None:
        """The last steps of such a pass, whose rows are dealt evenly among the shards
        (tail.py); None where they are cut as they fall (not fills_positions)."""

    def with_pass(self, epochs: int | None, drop_last: bool) -> StreamGeometry:
        """This stream within a finite pass of `epochs` (None: endless), whose tail it deals."""

    def to_dict(self) -> dict:
        """The small description that rebuilds it in another process; a checkpoint records it."""


class StreamShape:
    """What a Sampler and a MixtureSampler share: each step is a batch of batch_size
    positions of a seeded stream, shard shard_index of shard_count's part of the step's
    global batch. Checked where a sampler is built (a reader builds its own from a dict)
    against the limits LoaderOptions checked the loader's settings with. What of
    StreamGeometry both answer alike is here; a Sampler sets the attributes below where
    its shards read their own blocks, it deals a transition, or it resumed."""

    shard_blocks = False
    transition = None
    start_position = start_step = offset = 0

    def _check_shape(self, batch_size: int, seed: int, shard_index: int, shard_count: int) -> None:
        self.batch_size = check_integer("batch_size", batch_size, 1, BATCH_SIZE_MAX)
        self.seed = check_integer("seed", seed, 0, SEED_MAX)
        self.shard_index, self.shard_count = check_shard(shard_index, shard_count)

    @property
    def step_max(self) -> int:
        """The last step whose positions fit the 64-bit stream (zig/sampler.zig stepMax)."""
        return int(lib.shm_step_max(self.batch_size, self.shard_index, self.shard_count))

    @property
    def own_streams(self) -> bool:
        """Whether each shard reads a stream of its own (positions step * batch_size), not
        its block of the global one: a window split among shards, or a resharded dealing."""
        return self.shard_blocks or self.transition is not None

    @property
    def global_batch(self) -> int:
        """Positions a step advances the stream a checkpoint counts in (StreamGeometry)."""
        return self.batch_size if self.shard_blocks else self.batch_size * self.shard_count

    def first_position(self, step: int) -> int:
        """Where this shard's part of `step` starts in the stream it reads, unshifted: its
        block of the global batch, or its own position when it reads its share of blocks."""
        if self.shard_blocks:
            return step * self.batch_size
        return global_position(step, self.batch_size, self.shard_index, self.shard_count)

    def step_position(self, step: int) -> int:
        """Where `step` starts, the same on every shard (a checkpoint's position): the
        start of its global batch, or of each shard's own batch; shifted by `offset`."""
        if self.shard_blocks:
            return step * self.batch_size + self.offset
        return global_position(step, self.batch_size, 0, self.shard_count) + self.offset

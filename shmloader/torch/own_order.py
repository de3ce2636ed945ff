"""`loader.sampler` and `loader.batch_sampler` of the drop-in in its own order (shuffle=,
seed=, no sampler= given): views of the pass at hand's indices, and set_epoch(epoch) as
DistributedSampler's, so that the everyday DDP line works unchanged.
"""

from __future__ import annotations


class LoaderOrder:
    """`loader.sampler` of a loader in its own order (shuffle=, seed=): the indices of the
    pass at hand on this shard, and set_epoch(epoch), which makes the next `for` loop that
    epoch (its order a function of the seed and the epoch, as DistributedSampler's is)."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch takes a non-negative integer, got {epoch!r}")
        self._loader._requested_epoch = epoch

    def batches(self):
        """The pass at hand's batches of indices on this shard (lists of ints)."""
        inner = self._loader._loader
        sampler, finite = inner.sampler, inner.finite
        for step in range(finite.steps):
            yield sampler.fill(step)[:finite.rows(step)].tolist()

    def __iter__(self):
        for batch in self.batches():
            yield from batch

    def __len__(self) -> int:
        finite = self._loader._loader.finite
        return sum(finite.rows(step) for step in range(finite.steps))


class LoaderBatches:
    """`loader.batch_sampler` of a loader in its own order: the pass at hand's batches."""

    def __init__(self, loader) -> None:
        self._loader = loader
        self.sampler = loader.sampler
        self.batch_size, self.drop_last = loader.batch_size, loader.drop_last

    def __iter__(self):
        return self.sampler.batches()

    def __len__(self) -> int:
        return self._loader._loader.finite.steps

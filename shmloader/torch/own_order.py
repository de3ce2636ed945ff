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
        """The batches of indices on this shard (lists of ints) of the pass at hand, or of the
        epoch set_epoch named for the next loop where that is another: accelerate's
        skip_first_batches reads them after set_epoch (Hugging Face's resume mid-epoch), and
        the next loop gives that epoch's order."""
        inner = self._loader._loader
        sampler, finite = inner.sampler, inner.finite
        requested = self._loader._requested_epoch
        if requested is not None and requested != self._loader._epoch:
            # The sampler the next loop's new pass uses (session.new_pass): the plan's, reseeded.
            data = {key: value for key, value in inner._session.plan.sampler.to_dict().items()
                    if key not in ("transition", "start_position")}
            sampler = type(inner._session.plan.sampler).from_dict({**data, "seed": self._loader._epoch_seed(requested)})
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

    def set_epoch(self, epoch: int) -> None:
        """As loader.sampler's: Hugging Face's Trainer sets the epoch on the batch sampler
        under accelerate's skip_first_batches (its SkipBatchSampler's batch_sampler)."""
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        return self.sampler.batches()

    def __len__(self) -> int:
        return self._loader._loader.finite.steps

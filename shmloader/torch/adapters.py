"""PyTorch's shapes for a ShmDataLoader: an IterableDataset and a DataLoader-like object
whose batches are dicts of CPU tensors over the ring's slots (torch.from_numpy: no copy).
(The drop-in for torch.utils.data.DataLoader over your own map-style Dataset is
dataloader.py.)

    from shmloader.torch import TorchLoader
    train = TorchLoader(ShmDataLoader(fields, batch_size=256, epochs=1))
    for batch in train:             # {"image": tensor, "label": tensor, "indices": tensor}
        ...
    torch.utils.data.DataLoader(ShmIterableDataset(loader), batch_size=None)  # where a
                                    # framework insists on a real DataLoader

Each batch carries its rows' indices (int64, "indices"), so a run can count what it saw.
Where a finite pass with drop_last=False pads (fewer rows left than shards: plan/passes.py),
every batch of it carries "padding" too (bool, Batch.padding): True for a row repeated to
keep a shard's last step from being empty; leave those out of an evaluation's metric.
The loader batches already, in its own reader processes: a torch DataLoader around it must
have batch_size=None and num_workers=0 (its workers would fork, or pickle, a copy of the
trainer that cannot use the ring). A tensor views its slot and follows the batch lifetime
rule: keep it past the next batch only by copying it (`tensor.clone()`), or the slot stays
reserved.

Ranks (torch.distributed, torchrun): each rank builds its own loader with
shard_index=RANK, shard_count=WORLD_SIZE and batch_size per rank; iterating checks that the
shard is this rank's, so that an epoch gives each row once across the ranks. Frameworks:
- accelerate: `accelerator.prepare(TorchLoader(loader))` returns it unchanged (it is no
  torch DataLoader), each rank reading its shard. A torch DataLoader around
  ShmIterableDataset becomes accelerate's dispatcher (rank 0 reads, the others receive
  slices): that works over an unsharded loader (shard_count=1) and is refused over a
  sharded one, whose other shards the dispatcher would never read;
  `DataLoaderConfiguration(dispatch_batches=False)` is refused, since accelerate would then
  re-split each rank's batches (IterableDatasetShard) although the loader already shards.
  even_batches applies to map-style samplers only: for an iterable the dispatcher pads a
  last global batch that does not split evenly with rows of the first, which is refused
  (drop_last=True and a batch_size divisible by the processes avoid it).
- Lightning (DDP) and Hugging Face's Trainer: return TorchLoader over the rank's shard
  (trainer.global_rank / world_size, args.process_index / world_size). Neither puts a
  DistributedSampler under an iterable (use_distributed_sampler has nothing to do).

`state_dict()` and `load_state_dict()` are the loader's (exact resume), so a
StatefulDataLoader-style checkpoint of the wrapper is the loader's checkpoint. Hugging
Face's Trainer resumes by skipping the steps already trained (accelerate's
skip_first_batches), which TorchLoader's DataLoader-like settings make exact: it reads
and drops them. `TrainingArguments(ignore_data_skip=True)` with the loader's own
load_state_dict (or start_step) skips without reading.
PyTorch is an optional extra (pip install "shmloader[torch]"); only shmloader.torch imports it.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.utils.data

from ..loader import ShmDataLoader

_PICKLE_REFUSAL = (
    "a {kind} cannot be sent to another process: its loader's ring and readers belong to this one. A torch "
    "DataLoader with num_workers > 0 under the spawn or forkserver start method pickles its dataset for each "
    "worker: give it num_workers=0 (the loader's own readers do the work in parallel already), or iterate "
    "shmloader.torch.TorchLoader(loader) directly")


def _tensors(batch, indices: bool, padding: bool) -> dict:
    tensors = {name: torch.from_numpy(array) for name, array in batch.items()}
    if indices:
        # A copy in int64, torch's index type: uint64 tensors lack most operations, and
        # accelerate's dispatcher broadcasts every tensor of a batch (gloo has no uint64).
        tensors["indices"] = torch.from_numpy(batch.indices.astype(np.int64))
    if padding:  # True: a repeated row (Batch.padding). Only where the pass pads: a model's forward(**batch)
        tensors["padding"] = torch.from_numpy(batch.padding)  # would refuse a key it does not expect.
    return tensors


def _steps_left(loader: ShmDataLoader) -> int:
    """The steps of the loader's finite pass still to deliver: what a progress bar needs
    after a resume. len(loader) raises for an endless loader, saying so."""
    return max(0, len(loader) - loader.state_dict()["step"])


def _accelerate_dataloader(dataset):
    """The accelerate DataLoader that is iterating `dataset` now, or None. accelerate
    registers each of its DataLoaders in GradientState before it reads from it; the check
    is skipped where accelerate was never imported."""
    if "accelerate" not in sys.modules:
        return None
    from accelerate.data_loader import DataLoaderDispatcher, IterableDatasetShard
    from accelerate.state import GradientState

    active = GradientState().active_dataloader
    if active is None:
        return None
    inner = active.dataset  # Forwarded by accelerate's adapter to the DataLoader it wraps.
    if isinstance(inner, IterableDatasetShard) and inner.dataset is dataset:
        raise ValueError(
            "accelerate re-splits each batch of this dataset among the processes (IterableDatasetShard, "
            "DataLoaderConfiguration(dispatch_batches=False)), but the loader shards by rank already and yields "
            "whole batches. Give accelerate the rank's loader itself: accelerator.prepare(TorchLoader(ShmDataLoader("
            "..., shard_index=RANK, shard_count=WORLD_SIZE))) returns it unchanged")
    if isinstance(active, DataLoaderDispatcher) and inner is dataset:
        return active
    return None


def _ranks(loader: ShmDataLoader) -> tuple[int, int] | None:
    """(rank, world size) under torch.distributed with more than one rank, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.get_rank(), dist.get_world_size()


def _check_dispatched(loader: ShmDataLoader, processes: int) -> None:
    """Under accelerate's dispatcher, rank 0's loader is read for every rank: it must be
    unsharded, and a finite pass must end on a global batch the dispatcher splits evenly
    (otherwise it pads that batch with rows of the first one)."""
    sampler = loader.sampler
    if sampler.shard_count != 1:
        raise ValueError(
            f"accelerate's dispatcher (DataLoaderConfiguration(dispatch_batches=True), its default for an "
            f"IterableDataset) reads rank 0's loader only and splits its batches among the {processes} processes, "
            f"but this loader is shard {sampler.shard_index} of {sampler.shard_count}: the other shards would never "
            f"be read. Give accelerator.prepare the rank's TorchLoader instead (prepare returns it unchanged, each "
            f"rank reading its shard), or build the dispatched loader with shard_count=1")
    finite = loader.finite
    if finite is None:
        return
    left = _steps_left(loader)
    last_group = left - processes * ((left - 1) // processes) if left else 0  # Batches in the last dispatch.
    rows = sum(finite.rows(step) for step in range(finite.steps - last_group, finite.steps))
    if rows % processes:
        raise ValueError(
            f"accelerate's dispatcher gives each of {processes} processes one of every {processes} batches; this "
            f"pass (epochs={finite.epochs}) ends on {last_group} batch(es) of {rows} rows, which it would pad with "
            f"rows of the first batch (counted twice). Give the loader drop_last=True and a batch_size divisible by "
            f"{processes}, an endless loader (epochs=None), or each rank its own shard through TorchLoader")


def _check_shard(loader: ShmDataLoader, dataset) -> None:
    """Before a pass: the loader's shard fits the ranks, so each row comes once across them."""
    ranks = _ranks(loader)
    if ranks is None:
        return
    rank, world = ranks
    dispatcher = _accelerate_dataloader(dataset)
    if dispatcher is not None:
        _check_dispatched(loader, world)
        return
    sampler = loader.sampler
    if (sampler.shard_index, sampler.shard_count) != (rank, world) and dataset.check_ranks:
        raise ValueError(
            f"rank {rank} of {world} (torch.distributed) iterates shard {sampler.shard_index} of "
            f"{sampler.shard_count}: across the ranks an epoch would give rows twice or never. Build each rank's "
            f"loader with shard_index=RANK, shard_count=WORLD_SIZE ({rank}, {world} here) and batch_size per rank; "
            f"where ranks share a shard on purpose (tensor or pipeline parallel groups), pass check_ranks=False")


class ShmIterableDataset(torch.utils.data.IterableDataset):
    """An IterableDataset of whole batches (dicts of tensors, "indices" among them unless
    indices=False) from one loader. Use it with
    `torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)`. Under
    torch.distributed, iterating checks that the loader is this rank's shard
    (check_ranks=False where ranks share shards on purpose)."""

    def __init__(self, loader: ShmDataLoader, *, indices: bool = True, check_ranks: bool = True) -> None:
        if not isinstance(loader, ShmDataLoader):
            raise TypeError(f"ShmIterableDataset wraps a ShmDataLoader, got {type(loader).__name__}")
        self.loader, self.indices, self.check_ranks = loader, bool(indices), bool(check_ranks)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise RuntimeError(f"ShmIterableDataset runs in the trainer: give its DataLoader num_workers=0 (got "
                               f"{info.num_workers}); the loader's own readers do the work")
        _check_shard(self.loader, self)
        for batch in self.loader:
            finite = self.loader.finite  # Its tail may change with a resharded resume.
            yield _tensors(batch, self.indices, finite is not None and finite.pads)
            del batch

    def set_epoch(self, epoch: int) -> None:
        """accelerate's DataLoaders call this on every rank before a pass. The loader's
        epochs need nothing (each has its own order already); a wrapper that would lose or
        repeat rows is refused here, on every rank alike, before any batch is read."""
        if _ranks(self.loader) is None:
            return
        dispatcher = _accelerate_dataloader(self)
        if dispatcher is not None:
            _check_dispatched(self.loader, dispatcher.state.num_processes)

    def __len__(self) -> int:
        """The steps of the finite pass still to deliver (all of them before the first)."""
        return _steps_left(self.loader)

    def __reduce_ex__(self, protocol):
        raise TypeError(_PICKLE_REFUSAL.format(kind="ShmIterableDataset"))


class TorchLoader:
    """A DataLoader-shaped view of a ShmDataLoader: iterating gives dicts of tensors (with
    "indices" unless indices=False), `len()` the steps left of a finite pass, and the
    loader's `state_dict()` / `load_state_dict()` / `close()`.

    Its DataLoader settings are those of a torch DataLoader over whole batches
    (batch_size=None, drop_last=False, num_workers=0, prefetch_factor=None), so that a framework rebuilding a
    DataLoader from them (accelerate.skip_first_batches, under Hugging Face's resume)
    neither re-batches nor drops; the rows per batch are `loader.batch_size`."""

    batch_size = None
    drop_last = False
    num_workers = 0
    prefetch_factor = None  # What torch gives a DataLoader without workers (accelerate's default is 2).

    def __init__(self, loader: ShmDataLoader, *, indices: bool = True, check_ranks: bool = True) -> None:
        if not isinstance(loader, ShmDataLoader):
            raise TypeError(f"TorchLoader wraps a ShmDataLoader, got {type(loader).__name__}")
        self.loader = loader
        self.dataset = ShmIterableDataset(loader, indices=indices, check_ranks=check_ranks)

    def __iter__(self):
        return iter(self.dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()

    def __reduce_ex__(self, protocol):
        raise TypeError(_PICKLE_REFUSAL.format(kind="TorchLoader"))

    def __enter__(self) -> TorchLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

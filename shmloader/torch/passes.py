"""The drop-in's pieces around its loader class (dataloader.py): the rank and world size it
shards by where none is given, whether a dataset is empty now, and the iterator of one pass."""

from __future__ import annotations

import os
import sys
import warnings


def _shard_from_environment(shard_index, shard_count) -> tuple[int, int]:
    """(shard_index, shard_count): as given, else this process's rank and world size: RANK
    and WORLD_SIZE (torchrun, accelerate), else torch.distributed's where its process group
    is up, else LOCAL_RANK on the first node (Lightning's own DDP launcher sets WORLD_SIZE,
    LOCAL_RANK and NODE_RANK, never RANK, and gives a torch DataLoader a DistributedSampler
    that it does not give this one, which is no torch DataLoader subclass). A WORLD_SIZE past
    1 with no rank to read gives the whole dataset to this process, said once."""
    if shard_index is not None or shard_count is not None:
        return (shard_index or 0), (shard_count or 1)
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None and rank.isdigit() and world.isdigit():
        return int(rank), int(world)
    distributed = getattr(sys.modules.get("torch"), "distributed", None)
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank(), distributed.get_world_size()
    if world is None or not world.isdigit() or int(world) <= 1:
        return 0, 1
    local, node = os.environ.get("LOCAL_RANK", ""), os.environ.get("NODE_RANK", "0")
    if local.isdigit() and node == "0" and int(local) < int(world):
        return int(local), int(world)
    warnings.warn(f"shmloader.torch.DataLoader: WORLD_SIZE={world} is set but no rank this process has (no RANK, no "
                  f"torch.distributed process group, LOCAL_RANK={local or None} on NODE_RANK={node}): it reads the "
                  f"whole dataset; pass shard_index= and shard_count=", stacklevel=3)
    return 0, 1


def _empty(dataset) -> bool:
    """Whether `dataset` is a map-style dataset of no sample now (DataLoader.__new__); a
    dataset given by import path ("module:function") is built in the readers, never empty here."""
    if isinstance(dataset, str):
        return False
    try:
        return len(dataset) == 0
    except Exception:  # noqa: BLE001 (no len(), or one that raises: __init__ says so)
        return False


class _PassIterator:
    """One `for` loop's iterator over the loader's pass. The loader runs one pass at a time:
    a newer iter(loader) ends this one, and asking it for more then raises (zip(loader,
    loader) would otherwise end at once, in silence)."""

    def __init__(self, batches, loader, asked: bool = False) -> None:  # loader: dataloader.DataLoader
        self._batches, self._superseded, self._loader = batches, False, loader
        self.asked = asked  # Whether next() was called on it (DataLoader._untouched).

    def __iter__(self):
        return self

    def __len__(self) -> int:
        """As torch's iterator: the epoch's batches (`it = iter(loader); range(len(it))`)."""
        return self._loader._iterator_length()

    def __next__(self):
        if self._superseded:
            raise RuntimeError("this iterator's pass was ended by a newer iter() of the same "
                               "shmloader.torch.DataLoader, which runs one pass at a time (torch's runs each "
                               "iterator on workers of its own): iterate one loop at a time, or make a second "
                               "DataLoader")
        self.asked = True
        return next(self._batches)

    def supersede(self) -> None:
        self._superseded = True
        self._batches.close()

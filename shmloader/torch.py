"""PyTorch's shapes for a loader: an IterableDataset and a DataLoader-like object whose
batches are dicts of CPU tensors over the ring's slots (torch.from_numpy: no copy).

    from shmloader.torch import TorchLoader
    train = TorchLoader(ShmDataLoader(fields, batch_size=256, epochs=1))
    for batch in train:             # {"image": tensor, "label": tensor, ...}
        ...
    torch.utils.data.DataLoader(ShmIterableDataset(loader), batch_size=None)  # where a
                                    # framework insists on a real DataLoader

The loader batches already, in its own reader processes: a torch DataLoader around it must
have batch_size=None and num_workers=0 (its workers would fork a copy of the trainer that
cannot use the ring). A tensor views its slot and follows the batch lifetime rule: keep it
past the next batch only by copying it (`tensor.clone()`), or the slot stays reserved.

`state_dict()` and `load_state_dict()` are the loader's (exact resume), so a
StatefulDataLoader-style checkpoint of the wrapper is the loader's checkpoint.
PyTorch is an optional extra (pip install "shmloader[torch]"); only this module imports it.
"""

from __future__ import annotations

import torch
import torch.utils.data

from .loader import ShmDataLoader


def _tensors(batch) -> dict:
    return {name: torch.from_numpy(array) for name, array in batch.items()}


class ShmIterableDataset(torch.utils.data.IterableDataset):
    """An IterableDataset of whole batches (dicts of tensors) from one loader. Use it with
    `torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)`."""

    def __init__(self, loader: ShmDataLoader) -> None:
        if not isinstance(loader, ShmDataLoader):
            raise TypeError(f"ShmIterableDataset wraps a ShmDataLoader, got {type(loader).__name__}")
        self.loader = loader

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise RuntimeError(f"ShmIterableDataset runs in the trainer: give its DataLoader num_workers=0 (got "
                               f"{info.num_workers}); the loader's own readers do the work")
        for batch in self.loader:
            yield _tensors(batch)
            del batch

    def __len__(self) -> int:
        return len(self.loader)


class TorchLoader:
    """A DataLoader-shaped view of a ShmDataLoader: iterating gives dicts of tensors,
    `len()` the steps of a finite pass, `batch_size` the loader's, and the loader's
    `state_dict()` / `load_state_dict()` / `close()`."""

    def __init__(self, loader: ShmDataLoader) -> None:
        if not isinstance(loader, ShmDataLoader):
            raise TypeError(f"TorchLoader wraps a ShmDataLoader, got {type(loader).__name__}")
        self.loader = loader
        self.dataset = ShmIterableDataset(loader)
        self.batch_size = loader.batch_size

    def __iter__(self):
        return iter(self.dataset)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> TorchLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

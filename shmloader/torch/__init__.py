"""shmloader.torch: shmloader for PyTorch scripts, the drop-in DataLoader and the adapters.

    from shmloader.torch import DataLoader     # instead of torch.utils.data.DataLoader
    from shmloader.torch import TorchLoader    # a ShmDataLoader's batches as dicts of tensors

    module          runs in    its job
    dataloader.py   trainer    DataLoader: the drop-in over a map-style Dataset, in its own order
    sampling.py     trainer    DataLoader(sampler=, batch_sampler=): the caller's order, and its resume
    iterable.py     both       DataLoader(an IterableDataset): each reader's iterator, torch's order
    own_order.py    trainer    loader.sampler / loader.batch_sampler of the drop-in's own order
    collation.py    trainer    collate_fn= (Collated) and the structure a batch is rebuilt in
    worker.py       readers    get_worker_info() and worker_init_fn inside a reader; the start method
    adapters.py     trainer    TorchLoader and ShmIterableDataset over a ShmDataLoader (accelerate,
                               Lightning, Hugging Face)

The core (shmloader without .torch) imports none of these: a reader finds worker.py by the
import path the drop-in gives it (worker.HOOK). The names below are imported on first use
(PEP 562), as the core's are, so that a reader importing worker.py loads nothing of the
trainer's (the loader, the adapters). PyTorch is an optional extra (pip install
"shmloader[torch]"): it is imported here, so that `import shmloader.torch` fails at once
without it, as it always has.
"""

from __future__ import annotations

import importlib

import torch  # noqa: F401 (see the module: fail at once where PyTorch is missing)

__all__ = ["CollateGrowthWarning", "DataLoader", "ShmDataLoader", "ShmIterableDataset", "TorchLoader"]

# Each name and the module it lives in. The adapters' private helpers were importable from
# shmloader.torch when the adapters were this module (torch.py), and stay so.
_LAZY = {"DataLoader": ".dataloader", "CollateGrowthWarning": "shmloader.plan.collated",
         "ShmDataLoader": "shmloader.loader",
         **dict.fromkeys(("ShmIterableDataset", "TorchLoader", "_PICKLE_REFUSAL", "_accelerate_dataloader",
                          "_check_dispatched", "_check_shard", "_ranks", "_steps_left", "_tensors"), ".adapters")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    if name == "DataLoader":
        # sampling.py's SampledDataLoader and iterable.py's IterableDataLoader name themselves
        # to DataLoader as they are defined: DataLoader(sampler=...) or (batch_sampler=...) is
        # the caller's order, DataLoader(an IterableDataset) iterates it in the readers.
        importlib.import_module(".sampling", __name__)
        importlib.import_module(".iterable", __name__)
    value = getattr(module, name)
    globals()[name] = value  # Looked up once.
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

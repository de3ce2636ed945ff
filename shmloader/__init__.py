"""shmloader: a zero-copy shared-memory data loader for training on one machine."""

from .errors import (
    CacheError,
    DeviceError,
    NodeBudgetWarning,
    PerformanceWarning,
    ReaderError,
    ReaderRestartWarning,
    ReaderStallWarning,
    RemoteError,
    SharedMemoryError,
    ShmLoaderError,
    SkippedRecordsWarning,
    SlotsExhaustedError,
    StepTimeoutError,
    StorageError,
    TransformError,
)

__all__ = [
    "AutoReaders",
    "Batch",
    "CacheError",
    "DeviceError",
    "NodeBudgetWarning",
    "Packed",
    "PackedRagged",
    "Padded",
    "Ragged",
    "PerformanceWarning",
    "ReaderError",
    "ReaderRestartWarning",
    "ReaderStallWarning",
    "RemoteError",
    "Sampler",
    "SharedMemoryError",
    "ShmDataLoader",
    "ShmLoaderError",
    "SkippedRecordsWarning",
    "SlotsExhaustedError",
    "Source",
    "StepTimeoutError",
    "StorageError",
    "TransformError",
    "Windows",
    "rebuild_batch",
    "transform",
]
__version__ = "0.1.0"

# Imported on first use (PEP 562): a reader process imports shmloader.readers.reader, and through
# this package, only what it runs; the loader, the converter and their imports are the
# trainer's, and skipping them shortens every reader's start-up.
_LAZY = {"AutoReaders": ".plan.options", "Batch": ".ring.batch", "ShmDataLoader": ".loader",
         "Sampler": ".plan.sampler", "Padded": ".plan.fields", "Packed": ".plan.fields", "Windows": ".plan.fields", "Source": ".plan.sources",
         "Ragged": ".plan.dataset_outputs", "PackedRagged": ".plan.dataset_outputs", "rebuild_batch": ".plan.dataset"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


def transform(outputs, *, name: str | None = None):
    """Declares a transform (see shmloader.transforms.transform)."""
    from .transforms.core import transform as declare

    return declare(outputs, name=name)

"""shmloader: a zero-copy shared-memory data loader for training on one machine."""

from .errors import (
    PerformanceWarning,
    ReaderError,
    SharedMemoryError,
    ShmLoaderError,
    SlotsExhaustedError,
    StorageError,
)
from .loader import Batch, ShmDataLoader
from .sampler import Sampler

__all__ = [
    "Batch",
    "PerformanceWarning",
    "ReaderError",
    "Sampler",
    "SharedMemoryError",
    "ShmDataLoader",
    "ShmLoaderError",
    "SlotsExhaustedError",
    "StorageError",
]
__version__ = "0.1.0"

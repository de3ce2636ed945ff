"""shmloader: a zero-copy shared-memory data loader for training on one machine."""

from .sampler import Sampler

__all__ = ["Sampler"]
__version__ = "0.1.0"

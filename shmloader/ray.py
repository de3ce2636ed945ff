"""Ray actors as remote readers, by their public path: `from shmloader.ray import RayReaders`
(readers/ray.py; the `[ray]` extra)."""

from .readers.ray import RayReaders

__all__ = ["RayReaders"]

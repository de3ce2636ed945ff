"""The converters' public path: `from shmloader.convert import write_ragged` (tools/convert.py)."""

from .tools.convert import convert, write_ragged

__all__ = ["convert", "write_ragged"]

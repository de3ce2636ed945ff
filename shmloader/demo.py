"""The demo's dataset by its public path, as the examples use it (tools/demo.py)."""

from .tools.demo import CLASSES, IMAGE_SHAPE, make_dataset, run, write_dataset

__all__ = ["CLASSES", "IMAGE_SHAPE", "make_dataset", "run", "write_dataset"]

"""Importers by their public path, `shmloader.formats.from_parquet(...)`: Parquet and Arrow
tables or Hugging Face datasets (tools/formats.py), WebDataset shards (tools/webdataset.py)."""

from .tools.formats import from_arrow, from_parquet
from .tools.webdataset import from_webdataset

__all__ = ["from_arrow", "from_parquet", "from_webdataset"]

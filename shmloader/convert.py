"""The converters by their public path, `from shmloader.convert import write_ragged`
(tools/convert.py)."""

from .tools.convert import *  # noqa: F403
from .tools.convert import __all__  # noqa: F401

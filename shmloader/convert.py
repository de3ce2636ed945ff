"""The converters by their public path, `from shmloader.convert import write_ragged`
(tools/convert.py), and what a file's layout costs (tools/inspection.py)."""

from .tools.convert import *  # noqa: F403
from .tools.convert import __all__ as _convert_all
from .tools.inspection import inspect, measure_row_cost_us  # noqa: F401

__all__ = [*_convert_all, "inspect", "measure_row_cost_us"]

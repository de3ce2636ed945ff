"""Wiring fields to their readers: the reader of each plan's kind, and a transform's input
fields filled into this process's own memory (InputBuffers), which never enter the ring."""

from __future__ import annotations

import numpy as np

from ..plan.fields import FieldPlan
from ..transforms.core import Records
from .field_readers import FieldReader, RowsReader, SlotOutput
from .record_readers import DocumentWindowsReader, PackedReader, PaddedReader, WindowsReader

_READERS = {"rows": RowsReader, "windows": WindowsReader, "documents": DocumentWindowsReader,
            "padded": PaddedReader, "packed": PackedReader}


def field_reader(plan: FieldPlan, batch_size: int, verify: bool, sampler) -> FieldReader:
    """The reader of the plan's kind."""
    return _READERS[plan.kind](plan, batch_size, verify, sampler)


class InputBuffers:
    """A transform's input fields, filled into this process's own memory (they never enter
    the ring): `views` maps each field to what the transform gets (see transforms)."""

    def __init__(self, plans: tuple[FieldPlan, ...], batch_size: int, verify: bool, sampler) -> None:
        self.readers = [field_reader(plan, batch_size, verify, sampler) for plan in plans]
        self.outputs, self.views = [], {}
        for plan in plans:
            outputs = [SlotOutput(np.zeros(region.shape, np.dtype(region.dtype))) for region in plan.regions]
            self.outputs.append(outputs)
            arrays = {region.name: output.array for region, output in zip(plan.regions, outputs)}
            if plan.kind == "packed":
                shapes = arrays.get(f"{plan.name}.shapes")
                arrays[plan.name] = Records(arrays[plan.name], arrays[f"{plan.name}.offsets"], shapes)
            self.views.update(arrays)

    def fill(self, step: int, indices: np.ndarray, index_pointer, sources) -> dict:
        for reader, outputs in zip(self.readers, self.outputs):
            reader.fill(step, indices, index_pointer, outputs, sources)
        return self.views

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

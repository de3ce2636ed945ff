"""The step filler: the one place a step's slot is filled, whoever fills it.

fill(step, outputs) writes the step's row indices (and a mixture's source ids) from the
sampler, then every field's regions, or, under a transform, reads the fields into this
process's buffers and runs the transform into the slot. Reader processes (reader.py), the
trainer itself with readers=0 (loader.py), and compute_batch / check_determinism
(transforms/local.py) all call it, so batch k is the same array whoever computes it.
"""

from __future__ import annotations

import numpy as np

from ._native import ffi
from .fields import FieldReader, InputBuffers, _Output, field_reader
from .plan import FieldPlan
from .readahead import ReadAhead
from .slot_layout import SlotLayout
from .sources import MixtureSampler
from .transforms.core import TransformRunner, TransformSpec


class SlotOutputs:
    """One slot's arrays as the filler writes them, with their native pointers: built once
    per slot (StepFiller.bind), so that a step costs no cffi call to find its memory."""

    __slots__ = ("indices", "index_pointer", "sources", "source_pointer", "fields", "out")

    def __init__(self, indices: np.ndarray, sources: np.ndarray | None, fields: list, out: dict) -> None:
        self.indices, self.index_pointer = indices, ffi.from_buffer("uint64_t[]", indices)
        self.sources = sources
        self.source_pointer = None if sources is None else ffi.from_buffer("uint32_t[]", sources)
        self.fields, self.out = fields, out  # Per field its _Outputs (no transform); else the transform's arrays.


class StepFiller:
    """Fills steps of one plan: its fields' readers (or the transform's runner and input
    buffers), the sampler, and the block-local shuffle's read-ahead where the sampler has
    windows (read_ahead=False for a one-off computation)."""

    def __init__(self, fields: tuple[FieldPlan, ...], slot: SlotLayout, sampler, transform: TransformSpec | None,
                 verify: bool, read_ahead: bool = True) -> None:
        self.slot, self.sampler, self.transform = slot, sampler, transform
        self.plans = tuple(fields)
        batch = slot.batch_size
        self.mixture = isinstance(sampler, MixtureSampler)
        if self.mixture != slot.mixture:
            raise ValueError("a mixture's sampler needs a slot with a source region, and only it")
        self.fields, self.runner, self.inputs = [], None, None
        if transform is None:
            self.fields = [field_reader(plan, batch, verify, sampler) for plan in self.plans]
            expected = [region for plan in self.plans for region in plan.regions]
        else:  # The fields fill this process's own buffers; the transform fills the slot.
            self.runner = TransformRunner(transform, batch, sampler)
            self.inputs = InputBuffers(self.plans, batch, verify, sampler)
            expected = list(transform.regions(batch))
        found = list(slot.regions[:-1] if self.mixture else slot.regions)
        if found != expected:
            raise ValueError(f"the slot's regions {[r.name for r in found]} are not the plan's {[r.name for r in expected]}")
        self.read_ahead = None
        if read_ahead and getattr(sampler, "blocks_per_window", 0):  # The block-local shuffle reads windows ahead.
            self.read_ahead = ReadAhead(sampler, self.field_readers, sum(plan.stored_bytes for plan in self.plans))

    @property
    def field_readers(self) -> list[FieldReader]:
        return self.fields or self.inputs.readers

    def bind(self, views: tuple[np.ndarray, ...]) -> SlotOutputs:
        """The outputs over one slot's arrays, in SlotLayout view order (regions, indices)."""
        regions, indices = views[:-1], views[-1]
        sources = regions[-1] if self.mixture else None
        if self.mixture:
            regions = regions[:-1]
        if self.runner is not None:
            return SlotOutputs(indices, sources, [], dict(zip(self.runner.shapes, regions)))
        per_field, first = [], 0
        for plan in self.plans:
            per_field.append([_Output(array) for array in regions[first:first + len(plan.regions)]])
            first += len(plan.regions)
        return SlotOutputs(indices, sources, per_field, {})

    def fill(self, step: int, outputs: SlotOutputs, salt: int = 0) -> None:
        """Fills `outputs` with step `step` (`salt` reseeds the global generators differently:
        check_determinism's second run)."""
        if self.read_ahead is not None:
            self.read_ahead.note(step)
        if self.mixture:
            self.sampler.fill_unchecked(step, outputs.index_pointer, outputs.source_pointer)
        else:
            self.sampler.fill_unchecked(step, outputs.index_pointer)
        indices, sources = outputs.indices, outputs.sources
        if self.runner is None:
            for field, field_outputs in zip(self.fields, outputs.fields):
                field.fill(step, indices, outputs.index_pointer, field_outputs, sources)
        else:
            inputs = self.inputs.fill(step, indices, outputs.index_pointer, sources)
            self.runner.run(step, indices, sources, inputs, outputs.out, salt)

    def close(self) -> None:
        if self.read_ahead is not None:
            self.read_ahead.close()
            self.read_ahead = None
        for field in self.fields:
            field.close()
        if self.inputs is not None:
            self.inputs.close()

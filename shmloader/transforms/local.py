"""A transform run in this process, exactly as a reader runs it: for check_determinism,
compute_batch and tests (readers are not involved)."""

from __future__ import annotations

import numpy as np

from .._native import ffi
from ..slots import InputBuffers
from ..sources import MixtureSampler


class LocalTransform:
    def __init__(self, fields, transform, transform_args=None, *, label_path=None, batch_size: int = 256,
                 mode: str = "shuffle", seed: int = 0, shard_index: int = 0, shard_count: int = 1,
                 verify: bool = False, shuffle_window: int | None = None) -> None:
        from ..loader import plan_loader
        from . import TransformRunner

        plan = plan_loader(fields, label_path, batch_size, mode, seed, shard_index, shard_count, transform,
                           transform_args, shuffle_window)
        self.spec, self.sampler, self.batch_size = plan.transform, plan.sampler, batch_size
        self.runner = TransformRunner(self.spec, batch_size, self.sampler)
        self.inputs = InputBuffers(tuple(plan.plans.values()), batch_size, verify, self.sampler)
        self.indices = np.zeros(batch_size, dtype=np.uint64)
        self.sources = np.zeros(batch_size, dtype=np.uint32) if isinstance(self.sampler, MixtureSampler) else None

    def compute(self, step: int, salt: int = 0) -> dict:
        """Batch `step`'s outputs (new arrays), plus "indices" (and "source" for a mixture)."""
        pointer = ffi.from_buffer("uint64_t[]", self.indices)
        if self.sources is None:
            self.sampler.fill_unchecked(step, pointer)
        else:
            self.sampler.fill_unchecked(step, pointer, ffi.from_buffer("uint32_t[]", self.sources))
        inputs = self.inputs.fill(step, self.indices, pointer, self.sources)
        out = {name: np.zeros(shape, dtype) for name, (shape, dtype) in self.runner.shapes.items()}
        self.runner.run(step, self.indices, self.sources, inputs, out, salt)
        out["indices"] = self.indices.copy()
        if self.sources is not None:
            out["source"] = self.sources.copy()
        return out

    def close(self) -> None:
        self.inputs.close()

    def __enter__(self) -> LocalTransform:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

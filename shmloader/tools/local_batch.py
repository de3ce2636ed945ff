"""A batch computed in this process exactly as a reader fills it (the same StepFiller), with
no reader and no ring: compute_batch, check_determinism, and tests.

These tools drive the filler (fill/), which imports transforms/core.py, so they live above
both; shmloader.transforms re-exports them on first use (its __getattr__), and importing
shmloader.transforms, as every reader does, never imports this module or fill/.
"""

from __future__ import annotations

import numpy as np

from ..errors import TransformError
from ..fill.filler import StepFiller
from ..fill.global_seeds import global_states_kept
from ..plan.options import LoaderOptions
from ..plan.planner import plan_loader
from ..transforms.core import resolve


class LocalTransform:
    def __init__(self, fields, transform, transform_args=None, *, label_path=None, batch_size: int = 256,
                 mode: str = "shuffle", seed: int = 0, shard_index: int = 0, shard_count: int = 1,
                 verify: bool = True, shuffle_window: int | None = None, on_error: str = "raise") -> None:
        options = LoaderOptions(batch_size=batch_size, mode=mode, seed=seed, shard_index=shard_index,
                                shard_count=shard_count, transform=transform, transform_args=transform_args,
                                shuffle_window=shuffle_window, on_error=on_error, verify=verify)
        spec = None if transform is None else resolve(transform, transform_args, batch_size)
        plan = plan_loader(fields, label_path, options, spec)
        self.spec, self.slot = plan.transform, plan.slot
        self.filler = StepFiller(plan.fields, plan.slot, plan.sampler, plan.transform, verify, read_ahead=False,
                                 on_error=on_error)

    def compute(self, step: int, salt: int = 0) -> dict:
        """Batch `step`'s arrays (new ones): the transform's outputs, "source" for a mixture,
        and "indices"."""
        views = self.slot.allocate()
        with global_states_kept():  # The caller's own generators are not the batch's: as they were.
            self.filler.fill(step, self.filler.bind(views), salt)
        return dict(zip(self.slot.view_names, views))

    def close(self) -> None:
        self.filler.close()

    def __enter__(self) -> LocalTransform:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def check_determinism(fields, transform, transform_args=None, *, steps=(0, 1), **loader_options) -> None:
    """Runs each of `steps` twice in this process, the second time with the global `random`
    and `np.random` seeded differently, and raises TransformError naming the first output
    that differs (a transform that uses global randomness, the clock, or state kept between
    calls). Takes the loader's fields and options; starts no reader."""
    with LocalTransform(fields, transform, transform_args, **loader_options) as local:
        for step in steps:
            first = local.compute(step, salt=0)
            second = local.compute(step, salt=1)
            for name, array in first.items():
                if not np.array_equal(array, second[name], equal_nan=array.dtype.kind in "fc"):
                    raise TransformError(
                        f"transform {local.spec.path!r} is not deterministic: output {name!r} of step {step} differs "
                        f"between two runs with the global random and np.random seeded differently. Use ctx.rng(i) "
                        f"or ctx.batch_rng, and keep no state between calls"
                    )


def compute_batch(fields, step: int, transform, transform_args=None, **loader_options) -> dict:
    """Batch `step` as the loader's readers would give it, computed in this process (new
    arrays): a reference for tests, and a way to look at a transform's output."""
    with LocalTransform(fields, transform, transform_args, **loader_options) as local:
        return local.compute(step)


__all__ = ["LocalTransform", "check_determinism", "compute_batch"]

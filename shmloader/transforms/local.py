"""A step computed in this process, exactly as a reader fills it (the same StepFiller): for
check_determinism, compute_batch and tests (no reader, no ring)."""

from __future__ import annotations

from ..fill.filler import StepFiller
from ..plan.options import LoaderOptions
from ..plan.planner import plan_loader
from .core import resolve


class LocalTransform:
    def __init__(self, fields, transform, transform_args=None, *, label_path=None, batch_size: int = 256,
                 mode: str = "shuffle", seed: int = 0, shard_index: int = 0, shard_count: int = 1,
                 verify: bool = False, shuffle_window: int | None = None, on_error: str = "raise") -> None:
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
        self.filler.fill(step, self.filler.bind(views), salt)
        return dict(zip(self.slot.view_names, views))

    def close(self) -> None:
        self.filler.close()

    def __enter__(self) -> LocalTransform:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

"""Transforms in the readers: a user function that turns a batch's input records into the
slot's arrays, with randomness that is a pure function of (seed, sample, transform).

A transform is a function named by import path ("mypkg.data:train"), because readers are
fresh interpreters: they import it by that name (with the trainer's sys.path). It declares
its outputs with @transform, and the slot holds exactly those arrays; input fields it does
not output never enter the ring. It is called once per batch in a reader:

    @shmloader.transform(outputs={"image": ((224, 224, 3), "uint8"), "label": ((), "int64")})
    def train(batch, out, ctx, *, size=224):
        for i in range(len(ctx.indices)):
            decode_crop_flip(batch["jpeg"][i], out["image"][i], ctx.rng(i), size)
        out["label"][:] = batch["label"]

`batch` maps each input field to its records: a (B, ...) array for fixed-shape fields and
Windows; a Records sequence (record i is batch["jpeg"][i], an array viewing the reader's
buffer) for a ragged field declared by its bare path; the arrays of a Padded or Packed
declaration otherwise. `out` maps each declared output to its (B, *shape) array in the
slot: write into it. A transform may instead return a mapping of arrays, which are checked
against the declaration and copied in.

Randomness: ctx.rng(i) is sample i's numpy Generator, keyed by (seed, the sample's global
position in the sampler's stream, the transform's name): the same whatever the reader
count, slot count, shard count (at the same global batch) or resume. ctx.batch_rng is keyed
by (seed, step, name), the same on every shard. The global `random` and `np.random` must
not be used: readers reseed them from (seed, step, shard) before each call, so misuse is
at least reproducible, and check_determinism() finds it.

Lifetime: `out`'s arrays are the slot's memory for the length of the call only. Once the
call returns the slot may be delivered to the trainer at any moment, so the arrays passed
become read-only then; a transform must not keep them, or views derived from them, to
write later. `ctx.indices` and `ctx.sources` are read-only views of the slot: copy them
to reorder them. A transform must not fork a process that returns into the reader (a
forked child that does is ended before it can touch the ring).
"""

from __future__ import annotations

from ..errors import TransformError
from .core import Context, Records, batch_rng, global_positions, sample_rng, transform

# The tools that compute a batch in this process (compute_batch, check_determinism) drive
# the filler, which imports this package's core: they live above it, in
# tools/local_batch.py, and are imported from there on first use (PEP 562), so that
# importing shmloader.transforms, as every reader does, imports neither them nor fill/.
_TOOLS = ("check_determinism", "compute_batch")


def __getattr__(name: str):
    if name in _TOOLS:
        from ..tools import local_batch

        value = getattr(local_batch, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_TOOLS])


__all__ = ["Context", "Records", "TransformError", "check_determinism", "compute_batch", "transform",
           "sample_rng", "batch_rng", "global_positions"]

"""Transforms for the bad-record and reader-exit tests, importable by name as a user's module
would be: one that refuses chosen rows, each with its own message, and one that ends its
reader with os._exit at a chosen step."""

import os

import shmloader


@shmloader.transform(outputs={"x": ((4,), "float32")})
def refuses_rows(batch, out, ctx, *, bad=()):
    """x as given; a batch holding a row of `bad` fails, naming the first such row."""
    for row in ctx.indices.tolist():
        if row in bad:
            raise ValueError(f"row {row} is refused")
    out["x"][:] = batch["data"]


@shmloader.transform(outputs={"x": ((4,), "float32")})
def exits_at_step(batch, out, ctx, *, step=0, code=3):
    """x as given, until step `step`: there the reader ends at once with os._exit(code)
    (no exception, no report: a user's C extension or a careless library call)."""
    if int(ctx.step) == step:
        os._exit(code)
    out["x"][:] = batch["data"]

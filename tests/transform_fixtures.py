"""Transforms for the tests: importable by name (tests/ is on the trainer's sys.path, which
readers share), as a user's own module would be."""

import os
import random

import numpy as np

import shmloader


def _outputs(scale=2, width=4):
    return {"x": ((width,), "float32"), "noise": ((3,), "int64"), "position": ((), "uint64"), "draw": ((), "int64")}


@shmloader.transform(outputs=_outputs)
def scaled(batch, out, ctx, *, scale=2, width=4):
    """x = data * scale; noise from each sample's generator; the batch generator's draw."""
    out["x"][:] = batch["data"] * scale
    for i in range(len(ctx.indices)):
        out["noise"][i] = ctx.rng(i).integers(0, 1 << 40, 3)
    out["position"][:] = ctx.positions
    out["draw"][:] = ctx.batch_rng.integers(0, 1 << 40)


@shmloader.transform(outputs={"total": ((), "int64"), "length": ((), "uint32"), "first": ((), "int32")})
def summarise(batch, out, ctx):
    """Reduces each ragged record (tokens) to its sum, length and first element."""
    records = batch["tokens"]
    for i in range(len(records)):
        record = records[i]
        out["total"][i] = record.sum()
        out["length"][i] = record.size
        out["first"][i] = record.reshape(-1)[0]


@shmloader.transform(outputs={"x": ((4,), "float32")})
def uses_numpy_global(batch, out, ctx):
    out["x"][:] = batch["data"] + np.random.random((len(ctx.indices), 1))


@shmloader.transform(outputs={"x": ((4,), "float32")})
def uses_python_global(batch, out, ctx):
    out["x"][:] = batch["data"] + random.random()


@shmloader.transform(outputs={"x": ((4,), "float32")})
def fails_on_row_seven(batch, out, ctx):
    if 7 in ctx.indices.tolist():
        raise ValueError("row seven is cursed")
    out["x"][:] = batch["data"]


@shmloader.transform(outputs={"x": ((4,), "float32")})
def always_fails(batch, out, ctx):
    raise ValueError("this transform fails on every batch")


@shmloader.transform(outputs={"x": ((4,), "float32")})
def returns_wrong_dtype(batch, out, ctx):
    return {"x": batch["data"].astype(np.float64)}


@shmloader.transform(outputs={"x": ((4,), "float32")})
def returns_wrong_shape(batch, out, ctx):
    out["x"] = np.zeros((len(ctx.indices), 5), np.float32)


@shmloader.transform(outputs={"x": ((4,), "float32")})
def returns_arrays(batch, out, ctx):
    return {"x": batch["data"] + 1}


def undeclared(batch, out, ctx):
    pass


@shmloader.transform(outputs={"total": ((), "int64"), "length": ((), "uint32"), "window_sum": ((), "int64")})
def padded_and_windows(batch, out, ctx):
    """Reads a Padded input (its arrays and lengths) and a Windows input side by side."""
    out["length"][:] = batch["tokens.lengths"]
    out["total"][:] = batch["tokens"].sum(axis=1)
    out["window_sum"][:] = batch["stream"].sum(axis=1)


@shmloader.transform(outputs={"x": ((4,), "float32")})
def sorts_indices(batch, out, ctx):
    """Sorts ctx.indices in place: it must not reach the batch the trainer gets."""
    ctx.indices.sort()
    out["x"][:] = batch["data"]


_kept = {}


@shmloader.transform(outputs={"x": ((4,), "float32")})
def writes_late(batch, out, ctx):
    """Keeps `out` and writes into the previous call's slot: that batch may already be
    delivered, so the write must fail instead of changing it."""
    previous = _kept.get("out")
    if previous is not None:
        try:
            previous["x"][...] = -1
        except (ValueError, KeyError):
            pass
        try:
            _kept["array"][...] = -2
        except ValueError:
            pass
    _kept["out"], _kept["array"] = out, out["x"]
    out["x"][:] = batch["data"]


@shmloader.transform(outputs={"x": ((4,), "float32")})
def forks(batch, out, ctx):
    """Forks a child that returns into the reader loop instead of exiting (a user's bug)."""
    import os

    out["x"][:] = batch["data"]
    if ctx.step % 5 == 3:
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)


@shmloader.transform(outputs={"x": ((4,), "float32")})
def hangs(batch, out, ctx):
    """A transform that never returns (a deadlock, a network call without a timeout)."""
    import time

    while True:
        time.sleep(0.05)


class CustomError(Exception):
    """A user's own exception type."""


@shmloader.transform(outputs={"x": ((4,), "float32")})
def raises_key_error(batch, out, ctx):
    raise KeyError("no such sample")


@shmloader.transform(outputs={"x": ((4,), "float32")})
def raises_own_error(batch, out, ctx):
    raise CustomError("the user's own failure")


@shmloader.transform(outputs={"x": ((4,), "float32")})
def exits(batch, out, ctx):
    """sys.exit() in a transform: the reader reported "exited with code 0"."""
    import sys

    sys.exit(0)


@shmloader.transform(outputs={"x": ((4,), "float32"), "pid": ((), "int64")})
def records_pid(batch, out, ctx):
    """x as given, and the id of the process that ran the transform."""
    out["x"][:] = batch["data"]
    out["pid"][:] = os.getpid()


@shmloader.transform(outputs={"total": ((), "int64")})
def refuses_negative_records(batch, out, ctx):
    """Sums each ragged record; a record holding a negative value is refused (a bad record)."""
    records = batch["tokens"]
    for i in range(len(records)):
        if (records[i] < 0).any():
            raise ValueError(f"record {int(ctx.indices[i])} holds a negative value")
        out["total"][i] = records[i].sum()


@shmloader.transform(outputs={"x": ((4,), "float32")})
def prints_every_step(batch, out, ctx):
    """x as given; prints a line to standard output and to standard error at every step."""
    import sys

    print(f"step {int(ctx.step)} from reader {os.getpid()}", flush=True)
    print(f"step {int(ctx.step)} from reader {os.getpid()}", file=sys.stderr, flush=True)
    out["x"][:] = batch["data"]


@shmloader.transform(outputs={"x": ((4,), "float32")})
def says_hello(batch, out, ctx):
    """x as given; writes a line to the reader's standard error at step 0."""
    if int(ctx.step) == 0:
        import sys

        print(f"hello from reader {os.getpid()}", file=sys.stderr, flush=True)
    out["x"][:] = batch["data"]


@shmloader.transform(outputs={"x": ((), "int64"), "draw": ((), "int64")})
def draws_per_row(batch, out, ctx):
    """x as given, and one draw of each row's ctx.rng."""
    out["x"][:] = batch["x"]
    for i in range(len(ctx.indices)):
        out["draw"][i] = ctx.rng(i).integers(1 << 40)


@shmloader.transform(outputs={"x": ((), "int64")})
def slow_on_row_nine(batch, out, ctx):
    """x as given; the step holding row 9 takes 2.5 s."""
    import time

    if 9 in ctx.indices.tolist():
        time.sleep(2.5)
    out["x"][:] = batch["x"]


@shmloader.transform(outputs={"x": ((4,), "float32")})
def sleeps(batch, out, ctx):
    """Copies `data`, after 50 ms per batch in the user's code (a slow augmentation)."""
    import time

    time.sleep(0.05)
    out["x"][:] = batch["data"]


@shmloader.transform(outputs={"x": ((16,), "uint8")})
def crops(batch, out, ctx):
    """The first 16 bytes of each row of `data`: a slot far smaller than the rows read."""
    out["x"][:] = batch["data"][:, :16]

"""A caller's own order as the loader's sampler: an epoch's batches of dataset indices (a
PyTorch sampler's or batch sampler's, chosen in the trainer), laid out in a table that
readers read through a descriptor, and the sampler that looks each step's rows up in it.

The table is one anonymous memory file of the trainer (as a dataset's pickle is:
plan/dataset.py), read by readers through /proc/<trainer pid>/fd/<fd>: only the
descriptor crosses to them, never the indices through a pipe. Layout, uint64 little-endian:

    offset              entries            meaning
    0                   steps * width      step k's rows at [k * width, (k + 1) * width):
                                           its indices, then copies of its first (never
                                           filled nor delivered)
    steps * width * 8   steps              step k's rows (1 .. width)

`width` is the widest batch (the slot's batch_size); a narrower step's slot is cut to its
rows by the trainer, and readers fill only those (TableSampler.rows_of). Steps are
positions of a sequential stream over steps * width places, so the seed each row's
augmentation draws from is keyed by its place in the epoch, the same for any reader count.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from .._native import ffi
from .sampler import Sampler

_NAME = "shmloader-indices"
# A table larger than this is refused: readers each read all of it, once per epoch.
TABLE_ENTRIES_MAX = 1 << 31


class IndexTable:
    """An epoch's batches as the table above. The trainer builds it (of_batches) and owns
    its descriptor until close(); a reader opens it from to_dict() (open)."""

    def __init__(self, entries: np.ndarray, rows: np.ndarray, width: int, fd: int | None = None,
                 trainer_pid: int | None = None) -> None:
        assert entries.dtype == np.uint64 and rows.dtype == np.uint64, (entries.dtype, rows.dtype)
        assert len(rows) >= 1 and len(entries) == len(rows) * width, (len(entries), len(rows), width)
        self.entries, self.rows, self.width = entries, rows, width
        self.fd, self.trainer_pid = fd, trainer_pid

    @property
    def steps(self) -> int:
        return len(self.rows)

    @property
    def indices(self) -> int:
        """The indices the epoch delivers (its rows across all steps)."""
        return int(self.rows.sum())

    @classmethod
    def of_batches(cls, batches: list, length: int, what: str, width: int | None = None) -> IndexTable:
        """The table of `batches` (lists of ints in [0, length)); `width`: the slot's batch
        size when known up front (else the widest batch). Raises ValueError naming `what`
        (the sampler) and the batch at fault. The caller closes the table."""
        if not batches:
            raise ValueError(f"{what} gave no batch this epoch: nothing to deliver")
        rows = np.fromiter((len(batch) for batch in batches), dtype=np.uint64, count=len(batches))
        widest = int(rows.max())
        width = widest if width is None else width
        empty = np.flatnonzero(rows == 0)
        if len(empty):
            raise ValueError(f"{what} gave an empty batch (batch {int(empty[0])} of this epoch); a batch needs at "
                             f"least one index")
        if widest > width:
            raise ValueError(f"{what} gave a batch of {widest} indices, wider than the slot's {width}")
        if len(batches) * width > TABLE_ENTRIES_MAX:
            raise ValueError(f"{what} gives {len(batches)} batches of up to {width} indices this epoch, more than "
                             f"{TABLE_ENTRIES_MAX} places: shorten the epoch")
        table = np.empty((len(batches), width), dtype=np.int64)
        for step, batch in enumerate(batches):
            table[step, :len(batch)] = _checked(batch, step, length, what)
            table[step, len(batch):] = table[step, 0]
        return cls(table.reshape(-1).view(np.uint64), rows, width)

    def batch(self, step: int) -> np.ndarray:
        """Step `step`'s indices (uint64), a view of the table."""
        start = step * self.width
        return self.entries[start:start + int(self.rows[step])]

    def digest(self) -> str:
        """A hash of the epoch's order: what a rebuilt sequence is checked against."""
        hashed = hashlib.blake2b(digest_size=16)
        hashed.update(np.uint64(self.width).tobytes())
        hashed.update(self.rows.tobytes())
        hashed.update(self.entries.tobytes())
        return hashed.hexdigest()

    def share(self) -> None:
        """Writes the table into the trainer's memory file, for readers (idempotent)."""
        if self.fd is not None:
            return
        fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        try:
            for part in (self.entries, self.rows):
                view, written = memoryview(part).cast("B"), 0
                while written < len(view):
                    written += os.write(fd, view[written:])
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.trainer_pid = fd, os.getpid()

    def to_dict(self) -> dict:
        assert self.fd is not None, "share() the table before it crosses to readers"
        return {"trainer_pid": self.trainer_pid, "fd": self.fd, "steps": self.steps, "width": self.width}

    @classmethod
    def open(cls, data: dict) -> IndexTable:
        """A reader's copy of the trainer's table: read once (its bytes checked against
        the steps and width it is said to hold)."""
        pid, fd, steps, width = (int(data[key]) for key in ("trainer_pid", "fd", "steps", "width"))
        if pid == os.getpid():  # readers=0: the trainer's own memory file.
            path = f"/proc/self/fd/{fd}"
        else:
            path = f"/proc/{pid}/fd/{fd}"
        if not os.readlink(path).startswith(f"/memfd:{_NAME}"):
            raise ValueError(f"{path} is not the trainer's index table (is the trainer gone?)")
        expected = (steps * width + steps) * 8
        with open(path, "rb") as file:
            data_bytes = file.read(expected + 1)
        if len(data_bytes) != expected:
            raise ValueError(f"the trainer's index table {path} holds {len(data_bytes)} bytes, expected {expected} "
                             f"({steps} steps of width {width})")
        values = np.frombuffer(data_bytes, dtype=np.uint64)
        rows = values[steps * width:]
        if int(rows.min()) < 1 or int(rows.max()) > width:
            raise ValueError(f"the index table {path} has steps of {int(rows.min())} to {int(rows.max())} rows, "
                             f"outside 1 .. {width}")
        return cls(values[:steps * width], rows, width, fd, pid)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None and self.trainer_pid == os.getpid():
            os.close(fd)


def _checked(batch, step: int, length: int, what: str) -> np.ndarray:
    try:
        values = np.asarray(batch)
        if values.dtype == np.bool_ or values.dtype.kind not in "iu" or values.ndim != 1:
            raise TypeError
        values = values.astype(np.int64)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{what}: batch {step} of this epoch is {list(batch)[:8]!r}: expected a list of integer "
                         f"dataset indices") from None
    bad = np.flatnonzero((values < 0) | (values >= length))
    if len(bad):
        raise ValueError(f"{what}: batch {step} of this epoch holds index {int(values[bad[0]])}, outside the "
                         f"dataset's 0 .. {length - 1}")
    return values


class TableSampler:
    """The loader's sampler over an IndexTable: a sequential stream of the table's places
    (`stream`, a Sampler of steps * width positions, batch width, one shard), each step's
    places looked up in the table. Everything else (the pass, row keys, bounds) is the
    stream's."""

    has_sources = False
    fills_positions = False

    def __init__(self, table: IndexTable, seed: int) -> None:
        self.table, self.seed = table, seed
        self.stream = Sampler(table.steps * table.width, table.width, "sequential", seed, 0, 1, None, 1)

    def __getattr__(self, name: str):
        if name == "stream":  # Not set yet: no recursion through __getattr__.
            raise AttributeError(name)
        return getattr(self.stream, name)

    def rows_of(self, step: int) -> int:
        """How many of step `step`'s rows are delivered (the rest of its slot is cut)."""
        return int(self.table.rows[step]) if step < self.table.steps else 0

    def fill_unchecked(self, step: int, pointer) -> None:
        width = self.table.width
        out = np.frombuffer(ffi.buffer(pointer, width * 8), dtype=np.uint64)
        if step < self.table.steps:
            out[:] = self.table.entries[step * width:(step + 1) * width]
        else:  # Past the epoch (a step the ring requests but never delivers): its first batch.
            out[:] = self.table.entries[:width]

    def fill(self, step: int, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(self.table.width, dtype=np.uint64) if out is None else out
        self.fill_unchecked(step, ffi.from_buffer("uint64_t[]", out))
        return out

    def step_runs(self, step: int):
        return None  # The table's order, not the stream's runs of rows.

    def window_views(self) -> list:
        return []

    def with_pass(self, epochs: int | None, drop_last: bool) -> TableSampler:
        assert epochs == 1, epochs  # One table is one epoch.
        found = TableSampler(self.table, self.seed)
        found.stream = self.stream.with_pass(epochs, drop_last)
        return found

    def to_dict(self) -> dict:
        return {"kind": "index_table", "table": self.table.to_dict(), "seed": self.seed,
                **({} if self.stream.epochs is None else {"epochs": self.stream.epochs})}

    @classmethod
    def from_dict(cls, data: dict) -> TableSampler:
        found = cls(IndexTable.open(data["table"]), int(data["seed"]))
        if data.get("epochs") is not None:
            found = found.with_pass(int(data["epochs"]), False)
        return found

    def __repr__(self) -> str:
        return f"TableSampler(steps={self.table.steps}, width={self.table.width}, seed={self.seed})"

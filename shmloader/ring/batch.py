"""A batch as the trainer sees it.

Batch's arrays view a shared-memory slot; _cursor_batch.c (BatchBase) and _cursor.c keep the slot
reserved while any of them is alive.
"""

from __future__ import annotations

import collections.abc

import numpy as np

from .._native import load_cursor

cursor_module = load_cursor()


class Batch(cursor_module.BatchBase, collections.abc.Mapping):
    """One batch: a mapping of field name to a numpy array that views a shared-memory slot.

    `step` is the step it is, `indices` its row indices (uint64). Lifetime: the slot is
    reserved for this batch while the Batch (until released) or any array of it or view of
    one (slices, np.asarray, torch.from_numpy tensors) is alive; the loader hands it back to
    the readers at the first next() after the last of them is gone. `release()` or leaving
    `with batch:` gives up the Batch's own references. A view kept longer stays valid as
    long as it is held: when the ring needs its slot, the batch's pages become memory of
    its own at the same address (shmloader/kept.py), up to a bound on the memory so kept
    (SlotsExhaustedError past it, naming what holds it); that memory goes with the last
    view. Under pin_memory, and for a batch held when the process forked, the slot is kept
    instead and next() raises SlotsExhaustedError past hold_timeout. Copying what you keep
    (np.array(batch["x"])) costs less than keeping whole batches.

    The arrays are built once per slot and handed out again for later steps in that slot,
    so a batch costs no allocation; an array changed in place (its shape, dtype, strides or
    writeable flag) is replaced by a fresh one before its slot is handed out again.
    """

    __slots__ = ()
    # What says which rows repeat one (padding): the session's StepCuts, set on the batch
    # type each session makes (batch_type_of); None where no pass pads.
    _cuts = None

    @property
    def padding(self) -> np.ndarray:
        """A bool per row, True where the row repeats one delivered elsewhere in the pass:
        a finite pass with drop_last=False pads a shard's last step with one repeated row
        where fewer rows are left than shards (plan/passes.py), so that every shard steps
        alike and no batch is empty. Leave those rows out of a metric: the rows marked
        False are each row of the pass once across the shards."""
        indices = self.indices
        rows = 0 if indices is None else len(indices)
        finite = None if self._cuts is None else self._cuts.finite
        return np.zeros(rows, dtype=bool) if finite is None else finite.padding_mask(self.step, rows)

    def __enter__(self) -> Batch:
        return self

    def strings(self, name: str, encoding: str = "utf-8", errors: str = "strict") -> list[str]:
        """A Packed field of bytes (paths, captions, keys; shmloader.formats.from_parquet's strings)
        as Python strings, one per row."""
        offsets = self[f"{name}.offsets"].tolist()
        data = self[name][:offsets[-1]].tobytes()
        return [data[start:end].decode(encoding, errors) for start, end in zip(offsets[:-1], offsets[1:])]

    def __exit__(self, *exc_info) -> None:
        self.release()

    def __repr__(self) -> str:
        if self.released:
            return f"Batch(step={self.step}, released)"
        fields = ", ".join(f"{name}: {array.dtype}{list(array.shape)}" for name, array in self.items())
        return f"Batch(step={self.step}, {fields})"


def batch_type_of(cuts) -> type:
    """A Batch subclass whose padding answers from `cuts` (the session's StepCuts): one
    per session, since its pass (and, after a resharded resume, its tail) is its own."""
    return type("Batch", (Batch,), {"__slots__": (), "_cuts": cuts, "__module__": Batch.__module__,
                                    "__qualname__": "Batch"})

"""shmloader.torch.DataLoader with sampler= or batch_sampler=: the order is the caller's, drawn
in the trainer at each iter() as PyTorch's DataLoader draws it, and its indices go to the
readers in a table each epoch (plan/index_table.py: a descriptor, never the indices
through a pipe).

As in PyTorch: `batch_sampler`, else BatchSampler(sampler, batch_size, drop_last), is
iterated once per epoch, after one int64 is drawn from `generator` (or torch's global
generator) for the epoch's seed, at each iter() (the first only, with persistent_workers
and workers), so that a sampler drawing from the same generators gives the same order as
under PyTorch's loader: `loader.sampler.set_epoch(epoch)` before the loop (DistributedSampler)
changes it as it does there. Unlike PyTorch's, the whole epoch is drawn at iter(): a
sampler that changes its order from what the training loop does meanwhile (a curriculum
fed by the loss) is drawn before it. Batches may differ in size; the slot holds the widest
(a BatchSampler's batch_size, else the first epoch's widest batch, grown with a warning
where a later epoch's is wider: the readers start again). len(dataset) is read at each iter(),
as the sampler reads it: a dataset that grew or shrank between epochs (a replay buffer) is
planned again over its length then, with readers that read it as it is; a dataset empty when
the loader is made comes here too (DataLoader.__new__), its epochs without a batch while it is.

Exact resume: a checkpoint holds the epoch's position and its order, as the indices
themselves where the epoch has at most SEQUENCE_KEPT_MAX of them, else as what rebuilds
it (torch's global generator's state and the samplers' generators' states at the epoch's
start, their `epoch` attributes), checked by drawing it again when state_dict() is called:
a sampler whose order is not rebuilt that way is named then. It also holds the samplers'
generators' states after the epoch was drawn, restored on load, so that the next epoch
draws as the uninterrupted run's did.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.utils.data

from ..plan.defaults import TRAINER_SLOTS
from ..plan.index_table import TABLE_ENTRIES_MAX, IndexTable, TableSampler
from ..plan.sampler import derive_seed
from .collation import collating
from .dataloader import _SEED_MASK, DataLoader
from .passes import _PassIterator
from .worker import torch_context, torch_refusals, workers_setting

# An epoch's order with at most this many indices is kept in a checkpoint as it is.
SEQUENCE_KEPT_MAX = 1 << 16


def _name(index_sampler) -> str:
    """The user's sampler, as errors name it: sampler= under the loader's BatchSampler, else
    the batch sampler."""
    if type(index_sampler) is torch.utils.data.BatchSampler:
        inner = index_sampler.sampler
        return f"sampler {type(inner).__module__}.{type(inner).__qualname__}"
    return f"batch_sampler {type(index_sampler).__module__}.{type(index_sampler).__qualname__}"


def _samplers(index_sampler) -> list:
    """The batch sampler and the sampler it draws from (a BatchSampler's), where there is one."""
    inner = getattr(index_sampler, "sampler", None)
    return [index_sampler] + ([] if inner is None or inner is index_sampler else [inner])


class Snapshot:
    """What decides a sampler's draws: torch's global generator, the torch Generators the
    loader and its samplers hold, and their `epoch` attributes (DistributedSampler)."""

    def __init__(self, loader_generator, index_sampler) -> None:
        self.generators, self.epochs = [], []
        if loader_generator is not None:
            self.generators.append(("loader", loader_generator))
        for place, sampler in zip(("batch_sampler", "sampler"), _samplers(index_sampler)):
            found = getattr(sampler, "generator", None)
            if isinstance(found, torch.Generator) and all(found is not other for _, other in self.generators):
                self.generators.append((place, found))
            if isinstance(getattr(sampler, "epoch", None), int):
                self.epochs.append((place, sampler))

    def take(self) -> dict:
        return {"torch": torch.get_rng_state().numpy().tobytes(),
                "generators": {place: found.get_state().numpy().tobytes() for place, found in self.generators},
                "epochs": {place: sampler.epoch for place, sampler in self.epochs}}

    def restore(self, state: dict, global_too: bool = True) -> None:
        if global_too:
            torch.set_rng_state(_tensor(state["torch"]))
        for place, found in self.generators:
            if place in state["generators"]:
                found.set_state(_tensor(state["generators"][place]))
        for place, sampler in self.epochs:
            if place in state["epochs"]:
                sampler.epoch = int(state["epochs"][place])


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def draw_epoch(index_sampler, generator, draw_seed: bool, length: int, width: int | None):
    """(the epoch's batches as an IndexTable, the int64 drawn for its seed or None): as
    PyTorch's iterator does, iter() of the batch sampler, the seed, then its batches."""
    what = _name(index_sampler)
    batches_of = iter(index_sampler)
    drawn = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) if draw_seed else None
    batches, entries = [], 0
    for batch in batches_of:
        batch = list(batch)
        entries += len(batch)
        batches.append(batch)
        if entries > TABLE_ENTRIES_MAX:
            raise ValueError(f"{what} gave more than {TABLE_ENTRIES_MAX} indices this epoch (an endless sampler?): "
                             f"an epoch must end")
    if not batches:  # An epoch with no batch (drop_last, fewer indices than a batch): none delivered.
        return None, drawn
    return IndexTable.of_batches(batches, length, what, width), drawn


class SampledDataLoader(DataLoader, takes_sampler=True):
    """shmloader.torch.DataLoader given sampler= or batch_sampler= (see the module)."""

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, seed: int | None = None, outputs=None,
                 dataset_args=None, shard_index: int | None = None, shard_count: int | None = None,
                 on_error: str = "raise", audit_log=None) -> None:
        if audit_log is not None:
            raise ValueError("shmloader.torch.DataLoader: audit_log proves the loader's own order (shuffle=True or "
                             "False); with sampler= or batch_sampler= the order is the caller's, whose epochs it "
                             "cannot check: leave audit_log unset")
        if shard_index not in (None, 0) or shard_count not in (None, 1):
            raise ValueError(f"shmloader.torch.DataLoader: shard_index/shard_count ({shard_index}, {shard_count}) "
                             f"shard the loader's own order; with sampler= the sampler shards (DistributedSampler)")
        # PyTorch's own checks and defaults (shuffle and sampler exclusive, batch_sampler
        # alone, BatchSampler(sampler, batch_size, drop_last)): nothing starts until iter().
        reference = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                                                batch_sampler=batch_sampler, drop_last=drop_last, generator=generator,
                                                collate_fn=collate_fn)
        # The plain drop-in's checks of the other arguments, on a loader it never starts.
        torch_refusals(num_workers, timeout, prefetch_factor, persistent_workers)
        super()._check_arguments(dataset, batch_size or 1, collate_fn, in_order)
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no CUDA device is available: ignored, as torch's DataLoader does",
                          stacklevel=3)
            pin_memory = False
        self.dataset, self.worker_init_fn, self.multiprocessing_context = dataset, worker_init_fn, \
            torch_context(multiprocessing_context)
        self.sampler, self.batch_sampler = reference.sampler, reference.batch_sampler
        self.batch_size, self.drop_last = reference.batch_size, reference.drop_last
        self._index_sampler = reference._index_sampler
        (self._readers, self.num_workers), self.persistent_workers = workers_setting(num_workers), \
            bool(persistent_workers)
        self._attributes(reference.collate_fn, generator, pin_memory, timeout, prefetch_factor, in_order,
                         pin_memory_device)
        self.seed = None if seed is None else int(seed)  # None: each epoch's from the int64 drawn at iter().
        self.shard_index, self.shard_count, self._seed_drawn = 0, 1, seed is None
        self._declared, self._growths = set(outputs or {}), 0
        self._build = {"outputs": dict(outputs or {}), "dataset_args": dataset_args, "on_error": on_error,
                       "slots": None if prefetch_factor is None else
                       max(1, self.num_workers) * int(prefetch_factor) + TRAINER_SLOTS}
        self._length = len(dataset)
        # A BatchSampler's batches are batch_size wide at most: the slot's rows. Otherwise the
        # first epoch's widest batch, grown where a later one is wider (_begin).
        self._fixed_width = batch_size if type(self._index_sampler) is torch.utils.data.BatchSampler else None
        self._loader = None  # Built at the first iter(), when the first epoch's order is drawn.
        self._epoch, self._resumed, self._started, self._iterator, self._renew_failed = 0, False, False, None, False
        self._drawn = None  # The int64 drawn at the last iter() that drew one.
        # The epoch's order: its table, its seeds' base, whether a seed was drawn for it, the
        # generators' states before and after (Snapshot.take).
        self._order = None
        self._pending = None  # An order a new pass starts with (_start_pass).
        self._tables = []  # The tables readers may still open: this epoch's and the one before.

    def __len__(self) -> int:
        """len(batch_sampler), as PyTorch's; the steps left right after load_state_dict."""
        if self._resumed:
            return self._order["table"].steps - self._loader._session.cursor.next_step
        return len(self._index_sampler)

    def __iter__(self):
        if self._resumed:
            self._resumed = False
        elif self._untouched():  # Its order stays: nothing more is drawn (DataLoader._untouched).
            self._let_go()
        else:
            self._let_go()
            order = self._draw()
            epoch = self._epoch + 1 if self._started else self._epoch
            self._started = True
            if order is None:  # No batch this epoch, as PyTorch's loader gives none.
                self._epoch = epoch
                # Asked already: an epoch without a batch draws again at the next iter().
                self._iterator = iterator = _PassIterator((batch for batch in ()), self, asked=True)
                return iterator
            self._begin(epoch, order)
        self._started = True
        self._iterator = iterator = _PassIterator(self._batches(), self)
        return iterator

    def _length_changed(self) -> None:
        """None: each epoch's order is drawn over len(dataset) then (_draw), and a loader over
        another length opened for it (_begin)."""
        return None

    def _draw(self) -> dict | None:
        """The next epoch's order, drawn as PyTorch's iterator draws it, with what rebuilds it
        (None for an epoch without a batch)."""
        snapshot = Snapshot(self.generator, self._index_sampler)
        before = snapshot.take()
        # As torch's sampler reads it at each iter(): a dataset that grew (or began empty) is read
        # whole; one given by import path is built in the readers, planned once.
        if not isinstance(self.dataset, str):
            self._length = len(self.dataset)
        # PyTorch's iterator draws at each iter(), but a persistent one's only at the first.
        draw_seed = self._drawn is None or self.num_workers == 0 or not self.persistent_workers
        table, drawn = draw_epoch(self._index_sampler, self.generator, draw_seed, self._length, self._fixed_width)
        if drawn is not None:
            self._drawn = drawn
        if table is None:
            return None
        base = self.seed if self.seed is not None else (self._drawn or 0) & _SEED_MASK
        return {"table": table, "base": base, "drew": draw_seed, "before": before, "after": snapshot.take()}

    def _pass_seed(self, order: dict, epoch: int) -> int:
        return derive_seed(order["base"], "epoch", epoch) & _SEED_MASK

    def _begin(self, epoch: int, order: dict) -> None:
        """Starts `epoch`'s pass over `order`: a new loader where none is built yet or the
        slot is too narrow for its batches, else a new pass of the readers there are."""
        table = order["table"]
        if self._loader is not None and table.width > self._loader.batch_size:
            warnings.warn(f"{_name(self._index_sampler)} gave a batch of {table.width} indices in epoch {epoch}, "
                          f"wider than the slot's {self._loader.batch_size}: the slot grows, the readers start "
                          f"again", stacklevel=4)
            self._loader.close()
            self._loader = None
        elif self._loader is not None and not isinstance(self.dataset, str) and \
                self._loader._dataset.spec.length != self._length:
            self._loader.close()  # The dataset's length changed: planned again over it (its readers read it anew).
            self._loader = None
        if self._loader is None:
            self._open(epoch, order)
            return
        order["table"] = _widened(table, self._loader.batch_size)
        self._pending = order
        self._new_pass(epoch)

    def _open(self, epoch: int, order: dict) -> None:
        self._make_loader(epoch, order)
        self._keep(order["table"])
        self._order, self._epoch = order, epoch
        self._learn_layout()

    def _make_loader(self, epoch: int, order: dict) -> None:
        table = order["table"]
        table.share()
        self._loader = self._from_dataset(
            collating(self.dataset, self.collate_fn, table.width, self._build["on_error"]),
            outputs=self._build["outputs"], dataset_args=self._build["dataset_args"], index_table=table,
            reader_hook=self._reader_hook(), probe_view=self._probe_view(self._pass_seed(order, epoch)),
            batch_size=table.width, mode="sequential", seed=self._pass_seed(order, epoch), readers=self._readers,
            slots=self._build["slots"], epochs=1, drop_last=False, step_timeout=self.timeout or None,
            on_error=self._build["on_error"], pin_memory=self.pin_memory)

    def _regrow(self, outputs: dict) -> None:
        """The loader again with `outputs`, at the step the trainer was waiting for (DataLoader._regrow)."""
        step = self._loader._session.cursor.next_step
        self._loader.close()
        self._build["outputs"] = outputs
        self._make_loader(self._epoch, self._order)
        self._loader._session.seek(step)
        self._learn_layout()

    def _start_pass(self, epoch: int) -> None:
        """The readers fill the pending order's table from its step 0 (DataLoader._new_pass)."""
        order, self._pending = self._pending, None
        table = order["table"]
        table.share()
        sampler = TableSampler(table, self._pass_seed(order, epoch)).with_pass(1, False)
        session = self._loader._session
        session.use(sampler, new_pass=True)
        session.seek(0)
        self._keep(table)
        self._order = order

    def _keep(self, table: IndexTable) -> None:
        """Keeps `table` and the one before open (a reader replaced meanwhile may read it)."""
        self._tables.append(table)
        while len(self._tables) > 2:
            self._tables.pop(0).close()

    def _pass_batches(self):
        """The current inner loader's batches, each cut to its rows (the slot holds the
        widest); the last over memory of its own (see DataLoader._batches)."""
        table = self._order["table"]
        session = self._loader._session
        cursor, slot = session.cursor, session.slot
        for batch in self._loader:
            rows = int(table.rows[batch.step])
            arrays = batch if rows == table.width else dict(zip(slot.names, slot.cut(slot.views_of(batch), rows)))
            last = batch.step + 1 >= cursor.end_step
            yield self._rebuild(arrays, last)
            del batch, arrays

    def state_dict(self) -> dict:
        """The epoch, the next step in it, the epoch's order (or what rebuilds it, checked
        now), its seed, and the samplers' generators after it was drawn."""
        if self._order is None:
            return {"epoch": self._epoch, "sampler": None}
        order, table = self._order, self._order["table"]
        step = self._loader._session.cursor.next_step
        state = {"epoch": self._epoch, "step": step, "base": order["base"], "length": self._length,
                 "digest": table.digest(), "after": order["after"], "width": table.width}
        if table.indices <= SEQUENCE_KEPT_MAX:
            state["batches"] = [table.batch(index).tolist() for index in range(table.steps)]
        else:
            self._check_rebuilt(order)
            state["before"], state["drew"] = order["before"], order["drew"]
        return {"epoch": self._epoch, "sampler": state}

    def _rebuilt(self, before: dict, drew: bool) -> IndexTable:
        """The order drawn again from `before`; every generator as it was when called."""
        snapshot = Snapshot(self.generator, self._index_sampler)
        now = snapshot.take()
        snapshot.restore(before)
        try:
            table = draw_epoch(self._index_sampler, self.generator, drew, self._length, self._fixed_width)[0]
        finally:
            snapshot.restore(now)
        if table is None:
            raise ValueError(f"{_name(self._index_sampler)} gives no batch when its epoch is drawn again from the "
                             f"checkpoint's generator states: its order is not rebuilt from them")
        return table

    def _check_rebuilt(self, order: dict) -> None:
        if order.get("checked"):
            return
        rebuilt = _widened(self._rebuilt(order["before"], order["drew"]), order["table"].width)
        if rebuilt.digest() != order["table"].digest():
            raise ValueError(
                f"{_name(self._index_sampler)}'s order of this epoch ({order['table'].indices} indices, more than the "
                f"{SEQUENCE_KEPT_MAX} a checkpoint keeps as they are) is not drawn again from torch's generators' "
                f"states and its epoch: it draws from something else (Python's random, numpy, its own state), so "
                f"a resume could not continue it exactly. Give it a torch.Generator, or draw its order from its epoch "
                f"(as DistributedSampler does)")
        order["checked"] = True

    def load_state_dict(self, state: dict) -> None:
        """Continues from `state` (another num_workers is fine): the next `for` loop continues
        the saved epoch's order from its step, or starts the next epoch where the state was
        taken at its end."""
        if not isinstance(state, dict) or not {"epoch", "sampler"} <= set(state):
            raise ValueError(f"expected a state_dict() of shmloader.torch.DataLoader with a sampler (keys epoch, "
                             f"sampler), got {state!r:.200}")
        saved = state["sampler"]
        if saved is None:  # Taken before the first iter(): nothing drawn yet.
            return
        if saved["length"] != self._length:
            raise ValueError(f"the checkpoint was made over a dataset of {saved['length']} samples, this one has "
                             f"{self._length}")
        if "batches" in saved:
            table = IndexTable.of_batches(saved["batches"], self._length, "the checkpoint's order", saved["width"])
        else:
            table = _widened(self._rebuilt(saved["before"], saved["drew"]), saved["width"])
        if table.digest() != saved["digest"]:
            raise ValueError(f"{_name(self._index_sampler)} does not draw the checkpoint's order again (its hash "
                             f"differs): another sampler, dataset or seed than the checkpoint's")
        Snapshot(self.generator, self._index_sampler).restore(saved["after"], global_too=False)
        if self.seed is None:  # The base a persistent run's later epochs keep (_draw).
            self._drawn = saved["base"]
        order = {"table": table, "base": saved["base"], "drew": saved.get("drew", True), "after": saved["after"],
                 "before": saved.get("before"), "checked": "before" in saved}
        self._let_go()
        self._begin(state["epoch"], order)
        self._loader._session.seek(saved["step"])
        self._epoch, self._started = state["epoch"], True
        self._resumed = saved["step"] < table.steps

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
        for table in self._tables:
            table.close()
        self._tables = []


def _widened(table: IndexTable, width: int) -> IndexTable:
    """`table` laid out for a slot of `width` rows (its batches unchanged)."""
    if table.width == width:
        return table
    assert table.width < width and table.fd is None, (table.width, width)
    batches = [table.batch(step).tolist() for step in range(table.steps)]
    return IndexTable.of_batches(batches, int(np.iinfo(np.int64).max), "the epoch's order", width)

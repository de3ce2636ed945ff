"""shmloader.torch.DataLoader: a drop-in for torch.utils.data.DataLoader over a map-style dataset,
whose __getitem__ runs in shmloader's readers and writes each sample straight into the ring.
(Past 450 lines: the one class whose epochs, growth, forks and checkpoints the sampled and
iterable loaders override piece by piece; its helpers live beside it: passes.py, worker.py,
collation.py, own_order.py.)

    from shmloader.torch import DataLoader      # instead of torch.utils.data.DataLoader
    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=4, drop_last=False)
    for epoch in range(3):
        for batch in loader:                      # what default_collate gives, over the slot
            ...
    state = loader.state_dict()                   # StatefulDataLoader's convention
    loader.load_state_dict(state)                 # exact, under another num_workers too

Each `for` loop over the loader is one epoch: one finite pass of the dataset (every index
once, per shard), in an order drawn from (seed, epoch), with the readers kept between
epochs (a reader whose __getitem__ raised is replaced: the next epoch starts afresh, as
torch's new workers do). Arguments map to the loader's settings: num_workers -> readers (its
"auto" -> readers="auto": worker.workers_setting), prefetch_factor -> slots per worker, shuffle -> mode, generator -> seed (its initial_seed(); without a generator or
a seed, one drawn from torch's global generator, so that torch.manual_seed decides the order
and the samples' seeds as it does torch's; 0 across ranks, as DistributedSampler's), timeout ->
step_timeout, drop_last as it is, persistent_workers=False (torch's default) -> each later
epoch's readers get the dataset anew (forked or pickled), as it is then (a change made between
epochs is seen; True: they keep the copy they started with); shard_index and shard_count default to RANK and
WORLD_SIZE under torchrun, and batch_size is per rank. What cannot be honoured raises,
naming the argument. With sampler= or batch_sampler=, the order is the caller's, drawn as
PyTorch draws it (sampling.py); an IterableDataset is iterated in each reader, batches in
PyTorch's order (iterable.py): DataLoader(...) makes that class's loader.

multiprocessing_context="fork" (the default on Linux, as PyTorch's): the readers are forked
from the trainer once the dataset is planned (readers/trainer_fork.py): they share the
dataset's memory copy-on-write and see the trainer's globals, nothing pickled; without
persistent_workers each later epoch forks them anew (a change made between epochs is seen).
Each epoch reads len(dataset), as torch's sampler does: a dataset that grew or shrank between
epochs (a replay buffer) is planned again over it, with new readers (_replan), whatever
persistent_workers says.
Where the trainer cannot be forked safely (CUDA initialised, other Python threads), and for
"spawn" or "forkserver", readers start from the fork server with the dataset pickled
(worker.share_by_fork says why, once); a dataset that does not pickle (a lambda in it) is
forked after all, as torch's workers are whatever runs (_from_dataset, said once).

Readers are torch's workers as a dataset sees them (worker.py): they run in the
trainer's working directory with its sys.path (as they were when the loader was made),
torch.utils.data.get_worker_info() answers inside them (id, num_workers, seed, dataset;
None in the trainer, as torch's), and worker_init_fn(worker_id) runs in each reader once it
has loaded its copy of the dataset, before its first sample: once per reader with
persistent_workers=True, once per reader and epoch without, and again in a reader that
replaces one that died. Off the fork path it is pickled to the readers with the dataset (a
lambda is refused by name, as torch's spawn refuses it). The global generators are still seeded per sample
from its position before __getitem__: what worker_init_fn seeds there does not reach the
samples' draws (a generator of its own, kept on the dataset, does). The probe of dataset[0]
that plans the slot (in a fork of the trainer on the fork path, so that the dataset is
neither copied nor called in the trainer; on a copy in the trainer otherwise: plan/probe.py)
sees reader 0's worker info, without running worker_init_fn there.

collate_fn= (run in the readers, its output written into the slot) and the shape of a batch with
outputs= PackedRagged or Ragged: collation.py.

`audit_log=PATH` records what each rank delivered, each epoch a pass of its own, for
`shmloader audit` (ShmDataLoader's setting; not with sampler= or batch_sampler=).

`loader.padding` is the bool tensor of the batch last yielded (Batch.padding): True for a
sample repeated so that, across ranks with drop_last=False, each rank's last step holds one;
leave those out of an evaluation's metric (DistributedSampler's padding, but marked).

A batch's tensors view its slot (torch.from_numpy): they are valid for as long as they are
held. A batch the loop keeps (all_labels.append(y), list(loader), a peek such as
next(iter(loader)), the loop's variable after a `break`, across epochs too) keeps its
values: when the ring needs its slot, its pages become memory of their own at the same
address (shmloader/kept.py, bounded: the error at the bound names what holds it). Under
pin_memory, where the device has those pages registered, and for a batch held when the
process forked, the slot is kept instead: keep fewer batches than the ring holds (.clone()
what you keep), or next() waits `hold_timeout` and raises, and the next epoch raises at
once; the last batch of an epoch is a copy for the pin_memory case. A new iter(loader) ends
the one before: one pass runs at a time, so zip(loader, loader) raises.
"""

from __future__ import annotations

import functools
import inspect
import warnings

from ..loader import ShmDataLoader
from ..plan import collated
from ..plan.dataset import DatasetError, DatasetPickleError, rebuild_batch
from ..plan.dataset_outputs import Ragged, text_room_needed
from ..plan.defaults import TRAINER_SLOTS
from ..plan.options import check_flag
from ..plan.passes import FinitePass
from ..plan.sampler import derive_seed
from ..readers.supervision import drop_in_hold_advice
from .collation import collated_structure, collating
from .own_order import LoaderBatches, LoaderOrder
from .passes import _empty, _PassIterator, _shard_from_environment
from .worker import (HOOK, fork_refused, forked_anyway, may_fork_anyway, probe_view, share_by_fork, torch_context,
                     torch_refusals, workers_setting)

_SEED_MASK = (1 << 63) - 1


class DataLoader:
    """A drop-in for torch.utils.data.DataLoader (see the module)."""

    # The subclasses for sampler= or batch_sampler= (sampling.SampledDataLoader) and for an
    # IterableDataset (iterable.IterableDataLoader), which name themselves here as they are
    # defined (__init_subclass__): they build on this module, which needs nothing of them.
    # The package imports them with DataLoader.
    _sampled_class = _iterable_class = None

    def __init_subclass__(cls, takes_sampler: bool = False, takes_iterable: bool = False, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if takes_sampler:
            DataLoader._sampled_class = cls
        if takes_iterable:
            DataLoader._iterable_class = cls

    def __new__(cls, *args, **kwargs):
        """The loader over an IterableDataset (iterable.py), else with sampler= or
        batch_sampler= the loader over the caller's order (sampling.py), which also takes a
        dataset empty now: torch's sampler (sequential or random, as shuffle says) gives an
        epoch of no batch, and later epochs what it holds then, where this loader's own order
        is planned from dataset[0]."""
        if cls is DataLoader:
            import torch.utils.data

            try:
                given = inspect.signature(cls.__init__).bind(None, *args, **kwargs).arguments
            except TypeError:
                given = {}  # __init__ raises it, as it would have.
            iterable = isinstance(given.get("dataset"), torch.utils.data.IterableDataset)
            if iterable or given.get("sampler") is not None or given.get("batch_sampler") is not None or \
                    _empty(given.get("dataset")):
                cls = DataLoader._iterable_class if iterable else DataLoader._sampled_class
                if cls is None:
                    raise RuntimeError("shmloader.torch.dataloader was imported alone: import DataLoader from "
                                       "shmloader.torch, which takes sampler=, batch_sampler= and IterableDatasets")
        return object.__new__(cls)

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, seed: int | None = None, outputs=None,
                 dataset_args=None, shard_index: int | None = None, shard_count: int | None = None,
                 on_error: str = "raise", audit_log=None) -> None:
        import torch.utils.data

        torch_refusals(num_workers, timeout, prefetch_factor, persistent_workers)
        self._check_arguments(dataset, batch_size, collate_fn, in_order)
        if pin_memory and not torch.cuda.is_available():
            warnings.warn("pin_memory=True but no CUDA device is available: ignored, as torch's DataLoader does",
                          stacklevel=2)
            pin_memory = False
        self.shard_index, self.shard_count = _shard_from_environment(shard_index, shard_count)
        self._seed_drawn = generator is None and seed is None and self.shard_count == 1
        if generator is not None and seed is None:
            seed = int(generator.initial_seed())
        elif self._seed_drawn:
            # As torch's DataLoader draws its base seed: torch.manual_seed decides the run. Ranks
            # keep 0 (DistributedSampler's default): a seed drawn per rank would give each rank
            # its own order, and the shards would overlap.
            seed = int(torch.empty((), dtype=torch.int64).random_().item()) & _SEED_MASK
        self.dataset, self.batch_size = dataset, int(batch_size)
        self.drop_last = check_flag("drop_last", drop_last)
        (readers, self.num_workers), self.seed = workers_setting(num_workers), 0 if seed is None else int(seed)
        self.persistent_workers = check_flag("persistent_workers", persistent_workers)
        slots = None if prefetch_factor is None else max(1, self.num_workers) * int(prefetch_factor) + TRAINER_SLOTS
        self._epoch, self._resumed = 0, False
        self.worker_init_fn, self.multiprocessing_context = worker_init_fn, torch_context(multiprocessing_context)
        # The inner loader's settings: a collate_fn's slot that grows is built again from them (_regrow).
        self._build = {"dataset": collating(dataset, collate_fn, self.batch_size, on_error),
                       "outputs": dict(outputs or {}), "dataset_args": dataset_args, "batch_size": self.batch_size,
                       "mode": "shuffle" if shuffle else "sequential", "readers": readers, "slots": slots,
                       "epochs": 1, "drop_last": self.drop_last, "step_timeout": timeout or None,
                       "shard_index": self.shard_index, "shard_count": self.shard_count, "on_error": on_error,
                       "pin_memory": bool(pin_memory), "audit_log": audit_log}
        self._declared, self._growths = set(outputs or {}), 0
        self._hold_advice = drop_in_hold_advice(self.num_workers, prefetch_factor, TRAINER_SLOTS)
        self._loader = self._make_loader()
        self._learn_layout()
        self._started = False  # Whether the current epoch's pass has been iterated.
        self._iterator = None  # The current pass's: a new pass ends it first (_let_go).
        self._renew_failed = False  # The dataset stopped pickling: the readers keep theirs (_new_pass).
        self.padding = None  # The last batch's Batch.padding (bool per sample), as a tensor.
        self._requested_epoch = None  # loader.sampler.set_epoch(epoch): the next loop's epoch.
        self._attributes(collate_fn, generator, pin_memory, timeout, prefetch_factor, in_order, pin_memory_device)
        self.sampler = LoaderOrder(self)
        self.batch_sampler = LoaderBatches(self)

    def _attributes(self, collate_fn, generator, pin_memory, timeout, prefetch_factor, in_order,
                    pin_memory_device) -> None:
        """PyTorch's DataLoader attributes that a script or framework reads back (accelerate's
        skip_first_batches and Lightning's re-instantiation pass each of them on)."""
        import torch.utils.data

        self.collate_fn = torch.utils.data.default_collate if collate_fn is None else collate_fn
        self.generator, self.pin_memory, self.timeout, self.in_order = generator, bool(pin_memory), timeout, in_order
        self.pin_memory_device = pin_memory_device
        self.prefetch_factor = (2 if prefetch_factor is None else prefetch_factor) if self.num_workers else None

    def _reader_hook(self) -> tuple:
        """What each reader runs once it has loaded the dataset: torch's worker info, then
        worker_init_fn (worker.py)."""
        return HOOK, self.worker_init_fn

    # Set once a dataset did not pickle where forking was unsafe: its readers are forked (_from_dataset).
    _fork_anyway = False

    def _share_by_fork(self) -> bool:
        """Whether the readers are forked from this process (worker.share_by_fork; after a
        dataset that did not pickle, from then on: _from_dataset)."""
        return self.num_workers > 0 and (self._fork_anyway or share_by_fork(self.multiprocessing_context))

    def _from_dataset(self, dataset, **settings) -> ShmDataLoader:
        """ShmDataLoader.from_dataset(dataset, **settings) with this loader's way of starting
        readers (_share_by_fork). Where forking the trainer is unsafe now (threads run, CUDA
        is initialised) the dataset goes pickled; where it does not pickle, the readers are
        forked after all, said once (worker.forked_anyway): torch's DataLoader forks its
        workers whatever runs, and a script it runs (a lambda in the dataset, a wandb thread)
        would fail here instead."""
        forked = self._share_by_fork()
        try:
            return ShmDataLoader.from_dataset(dataset, share_by_fork=forked, **settings)
        except DatasetPickleError as error:
            if forked or not self.num_workers or not may_fork_anyway(self.multiprocessing_context):
                raise
            forked_anyway(error)
            self._fork_anyway = True
            return ShmDataLoader.from_dataset(dataset, share_by_fork=True, **settings)

    def _probe_view(self, pass_seed: int):
        """The worker info the probe of dataset[0] runs with (worker.probe_view)."""
        return functools.partial(probe_view, num_workers=self.num_workers, pass_seed=pass_seed)

    @staticmethod
    def _check_arguments(dataset, batch_size, collate_fn, in_order) -> None:
        """Refuses, by name, what the loader cannot honour (an IterableDataset is iterable.py's)."""
        if batch_size is None:
            raise ValueError("shmloader.torch.DataLoader: batch_size=None (no batching) cannot be honoured: the "
                             "loader delivers batches; give batch_size")
        # in_order=False lets PyTorch's loader give batches out of order; this one's are in
        # step order always (which is what makes resume exact), which in_order=False allows.
        del in_order

    def _epoch_seed(self, epoch: int) -> int:
        return derive_seed(self.seed, "epoch", epoch) & _SEED_MASK

    def __len__(self) -> int:
        """Batches in an epoch on this rank (the steps left in it right after load_state_dict);
        as torch's, of len(dataset) now where the dataset grew or shrank since its pass began
        (the next epoch is planned over it: _new_pass)."""
        finite = self._loader.finite
        if self._resumed:
            return finite.steps - self._loader._session.cursor.next_step
        length = self._length_changed()
        return finite.steps if length is None else self._steps_over(length)

    def _length_changed(self) -> int | None:
        """len(dataset) now where it is not the length this loader's order was planned over
        (a replay buffer that grew), else None. The loaders over a sampler's order or an
        IterableDataset read it their own way."""
        if isinstance(self.dataset, str):  # By import path: each reader builds its own, planned once.
            return None
        try:
            length = len(self.dataset)
        except Exception:  # noqa: BLE001 (a len() that raises now: the planned one stands)
            return None
        spec = self._loader._dataset.spec  # None once the loader is closed: the planned length stands.
        return None if spec is None or length == spec.length else length

    def _steps_over(self, length: int) -> int:
        """The batches on this rank of an epoch over `length` samples (0 for none)."""
        plan = self._loader._session.plan
        data = {key: value for key, value in plan.sampler.to_dict().items()
                if key not in ("transition", "start_position")}
        try:
            return FinitePass.of(type(plan.sampler).from_dict({**data, "length": length}), 1, self.drop_last).steps
        except ValueError:  # No batch: no row, or fewer than one across shards with drop_last.
            return 0

    def __iter__(self):
        requested, self._requested_epoch = self._requested_epoch, None
        if requested is not None and not ((self._resumed or not self._started) and requested == self._epoch):
            self._resumed = False  # set_epoch named another epoch than the one at hand: that one starts.
            self._new_pass(requested)
        elif self._resumed:
            self._resumed = False
        elif self._untouched():
            self._let_go()  # Its pass goes on from its first step.
        elif self._started:
            self._new_pass(self._epoch + 1)
        self._started = True
        self._iterator = iterator = _PassIterator(self._batches(), self)
        return iterator

    def _untouched(self) -> bool:
        """Whether the pass at hand has an iterator that was never asked for a batch: the next
        iter() gives that pass again, not the next epoch. Lightning calls iter() once on a
        loader that is no torch DataLoader to check that it iterates, then iterates it for
        the epoch: a torch DataLoader, which it does not check so, gives that epoch once."""
        iterator = self._iterator
        return iterator is not None and not iterator.asked and not iterator._superseded

    def _iterator_length(self) -> int:
        """len(iter(loader)): torch's is len(its batch sampler), the whole epoch's batches."""
        return len(self)

    def _batches(self):
        """The pass's batches, tensors over their slots; the last one's tensors over memory of
        their own: a `for` loop's variable keeps it after the loop, and under pin_memory its
        slot must be free for the next epoch (elsewhere the next pass would give the slot's
        pages to the batch: kept.py). One batch copied per epoch, no more. A collate_fn's
        batch that outgrows its slot grows the slot and the pass goes on from that step."""
        while True:
            try:
                yield from self._pass_batches()
                return
            except DatasetError as error:
                outputs = self._grown_outputs(error)
                if outputs is None:
                    raise
            self._regrow(outputs)

    def _pass_batches(self):
        """The current inner loader's batches, rebuilt (_batches)."""
        import torch

        cursor = self._loader._session.cursor
        for batch in self._loader:
            last = batch.step + 1 >= cursor.end_step
            self.padding = torch.from_numpy(batch.padding)
            yield self._rebuild(batch, last)
            del batch

    def _make_loader(self) -> ShmDataLoader:
        loader = self._from_dataset(self._build["dataset"], seed=self._epoch_seed(0), reader_hook=self._reader_hook(),
                                    probe_view=self._probe_view(self._epoch_seed(0)),
                                    **{key: value for key, value in self._build.items() if key != "dataset"})
        loader._session.supervisor.hold_advice = self._hold_advice
        return loader

    def _grown_outputs(self, error: Exception) -> dict | None:
        """outputs= with twice the room a CollateRoomError says each of its leaves needed, or
        a TextRoomError a str leaf's bytes (the slot grows geometrically), or None: another
        error, a room the caller declared (a maximum is kept), or the slot grown
        COLLATE_GROWTHS_MAX times already."""
        needed, texts = collated.room_needed(error), text_room_needed(error)
        if not (needed or texts) or set(needed) & self._declared or set(texts) & self._declared or \
                self._growths >= collated.COLLATE_GROWTHS_MAX:
            return None
        self._growths += 1
        step = self._loader._session.cursor.next_step
        if texts:  # dataset[0]'s str gave its leaf's room (plan/dataset_outputs.TEXT_BYTES_DEFAULT).
            what = ", ".join(f"{name!r} needs {count} bytes" for name, count in texts.items())
            warnings.warn(f"a sample's str at step {step} of epoch {self._epoch} is longer than the room dataset[0] "
                          f"gave its leaf ({what}): the room grows to twice that and the readers start again at that "
                          f"step (outputs={{name: Ragged(max_bytes)}} gives the room from the start)",
                          collated.CollateGrowthWarning, stacklevel=4)
            return {**self._build["outputs"], **{name: Ragged(2 * count) for name, count in texts.items()}}
        what = ", ".join(f"{name!r} needs {count} {'bytes' if name == collated.BESIDE else 'elements'}"
                         for name, count in needed.items())
        warnings.warn(f"collate_fn's batch at step {step} of epoch {self._epoch} outgrows the room the probe batches "
                      f"gave it ({what}): the room grows to twice that and the readers start again at that step "
                      f"(outputs={{name: its largest shape}} gives the room from the start)",
                      collated.CollateGrowthWarning, stacklevel=4)
        return {**self._build["outputs"], **{name: 2 * count for name, count in needed.items()}}

    def _regrow(self, outputs: dict) -> None:
        """The loader again with `outputs`, at the step the trainer was waiting for: batches
        already given keep their memory (a closed ring's mapping lives while they do)."""
        state = self._loader.state_dict()
        self._loader.close()
        self._build["outputs"] = outputs
        self._loader = self._make_loader()
        if self._epoch:
            self._start_pass(self._epoch)
        self._loader.load_state_dict(state)
        self._learn_layout()

    def _learn_layout(self) -> None:
        """How a batch is rebuilt from the slot: as default_collate stacks the samples, or
        as the collate_fn made it (plan/collated.py)."""
        handle = self._loader._dataset
        self._collated = ({output.name: output for output in handle.spec.outputs}, handle.classes) \
            if handle.spec.collate else None
        self._structure = None if handle.spec.collate else collated_structure(handle.spec)

    def _rebuild(self, arrays, last: bool):
        """The batch over the slot's `arrays`; over memory of its own where `last` (_batches)."""
        import torch

        if self._collated is None:
            return rebuild_batch(self._structure, arrays, (lambda array: torch.from_numpy(array.copy())) if last
                                 else torch.from_numpy)
        own = (lambda array: array.copy()) if last else (lambda array: array)
        outputs, classes = self._collated
        return collated.rebuild(arrays, outputs, classes, own, lambda array: torch.from_numpy(own(array)))

    def _new_pass(self, epoch: int) -> None:
        """Starts `epoch`'s pass, once the batches of the pass before are let go (_let_go);
        with persistent_workers=False (torch's default) and readers, they get the dataset as
        it is now (a change made between epochs is seen, as torch's new workers see it):
        pickled anew, or, where readers are forked from the trainer, forked anew. A dataset
        whose length changed (a replay buffer that grew) is planned again over its length now,
        as torch's sampler reads len(dataset) at each iter(): a new loader (_replan)."""
        self._let_go()
        length = self._length_changed()
        if length is not None:
            self._replan(epoch, length)
            return
        session, handle = self._loader._session, self._loader._dataset
        refork = not self.persistent_workers and handle.spec.forked and self._fork_safe_now()
        before = None
        if not self.persistent_workers and handle.spec.pickle_fd is not None and not self._renew_failed:
            try:
                before = handle.renew()
            except DatasetError as error:  # The trainer's object holds something now (a handle it opened).
                self._renew_failed = True
                warnings.warn(f"the dataset as it is now cannot be sent to the readers again ({error}); they keep "
                              f"the copy they have, from now on (as with persistent_workers=True)", stacklevel=3)
        try:
            if before is not None:
                session.dataset_spec = handle.spec
            if refork:
                session.refork()
            self._start_pass(epoch)
        except BaseException as error:
            if before is not None:  # Nothing changed: the readers keep the spec they have.
                handle.revert(before)
                session.dataset_spec = before
            if isinstance(error, RuntimeError) and "is held under pin_memory" in str(error):
                raise RuntimeError(f"{error}: a batch of the previous epoch, or a tensor or array made from one, "
                                   f"is still referenced: the loop's variable after a `break`, or a peek such as "
                                   f"next(iter(loader)). Delete it, or copy what you keep (tensor.clone()), before "
                                   f"the next epoch; the last batch of a whole epoch is a copy already") from None
            raise
        if before is not None:
            handle.settle(before)
        self._epoch = epoch

    def _replan(self, epoch: int, length: int) -> None:
        """`epoch`'s pass from a loader planned again over the dataset as it is now, `length`
        samples (its readers read it anew); the one before is closed (batches it gave keep
        their memory, as in _regrow)."""
        if length == 0:
            raise ValueError(f"shmloader.torch.DataLoader: the dataset has no sample at epoch {epoch} (it had "
                             f"{self._loader._dataset.spec.length}): a loader over this loader's own order needs one; "
                             f"give sampler=torch.utils.data.SequentialSampler(dataset) (or RandomSampler) to have "
                             f"epochs without a batch")
        self._loader.close()
        self._loader = self._make_loader()
        self._learn_layout()
        if epoch:
            self._start_pass(epoch)
        self._epoch = epoch

    @staticmethod
    def _fork_safe_now() -> bool:
        """Whether the trainer may be forked for a new epoch's readers; where not, the
        readers keep the copy they were forked with, said once (worker.fork_refused)."""
        from ..readers.trainer_fork import fork_hazard

        hazard = fork_hazard()
        if hazard is not None:
            fork_refused(hazard, "this epoch's readers keep the dataset as it was when they were forked (as with "
                                 "persistent_workers=True)")
        return hazard is None

    def _start_pass(self, epoch: int) -> None:
        """The readers fill `epoch`'s pass from its step 0."""
        self._loader._session.new_pass(self._epoch_seed(epoch))

    def _let_go(self) -> None:
        """Ends the previous pass's iterator (a `for` left by break, a peek at next(iter(...))):
        its frame lets go of the batch it was suspended on. A batch of that pass the caller
        still holds keeps its values: the new pass gives its pages memory of their own at the
        same address (kept.py), since its tensors, and any numpy array made of them,
        view the slot and cannot be moved."""
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            iterator.supersede()

    def set_epoch(self, epoch: int) -> None:
        """The next `for` loop is `epoch`, as accelerate's DataLoaderShard.set_epoch sets it on
        its samplers: Hugging Face's Trainer calls it on the loader it trains from before each
        epoch (a resumed run's later epochs then draw the uninterrupted run's orders; without
        it they restarted from epoch 0). torch's DataLoader has no such method; this one only
        forwards to loader.sampler.set_epoch where the sampler has one."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def state_dict(self) -> dict:
        """The epoch and the position in it: load_state_dict continues with the next batch."""
        return {"epoch": self._epoch, "seed": self.seed, "loader": self._loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continues from `state` (another num_workers is fine; another batch_size or rank
        count resumes elastically, as ShmDataLoader does). The next `for` loop continues
        the saved epoch, or starts the next one where the state was taken at its end."""
        if not isinstance(state, dict) or not {"epoch", "seed", "loader"} <= set(state):
            raise ValueError(f"expected a state_dict() of shmloader.torch.DataLoader (keys epoch, seed, loader), got "
                             f"{state!r:.200}")
        epoch = state["epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"the checkpoint's epoch must be a non-negative integer, got {epoch!r}")
        seed = state["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"the checkpoint's seed must be a non-negative integer, got {seed!r}")
        if seed != self.seed and not self._seed_drawn:
            raise ValueError(f"the checkpoint was made with seed {seed!r}, this loader has {self.seed}")
        if seed != self.seed or epoch != self._epoch or self._started:
            # A drawn seed (not given) gives way to the checkpoint's: the run resumed goes on with its own.
            previous, self.seed = self.seed, seed
            try:
                self._new_pass(epoch)
            except BaseException:
                self.seed = previous
                raise
        self._epoch, self._started = epoch, True
        self._loader.load_state_dict(state["loader"])
        # Taken at the end of its epoch (after a whole `for` loop): the next loop is the next
        # epoch, as it would have been without the interruption (StatefulDataLoader's too).
        cursor = self._loader._session.cursor
        self._resumed = cursor.next_step < cursor.end_step

    def close(self) -> None:
        self._loader.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

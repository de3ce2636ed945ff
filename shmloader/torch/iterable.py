"""shmloader.torch.DataLoader over a torch.utils.data.IterableDataset: each reader iterates
its own copy, and the batches come in PyTorch's order.

    loader = DataLoader(my_iterable, batch_size=32, num_workers=3, collate_fn=pad)

As in PyTorch's DataLoader:
- Each reader (worker) calls iter() on its copy of the dataset, with
  torch.utils.data.get_worker_info() answering (id, num_workers, seed, dataset), so a
  dataset shards itself by worker id; one that does not is read whole by every reader, and
  its samples come num_workers times, as torch's. num_workers=0 iterates in the trainer
  (get_worker_info() is None there).
- Batches of batch_size samples are collated by collate_fn (default_collate), in the
  reader; with drop_last=False a reader's last, shorter batch is delivered; batch_size=None:
  each item is a batch, through collate_fn (default_convert).
- Batch k of the epoch is batch k // W of reader k % W (W = max(1, num_workers)), a reader
  that is exhausted is skipped and the others go on in turn; the epoch ends when every
  reader is exhausted. Each `for` loop is an epoch: the readers call iter() again.

How: step k of the ring belongs to reader k % W (DatasetSpec.by_reader; Ring.claim_own),
which fills it with its iterator's next batch, or with an end mark once its iterator is
exhausted (IterableBatches.batch_of). The trainer takes the steps in order, leaves out the
end marks, and ends the epoch once it has seen one of each reader: that is torch's
round-robin with exhausted workers skipped, and nothing in the ring's protocol changed for
its other users. A reader exhausted early fills its later steps with end marks (a few
bytes each) until the longest reader ends.

Resume (state_dict / load_state_dict): by replay. The checkpoint holds the epoch and its
next step; on load, each reader calls iter() again and skips the batches it delivered
before that step (collating them as before: a replay costs the batches skipped). It is
exact where iterating the dataset again gives the same samples in the same order (the
same files, a seed of its own): a dataset that draws from an unseeded source continues
with other samples. The checkpoint names num_workers; another num_workers is refused (the
order depends on it, as torch's does). A reader that dies is replaced and replays the same
way, and so do the readers when a collate_fn's batch outgrows its room in the slot (the
slot grows, as for a map-style dataset: collation.py; outputs= gives the room up front).

Unlike torch's, the trainer iterates a copy of the dataset for its first two batches (of
reader 0's shard, as reader 0 sees get_worker_info(); of the next reader's where that is
empty) when the loader is made, to lay out the slot; an error in the first batch is raised
then, one later is raised by the reader that reaches it. Within a reader, samples are not
seeded one by one (unlike a map-style dataset's): the reader's generators are seeded once
when it starts, as torch seeds a worker.
"""

from __future__ import annotations

import math

from ..plan.collated import Collated
from .dataloader import DataLoader

# The steps a pass may hold: far more than any epoch of batches. The ring's steps are
# numbered in this range; the pass ends when every reader is exhausted, long before.
STEPS_MAX = 1 << 40
# Batches of the first readers the trainer's probe collates to lay out the slot.
_PROBE_BATCHES = 2


class IterableBatches(Collated):
    """What the readers read for an IterableDataset: a map-style view whose step k is the
    next batch of the iterator of reader k % readers (batch_of), wrapped as [batch], or None
    once that iterator is exhausted (the end mark). Pickled or forked to the readers
    without its iterator."""

    by_reader = True

    def __init__(self, dataset, collate_fn, batch_size: int | None, drop_last: bool, readers: int) -> None:
        super().__init__(dataset, collate_fn, batch_size or 1)
        self.batched, self.drop_last, self.readers = batch_size is not None, bool(drop_last), max(1, int(readers))
        self._iterator = self._pass_seed = self._next_step = self._last = None
        self._ended, self._rows = False, 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_iterator": None, "_pass_seed": None, "_next_step": None, "_last": None,
                "_ended": False}

    def __len__(self) -> int:
        return STEPS_MAX

    def __getitem__(self, index):
        raise TypeError("an IterableDataset's samples are not read by index: its readers iterate it (batch_of)")

    def batch_of(self, step: int, pass_seed: int):
        """Step `step`'s batch: this reader's next, as [batch], or None once its iterator is
        exhausted. A step behind the iterator (a new pass, a seek back, a replaced reader)
        starts it again from iter(); a step ahead of it (a resume) skips the batches before."""
        reader = step % self.readers
        if self._pass_seed == pass_seed and self._last is not None and self._last[0] == step:
            return self._last[1]  # Asked again (a slot grown at this step, readers=0): no replay.
        if self._pass_seed != pass_seed or self._next_step is None or step < self._next_step:
            self._iterator, self._ended = iter(self.dataset), False
            self._pass_seed, self._next_step = pass_seed, reader
        assert (step - self._next_step) % self.readers == 0, (step, self._next_step, self.readers)
        for _ in range((step - self._next_step) // self.readers):  # The replay of a resume.
            self._next_batch()
        self._next_step = step + self.readers
        self._last = None
        batch = self._next_batch()
        self._last = (step, None if batch is None else [batch])
        return self._last[1]

    def _next_batch(self):
        """The iterator's next batch, collated, or None once it is exhausted: as torch's
        _IterableDatasetFetcher, a shorter last batch is delivered unless drop_last, and an
        exhausted iterator is not asked again."""
        if self._ended:
            return None
        if not self.batched:
            try:
                item = next(self._iterator)
            except StopIteration:
                self._ended = True
                return None
            self._rows = 1
            return self.collate_fn(item)
        samples = []
        for _ in range(self.batch_size):
            try:
                samples.append(next(self._iterator))
            except StopIteration:
                self._ended = True
                break
        if not samples or (self.drop_last and len(samples) < self.batch_size):
            self._ended = True
            return None
        self._rows = len(samples)
        try:
            return self.collate_fn(samples)
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note(f"in collate_fn of {len(samples)} samples of the IterableDataset")
            raise

    def probe_batches(self) -> list:
        """([rows], batch) of the first batches, for the trainer's probe (plan/collated.py)
        on this copy: reader 0's, or where its shard is empty the next reader's (worker info
        set as in that reader); the end mark where no reader has any."""
        from torch.utils.data._utils import worker

        found, view = [], worker._worker_info
        for reader in range(self.readers if view is not None else 1):
            if view is not None:
                worker._worker_info = worker.WorkerInfo(id=reader, num_workers=view.num_workers, seed=view.seed,
                                                        dataset=view.dataset)
            try:
                self._iterator, self._ended = iter(self.dataset), False
                while len(found) < _PROBE_BATCHES and (batch := self._probe_next(found)) is not None:
                    found.append((list(range(self._rows)), [batch]))
            finally:
                worker._worker_info = view
                self._iterator = None
            if found:
                return found
        return [([], None)]

    def _probe_next(self, found: list):
        """The probe's next batch; None where a later one raises: the reader that reaches it
        raises it at its step, as torch's worker does, not the loader's construction."""
        try:
            return self._next_batch()
        except Exception:
            if not found:
                raise
            return None


class IterableDataLoader(DataLoader, takes_iterable=True):
    """shmloader.torch.DataLoader given an IterableDataset (see the module)."""

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, seed: int | None = None, outputs=None,
                 dataset_args=None, shard_index: int | None = None, shard_count: int | None = None,
                 on_error: str = "raise", audit_log=None) -> None:
        import torch.utils.data

        # PyTorch's own checks (shuffle=, sampler= and batch_sampler= refused with an
        # IterableDataset) and defaults (default_collate, default_convert for batch_size=None).
        reference = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                                                batch_sampler=batch_sampler, drop_last=drop_last,
                                                collate_fn=collate_fn, generator=generator)
        for name, value, default in (("audit_log", audit_log, None), ("dataset_args", dataset_args, None),
                                     ("on_error", on_error, "raise")):
            if value != default:
                raise ValueError(f"shmloader.torch.DataLoader: {name}={value!r} does not apply to an IterableDataset "
                                 f"(its samples have no index to audit, build or replace): leave {name} unset")
        if shard_index not in (None, 0) or shard_count not in (None, 1):
            raise ValueError(f"shmloader.torch.DataLoader: shard_index/shard_count ({shard_index}, {shard_count}) "
                             f"shard the loader's own order; an IterableDataset shards itself (by rank and "
                             f"get_worker_info()), as under torch's DataLoader")
        self._adapter = IterableBatches(dataset, reference.collate_fn, reference.batch_size, reference.drop_last,
                                        num_workers)
        self._ended_pass = False  # Whether the current epoch's pass saw every reader exhausted.
        super().__init__(dataset, batch_size=reference.batch_size or 1, num_workers=num_workers, pin_memory=pin_memory,
                         drop_last=reference.drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context, generator=generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, in_order=in_order,
                         seed=seed, outputs=outputs, shard_index=0, shard_count=1)
        self.batch_size, self.collate_fn = reference.batch_size, reference.collate_fn
        self.sampler, self.batch_sampler = reference.sampler, reference.batch_sampler

    def _make_loader(self):
        """The inner loader over IterableBatches: a step a batch, in sequence."""
        self._build.update(dataset=self._adapter, batch_size=1, drop_last=False, audit_log=None)
        return super()._make_loader()

    def __len__(self) -> int:
        """As torch's: from len(dataset) where the dataset has one (TypeError otherwise)."""
        length = len(self.dataset)
        if self.batch_size is None:
            return length
        return length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)

    def __iter__(self):
        if not self._resumed:
            self._ended_pass = False
        return super().__iter__()

    def _pass_batches(self):
        """The readers' batches in step order, the end marks left out, until every reader's
        has come (see the module)."""
        readers, ended = self._adapter.readers, set()
        for arrays in self._loader:
            step = arrays.step
            # Under pin_memory each batch is a copy (its slot is free for the next epoch at once).
            wrapped = self._rebuild(arrays, self.pin_memory)
            del arrays
            if wrapped is None:
                ended.add(step % readers)
                if len(ended) == readers:
                    self._ended_pass = True
                    return
                continue
            yield wrapped[0]
            del wrapped

    def state_dict(self) -> dict:
        """The epoch, its next step, num_workers, and whether the epoch had ended (see the
        module: resume replays each reader's iterator to that step)."""
        return {**super().state_dict(), "num_workers": self.num_workers, "ended": self._ended_pass}

    def load_state_dict(self, state: dict) -> None:
        """Continues from `state` by replay (see the module), under the same num_workers."""
        if not isinstance(state, dict) or not {"num_workers", "ended"} <= set(state):
            raise ValueError(f"expected a state_dict() of shmloader.torch.DataLoader over an IterableDataset (keys "
                             f"epoch, seed, loader, num_workers, ended), got {state!r:.200}")
        if state["num_workers"] != self.num_workers:
            raise ValueError(f"the checkpoint was made with num_workers={state['num_workers']!r}, this loader has "
                             f"num_workers={self.num_workers}: an IterableDataset's batches come in an order that "
                             f"depends on num_workers (as torch's), so resume with num_workers="
                             f"{state['num_workers']!r}")
        super().load_state_dict(state)
        self._ended_pass = bool(state["ended"])
        if self._ended_pass:  # Taken after the epoch's last batch: the next loop is the next epoch.
            self._resumed = False

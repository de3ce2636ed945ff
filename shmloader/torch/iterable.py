"""shmloader.torch.DataLoader over a torch.utils.data.IterableDataset: each reader iterates
its own copy, and the batches come in PyTorch's order. (Past 450 lines: the reader's side,
IterableBatches, and the trainer's, IterableDataLoader, keep one protocol of steps, states
and resumes that is read best in one place.)

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
bytes each) until the longest reader ends. A reader makes its batches in step order even
where the ring requests a later step of it first (a batch the loop keeps holds its slot):
the batches between are kept in the reader until their steps come (those the ring may
still ask for: within its slots of the step asked).

Resume (state_dict / load_state_dict), under the same num_workers (the order depends on
it, as torch's does; another is refused by name); the readers start afresh on load:
- A dataset with state_dict() and load_state_dict() (torchdata's Stateful protocol): each
  batch carries the reader's dataset.state_dict() after it (in the slot beside the batch,
  written as a collate_fn's leaves are: nothing pickled), and each end mark the state a next iter() starts from; the checkpoint holds each
  reader's last state the trainer took, and a resumed reader calls load_state_dict(state)
  then iter() (torchdata's order), so its iterator continues where it was: exact, also for
  a dataset whose order a replay would not give again. A reader whose iterator had ended
  keeps the state it ended in (checkpoint_entry). A resumed reader's steps before the
  checkpoint's, which the ring may ask of it before its cursor moves, never start the
  iterator its later steps come from (IterableBatches._owes_saved). With persistent_workers (or
  num_workers=0) a new epoch's iter() continues from the end mark's state, as the copy
  torch's persistent worker keeps would; with num_workers=0 a checkpoint before the first
  epoch's first batch keeps the dataset's state_dict() then (the trainer's own object,
  iterated again before a load in place). After an epoch left by `break`, the readers' copies
  start the next epoch from states the trainer never took: a checkpoint taken before a
  reader's first batch of that epoch restarts that reader from a fresh copy (as a replay).
  A dataset whose state_dict() raises (not written yet: torch's DataLoader never calls it)
  runs, with a warning naming the error, and resumes by replay (IterableBatches._with_state).
- Otherwise by replay: each reader calls iter() again and skips the batches it delivered
  before the checkpoint's step (collating them as before: a replay costs the batches
  skipped). It is exact where iterating the dataset again gives the same samples in the
  same order (the same files, a seed of its own); a dataset that draws from an unseeded
  source, or changes as it is iterated (a persistent copy's second epoch), continues with
  other samples.
A reader that dies is replaced and replays the same way; a Stateful dataset's replacement
goes on from the states the trainer took, which the trainer publishes to it (a memfd it
swaps whole, read as the pickled dataset is: IterableDataLoader._publish), so a persistent
copy's later epoch stays exact. When a collate_fn's batch outgrows its room in the slot (the
slot grows, as for a map-style dataset: collation.py; outputs= gives the room up front) the
readers start again as after load_state_dict.

Unlike torch's, the trainer iterates a copy of the dataset for its first two batches (of
reader 0's shard, as reader 0 sees get_worker_info(); of the next reader's where that is
empty) when the loader is made, to lay out the slot; an error in the first batch is raised
then, one later is raised by the reader that reaches it. Within a reader, samples are not
seeded one by one (unlike a map-style dataset's): the reader's generators are seeded once
when it starts, as torch seeds a worker.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import stat
import warnings
import weakref

from ..plan.collated import BESIDE, Collated
from .dataloader import DataLoader
from .worker import torch_refusals

# The steps a pass may hold: far more than any epoch of batches. The ring's steps are
# numbered in this range; the pass ends when every reader is exhausted, long before.
STEPS_MAX = 1 << 40
# Batches of the first readers the trainer's probe collates to lay out the slot.
_PROBE_BATCHES = 2
# Of the error a state_dict() raised, what each step of the reader carries (_with_state): a
# small part of the room the slot gives a batch's JSON (plan/collated.BESIDE_BYTES_MIN).
_STATELESS_CHARS_MAX = 200


class IterableBatches(Collated):
    """What the readers read for an IterableDataset: a map-style view whose step k is the
    next batch of the iterator of reader k % readers (batch_of) as {"batch": it, "state":
    ...}, or once that iterator is exhausted the end mark {"end": True, "state": ...}. A
    Stateful dataset's state is its state_dict() after the batch (with "ended": True where
    the iterator ended making it: a resume from it makes no batch), or at the end mark the
    state a next iter() starts from; otherwise None. Both are written into the slot as a
    collate_fn's batch is (plan/collated.py: its arrays in regions, the rest as JSON;
    nothing pickled). The view is pickled or forked to
    the readers without its iterator; `resume` (set by the trainer before it starts readers
    for a checkpoint's pass) says where each reader's iterator continues from."""

    by_reader = True

    def __init__(self, dataset, collate_fn, batch_size: int | None, drop_last: bool, readers: int) -> None:
        super().__init__(dataset, collate_fn, batch_size or 1)
        self.batched, self.drop_last, self.readers = batch_size is not None, bool(drop_last), max(1, int(readers))
        self.stateful = callable(getattr(dataset, "state_dict", None)) and \
            callable(getattr(dataset, "load_state_dict", None))
        # {"pass_seed": int, "readers": {reader: its checkpoint_entry()}}
        self.resume = None
        # (trainer pid, fd) of the trainer's latest `resume` (IterableDataLoader._publish): a
        # reader started after this view was forked or pickled (a replaced one) reads it.
        self.resume_source: tuple[int, int] | None = None
        # Why this copy's state_dict() raised (_with_state), or None.
        self.stateless: str | None = None
        self._iterator = self._pass_seed = self._next_step = self._last = None
        self._ended, self._rows, self._from_saved = False, 0, False
        # A Stateful dataset's (pass seed, _state_before_iter()): a restart in the pass (a
        # seek back) starts from it, as a replay of a copy iterated once more would not.
        self._pass_start = None
        # Batches made ahead of their step (batch_of), by step.
        self._ahead: dict[int, dict] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_iterator": None, "_pass_seed": None, "_next_step": None, "_last": None,
                "_ended": False, "_ahead": {}, "_from_saved": False,
                "_pass_start": None}

    def forget(self) -> None:
        """Drops the iterator and what it made ahead: the next step starts afresh (a seek in
        the trainer's own copy, readers=0)."""
        self.__dict__.update(self.__getstate__())

    def __len__(self) -> int:
        return STEPS_MAX

    def __getitem__(self, index):
        raise TypeError("an IterableDataset's samples are not read by index: its readers iterate it (batch_of)")

    def batch_of(self, step: int, pass_seed: int, window: int = 0) -> dict:
        """Step `step`'s batch: this reader's next, or the end mark once its iterator is
        exhausted (see the class); the iterator's batches are made in step order, whatever
        order the steps come in.

        A pass's first step here (a new pass, a replaced reader, a resume: the loader starts
        readers afresh for one) starts the iterator (iter(), or load_state_dict first where a
        checkpoint's state applies) and skips the batches of this reader's steps before it:
        they were delivered before (the replay of a resume). A later step past the next one
        is a step requested before an earlier one (the ring requests step k once step
        k - slots is let go of, and a batch the loop keeps holds its slot a while): the
        batches between are made now, kept, and given when their steps come, which is
        within the ring's slots of steps. A step behind the iterator and not kept is a seek
        back: the iterator starts again.

        `window`: the ring's slots (0: unknown). The steps requested at one time lie within so
        many of each other, so a batch of a step `window` or more below the one asked was
        skipped by a seek forward (a resume's, after its readers began at step 0) and is
        asked again only after a seek back, which starts the iterator again: it is not kept,
        or a resume deep into a pass would keep every batch it replays."""
        if self._pass_seed == pass_seed:
            if step in self._ahead:
                return self._ahead.pop(step)
            if self._last is not None and self._last[0] == step:
                return self._last[1]  # Asked again (a slot grown at this step, readers=0): no replay.
        first = self._pass_seed != pass_seed or self._next_step is None or step < self._next_step or \
            self._owes_saved(step, pass_seed)
        if first:
            self._restart(step, pass_seed)
        assert (step - self._next_step) % self.readers == 0, (step, self._next_step, self.readers)
        reachable = step - window + 1 if window else -1  # The lowest step the ring may still ask.
        for passed in [kept for kept in self._ahead if kept < reachable]:
            del self._ahead[passed]
        while self._next_step < step:
            made = self._made()
            if not first and self._next_step >= reachable:
                self._ahead[self._next_step] = made
            self._next_step += self.readers
        self._next_step = step + self.readers
        self._last = None  # Not a stale batch where the next raises.
        self._last = (step, self._made())
        return self._last[1]

    def _saved(self, step: int, pass_seed: int) -> list | None:
        """The checkpoint's [next step, state] of `step`'s reader where it applies to this pass."""
        if self.resume is None or self.resume["pass_seed"] != pass_seed:
            return None
        return self.resume["readers"].get(step % self.readers)

    def _owes_saved(self, step: int, pass_seed: int) -> bool:
        """Whether `step` needs the checkpoint's state that the running iterator did not start
        from: a resumed reader is asked for its steps before the checkpoint's (its pass starts
        at step 0, then the ring seeks: session.new_pass), and the iterator those start must
        not make a step from the checkpoint's on, nor be kept for one (_ahead, _last), or
        the batch would depend on when the reader was asked. Once it started from the state,
        a later step continues it; a seek back starts it again (batch_of)."""
        saved = None if self._from_saved else self._saved(step, pass_seed)
        return saved is not None and step >= saved[0]

    def _made(self) -> dict:
        """The iterator's next batch, or the end mark, with the state after it (the class)."""
        batch = self._next_batch()
        if batch is None:
            return self._with_state({"end": True})
        made = self._with_state({"batch": batch})
        if self.stateful and self._ended:  # Its iterator ended making it: a resume makes no batch.
            made["ended"] = True
        return made

    def _with_state(self, made: dict) -> dict:
        """`made` with the dataset's state_dict() after it as "state" (None where it is not
        Stateful). A state_dict() that raises makes this copy not Stateful from then on, and
        every step it makes says why ("stateless"): the trainer then resumes the dataset by
        replay (IterableDataLoader._stateless), as it would one without state_dict(); torch's
        DataLoader never calls it, so a dataset whose state_dict() is not written yet runs."""
        made["state"] = None
        if self.stateful:
            try:
                made["state"] = self.dataset.state_dict()
            except Exception as error:  # noqa: BLE001 (the user's, whatever it is)
                self.stateful, self.stateless = False, f"{type(error).__name__}: {error}"[:_STATELESS_CHARS_MAX]
        if self.stateless is not None:
            made["stateless"] = self.stateless
        return made

    def _restart(self, step: int, pass_seed: int) -> None:
        """iter() again for this reader's first step of the pass, or, where a checkpoint's
        state of it applies (the pass it was taken in, a step at or after it), its
        load_state_dict(state) first and its steps from the checkpoint's. A Stateful
        dataset's iter() again in the same pass (a seek back) starts from the state the
        pass's first started from (_pass_start)."""
        reader = step % self.readers
        self._pass_seed, self._next_step, self._ended, self._ahead = pass_seed, reader, False, {}
        self._read_published()
        saved = self._saved(step, pass_seed)
        self._from_saved = saved is not None and step >= saved[0]
        if self._from_saved:
            self._next_step = saved[0]
            if saved[1] is None:  # It had ended before the checkpoint: end marks, from the state it ended in.
                self._iterator, self._ended = None, True
                if len(saved) > 2 and saved[2] is not None:
                    self.dataset.load_state_dict(saved[2])
                return
            self.dataset.load_state_dict(saved[1])
        elif self.stateful:  # Every iter() of a pass from the state its first started from.
            if self._pass_start is None or self._pass_start[0] != pass_seed:
                self._pass_start = (pass_seed, self._state_before_iter())
            elif self._pass_start[1] is not None:
                self.dataset.load_state_dict(copy.deepcopy(self._pass_start[1]))
        self._iterator = iter(self.dataset)

    def _read_published(self) -> None:
        """`resume` as the trainer published it last (resume_source), in a reader: a reader
        replaced mid-pass goes on from the states the trainer took, not from the copy it was
        forked or pickled with (a persistent copy's later epoch would start afresh). The file
        is swapped whole (IterableDataLoader._publish); an empty one publishes nothing."""
        if self.resume_source is None or os.getpid() == self.resume_source[0]:
            return
        path = f"/proc/{self.resume_source[0]}/fd/{self.resume_source[1]}"
        try:  # Non-blocking, and only a regular file: the number may be reused once the trainer closed it.
            descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return  # The trainer is gone, or closed it: its readers are ending.
        try:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode) or \
                    not os.readlink(f"/proc/self/fd/{descriptor}").startswith("/memfd:shmloader-resume"):
                return  # Not the trainer's (it closed it, and the number was reused).
            with os.fdopen(descriptor, "rb", closefd=False) as file:
                data = file.read()
        except OSError:
            return
        finally:
            os.close(descriptor)
        if data:
            self.resume = pickle.loads(data)  # The trainer's, as the pickled dataset is (spawn path).

    def _state_before_iter(self):
        """The dataset's state_dict() before this pass's first iter(), copied, or None where it
        raises: torch never asks it of a copy not yet iterated (a dataset may set in __iter__
        what it reads); a seek back then calls iter() again, as a replay does."""
        try:
            return copy.deepcopy(self.dataset.state_dict())
        except Exception:
            return None

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
                    found.append((list(range(self._rows)), self._with_state({"batch": batch})))
            finally:
                worker._worker_info = view
                self._iterator = None
            if found:
                return found
        return [([], {"end": True, "state": None})]

    def _probe_next(self, found: list):
        """The probe's next batch; None where a later one raises: the reader that reaches it
        raises it at its step, as torch's worker does, not the loader's construction."""
        try:
            return self._next_batch()
        except Exception:
            if not found:
                raise
            return None


def checkpoint_entry(made: dict, step: int, readers: int) -> list:
    """What a checkpoint keeps of a Stateful dataset's reader after the trainer took `made`
    at `step`: [its next step, the state its iterator continues from], or where its iterator
    had ended [its next step, None, the state it ended in] (it makes end marks from there,
    whose state a kept reader's next epoch starts from). Copied: its arrays view the slot."""
    after = step + readers
    if "end" in made or made.get("ended"):
        return [after, None, copy.deepcopy(made["state"])]
    return [after, copy.deepcopy(made["state"])]


def _in_the_slot(outputs: dict | None) -> dict | None:
    """outputs= by the collate's leaf names ("input_ids"; "data" for a bare tensor) as the
    slot names them: under "batch" (IterableBatches wraps each batch with its state)."""
    if not outputs:
        return outputs
    return {name if name == BESIDE else "batch" if name == "data" else f"batch/{name}": room
            for name, room in outputs.items()}


def _weakly(method):
    """`method` called through a weak reference to its object: the pool keeps it, and the
    session's finalizer (a global registry) keeps the pool, so a strong one would keep an
    unclosed loader, its readers and its ring alive until the process ends (session.py:
    nothing the cursor refers to refers back to the loader)."""
    reference = weakref.WeakMethod(method)

    def call(*arguments) -> None:
        bound = reference()
        if bound is not None:  # A loader collected has no states to publish.
            bound(*arguments)
    return call


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

        if isinstance(num_workers, str) and num_workers == "auto":
            from ..plan.defaults import default_readers

            raise ValueError(f"shmloader.torch.DataLoader: num_workers=\"auto\" cannot be honoured for an "
                             f"IterableDataset: batch k comes from worker k % num_workers, as in PyTorch's DataLoader, "
                             f"so the count fixes the batches' order and what a checkpoint resumes, and workers cannot "
                             f"join or leave; give num_workers an integer (this node's default would be "
                             f"{default_readers()})")
        torch_refusals(num_workers, timeout, prefetch_factor, persistent_workers)
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
        self._published = None  # The memfd of the adapter's resume_source (_publish).
        if self._adapter.stateful and num_workers:
            self._published = os.memfd_create("shmloader-resume", os.MFD_CLOEXEC)
            self._adapter.resume_source = (os.getpid(), self._published)
            # Closed once: by close(), or with the loader where it is collected unclosed.
            self._unpublish = weakref.finalize(self, os.close, self._published)
        self._ended_pass = False  # Whether the current epoch's pass saw every reader exhausted.
        # A Stateful dataset's: each reader's [next step, state after its last batch taken
        # (None once it ended)] in this pass, by reader (IterableBatches.resume); and the
        # states its end marks gave, from which a reader kept for the next pass starts it.
        self._reader_states: dict[int, list] = {}
        self._next_pass_states: dict[int, list] = {}
        super().__init__(dataset, batch_size=reference.batch_size or 1, num_workers=num_workers, pin_memory=pin_memory,
                         drop_last=reference.drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context, generator=generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, in_order=in_order,
                         pin_memory_device=pin_memory_device, seed=seed, outputs=_in_the_slot(outputs), shard_index=0,
                         shard_count=1)
        self.batch_size, self.collate_fn = reference.batch_size, reference.collate_fn
        self.sampler, self.batch_sampler = reference.sampler, reference.batch_sampler

    def _make_loader(self):
        """The inner loader over IterableBatches: a step a batch, in sequence; a Stateful
        dataset's reader replaced mid-pass first gets the states taken (_before_replace)."""
        self._build.update(dataset=self._adapter, batch_size=1, drop_last=False, audit_log=None)
        loader = super()._make_loader()
        if self._published is not None:
            loader._session.pool.before_replace = _weakly(self._before_replace)
        return loader

    def _before_replace(self, reader: int) -> None:
        """Publishes the states the trainer took in this pass (and, for readers with none
        taken, what the adapter resumes from) for the replacement of `reader`."""
        resume = self._adapter.resume
        seed = self._epoch_seed(self._epoch)
        readers = dict(resume["readers"]) if resume is not None and resume["pass_seed"] == seed else {}
        readers.update(self._reader_states)
        self._publish({"pass_seed": seed, "readers": readers})

    def _publish(self, resume: dict | None) -> None:
        """Swaps the published resume (IterableBatches._read_published) whole: written to a
        new memfd, then put in place of the old at the same descriptor (dup2), so that a reader
        opening it reads one or the other; None publishes nothing. A state that cannot be
        pickled publishes nothing: the replacement replays, as it did before."""
        if self._published is None:
            return
        try:
            data = b"" if resume is None else pickle.dumps(resume, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            data = b""
        fresh = os.memfd_create("shmloader-resume", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fresh, view):]
            os.dup2(fresh, self._published, inheritable=False)
        finally:
            os.close(fresh)

    def __len__(self) -> int:
        """As torch's: from len(dataset) where the dataset has one (TypeError otherwise)."""
        length = len(self.dataset)
        if self.batch_size is None:
            return length
        return length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)

    def _length_changed(self) -> None:
        """None: the pass ends where the readers' iterators do, whatever len(dataset) says."""
        return None

    def _iterator_length(self) -> int:
        """torch's iterator over an IterableDataset has no len() (its sampler is infinite),
        even where the loader has one."""
        raise TypeError("the iterator of a DataLoader over an IterableDataset has no len(), as torch's has none; "
                        "len(loader) gives the batches len(dataset) makes")

    def __iter__(self):
        if not self._resumed and not self._untouched():
            kept = self.persistent_workers or self.num_workers == 0  # The readers' copies go on.
            self._reader_states = self._next_pass_states if kept else {}
            self._ended_pass, self._next_pass_states = False, {}
            if self.num_workers == 0 and self._adapter.stateful and 0 not in self._reader_states:
                # The trainer iterates the dataset itself: a checkpoint before its first batch
                # keeps the state this epoch starts from, which later epochs move on from.
                start = self._adapter._state_before_iter()
                if start is not None:
                    self._reader_states[0] = [0, start]
        return super().__iter__()

    def _pass_batches(self):
        """The readers' batches in step order, the end marks left out, until every reader's
        has come (see the module)."""
        readers, ended, stateful = self._adapter.readers, set(), self._adapter.stateful
        for arrays in self._loader:
            reader, step = arrays.step % readers, arrays.step
            # Under pin_memory each batch is a copy (its slot is free for the next epoch at once).
            made = self._rebuild(arrays, self.pin_memory)
            del arrays
            if stateful and "stateless" in made:
                stateful = self._stateless(reader, made["stateless"])
            if stateful:
                self._reader_states[reader] = checkpoint_entry(made, step, readers)
            if "end" in made:
                if stateful:  # A kept reader's next epoch starts from the state its iterator ended in.
                    self._next_pass_states[reader] = [reader, self._reader_states[reader][2]]
                ended.add(reader)
                if len(ended) == readers:
                    self._ended_pass = True
                    return
                continue
            yield made["batch"]
            del made

    def _stateless(self, reader: int, why: str) -> bool:
        """Reader `reader`'s copy of the dataset raised `why` from state_dict(): said once, and
        the dataset is resumed by replay from now on (IterableBatches._with_state). False."""
        warnings.warn(f"shmloader.torch.DataLoader: the dataset's state_dict() raised {why} (in reader {reader}), so "
                      f"checkpoints keep no state of it: load_state_dict() replays it (iter() again, the batches "
                      f"delivered skipped), as for a dataset without state_dict(); torch's DataLoader never calls "
                      f"state_dict()", stacklevel=5)
        self._adapter.stateful, self._adapter.resume = False, None
        self._reader_states, self._next_pass_states = {}, {}
        self._publish(None)  # A replaced reader resumes nothing: it replays too.
        return False

    def _grown_outputs(self, error: Exception) -> dict | None:
        """As the map-style loader's; where the slot grows, a Stateful dataset's readers start
        again from the states the trainer took in this pass (as after load_state_dict): a
        fresh copy's iter() is not a persistent copy's of a later epoch."""
        outputs = super()._grown_outputs(error)
        if outputs is not None and self._adapter.stateful and self.num_workers:
            self._adapter.resume = {"pass_seed": self._epoch_seed(self._epoch),
                                    "readers": {reader: list(entry) for reader, entry in self._reader_states.items()}}
            self._publish(self._adapter.resume)  # Not an older replacement's, which the new readers would read.
        return outputs

    def state_dict(self) -> dict:
        """The epoch, its next step, num_workers, whether the epoch had ended, and for a
        Stateful dataset each reader's state after its last batch taken (see the module)."""
        state = {**super().state_dict(), "num_workers": self.num_workers, "ended": self._ended_pass}
        if self._adapter.stateful:
            for key, states in (("reader_states", self._reader_states), ("next_pass_states", self._next_pass_states)):
                state[key] = {str(reader): list(saved) for reader, saved in states.items()}
        return state

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
        self._ended_pass, self._reader_states, self._next_pass_states = bool(state["ended"]), {}, {}
        if self._ended_pass:  # Taken after the epoch's last batch: the next loop is the next epoch.
            self._resumed = False
        resume = None
        if self._adapter.stateful:
            self._reader_states = self._checked_states(state, "reader_states")
            self._next_pass_states = self._checked_states(state, "next_pass_states")
            kept = self.persistent_workers or self.num_workers == 0
            # Where readers start from a state: this pass's, or after an epoch's end the next's
            # (kept readers start it from where their iterators ended).
            states, epoch = (self._next_pass_states, self._epoch + 1) if self._ended_pass and kept else \
                (self._reader_states, self._epoch)
            if states and (not self._ended_pass or kept):
                resume = {"pass_seed": self._epoch_seed(epoch), "readers": states}
        if self._adapter.stateful:  # Not an older resume or replacement's, which readers would read.
            self._adapter.resume = resume
            self._publish(resume)
        if resume is not None or not self._ended_pass:
            # Readers started afresh, whose first step of the pass starts their iterators (from
            # `resume`, or replaying: IterableBatches.batch_of); those running may have made
            # batches of this pass's steps before the checkpoint's.
            self._adapter.forget()  # Keeps `resume`, set above.
            self._regrow(self._build["outputs"])

    def close(self) -> None:
        super().close()
        if self._published is not None:
            self._published = None
            self._unpublish()

    def _checked_states(self, state: dict, key: str) -> dict[int, list]:
        """The checkpoint's `key`: reader -> [its next step, its state_dict() or None (ended),
        and where ended the state it ended in] (checkpoint_entry)."""
        saved = state.get(key, {})
        try:
            states = {int(reader): [int(entry[0]), *entry[1:3]] for reader, entry in saved.items()}
            if any(len(entry) < 2 for entry in states.values()):
                raise ValueError
            if not all(0 <= reader < self._adapter.readers for reader in states):
                raise ValueError
        except (TypeError, ValueError, IndexError, AttributeError):
            raise ValueError(f"the checkpoint's {key} must map each reader (0 to {self._adapter.readers - 1}) to "
                             f"[its next step, its state], got {saved!r:.200}") from None
        return states

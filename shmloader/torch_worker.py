"""The drop-in's side of a reader process: torch's worker view and worker_init_fn.

shmloader.torch.DataLoader gives its dataset this module's `enter_reader` as the reader
hook (plan/dataset.DatasetSpec.reader_hook): each reader calls it once it has loaded its
copy of the dataset, before its first sample, so that inside the reader, as in a worker of
torch's DataLoader:

- torch.utils.data.get_worker_info() answers with `id` (the reader's index, 0 to
  num_workers - 1), `num_workers` (the drop-in's), `seed` and `dataset` (this reader's
  copy). `seed` is the reader's (fill/dataset_runner.ReaderView): derived from the epoch's
  seed and the id, 63 bits, and torch.initial_seed() equals it while worker_init_fn runs
  (Python's, numpy's and torch's global generators are seeded with it then), as in torch.
- worker_init_fn(id) runs then: once per reader and loaded dataset, so once per reader
  with persistent_workers=True, once per reader and epoch without (each epoch's readers
  load the dataset anew, as torch's new workers do), and again in a reader that replaces
  one that died.

What differs from torch: before each sample, the loader seeds the global generators from
the sample's own position (fill/global_seeds.py), so a draw from `random`, `np.random` or
torch's generator inside __getitem__ depends on the sample, never on the reader, the
worker_init_fn or the worker count; torch.initial_seed() there is the sample's seed. What
worker_init_fn seeds of its own (a library's generator, a numpy Generator it keeps on the
dataset) it keeps, and its draws then depend on the reader, as in torch.

The core never imports this module: the hook is named by its import path.
"""

from __future__ import annotations

import contextlib

HOOK = "shmloader.torch_worker:enter_reader"


def enter_reader(dataset, reader, worker_init_fn) -> None:
    """Sets torch's worker info for this reader, then runs `worker_init_fn(reader.index)`
    where one was given. `reader`: fill/dataset_runner.ReaderView."""
    from torch.utils.data._utils import worker

    worker._worker_info = worker.WorkerInfo(id=reader.index, num_workers=reader.count, seed=reader.seed,
                                            dataset=dataset)
    if worker_init_fn is None:
        return
    try:
        worker_init_fn(reader.index)
    except Exception as error:
        if hasattr(error, "add_note"):
            error.add_note(f"in worker_init_fn({reader.index}), which reader {reader.index} runs before its first "
                           f"sample")
        raise


@contextlib.contextmanager
def probe_view(dataset, num_workers: int, pass_seed: int):
    """The trainer's probe of dataset[0] (plan/dataset.plan_dataset) sees get_worker_info()
    as reader 0 will (its id, num_workers, seed; `dataset` the probe's copy), so that a
    __getitem__ written for workers, which reads it without a None check, plans; then
    torch's main-process None again. worker_init_fn does not run in the trainer: a setting
    it makes (torch.set_num_threads(1), a seed) would be the trainer's."""
    from torch.utils.data._utils import worker

    from .fill.dataset_runner import ReaderView

    reader = ReaderView.of((0, num_workers), pass_seed)
    before = worker._worker_info
    worker._worker_info = worker.WorkerInfo(id=0, num_workers=num_workers, seed=reader.seed, dataset=dataset)
    try:
        yield
    finally:
        worker._worker_info = before

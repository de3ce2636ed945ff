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
import sys
import warnings

HOOK = "shmloader.torch.worker:enter_reader"


def workers_setting(num_workers) -> tuple[object, int]:
    """The drop-in's num_workers as (the loader's readers setting, the num_workers it reads
    back): an integer is PyTorch's, exactly (that many readers; 0: the trainer loads);
    "auto" is readers="auto" on this node (readers join and leave as the loader runs, within
    the node's reader budget), read back as the most it may run: the range of the worker
    ids, get_worker_info().num_workers in the readers, and what prefetch_factor multiplies."""
    if not isinstance(num_workers, str):
        return int(num_workers), int(num_workers)
    if num_workers != "auto":
        raise TypeError(f"shmloader.torch.DataLoader: num_workers must be an integer (PyTorch's meaning) or \"auto\", "
                        f"got {num_workers!r}")
    from ..plan.options import AutoReaders

    start, least, most = AutoReaders().resolve()
    return AutoReaders(start=start, least=least, most=most), most


def torch_refusals(num_workers, timeout, prefetch_factor, persistent_workers) -> None:
    """Raises what PyTorch's DataLoader raises for these, in its words (a negative
    num_workers or timeout, prefetch_factor or persistent_workers=True without workers):
    torch's own checks, run on a loader it never starts, so that the drop-in refuses what
    a script under torch could never have run, as torch does."""
    import torch.utils.data

    if isinstance(num_workers, str):  # "auto": the drop-in's own, checked by workers_setting.
        num_workers = 1
    torch.utils.data.DataLoader((), num_workers=num_workers, timeout=timeout, prefetch_factor=prefetch_factor,
                                persistent_workers=persistent_workers)


def enter_reader(dataset, reader, worker_init_fn) -> None:
    """Sets torch's worker info for this reader, then runs `worker_init_fn(reader.index)`
    where one was given. `reader`: fill/dataset_runner.ReaderView."""
    from torch.utils.data._utils import worker

    dataset = _users(dataset)
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


def _users(dataset):
    """The user's dataset: the loader reads a collate_fn's through a Collated wrapper."""
    from ..plan.collated import Collated

    return dataset.dataset if isinstance(dataset, Collated) else dataset


@contextlib.contextmanager
def probe_view(dataset, num_workers: int, pass_seed: int):
    """The probe of dataset[0] (plan/probe.py) sees get_worker_info() as reader 0 will (its
    id, num_workers, seed; `dataset` the one the probe reads: the trainer's own in the
    trainer's fork, else a copy), so that a __getitem__ written for workers, which reads it
    without a None check, plans; then torch's main-process None again. worker_init_fn does not run in the trainer: a setting
    it makes (torch.set_num_threads(1), a seed) would be the trainer's."""
    from torch.utils.data._utils import worker

    from ..fill.dataset_runner import ReaderView

    reader = ReaderView.of((0, num_workers), pass_seed)
    before = worker._worker_info
    worker._worker_info = worker.WorkerInfo(id=0, num_workers=num_workers, seed=reader.seed,
                                            dataset=_users(dataset))
    try:
        yield
    finally:
        worker._worker_info = before


# The reasons a fork was refused that this process has said already (share_by_fork).
_WARNED: set[tuple[str, str]] = set()


def start_method(context) -> str:
    """The start method torch's DataLoader would use for `multiprocessing_context`: a name
    or a multiprocessing context; None is the platform's default ("fork" on Linux, as
    PyTorch's workers are forked there; "spawn" elsewhere)."""
    import multiprocessing

    if context is None:
        return "fork" if sys.platform.startswith("linux") else "spawn"
    if isinstance(context, str):
        if context not in multiprocessing.get_all_start_methods():
            raise ValueError(f"shmloader.torch.DataLoader: multiprocessing_context={context!r} is no start method "
                             f"here; expected one of {multiprocessing.get_all_start_methods()}")
        return context
    method = getattr(context, "get_start_method", None)
    if method is None:
        raise TypeError(f"shmloader.torch.DataLoader: multiprocessing_context must be a start method's name or a "
                        f"multiprocessing context, got {type(context).__name__}")
    return method()


def torch_context(context):
    """`multiprocessing_context` as torch's DataLoader keeps it: a start method's name becomes
    its multiprocessing context (Lightning's worker check calls
    loader.multiprocessing_context.get_start_method()); a context or None stays as given.
    An unknown name is refused by name (start_method)."""
    if not isinstance(context, str):
        return context
    import multiprocessing

    return multiprocessing.get_context(start_method(context))


def share_by_fork(context) -> bool:
    """Whether readers are forked from the trainer (readers/trainer_fork.py) for
    `multiprocessing_context`: for "fork" (the default on Linux) where forking is safe now;
    where it is not (CUDA initialised, other Python threads running, no pidfds), the fork
    server's readers instead, said once per reason. "spawn" and "forkserver": the fork
    server's (fresh interpreters, the dataset pickled)."""
    if start_method(context) != "fork":
        return False
    from ..readers import forkserver
    from ..readers.trainer_fork import fork_hazard

    hazard = fork_hazard() if forkserver.available() else \
        "this system has no pidfds (Linux before 5.3) or SHMLOADER_FORKSERVER=0"
    if hazard is None:
        return True
    fork_refused(hazard, "readers start from a fresh interpreter with the dataset pickled (as with 'spawn')")
    return False


def may_fork_anyway(context) -> bool:
    """Whether readers can be forked from the trainer for `multiprocessing_context` where
    forking is unsafe now (share_by_fork refused it) but the dataset does not pickle: "fork"
    on a system with pidfds. torch's DataLoader forks its workers whatever runs."""
    from ..readers import forkserver

    return start_method(context) == "fork" and forkserver.available()


def forked_anyway(error: Exception) -> None:
    """Warns, once per process, that the readers are forked after all (may_fork_anyway)."""
    from ..readers.trainer_fork import fork_hazard

    hazard = fork_hazard() or "forking the trainer is unsafe now"
    _warn_once(("forked anyway", hazard.split(" (")[0]),
               f"shmloader.torch.DataLoader: the dataset does not go to the readers pickled ({error}), so they are "
               f"forked from the trainer after all, as torch's DataLoader forks its workers: {hazard}. Make the loader "
               f"before threads start or CUDA is initialised, or make the dataset picklable")


def fork_refused(hazard: str, instead: str) -> None:
    """Warns, once per reason and consequence in this process, that the trainer was not
    forked for its readers because of `hazard`, and what happens `instead`."""
    _warn_once((hazard.split(" (")[0], instead),
               f"shmloader.torch.DataLoader: multiprocessing_context='fork' cannot fork the trainer now: {hazard}; "
               f"{instead}. Make the loader before CUDA is initialised or threads start, or pass "
               f"multiprocessing_context='spawn' to choose that path")


def _warn_once(key: tuple, message: str) -> None:
    """Warns with `message` unless this process said it for `key` already (_WARNED)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, stacklevel=6)

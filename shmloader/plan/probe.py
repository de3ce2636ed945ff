"""The probe of dataset[0]: the samples' structure, shapes and dtypes read from the dataset
for the plan (plan/dataset.plan_dataset), without touching the trainer's own object (a
memoizing or counting dataset would see an extra call, unseeded).

Where the readers are forked from the trainer (share_by_fork), the probe runs in a fork of
its own (readers/fork_call.py): it reads the trainer's dataset copy-on-write, so a large
in-memory dataset is neither pickled nor copied (a 500 MB array dataset cost the trainer
twice its size for a moment), and it sends back a description: the structure, the outputs
(name, shape, dtype), the classes the structure names (pickled by reference) or the user's
exception with its traceback. Elsewhere (spawn, forkserver, readers=0, a trainer that
cannot be forked now), and where the answer cannot come back (a class or an exception that
does not pickle, an answer over PROBE_ANSWER_BYTES_MAX), the probe reads a copy in the
trainer: the readers' pickle, or one made for it.

Either way dataset[0] runs with the global generators seeded as the sample at stream
position 0 is (fill/global_seeds.py) and, in the trainer, put back after; and with the
caller's view (the drop-in's worker info as reader 0 sees it).
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import traceback

import numpy as np

from ..fill.global_seeds import global_states_kept, seed_all
from .collated import Collated, plan_collated
from .dataset_outputs import _NAMED_CLASSES, _SEPARATOR, DatasetError, _leaf_array, _output_of, _text_output, flatten
from .naming import loader_name_problem
from .sampler import sample_seeds

# The fork's answer is a description (a few kilobytes for any realistic sample: a leaf's
# name, shape and dtype) or an exception with its traceback; one larger than this (an
# exception whose message holds a sample's values) is not sent, and the trainer probes a
# copy instead.
PROBE_ANSWER_BYTES_MAX = 16 << 20
# How long the trainer waits for dataset[0] in its fork: far beyond a sample's read, short
# of a hang going unnoticed (the error names this limit).
PROBE_WAIT_SECONDS_MAX = 900.0


def probe(instance, length: int, declared: dict, probe_view, seed: int, in_fork=None, pickled: bytes | None = None):
    """(structure, outputs, classes) of `instance`'s samples (or of its collate_fn's batch,
    for a Collated dataset) for a loader of `seed`: read in a fork where `in_fork`
    (readers/fork_call.call_in_fork) can make one, else from `pickled` (the readers'
    pickle) or a copy made here. `probe_view`: a function of the dataset giving the context
    dataset[0] runs in, or None."""

    sample_seed = sample_seeds(seed, np.zeros(1, dtype=np.uint64))[0]  # The sample's at stream position 0.
    if in_fork is not None:
        planned = _probe_in_fork(instance, length, declared, probe_view, sample_seed, in_fork)
        if planned is not None:
            return planned
    copied = _probe_copy(instance) if pickled is None else pickle.loads(pickled)
    with global_states_kept():  # The trainer's own draws do not depend on the loader's probe.
        return _probed(copied, length, declared, probe_view, sample_seed)


def _probed(dataset, length: int, declared: dict, probe_view, sample_seed: int):
    """(structure, outputs, classes) read from `dataset`, which the probe may change, with
    the global generators seeded with `sample_seed` first."""
    seed_all(sample_seed)
    with probe_view(dataset) if probe_view is not None else contextlib.nullcontext():
        if isinstance(dataset, Collated):  # The outputs are the collate_fn's batch's.
            built, structure, classes = plan_collated(dataset, length, declared)
            return structure, built, classes
        structure, built = _sample_outputs(dataset, declared)
        return structure, built, {}


def _probe_in_fork(instance, length: int, declared: dict, probe_view, sample_seed: int, in_fork):
    """(structure, outputs, classes) from a fork of the trainer, the user's exception raised
    again here, or None where the trainer cannot fork now or the answer did not come back."""
    def job() -> bytes:
        named_before = set(_NAMED_CLASSES)
        try:
            structure, built, classes = _probed(instance, length, declared, probe_view, sample_seed)
            named = {name: found for name, found in _NAMED_CLASSES.items() if name not in named_before}
            answer = ("planned", structure, built, classes, named)
        except BaseException as error:  # noqa: BLE001 (the user's, whatever it is, goes back to the trainer)
            answer = ("raised", error, "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        return _bounded(answer)

    what = "the collate_fn's probe batches" if isinstance(instance, Collated) else "dataset[0]"
    from_fork = in_fork(job, PROBE_ANSWER_BYTES_MAX, PROBE_WAIT_SECONDS_MAX,
                        f"reading {what} for the samples' structure (multiprocessing_context='spawn' reads it in "
                        f"the trainer instead)")
    if from_fork is None:
        return None
    try:
        answer = pickle.loads(from_fork)
    except Exception:  # noqa: BLE001 (a class or an exception that does not unpickle here: probe a copy)
        return None
    if answer[0] == "raised":
        error, text = answer[1], answer[2]
        if isinstance(error, DatasetError):  # The plan's own check: its message says what and where.
            raise error
        # The user's exception lost its traceback on the way (as a torch worker's would): it
        # goes in a note, as torch puts a worker's in its message.
        raise _noted(error, f"the probe's traceback, in a fork of the trainer:\n{text}")
    if answer[0] != "planned":
        return None
    _, structure, built, classes, named = answer
    _NAMED_CLASSES.update(named)  # rebuild_batch finds them as the trainer's own probe would have left them.
    return structure, built, classes


def _bounded(answer: tuple) -> bytes:
    """`answer` pickled, or ("unsent", why) where it does not pickle or is too large."""
    try:
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 (pickle raises many types)
        return pickle.dumps(("unsent", f"{type(error).__name__}: {error}"))
    if len(data) > PROBE_ANSWER_BYTES_MAX:
        return pickle.dumps(("unsent", f"{len(data)} bytes"))
    return data


def _sample_outputs(probe, declared: dict) -> tuple[dict, list]:
    """(structure, outputs) of the samples, from dataset[0] of `probe` and `declared`."""
    try:
        first = probe[0]
    except Exception as error:
        raise _noted(error, "in dataset[0], which the loader reads first for the samples' structure")
    structure, leaves = flatten(first, "dataset[0]")
    names = [name for name, _ in leaves]
    unknown = sorted(set(declared) - set(names))
    if unknown:
        raise DatasetError(f"outputs names {unknown}, which dataset[0] does not have (its leaves: {names})")
    built = []
    for name, value in leaves:
        problem = loader_name_problem(name.replace(_SEPARATOR, "_"))
        if problem is not None:
            raise DatasetError(f"dataset[0]'s leaf {name!r} {problem}")
        if isinstance(value, str):
            built.append(_text_output(name, value, declared.get(name)))
            continue
        built.append(_output_of(name, _leaf_array(value, f"dataset[0][{name!r}]"), declared.get(name)))
    return structure, built


def _probe_copy(instance):
    """A copy of the dataset for the probe of dataset[0] (nothing was pickled), or the object
    itself where it neither pickles nor deep-copies: only then does the probe's __getitem__
    call reach the object that fills the batches."""
    try:
        return pickle.loads(pickle.dumps(instance, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 (pickle raises many types)
        pass
    try:
        return copy.deepcopy(instance)
    except Exception:  # noqa: BLE001
        return instance


def _noted(error: BaseException, note: str) -> BaseException:
    """`error` with `note` added, its type and arguments kept (a type whose constructor takes
    others, UnicodeDecodeError, cannot be made again with a new message): a note where Python
    has them (3.11 on); before, a copy whose message starts with the note where the type
    takes one message (chained to the error), else the error as it is."""
    if hasattr(error, "add_note"):
        error.add_note(note)
        return error
    try:
        copy = type(error)(f"{note}: {error}")
    except Exception:  # noqa: BLE001 (any constructor)
        return error
    copy.__cause__ = error
    return copy

"""A map-style dataset (any object with __len__ and __getitem__) as the loader's source,
planned in the trainer: the slot's regions from its samples' structure, and how readers
get the dataset (DatasetSpec, which crosses to them as data).

A sample is a numpy array, a Python scalar (int, float, bool), bytes, a torch tensor, or a
dict, tuple or list of those, nested. Its leaves become the slot's regions, named by their
path ("image", "label"; a tuple's items "0", "1"; nested "meta/id"; a bare array "data"),
each (batch_size, *shape) of its dtype (a torch dtype numpy lacks, bfloat16, as its bits:
dataset_outputs.TORCH_BITS; rebuild_batch gives tensors back as that dtype, arrays as the
bits), from the first sample or from `outputs=` (leaf
name -> (shape, dtype); for a leaf whose first dimension varies, Ragged(max_length): padded
to max_length with NAME.lengths beside it, or PackedRagged(max_items): back to back with
NAME.offsets beside it, as Packed gives a file's records). `structure` keeps the nesting so
that the trainer can rebuild each batch as the samples' structure (rebuild_batch). The
probe that reads dataset[0] for them, in a fork of the trainer or on a copy: plan/probe.py.

How readers get the dataset, once each (never per sample):
- pickled, with the standard library's pickle at the highest protocol (no extra
  dependency; protocol 5 keeps large numpy buffers in one piece). The bytes live in an
  anonymous memory file of the trainer that readers reopen through /proc (as the ring
  may: ring/backing.py), so nothing is left on disk if the trainer dies. A dataset class
  defined in the trainer's script (__main__) is found in readers by running that script
  as __mp_main__, as multiprocessing's spawn does: its top level must be guarded by
  `if __name__ == "__main__":`.
- by import path ("mypkg.data:make_dataset", called with `dataset_args`), for a dataset
  that cannot be pickled (open handles, lambdas, a database connection): each reader
  builds its own.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import mmap
import os
import pickle
import secrets
import sys

import numpy as np

from ..ring.slot_layout import Region
from .collated import Collated
from .dataset_outputs import _NAMED_CLASSES, DatasetError, DatasetOutput, as_torch_dtype
from .probe import probe

# A dataset's pickle larger than this is refused with the import-path advice: every reader
# holds its own copy of the unpickled dataset.
PICKLE_BYTES_MAX = 1 << 30
# The trainer's script while a reader runs it as __mp_main__ (fill/dataset_runner._run_main),
# to unpickle a dataset class defined there: a loader built then is the script's own loader,
# built again in the reader because the script has no `if __name__ == "__main__":` guard.
MAIN_BEING_RUN: list[str] = []


def refuse_a_loader_in_the_scripts_import() -> None:
    """Raises where a loader is being built while a reader runs the trainer's script."""
    if MAIN_BEING_RUN:
        raise RuntimeError(f"a loader is being built while a reader runs {MAIN_BEING_RUN[-1]} to find the dataset's "
                           f"class there: the script builds its loader at import. Put the code that builds and "
                           f"iterates the loader under `if __name__ == \"__main__\":` (as multiprocessing's spawn "
                           f"needs), or define the dataset class in a module of its own")


# The trainer's own dataset objects, by their spec's token: its fillers (readers=0,
# compute_batch) use them as they are, and so do readers forked from it (DatasetSpec.forked),
# with the reader hook's argument; DatasetHandle.close removes them.
LOCAL_DATASETS: dict[str, object] = {}
LOCAL_HOOK_ARGUMENTS: dict[str, object] = {}


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A dataset as it crosses to readers: where to get it, its length, its outputs and the
    samples' structure. `pickle_fd`/`trainer_pid`: the trainer's memory file of the pickle;
    `factory`/`args`: an import path instead. `main_path`: the trainer's script, run as
    __mp_main__ where the pickle refers to __main__."""

    length: int
    outputs: tuple[DatasetOutput, ...]
    structure: dict
    name: str
    token: str  # This loader's dataset, apart from any other in the same processes.
    pickle_fd: int | None = None
    trainer_pid: int | None = None
    pickle_bytes: int = 0
    factory: str | None = None
    args: dict = dataclasses.field(default_factory=dict)
    main_path: str | None = None
    sys_path: tuple[str, ...] = ()
    # Whether the trainer imported torch: readers then import it before the first sample,
    # so that torch's generator is seeded for it too (a dataset may import torch lazily).
    torch: bool = False
    # Whether the dataset is Collated (plan/collated.py): readers collate each step's samples
    # and the outputs are the collate_fn's, not a sample's.
    collate: bool = False
    # "module:function" a reader calls once it has loaded the dataset, before its first
    # sample: function(dataset, reader (fill/dataset_runner.ReaderView), argument), the
    # argument pickled here (base64). The drop-in's get_worker_info() and worker_init_fn
    # (shmloader/torch/worker.py); the core knows nothing of what it does.
    reader_hook: str | None = None
    reader_hook_argument: str = ""
    # Readers are forks of the trainer made after this spec (readers/trainer_fork.py): they
    # take the dataset and the hook's argument from LOCAL_DATASETS and LOCAL_HOOK_ARGUMENTS
    # as the trainer had them then; nothing is pickled.
    forked: bool = False
    # Step k is filled by reader k % readers, and each step is a whole batch the dataset
    # makes itself (dataset.batch_of(step, pass seed)): an IterableDataset's, each reader's
    # batches from its own iterator (shmloader/torch/iterable.py; Ring.claim_own).
    by_reader: bool = False

    def regions(self, batch_size: int) -> tuple[Region, ...]:
        return tuple(region for output in self.outputs for region in output.regions(batch_size))

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["outputs"] = [dataclasses.asdict(output) for output in self.outputs]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> DatasetSpec:
        outputs = tuple(DatasetOutput(**{**output, "shape": tuple(output["shape"])}) for output in data["outputs"])
        return cls(**{**data, "outputs": outputs, "sys_path": tuple(data["sys_path"])})


def import_factory(path: str, args: dict):
    """The dataset that "module:function" builds with `args` (each reader calls it)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise DatasetError(f"dataset import path must be 'module:function', got {path!r}")
    try:
        target = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise DatasetError(f"dataset {path!r} cannot be imported ({error}); it must be importable by that name from "
                           f"the trainer's sys.path, which readers share") from error
    return target(**args)


def _unpicklable_attribute(dataset) -> str:
    """The first attribute of `dataset` that does not pickle, for the error message."""
    for name, value in sorted(getattr(dataset, "__dict__", {}).items()):
        try:
            pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # noqa: BLE001 (any pickling failure names the attribute)
            return f"attribute {name!r} ({type(value).__name__}: {error})"
    return "an attribute or the class itself"


class DatasetPickleError(DatasetError):
    """The dataset cannot be pickled for the readers, or pickles too large to send (the
    drop-in then forks its readers after all, as torch's DataLoader forks its workers)."""


def _pickled(dataset) -> bytes:
    try:
        data = pickle.dumps(dataset, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 (pickle raises many types)
        raise DatasetPickleError(
            f"the dataset ({type(dataset).__name__}) cannot be pickled for the readers: {_unpicklable_attribute(dataset)} "
            f"does not pickle ({type(error).__name__}: {error}). Open such resources lazily in __getitem__, or give "
            f"the dataset by import path: from_dataset('mypkg.data:make_dataset', dataset_args={{...}}) builds it in "
            f"each reader") from None
    if len(data) > PICKLE_BYTES_MAX:
        mapped = _mapped_attributes(dataset)
        if mapped:
            name, filename, nbytes = mapped[0]
            raise DatasetPickleError(
                f"the dataset pickles to {len(data) / 2**20:,.0f} MiB (more than {PICKLE_BYTES_MAX >> 20} MiB): its "
                f"attribute {name!r} is a memory-mapped array ({nbytes / 2**20:,.0f} MiB of {filename}, from "
                f"np.load(mmap_mode='r') or np.memmap), and pickle copies a mapped array's bytes, it does not keep the "
                f"mapping, so every reader would hold a copy. Keep the path in the dataset and map the file in "
                f"__getitem__ on first use (if self.array is None: self.array = np.load(path, mmap_mode='r')), or "
                f"give the dataset by import path; readers=0 (the trainer fills) sends nothing")
        raise DatasetPickleError(f"the dataset pickles to {len(data) / 2**20:,.0f} MiB (more than {PICKLE_BYTES_MAX >> 20} "
                           f"MiB), which every reader would hold again: keep its data in files it opens lazily, or give "
                           f"it by import path")
    return data


def _mapped_attributes(dataset) -> list[tuple[str, str, int]]:
    """(attribute, file, bytes) of the memory-mapped arrays among the dataset's attributes
    (and the items of a list, tuple or dict attribute), largest first."""
    found = []
    for name, value in getattr(dataset, "__dict__", {}).items():
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) \
            else [(None, value)]
        for key, item in items:
            if isinstance(item, np.ndarray):
                filename = _mapped_file(item)
                if filename is not None:
                    found.append((name if key is None else f"{name}[{key!r}]", filename, item.nbytes))
    return sorted(found, key=lambda entry: -entry[2])


def _mapped_file(array: np.ndarray) -> str | None:
    """The file an array maps (np.memmap, or a view of one), or None."""
    while array is not None:
        if isinstance(array, np.memmap):
            return str(getattr(array, "filename", None) or "a mapped file")
        base = getattr(array, "base", None)
        if isinstance(base, mmap.mmap):
            return "a mapped file"
        array = base if isinstance(base, np.ndarray) else None
    return None


def _hook_fields(reader_hook) -> dict:
    """DatasetSpec's reader_hook fields for `reader_hook` = ("module:function", argument)."""
    if reader_hook is None:
        return {}
    path, argument = reader_hook
    try:
        data = pickle.dumps(argument, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 (pickle raises many types)
        raise DatasetError(f"{argument!r:.200} (what {path} runs in each reader, worker_init_fn for the drop-in) "
                           f"cannot be pickled for the readers ({type(error).__name__}: {error}): define it at a "
                           f"module's top level (a lambda or a local function does not pickle)") from None
    return {"reader_hook": path, "reader_hook_argument": base64.b64encode(data).decode()}


def _main_path(data: bytes, dataset, spec: DatasetSpec | None = None) -> str | None:
    """The trainer's script where the dataset's pickle (or its reader hook's argument, of
    `spec`) refers to __main__, which readers then run as __mp_main__."""
    if spec is not None and spec.reader_hook_argument:
        data = data + base64.b64decode(spec.reader_hook_argument)
    if b"__main__" not in data:
        return None
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None:
        raise DatasetError(f"the dataset's class {type(dataset).__qualname__} is defined in an interactive session "
                           f"(__main__ without a file), which readers cannot import: define it in a module, or give the "
                           f"dataset by import path")
    return os.path.abspath(path)


def _write_memory_file(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view, written = memoryview(data), 0
        while written < len(data):
            written += os.write(fd, view[written:])
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_length(dataset, where: str) -> int:
    try:
        length = len(dataset)
    except TypeError:
        raise DatasetError(f"{where} has no len(): a map-style dataset needs __len__ and __getitem__ (a torch "
                           f"IterableDataset goes to shmloader.torch.DataLoader; or convert it to files with "
                           f"shmloader import)") from None
    if not isinstance(length, int) or length < 1:
        raise DatasetError(f"{where} has len() = {length!r}; expected a positive integer")
    return length


class DatasetHandle:
    """What the trainer holds for a loader's dataset until close: its object in
    LOCAL_DATASETS and the memory file of its pickle. close() is idempotent."""

    def __init__(self, spec: DatasetSpec, instance) -> None:
        self.spec = spec
        self.classes = {}  # A collate_fn's Mapping and namedtuple classes, by name (collated.rebuild).
        LOCAL_DATASETS[spec.token] = instance

    def renew(self) -> DatasetSpec:
        """Pickles the dataset again, as it is now, under a new token: readers given the new
        spec load it anew (a drop-in epoch's fresh copy, as torch's non-persistent workers
        get). Returns the spec before: the caller closes its pickle's descriptor once the
        readers have the new spec (settle), or goes back to it (revert)."""
        assert self.spec is not None and self.spec.pickle_fd is not None, "a dataset given to readers by pickle"
        before = self.spec
        instance = LOCAL_DATASETS.pop(before.token)
        try:
            data = _pickled(instance)
            fd = _write_memory_file("shmloader-dataset", data)
        except BaseException:
            LOCAL_DATASETS[before.token] = instance
            raise
        self.spec = dataclasses.replace(before, token=secrets.token_hex(8), pickle_fd=fd, pickle_bytes=len(data),
                                        main_path=_main_path(data, instance, before))
        LOCAL_DATASETS[self.spec.token] = instance
        return before

    def settle(self, before: DatasetSpec) -> None:
        """The readers have the renewed spec: the pickle before is read by none again."""
        os.close(before.pickle_fd)

    def revert(self, before: DatasetSpec) -> None:
        """Back to the spec before renew(), its pickle kept; the renewed one is closed."""
        LOCAL_DATASETS[before.token] = LOCAL_DATASETS.pop(self.spec.token)
        os.close(self.spec.pickle_fd)
        self.spec = before

    def close(self) -> None:
        LOCAL_DATASETS.pop(self.spec.token, None)
        LOCAL_HOOK_ARGUMENTS.pop(self.spec.token, None)
        fd, self.spec = (None if self.spec is None else self.spec.pickle_fd), None
        if fd is not None:
            os.close(fd)


def plan_dataset(dataset, outputs=None, dataset_args=None, *, readers: int = 1, reader_hook=None,
                 probe_view=None, share_by_fork: bool = False, seed: int = 0, fork_call=None) -> DatasetHandle:
    """The trainer's handle on the dataset, whose spec readers get. `dataset`: the object,
    or "module:function" called with `dataset_args`. The structure and shapes come from
    sample 0, or from `outputs` for the leaves it names. With readers == 0 nothing is
    pickled (the trainer uses its own object, and no reader hook runs). `reader_hook`:
    ("module:function", argument), see DatasetSpec.reader_hook. `probe_view(dataset)`: a context
    manager the probe of dataset[0] runs in, with readers (the drop-in's worker info, as
    reader 0 would see it: a __getitem__ written for workers reads it unconditionally).
    `share_by_fork`: readers will be forked from this process (DatasetSpec.forked), so
    neither the dataset nor the hook's argument is pickled, and dataset[0] is read in a fork
    made by `fork_call` (readers/fork_call.call_in_fork) where one is given and can fork.
    `seed`: the loader's, whose sample at stream position 0 the probe is seeded as."""
    if isinstance(dataset, str):
        factory, args = dataset, dict(dataset_args or {})
        instance = import_factory(factory, args)
    else:
        if dataset_args is not None:
            raise DatasetError("dataset_args goes with a dataset given by import path ('module:function')")
        factory, args, instance = None, {}, dataset
    if not hasattr(instance, "__getitem__"):
        raise DatasetError(f"the dataset ({type(instance).__name__}) has no __getitem__: a map-style dataset is "
                           f"needed (a torch IterableDataset goes to shmloader.torch.DataLoader)")
    length = check_length(instance, f"the dataset ({type(instance).__name__})")
    declared = dict(outputs or {})
    # Pickled for the readers before the probe below reads dataset[0]: a dataset that opens
    # its files or connections lazily in __getitem__ (as the readers need) would otherwise
    # carry the handle it opened for the probe into its pickle, and fail to pickle.
    forked = share_by_fork and factory is None and readers > 0
    data = _pickled(instance) if factory is None and readers > 0 and not forked else None
    # The probe leaves the trainer's own object as it was given, to be pickled again for a
    # later epoch (DatasetHandle.renew) and (readers=0) to fill the batches (plan/probe.py).
    structure, built, classes = probe(instance, length, declared, probe_view if readers > 0 else None, seed,
                                      in_fork=fork_call if forked else None, pickled=data)
    name = factory or f"{type(instance).__module__}.{type(instance).__qualname__}"
    token = secrets.token_hex(8)
    if forked and reader_hook is not None:
        LOCAL_HOOK_ARGUMENTS[token] = reader_hook[1]
        hook = {"reader_hook": reader_hook[0]}
    else:
        hook = _hook_fields(reader_hook) if readers > 0 else {}
    spec = DatasetSpec(length, tuple(built), structure, name, token, trainer_pid=os.getpid(),
                       factory=factory, args=args, sys_path=tuple(os.path.abspath(entry) for entry in sys.path),
                       torch="torch" in sys.modules, collate=isinstance(instance, Collated), forked=forked,
                       by_reader=bool(getattr(instance, "by_reader", False)), **hook)
    if factory is not None and spec.reader_hook_argument:
        spec = dataclasses.replace(spec, main_path=_main_path(b"", instance, spec))
    if data is not None:
        main_path = _main_path(data, instance, spec)
        fd = _write_memory_file("shmloader-dataset", data)
        spec = dataclasses.replace(spec, pickle_fd=fd, pickle_bytes=len(data), main_path=main_path)
    handle = DatasetHandle(spec, instance)
    handle.classes = classes
    return handle


def _named_class(name: str) -> type:
    """The namedtuple or Mapping class `name` ("module:qualname") that dataset[0] returned
    in this process, or imported by name."""
    found = _NAMED_CLASSES.get(name)
    if found is None:
        module, _, qualname = name.partition(":")
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        _NAMED_CLASSES[name] = found
    return found


def rebuild_batch(structure: dict, arrays: dict, convert=lambda array: array):
    """A batch's arrays (by leaf name) in the samples' structure: what default_collate
    makes of a list of samples (dicts of batches, tuples and lists of batches)."""
    if "dict" in structure:
        made = {key: rebuild_batch(item, arrays, convert) for key, item in structure["dict"]}
        return _as_mapping(structure["named"], made) if "named" in structure else made
    if "text" in structure:  # A str leaf: the batch's strings, as default_collate gives them.
        values, offsets = arrays[structure["text"]], arrays[f"{structure['text']}.offsets"].tolist()
        texts = [bytes(values[start:end]).decode() for start, end in zip(offsets, offsets[1:])]
        return tuple(texts) if structure.get("tuple") else texts
    if "tuple" in structure:
        items = (rebuild_batch(item, arrays, convert) for item in structure["tuple"])
        return _named_class(structure["named"])(*items) if "named" in structure else tuple(items)
    if "list" in structure:
        return [rebuild_batch(item, arrays, convert) for item in structure["list"]]
    made = convert(arrays[structure["leaf"]])
    bits = structure.get("torch_bits")  # A torch dtype numpy lacks: its bits, seen as it as tensors (TORCH_BITS).
    return made if bits is None or isinstance(made, np.ndarray) else as_torch_dtype(made, bits)


def _as_mapping(name: str, made: dict):
    """`made` as the samples' Mapping class `name`, built from a dict as default_collate
    builds an immutable one; a plain dict where the class is not built so (defaultdict). Not
    default_collate's for a MutableMapping, which copies the first sample and updates it: a
    defaultdict keeps its default_factory there, and a BatchEncoding its other attributes
    (tests/test_torch_divergences.py)."""
    try:
        return _named_class(name)(made)
    except Exception:  # noqa: BLE001 (any constructor)
        return made

"""A map-style dataset's samples written into a slot: the reader's side of plan/dataset.py.

Each reader gets the dataset once (unpickled from the trainer's memory file, or built from
its import path), then for each row of a step calls dataset[index] with Python's, numpy's
and torch's global generators seeded from (seed, the row's stream position), so that an
augmentation drawn from them gives the same sample for any reader count, shard count and
on resume (global_seeds.py: __getitem__ runs once a sample), and writes each
leaf straight into its slot region: nothing is pickled per sample.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import os
import pickle
import runpy
import sys
import types

import numpy as np

from ..plan import collated
from ..plan.dataset import LOCAL_DATASETS, LOCAL_HOOK_ARGUMENTS, MAIN_BEING_RUN, DatasetSpec, import_factory
from ..plan.dataset_outputs import DatasetError, _leaf_array, flatten, text_bytes
from ..plan.sampler import derive_seed, sample_seeds  # noqa: F401 (sample_seeds: tests import it here)
from .global_seeds import GlobalSeeds, seed_all

_SCALARS = (int, float, bool)
_MASK63 = (1 << 63) - 1
# Datasets loaded in this reader, by their spec's token: a filler's probe for bad records
# (and a reconfigured filler) uses the same object instead of unpickling it again.
_LOADED: dict[str, object] = {}
# The global generators this process's datasets draw from (global_seeds.py): learned once
# per process, as the generators are the process's.
GLOBAL_SEEDS = GlobalSeeds()


def _run_main(path: str) -> None:
    """The trainer's script as __mp_main__, aliased as __main__ (what multiprocessing's spawn
    does), so that a pickle of a class defined there finds it."""
    if getattr(sys.modules.get("__mp_main__"), "__file__", None) == path:
        return
    module = types.ModuleType("__mp_main__")
    sys.modules["__mp_main__"] = module
    MAIN_BEING_RUN.append(path)
    try:
        namespace = runpy.run_path(path, run_name="__mp_main__")
    finally:
        MAIN_BEING_RUN.pop()
    module.__dict__.update(namespace)
    sys.modules["__main__"] = module


@dataclasses.dataclass(frozen=True)
class ReaderView:
    """What a reader hook (DatasetSpec.reader_hook) is told of the reader it runs in: its
    index (0 to count - 1), the loader's local reader count, and its seed: derive_seed(the
    pass's seed, "reader", index) to 63 bits, the value Python's, numpy's and torch's
    global generators are seeded with while the hook runs. It is the pass's in which the
    reader loaded the dataset (a persistent reader keeps its first; a replaced one gets the
    pass's it started in). Samples never draw from it: each is seeded from its own stream
    position before __getitem__ (sample_seeds), whichever reader reads it."""

    index: int
    count: int
    seed: int

    @classmethod
    def of(cls, share: tuple[int, int], pass_seed: int) -> ReaderView:
        index, count = share
        return cls(index, count, derive_seed(pass_seed, "reader", index) & _MASK63)


def load_dataset(spec: DatasetSpec, reader: ReaderView | None = None):
    """The dataset for `spec`: in the trainer its own object (readers=0, compute_batch),
    elsewhere loaded once per process, and then given to the spec's reader hook (as
    `reader`) before any sample is read."""
    if spec.token in LOCAL_DATASETS and os.getpid() == spec.trainer_pid:
        return LOCAL_DATASETS[spec.token]
    if spec.token in _LOADED:
        return _LOADED[spec.token]
    sys.path.extend(entry for entry in spec.sys_path if entry not in sys.path)
    if spec.torch:
        import torch  # noqa: F401 (seeded before each sample from now on)
    if spec.main_path is not None:
        _run_main(spec.main_path)
    if spec.forked:  # This process is a fork of the trainer's, made after the spec (readers/trainer_fork.py).
        if spec.token not in LOCAL_DATASETS:
            raise DatasetError(f"the dataset {spec.name} is shared by fork, but this process (pid {os.getpid()}) was "
                               f"not forked from its trainer (pid {spec.trainer_pid}) after the loader was made")
        dataset = LOCAL_DATASETS[spec.token]
    elif spec.factory is not None:
        dataset = import_factory(spec.factory, spec.args)
    else:
        path = f"/proc/{spec.trainer_pid}/fd/{spec.pickle_fd}"
        if not os.readlink(path).startswith("/memfd:shmloader-dataset"):
            raise DatasetError(f"{path} is not the trainer's pickled dataset (is the trainer gone?)")
        with open(path, "rb") as file:
            data = file.read()
        if len(data) != spec.pickle_bytes:
            raise DatasetError(f"the trainer's pickled dataset is {len(data)} bytes, expected {spec.pickle_bytes}")
        dataset = pickle.loads(data)
    if spec.reader_hook is not None:
        _run_reader_hook(spec, dataset, ReaderView(0, 1, 0) if reader is None else reader)
    _LOADED.clear()  # A reader fills for one loader: an earlier token is its dataset of an earlier epoch.
    _LOADED[spec.token] = dataset
    return dataset


def _run_reader_hook(spec: DatasetSpec, dataset, reader: ReaderView) -> None:
    """Calls the spec's reader hook with the freshly loaded dataset, the global generators
    seeded with the reader's seed (as torch seeds a worker before its worker_init_fn)."""
    module, _, attribute = spec.reader_hook.partition(":")
    hook = importlib.import_module(module)
    for part in attribute.split("."):
        hook = getattr(hook, part)
    argument = LOCAL_HOOK_ARGUMENTS.get(spec.token) if spec.forked else \
        pickle.loads(base64.b64decode(spec.reader_hook_argument))
    seed_all(reader.seed)
    hook(dataset, reader, argument)


class DatasetRunner:
    """Fills a slot's regions from dataset[index] for a step's rows; the transform runner's
    interface (shapes, run) so that the step filler treats both alike."""

    def __init__(self, spec: DatasetSpec, batch_size: int, sampler, share: tuple[int, int] = (0, 1),
                 ring_slots: int = 0) -> None:
        self.spec, self.batch_size, self.sampler, self.ring_slots = spec, batch_size, sampler, ring_slots
        self.dataset = load_dataset(spec, ReaderView.of(share, sampler.seed))
        self.shapes = {region.name: (region.shape, np.dtype(region.dtype)) for region in spec.regions(batch_size)}
        self._outputs = {output.name: output for output in spec.outputs}
        # A Collated dataset's batch is written whole (_collate_rows); its structure is the collate's.
        self._paths = [] if spec.collate else _leaf_paths(spec.structure)
        # Leaves that take a plain write: an array of the output's shape or a Python scalar
        # into a fixed-shape output (anything else goes through _write_leaf's checks).
        self._fixed = [self._outputs[name].fixed for name, _, _ in self._paths]
        self._flat = _flat_keys(spec.structure) if self._paths else None
        self._packed = [f"{output.name}.offsets" for output in spec.outputs
                        if output.max_items is not None or output.text_bytes is not None]
        self._seeds = GLOBAL_SEEDS

    def run(self, step: int, indices: np.ndarray, sources, inputs: dict, out: dict, salt: int = 0) -> None:
        sampler = self.sampler
        if self.spec.by_reader:  # The dataset makes the step's batch itself; nothing is seeded per sample.
            collated.write(self.dataset.batch_of(step, sampler.seed, self.ring_slots), self._outputs, out,
                           f"the batch of step {step}")
            return
        # Its own stream position (a dealt tail, a shifted resume); the rows a cut step keeps come first.
        positions = sampler.row_keys(step, self.batch_size)[:len(indices)]
        names = [name for name, _, _ in self._paths]
        targets = [out[name] for name in names]
        shapes = [target.shape[1:] for target in targets]
        plain = list(zip(names, targets, shapes, self._fixed))
        rows = list(zip(indices.tolist(), sample_seeds(sampler.seed + salt, positions)))
        if hasattr(sampler, "rows_of"):  # A caller's order (plan/index_table.py): the rest of the slot is cut.
            rows = rows[:sampler.rows_of(step)]
        if self.spec.collate:
            self._seeds.fill([seed for _, seed in rows],
                             lambda seeders: self._collate_rows(step, rows, seeders, out, sampler.seed + salt))
            return
        self._seeds.fill([seed for _, seed in rows], lambda seeders: self._fill_rows(step, rows, seeders, plain, out))

    def _fill_rows(self, step: int, rows: list[tuple[int, int]], seeders: list, plain: list, out: dict) -> None:
        """Writes dataset[index] for each (index, seed) of `rows` into its row, each of
        `seeders` seeded with the row's seed first. Arrays of the output's shape and dtype
        are written as they come; Python and numpy scalars of a fixed-shape output are kept
        and written as one array a leaf once the batch's samples are read (one conversion a
        batch instead of one a sample), or row by row through the checks where that array
        does not go into the output unchanged (the checks then name the sample). The loop
        is the reader's per-sample cost beside __getitem__: what it looks up once a batch is
        bound before it (a tuple or list sample of dataset[0]'s size is its own leaves)."""
        for offsets in self._packed:  # Rows are written in order, each from where the row before it ends.
            out[offsets][0] = 0
        dataset, flat = self.dataset, self._flat
        seeder = seeders[0] if len(seeders) == 1 else lambda seed: [each(seed) for each in seeders]
        # Per leaf: the dtype an array is written with unchecked (None: every value is checked).
        leaves_of = [(name, target, shape, target.dtype if fixed else None) for name, target, shape, fixed in plain]
        written = [[] for _ in plain]  # Rows of scalar leaves, and their values, a leaf.
        values = [[] for _ in plain]
        kind, size, keys = flat if flat is not None else (None, -1, None)
        itself = kind in (tuple, list) and keys == list(range(size))
        ndarray, scalars, generic = np.ndarray, _SCALARS, np.generic
        for row, (index, seed) in enumerate(rows):
            seeder(seed)
            try:
                sample = dataset[index]
            except Exception as error:
                if hasattr(error, "add_note"):
                    error.add_note(f"in dataset[{index}] (step {step}, batch position {row})")
                raise
            if type(sample) is kind and len(sample) == size:
                leaves = sample if itself else [sample[key] for key in keys]
            else:
                named = self._leaves(index, sample)
                if len(named) != len(plain) or not named or any(
                        name != expected for (name, _), (expected, _, _, _) in zip(named, plain)):
                    self._write(index, row, named, out)  # Shaped otherwise: _write names what differs.
                    continue
                leaves = [value for _, value in named]
            for value, (name, target, shape, dtype), rows_of, values_of in zip(leaves, leaves_of, written, values):
                if dtype is not None:
                    if type(value) is ndarray:
                        if value.dtype == dtype and value.shape == shape:
                            target[row] = value
                            continue
                    elif not shape and (type(value) in scalars or isinstance(value, generic)):
                        rows_of.append(row)
                        values_of.append(value)
                        continue
                self._write_leaf(index, row, name, value, out)  # Another dtype is cast only where no value changes.
        for (name, target, _, _), rows_of, values_of in zip(plain, written, values):
            if rows_of:
                self._write_scalars(name, target, rows_of, values_of, rows, out)

    def _write_scalars(self, name: str, target: np.ndarray, written: list, values: list, rows: list, out: dict) -> None:
        try:
            array = np.asarray(values)
        except (OverflowError, ValueError, TypeError):  # An integer past 64 bits: the checks name it.
            array = None
        if array is not None and array.dtype != target.dtype:
            try:  # Cast as one array where no value changes; otherwise each row's checks name the sample.
                array = _checked_cast(array, target.dtype, f"{name!r}")
            except DatasetError:
                array = None
        if array is not None:
            if len(written) == len(rows):
                target[:len(rows)] = array
            else:
                target[written] = array
            return
        for row, value in zip(written, values):
            self._write_leaf(rows[row][0], row, name, value, out)

    def _collate_rows(self, step: int, rows: list[tuple[int, int]], seeders: list, out: dict, seed: int) -> None:
        """collate_fn of dataset[index] for each (index, seed) of `rows` (each seeded as
        without a collate), written whole into the slot (plan/collated.py). The collate runs
        with the generators seeded from (seed, "collate", step): a collate that draws (a
        masking collate) draws the same for any reader count and on resume."""
        samples = []
        for row, (index, sample_seed) in enumerate(rows):
            for seeder in seeders:
                seeder(sample_seed)
            try:
                samples.append(self.dataset[index])
            except Exception as error:
                if hasattr(error, "add_note"):
                    error.add_note(f"in dataset[{index}] (step {step}, batch position {row})")
                raise
        for seeder in seeders:
            seeder(derive_seed(seed, "collate", step))
        try:
            batch = self.dataset.collate(samples)
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note(f"in collate_fn of step {step}'s {len(samples)} samples")
            raise
        collated.write(batch, self._outputs, out, f"collate_fn's batch of step {step}")

    @property
    def collates(self) -> bool:
        """Whether a batch is one collate_fn call: a failing one has no bad record to search for."""
        return self.spec.collate

    def _leaves(self, index: int, sample) -> list[tuple[str, object]]:
        """The sample's leaves by dataset[0]'s paths (no walk of the whole structure per
        sample); a sample shaped otherwise is walked, so that the error names the leaf."""
        try:
            leaves = []
            for name, path, sizes in self._paths:
                value = sample
                for key, size in zip(path, sizes):
                    if len(value) != size:
                        raise LookupError(name)
                    value = value[key]
                leaves.append((name, value))
            return leaves
        except (LookupError, TypeError):
            pass
        return flatten(sample, f"dataset[{index}]")[1]

    def _write(self, index: int, row: int, leaves: list[tuple[str, object]], out: dict) -> None:
        """Writes a sample's `leaves` (_leaves) into row `row` of the slot, every leaf checked."""
        if len(leaves) != len(self._outputs):
            raise DatasetError(f"dataset[{index}] has leaves {[name for name, _ in leaves]}; dataset[0] had "
                               f"{list(self._outputs)}")
        for name, value in leaves:
            self._write_leaf(index, row, name, value, out)

    def _write_leaf(self, index: int, row: int, name: str, value, out: dict) -> None:
        output = self._outputs.get(name)
        if output is None:
            raise DatasetError(f"dataset[{index}] has leaf {name!r}, which dataset[0] does not have "
                               f"({list(self._outputs)})")
        if output.text_bytes is not None:
            self._write_packed(index, row, output, text_bytes(value, output, f"dataset[{index}][{name!r}]"), out)
            return
        array = _checked_cast(_leaf_array(value, f"dataset[{index}][{name!r}]"), out[name].dtype,
                              f"dataset[{index}][{name!r}]")
        target = out[name]
        if output.max_items is not None:
            self._write_packed(index, row, output, array, out)
            return
        if output.max_length is None:
            if array.shape != target.shape[1:]:
                raise DatasetError(f"dataset[{index}][{name!r}] has shape {array.shape}, where dataset[0]'s (or "
                                   f"outputs=) is {target.shape[1:]}; declare outputs={{{name!r}: "
                                   f"Ragged(max_length)}} (padded) or PackedRagged(max_items) (packed) for a varying "
                                   f"first dimension")
            target[row] = array
            return
        length = array.shape[0] if array.ndim else -1
        if array.ndim < 1 or array.shape[1:] != target.shape[2:] or length > output.max_length:
            raise DatasetError(f"dataset[{index}][{name!r}] has shape {array.shape}; its output is Ragged with "
                               f"max_length={output.max_length} and per-item shape {target.shape[2:]}")
        target[row, :length] = array
        target[row, length:] = output.pad
        out[f"{name}.lengths"][row] = length

    def _write_packed(self, index: int, row: int, output, array: np.ndarray, out: dict) -> None:
        """Writes a sample after the rows before it in a packed output and ends its offsets."""
        name, target, offsets = output.name, out[output.name], out[f"{output.name}.offsets"]
        if array.ndim < 1 or array.shape[1:] != target.shape[1:]:
            raise DatasetError(f"dataset[{index}][{name!r}] has shape {array.shape}; its output is PackedRagged with "
                               f"per-item shape {target.shape[1:]} (any length, then that shape)")
        start = int(offsets[row])
        end = start + array.shape[0]
        if end > len(target):  # The slot's capacity (max_items; more in the probe for bad records).
            raise DatasetError(f"dataset[{index}][{name!r}] has {array.shape[0]} items, which after the "
                               f"{start} items of the {row} sample(s) before it in the batch make {end}, more than "
                               f"its PackedRagged max_items={output.max_items}; raise max_items (a batch of the "
                               f"{self.batch_size} longest samples always fits)")
        target[start:end] = array
        offsets[row + 1] = end


def _checked_cast(array: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    """`array`, where its values go into an output of `dtype` unchanged; otherwise a
    DatasetError naming the leaf. numpy's assignment would cast silently: 0.37 into
    dataset[0]'s int64 as 0, -2 into uint8 as 254, 1e6 into float16 as inf, 2 into bool as
    True, 2**24 + 1 into float32 as 2**24. Taken: integers a narrower integer, float or bool
    output holds exactly (small Python ints into int32, uint8 or float32; 0 and 1 into bool);
    floats into a narrower float output, to its precision, where none overflows."""
    source, target = array.dtype.kind, dtype.kind
    if array.dtype == dtype or (np.can_cast(array.dtype, dtype, "safe") and not (source in "iu" and target in "fc")):
        return array
    what = f"{where} is {array.dtype}, its output is {dtype} (dataset[0]'s dtype, or outputs=)"
    if target in "iub" and source in "iub":
        low, high = (int(array.min()), int(array.max())) if array.size else (0, 0)
        limits = (0, 1) if target == "b" else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
        if low < limits[0] or high > limits[1]:
            raise DatasetError(f"{what}, which holds [{limits[0]}, {limits[1]}]; the sample has values from {low} "
                               f"to {high}")
        return array
    if target in "fc" and source in "iu":
        with np.errstate(over="ignore", invalid="ignore"):
            exact = np.array_equal(array.astype(dtype).astype(object), array.astype(object))
        if not exact:
            raise DatasetError(f"{what}, which does not hold every one of the sample's integers exactly (as "
                               f"{dtype} they round or overflow); declare a wider output with outputs=")
        return array
    if (target == "f" and source == "f") or (target == "c" and source in "fc"):
        with np.errstate(over="ignore", invalid="ignore"):  # The overflow is what is looked for.
            overflows = not np.array_equal(np.isfinite(array), np.isfinite(array.astype(dtype)))
        if overflows:
            raise DatasetError(f"{what}, where some of the sample's finite values overflow to infinity")
        return array
    raise DatasetError(f"{what}: the values would change ({array.dtype.kind!r} into {dtype.kind!r}); return one dtype "
                       f"for every sample, or declare the output's with outputs={{name: (shape, dtype)}}")


def _flat_keys(structure: dict) -> tuple[type, int, list] | None:
    """(container type, size, keys) where dataset[0] is one tuple, list or dict of leaves:
    a sample of that type and size has its leaves at those keys, with no walk. None otherwise."""
    for kind, container in ((tuple, "tuple"), (list, "list"), (dict, "dict")):
        items = structure.get(container)
        if items is None:
            continue
        if kind is dict:
            if all("leaf" in item for _, item in items):
                return dict, len(items), [key for key, _ in items]
        elif all("leaf" in item for item in items):
            return kind, len(items), list(range(len(items)))
    return None


def _leaf_paths(structure: dict) -> list[tuple[str, tuple, tuple]]:
    """(leaf name, keys from the sample down to it, the size of each container on the way)."""
    paths = []

    def walk(node, keys, sizes):
        if "leaf" in node:
            paths.append((node["leaf"], tuple(keys), tuple(sizes)))
        elif "dict" in node:
            for key, item in node["dict"]:
                walk(item, [*keys, key], [*sizes, len(node["dict"])])
        else:
            items = node.get("tuple", node.get("list"))
            for position, item in enumerate(items):
                walk(item, [*keys, position], [*sizes, len(items)])

    walk(structure, [], [])
    return paths

"""A map-style dataset's samples written into a slot: the reader's side of plan/dataset.py.

Each reader gets the dataset once (unpickled from the trainer's memory file, or built from
its import path), then for each row of a step calls dataset[index] with Python's, numpy's
and torch's global generators seeded from (seed, the row's stream position), so that an
augmentation drawn from them gives the same sample for any reader count, shard count and
on resume, and writes each leaf straight into its slot region: nothing is pickled per
sample.
"""

from __future__ import annotations

import os
import pickle
import random
import runpy
import sys
import types

import numpy as np

from ..plan.dataset import LOCAL_DATASETS, DatasetError, DatasetSpec, _leaf_array, flatten, import_factory
from ..plan.sampler import derive_seed
from ..transforms.core import global_positions

_MASK32 = (1 << 32) - 1
# Datasets loaded in this reader, by their spec's token: a filler's probe for bad records
# (and a reconfigured filler) uses the same object instead of unpickling it again.
_LOADED: dict[str, object] = {}


def _run_main(path: str) -> None:
    """The trainer's script as __mp_main__, aliased as __main__ (what multiprocessing's spawn
    does), so that a pickle of a class defined there finds it."""
    if getattr(sys.modules.get("__mp_main__"), "__file__", None) == path:
        return
    module = types.ModuleType("__mp_main__")
    sys.modules["__mp_main__"] = module
    namespace = runpy.run_path(path, run_name="__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = module


def load_dataset(spec: DatasetSpec):
    """The dataset for `spec`: in the trainer its own object (readers=0, compute_batch),
    elsewhere loaded once per process."""
    if spec.token in LOCAL_DATASETS and os.getpid() == spec.trainer_pid:
        return LOCAL_DATASETS[spec.token]
    if spec.token in _LOADED:
        return _LOADED[spec.token]
    sys.path.extend(entry for entry in spec.sys_path if entry not in sys.path)
    if spec.torch:
        import torch  # noqa: F401 (seeded before each sample from now on)
    if spec.factory is not None:
        dataset = import_factory(spec.factory, spec.args)
    else:
        if spec.main_path is not None:
            _run_main(spec.main_path)
        path = f"/proc/{spec.trainer_pid}/fd/{spec.pickle_fd}"
        if not os.readlink(path).startswith("/memfd:shmloader-dataset"):
            raise DatasetError(f"{path} is not the trainer's pickled dataset (is the trainer gone?)")
        with open(path, "rb") as file:
            data = file.read()
        if len(data) != spec.pickle_bytes:
            raise DatasetError(f"the trainer's pickled dataset is {len(data)} bytes, expected {spec.pickle_bytes}")
        dataset = pickle.loads(data)
    _LOADED[spec.token] = dataset
    return dataset


def _seed_globals(seed: int, position: int) -> None:
    value = derive_seed(seed, "sample", position)
    random.seed(value)
    np.random.seed(value & _MASK32)
    torch = sys.modules.get("torch")
    if torch is not None:
        # The CPU generator alone: torch.manual_seed also queues a CUDA seeding with a
        # formatted stack on every call while CUDA is not initialised (time and memory).
        torch.default_generator.manual_seed(value & ((1 << 63) - 1))


class DatasetRunner:
    """Fills a slot's regions from dataset[index] for a step's rows; the transform runner's
    interface (shapes, run) so that the step filler treats both alike."""

    def __init__(self, spec: DatasetSpec, batch_size: int, sampler) -> None:
        self.spec, self.batch_size, self.sampler = spec, batch_size, sampler
        self.dataset = load_dataset(spec)
        self.shapes = {region.name: (region.shape, np.dtype(region.dtype)) for region in spec.regions(batch_size)}
        self._outputs = {output.name: output for output in spec.outputs}
        self._paths = _leaf_paths(spec.structure)

    def run(self, step: int, indices: np.ndarray, sources, inputs: dict, out: dict, salt: int = 0) -> None:
        sampler = self.sampler
        if hasattr(sampler, "row_keys"):  # Each row's own stream position (a dealt tail, a shifted resume).
            positions = sampler.row_keys(step, len(indices))
        else:
            positions = global_positions(step, len(indices), sampler.shard_index, sampler.shard_count)
        for position_in_batch, (index, position) in enumerate(zip(indices.tolist(), positions.tolist())):
            _seed_globals(sampler.seed + salt, position)
            try:
                sample = self.dataset[index]
            except Exception as error:
                if hasattr(error, "add_note"):
                    error.add_note(f"in dataset[{index}] (step {step}, batch position {position_in_batch})")
                raise
            self._write(index, position_in_batch, sample, out)

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

    def _write(self, index: int, row: int, sample, out: dict) -> None:
        leaves = self._leaves(index, sample)
        if len(leaves) != len(self._outputs):
            raise DatasetError(f"dataset[{index}] has leaves {[name for name, _ in leaves]}; dataset[0] had "
                               f"{list(self._outputs)}")
        for name, value in leaves:
            output = self._outputs.get(name)
            if output is None:
                raise DatasetError(f"dataset[{index}] has leaf {name!r}, which dataset[0] does not have "
                                   f"({list(self._outputs)})")
            array = _leaf_array(value, f"dataset[{index}][{name!r}]")
            target = out[name]
            if output.max_length is None:
                if array.shape != target.shape[1:]:
                    raise DatasetError(f"dataset[{index}][{name!r}] has shape {array.shape}, where dataset[0]'s (or "
                                       f"outputs=) is {target.shape[1:]}; declare outputs={{{name!r}: "
                                       f"Ragged(max_length)}} for a varying first dimension")
                target[row] = array  # Casts as numpy does (an int64 scalar into int32 if declared so).
                continue
            length = array.shape[0] if array.ndim else -1
            if array.ndim < 1 or array.shape[1:] != target.shape[2:] or length > output.max_length:
                raise DatasetError(f"dataset[{index}][{name!r}] has shape {array.shape}; its output is Ragged with "
                                   f"max_length={output.max_length} and per-item shape {target.shape[2:]}")
            target[row, :length] = array
            target[row, length:] = output.pad
            out[f"{name}.lengths"][row] = length


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

"""Transforms: declaration, resolution, context and the runner (the package docstring says how
to write one). The package re-exports the public names; the loader's modules import this one."""


from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import random
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import TransformError
from ..plan.sampler import derive_seed, global_position
from ..ring.slot_layout import RESERVED_NAMES, Region

_MASK64 = (1 << 64) - 1
# Philox counters: the highest word holds the sample's position (or the step), the next one
# which stream it is, so that no two streams share a counter before 2**128 draws.
_SAMPLE_STREAM, _BATCH_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class TransformInfo:
    outputs: object  # A mapping name -> (shape, dtype), or a function of transform_args giving one.
    name: str | None


def transform(outputs, *, name: str | None = None):
    """Declares a function a transform. `outputs` maps each output's name to (shape per
    sample, dtype), e.g. {"image": ((224, 224, 3), "uint8")}, or is a function of the
    transform's keyword arguments that returns such a mapping (when the shapes depend on
    them). `name` keys the generators (default: the import path); keep it when moving
    the function, to keep its augmentations."""

    def decorate(function):
        function.__shmloader_transform__ = TransformInfo(outputs, name)
        return function

    return decorate


def name_key(name: str) -> int:
    return derive_seed(name)


def sample_rng(seed: int, position: int, name: str) -> np.random.Generator:
    """The generator of the sample at global `position` of the sampler's stream (ctx.rng)."""
    return np.random.Generator(np.random.Philox(key=[seed & _MASK64, name_key(name)],
                                                counter=[0, 0, _SAMPLE_STREAM, position & _MASK64]))


def batch_rng(seed: int, step: int, name: str) -> np.random.Generator:
    """The generator of a whole step (ctx.batch_rng): the same on every shard."""
    return np.random.Generator(np.random.Philox(key=[seed & _MASK64, name_key(name)],
                                                counter=[0, 0, _BATCH_STREAM, step & _MASK64]))


def global_positions(step: int, batch_size: int, shard_index: int, shard_count: int) -> np.ndarray:
    """Each row's position in the global stream: a step's global batch holds batch_size *
    shard_count positions and shard h takes the h-th block of batch_size (plan/sampler.py)."""
    first = global_position(step, batch_size, shard_index, shard_count)
    return np.arange(first, first + batch_size, dtype=np.uint64)


class Context:
    """What a transform knows about the batch it fills: `step`, `indices` (rows, uint64),
    `positions` (each row's global stream position; where each shard reads its own stream,
    its position there times shard_count plus the shard), `sources` (a mixture's source ids, else None),
    `seed`, `shard_index`, `shard_count`, `name`; `rng(i)` and `batch_rng`."""

    __slots__ = ("step", "indices", "positions", "sources", "seed", "shard_index", "shard_count", "name", "_batch_rng")

    def __init__(self, step: int, indices: np.ndarray, sources, seed: int, shard_index: int, shard_count: int,
                 name: str, positions: np.ndarray | None = None) -> None:
        """`positions`: the rows' keys where the sampler gives them (Sampler.row_keys: each
        shard reading its own stream), else their global positions."""
        self.step, self.indices, self.sources, self.seed, self.name = step, indices, sources, seed, name
        self.shard_index, self.shard_count = shard_index, shard_count
        self.positions = global_positions(step, len(indices), shard_index, shard_count) if positions is None else \
            positions
        self._batch_rng = None

    def rng(self, i: int) -> np.random.Generator:
        return sample_rng(self.seed, int(self.positions[i]), self.name)

    @property
    def batch_rng(self) -> np.random.Generator:
        if self._batch_rng is None:
            self._batch_rng = batch_rng(self.seed, self.step, self.name)
        return self._batch_rng


class Records(Sequence):
    """A ragged field's records of one batch: records[i] is record i, an array viewing the
    reader's buffer (reshaped to its shape for N-D records); `values` and `offsets` are the
    packed form (record i is values[offsets[i]:offsets[i+1]])."""

    __slots__ = ("values", "offsets", "shapes")

    def __init__(self, values: np.ndarray, offsets: np.ndarray, shapes: np.ndarray | None) -> None:
        self.values, self.offsets, self.shapes = values, offsets, shapes

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} of a batch of {len(self)}")
        record = self.values[int(self.offsets[i]):int(self.offsets[i + 1])]
        return record if self.shapes is None else record.reshape(tuple(int(x) for x in self.shapes[i]))


@dataclasses.dataclass(frozen=True)
class TransformSpec:
    """A transform as it crosses to readers: its import path, arguments, generator name and
    outputs (shape per sample, dtype string)."""

    path: str
    args: dict
    name: str
    outputs: tuple[tuple[str, tuple[int, ...], str], ...]

    def to_dict(self) -> dict:
        return {"path": self.path, "args": self.args, "name": self.name,
                "outputs": [[name, list(shape), dtype] for name, shape, dtype in self.outputs]}

    @classmethod
    def from_dict(cls, data: dict) -> TransformSpec:
        return cls(data["path"], data["args"], data["name"],
                   tuple((name, tuple(shape), dtype) for name, shape, dtype in data["outputs"]))

    def load(self):
        return import_transform(self.path)[0]

    def regions(self, batch_size: int) -> tuple:
        """The slot's arrays under this transform: its outputs, (batch_size, *shape) each."""
        return tuple(Region(name, (batch_size, *shape), dtype) for name, shape, dtype in self.outputs)


def _path_of(function) -> str:
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None)
    if module == "__main__":
        raise TransformError(
            f"transform {qualname or function!r} is defined in __main__ (the script being run); readers are fresh "
            f"interpreters and cannot import it from there. Move it to a module beside the script (e.g. "
            f"my_transforms.py) and pass transform='my_transforms:{qualname or 'name'}'"
        )
    if not module or not qualname or "<locals>" in qualname:
        raise TransformError(f"transform {function!r} cannot be imported by name (a lambda or a nested function?); "
                             f"define it at the top level of a module and pass 'module:function'")
    return f"{module}:{qualname}"


def import_transform(path: str):
    """(function, TransformInfo) for "module:attribute", or a TransformError saying why not."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise TransformError(f"transform must be an import path 'module:function' (e.g. 'mypkg.data:train'), got {path!r}")
    if module_name == "__main__":
        raise TransformError(f"transform {path!r}: readers are fresh interpreters and cannot import __main__; move "
                             f"the function to a module (e.g. my_transforms.py) and pass 'my_transforms:{attribute}'")
    try:
        target = importlib.import_module(module_name)
    except ImportError as error:
        raise TransformError(f"transform {path!r}: cannot import module {module_name!r} ({error}); it must be "
                             f"importable by that name from this process's sys.path, which readers share") from error
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise TransformError(f"transform {path!r}: module {module_name!r} has no attribute {attribute!r}") from None
    info = getattr(target, "__shmloader_transform__", None)
    if not callable(target) or not isinstance(info, TransformInfo):
        raise TransformError(f"transform {path!r} is not declared as one: decorate it with "
                             f"@shmloader.transform(outputs={{name: (shape, dtype), ...}})")
    return target, info


def resolve(transform_, transform_args, batch_size: int) -> TransformSpec:
    """The trainer's side: imports the transform (so an error shows at construction),
    checks its arguments and outputs."""
    path = transform_ if isinstance(transform_, str) else _path_of(transform_)
    function, info = import_transform(path)
    args = {} if transform_args is None else transform_args
    if not isinstance(args, Mapping):
        raise TransformError(f"transform_args must be a mapping of keyword arguments, got {type(args).__name__}")
    args = _lists_for_tuples(dict(args))
    try:
        if json.loads(json.dumps(args)) != args:
            raise TypeError("it changes in a JSON round trip (tuples, non-string keys)")
    except (TypeError, ValueError) as error:
        raise TransformError(f"transform_args of {path!r} must be JSON values (they cross to readers as JSON): "
                             f"{error}") from None
    try:
        inspect.signature(function).bind(None, None, None, **args)
    except TypeError as error:
        raise TransformError(f"transform {path!r} cannot be called as f(batch, out, ctx, **{args!r}): {error}") from None
    declared = info.outputs(**args) if callable(info.outputs) else info.outputs
    return TransformSpec(path, args, info.name or path, _check_outputs(path, declared))


def _lists_for_tuples(value):
    """Tuples as lists, recursively: they cross to readers as JSON, which has lists only
    (the built-in transforms' defaults are tuples, and a user passes them the same way)."""
    if isinstance(value, (tuple, list)):
        return [_lists_for_tuples(item) for item in value]
    if isinstance(value, dict):
        return {key: _lists_for_tuples(item) for key, item in value.items()}
    return value


def _check_outputs(path: str, declared) -> tuple:
    if not isinstance(declared, Mapping) or not declared:
        raise TransformError(f"transform {path!r}: outputs must be a non-empty mapping name -> (shape, dtype), "
                             f"got {declared!r}")
    checked = []
    for name, value in declared.items():
        if not isinstance(name, str) or not name or "." in name or name in RESERVED_NAMES:
            raise TransformError(f"transform {path!r}: output names must be non-empty strings without '.', not "
                                 f"{RESERVED_NAMES}; got {name!r}")
        try:
            shape, dtype = value
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            dtype = np.dtype(dtype)
        except (TypeError, ValueError):
            raise TransformError(f"transform {path!r}: output {name!r} must be (shape per sample, dtype), "
                                 f"got {value!r}") from None
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in shape) or dtype.hasobject \
                or dtype.fields is not None or dtype.subdtype is not None or dtype.itemsize == 0:
            raise TransformError(f"transform {path!r}: output {name!r} needs a shape of non-negative integers and a "
                                 f"plain numeric or bool dtype (no objects, structured fields or sub-arrays: put a "
                                 f"sub-array's shape in the output's shape), got {shape!r}, {dtype}")
        checked.append((name, shape, dtype.str))
    return tuple(checked)


def reseed_globals(seed: int, step: int, shard_index: int, salt: int = 0) -> None:
    """Seeds `random` and `np.random` from (seed, step, shard): a transform that uses them
    anyway gives the same batch on every reader and resume (check_determinism finds it)."""
    value = derive_seed(seed, step, shard_index, salt)
    random.seed(value)
    np.random.seed(value & 0xFFFFFFFF)


class TransformRunner:
    """Calls a transform for one batch and checks what it wrote: used by readers, and in
    one process by check_determinism and compute_batch."""

    def __init__(self, spec: TransformSpec, batch_size: int, sampler) -> None:
        self.spec, self.batch_size, self.sampler = spec, batch_size, sampler
        self.function = spec.load()
        self.shapes = {region.name: (region.shape, np.dtype(region.dtype)) for region in spec.regions(batch_size)}

    def run(self, step: int, indices: np.ndarray, sources, inputs: dict, out: dict, salt: int = 0) -> None:
        """Calls the transform on fresh views: `ctx.indices` and `ctx.sources` read-only (they
        are the slot's, which the trainer receives), and `out`'s arrays made read-only once
        the call returns, so that a transform that keeps them cannot change a batch after
        it is delivered (a view it derives from them and keeps is not covered: the rule in
        the module docstring still applies)."""
        sampler = self.sampler
        ctx = Context(step, _read_only(indices), None if sources is None else _read_only(sources), sampler.seed,
                      sampler.shard_index, sampler.shard_count, self.spec.name,
                      sampler.row_keys(step, len(indices)))
        reseed_globals(sampler.seed, step, sampler.shard_index, salt)
        given = {name: array.view() for name, array in out.items()}
        passed = dict(given)
        try:
            returned = self.function(inputs, given, ctx, **self.spec.args)
        except Exception as error:
            raise TransformError(f"transform {self.spec.path!r} raised {type(error).__name__} at step {step} on rows "
                                 f"{_rows_text(indices)}: {error}") from error
        finally:
            for view in passed.values():
                view.flags.writeable = False
        if returned is not None and not isinstance(returned, Mapping):
            raise TransformError(f"transform {self.spec.path!r} returned a {type(returned).__name__} at step {step}; "
                                 f"it must write into `out` and return None, or return a mapping of arrays")
        replaced = {name: array for name, array in given.items() if array is not passed.get(name)}
        for name, array in {**replaced, **(returned or {})}.items():
            self._copy_in(step, name, array, out)

    def _copy_in(self, step: int, name: str, array, out: dict) -> None:
        if name not in self.shapes:
            raise TransformError(f"transform {self.spec.path!r} gave output {name!r} at step {step}, which it does "
                                 f"not declare (declared: {sorted(self.shapes)})")
        shape, dtype = self.shapes[name]
        array = np.asarray(array)
        if array.shape != shape or array.dtype != dtype:
            raise TransformError(f"transform {self.spec.path!r}: output {name!r} at step {step} is {array.dtype} of "
                                 f"shape {array.shape}; it declares {dtype} of shape {shape}")
        out[name][...] = array


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _rows_text(indices: np.ndarray) -> str:
    shown = ", ".join(str(int(x)) for x in indices[:8])
    return f"[{shown}{', ...' if len(indices) > 8 else ''}] ({len(indices)} rows)"



"""A dataset's outputs: how each leaf of a sample (or of a collate_fn's batch) becomes a
region of the slot (DatasetOutput), with the declarations that shape it (Ragged,
PackedRagged, str fields' bytes). Apart from plan/dataset.py, which plans a dataset from
them, so that plan/collated.py builds on them without importing the planner back."""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import re

import numpy as np

from ..errors import TransformError
from ..ring.slot_layout import Region

# The region of a collate_fn's batch that holds its leaves other than arrays (plan/collated.py).
COLLATE_BESIDE = "collate.beside"
_SEPARATOR = "/"


@dataclasses.dataclass(frozen=True)
class Ragged:
    """A dataset output whose first dimension varies between samples: padded with `pad` to
    `max_length`, its length per sample in NAME.lengths (int64, as torch indexes: a mask
    `arange(n) < lengths[:, None]`, `lengths - 1`). A longer sample raises."""

    max_length: int
    pad: int | float = 0


@dataclasses.dataclass(frozen=True)
class PackedRagged:
    """A dataset output whose first dimension varies between samples, packed as Packed packs
    a file's records: NAME holds the batch's samples back to back, (max_items, *rest), and
    NAME.offsets (B+1,) says where each is: sample i is NAME[offsets[i]:offsets[i+1]] (the
    cu_seqlens convention). An item is one entry of the first dimension (an element for 1-D
    samples). A batch whose samples hold more than max_items raises, naming the sample.
    `offsets` is their dtype: "int64", or "int32" (flash-attention's cu_seqlens; max_items
    must then be under 2**31). Items past offsets[-1] are left as they were."""

    max_items: int
    offsets: str = "int64"


_OFFSETS_DTYPES = {"int64": "<i8", "int32": "<i4"}


class DatasetError(TransformError):
    """A dataset's samples do not fit the slot, or the dataset cannot reach the readers."""


# torch dtypes numpy has no type for: a tensor of one travels as its bits (the torch integer
# dtype of its width, here by name) and the trainer views the batch back as that dtype
# (as_torch_dtype), so that a bfloat16 sample comes as bfloat16, as default_collate gives it.
TORCH_BITS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def torch_bits(value) -> str | None:
    """The name of `value`'s dtype where it is a torch tensor's that travels as bits (TORCH_BITS)."""
    if not type(value).__module__.startswith("torch"):
        return None
    name = str(getattr(value, "dtype", "")).removeprefix("torch.")
    return name if name in TORCH_BITS else None


def as_torch_dtype(tensor, name: str):
    """`tensor` (the bits, TORCH_BITS) viewed as the torch dtype `name`, no copy."""
    import torch

    return tensor.view(getattr(torch, name))


def _leaf_array(value, where: str) -> np.ndarray:
    """A sample's leaf as an array (a tensor's own memory where it is on the CPU; its bits
    where numpy has no dtype for it: TORCH_BITS)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(value, np.uint8)
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        tensor = value.detach().cpu().resolve_conj().resolve_neg()  # numpy() refuses the lazy conjugate bits.
        bits = torch_bits(tensor)
        if bits is not None:
            tensor = as_torch_dtype(tensor, TORCH_BITS[bits])
        try:
            return tensor.numpy()
        except (TypeError, RuntimeError) as error:
            raise DatasetError(f"{where} is a torch tensor of {tensor.dtype}, which numpy cannot hold ({error}); "
                               f"return a dtype numpy has (float32 for bfloat16), or the tensor's bits "
                               f"(tensor.view(torch.int16)) to view back in the training step") from None
    if isinstance(value, str):
        raise DatasetError(f"{where} is a str, where dataset[0]'s is not; return one type for every sample")
    raise DatasetError(f"{where} is a {type(value).__name__}; a sample's leaves must be numpy arrays, Python "
                       f"scalars, bytes or torch tensors (in dicts, tuples or lists)")


# The namedtuple and Mapping classes (other than dict) of the samples this process has
# flattened, by "module:qualname" (a class defined in a function cannot be imported again by name).
_NAMED_CLASSES: dict[str, type] = {}


def flatten(sample, where: str = "the sample") -> tuple[object, list[tuple[str, object]]]:
    """(structure, [(leaf name, leaf value)]) of a sample, leaves in a fixed order."""
    leaves: list[tuple[str, object]] = []

    def named(node: dict, value) -> dict:
        node["named"] = f"{type(value).__module__}:{type(value).__qualname__}"
        _NAMED_CLASSES[node["named"]] = type(value)
        return node

    def walk(value, path: tuple[str, ...]):
        # Any Mapping, as default_collate takes one: a tokenizer's BatchEncoding (a UserDict)
        # and an OrderedDict come back as their class (rebuild_batch).
        if isinstance(value, collections.abc.Mapping):
            items = []
            for key, item in value.items():
                if not isinstance(key, str) or not key or "." in key or _SEPARATOR in key:
                    raise DatasetError(f"{where}: key {key!r} must be a non-empty string without '.' or '/'")
                items.append([key, walk(item, (*path, key))])
            return {"dict": items} if type(value) is dict else named({"dict": items}, value)
        if isinstance(value, (tuple, list)):
            kind = "tuple" if isinstance(value, tuple) else "list"
            node = {kind: [walk(item, (*path, str(index))) for index, item in enumerate(value)]}
            if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # A namedtuple: rebuilt as its class.
                named(node, value)
            return node
        name = _SEPARATOR.join(path) if path else "data"
        leaves.append((name, value))
        node = {"leaf": name, "scalar": not isinstance(value, (np.ndarray, bytes, bytearray, memoryview))
                and not hasattr(value, "shape")}
        bits = torch_bits(value)
        return node if bits is None else {**node, "torch_bits": bits}

    structure = walk(sample, ())
    return structure, leaves


@dataclasses.dataclass(frozen=True)
class DatasetOutput:
    """One leaf's region(s): (batch, *shape) of dtype; with max_length, padded to it; with
    max_items, packed into that many items with the batch's offsets (offsets_dtype)."""

    name: str
    shape: tuple[int, ...]  # per sample; for a ragged leaf, its shape past the first dimension
    dtype: str
    max_length: int | None = None
    pad: float = 0
    max_items: int | None = None
    offsets_dtype: str = "<i8"
    # A str leaf: each sample's UTF-8 bytes, at most text_bytes of them, packed back to back
    # (NAME, NAME.offsets), given back as a list of str (rebuild_batch), as default_collate does.
    text_bytes: int | None = None
    # A collate_fn's leaf (plan/collated.py): its elements in the slot, whatever the batch's
    # shape (`shape` is the probe's largest); BESIDE: the bytes of the batch's JSON.
    collated: int | None = None

    @property
    def fixed(self) -> bool:
        """Whether every sample has the same shape (neither padded nor packed)."""
        return self.max_length is None and self.max_items is None and self.text_bytes is None and \
            self.collated is None

    def regions(self, batch_size: int) -> tuple[Region, ...]:
        if self.collated is not None:  # A whole batch's, never cut to rows.
            if self.name == COLLATE_BESIDE:
                return (Region(self.name, (self.collated,), "|u1", "whole"),
                        Region(f"{self.name}.length", (1,), "<i8", "whole"))
            return (Region(self.name, (self.collated,), self.dtype, "whole"),)
        if self.text_bytes is not None:
            return (Region(self.name, (self.text_bytes * batch_size,), "|u1", "packed"),
                    Region(f"{self.name}.offsets", (batch_size + 1,), "<i8", "offsets"))
        if self.max_items is not None:
            return (Region(self.name, (self.max_items, *self.shape), self.dtype, "packed"),
                    Region(f"{self.name}.offsets", (batch_size + 1,), self.offsets_dtype, "offsets"))
        if self.max_length is None:
            return (Region(self.name, (batch_size, *self.shape), self.dtype),)
        return (Region(self.name, (batch_size, self.max_length, *self.shape), self.dtype),
                Region(f"{self.name}.lengths", (batch_size,), "<i8"))


def _packed_output(name: str, leaf: np.ndarray, declared: PackedRagged) -> DatasetOutput:
    items = declared.max_items
    if isinstance(items, bool) or not isinstance(items, int) or items < 1:
        raise DatasetError(f"outputs[{name!r}]: PackedRagged max_items must be a positive integer, got {items!r}")
    offsets_dtype = _OFFSETS_DTYPES.get(declared.offsets)
    if offsets_dtype is None:
        raise DatasetError(f"outputs[{name!r}]: PackedRagged offsets must be 'int64' or 'int32', got "
                           f"{declared.offsets!r}")
    if offsets_dtype == "<i4" and items >= 1 << 31:
        raise DatasetError(f"outputs[{name!r}]: int32 offsets hold under 2**31 items, but max_items is {items}; "
                           f"lower max_items or use offsets='int64'")
    if leaf.ndim < 1:
        raise DatasetError(f"outputs[{name!r}] is PackedRagged, but the first sample's {name!r} is a scalar")
    return DatasetOutput(name, tuple(leaf.shape[1:]), leaf.dtype.str, max_items=items, offsets_dtype=offsets_dtype)


# A str leaf's bytes per sample unless declared (Ragged(max_bytes)): this, or four times
# dataset[0]'s if more.
TEXT_BYTES_DEFAULT = 256


def _text_output(name: str, text: str, declared) -> DatasetOutput:
    """A str leaf's output: its UTF-8 bytes, up to Ragged(max_length)'s bytes per sample."""
    if declared is None:
        return DatasetOutput(name, (), "|u1", text_bytes=max(TEXT_BYTES_DEFAULT, 4 * len(text.encode())))
    if not isinstance(declared, Ragged) or isinstance(declared.max_length, bool) or \
            not isinstance(declared.max_length, int) or declared.max_length < 1:
        raise DatasetError(f"outputs[{name!r}]: dataset[0]'s {name!r} is a str, whose output is Ragged(max_bytes) "
                           f"(its UTF-8 bytes per sample at most), got {declared!r}")
    return DatasetOutput(name, (), "|u1", text_bytes=declared.max_length)


class TextRoomError(DatasetError):
    """A str leaf longer than its output holds (the message says which and how many bytes:
    text_room_needed reads it, also from a reader's report of it, which keeps its type)."""


# The leaf's name as text_bytes writes it, its repr: single-quoted, or double-quoted where the
# name holds a quote (a key such as "user's caption"), escapes included.
_TEXT_ROOM = re.compile(r"is a str of ([0-9]+) bytes \(UTF-8\), more than the [0-9]+ its output "
                        r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\") holds")


def text_room_needed(error: BaseException) -> dict[str, int]:
    """{str leaf: the bytes a sample of it needed} of a TextRoomError; {} for another error."""
    if not isinstance(error, TextRoomError):
        return {}
    needed = {}
    for count, name in _TEXT_ROOM.findall(str(error)):
        try:  # A reader's report is read back: a literal that is no str's repr names no leaf.
            needed[ast.literal_eval(name)] = int(count)
        except (ValueError, SyntaxError):
            continue
    return needed


def text_bytes(value, output: DatasetOutput, where: str) -> np.ndarray:
    """A str leaf's UTF-8 bytes, checked against its output's bound."""
    if not isinstance(value, str):
        raise DatasetError(f"{where} is a {type(value).__name__}, where dataset[0]'s is a str")
    data = np.frombuffer(value.encode(), np.uint8)
    if len(data) > output.text_bytes:
        raise TextRoomError(f"{where} is a str of {len(data)} bytes (UTF-8), more than the {output.text_bytes} its "
                            f"output {output.name!r} holds; declare outputs={{{output.name!r}: Ragged(max_bytes)}}")
    return data


def _output_of(name: str, leaf: np.ndarray, declared) -> DatasetOutput:
    if isinstance(declared, PackedRagged):
        return _packed_output(name, leaf, declared)
    if isinstance(declared, Ragged):
        if isinstance(declared.max_length, bool) or not isinstance(declared.max_length, int) or declared.max_length < 1:
            raise DatasetError(f"outputs[{name!r}]: Ragged max_length must be a positive integer, got "
                               f"{declared.max_length!r}")
        if leaf.ndim < 1:
            raise DatasetError(f"outputs[{name!r}] is Ragged, but the first sample's {name!r} is a scalar")
        return DatasetOutput(name, tuple(leaf.shape[1:]), leaf.dtype.str, declared.max_length, declared.pad)
    if declared is None:
        shape, dtype = leaf.shape, leaf.dtype
    else:
        try:
            shape, dtype = declared
            shape = (shape,) if isinstance(shape, int) else tuple(int(x) for x in shape)
            dtype = np.dtype(dtype)
        except (TypeError, ValueError):
            raise DatasetError(f"outputs[{name!r}] must be (shape per sample, dtype), Ragged(max_length) or "
                               f"PackedRagged(max_items), got {declared!r}") from None
    if dtype.hasobject or dtype.fields is not None or dtype.itemsize == 0:
        raise DatasetError(f"sample leaf {name!r} has dtype {dtype}; the slot takes plain numeric or bool arrays")
    return DatasetOutput(name, tuple(shape), dtype.str)

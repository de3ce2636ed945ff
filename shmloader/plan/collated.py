"""A collate_fn's batch in a slot: its arrays in regions sized by probing, its other leaves
(strings, numbers, None, bytes) as JSON beside them, and the batch rebuilt from both.

A dataset given with a collate_fn (Collated) is collated in the readers: for each step they
call dataset[index] for the step's rows (each seeded as without a collate), then
collate_fn(samples) with the global generators seeded from (seed, "collate", step), and
write what it returns into the slot (fill/dataset_runner.py). The slot holds:

    region                  shape              dtype   meaning
    LEAF (one per array)    (capacity,)        its     the leaf's elements, C order, first
                                                       prod(shape) of them this batch's
    collate.beside          (beside bytes,)    uint8   the batch as JSON (below)
    collate.beside.length   (1,)               int64   the JSON's bytes this batch

The JSON is the batch's tree: {"d": [[key, node], ...]} a dict (another Mapping carries
"type"; a dataclass "type" and "fields": its class called with them), {"t": [...]} a tuple ("type": a namedtuple's class), {"l": [...]} a list,
{"s": str}, {"i": int}, {"f": float}, {"b": bool}, null for None, {"y": base64} bytes,
{"g": numpy dtype, "v": value} a numpy scalar, {"a": LEAF, "shape": [...], "torch": bool}
an array (a torch tensor where "torch"). A class named in it is one the trainer saw in the
probe batches (the slot is foreign input: no name read from it is imported).

A leaf's capacity (elements) comes from the probe: the loader collates two batches in the
trainer (the first batch_size indices and the last whole batch's, on a copy of the dataset)
and gives a leaf whose shape both agree on exactly that many elements, any other
COLLATE_HEADROOM times the larger (padding to the batch's longest varies). `outputs=`
declares a leaf's largest shape instead ({"input_ids": (64, 1024)}), and
{"collate.beside": bytes} the JSON's room. A batch whose leaf is larger raises
CollateRoomError naming the leaf, its shape and that setting; the drop-in grows a learned
room from it (room_needed; torch/dataloader.py) and keeps a declared one.
"""

from __future__ import annotations

import ast
import base64
import collections.abc
import dataclasses
import json
import math
import re

import numpy as np

from .dataset_outputs import (COLLATE_BESIDE, TORCH_BITS, DatasetError, DatasetOutput, _leaf_array, as_torch_dtype,
                              torch_bits)
from .naming import loader_name_problem

BESIDE = COLLATE_BESIDE
# A leaf whose shape differed between the probe batches gets this many times the larger's
# elements: a padding collate's longest sample in a batch varies from batch to batch.
COLLATE_HEADROOM = 4
# The JSON's room at least (strings, numbers and the tree of a batch): a small part of a
# slot, and more than a batch of a few hundred short strings needs.
BESIDE_BYTES_MIN = 64 << 10
_SEPARATOR = "/"


class Collated:
    """A dataset with the collate_fn its batches are made with (both pickled to readers);
    `batch_size` is the slot's rows, which the probe batches take."""

    def __init__(self, dataset, collate_fn, batch_size: int) -> None:
        self.dataset, self.collate_fn, self.batch_size = dataset, collate_fn, int(batch_size)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def collate(self, samples: list):
        return self.collate_fn(samples)


# A loader whose learned room was outgrown this many times raises the room error instead.
COLLATE_GROWTHS_MAX = 8


class CollateGrowthWarning(UserWarning):
    """A collate_fn's batch outgrew the room the probe batches gave a leaf: the slot grew."""


class CollateRoomError(DatasetError):
    """A collate_fn's batch needs more room in the slot than its leaf was given (the message
    says how much: room_needed reads it, also from a reader's report of it)."""


def _error(message: str) -> Exception:
    return DatasetError(message)


def _is_tensor(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "numpy") and hasattr(value, "shape")


def encode(batch, where: str) -> tuple[dict, list[tuple[str, np.ndarray]], dict]:
    """(the batch's JSON tree, its arrays as (leaf name, array), the classes it names by
    "module:qualname") of a collate_fn's `batch`; `where` names the batch in errors."""
    arrays: list[tuple[str, np.ndarray]] = []
    classes: dict[str, type] = {}

    def named(value) -> str:
        name = f"{type(value).__module__}:{type(value).__qualname__}"
        classes[name] = type(value)
        return name

    def walk(value, path: tuple[str, ...]):
        if value is None:
            return None
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":  # Before float: np.float64 is one.
            return {"g": value.dtype.str, "v": value.item()}
        if isinstance(value, bool):
            return {"b": value}
        if isinstance(value, int):
            return {"i": int(value)}
        if isinstance(value, float):
            return {"f": float(value)}
        if isinstance(value, str):
            return {"s": value}
        if isinstance(value, (bytes, bytearray)):
            return {"y": base64.b64encode(bytes(value)).decode()}
        if isinstance(value, np.ndarray) or _is_tensor(value):
            name = _SEPARATOR.join(path) if path else "data"
            problem = loader_name_problem(name.replace(_SEPARATOR, "_"))
            if problem is not None:
                raise _error(f"{where}: the array at {name!r} {problem}; name its keys without '.'")
            array = _leaf_array(value, f"{where}[{name!r}]")
            if array.dtype.hasobject or array.dtype.fields is not None or array.dtype.itemsize == 0:
                raise _error(f"{where}[{name!r}] has dtype {array.dtype}; the slot takes plain numeric or bool arrays")
            arrays.append((name, array))
            bits = torch_bits(value)
            node = {"a": name, "shape": list(array.shape), "torch": _is_tensor(value)}
            return node if bits is None else {**node, "bits": bits}
        if isinstance(value, collections.abc.Mapping):
            node = {"d": [[walk(key, ()), walk(item, (*path, str(key)))] for key, item in value.items()]}
            if type(value) is not dict:
                node["type"] = named(value)
            return node
        if isinstance(value, tuple):
            node = {"t": [walk(item, (*path, str(index))) for index, item in enumerate(value)]}
            if hasattr(type(value), "_fields"):
                node["type"] = named(value)
            return node
        if isinstance(value, list):
            return {"l": [walk(item, (*path, str(index))) for index, item in enumerate(value)]}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            # A batch class of the collate_fn's own (a dataclass with .to(), as research code
            # writes one): its fields given to its __init__, rebuilt by calling it with them.
            names = [field.name for field in dataclasses.fields(value) if field.init]
            return {"d": [[{"s": name}, walk(getattr(value, name), (*path, name))] for name in names],
                    "type": named(value), "fields": True}
        raise _error(f"{where}: {_SEPARATOR.join(path) or 'the batch'} is a {type(value).__name__}; a collate_fn's "
                     f"batch holds arrays and tensors, str, bytes, int, float, bool and None, in dicts (Mappings), "
                     f"tuples, lists and dataclasses")

    tree = walk(batch, ())
    names = [name for name, _ in arrays]
    if len(set(names)) != len(names):
        raise _error(f"{where}: two arrays take one name among {names} (keys 1 and '1' in one dict?)")
    return tree, arrays, classes


def _capacity(name: str, probes: list[tuple[int, ...]], declared, batch_rows: list[int], batch_size: int) -> int:
    """A leaf's elements in the slot: declared (a shape or a count), else from the probes."""
    if declared is not None:
        try:
            shape = (declared,) if isinstance(declared, int) else tuple(declared)
            if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
                raise TypeError
        except TypeError:
            raise _error(f"outputs[{name!r}]: a collate_fn's leaf takes its largest shape in any batch (a tuple of "
                         f"ints) or its elements (an int), got {declared!r}") from None
        return max(1, math.prod(shape))
    largest = max(math.prod(shape) for shape in probes)
    # A probe of fewer rows than batch_size (a dataset shorter than a batch) says per row.
    rows = max(batch_rows)
    largest = math.ceil(largest * max(1, batch_size) / max(1, rows)) if rows < batch_size else largest
    agreed = len(probes) > 1 and len(set(probes)) == 1
    return max(1, largest if agreed else largest * COLLATE_HEADROOM)


def plan_collated(probe, length: int, declared: dict):
    """(outputs, structure, classes) of a Collated dataset `probe` (a copy: its samples are
    read here, unseeded): the regions of its collate's arrays and of the JSON beside them.
    The structure names the arrays and their dtypes, never a value: a checkpoint's digest of
    it matches a loader built again whatever the probe drew."""
    batch_size = probe.batch_size
    first = list(range(min(batch_size, length)))
    start = (length // batch_size - 1) * batch_size if length >= batch_size else 0
    batches = [first] + ([list(range(start, start + batch_size))] if start > 0 else [])
    made = getattr(probe, "probe_batches", None)  # A dataset that makes its batches itself (DatasetSpec.by_reader).
    probes = made() if made is not None else [(indices, None) for indices in batches]
    shapes: dict[str, list[tuple[int, ...]]] = {}
    dtypes: dict[str, np.dtype] = {}
    classes: dict[str, type] = {}
    beside_bytes = 0
    for indices, batch in probes:
        where = f"collate_fn(dataset[{indices[0]}:{indices[-1] + 1}])" if made is None else "the first batches"
        try:
            batch = probe.collate([probe[index] for index in indices]) if made is None else batch
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note(f"in {where}, which the loader collates first to lay out the slot")
            raise
        tree, arrays, seen = encode(batch, where)
        classes.update(seen)
        beside_bytes = max(beside_bytes, len(json.dumps(tree).encode()))
        for name, array in arrays:
            if dtypes.setdefault(name, array.dtype) != array.dtype:
                raise _error(f"collate_fn's leaf {name!r} is {dtypes[name]} in one probe batch, {array.dtype} in "
                             f"another: return one dtype for every batch")
            shapes.setdefault(name, []).append(tuple(array.shape))
    unknown = sorted(set(declared) - set(shapes) - {BESIDE})
    if unknown:
        raise _error(f"outputs names {unknown}, which the collate_fn's batch does not have as arrays (its arrays: "
                     f"{sorted(shapes)}; {BESIDE!r} is the room for its other leaves, in bytes)")
    rows = [max(1, len(indices)) for indices, _ in probes]
    outputs = [DatasetOutput(name, max(found, key=math.prod), dtypes[name].str,
                             collated=_capacity(name, found, declared.get(name), rows, batch_size))
               for name, found in shapes.items()]
    beside = declared.get(BESIDE)
    if beside is None:
        beside = max(BESIDE_BYTES_MIN, COLLATE_HEADROOM * beside_bytes)
    elif isinstance(beside, bool) or not isinstance(beside, int) or beside < 1:
        raise _error(f"outputs[{BESIDE!r}] is the bytes of a batch's leaves that are not arrays (as JSON): a positive "
                     f"int, got {beside!r}")
    outputs.append(DatasetOutput(BESIDE, (), "|u1", collated=beside))
    return tuple(outputs), {"collated": [[output.name, output.dtype] for output in outputs]}, classes


def write(batch, outputs: dict, out: dict, where: str) -> None:
    """Writes a collate_fn's `batch` into the slot's arrays `out` (by region name), each
    array checked against its leaf's output (`outputs`, by name) before any is written: a
    CollateRoomError names every leaf that does not fit, so that one growth fits them all."""
    tree, arrays, _ = encode(batch, where)
    data = json.dumps(tree).encode()
    too_large = []
    for name, array in arrays:
        output = outputs.get(name)
        if output is None or name == BESIDE:
            raise _error(f"{where} has an array at {name!r}, which the probe batches did not have (their arrays: "
                         f"{sorted(key for key in outputs if key != BESIDE)}): a collate_fn returns the same arrays "
                         f"for every batch")
        if array.dtype.str != output.dtype:
            raise _error(f"{where}[{name!r}] is {array.dtype}, {np.dtype(output.dtype)} in the probe batches: return "
                         f"one dtype for every batch")
        if array.size > output.collated:
            too_large.append(f"{where}[{name!r}] has shape {tuple(array.shape)} ({array.size} elements), more than "
                             f"the {output.collated} the slot holds for it (laid out from the probe batches' "
                             f"largest, {output.shape}); declare its largest shape in any batch: DataLoader(..., "
                             f"outputs={{{name!r}: (...)}})")
    room = outputs[BESIDE].collated
    if len(data) > room:
        too_large.append(f"{where}: its leaves that are not arrays take {len(data)} bytes as JSON, more than the "
                         f"{room} the slot holds for them; declare more: DataLoader(..., outputs={{{BESIDE!r}: "
                         f"bytes}})")
    if too_large:
        raise CollateRoomError("; ".join(too_large))
    for name, array in arrays:
        np.copyto(out[name][:array.size].reshape(array.shape), array, casting="no")
    out[BESIDE][:len(data)] = np.frombuffer(data, np.uint8)
    out[f"{BESIDE}.length"][0] = len(data)


# A leaf's name as write() gives it, its repr: single-quoted, or double-quoted where it holds a
# quote, escapes included (as dataset_outputs.text_room_needed reads a str leaf's).
_ARRAY_ROOM = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\] has shape \([0-9, ]*\) \(([0-9]+) elements\), "
                         r"more than the")
_BESIDE_ROOM = re.compile(r"take ([0-9]+) bytes as JSON, more than the")


def room_needed(error: BaseException) -> dict[str, int]:
    """{leaf: the elements (or bytes) it needed} of a CollateRoomError, raised here or in a
    reader (whose report keeps its type and message); {} for another error."""
    if not isinstance(error, CollateRoomError):
        return {}
    text = str(error)
    needed = {}
    for name, count in _ARRAY_ROOM.findall(text):
        try:  # A reader's report is read back: a literal that is no str's repr names no leaf.
            needed[ast.literal_eval(name)] = int(count)
        except (ValueError, SyntaxError):
            continue
    needed.update({BESIDE: int(count) for count in _BESIDE_ROOM.findall(text)[:1]})
    return needed


def rebuild(arrays, outputs: dict, classes: dict, convert, to_tensor):
    """The batch the collate_fn made, from a slot's `arrays` (by region name): its arrays
    views of the slot through `convert` (numpy) or `to_tensor` (a tensor leaf). The slot
    is foreign input: its JSON is checked as it is read, and a class is one of `classes`."""
    room = outputs[BESIDE].collated
    length = int(arrays[f"{BESIDE}.length"][0])
    if not 0 < length <= room:
        raise _error(f"the slot's {BESIDE}.length is {length}, outside 1..{room}: the slot was not written by a reader")
    try:
        tree = json.loads(bytes(arrays[BESIDE][:length]))
    except ValueError as error:
        raise _error(f"the slot's {BESIDE} is not JSON ({error}): the slot was not written by a reader") from None

    def bad(node) -> Exception:
        return _error(f"the slot's {BESIDE} holds {str(node)[:80]!r}, which is no node of a batch")

    def build(node):
        if node is None:
            return None
        if not isinstance(node, dict):
            raise bad(node)
        if "a" in node:
            output, shape = outputs.get(node["a"]), node.get("shape")
            if output is None or node["a"] == BESIDE or not isinstance(shape, list) or \
                    not all(isinstance(size, int) and size >= 0 for size in shape) or math.prod(shape) > \
                    output.collated:
                raise bad(node)
            view = arrays[node["a"]][:math.prod(shape)].reshape(shape)
            if "bits" not in node:
                return to_tensor(view) if node.get("torch") else convert(view)
            if node["bits"] not in TORCH_BITS or not node.get("torch"):
                raise bad(node)
            return as_torch_dtype(to_tensor(view), node["bits"])
        for tag, kind in (("s", str), ("i", int), ("f", float), ("b", bool)):
            if tag in node:
                value = node[tag]
                if kind is float and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                if type(value) is not kind:
                    raise bad(node)
                return value
        if "y" in node or "g" in node:
            try:
                if "y" in node:
                    return base64.b64decode(node["y"], validate=True)
                dtype = np.dtype(node["g"])
                if dtype.kind not in "biuf" or isinstance(node["v"], (dict, list)):
                    raise TypeError(dtype)
                return dtype.type(node["v"])
            except (TypeError, ValueError, OverflowError):
                raise bad(node) from None
        items = node.get("d", node.get("t", node.get("l")))
        if not isinstance(items, list):
            raise bad(node)
        cls = classes.get(node.get("type")) if "type" in node else None
        if "d" in node:
            made = {build(pair[0]): build(pair[1]) for pair in items if isinstance(pair, list) and len(pair) == 2}
            if len(made) != len(items):
                raise bad(node)
            if node.get("fields"):  # A dataclass's (encode): only a dataclass the probe saw is called.
                if cls is None and isinstance(node.get("type"), str):
                    raise _error(f"collate_fn returned a {node['type']} (a dataclass), which the probe batches did "
                                 f"not: the trainer builds only the classes it saw there; return one class of batch")
                if cls is None or not dataclasses.is_dataclass(cls) or not all(isinstance(key, str) for key in made):
                    raise bad(node)
                return cls(**made)
            return _made(cls, made, dict)
        values = [build(item) for item in items]
        if "t" in node:
            return cls(*values) if cls is not None and hasattr(cls, "_fields") else tuple(values)
        return values

    try:
        return build(tree)
    finally:
        # build refers to itself (it recurses): a reference cycle through its closure, which
        # holds `arrays`, the slot's. Unbroken, a batch the loop drops would live until the
        # cycle collector ran, and the ring would copy it out to reuse its slot.
        del build


def _made(cls, made: dict, default):
    """`made` as the Mapping class the collate_fn returned (torch's pin_memory does the
    same), or a plain dict where that class is not built from one."""
    if cls is None:
        return made
    try:
        return cls(made)
    except Exception:  # noqa: BLE001 (any constructor)
        return default(made)

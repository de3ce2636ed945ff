"""The drop-in's collation: the dataset its readers read for a collate_fn (Collated), and
the structure a batch over the slot is rebuilt in, as default_collate would have made it.

A collate_fn other than default_collate runs in the readers on each step's samples (the
global generators seeded from (seed, "collate", step)); what it returns is written into the
slot, its arrays and tensors zero copy, its other leaves (str, bytes, numbers, None) beside
them, and given back as it made them (plan/collated.py). Each array's room in the slot is
learned from two probe batches, and grows where a batch outgrows it (a CollateGrowthWarning;
the loader is built again at that step, its batches unchanged); outputs={leaf: its largest
shape} declares it instead, and a batch that outgrows a declared room fails naming the
leaf, its shape and that setting.

A leaf declared PackedRagged(max_items) in outputs= (samples whose first dimension varies,
which default_collate cannot stack) comes as {"values": the batch's samples back to back,
"offsets": (B+1,)}: sample i is values[offsets[i]:offsets[i+1]], what Packed gives for
files (NAME and NAME.offsets); one declared Ragged(max_length) comes as {"values": padded
to max_length, "lengths": (B,)}.
"""

from __future__ import annotations

from ..plan import collated


def collating(dataset, collate_fn, batch_size: int, on_error: str):
    """The dataset the loader reads: `dataset`, or with a collate_fn other than
    default_collate, Collated (the readers collate each step's samples: plan/collated.py)."""
    import torch.utils.data

    if collate_fn is None or collate_fn is torch.utils.data.default_collate:
        return dataset
    if not callable(collate_fn):
        raise TypeError(f"shmloader.torch.DataLoader: collate_fn must be callable, got {collate_fn!r}")
    if on_error != "raise":
        raise ValueError(f"shmloader.torch.DataLoader: on_error={on_error!r} replaces a bad sample in a batch, but "
                         f"with a collate_fn a batch is one call of it: give on_error='raise'")
    return collated.Collated(dataset, collate_fn, batch_size)


def collated_structure(spec) -> dict:
    """The structure a batch of the dataset `spec` describes is rebuilt in (_as_collated)."""
    beside = {output.name: "offsets" if output.max_items is not None else "lengths" for output in spec.outputs
              if output.max_items is not None or output.max_length is not None}
    beside.update({output.name: "text" for output in spec.outputs if output.text_bytes is not None})
    return _as_collated(spec.structure, beside)


def _as_collated(structure: dict, beside: dict[str, str], in_sequence: bool = False) -> dict:
    """The samples' structure as default_collate gives it back: a tuple becomes a list, a
    namedtuple stays one; a leaf in `beside` (name -> "offsets" for PackedRagged, "lengths"
    for Ragged) becomes {"values", that key}; a str leaf ("text") the batch's strings, a
    list, or a tuple inside a tuple or list (default_collate's zip of the samples)."""
    if "dict" in structure:
        node = {"dict": [[key, _as_collated(item, beside)] for key, item in structure["dict"]]}
        return {**node, "named": structure["named"]} if "named" in structure else node
    if "named" in structure:
        return {"tuple": [_as_collated(item, beside, True) for item in structure["tuple"]],
                "named": structure["named"]}
    for kind in ("tuple", "list"):
        if kind in structure:
            return {"list": [_as_collated(item, beside, True) for item in structure[kind]]}
    name = structure["leaf"]
    if beside.get(name) == "text":
        return {"text": name, "tuple": in_sequence}
    if name in beside:
        values = {"leaf": name, **({"torch_bits": structure["torch_bits"]} if "torch_bits" in structure else {})}
        return {"dict": [["values", values], [beside[name], {"leaf": f"{name}.{beside[name]}"}]]}
    return structure

"""Field names: the names a loader takes, and the one way an untrusted name (a Parquet or
Arrow column, a WebDataset member's extension) becomes a file name in an output directory.

CPython's tarfile `data_filter` is the model: a name from outside is checked against an
explicit list of what it may not be before any file is made from it, and refused with
the reason; nothing is silently rewritten into a path.
"""

from __future__ import annotations

import pathlib

from ..ring.slot_layout import RESERVED_NAMES

# A field's file is NAME plus a suffix (".ragged", ".npy") inside a directory (".ragged"
# directories hold values.b2nd): names stay well under a file system's 255 bytes.
FIELD_NAME_BYTES_MAX = 200


def loader_name_problem(name) -> str | None:
    """Why the loader would refuse `name` as a field name, or None. Its companions are
    named NAME.offsets, NAME.lengths, ..., so a '.' would make them ambiguous."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    if "." in name:
        return "holds '.' (the loader names a field's companions NAME.offsets, NAME.lengths, ...)"
    if name in RESERVED_NAMES:
        return f"is reserved (the loader's {sorted(RESERVED_NAMES)} sit beside the fields)"
    return None


def file_name_problem(name) -> str | None:
    """Why `name` cannot be both a field name and a file name in a directory, or None."""
    problem = loader_name_problem(name)
    if problem is not None:
        return problem
    if "/" in name or "\\" in name:
        return "holds a path separator"
    if any(ord(character) < 32 or ord(character) == 127 for character in name):
        return "holds a control character"
    if len(name.encode("utf-8", "surrogatepass")) > FIELD_NAME_BYTES_MAX:
        return f"is longer than {FIELD_NAME_BYTES_MAX} bytes"
    return None


def field_file(directory: pathlib.Path, name: str, suffix: str, what: str) -> pathlib.Path:
    """directory / (name + suffix), once `name` is known to stay inside `directory`; `what`
    names the name's origin in the error (e.g. "column 'x' of data.parquet")."""
    problem = file_name_problem(name)
    if problem is not None:
        raise ValueError(f"{what}: the name {name!r} {problem}; it cannot be a field. Rename it, or leave it out")
    path = directory / f"{name}{suffix}"
    # Defence in depth: whatever the checks above missed must still land in the directory.
    if path.parent != directory:
        raise ValueError(f"{what}: the name {name!r} would be written outside {directory}")
    return path

"""Loads the native parts: the Zig library (built from zig/) through cffi in ABI mode, with its
API declared in _declarations.py, and the trainer's next() (the CPython extension built from
ring/_cursor*.c). `ffi` is shared by every library the package calls (libc's mapping calls,
libblosc2)."""

from __future__ import annotations

import enum
import importlib.machinery
import os
import pathlib
import sys

from ._declarations import (
    ABI_VERSION,  # Checked against the library's shm_abi_version() at load.
)

# The slot protocol's constants and structs (ring.h) are declared from the header itself.
RING_HEADER = pathlib.Path(__file__).resolve().parent / "ring" / "ring.h"

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
LIBRARY_STEM = "_shmloader_native"
# zig translate-c writes ring.h's Zig form here at build time (setup.py); not a source.
GENERATED_ZIG_HEADER = "ring_h.zig"
REBUILD_HINT = (
    "Rebuild it from the project's root with `pip install .` (or `pip install -e .` for a "
    "development checkout); the Zig compiler comes from the PyPI package `ziglang`."
)


class NativeLibraryError(ImportError):
    """A native part is missing, stale, or built from other sources."""


def _installed_elsewhere() -> pathlib.Path | None:
    """Another `shmloader` that Python would import but for this one (an installed package
    that this checkout shadows), or None. Only looked for while an error is being raised."""
    checkout = PACKAGE_DIR.parent
    paths = []
    for entry in sys.path:
        try:
            if pathlib.Path(entry or ".").resolve() != checkout:
                paths.append(entry)
        except (OSError, RuntimeError):
            paths.append(entry)  # Unresolvable: cannot be this checkout's directory.
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec("shmloader", paths if finder is importlib.machinery.PathFinder else None)
        except Exception:
            continue  # Another library's import hook failing says nothing about shmloader.
        origin = None if spec is None else spec.origin
        if origin and pathlib.Path(origin).resolve().parent != PACKAGE_DIR:
            return pathlib.Path(origin).parent
    return None


def _fix_hint() -> str:
    """How to fix a missing or stale build. From a source checkout's root, after
    `pip install .`, the checkout (the current directory comes first on sys.path), not the
    installed package, is what `import shmloader` finds: rebuilding is not what is wrong."""
    if not (PACKAGE_DIR.parent / "zig").is_dir():
        return REBUILD_HINT
    installed = _installed_elsewhere()
    if installed is None:
        return REBUILD_HINT
    checkout = PACKAGE_DIR.parent
    try:
        from_cwd = checkout == pathlib.Path(os.getcwd()).resolve()
    except OSError:
        from_cwd = False
    why = ("from the current directory, which Python searches first" if from_cwd
           else "which comes before it on sys.path")
    return (f"The `shmloader` imported is the source checkout {PACKAGE_DIR} ({why}), not the installed "
            f"package {installed}; it is the checkout's own build that is missing or stale. Run Python from another "
            f"directory to use the installed package, or build the checkout in place with `pip install -e .` "
            f"in {checkout}.")


def library_path() -> pathlib.Path:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = PACKAGE_DIR / f"{LIBRARY_STEM}{suffix}"
        if candidate.exists():
            return candidate
    raise NativeLibraryError(
        f"shmloader's native library {LIBRARY_STEM}*.so is not in {PACKAGE_DIR}. {_fix_hint()}"
    )


def _check_fresh(path: pathlib.Path, sources: list[pathlib.Path]) -> None:
    """In a source checkout (sources beside the package), refuse a build older than its sources."""
    if not sources:
        return  # An installed wheel: no sources to compare with.
    built_ns = path.stat().st_mtime_ns
    newer = sorted(source.name for source in sources if source.stat().st_mtime_ns > built_ns)
    if newer:
        raise NativeLibraryError(
            f"{path.name} is stale: {', '.join(newer)} in {sources[0].parent} changed after "
            f"it was built. {_fix_hint()}"
        )


def zig_sources() -> list[pathlib.Path]:
    """The files the Zig library is built from, in a source checkout (none in a wheel)."""
    zig_dir = PACKAGE_DIR.parent / "zig"
    sources = [path for path in zig_dir.glob("*.zig") if path.name != GENERATED_ZIG_HEADER]
    return [*sources, RING_HEADER] if sources else []


def _generated_ffi():
    """The declarations, parsed at build time (setup.py generates _ffi.py from _declarations.py)."""
    try:
        from . import _ffi
    except ImportError as error:
        raise NativeLibraryError(
            f"shmloader._ffi, generated at build time, is missing ({error}). {_fix_hint()}") from None
    in_checkout = (PACKAGE_DIR.parent / "zig").is_dir()
    _check_fresh(pathlib.Path(_ffi.__file__), [PACKAGE_DIR / "_declarations.py", RING_HEADER] if in_checkout else [])
    return _ffi.ffi


def _load():
    ffi = _generated_ffi()
    path = library_path()
    _check_fresh(path, zig_sources())
    try:
        lib = ffi.dlopen(str(path))
    except OSError as error:
        raise NativeLibraryError(f"cannot load {path}: {error}. {_fix_hint()}") from None
    if lib.shm_abi_version() != ABI_VERSION:
        raise NativeLibraryError(
            f"{path.name} has ABI version {lib.shm_abi_version()}, this Python code expects "
            f"{ABI_VERSION}. {_fix_hint()}"
        )
    return ffi, lib


ffi, lib = _load()


def _status_enum() -> type[enum.IntEnum]:
    """zig/status.zig's codes, named by the library itself (shm_status_name), so that no
    Python copy of them can drift: OK, INVALID_LENGTH, ..."""
    names, value = [], 0
    while name := ffi.string(lib.shm_status_name(value)).decode():
        names.append((name.upper(), value))
        value += 1
    return enum.IntEnum("Status", names, module=__name__)


Status = _status_enum()


def load_cursor():
    """The CPython extension compiled from ring/_cursor*.c (the trainer's next(); readers skip it)."""
    try:
        from .ring import _cursor
    except ImportError as error:
        raise NativeLibraryError(f"cannot import shmloader.ring._cursor ({error}). {_fix_hint()}") from None
    # Only a source checkout (zig/ beside the package) has sources to compare with: an
    # installed package may carry ring/_cursor.c and ring/ring.h as data, copied after the build.
    in_checkout = (PACKAGE_DIR.parent / "zig").is_dir()
    sources = [*RING_HEADER.parent.glob("_cursor*.[ch]"), RING_HEADER]
    _check_fresh(pathlib.Path(_cursor.__file__), sources if in_checkout else [])
    return _cursor


def status_name(code: int) -> str:
    return ffi.string(lib.shm_status_name(code)).decode()


def check(status: int, what: str, error: type[Exception] = ValueError) -> None:
    """The one mapping of a native call's status to an exception: nothing for OK, else
    `error` saying "{what}: {the status's name}". `what` names what failed (the setting, the
    step, the positions); `error` is a ValueError unless the caller's domain has its own
    (a gather's StorageError: the stored data, not the call, is at fault)."""
    if status != Status.OK:
        raise error(f"{what}: {status_name(status)}")

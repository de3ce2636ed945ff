"""Writing outputs safely (the converters' side): a directory staged and renamed into
place, and the checks that an output may be written where it is asked to be."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil


@contextlib.contextmanager
def publishing(path: str | os.PathLike):
    """Yields a fresh directory beside `path` to write into; when the block ends it takes
    `path`'s place in one rename (replacing a file or directory there), and when the block
    raises it is removed: an interrupted write leaves nothing that looks finished."""
    path = pathlib.Path(path)
    temporary = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        yield temporary
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def check_output_directory(output: str | os.PathLike) -> None:
    """Raises FileNotFoundError naming `output` when its directory does not exist (writers
    stage under a hidden name beside it, whose error would name that instead)."""
    directory = os.path.dirname(os.path.abspath(os.fspath(output)))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{output}: its directory {directory} does not exist; create it first")


def check_output(output: str | os.PathLike, sources=(), force: bool = False, marker: str | None = None) -> pathlib.Path:
    """`output` as an absolute path once it is safe to write there: its directory exists;
    it is none of `sources` and holds none of them; it does not exist, or `force` is given
    and (where `marker` names one) it is an earlier output of the same kind, holding that
    file: force replaces what a writer wrote, never a directory of other files."""
    out = pathlib.Path(os.path.abspath(os.fspath(output)))
    check_output_directory(out)
    for source in sources:
        path = pathlib.Path(os.path.abspath(os.fspath(source)))
        if path == out or out in path.parents:
            raise ValueError(f"{output}: writing there would replace the source {source}; choose another output")
    if out.exists():
        if not force:
            raise FileExistsError(f"{out} exists; pass force=True (--force) to overwrite it")
        if marker is not None and (not out.is_dir() or not (out / marker).is_file()):
            raise FileExistsError(f"{out} exists and is not an earlier output of this command (no {marker} in it): "
                                  f"force replaces only such an output; remove it yourself, or choose another output")
    return out



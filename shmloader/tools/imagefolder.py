"""`shmloader convert-images DIR OUT`: an ImageFolder directory (one subdirectory per class)
as a ragged field of the files' bytes, unchanged, plus labels and image sizes."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np

from ..errors import StorageError
from ..plan.defaults import usable_cores
from ..storage.image_headers import check_pixels, image_size
from .output import check_output_directory

# The extensions torchvision's ImageFolder takes, compared case-insensitively.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
def list_images(directory: str | os.PathLike) -> tuple[list[str], list[tuple[pathlib.Path, int]]]:
    """Class names (sorted subdirectory names) and (file, label) pairs in sorted order."""
    root = pathlib.Path(directory)
    if root.is_file():
        raise StorageError(f"{root} is a file; expected a directory of class subdirectories (DIR/CLASS/IMAGE, the "
                           f"ImageFolder layout)")
    if not root.is_dir():
        raise FileNotFoundError(f"image directory {root} does not exist")
    classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    if not classes:
        raise StorageError(f"{root}: no class subdirectories; expected DIR/CLASS/IMAGE files (the ImageFolder layout)")
    files = []
    for label, name in enumerate(classes):
        for path in sorted((root / name).rglob("*")):
            if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS:
                files.append((path, label))
    if not files:
        raise StorageError(f"{root}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in its class subdirectories")
    return classes, files


def convert_images(directory: str | os.PathLike, output: str | os.PathLike, *, force: bool = False,
                   progress: bool = True, skip_bad: bool = False, skip=()) -> dict[str, str]:
    """Writes OUTPUT.image (a ragged uint8 field: each file's bytes, unchanged, stored
    uncompressed since JPEG and PNG are compressed already), OUTPUT.label (int64, the
    class index), OUTPUT.size (uint32 (height, width) from each header), OUTPUT.path (a
    ragged uint8 field: each file's absolute path in UTF-8, which errors about a record
    name) and OUTPUT.classes.json (class names by index, the files in order, and those
    skipped). Deterministic: classes and files in sorted order. A file that cannot be read,
    is empty or has no readable image header stops the conversion naming it, unless
    `skip_bad`: then it is left out and listed under "skipped" (with its reason), as are
    the paths in `skip` (e.g. those check_images found). Returns the paths by name."""
    check_output_directory(output)
    from tqdm import tqdm

    from .convert import write_ragged

    classes, files = list_images(directory)
    output = pathlib.Path(output)
    paths = {"image": f"{output}.image", "label": f"{output}.label", "size": f"{output}.size",
             "path": f"{output}.path", "classes": f"{output}.classes.json"}
    existing = [path for path in paths.values() if os.path.exists(path)]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists; pass force=True (--force) to overwrite")
    excluded = {str(path) for path in skip}
    kept, sizes, skipped = [], [], [(str(path), "did not decode") for path, _ in files if str(path) in excluded]
    bar = tqdm(total=len(files), desc=f"convert-images {pathlib.Path(directory).name}", unit="img",
               disable=not progress, leave=False)

    def read(path: pathlib.Path) -> tuple[bytes, int, int]:
        try:
            data = path.read_bytes()
        except OSError as error:
            raise StorageError(f"{path}: cannot be read ({error.strerror or error})") from None
        if not data:
            raise StorageError(f"{path}: an empty file")
        height, width = image_size(data, str(path))
        check_pixels(height, width, str(path))
        return data, height, width

    def records():
        for path, label in files:
            bar.update(1)
            if str(path) in excluded:
                continue
            try:
                data, height, width = read(path)
            except StorageError as error:
                if not skip_bad:
                    raise StorageError(f"{error}; convert with skip_bad=True (--skip-bad) to leave such files "
                                       f"out") from None
                skipped.append((str(path), str(error)))
                continue
            kept.append((path, label))
            sizes.append((height, width))
            yield np.frombuffer(data, dtype=np.uint8)

    try:
        write_ragged(paths["image"], records(), codec="none", force=force)
    except ValueError as error:
        if kept or not skipped or isinstance(error, StorageError):
            raise
        raise StorageError(f"{directory}: no image could be read ({len(skipped)} skipped)") from error
    finally:
        bar.close()
    _save_npy(paths["label"], np.array([label for _, label in kept], dtype=np.int64))
    _save_npy(paths["size"], np.array(sizes, dtype=np.uint32).reshape(len(kept), 2))
    write_ragged(paths["path"], (np.frombuffer(str(path.resolve()).encode(), dtype=np.uint8) for path, _ in kept),
                 codec="lz4", force=force)
    root = pathlib.Path(directory)
    with open(paths["classes"], "w") as handle:
        json.dump({"classes": classes, "files": [str(path.relative_to(root)) for path, _ in kept],
                   "skipped": [{"file": name, "reason": reason} for name, reason in skipped]}, handle)
    return paths


def _save_npy(path: str, array: np.ndarray) -> None:
    """np.save under exactly this name (np.save would append .npy), written atomically."""
    temporary = f"{path}.partial-{os.getpid()}"
    with open(temporary, "wb") as handle:
        np.save(handle, array)
    os.replace(temporary, path)


def _decode_error(path: str) -> str | None:
    """Why Pillow cannot decode the image at `path` entirely, or None."""
    try:
        from PIL import Image

        with Image.open(path) as image:
            image.load()
        return None
    except Exception as error:  # Any failure to decode is what the check reports.
        return f"{type(error).__name__}: {error}"


def check_images(directory: str | os.PathLike, workers: int | None = None, progress: bool = True) -> list[tuple[str, str]]:
    """Decodes every image of an ImageFolder tree once, in `workers` processes (default:
    the cores), and returns (path, error) for each that does not decode, in file order:
    what convert-images' header reads cannot see (a truncated or corrupt body)."""
    import concurrent.futures

    from tqdm import tqdm

    _, files = list_images(directory)
    names = [str(path) for path, _ in files]
    workers = workers or usable_cores()
    bad = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        results = pool.map(_decode_error, names, chunksize=64)
        for name, error in tqdm(zip(names, results), total=len(names), desc="check images", unit="img",
                                disable=not progress, leave=False):
            if error is not None:
                bad.append((name, error))
    return bad

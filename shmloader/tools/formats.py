"""The formats users have, in: Parquet files and Arrow tables (a Hugging Face `datasets.Dataset`
is one, read through its indices mapping), column by column (columns.py), into the fields
ShmDataLoader reads. WebDataset tar shards: webdataset.py.

Each column becomes a field in the output directory OUT:

    scalars (integers, floats, bool)            OUT/<column>.npy, (rows,)
    fixed-size lists, nested ones too,          OUT/<column>.npy, (rows, *shape)
      Hugging Face Array2D..5D, and list
      columns named in fixed= (one length)
    variable-length lists of numbers (tokens)   OUT/<column>.ragged (Packed / Padded)
    strings and binaries                        OUT/<column>.ragged of uint8 bytes
    dictionary (pandas category)                as its decoded values
    timestamp, date, time, duration             OUT/<column>.npy of int64 (unit in columns.json)
    Hugging Face Image()                        OUT/<column>.ragged (encoded bytes, what the
                                                image transforms read) and OUT/<column>_path.ragged
    Hugging Face ClassLabel                     int64, its names in OUT/classes.json

OUT/columns.json describes every field (its column, Arrow type, file, unit, class names,
and "one_length" for a list column whose lists all have one length: fixed= would store it
as an (N, length) array) and the columns skipped. Decimals and other types with no exact
field form are refused naming the column, or skipped with skip_unsupported=True.

An Image() (or any struct<bytes, path>) row with no bytes but a path is read from that
file only under the directory the caller names, image_root= (--image-root; a relative
path is taken relative to it): the path, resolved, must stay under it (no `..`, no
symlink out of it), name a regular file (never a FIFO, a device or a directory) and hold
at most IMAGE_FILE_BYTES_MAX bytes; anything else is refused naming the row and the path.
So an import reads only what it was given, never a local file a dataset merely names.
Class labels (ClassLabel, and lists of them) must lie in -1 .. names - 1, as in datasets.

(Over the package's ~450 lines per module: the table above is one dispatch over Arrow's
types, and the columns' own conversions already live in columns.py.)

A null is refused naming the column and the row, unless `nulls` maps the column to a
value (for scalars and list items) or to "empty" (for lists, strings and binaries). The
import streams: one column of one record batch (a Parquet row group, an Arrow chunk) is
in memory at a time, and columns are written by several threads (pyarrow and Blosc2 work
without the GIL). It is atomic: everything is written under OUT.partial-PID and renamed to
OUT at the end, so an interrupted import leaves nothing that looks finished.
"""

from __future__ import annotations

import concurrent.futures
import glob as globbing
import os
import pathlib
import stat
import threading

import numpy as np

from ..errors import StorageError
from ..plan.defaults import usable_cores
from ..plan.naming import file_name_problem
from .columns import check_columns, column_form, with_options, write_column
from .output import check_output, publishing


# An image an Image() row names by path alone is read only if it holds at most this many
# bytes, so that a path to a huge or endless file cannot fill memory; the largest images
# of public datasets hold tens of MiB. Set shmloader.tools.formats.IMAGE_FILE_BYTES_MAX
# for larger ones.
IMAGE_FILE_BYTES_MAX = 256 << 20


def from_parquet(paths, out, *, columns=None, nulls=None, fixed=None, skip_unsupported: bool = False,
                 force: bool = False, progress: bool = True, threads: int | None = None,
                 image_root=None) -> dict[str, str]:
    """Imports Parquet file(s) (a path, a list or a glob; rows in that order) into OUT;
    returns {column: path} for ShmDataLoader (wrap list columns in Packed or Padded).
    image_root: the directory under which images stored by path alone are read (none
    are read without it)."""
    import pyarrow.parquet as pq

    files = expand_sources(paths)
    opened = []
    for path in files:
        try:
            opened.append(pq.ParquetFile(path))
        except Exception as error:  # pyarrow's errors name no file.
            raise StorageError(f"{path}: not a readable Parquet file ({one_line(error)})") from None
    schema = opened[0].schema_arrow
    features = _hugging_face_features(schema)
    for path, parquet in zip(files[1:], opened[1:]):
        if not parquet.schema_arrow.equals(schema):
            raise StorageError(f"{path}: its schema differs from {files[0]}'s; every file of an import must match")
        theirs = _hugging_face_features(parquet.schema_arrow)
        if theirs != features:  # ClassLabel names, say: codes that would be read with another file's names.
            changed = sorted(name for name in set(features) | set(theirs) if features.get(name) != theirs.get(name))
            raise StorageError(f"{path}: its Hugging Face features differ from {files[0]}'s for {changed} (e.g. "
                               f"other ClassLabel names); every file of an import must match")

    def batches(column):
        # Columns are written by threads of their own, and each opens its own readers: one
        # ParquetFile read from two threads at once deadlocked now and then (a suite hung
        # in read_row_group). The threads are the parallelism: Arrow's own pool stays out.
        for path in files:
            parquet = pq.ParquetFile(path)
            try:
                for group in range(parquet.num_row_groups):
                    try:
                        table = parquet.read_row_group(group, columns=[column], use_threads=False)
                    except Exception as error:
                        raise _read_error(path, parquet, group, column, error) from None
                    yield from table.column(0).chunks
            finally:
                parquet.close()

    rows = sum(parquet.metadata.num_rows for parquet in opened)
    return _import(schema, batches, rows, out, columns, nulls, force, progress, threads, fixed, skip_unsupported,
                   files, image_root)


# The first pyarrow that reads a null row of a fixed-size list column from Parquet; those
# before fail in their own cast ("Expected all lists to be of size=3 but index 2 had size=0").
_PYARROW_READS_NULL_FIXED_LISTS = 26


def _read_error(path, parquet, group: int, column: str, error: Exception) -> StorageError:
    """What a row group's column that pyarrow could not read says: where a pyarrow before
    _PYARROW_READS_NULL_FIXED_LISTS fails on a fixed-size list column whose row group holds
    nulls (its statistics count them), the import's own "is null" error, as a newer pyarrow
    gives once it reads the rows; else pyarrow's error, with the file, row group and column."""
    import pyarrow as pa

    where = f"{path}: row group {group}, column {column!r}"
    field_type = parquet.schema_arrow.field(column).type
    major = int(pa.__version__.split(".")[0])
    if major < _PYARROW_READS_NULL_FIXED_LISTS and pa.types.is_fixed_size_list(field_type):
        metadata = parquet.metadata.row_group(group)
        leaves = [metadata.column(index) for index in range(metadata.num_columns)
                  if metadata.column(index).path_in_schema.split(".")[0] == column]
        counts = [leaf.statistics.null_count for leaf in leaves
                  if leaf.statistics is not None and leaf.statistics.has_null_count]
        if len(counts) < len(leaves) or sum(counts) > 0:
            return StorageError(
                f"{where}: a row or item is null ({sum(counts) or 'an unknown number of'} null values in the row "
                f"group), and pyarrow {pa.__version__} cannot read a null row of a fixed-size list column "
                f"({one_line(error)}); pyarrow>={_PYARROW_READS_NULL_FIXED_LISTS} reads it (then give nulls={{"
                f"{column!r}: value}} to fill it), or drop those rows")
    return StorageError(f"{where}: {one_line(error)}")


def from_arrow(table, out, *, columns=None, nulls=None, fixed=None, skip_unsupported: bool = False,
               force: bool = False, progress: bool = True, threads: int | None = None,
               image_root=None) -> dict[str, str]:
    """Imports an Arrow table (or a RecordBatchReader, or a Hugging Face `datasets.Dataset`)
    into OUT; returns {column: path}. A Dataset is read through its indices mapping, so
    that `select`, `shuffle`, `filter` and `train_test_split` give their own rows in their
    own order (not the table they share underneath). image_root: the directory under
    which images stored by path alone are read (none are read without it)."""
    import pyarrow as pa

    if _is_hugging_face_dict(table):
        raise TypeError(f"from_arrow takes one split, got a DatasetDict of splits {sorted(table)}; pass one of them, "
                        f"e.g. dataset[{sorted(table)[0]!r}]")
    if _is_hugging_face_dataset(table):
        return _import(table.data.schema, _hugging_face_batches(table), table.num_rows, out, columns, nulls, force,
                       progress, threads, fixed, skip_unsupported, image_root=image_root)
    if isinstance(table, pa.RecordBatchReader):
        table = table.read_all()  # A stream is read once: its batches must be held to go column by column.
    if not isinstance(table, pa.Table):
        raise TypeError(f"from_arrow takes a pyarrow Table, RecordBatchReader or datasets.Dataset, got "
                        f"{type(table).__name__}")
    return _import(table.schema, lambda column: iter(table.column(column).chunks), table.num_rows, out, columns,
                   nulls, force, progress, threads, fixed, skip_unsupported, image_root=image_root)


# A Hugging Face dataset with an indices mapping is read this many rows at a time (each
# piece is gathered by Arrow's take into one column of that many rows).
_HUGGING_FACE_BATCH_ROWS = 1 << 16


def _is_hugging_face_dataset(value) -> bool:
    return type(value).__module__.startswith("datasets.") and hasattr(value, "with_format") \
        and hasattr(value, "num_rows") and hasattr(value, "data")


def _is_hugging_face_dict(value) -> bool:
    return type(value).__module__.startswith("datasets.") and type(value).__name__.endswith("DatasetDict")


def _hugging_face_batches(dataset):
    """A column's Arrow chunks of a Dataset, its rows in the dataset's own order: through
    the public Arrow view, which applies the indices mapping a select/shuffle/filter/split
    left (the underlying table holds every row of the parent, in storage order)."""
    arrow = dataset.with_format("arrow")

    def batches(column):
        view = arrow.select_columns([column])
        for start in range(0, dataset.num_rows, _HUGGING_FACE_BATCH_ROWS):
            yield from view[start:start + _HUGGING_FACE_BATCH_ROWS].column(0).chunks

    return batches


def one_line(error: Exception) -> str:
    """A library's message on one line (pyarrow's carry the C++ call site on the next)."""
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip())


def expand_sources(paths) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        path = os.fspath(paths)
        found = sorted(globbing.glob(path)) if globbing.has_magic(path) else [path]
    else:
        found = [os.fspath(path) for path in paths]
    if not found:
        raise FileNotFoundError(f"no Parquet file matches {paths}")
    for path in found:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file")
    return found


def _import(schema, batches, rows: int, out, columns, nulls, force: bool, progress: bool, threads,
            fixed=None, skip_unsupported: bool = False, sources=(), image_root=None) -> dict[str, str]:
    out = check_output(out, sources, force, COLUMNS_FILE)
    image_root = _check_image_root(image_root)
    names = check_columns(schema, columns)
    fixed = set(fixed or ())
    unknown = sorted(fixed - set(names))
    if unknown:
        raise StorageError(f"fixed= names {unknown}, which are not imported columns (imported: {names})")
    features = _hugging_face_features(schema)
    nulls = dict(nulls or {})
    outputs, skipped, plans = [], {}, {}
    for name in names:
        try:  # What a column's type allows: a column without a field form may be skipped.
            found = _outputs_of(name, schema.field(name).type, features.get(name, {}), name in fixed, image_root)
            forms = [column_form(output.field, output.arrow_type, nulls.get(output.field)) for output in found]
        except StorageError as error:
            if not skip_unsupported:
                raise StorageError(f"{error}; or skip such columns with skip_unsupported=True (--skip-columns)") \
                    from None
            skipped[name] = str(error)
            continue
        for output, form in zip(found, forms):
            plans[output.field] = with_options(output.field, output.arrow_type, form, nulls.get(output.field),
                                                output.fixed)
        outputs += found
    if not outputs:
        raise StorageError(f"no column can be imported (skipped: {skipped})")
    fields = [output.field for output in outputs]
    for output in outputs:
        if fields.count(output.field) > 1:
            raise StorageError(f"column {output.column!r} would write the field {output.field!r}, which another "
                               f"column writes too; rename one of them")
        problem = file_name_problem(output.field)
        if problem is not None:
            raise StorageError(f"column {output.column!r}: its field name {output.field!r} {problem}")
    unknown = sorted(set(nulls) - set(fields))
    if unknown:
        why = "; ".join(f"{name!r} was skipped: {skipped[name]}" for name in unknown if name in skipped)
        raise StorageError(f"nulls= names {unknown}, which are not imported columns (imported: {fields})"
                           f"{'; ' + why if why else ''}")
    if rows == 0:
        raise StorageError(f"{out}: the source has no rows; a field needs at least one")
    from tqdm import tqdm

    with publishing(out) as temporary:
        bar = tqdm(total=rows * len(outputs), desc=f"import {out.name}", unit="value", disable=not progress,
                   leave=False)
        try:
            shared = _SharedProgress(bar)
            workers = threads or min(len(outputs), usable_cores())
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                futures = {output.field: pool.submit(write_column, temporary, output.field, plans[output.field],
                                                     map(output.extract, batches(output.column)), rows, shared)
                           for output in outputs}
                written = {field: future.result() for field, future in futures.items()}
            _write_description(temporary, outputs, written, skipped)
        except BaseException:
            bar.close()  # Cleared where it stood: an import that failed shows no finished bar.
            raise
        # Finished: the bar shown, and left, at 100% (a bar cleared where its last refresh
        # left it read as an import stuck at 5%). Where a file's metadata miscounted its
        # rows, the values written are the total.
        bar.total = max(bar.n, 1)
        bar.leave = True
        bar.close()
    return {field: str(out / written[field][0]) for field in fields}


class _SharedProgress:
    """The import's bar, advanced by every column's thread: tqdm's update is no atomic
    step (it adds, then maybe refreshes), so without the lock a count could be lost."""

    def __init__(self, bar) -> None:
        self._bar, self._lock = bar, threading.Lock()

    def update(self, count: int) -> None:
        with self._lock:
            self._bar.update(count)


# What an import writes beside its fields: every field's column, Arrow type, file and
# notes (time units, class names, one length throughout), and the columns it skipped.
COLUMNS_FILE = "columns.json"
# Class names of Hugging Face ClassLabel columns, {column: [name of class 0, ...]}.
CLASSES_FILE = "classes.json"


def _write_description(directory: pathlib.Path, outputs, written: dict, skipped: dict) -> None:
    import json

    described = {}
    for output in outputs:
        file, notes = written[output.field]
        described[output.field] = {"column": output.column, "arrow_type": output.source_type, "file": file,
                                   **output.notes, **notes}
    with open(directory / COLUMNS_FILE, "w") as handle:
        json.dump({"fields": described, "skipped": skipped}, handle, indent=1)
    classes = {output.field: output.notes["classes"] for output in outputs if "classes" in output.notes}
    if classes:
        with open(directory / CLASSES_FILE, "w") as handle:
            json.dump(classes, handle, indent=1)


class _Output:
    """One field an import writes: from which column, how each chunk of that column
    becomes the array written (`extract`), its Arrow type then, and notes for columns.json."""

    def __init__(self, field: str, column: str, arrow_type, extract, source_type, notes=None, fixed=False) -> None:
        self.field, self.column, self.arrow_type, self.extract = field, column, arrow_type, extract
        self.source_type, self.notes, self.fixed = str(source_type), dict(notes or {}), fixed


def _hugging_face_features(schema) -> dict:
    """{column: feature} from the Hugging Face metadata an Arrow or Parquet schema carries
    (datasets writes it), or {}."""
    import json

    metadata = schema.metadata or {}
    try:
        info = json.loads(metadata.get(b"huggingface", b"{}"))
    except ValueError:
        return {}
    features = info.get("info", {}).get("features", {})
    return features if isinstance(features, dict) else {}


def _identity(chunk):
    return chunk


def _outputs_of(name: str, arrow_type, feature: dict, fixed: bool, image_root: str | None) -> list[_Output]:
    """The fields a column becomes (_outputs_of_column), class labels checked against
    their names as they are read."""
    outputs = _outputs_of_column(name, arrow_type, feature, fixed, image_root)
    for output in outputs:
        if "classes" in output.notes:
            output.extract = _RowCounted(lambda chunk, first_row, extract=output.extract, count=len(
                output.notes["classes"]): _check_class_labels(name, extract(chunk), first_row, count))
    return outputs


class _RowCounted:
    """A column's extract that is told the first row of each chunk: a column's chunks come
    in order, read by one thread, so a count of the rows passed is that row."""

    def __init__(self, extract) -> None:
        self._extract, self._first_row = extract, 0

    def __call__(self, chunk):
        result = self._extract(chunk, self._first_row)
        self._first_row += len(chunk)
        return result


def _check_class_labels(name: str, chunk, first_row: int, count: int):
    """A chunk of class labels (or lists of them), refused naming the row of the first
    label outside -1 .. count - 1 (datasets' ClassLabel range; -1 is its "no label")."""
    import pyarrow.compute as pc
    import pyarrow.types as types

    values, parents = chunk, None  # parents: each value's row in the chunk, through every list level.
    while types.is_list(values.type) or types.is_large_list(values.type) or types.is_fixed_size_list(values.type):
        level = pc.list_parent_indices(values)
        values = pc.list_flatten(values)
        parents = level if parents is None else pc.take(parents, level)
    if not types.is_integer(values.type) or len(values) == 0:
        return chunk
    labels = np.asarray(pc.fill_null(values, 0).to_numpy(zero_copy_only=False))
    outside = labels >= count
    if labels.dtype.kind == "i":
        outside |= labels < -1
    bad = np.flatnonzero(outside)
    if bad.size:
        index = int(bad[0])
        row = first_row + (index if parents is None else int(parents[index].as_py()))
        raise StorageError(f"column {name!r}: row {row} holds the class label {int(labels[index]):,}, outside its "
                           f"{count} names (a ClassLabel takes 0 .. {count - 1}, or -1 for no label); correct the "
                           f"labels, or the names in the dataset's features")
    return chunk


def _outputs_of_column(name: str, arrow_type, feature: dict, fixed: bool, image_root: str | None) -> list[_Output]:
    """The fields a column becomes: itself, or (a Hugging Face Image) its bytes and path;
    extension, dictionary and time types as their storage, decoded values or integers."""
    import pyarrow as pa

    source_type = arrow_type
    notes = {}
    label = feature
    while isinstance(label, dict) and label.get("_type") in ("Sequence", "List", "LargeList"):
        label = label.get("feature")  # A list of class labels: the names are its items'.
    if isinstance(label, dict) and label.get("_type") == "ClassLabel" and isinstance(label.get("names"), list):
        notes["classes"] = [str(name) for name in label["names"]]
    if isinstance(arrow_type, pa.ExtensionType):
        shape = getattr(arrow_type, "shape", None)
        value_type = getattr(arrow_type, "value_type", None)
        if shape is not None and value_type is not None:  # Hugging Face Array2D .. Array5D: a fixed shape.
            target = _array_type(name, shape, value_type)
            return [_Output(name, name, target, lambda chunk, target=target: _cast_shape(name, chunk.storage, target),
                            source_type, notes)]
        return _outputs_of_storage(name, arrow_type.storage_type, lambda chunk: chunk.storage, source_type, notes,
                                   feature, fixed, image_root)
    if str(feature.get("_type", "")).startswith("Array") and "shape" in feature and "dtype" in feature:
        # The same, from a file's metadata where datasets has not registered its extension type.
        target = _array_type(name, feature["shape"], feature["dtype"])
        return [_Output(name, name, target, lambda chunk, target=target: _cast_shape(name, chunk, target),
                        source_type, notes)]
    return _outputs_of_storage(name, arrow_type, _identity, source_type, notes, feature, fixed, image_root)


def _array_type(name: str, shape, value_type):
    """The nested fixed-size list type of a Hugging Face ArrayND of `shape`."""
    import pyarrow as pa

    if any(extent is None for extent in shape):
        raise StorageError(f"column {name!r}: an array feature of shape {tuple(shape)} has a variable dimension, which "
                           f"has no fixed field form (not supported yet); give it a fixed shape, or store it as "
                           f"flat lists (a ragged field)")
    try:
        target = pa.from_numpy_dtype(np.dtype(value_type)) if isinstance(value_type, str) else value_type
    except TypeError:
        raise StorageError(f"column {name!r}: array dtype {value_type!r} has no field form") from None
    for extent in reversed(tuple(shape)):
        target = pa.list_(target, int(extent))
    return target


def _outputs_of_storage(name, arrow_type, first, source_type, notes, feature, fixed, image_root) -> list[_Output]:
    import pyarrow as pa
    import pyarrow.types as types

    if types.is_dictionary(arrow_type):  # pandas' category: the values, decoded.
        return _outputs_of_storage(name, arrow_type.value_type, lambda chunk: first(chunk).dictionary_decode(),
                                   source_type, notes, feature, fixed, image_root)
    if types.is_timestamp(arrow_type) or types.is_date(arrow_type) or types.is_time(arrow_type) \
            or types.is_duration(arrow_type):
        width = arrow_type.bit_width
        integer = pa.int32() if width == 32 else pa.int64()
        return [_Output(name, name, pa.int64(), lambda chunk: first(chunk).view(integer).cast(pa.int64()),
                        source_type, {**notes, "unit": str(arrow_type), "stored_as": "int64"})]
    if types.is_decimal(arrow_type):
        raise StorageError(f"column {name!r}: {arrow_type} has no exact field form; cast it first (to float64, or to "
                           f"int64 in units of 10**-{arrow_type.scale})")
    if types.is_struct(arrow_type) and _image_struct(arrow_type, feature):
        read = _RowCounted(lambda chunk, first_row: _image_bytes(name, first(chunk), first_row, image_root))
        return [_Output(name, name, arrow_type.field("bytes").type, read, source_type, {**notes, "image": True}),
                _Output(f"{name}_path", name, arrow_type.field("path").type,
                        lambda chunk: _struct_child(first(chunk), "path").fill_null(""), source_type,
                        {"path_of": name})]
    return [_Output(name, name, arrow_type, first, source_type, notes, fixed)]


def _image_struct(arrow_type, feature: dict) -> bool:
    """A Hugging Face Image(): a struct of the encoded bytes and the file's path."""
    names = sorted(arrow_type.field(index).name for index in range(arrow_type.num_fields))
    return names == ["bytes", "path"] and (feature.get("_type") == "Image" or not feature)


def _image_bytes(name: str, chunk, first_row: int, image_root: str | None):
    """A Hugging Face Image chunk's encoded bytes: those stored, or where only the path is
    (an image folder loaded without embedding its files), the file's bytes, read only
    under image_root (_read_image_file). A row with neither stays null (refused unless
    nulls says "empty")."""
    import pyarrow as pa

    data = _struct_child(chunk, "bytes")
    if data.null_count == 0:
        return data
    paths = _struct_child(chunk, "path").to_pylist()
    filled = data.to_pylist()
    for index, (value, path) in enumerate(zip(filled, paths)):
        if value is None and path:
            filled[index] = _read_image_file(name, first_row + index, path, image_root)
    return pa.array(filled, type=data.type)


def _check_image_root(image_root) -> str | None:
    """image_root as the real path of a directory (the one every image path must resolve
    under), or None where none was given."""
    if image_root is None:
        return None
    root = os.path.realpath(os.fspath(image_root))
    if not os.path.isdir(root):
        raise StorageError(f"image_root={os.fspath(image_root)!r} (--image-root) is not a directory; give the "
                           f"directory that holds the images the dataset names by path")
    return root


def _read_image_file(name: str, row: int, path, image_root: str | None) -> bytes:
    """The bytes of the file an Image row names by path alone: only under image_root,
    only a regular file, at most IMAGE_FILE_BYTES_MAX bytes; else a StorageError naming
    the column, the row, the path and the fix."""
    path = os.fsdecode(path) if isinstance(path, bytes) else str(path)
    where = f"column {name!r}: row {row} holds no image bytes, only the path {path!r}"
    if image_root is None:
        raise StorageError(f"{where}; an import reads such files only under a directory you name: give "
                           f"image_root='DIR' (--image-root DIR) where the images are, or embed the images in the "
                           f"dataset first (datasets: cast_column with Image(), then save)")
    resolved = os.path.realpath(os.path.join(image_root, path))  # A relative path: relative to the root.
    if not _is_under(resolved, image_root):
        raise StorageError(f"{where}, which resolves to {resolved}, outside image_root {image_root} (through `..` or "
                           f"a symbolic link); only files under image_root are read: give the directory that holds "
                           f"them, or fix the path")
    try:
        # No link followed, and a FIFO or a device opened without blocking, to be refused.
        descriptor = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise StorageError(f"{where}, which cannot be opened under image_root {image_root} "
                           f"({error.strerror or error}); import where the files are, or fix the path") from None
    try:
        return _read_regular_file(descriptor, where, image_root)
    finally:
        os.close(descriptor)


def _read_regular_file(descriptor: int, where: str, image_root: str) -> bytes:
    """An open image file's bytes, once it is known to be a regular file under image_root
    (what was opened, seen through /proc: a directory swapped for a link after the path
    was resolved is caught too) of at most IMAGE_FILE_BYTES_MAX bytes."""
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        raise StorageError(f"{where}, which is not a regular file (a FIFO, a device, a directory or a socket); only "
                           f"image files are read: fix the path")
    try:
        opened = os.readlink(f"/proc/self/fd/{descriptor}")
    except OSError:
        opened = None  # No /proc: the path was resolved under the root just before, without links.
    if opened is not None and not _is_under(opened, image_root):
        raise StorageError(f"{where}, which was opened as {opened}, outside image_root {image_root} (a link changed "
                           f"while it was opened); only files under image_root are read")
    limit = IMAGE_FILE_BYTES_MAX
    if status.st_size > limit:
        raise StorageError(f"{where}, which holds {status.st_size:,} bytes, more than IMAGE_FILE_BYTES_MAX "
                           f"({limit:,}); set shmloader.tools.formats.IMAGE_FILE_BYTES_MAX higher to import it")
    pieces, total = [], 0
    while total <= limit:  # Bounded even if the file grows while it is read.
        piece = os.read(descriptor, min(limit + 1 - total, 16 << 20))
        if not piece:
            return b"".join(pieces)
        pieces.append(piece)
        total += len(piece)
    raise StorageError(f"{where}, which grew past IMAGE_FILE_BYTES_MAX ({limit:,} bytes) while it was read; set "
                       f"shmloader.tools.formats.IMAGE_FILE_BYTES_MAX higher to import it")


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _struct_child(chunk, child: str):
    """A child of a struct chunk, null where the struct itself is null."""
    import pyarrow.compute as pc

    values = pc.struct_field(chunk, child)
    return values if chunk.null_count == 0 else pc.if_else(chunk.is_null(), None, values)


def _cast_shape(name: str, chunk, target):
    """Nested lists as nested fixed-size lists of `target`'s shape, or an error naming the
    first row of another shape."""
    import pyarrow as pa

    try:
        return chunk.cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        raise StorageError(f"column {name!r}: a row's lists do not have the shape {target} ({one_line(error)})") from None



"""The formats users have, in: Parquet files and Arrow tables (a Hugging Face `datasets.Dataset`
is one, read through its indices mapping), column by column, and WebDataset tar shards
(from_webdataset, one field per extension), into the fields ShmDataLoader reads.

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

import numpy as np

from ..errors import StorageError
from ..plan.naming import field_file, file_name_problem
from ..storage.output import check_output, publishing

# A .npy header is written before the row count is known, then rewritten in place with
# it: this many bytes hold any header of a column (magic, version, length, dict, padding).
_NPY_HEADER_BYTES = 256


def from_parquet(paths, out, *, columns=None, nulls=None, fixed=None, skip_unsupported: bool = False,
                 force: bool = False, progress: bool = True, threads: int | None = None) -> dict[str, str]:
    """Imports Parquet file(s) (a path, a list or a glob; rows in that order) into OUT;
    returns {column: path} for ShmDataLoader (wrap list columns in Packed or Padded)."""
    import pyarrow.parquet as pq

    files = _expand(paths)
    opened = []
    for path in files:
        try:
            opened.append(pq.ParquetFile(path))
        except Exception as error:  # pyarrow's errors name no file.
            raise StorageError(f"{path}: not a readable Parquet file ({_one_line(error)})") from None
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
                        raise StorageError(f"{path}: row group {group}, column {column!r}: {_one_line(error)}") \
                            from None
                    yield from table.column(0).chunks
            finally:
                parquet.close()

    rows = sum(parquet.metadata.num_rows for parquet in opened)
    return _import(schema, batches, rows, out, columns, nulls, force, progress, threads, fixed, skip_unsupported,
                   files)


def from_arrow(table, out, *, columns=None, nulls=None, fixed=None, skip_unsupported: bool = False,
               force: bool = False, progress: bool = True, threads: int | None = None) -> dict[str, str]:
    """Imports an Arrow table (or a RecordBatchReader, or a Hugging Face `datasets.Dataset`)
    into OUT; returns {column: path}. A Dataset is read through its indices mapping, so
    that `select`, `shuffle`, `filter` and `train_test_split` give their own rows in their
    own order (not the table they share underneath)."""
    import pyarrow as pa

    if _is_hugging_face_dict(table):
        raise TypeError(f"from_arrow takes one split, got a DatasetDict of splits {sorted(table)}; pass one of them, "
                        f"e.g. dataset[{sorted(table)[0]!r}]")
    if _is_hugging_face_dataset(table):
        return _import(table.data.schema, _hugging_face_batches(table), table.num_rows, out, columns, nulls, force,
                       progress, threads, fixed, skip_unsupported)
    if isinstance(table, pa.RecordBatchReader):
        table = table.read_all()  # A stream is read once: its batches must be held to go column by column.
    if not isinstance(table, pa.Table):
        raise TypeError(f"from_arrow takes a pyarrow Table, RecordBatchReader or datasets.Dataset, got "
                        f"{type(table).__name__}")
    return _import(table.schema, lambda column: iter(table.column(column).chunks), table.num_rows, out, columns,
                   nulls, force, progress, threads, fixed, skip_unsupported)


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


def _one_line(error: Exception) -> str:
    """A library's message on one line (pyarrow's carry the C++ call site on the next)."""
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip())


def _expand(paths) -> list[str]:
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
            fixed=None, skip_unsupported: bool = False, sources=()) -> dict[str, str]:
    out = check_output(out, sources, force, COLUMNS_FILE)
    names = _check_columns(schema, columns)
    fixed = set(fixed or ())
    unknown = sorted(fixed - set(names))
    if unknown:
        raise StorageError(f"fixed= names {unknown}, which are not imported columns (imported: {names})")
    features = _hugging_face_features(schema)
    nulls = dict(nulls or {})
    outputs, skipped, plans = [], {}, {}
    for name in names:
        try:  # What a column's type allows: a column without a field form may be skipped.
            found = _outputs_of(name, schema.field(name).type, features.get(name, {}), name in fixed)
            forms = [_column_form(output.field, output.arrow_type, nulls.get(output.field)) for output in found]
        except StorageError as error:
            if not skip_unsupported:
                raise StorageError(f"{error}; or skip such columns with skip_unsupported=True (--skip-columns)") \
                    from None
            skipped[name] = str(error)
            continue
        for output, form in zip(found, forms):
            plans[output.field] = _with_options(output.field, output.arrow_type, form, nulls.get(output.field),
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
        workers = threads or min(len(outputs), max(1, len(os.sched_getaffinity(0))))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {output.field: pool.submit(_write_column, temporary, output.field, plans[output.field],
                                                 map(output.extract, batches(output.column)), rows, bar)
                       for output in outputs}
            written = {field: future.result() for field, future in futures.items()}
        bar.close()
        _write_description(temporary, outputs, written, skipped)
    return {field: str(out / written[field][0]) for field in fields}


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


def _outputs_of(name: str, arrow_type, feature: dict, fixed: bool) -> list[_Output]:
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
                                   feature, fixed)
    if str(feature.get("_type", "")).startswith("Array") and "shape" in feature and "dtype" in feature:
        # The same, from a file's metadata where datasets has not registered its extension type.
        target = _array_type(name, feature["shape"], feature["dtype"])
        return [_Output(name, name, target, lambda chunk, target=target: _cast_shape(name, chunk, target),
                        source_type, notes)]
    return _outputs_of_storage(name, arrow_type, _identity, source_type, notes, feature, fixed)


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


def _outputs_of_storage(name, arrow_type, first, source_type, notes, feature, fixed) -> list[_Output]:
    import pyarrow as pa
    import pyarrow.types as types

    if types.is_dictionary(arrow_type):  # pandas' category: the values, decoded.
        return _outputs_of_storage(name, arrow_type.value_type, lambda chunk: first(chunk).dictionary_decode(),
                                   source_type, notes, feature, fixed)
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
        return [_Output(name, name, arrow_type.field("bytes").type,
                        lambda chunk: _image_bytes(name, first(chunk)), source_type, {**notes, "image": True}),
                _Output(f"{name}_path", name, arrow_type.field("path").type,
                        lambda chunk: _struct_child(first(chunk), "path").fill_null(""), source_type,
                        {"path_of": name})]
    return [_Output(name, name, arrow_type, first, source_type, notes, fixed)]


def _image_struct(arrow_type, feature: dict) -> bool:
    """A Hugging Face Image(): a struct of the encoded bytes and the file's path."""
    names = sorted(arrow_type.field(index).name for index in range(arrow_type.num_fields))
    return names == ["bytes", "path"] and (feature.get("_type") == "Image" or not feature)


def _image_bytes(name: str, chunk):
    """A Hugging Face Image chunk's encoded bytes: those stored, or where only the path is
    (an image folder loaded without embedding its files), the file's bytes read from it.
    A row with neither stays null (refused unless nulls says "empty")."""
    import pyarrow as pa

    data = _struct_child(chunk, "bytes")
    if data.null_count == 0:
        return data
    paths = _struct_child(chunk, "path").to_pylist()
    filled = data.to_pylist()
    for row, (value, path) in enumerate(zip(filled, paths)):
        if value is None and path:
            try:
                with open(path, "rb") as handle:
                    filled[row] = handle.read()
            except OSError as error:
                raise StorageError(f"column {name!r}: an image stored by path only, {path!r}, cannot be read "
                                   f"({error.strerror or error}); import where the files are, or embed them first "
                                   f"(datasets: cast_column with Image(), then save)") from None
    return pa.array(filled, type=data.type)


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
        raise StorageError(f"column {name!r}: a row's lists do not have the shape {target} ({_one_line(error)})") from None


def _check_columns(schema, columns) -> list[str]:
    """The columns to import, each a name the loader takes and a safe file name: unknown,
    repeated or unusable names are refused here, naming them, before anything is written."""
    available = list(schema.names)
    repeated = sorted({name for name in available if available.count(name) > 1})
    names = available if columns is None else list(columns)
    if columns is not None:
        unknown = [name for name in names if name not in available]
        if unknown:
            raise StorageError(f"columns {unknown} are not in the source (its columns: {available})")
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise StorageError(f"columns {twice} are asked for more than once")
    clashing = sorted(set(names) & set(repeated))
    if clashing:
        raise StorageError(f"the source has several columns named {clashing}; a field needs a name of its own "
                           f"(rename them before the import)")
    for name in names:
        problem = file_name_problem(name)
        if problem is not None:
            raise StorageError(f"column {name!r}: its name {problem}, so it cannot be a field; rename it, or leave it "
                               f"out with columns= (--columns)")
    return names


class _ColumnPlan:
    """How one column is written: "fixed" rows of a dtype and shape, or "ragged" records
    (of numbers, or of bytes for strings and binaries), and what stands for a null."""

    def __init__(self, kind: str, dtype: np.dtype, shape: tuple[int, ...], null, text: bool = False) -> None:
        self.kind, self.dtype, self.shape, self.null, self.text = kind, dtype, shape, null, text


def _column_plan(name: str, arrow_type, null, fixed: bool = False) -> _ColumnPlan:
    return _with_options(name, arrow_type, _column_form(name, arrow_type, null), null, fixed)


def _with_options(name: str, arrow_type, plan: _ColumnPlan, null, fixed: bool) -> _ColumnPlan:
    """A column's form with what the caller asked of it (fixed=, nulls=), checked: a mistake
    there is the caller's, refused even where unsupported columns are skipped."""
    if fixed:
        if plan.kind != "ragged" or plan.text:
            raise StorageError(f"column {name!r}: fixed= takes variable-length list columns, and this one is "
                               f"{arrow_type}")
        plan = _ColumnPlan("fixed", plan.dtype, None, null)  # (rows, length): the length from the data.
    if plan.kind == "ragged" and null not in (None, "empty"):
        if plan.text:
            raise StorageError(f"column {name!r}: nulls of a string or binary column map to \"empty\" only, got "
                               f"{null!r}")
        _check_null_value(name, null, plan.dtype)  # A list column's value replaces its null items.
    if plan.kind == "fixed" and null is not None:
        _check_null_value(name, null, plan.dtype)
    return plan


def _column_form(name: str, arrow_type, null) -> _ColumnPlan:
    import pyarrow.types as types

    if types.is_string(arrow_type) or types.is_large_string(arrow_type) or types.is_binary(arrow_type) \
            or types.is_large_binary(arrow_type):
        return _ColumnPlan("ragged", np.dtype(np.uint8), (), null, text=True)
    shape, inner = [], arrow_type
    while types.is_fixed_size_list(inner):
        shape.append(inner.list_size)
        inner = inner.value_type
    if types.is_list(inner) or types.is_large_list(inner):
        if shape:
            raise StorageError(f"column {name!r}: fixed-size lists of variable-length lists ({arrow_type}) are not "
                               f"supported; store the lists at the top level")
        item = inner.value_type
        if not (types.is_integer(item) or types.is_floating(item) or types.is_boolean(item)):
            raise StorageError(f"column {name!r}: lists of {item} are not supported (numbers or bools only)")
        return _ColumnPlan("ragged", np.dtype(item.to_pandas_dtype()), (), null)
    if types.is_integer(inner) or types.is_floating(inner) or types.is_boolean(inner):
        return _ColumnPlan("fixed", np.dtype(inner.to_pandas_dtype()), tuple(shape), null)
    raise StorageError(f"column {name!r}: Arrow type {arrow_type} has no field form (numbers, bools, fixed or "
                       f"variable lists of them, strings and binaries do)")


def _check_null_value(name: str, null, dtype: np.dtype) -> None:
    """A scalar column's `nulls` value must be a number (or bool) its dtype holds: exactly
    for integers and bools, without overflowing for floats."""
    exact = False
    if isinstance(null, (int, float, bool, np.number, np.bool_)):
        try:
            with np.errstate(over="ignore"):
                stored = np.array(null, dtype=dtype)
            if dtype.kind == "f":  # The nearest float will do, but not an overflow to infinity.
                exact = bool(np.isfinite(stored)) or not np.isfinite(float(null))
            else:  # Compared as Python numbers: numpy would cast the other side to the dtype first.
                exact = stored.item() == null
        except (TypeError, ValueError, OverflowError):
            pass
    if not exact:
        raise StorageError(f"column {name!r}: its nulls value {null!r} is not a {dtype} value; give a number that "
                           f"{dtype} holds")


def _check_nulls(name: str, chunk, first_row: int, plan: _ColumnPlan):
    """A chunk of a ragged column with its null rows made empty as the caller said, or a
    StorageError naming the column and the first null's row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if chunk.null_count == 0:
        return chunk
    if plan.null != "empty":
        row = first_row + int(np.flatnonzero(np.asarray(chunk.is_null()))[0])
        raise StorageError(f"column {name!r}: row {row} is null ({chunk.null_count} nulls in rows {first_row}.."
                           f"{first_row + len(chunk) - 1}); give nulls={{{name!r}: \"empty\"}} to read null lists, "
                           f"strings and binaries as empty records, or drop those rows")
    empty = pa.scalar(b"" if plan.text else [], type=chunk.type)
    return pc.fill_null(chunk, empty)


def _write_column(directory: pathlib.Path, name: str, plan: _ColumnPlan, chunks, rows: int, bar) -> tuple[str, dict]:
    """Writes one field; returns its file name and notes (a list column of one length)."""
    if plan.kind == "fixed":
        return _write_fixed(directory, name, plan, chunks, rows, bar), {}
    import pyarrow as pa

    from .convert import RecordChunk, write_ragged

    def records():
        first = 0
        for chunk in chunks:
            chunk = _check_nulls(name, chunk, first, plan)
            if plan.text:  # Offsets into the data buffer: 32-bit, or 64-bit for the large types.
                _, offsets_buffer, data = chunk.buffers()
                wide = chunk.type in (pa.large_string(), pa.large_binary())
                offsets = np.frombuffer(offsets_buffer, dtype=np.int64 if wide else np.int32)
                offsets = offsets[chunk.offset:chunk.offset + len(chunk) + 1].astype(np.int64)
                values = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
            else:
                offsets = np.asarray(chunk.offsets).astype(np.int64)
                items = chunk.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])) if len(chunk) else chunk.values
                if items.null_count and plan.null in (None, "empty"):
                    row = first + int(np.searchsorted(offsets, int(offsets[0]) + int(
                        np.flatnonzero(np.asarray(items.is_null()))[0]), side="right")) - 1
                    raise StorageError(f"column {name!r}: row {row} holds a null item; give nulls={{{name!r}: value}} "
                                       f"to replace null items by a number, or drop those rows")
                if items.null_count:
                    import pyarrow.compute as pc

                    items = pc.fill_null(items, pa.scalar(plan.null, type=items.type))
                values = items.to_numpy(zero_copy_only=False).astype(plan.dtype, copy=False)
                offsets = offsets - offsets[0]
            # The chunk's records at once: no Python object per record.
            lengths = np.diff(offsets)
            if len(lengths):
                extremes[0], extremes[1] = min(extremes[0], int(lengths.min())), max(extremes[1], int(lengths.max()))
            yield RecordChunk(values[int(offsets[0]):int(offsets[-1])], lengths)
            first += len(chunk)
            bar.update(len(chunk))

    extremes = [1 << 63, -1]  # The shortest and the longest record.
    path = field_file(directory, name, ".ragged", f"column {name!r}")
    write_ragged(path, records(), codec="lz4" if not plan.text else "auto")
    one_length = not plan.text and extremes[0] == extremes[1]
    return path.name, ({"one_length": extremes[0]} if one_length else {})


def _write_fixed(directory: pathlib.Path, name: str, plan: _ColumnPlan, chunks, rows: int, bar) -> str:
    path = field_file(directory, name, ".npy", f"column {name!r}")
    written, shape, waiting = 0, plan.shape, []
    with open(path, "wb") as handle:
        handle.write(_npy_header(plan.dtype, (rows, *(shape or ()))))
        for chunk in chunks:
            if plan.shape is None:  # fixed=: lists of one length, as fixed-size lists of it.
                _, shape = _as_fixed_lists(name, chunk, written + sum(map(len, waiting)), shape)
                if shape is None:  # Empty or all null so far: written once a row gives the length.
                    waiting.append(chunk)
                    continue
                pending, waiting = [*waiting, chunk], []
            else:
                pending = [chunk]
            for piece in pending:
                if plan.shape is None:
                    piece, _ = _as_fixed_lists(name, piece, written, shape)
                values = _fixed_values(name, piece, written, _ColumnPlan("fixed", plan.dtype, shape, plan.null))
                handle.write(values.tobytes())
                written += len(piece)
                bar.update(len(piece))
        if waiting and sum(map(len, waiting)):
            raise StorageError(f"column {name!r}: every row is null, so fixed= cannot learn the lists' length")
        shape = (0,) if shape is None else shape
        if written != rows or shape != plan.shape:  # Rows miscounted by the metadata, or a length found.
            handle.seek(0)
            handle.write(_npy_header(plan.dtype, (written, *shape)))
    return path.name


def _as_fixed_lists(name: str, chunk, first_row: int, shape):
    """A chunk of a variable-length list column as fixed-size lists of the column's one
    length (that of its first non-null row, or `shape`'s); a row of another length is
    refused, naming it."""
    import pyarrow as pa

    lengths = np.asarray(chunk.value_lengths().fill_null(-1))
    if shape is None:
        present = lengths[lengths >= 0]
        if not present.size:
            return chunk, shape
        shape = (int(present[0]),)
    other = np.flatnonzero((lengths >= 0) & (lengths != shape[0]))
    if other.size:
        row = int(other[0])
        raise StorageError(f"column {name!r}: row {first_row + row} holds {int(lengths[row])} items, row(s) before it "
                           f"{shape[0]}; fixed= needs one length throughout (import it as a ragged field instead)")
    return chunk.cast(pa.list_(chunk.type.value_type, shape[0])), shape


def _fixed_values(name: str, chunk, first_row: int, plan: _ColumnPlan) -> np.ndarray:
    """A chunk of a scalar or fixed-size-list column as a C-contiguous (rows, *shape)
    array. A null anywhere (a row, a list inside it, an item) is refused naming the column
    and the row, or replaced by the column's `nulls` value, item by item."""
    import pyarrow.compute as pc

    mask = np.asarray(chunk.is_null()) if chunk.null_count else None
    values = chunk
    for _ in plan.shape:
        # Every child value, those under null entries too (`values` ignores the slice's
        # offset, hence the slice), so that each row keeps its place.
        width = values.type.list_size
        values = values.values.slice(values.offset * width, len(values) * width)
        if mask is not None:
            mask = np.repeat(mask, width)
        if values.null_count:
            inner = np.asarray(values.is_null())
            mask = inner if mask is None else mask | inner
    if mask is not None and mask.any():
        values = pc.fill_null(values, False if plan.dtype == np.bool_ else 0)
    array = np.asarray(values.to_numpy(zero_copy_only=False)).astype(plan.dtype, copy=True)
    if mask is not None and mask.any():
        if plan.null is None:
            item = int(np.flatnonzero(mask)[0])
            row_items = max(1, int(np.prod(plan.shape)))
            where = f"item {item % row_items} of row {first_row + item // row_items}" if plan.shape else \
                f"row {first_row + item}"
            raise StorageError(f"column {name!r}: {where} is null ({int(mask.sum())} null values in rows {first_row}.."
                               f"{first_row + len(chunk) - 1}); give nulls={{{name!r}: value}} (--nulls "
                               f"{name}=VALUE) or drop those rows")
        array[mask] = plan.null
    return np.ascontiguousarray(array.reshape(len(chunk), *plan.shape))


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A version 1.0 .npy header padded to _NPY_HEADER_BYTES, so that it can be rewritten."""
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)})
    length = _NPY_HEADER_BYTES - 10
    return b"\x93NUMPY\x01\x00" + length.to_bytes(2, "little") + (text.ljust(length - 1) + "\n").encode("latin1")


# ---- WebDataset ------------------------------------------------------------------------

# Entries read as one integer per sample (the WebDataset convention for class labels).
_INTEGER_EXTENSIONS = ("cls", "cls2", "class", "label", "index", "idx")
# Samples in flight between the tar reader and the field writers.
_QUEUE_SAMPLES = 256
_DONE = object()
# The field that holds each sample's key.
_KEY_FIELD = "__key__"


def _webdataset_names(shard: str, key: str, extensions: list[str]) -> dict[str, str]:
    """{extension: field name}: dots become underscores (`seg.png` -> `seg_png`). Refused,
    naming them: `__key__` (the keys' own field), two extensions that become one name, and
    any that is no safe field name."""
    names = {extension: extension.replace(".", "_") for extension in extensions}
    if _KEY_FIELD in names.values():
        raise StorageError(f"{shard}: sample {key} has an entry with extension {_KEY_FIELD!r}, the name of the field "
                           f"that holds the samples' keys")
    seen = {}
    for extension, name in names.items():
        if name in seen:
            raise StorageError(f"{shard}: sample {key}: extensions {seen[name]!r} and {extension!r} would both be the "
                               f"field {name!r}; rename one of them")
        seen[name] = extension
        problem = file_name_problem(name)
        if problem is not None:
            raise StorageError(f"{shard}: sample {key}: extension {extension!r} cannot be a field: {name!r} {problem}")
    return names


def from_webdataset(shards, out, *, force: bool = False, progress: bool = True) -> dict[str, str]:
    """Imports WebDataset tar shards (a path, a list or a glob; samples in shard order) into
    OUT: one ragged bytes field per extension (`jpg`, `txt`, ...), integer entries (`cls`,
    ...) as int64 fields, and the samples' keys as the bytes field `__key__`. Every sample
    must have the extensions of the first; one that lacks or adds one is refused, naming it.
    One pass over the shards: a reader thread feeds one writer thread per field."""
    import queue
    import tarfile
    import threading

    files = _expand(shards)
    out = check_output(out, files, force, COLUMNS_FILE)

    def samples():
        """(shard, key, {extension: bytes}) in order: members of one key are consecutive."""
        for shard in files:
            try:
                with tarfile.open(shard, "r|*") as archive:
                    key, entries = None, {}
                    for member in archive:
                        if not member.isfile():
                            continue
                        base = os.path.basename(member.name)
                        stem, dot, extension = base.partition(".")
                        member_key = os.path.join(os.path.dirname(member.name), stem)
                        if not dot:
                            raise StorageError(f"{shard}: member {member.name} has no extension (expected KEY.EXT)")
                        if member_key != key and key is not None:
                            yield shard, key, entries
                            entries = {}
                        key = member_key
                        if extension in entries:
                            raise StorageError(f"{shard}: sample {key} has two {extension!r} entries")
                        entries[extension] = archive.extractfile(member).read()
                    if key is not None:
                        yield shard, key, entries
            except (tarfile.TarError, OSError, EOFError) as error:
                raise StorageError(f"{shard}: not a readable tar shard ({_one_line(error)})") from None

    stream = samples()
    try:
        first_shard, first_key, first = next(stream)
    except StopIteration:
        raise StorageError(f"{files[0]}: no samples in the shards") from None
    extensions = sorted(first)
    integers = [extension for extension in extensions if extension in _INTEGER_EXTENSIONS]
    names = _webdataset_names(first_shard, first_key, extensions)
    queues = {name: queue.Queue(_QUEUE_SAMPLES) for name in [*names.values(), _KEY_FIELD]}
    failures = []

    def writer(name: str) -> None:
        from .convert import write_ragged

        finished = False

        def records():
            nonlocal finished
            while (item := queues[name].get()) is not _DONE:
                yield item
            finished = True

        try:
            write_ragged(field_file(temporary, name, ".ragged", f"{first_shard}: extension {name!r}"), records(),
                         codec="none")
        except BaseException as error:  # Reported by the reader's thread.
            failures.append(error)
            # Drained until the reader's end marker, unless the write failed after it (the
            # last flush, a full disk): a second one never comes.
            while not finished and queues[name].get() is not _DONE:
                pass

    ragged = [name for extension, name in names.items() if extension not in integers] + [_KEY_FIELD]
    threads = [threading.Thread(target=writer, args=(name,), daemon=True) for name in ragged]
    labels = {names[extension]: [] for extension in integers}
    from tqdm import tqdm

    bar = tqdm(desc=f"import {out.name}", unit="sample", disable=not progress, leave=False)

    def put(shard, key, entries):
        if sorted(entries) != extensions:
            missing, extra = sorted(set(extensions) - set(entries)), sorted(set(entries) - set(extensions))
            raise StorageError(f"{shard}: sample {key} has extensions {sorted(entries)}; the first sample "
                               f"({first_key} in {first_shard}) has {extensions}"
                               f"{f', missing {missing}' if missing else ''}{f', extra {extra}' if extra else ''}")
        for extension in extensions:
            data = entries[extension]
            if extension in integers:
                try:
                    label = int(data.decode().strip())
                except (ValueError, UnicodeDecodeError):
                    raise StorageError(f"{shard}: sample {key}: its {extension!r} entry {data[:40]!r} is not "
                                       f"an integer") from None
                if not -(1 << 63) <= label < 1 << 63:
                    raise StorageError(f"{shard}: sample {key}: its {extension!r} entry {label} does not fit an int64")
                labels[names[extension]].append(label)
            else:
                queues[names[extension]].put(np.frombuffer(data, dtype=np.uint8))
        queues[_KEY_FIELD].put(np.frombuffer(key.encode(), dtype=np.uint8))
        bar.update(1)
        if failures:
            raise failures[0]

    with publishing(out) as temporary:
        try:
            for thread in threads:
                thread.start()
            put(first_shard, first_key, first)
            for shard, key, entries in stream:
                put(shard, key, entries)
        finally:
            for name in ragged:
                queues[name].put(_DONE)
            for thread in threads:
                if thread.ident is not None:
                    thread.join()
            bar.close()
        if failures:
            raise failures[0]
        paths = {}
        for name, values in labels.items():
            np.save(field_file(temporary, name, ".npy", f"{first_shard}: extension {name!r}"),
                    np.asarray(values, dtype=np.int64))
            paths[name] = f"{name}.npy"
        for name in ragged:
            paths[name] = f"{name}.ragged"
        import json

        extension_of = {name: extension for extension, name in names.items()}
        with open(temporary / COLUMNS_FILE, "w") as handle:  # What an import wrote (force replaces only such).
            json.dump({"fields": {name: {"extension": extension_of.get(name, name), "file": path}
                                  for name, path in paths.items()}, "skipped": {}}, handle, indent=1)
    return {name: str(out / path) for name, path in paths.items()}

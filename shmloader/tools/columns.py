"""Arrow columns into fields: the form each column takes (an array, a ragged field, fixed-size
lists), its nulls checked or replaced, and its chunks written as .npy or ragged files."""

from __future__ import annotations

import pathlib

import numpy as np

from ..errors import StorageError
from ..plan.naming import field_file, file_name_problem

# A .npy header is written before the row count is known, then rewritten in place with
# it: this many bytes hold any header of a column (magic, version, length, dict, padding).
_NPY_HEADER_BYTES = 256


def check_columns(schema, columns) -> list[str]:
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
    return with_options(name, arrow_type, column_form(name, arrow_type, null), null, fixed)


def with_options(name: str, arrow_type, plan: _ColumnPlan, null, fixed: bool) -> _ColumnPlan:
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


def column_form(name: str, arrow_type, null) -> _ColumnPlan:
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


def write_column(directory: pathlib.Path, name: str, plan: _ColumnPlan, chunks, rows: int, bar) -> tuple[str, dict]:
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

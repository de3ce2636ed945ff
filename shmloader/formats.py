"""The formats users have, in: Parquet files and Arrow tables (a Hugging Face `datasets.Dataset`
is one: `dataset.data.table`), column by column, and WebDataset tar shards (from_webdataset,
one field per extension), into the fields ShmDataLoader reads.

Each column becomes a field in the output directory OUT:

    scalars (integers, floats, bool)            OUT/<column>.npy, (rows,)
    fixed-size lists, nested ones too           OUT/<column>.npy, (rows, *shape)
    variable-length lists of numbers (tokens)   OUT/<column>.ragged (Packed / Padded)
    strings and binaries                        OUT/<column>.ragged of uint8 bytes

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

from .errors import StorageError
from .storage import check_output_directory, publishing

# A .npy header is written before the row count is known, then rewritten in place with
# it: this many bytes hold any header of a column (magic, version, length, dict, padding).
_NPY_HEADER_BYTES = 256


def from_parquet(paths, out, *, columns=None, nulls=None, force: bool = False, progress: bool = True,
                 threads: int | None = None) -> dict[str, str]:
    """Imports Parquet file(s) (a path, a list or a glob; rows in that order) into OUT;
    returns {column: path} for ShmDataLoader (wrap list columns in Packed or Padded)."""
    import pyarrow.parquet as pq

    files = _expand(paths)
    opened = []
    for path in files:
        try:
            opened.append(pq.ParquetFile(path))
        except Exception as error:  # pyarrow's errors name no file.
            raise StorageError(f"{path}: not a readable Parquet file ({error})") from None
    schema = opened[0].schema_arrow
    for path, parquet in zip(files[1:], opened[1:]):
        if not parquet.schema_arrow.equals(schema):
            raise StorageError(f"{path}: its schema differs from {files[0]}'s; every file of an import must match")

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
                        raise StorageError(f"{path}: row group {group}, column {column!r}: {error}") from None
                    yield from table.column(0).chunks
            finally:
                parquet.close()

    rows = sum(parquet.metadata.num_rows for parquet in opened)
    return _import(schema, batches, rows, out, columns, nulls, force, progress, threads)


def from_arrow(table, out, *, columns=None, nulls=None, force: bool = False, progress: bool = True,
               threads: int | None = None) -> dict[str, str]:
    """Imports an Arrow table (or anything with `.to_table()`, or a Hugging Face
    `datasets.Dataset`) into OUT; returns {column: path}."""
    import pyarrow as pa

    if hasattr(table, "data") and hasattr(table.data, "table"):  # datasets.Dataset: its (mapped) Arrow table.
        table = table.data.table
    if isinstance(table, pa.RecordBatchReader):
        table = table.read_all()  # A stream is read once: its batches must be held to go column by column.
    if not isinstance(table, pa.Table):
        raise TypeError(f"from_arrow takes a pyarrow Table, RecordBatchReader or datasets.Dataset, got "
                        f"{type(table).__name__}")
    return _import(table.schema, lambda column: iter(table.column(column).chunks), table.num_rows, out, columns,
                   nulls, force, progress, threads)


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


def _import(schema, batches, rows: int, out, columns, nulls, force: bool, progress: bool, threads) -> dict[str, str]:
    out = pathlib.Path(out)
    check_output_directory(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass force=True to overwrite it")
    names = list(schema.names) if columns is None else list(columns)
    for name in names:
        if name not in schema.names:
            raise KeyError(f"column {name!r} is not in the source (columns: {schema.names})")
    nulls = dict(nulls or {})
    plans = {name: _column_plan(name, schema.field(name).type, nulls.get(name)) for name in names}
    from tqdm import tqdm

    with publishing(out) as temporary:
        bar = tqdm(total=rows * len(names), desc=f"import {out.name}", unit="value", disable=not progress,
                   leave=False)
        workers = threads or min(len(names), max(1, len(os.sched_getaffinity(0))))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {name: pool.submit(_write_column, temporary, name, plans[name], batches(name), rows, bar)
                       for name in names}
            written = {name: future.result() for name, future in futures.items()}
        bar.close()
    return {name: str(out / written[name]) for name in names}


class _ColumnPlan:
    """How one column is written: "fixed" rows of a dtype and shape, or "ragged" records
    (of numbers, or of bytes for strings and binaries), and what stands for a null."""

    def __init__(self, kind: str, dtype: np.dtype, shape: tuple[int, ...], null, text: bool = False) -> None:
        self.kind, self.dtype, self.shape, self.null, self.text = kind, dtype, shape, null, text


def _column_plan(name: str, arrow_type, null) -> _ColumnPlan:
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


def _check_nulls(name: str, chunk, first_row: int, plan: _ColumnPlan):
    """The chunk with its nulls mapped as the caller said, or a StorageError naming the
    column and the first null's row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if chunk.null_count == 0:
        return chunk
    if plan.null is None:
        row = first_row + int(np.flatnonzero(np.asarray(chunk.is_null()))[0])
        raise StorageError(f"column {name!r}: row {row} is null ({chunk.null_count} nulls in rows {first_row}.."
                           f"{first_row + len(chunk) - 1}); give nulls={{{name!r}: value}} (\"empty\" for lists, "
                           f"strings and binaries) or drop those rows")
    if plan.kind == "ragged":
        if plan.null != "empty":
            raise StorageError(f"column {name!r}: nulls of a list, string or binary column map to \"empty\" only, got "
                               f"{plan.null!r}")
        empty = pa.scalar(b"" if plan.text else [], type=chunk.type)
        return pc.fill_null(chunk, empty)
    return pc.fill_null(chunk, pa.scalar(plan.null, type=chunk.type))


def _write_column(directory: pathlib.Path, name: str, plan: _ColumnPlan, chunks, rows: int, bar) -> str:
    if plan.kind == "fixed":
        return _write_fixed(directory, name, plan, chunks, rows, bar)
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
                if items.null_count:
                    row = first + int(np.searchsorted(offsets, int(offsets[0]) + int(
                        np.flatnonzero(np.asarray(items.is_null()))[0]), side="right")) - 1
                    raise StorageError(f"column {name!r}: row {row} holds a null item; lists must hold numbers")
                values = items.to_numpy(zero_copy_only=False).astype(plan.dtype, copy=False)
                offsets = offsets - offsets[0]
            # The chunk's records at once: no Python object per record.
            yield RecordChunk(values[int(offsets[0]):int(offsets[-1])], np.diff(offsets))
            first += len(chunk)
            bar.update(len(chunk))

    filename = f"{name}.ragged"
    write_ragged(directory / filename, records(), codec="lz4" if not plan.text else "auto")
    return filename


def _write_fixed(directory: pathlib.Path, name: str, plan: _ColumnPlan, chunks, rows: int, bar) -> str:
    filename = f"{name}.npy"
    written = 0
    with open(directory / filename, "wb") as handle:
        handle.write(_npy_header(plan.dtype, (rows, *plan.shape)))
        for chunk in chunks:
            chunk = _check_nulls(name, chunk, written, plan)
            values = chunk.flatten() if plan.shape else chunk
            for _ in plan.shape[1:]:
                values = values.flatten()
            array = values.to_numpy(zero_copy_only=False).astype(plan.dtype, copy=False)
            handle.write(np.ascontiguousarray(array).tobytes())
            written += len(chunk)
            bar.update(len(chunk))
        if written != rows:  # A source whose metadata miscounted: the header says what was written.
            handle.seek(0)
            handle.write(_npy_header(plan.dtype, (written, *plan.shape)))
    return filename


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
    out = pathlib.Path(out)
    check_output_directory(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass force=True to overwrite it")

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
                raise StorageError(f"{shard}: not a readable tar shard ({error})") from None

    stream = samples()
    try:
        first_shard, first_key, first = next(stream)
    except StopIteration:
        raise StorageError(f"{files[0]}: no samples in the shards") from None
    extensions = sorted(first)
    integers = [extension for extension in extensions if extension in _INTEGER_EXTENSIONS]
    names = {extension: extension.replace(".", "_") for extension in extensions}
    queues = {name: queue.Queue(_QUEUE_SAMPLES) for name in [*names.values(), "__key__"]}
    failures = []

    def writer(name: str) -> None:
        from .convert import write_ragged

        def records():
            while (item := queues[name].get()) is not _DONE:
                yield item

        try:
            write_ragged(temporary / f"{name}.ragged", records(), codec="none")
        except BaseException as error:  # Reported by the reader's thread; the queue is drained.
            failures.append(error)
            while queues[name].get() is not _DONE:
                pass

    ragged = [name for extension, name in names.items() if extension not in integers] + ["__key__"]
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
                    labels[names[extension]].append(int(data.decode().strip()))
                except ValueError:
                    raise StorageError(f"{shard}: sample {key}: its {extension!r} entry {data[:40]!r} is not "
                                       f"an integer") from None
            else:
                queues[names[extension]].put(np.frombuffer(data, dtype=np.uint8))
        queues["__key__"].put(np.frombuffer(key.encode(), dtype=np.uint8))
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
            np.save(temporary / f"{name}.npy", np.asarray(values, dtype=np.int64))
            paths[name] = f"{name}.npy"
        for name in ragged:
            paths[name] = f"{name}.ragged"
    return {name: str(out / path) for name, path in paths.items()}

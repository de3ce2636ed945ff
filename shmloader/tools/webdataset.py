"""WebDataset shards into fields: a field per extension, one row per sample, read with the
standard library's tarfile."""

from __future__ import annotations

import os

import numpy as np

from ..errors import StorageError
from ..plan.naming import field_file, file_name_problem
from .formats import COLUMNS_FILE, expand_sources, one_line
from .output import check_output, publishing

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

    files = expand_sources(shards)
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
                raise StorageError(f"{shard}: not a readable tar shard ({one_line(error)})") from None

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

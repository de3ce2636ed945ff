"""Writing to a store: `shmloader convert`, `convert-images` and `import` given an `s3://`
output write to a local staging directory, then upload what they wrote.

A store has no rename, so a dataset of several objects cannot appear at once; instead it
is visible only once whole. The objects that make a field readable go last: a ragged
directory is read only where its offsets.b2nd is, so its values (and shapes) go before it,
and the metadata (.json) after every field. Objects go up by multipart upload (obstore's
put of a file), each of which the store shows only when complete; if any upload fails,
those of this run that did complete are deleted again. With force, the objects of an
earlier output of that name are deleted first, so none of them mixes with the new ones.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile

from ..remote import is_url
from ..remote.store import Client, split_url
from ..storage.ragged import OFFSETS_NAME


def _upload_order(relative: str) -> tuple[int, str]:
    """Uploaded last: what makes a ragged field (its offsets) or an import (its .json) readable."""
    name = posixpath.basename(relative)
    return (2 if name.endswith(".json") else 1 if name == OFFSETS_NAME else 0), relative


@contextlib.contextmanager
def staged_output(output: str, force: bool = False, options: dict | None = None):
    """Yields where a command writes `output`: the path itself, or for a URL a local path
    whose files are uploaded beside the URL when the block ends without an error."""
    if not is_url(output):
        yield output
        return
    client = Client(options)
    bucket, key = split_url(output.rstrip("/"))
    if not key:
        raise ValueError(f"{output}: a bucket; name the object or prefix to write in it, e.g. "
                         f"s3://{bucket}/train/images")
    parent, stem = posixpath.split(f"s3://{bucket}/{key}")
    # An earlier output of this name: the object itself, what is under it as a prefix, and
    # the files a command names after it (convert-images' STEM.image, STEM.label, ...).
    earlier = [url for url, _, _ in client.list(parent + "/")
               if _named_after(posixpath.relpath(url, parent), stem)]
    if earlier and not force:
        raise FileExistsError(f"{output} exists ({len(earlier)} object(s) named {stem}... under {parent}/); pass "
                              f"force=True (--force) to replace them")
    staging = tempfile.mkdtemp(prefix="shmloader-upload-")
    try:
        yield os.path.join(staging, stem)
        files = sorted((os.path.relpath(os.path.join(directory, name), staging)
                        for directory, _, names in os.walk(staging) for name in names), key=_upload_order)
        for url in earlier:  # An earlier output's objects never mix with these.
            client.delete(url)
        uploaded = []
        try:
            for relative in files:
                url = f"{parent}/{relative.replace(os.sep, '/')}"
                client.put_file(url, os.path.join(staging, relative))
                uploaded.append(url)
        except BaseException:
            for url in reversed(uploaded):
                with contextlib.suppress(Exception):
                    client.delete(url)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _named_after(relative: str, stem: str) -> bool:
    first = relative.split("/")[0]
    return first == stem or first.startswith(stem + ".")


def named(text: str, output: str, local: str) -> str:
    """`text` (a command's report) with the staging path named by the output URL."""
    return text if local == output else text.replace(local, output.rstrip("/"))

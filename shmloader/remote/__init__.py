"""Fields in object storage (`s3://bucket/key`): the client (store) and the node's cache
(cache, node, pages). The trainer's step that turns a field's URLs into cache files is
plan/localize.py; commands upload their outputs through tools/upload.py.

The trainer reads each object's header and index once (`localize`); every process of the
node then maps the same sparse local copy of it (cache.py; its ledger: node.py; its
units and locks: pages.py), whose pages are fetched by byte range the first time a gather
or the read-ahead needs them. obstore is imported only when a field names a URL: the core
needs no object-store client.
"""

from __future__ import annotations

SCHEMES = ("s3://",)


def is_url(path) -> bool:
    """Whether a field's path names an object in a store rather than a local file."""
    return isinstance(path, str) and path.startswith(SCHEMES)

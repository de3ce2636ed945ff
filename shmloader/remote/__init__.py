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

import contextlib
import threading
import time

SCHEMES = ("s3://",)


def is_url(path) -> bool:
    """Whether a field's path names an object in a store rather than a local file."""
    return isinstance(path, str) and path.startswith(SCHEMES)


# storage_options whose values are shown as they are (obstore's S3 settings that are not
# secrets); every other value, a credential or a setting unknown here, is shown redacted.
_SHOWN = frozenset(("endpoint", "endpoint_url", "aws_endpoint", "aws_endpoint_url", "region", "aws_region",
                    "default_region", "aws_default_region", "bucket", "bucket_name", "aws_bucket", "allow_http",
                    "virtual_hosted_style_request", "aws_virtual_hosted_style_request", "s3_express",
                    "aws_s3_express", "checksum_algorithm", "aws_checksum_algorithm", "skip_signature",
                    "aws_skip_signature", "unsigned_payload", "aws_unsigned_payload", "request_payer",
                    "aws_request_payer", "imdsv1_fallback", "conditional_put"))
REDACTED = "<redacted>"


def redact_options(options):
    """storage_options as any text of the package shows them: each value redacted but those
    of settings known not to be secrets, and an endpoint's user and password (a URL may
    carry them) taken out."""
    if options is None:
        return None
    try:
        items = dict(options).items()
    except (TypeError, ValueError):
        return REDACTED
    shown = {}
    for name, value in items:
        if str(name).lower() not in _SHOWN:
            shown[name] = REDACTED
        elif isinstance(value, str) and "@" in value and "://" in value:
            scheme, _, rest = value.partition("://")
            shown[name] = f"{scheme}://{REDACTED}@{rest.rpartition('@')[2]}"
        else:
            shown[name] = value
    return shown


# The deadline of the step this thread fills (readers=0: the trainer's own fills), which
# every wait of the node cache keeps (deadline_left).
_deadline = threading.local()


@contextlib.contextmanager
def step_deadline(seconds: float | None, step: int):
    """Waits of the node cache in this thread (for a request, for a page another request
    fetches) end in a StepTimeoutError once the step has been filling `seconds`."""
    previous = getattr(_deadline, "value", None)
    _deadline.value = None if seconds is None else (time.monotonic() + seconds, seconds, step)
    try:
        yield
    finally:
        _deadline.value = previous


def deadline_left(what: str) -> float | None:
    """Seconds left to this thread's step (None: no deadline); a StepTimeoutError naming
    `what` it waited for once none are."""
    found = getattr(_deadline, "value", None)
    if found is None:
        return None
    left = found[0] - time.monotonic()
    if left <= 0:
        from ..errors import StepTimeoutError

        raise StepTimeoutError(f"step {found[2]} has been filling for over step_timeout={found[1]:g} s, waiting for "
                               f"{what}: the store answers no more (its requests are given up on)", found[2])
    return left

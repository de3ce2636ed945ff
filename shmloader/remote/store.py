"""The object-store client: HEAD, LIST and ranged GET of `s3://` URLs through obstore
(Rust's object_store), with bounded retries.

Why obstore: one maintained client for S3, GCS, Azure and HTTP, whose GETs release the GIL
and run on its own runtime, so a reader's threads fetch many ranges at once without
Python in the way; fsspec/s3fs goes through aiobotocore and an event loop thread per
process. Measured against s3fs in bench/object_store.py.

Retries are ours (obstore's own are switched off) so that each one is counted and bounded
in time: timeouts, connection errors and 5xx answers are retried with exponential backoff
and full jitter for at most RETRY_SECONDS; a missing object, a refused credential or an
object that changed under the loader (If-Match fails) stops at once with an error naming
the URL. Endpoint and credentials: `storage_options` (obstore's S3 config keys, e.g.
endpoint, access_key_id, secret_access_key, region), else the standard AWS_* variables.
"""

from __future__ import annotations

import os
import pathlib
import random
import re
import threading
import time

from ..errors import RemoteError

# A failing request is tried again for at most this long (the server restarting, a
# dropped connection), waiting BACKOFF_FIRST_SECONDS, then twice as long each time (at
# most BACKOFF_MAX_SECONDS), each wait drawn uniformly below that bound (full jitter:
# readers that failed together do not retry together).
# SHMLOADER_REMOTE_RETRY_SECONDS, read at each request (retry_seconds), stands in for it.
RETRY_SECONDS = 60.0
BACKOFF_FIRST_SECONDS = 0.05
BACKOFF_MAX_SECONDS = 4.0
# One request's limits: a stalled connection is a timeout, and a timeout is retried.
_CLIENT_OPTIONS = {"timeout": "60s", "connect_timeout": "5s"}
# A streamed GET (Client.stream) hands its body over in pieces of at least this size: small
# enough that a piece is still in the core's cache when it is checksummed and written, and
# that its buffer is reused, where collecting a whole 8 MiB request first wrote it into fresh
# pages and read it back cold (about half the CPU of a download into the node cache,
# bench/RESULTS.md); large enough that the pieces cost few Python calls.
STREAM_PIECE_BYTES = 256 << 10


def retry_seconds() -> float:
    """The retry window: SHMLOADER_REMOTE_RETRY_SECONDS as set now, else RETRY_SECONDS."""
    value = os.environ.get("SHMLOADER_REMOTE_RETRY_SECONDS")
    if value is None:
        return RETRY_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"SHMLOADER_REMOTE_RETRY_SECONDS must be a positive number of seconds, got {value!r}")
    return seconds


def check_endpoint(endpoint: str, setting: str) -> None:
    """Refuses at once an endpoint that no request could reach (retrying it as a transient
    failure waited out the whole retry window), naming the setting it came from."""
    scheme, separator, rest = endpoint.partition("://")
    host = rest.split("/", 1)[0].rpartition("@")[2]
    if not separator or scheme.lower() not in ("http", "https") or not host or host.startswith(":"):
        shown = f"{scheme}://{host}" if separator else endpoint.rpartition("@")[2]
        raise ValueError(f"{setting} is {shown!r}, not an endpoint URL: expected http(s)://HOST[:PORT], e.g. "
                         f"https://s3.us-east-1.amazonaws.com or http://127.0.0.1:9000")


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key) of `s3://bucket/key`, the key as written: S3 keys may hold "#" and "?",
    which a URL parser would take for a fragment and a query."""
    if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
        raise ValueError(f"{url!r}: expected an object URL s3://bucket/key")
    bucket, _, key = url[5:].partition("/")
    return bucket, key.lstrip("/")


def _import_obstore():
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        raise ImportError("s3:// fields need obstore: pip install 'shmloader[s3]'") from None
    return obstore, S3Store


_stores: dict = {}
_stores_lock = threading.Lock()


def _store(bucket: str, options: dict):
    """One client per bucket and options in this process (its connection pool is shared
    by the process's threads). Made on first use: a reader forked from a process that
    never made one has no runtime to inherit."""
    endpoint = options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        check_endpoint(endpoint, "storage_options['endpoint']" if options.get("endpoint") else
                       "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL")
    # The endpoint as resolved now: a process whose environment names another one since
    # (another server, a test's) gets a client for it, not the first one's.
    key = (os.getpid(), bucket, endpoint, tuple(sorted(options.items())))
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            _, S3Store = _import_obstore()
            config = dict(options)
            if endpoint:
                config["endpoint"] = endpoint
            if not (config.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
                config["region"] = "us-east-1"  # object_store needs one; S3-compatible servers ignore it.
            client = dict(_CLIENT_OPTIONS)
            if str(endpoint or "").startswith("http://"):
                client["allow_http"] = True  # The endpoint itself says plain HTTP: a local or test server.
            store = _stores[key] = S3Store(bucket, client_options=client, retry_config={"max_retries": 0}, **config)
    return store


class Client:
    """Requests to one store with the loader's options; `count(requests, bytes, retries)`
    receives what each request cost (the node cache's counters)."""

    def __init__(self, options: dict | None = None, count=None) -> None:
        self.options = dict(options or {})
        self._count = count or (lambda requests, size, retries: None)

    def _call(self, url: str, what: str, function):
        """function(store, key) with bounded, counted retries; errors name the URL."""
        obstore, _ = _import_obstore()
        from obstore import exceptions

        bucket, key = split_url(url)
        started, window = time.monotonic(), retry_seconds()
        deadline = started + window
        wait, retries = BACKOFF_FIRST_SECONDS, 0
        while True:
            try:
                result = function(obstore, _store(bucket, self.options), key)
                self._count(1, result[1], retries)
                return result[0]
            except FileNotFoundError:
                self._count(1, 0, retries)
                if what.startswith("GET"):  # Described at the start: it was there then.
                    raise RemoteError(f"{url} was deleted since the loader described it ({what}): restart the "
                                      f"loader once the data is back") from None
                raise FileNotFoundError(f"{url}: no such object ({what})") from None
            except exceptions.PreconditionError:
                self._count(1, 0, retries)
                raise RemoteError(f"{url} changed since the loader described it (its ETag is not the one read "
                                  f"then): its rows may be other rows now. Restart the loader to read the new "
                                  f"object, or write new data under new keys") from None
            except (exceptions.PermissionDeniedError, exceptions.UnauthenticatedError) as error:
                self._count(1, 0, retries)
                raise RemoteError(f"{url}: access refused ({what}): {_first_line(error)}; check the credentials "
                                  f"(storage_options, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)") from None
            except (exceptions.GenericError, OSError, TimeoutError) as error:
                status = _STATUS.search(str(error))
                code = int(status.group(1)) if status else 0
                if 400 <= code < 500 and code not in (408, 429):  # The request itself is refused: no retry.
                    self._count(1, 0, retries)
                    if code == 404:
                        raise FileNotFoundError(f"{url}: not found ({what}: {_first_line(error)}); is the bucket "
                                                f"{bucket!r} there, on this endpoint?") from None
                    raise RemoteError(f"{url}: {what} refused with HTTP {code}: {_first_line(error)}") from None
                # Connection refused or reset, timeouts, 5xx, throttling: the server may come back.
                now = time.monotonic()
                if now >= deadline:
                    self._count(1, 0, retries)
                    # The time it really took: one request may outlast the retry window alone (its timeout).
                    raise RemoteError(f"{url}: {what} failed after {retries} retries over {now - started:.1f} s "
                                      f"(retries stop {window:g} s after the first request: "
                                      f"SHMLOADER_REMOTE_RETRY_SECONDS; each request times out after "
                                      f"{_CLIENT_OPTIONS['timeout']}): {_first_line(error)}") from None
                retries += 1
                time.sleep(min(random.uniform(0, wait), deadline - now))
                wait = min(2 * wait, BACKOFF_MAX_SECONDS)

    def head(self, url: str) -> tuple[int, str]:
        """(size, ETag) of an object."""
        if not split_url(url)[1]:
            raise ValueError(f"{url}: a bucket, not an object; name an object, a glob or a ragged directory in it "
                             f"(s3://bucket/key)")
        def function(obstore, store, key):
            meta = obstore.head(store, key)
            return (int(meta["size"]), str(meta.get("e_tag") or "")), 0
        size, etag = self._call(url, "HEAD", function)
        if not etag:
            raise RemoteError(f"{url}: the store gives no ETag, so a replaced object could not be told from the "
                              f"one described; shmloader needs stores that give ETags (S3 and S3-compatible do)")
        return size, etag

    def list(self, url: str) -> list[tuple[str, int, str]]:
        """(URL, size, ETag) of every object whose key starts with the URL's key, sorted.
        A key obstore cannot parse (a "." or ".." segment, an empty one: valid in S3) fails
        the whole listing page it is in, so it cannot be skipped: it is named instead."""
        bucket, prefix = split_url(url)

        def function(obstore, store, key):
            from obstore.exceptions import InvalidPathError

            try:
                found = [(f"s3://{bucket}/{item['path']}", int(item["size"]), str(item.get("e_tag") or ""))
                         for batch in obstore.list(store, prefix=key or None) for item in batch]
            except InvalidPathError as error:
                match = _UNPARSABLE.search(str(error))
                named = f"s3://{bucket}/{match.group(1)}" if match else _first_line(error)
                raise RemoteError(f"{url}: listing it met the key {named}, which the object-store client (obstore) "
                                  f"cannot read (a '.', '..' or empty path segment), and which hides every object "
                                  f"listed with it; rename or delete that key, or name objects by their URLs "
                                  f"instead of a glob or a ragged directory") from None
            return sorted(found), 0
        return self._call(url, "LIST", function)

    def stream(self, url: str, etag: str, start: int, end: int, size: int | None, receive) -> None:
        """Bytes [start, end) of the object as it was when its ETag was `etag` (and its size
        `size`), handed to `receive(offset, view)` in order as they arrive (`offset` from
        `start`; `view` valid during the call only). The answer's own ETag, size and range
        are checked first: a store or a proxy that ignores If-Match would otherwise serve
        another object's bytes. A request tried again starts over: its first call has offset
        0 again. An exception `receive` raises ends the request at once and is raised as it
        is (no retry)."""
        def function(obstore, store, key):
            result = obstore.get(store, key, options={"range": (start, end), "if_match": etag})
            _check_answer(url, etag, size, (start, end), result.meta, result.range)
            received = 0
            # Bounded: every piece holds at least a byte, and no more than were asked for arrive.
            for piece in result.stream(min_chunk_size=STREAM_PIECE_BYTES):
                view = memoryview(piece)
                if received + view.nbytes > end - start:
                    raise OSError(f"the server sent more than the {end - start} bytes asked for")
                try:
                    receive(received, view)
                except BaseException as error:
                    raise _Received(error) from None
                received += view.nbytes
            if received != end - start:
                raise OSError(f"the server sent {received} bytes of the {end - start} asked for")
            return None, received
        try:
            self._call(url, f"GET bytes {start}-{end}", function)
        except _Received as wrapped:
            self._count(1, 0, 0)  # Made, and given up on by its receiver.
            raise wrapped.error from None

    def put_file(self, url: str, path: str) -> None:
        """Uploads a file (multipart where it is large: the object appears only when whole)."""
        size = os.path.getsize(path)

        def function(obstore, store, key):
            obstore.put(store, key, pathlib.Path(path))
            return None, size
        self._call(url, "PUT", function)

    def delete(self, url: str) -> None:
        def function(obstore, store, key):
            obstore.delete(store, key)
            return None, 0
        self._call(url, "DELETE", function)


class _Received(Exception):
    """What a stream's receiver raised, carried past the retries of Client._call (an
    OSError of the receiver's own, a full disk, is no failing request)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _check_answer(url: str, etag: str, size: int | None, wanted: tuple[int, int], meta, answered) -> None:
    """Refuses a GET's answer that is not of the object the run described: another ETag,
    another size, or another byte range than the one asked for (its Content-Range)."""
    found_etag, found_size = str(meta.get("e_tag") or ""), int(meta["size"])
    if found_etag != etag or (size is not None and found_size != size):
        raise RemoteError(f"{url} changed since the loader described it: the store answered with ETag {found_etag} "
                          f"and {found_size} bytes, not ETag {etag} and {size} bytes (a store or proxy that ignores "
                          f"If-Match served the new object). Restart the loader to read the new object, or write "
                          f"new data under new keys")
    if tuple(answered) != tuple(wanted):
        raise RemoteError(f"{url}: asked for bytes {wanted[0]}-{wanted[1]}, the store answered with bytes "
                          f"{answered[0]}-{answered[1]} (its Content-Range); refusing them rather than serving "
                          f"other bytes")


_UNPARSABLE = re.compile(r'Error parsing Path "((?:[^"\\]|\\.)*)"')


_STATUS = re.compile(r"status code: (\d{3})")


_USER_INFO = re.compile(r"(://)[^/@\s]*@")


def _first_line(error: BaseException) -> str:
    """The first line of a client's error, without the user and password a URL in it may
    carry."""
    text = str(error).strip().splitlines()
    return _USER_INFO.sub(r"\1<redacted>@", text[0][:300]) if text else type(error).__name__

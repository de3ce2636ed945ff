"""Downloads into the node cache are written as their bytes arrive (store.Client.stream,
cache.CachedObject._download_run), with no request-sized buffer: each page's digest is the
low 32 bits of XXH3-64 of its bytes (the xxhash package's) whatever pieces they came in; a request cut short mid-body is tried again
from its first byte; an error of the receiver (a full disk) is raised at once, not retried;
and what a download wrote before it failed, or before its object was closed, is given back
(no stamp vouches for it, so the ledger does not count it). A stand-in server on 127.0.0.1
for the store's side."""

from __future__ import annotations

import email.utils
import errno
import http.server
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_invariants import _Store, cached_copy

from shmloader.remote.cache import create_object, open_object
from shmloader.remote.node import node_cache
from shmloader.remote.pages import CACHE_PAGE_BYTES, RunDigests

xxhash = pytest.importorskip("xxhash")

_ETAG = '"the-etag"'


@settings(max_examples=60, deadline=None)
@given(run_bytes=st.integers(1, 5 * CACHE_PAGE_BYTES), cuts=st.lists(st.integers(1, 3 * CACHE_PAGE_BYTES), max_size=12),
       restart_after=st.integers(0, 6), seed=st.integers(0, 2**32 - 1))
def test_page_digests_from_pieces_of_any_size_are_each_page_s_xxh3(run_bytes, cuts, restart_after, seed):
    data = np.random.default_rng(seed).integers(0, 256, run_bytes, dtype=np.uint8).tobytes()
    checksums = RunDigests(run_bytes)

    def pieces():
        offset, index = 0, 0
        while offset < run_bytes:  # Bounded: every piece holds a byte at least.
            size = cuts[index % len(cuts)] if cuts else run_bytes
            yield offset, memoryview(data)[offset:offset + size]
            offset, index = offset + size, index + 1

    for count, (offset, view) in enumerate(pieces()):  # A request that failed part-way...
        if count == restart_after:
            break
        checksums.add(offset, view)
    for offset, view in pieces():  # ...and the one that tried again from its first byte.
        checksums.add(offset, view)
    assert checksums.finish().tolist() == _digests(data)


def _digests(data: bytes) -> list[int]:
    """The reference: each page's low 32 bits of XXH3-64 (seed 0)."""
    return [xxhash.xxh3_64_intdigest(data[start:start + CACHE_PAGE_BYTES]) & 0xFFFFFFFF
            for start in range(0, len(data), CACHE_PAGE_BYTES)]


# The node cache's side, with stand-in clients.

@pytest.fixture
def copy(tmp_path):
    view, found, data = cached_copy(tmp_path, 40 * CACHE_PAGE_BYTES + 123, seed=3)
    yield found, data
    view.close()


def _disk_bytes(found) -> int:
    return os.stat(found.path).st_blocks * 512


class _FailingStore(_Store):
    """Streams `pieces` pieces of each request, then fails as a dropped connection would."""

    def __init__(self, data: bytes, pieces: int) -> None:
        super().__init__(data)
        self.pieces = pieces

    def stream(self, url, etag, start, stop, size, receive):
        for count, offset in enumerate(range(0, stop - start, self.PIECE_BYTES)):
            if count == self.pieces:
                raise OSError(errno.ECONNRESET, "the connection was reset mid-body")
            receive(offset, memoryview(self.data)[start + offset:min(stop, start + offset + self.PIECE_BYTES)])


def test_a_download_that_fails_part_way_leaves_no_byte_on_disk_and_the_next_one_is_right(copy):
    found, data = copy
    held = found.cache.counters()["bytes_held"]
    found.client = _FailingStore(data, pieces=20)  # About 140 KB of the request written first.
    with pytest.raises(OSError, match="reset mid-body"):
        found.pin(np.array([0]), np.array([len(data)]))
    found.unpin()
    assert not found.stamps.any()
    assert _disk_bytes(found) == 0  # What it wrote was given back: the ledger counts none of it.
    assert found.cache.counters()["bytes_held"] == held
    found.client = _Store(data)
    found.pin(np.array([0]), np.array([len(data)]))
    found.unpin()
    with open(found.path, "rb") as handle:
        assert handle.read() == data
    assert found.checksums.tolist() == _digests(data)


class _HeldStore(_Store):
    """Streams one piece, then waits for `go` before the rest; records what receive raised."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.first, self.go, self.raised = threading.Event(), threading.Event(), []

    def stream(self, url, etag, start, stop, size, receive):
        receive(0, memoryview(self.data)[start:start + self.PIECE_BYTES])
        self.first.set()
        assert self.go.wait(30)
        try:
            receive(self.PIECE_BYTES, memoryview(self.data)[start + self.PIECE_BYTES:stop])
        except BaseException as error:
            self.raised.append(error)
            raise


def test_closing_an_object_mid_download_gives_back_what_it_wrote_and_stops_its_writes(copy):
    found, data = copy
    found.client = store = _HeldStore(data)
    fill = threading.Thread(target=lambda: found.prefetch(np.array([0]), np.array([len(data)]), throttled=False))
    fill.start()
    assert store.first.wait(30)
    assert _disk_bytes(found) > 0
    found.close()
    assert _disk_bytes(found) == 0  # The written piece, which no stamp vouches for, given back.
    store.go.set()
    fill.join(30)
    deadline = time.monotonic() + 30
    while not store.raised and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.raised, "the download wrote on after its object closed"
    assert os.stat(found.path).st_blocks == 0


# The client's side, against a stand-in server.

class _Server(http.server.ThreadingHTTPServer):
    """Serves one object at /bucket/key: ranged GETs with its ETag; the first `cut` GETs send
    half their body and close the connection."""

    daemon_threads = True

    def __init__(self, data: bytes, cut: int) -> None:
        self.data, self.cut, self.gets = data, cut, 0
        super().__init__(("127.0.0.1", 0), _Handler)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name.
        server = self.server
        first, _, last = self.headers["Range"][len("bytes="):].partition("-")
        start, end = int(first), int(last) + 1
        server.gets += 1
        self.send_response(206)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(server.data)}")
        self.send_header("ETag", _ETAG)
        self.send_header("Last-Modified", email.utils.formatdate(usegmt=True))
        self.end_headers()
        if server.gets <= server.cut:
            self.wfile.write(server.data[start:start + (end - start) // 2])
            self.close_connection = True
            return
        self.wfile.write(server.data[start:end])

    def log_message(self, *arguments) -> None:
        pass


@pytest.fixture
def serve():
    servers = []

    def start(data: bytes, cut: int = 0) -> _Server:
        server = _Server(data, cut)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _client(server, counts):
    from shmloader.remote.store import Client

    options = {"endpoint": server.endpoint, "access_key_id": "x", "secret_access_key": "y", "region": "us-east-1"}
    return Client(options, lambda requests, size, retries: counts.append((requests, size, retries)))


def test_a_request_cut_short_mid_body_is_tried_again_from_its_first_byte(serve):
    data = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    server, counts, received = serve(data, cut=1), [], bytearray(len(data))
    starts = []

    def receive(offset, view):
        if offset == 0:
            starts.append(offset)
        received[offset:offset + view.nbytes] = view

    _client(server, counts).stream("s3://bucket/key", _ETAG, 0, len(data), len(data), receive)
    assert bytes(received) == data
    assert len(starts) == 2  # The cut request's pieces, then the whole answer again from offset 0.
    assert counts == [(1, len(data), 1)]  # One request counted, with its one retry.


def test_an_error_of_the_receiver_is_raised_at_once_not_retried(serve):
    data = bytes(range(256)) * 4096
    server, counts = serve(data), []

    def receive(offset, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    started = time.monotonic()
    with pytest.raises(OSError) as raised:
        _client(server, counts).stream("s3://bucket/key", _ETAG, 0, len(data), len(data), receive)
    assert raised.value.errno == errno.ENOSPC
    assert server.gets == 1 and counts == [(1, 0, 0)]
    assert time.monotonic() - started < 5  # Not the retry window (60 s).


def test_a_copy_whose_marker_names_no_digest_kind_is_fetched_anew_not_checked_page_by_page(copy):
    """A copy an older version made holds CRC-32s where the digests go: checked page by page
    every page would fail and be fetched alone; its marker says so, and the whole copy goes."""
    import json

    from shmloader.remote.pages import MARKER_SUFFIX

    found, data = copy
    found.client = _Store(data)
    found.pin(np.array([0]), np.array([len(data)]))
    found.unpin()
    held = found.cache.counters()["bytes_held"]
    with open(found.path + MARKER_SUFFIX) as handle:
        marker = json.load(handle)
    assert marker["digest"] == "xxh3-low32"
    del marker["digest"]
    with open(found.path + MARKER_SUFFIX, "w") as handle:
        json.dump(marker, handle)
    create_object(found.path, found.url, "etag", len(data), {})
    anew = open_object(found.cache, found.path, found.url)  # New files: this process opens them anew.
    assert anew is not found and not anew.stamps.any()  # Nothing of the old copy is served.
    assert _disk_bytes(anew) == 0
    assert found.cache.counters()["bytes_held"] <= held - len(data) // 4096 * 4096  # Its pages no longer counted.
    anew.client = _Store(data)
    anew.pin(np.array([0]), np.array([len(data)]))
    anew.unpin()
    assert anew.checksums.tolist() == _digests(data)

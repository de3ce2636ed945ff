"""The node cache shared by trainers that do not trust each other's settings, and the cache's
own metadata when it is damaged: each loader fetches with its own storage_options whoever
else uses the same copy, no text the package makes shows a credential, and a damaged
marker heals. Against moto's S3 server on 127.0.0.1, as test_object_store.py."""

from __future__ import annotations

import contextlib
import glob
import http.client
import http.server
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

pytest.importorskip("moto.server")
pytest.importorskip("obstore")
pytest.importorskip("boto3")

from test_object_store import serving  # noqa: E402

from shmloader import ReaderError, RemoteError, ShmDataLoader  # noqa: E402
from shmloader.errors import CacheError  # noqa: E402

pytestmark = pytest.mark.xdist_group("object_store")
_CREDENTIALS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


@pytest.fixture(scope="module")
def server():
    with serving() as found:
        yield found


def _upload_rows(server, tmp_path, key: str, rows: int = 60_000) -> tuple[np.ndarray, str]:
    values = np.arange(rows, dtype=np.int64)
    np.save(tmp_path / "rows.npy", values)
    return values, server.upload(str(tmp_path / "rows.npy"), key)


class _Refusing(http.server.ThreadingHTTPServer):
    """A store whose credentials allow HEAD and LIST but no read of an object's bytes (a
    GET with a Range): 403 AccessDenied, as S3 answers a key without s3:GetObject."""

    daemon_threads = True

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        super().__init__(("127.0.0.1", 0), _RefusingHandler)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"


class _RefusingHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.headers.get("Range"):
            body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            self.send_response(403)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._forward()

    def do_HEAD(self) -> None:
        self._forward()

    def _forward(self) -> None:
        headers = {name: value for name, value in self.headers.items() if name.lower() not in ("host", "connection")}
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=30)
        try:
            upstream.request(self.command, self.path, headers=headers)
            answer = upstream.getresponse()
            content = answer.read()
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(name, value)
            length = answer.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(content)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(content)
        finally:
            upstream.close()

    def log_message(self, *arguments) -> None:
        pass


@contextlib.contextmanager
def _refusing(server):
    proxy = _Refusing(server.port)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy.endpoint
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=10)


# Trainer B: opens the same object with its own storage_options, reads (or fails to), says
# so, and lives until told to go.
_OTHER_TRAINER = textwrap.dedent("""
    import json, sys
    from shmloader import ShmDataLoader
    url, cache, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    try:
        # Steps A has not read yet: their pages are not in the cache.
        with ShmDataLoader({"x": url}, cache_dir=cache, storage_options=options, batch_size=1000, readers=0,
                           mode="sequential", epochs=1, start_step=55) as loader:
            next(iter(loader))
        print("read", flush=True)
    except Exception as error:
        print("refused" if "access refused" in str(error) else f"other {type(error).__name__}: {error}", flush=True)
    sys.stdin.readline()
""")


def _kill_a_reader(loader) -> None:
    os.kill(loader.diagnostics.reader_pids[0], signal.SIGKILL)  # Restarted by the steps that follow.


@pytest.mark.parametrize("other_can_read", [False, True])
def test_each_trainer_s_readers_fetch_with_its_own_options_whoever_else_shares_the_cache(
        server, tmp_path, monkeypatch, other_can_read):
    import json

    values, url = _upload_rows(server, tmp_path, f"trainers/own-{other_can_read}.npy")
    for name in _CREDENTIALS:
        monkeypatch.delenv(name)  # Nobody fetches with the environment's: each with its storage_options.
    mine = {"endpoint": server.endpoint, "access_key_id": "trainer-a", "secret_access_key": "a-secret",
            "region": "us-east-1"}
    cache = tmp_path / "cache"
    # Steps of 1,000 rows with a budget of a few of them: later steps fetch after B came and went.
    with ShmDataLoader({"x": url}, cache_dir=cache, cache_bytes=256 << 10, storage_options=mine, batch_size=1000,
                       readers=1, mode="sequential", epochs=1) as loader:
        batches = iter(loader)
        rows = [np.array(next(batches)["x"])]
        with _refusing(server) as refusing:
            theirs = {**mine, "access_key_id": "trainer-b", "secret_access_key": "b-secret",
                      "endpoint": server.endpoint if other_can_read else refusing}
            other = subprocess.Popen([sys.executable, "-c", _OTHER_TRAINER, url, str(cache), json.dumps(theirs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy(),
                                     cwd=tmp_path)
            try:
                said = other.stdout.readline().decode().strip()
                assert said == ("read" if other_can_read else "refused"), said  # What its own options allow.
                _kill_a_reader(loader)  # B alive: a restarted reader of A must not take B's options.
                rows += [np.array(next(batches)["x"]) for _ in range(20)]
            finally:
                other.stdin.close()
                other.wait(timeout=60)
        _kill_a_reader(loader)  # B gone: nor follow it to a trainer that is no more.
        rows += [np.array(batch["x"]) for batch in batches]
    np.testing.assert_array_equal(np.concatenate(rows), values)


# No credential in any text the package makes.

_PLANTED = {"access_key_id": "AKIDPLANTED0001", "secret_access_key": "planted-secret-0002",
            "token": "planted-token-0003"}


def _texts_of(loader) -> list[str]:
    """Every text a user may print of a loader: reprs and strs of it, its options, stats,
    checkpoint and plan, its Prometheus metrics, and `shmloader top`."""
    texts = [repr(loader), str(loader), repr(loader.options), str(loader.options), repr(loader.stats()),
             repr(loader.state_dict()), repr(loader.plan)]
    with contextlib.suppress(ImportError):
        import prometheus_client

        from shmloader.metrics import register

        registry = prometheus_client.CollectorRegistry()
        register(loader, registry)
        texts.append(prometheus_client.generate_latest(registry).decode())
    import io

    from shmloader.tools.monitor import run

    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        run(once=True)
    texts.append(output.getvalue())
    return texts


def _texts_of_error(error: BaseException) -> list[str]:
    texts = []
    while error is not None:
        texts += [str(error), repr(error), repr(error.args)]
        error = error.__cause__ or error.__context__
    return texts


@pytest.mark.parametrize("readers", [0, 2])
def test_no_text_the_package_makes_shows_a_credential(server, tmp_path, monkeypatch, caplog, readers):
    import logging

    values, url = _upload_rows(server, tmp_path, f"trainers/planted-{readers}.npy")
    for name in _CREDENTIALS:
        monkeypatch.delenv(name)
    options = {"endpoint": server.endpoint, "region": "us-east-1", **_PLANTED}
    texts = []
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with ShmDataLoader({"x": url}, cache_dir=tmp_path / "cache", storage_options=options, batch_size=1000,
                           readers=readers, mode="sequential", epochs=1) as loader:
            batches = iter(loader)
            next(batches)
            texts += _texts_of(loader)
        texts += _texts_of(loader)  # Closed too.
        with _refusing(server) as refusing:  # A store that refuses them: the error names no credential.
            with pytest.raises((RemoteError, ReaderError)) as raised:
                with ShmDataLoader({"x": url}, cache_dir=tmp_path / "refused", readers=readers, batch_size=1000,
                                   storage_options={**options, "endpoint": refusing}) as loader:
                    next(iter(loader))
            texts += _texts_of_error(raised.value)
        with pytest.raises(Exception) as raised:  # A malformed endpoint.
            ShmDataLoader({"x": url}, cache_dir=tmp_path / "malformed", readers=readers,
                          storage_options={**options, "endpoint": "htp://x"})
        texts += _texts_of_error(raised.value)
    texts += [str(warning.message) for warning in warned] + [caplog.text]
    for secret in _PLANTED.values():
        shown = [text for text in texts if secret in text]
        assert not shown, (secret, shown[:1])


# Every wait on the store keeps the loader's deadline.

class _Stalling(_Refusing):
    """A store that answers HEAD, LIST and GETs of an object's first bytes (what the trainer
    reads to describe it), then never answers a GET of any other bytes."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.RequestHandlerClass = _StallingHandler
        self.released = threading.Event()


class _StallingHandler(_RefusingHandler):
    def do_GET(self) -> None:
        wanted = self.headers.get("Range") or ""
        if wanted and not wanted.startswith("bytes=0-"):
            self.server.released.wait(300)  # Headers never sent: the GET hangs.
            return
        self._forward()


_STALLED_TRAINER = textwrap.dedent("""
    import sys, time
    from shmloader import ShmDataLoader
    from shmloader.errors import StepTimeoutError
    url, cache, endpoint, readers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    loader = ShmDataLoader({"x": url}, cache_dir=cache, storage_options={"endpoint": endpoint}, batch_size=1000,
                           readers=readers, mode="sequential", start_step=20, step_timeout=1)
    started = time.monotonic()
    try:
        next(iter(loader))
        print("read", flush=True)
    except Exception as error:
        print(type(error).__name__, round(time.monotonic() - started, 2), flush=True)
    loader.close()
    print("closed", flush=True)
""")
# What a stalled store may add to step_timeout on a loaded machine (the wait itself ends
# within its polling interval, a few milliseconds).
_MARGIN_SECONDS = 10


@pytest.mark.parametrize("readers", [0, 2])
def test_a_stalled_store_ends_the_step_within_step_timeout_and_the_process_exits_after_close(
        server, tmp_path, readers):
    values, url = _upload_rows(server, tmp_path, f"trainers/stalled-{readers}.npy")
    proxy = _Stalling(server.port)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        child = subprocess.Popen([sys.executable, "-c", _STALLED_TRAINER, url, str(tmp_path / "cache"),
                                  proxy.endpoint, str(readers)], stdout=subprocess.PIPE, env=os.environ.copy(),
                                 cwd=tmp_path)
        try:
            kind, waited = child.stdout.readline().decode().split()
            assert kind == "StepTimeoutError" and float(waited) < 1 + _MARGIN_SECONDS, (kind, waited)
            assert child.stdout.readline().strip() == b"closed"
            closed = time.monotonic()
            child.wait(timeout=120)
            assert time.monotonic() - closed < _MARGIN_SECONDS  # Not after the stalled request's own timeout.
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:
        proxy.released.set()
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=10)


def test_a_malformed_endpoint_fails_at_once_naming_the_setting(server, tmp_path):
    values, url = _upload_rows(server, tmp_path, "trainers/malformed.npy")
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"storage_options\['endpoint'\] is 'htp://x', not an endpoint URL"):
        ShmDataLoader({"x": url}, cache_dir=tmp_path / "cache", readers=0, storage_options={"endpoint": "htp://x"})
    assert time.monotonic() - started < 30  # Not retried for the retry window (60 s).


# Damaged metadata heals, or is named with its remedy.

def _damage(marker: str, how: str) -> None:
    import json

    with open(marker) as handle:
        found = json.load(handle)
    content = {"empty": b"", "zeros": bytes(64), "no meta": json.dumps({k: v for k, v in found.items() if k != "meta"}).encode(),
               "wrong size": json.dumps({**found, "size": found["size"] + 8}).encode(),
               "not an object": b"[1, 2]"}[how]
    with open(marker, "wb") as handle:
        handle.write(content)


@pytest.mark.parametrize("how,readers", [("empty", 0), ("zeros", 2), ("no meta", 0), ("wrong size", 2),
                                         ("not an object", 0)])
def test_a_damaged_marker_is_discarded_with_a_warning_naming_it_and_the_object_fetched_again(
        server, tmp_path, how, readers):
    values, url = _upload_rows(server, tmp_path, "trainers/marker.npy", rows=20_000)
    cache = tmp_path / "cache"
    kwargs = dict(cache_dir=cache, batch_size=1000, readers=readers, mode="sequential", epochs=1)
    with ShmDataLoader({"x": url}, **kwargs) as loader:
        np.testing.assert_array_equal(np.concatenate([np.array(batch["x"]) for batch in loader]), values)
    (marker,) = glob.glob(os.path.join(str(cache), "objects", "*", "*", "marker.npy.remote.json"))
    _damage(marker, how)
    with pytest.warns(RuntimeWarning, match=rf"{marker}, the marker of the copy of {url} .* was damaged"):
        with ShmDataLoader({"x": url}, **kwargs) as loader:
            rows = np.concatenate([np.array(batch["x"]) for batch in loader])
            requests = loader.stats()["cache"]["requests"]
    np.testing.assert_array_equal(rows, values)
    assert requests > 0  # Fetched again: pages its marker did not vouch for are not served.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Healed: the run after says nothing.
        with ShmDataLoader({"x": url}, **kwargs) as loader:
            np.testing.assert_array_equal(np.concatenate([np.array(batch["x"]) for batch in loader]), values)


@pytest.mark.parametrize("which", ["", ".pages"])
def test_a_directory_in_place_of_a_cache_file_is_named_with_the_remedy(server, tmp_path, which):
    values, url = _upload_rows(server, tmp_path, "trainers/directory.npy", rows=20_000)
    cache = tmp_path / "cache"
    kwargs = dict(cache_dir=cache, batch_size=1000, readers=0, mode="sequential", epochs=1)
    with ShmDataLoader({"x": url}, **kwargs) as loader:
        next(iter(loader))
    (data,) = glob.glob(os.path.join(str(cache), "objects", "*", "*", "directory.npy"))
    os.unlink(data + which)
    os.mkdir(data + which)
    with pytest.raises(CacheError, match=rf"{data + which} is a directory where the node cache keeps a file: "
                                         rf"remove it"):
        ShmDataLoader({"x": url}, **kwargs)
    os.rmdir(data + which)  # The remedy it names.
    with ShmDataLoader({"x": url}, **kwargs) as loader:
        np.testing.assert_array_equal(np.concatenate([np.array(batch["x"]) for batch in loader]), values)


# One budget per node.

def _disk_bytes(root) -> int:
    return sum(os.lstat(os.path.join(directory, name)).st_blocks * 512
               for directory, _, names in os.walk(root) for name in names)


def test_the_smallest_budget_of_a_node_s_loaders_holds_whoever_starts_last(server, tmp_path):
    values, url = _upload_rows(server, tmp_path, "trainers/budget.npy", rows=400_000)  # 3.2 MB
    cache, budget = tmp_path / "cache", 512 << 10
    kwargs = dict(cache_dir=cache, batch_size=10_000, mode="sequential", epochs=1)
    with ShmDataLoader({"x": url}, cache_bytes=budget, readers=0, **kwargs) as small:
        next(iter(small))
        with pytest.warns(RuntimeWarning, match=rf"the node cache's budget is {budget} bytes, below this loader's"):
            ShmDataLoader({"x": url}, cache_bytes=budget * 4, readers=0, **kwargs).close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # A default budget (half the free disk) is lowered in silence.
            large = ShmDataLoader({"x": url}, readers=2, **kwargs)
        with large:
            rows = np.concatenate([np.array(batch["x"]) for batch in large])
            assert large.stats()["cache"]["bytes_budget"] == budget
    np.testing.assert_array_equal(rows, values)
    assert _disk_bytes(cache) <= budget, (_disk_bytes(cache), budget)


def test_the_budget_bounds_every_file_the_cache_keeps_after_close(server, tmp_path):
    # Small objects: their pages files and markers are most of their disk, and a glob keeps
    # each open for the whole run; once closed, the budget holds for every file.
    budget, count = 256 << 10, 40
    for k in range(count):
        np.save(tmp_path / "small.npy", np.full(10, k, dtype=np.int64))
        server.upload(str(tmp_path / "small.npy"), f"trainers/small/{k:03d}.npy")
    url = "s3://shmloader-tests/trainers/small/*.npy"
    cache = tmp_path / "cache"
    for replaced in (False, True):
        if replaced:  # New ETags: the old copies' directories are the budget's too.
            for k in range(count):
                np.save(tmp_path / "small.npy", np.full(10, -k, dtype=np.int64))
                server.upload(str(tmp_path / "small.npy"), f"trainers/small/{k:03d}.npy")
        with ShmDataLoader({"x": url}, cache_dir=cache, cache_bytes=budget, batch_size=10 * count, readers=0,
                           mode="sequential", epochs=1) as loader:
            (batch,) = list(loader)
        np.testing.assert_array_equal(np.sort(np.array(batch["x"])),
                                      np.sort(np.repeat(np.arange(count) * (-1 if replaced else 1), 10)))
        assert _disk_bytes(cache) <= budget, (replaced, _disk_bytes(cache), budget)

"""The node cache serves only bytes it can vouch for and only files its user made: a copy
truncated or altered between runs is fetched again, a store that ignores If-Match is caught
by the ETag of its answers, a planted link or a directory of another user is refused, no
credential reaches the disk, a full file system is an error naming cache_dir (never a
SIGBUS), the budget covers the cache's own files, and keys the client or the file system
cannot take as they are, or a hung server, get errors that say what happened. Against
moto's S3 server on 127.0.0.1, as test_object_store.py."""

from __future__ import annotations

import contextlib
import glob
import http.client
import http.server
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

pytest.importorskip("moto.server")
pytest.importorskip("obstore")
pytest.importorskip("boto3")

from test_object_store import BUCKET, serving  # noqa: E402

from shmloader import Packed, ReaderError, RemoteError, ShmDataLoader  # noqa: E402
from shmloader.remote.pages import CACHE_PAGE_BYTES  # noqa: E402

pytestmark = pytest.mark.xdist_group("object_store")


@pytest.fixture(scope="module")
def server():
    with serving() as found:
        yield found


def _upload_rows(server, tmp_path, key: str, rows: int = 200_000) -> tuple[np.ndarray, str]:
    values = np.arange(rows, dtype=np.int64)
    np.save(tmp_path / "rows.npy", values)
    return values, server.upload(str(tmp_path / "rows.npy"), key)


def _read_all(url: str, cache, **kwargs) -> tuple[np.ndarray, int]:
    """Every row of `url` in order, and the requests the pass made."""
    with ShmDataLoader({"x": url}, cache_dir=cache, batch_size=10_000, mode="sequential", readers=0, epochs=1,
                       **kwargs) as loader:
        rows = np.concatenate([np.array(batch["x"]) for batch in loader])
        return rows, loader.stats()["cache"]["requests"]


def _copy_of(cache, name: str) -> str:
    (path,) = glob.glob(os.path.join(str(cache), "objects", "*", "*", name))
    return path


# A copy changed between runs.

def test_a_cache_file_truncated_between_runs_is_fetched_again_not_read_as_zeros(server, tmp_path):
    values, url = _upload_rows(server, tmp_path, "hardening/truncated.npy")
    cache = tmp_path / "cache"
    rows, requests = _read_all(url, cache)
    np.testing.assert_array_equal(rows, values)
    os.truncate(_copy_of(cache, "truncated.npy"), values.nbytes // 2)
    rows, requests = _read_all(url, cache)
    np.testing.assert_array_equal(rows, values)
    assert requests > 0


def test_flipped_bytes_in_a_cached_page_are_fetched_again_not_served(server, tmp_path):
    values, url = _upload_rows(server, tmp_path, "hardening/flipped.npy")
    cache = tmp_path / "cache"
    _read_all(url, cache)
    with open(_copy_of(cache, "flipped.npy"), "r+b") as handle:
        handle.seek(800_000)
        flipped = bytes(byte ^ 0xFF for byte in handle.read(16))
        handle.seek(800_000)
        handle.write(flipped)
    rows, requests = _read_all(url, cache)
    np.testing.assert_array_equal(rows, values)
    assert requests > 0
    _, requests = _read_all(url, cache)  # Fetched again and stamped: trusted from now on.
    assert requests == 0


# A store that ignores If-Match.

class _Proxy(http.server.ThreadingHTTPServer):
    """An HTTP proxy on 127.0.0.1 in front of the store that drops the headers named in
    `dropped` from every request (as some S3-compatible servers and proxies ignore If-Match)."""

    daemon_threads = True

    def __init__(self, upstream_port: int, dropped: tuple[str, ...]) -> None:
        self.upstream_port, self.dropped = upstream_port, dropped
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {name: value for name, value in self.headers.items()
                   if name.lower() not in self.server.dropped + ("host", "connection")}
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=30)
        try:
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            content = answer.read()
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(name, value)
            length = answer.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(content)))  # A HEAD's: the object's.
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(content)
        finally:
            upstream.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    def log_message(self, *arguments) -> None:
        pass


@contextlib.contextmanager
def _proxy(server, dropped: tuple[str, ...]):
    proxy = _Proxy(server.port, dropped)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy.endpoint
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=10)


def test_a_store_that_ignores_if_match_cannot_serve_a_replaced_object(server, tmp_path):
    values, url = _upload_rows(server, tmp_path, "hardening/ignored.npy")
    with _proxy(server, dropped=("if-match",)) as endpoint:
        options = {"endpoint": endpoint, "access_key_id": "test", "secret_access_key": "test", "region": "us-east-1"}
        # A budget below the object: its last pages are fetched after it is replaced.
        with ShmDataLoader({"x": url}, cache_dir=tmp_path / "cache", cache_bytes=1 << 20, storage_options=options,
                           batch_size=10_000, mode="sequential", readers=0, epochs=1) as loader:
            batches = iter(loader)
            np.testing.assert_array_equal(next(batches)["x"], values[:10_000])
            np.save(tmp_path / "rows.npy", values[::-1].copy())  # The same size, other rows.
            server.upload(str(tmp_path / "rows.npy"), "hardening/ignored.npy")
            with pytest.raises((ReaderError, RemoteError), match="ignored.npy changed since the loader described it: "
                                                                  "the store answered with ETag"):
                for step, batch in enumerate(batches, start=1):
                    np.testing.assert_array_equal(batch["x"], values[step * 10_000:(step + 1) * 10_000])


# The cache is its user's own.

def _modes(root) -> dict[str, int]:
    found = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = os.path.join(directory, name)
            found[os.path.relpath(path, root)] = os.lstat(path).st_mode & 0o777
    return found


@pytest.mark.parametrize("umask", [0, 0o022])  # 0o022: the usual one, which left cache_dir listable by all.
def test_the_cache_is_made_private_whatever_the_umask(server, tmp_path, umask):
    values, url = _upload_rows(server, tmp_path, "hardening/umask.npy", rows=20_000)
    cache = tmp_path / "cache"
    previous = os.umask(umask)
    try:
        rows, _ = _read_all(url, cache)
    finally:
        os.umask(previous)
    np.testing.assert_array_equal(rows, values)
    assert os.stat(cache).st_mode & 0o777 == 0o700
    modes = _modes(cache)
    assert modes and all(mode & 0o077 == 0 for mode in modes.values()), modes


def test_a_cache_dir_of_another_user_or_writable_by_others_is_refused(server, tmp_path):
    from shmloader.errors import CacheError

    _, url = _upload_rows(server, tmp_path, "hardening/owner.npy", rows=1000)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(CacheError, match=f"cache_dir {theirs} belongs to another user"):
        ShmDataLoader({"x": url}, cache_dir=theirs, batch_size=10, readers=0)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "planted").write_bytes(b"x")
    os.chmod(shared, 0o777)
    with pytest.raises(CacheError, match=f"cache_dir {shared} may be written by others"):
        ShmDataLoader({"x": url}, cache_dir=shared, batch_size=10, readers=0)


def test_a_link_planted_in_the_cache_is_never_followed(server, tmp_path):
    from shmloader.errors import CacheError

    values, url = _upload_rows(server, tmp_path, "hardening/planted.npy", rows=20_000)
    cache = tmp_path / "cache"
    _read_all(url, cache)
    copy = _copy_of(cache, "planted.npy")
    victim = tmp_path / "victim"
    victim.write_bytes(b"a file the loader must neither read nor change")
    os.chmod(victim, 0o600)
    for planted in (copy, copy + ".pages"):
        os.replace(planted, planted + ".moved")
        os.symlink(victim, planted)
        with pytest.raises(CacheError, match=f"{planted} is a symbolic link"):
            _read_all(url, cache)
        assert victim.read_bytes() == b"a file the loader must neither read nor change"
        os.replace(planted + ".moved", planted)
    # A directory of the copy replaced by a link to one holding a copy of someone else's.
    version = os.path.dirname(copy)
    elsewhere = tmp_path / "elsewhere"
    os.rename(version, elsewhere)
    os.symlink(elsewhere, version)
    with pytest.raises(CacheError, match=f"{version} is not a directory of this user"):
        _read_all(url, cache)


# A full file system.

@contextlib.contextmanager
def _small_file_system(path, size: str):
    """A tmpfs of `size` mounted at `path` (the tests run as root), unmounted after."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill_up(directory) -> None:
    descriptor = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            for _ in range(1 << 16):  # A tmpfs of a few pages is full long before.
                os.write(descriptor, bytes(4096))
    finally:
        os.close(descriptor)


_OPEN_LOADER = textwrap.dedent("""
    import sys
    from shmloader import ShmDataLoader
    try:
        with ShmDataLoader({"x": sys.argv[1]}, cache_dir=sys.argv[2], cache_bytes=1 << 20, batch_size=10_000,
                           mode="sequential", readers=0, epochs=1) as loader:
            for batch in loader:
                pass
    except Exception as error:
        print(type(error).__name__, error)
""")


def _open_loader_in_a_child(url: str, cache) -> subprocess.CompletedProcess:
    """A loader run in a child process: a SIGBUS there fails the test instead of ending it."""
    return subprocess.run([sys.executable, "-c", _OPEN_LOADER, url, str(cache)], capture_output=True, text=True,
                          timeout=60, env=os.environ.copy(), cwd=str(cache.parent))


def test_a_full_file_system_under_cache_dir_is_an_error_naming_it_not_a_sigbus(server, tmp_path):
    _, url = _upload_rows(server, tmp_path, "hardening/full.npy", rows=1000)
    with _small_file_system(tmp_path / "small", "64k") as small:
        cache = small / "cache"
        cache.mkdir(mode=0o700)
        (cache / "objects").mkdir(mode=0o700)
        _fill_up(small)
        child = _open_loader_in_a_child(url, cache)
        assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
        assert f"CacheError cache_dir {cache}: its file system is full" in child.stdout
        assert "lower cache_bytes" in child.stdout  # The ledger comes before the budget: the setting, named.


def test_a_file_system_that_fills_while_pages_arrive_is_an_error_naming_cache_dir(server, tmp_path):
    _, url = _upload_rows(server, tmp_path, "hardening/filling.npy")  # 1.6 MB: more than the file system.
    with _small_file_system(tmp_path / "small", "256k") as small:
        child = _open_loader_in_a_child(url, small / "cache")
        assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
        assert f"cache_dir {small / 'cache'}: its file system is full" in child.stdout, child.stdout
        assert "cache_bytes=1048576" in child.stdout


# Credentials.

def test_no_credential_of_storage_options_reaches_the_cache_directory(server, tmp_path, monkeypatch):
    values, url = _upload_rows(server, tmp_path, "hardening/secret.npy", rows=30_000)
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(name)  # The readers fetch with the options' credentials or not at all.
    secrets = {"access_key_id": "AKIDNOTONDISK0001", "secret_access_key": "s3cr3t-not-on-disk-0002",
               "token": "session-token-not-on-disk-0003"}
    options = {"endpoint": server.endpoint, "region": "us-east-1", **secrets}
    with ShmDataLoader({"x": url}, cache_dir=tmp_path / "cache", storage_options=options, batch_size=1000,
                       readers=2, mode="sequential", epochs=1) as loader:
        rows = np.concatenate([np.array(batch["x"]) for batch in loader])
    np.testing.assert_array_equal(rows, values)
    for directory, _, names in os.walk(tmp_path / "cache"):
        for name in names:
            with open(os.path.join(directory, name), "rb") as handle:
                content = handle.read()
            for secret in secrets.values():
                assert secret.encode() not in content, (name, secret)


# The budget covers what the cache writes.

def _disk_bytes(root) -> int:
    return sum(os.lstat(os.path.join(directory, name)).st_blocks * 512
               for directory, _, names in os.walk(root) for name in names)


def test_the_budget_covers_the_cache_s_own_files_and_short_pages(server, tmp_path):
    from shmloader.remote.node import NodeCache

    # Small objects: their pages files, markers and short last pages are most of the disk
    # they take, which a budget of their pages alone would not see.
    for index in range(20):
        np.save(tmp_path / "small.npy", np.full((10, 256), index, dtype=np.int64))
        server.upload(str(tmp_path / "small.npy"), f"hardening/small/part-{index:02d}.npy")
    budget, cache = 256 << 10, tmp_path / "cache"
    with ShmDataLoader({"x": f"s3://{BUCKET}/hardening/small/part-*.npy"}, cache_dir=cache, cache_bytes=budget,
                       batch_size=10, mode="sequential", readers=0, epochs=1) as loader:
        peak = 0
        for step, batch in enumerate(loader):
            assert (np.asarray(batch["x"]) == step).all()
            peak = max(peak, _disk_bytes(cache))
    pinned = 2 * 2 * CACHE_PAGE_BYTES  # A batch's rows span two objects' pages at most.
    assert peak <= budget + pinned, (peak, budget)
    view = NodeCache(str(cache))  # Counted anew from what is on disk.
    try:
        assert _disk_bytes(cache) <= view.counters()["bytes_held"]  # Everything on disk is counted.
    finally:
        view.close()


_KILLED_DOWNLOAD = textwrap.dedent("""
    import os, sys
    from shmloader.remote.cache import create_object
    from shmloader.remote.node import node_cache
    from shmloader.remote.pages import CACHE_PAGE_BYTES
    path = sys.argv[1]
    node_cache(sys.argv[2])
    create_object(path, "s3://bucket/killed.npy", "etag", 10 * CACHE_PAGE_BYTES, {})
    descriptor = os.open(path, os.O_WRONLY)
    os.pwrite(descriptor, bytes(range(256)) * 64 * 6, 3 * CACHE_PAGE_BYTES)   # Pages written...
    os._exit(0)                                                              # ...never stamped.
""")


def test_bytes_a_killed_download_wrote_are_given_back_when_the_cache_is_next_counted(tmp_path):
    from shmloader.remote.node import NodeCache

    root = tmp_path / "cache"
    path = root / "objects" / "url" / "version" / "killed.npy"
    child = subprocess.run([sys.executable, "-c", _KILLED_DOWNLOAD, str(path), str(root)], cwd=tmp_path)
    assert child.returncode == 0
    assert os.stat(path).st_blocks * 512 >= 6 * CACHE_PAGE_BYTES
    cache = NodeCache(str(root))  # No other process uses it: counted anew.
    try:
        assert os.stat(path).st_blocks == 0
        assert cache.counters()["bytes_held"] >= _disk_bytes(root)
    finally:
        cache.close()


# Keys the client or the file system cannot take as they are.

def test_a_key_the_client_cannot_parse_is_named_in_a_clear_error(server, tmp_path):
    np.save(tmp_path / "a.npy", np.arange(100))
    server.upload(str(tmp_path / "a.npy"), "hardening/odd/a.npy")
    kwargs = dict(cache_dir=tmp_path / "cache", batch_size=10, readers=0)
    for junk in ("./junk", "x/../junk"):
        server.client.put_object(Bucket=BUCKET, Key=f"hardening/odd/{junk}", Body=b"not for the loader")
        with pytest.raises(RemoteError, match=f"met the key s3://{BUCKET}/hardening/odd/{junk}, which the "
                                              f"object-store client \\(obstore\\) cannot read") as raised:
            ShmDataLoader({"x": f"s3://{BUCKET}/hardening/odd/*.npy"}, **kwargs)
        assert "Debug source" not in str(raised.value)
        server.client.delete_object(Bucket=BUCKET, Key=f"hardening/odd/{junk}")
    server.client.put_object(Bucket=BUCKET, Key="hardening/odd/docs/./junk", Body=b"not for the loader")
    with pytest.raises(RemoteError, match=f"met the key s3://{BUCKET}/hardening/odd/docs/\\./junk"):
        ShmDataLoader({"x": Packed(f"s3://{BUCKET}/hardening/odd/docs")}, **kwargs)


def test_a_key_too_long_for_a_file_name_gets_a_bounded_name_in_the_cache(tmp_path):
    from shmloader.remote.cache import cached_name, create_object, open_object
    from shmloader.remote.node import acquire, release

    long_names = [f"s3://{BUCKET}/keys/{'x' * 300}{tail}.npy" for tail in ("-one", "-two")]
    names = [cached_name(url) for url in long_names]
    assert names[0] != names[1]
    assert all(len(name.encode()) <= 160 and name.endswith(".npy") for name in names)
    assert cached_name(f"s3://{BUCKET}/keys/short.npy") == "short.npy"
    assert cached_name(f"s3://{BUCKET}/keys/") == "object"
    root = str(tmp_path / "cache")
    cache = acquire(root)
    try:
        path = os.path.join(root, "objects", "url", "version", names[0])
        create_object(path, long_names[0], "etag", 3 * CACHE_PAGE_BYTES, {})  # No "File name too long".
        assert open_object(cache, path, long_names[0]).size == 3 * CACHE_PAGE_BYTES
    finally:
        release(cache)


def test_a_hung_server_s_error_says_how_long_it_really_waited(monkeypatch):
    import re
    import socket
    import time

    from shmloader.remote import store

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # Connections complete in the kernel's backlog; no answer ever comes.
    try:
        monkeypatch.setattr(store, "RETRY_SECONDS", 0.3)
        monkeypatch.setattr(store, "_CLIENT_OPTIONS", {"timeout": "1s", "connect_timeout": "1s"})
        options = {"endpoint": f"http://127.0.0.1:{hung.getsockname()[1]}", "access_key_id": "x",
                   "secret_access_key": "y", "region": "us-east-1"}
        started = time.monotonic()
        with pytest.raises(RemoteError) as raised:
            store.Client(options).stream(f"s3://{BUCKET}/hung.npy", "etag", 0, 10, None, lambda offset, view: None)
        elapsed = time.monotonic() - started
    finally:
        hung.close()
    message = str(raised.value)
    retries = int(re.search(r"after (\d+) retries", message).group(1))
    waited = float(re.search(r"over (\d+(?:\.\d+)?) s", message).group(1))
    assert 0.9 <= waited <= elapsed + 0.1, message  # The time each request hung, not the retry setting.
    assert retries == 0, message  # The first request outlived the retry window alone.

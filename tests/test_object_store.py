"""Fields in object storage: an S3-compatible server on 127.0.0.1 that these tests start
(moto's server mode), every field kind read from s3:// against the same local files read
directly, the node cache's budget and sharing, and the store's faults."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import zlib

import numpy as np
import pytest

moto_server = pytest.importorskip("moto.server")
pytest.importorskip("obstore")
boto3 = pytest.importorskip("boto3")

from conftest import our_shm_entries  # noqa: E402

from shmloader import (  # noqa: E402
    Packed,
    Padded,
    ReaderError,
    RemoteError,
    ShmDataLoader,
    Source,
    Windows,
)
from shmloader.remote.cache import pages_of
from shmloader.remote.pages import CACHE_PAGE_BYTES  # noqa: E402
from shmloader.tools.convert import write_ragged  # noqa: E402

pytestmark = pytest.mark.xdist_group("object_store")
BUCKET = "shmloader-tests"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """moto's S3 server on 127.0.0.1 (its objects live in this process: a restart keeps them)."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.start()
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                   aws_access_key_id="test", aws_secret_access_key="test")
        self.client.create_bucket(Bucket=BUCKET)

    def start(self) -> None:
        self._server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def upload(self, local: str, key: str) -> str:
        """Uploads a file, or a directory's files under key/, and returns the URL."""
        if os.path.isdir(local):
            for name in sorted(os.listdir(local)):
                self.client.upload_file(os.path.join(local, name), BUCKET, f"{key}/{name}")
        else:
            self.client.upload_file(local, BUCKET, key)
        return f"s3://{BUCKET}/{key}"


@contextlib.contextmanager
def serving():
    """A moto server on 127.0.0.1, with the environment (which readers inherit) pointing at
    it while the block runs."""
    found = Server()
    environment = {"AWS_ENDPOINT_URL": found.endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                   "AWS_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        yield found
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        found.stop()


@pytest.fixture(scope="module")
def server():
    with serving() as found:
        yield found


def _b2nd(path, array, chunks, blocks, codec=None):
    import blosc2

    cparams = {} if codec is None else {"codec": getattr(blosc2.Codec, codec), "clevel": 5}
    blosc2.asarray(np.ascontiguousarray(array), urlpath=str(path), mode="w", chunks=chunks, blocks=blocks,
                   cparams=cparams)
    return str(path)


@pytest.fixture(scope="module")
def data(server, tmp_path_factory):
    """One data set of every field kind, local and uploaded: {name: (local, url)}."""
    root = tmp_path_factory.mktemp("object-store-data")
    rng = np.random.default_rng(20261201)
    rows = 1500
    found = {}
    images = rng.integers(0, 255, size=(rows, 6, 5), dtype=np.uint8)
    found["image"] = _b2nd(root / "image.b2nd", images, (128, 6, 5), (16, 6, 5), "ZSTD")
    found["label"] = str(root / "label.npy")
    np.save(found["label"], rng.integers(0, 1000, size=rows).astype(np.int64))
    lengths = rng.integers(0, 300, size=rows)
    lengths[rng.integers(0, rows, size=20)] = 0
    write_ragged(root / "docs.ragged", [rng.integers(0, 50_000, size=n, dtype=np.int32) for n in lengths])
    found["docs"] = str(root / "docs.ragged")
    stream = rng.integers(0, 60_000, size=rows * 33 + 1).astype(np.uint16)
    found["stream"] = str(root / "stream.npy")
    np.save(found["stream"], stream)
    for part in range(3):  # A glob of shards of uneven length.
        count = (400, 650, 450)[part]
        _b2nd(root / f"shard-{part}.b2nd", rng.standard_normal((count, 4)).astype(np.float32), (100, 4), (10, 4))
    return {name: (local, server.upload(local, f"data/{os.path.basename(local)}")) for name, local in found.items()} | {
        "shards": (str(root / "shard-*.b2nd"), None)} | {
        "shard_urls": ([str(root / f"shard-{part}.b2nd") for part in range(3)],
                       [server.upload(str(root / f"shard-{part}.b2nd"), f"data/shards/shard-{part}.b2nd")
                        for part in range(3)])}


def _fields(data, which: int):
    """Every field kind, local (which=0) or from the store (1), of 1,500 rows each."""
    return {
        "image": data["image"][which],
        "label": data["label"][which],
        "packed": Packed(data["docs"][which]),
        "padded": Padded(data["docs"][which], max_length=64, overflow="random"),
    }


def assert_same(left, right, where="") -> None:
    """Two batches hold the same data (a packed region up to its last record's end: past it
    a slot keeps whatever an earlier step left)."""
    assert left.keys() == right.keys()
    for name in left.keys():
        a, b = np.asarray(left[name]), np.asarray(right[name])
        if f"{name}.offsets" in left.keys():
            end = int(np.asarray(left[f"{name}.offsets"])[-1])
            a, b = a[:end], b[:end]
        np.testing.assert_array_equal(a, b, err_msg=f"{name} {where}")


def _same_batches(local_kwargs, remote_kwargs, steps: int, **kwargs):
    with ShmDataLoader(**local_kwargs, **kwargs) as local, ShmDataLoader(**remote_kwargs, **kwargs) as remote:
        compared = 0
        for left, right in zip(local, remote):
            assert_same(left, right, f"at batch {compared}")
            compared += 1
            if compared == steps:
                break
        return compared, remote.stats()


@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("window", [None, 256])
def test_every_field_kind_equals_the_local_files(data, tmp_path, readers, window):
    compared, stats = _same_batches({"fields": _fields(data, 0)},
                                    {"fields": _fields(data, 1), "cache_dir": tmp_path / "cache"}, steps=60,
                                    batch_size=48, seed=7, readers=readers, shuffle_window=window)
    assert compared == 60
    assert stats["cache"]["requests"] > 0 and stats["cache"]["retries"] == 0


def test_windows_globs_and_lists_of_objects(data, tmp_path):
    for window in (lambda path: Windows(path, length=32), lambda path: Windows(path, length=16, separator=0)):
        name = "stream" if window(".").separator is None else "docs"
        _same_batches({"fields": {"x": window(data[name][0])}}, {"fields": {"x": window(data[name][1])},
                                                                 "cache_dir": tmp_path / "a"},
                      steps=40, batch_size=32, readers=2, seed=1)
    glob_url = data["shard_urls"][1][0].replace("shard-0", "shard-*")
    for remote_shards in (glob_url, data["shard_urls"][1]):
        _same_batches({"fields": {"x": data["shards"][0]}}, {"fields": {"x": remote_shards},
                                                           "cache_dir": tmp_path / "b"},
                      steps=40, batch_size=64, readers=2, seed=2)


def test_a_mixture_of_local_and_stored_sources(data, tmp_path):
    def sources(which):
        return [Source({"x": data["shards"][0]}, weight=2),
                Source({"x": data["shard_urls"][which] if which else data["shards"][0]}, weight=1, fraction=0.5)]
    _same_batches({"fields": sources(0)}, {"fields": sources(1), "cache_dir": tmp_path / "c"}, steps=50,
                  batch_size=30, readers=2, seed=4)


def test_shards_finite_passes_and_resume(data, tmp_path):
    cache = tmp_path / "cache"
    for shard in range(2):
        shard_kwargs = dict(batch_size=40, seed=9, readers=2, shard_index=shard, shard_count=2, epochs=1)
        with ShmDataLoader(_fields(data, 0), **shard_kwargs) as local, \
                ShmDataLoader(_fields(data, 1), cache_dir=cache, **shard_kwargs) as remote:
            steps = len(remote)
            count = 0
            for a, b in zip(local, remote):
                assert_same(a, b)
                count += 1
            assert count == steps == len(local)
    # Resume at step 7 from a checkpoint of the store's loader: the same batches as uninterrupted.
    kwargs = dict(batch_size=40, seed=5, readers=2)
    with ShmDataLoader(_fields(data, 1), cache_dir=cache, **kwargs) as first:
        batches = iter(first)
        for _ in range(7):
            next(batches)
        state = first.state_dict()
    with ShmDataLoader(_fields(data, 1), cache_dir=cache, **kwargs) as resumed, \
            ShmDataLoader(_fields(data, 0), start_step=7, **kwargs) as local:
        resumed.load_state_dict(state)
        for _, a, b in zip(range(10), local, resumed):
            assert_same(a, b)


def _cache_disk_bytes(root) -> int:
    total = 0
    for directory, _, names in os.walk(root):
        for name in names:
            if not name.endswith((".pages", ".json", "ledger")):
                total += os.stat(os.path.join(directory, name)).st_blocks * 512
    return total


@pytest.fixture(scope="module")
def big(server, tmp_path_factory):
    """16 MB of incompressible 2 KB rows, local and uploaded: (path, url)."""
    path = tmp_path_factory.mktemp("object-store-big") / "rows.npy"
    np.save(path, np.random.default_rng(8).integers(0, 1 << 60, size=(8000, 256), dtype=np.int64))
    return str(path), server.upload(str(path), "big/rows.npy")


def test_the_budget_bounds_the_cache_and_evicted_pages_come_back_right(big, tmp_path):
    cache, budget, batch, readers = tmp_path / "cache", 2 << 20, 16, 2
    compared, stats = _same_batches({"fields": {"x": big[0]}},
                                    {"fields": {"x": big[1]}, "cache_dir": cache, "cache_bytes": budget},
                                    steps=80, batch_size=batch, seed=3, readers=readers)
    assert stats["cache"]["evicted"] > 0
    # The budget, plus what the fills may hold pinned beyond it: each reader's batch (a row
    # may straddle two pages).
    bound = budget + readers * batch * 2 * CACHE_PAGE_BYTES
    assert _cache_disk_bytes(cache) <= bound
    assert stats["cache"]["bytes_held"] <= bound


def test_a_second_epoch_from_a_cache_that_holds_the_data_makes_no_request(data, tmp_path):
    with ShmDataLoader(_fields(data, 1), cache_dir=tmp_path, batch_size=100, readers=2, epochs=1) as loader:
        assert sum(1 for _ in loader) == 15
        first = loader.stats()["cache"]["requests"]
    with ShmDataLoader(_fields(data, 1), cache_dir=tmp_path, batch_size=100, readers=2, epochs=1, seed=1) as loader:
        assert sum(1 for _ in loader) == 15
        assert first > 0 and loader.stats()["cache"]["requests"] == 0


def test_two_loaders_share_one_copy(data, tmp_path):
    kwargs = dict(cache_dir=tmp_path, batch_size=64, readers=2, seed=11)
    with ShmDataLoader(_fields(data, 1), **kwargs) as one, ShmDataLoader(_fields(data, 1), **kwargs) as two:
        for _, a, b in zip(range(40), one, two):
            assert_same(a, b)
        fetched = two.stats()["cache"]["bytes"]  # Both loaders' requests: the node's counters.
    stored = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(os.path.dirname(data["image"][0]))
                 for n in names if n.startswith(("image", "label", "values", "offsets")))
    assert fetched <= stored * 1.2  # Each page once (pages round ranges up), not once per loader.


def test_the_server_stopped_mid_run_and_restarted_delivers_no_wrong_batch(server, big, tmp_path):
    import threading

    kwargs = dict(batch_size=16, seed=21, readers=2)
    with ShmDataLoader({"x": big[0]}, **kwargs) as local, \
            ShmDataLoader({"x": big[1]}, cache_dir=tmp_path, cache_bytes=2 << 20, **kwargs) as remote:
        compared = 0
        for a, b in zip(local, remote):
            if compared == 10:
                server.stop()
                threading.Timer(1.5, server.start).start()
            assert_same(a, b)
            compared += 1
            if compared == 50:
                break
        assert remote.stats()["cache"]["retries"] > 0


def test_an_object_replaced_under_a_run_stops_it_naming_the_url(server, tmp_path):
    # Larger than the cache: pages are fetched (again) all along, so the change is met; a
    # copy that were whole already would go on serving the rows it was described with.
    local = tmp_path / "replaced.npy"
    np.save(local, np.arange(2_000_000, dtype=np.int64))
    url = server.upload(str(local), "replaced/rows.npy")
    with ShmDataLoader({"x": url}, cache_dir=tmp_path / "cache", cache_bytes=2 << 20, batch_size=64, readers=1,
                       seed=0) as loader:
        np.save(local, np.arange(2_000_000, dtype=np.int64)[::-1].copy())
        server.upload(str(local), "replaced/rows.npy")
        with pytest.raises((ReaderError, RemoteError), match="replaced/rows.npy changed since the loader described it"):
            for _ in loader:
                pass
    # A new loader reads the new object.
    with ShmDataLoader({"x": url}, cache_dir=tmp_path / "cache", batch_size=64, readers=1, seed=0,
                       mode="sequential") as loader:
        assert next(iter(loader))["x"][0] == 1_999_999


def test_missing_objects_and_prefixes_are_named(server, data, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        ShmDataLoader({"x": f"s3://{BUCKET}/nothing-here.npy"}, cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="no object or ragged directory matches"):
        ShmDataLoader({"x": f"s3://{BUCKET}/data/none-*.b2nd"}, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="not a ragged directory"):
        ShmDataLoader({"x": f"s3://{BUCKET}/data/shards"}, cache_dir=tmp_path)
    broken = tmp_path / "broken.npy"
    broken.write_bytes(b"not a field file at all" * 100)
    url = server.upload(str(broken), "broken/x.npy")
    with pytest.raises(ValueError, match=f"{url} is neither a .npy file nor a Blosc2 frame"):
        ShmDataLoader({"x": url}, cache_dir=tmp_path / "cache")
    np.save(broken, np.arange(100))
    short = server.upload(str(broken), "broken/short.npy")
    with pytest.raises(ValueError, match=f"field 'x' \\({short}\\) has 100"):
        ShmDataLoader({"x": short, "y": data["label"][1]}, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="cache_dir, cache_bytes and storage_options go with fields in a store"):
        ShmDataLoader({"x": data["label"][0]}, cache_dir=tmp_path)
    assert not our_shm_entries(os.getpid())


_KILLED_TRAINER = textwrap.dedent("""
    import sys, numpy as np
    from shmloader import ShmDataLoader
    with ShmDataLoader({"x": sys.argv[1]}, cache_dir=sys.argv[2], cache_bytes=2 << 20, batch_size=16, readers=2) as loader:
        for step, batch in enumerate(loader):
            if step == 3:
                print("running", flush=True)
""")


def test_a_sigkilled_trainer_leaves_nothing_a_later_run_reads_wrong(big, tmp_path):
    local, url = big
    cache = tmp_path / "cache"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_TRAINER, url, str(cache)], stdout=subprocess.PIPE,
                             cwd=tmp_path, env=os.environ.copy(), start_new_session=True)
    try:
        assert child.stdout.readline().strip() == b"running"
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # The trainer and its readers, mid-download.
        child.wait()
    with ShmDataLoader({"x": url}, cache_dir=cache, cache_bytes=2 << 20, batch_size=16, readers=2, seed=0) as remote, \
            ShmDataLoader({"x": local}, batch_size=16, readers=2, seed=0) as reference:
        for _, a, b in zip(range(60), reference, remote):
            np.testing.assert_array_equal(a["x"], b["x"])


@pytest.mark.parametrize("codec,clevel", [("LZ4", 5), ("ZSTD", 9), ("LZ4", 0)])
def test_a_row_at_random_fetches_its_block_and_nothing_else_is_needed(server, tmp_path, codec, clevel):
    """Pins exactly what extents() names, in a cache nothing else fills, then gathers: a
    block range that misses the row's block would read zeros (pages never fetched)."""
    import blosc2

    from shmloader.plan.localize import CacheSettings, Localizer
    from shmloader.storage.opening import open_field
    from shmloader.storage.spec import describe_field

    # Not hash(): strings hash differently in each process, and the draws with them.
    rng = np.random.default_rng(zlib.crc32(f"{codec}{clevel}".encode()))
    rows = rng.integers(0, 256, size=(3000, 256), dtype=np.uint8)  # Incompressible: blocks span pages.
    rows[1000:1400] = 0  # Some all-zero blocks, a zero chunk too.
    path = tmp_path / "rows.b2nd"
    blosc2.asarray(rows, urlpath=str(path), mode="w", chunks=(1024, 256), blocks=(96, 256),
                   cparams={"codec": getattr(blosc2.Codec, codec), "clevel": clevel})
    url = server.upload(str(path), f"blocks/{codec}{clevel}.b2nd")
    localizer = Localizer(CacheSettings.of(tmp_path / "cache", None, None))
    spec = describe_field(localizer.path(url))
    field = open_field(spec)
    assert field.unit_pages == 1  # As for rows at random from data larger than the cache: pages alone.
    try:
        for _ in range(20):
            wanted = np.sort(rng.choice(3000, size=rng.integers(1, 40), replace=False)).astype(np.uint64)
            offsets, sizes = field.extents(wanted, np.ones(len(wanted), dtype=np.uint64))
            chunks = np.unique(wanted // 1024).astype(np.int64)
            whole = pages_of(field._file_offsets[chunks], field._sizes[chunks].astype(np.int64))
            assert len(pages_of(offsets, sizes)) <= len(whole)
            # Blocks, not whole chunks, where a block with data (rows 1024-1311 are zero
            # blocks of a few bytes) goes unread.
            blocks = {(row // 1024, row % 1024 // 96) for row in range(3000) if row // 1024 in chunks
                      and not 1024 <= row < 1312}
            if blocks - {(row // 1024, row % 1024 // 96) for row in wanted.tolist()}:
                assert len(pages_of(offsets, sizes)) < len(whole)
            field.remote.pin(offsets, sizes)
            out = np.empty((len(wanted), 256), dtype=np.uint8)
            field.gather(wanted, out)
            field.remote.unpin()
            np.testing.assert_array_equal(out, rows[wanted.astype(np.int64)])
            # Evicted again: the next draw starts from an empty cache.
            stamps = field.remote.stamps
            with open(spec.path, "r+b") as handle:
                for page in np.flatnonzero(stamps).tolist():
                    handle.seek(page * CACHE_PAGE_BYTES)
                    handle.write(bytes(min(CACHE_PAGE_BYTES, spec_size(spec) - page * CACHE_PAGE_BYTES)))
            stamps[:] = 0
    finally:
        field.close()


def spec_size(spec) -> int:
    return os.path.getsize(spec.path)


def test_commands_write_to_the_store_whole_or_not_at_all(server, tmp_path, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shmloader.remote.store import Client
    from shmloader.tools.cli import main

    rows = np.random.default_rng(3).standard_normal((5000, 7)).astype(np.float32)
    np.save(tmp_path / "rows.npy", rows)
    out = f"s3://{BUCKET}/written/rows.b2nd"
    assert main(["convert", str(tmp_path / "rows.npy"), out, "--quiet"]) == 0
    assert out in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "rows.npy"), out, "--quiet"]) == 2  # Exists: --force replaces it.
    assert "pass force=True (--force)" in capsys.readouterr().err
    lengths = np.random.default_rng(4).integers(0, 20, size=600)
    table = pa.table({"label": np.arange(600), "tokens": [list(range(n)) for n in lengths]})
    pq.write_table(table, tmp_path / "t.parquet")
    dataset = f"s3://{BUCKET}/written/imported"
    assert main(["import", "parquet", str(tmp_path / "t.parquet"), dataset, "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert dataset in printed and "shmloader-upload" not in printed
    with ShmDataLoader({"x": out}, cache_dir=tmp_path / "c", batch_size=50, mode="sequential", readers=1) as loader:
        np.testing.assert_array_equal(next(iter(loader))["x"], rows[:50])
    with ShmDataLoader({"label": f"{dataset}/label.npy", "tokens": Packed(f"{dataset}/tokens.ragged")},
                       cache_dir=tmp_path / "c", batch_size=600, mode="sequential", readers=1) as loader:
        batch = next(iter(loader))
        np.testing.assert_array_equal(batch["label"], np.arange(600))
        np.testing.assert_array_equal(np.diff(batch["tokens.offsets"]), lengths)
    # An upload that fails part-way leaves nothing of the new output (and, with --force,
    # nothing of the old one either).
    real, calls = Client.put_file, []

    def failing(self, url, path):
        calls.append(url)
        if len(calls) == 2:
            raise OSError("the link went down")
        return real(self, url, path)

    monkeypatch.setattr(Client, "put_file", failing)
    assert main(["import", "parquet", str(tmp_path / "t.parquet"), f"s3://{BUCKET}/written/failed", "--quiet"]) == 2
    assert "the link went down" in capsys.readouterr().err
    assert Client().list(f"s3://{BUCKET}/written/failed/") == []
    assert calls[-1].endswith(".json") is False  # The metadata, last, was never reached.


def test_globs_match_as_local_globs_do_and_keys_are_taken_as_written(server, tmp_path):
    """A wildcard stays inside one name and skips dot-names (as glob.glob); a key may hold
    "#" and "?"; a glob may name ragged directories."""
    root = tmp_path / "g"
    (root / "old").mkdir(parents=True)
    for name, first in (("a.npy", 0), ("b.npy", 100), ("old/a.npy", 200), (".tmp.npy", 300), ("x#1.npy", 400)):
        np.save(root / name, np.arange(first, first + 100))
        server.upload(str(root / name), f"globbed/{name}")
    np.save(root / "x.npy", np.arange(900, 1000))  # What a key cut at "#" would read.
    server.upload(str(root / "x.npy"), "globbed/x.npy")
    for docs in range(2):
        write_ragged(root / f"docs-{docs}.ragged", [np.arange(n) for n in range(docs, docs + 30)])
        server.upload(str(root / f"docs-{docs}.ragged"), f"globbed/docs-{docs}.ragged")
    kwargs = dict(batch_size=10, mode="sequential", readers=1, epochs=1)

    def rows(fields, **more):
        with ShmDataLoader(fields, **kwargs, **more) as loader:
            return np.concatenate([np.array(batch["x"]) for batch in loader])

    cache = {"cache_dir": tmp_path / "cache"}
    np.testing.assert_array_equal(rows({"x": f"s3://{BUCKET}/globbed/*.npy"}, **cache),
                                  rows({"x": str(root / "*.npy")}))
    np.testing.assert_array_equal(rows({"x": f"s3://{BUCKET}/globbed/x#1.npy"}, **cache), np.arange(400, 500))
    with ShmDataLoader({"x": Packed(f"s3://{BUCKET}/globbed/docs-*.ragged")}, **kwargs, **cache) as remote, \
            ShmDataLoader({"x": Packed(str(root / "docs-*.ragged"))}, **kwargs) as local:
        for a, b in zip(local, remote):
            assert_same(a, b)


def test_a_deleted_object_stops_the_run_even_when_skipping_bad_records(server, big, tmp_path):
    local, _ = big
    url = server.upload(local, "deleted/rows.npy")
    with ShmDataLoader({"x": url}, cache_dir=tmp_path, cache_bytes=2 << 20, batch_size=16, readers=1,
                       on_error="skip") as loader:
        server.client.delete_object(Bucket=BUCKET, Key="deleted/rows.npy")
        with pytest.raises((ReaderError, RemoteError), match="deleted/rows.npy was deleted since the loader"):
            for _ in loader:
                pass
        assert loader.stats()["skipped"]["count"] == 0


def test_checkpoints_and_budgets_follow_the_data_not_the_cache_directory(data, big, tmp_path):
    kwargs = dict(batch_size=40, seed=5, readers=1)
    with ShmDataLoader(_fields(data, 1), cache_dir=tmp_path / "one", **kwargs) as first:
        for _, _ in zip(range(3), first):
            pass
        state = first.state_dict()
    with ShmDataLoader(_fields(data, 1), cache_dir=tmp_path / "two", **kwargs) as other:
        other.load_state_dict(state)  # The same objects from another cache: the same data.
    # A cache directory moved keeps its budget: the copies find their ledger where they are.
    with ShmDataLoader({"x": big[1]}, cache_dir=tmp_path / "moved", cache_bytes=2 << 20, batch_size=16,
                       readers=1) as loader:
        for _, _ in zip(range(5), loader):
            pass
    os.rename(tmp_path / "moved", tmp_path / "here")
    with ShmDataLoader({"x": big[1]}, cache_dir=tmp_path / "here", cache_bytes=2 << 20, batch_size=16,
                       readers=2) as loader:
        for _, _ in zip(range(60), loader):
            pass
    assert not (tmp_path / "moved").exists()
    assert _cache_disk_bytes(tmp_path / "here") <= (2 << 20) + 2 * 16 * 2 * CACHE_PAGE_BYTES


def test_a_closed_loader_gives_back_the_cache_and_a_removed_cache_is_made_anew(data, tmp_path):
    import shutil
    import threading

    def open_files() -> set[str]:
        found = set()
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                found.add(os.readlink(f"/proc/self/fd/{name}"))
        return found

    import contextlib

    before_files, before_threads = open_files(), threading.active_count()
    for attempt in range(3):
        with ShmDataLoader(_fields(data, 1), cache_dir=tmp_path / "cache", batch_size=40, readers=0) as loader:
            for _, batch in zip(range(3), loader):
                pass
            stats = loader.stats()["cache"]
        assert loader.stats()["cache"] == stats  # The run's figures stay readable after close.
        shutil.rmtree(tmp_path / "cache")  # The next loader starts from nothing, in this same process.
    leaked = {path for path in open_files() - before_files if str(tmp_path) in path}
    assert not leaked
    assert threading.active_count() <= before_threads + 1


def test_buckets_and_bucket_urls_get_clear_errors_at_once(server, tmp_path):
    import time

    started = time.monotonic()
    with pytest.raises(FileNotFoundError, match="no-such-bucket"):
        ShmDataLoader({"x": "s3://no-such-bucket/x.npy"}, cache_dir=tmp_path)
    assert time.monotonic() - started < 10  # Not retried: a 404 does not get better.
    with pytest.raises(ValueError, match="a bucket, not an object"):
        ShmDataLoader({"x": f"s3://{BUCKET}"}, cache_dir=tmp_path)


def test_storage_options_stand_in_for_the_environment(server, data, tmp_path, monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(name)  # The readers, started now, see none of them either.
    options = {"endpoint": server.endpoint, "access_key_id": "test", "secret_access_key": "test",
               "region": "us-east-1"}
    _same_batches({"fields": {"x": data["label"][0]}},
                  {"fields": {"x": data["label"][1]}, "cache_dir": tmp_path, "storage_options": options},
                  steps=5, batch_size=64, readers=2)
    with pytest.raises(TypeError, match="storage_options must be a mapping"):
        ShmDataLoader({"x": data["label"][1]}, cache_dir=tmp_path, storage_options="endpoint")


def test_reservations_of_a_dead_process_are_given_back(tmp_path):
    from shmloader.remote.node import NodeCache

    root = str(tmp_path / "cache")
    cache = NodeCache(root)
    cache.set_budget(1 << 20)
    own = cache.counters()["bytes_held"]  # The ledger's own block: the budget covers it too.
    assert 0 < own <= 8192
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os
        from shmloader.remote.cache import NodeCache
        NodeCache({root!r}).reserve(900 << 10)   # A download begun...
        os._exit(0)                              # ...by a process killed before it ended.
    """)], cwd=tmp_path)
    assert child.returncode == 0
    assert cache.counters()["bytes_held"] == own + (900 << 10)
    assert cache.reserve(400 << 10, optional=True)  # Past the budget only with the dead one's bytes.
    assert cache.counters()["bytes_held"] == own + (400 << 10)
    cache.settle(400 << 10, downloaded=False)
    assert cache.counters()["bytes_held"] == own
    cache.close()


def test_a_budget_smaller_than_a_fetch_unit_still_bounds_reads_in_order(big, tmp_path):
    budget = 2 << 20  # A quarter of one 8 MiB unit.
    with ShmDataLoader({"x": big[1]}, cache_dir=tmp_path, cache_bytes=budget, batch_size=64, readers=2,
                       mode="sequential") as loader:
        peak = 0
        for step, _ in zip(range(120), loader):
            if step % 10 == 0:
                peak = max(peak, _cache_disk_bytes(tmp_path))
    assert peak <= budget + 2 * 64 * 2 * CACHE_PAGE_BYTES + (budget // 32) * 16


def test_writing_replaces_only_the_output_named(server, tmp_path, capsys):
    from shmloader.remote.store import Client
    from shmloader.tools.cli import main

    rows = np.tile(np.arange(64, dtype=np.float32), (4000, 1))  # Compressible: convert's advice reads the file.
    np.save(tmp_path / "rows.npy", rows)
    for key in ("named/training.npy", "named/train_v2/values.b2nd", "named/train.label.npy"):
        server.client.put_object(Bucket=BUCKET, Key=key, Body=b"other data")
    assert main(["convert", str(tmp_path / "rows.npy"), f"s3://{BUCKET}/named/train", "--quiet"]) == 2
    assert "named/train exists (1 object(s)" in capsys.readouterr().err  # train.label.npy: named after it.
    assert main(["convert", str(tmp_path / "rows.npy"), f"s3://{BUCKET}/named/train", "--quiet", "--force"]) == 0
    assert f"s3://{BUCKET}/named/train" in capsys.readouterr().out
    left = {url.rsplit("/named/", 1)[1] for url, _, _ in Client().list(f"s3://{BUCKET}/named/")}
    assert left == {"training.npy", "train_v2/values.b2nd", "train"}
    assert main(["convert", str(tmp_path / "rows.npy"), f"s3://{BUCKET}", "--quiet"]) == 2
    assert "a bucket; name the object or prefix to write in it" in capsys.readouterr().err


def test_loaders_of_one_process_keep_their_own_fetch_units(big, tmp_path):
    kwargs = dict(cache_dir=tmp_path, cache_bytes=4 << 20, batch_size=16, readers=0)  # 16 MB of data: too big.
    with ShmDataLoader({"x": big[1]}, mode="sequential", **kwargs) as ordered, \
            ShmDataLoader({"x": big[1]}, mode="shuffle", **kwargs) as shuffled:
        next(iter(ordered)), next(iter(shuffled))
        units = [loader._resources.filler.fields[0].part(0).unit_pages for loader in (ordered, shuffled)]
    assert units[0] > 1 and units[1] == 1  # Rows in order take units; rows at random past the budget, pages.


def test_the_read_ahead_keeps_the_requests_of_successive_calls_in_flight_together(big, tmp_path):
    """prefetch returns once its requests are made: the read-ahead asks step by step, and
    waiting for each step's request before the next left one request per reader in flight
    and the link idle between them. Claims go when the requests end, pages are stamped."""
    import threading
    import time

    from shmloader.remote.pages import REQUEST_BYTES

    unit = REQUEST_BYTES // CACHE_PAGE_BYTES
    with ShmDataLoader({"x": big[1]}, cache_dir=tmp_path, batch_size=16, readers=0, mode="sequential") as loader:
        remote = loader._resources.filler.fields[0].part(0).remote  # No step filled yet: nothing asked ahead.
        real_stream, gate, started = remote.client.stream, threading.Event(), []

        def held_stream(url, etag, start, end, size, receive):
            started.append(start)
            assert gate.wait(30)
            real_stream(url, etag, start, end, size, receive)

        remote.client.stream = held_stream
        first, second = 4 * CACHE_PAGE_BYTES, remote.size - 1  # In both units of the object, not fetched.
        for offset in (first, second):
            remote.prefetch(np.array([offset]), np.array([1]), unit)
        deadline = time.monotonic() + 60
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == 2  # Both in flight, the first not answered.
        gate.set()
        pages = [first // CACHE_PAGE_BYTES, second // CACHE_PAGE_BYTES]
        # The pages are stamped, then their claims go: wait for both (the claims went after
        # the stamps in one CI run of this check).
        while (not remote.stamps[pages].all() or remote._fetching.any()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert remote.stamps[pages].all() and not remote._fetching.any()
        remote.client.stream = real_stream
        batches = [batch["x"].copy() for _, batch in zip(range(3), loader)]
    local = np.load(big[0])
    assert all(np.array_equal(batch, local[16 * step:16 * (step + 1)]) for step, batch in enumerate(batches))


def test_the_trainer_fetches_its_readers_first_steps_while_they_start(big, tmp_path, monkeypatch):
    """fill/filler.fetch_first_steps: the pages of the readers' first steps, asked for by
    the trainer at construction (the link's first fifth of a second, otherwise idle), are
    all those steps read."""
    from shmloader import session as session_module
    from shmloader.fill.filler import fetch_first_steps

    started = []
    monkeypatch.setattr(session_module, "fetch_first_steps", lambda spec, first, count: started.append((first, count)))
    with ShmDataLoader({"x": big[1]}, cache_dir=tmp_path / "other", batch_size=16, readers=2, start_step=5):
        assert started == [(5, 2)]
    kwargs = dict(batch_size=16, readers=0, seed=3, start_step=7)
    local = ShmDataLoader({"x": big[0]}, **kwargs)
    with local, ShmDataLoader({"x": big[1]}, cache_dir=tmp_path / "cache", **kwargs) as remote:
        session = remote._session
        assert remote.stats()["cache"]["requests"] == 0
        fetch_first_steps(session.filler_spec(session.cuts.sampler), 7, 2)  # Returns once asked.
        deadline, last = time.monotonic() + 20, -1
        while time.monotonic() < deadline and (last == 0 or last != remote.stats()["cache"]["requests"]):
            last = remote.stats()["cache"]["requests"]
            time.sleep(0.3)  # Until the requests made at once have all ended.
        assert last > 0
        (pages_file,) = (tmp_path / "cache").glob("objects/*/*/*.pages")
        present = np.fromfile(pages_file, dtype=np.uint32) != 0  # Stamps first: a page's, then checksums.
        rows = []
        for _, a, b in zip(range(2), local, remote):
            assert_same(a, b)
            rows.extend(np.asarray(b.indices).tolist())
    stored = np.load(big[0], mmap_mode="r")
    starts = stored.offset + np.array(rows) * stored.shape[1] * stored.itemsize
    needed = np.unique(np.concatenate([starts, starts + stored.shape[1] * stored.itemsize - 1]) // CACHE_PAGE_BYTES)
    assert present[needed].all()  # Before the steps were filled (their own read-ahead fetches more since).

"""The node cache against what an outside review planted in it between runs: a FIFO in place
of a cache file is named at once (never waited on), a pages file or a ledger grown past its
layout costs neither memory nor disk past the budget, and the files of a copy whose data or
marker is gone are counted as the disk holds them; and against a process of the node stopped
while it holds the ledger's lock: a step keeps step_timeout and close() returns.
Every loader's rows are compared with the uploaded array. Against moto's S3 server on
127.0.0.1, as test_object_store.py."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

pytest.importorskip("moto.server")
pytest.importorskip("obstore")
pytest.importorskip("boto3")

from test_object_store import serving  # noqa: E402

from shmloader import ShmDataLoader, StepTimeoutError  # noqa: E402
from shmloader.errors import CacheError  # noqa: E402
from shmloader.remote import node  # noqa: E402
from shmloader.remote.node import read_stamps  # noqa: E402
from shmloader.remote.pages import CACHE_PAGE_BYTES  # noqa: E402

pytestmark = pytest.mark.xdist_group("object_store")

# A FIFO's open for reading blocks until a writer comes: the test comes as one after this
# long, so that code that waits for it fails the test by its time instead of hanging it.
_FIFO_WRITER_SECONDS = 10.0


@pytest.fixture(scope="module")
def server():
    with serving() as found:
        yield found


def _upload_rows(server, tmp_path, key: str, rows: int = 20_000) -> tuple[np.ndarray, str]:
    values = np.random.default_rng(len(key)).integers(0, 1 << 62, size=rows, dtype=np.int64)
    np.save(tmp_path / "rows.npy", values)
    return values, server.upload(str(tmp_path / "rows.npy"), key)


def _read_all(url: str, cache, **kwargs) -> tuple[np.ndarray, int]:
    """Every row of `url` in order, and the requests the pass made."""
    with ShmDataLoader({"x": url}, cache_dir=cache, batch_size=1000, mode="sequential", readers=0, epochs=1,
                       **kwargs) as loader:
        rows = np.concatenate([np.array(batch["x"]) for batch in loader])
        return rows, loader.stats()["cache"]["requests"]


def _copy_of(cache, name: str) -> str:
    (path,) = glob.glob(os.path.join(str(cache), "objects", "*", "*", name))
    return path


def _disk_bytes(root) -> int:
    return sum(os.lstat(os.path.join(directory, name)).st_blocks * 512
               for directory, _, names in os.walk(root) for name in names)


def _ledger_held(root) -> int:
    return int(np.fromfile(os.path.join(str(root), "ledger"), dtype=np.int64, count=2)[1])


@pytest.mark.parametrize("suffix", [".remote.json", ".pages"])
def test_a_fifo_in_place_of_a_cache_file_is_named_at_once_not_waited_on(server, tmp_path, suffix):
    values, url = _upload_rows(server, tmp_path, f"review/fifo{suffix}.npy")
    cache = tmp_path / "cache"
    np.testing.assert_array_equal(_read_all(url, cache)[0], values)
    planted = _copy_of(cache, f"fifo{suffix}.npy") + suffix
    os.unlink(planted)
    os.mkfifo(planted, 0o600)

    def writer() -> None:  # Ends a wait for a writer, if anything waits.
        if not finished.wait(_FIFO_WRITER_SECONDS):
            os.close(os.open(planted, os.O_RDWR | os.O_NONBLOCK))
    finished = threading.Event()
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(CacheError, match=rf"{planted} is not a regular file .*remove it"):
            _read_all(url, cache)
    finally:
        finished.set()
        thread.join()
    assert time.monotonic() - started < _FIFO_WRITER_SECONDS / 2
    os.unlink(planted)  # The remedy it names.
    np.testing.assert_array_equal(_read_all(url, cache)[0], values)


def test_a_pages_file_grown_between_runs_is_not_read_and_its_copy_is_fetched_again(server, tmp_path):
    values, url = _upload_rows(server, tmp_path, "review/grown.npy")
    cache = tmp_path / "cache"
    np.testing.assert_array_equal(_read_all(url, cache)[0], values)
    data = _copy_of(cache, "grown.npy")
    os.truncate(data + ".pages", 64 << 20)  # Sparse: 8 Mi stamps a loader's start would read.
    page_count = -(-values.nbytes // CACHE_PAGE_BYTES)
    assert read_stamps(data + ".pages", data).stamps.nbytes <= 4 * page_count
    rows, requests = _read_all(url, cache)
    np.testing.assert_array_equal(rows, values)
    assert requests > 0  # Its stamps vouched for nothing.
    assert _ledger_held(cache) == _disk_bytes(cache)


def test_a_ledger_grown_past_its_layout_is_cut_back_so_the_budget_holds(server, tmp_path):
    values, url = _upload_rows(server, tmp_path, "review/ledger.npy", rows=200_000)  # 1.6 MB
    cache, budget = tmp_path / "cache", 256 << 10
    np.testing.assert_array_equal(_read_all(url, cache, cache_bytes=budget)[0], values)
    with open(os.path.join(str(cache), "ledger"), "wb") as handle:
        handle.write(np.random.default_rng(1).bytes(1 << 20))
    rows, _ = _read_all(url, cache, cache_bytes=budget)
    np.testing.assert_array_equal(rows, values)
    assert _disk_bytes(cache) <= budget, (_disk_bytes(cache), budget)
    assert _ledger_held(cache) == _disk_bytes(cache)



def test_the_files_of_a_copy_whose_data_file_is_gone_are_counted_within_the_budget(server, tmp_path):
    # A removal killed between its unlinks (marker, data, pages), or a data file removed by
    # hand, leaves the copy's pages file and marker with no data file beside them.
    gone_values, gone_url = _upload_rows(server, tmp_path, "review/gone.npy", rows=200_000)  # 1.6 MB
    values, url = _upload_rows(server, tmp_path, "review/kept.npy", rows=200_000)
    cache, budget = tmp_path / "cache", 256 << 10
    np.testing.assert_array_equal(_read_all(gone_url, cache)[0], gone_values)
    gone = _copy_of(cache, "gone.npy")
    os.unlink(gone)
    with ShmDataLoader({"x": url}, cache_dir=cache, batch_size=1000, mode="sequential", readers=0, epochs=1,
                       cache_bytes=budget) as loader:
        assert _ledger_held(cache) == _disk_bytes(cache)  # Counted as the loader started.
        np.testing.assert_array_equal(np.concatenate([np.array(batch["x"]) for batch in loader]), values)
    assert _disk_bytes(cache) <= budget, (_disk_bytes(cache), budget)
    assert _ledger_held(cache) == _disk_bytes(cache)


def test_a_marker_removed_between_runs_is_written_anew_and_counted(server, tmp_path):
    values, url = _upload_rows(server, tmp_path, "review/unmarked.npy")
    cache = tmp_path / "cache"
    np.testing.assert_array_equal(_read_all(url, cache)[0], values)
    os.unlink(_copy_of(cache, "unmarked.npy") + ".remote.json")
    np.testing.assert_array_equal(_read_all(url, cache)[0], values)
    assert _ledger_held(cache) == _disk_bytes(cache)

# A process stopped in the ledger's lock.

# The stopped holder is killed after this long whatever happens, so that code that waits for
# it fails the test by its time instead of hanging it.
_HOLDER_KILL_SECONDS = 30.0


def _stopped_holder(cache) -> subprocess.Popen:
    """A process of this user that takes the ledger's lock and stops itself (SIGSTOP), as a
    loader's process stopped inside the lock (a job suspended, ctrl-Z) leaves it."""
    code = textwrap.dedent(f"""
        import fcntl, os, signal
        from shmloader.remote.pages import lock
        descriptor = os.open({os.path.join(str(cache), "ledger")!r}, os.O_RDWR)
        lock(descriptor, fcntl.F_WRLCK, 0, 1, True)
        print("held", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("readers", [0, 2])
def test_a_process_stopped_in_the_ledger_s_lock_holds_no_step_past_step_timeout_nor_close(
        server, tmp_path, monkeypatch, readers):
    monkeypatch.setattr(node, "CLOSE_WAIT_SECONDS", 1.0, raising=False)
    values, url = _upload_rows(server, tmp_path, f"review/stopped{readers}.npy", rows=200_000)  # 1.6 MB
    cache, step_timeout = tmp_path / "cache", 1.0
    # A small budget: each step reserves pages through the ledger.
    loader = ShmDataLoader({"x": url}, cache_dir=cache, cache_bytes=256 << 10, batch_size=1000, mode="sequential",
                           readers=readers, epochs=1, step_timeout=step_timeout)
    batches = iter(loader)
    np.testing.assert_array_equal(np.array(next(batches)["x"]), values[:1000])
    holder = _stopped_holder(cache)
    killer = threading.Timer(_HOLDER_KILL_SECONDS, holder.kill)
    killer.start()
    try:
        started = time.monotonic()
        with pytest.raises(StepTimeoutError):
            for step, batch in enumerate(batches, start=1):  # Every batch delivered is right.
                np.testing.assert_array_equal(np.array(batch["x"]), values[step * 1000:(step + 1) * 1000])
        # Margin: a step polls the lock for its deadline, then the trainer notices.
        assert time.monotonic() - started < step_timeout + 3
        started = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"left open at close .*held by another process of the node"):
            loader.close()
        # The bound, and the read-ahead's thread, which close() waits for for 5 s at most.
        assert time.monotonic() - started < node.CLOSE_WAIT_SECONDS + 5 + 3
    finally:
        killer.cancel()
        holder.kill()
        holder.wait()
        loader.close()
    rows, _ = _read_all(url, cache)  # Its lock gone with it, the cache serves again.
    np.testing.assert_array_equal(rows, values)
    assert _ledger_held(cache) == _disk_bytes(cache)

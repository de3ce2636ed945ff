"""A store's read-ahead requests run while the read-ahead goes on asking (remote/cache.py,
CachedObject.prefetch): each one's claim (an OFD lock on its pages' FETCH bytes) must last
exactly as long as its request, and never outlive the object. Found by an outside review:
a finishing request dropped the claim of the next request for the same pages (fetched twice,
the ledger counting them twice), and a read-ahead that outlived its object's close took a
claim through a descriptor number reused since, which no one released."""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
import traceback

import numpy as np

from shmloader.remote import cache as cached
from shmloader.remote.node import node_cache
from shmloader.remote.pages import CACHE_PAGE_BYTES, FETCH_BASE, IN_FLIGHT_FIRST, lock


def _object(root, size: int = 64 * CACHE_PAGE_BYTES):
    """A cached copy of a made-up object of `size` bytes; its client is the test's to set."""
    url = "s3://bucket/object.bin"
    directory = cached.object_directory(str(root), url, "etag1")
    path = os.path.join(directory, cached.cached_name(url))
    cached.create_object(path, url, "etag1", size, {})
    return cached.open_object(node_cache(str(root)), path, url)


def _content(start: int, end: int) -> bytes:
    return bytes((np.arange(start, end) % 251).astype(np.uint8))


def _claimable(remote, page: int) -> bool:
    """Whether another description of the pages file could claim `page` now."""
    descriptor = os.open(remote.path + cached.PAGES_SUFFIX, os.O_RDWR)
    try:
        return lock(descriptor, fcntl.F_WRLCK, FETCH_BASE + page, 1, False)
    finally:
        os.close(descriptor)


def _threads(calls) -> str:
    """What each thread of this process is doing, for a failure's message."""
    frames = sys._current_frames()
    return f"calls: {calls}\n" + "\n".join(
        f"{thread.name}:\n{''.join(traceback.format_stack(frames[thread.ident]))}"
        for thread in threading.enumerate() if thread.ident in frames)


def _wait(condition, seconds: float = 60.0) -> bool:  # Long: only a failure waits it out.
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_a_request_that_ends_keeps_the_claim_of_the_next_request_for_its_pages(tmp_path):
    remote = _object(tmp_path)
    calls, first_gate, later_gate = [], threading.Event(), threading.Event()

    def stream(url, etag, start, end, size, receive):
        calls.append((threading.current_thread().name, start))
        if len(calls) == 1:
            assert first_gate.wait(30)
            raise OSError("the first request fails")
        if threading.current_thread().name.startswith("shmloader-fetch-ahead"):
            assert later_gate.wait(30)
        receive(0, memoryview(_content(start, end)))

    remote.client.stream = stream
    first_ended, ahead_done = threading.Event(), remote._ahead_done

    def ended(*arguments):  # Waited for, not polled with a deadline: a loaded CI machine is slow.
        try:
            ahead_done(*arguments)
        finally:
            first_ended.set()

    remote._ahead_done = ended
    held_before = int(remote.cache.counters()["bytes_held"])
    offsets, sizes = np.array([0]), np.array([4 * CACHE_PAGE_BYTES])  # Pages 0-3, one run.
    remote.prefetch(offsets, sizes)
    # Another request writing its bytes holds this lock for as long as the write takes.
    with remote._descriptors_lock:
        first_gate.set()  # The first request fails; its end waits for the lock.
        time.sleep(0.2)
        remote.prefetch(offsets, sizes)  # The read-ahead asks again meanwhile.
    assert first_ended.wait(60), _threads(calls)
    # No page is marked as asked for without the claim of a request that asks for it.
    assert not remote._fetching.any() or not _claimable(remote, 0), (remote._fetching[:4], calls)
    time.sleep(0.2)
    # Either the pages are asked for again and claimed by that request, or left alone.
    if remote._fetching[:4].any():
        assert not _claimable(remote, 0)
    fill = threading.Thread(target=lambda: (remote.pin(offsets, sizes), remote.unpin()))
    fill.start()
    later_gate.set()
    fill.join(10)
    assert not fill.is_alive()
    assert _wait(lambda: not remote._fetching.any())
    fetched = [start for name, start in calls[1:]]
    assert len(fetched) == len(set(fetched)), calls  # No page downloaded twice.
    present = int((remote.stamps != 0).sum())
    assert present == 4
    assert int(remote.cache.counters()["bytes_held"]) - held_before == present * CACHE_PAGE_BYTES
    remote.close()


def test_a_read_ahead_outliving_its_objects_close_leaves_no_claim(tmp_path):
    remote = _object(tmp_path)
    gate, calls, box = threading.Event(), [], {}

    def stream(url, etag, start, end, size, receive):
        calls.append(start)
        assert gate.wait(30)
        receive(0, memoryview(_content(start, end)))

    remote.client.stream = stream
    pages = np.arange(0, 40, 2)  # 20 runs of a page: more than the read-ahead's threads.

    def read_ahead():
        box["descriptor"] = remote._fd("ahead")
        try:
            remote.prefetch(pages * CACHE_PAGE_BYTES, np.full(len(pages), 100))
        except Exception as error:  # noqa: BLE001 - what the read-ahead thread would swallow.
            box["error"] = error

    thread = threading.Thread(target=read_ahead)
    thread.start()
    # Every request it may have in flight so far made: the read-ahead waits for one to end.
    assert _wait(lambda: len(calls) == IN_FLIGHT_FIRST)
    remote.close()
    held = []  # The process opens files since: one takes the read-ahead's old descriptor number.
    try:
        while not held or held[-1] != box["descriptor"]:
            held.append(os.open(remote.path + cached.PAGES_SUFFIX, os.O_RDWR))
            assert len(held) < 1000
        gate.set()
        thread.join(10)
        assert not thread.is_alive()
        assert all(_claimable(remote, int(page)) for page in pages)
    finally:
        for descriptor in held:
            os.close(descriptor)

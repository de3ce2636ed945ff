"""Serving rows from the node cache without a lock per page (remote/cache.py): a gather of
pages that are all present and checked reads them unpinned, and says afterwards whether an
eviction ran meanwhile (the ledger's eviction sequence, remote/node.py), in which case the
fill reads again, pinned, and nothing it read the first time reaches the batch; a page is
never stamped present again over the hole an eviction left; pages another process
downloaded while this one had the copy open are not read again to be checked, pages that
were there before are; and the read-ahead's requests ramp up, giving way to a waiting fill
while they do. Stand-in clients and a second view of the same cache (another process's,
as far as the locks and the ledger go); the last test against moto's server."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from conftest import child_environment
from test_invariants import _Store, stored  # noqa: F401 (a fixture)

from shmloader.remote.cache import open_object
from shmloader.remote.node import _LEDGER, NodeCache, RampingSlots
from shmloader.remote.pages import CACHE_PAGE_BYTES

# Children run here, outside the checkout: its source would shadow an installed package (CI).
HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(not __import__("shmloader.remote.cache", fromlist=["x"]).UNPINNED_READS,
                                reason="unpinned reads are for x86-64 only")

ALL = (np.array([0]), np.array([5 * CACHE_PAGE_BYTES + 100]))  # Every byte of the stand-in object.


@contextlib.contextmanager
def _another_process(found):
    """Another process's view of the cache and the object (its own descriptors and locks)."""
    view = NodeCache(found.cache.root)
    try:
        other = open_object(view, found.path, found.url)
        other.client = found.client
        yield view, other
    finally:
        view.close()


def _evict_everything(view) -> int:
    """An eviction from `view` (budget 1 byte) of every page nobody pins; the bytes freed."""
    view.set_budget(1)
    held = view.counters()["bytes_held"]
    view.reserve(0)
    return held - view.counters()["bytes_held"]


def _fetch_then_read_unpinned(found) -> None:
    """Every page fetched (by this process: checked), then all read unpinned, no lock taken."""
    found.pin(*ALL)
    found.unpin()
    found.pin(*ALL, unpinned=True)
    assert not getattr(found._local, "pin_held", False)


def test_present_checked_pages_are_read_unpinned_and_hold_where_nothing_was_evicted(stored):  # noqa: F811
    found, data = stored
    found.pin(*ALL)  # Fetched (by this process: checked).
    assert found.unpin()
    requests = found.client.requests
    found.pin(*ALL, unpinned=True)
    assert not getattr(found._local, "pin_held", False)  # No USE lock taken.
    assert found.unpin() is True
    assert found.client.requests == requests


def test_an_eviction_during_an_unpinned_read_says_read_again_and_the_pinned_read_is_right(stored):  # noqa: F811
    found, data = stored
    _fetch_then_read_unpinned(found)
    with _another_process(found) as (view, _):
        assert _evict_everything(view) > 0  # Nothing pinned: the other process took every page.
        assert (found.stamps == 0).all()
        assert found.unpin() is False
        found.pin(*ALL, unpinned=True)  # Absent now: fetched again, under pins.
        assert getattr(found._local, "pin_held", False)
        with open(found.path, "rb") as handle:
            assert handle.read() == data
        assert found.unpin() is True


def test_a_block_pinned_inside_a_fill_leaves_the_fill_s_unpinned_reads_to_its_own_unpin(stored):  # noqa: F811
    found, _ = stored
    _fetch_then_read_unpinned(found)
    with found.pinned([(0, 10)]):  # A part of another field opening lazily, mid-fill.
        pass
    with _another_process(found) as (view, _):
        assert _evict_everything(view) > 0
        assert found.unpin() is False


def test_a_page_marked_absent_counts_as_an_eviction(stored):  # noqa: F811
    found, _ = stored
    _fetch_then_read_unpinned(found)
    found.cache.mark_absent(found.stamps, 2, CACHE_PAGE_BYTES)  # Another process found it altered...
    with _another_process(found) as (view, other):
        other.pin(np.array([2 * CACHE_PAGE_BYTES]), np.array([1]))  # ...and fetched it again.
        other.unpin()
    assert found.stamps[2] != 0
    assert found.unpin() is False


def test_a_pinned_read_holds_off_the_eviction_an_unpinned_one_cannot(stored):  # noqa: F811
    found, _ = stored
    found.pin(*ALL)
    with _another_process(found) as (view, _):
        assert _evict_everything(view) == 0
        assert (found.stamps != 0).all()
    found.unpin()


def test_a_word_left_odd_by_an_evictor_that_died_is_made_even_by_the_next_read(stored):  # noqa: F811
    found, _ = stored
    found.pin(*ALL)
    found.unpin()
    word = _LEDGER["evictions"]
    found.cache._ledger[word] += 1  # Odd: an evicting process killed mid-way (its lock went with it).
    found.pin(*ALL, unpinned=True)  # No eviction can run while the ledger lock is held: repaired.
    assert not getattr(found._local, "pin_held", False)
    assert found.cache._ledger[word] % 2 == 0
    assert found.unpin() is True


def test_a_read_waits_for_an_eviction_that_runs(stored):  # noqa: F811
    found, _ = stored
    _fetch_then_read_unpinned(found)
    assert found.unpin()
    with _another_process(found) as (view, _):
        with view.locked(), view._evicting():  # Another process evicting now.
            reading = threading.Thread(target=found.pin, args=ALL, kwargs={"unpinned": True})
            reading.start()
            reading.join(0.3)
            assert reading.is_alive()  # Waits on the ledger lock.
        reading.join(10)
        assert not reading.is_alive()


def test_stamping_pages_used_never_makes_an_evicted_page_present(stored):  # noqa: F811
    found, _ = stored
    found.pin(*ALL)
    found.unpin()
    with _another_process(found) as (view, _):
        _evict_everything(view)
    found.cache.touch(found.stamps, np.arange(found.page_count), 12345)
    assert (found.stamps == 0).all()


def test_pages_another_process_fetched_since_this_one_opened_are_not_checked_again(stored, monkeypatch):  # noqa: F811
    found, _ = stored  # Opened with every page absent.
    with _another_process(found) as (view, other):
        other.pin(*ALL)  # The other process downloads them.
        other.unpin()
        checked = []
        failing = type(found)._failing
        monkeypatch.setattr(type(found), "_failing",
                            lambda self, first, end, wanted: checked.append(first) or failing(self, first, end, wanted))
        found.pin(*ALL, unpinned=True)
        assert found.unpin() and checked == []
    with _another_process(found) as (_, later):  # Opened now, it finds them there: checks each once.
        later.pin(*ALL)
        later.unpin()
        later.pin(*ALL)
        later.unpin()
    assert checked == [0]  # One read of the run of six pages, then never again.


_EVICTOR = textwrap.dedent("""
    import sys, time
    import numpy as np
    from shmloader.remote.cache import open_object
    from shmloader.remote.node import NodeCache

    class Store:
        def __init__(self, data):
            self.data = data
        def stream(self, url, etag, start, stop, size, receive):
            receive(0, memoryview(self.data)[start:stop])

    root, path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    data = open(sys.argv[4], "rb").read()
    view = NodeCache(root)
    found = open_object(view, path, "s3://bucket/x.bin")
    found.client = Store(data)
    print("ready", flush=True)
    evictions, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:   # Every page out, then every page back.
        view.set_budget(1)
        view.reserve(0)
        view.set_budget(1 << 30)
        found.pin(np.array([0]), np.array([len(data)]))
        found.unpin()
        evictions += 1
    print(evictions, flush=True)
""")


def test_gathers_beside_a_process_that_evicts_all_along_read_only_the_object_s_bytes(tmp_path):
    """A reader gathering random ranges unpinned (pinning where told to read again) beside
    another process that evicts every page and fetches it back, over and over: every
    gather that held is the object's bytes, and both kinds of read happened."""
    from shmloader.remote.cache import create_object

    root, pages = tmp_path / "cache", 64
    path = str(root / "objects" / "url" / "version" / "x.bin")
    data = np.random.default_rng(7).integers(0, 256, pages * CACHE_PAGE_BYTES - 100, dtype=np.uint8).tobytes()
    (tmp_path / "source.bin").write_bytes(data)
    create_object(path, "s3://bucket/x.bin", "etag", len(data), {})
    view = NodeCache(str(root))
    view.set_budget(1 << 30)
    found = open_object(view, path, "s3://bucket/x.bin")
    found.client = _Store(data)
    evictor = subprocess.Popen([sys.executable, "-c", _EVICTOR, str(root), path, "3", str(tmp_path / "source.bin")],
                               stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(__file__))
    try:
        assert evictor.stdout.readline().strip() == "ready"
        rng = np.random.default_rng(11)
        counts = {"held": 0, "again": 0, "wrong": 0}
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), len(data), prot=mmap.PROT_READ)
            while evictor.poll() is None:
                offsets, sizes = rng.integers(0, len(data) - 3000, 16), np.full(16, 3000)
                for unpinned in (True, False):
                    found.pin(offsets, sizes, unpinned=unpinned)
                    read = [mapped[start:start + 3000] for start in offsets.tolist()]
                    if found.unpin():
                        counts["held"] += 1
                        counts["wrong"] += sum(piece != data[start:start + 3000]
                                               for piece, start in zip(read, offsets.tolist()))
                        break
                    counts["again"] += 1
            mapped.close()
        assert int(evictor.stdout.readline()) > 10
        assert counts["wrong"] == 0 and counts["held"] > 100 and counts["again"] > 0, counts
    finally:
        evictor.kill()
        evictor.wait()
        view.close()


def test_the_first_steps_fetch_makes_at_most_in_flight_requests_and_none_once_closed(tmp_path):
    """prefetch(throttled=False), the trainer's fetch of its readers' first steps: the first
    IN_FLIGHT runs at once, the rest left to the fills (not queued behind busy threads);
    requests still waiting for a thread when the object closes are not made, and an unpin
    after the close returns."""
    from shmloader.remote.cache import create_object
    from shmloader.remote.pages import IN_FLIGHT

    root, pages = tmp_path / "cache", 4 * IN_FLIGHT
    path = str(root / "objects" / "url" / "version" / "x.bin")
    create_object(path, "s3://bucket/x.bin", "etag", pages * CACHE_PAGE_BYTES, {})
    view = NodeCache(str(root))
    found = open_object(view, path, "s3://bucket/x.bin")
    gate, calls = threading.Event(), []

    def stream(url, etag, start, stop, size, receive):
        calls.append(start)
        if start // CACHE_PAGE_BYTES % 2 == 0:  # The first steps' pages: held until the gate opens.
            gate.wait(10)
        receive(0, memoryview(bytes(stop - start)))

    found.client.stream = stream
    every_other = np.arange(0, pages, 2) * CACHE_PAGE_BYTES  # 2 * IN_FLIGHT runs of a page.
    found.prefetch(every_other, np.full(len(every_other), 10), throttled=False)
    deadline = time.monotonic() + 60
    while len(calls) < IN_FLIGHT and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(calls) == IN_FLIGHT
    assert _claimable(found, 2 * (IN_FLIGHT - 1)) is False  # The last run asked for: claimed, in flight.
    assert _claimable(found, 2 * IN_FLIGHT)  # The next: left to the fills, unclaimed.
    found.pin(np.array([CACHE_PAGE_BYTES]), np.array([10]))  # A page nobody asked for: fetched, pinned.
    view.close()
    assert found.unpin() is True  # Closed meanwhile: nothing to let go of, no error.
    gate.set()
    time.sleep(0.3)  # The requests in flight end.
    assert len(calls) == IN_FLIGHT + 1


def _claimable(found, page: int) -> bool:
    """Whether another description could claim (FETCH-lock) `page` now."""
    from shmloader.remote.pages import FETCH_BASE, PAGES_SUFFIX, lock

    descriptor = os.open(found.path + PAGES_SUFFIX, os.O_RDWR)
    try:
        return lock(descriptor, fcntl.F_WRLCK, FETCH_BASE + page, 1, False)
    finally:
        os.close(descriptor)


# The read-ahead's requests in flight.

def test_the_read_ahead_ramps_up_by_requests_that_end_not_by_permits_given_back_unused():
    slots = RampingSlots(2, 5)
    slots.acquire()
    slots.acquire()
    slots.release(used=False)  # Nothing to fetch: the limit stays 2.
    slots.acquire()
    blocked = _acquirer(slots)
    assert not blocked.wait(0.2)
    slots.release()  # A request ended: 3 in flight at most now.
    assert blocked.wait(5)
    slots.acquire()
    blocked = _acquirer(slots)
    assert not blocked.wait(0.2)
    for _ in range(3):
        slots.release()  # 5 at most, however many end.
    assert blocked.wait(5)
    for _ in range(4):
        slots.acquire()
    blocked = _acquirer(slots)
    assert not blocked.wait(0.2)
    slots.release()
    assert blocked.wait(5)


def test_a_waiting_fill_holds_the_read_ahead_back_only_while_it_ramps_up():
    slots = RampingSlots(2, 3)
    with slots.fill_waiting():
        blocked = _acquirer(slots)
        assert not blocked.wait(0.2)
    assert blocked.wait(5)  # The fill has its pages.
    slots.release()  # Ramped up: 3.
    with slots.fill_waiting():
        assert _acquirer(slots).wait(5)
    with pytest.raises(ValueError):
        RampingSlots(1, 1).release()


def _acquirer(slots: RampingSlots) -> threading.Event:
    """A thread that takes a permit; the event says it has."""
    done = threading.Event()
    threading.Thread(target=lambda: (slots.acquire(), done.set()), daemon=True).start()
    return done


def test_while_an_older_version_s_loaders_use_the_cache_every_gather_pins(stored):  # noqa: F811
    from shmloader.remote.node import _LEDGER_MAGIC, _LEDGER_MAGIC_UNCOUNTED

    found, _ = stored
    found.pin(*ALL)
    found.unpin()
    found.cache._ledger[_LEDGER["magic"]] = _LEDGER_MAGIC_UNCOUNTED  # An older loader's ledger...
    newer = NodeCache(found.cache.root)  # ...which it uses now (found's view holds the users' byte).
    try:
        assert newer.eviction_sequence() is None and found.cache.eviction_sequence() is None
        assert newer._ledger[_LEDGER["magic"]] == _LEDGER_MAGIC_UNCOUNTED  # Left as it is.
        found.pin(*ALL, unpinned=True)
        assert getattr(found._local, "pin_held", False)
        assert found.unpin() is True
    finally:
        newer.close()
    found.cache.close()  # Nobody uses it now: the next view makes it this version's.
    alone = NodeCache(found.cache.root)
    try:
        assert alone._ledger[_LEDGER["magic"]] == _LEDGER_MAGIC and alone.eviction_sequence() == 0
    finally:
        alone.close()


def test_pages_missing_where_the_budget_has_room_are_fetched_and_read_unpinned(stored):  # noqa: F811
    found, data = stored  # Every page absent.
    requests = found.client.requests
    found.pin(*ALL, unpinned=True)
    assert not getattr(found._local, "pin_held", False)  # Fetched, then read without a USE lock.
    assert found.client.requests > requests
    assert found.unpin() is True
    with open(found.path, "rb") as handle:
        assert handle.read() == data


def test_pages_missing_past_the_budget_are_fetched_under_pins(stored):  # noqa: F811
    found, data = stored
    found.cache.set_budget(CACHE_PAGE_BYTES)  # No room: what the fill holds past the budget is pinned.
    found.pin(*ALL, unpinned=True)
    assert getattr(found._local, "pin_held", False)
    assert found.unpin() is True
    with open(found.path, "rb") as handle:
        assert handle.read() == data


def test_pages_present_at_open_are_checked_without_pins_and_a_bad_one_is_fetched_again(stored):  # noqa: F811
    found, data = stored
    found.pin(*ALL)
    found.unpin()
    with _another_process(found) as (_, later):  # Opened with every page there: none checked yet.
        later.pin(*ALL, unpinned=True)
        assert not getattr(later._local, "pin_held", False)  # Checked, and read, without a lock.
        assert later.verified.all() and later.unpin() is True
    with open(found.path, "r+b") as handle:  # A byte of page 3 altered on disk between runs.
        handle.seek(3 * CACHE_PAGE_BYTES + 10)
        handle.write(bytes([data[3 * CACHE_PAGE_BYTES + 10] ^ 0xFF]))
    requests = found.client.requests
    with _another_process(found) as (_, later):
        later.pin(*ALL, unpinned=True)
        assert getattr(later._local, "pin_held", False)  # It failed unpinned: checked again under pins.
        assert later.unpin() is True
        assert found.client.requests == requests + 1  # That page alone, fetched again.
    with open(found.path, "rb") as handle:
        assert handle.read() == data


def test_the_pages_of_byte_ranges_are_each_page_a_range_touches_once_in_order():
    """pages_of, which every pin and gather starts from, against the pages counted one range
    at a time, over ranges smaller and larger than a page, empty ones included."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from shmloader.remote.cache import pages_of

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 40 * CACHE_PAGE_BYTES), st.integers(0, 3 * CACHE_PAGE_BYTES)),
                    max_size=60))
    def check(ranges):
        offsets = np.array([offset for offset, _ in ranges], dtype=np.int64)
        sizes = np.array([size for _, size in ranges], dtype=np.int64)
        touched = [page for offset, size in ranges if size
                   for page in range(offset // CACHE_PAGE_BYTES, (offset + size - 1) // CACHE_PAGE_BYTES + 1)]
        assert pages_of(offsets, sizes).tolist() == sorted(set(touched))
        assert pages_of(offsets, sizes, ordered=True).tolist() == list(dict.fromkeys(touched))

    check()


def test_a_fill_whose_unit_another_request_holds_in_part_claims_its_own_pages_alone(stored):  # noqa: F811
    """Its other free pages are no fill's to wait for: claimed page by page they cost a lock
    call and a request each."""
    from shmloader.remote.pages import FETCH_BASE, PAGES_SUFFIX, lock

    found, data = stored
    other = os.open(found.path + PAGES_SUFFIX, os.O_RDWR)  # Another request, fetching page 0.
    try:
        assert lock(other, fcntl.F_WRLCK, FETCH_BASE, 1, False)
        requests = found.client.requests
        found.pin(np.array([3 * CACHE_PAGE_BYTES + 5]), np.array([10]), unit_pages=found.page_count, unpinned=True)
        assert found.unpin() is True
        assert found.client.requests == requests + 1
        assert np.flatnonzero(found.stamps).tolist() == [3]
    finally:
        os.close(other)


def test_the_page_arithmetic_of_a_fill_does_not_import_numpy_ma():
    """numpy 2.4's np.unique asks np.ma.is_masked, whose first call imports numpy.ma: a tenth
    of a CPU second in every reader that fills from a store, where np.unique was called."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from shmloader.remote.cache import distinct, first_seen, pages_of
        from shmloader.storage.readahead import _page_bytes
        offsets, sizes = np.array([5, 40000, 3, 90000]), np.array([20000, 10, 3000, 70000])
        pages_of(offsets, sizes), pages_of(offsets, sizes, ordered=True), _page_bytes(offsets, sizes)
        assert distinct(np.array([3, 1, 3])).tolist() == [1, 3]
        assert first_seen(np.array([3, 1, 3, 2, 1])).tolist() == [3, 1, 2]
        print("numpy.ma" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=HERE,
                            env=child_environment())
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_pages_read_unpinned_are_stamped_used_within_a_second(stored, monkeypatch):  # noqa: F811
    """The ledger's lock is taken for the stamps of a thread's unpinned reads once a
    TOUCH_EVERY_SECONDS, not at every fill; a page read is stamped as used within it."""
    from shmloader.remote import cache as cached
    from shmloader.remote.pages import now_stamp

    monkeypatch.setattr(cached, "TOUCH_EVERY_SECONDS", 0.2)
    found, _ = stored
    found.pin(*ALL)
    found.unpin()
    found.stamps[:] = 5  # Used long ago.
    touched = []
    real = found.cache.touch
    monkeypatch.setattr(found.cache, "touch", lambda *arguments: touched.append(1) or real(*arguments))
    for _ in range(3):
        found.pin(*ALL, unpinned=True)
        assert found.unpin() is True
    assert not touched and (found.stamps == 5).all()  # Within the interval: stamped later, together.
    time.sleep(0.25)
    found.pin(*ALL, unpinned=True)
    assert found.unpin() is True
    assert touched == [1] and (found.stamps >= now_stamp() - 1).all()

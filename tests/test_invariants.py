"""The invariants asserted on the paths that matter fire when broken on purpose: a resharded
resume's dealing (plan/reshard.py), a finite pass's tail (plan/tail.py), the node cache's
ledger and pins (remote/node.py, remote/cache.py), and the Zig sampler's checks that hold in
the release build (zig/; their broken-struct cases are Zig tests, run by test_native.py).
Each test also shows the invariant holding where nothing is broken, and the ledger's tests
keep the defects the assertions found as cases of their own."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from shmloader._native import Status, lib
from shmloader.plan import reshard
from shmloader.plan.reshard import transition_from
from shmloader.plan.sampler import Sampler
from shmloader.plan.sources import MixtureSampler
from shmloader.plan.tail import Tail, tail_of

ROWS, BATCH, WINDOW = 1000, 10, 200


# The dealing of a resharded resume.

def _resharded(new_index: int = 1, new_count: int = 3, old_count: int = 2, position: int = 150,
               **changes) -> Sampler:
    """New shard `new_index` of `new_count` continuing `old_count` shards at `position`;
    `changes` replace fields of the dealt transition (to break it)."""
    dealt = transition_from(Sampler(ROWS, BATCH, "shuffle", 3, 0, new_count, WINDOW), [position] * old_count,
                            position, None)
    return Sampler(ROWS, BATCH, "shuffle", 3, new_index, new_count, WINDOW,
                   transition=dataclasses.replace(dealt, **changes))


def test_a_dealing_s_pieces_cut_the_old_remainders_exactly():
    dealings = [_resharded(index).dealing for index in range(3)]
    assert sum(dealing.piece_rows for dealing in dealings) == dealings[0].total_rows == 2 * (500 - 150)
    for dealing in dealings:  # Every run of a piece lies in an old remainder.
        assert sum(rows for _, _, rows, _ in dealing.segments(140, 400)) == 400


def test_an_old_shard_standing_past_the_dealt_epochs_is_refused():
    # through_epoch -1 says no old shard had begun an epoch, yet each stands at 150 (a
    # checkpoint's own numbers, edited: a ValueError that names them, not an assertion).
    with pytest.raises(ValueError, match="150"):
        _resharded(through_epoch=-1)


def test_pieces_that_do_not_sum_to_the_remainders_are_an_assertion(monkeypatch):
    original = reshard.Dealing.piece_rows_of
    monkeypatch.setattr(reshard.Dealing, "piece_rows_of", lambda self, index: original(self, index) + (index == 2))
    with pytest.raises(AssertionError):
        _resharded()


def test_a_run_outside_its_old_shard_s_remainder_is_an_assertion():
    sampler = _resharded(new_index=0, new_count=1)
    dealing = sampler.dealing
    dealing._cumulative = [0, dealing.total_rows, dealing.total_rows]  # Old shard 0 said to hold all of T.
    with pytest.raises(AssertionError):
        list(dealing.segments(150, 700))


def test_a_run_that_does_not_move_forward_is_an_assertion(monkeypatch):
    dealing = _resharded(new_index=0, new_count=1).dealing
    # Every position of the piece looked up in old shard 0: past its remainder no row is left.
    monkeypatch.setattr(reshard, "bisect", types.SimpleNamespace(bisect_right=lambda values, value: 1))
    with pytest.raises(AssertionError):
        list(dealing.segments(150, 700))


# A finite pass's tail.

def _tail(**changes) -> Tail:
    tail = tail_of([203, 157], batch_size=10, shard_count=2, own_streams=True, drop_last=False)
    assert (tail.first_step, tail.steps, tail.rows, tail.remainders) == (15, 3, 60, (53, 7))
    return dataclasses.replace(tail, **changes) if changes else tail


def test_a_tail_s_chunks_cover_its_rows_in_order_none_empty():
    tail = _tail()
    chunks = [tail.chunk(step, shard) for step in range(tail.first_step, tail.end_step) for shard in range(2)]
    assert all(rows > 0 and not padding for _, rows, padding in chunks)
    assert [offset for offset, _, _ in chunks] == list(np.cumsum([0] + [rows for _, rows, _ in chunks])[:-1])
    assert sum(rows for _, rows, _ in chunks) == tail.rows


def test_a_tail_of_fewer_rows_than_chunks_repeats_one_marked_padding():
    tail = tail_of([3], batch_size=1, shard_count=2, own_streams=False, drop_last=False)
    chunks = [tail.chunk(step, shard) for step in range(tail.first_step, tail.end_step) for shard in range(2)]
    assert (tail.first_step, tail.steps, tail.padded) == (1, 1, 1)  # Step 0 is whole: rows 0 and 1.
    assert chunks == [(0, 1, False), (0, 1, True)]  # Row 2 once, then repeated on shard 1.


@pytest.mark.parametrize("changes", [
    pytest.param({"rows": 61, "steps": 4}, id="more rows than the streams hold"),
    pytest.param({"rows": 0, "steps": 1, "remainders": (0, 0)}, id="a step with no row to repeat"),
    pytest.param({"steps": 2}, id="fewer steps than the rows fill"),
    pytest.param({"remainders": (60,)}, id="one remainder for two own streams"),
    pytest.param({"rows": 40, "steps": 2}, id="a global batch of rows left out"),
])
def test_a_tail_made_inconsistent_is_an_assertion(changes):
    with pytest.raises(AssertionError):
        _tail(**changes)


def test_a_chunk_past_the_streams_is_an_assertion():
    tail = _tail()
    object.__setattr__(tail, "remainders", (40, 7))  # The streams hold less than the chunks say.
    with pytest.raises(AssertionError):
        list(tail.segments(tail.end_step - 1, 1))
    with pytest.raises(AssertionError):
        _tail().chunk(_tail().first_step, 2)  # Shard 2 of 2.


# The node cache's ledger.

@pytest.fixture
def cache(tmp_path):
    from shmloader.remote.node import NodeCache

    view = NodeCache(str(tmp_path / "cache"))
    view.set_budget(1 << 20)
    yield view
    view.close()


def test_a_reservation_given_back_by_another_view_is_counted_again_when_its_bytes_land(tmp_path):
    """Two views of one ledger in one process (the cache directory by a link, or a loader's
    close racing a new loader's start) share this pid's slot: the first to close gives back
    the other's reservation. The other's download then settles without an assertion (it
    raised in the download thread), its bytes held again where they landed, none where not."""
    from shmloader.remote.node import NodeCache

    root = tmp_path / "cache"
    first = NodeCache(str(root))
    (tmp_path / "link").symlink_to(root)
    second = NodeCache(str(tmp_path / "link"))
    try:
        held = second.counters()["bytes_held"]
        second.reserve(4096)
        second.reserve(8192)
        first.close()  # Gives back this pid's slot: both reservations.
        assert second.counters()["bytes_held"] == held
        second.settle(4096, downloaded=True)
        assert second.counters()["bytes_held"] == held + 4096
        second.settle(8192, downloaded=False)
        assert second.counters()["bytes_held"] == held + 4096
    finally:
        second.close()


def test_bytes_given_back_twice_are_an_assertion(cache):
    from shmloader.remote.node import _LEDGER

    held = cache.counters()["bytes_held"]
    with pytest.raises(AssertionError, match="holds -1 bytes"):
        cache.mark_absent(np.ones(1, np.uint32), 0, held + 1)
    cache._ledger[_LEDGER["held"]] = held


def test_bytes_in_flight_beyond_the_bytes_held_are_an_assertion(cache):
    from shmloader.remote.node import _LEDGER

    cache.reserve(8192)
    cache._ledger[_LEDGER["held"]] = 4096  # Another process's accounting gone wrong.
    with pytest.raises(AssertionError, match="8192 bytes in flight, 4096 held"):
        cache.mark_absent(np.ones(1, np.uint32), 0, 0)
    cache._ledger[_LEDGER["held"]] = 8192
    cache.settle(8192, downloaded=False)


_DEAD_RESERVATION = textwrap.dedent("""
    import os, sys
    from shmloader.remote.node import NodeCache
    NodeCache(sys.argv[1]).reserve(900 << 10)   # A download begun...
    os._exit(0)                                 # ...by a process killed before it ended.
""")


def test_a_dead_process_s_reservation_is_not_given_back_after_the_cache_is_counted_anew(tmp_path):
    from shmloader.remote.node import NodeCache

    root = str(tmp_path / "cache")
    NodeCache(root).close()
    assert subprocess.run([sys.executable, "-c", _DEAD_RESERVATION, root], cwd=tmp_path).returncode == 0
    view = NodeCache(root)  # No other user: counted anew from the disk, which has no reservation in it.
    try:
        counted = view.counters()["bytes_held"]
        assert counted < 900 << 10
        view.set_budget(counted + 4096)
        assert view.reserve(8192)  # Past the budget: the dead are reclaimed first, and must give nothing back.
        assert view.counters()["bytes_held"] == counted + 8192
        view.settle(8192, downloaded=False)
    finally:
        view.close()


def test_reservations_past_a_full_table_of_live_processes_are_kept_apart(cache):
    # Every slot taken by a live process that is not this one: this process's reservations
    # then go untracked instead of sharing a slot another process's close() would clear.
    parent = os.getppid()
    cache._slots[:] = (parent, 100)
    from shmloader.remote.node import _LEDGER

    cache._ledger[_LEDGER["held"]] += 100 * len(cache._slots)
    held = cache.counters()["bytes_held"]
    cache.reserve(4096)
    cache.reserve(4096)
    cache.settle(4096, downloaded=True)
    assert (cache._slots[:, 0] == parent).all() and (cache._slots[:, 1] == 100).all()
    assert cache.counters()["bytes_held"] == held + 8192
    cache.settle(4096, downloaded=False)
    assert cache.counters()["bytes_held"] == held + 4096
    cache._slots[:] = 0
    cache._ledger[_LEDGER["held"]] -= 100 * len(cache._slots)


def test_a_download_settling_after_its_cache_closed_does_nothing(tmp_path):
    from shmloader.remote.node import NodeCache

    view = NodeCache(str(tmp_path / "cache"))
    view.reserve(4096)
    view.close()  # Gives the reservation back.
    view.settle(4096, downloaded=True)
    view.close()


# Pins and fetch units of a cached object (no store: a stand-in client).

class _Store:
    """A stand-in for store.Client serving one object's bytes, streamed in uneven pieces
    that cross the cache's pages (a page's checksum then spans pieces)."""

    PIECE_BYTES = 7001

    def __init__(self, data: bytes) -> None:
        self.data, self.requests = data, 0

    def stream(self, url, etag, start, stop, size, receive):
        self.requests += 1
        view = memoryview(self.data)[start:stop]
        for offset in range(0, len(view), self.PIECE_BYTES):
            receive(offset, view[offset:offset + self.PIECE_BYTES])


def cached_copy(tmp_path, size: int, seed: int):
    """(a node cache's view under tmp_path, its empty copy of an object of `size` random
    bytes, those bytes); the caller closes the view."""
    from shmloader.remote.cache import create_object, open_object
    from shmloader.remote.node import node_cache

    root = tmp_path / "cache"
    path = str(root / "objects" / "url" / "version" / "x.bin")
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    create_object(path, "s3://bucket/x.bin", "etag", len(data), {})
    view = node_cache(str(root))
    return view, open_object(view, path, "s3://bucket/x.bin"), data


@pytest.fixture
def stored(tmp_path):
    from shmloader.remote.pages import CACHE_PAGE_BYTES

    view, found, data = cached_copy(tmp_path, 5 * CACHE_PAGE_BYTES + 100, seed=0)
    found.client = _Store(data)
    yield found, data
    view.close()


def test_a_pin_returns_with_its_pages_present_and_the_ledger_settled(stored):
    found, data = stored
    held = found.cache.counters()["bytes_held"]
    found.pin(np.array([100, 3 * 16384 + 5]), np.array([200, 40000]))
    try:
        assert (found.stamps[[0, 3, 4, 5]] != 0).all()
        assert found.cache._own_slot()[1] == 0  # Settled: nothing in flight.
        assert found.cache.counters()["bytes_held"] > held
        with open(found.path, "rb") as handle:
            assert handle.read()[100:300] == data[100:300]
    finally:
        found.unpin()


def test_a_download_settles_its_reservation_before_its_stamps_say_present(stored, monkeypatch):
    found, _ = stored
    seen = []
    settle = found.cache.settle
    monkeypatch.setattr(found.cache, "settle", lambda size, downloaded: (seen.append(
        (downloaded, int(found.stamps[1]))), settle(size, downloaded)))
    found.cache.reserve(16384)
    found._fetch_run(1, 2, 16384)
    assert seen == [(True, 0)] and found.stamps[1] != 0


def test_a_pinned_page_found_absent_is_an_error_naming_the_object(stored, monkeypatch):
    from shmloader.errors import CacheError

    found, _ = stored
    # A fetch that returns without the pages (what another process's _verify does to a pin).
    monkeypatch.setattr(found, "_fetch_missing", lambda missing, descriptor, unit_pages: None)
    with pytest.raises(CacheError, match="s3://bucket/x.bin: 1 page.*marked absent while this process held"):
        found.pin(np.array([0]), np.array([10]))
    found.unpin()


def test_a_request_past_the_object_s_last_page_is_an_assertion(stored):
    found, _ = stored
    with pytest.raises(AssertionError):
        found._download_run(found.page_count - 1, found.page_count + 1, 0, False, [])
    with pytest.raises(AssertionError):
        found._download_run(2, 2, 0, False, [])


# The Zig sampler's checks that a release build keeps.

def test_a_mixture_pattern_that_ranks_a_source_s_offsets_out_of_order_is_refused_by_the_library():
    mixture = MixtureSampler([40, 30], [2, 1], [1.0, 1.0], [False, False], batch_size=6)
    assert lib.shm_mixture_check(mixture._config) == Status.OK
    first = np.flatnonzero(mixture._pattern_sources == 0)
    mixture._pattern_ranks[first] = mixture._pattern_ranks[first][::-1].copy()  # The config points at this array.
    assert lib.shm_mixture_check(mixture._config) == Status.INVALID_PATTERN
    with pytest.raises(ValueError, match="invalid_pattern"):
        mixture.fill(0)


def test_the_release_build_refuses_a_broken_invariant_by_a_status_of_its_own():
    # Broken geometry cannot be built through a valid config; zig/ tests break it by hand
    # (permutation.zig, sampler_test.zig). Python names the status the library returns.
    assert Status.INVARIANT_BROKEN.name == "INVARIANT_BROKEN"
    assert Status(Status.INVALID_PATTERN + 1) is Status.INVARIANT_BROKEN

"""`shmloader bench`'s decisions, on a simulated clock: it warms up, keeps measuring while the
rate moves, stops once rounds agree, reports the median and spread of the settled rounds,
and calls the data cold from mincore. No assertion depends on how fast this machine is."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from shmloader.tools import measuring
from shmloader.tools.measuring import StopRule, describe_cache, measure, page_cache_share, settled, spread


class FakeLoader:
    """A loader on a simulated clock: each batch costs the seconds `cost(batch_index)` says."""

    def __init__(self, cost):
        self.now = 0.0
        self.batches = 0
        self.cost = cost

    def clock(self) -> float:
        return self.now

    def step(self) -> int:
        self.now += self.cost(self.batches)
        self.batches += 1
        return 100


def test_a_slow_start_is_warmed_up_and_left_out_of_the_figure():
    """The first second runs at a tenth of the speed (readers starting, caches filling): the
    old bench timed 500 steps from there and reported a fraction of the real rate."""
    fake = FakeLoader(lambda index: 0.01 if index < 50 else 0.001)  # 10 k rows/s, then 100 k.
    result = measure(fake.step, StopRule(), clock=fake.clock)
    assert result["settled"]
    assert result["rows_per_s"] == pytest.approx(100_000, rel=0.01)
    assert result["spread"] <= 0.03


def test_a_rate_that_keeps_moving_is_measured_to_the_time_limit_and_said_to_be_unsettled():
    # Alternating rounds of fast and slow batches: never 5 rounds within 3%.
    fake = FakeLoader(lambda index: 0.001 if (index // 250) % 2 else 0.002)
    rule = StopRule(max_s=8.0)
    result = measure(fake.step, rule, clock=fake.clock)
    assert not result["settled"]
    assert 8.0 <= result["timed_s"] < 8.0 + 2 * rule.round_s
    assert result["spread"] > rule.tolerance
    assert "NOT stable" in measuring.describe_figure(result, rule)


def test_a_steady_rate_stops_as_soon_as_the_window_agrees_and_the_least_time_passed():
    fake = FakeLoader(lambda index: 0.001)
    rule = StopRule()
    result = measure(fake.step, rule, clock=fake.clock)
    assert result["rounds"] == rule.window
    assert rule.min_s <= result["timed_s"] < rule.min_s + rule.round_s + 0.01


@pytest.mark.parametrize("rates,timed_s,expected", [
    ([100.0] * 4, 10.0, False),                            # Fewer rounds than the window.
    ([100.0] * 5, 1.0, False),                             # Not yet the least time.
    ([100.0, 101.0, 99.0, 100.5, 100.0], 2.5, True),       # Within 3%.
    ([50.0, 100.0, 101.0, 99.0, 100.5, 100.0], 3.0, True),  # Only the last window counts.
    ([100.0, 110.0, 100.0, 110.0, 100.0], 5.0, False),     # 10% apart.
    ([100.0, 110.0, 100.0, 110.0, 100.0], 20.0, True),     # The time limit.
    ([], 30.0, False),                                     # Never without a round.
])
def test_the_stop_rule(rates, timed_s, expected):
    assert settled(rates, timed_s, StopRule()) is expected


def test_a_fixed_step_count_is_one_round_without_a_warm_up():
    fake = FakeLoader(lambda index: 0.002)
    result = measure(fake.step, StopRule(steps=30), clock=fake.clock)
    assert fake.batches == 30 and result["rounds"] == 1
    assert result["rows_per_s"] == pytest.approx(100 / 0.002)


def test_spread_is_range_over_median():
    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)
    assert spread([5.0]) == 0.0


def test_the_page_cache_share_of_written_then_evicted_data(tmp_path):
    """mincore on the real file: just written, it is in the page cache; after
    POSIX_FADV_DONTNEED (clean pages go) it is not, and the line says the run read the disk."""
    path = tmp_path / "x.npy"
    np.save(path, np.arange(4 * 2**20 // 8, dtype=np.int64))
    with open(path, "rb") as handle:  # Read once: in the cache.
        handle.read()
    warm = page_cache_share([str(path)])
    assert warm is not None and warm[0] > 0.9 and warm[1] == os.path.getsize(path)
    assert "COLD" not in describe_cache(warm, warm)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    cold = page_cache_share([str(path)])
    if cold[0] > 0.5:  # tmpfs keeps its pages whatever is advised: nothing to evict there.
        pytest.skip("this file system keeps the pages in memory (tmpfs)")
    assert "COLD" in describe_cache(cold, warm)


@pytest.mark.parametrize("share,cold", [(0.0, True), (0.5, True), (0.89, True), (0.9, False), (1.0, False)])
def test_cold_is_named_below_nine_tenths(share, cold):
    line = describe_cache((share, 10**9), (1.0, 10**9))
    assert ("COLD" in line) is cold
    assert "does not stay" not in line


def test_data_that_leaves_the_cache_during_the_run_is_called_disk_bound():
    assert "does not stay in the page cache" in describe_cache((1.0, 10**9), (0.3, 10**9))
    assert "not measured" in describe_cache(None, None)


def test_a_directory_of_files_and_a_glob_count_every_file(tmp_path):
    for index in range(3):
        (tmp_path / f"part-{index}.bin").write_bytes(b"x" * mmap.PAGESIZE * 2)
    (tmp_path / "empty").write_bytes(b"")
    by_glob = page_cache_share([str(tmp_path / "part-*.bin")])
    by_directory = page_cache_share([str(tmp_path)])
    assert by_glob[1] == by_directory[1] == 6 * mmap.PAGESIZE
    assert page_cache_share([str(tmp_path / "empty")]) is None


def test_an_unsettled_figure_is_the_median_of_every_round_with_its_middle_half():
    """A few slow rounds at the end (another process took the core) do not make the figure:
    the median of every round does, and the middle half's spread is shown."""
    rule = StopRule(max_s=5.0)
    rates = [100.0] * 7 + [100.0, 40.0, 100.0, 45.0, 50.0]  # The last 5 rounds: 3 slow.
    result = measuring.summary(rates, 6.0, rule)
    assert not result["settled"] and result["rows_per_s"] == 100.0
    assert result["rounds_used"] == len(rates)
    settled_result = measuring.summary([100.0] * 5, 2.5, StopRule())
    assert settled_result["settled"] and settled_result["rounds_used"] == 5

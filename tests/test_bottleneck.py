"""stats()["bottleneck"] names the stage that limits the loader: end to end, loaders built so
that one stage dominates by a wide margin (a training step of 50 ms against fills of a
millisecond, a __getitem__ or transform that sleeps 50 ms against a trainer that does not,
batches the trainer keeps, a fill that does not end, which the stall warning names too, a
store behind a slow link, and cold data read through a blkio cgroup that throttles the disk,
which `top` names too, within a memory group smaller than the data: the disk where the
shuffle_window fits the group, the page cache's memory where it does not, top too); and
diagnose() itself on counters written by hand for every stage, cores free or not. (A node cache below the data: test_cache_budget.py.)
No assertion compares timings: each case is limited by one stage whatever the machine's load."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import time
import uuid
import warnings

import numpy as np
import pytest

import dataset_fixtures as fixtures
from conftest import child_environment, examples, our_shm_entries, wait_until
from hypothesis import given
from hypothesis import strategies as st
from shmloader import ReaderStallWarning, ShmDataLoader
from shmloader.readers import supervision
from shmloader.readers.bottleneck import STAGES, Context, Meter, ReaderCounters, Reading, diagnose, zero_reading
from shmloader.readers.disk_device import DiskCounters
from shmloader.readers.page_cache import MemoryCounters

# A training step, or a sample's __getitem__, that dominates what the other side takes.
_SLOW_SECONDS = 0.05
# A link slow enough that a few steps' pages of a 6 MB object take seconds.
_LINK_BYTES_PER_SECOND = 2e6
# A disk this slow (1 MiB/s) makes a step of 256 KiB wait for it a quarter of a second,
# against the microseconds its copy takes: the readers wait for the disk on any host load.
_DISK_BYTES_PER_SECOND = 1 << 20
# cgroup v1's blkio hierarchy, where this host has one.
_BLKIO_ROOT = pathlib.Path("/sys/fs/cgroup/blkio")
# cgroup v1's memory hierarchy; a group made in this process's own there holds the page
# cache its child reads to this much: about the loader's own memory (its processes, ~45 MB)
# and the ~50 MB of pages a fitting window's pass keeps, with room to spare (in 80 MiB such a
# pass read its blocks again once the group was full).
_MEMORY_ROOT = pathlib.Path("/sys/fs/cgroup/memory")
_MEMORY_GROUP_BYTES = 128 << 20
# Rows of 4 KiB, 320 MiB of them (more than twice the group), read at 32 MiB/s: the disk
# limits a pass in any load a CI machine has, and the group's worth is read in seconds.
_LARGE_ROWS, _STREAM_BYTES_PER_SECOND = 81920, 32 << 20
# A window of 16 MiB of rows (blocks of 2 MiB: plan/planner.shuffle_block_rows), with the
# blocks read ahead 24 MiB, fits the group beside the loader; one of 192 MiB (blocks of
# 24 MiB, 288 MiB asked for) does not.
_WINDOW_FITS_ROWS, _WINDOW_TOO_LARGE_ROWS = 4096, 49152
# The fitting window's child looks on this long: past the group's worth read at the throttle's rate.
_LOOK_PAST_THE_LIMIT_SECONDS = 6.0
# The child trainer's bound on asking what limits it, and the test's on the child.
_CHILD_DEADLINE_SECONDS, _CHILD_TIMEOUT_SECONDS = 30.0, 90.0


def _windowed(loader, steps: int, step_seconds: float = 0.0, keep: int = 0) -> dict:
    """The bottleneck over `steps` steps after a warm-up (readers started, a first reading
    taken): the second stats() judges the steps between the two. `keep`: batches the
    trainer holds on to, the newest ones."""
    kept = []
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    loader.stats()
    for _ in range(steps):
        batch = next(iterator)
        if keep:
            kept = (kept + [batch])[-keep:]
        del batch
        time.sleep(step_seconds)
    verdict = loader.stats()["bottleneck"]
    kept.clear()
    return verdict


def test_a_slow_training_step_names_the_trainer():
    with ShmDataLoader.from_dataset(fixtures.Sleepy(0.0), batch_size=4, readers=1) as loader:
        verdict = _windowed(loader, 20, step_seconds=_SLOW_SECONDS)
    assert verdict["stage"] == "trainer", verdict
    assert "nothing to do" in verdict["advice"] and verdict["line"].startswith("bottleneck: the training step")


def test_a_slow_getitem_names_the_users_code_and_its_share():
    with ShmDataLoader.from_dataset(fixtures.Sleepy(_SLOW_SECONDS), batch_size=2, readers=1) as loader:
        verdict = _windowed(loader, 6)
        reader = loader.stats()["readers"][0]
    assert verdict["stage"] == "user_code", verdict
    assert "__getitem__" in verdict["line"] and verdict["detail"]["shares"]["user"] > 0.5, verdict
    # A sleep is off the CPU: another reader overlaps it without a free core.
    assert "readers=2" in verdict["advice"], verdict
    assert 0 < reader["user_s"] <= reader["busy_s"], reader


def test_a_slow_transform_names_the_transform(tmp_path):
    np.save(tmp_path / "data.npy", np.arange(400 * 4, dtype=np.float32).reshape(400, 4))
    with ShmDataLoader({"data": str(tmp_path / "data.npy")}, batch_size=4, readers=1,
                       transform="transform_fixtures:sleeps") as loader:
        verdict = _windowed(loader, 8)
    assert verdict["stage"] == "user_code" and "the transform" in verdict["line"], verdict


def test_a_trainer_that_outruns_compressed_fields_names_decompression(tmp_path):
    """Fields of ZSTD at level 9, a trainer that does nothing: readers spend their fills in
    decompressing (the file is in the page cache: nothing is read from storage)."""
    from conftest import image_like, write_b2nd

    path = write_b2nd(tmp_path / "x.b2nd", image_like(8192, (256,)), chunks=(1024, 256), blocks=(128, 256),
                      codec="ZSTD", clevel=9)
    with ShmDataLoader({"x": path}, batch_size=512, readers=1, warn_layout=False) as loader:
        verdict = _windowed(loader, 30)
    assert verdict["stage"] == "decompression", verdict
    assert "--codec lz4" in verdict["advice"], verdict


def test_a_trainer_that_outruns_plain_rows_names_reader_cpu(tmp_path):
    # 4 MiB batches of random rows over 300 steps: the reader's gather outweighs the
    # trainer's next() by far, and the ring's first fill is a small part of the window (with
    # 60 steps of 1 MiB a loaded CI host once saw the trainer as the limit).
    np.save(tmp_path / "x.npy", np.ones((16384, 256), np.float32))
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=4096, readers=1) as loader:
        verdict = _windowed(loader, 300)
    assert verdict["stage"] == "reader_cpu", verdict


def test_batches_the_trainer_keeps_name_held_batches():
    slots = 8
    with ShmDataLoader.from_dataset(fixtures.Sleepy(0.005), batch_size=4, readers=2, slots=slots) as loader:
        verdict = _windowed(loader, 20, keep=slots - 1)
    assert verdict["stage"] == "held", verdict
    assert "release" in verdict["advice"] and verdict["detail"]["held_slots"] >= slots - 1, verdict


def test_the_stall_warning_names_a_fill_that_does_not_end(tmp_path, monkeypatch):
    monkeypatch.setattr(supervision, "STALL_WARNING_SECONDS", 1.0)
    np.save(tmp_path / "x.npy", np.arange(16, dtype=np.int64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=4, mode="sequential", readers=1, slots=4,
                           transform="transform_fixtures:slow_on_row_nine") as loader:
            for _ in zip(range(4), loader):
                pass
    stalls = [str(warning.message) for warning in caught if issubclass(warning.category, ReaderStallWarning)]
    assert stalls and "bottleneck: a fill that has not ended" in stalls[0], stalls


def test_stats_before_and_after_close_keep_the_same_form(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((64, 2), np.float32))
    loader = ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=8, readers=1)
    first = loader.stats()["bottleneck"]
    next(loader)
    loader.close()
    after = loader.stats()["bottleneck"]
    for verdict in (first, after):
        assert verdict["stage"] in STAGES and set(verdict) == {"stage", "utilisation", "advice", "line",
                                                               "window_s", "detail"}, verdict


# diagnose() on counters written by hand: one window of 10 s, two readers.

_WINDOW_NS = 10_000_000_000


def _reader(busy_s: float, user_s=0.0, read_s=0.0, fetch_s=0.0, cpu_s=None, storage_bytes=None, batches=100,
            queued_s=None):
    ns = 1_000_000_000
    return ReaderCounters(7, int(busy_s * ns), batches, int(user_s * ns), int(read_s * ns), int(fetch_s * ns),
                          cpu_ns=None if cpu_s is None else int(cpu_s * ns),
                          queued_ns=None if queued_s is None else int(queued_s * ns), storage_read_bytes=storage_bytes)


def _readings(readers, waited_s: float, held: int = 0, idle_cores: float | None = 0.0, evicted=None,
              filling=False):
    before = Reading(0, 0, tuple(ReaderCounters(7, 0, 0, cpu_ns=None if r.cpu_ns is None else 0,
                                                queued_ns=None if r.queued_ns is None else 0,
                                                storage_read_bytes=None if r.storage_read_bytes is None else 0)
                                 for r in readers), 8, 0, 0, 0, 4, None if evicted is None else 0)
    if filling:  # Fills that began before the window and go on: no counter moved in it.
        before = Reading(0, 0, tuple(readers), 8, 0, 0, 0, 4)
        readers = [ReaderCounters(r.pid, r.busy_ns, r.batches, filling=True) for r in readers]
    after = Reading(_WINDOW_NS, int(waited_s * 1e9), tuple(readers), 8, held,
                    None if idle_cores is None else int(idle_cores / 4 * _WINDOW_NS), _WINDOW_NS, 4, evicted)
    return before, after


@pytest.mark.parametrize("case, readers, options, context, stage, words", [
    ("a trainer that barely waits", [_reader(2), _reader(2)], dict(waited_s=0.2), Context(), "trainer",
     "readers=1 would keep up"),
    ("readers on the CPU, cores idle", [_reader(10, read_s=2, cpu_s=10), _reader(10, read_s=2, cpu_s=10)],
     dict(waited_s=6, idle_cores=2.5), Context(local_readers=2), "reader_cpu", "readers=4"),
    ("readers on the CPU, no core idle", [_reader(10, read_s=2, cpu_s=10), _reader(10, read_s=2, cpu_s=10)],
     dict(waited_s=6, idle_cores=0.2), Context(local_readers=2), "reader_cpu", "no core is idle"),
    ("compressed fields", [_reader(10, read_s=8, cpu_s=10), _reader(10, read_s=8, cpu_s=10)],
     dict(waited_s=6), Context(compressed=True, local_readers=2), "decompression", "--codec lz4"),
    ("reads that block on storage", [_reader(10, read_s=9, cpu_s=2, storage_bytes=10**9)] * 2,
     dict(waited_s=6), Context(compressed=True, local_readers=2), "disk", "200 MB/s"),
    ("waits for a store's pages", [_reader(10, fetch_s=8), _reader(10, fetch_s=8)],
     dict(waited_s=6, evicted=0), Context(local_readers=2), "link", "object store"),
    ("waits for pages a small cache evicted", [_reader(10, fetch_s=8), _reader(10, fetch_s=8)],
     dict(waited_s=6, evicted=500 * 10**6), Context(local_readers=2), "cache", "cache_bytes"),
    ("the user's code", [_reader(10, user_s=9, cpu_s=9)] * 2, dict(waited_s=6, idle_cores=0.0),
     Context(user_code="the transform", local_readers=2), "user_code", "make the transform cheaper"),
    ("the user's code asleep", [_reader(10, user_s=9, cpu_s=1, queued_s=0)] * 2, dict(waited_s=6, idle_cores=0.0),
     Context(user_code="the transform", local_readers=2), "user_code", "more readers overlap those waits: readers=4"),
    ("the user's code waiting for a core", [_reader(10, user_s=9, cpu_s=4, queued_s=5)] * 2,
     dict(waited_s=6, idle_cores=0.0), Context(user_code="the transform", local_readers=2), "user_code",
     "wait for a core 50%"),
    ("batches held", [_reader(2), _reader(2)], dict(waited_s=6, held=7), Context(local_readers=2), "held",
     "holds 7 of 8"),
    ("a fill that has not ended", [_reader(0.5, batches=50)] * 2, dict(waited_s=9.5, filling=True, idle_cores=None),
     Context(local_readers=2), "stalled", "filled one step"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_diagnose_names_the_stage_its_counters_describe(case, readers, options, context, stage, words):
    before, after = _readings(readers, **options)
    verdict = diagnose(before, after, context)
    assert verdict["stage"] == stage, (case, verdict)
    assert words in verdict["advice"], (case, verdict)
    assert 0.0 <= verdict["utilisation"] <= 1.0 and verdict["line"].startswith("bottleneck: ")


@pytest.mark.parametrize("case, readers, options, auto_most, words", [
    ("cores idle, within auto's most", [_reader(10, read_s=2, cpu_s=10)] * 2, dict(waited_s=6, idle_cores=2.5), 8,
     "4 readers, which auto adds as cores and the node's budget (SHMLOADER_CPU_BUDGET) allow"),
    ("cores idle, past auto's most", [_reader(10, read_s=2, cpu_s=10)] * 2, dict(waited_s=6, idle_cores=2.5), 3,
     "4 readers, past auto's most (3): AutoReaders(most=4)"),
    ("the user's code asleep", [_reader(10, user_s=9, cpu_s=1, queued_s=0)] * 2, dict(waited_s=6, idle_cores=0.0), 2,
     "AutoReaders(most=4)"),
    ("a trainer that barely waits", [_reader(2), _reader(2)], dict(waited_s=0.2), 8, "auto retires those 1 do not"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_advice_under_auto_names_what_auto_does_or_its_bound_never_a_fixed_count(case, readers, options, auto_most,
                                                                                 words):
    """readers="auto", the default: "readers=4" would end its sizing for good."""
    before, after = _readings(readers, **options)
    verdict = diagnose(before, after, Context(local_readers=2, auto_most=auto_most))
    assert words in verdict["advice"], (case, verdict)
    assert "readers=" not in verdict["advice"].replace("AutoReaders(most=", ""), (case, verdict)


def test_a_restarted_reader_counts_from_zero_and_no_window_says_unknown():
    before = Reading(0, 0, (ReaderCounters(5, 9 * 10**9, 900),), 4, 0)
    after = Reading(_WINDOW_NS, 9 * 10**9, (ReaderCounters(6, 10**10, 10, user_ns=9 * 10**9),), 4, 0)
    verdict = diagnose(before, after, Context(user_code="the transform", local_readers=1))
    assert verdict["stage"] == "user_code" and verdict["detail"]["readers_busy"] == 1.0, verdict
    assert diagnose(after, after, Context())["stage"] == "unknown"


def test_the_disk_verdict_compares_the_readers_reads_with_their_disks_window():
    """Readers blocked on storage: with the counters of the disk their files are on, the
    verdict names it, its busy share, its rate and the best seen before (the meter's); without
    them (tmpfs, no /proc/diskstats) it says what it said before and no device."""
    readers = [_reader(10, read_s=9, cpu_s=2, storage_bytes=10**9)] * 2
    before, after = _readings(readers, waited_s=6)
    context = Context(local_readers=2)
    plain = diagnose(before, after, context)
    assert plain["stage"] == "disk" and "device" not in plain["detail"] and "the device" not in plain["line"], plain
    before = dataclasses.replace(before, disks=(DiskCounters("sdb", 10**12, 5_000), DiskCounters("sdc", 0, 0)))
    after = dataclasses.replace(after, disks=(DiskCounters("sdb", 10**12 + 3 * 10**9, 14_800),
                                              DiskCounters("sdc", 10**6, 10_000)))
    verdict = diagnose(before, after, context, {"sdb": 310e6})
    assert verdict["stage"] == "disk", verdict
    assert {name: verdict["detail"][name] for name in ("device", "device_busy", "device_read_bytes_per_s",
                                                         "device_best_bytes_per_s")} == {
        "device": "sdb", "device_busy": 0.98, "device_read_bytes_per_s": 300 * 10**6,
        "device_best_bytes_per_s": 310 * 10**6}, verdict
    assert "the device (sdb) was busy 98% of the window at 300 MB/s (the best seen from it here 310 MB/s)" in \
        verdict["line"] and "more readers would not help" in verdict["line"], verdict


@pytest.mark.parametrize("case, read_bytes, refault_bytes, stage", [
    ("reads again what the group evicted", 6 * 10**9, 5 * 10**9, "memory"),
    ("a cold pass's read-ahead, nothing read again", 6 * 10**9, 0, "disk"),
    ("a later pass over data larger than memory, each byte once", 10**9, 10**9, "disk"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_the_memory_verdict_needs_reads_past_the_rows_and_refaults(case, read_bytes, refault_bytes, stage):
    """Readers blocked on storage that delivered 100 steps of 1,000 rows of 10 kB (1 GB) each:
    the page cache's memory is named only where they read more than the rows need and much
    of it was refaulted; its words name the group and its limit."""
    readers = [_reader(10, read_s=9, cpu_s=2, storage_bytes=read_bytes // 2)] * 2
    before, after = _readings(readers, waited_s=6)
    before = dataclasses.replace(before, memory=MemoryCounters(10**6, 2**30, "/jobs/a"))
    after = dataclasses.replace(after, memory=MemoryCounters(10**6 + refault_bytes, 2**30, "/jobs/a"))
    verdict = diagnose(before, after, Context(local_readers=2, batch_size=1000, row_bytes=5000.0))
    assert verdict["stage"] == stage, (case, verdict)
    assert verdict["detail"]["read_amplification"] == read_bytes / 10**9, (case, verdict)
    if stage == "memory":
        assert "the page cache (the memory group /jobs/a's limit of 1,024 MiB) cannot hold" in verdict["line"], verdict


@pytest.mark.parametrize("case, window_s, group, words", [
    ("an epoch start's read-ahead on a second pass, seen over the stall warning's second", 1.0, "/jobs/a",
     "not judged: a window of 1.0 s"),
    ("the machine's counters (/proc/vmstat, a root group)", 10.0, "", "(the machine) counts other jobs' refaults"),
    ("a top-level slice", 10.0, "/user.slice", "counts other jobs' refaults"),
    ("a login session's scope", 10.0, "/user.slice/user-1000.slice/session-4.scope", "counts other jobs' refaults"),
    ("the same burst over a window long enough to judge, in the job's own group", 10.0, "/jobs/a", None),
], ids=lambda value: value if isinstance(value, str) else "")
def test_no_memory_verdict_from_a_short_window_or_counters_other_jobs_share(case, window_s, group, words):
    """An epoch start on a second pass over data larger than memory: the window's blocks are
    read ahead (3 times the stored bytes of the rows dealt meanwhile) and nearly all of that is
    refaults. Over a window shorter than MEMORY_WINDOW_SECONDS_MIN, or from counters that count
    other jobs' refaults, the verdict is not memory and the detail says why; over a long
    window in the job's own group those counters do say memory."""
    scale = window_s / 10  # The counters of test_the_memory_verdict_needs_reads_past_the_rows_and_refaults, scaled.
    window_ns = int(window_s * 1e9)
    stored = 100 * 1000 * 5000 * scale  # Each reader's rows'.
    readers = [_reader(10 * scale, read_s=9 * scale, cpu_s=2 * scale, storage_bytes=int(3 * stored),
                       batches=round(100 * scale))] * 2
    before, after = _readings(readers, waited_s=6 * scale)
    before = dataclasses.replace(before, memory=MemoryCounters(0, 2**30, group))
    after = dataclasses.replace(after, at_ns=window_ns, cores_total_ns=window_ns,
                                memory=MemoryCounters(int(5.8 * stored), 2**30, group))
    verdict = diagnose(before, after, Context(local_readers=2, batch_size=1000, row_bytes=5000.0))
    assert verdict["detail"]["read_amplification"] == 3.0 and verdict["detail"]["refaulted_share"] > 0.9, verdict
    if words is None:
        assert verdict["stage"] == "memory", (case, verdict)
        return
    assert verdict["stage"] == "disk" and not verdict["detail"]["page_cache_short"], (case, verdict)
    assert words in verdict["detail"]["page_cache"], (case, verdict)


def test_a_mixtures_stored_bytes_per_row_weigh_each_source_by_the_rows_it_delivers(tmp_path):
    """A source of 1% of the rows, each of 32,768 tokens, at half the weight, beside 12,672
    short documents: the stored bytes a delivered row takes, which the readers' reads are
    compared with, are the mean over the rows the sampler deals (each row's tokens, as
    written here: 16 MiB, whole chunks of the file) and not the mean over all rows, 48 times
    lower."""
    from shmloader import Padded, Source
    from shmloader.tools.convert import write_ragged

    rng = np.random.default_rng(5)
    short = [rng.integers(0, 1000, size=32, dtype=np.int32) for _ in range(12_672)]
    long = [rng.integers(0, 1000, size=32768, dtype=np.int32) for _ in range(128)]
    write_ragged(tmp_path / "short.ragged", short, codec="none")
    write_ragged(tmp_path / "long.ragged", long, codec="none")
    sources = [Source({"tokens": Padded(str(tmp_path / name), max_length=32768)}, weight=1)
               for name in ("short.ragged", "long.ragged")]
    with ShmDataLoader(sources, batch_size=8, readers=1, seed=3, slots=4) as loader:
        row_bytes = loader._session.meter.context.row_bytes
        sampler = loader._session.plan.sampler
        dealt = [(short, long)[int(source)][int(row)].nbytes for step in range(200)
                 for row, source in zip(*sampler.fill(step))]
    assert row_bytes == pytest.approx(np.mean(dealt), rel=0.05), (row_bytes, np.mean(dealt))
    assert row_bytes > 40 * sum(document.nbytes for document in short + long) / 12_800, row_bytes


def test_the_meter_judges_from_the_reading_before_once_it_has_one():
    """The first diagnosis counts from the ring's start; the next from the reading before,
    leaving a slow start-up out."""
    start = time.monotonic_ns() - 20 * 10**9
    readings = iter([
        Reading(start + 10**9, 9 * 10**8, (ReaderCounters(1, 10**8, 1),), 4, 0),  # Waited 90% of the first second.
        Reading(start + 11 * 10**9, 10**9, (ReaderCounters(1, 2 * 10**8, 50),), 4, 0),  # Then 1% of 10 s.
    ])
    meter = Meter(lambda **_: next(readings), Context(local_readers=1), zero_reading(start, 4, 1))
    assert meter.diagnosis()["stage"] != "trainer"
    verdict = meter.diagnosis()
    assert verdict["stage"] == "trainer" and verdict["window_s"] == 10.0, verdict


def test_a_slow_store_names_the_link(tmp_path):
    """Fields in a store behind a proxy that answers reads of an object's bytes as one link of
    2 MB/s would, through a cache that holds the data: in the first pass readers wait for
    pages, nothing is evicted, and the link is named, not the cache."""
    pytest.importorskip("moto.server")
    pytest.importorskip("obstore")
    pytest.importorskip("boto3")
    import threading

    from test_cache_trainers import _Refusing, _RefusingHandler
    from test_object_store import serving

    link = threading.Lock()  # One link: requests share its rate.

    class SlowHandler(_RefusingHandler):
        def do_GET(self) -> None:
            self._forward()  # Every read answered (the refusing proxy's forwarding), the slow link's way.

        def send_response(self, *arguments) -> None:
            wanted = self.headers.get("Range") or ""
            if wanted.startswith("bytes=") and not wanted.startswith("bytes=0-"):
                first, _, last = wanted[len("bytes="):].partition("-")
                with link:
                    time.sleep((int(last or first) - int(first) + 1) / _LINK_BYTES_PER_SECOND)
            super().send_response(*arguments)

    class SlowLink(_Refusing):
        def handle_error(self, request, client_address) -> None:
            pass  # A loader closed with fetches ahead in flight drops their connections: not this test's.

    rows = np.random.default_rng(7).integers(0, 1 << 60, size=(3000, 256), dtype=np.int64)  # 6 MB, 2 KB a row.
    np.save(tmp_path / "rows.npy", rows)
    with serving() as server:
        url = server.upload(str(tmp_path / "rows.npy"), "bottleneck/rows.npy")
        proxy = SlowLink(server.port)
        proxy.RequestHandlerClass = SlowHandler
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        try:
            # In order, through a cache of twice the data: fetched in units of a 32nd of it, as the steps
            # come, each once (remote/cache.set_fetch_unit).
            with ShmDataLoader({"x": url}, cache_dir=tmp_path / "cache", cache_bytes=2 * rows.nbytes, batch_size=32,
                               readers=2, mode="sequential", storage_options={"endpoint": proxy.endpoint}) as loader:
                verdict = _windowed(loader, 20)
        finally:
            proxy.shutdown()
            proxy.server_close()
            thread.join(timeout=10)
    assert verdict["stage"] == "link", verdict
    assert verdict["detail"]["cache_evicted_bytes"] == 0 and "object store" in verdict["advice"], verdict


def _whole_disk(path: pathlib.Path) -> str:
    """"MAJOR:MINOR" of the disk `path` is stored on (a partition's disk: blkio throttles
    whole disks); skips where no block device holds it (tmpfs, overlay)."""
    device = os.stat(path).st_dev
    sysfs = pathlib.Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    if not sysfs.exists():
        pytest.skip(f"{path} is on no block device (device {os.major(device)}:{os.minor(device)}: tmpfs or "
                    f"overlay?): no disk to throttle")
    if (sysfs / "partition").exists():
        sysfs = sysfs.resolve().parent
    return (sysfs / "dev").read_text().strip()


def _remove_group(group: pathlib.Path) -> None:
    """Removes cgroup `group` once its processes have gone: the child trainer's readers and fork
    server die with it (PR_SET_PDEATHSIG); any still there are moved back to the group above,
    which a cgroup's removal needs."""
    procs = group / "cgroup.procs"
    wait_until(lambda: not procs.read_text().split(), timeout=10, interval=0.05)
    for pid in procs.read_text().split():
        try:
            (group.parent / "cgroup.procs").write_text(pid)
        except ProcessLookupError:
            pass  # Exited meanwhile.
    assert wait_until(lambda: _removed(group), timeout=10, interval=0.05), f"{group} could not be removed"


def _removed(group: pathlib.Path) -> bool:
    try:
        group.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False  # EBUSY: a process is still leaving.
    return True


@contextlib.contextmanager
def _group(root: pathlib.Path, setting: str, value: str):
    """A new cgroup (v1) under `root` with `setting` written `value`: its cgroup.procs file,
    for the test's child trainer to join. Removed at the end, however the test ends. Skips
    where the host has no such controller or it cannot be written (cgroup v2 alone, a
    container's read-only /sys, not root)."""
    if not (root / setting).exists():
        pytest.skip(f"no cgroup v1 controller with {setting} at {root}: no group to test in")
    group = root / f"shmloader-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a cgroup at {group}: {error}")
    try:
        try:
            (group / setting).write_text(value)
        except OSError as error:
            pytest.skip(f"cannot write {value!r} to {group / setting}: {error}")
        yield group / "cgroup.procs"
    finally:
        _remove_group(group)


@pytest.fixture
def throttled_disk(tmp_path):
    """A blkio group that limits reads from the disk under tmp_path to _DISK_BYTES_PER_SECOND."""
    with _group(_BLKIO_ROOT, "blkio.throttle.read_bps_device", f"{_whole_disk(tmp_path)} {_DISK_BYTES_PER_SECOND}") \
            as procs:
        yield procs


def _cold(path: pathlib.Path) -> None:
    """Drops `path`'s pages from the page cache, written back first: reading it reads the disk."""
    os.sync()
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def test_cold_rows_on_a_throttled_disk_name_disk_reads_in_stats_and_top(tmp_path, throttled_disk):
    """32 MiB of rows, out of the page cache, read by readers in a group whose disk gives
    1 MiB/s: they wait for the disk most of every fill, and both stats()["bottleneck"] and
    top's view of the ring name disk reads, the disk the file is on (its uevent's name),
    how busy it was, and the group's limit that holds the readers back rather than the disk
    (the child trainer asks them in turn: bottleneck_child.py)."""
    path = tmp_path / "rows.npy"
    np.save(path, np.random.default_rng(11).integers(0, 256, size=(8192, 4096), dtype=np.uint8))
    found = _child_verdicts([throttled_disk], path, "disk", "the readers' cgroup limits reads")
    verdict = found["verdict"]
    assert verdict["stage"] == "disk", found
    assert "from storage" in verdict["advice"] and verdict["detail"]["readers_blocked"] >= 0.5, found
    assert verdict["detail"]["storage_read_bytes_per_s"] > 0, found
    assert "bottleneck: disk reads at" in found["top"], found
    for said in (verdict, found["top_verdict"]):
        _assert_names_the_disk(said, _disk_name(_whole_disk(tmp_path)), found)
        # The disk is not what holds the readers back: the group's limit is, and the verdict says so.
        assert said["detail"]["device_read_limit_bytes_per_s"] == _DISK_BYTES_PER_SECOND, found
        assert said["detail"]["device_read_limit_source"].endswith(throttled_disk.parent.name), found
        assert "the readers' cgroup limits reads from it to 1 MB/s" in said["line"], found


def _child_verdicts(groups: list[pathlib.Path], path: pathlib.Path, expected: str, words: str,
                    options: dict | None = None) -> dict:
    """What bottleneck_child.py, in `groups` (their cgroup.procs files), saw reading `path` cold."""
    _cold(path)
    child = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).with_name("bottleneck_child.py")),
                              ",".join(map(str, groups)), str(path), expected, str(_CHILD_DEADLINE_SECONDS), words,
                              json.dumps(options or {})],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_environment())
    try:
        output, errors = child.communicate(timeout=_CHILD_TIMEOUT_SECONDS)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0 and output, (child.returncode, errors)
    assert wait_until(lambda: not our_shm_entries(child.pid), timeout=10), our_shm_entries(child.pid)
    found = json.loads(output)
    found["errors"] = errors[-4000:]  # Each verdict the child saw, for a failure's message.
    return found


def _own_memory_group() -> pathlib.Path:
    """This process's cgroup v1 memory group: a test's group is made inside it, so that the
    host's limits above still hold."""
    for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, group = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _MEMORY_ROOT / group.strip("/")
    pytest.skip("this process is in no cgroup v1 memory group: no memory group to test in")


@pytest.fixture
def memory_and_disk(tmp_path):
    """A memory group of _MEMORY_GROUP_BYTES (its page cache counted against it) and a blkio
    group that limits reads from the disk under tmp_path to _STREAM_BYTES_PER_SECOND."""
    throttle = f"{_whole_disk(tmp_path)} {_STREAM_BYTES_PER_SECOND}"
    with _group(_own_memory_group(), "memory.limit_in_bytes", str(_MEMORY_GROUP_BYTES)) as memory, \
            _group(_BLKIO_ROOT, "blkio.throttle.read_bps_device", throttle) as disk:
        yield [memory, disk]


def _rows_larger_than_the_group(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "rows.npy"
    np.save(path, np.random.default_rng(13).integers(0, 256, size=(_LARGE_ROWS, 4096), dtype=np.uint8))
    assert path.stat().st_size > 2 * _MEMORY_GROUP_BYTES
    return path


def test_a_window_that_fits_a_memory_group_over_larger_data_names_the_throttled_disk(tmp_path, memory_and_disk):
    """Rows twice the memory group's size, read cold through a shuffle_window whose blocks
    (and those read ahead) fit the group beside the loader's own memory: each byte is read
    about once and nothing is read again, so for as long as the child looks (past the point
    where the group would be full) the verdict is the disk, the throttled one, never memory."""
    found = _child_verdicts(memory_and_disk, _rows_larger_than_the_group(tmp_path), "disk",
                            "the readers' cgroup limits reads",
                            {"mode": "shuffle", "seed": 1, "shuffle_window": _WINDOW_FITS_ROWS,
                             "look_seconds_min": _LOOK_PAST_THE_LIMIT_SECONDS})
    verdict = found["verdict"]
    assert verdict["stage"] == "disk" and found["top_verdict"]["stage"] == "disk", found
    assert all("memory" not in pair for pair in found["seen"]), found
    _assert_names_the_disk(verdict, _disk_name(_whole_disk(tmp_path)), found)
    assert verdict["detail"]["read_amplification"] < 1.5 and verdict["detail"]["refaulted_share"] < 0.25, found
    assert verdict["detail"]["memory_limit_bytes"] == _MEMORY_GROUP_BYTES, found


def test_a_window_larger_than_its_memory_group_names_the_page_cache(tmp_path, memory_and_disk):
    """The same rows, group and disk, through a window whose blocks read ahead take twice
    the group: the blocks read ahead are evicted before their rows are dealt and read again, and
    stats() names the page cache's memory, the group and its limit, not the disk; so does top,
    from the stored bytes per row the trainer wrote into the ring's header."""
    found = _child_verdicts(memory_and_disk, _rows_larger_than_the_group(tmp_path), "memory",
                            "cannot hold what the readers read ahead",
                            {"mode": "shuffle", "seed": 1, "shuffle_window": _WINDOW_TOO_LARGE_ROWS})
    said = found["verdict"]
    assert said["stage"] == "memory", found
    assert said["detail"]["read_amplification"] >= 1.5 and said["detail"]["refaulted_share"] >= 0.25, found
    assert f"{memory_and_disk[0].parent.name}'s limit of {_MEMORY_GROUP_BYTES >> 20} MiB" in said["line"], found
    assert found["top_verdict"]["stage"] == "memory", found
    assert "cannot hold what the readers read ahead" in found["top"], found


def _disk_name(device: str) -> str:
    """The kernel's name for disk "MAJOR:MINOR" (its uevent's DEVNAME): the reference the
    verdict's device is checked against."""
    for line in pathlib.Path(f"/sys/dev/block/{device}/uevent").read_text().splitlines():
        if line.startswith("DEVNAME="):
            return line.partition("=")[2]
    pytest.fail(f"/sys/dev/block/{device}/uevent has no DEVNAME line")


def _assert_names_the_disk(verdict: dict, name: str, found: dict) -> None:
    """The disk verdict names the disk the data is on, how busy it was and its rates."""
    detail = verdict["detail"]
    assert detail["device"] == name, found
    assert 0.0 <= detail["device_busy"] <= 1.0, found
    assert 0 < detail["device_read_bytes_per_s"] <= detail["device_best_bytes_per_s"], found
    assert f"the device ({name}) was busy {detail['device_busy']:.0%} of the window" in verdict["line"], found


@examples(60)
@given(user_code=st.sampled_from([None, "the transform", "the dataset's __getitem__"]), compressed=st.booleans(),
       row_bytes=st.floats(1e-3, 1e12), auto_most=st.one_of(st.none(), st.integers(1, 10_000)),
       readers=st.integers(0, 64), batch_size=st.integers(1, 1 << 20))
def test_the_rings_header_carries_a_context_whole(user_code, compressed, row_bytes, auto_most, readers, batch_size):
    """What the trainer writes of its readers' work (header_words) is what top reads back
    (context_of_header): the same Context, the row's bytes to the bit (plan_context's: a
    dataset's rows have none)."""
    from shmloader.readers.bottleneck import context_of_header, header_words

    row_bytes = None if user_code == "the dataset's __getitem__" else row_bytes
    context = Context(user_code, compressed, readers, batch_size, row_bytes, auto_most=auto_most)
    assert context_of_header(*header_words(context), readers, batch_size) == context


@examples(60)
@given(bits=st.integers(0, (1 << 64) - 1), runs=st.integers(0, (1 << 32) - 1), auto_most=st.integers(0, (1 << 32) - 1))
def test_a_foreign_headers_words_give_a_context_top_can_judge_with(bits, runs, auto_most):
    """Any words a planted or damaged header holds: no error, a row's bytes positive and finite
    or unknown (then the detail says why), and a diagnosis over them."""
    from shmloader.readers.bottleneck import context_of_header

    context = context_of_header(bits, runs, auto_most, 1, 64)
    assert context.row_bytes is None or (math.isfinite(context.row_bytes) and context.row_bytes > 0)
    assert context.user_code in (None, "the transform", "the dataset's __getitem__")
    before, after = _readings([_reader(2)], waited_s=6)
    assert diagnose(before, after, context)["stage"] in STAGES


@pytest.mark.parametrize("row_bytes", [5e-324, 1e-9, float(1 << 60), float("inf"), float("nan"), -4.0, 0.0])
def test_a_foreign_headers_row_bytes_outside_any_rows_are_unknown(row_bytes):
    """A subnormal, huge, infinite or negative stored size of a row would print the readers'
    read amplification as inf or 0: top takes it for unknown."""
    import struct

    from shmloader.readers.bottleneck import context_of_header

    bits = struct.unpack("<Q", struct.pack("<d", row_bytes))[0]
    assert context_of_header(bits, 0, 0, 1, 64).row_bytes is None

"""`shmloader top`: run under a real pseudo-terminal against a live loader, the screen shows
the loader's ring, each reader's pid, rows/s, the slot states, and a reader restart; it
reads the rings only; Ctrl-C ends it. What it shows agrees with loader.stats() after a
SIGKILL, or says what the ring does not hold; busy shares stay within 0-100%; a node cache's
evictions come from the ledgers its readers hold open."""

from __future__ import annotations

import dataclasses
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import wait_until

from shmloader import ShmDataLoader
from shmloader.readers import pool as readers
from shmloader.tools.monitor import Monitor, render_text


class _Terminal:
    """The screen side of a pty: everything received, read until a pattern shows."""

    def __init__(self, master: int) -> None:
        self.master, self.received, self.searched = master, b"", 0

    def until(self, pattern: str, timeout: float) -> str:
        """What arrived since the last call, read until `pattern` appears in it (or the time-out)."""
        start, deadline = self.searched, time.monotonic() + timeout
        while not re.search(pattern, self.received[start:].decode(errors="replace")) and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.received += os.read(self.master, 65536)
                except OSError:
                    break
        self.searched = len(self.received)
        return self.received[start:].decode(errors="replace")


def _terminal_session() -> None:
    """In the child: a session of its own whose controlling terminal is the pty on its
    stdin, so that a typed Ctrl-C reaches it as SIGINT."""
    import fcntl
    import termios

    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.fixture
def live_loader(tmp_path, monkeypatch):
    monkeypatch.setattr(readers.ReaderPool, "signal_grace_seconds", 0.2)
    np.save(tmp_path / "x.npy", np.arange(4000 * 8, dtype=np.float32).reshape(4000, 8))
    loader = ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=32, readers=2, slots=6)
    stop = threading.Event()

    def consume():
        while not stop.is_set():
            batch = next(loader)
            del batch
            time.sleep(0.002)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    yield loader
    stop.set()
    thread.join(10)
    loader.close()


def test_top_under_a_terminal_shows_the_live_loader_and_a_restart(live_loader):
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    # A wide terminal, so that no line wraps; and only this test's ring (others' run beside it).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "shmloader", "top", live_loader.diagnostics.ring_name, "--interval", "0.2"],
                               stdin=slave, stdout=slave, stderr=slave, close_fds=True, preexec_fn=_terminal_session,
                               cwd="/")  # Not the checkout: there `shmloader` is the source tree, unbuilt.
    os.close(slave)
    terminal = _Terminal(master)
    try:
        pids = live_loader.diagnostics.reader_pids
        screen = terminal.until(rf"reader 1: pid\s+{pids[1]}", 30)
        assert live_loader.diagnostics.ring_name.lstrip("/") in screen, screen[-2000:]
        assert re.search(rf"reader 0: pid\s+{pids[0]}", screen) and re.search(rf"reader 1: pid\s+{pids[1]}", screen)
        screen = terminal.until(r"[1-9][\d,]* rows/s", 30)
        assert re.search(r"[1-9][\d,]* rows/s", screen), screen[-2000:]
        os.kill(pids[0], signal.SIGKILL)
        assert wait_until(lambda: live_loader.diagnostics.reader_pids[0] != pids[0], 20)
        # \s+: rich may wrap the header line just before the count (a narrower console).
        screen = terminal.until(r"restarts\s+seen\s+[1-9]", 30)
        assert re.search(r"restarts\s+seen\s+[1-9]", screen), screen[-2000:]
        os.write(master, b"\x03")  # Ctrl-C, as a user would type it.
        assert process.wait(10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)


def test_the_view_reads_states_and_a_gone_trainers_ring(live_loader, tmp_path):
    monitor = Monitor([live_loader.diagnostics.ring_name])
    monitor.refresh()
    time.sleep(0.3)
    monitor.refresh()
    (view,) = monitor.views.values()
    assert view.last.trainer_pid == os.getpid() and view.last.trainer_alive
    assert len(view.last.states) == live_loader.slots and view.rows_per_s > 0
    assert "trainer" in render_text(monitor) and "(alive)" in render_text(monitor)
    assert Monitor(["shml_1_000000000000"]).views == {}  # A name that is not there shows nothing.


def test_a_reader_killed_while_top_watches_agrees_with_stats(live_loader):
    """A SIGKILLed reader: the restarts top saw equal loader.stats()'s, and the reader's row
    shows the new process, its batches marked as that process's own (before: the count fell
    back to 0 under the same heading, looking like a reset)."""
    monitor = Monitor([live_loader.diagnostics.ring_name])
    pids = live_loader.diagnostics.reader_pids

    def shows(pid: int) -> bool:
        monitor.refresh()
        return any(view.last.readers[0].pid == pid for view in monitor.views.values())

    assert wait_until(lambda: shows(pids[0]), 20)  # Top saw the first process (it writes its pid as it starts).
    os.kill(pids[0], signal.SIGKILL)
    assert wait_until(lambda: live_loader.diagnostics.reader_pids[0] != pids[0], 20)
    new_pid = live_loader.diagnostics.reader_pids[0]
    assert wait_until(lambda: shows(new_pid), 20)
    (view,) = monitor.views.values()
    assert view.restarts == live_loader.stats()["reader_restarts"] == 1
    screen = render_text(monitor)
    line = next(line for line in screen.splitlines() if line.strip().startswith("reader 0:"))
    assert re.search(rf"pid\s+{new_pid}\b.*batches by this pid\s+[\d,]+", line), screen
    stats = live_loader.stats()["readers"][0]
    assert stats["pid"] == new_pid and view.last.readers[0].batches <= stats["batches"]
    assert "restarts seen 1 in" in screen and "loader.stats()" in screen


def test_top_once_after_a_restart_does_not_claim_there_was_none(live_loader, capsys):
    """The restart happened before top began: the ring does not hold the count, so --once
    says how long it watched and where the total is (before: "restarts 0" where
    loader.stats() said 1)."""
    from shmloader.tools.monitor import run

    pid = live_loader.diagnostics.reader_pids[0]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: live_loader.stats()["reader_restarts"] == 1, 20)
    assert run([live_loader.diagnostics.ring_name], interval_s=0.2, once=True) == 0
    screen = capsys.readouterr().out
    assert not re.search(r"restarts\s+0\b", screen), screen
    assert re.search(r"restarts seen 0 in 0\.\d s", screen) and 'loader.stats()["reader_restarts"]' in screen, screen


def test_busy_shares_never_pass_100_percent(tmp_path):
    """busy_ns grows when a batch is published, by the whole fill: a 2.5 s fill published
    between two samples 0.1 s apart read as 2,500% busy. Shown shares stay within 0-100%."""
    np.save(tmp_path / "x.npy", np.arange(16, dtype=np.int64))
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=4, mode="sequential", readers=1, slots=4,
                       transform="transform_fixtures:slow_on_row_nine") as loader:
        monitor = Monitor([loader.diagnostics.ring_name])
        busy, starved = [], []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            monitor.refresh()
            views = list(monitor.views.values())
            if views:
                busy += views[0].busy
                starved += views[0].starved
                if views[0].last.readers[0].batches >= 3:
                    break
            time.sleep(0.1)
        assert views and views[0].last.readers[0].batches >= 3, "the slow step was never published"
        assert busy and 0.0 <= min(busy) and max(busy) <= 1.0, busy
        assert starved and 0.0 <= min(starved) and max(starved) <= 1.0, starved
        assert max(busy) == 1.0  # The window that held the publication: the reader was busy throughout.


def test_stats_scrape_as_prometheus_metrics(tmp_path):
    prometheus = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from shmloader.metrics import register

    np.save(tmp_path / "x.npy", np.zeros((400, 4), np.float32))
    registry = prometheus.CollectorRegistry()
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=8, readers=2) as loader:
        register(loader, registry)
        for _ in range(30):
            next(loader)
        samples = {(sample.name, sample.labels.get("reader")): sample.value
                   for family in text_string_to_metric_families(prometheus.generate_latest(registry).decode())
                   for sample in family.samples}
        ring = loader.diagnostics.ring_name.lstrip("/")
        stats = loader.stats()
        text = prometheus.generate_latest(registry).decode()
    assert samples[("shmloader_batches_total", None)] == 30 and samples[("shmloader_rows_total", None)] == 240
    assert samples[("shmloader_shared_memory_bytes", None)] == stats["shared_memory_bytes"]
    assert sum(samples[("shmloader_reader_batches_total", str(k))] for k in range(2)) >= 30
    assert text.count(f'ring="{ring}"') > 5
    assert "shmloader_batches" not in prometheus.generate_latest(registry).decode()  # Closed: reported no more.


def test_several_loaders_share_one_collector_and_closed_ones_drop_out(tmp_path):
    """Before: a second loader (even after the first closed) raised DuplicateTimeseries on
    the default registry, and a custom one repeated every family."""
    prometheus = pytest.importorskip("prometheus_client")
    from shmloader.metrics import register

    np.save(tmp_path / "x.npy", np.zeros((100, 2), np.float32))
    registry = prometheus.CollectorRegistry()
    for _ in range(2):  # A new loader per evaluation pass.
        with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=10, epochs=1, readers=0) as loader:
            register(loader, registry)
            for batch in loader:
                del batch
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=10, readers=0) as first, \
            ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=10, readers=0) as second:
        register(first, registry)
        register(second, registry)
        next(first)
        text = prometheus.generate_latest(registry).decode()
    assert text.count("# HELP shmloader_batches_total") == 1
    assert text.count("shmloader_batches_total{") == 2  # The two open loaders; the closed ones are gone.


def test_a_loader_that_fills_in_the_trainer_shows_its_work(tmp_path):
    """readers=0: the trainer fills as reader 0, and its record says so (before: pid 0, no
    batches, 0 rows/s while the trainer took millions of rows a second)."""
    np.save(tmp_path / "x.npy", np.zeros((100, 2), np.float32))
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=10, readers=0) as loader:
        monitor = Monitor([loader.diagnostics.ring_name])
        monitor.refresh()
        for _ in range(50):
            next(loader)
        time.sleep(0.05)
        monitor.refresh()
        (view,) = monitor.views.values()
        assert view.last.readers[0].pid == os.getpid() and view.last.readers[0].batches >= 50
        assert view.rows_per_s > 0


def test_top_names_a_ring_it_cannot_find_and_refuses_a_bad_interval(capsys):
    from shmloader.tools.cli import main

    assert main(["top", "shml_1_000000000000", "--once"]) == 1
    assert "no ring named shml_1_000000000000" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["top", "--interval", "-1"])
    assert "must be above 0 seconds" in capsys.readouterr().err


def test_top_names_what_limits_a_loader_as_stats_does(tmp_path):
    """A trainer whose step (50 ms) outlasts every fill: top reads the trainer's waits from
    the ring and names the training step, the same stage as stats()["bottleneck"]."""
    np.save(tmp_path / "x.npy", np.zeros((4000, 8), np.float32))
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=32, readers=1) as loader:
        for _ in range(3):
            next(loader)
        monitor = Monitor([loader.diagnostics.ring_name])
        monitor.refresh()
        loader.stats()
        for _ in range(20):
            next(loader)
            time.sleep(0.05)
        monitor.refresh()
        stage = loader.stats()["bottleneck"]["stage"]
        (view,) = monitor.views.values()
        assert view.bottleneck is not None and view.bottleneck["stage"] == stage == "trainer", view.bottleneck
        assert "bottleneck: the training step" in render_text(monitor)


def test_top_reads_a_ring_that_keeps_a_record_of_checked_blocks(tmp_path):
    """A loader that checks a .b2nd keeps its readers' record of checked blocks after the
    slots (the header's checked_pages): top sizes the ring with it and shows the loader."""
    from shmloader.tools.convert import convert

    convert(np.arange(64 * 4096, dtype=np.uint8).reshape(64, 4096), tmp_path / "x.b2nd", codec="none",
            progress=False)
    with ShmDataLoader({"x": str(tmp_path / "x.b2nd")}, batch_size=16, readers=2, slots=4,
                       warn_layout=False) as loader:
        next(loader)
        assert loader._session.layout.checked_pages > 0
        monitor = Monitor([loader.diagnostics.ring_name])
        monitor.refresh()
        (view,) = monitor.views.values()
        assert view.last.trainer_pid == os.getpid() and len(view.last.states) == 4


def test_top_lists_an_auto_loaders_empty_reader_records_once_and_never_as_pid_0(tmp_path, monkeypatch):
    """readers="auto" sizes its ring for the most readers it may reach: the records it has no
    reader in (pid 0) are named in one line, not shown as readers of pid 0."""
    from shmloader import AutoReaders
    from shmloader.tools.monitor import _ranges

    assert _ranges([0, 3, 4, 5, 7]) == "0, 3-5, 7" and _ranges([2]) == "2"
    np.save(tmp_path / "x.npy", np.zeros((4000, 8), np.float32))
    monkeypatch.setenv("SHMLOADER_CPU_BUDGET", "4")
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=32, readers=AutoReaders(start=2, most=4)) as loader:
        next(loader)
        monitor = Monitor([loader.diagnostics.ring_name])

        def both_readers_attached() -> bool:  # Each writes its pid in its record when it starts.
            monitor.refresh()
            return sum(1 for reader in next(iter(monitor.views.values())).last.readers if reader.pid) == 2

        assert wait_until(both_readers_attached, timeout=10)
        screen = render_text(monitor)
    assert "pid       0" not in screen and re.search(r"reader 0: pid +\d+", screen), screen
    assert len(re.findall(r"reader \d: pid", screen)) == 2, screen
    assert "reader records 2-3: no reader now" in screen, screen


def test_top_counts_the_evictions_of_each_ledger_a_reader_holds_once_and_no_file_only_named_so(tmp_path):
    """top's view of a node cache (remote/node.evicted_bytes_of): the ledgers a process has
    open, found in /proc, each counted once however many descriptors it has, in bytes (the
    ledger counts pages); a file named "ledger" without a ledger's magic is not one."""
    from shmloader.remote.node import NodeCache, evicted_bytes_of
    from shmloader.remote.pages import CACHE_PAGE_BYTES

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "ledger").write_bytes(b"\xff" * 4096)
    with open(tmp_path / "elsewhere" / "ledger", "rb"):
        assert evicted_bytes_of([os.getpid()]) is None
        first, second = NodeCache(str(tmp_path / "cache")), NodeCache(str(tmp_path / "cache"))
        try:
            first.count(evicted=3)
            assert evicted_bytes_of([os.getpid(), os.getpid()]) == 3 * CACHE_PAGE_BYTES
        finally:
            first.close()
            second.close()
    assert evicted_bytes_of([os.getpid()]) is None


def _loader_of_kind(kind: str, tmp_path):
    """A loader whose readers run `kind`'s work: plain rows, a transform of them, compressed
    rows, a dataset's __getitem__, or plain rows under readers="auto"."""
    import dataset_fixtures
    from conftest import image_like, write_b2nd

    from shmloader import AutoReaders

    path = str(tmp_path / "data.npy")
    np.save(path, np.zeros((2048, 4096), np.uint8))
    if kind == "transform":
        return ShmDataLoader({"data": path}, batch_size=64, readers=1, transform="transform_fixtures:crops")
    if kind == "compressed":
        path = write_b2nd(tmp_path / "x.b2nd", image_like(4096, (256,)), chunks=(1024, 256), blocks=(128, 256),
                          codec="ZSTD", clevel=9)
        return ShmDataLoader({"x": path}, batch_size=64, readers=1, warn_layout=False)
    if kind == "dataset":
        return ShmDataLoader.from_dataset(dataset_fixtures.Sleepy(0.0), batch_size=4, readers=1)
    if kind == "auto":
        return ShmDataLoader({"data": path}, batch_size=64, readers=AutoReaders(start=1, most=3))
    return ShmDataLoader({"data": path}, batch_size=64, readers=1)


@pytest.mark.parametrize("kind", ["rows", "transform", "compressed", "dataset", "auto"])
def test_top_reads_what_the_readers_run_as_the_loaders_own_verdict_has_it(kind, tmp_path, monkeypatch):
    """What the counters cannot say (a transform or a dataset runs, a field is compressed, the
    stored bytes of a row, auto's most) the trainer writes into the ring's header: the
    Context top judges with is the one stats()["bottleneck"] judges with."""
    from shmloader.readers.bottleneck import context_of_header
    from shmloader.tools.monitor import sample

    monkeypatch.setenv("SHMLOADER_CPU_BUDGET", "4")  # auto's most, whatever this host's cores.
    with _loader_of_kind(kind, tmp_path) as loader:
        next(loader)
        found = sample(loader.diagnostics.ring_name.lstrip("/"))
        own = loader._session.meter.context
    assert found is not None
    assert context_of_header(*found.work, own.local_readers, found.batch_size) == own, (found.work, own)
    assert (own.user_code is not None) == (kind in ("transform", "dataset"))
    assert own.compressed == (kind == "compressed")
    assert (own.row_bytes is None) == (kind == "dataset") and (own.auto_most is not None) == (kind == "auto")


@pytest.mark.parametrize("thrashing", [False, True])
@pytest.mark.parametrize("refreshes", [1, 10])
def test_top_judges_a_transforms_reads_by_the_rows_stored_bytes_not_the_slots(thrashing, refreshes, tmp_path):
    """A crop's slot holds 16 bytes of each 4 KiB row read: judged by the slot's bytes, every
    byte read would look read 200 times. Over 10 s of counters where the readers read each
    stored byte 1.2 times (a fifth of it refaults: a second pass over data larger than memory)
    top names the disk, and where they read it 3 times and half of it refaults, the page
    cache's memory: each as the loader's own diagnosis over those 10 s does, whether top
    sampled them once or every second (each second alone is too short a window for the page
    cache's verdict: page_cache.MEMORY_WINDOW_SECONDS_MIN)."""
    from shmloader.readers.bottleneck import ReaderCounters, Reading, diagnose
    from shmloader.readers.page_cache import MemoryCounters
    from shmloader.tools.monitor import RingView, sample

    with _loader_of_kind("transform", tmp_path) as loader:
        next(loader)
        name = loader.diagnostics.ring_name.lstrip("/")
        first, second = sample(name), sample(name)
        context = loader._session.meter.context
    assert first is not None and second is not None and first.batch_size == 64
    window_ns, batches, stored = 10**10, 100, 100 * 64 * 4096
    read, refaulted = (3 * stored, 1.5 * stored) if thrashing else (1.2 * stored, 0.24 * stored)

    def reading(share: float) -> Reading:  # The counters `share` of the way through the window.
        counters = ReaderCounters(7, int(share * 9 * 10**9), int(share * batches), read_ns=int(share * 8 * 10**9),
                                  cpu_ns=int(share * 10**9), queued_ns=0, storage_read_bytes=int(share * read))
        return Reading(first.at_ns + int(share * window_ns), int(share * window_ns / 2), (counters,), 8, 0,
                       memory=MemoryCounters(int(share * refaulted), 2**30, "/jobs/a"))

    view = RingView(dataclasses.replace(first, reading=reading(0.0)))
    for refresh in range(1, refreshes + 1):
        share = refresh / refreshes
        view.update(dataclasses.replace(second, at_ns=first.at_ns + int(share * window_ns), reading=reading(share)))
    own = diagnose(reading(0.0), reading(1.0), dataclasses.replace(context, local_readers=1))
    assert own["stage"] == ("memory" if thrashing else "disk"), own
    assert own["detail"]["read_amplification"] == (3.0 if thrashing else 1.2), own
    assert view.bottleneck == own, (view.bottleneck, own)

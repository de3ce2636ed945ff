"""Readers are forked by the trainer's fork server: one server per trainer process and
start-up settings, readers with the trainer's current environment and output, the right
batches whoever started them, and a server that dies alone costs no batch and no ring."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from conftest import our_shm_entries, process_alive, wait_until

from shmloader import ShmDataLoader
from shmloader.readers import forkserver
from shmloader.readers import pool as readers

pytestmark = pytest.mark.skipif(not forkserver.available(), reason="no pidfds: readers start as fresh interpreters")


def parent_and_name(pid: int) -> tuple[int, str]:
    with open(f"/proc/{pid}/stat") as handle:
        name, rest = handle.read().split(" (", 1)[1].rsplit(") ", 1)
    return int(rest.split()[1]), name


def describe(pid: int) -> str:
    """A process's state and where it sleeps, for a failure's message."""
    try:
        with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/wchan") as wchan:
            return f"{stat.read().strip()} in {wchan.read()}"
    except OSError:
        return f"{pid} gone"


@pytest.fixture
def data(tmp_path):
    rows = np.arange(400 * 4, dtype=np.float32).reshape(400, 4)
    np.save(tmp_path / "data.npy", rows)
    return str(tmp_path / "data.npy"), rows


def check(loader, rows, steps, field="data"):
    for _, batch in zip(range(steps), loader):
        np.testing.assert_array_equal(batch[field], rows[batch.indices], err_msg=f"step {batch.step}")


def test_readers_of_successive_loaders_are_forked_by_one_server_of_this_trainer(data):
    path, rows = data
    servers = set()
    for count in (2, 3):
        with ShmDataLoader({"data": path}, batch_size=8, readers=count, seed=count) as loader:
            check(loader, rows, 30)
            assert wait_until(lambda: {parent_and_name(pid)[1] for pid in loader.diagnostics.reader_pids} == {"shml-reader"})
            servers.update(parent_and_name(pid)[0] for pid in loader.diagnostics.reader_pids)
    (server,) = servers
    assert parent_and_name(server) == (os.getpid(), "shml-forkserver")


def test_without_the_server_readers_are_interpreters_of_their_own(data, monkeypatch):
    path, rows = data
    monkeypatch.setenv(forkserver.ENVIRONMENT_VARIABLE, "0")
    with ShmDataLoader({"data": path}, batch_size=8, readers=2, seed=3) as loader:
        check(loader, rows, 30)
        # One may still be importing (its name is set in reader.main) while the other filled all.
        assert wait_until(lambda: [parent_and_name(pid) for pid in loader.diagnostics.reader_pids] == [(os.getpid(), "shml-reader")] * 2)


def test_a_loader_made_in_a_thread_that_ended_keeps_its_readers(data, monkeypatch):
    """A reader's death signal followed the thread that started it: once a thread that made
    a loader ended, every reader got SIGTERM, left after its grace and was restarted."""
    path, rows = data
    monkeypatch.setattr(readers.ReaderPool, "signal_grace_seconds", 0.2)
    made = {}

    def make():
        made["loader"] = loader = ShmDataLoader({"data": path}, batch_size=8, readers=2, seed=1)
        check(loader, rows, 5)  # The readers are configured and running before the thread ends.

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    with made["loader"] as loader:
        pids = loader.diagnostics.reader_pids
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            check(loader, rows, 20)
        assert loader.stats()["reader_restarts"] == 0
        assert loader.diagnostics.reader_pids == pids


def test_a_fork_server_killed_alone_costs_no_batch_and_keeps_the_ring(data, monkeypatch):
    """Its readers lose their parent (their death signal comes) while the trainer lives: they
    must not unlink the trainer's ring; the trainer replaces them through a new server."""
    path, rows = data
    monkeypatch.setattr(readers.ReaderPool, "signal_grace_seconds", 0.2)
    with ShmDataLoader({"data": path}, batch_size=8, readers=2, seed=5, max_reader_restarts=1) as loader:
        check(loader, rows, 20)
        old_pids = loader.diagnostics.reader_pids
        server = parent_and_name(old_pids[0])[0]
        ring = set(our_shm_entries(os.getpid()))
        os.kill(server, signal.SIGKILL)
        assert wait_until(lambda: not any(process_alive(pid) for pid in old_pids), 5), [
            describe(pid) for pid in old_pids]
        check(loader, rows, 200)
        assert set(our_shm_entries(os.getpid())) == ring
        assert loader.stats()["reader_restarts"] == 2
        new_servers = {parent_and_name(pid)[0] for pid in loader.diagnostics.reader_pids}
        assert len(new_servers) == 1 and server not in new_servers


def test_readers_write_to_the_trainers_current_standard_error(data, capfd):
    """The server started under another stderr (an earlier test's, or none): each reader gets
    the trainer's descriptors of the moment it is started."""
    path, rows = data
    for _ in range(2):
        with ShmDataLoader({"data": path}, transform="transform_fixtures:says_hello", batch_size=8, readers=1) as loader:
            check(loader, rows, 3, field="x")
            pid = loader.diagnostics.reader_pids[0]
        assert f"hello from reader {pid}" in capfd.readouterr().err


def test_a_new_cpu_affinity_gets_a_new_server(data):
    """The server's readers inherit its affinity: a trainer that changed its own needs another."""
    path, rows = data
    cpus = sorted(os.sched_getaffinity(0))
    with ShmDataLoader({"data": path}, batch_size=8, readers=1) as loader:
        server = parent_and_name(loader.diagnostics.reader_pids[0])[0]
    try:
        os.sched_setaffinity(0, cpus[:1])
        with ShmDataLoader({"data": path}, batch_size=8, readers=1) as loader:
            check(loader, rows, 5)
            pid = loader.diagnostics.reader_pids[0]
            assert os.sched_getaffinity(pid) == set(cpus[:1])
            if len(cpus) > 1:
                assert parent_and_name(pid)[0] != server
    finally:
        os.sched_setaffinity(0, cpus)


def test_a_lower_descriptor_limit_gets_a_new_server_whose_readers_have_it(data):
    import resource

    path, rows = data
    with ShmDataLoader({"data": path}, batch_size=8, readers=1) as loader:
        server = parent_and_name(loader.diagnostics.reader_pids[0])[0]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 4096) - 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        with ShmDataLoader({"data": path}, batch_size=8, readers=1) as loader:
            check(loader, rows, 5)
            pid = loader.diagnostics.reader_pids[0]
            with open(f"/proc/{pid}/limits") as handle:
                line = next(line for line in handle if line.startswith("Max open files"))
            assert int(line.split()[3]) == lowered
            assert parent_and_name(pid)[0] != server
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("closed", ["1>&-", "2>&-", "1>&- 2>&-"])
def test_a_trainer_started_with_its_output_closed_keeps_its_server_when_readers_print(data, tmp_path, closed):
    """Before: the trainer's socket to its server took descriptor 1 or 2, readers got it as
    their standard output, and a print in a transform killed the server."""
    import json
    import subprocess
    import sys

    path, rows = data
    tests = os.path.dirname(os.path.abspath(__file__))
    result = tmp_path / "result.json"
    script = f"""
import json, os, sys
sys.path.insert(0, {tests!r})
import numpy as np
from child_guard import die_with_parent
from shmloader import ShmDataLoader
die_with_parent()
rows = np.load({path!r})
with ShmDataLoader({{"data": {path!r}}}, transform="transform_fixtures:prints_every_step", batch_size=8, readers=2,
                   max_reader_restarts=0) as loader:
    wrong = 0
    for _, batch in zip(range(40), loader):
        wrong += not np.array_equal(batch["x"], rows[batch.indices])
    restarts = loader.stats()["reader_restarts"]
with open({str(result)!r}, "w") as handle:
    json.dump({{"wrong": wrong, "restarts": restarts}}, handle)
"""
    (tmp_path / "trainer.py").write_text(script)
    subprocess.run(["bash", "-c", f"exec {sys.executable} {tmp_path / 'trainer.py'} {closed}"], timeout=60,
                   check=True, stdin=subprocess.DEVNULL)
    assert json.loads(result.read_text()) == {"wrong": 0, "restarts": 0}


def test_a_stopped_server_is_given_up_on_a_reader_killed_meanwhile_is_replaced_and_close_returns(data, monkeypatch):
    """Before: with the server stopped (SIGSTOP) a reader killed mid-run was never noticed
    (its exit is reported by the server), close() waited for that report forever, and a new
    loader waited 60 s for its readers."""
    path, rows = data
    monkeypatch.setattr(readers.ReaderPool, "signal_grace_seconds", 0.2)
    loader = ShmDataLoader({"data": path}, batch_size=8, readers=2, seed=5, max_reader_restarts=2)
    server = parent_and_name(loader.diagnostics.reader_pids[0])[0]
    try:
        check(loader, rows, 20)
        os.kill(server, signal.SIGSTOP)
        os.kill(loader.diagnostics.reader_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while server in {parent_and_name(pid)[0] for pid in loader.diagnostics.reader_pids if process_alive(pid)} or \
                not all(process_alive(pid) for pid in loader.diagnostics.reader_pids):
            assert time.monotonic() < deadline, [describe(pid) for pid in loader.diagnostics.reader_pids]
            check(loader, rows, 5)  # Readers replaced through a new server, no batch lost or wrong.
        assert wait_until(lambda: not process_alive(server), 5), describe(server)
        new_server = parent_and_name(loader.diagnostics.reader_pids[0])[0]
        os.kill(new_server, signal.SIGSTOP)
        started = time.monotonic()
        loader.close()
        assert time.monotonic() - started < 15
        started = time.monotonic()
        with ShmDataLoader({"data": path}, batch_size=8, readers=1, seed=5) as second:
            check(second, rows, 5)
        assert time.monotonic() - started < 15
    finally:
        loader.close()
        for pid in (server, locals().get("new_server")):
            if pid and process_alive(pid):
                os.kill(pid, signal.SIGCONT)


def test_idle_servers_of_other_settings_are_retired_instead_of_piling_up(data, monkeypatch):
    """Before: each new OMP_NUM_THREADS value left one more server (an interpreter with
    numpy imported) alive for the trainer's life."""
    path, rows = data
    servers = set()
    settings = forkserver._SERVERS_MAX + 2  # Two retirements at the bound.
    for threads in range(1, settings + 1):
        monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
        with ShmDataLoader({"data": path}, batch_size=8, readers=1) as loader:
            check(loader, rows, 3)
            servers.add(parent_and_name(loader.diagnostics.reader_pids[0])[0])
        alive = [pid for pid in servers if process_alive(pid) and parent_and_name(pid)[1] == "shml-forkserver"]
        assert len(alive) <= forkserver._SERVERS_MAX, alive
        assert len(forkserver._servers) <= forkserver._SERVERS_MAX
    assert len(servers) == settings  # Each value had a server of its own while it was used.

"""Remote readers on a real local Ray cluster (a head and worker nodes on this machine,
bound to 127.0.0.1): batches equal local ones for every field kind and transforms; a
killed actor, a removed node and an actor that raises cost no batch; close() leaves no
actor alive and nothing in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

# Before Ray is imported: its nodes then bind 127.0.0.1 only (the suite talks to loopback).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
from conftest import assert_same, batches, declarations, wait_until  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from shmloader import Packed, ShmDataLoader, Source  # noqa: E402
from shmloader.errors import ReaderError  # noqa: E402
from shmloader.readers.ray import RayReaders  # noqa: E402

# One Ray cluster per worker process of the suite: the tests share it (xdist's loadgroup
# keeps them on one worker, README's test command).
pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": 256 << 20, "include_dashboard": False,
        "_system_config": {"enable_worker_prestart": False}})
    # Ray puts the driver's working directory first on its workers' sys.path: started from a
    # source checkout (CI runs the suite from one, with the package installed), actors would
    # import the checkout, which has no native library. shmloader.readers.ray refuses that case
    # (test_a_checkout_where_ray_was_started_is_refused_with_the_reason).
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray_driver"))
    try:
        ray.init(address=cluster.address, log_to_driver=False)
    finally:
        os.chdir(here)
    session = ray._private.worker._global_node.get_session_dir_path()
    reaper = _reaper_of(_descendants(os.getpid()), cluster.address, session)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        reaper.kill()
        reaper.wait()
        _remove_session(session)


def _remove_session(session: str) -> None:
    """The cluster's logs and sockets in /tmp/ray (Ray keeps every session's there)."""
    import shutil

    shutil.rmtree(session, ignore_errors=True)
    latest = os.path.join(os.path.dirname(session), "session_latest")
    try:
        if os.readlink(latest) == session:
            os.unlink(latest)
    except OSError:
        pass
    with contextlib.suppress(OSError):  # /tmp/ray itself, where no other session is left in it.
        os.rmdir(os.path.dirname(session))


def _descendants(pid: int) -> list[int]:
    import psutil  # Ray depends on it.

    return [child.pid for child in psutil.Process(pid).children(recursive=True)]


def _reaper_of(pids: list[int], address: str = "", session: str = ""):
    """A process that SIGKILLs the cluster's processes if this test worker dies without
    shutting it down (ended by pytest-timeout): Ray's raylets, GCS and agents were left as
    orphans, and /tmp/ray/ray_current_cluster still named the dead cluster (a later
    ray.init() would try to join it). It learns of the worker's death by its own death
    signal (PR_SET_PDEATHSIG), then removes that file if it names this cluster, and the
    session's directory."""
    import subprocess
    import sys

    code = ("import os, shutil, signal, sys, time\n"
            "address, session, pids = sys.argv[1], sys.argv[2], [int(p) for p in sys.argv[3:]]\n"
            "def reap(*_):\n"
            "    for pid in pids:\n"
            "        os.path.exists(f'/proc/{pid}') and os.kill(pid, 9)\n"
            "    current = '/tmp/ray/ray_current_cluster'\n"
            "    try:\n"
            "        if address and open(current).read().strip() == address:\n"
            "            os.unlink(current)\n"
            "    except OSError:\n"
            "        pass\n"
            "    if session:\n"
            "        time.sleep(0.5)\n"  # The killed processes' last writes.
            "        shutil.rmtree(session, ignore_errors=True)\n"
            "        latest = os.path.join(os.path.dirname(session), 'session_latest')\n"
            "        try:\n"
            "            os.readlink(latest) == session and os.unlink(latest)\n"
            "        except OSError:\n"
            "            pass\n"
            "    os._exit(0)\n"
            "signal.signal(signal.SIGTERM, reap)\n"
            "import ctypes; ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
            f"os.getppid() == {os.getpid()} or os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(24 * 3600)\n")
    return subprocess.Popen([sys.executable, "-c", code, address, session, *map(str, pids)])


def alive_actors() -> list[dict]:
    return [actor for actor in ray._private.state.actors().values()
            if actor["State"] != "DEAD" and actor["ActorClassName"] == "_FillActor"]


def remote_batches(fields, readers=0, steps=12, actors=1, **options):
    return batches(fields, readers, steps, remote=RayReaders(actors=actors), **options)


@pytest.mark.parametrize("kind", ["rows npy", "rows b2nd", "padded", "packed", "windows"])
def test_remote_batches_equal_local_ones_for_every_field_kind(cluster, kinds, kind):
    fields = declarations(kinds)[kind]
    assert_same(batches(fields, 0), remote_batches(fields))


def test_remote_and_local_readers_share_steps_for_mixtures_windows_and_transforms(cluster, kinds):
    mixture = [Source({"x": str(kinds / "rows.npy")}, weight=3), Source({"x": str(kinds / "part1.npy")}, weight=1)]
    assert_same(batches(mixture, 0, steps=30), remote_batches(mixture, readers=1, steps=30))
    windowed = {"x": str(kinds / "rows.npy")}
    assert_same(batches(windowed, 0, shuffle_window=64), remote_batches(windowed, shuffle_window=64))
    data = {"data": str(kinds / "data.npy")}
    assert_same(batches(data, 0, steps=30, transform="transform_fixtures:scaled"),
                remote_batches(data, readers=1, steps=30, transform="transform_fixtures:scaled"))


def test_both_kinds_of_reader_fill_steps_and_report_them(cluster, kinds):
    """Batches stay right while both kinds fill steps. The local reader starts first and
    alone could fill everything: the loop runs until the actors have filled some too."""
    fields = {"x": str(kinds / "rows.npy")}
    options = dict(batch_size=16, seed=7, warn_layout=False)
    deadline, step = time.monotonic() + 60, 0
    with ShmDataLoader(fields, readers=0, **options) as reference, \
            ShmDataLoader(fields, readers=1, remote=RayReaders(actors=2), **options) as loader:
        for expected, batch in zip(reference, loader):
            assert batch.step == expected.step == step
            np.testing.assert_array_equal(batch.indices, expected.indices)
            np.testing.assert_array_equal(batch["x"], expected["x"])
            step += 1
            if step % 50 == 0:
                readers = loader.stats()["readers"]
                if step >= 200 and sum(reader["batches"] for reader in readers[1:]) > 0:
                    break
                assert time.monotonic() < deadline, f"the actors filled nothing in {step} steps"
    assert [reader["remote"] for reader in readers] == [False, True, True]
    assert sum(reader["batches"] for reader in readers) >= step
    assert all(reader["pid"] > 0 for reader in readers[1:] if reader["batches"])


def test_killed_actors_cost_no_batch(cluster, kinds):
    """One actor killed through Ray, another's process by SIGKILL, mid-run: replaced, their
    steps sent again, every batch still the right one."""
    fields = {"x": str(kinds / "rows.b2nd")}
    expected = batches(fields, 0, steps=120)
    with ShmDataLoader(fields, readers=0, batch_size=16, seed=7, remote=RayReaders(actors=2), warn_layout=False) as loader:
        found = []
        for batch in loader:
            found.append({"step": batch.step, "indices": batch.indices.copy(), "x": np.array(batch["x"])})
            if batch.step == 20:
                ray.kill(loader.diagnostics.remote_actors[0])
            if batch.step == 60:
                pid = ray.get(loader.diagnostics.remote_actors[1].where.remote())[0]
                assert pid > 0
                os.kill(pid, signal.SIGKILL)
            if len(found) == 120:
                break
        assert loader.stats()["reader_restarts"] == 2
    assert_same(expected, found)
    assert wait_until(lambda: not alive_actors(), timeout=30), alive_actors()


def test_an_actor_that_raises_reaches_the_trainer_with_its_type_and_step(cluster, kinds):
    fields = {"data": str(kinds / "data.npy")}
    with ShmDataLoader(fields, readers=0, batch_size=16, mode="sequential", remote=RayReaders(actors=1),
                       transform="transform_fixtures:fails_on_row_seven", warn_layout=False) as loader:
        with pytest.raises(ValueError, match="row seven is cursed") as raised:
            next(loader)
    assert isinstance(raised.value, ReaderError)
    assert raised.value.step == 0 and "Ray actor 0" in str(raised.value)
    assert wait_until(lambda: not alive_actors(), timeout=30), alive_actors()


def test_an_actor_lost_past_its_budget_stops_the_loader_with_a_named_error(cluster, kinds):
    fields = {"x": str(kinds / "rows.npy")}
    with ShmDataLoader(fields, readers=0, batch_size=16, remote=RayReaders(actors=1, max_restarts=0),
                       warn_layout=False) as loader:
        next(loader)
        ray.kill(loader.diagnostics.remote_actors[0])
        with pytest.raises(ReaderError, match=r"Ray actor 0 .*max_restarts=0"):
            for _ in range(100):
                next(loader)


def test_close_with_steps_in_flight_leaves_no_actor_and_no_ring(cluster, kinds):
    fields = {"x": str(kinds / "rows.npy")}
    loader = ShmDataLoader(fields, readers=1, batch_size=16, remote=RayReaders(actors=3, in_flight=3),
                           warn_layout=False)
    try:
        next(loader)  # The local reader may have filled it before any actor started.
        ours = {handle._actor_id.hex() for handle in loader.diagnostics.remote_actors}
        assert len(ours) == 3
        assert wait_until(lambda: ours <= {actor["ActorID"] for actor in alive_actors()}, timeout=30), alive_actors()
        for _ in range(20):
            next(loader)
        name = loader.diagnostics.ring_name
    finally:
        loader.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert wait_until(lambda: not ours & {actor["ActorID"] for actor in alive_actors()}, timeout=30), alive_actors()


def test_a_removed_node_costs_no_batch(cluster, kinds):
    """The actor lives on a worker node that is taken out of the cluster mid-run; its
    replacement starts on the other worker node."""
    nodes = [cluster.add_node(num_cpus=1, resources={"shmloader_side": 1}) for _ in range(2)]
    try:
        cluster.wait_for_nodes()
        fields = {"tokens": Packed(str(kinds / "docs.ragged"))}
        expected = batches(fields, 0, steps=60)
        remote = RayReaders(actors=1, options={"resources": {"shmloader_side": 1}})
        with ShmDataLoader(fields, readers=0, batch_size=16, seed=7, remote=remote, warn_layout=False) as loader:
            found = []
            for batch in loader:
                found.append({"step": batch.step, "indices": batch.indices.copy(),
                              **{k: np.array(v) for k, v in batch.items()}})
                if batch.step == 15:
                    actor_node = ray.get(loader.diagnostics.remote_actors[0].where.remote())
                    ours = loader.diagnostics.remote_actors[0]._actor_id.hex()
                    node_id = next(actor["Address"]["NodeID"] for actor in alive_actors() if actor["ActorID"] == ours)
                    victim = next(node for node in nodes if node.node_id == node_id)
                    cluster.remove_node(victim)
                    nodes.remove(victim)
                if len(found) == 60:
                    break
            assert loader.stats()["reader_restarts"] >= 1
            assert actor_node[0] > 0
        assert_same(expected, found)
    finally:
        for node in nodes:
            cluster.remove_node(node)


def test_remote_settings_are_checked(cluster, kinds):
    with pytest.raises(ValueError, match="actors must be an integer >= 1"):
        RayReaders(actors=0)
    with pytest.raises(ValueError, match="in_flight"):
        RayReaders(in_flight=0)
    with pytest.raises(TypeError, match="remote must be remote readers"):
        ShmDataLoader({"x": str(kinds / "rows.npy")}, readers=0, remote="ray://somewhere")



def test_records_an_actor_skips_are_reported_like_a_readers(cluster, kinds):
    fields = {"data": str(kinds / "data.npy")}
    options = dict(mode="sequential", transform="transform_fixtures:fails_on_row_seven", on_error="skip")
    with pytest.warns(UserWarning, match="replaced 1 record"):
        with ShmDataLoader(fields, readers=0, batch_size=16, remote=RayReaders(actors=1), warn_layout=False,
                           **options) as loader:
            found = [{"step": b.step, "indices": b.indices.copy(), "x": np.array(b["x"])}
                     for _, b in zip(range(3), loader)]
            skipped = loader.stats()["skipped"]
    assert skipped["count"] == 1 and skipped["records"][0]["row"] == 7 and skipped["records"][0]["step"] == 0
    with pytest.warns(UserWarning, match="replaced 1 record"):
        assert_same(batches(fields, 0, steps=3, **options), found)


def test_seek_and_resume_with_actors_are_exact(cluster, kinds):
    fields = {"x": str(kinds / "rows.b2nd")}
    expected = batches(fields, 0, steps=40)
    with ShmDataLoader(fields, readers=1, batch_size=16, seed=7, remote=RayReaders(actors=2), warn_layout=False) as loader:
        for _, batch in zip(range(25), loader):
            pass
        state = loader.state_dict()
        del batch
        loader.seek(5)
        found = [{"step": b.step, "indices": b.indices.copy(), "x": np.array(b["x"])} for _, b in zip(range(10), loader)]
    assert_same(expected[5:15], found)
    with ShmDataLoader(fields, readers=0, batch_size=16, seed=7, remote=RayReaders(actors=1), warn_layout=False) as loader:
        loader.load_state_dict(state)
        found = [{"step": b.step, "indices": b.indices.copy(), "x": np.array(b["x"])} for _, b in zip(range(15), loader)]
    assert_same(expected[25:40], found)


def test_an_actor_ray_cannot_place_is_named_when_a_step_times_out(cluster, kinds):
    from shmloader.errors import StepTimeoutError

    remote = RayReaders(actors=1, options={"resources": {"no_such_node": 1}})
    with ShmDataLoader({"x": str(kinds / "rows.npy")}, readers=0, batch_size=16, remote=remote, step_timeout=1.0,
                       warn_layout=False) as loader:
        with pytest.raises(StepTimeoutError, match=r"not placed actor\(s\) 0 .*no_such_node.*dealt no step"):
            next(loader)
    assert wait_until(lambda: not alive_actors(), timeout=30), alive_actors()


def test_actors_ray_cannot_place_are_dealt_no_step_so_the_others_fill_every_one(cluster, kinds):
    """Three actors on a two-CPU cluster: the third is never placed. Its share of the steps
    went to it and the trainer waited for ever; now the two placed actors fill every step,
    right, within the step time-out. No local reader: it would fill most steps first."""
    fields = {"x": str(kinds / "rows.npy")}
    expected = batches(fields, 1, 40)
    found = batches(fields, 0, 40, remote=RayReaders(actors=3, num_cpus=1), step_timeout=60.0)
    assert_same(expected, found)


def test_a_checkout_where_ray_was_started_is_refused_with_the_reason(cluster, kinds, tmp_path, monkeypatch):
    (tmp_path / "shmloader").mkdir()
    (tmp_path / "shmloader" / "__init__.py").write_text("")
    monkeypatch.setattr("shmloader.readers.ray._driver_paths", lambda: [str(tmp_path)])
    with pytest.raises(RuntimeError, match="a source checkout without its native library"):
        ShmDataLoader({"x": str(kinds / "rows.npy")}, readers=0, batch_size=16, remote=RayReaders(),
                      warn_layout=False)


class _RayWith:
    """shmloader.readers.ray's view of Ray with one call replaced (the bridge runs in this process)."""

    def __init__(self, **replaced) -> None:
        self._replaced = replaced

    def __getattr__(self, name):
        return self._replaced.get(name, getattr(ray, name))


@pytest.mark.parametrize("mangle", [lambda data: data[:1], lambda data: data.view(np.int8),
                                    lambda data: data.astype(np.uint16), lambda data: data.tobytes()],
                         ids=["one-byte", "int8", "uint16", "bytes"])
def test_a_remote_result_of_the_wrong_size_or_dtype_fails_its_step_instead_of_filling_the_slot(
        cluster, kinds, monkeypatch, mangle):
    """Before: np.copyto broadcast a one-byte result over the whole slot (or cast another
    dtype) and the batch was delivered."""
    def get(ref):
        result = ray.get(ref)
        if len(result) == 2:  # An actor's where() (pid, node), not a filled step.
            return result
        data, *rest = result
        return (mangle(data) if data is not None else None), *rest

    monkeypatch.setattr("shmloader.readers.ray.ray", _RayWith(get=get))
    with ShmDataLoader({"x": str(kinds / "rows.npy")}, readers=0, batch_size=16, remote=RayReaders(actors=1),
                       warn_layout=False) as loader:
        with pytest.raises(ReaderError, match=r"Ray actor 0 \(pid \d+\) returned (an array of shape|a bytes)"):
            next(loader)


def test_close_is_bounded_when_ray_no_longer_answers(cluster, kinds, monkeypatch):
    """With Ray's head gone, ray.kill blocks until Ray aborts the process a minute later;
    close() gives up after a bound and says so (the blocked kill simulated here)."""
    import threading

    import shmloader.readers.ray as remote

    released = threading.Event()
    monkeypatch.setattr(remote, "_STOP_SECONDS", 0.5)
    loader = ShmDataLoader({"x": str(kinds / "rows.npy")}, readers=0, batch_size=16, remote=RayReaders(actors=1),
                           warn_layout=False)
    actors = list(loader.diagnostics.remote_actors)
    try:
        next(loader)
        monkeypatch.setattr("shmloader.readers.ray.ray", _RayWith(kill=lambda handle: released.wait(60)))
        started = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"Ray did not answer within 0.5 s"):
            loader.close()
        assert time.monotonic() - started < 10
    finally:
        released.set()
        loader.close()
        for handle in actors:
            ray.kill(handle)


def test_a_killed_test_worker_leaves_no_ray_process_behind(tmp_path):
    """The cluster fixture's reaper: a worker ended by pytest-timeout (SIGKILL here) left
    Ray's DashboardAgent and RuntimeEnvAgent running as orphans."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    script = f"""
import os, signal, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, {tests!r})
import ray, test_ray
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 1, "object_store_memory": 96 << 20,
                                                        "include_dashboard": False}})
ray.init(address=cluster.address, log_to_driver=False)
session = ray._private.worker._global_node.get_session_dir_path()
reaper = test_ray._reaper_of(test_ray._descendants(os.getpid()), cluster.address, session)
print(cluster.address, session, flush=True)
print(" ".join(map(str, test_ray._descendants(os.getpid()))), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=str(tmp_path))
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout + result.stderr
    address, session = lines[0].split()
    pids = [int(pid) for pid in lines[1].split()]
    assert pids, result.stderr
    assert wait_until(lambda: not [pid for pid in pids if os.path.exists(f"/proc/{pid}") and
                                   open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z"], timeout=20), pids
    assert wait_until(lambda: not os.path.exists(session), timeout=30), session

    def names_this_cluster() -> bool:
        try:
            with open("/tmp/ray/ray_current_cluster") as current:
                return current.read().strip() == address
        except OSError:
            return False

    assert not names_this_cluster()


def test_a_resharded_checkpoint_replaces_the_actors_with_the_dealings_sampler(cluster, kinds):
    """load_state_dict under another shard count with a window split among shards: the
    actors are started anew with the dealing's sampler, and their batches are the local
    filler's."""
    fields = {"x": str(kinds / "rows.npy")}
    options = dict(batch_size=16, seed=7, shuffle_window=200, warn_layout=False)
    with ShmDataLoader(fields, readers=0, shard_index=0, shard_count=2, **options) as before:
        for _ in range(3):
            next(before)
        state = before.state_dict()

    def resumed(**more):
        with ShmDataLoader(fields, shard_index=1, shard_count=3, **options, **more) as loader:
            loader.load_state_dict(state)
            assert loader.sampler.transition is not None
            return [(b.step, b.indices.copy(), np.array(b["x"])) for _, b in zip(range(8), loader)]

    local = resumed(readers=0)
    remote = resumed(readers=0, remote=RayReaders(actors=1))
    assert [step for step, _, _ in remote] == [step for step, _, _ in local]
    for (_, indices, x), (_, expected_indices, expected_x) in zip(remote, local):
        np.testing.assert_array_equal(indices, expected_indices)
        np.testing.assert_array_equal(x, expected_x)

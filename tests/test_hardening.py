"""The defects an outside attack found (crashes, stalls, leaks, errors that hide their
cause) stay fixed: each test drives real processes, real signals and real files into the
situation that broke the loader, and checks the loader's answer and that nothing is left."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import posix_ipc
import pytest
from conftest import our_shm_entries, process_alive, wait_until, write_b2nd
from test_faults import HERE, assert_all_gone, exit_code_and_errors, run_child

from shmloader import ReaderError, SharedMemoryError, ShmDataLoader, StorageError
from shmloader.readers.reader import FAULT_INJECTION_VARIABLE, ErrorReport
from shmloader.ring.layout import READER_ERROR_BYTES_MAX
from shmloader.ring.stale import sweep_stale
from shmloader.storage.opening import open_field
from shmloader.storage.spec import describe_field

# Subprocesses run in the tests' folder: `python -c` puts its working directory first on
# sys.path, and a source checkout there (without a build in it) must not shadow the
# installed package.


def test_a_b2nd_that_cannot_be_opened_raises_storage_error_instead_of_crashing(tmp_path):
    """libblosc2 returned NULL for a truncated frame and close() freed it: SIGSEGV."""
    path = write_b2nd(tmp_path / "t.b2nd", np.arange(4096, dtype=np.int64).reshape(512, 8))
    spec = describe_field(path)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)  # The frame header survives; its chunks do not.
    code = (
        "import sys; sys.path.insert(0, {tests!r}); from shmloader.storage.spec import FieldSpec; from shmloader.storage.opening import open_field;"
        "from shmloader import StorageError; import json\n"
        "try:\n    open_field(FieldSpec.from_dict(json.loads(sys.argv[1])))\n"
        "except StorageError as error:\n    print('StorageError', error)\n"
    ).format(tests=os.path.dirname(__file__))
    result = subprocess.run([sys.executable, "-c", code, json.dumps(spec.to_dict())], capture_output=True, text=True,
                            timeout=60, cwd=HERE)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    assert result.stdout.startswith("StorageError") and "t.b2nd" in result.stdout


def test_ready_semaphores_stay_bounded_while_readers_run_ahead(dataset):
    """Each fill used to post its slot's semaphore whether or not anyone waited on it."""
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=4, readers=2, slots=4) as loader:
        for _ in range(1000):
            next(loader)
            time.sleep(0.0005)  # A trainer slower than its readers: they are always ahead.
        values = [posix_ipc.Semaphore(name).value for name in loader._session.ring.names.ready]
    assert max(values) <= 3, values  # Before the fix: about 1000 / 4 posts per slot.


def test_the_sweep_of_another_pid_namespace_leaves_a_live_ring_alone(dataset):
    """Seen from another PID namespace the owner's pid is dead; its lock is not."""
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=2) as loader:
        entries = our_shm_entries(os.getpid())
        code = "import sys; from shmloader.ring.stale import sweep_stale; print(sweep_stale())"
        result = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", code], capture_output=True,
                                text=True, timeout=60, cwd=HERE)
        if result.returncode != 0 and "unshare" in result.stderr:
            pytest.skip(f"no PID namespace here: {result.stderr.strip()}")
        assert result.returncode == 0, result.stderr
        assert our_shm_entries(os.getpid()) == entries
        assert next(loader).step == 0


def test_the_sweep_takes_a_ring_whose_owner_lock_is_free_even_if_its_pid_lives(dataset):
    """Liveness is the owner lock, not a pid: a ring named after a live pid but abandoned goes."""
    name = f"shml_{os.getppid()}_00112233aabb"  # A pid that lives (pytest's parent).
    posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=4096).close_fd()
    posix_ipc.Semaphore(f"/{name}_w", posix_ipc.O_CREX).close()
    assert {name, f"sem.{name}_w"} <= set(sweep_stale())


def test_entries_the_sweep_does_not_understand_are_skipped(dataset, tmp_path):
    """A file named like a ring with a pid too large for os.kill stopped every loader."""
    stray = "/dev/shm/shml_99999999999999999999_aa"
    with open(stray, "w"):
        pass
    try:
        with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=2) as loader:
            next(loader)
        assert os.path.exists(stray)
    finally:
        os.unlink(stray)


@pytest.mark.parametrize("signal_number", [signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT], ids=lambda s: s.name)
def test_a_signal_to_the_whole_process_group_leaves_nothing(dataset, signal_number):
    """Readers died with their trainer and nobody unlinked the ring."""
    child, info = run_child("iterate", {"label": dataset["paths"]["labels_npy"]}, start_new_session=True)
    os.killpg(child.pid, signal_number)
    child.wait(10)
    assert_all_gone(child.pid, info, timeout=5.0)


def test_a_second_ctrl_c_during_close_leaks_nothing(dataset):
    child, info = run_child("close-with-stopped-readers", {"label": dataset["paths"]["labels_npy"]},
                            stderr=subprocess.PIPE)
    assert child.stdout.readline().strip() == "closing"
    time.sleep(0.3)  # Inside close(): its readers are stopped, so it waits to join them.
    child.send_signal(signal.SIGINT)
    time.sleep(0.3)
    child.send_signal(signal.SIGINT)
    code, errors = exit_code_and_errors(child, 15)
    assert "KeyboardInterrupt" in errors, errors
    for pid in info["readers"]:
        if process_alive(pid):
            os.kill(pid, signal.SIGCONT)
    assert_all_gone(child.pid, info)


def test_a_trainer_that_execs_another_program_has_its_readers_clean_up(dataset):
    child, info = run_child("exec", {"label": dataset["paths"]["labels_npy"]})
    try:
        assert_all_gone(child.pid, info, timeout=5.0)
        assert child.poll() is None  # The exec'd program still runs under the same pid.
    finally:
        child.kill()
        child.wait()


def mapped(name: str) -> bool:
    """Whether this process maps the segment `name` (judged by the ring's own name, not by
    /dev/shm's free space, which other processes change)."""
    with open("/proc/self/maps") as maps:
        return any(f"/dev/shm/{name}" in line for line in maps)


def test_close_gives_the_ring_memory_back_once_no_batch_view_is_alive(tmp_path):
    if shutil.disk_usage("/dev/shm").free < 256 << 20:  # A container's: the ring goes to a memfd (no path).
        pytest.skip("this /dev/shm cannot hold the 128 MiB ring this test looks for there")
    np.save(tmp_path / "big.npy", np.zeros((64, 1 << 20), dtype=np.uint8))
    loader = ShmDataLoader({"x": str(tmp_path / "big.npy")}, batch_size=32, readers=1, slots=4)
    name = loader.diagnostics.ring_name.lstrip("/")
    batch = next(loader)
    assert mapped(name) and os.path.exists(f"/dev/shm/{name}")
    assert os.path.getsize(f"/dev/shm/{name}") >= 4 * 32 << 20
    loader.close()
    view = batch["x"]
    del batch
    gc.collect()
    assert not os.path.exists(f"/dev/shm/{name}")  # Unlinked at close...
    assert mapped(name)  # ...while a live view keeps its mapping valid.
    assert view.sum() == 0
    del view
    gc.collect()
    assert wait_until(lambda: not mapped(name), 3), "the closed loader still maps the ring"
    assert loader.closed  # The loader object itself is still referenced here.


def test_an_oversized_error_report_keeps_type_step_and_the_end_of_its_traceback():
    try:
        raise RuntimeError("bad record " + "y" * (3 * READER_ERROR_BYTES_MAX))
    except RuntimeError as error:
        report = ErrorReport.of(error, step=41)
    encoded = report.encode()
    assert len(encoded) <= READER_ERROR_BYTES_MAX
    decoded = ErrorReport.decode(encoded)
    assert decoded.type == "RuntimeError" and decoded.step == 41
    assert decoded.message.startswith("bad record yyy") and decoded.message.endswith("[... message cut]")
    assert decoded.traceback.rstrip().endswith(report.traceback.rstrip()[-40:])


def test_an_oversized_reader_error_reaches_the_trainer_readable(dataset, tmp_path, monkeypatch):
    marker = tmp_path / "fire"
    marker.touch()
    monkeypatch.setenv(FAULT_INJECTION_VARIABLE, f"raise:5:{marker}")
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=3) as loader:
        with pytest.raises(ReaderError) as raised:
            for _ in range(100):
                next(loader)
    assert raised.value.original_type == "RuntimeError" and raised.value.step == 5
    assert "injected fault at step 5" in str(raised.value) and "unreadable" not in str(raised.value)


def test_a_reader_error_is_reported_as_such_when_the_trainer_ignores_sigchld(dataset, tmp_path):
    """With SIGCHLD ignored every child 'exits with code 0': the report must still be read."""
    marker = tmp_path / "fire"
    marker.touch()
    code = (
        "import signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
        "from shmloader import ShmDataLoader, ReaderError\n"
        "with ShmDataLoader({'label': sys.argv[1]}, batch_size=8, readers=2, slots=3) as loader:\n"
        "    try:\n"
        "        for _ in range(100): next(loader)\n"
        "    except ReaderError as error: print('ReaderError', error.original_type, error.step)\n"
    )
    environment = {**os.environ, FAULT_INJECTION_VARIABLE: f"raise:5:{marker}"}
    result = subprocess.run([sys.executable, "-c", code, dataset["paths"]["labels_npy"]], capture_output=True,
                            text=True, timeout=60, env=environment, cwd=HERE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:3] == ["ReaderError", "RuntimeError", "5"], result.stdout


def test_a_npy_truncated_under_a_reader_is_named(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(1000, dtype=np.int64))
    spec = describe_field(tmp_path / "t.npy")
    with open(tmp_path / "t.npy", "r+b") as handle:
        handle.truncate(200)
    with pytest.raises(StorageError, match=r"t\.npy: the file changed since the loader described it.*now inode \d+ "
                                           r"of 200 bytes"):
        open_field(spec)
    # A spec without an identity (built by hand) still gets the size check.
    with pytest.raises(StorageError, match=r"t\.npy: cannot map the \.npy file.*200 bytes now, 1000 rows"):
        open_field(dataclasses.replace(spec, identity=()))


def test_a_b2nd_with_zero_width_rows_loads_like_the_npy_equivalent(tmp_path):
    import blosc2

    blosc2.asarray(np.zeros((10, 0), dtype=np.uint8), urlpath=str(tmp_path / "z.b2nd"), mode="w")
    np.save(tmp_path / "z.npy", np.zeros((10, 0), dtype=np.uint8))
    with ShmDataLoader({"b": str(tmp_path / "z.b2nd"), "n": str(tmp_path / "z.npy")}, batch_size=4, readers=1) as loader:
        batch = next(loader)
        assert batch["b"].shape == batch["n"].shape == (4, 0)


@pytest.mark.parametrize("start_step", [2**63, 2**64 - 1])
def test_steps_past_the_samplers_range_are_refused_at_construction_and_seek(dataset, start_step):
    path = dataset["paths"]["labels_npy"]
    with pytest.raises(ValueError, match=r"start_step must be in \[0, \d+\]"):
        ShmDataLoader({"label": path}, batch_size=8, readers=1, slots=2, start_step=start_step)
    with ShmDataLoader({"label": path}, batch_size=8, readers=1, slots=2) as loader:
        with pytest.raises(ValueError, match=r"step must be in \[0, \d+\]"):
            loader.seek(start_step)
        assert next(loader).step == 0


def test_next_from_a_second_thread_says_one_thread_iterates(dataset):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=2) as loader:
        next(loader)
        os.kill(loader.diagnostics.reader_pids[0], signal.SIGSTOP)
        try:
            outcome = []

            def iterate() -> None:
                try:
                    for _ in range(10):
                        next(loader)
                except Exception as error:  # Whatever ends it once the readers go on.
                    outcome.append(error)

            blocked = threading.Thread(target=iterate, daemon=True)
            blocked.start()
            time.sleep(0.5)  # The ring's ready batches are gone; it waits in next().
            with pytest.raises(RuntimeError, match="one thread iterates and seeks a loader"):
                next(loader)
        finally:
            os.kill(loader.diagnostics.reader_pids[0], signal.SIGCONT)
        blocked.join(10)


def test_no_room_for_the_semaphores_is_a_shared_memory_error_with_sizes(dataset, monkeypatch):
    real = posix_ipc.Semaphore

    def semaphore(name, flags=0, *args, **kwargs):
        if flags & posix_ipc.O_CREX and name.endswith("_r1"):
            raise OSError(28, "No space left on device")
        return real(name, flags, *args, **kwargs)

    monkeypatch.setattr(posix_ipc, "Semaphore", semaphore)
    with pytest.raises(SharedMemoryError, match=r"MiB were reserved, but its \d+ semaphores \(a page each of /dev/shm\).*No space left"):
        ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=3)
    assert not our_shm_entries(os.getpid())


def test_a_fifo_as_a_data_path_is_refused_instead_of_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.npy")
    with pytest.raises(StorageError, match=r"pipe\.npy is not a regular file"):
        ShmDataLoader({"label": str(tmp_path / "pipe.npy")}, batch_size=8, readers=1, slots=2)


def test_losing_every_reader_at_once_costs_each_one_restart(dataset):
    """The budget was per loader: four readers killed together exceeded the default 3."""
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=4, slots=6) as loader:
        next(loader)
        for pid in loader.diagnostics.reader_pids:
            os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            next(loader)
        assert loader.stats()["reader_restarts"] == 4


_FORK_DESCRIPTORS_SCENARIO = """
import os, sys
from shmloader import ShmDataLoader

def ring_descriptors(segment):
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{entry}").startswith(segment)
        except OSError:
            pass
    return count

with ShmDataLoader({"label": sys.argv[1]}, batch_size=8, readers=1, slots=3) as loader:
    segment = "/dev/shm" + loader.diagnostics.ring_name
    assert ring_descriptors(segment) >= 1
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write_end, str(ring_descriptors(segment)).encode())
        os._exit(0)
    os.close(write_end)
    found = int(os.read(read_end, 16))
    os.waitpid(pid, 0)
    assert found == 0, found
    assert next(loader).step == 0  # The parent's loader is untouched.
print("ok")
"""


def test_a_child_forked_while_a_loader_lives_keeps_no_descriptor_of_its_ring(dataset):
    """It kept two (the owner lock's and the mapping's), holding the unlinked segment and
    making a dead trainer's ring look owned. Forked in a fresh interpreter: a worker of the
    suite runs threads (faulthandler's, pytest-timeout's, Ray's after its tests), and a
    child forked from threads can block on a lock one of them held."""
    result = subprocess.run([sys.executable, "-c", _FORK_DESCRIPTORS_SCENARIO, dataset["paths"]["labels_npy"]],
                            capture_output=True, text=True, timeout=60, cwd=HERE)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("kind", ["npy", "b2nd"])
def test_a_field_of_more_shards_than_the_descriptor_limit_loads(tmp_path, kind):
    """CPython's mmap kept a descriptor per mapped shard: 1,500 shards under `ulimit -n
    1024` failed at the first shuffled batch (a bare OSError [Errno 24] for .b2nd)."""
    rows = np.arange(600 * 4, dtype=np.int32).reshape(600, 4)
    for shard in range(300):
        part = rows[shard * 2:(shard + 1) * 2]
        if kind == "npy":
            np.save(tmp_path / f"part{shard:04d}.npy", part)
        else:
            write_b2nd(tmp_path / f"part{shard:04d}.b2nd", part, chunks=(2, 4), blocks=(1, 4))
    np.save(tmp_path / "rows.npy", rows)
    code = (
        "import resource, sys, numpy as np\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))\n"
        "from shmloader import ShmDataLoader\n"
        "rows = np.load(sys.argv[2])\n"
        "with ShmDataLoader({'x': sys.argv[1]}, batch_size=64, readers=1, slots=3, seed=1) as loader:\n"
        "    for _, batch in zip(range(40), loader):\n"
        "        assert np.array_equal(batch['x'], rows[batch.indices]), batch.step\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"part*.{kind}"), str(tmp_path / "rows.npy")],
                            capture_output=True, text=True, timeout=120, cwd=HERE)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_npy_header_with_a_negative_extent_is_refused_naming_the_file(tmp_path):
    """numpy reads (-5, 3) from a hand-edited header: it was described as -5 rows."""
    path = tmp_path / "neg.npy"
    np.save(path, np.zeros((5, 3), np.float32))
    path.write_bytes(path.read_bytes().replace(b"(5, 3)", b"(-5, 3)"))
    with pytest.raises(StorageError, match=r"neg\.npy: its header declares the shape \(-5, 3\)"):
        describe_field(path)


@pytest.mark.parametrize("writer", ["convert", "write_ragged", "convert_images"])
def test_an_output_in_a_missing_directory_is_named_before_anything_is_written(tmp_path, writer):
    """convert ended in RuntimeError: Could not build empty array; the others named a hidden .partial path."""
    from shmloader.tools.convert import convert, write_ragged
    from shmloader.tools.imagefolder import convert_images

    np.save(tmp_path / "x.npy", np.zeros((4, 3), np.float32))
    target = tmp_path / "missing" / "out"
    with pytest.raises(FileNotFoundError, match=rf"{target}.*: its directory {tmp_path / 'missing'} does not exist"):
        if writer == "convert":
            convert(tmp_path / "x.npy", f"{target}.b2nd", progress=False)
        elif writer == "write_ragged":
            write_ragged(target, [np.zeros(3)])
        else:
            convert_images(tmp_path, target, progress=False)


def test_mixture_settings_take_numpy_numbers_and_refuse_a_string_for_fixed(dataset):
    from shmloader import Source

    path = dataset["paths"]["labels_npy"]
    assert Source({"x": path}, fraction=np.float32(0.5)).checked(0).fraction == 0.5
    with pytest.raises(TypeError, match="source 0: fixed must be True or False, got 'yes'"):
        Source({"x": path}, fixed="yes").checked(0)


def test_a_structured_output_dtype_is_refused_when_the_transform_is_declared(dataset):
    from shmloader.transforms import TransformError
    from shmloader.transforms.core import _check_outputs

    with pytest.raises(TransformError, match="structured fields"):
        _check_outputs("m:f", {"x": ((2,), [("a", "<f4"), ("b", "<i4")])})
    with pytest.raises(TransformError, match="sub-arrays"):
        _check_outputs("m:f", {"x": ((2,), "(3,)f4")})


@pytest.mark.parametrize("state, error, message", [
    ({"step": 3}, ValueError, r"lacks \[.*'sources'.*\].*seek\(step\)"),
    ("step 3", TypeError, "state must be the mapping state_dict"),
    (None, TypeError, "state must be the mapping state_dict"),
])
def test_a_checkpoint_that_cannot_be_checked_is_refused(dataset, state, error, message):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=3) as loader:
        with pytest.raises(error, match=message):
            loader.load_state_dict(state)


def test_a_checkpoint_whose_sources_are_not_a_list_is_refused(dataset):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=3) as loader:
        state = {**loader.state_dict(), "sources": "x"}
        with pytest.raises(ValueError, match="sources must be a list of dicts"):
            loader.load_state_dict(state)


def test_checksum_metadata_of_an_odd_length_names_the_file(tmp_path):
    import blosc2

    from shmloader.storage.spec import BLOCK_DIGESTS_META, CHECKSUM_META
    from shmloader.tools.convert import convert

    np.save(tmp_path / "x.npy", np.arange(4096, dtype=np.int64).reshape(512, 8))
    spec = convert(tmp_path / "x.npy", tmp_path / "x.b2nd", progress=False)
    array = blosc2.open(spec.path, mode="a")
    array.schunk.vlmeta[CHECKSUM_META] = b"\x01\x02\x03\x04\x05"
    del array.schunk.vlmeta[BLOCK_DIGESTS_META]  # A file converted before block digests: chunks are checked whole.
    del array
    with pytest.raises(StorageError, match=r"x\.b2nd: its shmloader\.crc32 metadata holds 5 bytes"):
        open_field(describe_field(spec.path), verify=True)


def test_a_trainer_killed_before_its_readers_are_configured_leaves_nothing(dataset):
    """Killed 0.3-0.4 s after start (ring made, readers still waiting for their
    configuration), it left the ring until another loader swept it: readers read EOF and
    exited without a name to unlink."""
    code = (
        "import os, sys, json\n"
        "from shmloader.readers import pool as readers\n"
        "def configure(self, ring, config):\n"
        "    print(json.dumps({'readers': self.pids, 'segment': ring.names.segment}), flush=True)\n"
        "    os.kill(os.getpid(), 9)\n"
        "readers.ReaderPool.configure = configure\n"
        "from shmloader import ShmDataLoader\n"
        "ShmDataLoader({'label': sys.argv[1]}, batch_size=8, readers=2, slots=4)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, dataset["paths"]["labels_npy"]], stdout=subprocess.PIPE,
                             text=True, cwd=HERE)
    info = json.loads(child.stdout.readline())
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert_all_gone(child.pid, info, timeout=5.0)


def test_ctrl_c_while_readers_start_prints_no_reader_traceback(dataset):
    """Ctrl-C 0.4-0.6 s after start printed two readers' KeyboardInterrupt tracebacks."""
    code = (
        "import sys, time\n"
        "from shmloader import ShmDataLoader; from shmloader.readers import pool as readers\n"
        "start = readers.ReaderPool.start\n"
        "def started(self):\n"
        "    start(self)\n"
        "    print('spawned', flush=True)\n"
        "    time.sleep(0.05)\n"
        "readers.ReaderPool.start = started\n"
        "try:\n"
        "    with ShmDataLoader({'label': sys.argv[1]}, batch_size=8, readers=2, slots=4) as loader:\n"
        "        time.sleep(30)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, dataset["paths"]["labels_npy"]], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=HERE, start_new_session=True)
    assert child.stdout.readline().strip() == "spawned"
    time.sleep(0.1)  # The readers are importing now.
    os.killpg(child.pid, signal.SIGINT)  # As a terminal does: the whole process group.
    out, err = child.communicate(timeout=60)
    assert "interrupted" in out
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err
    assert wait_until(lambda: not our_shm_entries(child.pid), timeout=30)


@pytest.mark.parametrize("kind", ["npy", "b2nd"])
@pytest.mark.parametrize("readers", [0, 2])
def test_a_file_written_in_place_while_read_stops_the_loader_and_no_batch_carries_its_new_bytes(
        tmp_path, kind, readers):
    """A field file rewritten in place at the same size (same inode) while a loader reads it:
    batches carried the new bytes under the old rows' indices with no error (an outside
    review: 54-60 of 91 batches). Now every batch delivered holds the described file's rows,
    and a StorageError naming the file comes within the batches already filled."""
    rows = np.arange(4000 * 4, dtype=np.int64).reshape(4000, 4)
    path = str(tmp_path / f"rows.{kind}")
    if kind == "npy":
        np.save(path, rows)
    else:
        write_b2nd(path, rows, chunks=(64, 4), blocks=(16, 4))
    slots = 6
    delivered = 0
    with ShmDataLoader({"x": path}, batch_size=32, readers=readers, slots=slots, seed=3) as loader:
        with pytest.raises(StorageError, match=r"rows\.(npy|b2nd): the file changed since the loader described it"):
            for step, batch in enumerate(loader):
                assert np.array_equal(batch["x"], rows[batch.indices.astype(np.int64)]), step
                delivered += 1
                if step == 20:
                    if kind == "npy":
                        with open(path, "r+b") as handle:  # Same size, other rows: a write in place.
                            handle.seek(128)
                            handle.write((rows[::-1] + 1).tobytes())
                    else:
                        data = bytearray(open(path, "rb").read())
                        with open(path, "r+b") as handle:
                            handle.write(bytes(data))  # The same bytes again: a write all the same.
                assert step < 20 + slots + readers + 1, "no error within the batches filled before the write"
    assert delivered > 20
    assert not our_shm_entries(os.getpid())


def test_a_file_cut_short_between_batches_is_an_error_not_a_bus_error_with_readers_0(tmp_path):
    """With readers=0 the trainer reads the mapping itself: a file truncated between two
    batches killed it with SIGBUS, naming nothing (an outside review)."""
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(20000 * 8, dtype=np.float64).reshape(20000, 8))
    script = (
        "import os, sys\n"
        "from shmloader import ShmDataLoader, StorageError\n"
        f"path = {str(path)!r}\n"
        "with ShmDataLoader({'x': path}, batch_size=128, readers=0, mode='random') as loader:\n"
        "    try:\n"
        "        for step, batch in enumerate(loader):\n"
        "            if step == 5:\n"
        "                os.truncate(path, 64128)\n"
        "    except StorageError as error:\n"
        "        print('StorageError', error)\n"
        "        sys.exit(0)\n"
        "sys.exit(3)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=str(tmp_path))  # Not the checkout: the installed package.
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "rows.npy: the file changed" in result.stdout

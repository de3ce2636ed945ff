"""Faults are survived or reported, never hung on, and leave nothing behind: readers are
killed, raise, or outlive a killed trainer; /dev/shm fills up; loaders run side by side."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import posix_ipc
import pytest
from conftest import our_shm_entries, process_alive, wait_until, write_b2nd

from shmloader import ReaderError, Sampler, ShmDataLoader
from shmloader.readers import pool as readers
from shmloader.readers.reader import FAULT_INJECTION_VARIABLE
from shmloader.ring.stale import sweep_stale

HERE = pathlib.Path(__file__).resolve().parent


def check_step(batch, labels, sampler):
    assert np.array_equal(batch["label"], labels[sampler.fill(batch.step)]), batch.step


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM], ids=lambda s: s.name)
def test_a_killed_reader_is_replaced_and_no_step_is_lost(dataset, signal_number, monkeypatch):
    # A SIGTERM sent to a reader alone ends it after its grace (its trainer lives): shortened here.
    monkeypatch.setattr(readers.ReaderPool, "signal_grace_seconds", 0.3)
    labels = dataset["labels"]
    sampler = Sampler(600, 8, seed=2)
    with ShmDataLoader({"label": dataset["paths"]["labels_b2nd"]}, batch_size=8, readers=2, slots=4, seed=2) as loader:
        steps = []
        for step in range(300):
            if step in (50, 150):
                victim = loader.diagnostics.reader_pids[step // 100 % 2]
                os.kill(victim, signal_number)
                assert wait_until(lambda victim=victim: not process_alive(victim), timeout=30)
            batch = next(loader)
            check_step(batch, labels, sampler)
            steps.append(batch.step)
        assert steps == list(range(300))
        assert loader.stats()["reader_restarts"] == 2


def test_a_reader_exiting_mid_step_has_that_step_recomputed(dataset, tmp_path, monkeypatch):
    marker = tmp_path / "fire-once"
    marker.touch()
    monkeypatch.setenv(FAULT_INJECTION_VARIABLE, f"exit:7:{marker}")
    labels = dataset["labels"]
    sampler = Sampler(600, 8, seed=4)
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=3, seed=4) as loader:
        for step in range(30):
            batch = next(loader)
            assert batch.step == step
            check_step(batch, labels, sampler)
        assert not marker.exists()
        assert loader.stats()["reader_restarts"] == 1


def test_deaths_past_the_restart_budget_raise_naming_reader_pid_and_signal(dataset):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=4, max_reader_restarts=0) as loader:
        next(loader)
        victim = loader.diagnostics.reader_pids[1]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(ReaderError, match=rf"reader 1 \(pid {victim}\) was killed by SIGKILL") as raised:
            for _ in range(100000):
                next(loader)
        assert time.monotonic() - killed_at < 1.5
        assert raised.value.reader_index == 1 and raised.value.pid == victim and raised.value.exit_code == -signal.SIGKILL


def test_a_reader_exception_reaches_the_trainer_with_type_file_step_and_traceback(tmp_path):
    # Compressible rows, so that chunks are really compressed and damage is detectable.
    rows = ((np.arange(400)[:, None] + np.arange(256)[None, :] // 8) % 256).astype(np.uint8)
    path = write_b2nd(tmp_path / "broken.b2nd", rows, chunks=(100, 256), blocks=(10, 256))
    from shmloader.storage.opening import open_field
    from shmloader.storage.spec import describe_field

    field = open_field(describe_field(path), 8)
    base = int(field._addresses[0]) - 0
    chunk_offset = int(field._addresses[2]) - base
    chunk_bytes = int(field._sizes[2])
    from shmloader._native import ffi

    file_offset = int(field._addresses[0]) - int(ffi.cast("uintptr_t", ffi.from_buffer("uint8_t[]", field._map)))
    field.close()
    with open(path, "r+b") as handle:
        handle.seek(file_offset + chunk_offset + 72)
        handle.write(b"\x5a" * (chunk_bytes - 72))
    with ShmDataLoader({"rows": path}, batch_size=10, readers=2, slots=4, mode="sequential") as loader:
        with pytest.raises(ReaderError) as raised:
            for batch in loader:
                assert batch.step < 20
    error = raised.value
    assert error.original_type == "StorageError"
    assert error.step == 20  # Rows 200..209 are in chunk 2.
    assert "broken.b2nd: chunk 2" in str(error) and "at step 20" in str(error)
    assert "Traceback" in error.traceback_text and "gather" in error.traceback_text


def run_child(behaviour: str, fields: dict, **popen):
    child = subprocess.Popen(
        [sys.executable, str(HERE / "fault_child.py"), behaviour, json.dumps(fields)],
        stdout=subprocess.PIPE, text=True, **popen,
    )
    line = child.stdout.readline()
    assert line, "the child trainer printed nothing"
    return child, json.loads(line)


def exit_code_and_errors(child: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """The child's exit code and stderr; a child still running after `timeout` is killed."""
    try:
        return child.wait(timeout), child.stderr.read()
    finally:
        child.kill()


def assert_all_gone(child_pid: int, info: dict, timeout: float = 3.0) -> None:
    assert wait_until(lambda: not any(process_alive(pid) for pid in info["readers"]), timeout), "readers outlived"
    assert wait_until(lambda: not our_shm_entries(child_pid), timeout), our_shm_entries(child_pid)


def test_readers_exit_and_clean_up_when_the_trainer_is_killed(dataset):
    child, info = run_child("sleep", {"label": dataset["paths"]["labels_npy"]})
    assert our_shm_entries(child.pid)
    child.kill()
    child.wait()
    started = time.monotonic()
    assert_all_gone(child.pid, info)
    assert time.monotonic() - started < 2.5


def sleeping(pid: int) -> bool:
    """Whether the process sleeps in nanosleep (time.sleep), from /proc/PID/wchan."""
    try:
        with open(f"/proc/{pid}/wchan") as handle:
            return "nanosleep" in handle.read()
    except OSError:
        return False


def test_readers_stuck_in_a_transform_die_with_their_killed_trainer(tmp_path):
    """They stayed alive with ppid 1, holding the ring, until killed by hand."""
    np.save(tmp_path / "data.npy", np.zeros((64, 4), dtype=np.float32))
    child, info = run_child("stuck-transform", {"data": str(tmp_path / "data.npy")})
    try:
        # Both readers are inside the transform (sleeping in it, not waiting for work).
        assert wait_until(lambda: all(sleeping(pid) for pid in info["readers"]), 10)
        child.kill()
        child.wait()
        assert_all_gone(child.pid, info, timeout=5.0)
    finally:  # A failure must not leave stuck readers (and their ring) behind.
        for pid in info["readers"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sweep_stale()


def test_a_step_timeout_names_the_step_and_the_reader_that_holds_it(tmp_path, monkeypatch):
    from shmloader import StepTimeoutError

    monkeypatch.setattr(readers.ReaderPool, "join_timeout_seconds", 0.3)  # close() then kills the hung reader.
    np.save(tmp_path / "data.npy", np.zeros((64, 4), dtype=np.float32))
    with ShmDataLoader({"data": str(tmp_path / "data.npy")}, batch_size=4, readers=1, slots=3,
                       transform="transform_fixtures:hangs", step_timeout=0.5) as loader:
        # The reader has claimed step 0 (and hangs in it) before the timeout's clock starts.
        assert wait_until(lambda: loader.diagnostics.slot_states()[0][0] == "FILLING", timeout=30)
        started = time.monotonic()
        with pytest.raises(StepTimeoutError, match=r"step 0 has been in flight for .* reader 0 \(pid \d+\)") as raised:
            next(loader)
        assert time.monotonic() - started < 5
        assert raised.value.step == 0 and raised.value.pid == loader.diagnostics.reader_pids[0]


def test_a_reader_whose_start_outlasts_step_timeout_still_delivers_the_first_batch():
    """A reader's start (here a dataset whose load sleeps 3 s in the reader, as one importing
    torch with CUDA would take) is its own phase: step_timeout=1.5 counts from the moment a
    reader is ready, so the first batch comes, and every batch is the dataset's."""
    from dataset_fixtures import StartsSlowly

    started = time.monotonic()
    # Twice step_timeout: a clock that started with the reader would fail for sure; each
    # step of 8 tiny rows, once the reader is ready, is far inside 1.5 s.
    with ShmDataLoader.from_dataset(StartsSlowly(3.0, length=32), batch_size=8, mode="sequential", readers=1,
                                    step_timeout=1.5) as loader:
        got = [batch["data"].copy() for _, batch in zip(range(4), loader)]  # The whole pass.
    assert time.monotonic() - started >= 3.0  # The start did outlast step_timeout.
    np.testing.assert_array_equal(np.concatenate(got), np.repeat(np.arange(32), 3).reshape(32, 3))


def test_a_reader_that_never_starts_fails_naming_its_start_within_the_bound(monkeypatch):
    """A reader whose dataset load never returns: next() warns that the readers are still
    starting (with the reader, its pid and for how long), and raises a ReaderError naming
    the start once start_timeout_seconds have passed since its configuration; never a
    StepTimeoutError, whose clock has not started."""
    from dataset_fixtures import StartsSlowly

    from shmloader import ReaderStallWarning
    from shmloader.readers import supervision

    monkeypatch.setattr(readers.ReaderPool, "start_timeout_seconds", 2.0)
    monkeypatch.setattr(readers.ReaderPool, "join_timeout_seconds", 0.3)  # close() then kills the sleeping reader.
    monkeypatch.setattr(supervision, "STALL_WARNING_SECONDS", 0.5)
    with ShmDataLoader.from_dataset(StartsSlowly(3600.0), batch_size=8, readers=1, step_timeout=1.0) as loader:
        started = time.monotonic()
        with pytest.warns(ReaderStallWarning, match=r"waits for the readers to start: reader 0 \(pid \d+\) is still "
                                                    r"starting .* for \d+\.\d s, at most start_timeout_seconds=2 s"):
            with pytest.raises(ReaderError, match=r"reader 0 \(pid \d+\) has not started .* past "
                                                  r"ReaderPool.start_timeout_seconds=2 s") as raised:
                next(loader)
        waited = time.monotonic() - started
        assert 1.0 <= waited < 60.0, waited  # Its configuration was sent a little before next() began.
        assert raised.value.pid == loader.diagnostics.reader_pids[0] and raised.value.reader_index == 0


def test_sigterm_of_the_trainer_leaves_nothing(dataset):
    child, info = run_child("iterate", {"label": dataset["paths"]["labels_npy"]})
    child.send_signal(signal.SIGTERM)
    child.wait(10)
    assert_all_gone(child.pid, info)


def test_ctrl_c_closes_cleanly(dataset):
    # A terminal sends SIGINT to the whole foreground group: trainer and readers alike.
    child, info = run_child("iterate", {"label": dataset["paths"]["labels_npy"]}, start_new_session=True, stderr=subprocess.PIPE)
    os.killpg(child.pid, signal.SIGINT)
    code, errors = exit_code_and_errors(child, 10)
    assert code != 0
    assert "KeyboardInterrupt" in errors, errors
    assert_all_gone(child.pid, info)


def test_ctrl_c_interrupts_a_next_that_waits_for_stalled_readers(dataset):
    """next() waits natively with the GIL released; a signal must still end that wait at once."""
    child, info = run_child("stall", {"label": dataset["paths"]["labels_npy"]}, stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "stalled"
        time.sleep(0.3)  # The ring's ready batches go in microseconds; then next() blocks.
        assert child.poll() is None, "next() returned although every reader is stopped"
    except BaseException:
        child.kill()  # It would block for ever on its stopped readers.
        raise
    child.send_signal(signal.SIGINT)  # The trainer only: its readers stay stopped.
    started = time.monotonic()
    code, errors = exit_code_and_errors(child, 10)
    assert code != 0
    # Closing waits (0.3 s here) for the stopped readers to exit, then kills them.
    assert time.monotonic() - started < 5
    assert "KeyboardInterrupt" in errors, errors
    assert_all_gone(child.pid, info)


def test_close_from_another_thread_ends_a_waiting_next(dataset):
    """next() waits without the GIL: a close() meanwhile must end that wait with an error,
    never free what the waiting thread still uses (the process would crash)."""
    child, info = run_child("close-while-waiting", {"label": dataset["paths"]["labels_npy"]}, stderr=subprocess.PIPE)
    line = child.stdout.readline()
    code, errors = exit_code_and_errors(child, 20)
    assert code == 0, errors
    result = json.loads(line)
    assert not result["alive"] and result["outcome"] == ["the loader is closed"], result
    assert_all_gone(child.pid, info)


@pytest.mark.parametrize("attempt", range(3))
def test_a_trainer_killed_as_its_first_loader_is_built_leaves_nothing(dataset, attempt):
    """Killed while its fork server starts, before any reader exists to clean up: the
    server removes the trainer's rings. Before: the ring and its semaphores stayed in
    /dev/shm (5 of 5 runs) until another loader swept."""
    child, info = run_child("die-after-build", {"label": dataset["paths"]["labels_npy"]})
    assert child.wait(10) == -signal.SIGKILL
    assert wait_until(lambda: not our_shm_entries(child.pid), 10), our_shm_entries(child.pid)


def test_interpreter_exit_without_close_leaves_nothing(dataset):
    child, info = run_child("exit-without-close", {"label": dataset["paths"]["labels_npy"]})
    assert child.wait(10) == 0
    assert_all_gone(child.pid, info, timeout=1.0)


def test_an_unclosed_loader_is_cleaned_up_by_garbage_collection(dataset):
    loader = ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=3)
    batch = next(loader)
    pids = loader.diagnostics.reader_pids
    del loader
    gc.collect()
    assert wait_until(lambda: not our_shm_entries(os.getpid()), 2)
    assert wait_until(lambda: not any(process_alive(pid) for pid in pids), 2)
    assert batch["label"].sum() >= 0  # Still readable: the mapping lives with the batch.


def test_an_exception_inside_the_loop_closes_the_loader(dataset):
    with pytest.raises(ZeroDivisionError):
        with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=3) as loader:
            pids = loader.diagnostics.reader_pids
            for batch in loader:
                raise ZeroDivisionError("the training step failed")
    assert not our_shm_entries(os.getpid())
    assert wait_until(lambda: not any(process_alive(pid) for pid in pids), 2)


def test_stale_segments_of_dead_trainers_are_swept(dataset):
    dead = subprocess.Popen([sys.executable, "-c", "pass"], cwd=HERE)
    dead.wait()
    name = f"/shml_{dead.pid}_00112233aabb"
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096).close_fd()
    posix_ipc.Semaphore(f"{name}_w", posix_ipc.O_CREX).close()
    assert our_shm_entries(dead.pid) == {f"shml_{dead.pid}_00112233aabb", f"sem.shml_{dead.pid}_00112233aabb_w"}
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=2):
        assert not our_shm_entries(dead.pid)


def test_live_rings_of_other_processes_are_left_alone(dataset):
    child, info = run_child("sleep", {"label": dataset["paths"]["labels_npy"]})
    try:
        before = our_shm_entries(child.pid)
        with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=2):
            assert our_shm_entries(child.pid) == before
    finally:
        child.kill()
        child.wait()
    assert_all_gone(child.pid, info)


def test_several_trainer_processes_at_once(dataset):
    code = (
        "import sys, numpy as np; from shmloader import ShmDataLoader, Sampler;"
        "seed = int(sys.argv[1]); labels = np.load(sys.argv[2]); s = Sampler(600, 8, seed=seed);"
        "loader = ShmDataLoader({'label': sys.argv[2]}, batch_size=8, readers=2, slots=3, seed=seed);"
        "ok = all(np.array_equal(b['label'], labels[s.fill(b.step)]) for _, b in zip(range(300), loader));"
        "loader.close(); sys.exit(0 if ok else 1)"
    )
    children = [
        subprocess.Popen([sys.executable, "-c", code, str(seed), dataset["paths"]["labels_npy"]], cwd=HERE) for seed in range(3)
    ]
    assert [child.wait(60) for child in children] == [0, 0, 0]
    for child in children:
        assert not our_shm_entries(child.pid)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for a private tmpfs mount")
@pytest.mark.parametrize("check", ["statvfs", "fallocate"])
def test_a_full_dev_shm_is_an_error_at_construction_never_a_sigbus(dataset, check):
    """A 2 MiB /dev/shm in a private mount namespace, with anonymous memory forbidden
    (SHMLOADER_RING_MEMORY=dev-shm): the ring (about 8 MiB) cannot fit. With "fallocate"
    the placement's free-space check is bypassed, so posix_fallocate must refuse it."""
    disable = ("import shmloader.ring.backing as b; b.place = lambda *a, **k: 'dev-shm';"
               if check == "fallocate" else "")
    code = (
        f"{disable}"
        "from shmloader import ShmDataLoader, SharedMemoryError; import os, sys\n"
        "try:\n"
        f"    ShmDataLoader({{'label': {dataset['paths']['labels_npy']!r}}}, batch_size=500000, readers=1, slots=2)\n"
        "except SharedMemoryError as error:\n"
        "    print('ERROR', error); print('LEFT', os.listdir('/dev/shm')); sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=2m tmpfs /dev/shm && exec {sys.executable} -c \"$0\"", code],
        capture_output=True, text=True, timeout=60, cwd=HERE, env={**os.environ, "SHMLOADER_RING_MEMORY": "dev-shm"},
    )
    if "mount:" in result.stderr or "unshare:" in result.stderr:
        pytest.skip(f"no private mount here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MiB" in result.stdout and "/dev/shm" in result.stdout
    assert "LEFT []" in result.stdout


def test_a_loader_that_fails_while_starting_readers_leaves_nothing(dataset, monkeypatch):
    started = []
    original = readers.spawn_reader

    def spawn_then_fail():
        if len(started) == 1:
            raise OSError("no more processes")
        process = original()
        started.append(process.pid)
        return process

    monkeypatch.setattr(readers, "spawn_reader", spawn_then_fail)
    with pytest.raises(OSError, match="no more processes"):
        ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=3)
    assert not our_shm_entries(os.getpid())
    assert started and wait_until(lambda: not any(process_alive(pid) for pid in started), 30)


def test_readers_started_for_a_loader_whose_files_are_bad_exit(tmp_path, monkeypatch):
    started = []
    original = readers.spawn_reader

    def recording_spawn():
        process = original()
        started.append(process.pid)
        return process

    monkeypatch.setattr(readers, "spawn_reader", recording_spawn)
    with pytest.raises(FileNotFoundError):
        ShmDataLoader({"label": str(tmp_path / "missing.npy")}, batch_size=8, readers=2, slots=3)
    assert len(started) == 2
    assert wait_until(lambda: not any(process_alive(pid) for pid in started), 30)


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_reader_ended_by_os_exit_3_in_a_transform_is_named_with_its_exit_code_and_step(tmp_path, restarts):
    """Code 3 is also what a reader returns after writing an error report: before, a
    transform's os._exit(3) was reported as "raised unknown while starting"."""
    path = tmp_path / "data.npy"
    np.save(path, np.arange(64 * 4, dtype=np.float32).reshape(64, 4))
    with ShmDataLoader({"data": str(path)}, transform="skip_fixtures:exits_at_step",
                       transform_args={"step": 2, "code": 3}, batch_size=4, readers=2, slots=4, mode="sequential",
                       max_reader_restarts=restarts) as loader:
        started = list(loader.diagnostics.reader_pids)
        with pytest.raises(ReaderError) as raised:
            for batch in loader:
                assert batch.step < 2
        pids = list(loader.diagnostics.reader_pids)
    error, message = raised.value, str(raised.value)
    assert error.exit_code == 3 and error.step == 2 and error.reader_index in (0, 1)
    assert error.pid == pids[error.reader_index] and (restarts or error.pid == started[error.reader_index])
    assert f"reader {error.reader_index} (pid {error.pid}) exited with code 3 while filling step 2" in message
    assert f"restarted {restarts} times already" in message
    assert "unknown" not in message and "while starting" not in message

"""A readers=0 trainer has no fork server to clean after it: its ring's janitor removes the
ring's names from /dev/shm within seconds of the trainer's death (SIGKILL, os._exit in a
transform), without waiting for another loader's sweep, and a normal close leaves no
janitor behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import our_shm_entries, process_alive, wait_until
from shmloader import ShmDataLoader

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("janitor_kind", ["shell", "python"])
@pytest.mark.parametrize("death", ["sigkill", "exit_in_transform"])
def test_a_dead_readers_0_trainer_leaves_nothing_in_dev_shm(tmp_path, death, janitor_kind):
    """A shell waiting in flock(1), or an interpreter where flock is not installed."""
    np.save(tmp_path / "x.npy", np.arange(4000, dtype=np.float32).reshape(1000, 4))
    transform = ("transform='skip_fixtures:exits_at_step', transform_args={'step': 3, 'code': 3}, "
                 if death == "exit_in_transform" else "")
    without_flock = "import shmloader.ring.janitor as j; j.trusted_program = lambda name: None\n"
    code = (
        "import os, sys, time; from shmloader import ShmDataLoader\n"
        f"{without_flock if janitor_kind == 'python' else ''}"
        f"loader = ShmDataLoader({{'data': {str(tmp_path / 'x.npy')!r}}}, batch_size=8, readers=0, {transform})\n"
        "print(loader._session.ring.janitor.process.pid, flush=True)\n"
        "for _ in range(10): next(loader)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=HERE)
    try:
        janitor = int(child.stdout.readline())
        assert wait_until(lambda: bool(our_shm_entries(child.pid)) or child.poll() is not None, 10)
        if death == "sigkill":
            wait_until(lambda: False, 0.3)
            os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) in (-signal.SIGKILL, 3)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert wait_until(lambda: not our_shm_entries(child.pid), 5), our_shm_entries(child.pid)
    assert wait_until(lambda: not process_alive(janitor), 5)


def test_a_closed_readers_0_loader_reaps_its_janitor(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((100, 3), np.float32))
    loader = ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=4, readers=0)
    janitor = loader._session.ring.janitor
    assert janitor is not None
    next(loader)
    loader.close()
    assert janitor.process.returncode is not None  # Ended and reaped by close(): no zombie left.
    assert not our_shm_entries(os.getpid())


def test_loaders_with_readers_have_no_janitor(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((100, 3), np.float32))
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=4, readers=1) as loader:
        assert loader._session.ring.janitor is None  # The fork server cleans after its trainer.


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                if int(handle.read().rsplit(") ", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_a_flock_earlier_on_path_is_not_what_the_janitor_runs(tmp_path, monkeypatch):
    """A `flock` that exits at once, first on PATH, would let the shell janitor unlink a
    live ring's names; the janitor runs the system's flock by its absolute path."""
    fake = tmp_path / "bin"
    fake.mkdir()
    marker = tmp_path / "fake-flock-ran"
    (fake / "flock").write_text(f"#!/bin/sh\ntouch {marker}\nexit 0\n")
    (fake / "flock").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ.get('PATH', '')}")
    system_flock = shutil.which("flock", path="/usr/bin:/bin")
    real_flock = os.path.realpath(system_flock) if system_flock else None
    if real_flock is None:
        pytest.skip("no system flock here: the Python janitor runs, which no PATH reaches")
    np.save(tmp_path / "x.npy", np.arange(400, dtype=np.float32).reshape(100, 4))
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=4, readers=0) as loader:
        janitor = loader._session.ring.janitor.process
        names = our_shm_entries(os.getpid())

        def waiting_in_flock() -> bool:
            for child in _children(janitor.pid):
                try:
                    if os.readlink(f"/proc/{child}/exe") == real_flock:
                        return True
                except OSError:
                    continue
            return janitor.poll() is not None

        assert wait_until(waiting_in_flock, 30)
        assert janitor.poll() is None, "the janitor ended while its ring lives"
        assert not marker.exists()
        assert our_shm_entries(os.getpid()) == names and len(names) >= 3
        next(loader)
    assert not our_shm_entries(os.getpid())

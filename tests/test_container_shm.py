"""Where /dev/shm is a container's 64 MB: rings that do not fit there live in anonymous memory
(ring/backing.py), readers attach to them, batches are right, `top` sees them, and nothing is
left anywhere afterwards. The namespace tests need root (a private tmpfs mount)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import our_shm_entries, wait_until
from shmloader import Sampler, SharedMemoryError, ShmDataLoader
from shmloader.ring import backing
from shmloader.tools import monitor

HERE = os.path.dirname(os.path.abspath(__file__))
needs_namespace = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                     reason="needs root for a private tmpfs mount")


def _in_small_dev_shm(code: str, size: str = "64m", timeout: float = 120, environment: dict | None = None):
    """Runs `code` in a mount namespace whose /dev/shm is a fresh tmpfs of `size`; the
    child prints what it left in /dev/shm as its last line."""
    script = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} -c \"$0\""
    result = subprocess.run(["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True,
                            timeout=timeout, cwd=HERE, env={**os.environ, **(environment or {})})
    if "mount:" in result.stderr or "unshare:" in result.stderr:
        pytest.skip(f"no private mount here: {result.stderr.strip()}")
    return result


@needs_namespace
def test_default_settings_run_224x224x3_rows_at_batch_256_in_a_64_mb_dev_shm(tmp_path):
    rows = np.random.default_rng(7).integers(0, 256, size=(300, 224, 224, 3), dtype=np.uint8)
    np.save(tmp_path / "images.npy", rows)
    code = (
        "import os, sys, numpy as np\n"
        "from shmloader import ShmDataLoader, Sampler\n"
        "from shmloader.tools import monitor\n"
        f"rows = np.load({str(tmp_path / 'images.npy')!r}, mmap_mode='r')\n"
        "loader = ShmDataLoader({'image': " + repr(str(tmp_path / "images.npy")) + "}, batch_size=256, seed=5)\n"
        "assert loader._session.ring.data_fd is not None, 'expected anonymous memory'\n"
        "sampler = Sampler(300, 256, seed=5)\n"
        "samples = [monitor.sample(name) for name in monitor.ring_names()]\n"
        "assert len(samples) == 1 and samples[0] is not None and samples[0].batch_size == 256, samples\n"
        "for _, batch in zip(range(6), loader):\n"
        "    assert np.array_equal(batch['image'], rows[sampler.fill(batch.step)]), batch.step\n"
        "loader.close()\n"
        "print('LEFT', sorted(os.listdir('/dev/shm')))\n"
    )
    result = _in_small_dev_shm(code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "LEFT []"


@needs_namespace
def test_the_demo_runs_in_a_64_mb_dev_shm():
    code = (
        "import os, sys\n"
        "from shmloader.tools.cli import main\n"
        "code = main(['demo', '--quiet', '--rows', '4000', '--steps', '60'])\n"
        "print('LEFT', sorted(os.listdir('/dev/shm')))\n"
        "sys.exit(code)\n"
    )
    result = _in_small_dev_shm(code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "LEFT []"


@needs_namespace
def test_a_ring_too_big_for_memory_and_dev_shm_names_both_limits_and_the_fixes(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 4), np.uint8))
    code = (
        "import os, sys\n"
        "import shmloader.ring.backing as b\n"
        "b.memory_room_bytes = lambda: 3 << 20\n"
        "from shmloader import ShmDataLoader, SharedMemoryError\n"
        "try:\n"
        f"    ShmDataLoader({{'x': {str(tmp_path / 'x.npy')!r}}}, batch_size=2_000_000, readers=1, slots=2)\n"
        "except SharedMemoryError as error:\n"
        "    print(error)\n"
        "print('LEFT', sorted(os.listdir('/dev/shm')))\n"
    )
    result = _in_small_dev_shm(code, size="2m")
    assert result.returncode == 0, result.stdout + result.stderr
    message = result.stdout
    assert "/dev/shm" in message and "--shm-size" in message and "medium: Memory" in message, message
    assert "3.0 MiB more memory" in message, message
    assert message.strip().splitlines()[-1] == "LEFT []"


@pytest.mark.parametrize("readers", [0, 2])
def test_anonymous_rings_give_the_same_batches_and_leave_nothing(tmp_path, monkeypatch, readers):
    rows = np.random.default_rng(readers).integers(0, 1 << 30, size=(700, 5), dtype=np.int64)
    np.save(tmp_path / "x.npy", rows)
    monkeypatch.setenv(backing.MEMORY_VARIABLE, "anonymous")
    sampler = Sampler(700, 16, seed=11)
    loader = ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=16, readers=readers, seed=11)
    try:
        ring = loader._session.ring
        assert ring.data_fd is not None
        stub = f"/dev/shm{ring.names.segment}"
        assert os.path.getsize(stub) == backing.STUB_BYTES
        for _, batch in zip(range(120), loader):
            assert np.array_equal(batch["x"], rows[sampler.fill(batch.step)])
    finally:
        loader.close()
    assert not our_shm_entries(os.getpid())


def test_a_killed_trainers_anonymous_ring_frees_its_memory_and_the_sweep_takes_its_names(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(4000, dtype=np.int64).reshape(1000, 4))
    code = (
        "import os, sys, time; from shmloader import ShmDataLoader\n"
        f"loader = ShmDataLoader({{'x': {str(tmp_path / 'x.npy')!r}}}, batch_size=8, readers=1)\n"
        "next(iter(loader)); print(loader._session.ring.data_fd, flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=HERE,
                             env={**os.environ, backing.MEMORY_VARIABLE: "anonymous"})
    try:
        data_fd = int(child.stdout.readline())
        assert os.readlink(f"/proc/{child.pid}/fd/{data_fd}").startswith("/memfd:shml_")
        assert our_shm_entries(child.pid)
    finally:
        child.kill()
        child.wait()
    # The memory went with the last process that mapped it (the trainer and its reader);
    # the fork server sweeps the stub and semaphores its trainer left.
    assert wait_until(lambda: not our_shm_entries(child.pid), 10)


def test_a_fifo_named_like_a_ring_does_not_hang_top(tmp_path):
    name = "shml_1_00112233aabb"
    os.mkfifo(tmp_path / name)
    assert monitor.sample(name, directory=str(tmp_path)) is None


def test_placement_leaves_proportional_headroom_and_obeys_the_variable(tmp_path, monkeypatch):
    assert backing.headroom_bytes(4 << 20) == 1 << 20
    assert backing.headroom_bytes(40 << 20) == 10 << 20
    assert backing.headroom_bytes(4 << 30) == 64 << 20
    free = 8 << 20
    monkeypatch.setattr(backing, "free_bytes", lambda directory: free)
    assert backing.place(4 << 20, str(tmp_path), {}) == "dev-shm"  # 4 MiB + 1 MiB headroom <= 8 MiB
    assert backing.place(7 << 20, str(tmp_path), {}) == "anonymous"  # 7 MiB + 1.75 MiB > 8 MiB
    assert backing.place(1 << 20, str(tmp_path), {backing.MEMORY_VARIABLE: "anonymous"}) == "anonymous"
    with pytest.raises(SharedMemoryError, match="SHMLOADER_RING_MEMORY=dev-shm"):
        backing.place(free, str(tmp_path), {backing.MEMORY_VARIABLE: "dev-shm"})
    with pytest.raises(ValueError, match="SHMLOADER_RING_MEMORY='tmpfs'"):
        backing.place(1 << 20, str(tmp_path), {backing.MEMORY_VARIABLE: "tmpfs"})

"""Entries in /dev/shm that shmloader did not make are data, not trust: a file named like a
ring, with the ring's magic and a reader count no loader makes, in a sparse file of the
size that count implies, is listed by `shmloader top` as foreign and not read. Before, top
mapped it and read every reader record, faulting in tmpfs pages: SIGBUS in a 64 MB
/dev/shm, hundreds of MB in a large one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from shmloader._native import ffi
from shmloader.ring.layout import RING_MAGIC, RING_VERSION, RingLayout
from shmloader.tools import monitor

HERE = os.path.dirname(os.path.abspath(__file__))


def plant(directory: str, name: str, readers: int, slots: int = 8, stride: int = 4096) -> str:
    """A sparse file named `name` with a ring header of `readers` reader records, sized as
    that layout implies (costing no pages: nothing is written past the header)."""
    layout = RingLayout(slots, readers, 4, stride, 1)
    header = ffi.new("shm_ring_header *")
    header.magic, header.version, header.slot_count, header.reader_count = RING_MAGIC, RING_VERSION, slots, readers
    header.field_count, header.trainer_pid, header.batch_size = 1, 1, 4
    header.slot_stride, header.slots_offset = stride, layout.slots_offset
    path = os.path.join(directory, name)
    with open(path, "wb") as handle:
        handle.write(bytes(ffi.buffer(header)))
        handle.truncate(layout.total_bytes)
    return path


@pytest.mark.parametrize("readers", [20_000, 2_000_000])
def test_a_planted_ring_is_foreign_and_not_read(tmp_path, readers):
    plant(str(tmp_path), "shml_1_00112233aabb", readers)
    found = monitor.inspect("shml_1_00112233aabb", str(tmp_path))
    assert isinstance(found, monitor.Foreign), found
    assert f"{readers:,} reader records" in found.reason


def test_a_header_whose_arithmetic_misses_the_file_size_is_foreign(tmp_path):
    path = plant(str(tmp_path), "shml_1_00112233aabc", 2)
    os.truncate(path, os.path.getsize(path) + 4096)
    found = monitor.inspect("shml_1_00112233aabc", str(tmp_path))
    assert isinstance(found, monitor.Foreign) and "the file has" in found.reason, found
    path = plant(str(tmp_path), "shml_1_00112233aabd", 2, stride=4097)
    assert isinstance(monitor.inspect("shml_1_00112233aabd", str(tmp_path)), monitor.Foreign)


def test_a_well_formed_planted_ring_is_read_without_mapping(tmp_path):
    plant(str(tmp_path), "shml_1_00112233aabe", 3)
    found = monitor.inspect("shml_1_00112233aabe", str(tmp_path))
    assert isinstance(found, monitor.RingSample) and len(found.readers) == 3 and len(found.states) == 8


_TOP_IN_SMALL_DEV_SHM = r"""
import os, resource, subprocess, sys, time
sys.path.insert(0, {here!r})
from test_foreign_entries import plant
import numpy as np
from shmloader import ShmDataLoader
np.save({data!r}, np.arange(400, dtype=np.float32).reshape(100, 4))
with ShmDataLoader({{'x': {data!r}}}, batch_size=4, readers=0) as loader:
    next(loader)
    plant('/dev/shm', 'shml_1_00112233aa01', 20_000)
    plant('/dev/shm', 'shml_1_00112233aa02', 2_000_000)
    began = time.monotonic()
    top = subprocess.run([sys.executable, '-m', 'shmloader', 'top', '--once'], capture_output=True, text=True,
                         timeout=120)
    print('ELAPSED', time.monotonic() - began)
    print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    print('RC', top.returncode)
    print(top.stdout, top.stderr)
    print('RING', loader.diagnostics.ring_name)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for a private tmpfs mount")
def test_top_once_survives_planted_rings_in_a_64_mb_dev_shm(tmp_path):
    code = _TOP_IN_SMALL_DEV_SHM.format(here=HERE, data=str(tmp_path / "x.npy"))
    script = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -c \"$0\""
    result = subprocess.run(["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True,
                            timeout=300, cwd=HERE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if "mount:" in result.stderr or "unshare:" in result.stderr:
        pytest.skip(f"no private mount here: {result.stderr.strip()}")
    out = result.stdout
    assert result.returncode == 0 and "RC 0" in out, out + result.stderr
    values = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("ELAPSED", "MAXRSS_KB")))
    # Generous for a loaded machine: a faulting read took minutes or died; memory is the check.
    assert float(values["ELAPSED"]) < 60, out
    assert int(values["MAXRSS_KB"]) < 300 * 1024, out
    ring = out.split("RING ")[1].split()[0].lstrip("/")
    assert ring + "  trainer" in out, out
    assert "foreign (not read): shml_1_00112233aa01: 20,000 reader records" in out, out
    assert "foreign (not read): shml_1_00112233aa02: 2,000,000 reader records" in out, out


def test_the_stale_sweep_leaves_what_no_loader_makes():
    """A FIFO named like a ring, old, is not a ring left behind: the sweep leaves it (before,
    it took the FIFO's free flock for an owner gone and unlinked it)."""
    from shmloader.ring.stale import sweep_stale

    name = "shml_1_0011223344f1"
    path = os.path.join("/dev/shm", name)
    os.mkfifo(path)
    try:
        os.utime(path, (1, 1))
        assert name not in sweep_stale()
        assert os.path.exists(path)
    finally:
        if os.path.lexists(path):
            os.unlink(path)

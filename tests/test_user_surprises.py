"""What a user tripped over, now said or refused: a shuffle batch larger than an epoch (rows
repeated within a batch) is warned of, a slow fill of a huge batch is not blamed on SIGSTOP
alone, `with` on a closed loader raises, and Ctrl-C pressed again while a command cleans up
still ends in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from shmloader import ShmDataLoader
from shmloader.readers.supervision import _stall_cause


@pytest.fixture
def ten_rows(tmp_path):
    np.save(tmp_path / "ten.npy", np.arange(10, dtype=np.int64))
    return str(tmp_path / "ten.npy")


def test_a_shuffle_batch_larger_than_an_epoch_is_warned_of_and_says_what_to_do(ten_rows):
    with pytest.warns(UserWarning, match=r"batch_size=16 is larger than an epoch's 10 rows.*holds some rows twice"
                                         r".*epochs=N.*batch_size <= 10"):
        loader = ShmDataLoader({"a": ten_rows}, batch_size=16, readers=1, slots=2, mode="shuffle")
    with loader:
        batch = next(loader)["a"]
        assert len(np.unique(batch)) == 10 and len(batch) == 16  # What the warning says happens.


@pytest.mark.parametrize("options", [dict(batch_size=16, epochs=1), dict(batch_size=10), dict(batch_size=16, mode="random"),
                                     dict(batch_size=16, mode="sequential")], ids=["epochs", "equal", "random", "sequential"])
def test_no_warning_where_no_batch_repeats_rows_unasked(ten_rows, options):
    options = {"mode": "shuffle", **options}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with ShmDataLoader({"a": ten_rows}, readers=1, slots=2, **options) as loader:
            batch = next(iter(loader))["a"]
    if options.get("epochs") == 1:
        assert sorted(batch.tolist()) == list(range(10))  # One short batch of the whole pass.


def test_a_slow_step_of_a_huge_batch_names_the_batch_size_first():
    large = _stall_cause(900 << 20, 0)
    assert large.startswith("Each batch is 0.94 GB") and "the first batches" in large and "smaller batch_size" in large
    assert "SIGSTOP" in large  # Still named, after it.
    small = _stall_cause(4 << 20, 0)
    assert small.startswith("A reader stopped (SIGSTOP") and "batch" not in small


def test_with_on_a_closed_loader_raises(ten_rows):
    loader = ShmDataLoader({"a": ten_rows}, batch_size=4, readers=1, slots=2)
    with loader:
        next(loader)
    with pytest.raises(RuntimeError, match="closed loader.*build a new ShmDataLoader"):
        with loader:
            pytest.fail("the block ran on a closed loader")


def test_ctrl_c_pressed_again_during_the_clean_up_still_ends_in_one_line(tmp_path):
    """The second Ctrl-C landed in the loader's clean-up and printed an internal traceback."""
    np.save(tmp_path / "x.npy", np.zeros((5000, 64), dtype=np.uint8))
    process = subprocess.Popen(
        [sys.executable, "-m", "shmloader", "bench", str(tmp_path / "x.npy"), "--steps", "100000000", "--quiet",
         "--batch-size", "8", "--readers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while "field" not in (process.stdout.readline() or ""):
            assert time.monotonic() < deadline and process.poll() is None
        time.sleep(1.0)  # In the timed loop by now.
        # Ctrl-C held down until it exits: the later ones land in the clean-up (the fork
        # server's retirement at exit printed "Exception ignored in atexit callback").
        started = time.monotonic()
        while process.poll() is None and time.monotonic() - started < 30:
            os.kill(process.pid, signal.SIGINT)
            time.sleep(0.005)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 130, stderr
    assert stderr.strip() == "shmloader bench: interrupted"

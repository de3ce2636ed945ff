"""readers/fork_call.call_in_fork runs a job in a fork of this process and gives back its bytes:
the fork sees this process's memory and its changes stay its own; no fork is made while
another Python thread runs (None: the caller does the work its own way); a fork that dies,
or sends more than the bound, is named with its pid and status, and none is left behind."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading

import pytest

from conftest import process_alive
from shmloader.readers.fork_call import ForkCallError, call_in_fork

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork"),
              pytest.mark.timeout(60, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]

_STATE = {"calls": 0}


def _counted_job() -> bytes:
    _STATE["calls"] += 1
    return f"{os.getpid()} {_STATE['calls']}".encode()


def test_the_job_runs_in_a_fork_whose_changes_stay_its_own():
    answer = call_in_fork(_counted_job, 64, 10.0, "counting")
    pid, calls = answer.decode().split()
    assert int(pid) != os.getpid() and calls == "1" and _STATE["calls"] == 0
    assert not process_alive(int(pid))


def test_no_fork_is_made_while_another_python_thread_runs():
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(10,))
    thread.start()
    try:
        assert call_in_fork(_counted_job, 64, 10.0, "counting") is None
    finally:
        release.set()
        thread.join()
    assert _STATE["calls"] == 0


def _dies() -> bytes:
    os.kill(os.getpid(), signal.SIGKILL)
    return b""


def _too_much() -> bytes:
    return b"x" * 65


def test_a_fork_that_dies_or_answers_past_the_bound_is_named_and_gone():
    with pytest.raises(ForkCallError, match=r"pid (\d+)\) dying ended with signal 9 before it answered") as raised:
        call_in_fork(_dies, 64, 10.0, "dying")
    assert not process_alive(int(re.search(r"pid (\d+)", str(raised.value)).group(1)))
    # The job's own check: the child refuses an answer over the bound and exits with 1.
    with pytest.raises(ForkCallError, match=r"talking ended with exit code 1"):
        call_in_fork(_too_much, 64, 10.0, "talking")

"""die_with_parent(), called first by the suite's child trainers (fault_child.py,
distributed_child.py): a child dies with the test worker that started it. A worker ended
by pytest-timeout exits at once, and a child left iterating forever would hold the run's
output open."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
# Set by conftest.py to the test worker's pid.
WORKER_VARIABLE = "SHMLOADER_TEST_WORKER_PID"


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    worker = os.environ.get(WORKER_VARIABLE)
    if worker and os.getppid() != int(worker):  # The worker died before the request took effect.
        os._exit(1)


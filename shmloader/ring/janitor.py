"""The janitor of a ring that no fork server watches (readers=0): a small process that removes
the ring's names from /dev/shm as soon as its trainer lets go of the owner lock, by close()
or by dying (SIGKILL, os._exit in a transform), instead of when another loader next sweeps.

With readers > 0 the fork server does this (readers/forkserver_process.py). A readers=0
trainer has none, so it starts this one: a fresh interpreter without site packages, in its
own session (a Ctrl-C at the terminal reaches the trainer, not it), that opens the segment
and blocks in a shared flock, which the kernel grants once the trainer's exclusive owner
lock is gone (every descriptor of the segment closed, its mappings' included). It then
unlinks the segment and the semaphores and exits. A normal close unlinks them itself, then
ends and reaps the janitor.
"""

from __future__ import annotations

import os
import subprocess
import sys

from .layout import SHM_DIRECTORY, RingNames

# How long close() waits for the janitor to exit once told to.
_REAP_SECONDS = 2.0

_CODE = r"""
import fcntl, os, sys
directory, segment, semaphores = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    fd = os.open(directory + segment, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
except OSError:
    sys.exit(0)
sys.stdout.write("watching\n")
sys.stdout.flush()
fcntl.flock(fd, fcntl.LOCK_SH)
for name in semaphores:
    try:
        os.unlink(directory + "/sem." + name.lstrip("/"))
    except OSError:
        pass
try:
    os.unlink(directory + segment)
except OSError:
    pass
"""


class Janitor:
    """The janitor process of one ring (see the module)."""

    def __init__(self, names: RingNames, directory: str = SHM_DIRECTORY) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-S", "-I", "-c", _CODE, directory, names.segment, names.work, *names.ready],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
            start_new_session=True,
        )
        # Watching once it has the segment open (a lock it then waits for cannot be missed):
        # an empty line means it found no segment, which only a trainer already gone causes.
        self.watching = self.process.stdout.readline() == b"watching\n"
        self.process.stdout.close()

    def stop(self) -> None:
        """At the ring's close, whose names the trainer unlinks itself: ends the janitor and
        reaps it (its wait for the lock could outlast close(), since a batch view keeps the
        segment mapped, and the mapping's own descriptor holds the lock)."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(_REAP_SECONDS)
        except subprocess.TimeoutExpired:
            pass  # SIGTERM ends it at once; a zombie would go with this process.


def start(names: RingNames) -> Janitor | None:
    """A janitor for the ring named `names`, or None where no process can be started (the
    ring then waits for the next loader's sweep, as before)."""
    try:
        return Janitor(names)
    except OSError:
        return None

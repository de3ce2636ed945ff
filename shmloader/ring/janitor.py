"""The janitor of a ring that no fork server watches (readers=0): a small process that removes
the ring's names from /dev/shm as soon as its trainer lets go of the owner lock, by close()
or by dying (SIGKILL, os._exit in a transform), instead of when another loader next sweeps.

With readers > 0 the fork server does this (readers/forkserver_process.py). A readers=0
trainer has none, so it starts this one: a fresh interpreter without site packages, in its
own session (a Ctrl-C at the terminal reaches the trainer, not it): a shell waiting in
flock(1) where a trusted one is installed, else a fresh interpreter without site packages. It opens
the segment and blocks in a shared flock, which the kernel grants once the trainer's exclusive owner
lock is gone (every descriptor of the segment closed, its mappings' included). It then
unlinks the segment and the semaphores and exits. A normal close unlinks them itself, then
ends and reaps the janitor.

The programs the shell janitor runs (sh, flock, rm) are found in the system's own
directories by absolute path, never through PATH, and each must be a root- (or this user-)
owned file that nobody else can write, in a directory nobody else can write: a `flock`
earlier on PATH that exits at once would otherwise unlink a live ring's names. Where one
is missing or fails the check, the Python janitor runs instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
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


# Where util-linux's (or busybox's) flock is there, the janitor is a shell that waits in it:
# a millisecond to start, where an interpreter takes tens (a readers=0 loader is made often).
# $1 and $2 are the absolute flock and rm (trusted_program); the names to remove follow.
_SHELL_CODE = 'exec 3<"$0" || exit 0; flock="$1"; rm="$2"; shift 2; "$flock" -s 3 && exec "$rm" -f -- "$@"'
# Where the janitor looks for the programs it runs, instead of PATH.
SYSTEM_DIRECTORIES = ("/usr/bin", "/bin", "/usr/sbin", "/sbin")


def _trusted_file(path: str, directory: bool) -> bool:
    try:
        status = os.stat(path)
    except OSError:
        return False
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    return (kind(status.st_mode) and status.st_uid in (0, os.geteuid())
            and not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def trusted_program(name: str) -> str | None:
    """The absolute, symlink-resolved path of program `name` in SYSTEM_DIRECTORIES, where it
    and its directory are owned by root (or this user) and writable by no one else; else None."""
    found = shutil.which(name, path=os.pathsep.join(SYSTEM_DIRECTORIES))
    if found is None:
        return None
    real = os.path.realpath(found)
    if not (os.access(real, os.X_OK) and _trusted_file(real, directory=False)
            and _trusted_file(os.path.dirname(real), directory=True)):
        return None
    return real


class Janitor:
    """The janitor process of one ring (see the module). It is started without waiting for
    it: if the trainer dies before the janitor opened the segment, it finds the lock free
    and cleans at once; if the ring is closed first, close() ends it."""

    def __init__(self, names: RingNames, directory: str = SHM_DIRECTORY) -> None:
        segment = directory + names.segment
        semaphores = [f"{directory}/sem.{name.lstrip('/')}" for name in (names.work, *names.ready)]
        shell, flock, rm = (trusted_program(name) for name in ("sh", "flock", "rm"))
        if shell is not None and flock is not None and rm is not None:
            command = [shell, "-c", _SHELL_CODE, segment, flock, rm, *semaphores, segment]
        else:
            command = [sys.executable, "-S", "-I", "-c", _CODE, directory, names.segment, names.work, *names.ready]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)

    def stop(self) -> None:
        """At the ring's close, whose names the trainer unlinks itself: ends the janitor (its
        whole process group: the shell and its flock) and reaps it. Its wait for the lock
        could outlast close(), since a batch view keeps the segment mapped, and the
        mapping's own descriptor holds the lock."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
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

"""Rings left behind: finding the segments and semaphores of trainers that are gone (their
owner locks free) and removing them."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import time

import posix_ipc

from .layout import NAME_PREFIX, SHM_DIRECTORY

_SEGMENT_PATTERN = re.compile(r"^shml_\d{1,10}_[0-9a-f]{12}$")
_SEMAPHORE_PATTERN = re.compile(r"^sem\.(shml_\d{1,10}_[0-9a-f]{12})_(?:w|r\d{1,5})$")
# How old an empty ring segment must be before the sweep takes it for abandoned.
_CREATION_GRACE_SECONDS = 60.0


def lock_free(fd: int, shared: bool) -> bool:
    """Whether no process holds an exclusive flock on the file (a ring's owner lock). The
    probe's own lock, when it gets one, is released again unless `shared` is False (then
    the caller keeps it while it removes the ring)."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    if shared:
        fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def sweep_stale(directory: str = SHM_DIRECTORY, owner_pid: int | None = None) -> list[str]:
    """Unlinks the segments and semaphores of rings whose owner is gone: a segment whose
    owner lock this process can take, and semaphores whose segment no longer exists.
    Entries it cannot judge (not ours to open, mid-creation, unknown names) are left alone.
    With `owner_pid`, only the rings named after that trainer (a fork server cleaning up
    after its trainer). Returns what it removed."""
    removed = []
    try:
        entries = set(os.listdir(directory))
    except OSError:
        return removed
    if owner_pid is not None:
        mine = f"{NAME_PREFIX}{owner_pid}_"
        entries = {entry for entry in entries if entry.startswith((mine, f"sem.{mine}"))}
    for entry in sorted(entries):
        if not _SEGMENT_PATTERN.match(entry) or not _segment_abandoned(os.path.join(directory, entry),
                                                                       owner_gone=owner_pid is not None):
            continue
        try:
            posix_ipc.unlink_shared_memory("/" + entry)
            removed.append(entry)
        except (posix_ipc.ExistentialError, OSError):
            pass
    # Semaphores are created after their segment and unlinked before it, so one whose
    # segment is gone belongs to a ring whose owner is gone.
    remaining = (set(os.listdir(directory)) & entries) if removed else entries
    for entry in sorted(remaining):
        match = _SEMAPHORE_PATTERN.match(entry)
        if not match or match.group(1) in remaining:
            continue
        try:
            posix_ipc.unlink_semaphore("/" + entry[len("sem."):])
            removed.append(entry)
        except (posix_ipc.ExistentialError, OSError):
            pass
    return removed


def _segment_abandoned(path: str, owner_gone: bool = False) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # Another user's, or gone already: not ours to judge.
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False  # A FIFO or socket named like a ring: no loader made it.
        if not lock_free(fd, shared=False):
            return False  # Its owner lives (in this PID namespace or another).
        stats = os.fstat(fd)
        # An empty segment may be one being created (the lock comes a moment after the
        # name): leave it unless it is old, or its owner is known to be gone.
        return owner_gone or stats.st_size > 0 or time.time() - stats.st_mtime > _CREATION_GRACE_SECONDS
    finally:
        os.close(fd)

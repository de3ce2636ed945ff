"""The channel between a trainer and its fork server (forkserver.py for the design): the
server's name, messages with descriptors (SCM_RIGHTS), and the care a trainer started
without standard streams needs. Both sides import it; the server imports nothing else of
the client."""

from __future__ import annotations

import array
import fcntl
import os
import socket
import sys

SERVER_NAME = b"shml-forkserver"  # Its /proc/PID/comm; a reader's is reader.PROCESS_NAME.
MESSAGE_BYTES_MAX = 1 << 20  # A request carries the environment.


def above_standard(end: socket.socket) -> socket.socket:
    """`end` on a descriptor above 2. A trainer started with its standard output or error
    closed hands those numbers to the next descriptors it opens: a socket there would be
    taken for the trainer's output (by the server's Popen, by a reader's request), and a
    reader's print would write into the server's channel."""
    if end.fileno() > 2:
        return end
    moved = socket.socket(fileno=fcntl.fcntl(end.fileno(), fcntl.F_DUPFD_CLOEXEC, 3))
    end.close()
    return moved


def standard_stream(descriptor: int) -> bool:
    """Whether descriptor 1 or 2 is the trainer's standard output or error: open, and the
    interpreter started with it (a trainer started with it closed has no sys.__stdout__,
    and whatever it opens later may take the number)."""
    stream = sys.__stdout__ if descriptor == 1 else sys.__stderr__
    return stream is not None and is_open(descriptor)


def is_open(descriptor: int) -> bool:
    try:
        os.fstat(descriptor)
        return True
    except OSError:
        return False


def receive(channel: socket.socket, descriptors_max: int, flags: int = 0) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it (socket.recv_fds ignores its
    flags before Python 3.12)."""
    descriptors = array.array("i")
    data, ancillary, _, _ = channel.recvmsg(MESSAGE_BYTES_MAX, socket.CMSG_LEN(descriptors_max * descriptors.itemsize), flags)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            descriptors.frombytes(payload[:len(payload) - len(payload) % descriptors.itemsize])
    return data, list(descriptors)


def flush_and_exit(code: int):
    """Ends a forked process (a reader, the trainer's fork) with `code`: its standard streams
    flushed, nothing else run (no atexit, no finalizer of the objects it inherited)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)

"""One function run in a short-lived fork of the trainer, its answer (bytes) sent back: the
probe of dataset[0] under multiprocessing_context="fork" (plan/probe.py), which so reads the
trainer's dataset copy-on-write, neither copying it nor touching the trainer's object.

The fork is made as the readers' fork is (trainer_fork.py): only where fork_hazard finds
nothing (no CUDA, no other Python thread), with the standard streams flushed first and
lifecycle's at-fork hook told that the child never reads the batches held now. The child
runs no garbage collection (it would write the header of every object the trainer has, and
so copy the trainer's heap), ignores Ctrl-C (the trainer, in the same process group, ends
it), runs none of the trainer's signal handlers, and never returns into the trainer's code
(os._exit).
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import time

from . import trainer_fork
from .forkserver_channel import above_standard, flush_and_exit

# How long the trainer waits between checks that the child is still alive while it reads.
_POLL_SECONDS = 0.5
# The child's answer (the job's bytes) is bounded by the caller; the trainer reads at most
# this many bytes a call.
_READ_BYTES = 1 << 16
# How long a child that closed its channel may take to exit (flushing its standard streams)
# before it is killed.
_EXIT_WAIT_SECONDS = 10.0


class ForkCallError(RuntimeError):
    """The child ended (killed, crashed, os._exit) before its answer was complete."""


def call_in_fork(job, answer_bytes_max: int, wait_seconds_max: float, purpose: str) -> bytes | None:
    """job()'s bytes, computed in a fork of this process; None where the trainer cannot be
    forked now (trainer_fork.fork_hazard): the caller then does the work its own way. The
    job must return at most `answer_bytes_max` bytes (it bounds its own answer) and catch
    its own exceptions: one that escapes, or a child that dies, raises ForkCallError naming
    `purpose` (what the fork does, for the message), its pid and exit status, as does a
    child that has not answered within `wait_seconds_max` (it is killed)."""
    assert answer_bytes_max > 0, answer_bytes_max
    assert wait_seconds_max > 0, wait_seconds_max
    if trainer_fork.fork_hazard() is not None:
        return None
    parent_end, child_end = (above_standard(end) for end in socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
    try:
        pid = _fork()
    except BaseException:  # No child (ENOMEM, EAGAIN): nothing but the channel to close.
        parent_end.close()
        child_end.close()
        raise
    if pid == 0:
        parent_end.close()
        _answer_in_child(child_end, job, answer_bytes_max)  # Never returns.
    child_end.close()
    answer = None
    try:
        answer = _read_to_end(parent_end, f"the trainer's fork (pid {pid}) {purpose}", answer_bytes_max,
                              wait_seconds_max)
    finally:
        parent_end.close()
        code = _reap(pid, kill=answer is None)
    if code != 0:
        raise ForkCallError(f"the trainer's fork (pid {pid}) {purpose} ended with {_status_text(code)} before it "
                            f"answered")
    return answer


def _fork() -> int:
    for stream in (sys.stdout, sys.stderr):  # What the child would otherwise print again.
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    trainer_fork.forking = True
    try:
        return os.fork()
    finally:
        trainer_fork.forking = False


def _answer_in_child(channel: socket.socket, job, answer_bytes_max: int) -> None:
    code = 1
    try:
        gc.disable()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # The trainer's own handlers (a scheduler's SIGTERM checkpointing) are not the
        # child's to run: a signal ends it, as it ends the readers' fork.
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(number, signal.SIG_DFL)
        answer = job()
        if len(answer) > answer_bytes_max:
            raise AssertionError(f"the job's answer is {len(answer)} bytes, more than {answer_bytes_max}")
        channel.sendall(answer)
        channel.close()
        code = 0
    except BaseException:  # noqa: BLE001 (anything: it must never return into the trainer's code)
        import traceback

        traceback.print_exc()
    finally:
        flush_and_exit(code)


def _read_to_end(channel: socket.socket, child: str, answer_bytes_max: int, wait_seconds_max: float) -> bytes:
    """The child's bytes up to its end of the channel (it closed it, or exited). Bounded by
    `wait_seconds_max` and `answer_bytes_max`."""
    channel.settimeout(_POLL_SECONDS)
    parts, received = [], 0
    deadline = time.monotonic() + wait_seconds_max
    while time.monotonic() < deadline:
        try:
            part = channel.recv(_READ_BYTES)
        except socket.timeout:
            continue
        if not part:
            return b"".join(parts)
        received += len(part)
        if received > answer_bytes_max:
            raise ForkCallError(f"{child} sent more than {answer_bytes_max} bytes")
        parts.append(part)
    raise ForkCallError(f"{child} did not answer within {wait_seconds_max:g} s; it was killed")


def _reap(pid: int, kill: bool) -> int:
    """The child's exit status: killed first where the trainer gave up on it (an error, Ctrl-C,
    the timeout), else waited for a bounded time once it closed its channel (it flushes its
    streams and exits), then killed."""
    deadline = time.monotonic() + (0 if kill else _EXIT_WAIT_SECONDS)
    while True:  # Bounded: by the deadline, then by SIGKILL.
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _status_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"

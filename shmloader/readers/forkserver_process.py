"""The fork server's own process (see forkserver.py for the design): its loop forks a reader
per request, reports every exit, and ends with its trainer or its socket."""

from __future__ import annotations

import json
import os
import select
import signal
import socket

from .forkserver_channel import SERVER_NAME, flush_and_exit, receive

# The server's side: a process of its own, started by ForkServer.


def serve(argv: list[str]) -> int:
    """The server's loop: forks a reader per request, reports every exit, and ends with
    its trainer or its socket."""
    channel, trainer_pid = socket.socket(fileno=int(argv[1])), int(argv[2])
    from ..readers import (
        reader,  # What every reader imports before its configuration, once.
    )

    try:
        trainer = os.pidfd_open(trainer_pid)
    except OSError:
        return _trainer_gone(trainer_pid, 1)
    if os.getppid() != trainer_pid:
        # The trainer died while this server started (the pidfd may name another process).
        return _trainer_gone(trainer_pid, 0)

    reader.set_process_name(SERVER_NAME)

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda number, frame: None)
    try:
        while True:
            readable = select.select([channel, trainer, wake_read], [], [], 1.0)[0]
            if trainer in readable:
                return _trainer_gone(trainer_pid, 0)
            if wake_read in readable:
                while True:
                    try:
                        if not os.read(wake_read, 512):
                            break
                    except BlockingIOError:
                        break
            _report_exits(channel)
            if channel in readable:
                try:
                    data, descriptors = receive(channel, 3)
                except OSError:
                    return 0
                if not data:
                    return 0  # The trainer closed its end.
                request = json.loads(data)
                _fork_reader(channel, request, descriptors, (channel.fileno(), trainer, wake_read, wake_write), reader)
    except (BrokenPipeError, ConnectionError):
        return 0  # The trainer is gone.
    finally:
        channel.close()  # A server forked from the trainer returns into it: nothing left unclosed.


def _trainer_gone(trainer_pid: int, code: int) -> int:
    """Removes the rings of a trainer that died (their owner locks free): a trainer killed
    before its readers were forked left nobody else to (its readers unlink their own ring,
    reader.py). Returns `code`."""
    from ..ring.stale import sweep_stale

    sweep_stale(owner_pid=trainer_pid)
    return code


def _report_exits(channel: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        channel.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fork_reader(channel, request: dict, descriptors: list[int], own: tuple, reader_module) -> None:
    try:
        # A fork copies only the calling thread: a server with another thread (none is ever
        # started here) could fork a reader holding a lock that thread had.
        refused = ("a request without its three descriptors" if len(descriptors) != 3 else
                   "the fork server has more than one thread" if len(os.listdir("/proc/self/task")) != 1 else None)
        if refused:
            channel.send(json.dumps({"error": refused}).encode())
            return
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            _become_reader(request, descriptors, own, reader_module, server_pid)  # Never returns.
        pidfd = os.pidfd_open(pid)
        try:
            socket.send_fds(channel, [json.dumps({"forked": pid}).encode()], [pidfd])
        finally:
            os.close(pidfd)
    finally:
        for descriptor in descriptors:
            os.close(descriptor)


def _become_reader(request: dict, descriptors: list[int], own: tuple, reader_module, server_pid: int) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for descriptor in own:
            os.close(descriptor)
        os.setsid()
        for target, descriptor in enumerate(descriptors):
            os.dup2(descriptor, target)
            os.close(descriptor)
        os.environ.clear()
        os.environ.update(request["env"])
        # The server's pid as it was at the fork: it may die before the reader asks for its
        # death signal, and the reader must see that (reader.main).
        code = reader_module.main(["shmloader-reader", str(server_pid)])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        flush_and_exit(code)

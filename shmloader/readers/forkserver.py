"""Reader processes forked from a prepared interpreter: the trainer's fork server.

A reader is a new process that imports only this package: not the trainer's __main__, and
not a forked copy of a trainer that may hold threads, CUDA or JAX. Starting an interpreter
and importing numpy for every reader is most of a reader's start-up, paid again for every
loader (an evaluation pass each epoch) and every restart. So the trainer starts one
interpreter per process, the fork server, which imports the reader's modules once, never
starts a thread, and forks a reader per request. Like multiprocessing's forkserver, minus
its re-import of the trainer's __main__. (The drop-in's multiprocessing_context="fork" forks
the trainer itself instead, where that is safe: trainer_fork.py, which reuses this server's
protocol and loop.)

A forked reader gets, per request, what a fresh interpreter would: the trainer's current
environment, its current standard output and error (descriptors passed with SCM_RIGHTS),
a stdin pipe for its configuration, its own session. Global random states need no
reseeding: `random` reseeds after a fork, and the step filler seeds numpy's per step. What
the server fixed when it started (sys.path from PYTHONPATH, its cgroup, CPU affinity, nice
value, resource limits, user and group ids) is its key: a trainer that changed one of those
gets a new server. A server costs its trainer one idle process (its imports' memory).

Lifetimes:
- The server watches its trainer through a pidfd (the whole process: a loader made in a
  thread that then ends keeps its readers) and its socket; when either ends it exits, and
  its readers get their death signal (PR_SET_PDEATHSIG, relative to the server's only
  thread), see their trainer gone and clean up (reader.py).
- Readers are the server's children: it reaps them and sends the trainer each exit status.
  With each pid comes a pidfd, through which the trainer signals that reader: a signal
  never reaches a recycled pid.
- A server that dies while its trainer lives (killed alone) loses its readers' exit
  statuses: the trainer kills them through their pidfds, reports them killed, and the
  pool restarts them through a new server. A reader forked just before its server died
  exits at once (reader.EXIT_SERVER_GONE): nothing would end it with its trainer.

Without pidfds (Linux before 5.3, other systems) or with SHMLOADER_FORKSERVER=0, every
reader starts as a fresh interpreter (pool.spawn_interpreter).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from .forkserver_channel import above_standard, receive, standard_stream

ENVIRONMENT_VARIABLE = "SHMLOADER_FORKSERVER"
# How long the trainer waits for a server to answer a fork request before it gives up on
# the server (an interpreter start and the reader's imports take well under a second).
_ANSWER_TIMEOUT_SECONDS = 60.0
# A server reports a reader's exit as soon as it reaps it (a SIGCHLD wakes it); one that
# has not, this long after the reader's pidfd said it exited, or that has been stopped
# (SIGSTOP) this long while a request waits, is given up on: its readers are restarted
# through a new server, and close() never waits on it.
_REPORT_TIMEOUT_SECONDS = 2.0
_BOOTSTRAP = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); import sys; "
              "from shmloader.readers.forkserver_process import serve; sys.exit(serve(sys.argv))")
# Environment variables read once, while an interpreter starts or imports numpy and blosc2:
# a request that differs in one of them needs a server started with it.
_STARTUP_PREFIXES = ("PYTHON", "LD_", "OPENBLAS", "OMP_", "MKL_", "BLOSC", "MALLOC", "GLIBC")


def available() -> bool:
    """Whether readers are forked from a server here: not turned off, and pidfds work."""
    global _pidfds
    if os.environ.get(ENVIRONMENT_VARIABLE, "1") == "0":
        return False
    if _pidfds is None:
        _pidfds = False
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") and hasattr(socket, "send_fds"):
            try:
                os.close(os.pidfd_open(os.getpid()))
                _pidfds = True
            except OSError:
                pass  # ENOSYS (before Linux 5.3) or refused by a seccomp filter.
    return _pidfds


_pidfds: bool | None = None


class ServerLost(OSError):
    """The fork server died or stopped answering: its readers' statuses are gone."""


class ForkedReader:
    """A reader forked by a server, with what pool.py uses of subprocess.Popen (pid, stdin,
    poll, wait, kill, send_signal, returncode). Its pid is known once the server answers,
    so requests for several readers go out before any answer is awaited."""

    def __init__(self, server: ForkServer, stdin) -> None:
        self.server = server
        self.stdin = stdin
        self.returncode: int | None = None
        self._pid: int | None = None
        self._pidfd: int | None = None
        self._failure: str | None = None
        self.unreported_since: float | None = None  # When its pidfd first said it exited.

    @property
    def pid(self) -> int:
        if self._pid is None and self._failure is None:
            self.server.await_answer(self)
        return self._pid if self._pid is not None else 0

    def answered(self, pid: int | None, pidfd: int | None, failure: str | None = None) -> None:
        self._pid, self._pidfd, self._failure = pid, pidfd, failure
        if failure is not None:
            self.returncode = 1

    def poll(self) -> int | None:
        if self.returncode is None and self.pid:
            self.returncode = self.server.exit_code(self)
            if self.returncode is not None:
                self._close_pidfd()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if remaining <= 0:
                raise subprocess.TimeoutExpired("shmloader reader", timeout)
            self.server.receive(remaining)
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, number)
            except ProcessLookupError:
                pass  # It has exited; its status is on its way.

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, timeout: float) -> bool:
        """Whether the process has exited, by its pidfd (for a reader whose server is gone)."""
        return self._pidfd is None or bool(select.select([self._pidfd], [], [], timeout)[0])

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        try:
            self._close_pidfd()
        except (OSError, AttributeError, TypeError):
            pass


class ForkServer:
    """The trainer's side of one server: sends fork requests, reads answers and exit
    statuses. Thread-safe: loaders in several threads may share it."""

    def __init__(self, environment: dict[str, str]) -> None:
        parent_end, child_end = (above_standard(end) for end in socket.socketpair(socket.AF_UNIX,
                                                                                   socket.SOCK_SEQPACKET))
        try:
            # Like a reader started alone (pool.spawn_interpreter): a fresh interpreter,
            # its own session, "/" as working directory; its command line ends with the
            # trainer's pid, and so do its readers'.
            # Descriptors 0-2 always open there (its stderr the trainer's, for its own crash),
            # so that the descriptors a request brings never take their numbers.
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(child_end.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=None if standard_stream(2) else subprocess.DEVNULL,
                env=environment, cwd="/", pass_fds=[child_end.fileno()], start_new_session=True,
            )
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        self._set_up(parent_end, process)

    def _set_up(self, parent_end: socket.socket, process) -> None:
        """The trainer's side, once `process` (the server; subprocess.Popen's interface) runs."""
        self.process = process
        self.socket = parent_end
        self.owner = os.getpid()
        self.lost = False
        self._lock = threading.RLock()
        self._pending: collections.deque[ForkedReader] = collections.deque()
        self._exits: dict[int, int] = {}
        self._running: set[int] = set()  # Pids forked whose exit has not been reported yet.
        self.last_used = time.monotonic()

    def fork(self, environment: dict[str, str]) -> ForkedReader:
        """Asks for a reader with `environment`; its stdin is a pipe the caller writes."""
        read_end, write_end = os.pipe()
        reader = ForkedReader(self, os.fdopen(write_end, "wb"))
        opened = []
        try:
            streams = []
            for descriptor in (1, 2):
                if not standard_stream(descriptor):  # None in this trainer: the reader writes to /dev/null.
                    opened.append(os.open(os.devnull, os.O_WRONLY))
                    descriptor = opened[-1]
                streams.append(descriptor)
            with self._lock:
                if self.lost:
                    raise ServerLost("the fork server is gone")
                try:
                    socket.send_fds(self.socket, [json.dumps({"env": environment}).encode()], [read_end, *streams])
                except OSError as error:
                    self._lose()
                    raise ServerLost(f"the fork server is gone: {error}") from None
                self._pending.append(reader)
                self.last_used = time.monotonic()
            return reader
        except BaseException:
            reader.stdin.close()
            raise
        finally:
            os.close(read_end)
            for descriptor in opened:
                os.close(descriptor)

    def await_answer(self, reader: ForkedReader) -> None:
        deadline = time.monotonic() + _ANSWER_TIMEOUT_SECONDS
        stopped_since = None
        while reader._pid is None and reader._failure is None:
            if not self.lost and _stopped(self.process.pid):
                stopped_since = stopped_since or time.monotonic()
            else:
                stopped_since = None
            if self.lost or time.monotonic() > deadline or (
                    stopped_since is not None and time.monotonic() - stopped_since > _REPORT_TIMEOUT_SECONDS):
                self._lose()
                reader.answered(None, None, "its fork server died or stopped before starting it")
                return
            self.receive(min(0.1, max(0.0, deadline - time.monotonic())))

    def exit_code(self, reader: ForkedReader) -> int | None:
        """The reader's exit code once the server reaped it (as subprocess reports it:
        -N for signal N), or None while it runs. A server that has not reported a reader
        whose pidfd says it has exited within _REPORT_TIMEOUT_SECONDS is not serving (a
        SIGSTOP, a debugger, a hang): it is given up on, which ends its readers too."""
        self.receive(0)
        with self._lock:
            code = self._exits.pop(reader._pid, None)
            if code is not None:
                return code
        if not self.lost and reader._pidfd is not None and reader.exited(0):
            if reader.unreported_since is None:
                reader.unreported_since = time.monotonic()
            elif time.monotonic() - reader.unreported_since > _REPORT_TIMEOUT_SECONDS:
                self._lose()
        if self.lost:  # Its status is gone with the server: kill it, then say so.
            if reader._pidfd is not None:
                try:
                    signal.pidfd_send_signal(reader._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return -signal.SIGKILL if reader.exited(1.0) else None
        return None

    def receive(self, timeout: float) -> None:
        """Reads what the server sent, waiting at most `timeout` for the first message."""
        with self._lock:
            if self.lost:
                return
            if timeout > 0 and not select.select([self.socket], [], [], timeout)[0]:
                return
            while True:
                try:
                    data, descriptors = receive(self.socket, 1, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                except OSError:
                    data, descriptors = b"", []
                if not data:
                    self._lose()
                    return
                self._handle(json.loads(data), descriptors)

    def _handle(self, message: dict, descriptors: list[int]) -> None:
        if "exit" in message:
            self._exits[message["exit"]] = message["code"]
            self._running.discard(message["exit"])
            return
        reader = self._pending.popleft()
        if "forked" in message:
            self._running.add(message["forked"])
            reader.answered(message["forked"], descriptors[0] if descriptors else None)
        else:
            for descriptor in descriptors:
                os.close(descriptor)
            reader.answered(None, None, message.get("error", "the fork server could not start it"))

    def _lose(self) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = True
            self.socket.close()
            for reader in self._pending:
                reader.answered(None, None, "its fork server died before starting it")
            self._pending.clear()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def idle(self) -> bool:
        """Whether none of its readers runs and no request is pending."""
        self.receive(0)
        with self._lock:
            return not self._running and not self._pending

    def retire(self) -> None:
        """Ends the server (an idle one, or at exit): it exits when its socket closes, or is
        killed a second later."""
        with self._lock:
            if self.lost:
                return
            self.lost = True
            self.socket.close()
        try:
            self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def forget_in_child(self) -> None:
        """A forked trainer's copy: closes its descriptor, leaves the server to the parent."""
        self.lost = True
        try:
            self.socket.close()
        except OSError:
            pass
        self.process.returncode = 0  # Not this process's child: never wait for it here.


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (by a signal or a tracer): state T or t."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b") ", 1)[1][:1] in (b"T", b"t")
    except (OSError, IndexError):
        return False


# Resource limits a reader inherits from its server (a trainer may lower RLIMIT_NOFILE or
# RLIMIT_AS after its first loader).
_LIMITS = (resource.RLIMIT_NOFILE, resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_MEMLOCK,
           resource.RLIMIT_NPROC, resource.RLIMIT_CORE)
_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def _key(environment: dict[str, str]) -> tuple:
    """What a server fixes when it starts (see the module's docstring)."""
    startup = tuple(sorted((name, value) for name, value in environment.items() if name.startswith(_STARTUP_PREFIXES)))
    try:
        with open("/proc/self/cgroup") as handle:
            cgroup = handle.read()
    except OSError:
        cgroup = ""
    limits = tuple(resource.getrlimit(limit) for limit in _LIMITS)
    return (sys.executable, startup, cgroup, tuple(sorted(os.sched_getaffinity(0))),
            os.getpriority(os.PRIO_PROCESS, 0), limits, os.getresuid(), os.getresgid())


# A server none of whose readers runs is ended once it has not forked one for this long,
# or at once when the trainer has more servers than this (each holds an interpreter with
# numpy and blosc2 imported: a trainer that changes OMP_NUM_THREADS per evaluation would
# otherwise keep one per value for its whole life).
_IDLE_SECONDS = 60.0
_SERVERS_MAX = 3


def start_reader(environment: dict[str, str]) -> ForkedReader:
    """A reader forked by this trainer's server for `environment` (started when needed)."""
    key = _key(environment)
    for attempt in range(2):
        with _servers_lock:
            _retire_idle(keep=key)
            server = _servers.get(key)
            if server is None or server.lost:
                server = _servers[key] = ForkServer(environment)
        try:
            return server.fork(environment)
        except ServerLost:
            if attempt:
                raise
    raise AssertionError("unreachable")


def _retire_idle(keep: tuple) -> None:
    """Ends servers other than `keep`'s that are lost, or idle past _IDLE_SECONDS, or idle
    while there are more than _SERVERS_MAX (the least recently used first). Under
    _servers_lock."""
    now = time.monotonic()
    for key, server in sorted(_servers.items(), key=lambda item: item[1].last_used):
        if key == keep:
            continue
        crowded = len(_servers) >= _SERVERS_MAX
        if server.lost or ((crowded or now - server.last_used > _IDLE_SECONDS) and server.idle()):
            server.retire()
            del _servers[key]


def _forget_servers_in_child() -> None:
    global _servers_lock
    _servers_lock = threading.Lock()
    for server in _servers.values():
        server.forget_in_child()
    _servers.clear()


def _close_servers() -> None:
    """At exit: each server sees its socket close and exits (the loaders' finalizers, which
    atexit runs before this, registered later, have stopped their readers)."""
    for server in list(_servers.values()):
        if server.owner == os.getpid():
            server.retire()


os.register_at_fork(after_in_child=_forget_servers_in_child)
atexit.register(_close_servers)



"""Readers forked from the trainer's own process image (the drop-in's
multiprocessing_context="fork", PyTorch's default on Linux): a fork server made by os.fork
of the trainer, so that its readers see the trainer's working directory, globals (set under
the main guard too) and the dataset's memory, shared copy-on-write, with nothing pickled.

The trainer forks once per loader, when the loader is made and its dataset planned (not
for every reader): the copy, its "zygote", runs forkserver_process.serve, as the fork
server started from a fresh interpreter does, and forks each reader from itself on
request, a reader replacing one that died included. So a replacement is forked from the
trainer as it was then, not as it is later, when it may have CUDA initialised or threads
running (a fork copies only the calling thread: a lock another thread held stays held in
the child forever). The trainer forks only when neither holds (fork_hazard); the drop-in
falls back to the fork server otherwise, saying why once. A zygote killed alone is made
again from the trainer as it is then, where that is safe (ReaderForks).

Memory: the zygote shares the trainer's pages copy-on-write; a page the trainer writes
afterwards (its model, optimiser, Python heap) is copied, and the zygote keeps the old one,
as each of torch's forked workers does. Without persistent_workers the zygote is made anew
each epoch (ReaderPool.refork), which gives those pages back.

What the zygote inherits and must not use: the trainer's rings (lifecycle's at-fork hook
points their descriptors at /dev/null), its fork servers (forkserver's hook forgets them),
its signal handlers (SIGINT is ignored: the trainer handles Ctrl-C and stops its readers)
and its threads' state (none run in it). It exits with its trainer (a pidfd) or its socket,
as the fork server does; it never returns into the trainer's code (os._exit).
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import threading
import time
import weakref

from .forkserver import ForkServer, ServerLost
from .forkserver_channel import above_standard, flush_and_exit

# Set while the trainer forks itself for its readers: lifecycle's at-fork hook then does not
# note the held batches as shared (that child never reads the batches mapped in it).
forking = False


def fork_hazard() -> str | None:
    """Why forking the trainer now is unsafe, or None: CUDA initialised (a forked child
    cannot use it, and torch's own fork check raises there), or Python threads other than
    this one running (one may hold a lock, the import lock or a logging handler's, that
    would stay held in the child). Native thread pools (OpenBLAS's, OpenMP's, torch's
    intra-op pool) are not counted: numpy starts one as it is imported on any machine with
    more than one core, and they reset themselves in a child (pthread_atfork), which is why
    PyTorch's own DataLoader forks past them."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA is initialised in the trainer (a forked reader could not use it, and forking it is unsafe)"
    threads = threading.active_count()
    if threads > 1:
        names = ", ".join(sorted(thread.name for thread in threading.enumerate()
                                 if thread is not threading.current_thread()))
        return f"the trainer runs {threads - 1} other Python thread(s) ({names}), which a fork would leave " \
               f"holding whatever lock they held"
    return None


class ReaderForks:
    """A reader pool's source of readers under share_by_fork: the trainer's fork, made by
    start() (the caller checked fork_hazard), and every reader forked from it. A fork that
    died (killed alone) is made again from the trainer as it is then, where that is safe;
    where not, a reader that must be replaced cannot be, and the error says why."""

    def __init__(self) -> None:
        self.server: TrainerFork | None = None

    def start(self) -> None:
        self.retire()
        self.server = TrainerFork()

    def reader(self, environment: dict[str, str]):
        """A reader forked from the trainer's fork (forkserver.ForkedReader)."""
        for attempt in range(2):
            if self.server is None or self.server.lost:
                hazard = fork_hazard()
                if hazard is not None:
                    gone = "" if self.server is None else f" (pid {self.server.process.pid}) is gone and"
                    raise RuntimeError(f"the readers' fork of the trainer{gone} a reader must be started, but the "
                                       f"trainer cannot be forked now: {hazard}; use multiprocessing_context='spawn'")
                self.start()
            try:
                return self.server.fork(environment)
            except ServerLost:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def retire(self) -> None:
        """Ends the fork (its readers are the caller's to end first). Idempotent."""
        server, self.server = self.server, None
        if server is not None:
            server.retire()


class _ForkedProcess:
    """The zygote as ForkServer uses its process: pid, poll, wait, kill."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL  # Reaped elsewhere: it is gone either way.
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:  # Bounded by `timeout` where given; the zygote exits with its socket.
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("shmloader trainer fork", timeout)
            time.sleep(0.005)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# A fork collects the oldest generation too at most this often (its young ones always). The
# fork and its readers would keep garbage in reference cycles for good (a 500 MB array in a
# cycle: 500 MB more in the readers, once the trainer frees its own copy), but the oldest
# generation's collection walks every object of the trainer: 70 ms with torch imported, 180
# with Lightning, at every epoch's fork where readers do not persist. Garbage that came into
# it since the last such collection, seconds ago, is kept by a fork that lasts an epoch.
FULL_COLLECTION_SECONDS = 10.0
_last_full_collection: float | None = None


def _collect_garbage(now: float | None = None, collect=gc.collect) -> None:
    """`now` (time.monotonic's) and `collect` (gc.collect): what the tests give instead."""
    global _last_full_collection
    now = time.monotonic() if now is None else now
    if _last_full_collection is None or now - _last_full_collection >= FULL_COLLECTION_SECONDS:
        collect()
        _last_full_collection = now
    else:
        collect(1)


class TrainerFork(ForkServer):
    """A fork server that is a fork of this trainer (see the module)."""

    def __init__(self) -> None:  # noqa: D107 (ForkServer's __init__ starts an interpreter instead)
        parent_end, child_end = (above_standard(end) for end in socket.socketpair(socket.AF_UNIX,
                                                                                   socket.SOCK_SEQPACKET))
        trainer_pid = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # What the child would otherwise print twice.
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        global forking
        forking = True
        # Garbage in reference cycles goes first (_collect_garbage). Then the trainer's objects
        # go into the collector's permanent generation across the fork, so that a collection
        # in the fork or its readers does not write every object's header and copy the
        # trainer's heap into each; the trainer collects them again after the fork. A trainer
        # that froze its objects itself (gc.freeze() before its loaders, as users of forked
        # workers do) keeps them frozen: unfreeze() moves every frozen object back, its own
        # too, and its collection here is cheap (frozen objects are not traversed).
        frozen_by_user = gc.get_freeze_count() > 0
        _collect_garbage()
        if not frozen_by_user:
            gc.freeze()
        pid = None
        try:
            pid = os.fork()
        finally:
            forking = False
            if pid != 0 and not frozen_by_user:
                gc.unfreeze()
        if pid == 0:
            _serve_in_child(parent_end, child_end, trainer_pid)  # Never returns.
        child_end.close()
        self._set_up(parent_end, _ForkedProcess(pid))
        _live.add(self)


# Every trainer fork this process made: a later fork of the trainer (another loader's, a
# user's) closes its copies of their sockets, or each would wait for the other's EOF.
_live: weakref.WeakSet = weakref.WeakSet()


def _forget_in_child() -> None:
    for server in list(_live):
        server.forget_in_child()
    _live.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _serve_in_child(parent_end: socket.socket, child_end: socket.socket, trainer_pid: int) -> None:
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # The trainer's own handlers (a scheduler's SIGTERM checkpointing, a profiler's
        # SIGUSR1) are the trainer's business, not its fork's: a signal ends the fork.
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(number, signal.SIG_DFL)
        parent_end.close()
        os.setsid()  # Its own session, as the fork server's: the terminal's Ctrl-C reaches the trainer alone.
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        from .forkserver_process import serve

        code = serve(["shmloader-trainer-fork", str(child_end.fileno()), str(trainer_pid)])
    except BaseException:  # noqa: BLE001 (anything: it must never return into the trainer's code)
        import traceback

        traceback.print_exc()
    finally:
        flush_and_exit(code)

"""A loader's lifecycle outside its iteration: what it must give back (Resources, with the
teardown order of pool.py's shutdown note), Ctrl-C held back during teardown, and rings
forgotten in a forked child. session.py ties Resources to the cursor's lifetime."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import weakref

from .device import PinnedRing
from .fill.filler import StepFiller
from .readers import trainer_fork
from .readers.pool import ReaderPool
from .ring.segment import Ring


class Resources:
    """Everything the loader must give back, without a reference to the loader, its session
    or its cursor, so that weakref.finalize can clean up a loader that was never closed.
    Teardown follows the shutdown note in pool.py; it is idempotent and never raises."""

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.cursor = None  # A weak reference to the cursor over the ring, once there is one.
        self.ring: Ring | None = None
        self.pool: ReaderPool | None = None
        self.pinned: PinnedRing | None = None
        self.filler: StepFiller | None = None  # readers=0: the trainer's own filler.
        self.node_cache = None  # Fields in a store: this process's view of the node cache, released last.
        self.dataset = None  # from_dataset: the trainer's DatasetHandle (its pickle's memory file).
        self.audit = None  # audit_log: the AuditWriter (audit_log.py), its file closed last.
        self.node_share = None  # Local readers: this loader's entry in the node's reader budget (budget_record.py).
        self.device_iterators: weakref.WeakSet = weakref.WeakSet()
        # (slot, step) of the batches held when this process forked: a child may read their
        # pages, which stay shared, so neither next() nor a seek can give them to the readers (kept.py).
        self.held_at_fork: set[tuple[int, int]] = set()

    def close(self) -> None:
        if os.getpid() != self.owner_pid:
            return  # A forked child inherited this object: the ring is its parent's.
        live_resources.discard(self)
        with interrupts_deferred():
            self._close()

    def _close(self) -> None:
        pool, ring = self.pool, self.ring
        try:
            if ring is not None and not ring.closed:
                ring.set_stopping()
                ring.names.unlink_all()
            if pool is not None:
                pool.stop()
        finally:
            if self.node_share is not None:
                self.node_share.close()  # The readers are gone: their share goes back to the node.
            for iterator in list(self.device_iterators):
                try:
                    iterator.close()  # Copies in flight read the ring: they finish first.
                except Exception:
                    pass  # A failed device must not stop the ring's teardown.
            if self.pinned is not None:
                self.pinned.unregister()  # Before the mapping can go.
            if self.filler is not None:
                self.filler.close()
            if ring is not None:
                ring.close()
            if self.dataset is not None:
                self.dataset.close()
            if self.node_cache is not None:
                from .remote.node import release

                cache, self.node_cache = self.node_cache, None
                try:
                    release(cache)
                except Exception:
                    pass  # Its files close with the process anyway.
            if self.audit is not None:
                self.audit.close()


@contextlib.contextmanager
def interrupts_deferred():
    """Holds back Ctrl-C (SIGINT) while the block runs, then delivers it, so that a second
    Ctrl-C cannot stop a teardown half-way. Only the main thread can do this; elsewhere
    the block runs as it is (its steps are ordered so that an interruption leaks nothing
    in /dev/shm, see pool.py)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt.
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)


# The Resources of every ring this process created and has not closed yet.
live_resources: weakref.WeakSet = weakref.WeakSet()


def _forget_rings_in_child() -> None:
    """A forked child inherits its parent's rings and cursors, which it must not touch."""
    for resources in list(live_resources):
        cursor = None if resources.cursor is None else resources.cursor()
        if cursor is not None:
            cursor.forget_in_child()
        ring = resources.ring
        if ring is not None and not ring.closed:
            ring.forget_descriptors_in_child()


def _note_held_at_fork() -> None:
    """The parent's side of a fork: the batches its loaders hold now are shared with the child
    (not in the loader's own fork of the trainer for its readers, trainer_fork.forking: that
    child never reads the batches mapped in it)."""
    if trainer_fork.forking:
        return
    for resources in list(live_resources):
        cursor = None if resources.cursor is None else resources.cursor()
        if cursor is not None and cursor.active:
            resources.held_at_fork.update(cursor.held().items())


os.register_at_fork(after_in_parent=_note_held_at_fork, after_in_child=_forget_rings_in_child)

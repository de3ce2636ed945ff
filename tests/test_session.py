"""The loader's session (shmloader/session.py): the cursor is the iterator, the ring lives as
long as the loader or a loop over it, and nothing waits for the garbage collector."""

from __future__ import annotations

import contextlib
import gc
import os

import numpy as np
import pytest
from conftest import our_shm_entries, process_alive, wait_until

from shmloader import Sampler, ShmDataLoader
from shmloader.ring.batch import cursor_module


@contextlib.contextmanager
def collector_off():
    """Teardown must follow reference counts alone: a cycle would only go with gc.collect()."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_a_loop_over_a_temporary_loader_keeps_its_ring_until_the_loop_ends(dataset):
    labels = dataset["labels"]
    sampler = Sampler(len(labels), 10, seed=3)
    with collector_off():
        seen = 0
        for step, batch in zip(range(40), ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10,
                                                        readers=2, slots=3, seed=3)):
            assert np.array_equal(batch["label"], labels[sampler.fill(step)])
            assert our_shm_entries(os.getpid())  # The loader object is gone; its cursor keeps the ring.
            seen += 1
        assert seen == 40
        del batch
        # zip holds the cursor until it is dropped; then the session's finalizer runs.
        assert not our_shm_entries(os.getpid())


def test_an_unclosed_loader_is_torn_down_when_its_last_reference_goes(dataset):
    with collector_off():
        loader = ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=2, slots=3)
        batch = next(loader)
        pids = loader.diagnostics.reader_pids
        iterator = iter(loader)
        del loader
        assert our_shm_entries(os.getpid())  # An iterator still refers to the cursor.
        assert next(iterator).step == 1
        del iterator
        assert not our_shm_entries(os.getpid())
        assert wait_until(lambda: not any(process_alive(pid) for pid in pids))
        assert batch["label"].shape == (10,)  # The mapping outlives the ring's names.


def test_the_iterator_is_the_native_cursor_and_a_closed_loader_stops_it(dataset):
    loader = ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=1, slots=3)
    iterator = iter(loader)
    assert type(iterator) is cursor_module.Cursor and iter(iterator) is iterator
    assert next(iterator).step == 0 and next(loader).step == 1  # One stream, whichever is called.
    # next(loader) is C forwarding to the cursor (no interpreter frame per step), not a Python method.
    assert type(loader).__next__ is cursor_module.LoaderBase.__next__ and loader._cursor is iterator
    assert loader.state_dict()["step"] == 2
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(iterator)


@pytest.mark.parametrize("change, error", [
    ({"slot_count": -1}, OverflowError),
    ({"slot_count": 0}, ValueError),
    ({"poll_interval_ns": 0}, ValueError),
    ({"check_every_ns": 0}, ValueError),
    ({"supervise": None}, TypeError),
    ({"batch_type": dict}, TypeError),
    ({"unknown": 1}, TypeError),
])
def test_the_cursor_takes_one_fixed_signature_and_refuses_what_is_outside_it(dataset, change, error):
    """Every setting is an argument of the constructor, checked there (not attributes read by name)."""
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=1, slots=3) as loader:
        session = loader._session
        settings = dict(
            control_table_address=session.ring.control_table_address, slot_count=3,
            work_semaphore=session.ring.names.work, ready_semaphores=tuple(session.ring.names.ready),
            field_names=("label",), batch_type=type(next(loader)), views=tuple(session.views(s) for s in range(3)),
            next_step=0, check_every_batches=64, check_every_ns=10**9, wake_after_slots=1, reader_count=1,
            trainer_slots=2,
            poll_interval_ns=1000, wait_ahead_span_ns=0, end_step=2**64 - 1, partial_from=2**64 - 1,
            supervise=print, views_of=print, partial=print)
        cursor_module.Cursor(**settings).deactivate()  # The settings as they are make a cursor.
        missing = dict(settings)
        del missing["partial"]
        with pytest.raises(TypeError):
            cursor_module.Cursor(**missing)
        with pytest.raises(error):
            cursor_module.Cursor(**{**settings, **change})


def test_a_seek_waits_natively_for_the_slot_a_reader_fills(dataset):
    """The trainer's one wait (ring/_cursor.c's cursor_wait) serves a seek too: armed, woken by the
    reader's publish, disarmed after."""
    import threading
    import time

    from shmloader.ring.layout import SlotState

    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=0, slots=3) as loader:
        ring, cursor = loader._session.ring, loader._session.cursor
        slot = ring.claim(0)  # As a reader would: step 0's slot, FILLING by record 0.
        began = time.monotonic()
        assert not cursor.wait_filled(slot, 0.1)
        assert time.monotonic() - began >= 0.1
        publisher = threading.Timer(0.2, ring.publish, (slot, SlotState.READY, 0))
        publisher.start()
        assert cursor.wait_filled(slot, 30.0)
        assert time.monotonic() - began < 10.0  # Woken by the post, not by the time-out.
        publisher.join()
        assert ring._lines[slot].waiter == 0
        assert cursor.wait_filled(slot, 30.0)  # Not in flight: at once.
        with pytest.raises(IndexError):
            cursor.wait_filled(3, 0.1)
        with pytest.raises(ValueError):
            cursor.wait_filled(slot, -1.0)


def _run_child(code: str, *args: str) -> str:
    """Runs `code` in its own interpreter (a segfault fails the test instead of the worker)."""
    import subprocess
    import sys

    # From the tests' folder: from the repository's root, `-c` would import the source tree
    # (unbuilt where the package is installed) instead of the installed package.
    child = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stdout}\n{child.stderr}"
    return child.stdout


_CLOSE_INSIDE_NEXT = '''
import gc, os, signal, sys, threading, time
import numpy as np
import shmloader
import shmloader.session as session
from shmloader import ShmDataLoader
how = sys.argv[2]
package = os.path.dirname(os.path.abspath(shmloader.__file__))

def inside_next(frame):
    """Whether `frame` runs inside next(): the loader's own Python code (its supervisor, which
    next() calls while it waits) is on the stack; nothing else of the package runs here."""
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
            return True
        frame = frame.f_back
    return False

if how == "views_of":  # Another thread closes while next() rebuilds a damaged slot in Python.
    original = session._views_function
    def slow(slot, ring, layout):
        views_of = original(slot, ring, layout)
        def rebuild(index):
            time.sleep(0.3)
            return views_of(index)
        return rebuild
    session._views_function = slow
loader = ShmDataLoader({"label": sys.argv[1]}, batch_size=10, readers=1, slots=3, hold_timeout=60,
                       epochs=1 if how == "cut" else None)
batch = next(loader)
if how == "views_of":
    batch["label"].shape = (2, 5)  # Changed in place: slot 0 is rebuilt before it is handed out again.
    del batch
    for _ in range(2):
        next(loader)
    threading.Thread(target=lambda: (time.sleep(0.1), loader.close())).start()
elif how == "cut":  # A collection in the allocation of the cut last batch of a finite pass (Cursor.batch_of).
    del batch
    time.sleep(0.3)
    loader.seek(len(loader) - 1)
    class Closer:
        def __del__(self):
            loader.close()
    closer = Closer()
    closer.cycle = closer
    del closer
    gc.set_threshold(1)
elif how == "signal":
    # A signal handler closes the loader while next() waits natively (without the GIL) for a
    # step its stopped reader never fills: the wait's EINTR runs it (or the eval breaker of
    # the supervisor's Python, between waits). The timer is armed by next()'s first look at
    # the readers, so it can only fire inside next().
    del batch
    os.kill(loader.diagnostics.reader_pids[0], signal.SIGSTOP)
    supervisor = loader._session.supervisor
    looked = supervisor.in_flight
    def arm(cursor, step):
        supervisor.in_flight = looked
        signal.setitimer(signal.ITIMER_REAL, 0.02)
        looked(cursor, step)
    def on_alarm(number, frame):
        loader.close()
        print("closed inside next()")
    signal.signal(signal.SIGALRM, on_alarm)
    supervisor.in_flight = arm
    for _ in range(4):  # The steps the reader filled before it stopped (at most 3), then the wait.
        try:
            next(loader)
        except RuntimeError as error:
            print("raised", error)
            sys.exit(0)
else:
    # Every slot held: next() waits in its supervisor for a batch to go (a Python-level wait on
    # every Python version); a collection there (in an allocation before 3.12, at the eval
    # breaker since) runs a finalizer that closes the loader.
    held = [batch, next(loader), next(loader)]
    del batch
    armed = [True]
    class Closer:
        def __del__(self):
            if not armed[0]:
                return
            if inside_next(sys._getframe(1)):
                armed[0] = False
                loader.close()
                print("closed inside next()")
            else:
                garbage()  # Collected before next() began: garbage again for a later collection.
    def garbage():
        closer = Closer()
        closer.cycle = closer
    garbage()
    gc.set_threshold(1)
try:
    got = next(loader)
    print("delivered", got.step)
except RuntimeError as error:
    print("raised", error)
'''


@pytest.mark.parametrize("how", ["views_of", "signal", "collection", "cut"])
def test_a_close_from_code_that_runs_inside_next_raises_and_never_frees_what_next_uses(tmp_path, monkeypatch, how):
    """Before: next() called Python (views_of, a Batch allocation that collects garbage) and
    then used the slot table that a close() meanwhile had freed: a segfault. On every Python
    version code runs inside next(): a signal handler, and since 3.12 the collector (and so
    finalizers and gc callbacks) at the eval breaker of the Python code next() calls; the
    child checks that its close ran there."""
    np.save(tmp_path / "x.npy", np.arange(95, dtype=np.int64))
    # Python's debug allocator fills freed memory: a slot table freed under next() crashes it.
    monkeypatch.setenv("PYTHONMALLOC", "debug")
    out = _run_child(_CLOSE_INSIDE_NEXT, str(tmp_path / "x.npy"), how)
    assert "raised the loader is closed" in out or (how == "cut" and "delivered" in out), out
    if how in ("signal", "collection"):
        assert "closed inside next()" in out, out


def test_only_numpy_arrays_pass_for_a_slots_arrays(dataset):
    """Before: a type merely named numpy.ndarray passed, and its memory was read as an array's (a segfault)."""
    out = _run_child('''
import sys
from shmloader import ShmDataLoader
from shmloader.ring.batch import Batch, cursor_module
loader = ShmDataLoader({"label": sys.argv[1]}, batch_size=10, readers=0, slots=3)
ring = loader._session.ring
spoof = type("numpy.ndarray", (int,), {})(1 + (0x1000 << 30) + (1 << 60) + (1 << 90))
try:
    cursor_module.Cursor(control_table_address=ring.control_table_address, slot_count=3,
        work_semaphore=ring.names.work, ready_semaphores=tuple(ring.names.ready), field_names=("label",),
        batch_type=Batch, views=((spoof, spoof),) * 3, next_step=0, check_every_batches=64, check_every_ns=10**9,
        wake_after_slots=1,
        reader_count=0, trainer_slots=2, poll_interval_ns=10**8, wait_ahead_span_ns=0, end_step=2**64 - 1, partial_from=2**64 - 1,
        supervise=print, views_of=print, partial=print)
except TypeError as error:
    print("refused:", error)
''', dataset["paths"]["labels_npy"])
    assert "refused: slot 0: expected numpy arrays" in out


def test_steps_given_to_the_cursor_do_not_wrap(dataset):
    """Before: request(0, 2**64 + 3) requested step 3, and batch_of(views, -1) made step 2**64 - 1."""
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=0, slots=3) as loader:
        cursor, views = loader._session.cursor, loader._session.views(0)
        with pytest.raises(OverflowError):
            cursor.request(0, 2**64 + 3)
        with pytest.raises(OverflowError):
            cursor.request(2, -2)
        with pytest.raises(OverflowError):
            cursor.batch_of(views, -1)
        with pytest.raises(ValueError, match=r"got -1\.0"):
            cursor.wait_filled(0, -1.0)


def test_a_seek_that_a_close_interrupts_says_the_loader_is_closed(tmp_path):
    """Before: a seek waiting for a reader's step, closed from another thread, raised IndexError
    (and a failed fill under readers=0 hid the close behind an IndexError too)."""
    import threading

    np.save(tmp_path / "x.npy", np.arange(200, dtype=np.int64))
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=10, readers=1, slots=3, mode="sequential",
                       transform="transform_fixtures:slow_on_row_nine") as loader:  # Step 0 takes 2.5 s.
        assert wait_until(lambda: loader.diagnostics.slot_states()[0][0] == "FILLING", 10)  # The seek waits for that step.
        closer = threading.Timer(0.3, loader.close)
        closer.start()
        with pytest.raises(RuntimeError, match="closed"):
            loader.seek(5)
        closer.join()
        with pytest.raises(RuntimeError, match="closed"):
            loader.diagnostics.slot_states()
    assert not our_shm_entries(os.getpid())


def _inside_loader_code(frame) -> bool:
    """Whether `frame` runs inside the loader's own Python code (its supervisor, which the
    native next() calls while it waits): the only code of the package on the stack there."""
    import shmloader

    package = os.path.dirname(os.path.abspath(shmloader.__file__)) + os.sep
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(package):
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("how", ["signal", "gc_callback"])
def test_a_seek_from_code_that_runs_inside_next_is_refused_and_batches_stay_right(dataset, how):
    """Before: a gc callback (or finalizer, or signal handler) that seeks while next() runs
    moved the step under it: a wrong batch, then 'another process wrote to the ring' forever.
    Every slot is held (next() gives the oldest batch memory of its own) and the readers are
    stopped, so next() waits in its supervisor for step 3 (on every Python version); a signal
    handler, or a gc callback (run there by the collector: in an allocation before 3.12, at
    the eval breaker since), seeks there, is refused, and lets the readers go on."""
    import signal
    import sys

    labels = dataset["labels"]
    sampler = Sampler(len(labels), 10, seed=1)
    refused = []
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=2, slots=3, seed=1,
                       hold_timeout=60) as loader:
        held = [next(loader) for _ in range(3)]
        got = [(batch.step, batch["label"].tolist()) for batch in held]

        pids = list(loader._session.pool.pids)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

        def seek_inside(frame):
            if not refused and _inside_loader_code(frame):
                try:
                    loader.seek(0)
                except RuntimeError as error:
                    refused.append(str(error))
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)

        threshold, handler = gc.get_threshold(), signal.getsignal(signal.SIGALRM)
        callback = lambda phase, info: seek_inside(sys._getframe(1)) if phase == "start" else None  # noqa: E731
        if how == "signal":
            signal.signal(signal.SIGALRM, lambda number, frame: seek_inside(frame))
            # The signal comes while the supervisor runs its check of the wait, as any signal
            # may: an interval timer's found it there only by chance, after 80 s at times.
            supervisor = loader._session.supervisor
            check = supervisor._check

            def check_then_signal(*arguments, **keywords):
                if not refused:
                    os.kill(os.getpid(), signal.SIGALRM)
                return check(*arguments, **keywords)

            supervisor._check = check_then_signal
        else:
            gc.callbacks.append(callback)
            gc.set_threshold(1)
        try:
            batch = next(loader)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            signal.signal(signal.SIGALRM, handler)
            gc.set_threshold(*threshold)
            if callback in gc.callbacks:
                gc.callbacks.remove(callback)
        assert refused and "already running" in refused[0], refused
        got += [(batch.step, batch["label"].tolist())]
        del batch, held[:]
        got += [(b.step, b["label"].tolist()) for b in (next(loader) for _ in range(4))]
    assert got == [(step, labels[sampler.fill(step)].tolist()) for step in range(8)]


def test_a_close_during_an_in_process_fill_waits_for_the_gather(tmp_path):
    """Before: with readers=0, close() from another thread released the fields' mappings
    while the trainer's thread was inside the native gather: a segfault."""
    for part in range(4):
        rows = np.empty((600, 2048), dtype=np.int64)
        rows[:] = (np.arange(600) + 600 * part)[:, None]
        np.save(tmp_path / f"m{part}.npy", rows)
    out = _run_child('''
import random, sys, threading, time
from shmloader import ShmDataLoader
files, outcomes = sys.argv[1:], []
random.seed(1)
for _ in range(6):
    loader = ShmDataLoader({"x": files}, batch_size=512, readers=0, slots=3, seed=1)
    def iterate():
        try:
            while True:
                batch = next(loader)
                assert (batch["x"][:, 0] == batch["x"][:, -1]).all()
        except RuntimeError as error:
            outcomes.append(str(error))
    worker = threading.Thread(target=iterate)
    worker.start()
    time.sleep(random.random() * 0.05)
    loader.close()
    worker.join(30)
print(outcomes)
''', *(str(tmp_path / f"m{part}.npy") for part in range(4)))
    assert out.count("the loader is closed") == 6, out


def test_a_fork_inside_next_leaves_the_child_an_error_not_a_crash(dataset):
    """Before: a fork from code next() runs (here a gc callback while a damaged slot is
    rebuilt) left the child inside next() with its slot table freed: a segfault."""
    out = _run_child('''
import gc, os, sys, time
from shmloader import ShmDataLoader
loader = ShmDataLoader({"label": sys.argv[1]}, batch_size=10, readers=2, slots=3, seed=1)
batch = next(loader)
batch["label"].shape = (2, 5)  # Slot 0 is rebuilt before step 3.
del batch
next(loader), next(loader)
slot, child = loader._session.slot, []
views = slot.views
def forking_views(*args):
    gc.set_threshold(1)
    try:
        [[] for _ in range(10)]
        return views(*args)
    finally:
        gc.set_threshold(700)
object.__setattr__(slot, "views", forking_views)
gc.callbacks.append(lambda phase, info: child.append(os.fork()) if phase == "start" and not child else None)
try:
    got = ("batch", next(loader).step)
except RuntimeError as error:
    got = ("error", str(error))
if child and child[0] == 0:
    print("child", got, flush=True)
    os._exit(0)
gc.callbacks.clear()
_, status = os.waitpid(child[0], 0)
print("parent", got, "child status", status)
loader.close()
''', dataset["paths"]["labels_npy"])
    assert "child ('error', 'this loader belongs to process" in out and "child status 0" in out, out

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
        pids = loader.reader_pids
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
    assert loader.state_dict()["step"] == 2
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(iterator)


@pytest.mark.parametrize("change, error", [
    ({"slot_count": -1}, OverflowError),
    ({"slot_count": 0}, ValueError),
    ({"poll_interval_ns": 0}, ValueError),
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
            next_step=0, check_every_batches=64, wake_after_slots=1, reader_count=1, trainer_slots=2,
            poll_interval_ns=1000, end_step=2**64 - 1, partial_from=2**64 - 1, supervise=print, views_of=print,
            partial=print)
        cursor_module.Cursor(**settings).deactivate()  # The settings as they are make a cursor.
        missing = dict(settings)
        del missing["partial"]
        with pytest.raises(TypeError):
            cursor_module.Cursor(**missing)
        with pytest.raises(error):
            cursor_module.Cursor(**{**settings, **change})


def test_a_seek_waits_natively_for_the_slot_a_reader_fills(dataset):
    """The trainer's one wait (_cursor.c's wait_slot) serves a seek too: armed, woken by the
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

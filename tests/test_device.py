"""The GPU hop without a GPU: a fake device backend whose copies complete when the test
says proves the slot-lifetime rules (a slot is never refilled under a copy that reads it,
close and errors free everything, registration pairs with unregistration); without CUDA,
pin_memory=True is a clear error; the CUDA checks run only where CUDA is."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from conftest import our_shm_entries, wait_until

from shmloader import DeviceError, Sampler, ShmDataLoader


class FakeEvent:
    def __init__(self, backend) -> None:
        self.complete = False
        backend.events.append(self)


class FakeBackend:
    """Copies complete only when complete_all() (or synchronize) says so; records calls."""

    def __init__(self) -> None:
        self.calls, self.events = [], []

    def register(self, address, nbytes):
        self.calls.append(("register", address, nbytes))

    def unregister(self, address):
        self.calls.append(("unregister", address))

    def copy(self, batch):
        tensors = {name: np.array(array) for name, array in batch.items()}  # The "device" copy.
        tensors["step"] = batch.step
        return tensors, FakeEvent(self)

    def hand_over(self, tensors, event):
        self.calls.append(("hand_over", tensors["step"]))

    def done(self, event):
        return event.complete

    def synchronize(self, event):
        self.calls.append(("synchronize",))
        event.complete = True

    def complete_all(self):
        for event in self.events:
            event.complete = True


def test_pin_memory_without_cuda_is_a_clear_error_and_starts_nothing(dataset, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    from shmloader.readers import pool as readers

    started = []
    monkeypatch.setattr(readers, "spawn_reader", lambda: started.append(1))
    with pytest.raises(DeviceError, match="torch.cuda.is_available\\(\\) is False"):
        ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, pin_memory=True)
    assert not started and not our_shm_entries(os.getpid())
    monkeypatch.undo()
    with pytest.raises(DeviceError, match="needs CUDA"):
        with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1) as loader:
            loader.to_device("cuda")


def test_the_ring_is_registered_once_and_unregistered_before_it_goes(dataset):
    backend = FakeBackend()
    loader = ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=4,
                           pin_memory=backend)
    assert backend.calls == [("register", loader._session.ring.base_address, loader.diagnostics.shared_memory_bytes)]
    address = loader._session.ring.base_address
    next(loader)
    loader.close()
    loader.close()
    assert backend.calls[-1] == ("unregister", address) and len(backend.calls) == 2
    collected = FakeBackend()
    unclosed = ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, pin_memory=collected)
    del unclosed
    gc.collect()
    assert [call[0] for call in collected.calls] == ["register", "unregister"]


def test_a_slot_stays_held_until_the_copy_that_reads_it_completes(dataset):
    labels = dataset["labels"]
    sampler = Sampler(600, 8, seed=3)
    backend = FakeBackend()
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=6, seed=3) as loader:
        device = loader.to_device(prefetch=1, backend=backend)
        first = next(device)
        assert first["step"] == 0 and np.array_equal(first["label"], labels[sampler.fill(0)])
        # Step 0 was handed out, step 1's copy issued: neither completed, both slots held.
        assert sorted(loader.diagnostics.held_steps().values()) == [0, 1]
        for step in (0, 1):
            assert loader.diagnostics.slot_states()[step % 6][0] == "HELD"
        next(device)  # Copies still pending: nothing may be given back.
        assert sorted(loader.diagnostics.held_steps().values()) == [0, 1, 2]
        backend.complete_all()
        third = next(device)
        assert third["step"] == 2 and np.array_equal(third["label"], labels[sampler.fill(2)])
        loader._session.cursor.release_unused()
        assert sorted(loader.diagnostics.held_steps().values()) == [2, 3]  # Completed copies gave 0 and 1 back.


def test_slow_copies_are_waited_for_before_the_ring_runs_out(dataset):
    backend = FakeBackend()
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=5) as loader:
        device = loader.to_device(prefetch=2, backend=backend)
        steps = [next(device)["step"] for _ in range(40)]  # No copy ever completes on its own.
        assert steps == list(range(40))
        assert device.held <= loader.slots - 2
        assert ("synchronize",) in backend.calls


def test_close_and_errors_with_copies_in_flight_free_every_slot(dataset):
    backend = FakeBackend()
    loader = ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=6,
                           pin_memory=backend)
    with pytest.raises(ZeroDivisionError):
        with loader.to_device(prefetch=2, backend=backend) as device:
            next(device)
            raise ZeroDivisionError("the training step failed")
    assert device.held == 0 and all(event.complete for event in backend.events)
    loader._session.cursor.release_unused()
    assert loader.diagnostics.held_steps() == {}
    second = loader.to_device(prefetch=1, backend=backend)
    next(second)
    loader.close()  # Closes the iterator first: its copies finish before the ring is unregistered.
    names = [call[0] for call in backend.calls]
    assert names[-1] == "unregister" and names[-2] == "synchronize" and second.held == 0
    assert wait_until(lambda: not our_shm_entries(os.getpid()))


def test_prefetch_must_leave_slots_for_the_readers(dataset):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=4) as loader:
        with pytest.raises(ValueError, match=r"prefetch must be an integer in \[0, slots - 3\] = \[0, 1\]"):
            loader.to_device(prefetch=2, backend=FakeBackend())


def test_pinned_batches_reach_the_gpu_unchanged(dataset):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here")
    sampler = Sampler(600, 8, seed=1)
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, seed=1,
                       pin_memory=True) as loader:
        batch = next(loader)
        assert torch.from_numpy(batch["label"]).is_pinned()
        del batch
        for step, tensors in zip(range(1, 30), loader.to_device("cuda", prefetch=2)):
            assert tensors["label"].is_cuda
            assert np.array_equal(tensors["label"].cpu().numpy(), dataset["labels"][sampler.fill(step)])


def test_to_device_cpu_gives_tensors_over_the_slots_without_a_copy(dataset):
    """It raised (no CUDA) instead of passing the batches through."""
    torch = pytest.importorskip("torch")
    labels = dataset["labels"]
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, mode="sequential") as loader:
        for step, tensors in zip(range(3), loader.to_device("cpu")):
            assert isinstance(tensors["label"], torch.Tensor)
            np.testing.assert_array_equal(tensors["label"].numpy(), labels[step * 8:(step + 1) * 8])
            del tensors


def test_a_finite_pass_hands_out_every_prefetched_batch_before_it_stops(dataset):
    """The loader's StopIteration comes while copies are still issued: they are handed out
    first, the last one partial, and then the iterator stops."""
    backend = FakeBackend()
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=64, slots=6, readers=1,
                       mode="sequential", epochs=1) as loader:
        iterator = loader.to_device("cuda", prefetch=2, backend=backend)
        labels = [tensors["label"] for tensors in iterator]
        with pytest.raises(StopIteration):  # And stays stopped.
            next(iterator)
        iterator.close()
    assert [len(batch) for batch in labels] == [64] * 9 + [24]  # 600 rows
    np.testing.assert_array_equal(np.concatenate(labels), dataset["labels"])


def test_to_device_on_a_finished_pass_raises_instead_of_yielding_nothing(dataset):
    """Before: a second epoch through to_device() (which calls next() itself) trained on
    nothing, while a plain loop raised."""
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=100, readers=1, slots=6,
                       epochs=1) as loader:
        assert sum(1 for _ in loader.to_device("cuda", backend=FakeBackend())) == len(loader)
        with pytest.raises(RuntimeError, match="has ended"):
            loader.to_device("cuda", backend=FakeBackend())
        with pytest.raises(RuntimeError, match="has ended"):
            loader.to_device("cpu")

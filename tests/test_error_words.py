"""Errors and warnings in the words of the API the user called: the drop-in's exhaustion
error (left for a batch held across a fork) names prefetch_factor and the batches kept (it
has no batch.release() and no slots=); a memory-mapped array is named as the reason a
dataset pickles large; a restarted reader's warning names its signal and its restart count."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from conftest import process_alive, wait_until
from shmloader import ReaderRestartWarning, ShmDataLoader, SlotsExhaustedError
from shmloader.plan import dataset as dataset_module
from shmloader.plan.dataset import DatasetError


class Rows:
    def __init__(self, length: int = 40) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return {"x": np.full(3, index, dtype=np.int64)}


# The reader forks from the trainer as a script's does (test_kept_batches.py says why).
@pytest.mark.timeout(120, method="signal")
@pytest.mark.usefixtures("harness_threads_not_counted")
def test_the_drop_in_names_prefetch_factor_and_the_batches_kept():
    """Kept batches get memory of their own (kept.py), except one held when the process
    forked, whose pages a child shares: the refusal that remains is in the drop-in's words."""
    pytest.importorskip("torch")
    from shmloader.torch import DataLoader

    with DataLoader(Rows(), batch_size=2, num_workers=1, prefetch_factor=1) as loader:
        loader._loader._session.supervisor.hold_timeout = 0.5  # Only how long this test waits.
        slots = loader._loader._session.slots
        iterator = iter(loader)
        kept = [next(iterator) for _ in range(slots)]
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        with pytest.raises(SlotsExhaustedError) as raised:
            next(iterator)
        message = str(raised.value)
        assert [batch["x"][:, 0].tolist() for batch in kept] == [[2 * step, 2 * step + 1] for step in range(slots)]
        del kept, iterator
    assert "prefetch_factor=1" in message and "num_workers=1" in message, message
    assert f"batches {', '.join(str(step) for step in range(slots))} of this epoch are still referenced" in message
    assert "this process forked while it was held" in message, message
    assert "release()" not in message and "raise slots" not in message, message


class Mapped:
    def __init__(self, path: str) -> None:
        self.rows = np.load(path, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        return {"x": np.asarray(self.rows[index])}


def test_a_memory_mapped_array_is_named_as_why_a_dataset_pickles_large(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset_module, "PICKLE_BYTES_MAX", 1 << 20)  # 1 GiB in use: a small file stands in.
    path = tmp_path / "rows.npy"
    np.save(path, np.zeros((512, 1024), np.float32))  # 2 MiB
    with pytest.raises(DatasetError) as raised:
        ShmDataLoader.from_dataset(Mapped(str(path)), batch_size=4, readers=1)
    message = str(raised.value)
    assert "attribute 'rows' is a memory-mapped array" in message and str(path) in message, message
    assert "np.load(mmap_mode='r')" in message and "in __getitem__ on first use" in message, message


def test_a_restarted_reader_warns_with_its_signal_and_count(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(4000, dtype=np.int64))
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=4, readers=2, slots=4,
                       max_reader_restarts=3) as loader:
        next(loader)
        victim = loader.diagnostics.reader_pids[0]
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: not process_alive(victim), 30)
        with pytest.warns(ReaderRestartWarning) as caught:
            assert wait_until(lambda: next(loader) is not None and loader.stats()["reader_restarts"] == 1, 60)
    message = str(caught[0].message)
    assert f"reader 0 (pid {victim}) was killed by SIGKILL" in message, message
    assert "restart 1 of max_reader_restarts=3" in message, message

"""Batches a loop keeps stay right (shmloader/kept.py): an evaluation loop that keeps every
batch's arrays or tensors over several epochs, list(loader), and a batch peeked with
next(iter(loader)) and kept across epochs give the values of an independent reference, in
ShmDataLoader and in the drop-in alike, as does any pattern of keeping, slicing and
dropping batches that Hypothesis draws; the memory so kept is bounded, with an error that
names what holds it; the kept memory and descriptors go with the batches. Before, each of
these loops stopped after `slots` batches with SlotsExhaustedError."""

from __future__ import annotations

import collections.abc
import gc
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from conftest import examples, our_shm_entries  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from shmloader import Sampler, ShmDataLoader, SlotsExhaustedError  # noqa: E402
from shmloader.plan import defaults  # noqa: E402
from shmloader.storage.readahead import memory_limit_bytes  # noqa: E402

ROWS = 203  # Not a multiple of the batch size: each pass ends with a partial batch.
BATCH = 8


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("kept") / "x.npy"
    np.save(path, np.random.default_rng(3).integers(0, 1 << 40, size=(ROWS, 5), dtype=np.int64))
    return str(path)


def _copied(path: str, **options) -> list[tuple[np.ndarray, np.ndarray]]:
    """(indices, x) of each batch of a run that copies each batch and keeps no view."""
    with ShmDataLoader({"x": path}, batch_size=BATCH, warn_layout=False, **options) as loader:
        return [(batch.indices.copy(), batch["x"].copy()) for batch in loader]


def _mappings() -> int:
    with open("/proc/self/maps") as maps:
        return len(maps.readlines())


def _open_descriptors() -> dict[str, str]:
    found = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            found[entry] = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            pass  # listdir's own descriptor, closed since.
    return found


@pytest.mark.parametrize("readers", [0, 2])
def test_an_evaluation_loop_keeping_every_batchs_arrays_over_epochs_gets_right_values(rows, readers):
    reference = np.load(rows)
    options = dict(readers=readers, slots=3 if readers == 0 else 4, epochs=3, seed=7)
    expected = _copied(rows, **options)
    assert len(expected) > 3 * options["slots"]
    for indices, x in expected:  # The copying run itself against the file.
        np.testing.assert_array_equal(x, reference[indices.astype(np.int64)])
    with ShmDataLoader({"x": rows}, batch_size=BATCH, warn_layout=False, **options) as loader:
        kept_x, kept_indices = [], []
        for batch in loader:
            kept_x.append(batch["x"])  # Views of the slot, kept past the ring's turn.
            kept_indices.append(batch.indices)
            del batch
        assert len(kept_x) == len(expected)
        for step, (indices, x) in enumerate(expected):
            np.testing.assert_array_equal(kept_indices[step], indices, err_msg=f"step {step}")
            np.testing.assert_array_equal(kept_x[step], x, err_msg=f"step {step}")
        assert loader._session.kept.count >= len(expected) - options["slots"]
    del kept_x, kept_indices
    assert not our_shm_entries(os.getpid())


def test_list_of_a_finite_pass_longer_than_the_ring_gets_right_values(rows):
    options = dict(readers=2, slots=4, epochs=1, mode="sequential")
    expected = _copied(rows, **options)
    with ShmDataLoader({"x": rows}, batch_size=BATCH, warn_layout=False, **options) as loader:
        batches = list(loader)
    assert [batch.step for batch in batches] == list(range(len(expected))) and len(expected) > 2 * 4
    for batch, (indices, x) in zip(batches, expected):
        np.testing.assert_array_equal(batch["x"], x)
        np.testing.assert_array_equal(batch.indices, indices)
    del batches, batch
    assert not our_shm_entries(os.getpid())


def test_descriptors_do_not_grow_with_kept_batches_and_their_memory_goes_with_them(rows):
    with ShmDataLoader({"x": rows}, batch_size=BATCH, readers=1, slots=4, warn_layout=False) as loader:
        # The ring set up, the reader started and checked (its pidfd opened), 96 batches kept.
        kept = [next(loader) for _ in range(100)]
        descriptors = _open_descriptors()
        kept += [next(loader) for _ in range(200)]
        # None opened (one may close: an earlier test's loader collected meanwhile, under xdist).
        assert _open_descriptors().items() <= descriptors.items()
        stats = loader.stats()
        assert stats["kept_batches"] >= 296
        assert stats["kept_bytes"] == stats["kept_batches"] * loader._session.kept.slot_bytes
        reference = np.load(rows)
        for batch in kept:
            np.testing.assert_array_equal(batch["x"], reference[batch.indices.astype(np.int64)])
        mappings = _mappings()
        del kept, batch
        gc.collect()
        # Each kept batch's memory was a mapping of its own, gone with it; only the first kept of
        # each slot lies in the ring's own mapping, which goes with the ring.
        assert _mappings() <= mappings - 290
        assert loader.stats()["kept_batches"] <= loader._session.slots
        assert next(loader).step == 300


def test_the_bound_on_kept_memory_is_a_share_of_memory_and_its_error_names_what_holds_it(rows):
    with ShmDataLoader({"x": rows}, batch_size=BATCH, readers=1, slots=3, warn_layout=False) as loader:
        kept = loader._session.kept
        assert kept.bytes_max == int(memory_limit_bytes() * defaults.KEPT_MEMORY_SHARE)
        kept.bytes_max = 5 * kept.slot_bytes
        held = []
        with pytest.raises(SlotsExhaustedError) as raised:
            for _ in range(20):
                held.append(next(loader))
        message = str(raised.value)
        assert len(held) == 5 + 3  # Five given memory of their own, and the ring's three.
        assert "5 batches" in message and f"{5 * kept.slot_bytes / 2**20:.1f} MiB" in message, message
        assert f"bound of {5 * kept.slot_bytes / 2**20:.1f} MiB" in message, message
        assert "KEPT_MEMORY_SHARE" in message and "steps 0, 1, 2, 3, 4" in message, message
        assert "copy the part you keep" in message, message
        reference = np.load(rows)
        for batch in held:  # What was kept before the bound is still right.
            np.testing.assert_array_equal(batch["x"], reference[batch.indices.astype(np.int64)])
        del held, batch
        gc.collect()
        batch = next(loader)  # The memory went with the batches: the loader goes on.
        assert batch.step == 8
        np.testing.assert_array_equal(batch["x"], reference[batch.indices.astype(np.int64)])
        del batch
    assert not our_shm_entries(os.getpid())


class Items:
    """A dataset whose item is a function of its index alone: the reference for kept tensors."""

    def __len__(self) -> int:
        return 45

    def __getitem__(self, index: int):
        return {"x": np.array([index, index * 7 % 13, index * index], dtype=np.int64), "y": index}


@pytest.mark.parametrize("num_workers", [0, 2])
# The readers fork from the trainer as a script's do: the harness's threads (pytest-timeout's
# timer, threads other tests of this worker left) would send them to the spawn path, a fresh
# interpreter importing torch per reader per epoch.
@pytest.mark.timeout(120, method="signal")
@pytest.mark.usefixtures("harness_threads_not_counted")
def test_the_drop_in_keeps_every_batchs_tensors_and_a_peeked_batch_across_epochs(num_workers):
    torch = pytest.importorskip("torch")
    from shmloader.torch import DataLoader

    dataset = Items()
    expected = [dataset[index] for index in range(len(dataset))]
    with DataLoader(dataset, batch_size=4, num_workers=num_workers, prefetch_factor=1 if num_workers else None) as loader:
        peeked = next(iter(loader))  # Kept across every epoch below.
        epochs = []
        for _ in range(3):
            kept_x, kept_y = [], []
            for batch in loader:
                kept_x.append(batch["x"])
                kept_y.append(batch["y"])
            epochs.append((kept_x, kept_y))
            assert len(kept_x) > loader._loader._session.slots
        listed = list(loader)
        del batch
    for kept_x, kept_y in epochs + [([b["x"] for b in listed], [b["y"] for b in listed])]:
        assert torch.equal(torch.cat(kept_y), torch.arange(len(dataset)))
        assert torch.equal(torch.cat(kept_x), torch.from_numpy(np.stack([item["x"] for item in expected])))
    assert torch.equal(peeked["y"], torch.arange(4))
    assert torch.equal(peeked["x"], torch.from_numpy(np.stack([item["x"] for item in expected[:4]])))
    del epochs, listed, peeked, kept_x, kept_y
    assert not our_shm_entries(os.getpid())



@examples(12)
@given(readers=st.sampled_from([0, 1]), slots=st.integers(2, 6),
       actions=st.lists(st.one_of(st.just("keep"), st.just("drop"), st.just("view"), st.integers(0, 40)),
                        min_size=1, max_size=50))
def test_any_pattern_of_keeping_and_dropping_keeps_the_rows_of_every_kept_batch(rows, readers, slots, actions):
    """Each action takes a batch, then: keeps it, drops it, keeps a slice of it, or drops the
    kept one at that position; whatever is kept holds its step's rows (the pure Sampler's)."""
    reference = np.load(rows)
    sampler = Sampler(ROWS, BATCH, "shuffle", 4)
    with ShmDataLoader({"x": rows}, batch_size=BATCH, readers=readers, slots=slots, seed=4, warn_layout=False,
                       hold_timeout=0.1) as loader:
        kept = []  # (step, what is kept: a Batch or a slice of one)
        for action in actions:
            batch = next(loader)
            if action == "keep":
                kept.append((batch.step, batch))
            elif action == "view":
                kept.append((batch.step, batch["x"][1:]))
            elif isinstance(action, int) and kept:
                kept.pop(action % len(kept))
            del batch
            for step, held in kept:
                x = held["x"] if isinstance(held, collections.abc.Mapping) else held
                expected = reference[sampler.fill(step).astype(np.int64)]
                np.testing.assert_array_equal(x, expected if x.shape == expected.shape else expected[1:])
        del kept

"""ShmDataLoader delivers, in step order, exactly the rows the sampler names, for any number of
readers and slots; batches are zero-copy and their slots are never reused while viewed;
resume is exact; bad settings are refused at construction."""

from __future__ import annotations

import gc
import os
import warnings

import numpy as np
import pytest

from conftest import our_shm_entries
from shmloader import (
    PerformanceWarning,
    Sampler,
    SharedMemoryError,
    ShmDataLoader,
    SlotsExhaustedError,
    StorageError,
)


def reference_batch(data, sampler, step):
    indices = sampler.fill(step)
    return indices, {name: array[indices] for name, array in data.items()}


def check_batches(loader, data, steps, seed=0, mode="shuffle", start=0, shard_index=0, shard_count=1):
    sampler = Sampler(len(next(iter(data.values()))), loader.batch_size, mode, seed, shard_index, shard_count)
    for expected_step, batch in zip(range(start, start + steps), loader):
        assert batch.step == expected_step
        indices, expected = reference_batch(data, sampler, expected_step)
        assert np.array_equal(batch.indices, indices)
        for name, array in expected.items():
            assert batch[name].dtype == array.dtype and batch[name].shape == array.shape
            assert np.array_equal(batch[name], array), (name, expected_step)


@pytest.mark.parametrize("readers", [1, 2, 4])
@pytest.mark.parametrize("slots", [2, 3, 8])
@pytest.mark.parametrize("storage", ["b2nd", "npy"])
def test_batches_equal_the_reference_in_step_order(dataset, readers, slots, storage):
    paths = dataset["paths"]
    fields = {"image": paths[f"images_{storage}"], "label": paths[f"labels_{storage}"]}
    with ShmDataLoader(fields, batch_size=32, readers=readers, slots=slots, seed=7) as loader:
        check_batches(loader, {"image": dataset["images"], "label": dataset["labels"]}, steps=60, seed=7)


@pytest.mark.parametrize("mode", ["sequential", "random", "shuffle"])
def test_every_mode(dataset, mode):
    paths = dataset["paths"]
    with ShmDataLoader({"label": paths["labels_b2nd"]}, batch_size=50, readers=2, slots=4, mode=mode, seed=3) as loader:
        check_batches(loader, {"label": dataset["labels"]}, steps=30, seed=3, mode=mode)


def test_single_path_and_seed_style_calls(dataset):
    paths = dataset["paths"]
    with ShmDataLoader(paths["images_b2nd"], batch_size=8, readers=1, slots=2) as loader:
        assert set(next(loader)) == {"data"}
    with ShmDataLoader(paths["images_b2nd"], paths["labels_npy"], batch_size=8, readers=1, slots=2) as loader:
        batch = next(loader)
        assert set(batch) == {"data", "label"}
        assert np.array_equal(batch["label"], dataset["labels"][batch.indices])


def test_batches_are_zero_copy_views_of_the_ring(dataset):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=2) as loader:
        batch = next(loader)
        array = batch["label"]
        assert not array.flags.owndata
        address = array.__array_interface__["data"][0]
        ring = loader._ring
        assert ring.base_address <= address < ring.base_address + loader.shared_memory_bytes


def test_a_viewed_slot_is_never_overwritten(dataset):
    """A view that outlives its Batch keeps the slot: the loader stops short of reusing it."""
    labels = dataset["labels"]
    sampler = Sampler(600, 16)
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=16, readers=2, slots=4, hold_timeout=0.3) as loader:
        kept = next(loader)["label"][2:]  # A slice of step 0, in slot 0.
        snapshot = kept.copy()
        for step in range(1, 4):
            assert next(loader).step == step
        with pytest.raises(SlotsExhaustedError, match="step 4 needs slot 0"):
            next(loader)  # Step 4 would overwrite slot 0.
        assert np.array_equal(kept, snapshot)
        del kept
        batch = next(loader)  # Now the slot is free again.
        assert batch.step == 4 and np.array_equal(batch["label"], labels[sampler.fill(4)])


def test_holding_every_slot_raises_a_clear_error(dataset):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=16, readers=1, slots=3, hold_timeout=0.3) as loader:
        held = [next(loader) for _ in range(3)]
        with pytest.raises(SlotsExhaustedError, match=r"slot 0.*still holds step 0.*release\(\)"):
            next(loader)
        del held


def test_release_and_with_hand_the_slot_back(dataset):
    data = {"label": dataset["labels"]}
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=16, readers=1, slots=2, hold_timeout=0.5) as loader:
        sampler = Sampler(600, 16)
        held = []
        for step in range(20):
            batch = next(loader)
            assert np.array_equal(batch["label"], data["label"][sampler.fill(step)])
            if step % 2:
                batch.release()
                with pytest.raises(RuntimeError, match="released"):
                    batch["label"]
            else:
                with batch:
                    pass
            held.append(batch)  # Released Batch objects hold no slot.


def test_resume_gives_identical_batches(dataset):
    paths = dataset["paths"]
    fields = {"image": paths["images_b2nd"], "label": paths["labels_b2nd"]}
    with ShmDataLoader(fields, batch_size=24, readers=2, slots=4, seed=5) as loader:
        first = [(batch.step, batch["image"].copy(), batch["label"].copy()) for _, batch in zip(range(40), loader)]
        state = loader.state_dict()
    assert state["step"] == 40
    with ShmDataLoader(fields, batch_size=24, readers=2, slots=4, seed=5, start_step=25) as resumed:
        for (step, image, label), batch in zip(first[25:], resumed):
            assert batch.step == step
            assert np.array_equal(batch["image"], image) and np.array_equal(batch["label"], label)
    with ShmDataLoader(fields, batch_size=24, readers=3, slots=5, seed=5) as loader:
        next(loader)
        next(loader)
        gc.collect()
        loader.load_state_dict({**state, "step": 30})
        for (step, image, label), batch in zip(first[30:], loader):
            assert batch.step == step and np.array_equal(batch["image"], image)
        with pytest.raises(ValueError, match="seed: checkpoint 6, loader 5"):
            loader.load_state_dict({**state, "seed": 6})


def test_two_loaders_in_one_process_do_not_interfere(dataset):
    paths = dataset["paths"]
    with ShmDataLoader({"label": paths["labels_npy"]}, batch_size=10, readers=2, slots=3, seed=1) as first, \
            ShmDataLoader({"label": paths["labels_b2nd"]}, batch_size=7, readers=1, slots=4, seed=2, mode="sequential") as second:
        assert first._ring.names.segment != second._ring.names.segment
        one, two = Sampler(600, 10, seed=1), Sampler(600, 7, "sequential", seed=2)
        for step in range(40):
            assert np.array_equal(next(first)["label"], dataset["labels"][one.fill(step)])
            assert np.array_equal(next(second)["label"], dataset["labels"][two.fill(step)])


def test_nothing_remains_after_close(dataset):
    loader = ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=2, slots=3)
    batch = next(loader)
    pids = loader.reader_pids
    assert our_shm_entries(os.getpid())
    loader.close()
    loader.close()  # Idempotent.
    assert not our_shm_entries(os.getpid())
    assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[-1][0] == "Z" for pid in pids)
    # A batch that outlived its loader still reads valid (now frozen) memory.
    assert batch["label"].shape == (10,)
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


def test_stats_report_progress(dataset):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=2, slots=4) as loader:
        for _, batch in zip(range(50), loader):
            pass
        stats = loader.stats()
    assert stats["batches"] == 50 and stats["rows"] == 500
    assert stats["rows_per_s"] > 0 and 0 <= stats["wait_fraction"] <= 1
    assert len(stats["readers"]) == 2
    assert sum(reader["batches"] for reader in stats["readers"]) >= 50
    assert stats["shared_memory_bytes"] == loader.shared_memory_bytes


def test_poor_layout_warns_once_and_good_layout_does_not(dataset):
    paths = dataset["paths"]
    with pytest.warns(PerformanceWarning, match=r"field 'image'.*images_default\.b2nd.*shmloader convert"):
        ShmDataLoader({"image": paths["images_default"]}, batch_size=4, readers=1, slots=2).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        ShmDataLoader({"image": paths["images_b2nd"], "label": paths["labels_b2nd"]}, batch_size=4, readers=1, slots=2).close()


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"slots": 1}, ValueError, "slots"),
        ({"readers": 0}, ValueError, "readers"),
        ({"mode": "epochs"}, ValueError, "mode"),
        ({"shard_index": 1, "shard_count": 1}, ValueError, "shard_index"),
        ({"hold_timeout": 0}, ValueError, "hold_timeout"),
        ({"batch_size": 2.5}, TypeError, "batch_size"),
    ],
)
def test_invalid_settings_are_refused(dataset, kwargs, error, words):
    with pytest.raises(error, match=words):
        ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, **{"readers": 1, "slots": 2, **kwargs})


def test_bad_files_are_refused_naming_field_and_file(dataset, tmp_path):
    paths = dataset["paths"]
    np.save(tmp_path / "short.npy", np.zeros(10, dtype=np.int64))
    with pytest.raises(StorageError, match=r"field 'image' \(.*images\.npy\) has 600, field 'label' \(.*short\.npy\) has 10"):
        ShmDataLoader({"image": paths["images_npy"], "label": str(tmp_path / "short.npy")}, readers=1, slots=2)
    with pytest.raises(FileNotFoundError, match=r"field 'label'.*missing\.b2nd"):
        ShmDataLoader({"label": str(tmp_path / "missing.b2nd")}, readers=1, slots=2)
    (tmp_path / "junk.npy").write_bytes(b"junk" * 10)
    with pytest.raises(StorageError, match=r"field 'x'.*junk\.npy"):
        ShmDataLoader({"x": str(tmp_path / "junk.npy")}, readers=1, slots=2)


def test_not_enough_shared_memory_is_an_error_naming_sizes(dataset, monkeypatch):
    from shmloader import ring

    class TinyStatvfs:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(ring.os, "statvfs", lambda path: TinyStatvfs)
    with pytest.raises(SharedMemoryError, match=r"needs \d+\.\d MiB.*0\.0 MiB are free"):
        ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=1000, readers=1, slots=2)

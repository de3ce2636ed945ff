"""ShmDataLoader delivers, in step order, exactly the rows the sampler names, for any number of
readers and slots; batches are zero-copy, and a batch still viewed keeps its rows when its slot is reused;
resume is exact; bad settings are refused at construction."""

from __future__ import annotations

import collections.abc
import gc
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from conftest import our_shm_entries, process_alive, wait_until

from shmloader import (
    PerformanceWarning,
    Sampler,
    SharedMemoryError,
    ShmDataLoader,
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
        ring = loader._session.ring
        assert ring.base_address <= address < ring.base_address + loader.diagnostics.shared_memory_bytes


def test_a_viewed_slot_keeps_its_rows_when_the_ring_needs_it(dataset):
    """A view that outlives its Batch keeps its rows: when the ring needs its slot, the
    batch's pages become memory of its own (kept.py), and the slot is refilled anew.
    Before, next() stopped short of the slot and raised SlotsExhaustedError."""
    labels = dataset["labels"]
    sampler = Sampler(600, 16)
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=16, readers=2, slots=4, hold_timeout=0.3) as loader:
        kept = next(loader)["label"][2:]  # A slice of step 0, in slot 0.
        for step in range(1, 13):  # Slot 0 is refilled for steps 4, 8 and 12.
            batch = next(loader)
            assert batch.step == step and np.array_equal(batch["label"], labels[sampler.fill(step)])
        assert np.array_equal(kept, labels[sampler.fill(0)][2:])
        del batch, kept


def _holders():
    """Ways a trainer keeps part of a batch alive; each must keep the batch's slot."""
    holders = {
        "slice": lambda batch: batch["label"][2:],
        "view of a view": lambda batch: batch["label"][1:][::2],
        "np.asarray": lambda batch: np.asarray(batch["label"]),
        "reshape": lambda batch: batch["image"].reshape(len(batch["image"]), -1),
        "memoryview": lambda batch: memoryview(batch["label"]),
        "dict of arrays": lambda batch: dict(batch),
        "indices": lambda batch: batch.indices,
        "the batch itself": lambda batch: batch,
    }
    holders["torch.from_numpy"] = lambda batch: _torch().from_numpy(batch["image"])
    return holders


def _torch():
    """Imported by the one case that uses it, not at collection (torch takes seconds to import)."""
    return pytest.importorskip("torch")


def _as_array(kept) -> np.ndarray:
    if isinstance(kept, collections.abc.Mapping):
        return np.asarray(kept["label"])
    return kept.numpy() if hasattr(kept, "numpy") else np.asarray(kept)


class _ReferenceBatch(dict):
    """The rows a batch should hold, from the arrays themselves, for the holders above."""

    def __init__(self, data, indices) -> None:
        super().__init__({name: array[indices] for name, array in data.items()})
        self.indices = indices


@pytest.mark.parametrize("kind", sorted(_holders()))
def test_every_kind_of_reference_keeps_its_rows(dataset, kind):
    """Whatever refers to a batch's arrays (numpy views, buffers, tensors, containers) keeps
    the rows it was given while its slot is refilled for later steps: the loader tells a
    held slot by reference counts, and gives such a batch memory of its own."""
    paths, data = dataset["paths"], {"image": dataset["images"], "label": dataset["labels"]}
    sampler = Sampler(600, 16)
    fields = {"image": paths["images_npy"], "label": paths["labels_npy"]}
    expected = _as_array(_holders()[kind](_ReferenceBatch(data, sampler.fill(0).astype(np.int64)))).copy()
    with ShmDataLoader(fields, batch_size=16, readers=1, slots=2, hold_timeout=0.2) as loader:
        kept = _holders()[kind](next(loader))
        for step in range(1, 8):  # Slot 0 is refilled for steps 2, 4 and 6.
            batch = next(loader)
            assert batch.step == step
            assert np.array_equal(batch["image"], data["image"][sampler.fill(step)])
        assert np.array_equal(_as_array(kept), expected)
        del batch, kept


def test_arrays_changed_in_place_are_rebuilt_before_their_slot_is_reused(dataset):
    """Arrays are built once per slot: a shape, dtype or flag changed in place by a trainer
    must not reach the batches that later use the slot."""
    paths, data = dataset["paths"], {"image": dataset["images"], "label": dataset["labels"]}
    sampler = Sampler(600, 16)
    fields = {"image": paths["images_npy"], "label": paths["labels_npy"]}
    with ShmDataLoader(fields, batch_size=16, readers=1, slots=2) as loader:
        for step in range(12):
            batch = next(loader)
            indices = sampler.fill(step)
            assert batch["image"].shape == (16, 3, 8, 8) and batch["image"].dtype == np.uint8
            assert batch["label"].flags.writeable and batch.indices.shape == (16,)
            assert np.array_equal(batch["image"], data["image"][indices])
            assert np.array_equal(batch["label"], data["label"][indices])
            assert np.array_equal(batch.indices, indices)
            if step % 3 == 0:
                image = batch["image"]
                _change_in_place(lambda: setattr(image, "shape", (16, -1)))
                _change_in_place(lambda: setattr(batch["label"], "dtype", np.uint8))
                batch.indices.flags.writeable = False  # Always allowed.
                del image
            elif step % 3 == 1:
                _change_in_place(lambda: setattr(batch["image"], "strides", (0, 64, 8, 1)))  # Every row reads row 0.


def _change_in_place(change) -> None:
    """Numpy deprecates (2.4, 2.5) and will remove these setters; what it still allows must
    not leak into later batches, and what it refuses cannot."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            change()
        except (AttributeError, TypeError, ValueError):
            pass


def test_slots_are_handed_back_at_the_next_call_after_their_last_reference(dataset):
    """A `for` loop's variable still refers to the previous batch while next() runs: that
    batch's slot goes back at the call after, and a dropped batch's at the next call."""
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=6) as loader:
        for batch in loader:
            held = sorted(loader.diagnostics.held_steps().values())
            assert held == ([0] if batch.step == 0 else [batch.step - 1, batch.step])
            if batch.step == 10:
                break
        batch.release()
        released = next(loader)
        assert released.step == 11 and sorted(loader.diagnostics.held_steps().values()) == [11]
        kept = released["label"]
        del released
        assert next(loader).step == 12 and sorted(loader.diagnostics.held_steps().values()) == [11, 12]
        del kept
        loader._session.cursor.release_unused()
        assert loader.diagnostics.held_steps() == {}


def test_reader_wake_ups_are_batched_while_the_readers_are_ahead(dataset):
    """Handing a slot back requests its next step at once, but wakes the readers only once
    half the ring waits for them, or at once when they are not ahead."""
    from shmloader.ring.layout import SlotState

    data = {"label": dataset["labels"]}
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=8) as loader:
        ring = loader._session.ring
        check_batches(loader, data, steps=1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(ring.state(slot)[0] != SlotState.READY for slot in range(1, 8)):
            time.sleep(0.01)  # The readers fill the ring (steps 1-7) and go to sleep.
        for step in range(1, 4):
            batch = next(loader)  # Hands back the previous step's slot: requested, not yet woken.
            assert batch.step == step and loader._session.cursor.pending_posts == step
            assert ring.state((step - 1) % 8)[0] in (SlotState.REQUESTED, SlotState.FILLING, SlotState.READY)
            del batch
        assert next(loader).step == 4 and loader._session.cursor.pending_posts == 0  # Half the ring (4): woken.
        check_batches(loader, data, steps=40, start=5)  # And nothing is lost on the way.


def test_batch_is_a_read_only_mapping_made_only_by_the_loader(dataset):
    from shmloader import Batch

    paths = dataset["paths"]
    with ShmDataLoader({"image": paths["images_npy"], "label": paths["labels_npy"]}, batch_size=4, readers=1, slots=2) as loader:
        batch = next(loader)
        assert list(batch) == ["image", "label"] and len(batch) == 2 and "label" in batch and "x" not in batch
        assert list(batch.keys()) == ["image", "label"] and batch.get("x") is None
        assert all(value is batch[key] for key, value in batch.items())
        assert repr(batch) == "Batch(step=0, image: uint8[4, 3, 8, 8], label: int64[4])"
        with pytest.raises(KeyError, match="'x'"):
            batch["x"]
        with pytest.raises(AttributeError):
            batch.step = 3
        assert not batch.released
        batch.release()
        assert batch.released and len(batch) == 0 and list(batch) == [] and batch.indices is None
        assert repr(batch) == "Batch(step=0, released)"
    with pytest.raises(TypeError):
        Batch()


_FORK_SCENARIO = """
import os, sys
import numpy as np
from shmloader import Sampler, ShmDataLoader
labels = np.load(sys.argv[1])
sampler = Sampler(len(labels), 8)
with ShmDataLoader({"label": sys.argv[1]}, batch_size=8, readers=1, slots=3) as loader:
    assert np.array_equal(next(loader)["label"], labels[sampler.fill(0)])
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            next(loader)
        except RuntimeError as error:
            code = 0 if "forked child" in str(error) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    for step in range(1, 20):  # The parent's ring and readers are untouched.
        assert np.array_equal(next(loader)["label"], labels[sampler.fill(step)])
print("ok")
"""


def test_a_forked_child_cannot_use_its_parents_loader(dataset):
    # In a fresh interpreter: this one may run threads (JAX's), with which fork is unsafe.
    result = subprocess.run(
        [sys.executable, "-c", _FORK_SCENARIO, dataset["paths"]["labels_npy"]],
        capture_output=True, text=True, timeout=120, cwd=os.path.dirname(__file__),
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


def test_holding_every_slot_keeps_every_batchs_rows(dataset):
    """Before: SlotsExhaustedError once every slot was held. Now the oldest held batches get
    memory of their own, and the readers go on."""
    labels, sampler = dataset["labels"], Sampler(600, 16)
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=16, readers=1, slots=3, hold_timeout=0.3) as loader:
        held = [next(loader) for _ in range(30)]
        for step, batch in enumerate(held):
            assert batch.step == step and np.array_equal(batch["label"], labels[sampler.fill(step)])
        del held, batch


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
        loader.load_state_dict({**state, "step": 30, "position": 30 * 24})  # A checkpoint of step 30.
        for (step, image, label), batch in zip(first[30:], loader):
            assert batch.step == step and np.array_equal(batch["image"], image)
        with pytest.raises(ValueError, match="seed: checkpoint 6, loader 5"):
            loader.load_state_dict({**state, "seed": 6})


def test_two_loaders_in_one_process_do_not_interfere(dataset):
    paths = dataset["paths"]
    with ShmDataLoader({"label": paths["labels_npy"]}, batch_size=10, readers=2, slots=3, seed=1) as first, \
            ShmDataLoader({"label": paths["labels_b2nd"]}, batch_size=7, readers=1, slots=4, seed=2, mode="sequential") as second:
        assert first.diagnostics.ring_name != second.diagnostics.ring_name
        one, two = Sampler(600, 10, seed=1), Sampler(600, 7, "sequential", seed=2)
        for step in range(40):
            assert np.array_equal(next(first)["label"], dataset["labels"][one.fill(step)])
            assert np.array_equal(next(second)["label"], dataset["labels"][two.fill(step)])


def test_nothing_remains_after_close(dataset):
    loader = ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=2, slots=3)
    batch = next(loader)
    pids = loader.diagnostics.reader_pids
    assert our_shm_entries(os.getpid())
    loader.close()
    loader.close()  # Idempotent.
    assert not our_shm_entries(os.getpid())
    assert not any(process_alive(pid) for pid in pids)
    # A batch that outlived its loader still reads valid (now frozen) memory.
    assert batch["label"].shape == (10,)
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_readers_run_as_batch_work_so_their_wake_ups_do_not_preempt_the_trainer(dataset):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=2, slots=4) as loader:
        next(loader)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(loader._session.ring.records.stats(r)[0] for r in range(2)):
            time.sleep(0.01)  # A reader records its pid once running, after choosing its policy.
        assert [os.sched_getscheduler(pid) for pid in loader.diagnostics.reader_pids] == [os.SCHED_BATCH] * 2
    assert os.sched_getscheduler(0) != os.SCHED_BATCH  # The trainer keeps its own policy.


def test_stats_report_progress(dataset):
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=10, readers=2, slots=4) as loader:
        for _, batch in zip(range(50), loader):
            pass
        stats = loader.stats()
    assert stats["batches"] == 50 and stats["rows"] == 500
    assert stats["rows_per_s"] > 0 and 0 <= stats["wait_fraction"] <= 1
    assert len(stats["readers"]) == 2
    assert sum(reader["batches"] for reader in stats["readers"]) >= 50
    assert stats["shared_memory_bytes"] == loader.diagnostics.shared_memory_bytes


def test_poor_layout_warns_once_and_good_layout_does_not(dataset):
    paths = dataset["paths"]
    with pytest.warns(PerformanceWarning, match=r"field 'image'.*images_default\.b2nd.*shmloader convert") as record:
        ShmDataLoader({"image": paths["images_default"]}, batch_size=4, readers=1, slots=2).close()
    assert record[0].filename == __file__  # It points at the user's line, not into the package.
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        ShmDataLoader({"image": paths["images_b2nd"], "label": paths["labels_b2nd"]}, batch_size=4, readers=1, slots=2).close()


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"slots": 1}, ValueError, "slots"),
        ({"readers": -1}, ValueError, "readers"),
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


@pytest.mark.parametrize("memory", ["dev-shm", "auto"])
def test_not_enough_shared_memory_is_an_error_naming_sizes(dataset, monkeypatch, memory):
    """With anonymous memory forbidden, a full /dev/shm is the error; by default the ring
    goes to anonymous memory instead, and only when that has no room either is it refused."""
    from shmloader.ring import backing

    monkeypatch.setattr(backing, "free_bytes", lambda directory: 10 * 4096)
    monkeypatch.setenv(backing.MEMORY_VARIABLE, memory)
    if memory == "auto":
        monkeypatch.setattr(backing, "memory_room_bytes", lambda: 10 * 4096)
    with pytest.raises(SharedMemoryError, match=r"needs \d+\.\d MiB.*0\.0 MiB are free|\d+\.\d MiB.*0\.0 MiB more"):
        ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=1000, readers=1, slots=2)


def test_stats_show_readers_starved_by_deferred_wake_ups(dataset):
    """While readers are ahead the trainer defers their wake-ups to once per half ring: a
    slot requested meanwhile waits for a reader that sleeps, and stats() shows that time."""
    with ShmDataLoader({"label": dataset["paths"]["labels_npy"]}, batch_size=8, readers=1, slots=8) as loader:
        next(loader)
        time.sleep(0.2)  # The reader fills the ring and goes to sleep.
        for _ in range(24):
            next(loader)
            time.sleep(0.01)  # A slow trainer: the reader is always ahead, then asleep.
        reader = loader.stats()["readers"][0]
    assert reader["sleeps"] > 0 and reader["wakeups"] > 0
    assert reader["starved_s"] > 0.005  # Requests waited for the deferred post.
    assert reader["batches_per_wakeup"] > 1  # One post wakes it for several slots.


def test_the_default_reader_count_divides_the_cores_among_the_nodes_trainers(monkeypatch):
    from shmloader.plan import defaults as plan

    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(plan.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(plan, "cpu_quota", lambda: None)  # The cores faked, not a CI host's CPU limit.
    assert plan.default_readers({}) == 8
    assert plan.default_readers({"LOCAL_WORLD_SIZE": "8"}) == 2  # torchrun, 8 ranks: 2 readers each
    assert plan.default_readers({"SLURM_NTASKS_PER_NODE": "4(x2)"}) == 4
    assert plan.default_readers({"LOCAL_WORLD_SIZE": "32"}) == 1
    for bad in ("abc", "0", "-2", "4.5"):  # Before: silently taken for one trainer.
        with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE={bad!r}: expected a positive integer"):
            plan.default_readers({"LOCAL_WORLD_SIZE": bad})
    assert plan.default_readers({"LOCAL_WORLD_SIZE": ""}) == plan.default_readers({})
    monkeypatch.setattr(plan.os, "sched_getaffinity", lambda pid: {0, 1, 2})  # A rank pinned to 3 cores.
    assert plan.default_readers({"LOCAL_WORLD_SIZE": "8"}) == 3


def test_a_seek_that_fails_while_a_reader_fills_leaves_the_loader_as_it_was(tmp_path, monkeypatch):
    """Before: seek() took some slots back, raised, and never requested them again: the next
    batches were old steps, then a SharedMemoryError blamed another process. A reader that
    holds its slot past the bound is replaced; here its replacement cannot start."""
    from shmloader.readers import pool as pool_module

    np.save(tmp_path / "x.npy", np.arange(60, dtype=np.int64))
    monkeypatch.setattr(pool_module.ReaderPool, "take_back_seconds", 0.5)
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=4, mode="sequential", readers=1, slots=6,
                       transform="transform_fixtures:slow_on_row_nine", hold_timeout=0.2) as loader:
        assert next(loader).step == 0
        assert wait_until(lambda: ("FILLING", 2) in loader.diagnostics.slot_states(), 30)  # Inside step 2 (2.5 s).
        with monkeypatch.context() as refusing:
            refusing.setattr(pool_module, "spawn_reader", lambda: (_ for _ in ()).throw(OSError("fork refused")))
            with pytest.raises(OSError, match="fork refused"):
                loader.seek(0)
        got = [(batch.step, batch["x"].tolist()) for batch in (next(loader) for _ in range(5))]
    assert got == [(step, list(range(4 * step, 4 * step + 4))) for step in range(1, 6)]


def test_diagnostics_moved_off_the_loader_say_where(dataset):
    with ShmDataLoader(dataset["paths"]["images_b2nd"], batch_size=4, readers=1, slots=2) as loader:
        assert loader.diagnostics.ring_name and len(loader.diagnostics.reader_pids) == 1
        with pytest.raises(AttributeError, match=r"loader\.diagnostics\.reader_pids"):
            loader.reader_pids
        with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
            loader.nonsense
        assert not hasattr(loader, "ring_name")
        with pytest.raises(AttributeError, match=r"loader\.plan\.slot"):
            loader.slot
        with pytest.raises(AttributeError, match=r"loader\.options\.verify"):
            loader.verify
        assert loader.plan.slot.batch_size == 4 and loader.options.verify is True

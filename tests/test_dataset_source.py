"""A map-style dataset as the loader's source (ShmDataLoader.from_dataset): batches equal the
samples stacked by numpy over drawn structures, shapes and dtypes, for readers 0 and 2;
PackedRagged outputs equal the samples concatenated with their offsets, and resume exactly;
each index once per epoch across shards; augmentations from the global generators identical
for any reader count and on resume; errors name the index; a killed reader costs no batch."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dataset_fixtures as fixtures
from conftest import examples, our_shm_entries
from shmloader import PackedRagged, Ragged, ShmDataLoader, rebuild_batch
from shmloader.plan.dataset import DatasetError
from shmloader.readers.pool import ReaderPool

HERE = os.path.dirname(os.path.abspath(__file__))

_DTYPES = ["uint8", "int16", "int32", "int64", "float32", "float64", "bool"]
_leaf = st.tuples(st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple), st.sampled_from(_DTYPES))
_leaves = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4), _leaf, min_size=2, max_size=4)


def _reference(dataset, indices, names) -> dict:
    """What the batch should hold: each leaf of dataset[index], stacked by numpy."""
    samples = [rebuild_batch_leaves(dataset[int(index)]) for index in indices]
    return {name: np.stack([sample[name] for sample in samples]) for name in names}


def rebuild_batch_leaves(sample) -> dict:
    from shmloader.plan.dataset_outputs import flatten

    return {name: np.asarray(value) for name, value in flatten(sample)[1]}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(leaves=_leaves, container=st.sampled_from(["dict", "tuple", "nested"]), length=st.integers(3, 40),
       batch_size=st.integers(1, 7), readers=st.sampled_from([0, 2]), mode=st.sampled_from(["shuffle", "sequential"]))
def test_batches_are_the_samples_stacked_for_drawn_structures(leaves, container, length, batch_size, readers, mode):
    dataset = fixtures.Drawn(length, leaves, container)
    with ShmDataLoader.from_dataset(dataset, batch_size=batch_size, readers=readers, mode=mode, seed=length,
                                    epochs=1) as loader:
        names = [name for name in loader.field_names if name != "indices"]
        seen = []
        for batch in loader:
            kept = len(batch[names[0]])
            indices = batch.indices[:kept]
            expected = _reference(dataset, indices, names)
            for name in names:
                np.testing.assert_array_equal(batch[name], expected[name], err_msg=name)
                assert batch[name].dtype == expected[name].dtype, name
            seen += indices.tolist()
    assert sorted(seen) == list(range(length))


@pytest.mark.parametrize("drop_last", [False, True])
def test_each_index_once_per_epoch_across_two_shards(drop_last):
    dataset = fixtures.Drawn(23, {"x": ((2,), "int64")})
    rows = []
    for shard in range(2):
        with ShmDataLoader.from_dataset(dataset, batch_size=4, readers=1, seed=5, epochs=1, drop_last=drop_last,
                                        shard_index=shard, shard_count=2) as loader:
            for batch in loader:
                rows += batch.indices[:len(batch["x"])].tolist()
    if drop_last:
        assert len(rows) == len(set(rows)) == 16  # Two full global batches of 8.
    else:
        assert sorted(rows) == list(range(23))


def _draws(readers: int, start_state=None, steps: int = 10) -> list:
    with ShmDataLoader.from_dataset(fixtures.Augmented(), batch_size=4, readers=readers, seed=9) as loader:
        if start_state is not None:
            loader.load_state_dict(start_state)
        return [(batch.indices.copy(), batch["drawn"].copy()) for _, batch in zip(range(steps), loader)]


def test_global_generators_give_the_same_samples_for_any_reader_count_and_on_resume():
    pytest.importorskip("torch")
    alone = _draws(0)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(alone, _draws(2)))
    with ShmDataLoader.from_dataset(fixtures.Augmented(), batch_size=4, readers=2, seed=9) as loader:
        for _, batch in zip(range(4), loader):
            pass
        del batch
        state = loader.state_dict()
    resumed = _draws(1, state, 6)
    for (indices, drawn), (resumed_indices, resumed_drawn) in zip(alone[4:], resumed):
        assert np.array_equal(indices, resumed_indices) and np.array_equal(drawn, resumed_drawn)
    # Different samples draw differently (the generators are seeded per sample).
    assert len({tuple(row) for _, drawn in alone for row in drawn}) == 40


@pytest.mark.parametrize("readers", [0, 2])
def test_an_exception_in_getitem_keeps_its_type_and_names_the_index(readers):
    with ShmDataLoader.from_dataset(fixtures.Failing(), batch_size=30, readers=readers, mode="sequential") as loader:
        with pytest.raises(KeyError) as raised:
            next(loader)
    text = " ".join([str(raised.value), *getattr(raised.value, "__notes__", [])])  # readers=0: the error itself.
    assert "no record 7" in text and "dataset[7]" in text, text


@pytest.mark.filterwarnings("ignore::shmloader.SkippedRecordsWarning")
def test_a_failing_index_is_skipped_under_on_error_skip():
    with ShmDataLoader.from_dataset(fixtures.Failing(bad=(3, 11)), batch_size=5, readers=1, mode="sequential",
                                    epochs=1, on_error="skip") as loader:
        rows = [row for batch in loader for row in batch["x"][:, 0].tolist()]
        skipped = loader.stats()["skipped"]
    assert 3 not in rows and 11 not in rows and len(rows) == 30
    assert sorted(record["row"] for record in skipped["records"]) == [3, 11]
    assert all("dataset[" in record["where"] and "no record" in record["error"] for record in skipped["records"])


class _LongFirst:
    """Record 0 holds 8 items, the others 1; record 1 raises."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 1:
            raise KeyError(f"no record {index}")
        return {"tokens": np.full(8 if index == 0 else 1, index, np.int32)}


@pytest.mark.filterwarnings("ignore::shmloader.SkippedRecordsWarning")
def test_the_search_for_bad_records_gives_packed_samples_room_and_blames_only_the_bad_one():
    """The search tries records alone, repeated to fill a batch: record 0 four times holds 32
    items, past the batch's max_items of 24, which it must not blame on record 0 (it was
    skipped with the bad one)."""
    from shmloader import PackedRagged

    with ShmDataLoader.from_dataset(_LongFirst(), outputs={"tokens": PackedRagged(24)}, batch_size=4, readers=0,
                                    mode="sequential", epochs=1, on_error="skip") as loader:
        batch = next(loader)
        offsets = batch["tokens.offsets"].tolist()
        skipped = loader.stats()["skipped"]["records"]
    assert [record["row"] for record in skipped] == [1]
    assert batch["tokens"][offsets[0]:offsets[1]].tolist() == [0] * 8
    assert offsets == [0, 8, 9, 10, 11]  # Record 1 replaced by record 2, the next good one.


def test_a_sample_of_another_shape_names_the_index_the_key_and_both_shapes():
    with ShmDataLoader.from_dataset(fixtures.Varying(), batch_size=5, readers=0, mode="sequential") as loader:
        with pytest.raises(DatasetError, match=r"dataset\[1\]\['tokens'\] has shape \(2,\).*\(1,\).*Ragged"):
            next(loader)


def test_ragged_outputs_are_padded_with_their_lengths():
    with ShmDataLoader.from_dataset(fixtures.Varying(), outputs={"tokens": Ragged(8, pad=-1)}, batch_size=5,
                                    readers=1, mode="sequential") as loader:
        batch = next(loader)
        assert batch["tokens"].shape == (5, 8)
        for row, index in enumerate(batch.indices.tolist()):
            length = index % 6 + 1
            assert batch["tokens.lengths"][row] == length
            np.testing.assert_array_equal(batch["tokens"][row, :length], np.arange(length))
            assert (batch["tokens"][row, length:] == -1).all()


def _packed_reference(dataset, indices) -> tuple[np.ndarray, np.ndarray]:
    """What a packed batch should hold: the samples' points concatenated, and their offsets."""
    samples = [dataset[int(index)]["points"] for index in indices]
    offsets = np.concatenate([[0], np.cumsum([len(sample) for sample in samples])])
    return np.concatenate(samples), offsets


# The long profile's 120 examples take about 2 s, but over a minute where each reader
# imports torch (DatasetSpec.torch): conftest's torch_only_where_the_test_uses_it keeps the
# torch that other modules of a test worker imported out of these readers.
@pytest.mark.timeout(600)
@examples(6)
@given(length=st.integers(3, 30), item_shape=st.lists(st.integers(1, 3), max_size=2).map(tuple),
       dtype=st.sampled_from(_DTYPES[:-1]), longest=st.integers(0, 6), batch_size=st.integers(1, 6),
       readers=st.sampled_from([0, 2]), mode=st.sampled_from(["shuffle", "sequential"]),
       offsets=st.sampled_from(["int64", "int32"]), room=st.integers(0, 5))
def test_packed_outputs_are_the_samples_concatenated_with_their_offsets(length, item_shape, dtype, longest,
                                                                        batch_size, readers, mode, offsets, room):
    dataset = fixtures.Packable(length, item_shape, dtype, longest)
    declared = PackedRagged(batch_size * longest + room or 1, offsets=offsets)  # Room for the longest batch.
    with ShmDataLoader.from_dataset(dataset, outputs={"points": declared}, batch_size=batch_size, readers=readers,
                                    mode=mode, seed=length, epochs=1) as loader:
        seen = []
        for batch in loader:
            indices = batch.indices[:len(batch["label"])]
            values, expected_offsets = _packed_reference(dataset, indices)
            # As Packed's: a full batch's region is whole, items past offsets[-1] as they were.
            assert batch["points"].dtype == np.dtype(dtype) and batch["points"].shape[1:] == item_shape
            np.testing.assert_array_equal(batch["points"][:len(values)], values)
            assert batch["points.offsets"].dtype == np.dtype(offsets)
            np.testing.assert_array_equal(batch["points.offsets"], expected_offsets)
            seen += indices.tolist()
    assert sorted(seen) == list(range(length))


@pytest.mark.parametrize("readers", [0, 1])
def test_a_batch_over_the_packed_capacity_names_the_index_the_key_and_the_sizes(readers):
    # Varying's tokens hold index % 6 + 1 items: rows 0..3 hold 1 + 2 + 3 + 4 = 10 items.
    with ShmDataLoader.from_dataset(fixtures.Varying(), outputs={"tokens": PackedRagged(8)}, batch_size=4,
                                    readers=readers, mode="sequential") as loader:
        with pytest.raises(DatasetError) as raised:
            next(loader)
    message = str(raised.value)
    assert "dataset[3]['tokens'] has 4 items" in message and "after the 6 items of the 3 sample(s)" in message
    assert "make 10, more than its PackedRagged max_items=8" in message, message


@pytest.mark.parametrize(("declared", "message"), [
    (PackedRagged(0), "max_items must be a positive integer"),
    (PackedRagged(8, offsets="int16"), "offsets must be 'int64' or 'int32'"),
    (PackedRagged(1 << 31, offsets="int32"), "int32 offsets hold under 2\\*\\*31 items"),
])
def test_a_bad_packed_declaration_is_refused_by_name(declared, message):
    with pytest.raises(DatasetError, match=message):
        ShmDataLoader.from_dataset(fixtures.Varying(), outputs={"tokens": declared}, batch_size=2, readers=0)
    with pytest.raises(DatasetError, match="PackedRagged, but the first sample's 'label' is a scalar"):
        ShmDataLoader.from_dataset(fixtures.Varying(), outputs={"label": PackedRagged(8)}, batch_size=2, readers=0)


def _packed_batches(readers: int, steps: int, state=None) -> tuple[list, dict]:
    """`steps` packed batches (copied) after `state`, and the state after them."""
    dataset = fixtures.Packable(29, (2,), "float32", 5)
    with ShmDataLoader.from_dataset(dataset, outputs={"points": PackedRagged(20)}, batch_size=4, readers=readers,
                                    seed=3) as loader:
        if state is not None:
            loader.load_state_dict(state)
        found = []
        for _, batch in zip(range(steps), loader):
            end = int(batch["points.offsets"][-1])
            found.append((batch.indices.copy(), batch["points"][:end].copy(), batch["points.offsets"].copy()))
        del batch
        return found, loader.state_dict()


def test_packed_batches_resume_exactly_mid_pass_under_another_reader_count():
    whole, _ = _packed_batches(0, 12)
    _, state = _packed_batches(2, 5)
    resumed, _ = _packed_batches(1, 7, state)
    assert len(resumed) == 7
    for (indices, values, offsets), (resumed_indices, resumed_values, resumed_offsets) in zip(whole[5:], resumed):
        np.testing.assert_array_equal(resumed_indices, indices)
        np.testing.assert_array_equal(resumed_offsets, offsets)
        np.testing.assert_array_equal(resumed_values, values)


def test_declared_outputs_set_dtype_and_unknown_names_are_refused():
    dataset = fixtures.Drawn(10, {"x": ((3,), "float64")})
    with ShmDataLoader.from_dataset(dataset, outputs={"x": ((3,), "float32")}, batch_size=2, readers=0) as loader:
        assert next(loader)["x"].dtype == np.float32
    with pytest.raises(DatasetError, match=r"outputs names \['y'\].*leaves: \['x'\]"):
        ShmDataLoader.from_dataset(dataset, outputs={"y": ((3,), "float32")}, batch_size=2, readers=0)


class _SignedLabels:
    """Labels -1 .. 2 as Python ints and as numpy int64 side by side."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return {"plain": index % 4 - 1, "numpy": np.int64(index % 4 - 1)}


def test_a_python_scalar_goes_into_a_declared_dtype_where_it_fits_and_is_refused_where_not():
    """-1 into a uint8 output is refused naming the leaf, whether the sample gives int or
    np.int64 (numpy's assignment would have made it 255); values that fit go in."""
    outputs = {"plain": ((), "u1"), "numpy": ((), "u1")}
    with ShmDataLoader.from_dataset(_SignedLabels(), outputs=outputs, batch_size=8, readers=0, mode="sequential") \
            as loader, pytest.raises(DatasetError, match=r"dataset\[0\]\['plain'\] is int64, its output is uint8.*"
                                                          r"values from -1 to -1"):
        next(loader)
    outputs = {"plain": ((), "i1"), "numpy": ((), "i2")}
    with ShmDataLoader.from_dataset(_SignedLabels(), outputs=outputs, batch_size=8, readers=0, mode="sequential") \
            as loader:
        batch = next(loader)
        assert batch["plain"].tolist() == batch["numpy"].tolist() == [-1, 0, 1, 2] * 2


class _TwoDtypes:
    """Sample 0 of one dtype (its output's), the others one value of another."""

    def __init__(self, first: str, later: str, value) -> None:
        self.first, self.later, self.value = first, later, value

    def __len__(self):
        return 4

    def __getitem__(self, index):
        if index == 0:
            return {"x": np.zeros(2, self.first)}
        return {"x": self.value}


_DTYPES = ["bool", "uint8", "int8", "int16", "uint32", "int32", "int64", "float16", "float32", "float64",
           "complex64"]


@examples(25)
@given(first=st.sampled_from(_DTYPES), later=st.sampled_from(_DTYPES),
       value=st.one_of(st.integers(-(1 << 40), 1 << 40), st.floats(-1e10, 1e10), st.sampled_from([0, 1, -1, 255,
                                                                                                      256, 0.5])))
def test_a_later_sample_of_another_dtype_is_delivered_unchanged_or_refused(first, later, value):
    """Never cast silently: a later sample whose dtype differs from dataset[0]'s either
    comes out as the dataset returned it (integers exactly, floats to the output's
    precision), or raises a DatasetError naming it. Refused: a value an integer or bool
    output cannot hold, an integer a float output rounds, a finite value that overflows, a
    float into an integer or bool output, a complex into a real output."""
    target, kind = np.dtype(first), np.dtype(later).kind
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sample = np.full(2, np.float64(value) if isinstance(value, float) else np.int64(value)).astype(later)
        cast = sample.astype(target)
    if target.kind == "b":
        fits = kind == "b" or kind in "iu" and set(sample.tolist()) <= {0, 1}
    elif target.kind in "iu":
        fits = kind in "iub" and [int(item) for item in cast] == [int(item) for item in sample]
    elif kind in "iu":  # Integers into a float output: exactly, or refused.
        fits = bool(np.all(np.isfinite(cast))) and [complex(item) for item in cast] == [int(item) for item in sample]
    else:
        fits = (kind != "c" or target.kind == "c") and np.array_equal(np.isfinite(cast), np.isfinite(sample))
    with ShmDataLoader.from_dataset(_TwoDtypes(first, later, sample), batch_size=4, readers=0, mode="sequential") \
            as loader:
        if fits:
            delivered = next(loader)["x"]
            assert delivered.dtype == target
            assert np.array_equal(delivered[1:], np.broadcast_to(cast, (3, 2)))
            if target.kind in "iu":
                assert [int(item) for item in delivered[1]] == [int(item) for item in sample]
        else:
            with pytest.raises(DatasetError, match=r"dataset\[1\]\['x'\] is " + later):
                next(loader)


def test_an_unpicklable_dataset_names_the_attribute_and_the_import_path_way():
    with pytest.raises(DatasetError, match=r"attribute 'guard'.*import path.*module:function|attribute 'guard'"):
        ShmDataLoader.from_dataset(fixtures.HoldsALock(), batch_size=2, readers=1)
    assert not our_shm_entries(os.getpid())


def test_a_dataset_by_import_path_is_built_in_each_reader():
    with ShmDataLoader.from_dataset("dataset_fixtures:make_squares", dataset_args={"length": 12, "scale": 3},
                                    batch_size=4, readers=2, mode="sequential", epochs=1) as loader:
        values = [value for batch in loader for value in batch["data"][:, 0].tolist()]
    assert values == [index * index * 3 for index in range(12)]


def test_iterable_samples_and_a_shuffle_window_are_refused_by_name():
    with pytest.raises(DatasetError, match="no __getitem__"):
        ShmDataLoader.from_dataset(iter(range(3)), batch_size=1, readers=0)
    with pytest.raises(ValueError, match="shuffle_window"):
        ShmDataLoader.from_dataset(fixtures.Drawn(10, {"x": ((1,), "int64")}), batch_size=2, readers=0,
                                   shuffle_window=4)


def test_a_reader_killed_mid_batch_costs_no_batch():
    dataset = fixtures.Slow(0.01)
    with ShmDataLoader.from_dataset(dataset, batch_size=8, readers=2, seed=1, slots=4) as loader:
        found = []
        for count, batch in zip(range(24), loader):
            if count == 3:
                os.kill(loader.diagnostics.reader_pids[0], signal.SIGKILL)
            found.append((batch.indices.copy(), batch["data"][:, 0].copy()))
    for indices, values in found:
        np.testing.assert_array_equal(values, indices.astype(np.int64))


def test_a_dataset_class_defined_in_the_trainers_script_reaches_the_readers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import numpy as np\n"
        "from shmloader import ShmDataLoader\n"
        "class Mine:\n"
        "    def __len__(self): return 9\n"
        "    def __getitem__(self, i): return {'x': np.asarray([i * 2])}\n"
        "if __name__ == '__main__':\n"
        "    with ShmDataLoader.from_dataset(Mine(), batch_size=3, readers=2, mode='sequential', epochs=1) as loader:\n"
        "        print(sorted(v for b in loader for v in b['x'][:, 0].tolist()))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str([index * 2 for index in range(9)])


def test_the_pickle_lives_in_memory_only_and_goes_with_close():
    loader = ShmDataLoader.from_dataset(fixtures.Drawn(10, {"x": ((1,), "int64")}), batch_size=2, readers=1)
    spec = loader._dataset.spec
    link = os.readlink(f"/proc/self/fd/{spec.pickle_fd}")
    assert link.startswith("/memfd:shmloader-dataset")
    assert pickle.loads(open(f"/proc/self/fd/{spec.pickle_fd}", "rb").read()).length == 10
    loader.close()
    assert not os.path.exists(f"/proc/self/fd/{spec.pickle_fd}") or \
        not os.readlink(f"/proc/self/fd/{spec.pickle_fd}").startswith("/memfd:shmloader-dataset")


def test_rebuild_batch_gives_the_samples_structure_back():
    dataset = fixtures.Drawn(6, {"p": ((2,), "int32"), "q": ((), "float64"), "r": ((1,), "uint8")}, "nested")
    with ShmDataLoader.from_dataset(dataset, batch_size=3, readers=0, mode="sequential") as loader:
        batch = next(loader)
        rebuilt = rebuild_batch(loader._dataset.spec.structure, batch)
        assert set(rebuilt) == {"a", "b"} and isinstance(rebuilt["b"]["c"], tuple) and len(rebuilt["b"]["c"]) == 2
        np.testing.assert_array_equal(rebuilt["a"], np.stack([dataset[i]["a"] for i in range(3)]))


class StartsAHelper:
    """Starts a helper process on its first sample without stdin=DEVNULL (as most code
    does; `cat` stands in for ffmpeg without -nostdin, which reads its stdin)."""

    helper = None

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        if StartsAHelper.helper is None:
            StartsAHelper.helper = subprocess.Popen(["cat"], stdout=subprocess.DEVNULL)
        return np.int64(index)


def _two_passes(readers: int) -> list[list[int]]:
    passes = []
    with ShmDataLoader.from_dataset(StartsAHelper(), batch_size=4, readers=readers, seed=1, epochs=1) as loader:
        for seed in (None, 77):
            if seed is not None:
                loader._session.new_pass(seed)  # What the drop-in's next epoch does.
            passes.append([int(value) for batch in loader for value in batch["data"]])
    return passes


def test_a_process_the_dataset_starts_cannot_take_the_readers_next_pass():
    """A reader's configuration pipe is not its stdin: a child that inherits stdin and
    reads it (it got the new pass's filler, and the reader refilled the old order) sees
    /dev/null."""
    try:
        local = _two_passes(0)
    finally:
        if StartsAHelper.helper is not None:  # This process's, with readers=0.
            StartsAHelper.helper.kill()
            StartsAHelper.helper.wait()
            StartsAHelper.helper = None
    readers = _two_passes(1)
    assert local[0] != local[1] and readers == local


def _passes_by_import_path(readers: int, stop_a_reader: bool = False) -> tuple[list[list[int]], bool]:
    """Two passes (seed 3, then 5) of a dataset whose configuration is 200 KB (more than a
    pipe holds); with `stop_a_reader`, reader 0 is SIGSTOPped while the second pass is
    given. Also whether that reader was replaced."""
    settings = {"dataset_args": {"length": 24, "padding": "x" * 200_000}, "batch_size": 4, "readers": readers,
                "epochs": 1, "seed": 3}
    with ShmDataLoader.from_dataset("dataset_fixtures:make_squares_padded", **settings) as loader:
        passes = [[int(value) for batch in loader for value in batch["data"][:, 0]]]
        stopped = loader.diagnostics.reader_pids[0] if stop_a_reader else None
        if stopped is not None:
            os.kill(stopped, signal.SIGSTOP)
        try:
            loader._session.new_pass(5)
        finally:
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)
        replaced = stopped is not None and stopped not in loader.diagnostics.reader_pids
        passes.append([int(value) for batch in loader for value in batch["data"][:, 0]])
    return passes, replaced


def test_a_stopped_reader_that_cannot_take_a_new_pass_is_replaced(monkeypatch):
    """A new filler longer than the pipe holds waits for each reader to read it: a stopped
    one (it never reads) is replaced after reconfigure_timeout_seconds instead of hanging
    the trainer, and the pass is right."""
    monkeypatch.setattr(ReaderPool, "reconfigure_timeout_seconds", 1.0)
    expected, _ = _passes_by_import_path(0)
    found, replaced = _passes_by_import_path(2, stop_a_reader=True)
    assert replaced and found == expected and expected[0] != expected[1]


def test_a_dataset_that_opens_its_file_lazily_in_getitem_is_sent_to_readers(tmp_path):
    """The probe of dataset[0] opened the file in the trainer before the dataset was
    pickled, so the handle went into the pickle and failed it."""
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(40)))
    dataset = fixtures.OpensLazily(str(path), 40)
    with ShmDataLoader.from_dataset(dataset, batch_size=8, readers=2, mode="sequential", epochs=1) as loader:
        assert [value for batch in loader for value in batch["byte"][:, 0].tolist()] == list(range(40))
    assert not our_shm_entries(os.getpid())


@pytest.mark.parametrize("readers", [0, 1])
def test_an_error_of_dataset_0_keeps_its_type_and_arguments(readers):
    """It was raised again as type(error)(message), which a UnicodeDecodeError refuses (a
    TypeError came out instead)."""
    with pytest.raises(UnicodeDecodeError) as raised:
        ShmDataLoader.from_dataset(fixtures.UndecodableFirst(), batch_size=2, readers=readers)
    assert raised.value.encoding == "utf-8" and raised.value.start == 0
    if sys.version_info >= (3, 11):
        assert any("dataset[0]" in note for note in raised.value.__notes__)
    assert not our_shm_entries(os.getpid())


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """A reader runs the trainer's script to find a dataset class defined there; a script
    that builds its loader at import built another loader in each reader, which failed
    with an AttributeError that named no cause."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "import numpy as np\n"
        "from shmloader import ShmDataLoader\n"
        "class Squares:\n"
        "    def __len__(self):\n"
        "        return 8\n"
        "    def __getitem__(self, index):\n"
        "        return {'x': np.int64(index * index)}\n"
        "with ShmDataLoader.from_dataset(Squares(), batch_size=4, readers=1, epochs=1) as loader:\n"
        "    print(sum(len(batch['x']) for batch in loader))\n")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=str(tmp_path))
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    assert 'if __name__ == "__main__":' in stderr and str(script) in stderr
    assert not our_shm_entries(process.pid)

"""Finite passes (epochs=N): every row exactly N times, a partial last batch, the same
number of steps on every shard, exact resume mid-pass, for every field kind, a transform
and a mixture."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from shmloader import Packed, Padded, ShmDataLoader, Source, Windows
from shmloader.tools.convert import write_ragged

ROWS = 1800


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("passes")
    rng = np.random.default_rng(5)
    np.save(directory / "x.npy", np.arange(ROWS, dtype=np.int64))
    np.save(directory / "data.npy", np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4))
    documents = [np.full(int(n), i, dtype=np.int32) for i, n in enumerate(rng.integers(1, 9, size=ROWS))]
    write_ragged(directory / "docs.ragged", documents)
    np.save(directory / "stream.npy", np.arange(ROWS * 4 + 1, dtype=np.int32))  # ROWS windows of 4
    np.save(directory / "small.npy", np.arange(10_000, 10_300, dtype=np.int64))
    return directory


def rows_of(batch, kind: str) -> np.ndarray:
    """The row ids a batch holds, read from its data (not from its indices)."""
    if kind == "rows":
        return np.asarray(batch["x"])
    if kind == "padded":
        return np.asarray(batch["tokens"])[:, 0]
    if kind == "packed":
        offsets = np.asarray(batch["tokens.offsets"]).astype(np.int64)
        if len(offsets) - 1 < 256:  # A partial batch's values are cut where its kept rows end.
            assert len(batch["tokens"]) == offsets[-1]
        return np.asarray(batch["tokens"])[offsets[:-1]]
    return np.asarray(batch["tokens"])[:, 0] // 4  # windows: row i starts at element 4 i


def fields_of(directory, kind: str) -> dict:
    return {
        "rows": {"x": str(directory / "x.npy")},
        "padded": {"tokens": Padded(str(directory / "docs.ragged"), max_length=8)},
        "packed": {"tokens": Packed(str(directory / "docs.ragged"))},
        "windows": {"tokens": Windows(str(directory / "stream.npy"), length=4)},
    }[kind]


@pytest.mark.parametrize("kind", ["rows", "padded", "packed", "windows"])
@pytest.mark.parametrize("readers", [1, 3])
def test_an_evaluation_pass_gives_every_row_once_in_order(data, kind, readers):
    with ShmDataLoader(fields_of(data, kind), batch_size=256, mode="sequential", epochs=1, readers=readers) as loader:
        assert len(loader) == 8
        batches = [(np.array(batch.indices), np.array(rows_of(batch, kind))) for batch in loader]
        assert [len(indices) for indices, _ in batches] == [256] * 7 + [8]
        np.testing.assert_array_equal(np.concatenate([rows for _, rows in batches]), np.arange(ROWS))
        np.testing.assert_array_equal(np.concatenate([indices for indices, _ in batches]), np.arange(ROWS))
        assert loader.stats()["rows"] == ROWS
        with pytest.raises(StopIteration):
            next(loader)


def test_iterating_a_finished_pass_again_raises_instead_of_giving_no_batch(data):
    """Before: a second `for batch in loader` over an ended pass gave 0 batches, silently
    (a framework that iterates its dataloader once per epoch trained on nothing)."""
    with ShmDataLoader(fields_of(data, "rows"), batch_size=256, mode="sequential", epochs=1, readers=1) as loader:
        assert sum(1 for _ in loader) == 8
        with pytest.raises(RuntimeError, match=r"pass \(epochs=1, 8 steps\) has ended"):
            for _ in loader:
                pass
        loader.seek(0)  # Replaying the pass is asked for by name.
        assert sum(1 for _ in loader) == 8


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_shards_split_an_evaluation_pass_exactly_with_the_same_steps(data, shards):
    counts, union = [], []
    for shard in range(shards):
        with ShmDataLoader({"x": str(data / "x.npy")}, batch_size=128, mode="sequential", epochs=1, readers=1,
                           shard_index=shard, shard_count=shards) as loader:
            sizes = [len(batch["x"]) for batch in loader]
            counts.append(len(sizes))
            assert len(loader) == len(sizes)
        with ShmDataLoader({"x": str(data / "x.npy")}, batch_size=128, mode="sequential", epochs=1, readers=1,
                           shard_index=shard, shard_count=shards) as loader:
            kept = [np.array(batch["x"]) for batch in loader]
            assert all(len(rows) == 128 for rows in kept[:-1]) and 0 <= len(kept[-1]) <= 128
            union.extend(np.concatenate(kept).tolist())
    assert len(set(counts)) == 1  # Every host steps alike: collectives stay matched.
    assert sorted(union) == list(range(ROWS))


def test_n_shuffled_epochs_give_every_row_n_times_and_drop_last_only_full_batches(data):
    with ShmDataLoader({"x": str(data / "x.npy")}, batch_size=256, epochs=3, readers=2, seed=4) as loader:
        counts = collections.Counter(int(x) for batch in loader for x in batch["x"])
        assert len(loader) == -(-3 * ROWS // 256)
    assert set(counts.values()) == {3} and len(counts) == ROWS
    with ShmDataLoader({"x": str(data / "x.npy")}, batch_size=256, epochs=3, drop_last=True, readers=2, seed=4) as loader:
        sizes = [len(batch["x"]) for batch in loader]
    assert sizes == [256] * (3 * ROWS // 256)


def test_shuffle_windows_and_windows_over_shards_cover_each_epoch(data):
    with ShmDataLoader({"x": str(data / "x.npy")}, batch_size=100, epochs=2, shuffle_window=600, readers=2) as loader:
        counts = collections.Counter(int(x) for batch in loader for x in batch["x"])
    assert set(counts.values()) == {2} and len(counts) == ROWS
    union, lengths = collections.Counter(), set()
    for shard in range(2):
        with ShmDataLoader({"x": str(data / "x.npy")}, batch_size=100, epochs=1, shuffle_window=600, readers=1,
                           shard_index=shard, shard_count=2) as loader:
            lengths.add(len(loader))
            union.update(int(x) for batch in loader for x in batch["x"])
    assert len(lengths) == 1 and set(union.values()) == {1} and len(union) == ROWS


def test_resume_mid_pass_is_exact(data):
    options = dict(batch_size=128, epochs=2, readers=2, seed=9)
    with ShmDataLoader({"x": str(data / "x.npy")}, **options) as loader:
        whole = [np.array(batch["x"]) for batch in loader]
    with ShmDataLoader({"x": str(data / "x.npy")}, **options) as loader:
        head = [np.array(batch["x"]) for _, batch in zip(range(10), loader)]
        state = loader.state_dict()
    assert state["epochs"] == 2 and state["step"] == 10
    with ShmDataLoader({"x": str(data / "x.npy")}, **options) as loader:
        loader.load_state_dict(state)
        tail = [np.array(batch["x"]) for batch in loader]
    for expected, found in zip(whole, head + tail):
        np.testing.assert_array_equal(expected, found)
    assert len(head + tail) == len(whole)
    with ShmDataLoader({"x": str(data / "x.npy")}, batch_size=128, epochs=3, readers=1, seed=9) as other:
        with pytest.raises(ValueError, match="epochs"):
            other.load_state_dict(state)


def test_a_transform_and_a_mixture_in_a_finite_pass(data):
    fields = {"data": str(data / "data.npy")}
    with ShmDataLoader(fields, batch_size=256, mode="sequential", epochs=1, readers=2,
                       transform="transform_fixtures:scaled", transform_args={"scale": 2}) as loader:
        xs = [np.array(batch["x"]) for batch in loader]
    np.testing.assert_array_equal(np.concatenate(xs), np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4) * 2)
    mixture = [Source({"x": str(data / "x.npy")}, weight=3), Source({"x": str(data / "small.npy")}, weight=1)]
    with ShmDataLoader(mixture, batch_size=100, epochs=1, readers=2) as loader:
        seen = collections.Counter(int(x) for batch in loader for x in batch["x"])
        # An epoch of a mixture: the fewest whole blocks in which every source gives its epoch.
        assert len(loader) == -(-4 * max(-(-ROWS // 3), 300) // 100)
    assert all(seen[row] >= 1 for row in range(ROWS)) and all(seen[row] >= 1 for row in range(10_000, 10_300))


def test_a_finite_pass_ends_to_device_and_has_no_length_when_endless(data):
    torch = pytest.importorskip("torch")
    with ShmDataLoader({"x": str(data / "x.npy")}, batch_size=256, mode="sequential", epochs=1, readers=1) as loader:
        tensors = [batch["x"].clone() for batch in loader.to_device("cpu")]
    assert torch.equal(torch.cat(tensors), torch.arange(ROWS))
    with ShmDataLoader({"x": str(data / "x.npy")}, batch_size=256, readers=1) as loader:
        with pytest.raises(TypeError, match="no length"):
            len(loader)
        assert loader  # An endless loader is still true.


@pytest.mark.parametrize("rows,shards,batch,window", [
    (256, 4, 16, 50), (256, 4, 16, None), (1000, 3, 16, 200), (1000, 3, 16, None), (1800, 2, 100, 600),
    (333, 5, 7, 60), (333, 5, 7, None), (97, 2, 48, 30), (500, 1, 64, 100)],
    ids=lambda value: str(value))
def test_drop_last_drops_only_what_does_not_divide_among_shards(tmp_path, rows, shards, batch, window):
    """rows // (shards * batch) full global batches, with or without a shuffle window split
    among shards (before: 256 rows, 4 shards of 16 and a window of 50 dropped a whole global
    batch, 64 rows, since the shards' shares differ by a block)."""
    np.save(tmp_path / "x.npy", np.arange(rows, dtype=np.int64))
    counts, lengths = collections.Counter(), set()
    for shard in range(shards):
        with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=batch, epochs=1, drop_last=True, readers=0,
                           shuffle_window=window, shard_index=shard, shard_count=shards, seed=2) as loader:
            sizes = [len(got["x"]) for got in loader if counts.update(got["x"].tolist()) or True]
            assert set(sizes) == {batch} and len(sizes) == len(loader)
            lengths.add(len(loader))
    assert len(lengths) == 1
    assert sum(counts.values()) == rows // (shards * batch) * shards * batch and set(counts.values()) == {1}


@pytest.mark.parametrize("rows,shards,batch,window", [
    (1000, 3, 128, None), (1000, 3, 16, 200), (17, 4, 8, None), (250, 4, 1, None), (256, 4, 16, 50)],
    ids=lambda value: str(value))
def test_no_shard_gets_an_empty_batch_at_the_end_of_a_pass(tmp_path, rows, shards, batch, window):
    """The rows after the last step that is whole on every shard are dealt evenly (before: 1000
    rows on 3 shards of 128 gave shard 2 an empty last batch, a NaN loss in DDP). Every row
    once among the rows not marked padding (batch_size 1: 250 rows on 4 shards end on a step
    of 2 rows and 2 repeats; before, those 2 rows were left out)."""
    np.save(tmp_path / "x.npy", np.arange(rows, dtype=np.int64))
    counts, lengths = collections.Counter(), set()
    for shard in range(shards):
        with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=batch, epochs=1, readers=1, seed=2,
                           shuffle_window=window, shard_index=shard, shard_count=shards) as loader:
            sizes = [len(got["x"]) for got in loader if counts.update(got["x"][~got.padding].tolist()) or True]
            assert min(sizes) >= 1 and len(sizes) == len(loader)
            lengths.add(len(loader))
    assert len(lengths) == 1 and set(counts.values()) == {1} and len(counts) == rows

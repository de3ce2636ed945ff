"""Many files and weighted mixtures stay stateless and exact: every block of sum(weights)
positions holds each source's exact share, each source covers its rows (or its fraction
of them) once per source epoch, batches equal a reference whatever the reader count or
resume step, shards are disjoint, a 10,000-file field maps rows at every boundary, and
bad declarations name what is wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shmloader import ShmDataLoader, Source, StorageError
from shmloader.plan.sources import MixtureSampler, interleave

WEIGHTS = [7, 2, 1]


def stream(sampler: MixtureSampler, steps: int) -> tuple[np.ndarray, np.ndarray]:
    pairs = [sampler.fill(step) for step in range(steps)]
    return np.concatenate([rows for rows, _ in pairs]), np.concatenate([sources for _, sources in pairs])


def test_the_interleave_gives_each_source_its_weight_spread_evenly():
    sources, ranks = interleave(WEIGHTS)
    assert np.bincount(sources).tolist() == WEIGHTS
    for source, weight in enumerate(WEIGHTS):
        assert ranks[sources == source].tolist() == list(range(weight))
    assert sources[:5].tolist() != [0, 0, 0, 0, 0]  # Spread, not seven in a row.


def test_every_block_holds_each_sources_exact_share():
    sampler = MixtureSampler([500, 80, 30], WEIGHTS, [1.0, 1.0, 1.0], [False] * 3, batch_size=13, seed=4)
    _, sources = stream(sampler, 200)  # 2,600 positions: 260 blocks, batches straddling them.
    blocks = sources[: len(sources) // 10 * 10].reshape(-1, 10)
    for block in blocks:
        assert np.bincount(block, minlength=3).tolist() == WEIGHTS


@pytest.mark.parametrize("fraction,fixed", [(1.0, False), (0.3, False), (0.3, True)])
def test_each_source_covers_its_rows_once_per_source_epoch(fraction, fixed):
    lengths = [70, 40, 10]
    sampler = MixtureSampler(lengths, WEIGHTS, [1.0, fraction, 1.0], [False, fixed, False], batch_size=10, seed=9)
    rows, sources = stream(sampler, 400)
    take = math.ceil(fraction * 40)
    drawn = rows[sources == 1]
    subsets = []
    for epoch in range(len(drawn) // take):
        part = drawn[epoch * take:(epoch + 1) * take]
        assert len(set(part.tolist())) == take  # Once each within the epoch.
        subsets.append(frozenset(part.tolist()))
    assert all(row < 40 for row in drawn)
    if fraction == 1.0:
        assert all(subset == frozenset(range(40)) for subset in subsets)
    elif fixed:
        assert len(set(subsets)) == 1  # One subset, visited in a new order each epoch.
    else:
        assert len(set(subsets)) > 1  # A fresh subset each epoch.
    small = rows[sources == 2]  # 10 rows, a weight of 1: it repeats while the others go on.
    assert all(sorted(small[e * 10:(e + 1) * 10].tolist()) == list(range(10)) for e in range(len(small) // 10))


@pytest.fixture
def three_sources(tmp_path):
    values = {}
    for source, rows in enumerate((70, 40, 10)):
        data = np.arange(rows, dtype=np.int64) + 1000 * source
        np.save(tmp_path / f"s{source}.npy", data)
        values[source] = data
    return values, [
        Source({"x": str(tmp_path / "s0.npy")}, weight=7),
        Source({"x": str(tmp_path / "s1.npy")}, weight=2, fraction=0.5),
        Source({"x": str(tmp_path / "s2.npy")}, weight=1, fraction=0.3, fixed=True),
    ]


@pytest.mark.parametrize("readers", [1, 3])
def test_mixture_batches_equal_the_reference_and_resume_exactly(three_sources, readers):
    values, sources = three_sources
    reference = MixtureSampler([70, 40, 10], WEIGHTS, [1.0, 0.5, 0.3], [False, False, True], batch_size=16, seed=2)
    with ShmDataLoader(sources, batch_size=16, readers=readers, seed=2) as loader:
        for step in range(30):
            batch = next(loader)
            rows, ids = reference.fill(step)
            assert np.array_equal(batch["source"], ids) and np.array_equal(batch.indices, rows)
            assert np.array_equal(batch["x"], [values[int(s)][int(r)] for s, r in zip(ids, rows)])
        state = loader.state_dict()
    with ShmDataLoader(sources, batch_size=16, readers=2, seed=2, start_step=17) as resumed:
        for step in range(17, 30):
            rows, ids = reference.fill(step)
            assert np.array_equal(next(resumed)["source"], ids)
        resumed.load_state_dict(state)
        assert next(resumed).step == 30


def test_shards_are_disjoint_blocks_of_one_global_mixture_batch(three_sources):
    _, sources = three_sources
    with ShmDataLoader(sources, batch_size=16, readers=1, seed=5) as whole:
        expected = [(np.array(b["source"]), np.array(b.indices)) for b in (next(whole) for _ in range(5))]
    halves = []
    for shard in (0, 1):
        with ShmDataLoader(sources, batch_size=8, readers=1, seed=5, shard_index=shard, shard_count=2) as loader:
            halves.append([(np.array(b["source"]), np.array(b.indices)) for b in (next(loader) for _ in range(5))])
    for step in range(5):
        assert np.array_equal(np.concatenate([halves[0][step][0], halves[1][step][0]]), expected[step][0])
        assert np.array_equal(np.concatenate([halves[0][step][1], halves[1][step][1]]), expected[step][1])


def test_a_checkpoint_of_other_sources_is_refused_saying_what_changed(three_sources):
    _, sources = three_sources
    with ShmDataLoader(sources, batch_size=16, readers=1, seed=2) as loader:
        state = loader.state_dict()
    changed = [sources[0], Source(sources[1].fields, weight=3, fraction=0.5), sources[2]]
    with ShmDataLoader(changed, batch_size=16, readers=1, seed=2) as loader:
        with pytest.raises(ValueError, match=r"source 1 weight: 2 in the checkpoint, 3 now"):
            loader.load_state_dict(state)


def test_a_field_of_10000_files_maps_rows_at_every_boundary(tmp_path):
    directory = tmp_path / "shards"
    directory.mkdir()
    sizes = [1 + (shard * 7) % 3 for shard in range(10_000)]  # 1 to 3 rows each.
    start = 0
    for shard, size in enumerate(sizes):
        np.save(directory / f"part-{shard:05d}.npy", np.arange(start, start + size, dtype=np.int64))
        start += size
    batch_size = 500
    with ShmDataLoader({"x": str(directory / "part-*.npy")}, batch_size=batch_size, readers=2,
                       mode="sequential") as loader:
        for step in range(-(-start // batch_size)):
            batch = next(loader)
            assert np.array_equal(batch["x"], batch.indices.astype(np.int64)), step
        assert loader.plan.plans["x"].row_count == start and len(loader.plan.plans["x"].parts) == 10_000


def test_files_of_one_field_must_match_and_bad_sources_are_named(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((5, 3), dtype=np.float32))
    np.save(tmp_path / "b.npy", np.zeros((5, 4), dtype=np.float32))
    np.save(tmp_path / "empty.npy", np.zeros((0, 3), dtype=np.float32))
    with pytest.raises(StorageError, match=r"field 'x': .*b\.npy has row shape and dtype \(\(4,\), '<f4'\), but .*a\.npy"):
        ShmDataLoader({"x": [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]}, batch_size=2, readers=1)
    with pytest.raises(StorageError, match=r"empty\.npy: the array has zero rows"):
        ShmDataLoader({"x": [str(tmp_path / "a.npy"), str(tmp_path / "empty.npy")]}, batch_size=2, readers=1)
    with pytest.raises(FileNotFoundError, match=r"field 'x': no file matches .*nothing-\*\.npy"):
        ShmDataLoader({"x": str(tmp_path / "nothing-*.npy")}, batch_size=2, readers=1)
    one = {"x": str(tmp_path / "a.npy")}
    with pytest.raises(ValueError, match=r"source 1 weight must be in \[1, \d+\], got 0"):
        ShmDataLoader([Source(one), Source(one, weight=0)], batch_size=2, readers=1)
    with pytest.raises(ValueError, match=r"source 0: fraction must be a number in \(0, 1\], got 1.5"):
        ShmDataLoader([Source(one, fraction=1.5)], batch_size=2, readers=1)
    with pytest.raises(StorageError, match=r"source 1: fields \['y'\] differ from source 0's \['x'\]"):
        ShmDataLoader([Source(one), Source({"y": str(tmp_path / "a.npy")})], batch_size=2, readers=1)
    with pytest.raises(ValueError, match="mode must be 'shuffle'"):
        ShmDataLoader([Source(one)], batch_size=2, readers=1, mode="sequential")


@pytest.mark.parametrize("verify", [False, True], ids=["unchecked", "checked-by-block-digests"])
def test_a_field_of_b2nd_shards_reads_like_one_file(tmp_path, verify):
    from shmloader.plan.sampler import Sampler
    from shmloader.tools.convert import convert

    rows = np.random.default_rng(0).integers(0, 255, size=(700, 96), dtype=np.uint8)
    for shard, start in enumerate(range(0, 700, 30)):  # 24 shards, the last one short.
        convert(rows[start:start + 30], tmp_path / f"img-{shard:03d}.b2nd", codec="lz4", progress=False)
    sampler = Sampler(700, 64, seed=3)
    with ShmDataLoader({"x": str(tmp_path / "img-*.b2nd")}, batch_size=64, readers=2, seed=3,
                       verify=verify) as loader:
        for _ in range(25):
            batch = next(loader)
            assert np.array_equal(batch["x"], rows[sampler.fill(batch.step)])
    shards = sorted(str(path) for path in tmp_path.glob("img-*.b2nd"))
    mixture = [Source({"x": shards}, weight=3), Source({"x": shards[:2]}, weight=1)]
    with ShmDataLoader(mixture, batch_size=64, readers=2, seed=3, verify=verify) as loader:
        for _ in range(10):
            batch = next(loader)
            assert np.array_equal(batch["x"], rows[batch.indices])

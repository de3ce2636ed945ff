"""A dataset's __getitem__ runs once per delivered sample, with the global generators seeded
from the sample's position (fill/global_seeds.py): a dataset that memoizes its draws, counts
its calls or draws from Python's, numpy's and torch's generators gives, for any reader
count, what seeding each sample in one process gives. Before: a reader filled a batch with
one seeding, saw a generator drawn from, and filled it again seeded per sample, so a
memoizing dataset kept the first, wrongly seeded values (a different set each run), and
with readers=0 the probe of dataset[0] ran on the trainer's own object, unseeded."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from conftest import seed_sample_generators
from shmloader import ShmDataLoader
from shmloader.fill.dataset_runner import sample_seeds

ROWS, BATCH, SEED = 48, 5, 9


class Memo:
    """Lazily generated synthetic data: a sample's draw is made at its first call, kept."""

    def __init__(self) -> None:
        self.memo = {}

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int):
        if index not in self.memo:
            self.memo[index] = np.float64(np.random.random() + random.random())
        return self.memo[index]


class Counting:
    """Appends each call's index to a file (one line a call, from any process)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int):
        with open(self.path, "a") as log:
            log.write(f"{index}\n")
        return np.int64(index * 1000 + random.randrange(1000))


class AllThree:
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int):
        import torch

        return np.array([random.random(), np.random.random(), float(torch.rand(()))])


def _delivered(dataset, readers: int) -> tuple[dict, int]:
    """{index: value} over one pass, and the samples delivered (padding included)."""
    found, samples = {}, 0
    with ShmDataLoader.from_dataset(dataset, batch_size=BATCH, readers=readers, seed=SEED, epochs=1,
                                    shard_index=0, shard_count=1) as loader:
        for batch in loader:
            values = np.array(batch["data"])
            samples += len(values)
            for index, value in zip(batch.indices.tolist(), values):
                found[index] = value.tolist()
    return found, samples


def _seed_every_generator(value: int) -> None:
    seed_sample_generators(value)


def _reference(make) -> dict:
    """Each index's sample with every generator seeded from its position, in one process,
    on an object of its own per sample: what the per-sample promise says."""
    with ShmDataLoader.from_dataset(make(), batch_size=BATCH, readers=0, seed=SEED, epochs=1) as loader:
        keys = {index: key for batch in loader for index, key in
                zip(batch.indices.tolist(), loader.sampler.row_keys(batch.step, len(batch.indices)).tolist())}
    found = {}
    for index, key in keys.items():
        _seed_every_generator(sample_seeds(SEED, np.array([key], dtype=np.uint64))[0])
        found[index] = np.asarray(make()[index]).tolist()
    return found


@pytest.mark.parametrize("readers", [0, 1, 2, 4])
def test_a_memoizing_dataset_equals_seeding_each_sample_in_one_process(readers):
    found, samples = _delivered(Memo(), readers)
    assert samples == ROWS and found == _reference(Memo)


@pytest.mark.parametrize("readers", [0, 1, 2])
def test_a_counting_dataset_is_called_once_per_delivered_sample(tmp_path, readers):
    path = str(tmp_path / "calls")
    found, samples = _delivered(Counting(path), readers)
    with open(path) as log:
        calls = [int(line) for line in log]
    # The probe of dataset[0] calls a copy (the readers' pickle, or with readers=0 one of its
    # own), never the object that fills the batches; the copy writes to the same file.
    probe = [0]
    assert sorted(calls) == sorted(probe + list(range(ROWS))) and samples == ROWS
    assert found == _reference(lambda: Counting(os.devnull))


def test_with_readers_0_the_probe_leaves_the_trainer_s_object_untouched():
    dataset = Memo()
    with ShmDataLoader.from_dataset(dataset, batch_size=BATCH, readers=0, seed=SEED, epochs=1) as loader:
        assert dataset.memo == {}  # Before: dataset[0] memoized there, unseeded.
        found = {index: float(value) for batch in loader for index, value in zip(batch.indices.tolist(), batch["data"])}
    assert found == _reference(Memo)


def test_a_dataset_drawing_from_all_three_generators_gives_the_same_samples_for_any_reader_count():
    pytest.importorskip("torch")
    expected = _reference(AllThree)
    for readers in (0, 1, 2):
        found, samples = _delivered(AllThree(), readers)
        assert samples == ROWS and found == expected, readers

"""shmloader.torch: PyTorch's shapes for a loader. Batches are dicts of tensors that view
the slots (no copy), equal to the data, with their rows' indices; len() is the steps left of
the pass; a checkpoint of the wrapper resumes exactly, through Hugging Face's Trainer too;
a torch DataLoader around it works with batch_size=None and refuses worker processes,
forked or spawned, saying what to do."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shmloader import ShmDataLoader  # noqa: E402
from shmloader.torch import ShmIterableDataset, TorchLoader  # noqa: E402


@pytest.fixture
def rows(tmp_path):
    data = np.random.default_rng(3).standard_normal((203, 5)).astype(np.float32)
    labels = np.arange(203, dtype=np.int64)
    np.save(tmp_path / "x.npy", data)
    np.save(tmp_path / "y.npy", labels)
    return {"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")}, data, labels


def test_a_torch_loader_gives_tensors_equal_to_the_data_for_one_pass(rows):
    fields, data, labels = rows
    with TorchLoader(ShmDataLoader(fields, batch_size=16, epochs=1, readers=2, seed=4)) as train:
        assert len(train) == 13 and train.loader.batch_size == 16
        seen = []
        for batch in train:
            assert isinstance(batch["x"], torch.Tensor) and batch["x"].dtype == torch.float32
            np.testing.assert_array_equal(batch["x"].numpy(), data[batch["y"].numpy()])
            seen += batch["y"].tolist()
    assert sorted(seen) == list(range(203))  # Every row once in the pass.


def test_a_checkpoint_of_the_wrapper_resumes_exactly(rows):
    fields, _, _ = rows
    with TorchLoader(ShmDataLoader(fields, batch_size=16, readers=1, seed=4)) as train:
        iterator = iter(train)
        for _ in range(5):
            next(iterator)
        state = train.state_dict()
        expected = [next(iterator)["y"].clone() for _ in range(4)]
    with TorchLoader(ShmDataLoader(fields, batch_size=16, readers=2, seed=4)) as train:
        train.load_state_dict(state)
        iterator = iter(train)
        for labels in expected:
            assert torch.equal(next(iterator)["y"], labels)


def test_a_torch_dataloader_wraps_it_with_batch_size_none_and_refuses_workers(rows):
    fields, data, _ = rows
    with ShmDataLoader(fields, batch_size=16, epochs=1, readers=1) as loader:
        wrapped = torch.utils.data.DataLoader(ShmIterableDataset(loader), batch_size=None)
        assert len(wrapped) == 13
        batch = next(iter(wrapped))
        np.testing.assert_array_equal(batch["x"].numpy(), data[batch["y"].numpy()])
    with ShmDataLoader(fields, batch_size=16, readers=1) as loader:
        workers = iter(torch.utils.data.DataLoader(ShmIterableDataset(loader), batch_size=None, num_workers=1))
        with pytest.raises(RuntimeError, match="num_workers=0"):
            next(workers)
        del workers
        # The refusal's traceback holds the iterator: its worker is joined here (torch waits
        # up to 5 s for it), not in whichever later test collects it.
        gc.collect()


def test_batches_keep_their_row_indices_and_len_is_the_steps_left_after_a_resume(rows):
    """Before: TorchLoader dropped `indices` (rows could not be counted), and len() after
    load_state_dict said the whole pass (13) where 8 steps were left."""
    fields, _, _ = rows
    with TorchLoader(ShmDataLoader(fields, batch_size=16, epochs=1, readers=1, seed=4)) as train:
        iterator = iter(train)
        for _ in range(5):
            batch = next(iterator)
            assert batch["indices"].dtype == torch.int64  # torch's index type; gloo broadcasts it.
            assert torch.equal(batch["indices"], batch["y"])  # y is arange: a row's label is its index.
        state = train.state_dict()
        del batch, iterator
    with TorchLoader(ShmDataLoader(fields, batch_size=16, epochs=1, readers=1, seed=4)) as train:
        assert len(train) == 13
        train.load_state_dict(state)
        assert len(train) == len(train.dataset) == 8
        seen = [index for batch in train for index in batch["indices"].tolist()]
    assert len(seen) == 203 - 5 * 16 and len(set(seen)) == len(seen)
    with TorchLoader(ShmDataLoader(fields, batch_size=16, readers=0), indices=False) as train:
        assert set(next(iter(train))) == {"x", "y"}  # For a model that takes the batch as its keyword arguments.


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_dataloader_workers_are_refused_saying_what_to_do(rows, method):
    """Before: `TypeError: cannot pickle 'ShmDataLoader' object`, no hint."""
    fields, _, _ = rows
    with ShmDataLoader(fields, batch_size=16, readers=0) as loader:
        wrapped = torch.utils.data.DataLoader(ShmIterableDataset(loader), batch_size=None, num_workers=1,
                                              multiprocessing_context=method)
        with pytest.raises(TypeError, match=r"num_workers=0.*TorchLoader"):
            iter(wrapped)
        with pytest.raises(TypeError, match="num_workers=0"):
            pickle.dumps(TorchLoader(loader))


def test_hugging_face_trainer_resumes_from_a_checkpoint_exactly(rows, tmp_path):
    """Before: resume_from_checkpoint raised AttributeError: 'TorchLoader' object has no
    attribute 'drop_last' (accelerate.skip_first_batches); a DataLoader rebuilt from the
    wrapper's batch_size would have stacked 16 batches into one."""
    transformers = pytest.importorskip("transformers")
    fields, _, _ = rows
    trained = []  # Per training step, the rows the model saw.

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(5, 1)

        def forward(self, x, y, indices):
            trained.append(indices.tolist())
            return {"loss": self.linear(x).square().mean()}

    class Trainer(transformers.Trainer):
        loaders = []

        def get_train_dataloader(self) -> TorchLoader:
            self.loaders.append(TorchLoader(ShmDataLoader(fields, batch_size=16, readers=1, seed=4)))
            return self.loaders[-1]

    def train(resume=None) -> list:
        trained.clear()
        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=6, save_steps=3, use_cpu=True, report_to="none",
            remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True, logging_strategy="no")
        trainer = Trainer(model=Model(), args=arguments)
        try:
            trainer.train(resume_from_checkpoint=resume)
        finally:
            for loader in Trainer.loaders:
                loader.close()
        return list(trained)

    whole = train()
    assert len(whole) == 6
    assert train(str(tmp_path / "checkpoint-3")) == whole[3:]


@pytest.mark.parametrize("settings, refusal", [
    ({"epochs": None}, None),  # Endless: every dispatch is two whole batches.
    ({"epochs": 1, "drop_last": True}, None),  # 12 batches of 16: six whole dispatches.
    ({"epochs": 1}, "drop_last=True"),  # 13 batches, the last of 11 rows: padded with rows of the first.
    ({"epochs": None, "shard_count": 2}, "shard_count=1"),  # The dispatcher would never read shard 1.
])
def test_accelerates_dispatcher_is_refused_where_it_would_lose_or_repeat_rows(rows, settings, refusal):
    """What ShmIterableDataset checks on every rank under accelerate's dispatcher (two
    processes here; tests/test_distributed.py runs the real one under torchrun)."""
    from shmloader.torch.adapters import _check_dispatched

    fields, _, _ = rows
    with ShmDataLoader(fields, batch_size=16, readers=0, **settings) as loader:
        if refusal is None:
            _check_dispatched(loader, 2)
        else:
            with pytest.raises(ValueError, match=refusal):
                _check_dispatched(loader, 2)

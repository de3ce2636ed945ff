"""shmloader.torch: PyTorch's shapes for a loader. Batches are dicts of tensors that view
the slots (no copy), equal to the data; len() is the pass's; a checkpoint of the wrapper
resumes exactly; a torch DataLoader around it works with batch_size=None and refuses
worker processes."""

from __future__ import annotations

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
        assert len(train) == 13 and train.batch_size == 16
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
        with pytest.raises(RuntimeError, match="num_workers=0"):
            next(iter(torch.utils.data.DataLoader(ShmIterableDataset(loader), batch_size=None, num_workers=1)))

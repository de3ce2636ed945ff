"""Where shmloader.torch.DataLoader still gives other batches than torch.utils.data.DataLoader
for a script torch runs, each case beside torch's own loader as the reference: every test
here is a known divergence, marked xfail(strict=True), so that the fix that closes one
shows (the test then passes and strict fails it until the mark goes)."""

from __future__ import annotations

import collections
import copy

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.timeout(300, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from shmloader.torch import DataLoader  # noqa: E402
from test_torch_iterable import assert_same  # noqa: E402


class Made(Dataset):
    """Samples made by a module-level function (so that they pickle), `length` of them."""

    def __init__(self, make, length: int = 7) -> None:
        self.make, self.length = make, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.make(index)


def _batches(loader_class, dataset, epochs: int = 1, **arguments) -> list:
    loader = loader_class(dataset, **arguments)
    try:
        return [copy.deepcopy(batch) for _ in range(epochs) for batch in loader]
    finally:
        if hasattr(loader, "close"):
            loader.close()


def _compare(dataset_of, epochs: int = 1, **arguments) -> None:
    expected = _batches(TorchDataLoader, dataset_of(), epochs, **arguments)
    found = _batches(DataLoader, dataset_of(), epochs, **arguments)
    assert_same(expected, found)


def _key_bytes(index: int) -> dict:
    return {"key": b"k" * (index + 1), "label": index}


def _same_length_bytes(index: int) -> dict:
    return {"key": bytes([index]) * 3}


@pytest.mark.xfail(strict=True, reason="a bytes leaf is the core's uint8 array (plan/dataset.py): the drop-in gives a "
                                       "(B, n) uint8 tensor, and refuses bytes of varying length, where default_collate "
                                       "gives the list of bytes (as it gives a str leaf's list of str)")
@pytest.mark.parametrize("make", [_key_bytes, _same_length_bytes], ids=["varying length", "one length"])
def test_a_bytes_leaf_comes_as_default_collates_list_of_bytes(make):
    _compare(lambda: Made(make), batch_size=3)




class Batch:
    """A collate_fn's own batch class, no dataclass (torch_geometric's Batch, with .to()): a
    dataclass comes back as its class (plan/collated.py)."""

    def __init__(self, samples: list) -> None:
        self.x = torch.stack([torch.tensor([float(sample)]) for sample in samples])

    def __eq__(self, other) -> bool:
        return type(other) is Batch and torch.equal(self.x, other.x)


@pytest.mark.xfail(strict=True, reason="a collate_fn's batch is written into the slot as arrays and JSON "
                                       "(plan/collated.py): an object of a class that is no dataclass, Mapping or "
                                       "namedtuple is refused by name; torch pickles it through the worker's queue")
def test_a_collate_fn_returning_its_own_class_gives_that_object():
    _compare(lambda: Made(int), batch_size=3, collate_fn=Batch)


def _numbered(index: int) -> dict:
    return {0: index, 1: torch.tensor([index])}


@pytest.mark.xfail(strict=True, reason="a dict's keys name the slot's regions, so they must be str "
                                       "(plan/dataset_outputs.flatten); default_collate keeps any key")
def test_a_dict_with_int_keys_comes_as_torchs():
    _compare(lambda: Made(_numbered), batch_size=3)


def _defaultdict(index: int):
    return collections.defaultdict(list, {"x": torch.tensor([index])})


@pytest.mark.xfail(strict=True, reason="a Mapping sample is rebuilt by calling its class with a dict "
                                       "(plan/dataset.py _as_mapping), a plain dict where that raises; default_collate "
                                       "copies the first sample of a MutableMapping, so a defaultdict comes back a "
                                       "defaultdict with its default_factory (and a BatchEncoding with its attributes)")
def test_a_defaultdict_sample_comes_back_a_defaultdict():
    _compare(lambda: Made(_defaultdict), batch_size=3)

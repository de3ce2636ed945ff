"""shmloader.torch.DataLoader with collate_fn=, against PyTorch's own DataLoader given the same
dataset, batch size, order and collate: every batch equal (types, nesting, dtypes, values) for
a padding collate over token lists of 16-512 (lengths drawn by Hypothesis and by a seeded
RNG), a collate of dicts with str leaves, a list of str, ints, floats, None, bytes, a numpy
scalar and nested tuples, lists and namedtuples; num_workers 0 and 2, the loader's order and a
seeded RandomSampler. Batch k is the same under num_workers 0, 1 and 3 with a collate that
draws from torch's generator, after a reader is killed with SIGKILL, and after a resume from
state_dict() under another num_workers. A batch whose array outgrows the room the probe
learned grows the slot (said by a warning) and the batches stay torch's; one that outgrows
a declared room fails naming the leaf, its shape and the setting to raise."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import os
import signal

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# The drop-in forks its readers from the trainer unless threads run there; the harness's own
# (pytest-timeout's timer thread, an xdist worker's) are not the script's, so they are left out
# and the timer is a signal: these tests run the path a script takes (the spawn path has tests
# of its own, pinned with multiprocessing_context="spawn").
pytestmark = [pytest.mark.timeout(300, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.data import Dataset, RandomSampler  # noqa: E402
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402

from conftest import examples  # noqa: E402
from shmloader import ReaderRestartWarning  # noqa: E402
from shmloader.plan.collated import BESIDE  # noqa: E402
from shmloader.torch import CollateGrowthWarning, DataLoader  # noqa: E402


class Tokens(Dataset):
    """Token lists of the given lengths (their values tell the sample apart), a label and a name."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = list(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int):
        ids = (np.arange(self.lengths[index], dtype=np.int64) * 7 + index) % 30_000
        return {"input_ids": ids, "label": index % 5, "name": f"sample-{index}"}


def pad_collate(samples: list) -> dict:
    """DataCollatorWithPadding's shape: ids and mask padded to the batch's longest, labels."""
    longest = max(len(sample["input_ids"]) for sample in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest, dtype=torch.int64)
    for row, sample in enumerate(samples):
        ids[row, :len(sample["input_ids"])] = torch.from_numpy(sample["input_ids"])
        mask[row, :len(sample["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([s["label"] for s in samples])}


Pair = collections.namedtuple("Pair", ["left", "right"])


def mixed_collate(samples: list) -> dict:
    """Arrays and tensors beside leaves that are not arrays, nested."""
    lengths = [len(sample["input_ids"]) for sample in samples]
    return {"names": [sample["name"] for sample in samples], "first": samples[0]["name"], "count": len(samples),
            "mean": float(np.mean(lengths)), "none": None, "flag": lengths[0] > 100, "raw": b"\x00\xffab",
            "longest": np.int32(max(lengths)), "mean64": np.mean(lengths), "odd": np.bool_(lengths[0] % 2), "lengths": np.asarray(lengths, np.int32),
            "nested": (torch.tensor(lengths, dtype=torch.float16), [samples[-1]["name"], None, (1, 2.5)]),
            "pair": Pair(torch.arange(len(samples)), "right"), "empty": []}


def noisy_collate(samples: list) -> dict:
    """A padding collate that masks by torch's global generator (as a masking collate does)."""
    batch = pad_collate(samples)
    batch["noise"] = torch.rand(len(samples))
    return batch


def assert_same(expected, found, where: str = "batch") -> None:
    """Equal types, nesting, dtypes, shapes and values."""
    assert type(expected) is type(found), (where, type(expected), type(found))
    if isinstance(expected, dict):
        assert list(expected) == list(found), where
        for key in expected:
            assert_same(expected[key], found[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(found), where
        for index, (one, other) in enumerate(zip(expected, found)):
            assert_same(one, other, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert expected.dtype == found.dtype and torch.equal(expected, found), where
    elif isinstance(expected, np.ndarray):
        assert expected.dtype == found.dtype and np.array_equal(expected, found), where
    else:
        assert expected == found, (where, expected, found)


def batches(loader) -> list:
    return [copy.deepcopy(batch) for batch in loader]


def seeded_lengths(count: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(16, 513, count).tolist()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_padding_collate_gives_torchs_batches_with_the_room_learned_by_probing(num_workers, drop_last):
    dataset = Tokens(seeded_lengths(61, 3))
    expected = list(TorchDataLoader(dataset, batch_size=8, collate_fn=pad_collate, drop_last=drop_last))
    with DataLoader(dataset, batch_size=8, collate_fn=pad_collate, num_workers=num_workers,
                    drop_last=drop_last) as loader:
        found = batches(loader)
        assert loader.collate_fn is pad_collate
    assert len(found) == len(expected) == len(loader)
    assert len({batch["input_ids"].shape for batch in found}) > 2  # The padded shape changes batch to batch.
    for one, other in zip(expected, found):
        assert_same(one, other)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_collated_batch_the_loop_drops_goes_at_once_and_its_slot_is_reused_without_a_copy(num_workers):
    """Before: the rebuilt batch's builder referred to itself, a reference cycle holding the
    slot's arrays, so a dropped batch lived until the cycle collector ran and the ring gave
    nearly every slot's batch memory of its own (a copy) to go on."""
    import gc

    dataset = Tokens(seeded_lengths(200, 5))
    with DataLoader(dataset, batch_size=4, collate_fn=pad_collate, num_workers=num_workers) as loader:
        kept = loader._loader._session.kept
        gc.disable()
        try:
            most = 0
            for epoch in range(2):
                for batch in loader:
                    most = max(most, kept.count)
                    del batch
        finally:
            gc.enable()
    assert most == 0, most


@given(lengths=st.lists(st.integers(16, 512), min_size=7, max_size=30), batch_size=st.integers(1, 7),
       drop_last=st.booleans())
@examples(8)
def test_a_padding_collate_with_its_largest_shape_declared_gives_torchs_batches(lengths, batch_size, drop_last):
    dataset = Tokens(lengths)
    expected = list(TorchDataLoader(dataset, batch_size=batch_size, collate_fn=pad_collate, drop_last=drop_last))
    largest = {"input_ids": (batch_size, 512), "attention_mask": (batch_size, 512)}
    with DataLoader(dataset, batch_size=batch_size, collate_fn=pad_collate, drop_last=drop_last,
                    outputs=largest) as loader:
        found = batches(loader)
    assert len(found) == len(expected)
    for one, other in zip(expected, found):
        assert_same(one, other)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_leaves_that_are_not_arrays_come_back_as_the_collate_made_them(num_workers):
    dataset = Tokens(seeded_lengths(23, 4))
    expected = list(TorchDataLoader(dataset, batch_size=4, collate_fn=mixed_collate))
    with DataLoader(dataset, batch_size=4, collate_fn=mixed_collate, num_workers=num_workers) as loader:
        found = batches(loader)
    assert len(found) == len(expected) == 6
    for one, other in zip(expected, found):
        assert_same(one, other)
        assert type(other["pair"]) is Pair and type(other["longest"]) is np.int32
        assert type(other["mean64"]) is np.float64 and type(other["odd"]) is np.bool_


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_seeded_random_sampler_gives_torchs_batches_with_a_collate(num_workers):
    dataset = Tokens(seeded_lengths(30, 5))
    reference = TorchDataLoader(dataset, batch_size=4, collate_fn=mixed_collate,
                                sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(9)))
    expected = [batch for _ in range(2) for batch in reference]
    with DataLoader(dataset, batch_size=4, collate_fn=mixed_collate, num_workers=num_workers,
                    sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(9))) as loader:
        found = [batch for _ in range(2) for batch in batches(loader)]
    assert len(found) == len(expected) == 16
    for one, other in zip(expected, found):
        assert_same(one, other)


def test_batch_k_is_the_same_for_any_num_workers_and_after_a_resume_under_another():
    dataset = Tokens(seeded_lengths(29, 6))
    options = {"batch_size": 4, "shuffle": True, "seed": 12, "collate_fn": noisy_collate}
    runs = []
    for num_workers in (0, 1, 3):
        with DataLoader(dataset, num_workers=num_workers, **options) as loader:
            runs.append(batches(loader) + batches(loader))  # Two epochs.
    for run in runs[1:]:
        for one, other in zip(runs[0], run, strict=True):
            assert_same(one, other)
    assert not torch.equal(runs[0][0]["noise"], runs[0][1]["noise"])  # The collate's draws differ by step.
    with DataLoader(dataset, num_workers=3, **options) as loader:
        batches(loader)
        iterator = iter(loader)  # Epoch 1, interrupted after 3 batches.
        for _ in range(3):
            next(iterator)
        state = loader.state_dict()
    with DataLoader(dataset, num_workers=1, **options) as resumed:
        resumed.load_state_dict(state)
        rest = batches(resumed)
    for one, other in zip(runs[0][8 + 3:], rest, strict=True):
        assert_same(one, other)


class KillsOnce(Tokens):
    """Tokens whose reader SIGKILLs itself at sample `kill` while the count in `kills` is
    above zero (the replacement reader fills the step again)."""

    def __init__(self, lengths: list[int], kill: int, kills: str) -> None:
        super().__init__(lengths)
        self.kill, self.kills, self.trainer = kill, kills, os.getpid()

    def __getitem__(self, index: int):
        if index == self.kill and os.getpid() != self.trainer:
            with open(self.kills, "r+") as file:
                left = int(file.read())
                if left > 0:
                    file.seek(0)
                    file.write(f"{left - 1}\n")
                    file.truncate()
                    file.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


def test_a_reader_killed_mid_epoch_gives_the_same_batches(tmp_path):
    kills = tmp_path / "kills"
    kills.write_text("1\n")
    dataset = KillsOnce(seeded_lengths(27, 7), kill=13, kills=str(kills))
    expected = list(TorchDataLoader(dataset, batch_size=4, collate_fn=mixed_collate))
    with pytest.warns(ReaderRestartWarning):
        with DataLoader(dataset, batch_size=4, collate_fn=mixed_collate, num_workers=2) as loader:
            found = batches(loader)
    assert kills.read_text().strip() == "0"
    for one, other in zip(expected, found, strict=True):
        assert_same(one, other)


class LongInTheMiddle(Tokens):
    """Short samples but for one, far from the batches the loader probes."""

    def __init__(self) -> None:
        super().__init__([16] * 20)
        self.lengths[9] = 300


def _grown(records) -> list[str]:
    return [str(record.message) for record in records if issubclass(record.category, CollateGrowthWarning)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_array_larger_than_its_learned_room_grows_the_slot_and_the_batches_stay_torchs(num_workers):
    expected = list(TorchDataLoader(LongInTheMiddle(), batch_size=4, collate_fn=pad_collate))
    with pytest.warns(CollateGrowthWarning) as records:
        with DataLoader(LongInTheMiddle(), batch_size=4, collate_fn=pad_collate, num_workers=num_workers) as loader:
            # Batches kept, not copied: those given before the loader was built again keep their values.
            found = list(loader) + list(loader)  # The second epoch runs in the grown slot.
    grown = _grown(records)  # One growth for both arrays.
    assert len(grown) == 1 and "at step 2 of epoch 0" in grown[0], grown
    assert "'input_ids' needs 1200 elements, 'attention_mask' needs 1200 elements" in grown[0], grown
    for one, other in zip(expected + expected, found, strict=True):
        assert_same(one, other)


def test_a_slot_grown_in_a_later_shuffled_epoch_gives_the_batches_of_one_with_the_room_declared():
    """persistent_workers=False: the dataset as it is at each epoch, here longer in epoch 1."""
    options = {"batch_size": 4, "shuffle": True, "seed": 4, "collate_fn": noisy_collate, "num_workers": 2}
    runs = []
    for outputs in ({}, {"input_ids": (4, 300), "attention_mask": (4, 300)}):
        dataset = Tokens([16] * 20)
        with DataLoader(dataset, outputs=outputs, **options) as loader:
            first = batches(loader)
            dataset.lengths[9] = 300
            with pytest.warns(CollateGrowthWarning) if not outputs else contextlib.nullcontext():
                runs.append(first + batches(loader) + batches(loader))
    for one, other in zip(*runs, strict=True):
        assert_same(one, other)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampled_loaders_slot_grows_too(num_workers):
    def sampler():
        return RandomSampler(LongInTheMiddle(), generator=torch.Generator().manual_seed(3))

    expected = list(TorchDataLoader(LongInTheMiddle(), batch_size=4, collate_fn=pad_collate, sampler=sampler()))
    with pytest.warns(CollateGrowthWarning):
        with DataLoader(LongInTheMiddle(), batch_size=4, collate_fn=pad_collate, sampler=sampler(),
                        num_workers=num_workers) as loader:
            found = batches(loader)
    for one, other in zip(expected, found, strict=True):
        assert_same(one, other)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_array_larger_than_its_declared_room_is_named_with_its_shape_and_the_setting(num_workers):
    with DataLoader(LongInTheMiddle(), batch_size=4, collate_fn=pad_collate, num_workers=num_workers,
                    outputs={"input_ids": (4, 16)}) as loader:
        with pytest.raises(ValueError, match=r"'input_ids'\] has shape \(4, 300\) \(1200 elements\), more than the "
                                             r"64 the slot holds.*outputs=\{'input_ids': \(\.\.\.\)\}"):
            batches(loader)


def many_names(samples: list) -> list:
    return [sample["name"] * (200 if sample["label"] == 3 and len(samples) == 4 else 1) for sample in samples]


def test_leaves_beside_the_arrays_larger_than_their_room_name_the_setting():
    dataset = Tokens([16] * 12)
    with DataLoader(dataset, batch_size=4, collate_fn=many_names, outputs={BESIDE: 1000}) as loader:
        with pytest.raises(ValueError, match=r"take \d+ bytes as JSON, more than the 1000.*'collate.beside'"):
            batches(loader)
    with DataLoader(dataset, batch_size=4, collate_fn=many_names) as loader:
        assert batches(loader) == list(TorchDataLoader(dataset, batch_size=4, collate_fn=many_names))


def test_what_a_collate_cannot_do_is_refused_by_name():
    dataset = Tokens([16] * 8)
    with pytest.raises(ValueError, match="on_error='skip'.*collate_fn.*on_error='raise'"):
        DataLoader(dataset, batch_size=4, collate_fn=pad_collate, on_error="skip")
    with pytest.raises(ValueError, match=r"outputs names \['ids'\].*its arrays: \['attention_mask', 'input_ids', "
                                         r"'labels'\]"):
        DataLoader(dataset, batch_size=4, collate_fn=pad_collate, outputs={"ids": (4, 16)})
    with pytest.raises(ValueError, match=r"names is a set"):
        DataLoader(dataset, batch_size=4, collate_fn=lambda samples: {"names": {1}}, num_workers=0)


@pytest.mark.parametrize("length, text", [
    (0, b""), (70_000, b"{}"), (5, b"{\"a\":"), (9, b"{\"q\": 1}"), (24, b"{\"a\": \"labels\", \"shape\": [99]}"),
    (22, b"{\"g\": \"|O\", \"v\": 1}"), (19, b"{\"a\": \"collate.beside\", \"shape\": [1]}"[:19]),
])
def test_a_slot_whose_json_a_reader_did_not_write_is_refused(length, text):
    """The slot is foreign input: a length or JSON node no reader writes is a DatasetError."""
    from shmloader.plan import collated
    from shmloader.plan.dataset import DatasetError

    with DataLoader(Tokens([16] * 8), batch_size=4, collate_fn=pad_collate) as loader:
        outputs = {output.name: output for output in loader._loader._dataset.spec.outputs}
    room = outputs[BESIDE].collated
    arrays = {BESIDE: np.zeros(room, np.uint8), f"{BESIDE}.length": np.array([length]),
              "labels": np.zeros(outputs["labels"].collated, np.int64)}
    arrays[BESIDE][:len(text)] = np.frombuffer(text, np.uint8)
    with pytest.raises(DatasetError, match="collate.beside"):
        collated.rebuild(arrays, outputs, {}, lambda array: array, torch.from_numpy)


@dataclasses.dataclass
class LabelledBatch:
    """A collate_fn's own batch class, as research code writes one: a dataclass with .to()."""

    tokens: torch.Tensor
    names: list
    rows: int = 0
    nested: dict = dataclasses.field(default_factory=dict)

    def to(self, device):
        return dataclasses.replace(self, tokens=self.tokens.to(device))


def _labelled(samples: list) -> LabelledBatch:
    longest = max(len(sample["input_ids"]) for sample in samples)
    tokens = torch.zeros((len(samples), longest), dtype=torch.int64)
    for row, sample in enumerate(samples):
        tokens[row, :len(sample["input_ids"])] = torch.from_numpy(sample["input_ids"])
    return LabelledBatch(tokens, [sample["name"] for sample in samples], len(samples),
                         {"lengths": torch.tensor([len(sample["input_ids"]) for sample in samples])})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_collate_fn_returning_a_dataclass_gives_that_class_as_torchs_loader_does(num_workers):
    """Its fields cross as the batch's leaves do and the trainer calls the class with them."""
    def same(one, other) -> bool:
        return type(one) is type(other) is LabelledBatch and torch.equal(one.tokens, other.tokens) and \
            one.names == other.names and one.rows == other.rows and \
            torch.equal(one.nested["lengths"], other.nested["lengths"])

    lengths = [3, 5, 1, 7, 2, 4, 6]
    expected = list(TorchDataLoader(Tokens(lengths), batch_size=3, collate_fn=_labelled))
    with DataLoader(Tokens(lengths), batch_size=3, collate_fn=_labelled, num_workers=num_workers) as loader:
        found = [copy.deepcopy(batch) for batch in loader]
    assert len(found) == len(expected) and all(same(one, other) for one, other in zip(expected, found))


class _QuotedKeys(Dataset):
    """A padding collate's leaf under a key holding a quote ("user's ids"), growing past its probes."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int):
        return np.arange(1 + 40 * (index // 8), dtype=np.int64)


def _quoted(samples: list) -> dict:
    longest = max(len(sample) for sample in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.int64)
    for row, sample in enumerate(samples):
        ids[row, :len(sample)] = torch.from_numpy(sample)
    return {"user's ids": ids}


def test_an_array_under_a_key_holding_a_quote_grows_its_room_as_any_other():
    """repr() double-quotes a name holding a quote: room_needed reads it as it reads any other."""
    expected = [batch["user's ids"] for batch in TorchDataLoader(_QuotedKeys(), batch_size=4, collate_fn=_quoted)]
    with pytest.warns(CollateGrowthWarning):
        with DataLoader(_QuotedKeys(), batch_size=4, collate_fn=_quoted) as loader:
            found = [batch["user's ids"].clone() for batch in loader]
    assert len(found) == len(expected) and all(torch.equal(one, other) for one, other in zip(expected, found))


@dataclasses.dataclass
class OtherBatch:
    tokens: torch.Tensor


def _labelled_then_other(samples: list):
    made = _labelled(samples)
    return OtherBatch(made.tokens) if made.names[0] == "sample-3" else made


def test_a_dataclass_the_probe_batches_did_not_return_is_named():
    """The trainer builds only the classes the probe batches gave (the slot is foreign input)."""
    from shmloader.plan.dataset import DatasetError

    with DataLoader(Tokens([3, 5, 1, 7, 2, 4, 6, 2, 3]), batch_size=3, collate_fn=_labelled_then_other) as loader:
        with pytest.raises(DatasetError, match=r"collate_fn returned a .*OtherBatch \(a dataclass\), which the probe"):
            list(loader)

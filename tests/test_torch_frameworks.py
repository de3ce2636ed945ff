"""What Lightning, accelerate and Hugging Face's Trainer do with shmloader.torch.DataLoader in
place of torch's, against torch's own DataLoader given the same arguments: the attributes they
read and pass on (type and value), the epoch Hugging Face's resume sets before accelerate's
skip_first_batches, and, marked xfail with the reason, what still differs (the drop-in is no
torch.utils.data.DataLoader; a loop that stops at len() leaves torch's sampler undrained)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
# As the other drop-in tests: the readers fork from the trainer, the harness's threads left out.
pytestmark = [pytest.mark.timeout(300, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]
from torch.utils.data import Dataset, RandomSampler  # noqa: E402
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402

from shmloader.torch import DataLoader  # noqa: E402


class Counting(torch.utils.data.IterableDataset):
    """0 to 9 as samples, read whole by each worker."""

    def __iter__(self):
        return ({"x": torch.tensor([float(index)]), "index": index} for index in range(10))


class Items(Dataset):
    """A float tensor and the index: each batch says which samples it holds."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return {"x": torch.tensor([float(index)]), "index": index}


def _indices(batches) -> list:
    return [batch["index"].tolist() for batch in batches]


@pytest.mark.parametrize("arguments", [
    pytest.param({"batch_size": 3, "shuffle": True, "num_workers": 2, "multiprocessing_context": "spawn"},
                 id="own-order"),
    pytest.param({"batch_size": 3, "sampler": range(10), "num_workers": 1, "multiprocessing_context": "forkserver"},
                 id="sampler"),
    pytest.param({"batch_size": 3, "num_workers": 1, "multiprocessing_context": "spawn", "iterable": True},
                 id="iterable"),
])
def test_the_attributes_frameworks_pass_on_have_torchs_types(arguments):
    """Before: multiprocessing_context read back as the str given (torch keeps the context:
    Lightning's worker check calls .get_start_method() on it) and pin_memory_device was
    missing (accelerate's skip_first_batches and Lightning's re-instantiation read it)."""
    arguments = dict(arguments)
    dataset = Counting() if arguments.pop("iterable", False) else Items(10)
    reference = TorchDataLoader(dataset, pin_memory_device="cuda:1", **arguments)
    with DataLoader(dataset, pin_memory_device="cuda:1", **arguments) as loader:
        assert type(loader.multiprocessing_context) is type(reference.multiprocessing_context)
        assert loader.multiprocessing_context.get_start_method() == arguments["multiprocessing_context"]
        assert loader.pin_memory_device == reference.pin_memory_device == "cuda:1"


def test_the_batch_sampler_after_set_epoch_is_the_next_loops_order():
    """accelerate's skip_first_batches rebuilds a loader from loader.batch_sampler; Hugging
    Face's Trainer sets the epoch first. Before: the batch sampler had no set_epoch and gave
    the pass at hand's order (epoch 0) whatever epoch the next loop was."""
    with DataLoader(Items(10), batch_size=3, shuffle=True, seed=7) as loader:
        epochs = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            epochs.append(_indices(loader))
        assert epochs[1] != epochs[0]
        with DataLoader(Items(10), batch_size=3, shuffle=True, seed=7) as fresh:
            fresh.batch_sampler.set_epoch(2)
            assert list(fresh.batch_sampler) == epochs[2]
            assert _indices(fresh) == epochs[2]


def test_hugging_faces_resume_mid_epoch_gives_the_uninterrupted_runs_batches(tmp_path):
    """A resume in epoch 1 skips the trained batches of epoch 1 (skip_first_batches over
    loader.batch_sampler), then epoch 2. Before: both came in epoch 0's order (the resumed
    loader was never told the epoch). torch's own loader given a seeded generator is not
    exact here either (a new generator restarts at its first epoch's order): the reference
    is the drop-in's uninterrupted run, which the drop-in's exact resume promises."""
    transformers = pytest.importorskip("transformers")
    trained = []

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(1, 1)

        def forward(self, x, index):
            trained.append(index.tolist())
            return {"loss": self.linear(x).square().mean()}

    class Trainer(transformers.Trainer):
        loaders = []  # Closed after each run: the Trainer keeps no loader, nor closes one.

        def get_train_dataloader(self):
            self.loaders.append(DataLoader(Items(10), batch_size=2, shuffle=True, seed=5))
            return self.loaders[-1]

    def train(resume=None) -> list:
        trained.clear()
        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path), num_train_epochs=3, save_steps=7, use_cpu=True, report_to="none",
            remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True, logging_strategy="no")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                Trainer(model=Model(), args=arguments).train(resume_from_checkpoint=resume)
            finally:
                for loader in Trainer.loaders:
                    loader.close()
        return list(trained)

    whole = train()
    assert len(whole) == 15 and whole[5:10] != whole[:5]
    assert train(str(tmp_path / "checkpoint-7")) == whole[7:]


@pytest.mark.xfail(strict=True, reason="the drop-in is no subclass of torch.utils.data.DataLoader: Fabric refuses it, "
                                       "Lightning neither injects its DistributedSampler nor skips its iter() check, "
                                       "accelerate.prepare returns it unchanged (no device placement): a design choice "
                                       "for the lead (subclassing changes what accelerate.prepare does with it)")
def test_fabric_sets_up_the_drop_in_as_it_sets_up_torchs_loader():
    fabric_module = pytest.importorskip("lightning.fabric")
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
    reference = _indices(fabric.setup_dataloaders(TorchDataLoader(Items(10), batch_size=3)))
    with DataLoader(Items(10), batch_size=3) as loader:
        assert _indices(fabric.setup_dataloaders(loader)) == reference


def test_lightning_trains_on_a_samplers_order_as_with_torchs_loader():
    """Lightning calls iter() once on a loader that is no torch DataLoader (its iterable
    check), then iterates it for the epoch: that iterator, never asked for a batch, gives
    its epoch again (DataLoader._untouched), so the sampler is drawn once an epoch, as
    torch's loader, which Lightning does not check so, draws it."""
    lightning = pytest.importorskip("lightning.pytorch")

    def fit(loader_class) -> list:
        seen = []

        class Module(lightning.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(1, 1)

            def training_step(self, batch, index):
                seen.append(batch["index"].tolist())
                return self.linear(batch["x"]).sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), 0.01)

            def train_dataloader(self):
                sampler = RandomSampler(Items(10), generator=torch.Generator().manual_seed(1))
                made.append(loader_class(Items(10), batch_size=3, sampler=sampler))
                return made[-1]

        made = []
        trainer = lightning.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Module())
        for loader in made:  # Lightning never closes its dataloaders.
            if hasattr(loader, "close"):
                loader.close()
        return seen

    assert fit(DataLoader) == fit(TorchDataLoader)


@pytest.mark.xfail(strict=True, reason="the drop-in draws a sampler's epoch whole at iter() (sampling.py says so): "
                                       "torch's single-process loader stopped after len(loader) batches (Hugging "
                                       "Face's Trainer, Lightning's limit_train_batches) leaves RandomSampler's "
                                       "trailing randperm undrawn, so its next epoch draws from another generator "
                                       "state; torch's workers drain it as the drop-in does")
def test_a_loop_that_stops_at_len_draws_the_next_epoch_as_torchs_loader_does():
    def epochs(loader_class) -> list:
        sampler = RandomSampler(Items(10), generator=torch.Generator().manual_seed(1))
        loader = loader_class(Items(10), batch_size=2, sampler=sampler)
        found = []
        for _ in range(2):
            iterator = iter(loader)
            found.append(_indices(next(iterator) for _ in range(len(loader))))
        if hasattr(loader, "close"):
            loader.close()
        return found

    assert epochs(DataLoader) == epochs(TorchDataLoader)

"""The ranks of the torch.distributed tests, under torchrun; not a test module,
tests/test_distributed.py starts it.

`distributed_child.py DIRECTORY LABELS OUTPUT`: each rank shards a loader by its rank for an
epoch, then runs examples/train_ddp.py, then (where all three are installed) accelerate,
Lightning and Hugging Face's Trainer over the same labels; rank 0 writes what every rank saw
in each (its batches, the rows, or the error it raised). One launch for all: each costs two
interpreters importing torch and a process group."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import sys

import torch.distributed as dist

from shmloader import ShmDataLoader

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Rows per rank per step in every run: 600 labels make 30 steps on each of 2 ranks.
BATCH_SIZE = 10
FRAMEWORKS = ("accelerate", "lightning", "transformers")


def rank_shards(labels: str) -> list[dict]:
    """An epoch of this rank's shard (shard_index=rank): each batch's step, indices and labels."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with ShmDataLoader({"label": labels}, batch_size=BATCH_SIZE, epochs=1, readers=1, slots=3, seed=3,
                       shard_index=rank, shard_count=world) as loader:
        return [{"step": batch.step, "indices": batch.indices.tolist(), "labels": batch["label"].tolist()}
                for batch in loader]


def run_example(directory: pathlib.Path) -> list[int]:
    """examples/train_ddp.py's own main, as torchrun runs it; the rows each rank trained on."""
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "examples" / "train_ddp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    output = directory / "train_ddp.json"
    example.main(["--data", str(directory), "--rows", "600", "--batch-size", str(BATCH_SIZE), "--epochs", "1",
                  "--readers", "1", "--indices", str(output)])
    return sum(json.loads(output.read_text()), []) if dist.get_rank() == 0 else []


def rows_of(batches) -> list[int]:
    return [index for batch in batches for index in batch["indices"].tolist()]


def first_error(batches) -> str:
    """The error iterating raises (on every rank alike), or what it gave instead."""
    try:
        return f"no error: {len(rows_of(batches))} rows"
    except ValueError as error:
        return str(error)


def with_accelerate(labels: str) -> dict:
    import torch.utils.data
    from accelerate import Accelerator, DataLoaderConfiguration

    from shmloader.torch import ShmIterableDataset, TorchLoader

    seen = {}
    accelerator = Accelerator(cpu=True)  # Over the process group already started.
    rank, world = accelerator.process_index, accelerator.num_processes
    # The recipe: the rank's shard in TorchLoader, which prepare returns unchanged.
    with TorchLoader(ShmDataLoader({"label": labels}, batch_size=BATCH_SIZE, epochs=1, readers=1,
                                   shard_index=rank, shard_count=world)) as train:
        assert accelerator.prepare(train) is train
        seen["accelerate TorchLoader"] = rows_of(train)
    # The documented wrapper: accelerate's dispatcher over an unsharded loader read on rank 0.
    with ShmDataLoader({"label": labels}, batch_size=BATCH_SIZE, epochs=1, readers=1 if rank == 0 else 0) as loader:
        seen["accelerate dispatcher"] = rows_of(accelerator.prepare(
            torch.utils.data.DataLoader(ShmIterableDataset(loader), batch_size=None)))
    # Refused: the dispatcher over rank shards (it reads rank 0's only), and accelerate's own
    # re-split of every rank's batches (dispatch_batches=False).
    for name, accelerator in [("dispatcher over shards", accelerator),
                              ("dispatch_batches=False", Accelerator(
                                  cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False)))]:
        with ShmDataLoader({"label": labels}, batch_size=BATCH_SIZE, epochs=1, readers=0, shard_index=rank,
                           shard_count=world) as loader:
            seen[name] = first_error(accelerator.prepare(
                torch.utils.data.DataLoader(ShmIterableDataset(loader), batch_size=None)))
    return seen


def with_lightning(labels: str) -> list[int]:
    import lightning
    import torch

    from shmloader.torch import TorchLoader

    seen, loaders = [], []

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(1, 1)

        def train_dataloader(self) -> TorchLoader:
            loaders.append(TorchLoader(ShmDataLoader({"label": labels}, batch_size=BATCH_SIZE, epochs=1, readers=1,
                                                     shard_index=self.trainer.global_rank,
                                                     shard_count=self.trainer.world_size)))
            return loaders[-1]

        def training_step(self, batch, batch_index):
            seen.extend(batch["indices"].tolist())
            return self.linear(batch["label"].float()[:, None]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    trainer = lightning.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp", max_epochs=1,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, use_distributed_sampler=True)
    try:
        trainer.fit(Model())
    finally:
        for loader in loaders:
            loader.close()  # Lightning never closes a dataloader.
    return seen


def with_hugging_face(labels: str, directory: pathlib.Path) -> list[int]:
    import torch
    import transformers

    from shmloader.torch import TorchLoader

    seen, loaders = [], []

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(1, 1)

        def forward(self, label, indices):
            seen.extend(indices.tolist())
            return {"loss": self.linear(label.float()[:, None]).square().mean()}

    class Trainer(transformers.Trainer):
        def get_train_dataloader(self) -> TorchLoader:
            loaders.append(TorchLoader(ShmDataLoader({"label": labels}, batch_size=BATCH_SIZE, epochs=1, readers=1,
                                                     shard_index=self.args.process_index,
                                                     shard_count=self.args.world_size)))
            return loaders[-1]

    arguments = transformers.TrainingArguments(
        output_dir=str(directory / "hf"), num_train_epochs=1, per_device_train_batch_size=BATCH_SIZE, use_cpu=True,
        report_to="none", save_strategy="no", logging_strategy="no", remove_unused_columns=False,
        dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo", learning_rate=1e-6)
    try:
        Trainer(model=Model(), args=arguments).train()
    finally:
        for loader in loaders:
            loader.close()
    return seen


def frameworks(directory: pathlib.Path, labels: str, output: str) -> None:
    """Each run in turn on this rank; rank 0 writes {name: [each rank's batches, rows or
    error]}, and under "not installed" the frameworks it could not run."""
    # One process group for all: gloo cannot start a second one over torchrun's store, whose
    # keys the first left behind.
    dist.init_process_group("gloo")
    seen = {"rank shards": rank_shards(labels), "train_ddp.py": run_example(directory)}
    missing = [name for name in FRAMEWORKS if importlib.util.find_spec(name) is None]
    if not missing:
        seen.update(with_accelerate(labels))
        seen["lightning"] = with_lightning(labels)
        seen["hugging face"] = with_hugging_face(labels, directory)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() == 0:
        with open(output, "w") as handle:
            json.dump({"not installed": missing, **{name: [rank[name] for rank in everyone] for name in seen}}, handle)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


if __name__ == "__main__":
    frameworks(pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3])

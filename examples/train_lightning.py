"""Train with PyTorch Lightning from ShmDataLoader batches (CPU is fine).

Run: python examples/train_lightning.py   (needs `pip install torch lightning`)

The LightningDataModule's train_dataloader returns shmloader.torch.TorchLoader: an
iterable of dicts of tensors over the ring's slots, with len() for a finite pass
(epochs=1) and the loader's state_dict. The loader batches already, in its own reader
processes: no torch DataLoader workers. Tensors view the slots; Lightning keeps a batch
(and one prefetched) alive for a step, which the default slot count allows.

Under DDP (devices=N, or torchrun) each rank reads its own shard: shard_index is
trainer.global_rank, shard_count trainer.world_size, batch_size per rank. Lightning puts
no DistributedSampler under an iterable, so use_distributed_sampler changes nothing here.
"""

from __future__ import annotations

import pathlib
import tempfile

import lightning
import numpy as np
import torch

from shmloader import ShmDataLoader
from shmloader.demo import CLASSES, IMAGE_SHAPE, make_dataset, write_dataset
from shmloader.torch import TorchLoader


class Data(lightning.LightningDataModule):
    def __init__(self, directory: pathlib.Path, batch_size: int) -> None:
        super().__init__()
        self.directory, self.batch_size = directory, batch_size

    def setup(self, stage: str) -> None:
        self.fields = write_dataset(self.directory)

    def train_dataloader(self) -> TorchLoader:
        # Called every epoch (reload_dataloaders_every_n_epochs=1): one pass of the loader,
        # in an order of its own (a seed per epoch, as DistributedSampler.set_epoch gives).
        # A loader whose pass ended raises if iterated again rather than give no batch.
        epoch, rank, world = 0, 0, 1
        if self.trainer is not None:
            epoch, rank, world = self.trainer.current_epoch, self.trainer.global_rank, self.trainer.world_size
        return TorchLoader(ShmDataLoader(self.fields, batch_size=self.batch_size, readers=2, seed=epoch, epochs=1,
                                         shard_index=rank, shard_count=world))


class Classifier(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(IMAGE_SHAPE)), 64),
                                         torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))

    def training_step(self, batch, batch_index):
        x = batch["image"].float().sub(128).div(64)  # A new tensor: the slot is only read.
        loss = torch.nn.functional.cross_entropy(self.model(x), batch["label"])
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(epochs: int = 2, batch_size: int = 256) -> float:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        data, model = Data(pathlib.Path(directory), batch_size), Classifier()
        trainer = lightning.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                                    reload_dataloaders_every_n_epochs=1, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, datamodule=data)
        print(f"trained {trainer.global_step} steps in {epochs} epochs")
        images, labels = make_dataset(2_000, seed=1)
        with torch.no_grad():
            logits = model.model(torch.from_numpy(images).float().sub(128).div(64))
        accuracy = float((logits.argmax(1).numpy() == labels).mean())
    print(f"held-out accuracy {accuracy:.1%} (chance {1 / CLASSES:.0%})")
    return accuracy


if __name__ == "__main__":
    main()

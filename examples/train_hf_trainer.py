"""Train with Hugging Face's Trainer from ShmDataLoader batches (CPU is fine).

Run: python examples/train_hf_trainer.py   (needs `pip install torch transformers accelerate`)

Trainer builds its own torch DataLoader from a dataset; here get_train_dataloader is
overridden to return shmloader.torch.TorchLoader over an endless loader (epochs=None),
and max_steps bounds training. Each batch is a dict of tensors over a slot, passed to the
model as keyword arguments (image=..., label=..., indices=...: the rows' indices; give
TorchLoader indices=False for a model that does not take them).

Under torchrun each rank reads its own shard (args.process_index of args.world_size), with
batch_size rows per rank. resume_from_checkpoint is exact: the Trainer skips the steps
already trained by reading them again; TrainingArguments(ignore_data_skip=True) and
ShmDataLoader(..., start_step=trainer.state.global_step) skip without reading.
"""

from __future__ import annotations

import pathlib
import tempfile

import numpy as np
import torch
import transformers

from shmloader import ShmDataLoader
from shmloader.demo import CLASSES, IMAGE_SHAPE, make_dataset, write_dataset
from shmloader.torch import TorchLoader


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(IMAGE_SHAPE)), 64),
                                          torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))

    def forward(self, image, label=None, indices=None):
        logits = self.layers(image.float().sub(128).div(64))  # A new tensor: the slot is only read.
        loss = None if label is None else torch.nn.functional.cross_entropy(logits, label)
        return {"loss": loss, "logits": logits}


class ShmTrainer(transformers.Trainer):
    def __init__(self, *args, fields=None, batch_size=256, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields, self.shm_batch_size = fields, batch_size

    def get_train_dataloader(self) -> TorchLoader:
        return TorchLoader(ShmDataLoader(self.fields, batch_size=self.shm_batch_size, readers=2, seed=self.args.seed,
                                         shard_index=self.args.process_index, shard_count=self.args.world_size))


def main(steps: int = 200, batch_size: int = 256) -> float:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        fields = write_dataset(pathlib.Path(directory))
        arguments = transformers.TrainingArguments(
            output_dir=str(pathlib.Path(directory) / "out"), max_steps=steps, learning_rate=0.05, optim="sgd",
            lr_scheduler_type="constant", use_cpu=True, report_to="none", save_strategy="no", logging_steps=50,
            remove_unused_columns=False, label_names=["label"], dataloader_num_workers=0, disable_tqdm=True)
        model = Classifier()
        trainer = ShmTrainer(model=model, args=arguments, fields=fields, batch_size=batch_size)
        trainer.train()
        images, labels = make_dataset(2_000, seed=1)
        with torch.no_grad():
            logits = model(torch.from_numpy(images))["logits"]
        accuracy = float((logits.argmax(1).numpy() == labels).mean())
    print(f"held-out accuracy {accuracy:.1%} (chance {1 / CLASSES:.0%})")
    return accuracy


if __name__ == "__main__":
    main()

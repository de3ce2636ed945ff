"""A trainer for the drop-in's kill -9 test (test_torch_sampling.py): iterates a
DistributedSampler run, writes a checkpoint and the batch after each step, and SIGKILLs
itself after `steps` batches of epoch 1. Not a test module."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from child_guard import die_with_parent

LENGTH, BATCH = 41, 3


class Augmented(Dataset):
    """A sample and an augmentation drawn from torch's global generator."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int):
        return {"label": index, "noise": torch.rand(2), "image": np.full(3, index, np.float32)}


def make_loader(num_workers: int):
    from shmloader.torch import DataLoader

    dataset = Augmented()
    return DataLoader(dataset, batch_size=BATCH, num_workers=num_workers, seed=11,
                      sampler=DistributedSampler(dataset, num_replicas=2, rank=1, seed=5))


def main() -> None:
    die_with_parent()
    directory, steps = sys.argv[1], int(sys.argv[2])
    loader = make_loader(2)
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for step, batch in enumerate(loader):
            if epoch == 1:
                record = {"state": loader.state_dict(), "batch": batch}
                torch.save(record, os.path.join(directory, "next.pt"))
                os.replace(os.path.join(directory, "next.pt"), os.path.join(directory, "last.pt"))
                if step + 1 == steps:
                    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()

"""Train with DistributedDataParallel, each rank reading its own shard (CPU and gloo are fine).

Run: torchrun --nproc_per_node=2 examples/train_ddp.py   (needs `pip install torch`)

The recipe: torchrun sets RANK and WORLD_SIZE in each rank's environment; they are the
loader's shard_index and shard_count. batch_size is per rank: step k's global batch is
batch_size * WORLD_SIZE rows and rank r takes block r of it, so the ranks' batches are
disjoint, every rank runs the same number of steps (len(loader)), and a pass of epochs=1
gives each row of the data once across the ranks. Readers default to the node's cores
divided among its ranks (LOCAL_WORLD_SIZE). No DistributedSampler and no torch DataLoader:
the loader is the sampler. A checkpoint is rank 0's loader.state_dict() (every rank's
next step is the same); load it on every rank, under another WORLD_SIZE too.

The data must be at one path every rank can read: here rank 0 writes the demo's data and
tells the others where (on several nodes, give --data a directory they all mount).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from shmloader import ShmDataLoader
from shmloader.demo import CLASSES, IMAGE_SHAPE, write_dataset


def shared_fields(directory: str | None, rows: int, scratch: str) -> dict:
    """The demo's fields at one path for every rank: written by rank 0, the path broadcast."""
    message = [None]
    if dist.get_rank() == 0:
        message[0] = {name: str(path) for name, path in write_dataset(pathlib.Path(directory or scratch), rows).items()}
    dist.broadcast_object_list(message, src=0)
    return message[0]


def train(fields: dict, batch_size: int, epochs: int, readers: int | None) -> tuple[list[int], float]:
    """One run of the recipe; returns the rows this rank trained on (by index) and its last loss."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)  # The same initial weights on every rank (DDP also broadcasts rank 0's).
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(int(np.prod(IMAGE_SHAPE)), 64), torch.nn.ReLU(),
        torch.nn.Linear(64, CLASSES)))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    seen, loss = [], torch.tensor(float("nan"))
    with ShmDataLoader(fields, batch_size=batch_size, epochs=epochs, readers=readers, seed=0,
                       shard_index=rank, shard_count=world) as loader:
        for step, batch in enumerate(loader):  # len(loader) steps, the same on every rank.
            with batch:  # The slot goes back to the readers at the end of this block.
                x = torch.from_numpy(batch["image"]).float().sub_(128).div_(64)  # Copies out of the slot.
                y = torch.from_numpy(batch["label"])
                seen += batch.indices.tolist()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimiser.zero_grad()
            loss.backward()  # DDP averages the gradients over the ranks here.
            optimiser.step()
            if rank == 0 and step % 20 == 0:
                print(f"step {step}/{len(loader)}: loss {loss.item():.3f}")
    return seen, loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a directory every rank can read (default: a temporary one, one node only)")
    parser.add_argument("--rows", type=int, default=20_000, help="rows of demo data rank 0 writes")
    parser.add_argument("--batch-size", type=int, default=128, help="rows per rank per step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--readers", type=int, default=None, help="per rank (default: the node's cores / its ranks)")
    parser.add_argument("--indices", help="rank 0 writes here, as JSON, the row indices each rank trained on")
    arguments = parser.parse_args(argv)
    started = not dist.is_initialized()  # A caller (a test, a notebook) may have started it for several runs.
    if started:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # MASTER_ADDR/PORT from torchrun.
    try:
        with tempfile.TemporaryDirectory() as scratch:
            fields = shared_fields(arguments.data, arguments.rows, scratch)
            seen, loss = train(fields, arguments.batch_size, arguments.epochs, arguments.readers)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, seen)  # Also keeps rank 0's directory until every rank is done.
        if dist.get_rank() == 0:
            print(f"{sum(map(len, everyone)):,} rows over {len(everyone)} ranks, last loss {loss:.3f}")
            if arguments.indices:
                pathlib.Path(arguments.indices).write_text(json.dumps(everyone))
    finally:
        if started:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One rank of the torch.distributed test: shards the loader by rank and gathers all ranks' batches.
Not a test module; tests/test_distributed.py starts it."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from child_guard import die_with_parent

from shmloader import ShmDataLoader


def main() -> None:
    die_with_parent()
    path, steps, output = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK and WORLD_SIZE come from the environment.
    rank, world = dist.get_rank(), dist.get_world_size()
    with ShmDataLoader({"label": path}, batch_size=10, readers=1, slots=3, seed=3,
                       shard_index=rank, shard_count=world) as loader:
        mine = []
        for _, batch in zip(range(steps), loader):
            mine.append({"step": batch.step, "indices": batch.indices.tolist(), "labels": batch["label"].tolist()})
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(output, "w") as handle:
            json.dump(everyone, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Multi-host sharding with torch.distributed (gloo on localhost, two ranks, each its own loader):
per step the ranks' batches are disjoint and form the global batch; an epoch covers every row once."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from shmloader import Sampler

HERE = pathlib.Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_ranks_share_each_step_and_cover_an_epoch(dataset, tmp_path):
    pytest.importorskip("torch.distributed")
    world, batch_size, rows = 2, 10, 600
    steps = rows // (batch_size * world)  # Exactly one epoch across both ranks.
    output = tmp_path / "batches.json"
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(HERE / "distributed_child.py"), dataset["paths"]["labels_b2nd"], str(steps), str(output)],
            env={**environment, "RANK": str(rank)}, cwd=HERE,
        )
        for rank in range(world)
    ]
    try:
        assert [rank.wait(120) for rank in ranks] == [0, 0]
    finally:
        for rank in ranks:
            rank.kill()
    everyone = json.loads(output.read_text())
    global_sampler = Sampler(rows, batch_size * world, "shuffle", seed=3)
    seen = []
    for step in range(steps):
        per_rank = [everyone[rank][step] for rank in range(world)]
        assert all(batch["step"] == step for batch in per_rank)
        indices = [np.array(batch["indices"]) for batch in per_rank]
        assert not set(indices[0]) & set(indices[1])
        assert np.array_equal(np.concatenate(indices), global_sampler.fill(step))
        for batch, rank_indices in zip(per_rank, indices):
            assert np.array_equal(batch["labels"], dataset["labels"][rank_indices])
        seen.extend(np.concatenate(indices).tolist())
    assert sorted(seen) == list(range(rows))

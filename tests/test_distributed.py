"""Multi-host sharding with torch.distributed (gloo on localhost, two ranks, each its own loader):
per step the ranks' batches are disjoint and form the global batch; an epoch covers every row once,
under torchrun through examples/train_ddp.py, accelerate, Lightning and Hugging Face's Trainer too,
and a framework wrapper that would lose or repeat rows is refused, naming the setting."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import free_port
from shmloader import Sampler

HERE = pathlib.Path(__file__).resolve().parent


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


# One torchrun launch for every framework: each launch costs two interpreters importing torch.
_FRAMEWORKS_TIMEOUT_S = 240


def test_under_torchrun_every_framework_sees_each_row_of_an_epoch_once_or_refuses(dataset, tmp_path):
    """Before: accelerate's dispatcher over rank shards read rank 0's shard only (half the rows
    missing, no warning), dispatch_batches=False crashed with `TypeError: NoneType * int`, and
    TorchLoader's batches had no indices to count rows by."""
    for module in ("accelerate", "lightning", "transformers"):
        pytest.importorskip(module)
    torchrun = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    output = tmp_path / "seen.json"
    environment = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [torchrun, "--nproc_per_node=2", "--monitor-interval=0.1", "--master_addr=127.0.0.1",
               f"--log-dir={tmp_path / 'torchrun'}",  # Not a torchelastic_* directory of its own in /tmp.
               f"--master_port={free_port()}", str(HERE / "distributed_child.py"), "frameworks", str(tmp_path),
               dataset["paths"]["labels_b2nd"], str(output)]
    launch = subprocess.Popen(command, env=environment, cwd=tmp_path, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = launch.communicate(timeout=_FRAMEWORKS_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)  # torchrun and both ranks, should the test end early.
    assert launch.returncode == 0, log[-4000:]
    seen = json.loads(output.read_text())
    for name in ("train_ddp.py", "accelerate TorchLoader", "accelerate dispatcher", "lightning", "hugging face"):
        assert sorted(sum(seen[name], [])) == list(range(600)), name
    for rank in range(2):
        assert len(seen["accelerate TorchLoader"][rank]) == 300  # Each rank its own shard.
        assert "shard_count=1" in seen["dispatcher over shards"][rank]
        assert "dispatch_batches=False" in seen["dispatch_batches=False"][rank]

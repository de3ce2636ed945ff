"""Multi-host sharding with torch.distributed (gloo on localhost, two ranks, each its own loader):
per step the ranks' batches are disjoint and form the global batch; an epoch covers every row once,
under torchrun through examples/train_ddp.py, accelerate, Lightning and Hugging Face's Trainer too,
and a framework wrapper that would lose or repeat rows is refused, naming the setting."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import free_port
from shmloader import Sampler

HERE = pathlib.Path(__file__).resolve().parent
ROWS = 600  # The dataset fixture's labels.
# One torchrun launch for both tests: each launch costs two interpreters importing torch.
_LAUNCH_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def launched(dataset, tmp_path_factory):
    """(torchrun's exit code, its log, what rank 0 wrote) of one launch of
    distributed_child.py on two ranks, each its own loader (gloo on localhost)."""
    pytest.importorskip("torch.distributed")
    directory = tmp_path_factory.mktemp("distributed")
    output = directory / "seen.json"
    environment = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    # torch.distributed.run is torchrun's own module: no script beside this Python needed.
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--monitor-interval=0.1",
               "--master_addr=127.0.0.1", f"--log-dir={directory / 'torchrun'}",  # Not a torchelastic_* of its own in /tmp.
               f"--master_port={free_port()}", str(HERE / "distributed_child.py"), str(directory),
               dataset["paths"]["labels_b2nd"], str(output)]
    launch = subprocess.Popen(command, env=environment, cwd=directory, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = launch.communicate(timeout=_LAUNCH_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)  # torchrun and both ranks, should the launch end early.
    return launch.returncode, log, json.loads(output.read_text()) if launch.returncode == 0 else None


def test_two_ranks_share_each_step_and_cover_an_epoch(dataset, launched):
    returncode, log, seen = launched
    assert returncode == 0, log[-4000:]
    everyone, world, batch_size = seen["rank shards"], 2, 10
    steps = ROWS // (batch_size * world)  # Exactly one epoch across both ranks.
    assert [len(batches) for batches in everyone] == [steps, steps]
    global_sampler = Sampler(ROWS, batch_size * world, "shuffle", seed=3)
    seen_rows = []
    for step in range(steps):
        per_rank = [everyone[rank][step] for rank in range(world)]
        assert all(batch["step"] == step for batch in per_rank)
        indices = [np.array(batch["indices"]) for batch in per_rank]
        assert not set(indices[0]) & set(indices[1])
        assert np.array_equal(np.concatenate(indices), global_sampler.fill(step))
        for batch, rank_indices in zip(per_rank, indices):
            assert np.array_equal(batch["labels"], dataset["labels"][rank_indices])
        seen_rows.extend(np.concatenate(indices).tolist())
    assert sorted(seen_rows) == list(range(ROWS))


def test_under_torchrun_every_framework_sees_each_row_of_an_epoch_once_or_refuses(launched):
    """Before: accelerate's dispatcher over rank shards read rank 0's shard only (half the rows
    missing, no warning), dispatch_batches=False crashed with `TypeError: NoneType * int`, and
    TorchLoader's batches had no indices to count rows by."""
    returncode, log, seen = launched
    assert returncode == 0, log[-4000:]
    if seen["not installed"]:  # Found by the ranks: importing them here would only slow the test worker.
        pytest.skip(f"not installed: {', '.join(seen['not installed'])}")
    for name in ("train_ddp.py", "accelerate TorchLoader", "accelerate dispatcher", "lightning", "hugging face"):
        assert sorted(sum(seen[name], [])) == list(range(ROWS)), name
    for rank in range(2):
        assert len(seen["accelerate TorchLoader"][rank]) == 300  # Each rank its own shard.
        assert "shard_count=1" in seen["dispatcher over shards"][rank]
        assert "dispatch_batches=False" in seen["dispatch_batches=False"][rank]

"""Under multiprocessing_context="fork", the drop-in's probe of dataset[0] (plan/probe.py)
runs in a fork of the trainer: the trainer's own dataset object sees no __getitem__ call at
construction (nor at a batch_sampler's later passes, each planned anew), even one that neither pickles nor deep-copies (before, the probe then called
the trainer's object), and its samples are still the per-sample reference's and a
collate_fn's batches torch's; dataset[0]'s error reaches the trainer as the user's
exception, with a note naming dataset[0] (one that does not unpickle is raised by a probe
of a copy in the trainer, as before); a fork killed, or one that does not answer within
the bound (then killed), is named with its pid; and the trainer's peak memory while the
loader is made does not grow by the dataset's size (before, the probe read a copy: the
pickle's bytes and the object made from them)."""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from conftest import child_environment, process_alive, seed_sample_generators  # noqa: E402
from shmloader.plan import probe  # noqa: E402
from shmloader.plan.dataset import DatasetError  # noqa: E402
from shmloader.fill.dataset_runner import sample_seeds  # noqa: E402
from shmloader.torch import DataLoader  # noqa: E402

# SIGALRM instead of pytest-timeout's timer thread, which would make the trainer one that
# runs threads (the fork path's fallback); conftest's fixture leaves out the harness's others.
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork is the default on Linux"),
              pytest.mark.timeout(120, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]

ROWS, BATCH = 20, 4


class CountsInItself(Dataset):
    """Counts its calls in the object, draws from Python's and numpy's generators, and holds
    a lock, which neither pickles nor deep-copies: the probe has no copy to read but a fork."""

    def __init__(self) -> None:
        self.calls, self.lock = 0, threading.Lock()

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int):
        self.calls += 1
        return {"index": index, "draw": np.float64(np.random.random() + random.random())}


def test_the_trainer_s_dataset_sees_no_call_at_construction_and_samples_are_the_per_sample_reference():
    dataset = CountsInItself()
    with DataLoader(dataset, batch_size=BATCH, num_workers=2, shuffle=True, multiprocessing_context="fork") as loader:
        assert loader._loader._dataset.spec.forked
        assert dataset.calls == 0  # Before: the probe called this object (no copy could be made).
        inner = loader._loader
        found, keys = {}, {}
        for step, batch in enumerate(loader):
            indices = batch["index"].tolist()
            found.update(zip(indices, batch["draw"].tolist()))
            keys.update(zip(indices, inner.sampler.row_keys(step, len(indices)).tolist()))
        seed = inner.options.seed
    assert dataset.calls == 0 and sorted(found) == list(range(ROWS))
    # The reference: each index read from an object of its own, every generator seeded from
    # its stream position through the generators' public calls (tests/test_once_per_sample.py).
    expected = {}
    for index, key in keys.items():
        seed_sample_generators(sample_seeds(seed, np.array([key], dtype=np.uint64))[0])
        expected[index] = float(CountsInItself()[index]["draw"])
    assert found == expected


def test_with_a_batch_sampler_each_pass_s_probe_is_read_in_the_fork():
    """The sampled loader plans each epoch's pass anew (torch/sampling.py), probe included."""
    dataset, batches = CountsInItself(), [[5, 6, 7], [1], [0, 2]]
    with DataLoader(dataset, batch_sampler=batches, num_workers=2, multiprocessing_context="fork") as loader:
        for _ in range(2):
            assert [batch["index"].tolist() for batch in loader] == batches
            assert loader._loader._dataset.spec.forked and dataset.calls == 0


class DrawsLogged(Dataset):
    """Draws from the three global generators and logs each call's draws, one line a call."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int):
        draws = [random.random(), float(np.random.random()), float(torch.rand(()))]
        with open(self.log, "a") as log:
            log.write(json.dumps([index, draws]) + "\n")
        return {"index": index, "draws": np.array(draws)}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_the_probe_draws_what_the_sample_at_position_0_draws_and_leaves_the_trainer_s_generators(tmp_path, context):
    """Before: the probe drew from the trainer's generators as they happened to be."""
    log = tmp_path / "calls"
    python, numpy, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    # A generator gives the loader its seed: without one, the drop-in draws it from torch's, as torch's does.
    with DataLoader(DrawsLogged(str(log)), batch_size=BATCH, num_workers=2, multiprocessing_context=context,
                    generator=torch.Generator().manual_seed(3)) as loader:
        assert loader._loader._dataset.spec.forked == (context == "fork")
        assert random.getstate() == python and torch.equal(torch.get_rng_state(), torch_state)
        assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), numpy))
        (probed,) = [json.loads(line) for line in log.read_text().splitlines()]  # Only the probe's, so far.
        first = next(iter(loader))  # shuffle=False: dataset[0] is the sample at stream position 0.
    assert probed[0] == 0 and first["index"][0] == 0
    assert probed[1] == first["draws"][0].tolist()


Pair = collections.namedtuple("Pair", ["indices", "name"])


def pair_collate(samples: list) -> Pair:
    """A collate whose batch is a namedtuple of a tensor and a str: classes the fork names back."""
    return Pair(torch.tensor([sample["index"] for sample in samples]), f"batch of {len(samples)}")


def test_a_collate_fn_s_probe_batches_are_read_in_the_fork_and_batches_are_torch_s():
    dataset = CountsInItself()
    with DataLoader(dataset, batch_size=BATCH, num_workers=2, collate_fn=pair_collate,
                    multiprocessing_context="fork") as loader:
        assert loader._loader._dataset.spec.forked
        assert dataset.calls == 0  # Before: the probe batches called this object.
        found = [(type(batch), batch.indices.tolist(), batch.name) for batch in loader]
    reference = TorchDataLoader(CountsInItself(), batch_size=BATCH, collate_fn=pair_collate)
    assert found == [(Pair, batch.indices.tolist(), batch.name) for batch in reference]


class FirstSampleError(Exception):
    """dataset[0]'s own error, carrying the pid of the process that raised it."""


class FailsFirst(Dataset):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int):
        if index == 0:
            raise FirstSampleError("sample 0 is unreadable", os.getpid())
        return np.int64(index)


def test_dataset_0_raising_in_the_fork_gives_the_user_s_exception_with_a_note():
    with pytest.raises(FirstSampleError) as raised:
        DataLoader(FailsFirst(), batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    assert raised.value.args[0] == "sample 0 is unreadable"
    assert raised.value.args[1] != os.getpid()  # Read in the trainer's fork, not in the trainer.
    notes = "\n".join(raised.value.__notes__)
    assert "in dataset[0], which the loader reads first" in notes
    assert "raise FirstSampleError" in notes  # The fork's traceback, which the exception lost on its way.


def test_the_plan_s_own_checks_raise_from_the_fork_as_they_did_in_the_trainer():
    with pytest.raises(DatasetError, match=r"outputs names \['nowhere'\], which dataset\[0\] does not have") as raised:
        DataLoader(CountsInItself(), batch_size=BATCH, num_workers=2, outputs={"nowhere": ((2,), "float32")},
                   multiprocessing_context="fork")
    assert not getattr(raised.value, "__notes__", None)  # No traceback of the loader's own code.


class TwoArgumentsError(Exception):
    """An exception that pickles but does not unpickle (its constructor takes two arguments)."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__(f"{first} {second}")


class FailsFirstUnpicklably(FailsFirst):
    def __getitem__(self, index: int):
        if index == 0:
            raise TwoArgumentsError("sample 0", "is unreadable")
        return np.int64(index)


def test_an_exception_that_does_not_come_back_from_the_fork_is_raised_by_a_probe_in_the_trainer():
    with pytest.raises(TwoArgumentsError, match="sample 0 is unreadable") as raised:
        DataLoader(FailsFirstUnpicklably(), batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    assert any("dataset[0]" in note for note in raised.value.__notes__)


class KillsItsProcessAtFirst(FailsFirst):
    """dataset[0] kills the process it runs in, unless that is the trainer (a fallback)."""

    def __init__(self) -> None:
        self.trainer = os.getpid()

    def __getitem__(self, index: int):
        if index == 0 and os.getpid() != self.trainer:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.int64(index)


def test_a_fork_killed_while_reading_dataset_0_is_named_with_its_signal():
    with pytest.raises(RuntimeError, match=r"trainer's fork \(pid \d+\) reading dataset\[0\].* ended with signal 9"):
        DataLoader(KillsItsProcessAtFirst(), batch_size=BATCH, num_workers=2, multiprocessing_context="fork")


class SlowFirst(FailsFirst):
    def __getitem__(self, index: int):
        if index == 0:
            time.sleep(60)
        return np.int64(index)


def test_a_fork_that_does_not_answer_within_the_bound_is_killed_and_named(monkeypatch):
    monkeypatch.setattr(probe, "PROBE_WAIT_SECONDS_MAX", 1.0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reading dataset\[0\].* did not answer within 1 s; it was killed") \
            as raised:
        DataLoader(SlowFirst(), batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    assert time.monotonic() - started < 30
    pid = int(re.search(r"pid (\d+)", str(raised.value)).group(1))
    assert not process_alive(pid)


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from torch.utils.data import Dataset
    from shmloader.torch import DataLoader

    class Rows(Dataset):
        def __init__(self):
            self.rows = np.ones((200 * 1024, 256), np.float32)  # 200 MiB, every page touched.

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, index):
            return self.rows[index], index % 10

    def kilobytes(field):
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith(field + ":"))
        return int(line.split()[1])

    if __name__ == "__main__":
        dataset = Rows()
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # The peak (VmHWM) starts again from the resident size now.
        before = kilobytes("VmRSS")
        loader = DataLoader(dataset, batch_size=64, num_workers=1, multiprocessing_context=sys.argv[1])
        growth = (kilobytes("VmHWM") - before) * 1024
        forked = loader._loader._dataset.spec.forked
        loader.close()
        print(json.dumps({"growth": growth, "bytes": dataset.rows.nbytes, "forked": forked}))
""")


def test_the_trainer_s_peak_memory_does_not_grow_by_the_dataset_s_size_while_the_loader_is_made(tmp_path):
    """Measured in a fresh interpreter, by the kernel's peak resident size of the trainer
    (VmHWM, reset through /proc/self/clear_refs before the loader is made)."""
    script = tmp_path / "peak.py"
    script.write_text(_MEMORY_SCRIPT)
    done = subprocess.run([sys.executable, str(script), "fork"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=child_environment())
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["forked"], found
    # Before: the pickle's 200 MiB and the copy's 200 MiB at once. Now tens of MiB at most
    # (the ring, the modules the loader imports as it is made).
    assert found["growth"] < found["bytes"] // 2, (found["growth"] / 2**20, found["bytes"] / 2**20)

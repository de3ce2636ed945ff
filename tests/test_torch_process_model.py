"""shmloader.torch.DataLoader's readers behave as torch's DataLoader workers do, checked
against torch's own loader, on the fork path and the spawn path alike: they run in the
trainer's working directory with its sys.path, get_worker_info() answers inside them (id,
num_workers, seed, dataset), and worker_init_fn runs once in each reader before its first
sample (again in a reader that replaces one killed, and for each epoch's readers without
persistent_workers), counted by the files it leaves, not by the loader."""

from __future__ import annotations

import functools
import gc
import os
import signal
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402
from torch.utils.data import Dataset, get_worker_info  # noqa: E402

from conftest import wait_until  # noqa: E402
from shmloader.torch import DataLoader as _DataLoader  # noqa: E402

# SIGALRM instead of pytest-timeout's timer thread: the fork path forks a trainer without
# threads (conftest's harness_threads_not_counted leaves out the harness's others).
pytestmark = [pytest.mark.timeout(120, method="signal"), pytest.mark.usefixtures("harness_threads_not_counted")]


@pytest.fixture(params=["fork", "spawn"])
def DataLoader(request):  # noqa: N802 (stands for the class)
    """The drop-in with each start method: readers forked from the trainer, or started from
    the fork server with the dataset pickled."""
    def make(*args, **kwargs):
        if request.param == "fork":  # The queue threads of torch's reference loader end once it is collected.
            gc.collect()
            assert wait_until(lambda: threading.active_count() == 1, timeout=10), threading.enumerate()
        loader = _DataLoader(*args, multiprocessing_context=request.param, **kwargs)
        if loader.num_workers and loader._loader._dataset.spec.forked != (request.param == "fork"):
            loader.close()
            raise AssertionError(f"the loader did not take the {request.param} path")
        return loader

    return make


class RelativeWords(Dataset):
    """Reads its words from data/words.txt, relative to the working directory."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int):
        with open(os.path.join("data", "words.txt")) as file:
            return {"word": file.read().split()[index], "index": index}


def _batches(loader) -> list:
    return [{"word": list(batch["word"]), "index": batch["index"].tolist()} for batch in loader]


def test_a_dataset_opening_a_relative_path_reads_it_in_the_readers_as_in_torchs_workers(DataLoader, tmp_path,
                                                                                        monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "words.txt").write_text(" ".join(f"word{index}" for index in range(9)))
    monkeypatch.chdir(tmp_path)
    expected = _batches(TorchDataLoader(RelativeWords(), batch_size=4, num_workers=2))
    with DataLoader(RelativeWords(), batch_size=4, num_workers=2) as loader:
        assert _batches(loader) == expected


class SysPathSeen(Dataset):
    """Whether a reader's sys.path starts with the trainer's (as it was at construction)."""

    def __init__(self) -> None:
        self.trainer_path = [os.path.abspath(entry) for entry in sys.path]

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        head = [os.path.abspath(entry) for entry in sys.path[:len(self.trainer_path)]]
        return np.array(head == self.trainer_path)


def test_readers_see_the_trainers_sys_path_in_its_order_as_torchs_workers(DataLoader, tmp_path):
    sys.path.insert(0, str(tmp_path))  # A directory only this trainer has, first.
    try:
        expected = [batch.tolist() for batch in TorchDataLoader(SysPathSeen(), batch_size=2, num_workers=2)]
        with DataLoader(SysPathSeen(), batch_size=2, num_workers=2) as loader:
            assert [batch.tolist() for batch in loader] == expected == [[True, True], [True, True]]
    finally:
        sys.path.remove(str(tmp_path))


class WorkerView(Dataset):
    """Each sample is what get_worker_info() says in the process reading it (read without a
    None check, as a dataset written for workers does), and what worker_init_fn left."""

    def __init__(self, length: int = 24) -> None:
        self.length, self.initialised_by = length, -1
        # (directory, calls): each sample waits for that many worker_init_fn calls, so that
        # every reader has run it before the epoch can end (a reader loads each epoch's
        # dataset when it next looks for work), whatever the machine's load.
        self.barrier = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        # Not the probe of dataset[0] (in a fork of the trainer, or in the trainer), which runs
        # no worker_init_fn.
        if self.barrier is not None and self.initialised_by != -1:
            directory, calls = self.barrier
            assert wait_until(lambda: len(os.listdir(directory)) >= calls), (directory, calls)
        info = get_worker_info()
        return {"id": info.id, "num_workers": info.num_workers, "seed": info.seed,
                "own_copy": info.dataset is self, "initialised_by": self.initialised_by}


def record_init(directory: str, worker_id: int) -> None:
    """A worker_init_fn: leaves a file per call (its id, pid, the seeds it sees) and marks
    the process's dataset copy."""
    info = get_worker_info()
    info.dataset.initialised_by = worker_id
    with open(os.path.join(directory, f"{worker_id}-{os.getpid()}-{len(os.listdir(directory))}"), "w") as file:
        file.write(f"{info.id} {info.num_workers} {info.seed} {torch.initial_seed()}")


def _calls(directory) -> list[tuple[int, int, int, int, int]]:
    """(worker id, pid, info.id, info.num_workers, info.seed == torch.initial_seed()) per call."""
    calls = []
    for path in sorted(directory.iterdir()):
        worker_id, pid, _ = path.name.split("-")
        info_id, num_workers, seed, initial_seed = map(int, path.read_text().split())
        calls.append((int(worker_id), int(pid), info_id, num_workers, seed == initial_seed))
    return calls


def _views(loader) -> list[dict]:
    rows = []
    for batch in loader:
        rows += [dict(zip(batch, values)) for values in zip(*(batch[key].tolist() for key in batch))]
    return rows


def _check_views(rows: list[dict], num_workers: int) -> dict[int, int]:
    """Asserts what both loaders promise of each sample's view; returns each id's seed."""
    seeds = {}
    for row in rows:
        assert 0 <= row["id"] < num_workers and row["num_workers"] == num_workers, row
        assert row["own_copy"] and row["initialised_by"] == row["id"], row
        assert 0 <= row["seed"] < 2**64 and seeds.setdefault(row["id"], row["seed"]) == row["seed"], row
    assert len(set(seeds.values())) == len(seeds), seeds  # A seed of its own per worker.
    return seeds


# One worker and several on the fork path; the spawn path (each reader a fresh interpreter
# importing torch) with several, where its ids and counts could go wrong as they could forked.
@pytest.mark.parametrize(("DataLoader", "num_workers"), [("fork", 1), ("fork", 3), ("spawn", 3)],
                         indirect=["DataLoader"])
def test_get_worker_info_answers_in_readers_as_in_torchs_workers(DataLoader, tmp_path, num_workers):
    theirs, ours = tmp_path / "torch", tmp_path / "ours"
    theirs.mkdir()
    ours.mkdir()
    torch_rows = _views(TorchDataLoader(WorkerView(), batch_size=4, num_workers=num_workers,
                                        worker_init_fn=functools.partial(record_init, str(theirs)),
                                        generator=torch.Generator().manual_seed(5)))
    torch_seeds = _check_views(torch_rows, num_workers)
    with DataLoader(WorkerView(), batch_size=4, num_workers=num_workers, generator=torch.Generator().manual_seed(5),
                    worker_init_fn=functools.partial(record_init, str(ours))) as loader:
        rows = _views(loader)
        assert len(rows) == len(torch_rows) == 24
        seeds = _check_views(rows, num_workers)
        # A reader runs worker_init_fn as it starts, whether or not it has a sample to read.
        assert wait_until(lambda: len(os.listdir(ours)) == num_workers)
        pids = set(loader._loader.diagnostics.reader_pids)
    # In worker_init_fn, torch.initial_seed() is the worker's seed, the id and count its own.
    for calls in (_calls(theirs), _calls(ours)):
        assert sorted(call[0] for call in calls) == list(range(num_workers))
        assert all(info_id == worker_id and count == num_workers and same
                   for worker_id, _, info_id, count, same in calls), calls
    assert {call[1] for call in _calls(ours)} == pids
    # The same generator gives each id the same seed again, as torch's base seed does.
    with DataLoader(WorkerView(), batch_size=4, num_workers=num_workers, generator=torch.Generator().manual_seed(5),
                    worker_init_fn=functools.partial(record_init, str(tmp_path))) as again:
        assert all(seeds.get(worker_id, seed) == seed for worker_id, seed in _check_views(_views(again),
                                                                                            num_workers).items())
    assert torch_seeds and seeds


def test_get_worker_info_is_none_in_the_trainer_with_num_workers_0_as_in_torch(DataLoader, tmp_path):
    class Probe(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return np.int64(get_worker_info() is None)

    assert [batch.tolist() for batch in TorchDataLoader(Probe(), batch_size=2)] == [[1, 1], [1, 1]]
    with DataLoader(Probe(), batch_size=2, worker_init_fn=functools.partial(record_init, str(tmp_path))) as loader:
        assert [batch.tolist() for batch in loader] == [[1, 1], [1, 1]]
    assert get_worker_info() is None and not list(tmp_path.iterdir())  # Not run without workers, as torch's.


@pytest.mark.parametrize("persistent", [True, False])
def test_worker_init_fn_runs_once_per_reader_before_its_first_sample_as_torchs(DataLoader, tmp_path, persistent):
    """Counted over two epochs: once per reader with persistent_workers, once per reader and
    epoch without (torch starts new workers, the drop-in's readers load the dataset anew)."""
    theirs, ours = tmp_path / "torch", tmp_path / "ours"
    theirs.mkdir()
    ours.mkdir()
    dataset = WorkerView()
    reference = TorchDataLoader(dataset, batch_size=3, num_workers=2, persistent_workers=persistent,
                                worker_init_fn=functools.partial(record_init, str(theirs)))
    for epoch in range(2):
        dataset.barrier = (str(theirs), 2 if persistent else 2 * (epoch + 1))
        _check_views(_views(reference), 2)
    del reference  # Its persistent workers end, and its queues' threads.
    dataset = WorkerView()
    dataset.barrier = (str(ours), 2)  # The readers' first copy is pickled as the loader is made.
    with DataLoader(dataset, batch_size=3, num_workers=2, persistent_workers=persistent,
                    worker_init_fn=functools.partial(record_init, str(ours))) as loader:
        for epoch in range(2):
            dataset.barrier = (str(ours), 2 if persistent else 2 * (epoch + 1))
            rows = _views(loader)
            _check_views(rows, 2)
            assert len(rows) == 24
    expected = sorted(call[0] for call in _calls(theirs))
    assert expected == ([0, 1] if persistent else [0, 0, 1, 1])
    assert sorted(call[0] for call in _calls(ours)) == expected
    # The same two readers each epoch; without persistent_workers, forked readers are new
    # ones each epoch, as torch's workers are (the spawn path keeps them and reloads the dataset).
    assert len({call[1] for call in _calls(ours)}) in ((2,) if persistent else (2, 4))


class KillsOnce(WorkerView):
    """WorkerView whose sample 7 SIGKILLs its reader while the file `kills` says 1."""

    def __init__(self, kills: str) -> None:
        super().__init__()
        self.kills = kills

    def __getitem__(self, index: int):
        if index == 7 and get_worker_info() is not None:
            with open(self.kills, "r+") as file:
                if file.read().strip() == "1":
                    file.seek(0)
                    file.write("0\n")
                    file.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


def test_a_reader_replacing_one_killed_runs_worker_init_fn_before_its_first_sample(DataLoader, tmp_path):
    calls, kills = tmp_path / "calls", tmp_path / "kills"
    calls.mkdir()
    kills.write_text("1\n")
    with DataLoader(KillsOnce(str(kills)), batch_size=3, num_workers=2, persistent_workers=True,
                    worker_init_fn=functools.partial(record_init, str(calls))) as loader:
        rows = _views(loader)
        assert kills.read_text().strip() == "0" and len(rows) == 24
        assert all(row["initialised_by"] == row["id"] for row in rows)
        assert loader._loader.stats()["reader_restarts"] == 1
        # The replacement loads the dataset as it starts (it may have had no sample to read).
        assert wait_until(lambda: len(os.listdir(calls)) == 3)
    found = _calls(calls)
    assert sorted(call[0] for call in found) in ([0, 0, 1], [0, 1, 1]) and len({call[1] for call in found}) == 3


def failing_init(worker_id: int) -> None:
    raise OSError(f"no device for worker {worker_id}")


def test_an_error_in_worker_init_fn_reaches_the_trainer_naming_it(DataLoader):
    with DataLoader(WorkerView(), batch_size=3, num_workers=1, worker_init_fn=failing_init) as loader:
        with pytest.raises(OSError, match=r"no device for worker 0(.|\n)*worker_init_fn\(0\)"):
            list(loader)


def keep_collate(samples: list):
    """A collate_fn other than default_collate (the readers collate through a wrapper)."""
    return torch.utils.data.default_collate(samples)


def test_get_worker_info_gives_the_users_dataset_with_a_collate_fn(DataLoader, tmp_path):
    with DataLoader(WorkerView(8), batch_size=4, num_workers=2, collate_fn=keep_collate,
                    worker_init_fn=functools.partial(record_init, str(tmp_path))) as loader:
        rows = _views(loader)
    assert len(rows) == 8
    _check_views(rows, 2)  # info.dataset is the dataset whose __getitem__ runs, worker_init_fn marked it.

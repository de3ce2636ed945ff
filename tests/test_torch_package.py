"""shmloader/torch/ as a package: the core imports no torch, a reader loading the drop-in's
hook loads nothing of the trainer's, and the names shmloader.torch gave as one module
(torch.py) it still gives. Each check runs in a fresh interpreter, whose sys.modules is
the reference."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("torch")

from conftest import child_environment  # noqa: E402


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    done = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys; print(json.dumps(sorted(sys.modules)))"],
                          capture_output=True, text=True, timeout=120, env=child_environment(),
                          cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_core_a_trainer_and_a_reader_import_knows_nothing_of_torch():
    modules = _modules_after("import shmloader, shmloader.loader, shmloader.readers.reader, "
                             "shmloader.fill.dataset_runner, shmloader.tools.cli")
    assert "torch" not in modules
    assert not {name for name in modules if name.startswith("shmloader.torch")}


def test_a_reader_importing_the_drop_ins_hook_loads_none_of_the_trainers_modules():
    """The hook is named by its import path (worker.HOOK); its package's names load on first
    use, so a reader's start-up stays what it was when the hook was a module of the core."""
    modules = _modules_after("import shmloader.readers.reader, shmloader.fill.dataset_runner, importlib\n"
                             "from shmloader.torch.worker import HOOK\n"
                             "importlib.import_module(HOOK.partition(':')[0])")
    assert "shmloader.torch.worker" in modules
    assert not modules & {"shmloader.loader", "shmloader.torch.adapters", "shmloader.torch.dataloader",
                          "shmloader.torch.sampling"}


@pytest.mark.parametrize("name", ["DataLoader", "TorchLoader", "ShmIterableDataset", "CollateGrowthWarning",
                                  "ShmDataLoader", "torch", "_check_dispatched", "_check_shard", "_ranks",
                                  "_steps_left", "_tensors", "_accelerate_dataloader", "_PICKLE_REFUSAL"])
def test_every_name_the_single_module_gave_is_still_given_and_listed(name):
    import shmloader.torch

    exec(f"from shmloader.torch import {name}", {})
    assert name in dir(shmloader.torch)


def test_a_sampler_still_makes_the_sampled_loader_when_dataloader_comes_from_the_package():
    import torch.utils.data

    from shmloader.torch import DataLoader
    from shmloader.torch.sampling import SampledDataLoader

    dataset = list(range(8))
    loader = DataLoader(dataset, batch_size=2, sampler=torch.utils.data.SequentialSampler(dataset))
    try:
        assert type(loader) is SampledDataLoader and isinstance(loader, DataLoader)
    finally:
        loader.close()

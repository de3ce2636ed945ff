"""The `shmloader` command: demo trains to well above chance, convert/inspect/bench work on real
files and fail clearly on bad ones; the examples run."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from shmloader.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_demo_learns_from_aligned_data_and_labels(capsys):
    from shmloader.demo import run

    result = run(rows=6000, steps=150, progress=False)
    assert result["accuracy"] > 0.5  # Chance is 10%: data and labels stayed aligned.
    assert "held-out accuracy" in capsys.readouterr().out


def test_convert_and_inspect_commands(tmp_path, capsys, dataset):
    np.save(tmp_path / "x.npy", np.arange(5000, dtype=np.float32).reshape(1000, 5))
    assert main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "x.b2nd"), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "x.b2nd"), "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "x.b2nd"), "--quiet", "--force", "--codec", "zstd"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "x.b2nd"), "--json", "--sample", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 1000 and report["codec"] == "ZSTD"
    assert main(["inspect", dataset["paths"]["images_default"], "--sample", "8"]) == 0
    assert "fix" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "missing.b2nd")]) == 2
    assert "missing.b2nd" in capsys.readouterr().err


def test_bench_command(dataset, capsys):
    paths = dataset["paths"]
    assert main(["bench", paths["images_b2nd"], paths["labels_b2nd"], "--steps", "30", "--batch-size", "16",
                 "--readers", "1", "--slots", "2", "--quiet"]) == 0
    output = capsys.readouterr().out
    assert "rows/s" in output and "GB/s" in output and "shared memory" in output and "field 'images'" in output
    assert main(["bench", paths["labels_npy"], "--plot", "x.png", "--quiet"]) == 2
    assert "--plot goes with --sweep" in capsys.readouterr().err


def test_bench_compare_torch(dataset, capsys):
    pytest.importorskip("torch")
    assert main(["bench", dataset["paths"]["labels_npy"], "--steps", "20", "--batch-size", "8", "--readers", "1",
                 "--compare", "torch", "--quiet"]) == 0
    assert "PyTorch DataLoader" in capsys.readouterr().out


def test_command_line_entry_point_runs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "shmloader.cli", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and "demo" in result.stdout


@pytest.mark.parametrize("name,module", [("train_torch", "torch"), ("train_jax", "jax")])
def test_examples_train(name, module):
    pytest.importorskip(module)
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(steps=200) > 0.3


def test_bench_sweep_draws_a_plot(dataset, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sweep.png"
    assert main(["bench", dataset["paths"]["labels_npy"], "--steps", "10", "--batch-size", "8", "--sweep",
                 "--plot", str(plot), "--quiet"]) == 0
    assert "best: readers=" in capsys.readouterr().out
    assert plot.read_bytes().startswith(b"\x89PNG")

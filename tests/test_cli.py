"""The `shmloader` command: demo trains to well above chance, convert/inspect/bench work on real
files and fail clearly on bad ones; the examples run."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from shmloader.tools.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_demo_learns_from_aligned_data_and_labels(capsys):
    from shmloader.tools.demo import run

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
    out = capsys.readouterr().out  # Whether compression pays for cold reads, from a measured rate and the ratio.
    assert re.search(r"decompresses at [\d,]+ MB/s on one core: compression pays for cold reads only where the disk "
                     r"gives each reader less than [\d,]+ MB/s", out), out
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
    result = subprocess.run([sys.executable, "-m", "shmloader.tools.cli", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and "demo" in result.stdout


@pytest.mark.parametrize("name,module", [("train_torch", "torch"), ("train_jax", "jax")])
def test_examples_train(name, module):
    pytest.importorskip(module)
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(steps=200) > 0.3


@pytest.mark.filterwarnings("ignore::shmloader.SkippedRecordsWarning")  # The example's broken image, on purpose.
def test_imagenet_style_example_trains():
    pytest.importorskip("torch")
    pytest.importorskip("PIL")
    spec = importlib.util.spec_from_file_location("train_imagenet_style", ROOT / "examples" / "train_imagenet_style.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(steps=60) > 0.5  # Four classes: chance is 0.25.


def test_bench_sweep_draws_a_plot(dataset, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sweep.png"
    assert main(["bench", dataset["paths"]["labels_npy"], "--steps", "10", "--batch-size", "8", "--sweep",
                 "--seconds-per-point", "0", "--repeats", "1",
                 "--plot", str(plot), "--quiet"]) == 0
    assert "best: readers=" in capsys.readouterr().out
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_bench_sweep_runs_with_its_progress_bar(dataset, capsys):
    """tqdm(zip(range(n), loader)) kept one batch more than the sweep's 2 slots per reader
    allowed: SlotsExhaustedError on every run with the bar on (the default)."""
    assert main(["bench", dataset["paths"]["labels_npy"], "--steps", "30", "--batch-size", "8", "--sweep",
                 "--seconds-per-point", "0", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "best: readers=" in out and "readers=1 slots=4:" in out  # 2 per reader + the trainer's 2.


def test_python_dash_m_and_version_work_like_the_command(tmp_path):
    from shmloader import __version__

    # In tmp_path: `-m` puts the working directory first on sys.path, where a source
    # checkout must not shadow the installed package.
    result = subprocess.run([sys.executable, "-m", "shmloader", "--version"], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"shmloader {__version__}"
    result = subprocess.run([sys.executable, "-m", "shmloader", "convert", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert result.returncode == 0 and "(default: auto)" in result.stdout and "(default: 5)" in result.stdout


def test_every_option_has_help_text():
    from shmloader.tools.cli import build_parser

    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command")
    for name, command in commands.choices.items():
        for action in command._actions:
            assert action.help, f"shmloader {name} {action.option_strings or action.dest} has no help text"


def test_convert_refuses_a_npy_output_name(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.arange(10, dtype=np.int64))
    assert main(["convert", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), "--quiet"]) == 2
    assert "name it .b2nd" in capsys.readouterr().err
    assert not (tmp_path / "y.npy").exists()


def test_missing_optional_dependencies_are_reported_before_the_benchmark_runs(dataset, capsys, monkeypatch):
    import importlib.util as importlib_util

    real_find_spec = importlib_util.find_spec
    monkeypatch.setattr(importlib_util, "find_spec", lambda name, *a: None if name in ("torch", "matplotlib") else real_find_spec(name, *a))
    path = dataset["paths"]["labels_npy"]
    assert main(["bench", path, "--sweep", "--plot", "x.png", "--quiet"]) == 2
    error = capsys.readouterr()
    assert "needs matplotlib" in error.err and "pip install '.[plot]'" in error.err and "rows/s" not in error.out
    assert main(["bench", path, "--compare", "torch", "--quiet"]) == 2
    error = capsys.readouterr()
    assert "needs torch" in error.err and "rows/s" not in error.out


def test_ctrl_c_in_a_command_exits_130_with_one_line(tmp_path):
    """A real SIGINT to a running `shmloader bench`: one line on stderr, no traceback."""
    import os
    import signal
    import time

    np.save(tmp_path / "x.npy", np.zeros((5000, 64), dtype=np.uint8))
    process = subprocess.Popen(
        [sys.executable, "-m", "shmloader", "bench", str(tmp_path / "x.npy"), "--steps", "100000000", "--quiet",
         "--batch-size", "8", "--readers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(f"/proc/{process.pid}") or "field" not in (process.stdout.readline() or ""):
            assert time.monotonic() < deadline and process.poll() is None
        time.sleep(1.0)  # In the timed loop by now.
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert stderr.strip() == "shmloader bench: interrupted"


@pytest.fixture
def ragged_dir(tmp_path):
    from shmloader.tools.convert import write_ragged

    rng = np.random.default_rng(0)
    write_ragged(tmp_path / "docs.ragged", [rng.integers(0, 100, rng.integers(1, 30)).astype(np.int32)
                                            for _ in range(200)])
    return str(tmp_path / "docs.ragged")


def test_inspect_verify_and_bench_take_a_ragged_directory(ragged_dir, capsys):
    """They refused it: "... is a directory"."""
    assert main(["inspect", ragged_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "ragged" and report["records"] == 200 and 1 <= report["elements_min"]
    assert main(["verify", ragged_dir, "--quiet"]) == 0  # Each of its files with checksums.
    assert "values.b2nd: every chunk matches its checksum" in capsys.readouterr().out
    assert main(["bench", ragged_dir, "--steps", "20", "--batch-size", "8", "--quiet"]) == 0
    assert "read as Packed" in capsys.readouterr().out


def test_bench_takes_a_glob_of_shards(tmp_path, capsys):
    for shard in range(3):
        np.save(tmp_path / f"label-{shard}.npy", np.arange(50, dtype=np.int64))
    assert main(["bench", str(tmp_path / "label-*.npy"), "--steps", "20", "--batch-size", "8", "--quiet"]) == 0
    assert "3 files, 150 rows" in capsys.readouterr().out



def test_bench_without_readers_reports_the_readers_that_ran_not_the_most_auto_may_reach(tmp_path, capsys,
                                                                                          monkeypatch):
    """Without --readers the loader's default is readers="auto": loader.readers is the most it
    may reach (the node's budget, 63 on 64 cores), and the report said readers=63 (and
    --compare torch ran 63 workers) where a few ran."""
    np.save(tmp_path / "label.npy", np.arange(400, dtype=np.int64))
    monkeypatch.setenv("SHMLOADER_CPU_BUDGET", "6")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    assert main(["bench", str(tmp_path / "label.npy"), "--steps", "20", "--batch-size", "8", "--quiet"]) == 0
    output = capsys.readouterr().out
    assert "readers=6 " not in output, output
    assert re.search(r"readers=auto \(\d at the end, at most 6\)", output), output


@pytest.mark.parametrize("argv", [["bench", "x.npy", "--steps", "0"], ["inspect", "x.npy", "--sample", "0"],
                                  ["inspect", "x.npy", "--sample", "-1"]])
def test_counts_below_one_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_help_texts_name_each_default_once(capsys):
    for command in ("bench", "convert", "inspect"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: None)" not in text and "(default: False)" not in text
        assert not re.search(r"\(default: [^)]*\) \(default:", text), text


def test_convert_images_given_a_file_says_it_wants_a_directory(tmp_path, capsys):
    (tmp_path / "one.jpg").write_bytes(b"\xff\xd8")
    assert main(["convert-images", str(tmp_path / "one.jpg"), str(tmp_path / "out")]) == 2
    assert "one.jpg is a file; expected a directory of class subdirectories" in capsys.readouterr().err


def test_compare_torch_with_sweep_runs_torch_with_the_best_points_readers(dataset, monkeypatch, capsys):
    from shmloader.tools import benchmark

    def fake_run(fields, batch_size, readers, slots, mode, progress, rule):
        rate = {1: 10.0, 2: 30.0}.get(readers, 5.0)  # The best point is not the last one swept.
        return {"readers": readers, "slots": slots, "rows_per_s": rate, "batches_per_s": 1.0, "gb_per_s": 0.0,
                "wait_fraction": 0.0, "first_batch_s": 0.0, "shared_memory_mib": 0.0, "starved_fraction": 0.0,
                "batches_per_wakeup": 1.0}

    used = []
    monkeypatch.setattr(benchmark, "run_loader", fake_run)
    monkeypatch.setattr(benchmark, "run_torch", lambda fields, batch, workers, rule: used.append(workers) or
                        {"rows_per_s": 1.0, "spread": 0.0, "rounds": 5, "rounds_used": 5, "settled": True})
    monkeypatch.setattr(benchmark, "_require", lambda *args: None)
    assert main(["bench", dataset["paths"]["labels_npy"], "--sweep", "--compare", "torch", "--quiet",
                 "--repeats", "1"]) == 0
    assert used == [2]


def test_the_sweep_times_each_setting_long_enough_repeats_it_and_says_how_sure_the_pick_is(dataset, monkeypatch,
                                                                                          capsys):
    """Its advice was noise: 500 steps (0.1-0.6 s) a point, run once; the best changed
    between runs; the default slots were never tried."""
    from shmloader.tools import benchmark

    calls = []

    def fake_run(fields, batch_size, readers, slots, mode, progress, rule):
        calls.append((readers, slots, rule.min_s))
        rate = 100.0 + (10.0 if readers == 2 else 0.0) + len(calls) % 3  # Readers 2 ahead, within noise of none.
        return {"readers": readers, "slots": slots, "rows_per_s": rate, "batches_per_s": 1.0, "gb_per_s": 0.0,
                "wait_fraction": 0.0, "first_batch_s": 0.0, "shared_memory_mib": 0.0, "starved_fraction": 0.0,
                "batches_per_wakeup": 1.0}

    monkeypatch.setattr(benchmark, "run_loader", fake_run)
    assert main(["bench", dataset["paths"]["labels_npy"], "--sweep", "--quiet", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert {slots for readers, slots, _ in calls if readers == 2} == {6, 10}  # 2 and 4 per reader + 2: the default.
    assert all(seconds == 2.0 for _, _, seconds in calls)
    points = {(readers, slots) for readers, slots, _ in calls}
    assert len(calls) == 3 * len(points)
    assert "best: readers=2" in out and "rows/s median" in out
    assert "every other setting's runs stayed below its slowest run" in out or "within run-to-run noise" in out


def test_the_tokenize_example_writes_documents_that_windows_read(tmp_path):
    pytest.importorskip("tokenizers")
    spec = importlib.util.spec_from_file_location("tokenize_corpus", ROOT / "examples" / "tokenize_corpus.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i}: " + "some words " * (i % 9)}) for i in range(300)))
    assert example.main([str(corpus), "--out", str(tmp_path / "corpus.tokens")]) > 0
    from shmloader.storage.ragged import describe_ragged

    assert describe_ragged(tmp_path / "corpus.tokens").record_count == 300


def _one_line_error(capsys, argv, pattern) -> str:
    """The command exits 2 with one message matching `pattern`, and no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(pattern, err), err
    return err


def test_import_errors_name_the_column_file_or_setting_without_a_traceback(tmp_path, capsys):
    """Before: KeyError and ArrowInvalid tracebacks, and an option the import lacked."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"a": [1, None, 3], "b": [[1], [2, 3], None]}), tmp_path / "t.parquet")
    source, out = str(tmp_path / "t.parquet"), str(tmp_path / "out")
    _one_line_error(capsys, ["import", "parquet", source, out, "--columns", "nope", "--quiet"],
                    r"columns \['nope'\] are not in the source")
    _one_line_error(capsys, ["import", "parquet", source, out, "--columns", "a,a", "--quiet"],
                    r"asked for more than once")
    _one_line_error(capsys, ["import", "parquet", source, out, "--quiet"], r"column 'a': row 1 is null")
    _one_line_error(capsys, ["import", "parquet", source, out, "--nulls", "a", "--quiet"], r"COLUMN=VALUE")
    assert main(["import", "parquet", source, out, "--nulls", "a=-1", "--nulls", "b=empty", "--quiet"]) == 0
    assert np.load(tmp_path / "out" / "a.npy").tolist() == [1, -1, 3]
    (tmp_path / "garbage.arrow").write_bytes(b"garbage\n" * 10)
    _one_line_error(capsys, ["import", "arrow", str(tmp_path / "garbage.arrow"), str(tmp_path / "o2"), "--quiet"],
                    r"garbage.arrow: neither an Arrow IPC file nor an Arrow stream")
    _one_line_error(capsys, ["import", "parquet", source, out, "--quiet"], r"--force")


def test_convert_into_an_unwritable_place_names_it(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.arange(100).reshape(10, 10))
    _one_line_error(capsys, ["convert", str(tmp_path / "x.npy"), "/proc/x.b2nd", "--quiet"], r"/proc/x.b2nd: ")


@pytest.mark.parametrize("argv, pattern", [
    (["demo", "--steps", "-1"], r"--steps: .*at least 1"),
    (["demo", "--rows", "0"], r"--rows: .*at least 1"),
])
def test_demo_counts_below_one_are_refused(argv, pattern, capsys):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2 and re.search(pattern, capsys.readouterr().err)


def test_a_demo_too_small_to_learn_says_so(capsys):
    """Before: `demo --rows 10` exited 1 with no message."""
    _one_line_error(capsys, ["demo", "--rows", "10", "--quiet"], r"rows must be an integer of at least 2,000")


def test_bench_runs_with_readers_zero_and_refuses_negative_counts(dataset, capsys):
    """The loader fills steps in the trainer with readers=0; bench refused it."""
    assert main(["bench", dataset["paths"]["labels_npy"], "--readers", "0", "--steps", "20", "--batch-size", "8",
                 "--quiet"]) == 0
    assert "rows/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "x.npy", "--readers", "-1"])
    assert "must be at least 0" in capsys.readouterr().err


@pytest.mark.parametrize("name, module", [("train_lightning", "lightning"), ("train_hf_trainer", "transformers")])
def test_the_framework_examples_train_on_the_cpu(name, module, tmp_path, monkeypatch):
    """Lightning (a LightningDataModule, a fresh pass per epoch) and Hugging Face's Trainer
    (get_train_dataloader overridden) train from shmloader.torch.TorchLoader."""
    pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main() > 0.3  # Ten classes: chance is 0.1.
    import gc

    gc.collect()  # The frameworks drop their dataloader when training ends; its loader closes with it.

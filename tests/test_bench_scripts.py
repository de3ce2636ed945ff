"""The scripts in bench/ leave the checkout as it was unless asked: a run saves its table only
with --write, bench/report.py rewrites README.md and RESULTS.md only with --write, and their
output speaks of what is compared, not of the project's internal targets."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


@pytest.fixture
def common(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    import _common

    monkeypatch.setattr(_common, "RESULTS_DIRECTORY", str(tmp_path / "results"))
    return _common


def test_a_run_saves_its_table_only_with_write(common, tmp_path, capsys):
    assert common.record("example", "python bench/example.py", ["a"], [["1"]]) is None
    assert not (tmp_path / "results").exists()
    assert "--write" in capsys.readouterr().out
    path = common.record("example", "python bench/example.py", ["a"], [["1"]], write=True)
    assert pathlib.Path(path) == tmp_path / "results" / "example.json"
    assert '"rows": [\n  [\n   "1"' in pathlib.Path(path).read_text()


def test_the_recorded_command_is_the_one_to_rerun_without_write(common, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench/dataset.py", "--cases", "b", "--write"])
    assert common.command_line("dataset.py") == "python bench/dataset.py --cases b"


def test_report_without_write_changes_no_file():
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in (ROOT / "README.md", BENCH / "RESULTS.md")}
    result = subprocess.run([sys.executable, str(BENCH / "report.py")], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--write" in result.stdout and "| data |" in result.stdout
    after = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in before}
    assert after == before


@pytest.mark.parametrize("script", sorted(path.name for path in BENCH.glob("*.py")))
def test_no_script_prints_pass_fail_verdicts_or_issue_numbers(script):
    text = (BENCH / script).read_text()
    assert not re.search(r"\b(PASS|FAIL)\b|verdict\(", text), script
    assert not re.search(r"\b[Ii]ssue \d+", text), script


@pytest.mark.parametrize("script", ["throughput.py", "ragged.py", "images.py", "dataset.py", "cold.py",
                                    "object_store.py"])
def test_every_script_that_records_takes_write(script):
    text = (BENCH / script).read_text()
    assert "add_write_argument(parser)" in text and "write=" in text

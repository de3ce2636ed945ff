"""The scripts in bench/ leave the checkout as it was unless asked: a run saves its table only
with --write, bench/report.py rewrites README.md and RESULTS.md only with --write, and their
output speaks of what is compared, not of the project's internal targets; and bench/autotune.py's
torchrun case finds a rank that waits beside another's idle readers."""

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
                                    "object_store.py", "autotune.py"])
def test_every_script_that_records_takes_write(script):
    text = (BENCH / script).read_text()
    assert "add_write_argument(parser)" in text and "write=" in text


@pytest.fixture
def ranks(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import _autotune_ranks

    return _autotune_ranks


# bench/autotune.py's torchrun case: its check that no rank waits while another's readers idle.

def _rank(rank, wait_share, readers, readers_busy, least=1):
    return {"rank": rank, "wait_share": wait_share, "readers": readers, "readers_busy": readers_busy, "least": least}


def test_a_rank_that_waits_beside_a_rank_with_idle_readers_is_reported(ranks):
    waiting, idle = _rank(0, 0.4, 1, 0.98), _rank(1, 0.0, 3, 0.6)  # Rank 1 needs 2 readers at half busy: 1 spare.
    assert ranks.spare_readers(idle) == 1
    found = ranks.waits_beside_idle_readers([waiting, idle])
    assert len(found) == 1 and found[0].startswith("rank 0 waited 40% while rank 1's 3 readers")


def test_readers_at_the_least_or_busy_are_not_idle_and_a_rank_that_hardly_waits_is_not_waiting(ranks):
    assert ranks.waits_beside_idle_readers([_rank(0, 0.9, 1, 1.0), _rank(1, 0.0, 1, 0.1)]) == []  # At its least.
    assert ranks.waits_beside_idle_readers([_rank(0, 0.9, 1, 1.0), _rank(1, 0.0, 2, 0.9)]) == []  # Both needed.
    assert ranks.waits_beside_idle_readers([_rank(0, 0.04, 1, 1.0), _rank(1, 0.0, 4, 0.1)]) == []  # No wait.


def test_the_fixed_splits_give_the_faster_half_and_the_slower_half_each_count(ranks):
    assert ranks._splits(2, [1, 2]) == ["1,1", "1,2", "2,1", "2,2"]
    assert ranks._splits(4, [1, 3]) == ["1,1,1,1", "1,1,3,3", "3,3,1,1", "3,3,3,3"]

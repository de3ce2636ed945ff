"""The README says what is true: its benchmark table is the current figures of
bench/results (bench/report.py), and every public name it shows still imports."""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_benchmark_tables_are_the_last_runs():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_import_the_readme_shows_still_works():
    text = (ROOT / "README.md").read_text()
    statements = re.findall(r"^\s*from (shmloader[\w.]*) import ([\w, ]+)", text, re.MULTILINE)
    assert len(statements) >= 3
    for module, names in statements:
        imported = importlib.import_module(module)
        for name in (name.strip() for name in names.split(",")):
            assert hasattr(imported, name), f"{module}.{name}"
    for dotted in set(re.findall(r"`(shmloader(?:\.\w+)+)[.:(`]", text)):
        module, _, attribute = dotted.rpartition(".")
        try:
            importlib.import_module(dotted)
        except ModuleNotFoundError:
            assert hasattr(importlib.import_module(module), attribute), dotted

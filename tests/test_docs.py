"""The README says what is true: its benchmark table is the current figures of
bench/results (bench/report.py), and every public name it shows still imports."""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Optional extras a public module needs: without them that module is not checked here.
OPTIONAL = ("torch", "ray", "prometheus_client")


def _import(module: str):
    """The module, or None where it needs an optional extra that is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] in OPTIONAL:
            return None
        raise


def test_the_benchmark_tables_are_the_last_runs():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_import_the_readme_shows_still_works():
    text = (ROOT / "README.md").read_text()
    statements = re.findall(r"^\s*from (shmloader[\w.]*) import ([\w, ]+)", text, re.MULTILINE)
    assert len(statements) >= 3
    for module, names in statements:
        imported = _import(module)
        for name in (name.strip() for name in names.split(",")) if imported is not None else ():
            assert hasattr(imported, name), f"{module}.{name}"
    for dotted in set(re.findall(r"`(shmloader(?:\.\w+)+)[.:(`]", text)):
        module, _, attribute = dotted.rpartition(".")
        try:
            _import(dotted)
        except ModuleNotFoundError:
            parent = _import(module)
            assert parent is None or hasattr(parent, attribute), dotted


def test_the_console_script_and_the_public_module_paths_load():
    """The installed `shmloader` command's target, and the paths users and the examples
    import (the modules moved into folders; these stay as public paths)."""
    from importlib.metadata import entry_points

    (script,) = [point for point in entry_points(group="console_scripts") if point.name == "shmloader"]
    assert callable(script.load()), script.value
    public = {"shmloader.convert": ["convert", "write_ragged", "verify", "inspect", "CODECS"],
              "shmloader.formats": ["from_parquet", "from_arrow", "from_webdataset"],
              "shmloader.imagefolder": ["convert_images", "check_images"],
              "shmloader.demo": ["make_dataset", "write_dataset", "CLASSES", "IMAGE_SHAPE"],
              "shmloader.ray": ["RayReaders"], "shmloader.torch": ["TorchLoader"],
              "shmloader.transforms": ["transform", "compute_batch", "check_determinism"]}
    for module, names in public.items():
        imported = _import(module)
        assert imported is None or all(hasattr(imported, name) for name in names), module

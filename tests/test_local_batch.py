"""The tools that compute a batch in this process (tools/local_batch.py) sit above the
filler they drive: their public names still import from shmloader.transforms, as the
same functions, and importing shmloader.transforms, as every reader does, imports neither
them nor fill/. That they compute the readers' batches is test_transforms.py's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import shmloader.transforms
from shmloader.tools import local_batch


def test_the_tools_import_by_their_public_path_as_the_same_functions():
    from shmloader.transforms import check_determinism, compute_batch

    assert compute_batch is local_batch.compute_batch
    assert check_determinism is local_batch.check_determinism
    assert {"compute_batch", "check_determinism"} <= set(dir(shmloader.transforms))
    assert {"compute_batch", "check_determinism"} <= set(shmloader.transforms.__all__)


def test_importing_transforms_imports_neither_the_tools_nor_the_filler():
    code = ("import sys, shmloader.transforms; "
            "print(sorted(m for m in sys.modules if m.startswith(('shmloader.fill', 'shmloader.tools'))))")
    # From the tests' folder: the installed package, not the checkout's unbuilt sources.
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    assert found.stdout.strip() == "[]"


def test_a_name_transforms_does_not_have_is_an_attribute_error():
    with pytest.raises(AttributeError, match="compute_batches"):
        shmloader.transforms.compute_batches  # noqa: B018

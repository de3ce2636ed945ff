"""The cffi declarations agree with the Zig library, and the Zig unit tests pass."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from shmloader import _native

ZIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "zig"


def test_abi_version_matches():
    assert _native.lib.shm_abi_version() == _native.ABI_VERSION


@pytest.mark.parametrize(
    "struct,size_function",
    [
        ("shm_sampler_config", "shm_sizeof_sampler_config"),
        ("shm_blosc_layout", "shm_sizeof_blosc_layout"),
        ("shm_gather_error", "shm_sizeof_gather_error"),
    ],
)
def test_struct_sizes_match(struct, size_function):
    assert _native.ffi.sizeof(struct) == getattr(_native.lib, size_function)()


def test_status_enum_matches_value_for_value():
    for status in _native.Status:
        assert _native.status_name(status.value) == status.name.lower()
    assert _native.status_name(len(_native.Status)) == ""


def test_zig_unit_tests_pass():
    if not ZIG_DIR.exists():
        pytest.skip("no zig/ sources beside the package (installed wheel)")
    pytest.importorskip("ziglang")
    result = subprocess.run(
        [sys.executable, "-m", "ziglang", "test", "c_api.zig"], cwd=ZIG_DIR, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_stale_library_is_refused(tmp_path, monkeypatch):
    library = tmp_path / "lib.so"
    library.write_bytes(b"")
    sources = tmp_path / "zig"
    sources.mkdir()
    (sources / "sampler.zig").write_text("// newer")
    import os
    os.utime(library, ns=(0, 0))
    with pytest.raises(_native.NativeLibraryError, match="lib.so is stale: sampler.zig.*pip install"):
        _native._check_fresh(library, [sources / "sampler.zig"])
    _native._check_fresh(library, [])  # An installed wheel has no sources to compare with.
    os.utime(library, ns=(2 * 10**18, 2 * 10**18))
    _native._check_fresh(library, [sources / "sampler.zig"])

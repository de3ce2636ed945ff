"""The cffi declarations agree with the Zig library, and the Zig unit tests pass."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
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
        ("shm_mixture_source", "shm_sizeof_mixture_source"),
        ("shm_mixture_config", "shm_sizeof_mixture_config"),
    ],
)
def test_struct_sizes_match(struct, size_function):
    assert _native.ffi.sizeof(struct) == getattr(_native.lib, size_function)()


def test_status_enum_is_the_zig_enum_value_for_value():
    """Python reads the names from the library; they are status.zig's, in its order."""
    import re

    declared = re.findall(r"^\s+(\w+) = (\d+),", (ZIG_DIR / "status.zig").read_text(), re.MULTILINE)
    assert [(name.upper(), int(value)) for name, value in declared] == [(s.name, s.value) for s in _native.Status]
    assert _native.status_name(len(_native.Status)) == ""


def test_zig_unit_tests_pass_in_a_safe_build_mode(tmp_path):
    """Debug mode keeps every std.debug.assert and bounds check that ReleaseFast drops."""
    if not ZIG_DIR.exists():
        pytest.skip("no zig/ sources beside the package (installed wheel)")
    pytest.importorskip("ziglang")
    for source in ZIG_DIR.glob("*.zig"):
        if source.name != _native.GENERATED_ZIG_HEADER:
            shutil.copy(source, tmp_path / source.name)
    zig = [sys.executable, "-m", "ziglang"]
    translated = subprocess.run([*zig, "translate-c", "-lc", str(_native.RING_HEADER)], capture_output=True, timeout=120)
    assert translated.returncode == 0, translated.stderr.decode()
    (tmp_path / _native.GENERATED_ZIG_HEADER).write_bytes(translated.stdout)
    result = subprocess.run(
        [*zig, "test", "-ODebug", "c_api.zig"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout + result.stderr


def test_no_process_parses_c_declarations_at_run_time():
    """They are parsed at build time (_ffi.py): pycparser's import and parse were about a
    fifth of a reader's start-up."""
    code = ("import sys, shmloader.readers.reader, shmloader.storage, shmloader._blosc2_capi as capi; capi.load(); "
            "print('pycparser' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert result.stdout.strip() == "False", result.stderr


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


def test_the_source_distribution_holds_every_source(tmp_path):
    """The sdist rebuilds everything: each Zig file, the C extension and the protocol header."""
    root = ZIG_DIR.parent
    if not (root / "pyproject.toml").exists():
        pytest.skip("not a source checkout")
    pytest.importorskip("setuptools")
    script = (
        "import sys; from setuptools import build_meta; "
        f"print(build_meta.build_sdist({str(tmp_path)!r}))"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    import tarfile

    archive = tmp_path / result.stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    expected = {f"zig/{path.name}" for path in ZIG_DIR.glob("*.zig") if path.name != _native.GENERATED_ZIG_HEADER}
    expected |= {f"shmloader/ring/{path.name}" for path in (ZIG_DIR.parent / "shmloader" / "ring").glob("_cursor*.[ch]")}
    expected |= {"shmloader/ring/_cursor.c", "shmloader/ring/_cursor.h", "shmloader/ring/ring.h", "shmloader/py.typed",
                 "shmloader/_declarations.py", "setup.py", "pyproject.toml"}
    assert expected <= names, expected - names
    assert "zig/ring_h.zig" not in names  # Generated at build time from ring.h.
    assert "shmloader/_ffi.py" not in names  # Generated at build time from _declarations.py.


def test_bounded_draws_are_splitmix64_of_a_keyed_counter():
    """Padded(overflow="random") crops with these draws: the specification, spelled out in
    numpy, must give the same values (checkpoints made before the Zig version resume alike)."""
    import numpy as np

    from shmloader.fill.record_readers import _window_starts

    def reference(seed, step, stream, room):
        with np.errstate(over="ignore"):
            key = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(step) * np.uint64(0xBF58476D1CE4E5B9)
                   + np.uint64(stream) * np.uint64(0x94D049BB133111EB))
            value = key + np.arange(1, len(room) + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            value = (value ^ (value >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            value = (value ^ (value >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            value = value ^ (value >> np.uint64(31))
        return value % (room + np.uint64(1))

    rng = np.random.default_rng(0)
    for _ in range(50):
        seed, step, stream = (int(x) for x in rng.integers(0, 1 << 62, 3))
        room = rng.integers(0, 1 << 40, 64).astype(np.uint64)
        draws = _window_starts(seed, step, stream, 64, room)
        assert np.array_equal(draws, reference(seed, step, stream, room)) and (draws <= room).all()


def test_a_checkout_imported_instead_of_the_installed_package_says_so(tmp_path):
    """`pip install .` then Python from the clone's root: the unbuilt source tree in the
    current directory shadows the installed package. The error names the checkout, the
    installed copy and the way out (before: only "rebuild it", which the user had done)."""
    clone, installed = tmp_path / "clone", tmp_path / "site-packages"
    shutil.copytree(_native.PACKAGE_DIR, clone / "shmloader",
                    ignore=shutil.ignore_patterns("*.so", "_ffi.py", "__pycache__"))
    (clone / "zig").mkdir()
    (clone / "zig" / "sampler.zig").write_text("// a source checkout's Zig sources")
    (installed / "shmloader").mkdir(parents=True)
    (installed / "shmloader" / "__init__.py").write_text("")  # Found, never imported.
    # -S: without site's .pth files, so that a development install's import hook (an editable
    # install maps shmloader's modules to its own checkout) stays out; the libraries come
    # from PYTHONPATH instead, after the installed copy, as a plain install orders them.
    import os
    import sysconfig

    libraries = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    result = subprocess.run([sys.executable, "-S", "-c", "from shmloader import ShmDataLoader"], cwd=clone,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), *libraries])})
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert "NativeLibraryError" in error, result.stderr
    assert f"source checkout {clone / 'shmloader'}" in error and str(installed / "shmloader") in error, error
    assert "current directory" in error and "another directory" in error and "pip install -e ." in error, error


def test_file_unchanged_compares_size_and_modification_time_of_an_open_file(tmp_path):
    from shmloader._native import lib

    path = tmp_path / "f.bin"
    path.write_bytes(b"abcd")
    descriptor = os.open(path, os.O_RDONLY)
    try:
        status = os.fstat(descriptor)
        assert lib.shm_file_unchanged(descriptor, status.st_size, status.st_mtime_ns) == 1
        assert lib.shm_file_unchanged(descriptor, status.st_size + 1, status.st_mtime_ns) == 0
        assert lib.shm_file_unchanged(descriptor, status.st_size, status.st_mtime_ns + 1) == 0
        os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))  # Another time, same size.
        assert lib.shm_file_unchanged(descriptor, status.st_size, status.st_mtime_ns) == 0
    finally:
        os.close(descriptor)
    assert lib.shm_file_unchanged(descriptor, 4, 0) == -errno.EBADF

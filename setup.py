"""Builds shmloader's two native parts with PyPI's ziglang (no system compiler needed):
the Zig library (zig/, called through cffi) and the trainer's next() (a CPython extension
in C, compiled by `zig cc`)."""

import os
import pathlib
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).parent
ZIG_ROOT_SOURCE = "zig/c_api.zig"
# The trainer's next(): shmloader/ring/_cursor*.c, with _cursor.h (see its first lines),
# built as shmloader.ring._cursor beside its sources.
CURSOR_MODULE = "shmloader.ring._cursor"
CURSOR_SOURCES = sorted(str(path.relative_to(ROOT)) for path in ROOT.glob("shmloader/ring/_cursor*.c"))
# The slot protocol's one definition; the Zig sources import its translation.
RING_HEADER = "shmloader/ring/ring.h"
# The Zig library, called through cffi; _ffi.py is written beside it.
NATIVE_MODULE = "shmloader._shmloader_native"
GENERATED_ZIG_HEADER = "zig/ring_h.zig"
# The C declarations called through cffi; _ffi.py is generated from them.
DECLARATIONS = "shmloader/_declarations.py"


def translate_ring_header(zig: list[str], output: pathlib.Path) -> None:
    """Writes ring.h as Zig (what @cImport did before Zig 0.16 moved it out of the language)."""
    result = subprocess.run([*zig, "translate-c", "-lc", str(ROOT / RING_HEADER)], check=True, capture_output=True)
    output.write_bytes(result.stdout)


def write_ffi_module(package_dir: pathlib.Path) -> None:
    """Writes shmloader/_ffi.py: cffi's declarations parsed now, so that a process does not
    import pycparser and parse them at every start (a reader starts often)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_declarations", ROOT / DECLARATIONS)
    declarations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(declarations)
    builder = declarations.ffi_builder((ROOT / RING_HEADER).read_text())
    target = package_dir / "_ffi.py"
    builder.emit_python_code(str(target))
    # cffi leaves an unchanged file alone, old mtime and all; _native.py tells a stale build
    # by mtimes (ring.h newer than _ffi.py), so a rebuild after a comment's edit must show.
    os.utime(target)


class ZigBuildExt(build_ext):
    """Compiles each extension with the Zig toolchain instead of the system's C compiler,
    and generates the cffi module the Zig library is called through."""

    def run(self) -> None:
        package_dir = pathlib.Path(self.get_ext_fullpath(NATIVE_MODULE)).resolve().parent
        package_dir.mkdir(parents=True, exist_ok=True)
        write_ffi_module(package_dir)
        super().run()

    def build_extension(self, ext: Extension) -> None:
        target = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        zig = [sys.executable, "-m", "ziglang"]
        if ext.name == CURSOR_MODULE:
            import numpy  # A build requirement (pyproject.toml): its headers give the array struct.

            command = [
                *zig, "cc", "-shared", "-fPIC", "-O2",
                # Portable to any machine of the architecture, like the Zig library.
                "-mcpu=baseline",
                "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                "-Wno-cast-function-type",
                # Only PyInit__cursor leaves the module; the files share the rest (_cursor.h).
                "-fvisibility=hidden",
                f"-I{sysconfig.get_paths()['include']}",
                f"-I{sysconfig.get_paths()['platinclude']}",
                f"-I{numpy.get_include()}",
                "-o", str(target),
                *(str(ROOT / source) for source in CURSOR_SOURCES),
            ]
        else:
            translate_ring_header(zig, ROOT / GENERATED_ZIG_HEADER)
            command = [
                *zig, "build-lib", "-dynamic",
                "-OReleaseFast",
                # A baseline CPU keeps the wheel portable to any machine of the architecture.
                "-mcpu=baseline",
                "-fPIC",
                "-fno-emit-h",
                f"-femit-bin={target}",
                str(ROOT / ZIG_ROOT_SOURCE),
            ]
        print(" ".join(command))
        subprocess.run(command, check=True, cwd=ROOT)


setup(
    ext_modules=[
        Extension(NATIVE_MODULE, sources=[ZIG_ROOT_SOURCE]),
        Extension(CURSOR_MODULE, sources=CURSOR_SOURCES, depends=["shmloader/ring/_cursor.h", RING_HEADER]),
    ],
    cmdclass={"build_ext": ZigBuildExt},
)

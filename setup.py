"""Builds the Zig sources in zig/ into shmloader's native library with PyPI's ziglang."""

import pathlib
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).parent
ZIG_ROOT_SOURCE = "zig/c_api.zig"


class ZigBuildExt(build_ext):
    """Compiles the one 'extension' with Zig instead of a C compiler."""

    def build_extension(self, ext: Extension) -> None:
        target = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "ziglang", "build-lib", "-dynamic",
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
    ext_modules=[Extension("shmloader._shmloader_native", sources=[ZIG_ROOT_SOURCE])],
    cmdclass={"build_ext": ZigBuildExt},
)

"""Builds smp: setup.py only drives CMake (the one build); see CMakeLists.txt.

Developer install (build isolation would pull a second torch):
    pip install --no-build-isolation -e .
Environment:
    SMP_BUILD_DIR     CMake build directory (default: build/)
    SMP_BUILD_TESTS   ON/OFF, build the GoogleTest suites too (default: ON)
    MAX_JOBS          parallel compile jobs (default: number of CPUs)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = Path(os.environ.get("SMP_BUILD_DIR", ROOT / "build")).resolve()
        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DSMP_PYTHON_OUTPUT_DIR={output_dir}",
            f"-DSMP_BUILD_TESTS={os.environ.get('SMP_BUILD_TESTS', 'ON')}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja") and not (build_dir / "Makefile").exists():
            configure += ["-G", "Ninja"]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)
        # CMake writes the module where setuptools expects it; fail loudly if it did not.
        target = Path(self.get_ext_fullpath(ext.name))
        if not target.exists():
            raise RuntimeError(f"CMake did not produce {target}")


setup(
    name="smp",
    version="0.1.0",
    packages=find_packages(include=["smp", "smp.*"]),
    package_data={"smp": ["_C.pyi", "py.typed"]},
    ext_modules=[CMakeExtension("smp._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    zip_safe=False,
)

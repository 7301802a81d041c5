"""Build ktrans, including the C++ extension ktrans._cpu from csrc/ through CMake.

Every *.cpp under csrc/cpu is compiled into one pybind11 module (see CMakeLists.txt), so a new kernel file
needs no packaging change. The extension does not link against torch: buffers cross as raw pointers.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path):
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        cmake = shutil.which("cmake")
        if cmake is None:
            try:  # the `cmake` PyPI package, listed in build-system.requires
                import cmake as cmake_pkg

                cmake = str(Path(cmake_pkg.CMAKE_BIN_DIR) / "cmake")
            except ImportError:
                sys.exit("ktrans: building the C++ extension needs CMake >= 3.20: `pip install cmake` or apt install cmake")
        if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
            sys.exit("ktrans: building the C++ extension needs a C++17 compiler (g++ or clang++): apt install g++")
        try:
            import pybind11
        except ImportError:
            sys.exit("ktrans: building the C++ extension needs pybind11: `pip install pybind11`")

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("KTRANS_BUILD_TYPE", "Release")
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
        ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        subprocess.run([cmake, ext.source_dir, *args], cwd=build_dir, check=True)
        jobs = str(os.cpu_count() or 2)
        subprocess.run([cmake, "--build", ".", "--config", cfg, "-j", jobs], cwd=build_dir, check=True)


setup(ext_modules=[CMakeExtension("ktrans._cpu", ROOT)], cmdclass={"build_ext": CMakeBuild})

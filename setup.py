"""Builds the `kvtier` wheel with the project's CMake (pyproject.toml has the metadata).

`build_ext` configures the project into ``build-pip-<python tag>/`` of the source tree (or
``$KVTIER_CMAKE_BUILD_DIR``), builds the targets the package needs and copies them into the
wheel's tree:

* ``kvtier_python_ext`` -> ``kvtier/_kvtier<EXT_SUFFIX>`` (the pybind11 extension),
* ``kvtier-server``     -> ``kvtier/bin/kvtier-server`` (``python3 -m kvtier.server``),
* ``kvtier-cli``        -> ``kvtier/bin/kvtier`` (the operator CLI), when the project has it.

Where CMake put each one is read from CMake's file API (codemodel-v2), not assumed. The
build directory is kept: a second ``pip install``/``pip wheel`` of the same tree only
relinks what changed. ``$CMAKE_ARGS`` adds configure arguments (``-DKVTIER_WITH_CUDA=ON``,
``-DCMAKE_BUILD_TYPE=RelWithDebInfo``), ``$CMAKE_BUILD_PARALLEL_LEVEL`` the build's jobs.

The wheel is for the machine it was built on (it links the system's liburing, fmt and
OpenSSL as shared libraries, like the CMake build does): it is not a manylinux wheel.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

#: The CMake targets the package takes, and where each lands in the package (relative to
#: kvtier/). Optional ones are taken when the configured project defines them.
EXTENSION_TARGET = "kvtier_python_ext"
PROGRAMS = {"kvtier-server": "bin/kvtier-server"}
OPTIONAL_PROGRAMS = {"kvtier-cli": "bin/kvtier"}

#: What the wheel's build turns off: it builds three targets, and the tests, benchmarks,
#: fuzzers and the CUDA path (neither the extension nor the server uses it) would only
#: lengthen the configure. $CMAKE_ARGS comes after these and wins.
CMAKE_DEFAULTS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DKVTIER_BUILD_PYTHON=ON",
    "-DKVTIER_BUILD_EXAMPLES=ON",
    "-DKVTIER_BUILD_TESTS=OFF",
    "-DKVTIER_BUILD_BENCH=OFF",
    "-DKVTIER_BUILD_FUZZERS=OFF",
    "-DKVTIER_WITH_CUDA=OFF",
]


def kvtier_version() -> str:
    """include/kvtier/version.hpp's version_major.minor.patch: the one place it is written."""
    text = (ROOT / "include" / "kvtier" / "version.hpp").read_text()
    parts = []
    for part in ("major", "minor", "patch"):
        m = re.search(rf"inline constexpr int version_{part} = (\d+);", text)
        if not m:
            raise RuntimeError(f"include/kvtier/version.hpp has no version_{part}")
        parts.append(m.group(1))
    return ".".join(parts)


def cmake_build_dir() -> Path:
    """$KVTIER_CMAKE_BUILD_DIR, else one CMake build per interpreter (cpython-311: its
    headers, its extension suffix), one level below the source like build/: with
    CCACHE_BASEDIR at the source its compiles are those of build/ and hit ccache."""
    named = os.environ.get("KVTIER_CMAKE_BUILD_DIR")
    return Path(named).resolve() if named else ROOT / f"build-pip-{sys.implementation.cache_tag}"


class CMakeBuild(build_ext):
    """build_ext that runs the project's CMake instead of compiling sources itself."""

    def build_extension(self, ext: Extension) -> None:
        artifacts = self._cmake(cmake_build_dir())

        ext_path = Path(self.get_ext_fullpath(ext.name))
        built = artifacts[EXTENSION_TARGET]
        if built.name != ext_path.name:
            raise RuntimeError(
                f"CMake built the extension as {built.name}, but this Python loads {ext_path.name}: "
                f"CMake found another Python than {sys.executable} (set -DPython_EXECUTABLE in CMAKE_ARGS)")
        self._copy(built, ext_path, executable=False)
        package_dir = ext_path.parent
        for target, dest in {**PROGRAMS, **OPTIONAL_PROGRAMS}.items():
            if target in artifacts:
                self._copy(artifacts[target], package_dir / dest, executable=True)

    def copy_extensions_to_source(self) -> None:
        """`--inplace` and editable installs: the programs go next to the extension too."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        source_dir = Path(build_py.get_package_dir("kvtier"))
        for dest in {**PROGRAMS, **OPTIONAL_PROGRAMS}.values():
            built = Path(self.build_lib) / "kvtier" / dest  # where build_extension put it
            if built.exists():
                self._copy(built, source_dir / dest, executable=True)

    # -- CMake --------------------------------------------------------------------------------

    def _cmake(self, build_dir: Path) -> Dict[str, Path]:
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("building kvtier needs CMake >= 3.25 on PATH (Debian 12: apt-get install cmake; "
                               "or pip install cmake)")
        build_dir.mkdir(parents=True, exist_ok=True)
        # Ask CMake's file API where it puts each target (build_dir/.cmake/api/v1/reply).
        query = build_dir / ".cmake" / "api" / "v1" / "query" / "codemodel-v2"
        query.parent.mkdir(parents=True, exist_ok=True)
        query.touch()

        configure = [cmake, "-S", str(ROOT), "-B", str(build_dir)]
        if not (build_dir / "CMakeCache.txt").exists() and shutil.which("ninja"):
            configure += ["-G", "Ninja"]  # a build directory keeps the generator it was made with
        configure += CMAKE_DEFAULTS
        configure.append(f"-DPython_EXECUTABLE={sys.executable}")
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        self._run(configure)

        targets = self._targets(build_dir)
        missing = [t for t in (EXTENSION_TARGET, *PROGRAMS) if t not in targets]
        if missing:
            raise RuntimeError(f"the CMake project in {ROOT} defines no target {', '.join(missing)} "
                               f"(its configure output above says why; KVTIER_BUILD_PYTHON needs python3-dev "
                               f"and pybind11-dev)")
        wanted = [EXTENSION_TARGET, *PROGRAMS, *(t for t in OPTIONAL_PROGRAMS if t in targets)]
        build = [cmake, "--build", str(build_dir), "--target", *wanted]
        if self.parallel and "CMAKE_BUILD_PARALLEL_LEVEL" not in os.environ:
            build += ["--parallel", str(self.parallel)]
        self._run(build)
        artifacts = {name: targets[name] for name in wanted}
        for name, path in artifacts.items():
            if not path.is_file():
                raise RuntimeError(f"CMake reported {path} for target {name}, but the build did not make it")
        return artifacts

    def _run(self, command: List[str]) -> None:
        print("kvtier:", " ".join(shlex.quote(c) for c in command), flush=True)
        subprocess.run(command, check=True, cwd=ROOT)

    @staticmethod
    def _targets(build_dir: Path) -> Dict[str, Path]:
        """target name -> its first artifact, from the file API's codemodel-v2 reply."""
        reply = build_dir / ".cmake" / "api" / "v1" / "reply"
        indexes = sorted(reply.glob("index-*.json"))
        if not indexes:
            raise RuntimeError(f"CMake wrote no file-API reply in {reply} (CMake >= 3.14 writes one)")
        index = json.loads(indexes[-1].read_text())
        codemodel = json.loads((reply / index["reply"]["codemodel-v2"]["jsonFile"]).read_text())
        targets: Dict[str, Path] = {}
        for target in codemodel["configurations"][0]["targets"]:
            detail = json.loads((reply / target["jsonFile"]).read_text())
            if detail.get("artifacts"):
                path = Path(detail["artifacts"][0]["path"])
                targets[target["name"]] = path if path.is_absolute() else build_dir / path
        return targets

    @staticmethod
    def _copy(source: Path, dest: Path, executable: bool) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
        os.chmod(dest, 0o755 if executable else 0o644)


if __name__ == "__main__":
    build_base = cmake_build_dir() / "setuptools"
    build_base.mkdir(parents=True, exist_ok=True)
    setup(
        version=kvtier_version(),
        # setuptools' own build/ and egg-info would land in the source tree (build/ is
        # CMake's): both go into the CMake build directory instead.
        options={"build": {"build_base": str(build_base)}, "egg_info": {"egg_base": str(build_base)}},
        # One extension, built by CMake (CMakeBuild): listed so that setuptools makes a
        # platform wheel (cp311-cp311-linux_x86_64) and copies it for --inplace.
        ext_modules=[Extension("kvtier._kvtier", sources=[])],
        cmdclass={"build_ext": CMakeBuild},
    )

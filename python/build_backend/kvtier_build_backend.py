"""kvtier's PEP 517 build backend: setuptools.build_meta, plus CMake on demand.

Everything is setuptools' (setup.py runs the project's CMake in its build_ext). The one
addition: an isolated build (``pip install .`` with an index) asks for pip's ``cmake``
package only where no CMake >= 3.25 is on PATH, so that a machine with a system CMake
downloads nothing more than setuptools and wheel, and one without still builds. With
``--no-build-isolation`` pip asks nothing and uses what is installed (Debian 12:
python3-setuptools 66, python3-wheel 0.38, cmake 3.25).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import List, Optional, Tuple

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - the hooks this module does not change

#: The project's cmake_minimum_required (CMakeLists.txt).
CMAKE_MINIMUM: Tuple[int, int] = (3, 25)


def _system_cmake_version() -> Optional[Tuple[int, ...]]:
    cmake = shutil.which("cmake")
    if cmake is None:
        return None
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _cmake_requirement() -> List[str]:
    version = _system_cmake_version()
    if version is not None and version >= CMAKE_MINIMUM:
        return []
    return [f"cmake>={CMAKE_MINIMUM[0]}.{CMAKE_MINIMUM[1]}"]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _cmake_requirement()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _cmake_requirement()

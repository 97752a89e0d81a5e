"""Pytest setup of the kvtier Python suite.

* ``KVTIER_BUILD_DIR`` (default: ``<repo>/build``): the CMake build directory. Its
  ``python/`` folder (the package as ``cmake --build <dir> --target kvtier_python`` assembles
  it) goes first on sys.path, so the tests use the tree's build, not an installed copy.
* ``KVTIER_SERVER`` (default: ``$KVTIER_BUILD_DIR/examples/kvtier-server``): the server
  binary the tests start, each on a socket in its own temporary directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("KVTIER_BUILD_DIR", REPO / "build")).resolve()
sys.path.insert(0, str(BUILD_DIR / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    import kvtier  # noqa: F401
except ImportError as e:  # pragma: no cover - a setup problem, said plainly
    pytest.exit(
        f"cannot import kvtier from {BUILD_DIR / 'python'} ({e}): build it first with "
        f"'cmake --build {BUILD_DIR} --target kvtier_python kvtier-server' (KVTIER_BUILD_DIR names another build)",
        returncode=2,
    )

from kvtier_testing import ServerFactory, server_binary  # noqa: E402


@pytest.fixture(scope="session")
def kvtier_server_binary() -> Path:
    path = server_binary(BUILD_DIR)
    if not path.exists():
        pytest.exit(f"no kvtier-server at {path}: build it (cmake --build {BUILD_DIR} --target kvtier-server) "
                    "or set KVTIER_SERVER", returncode=2)
    return path


@pytest.fixture
def servers(tmp_path, kvtier_server_binary):
    """Starts kvtier-server processes on sockets in the test's temporary directory; stops
    every one at the end."""
    factory = ServerFactory(kvtier_server_binary, tmp_path)
    yield factory
    factory.close()

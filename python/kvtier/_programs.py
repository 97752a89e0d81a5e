"""The programs a wheel of kvtier bundles (kvtier/bin/), and how the console scripts run them.

``pip install``/``pip wheel`` of the checkout (setup.py) copies ``kvtier-server`` and, where
the project has it, the operator CLI ``kvtier`` into ``kvtier/bin/``; the console scripts
``kvtier-server`` and ``kvtier`` (and ``python3 -m kvtier.server`` / ``-m kvtier.cli``) exec
them with the arguments they were given, so the program replaces the Python process (same
pid, signals and exit status go to the program itself). A package without them (the build
tree's ``<build>/python``, ``cmake --install --component python``) says where the program is
instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn, Optional, Sequence

#: Where the wheel puts the programs. Not resolved: in a build tree the package's .py files
#: are symlinks into the source, and the package is the build's <build>/python/kvtier.
BIN_DIR = Path(os.path.abspath(__file__)).parent / "bin"

#: The exit status when the program is not bundled (a shell's "command not found").
EXIT_NOT_BUNDLED = 127


def bundled(name: str) -> Path:
    """The path of the bundled program ``name`` (it may not exist)."""
    return BIN_DIR / name


def exec_bundled(name: str, argv: Optional[Sequence[str]], build_paths: Sequence[str], install_hint: str) -> NoReturn:
    """Replaces this process with the bundled program ``name`` run with ``argv`` (default:
    this process's arguments); when it is not bundled, prints why and where it is instead to
    stderr and exits with :data:`EXIT_NOT_BUNDLED`.

    ``build_paths``: where a CMake build may put the program, relative to the build
    directory (``examples/kvtier-server``); ``install_hint``: a sentence that says how to get it."""
    args = list(sys.argv[1:] if argv is None else argv)
    path = bundled(name)
    if path.is_file() and os.access(path, os.X_OK):
        os.execv(str(path), [str(path), *args])
    lines = [f"{name}: this kvtier package ({BIN_DIR.parent}) has no bundled {name} program ({path} is missing)."]
    # The package of a CMake build tree is <build>/python/kvtier: name the program beside it.
    build_dir = BIN_DIR.parent.parent.parent
    for in_build in (build_dir / p for p in build_paths):
        if in_build.is_file():
            lines.append(f"This is a CMake build tree's package: run {in_build} instead.")
            break
    lines.append(install_hint)
    print("\n".join(lines), file=sys.stderr)
    raise SystemExit(EXIT_NOT_BUNDLED)

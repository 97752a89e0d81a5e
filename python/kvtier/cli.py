"""``kvtier``, the operator's command line, from the Python package: the ``kvtier`` console
script (and ``python3 -m kvtier.cli``) run the program bundled in the wheel (CMake target
``kvtier-cli``: ``status``, ``ls``, ``clear``, ``evict``, ``ping`` against a running
kvtier-server; docs/server.md), arguments passed through.
"""

from __future__ import annotations

from typing import NoReturn, Optional, Sequence

from ._programs import exec_bundled

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Execs the bundled ``kvtier`` program with ``argv`` (default: this process's arguments)."""
    exec_bundled("kvtier", argv, build_paths=["examples/kvtier", "examples/cli/kvtier"],
                 install_hint="The wheel that `pip install .` (or `pip wheel .`) builds bundles it when the kvtier "
                              "checkout has the CMake target kvtier-cli; `cmake --install <build> --component "
                              "programs` installs it on PATH.")


if __name__ == "__main__":
    main()

"""``kvtier-server`` from the Python package: ``python3 -m kvtier.server [flags]`` and the
``kvtier-server`` console script run the cache server bundled in the wheel, with the
server's own flags (``--socket``, ``--l1-size-gb``, ...; ``--help`` lists them,
docs/server.md explains them), for a user who has no server running::

    kvtier-server --socket /tmp/kvtier.sock --l1-size-gb 4

The server replaces the Python process (:func:`kvtier._programs.exec_bundled`).
"""

from __future__ import annotations

from typing import NoReturn, Optional, Sequence

from ._programs import exec_bundled

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Execs the bundled kvtier-server with ``argv`` (default: this process's arguments)."""
    exec_bundled("kvtier-server", argv, build_paths=["examples/kvtier-server"],
                 install_hint="The wheel that `pip install .` (or `pip wheel .`) of the kvtier checkout builds "
                              "bundles it; `cmake --install <build> --component programs` installs it on PATH.")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Shows that the include-rule check can fail (ctest house.include_rules_catches).

Runs tests/house/check_include_rules.py on temporary copies of include/kvtier, of the rules
table and of docs/architecture.md, each broken in one way, and passes only when the checker
exits 1 and reports each break as expected; the unbroken copies must pass (so what fails is
the break, not the copying). Prints the checker's output of every case.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CHECKER = os.path.join(HERE, "check_include_rules.py")
RULES = os.path.join(HERE, "include_rules.txt")
DOCS = os.path.join(REPO, "docs", "architecture.md")
INCLUDE = os.path.join(REPO, "include", "kvtier")

sys.dont_write_bytecode = True  # nothing written into the source tree
sys.path.insert(0, HERE)
import check_include_rules  # noqa: E402


class case_dir:
    """A copy of include/kvtier (shared by the cases: each removes what it added), and fresh
    copies of the rules table and the architecture page."""

    def __init__(self, root: str, include: str, name: str) -> None:
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir)
        self.include = include
        self.rules = os.path.join(self.dir, "include_rules.txt")
        self.docs = os.path.join(self.dir, "architecture.md")
        self.added: list[str] = []
        shutil.copyfile(RULES, self.rules)
        shutil.copyfile(DOCS, self.docs)

    def add_header(self, rel: str, *lines: str) -> None:
        path = os.path.join(self.include, rel)
        if not os.path.isdir(os.path.dirname(path)):
            os.makedirs(os.path.dirname(path))
            self.added.append(os.path.dirname(path))
        else:
            self.added.append(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write("#pragma once\n" + "".join(line + "\n" for line in lines))

    def edit(self, path: str, old: str, new: str) -> None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if old not in text:
            raise SystemExit(f"FAILED: the test's own edit does not apply: '{old}' is not in {path}")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new, 1))

    def run(self, in_process: bool) -> tuple[int, str]:
        args = ["--include-dir", self.include, "--rules", self.rules, "--docs", self.docs]
        try:
            if not in_process:  # the exit status as ctest sees it
                p = subprocess.run([sys.executable, CHECKER, *args], capture_output=True, text=True, check=False)
                return p.returncode, p.stdout + p.stderr
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                rc = check_include_rules.main(args)
            return rc, out.getvalue()
        finally:
            for path in self.added:
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)


def main() -> int:
    failures: list[str] = []

    def expect(name: str, c: case_dir, status: int, patterns: list[str], in_process: bool = True) -> None:
        rc, out = c.run(in_process)
        print(f"--- {name}: exit status {rc}")
        print(out.rstrip())
        if rc != status:
            failures.append(f"{name}: exit status {rc}, expected {status}")
        for pat in patterns:
            if not re.search(pat, out, re.MULTILINE):
                failures.append(f"{name}: no line matches /{pat}/")

    with tempfile.TemporaryDirectory(prefix="kvtier-house-") as root:
        include = os.path.join(root, "include", "kvtier")
        shutil.copytree(INCLUDE, include)
        # The copies as they are pass.
        c = case_dir(root, include, "unchanged")
        expect("unchanged copy", c, 0, [r"^include rules: OK"], in_process=False)

        # One forbidden include (core/ including server/: up three floors) and one cycle
        # (bus/ including telemetry/, which includes bus/), each reported with file:line.
        # core/ -> server/ closes a ring too, but bus/ includes core/ (the key events carry
        # chunk keys), so both rings are one component, reported once by its shortest cycle.
        c = case_dir(root, include, "forbidden")
        c.add_header("core/zz_forbidden.hpp", "// core/ must not know the server", "#include <kvtier/server/server.hpp>")
        c.add_header("bus/zz_cycle.hpp", '#include "../telemetry/logger.hpp"')
        expect("forbidden include and cycle", c, 1, [
            r"core/zz_forbidden\.hpp:3: core/ includes server/ \(<kvtier/server/server\.hpp>\): not allowed: "
            r"core/ \(floor 0\) may include config\.hpp, error\.hpp; server/ is on floor 4.*include_rules\.txt:\d+\)$",
            r"bus/zz_cycle\.hpp:2: bus/ includes telemetry/ .*not allowed",
            r"^cycle between modules: bus/ -> telemetry/ -> bus/$",
            r"^  .*bus/zz_cycle\.hpp:2: bus/ includes telemetry/",
            r"^  .*telemetry/[a-z_]+\.hpp:\d+: telemetry/ includes bus/",
        ], in_process=False)

        # A header only some modules may include: the OpenSSL hasher from the server.
        c = case_dir(root, include, "hasher")
        c.add_header("server/zz_hasher.hpp", "#include <kvtier/core/token_hasher.hpp>")
        expect("header rule", c, 1, [
            r"server/zz_hasher\.hpp:2: server/ includes core/token_hasher\.hpp .*only engine/ may include it",
        ])

        # Only the logger of telemetry/ for io/.
        c = case_dir(root, include, "registry")
        c.add_header("io/zz_registry.hpp", "#include <kvtier/telemetry/registry.hpp>")
        expect("one header of a module", c, 1, [
            r"io/zz_registry\.hpp:2: io/ includes telemetry/ .*of telemetry/ it may include only telemetry/logger\.hpp",
        ])

        # A module in the tree the table does not list, and an include of a missing header.
        c = case_dir(root, include, "unlisted")
        c.add_header("newmod/x.hpp", "#include <kvtier/config.hpp>")
        c.add_header("l1/zz_missing.hpp", "#include <kvtier/l1/no_such_header.hpp>")
        expect("module not in the table", c, 1, [
            r"newmod: module newmod/ is in the tree but not in .*include_rules\.txt",
            r"l1/zz_missing\.hpp:2: includes <kvtier/l1/no_such_header\.hpp>, which is not in",
        ])

        # A module in the table the tree lacks (and the docs do not list).
        c = case_dir(root, include, "ghost")
        c.edit(c.rules, "\nkvtier.hpp ", "\nghost/        2      config.hpp\nkvtier.hpp ")
        expect("module not in the tree", c, 1, [
            r"include_rules\.txt:\d+: module ghost/ is in the table but not in",
            r"architecture\.md: Floors lacks ghost/",
            r"architecture\.md: the Modules table has no row for ghost/",
        ])

        # The table itself: an include above the module's floor, and a cycle of rules.
        c = case_dir(root, include, "table")
        c.edit(c.rules, "\nl1/           2      config.hpp", "\nl1/           2      cache/ config.hpp")
        c.edit(c.rules, "\nbus/          1      config.hpp", "\nbus/          1      telemetry/ config.hpp")
        expect("bad table", c, 1, [
            r"include_rules\.txt:\d+: l1/ \(floor 2\) may include cache/ of floor 3",
            r"include_rules\.txt: the rules form a cycle: bus/ -> telemetry/ -> bus/",
        ])

        # The prose drifts from the table: a module left out, another on the wrong floor.
        c = case_dir(root, include, "docs")
        c.edit(c.docs, "| 0 | `version.hpp`, `error.hpp`, `fwd.hpp` |", "| 0 | `error.hpp`, `fwd.hpp` |")
        c.edit(c.docs, "| 2 | `l1/` |", "| 3 | `l1/` |")
        c.edit(c.docs, "| `io/` (optional", "| io (optional")
        expect("docs drift", c, 1, [
            r"architecture\.md: Floors lacks version\.hpp \(floor 0 in",
            r"architecture\.md: Floors puts l1/ on floor 3, .* on floor 2",
            r"architecture\.md: the Modules table has no row for io/",
        ])

    if failures:
        print("\nFAILED: the include-rule check missed what it must catch:")
        for f in failures:
            print("  " + f)
        return 1
    print("\nOK: the include-rule check catches every break above")
    return 0


if __name__ == "__main__":
    sys.exit(main())

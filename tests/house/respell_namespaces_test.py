#!/usr/bin/python3
"""house.respell_namespaces: scripts/dev/respell_namespaces.py on a fixture
(tests/house/respell/input.hpp.txt: one-line forms, a deeper namespace, one opened twice, an
anonymous namespace and braces in strings, characters, a raw string, a directive and a
comment, a closing brace without the namespace's name, a `using namespace` line, a nested
definition without `inline`): --check finds the old forms (exit 1); the rewrite gives
expected.hpp.txt exactly; a second run changes nothing and --check passes; input and output
compile (--cxx) and their static_asserts hold; an old closing comment left without its
opening is reported (exit 2), not guessed at.

Usage: respell_namespaces_test.py [--cxx PATH]"""

import os
import shutil
import subprocess
import sys
import tempfile

from code_tools import ROOT, finish, tool

SCRIPT = os.path.join(ROOT, "scripts", "dev", "respell_namespaces.py")
FIXTURES = os.path.join(ROOT, "tests", "house", "respell")


def run(*args):
  r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, check=False)
  return r.returncode, r.stdout + r.stderr


def read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def main():
  cxx = tool(sys.argv, "--cxx", None)
  failures = []

  def expect(ok, what, detail=""):
    if not ok:
      failures.append(what + (f"\n{detail}" if detail else ""))

  with tempfile.TemporaryDirectory(prefix="kvtier-respell-") as tmp:
    tree = os.path.join(tmp, "include")
    os.makedirs(tree)
    f = os.path.join(tree, "fixture.hpp")
    shutil.copyfile(os.path.join(FIXTURES, "input.hpp.txt"), f)
    rc, out = run("--check", tree)
    expect(rc == 1 and out.count("fixture.hpp:") == 7, "--check on the input: exit 1 naming 7 old lines", out)
    rc, out = run(tree)
    expect(rc == 0 and "5 namespace(s) respelled in 1 of 1 files" in out, "the rewrite: 5 namespaces respelled", out)
    expect(read(f) == read(os.path.join(FIXTURES, "expected.hpp.txt")), "the rewrite gives expected.hpp.txt",
           subprocess.run(["diff", "-u", os.path.join(FIXTURES, "expected.hpp.txt"), f], capture_output=True,
                          text=True, check=False).stdout)
    before = read(f)
    rc, out = run(tree)
    expect(rc == 0 and "0 namespace(s) respelled" in out and read(f) == before, "a second run changes nothing", out)
    rc, out = run("--check", tree)
    expect(rc == 0, "--check on the output passes", out)
    if cxx:
      for src in (os.path.join(FIXTURES, "input.hpp.txt"), f):
        r = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", "-x", "c++", src], capture_output=True, text=True,
                           check=False)
        expect(r.returncode == 0, f"{os.path.basename(src)} compiles with {cxx}", r.stderr)
    orphan = os.path.join(tree, "orphan.hpp")
    with open(orphan, "w", encoding="utf-8") as o:
      o.write("namespace kvtier {\ninline namespace KVTIER_ABI_TAG {\nnamespace x {\n}  // namespace x\n}\n"
              "}  // namespace kvtier::inline KVTIER_ABI_TAG::x\n")
    rc, out = run(tree)
    expect(rc == 2 and "orphan.hpp:6: cannot respell" in out, "an old closing comment without its opening: exit 2",
           out)
  return finish("house.respell_namespaces", failures,
                "house.respell_namespaces: the script respells the fixture as expected, idempotently")


if __name__ == "__main__":
  sys.exit(main())

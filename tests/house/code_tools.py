"""Shared by the house.ctags, house.cscope and house.function_lengths tests: the repository
root, Universal Ctags as JSON records, and a failure report. Python's standard library only."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The .cuh headers parse as C++: Universal Ctags' CUDA parser (5.9) gives their members no
# class or namespace scope, and fewer functions (copy_engine.cuh: 17 of 23).
CTAGS_MAPS = ["--map-C++=+.cuh", "--map-C++=+.cu"]


def tool(argv, flag, default):
  """The value of `flag PATH` in argv (what CMake's find_program found), else default."""
  if flag in argv:
    return argv[argv.index(flag) + 1]
  return default


def ctags_tags(ctags, paths, extra=()):
  """Universal Ctags' records for paths (relative to the root): dicts with name, path, kind,
  line, end, scope, scopeKind. Prototypes included."""
  version = subprocess.run([ctags, "--version"], capture_output=True, text=True, check=False).stdout
  if "Universal Ctags" not in version:
    sys.exit(f"{ctags} is not Universal Ctags (Debian package universal-ctags): {version.strip()[:80]}")
  cmd = [ctags, "--output-format=json", "--fields=+nesKZp", "--kinds-C++=+p", "--sort=no",
         *CTAGS_MAPS, *extra, "-o", "-", *paths]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
  return [t for t in map(json.loads, out.splitlines()) if t.get("_type") == "tag"]


def finish(name, failures, ok_line):
  if failures:
    for f in failures:
      print(f"FAILED: {f}")
    print(f"{name}: {len(failures)} failure(s)")
    return 1
  print(ok_line)
  return 0

#!/usr/bin/python3
"""house.co_await_conditional: no co_await in an operand of the conditional operator.

g++ 12 evaluates both operands of `c ? co_await x() : co_await y()` with Boost.Asio's
awaitables: both operations start (found in issue 30: an fsync and an fdatasync of one
file; clang 14 runs one). Write an if/else instead. The check drops comments, strings
and character literals, cuts the source into statements at ; { and }, and flags a
statement where co_await comes after a `?`. It checks itself on fixtures first.

Usage: co_await_conditional_test.py [PATH...]   (default: include examples bench tests python/src)"""

import os
import re
import sys

from code_tools import ROOT, finish

SOURCE_EXTENSIONS = (".hpp", ".h", ".cpp", ".cc", ".cu", ".cuh")
_NOISE = re.compile(r'//[^\n]*|/\*.*?\*/|R"([^(]*)\(.*?\)\1"|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def blank(m):
  """Keeps the newlines of what it removes, so line numbers stay right."""
  return "".join(c if c == "\n" else " " for c in m.group(0))


def offenders(text):
  """Line numbers of statements with a co_await after a `?`."""
  code = _NOISE.sub(blank, text)
  found, start = [], 0
  for m in re.finditer(r"[;{}]|$", code):
    statement = code[start:m.start()]
    q = statement.find("?")
    if q >= 0 and re.search(r"\bco_await\b", statement[q:]):
      found.append(code.count("\n", 0, start + q) + 1)
    start = m.end()
  return found


FIXTURES = [
    ("x = c ? co_await a() : co_await b();", [1]),
    ("std::tie(ec) = c\n    ? co_await a(t)\n    : co_await b(t);", [2]),
    ("auto r = c ? 1 : co_await b();", [1]),
    ("if (c) x = co_await a(); else x = co_await b();", []),
    ("auto r = co_await a(); int y = c ? 1 : 2;", []),
    ("for (auto k : co_await keys()) f(k);", []),
    ("// c ? co_await a() : 0\nf(\"?\", co_await a());", []),
]


def main():
  failures = []
  for text, want in FIXTURES:
    if offenders(text) != want:
      failures.append(f"the check itself: {text!r} gave lines {offenders(text)}, want {want}")
  paths = sys.argv[1:] or ["include", "examples", "bench", "tests", "python/src"]
  files = 0
  for p in paths:
    for d, dirs, names in os.walk(os.path.join(ROOT, p)):
      dirs.sort()
      for n in sorted(names):
        if not n.endswith(SOURCE_EXTENSIONS):
          continue
        path = os.path.join(d, n)
        files += 1
        with open(path, encoding="utf-8", errors="replace") as f:
          for line in offenders(f.read()):
            failures.append(f"{os.path.relpath(path, ROOT)}:{line}: co_await in an operand of ?: (g++ 12 "
                            "starts both operands' operations): use if/else")
  return finish("house.co_await_conditional", failures, f"{files} files, no co_await in an operand of ?:")


if __name__ == "__main__":
  sys.exit(main())

#!/usr/bin/python3
"""house.function_lengths: no function under include/kvtier longer than --max-function-lines
(80), from its name's line to its closing brace as Universal Ctags reports them
(--fields=+ne; a lambda counts in the function that holds it); and no header whose opening
comment (the comment lines after `#pragma once`, before the first line of code; blank lines
not counted) is longer than --max-opening-comment-lines (20): a header says what it is for
in a few lines and points to docs/ for the rest.

Usage: function_lengths_test.py [--ctags PATH] [--max-function-lines N]
                                [--max-opening-comment-lines N] [PATH...]"""

import argparse
import os
import sys

from code_tools import ROOT, ctags_tags, finish

HEADER_EXTENSIONS = (".hpp", ".h", ".cuh")


def opening_comment_lines(text):
  """The number of comment lines that open the file (after `#pragma once`)."""
  count, in_block = 0, False
  for line in text.splitlines():
    s = line.strip()
    if in_block:
      count += 1
      in_block = "*/" not in s
      continue
    if not s or s == "#pragma once":
      continue
    if s.startswith("//"):
      count += 1
    elif s.startswith("/*"):
      count += 1
      in_block = "*/" not in s[2:]
    else:
      break
  return count


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--ctags", default="ctags")
  ap.add_argument("--max-function-lines", type=int, default=80)
  ap.add_argument("--max-opening-comment-lines", type=int, default=20)
  ap.add_argument("paths", nargs="*", default=["include/kvtier"])
  args = ap.parse_args()
  headers = []
  for p in args.paths:
    for d, dirs, names in os.walk(os.path.join(ROOT, p)):
      dirs.sort()
      headers += [os.path.relpath(os.path.join(d, n), ROOT) for n in sorted(names) if n.endswith(HEADER_EXTENSIONS)]
  failures = []
  tags = ctags_tags(args.ctags, headers)
  functions = [t for t in tags if t["kind"] == "function" and not t["name"].startswith("__anon")]
  long_functions = []
  for t in functions:
    if "end" not in t:
      failures.append(f"{t['path']}:{t['line']}: ctags gives {t['name']} no end line")
      continue
    lines = t["end"] - t["line"] + 1
    if lines > args.max_function_lines:
      scope = t.get("scope", "").replace("KVTIER_ABI_TAG::", "")
      long_functions.append((lines, f"{t['path']}:{t['line']}: {scope + '::' if scope else ''}{t['name']} "
                                    f"is {lines} lines (at most {args.max_function_lines})"))
  failures += [f for _, f in sorted(long_functions, reverse=True)]
  long_comments = []
  for h in headers:
    with open(os.path.join(ROOT, h), encoding="utf-8") as f:
      n = opening_comment_lines(f.read())
    if n > args.max_opening_comment_lines:
      long_comments.append((n, f"{h}: its opening comment is {n} lines (at most {args.max_opening_comment_lines}: "
                               "say what the file is for and point to docs/)"))
  failures += [f for _, f in sorted(long_comments, reverse=True)]
  return finish("house.function_lengths", failures,
                f"house.function_lengths: {len(functions)} functions in {len(headers)} headers, none over "
                f"{args.max_function_lines} lines; no opening comment over {args.max_opening_comment_lines}")


if __name__ == "__main__":
  sys.exit(main())

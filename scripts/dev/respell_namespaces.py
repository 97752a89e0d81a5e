#!/usr/bin/python3
"""Respells C++20 nested namespace definitions that contain an inline component, e.g.

    namespace kvtier::inline KVTIER_ABI_TAG::l2::detail {
    ...
    }  // namespace kvtier::inline KVTIER_ABI_TAG::l2::detail

as one spelled-out namespace per line, the ABI tag kept:

    namespace kvtier {
    inline namespace KVTIER_ABI_TAG {
    namespace l2 {
    namespace detail {
    ...
    }  // namespace detail
    }  // namespace l2
    }  // namespace KVTIER_ABI_TAG
    }  // namespace kvtier

Why: Universal Ctags (and the tools built on it) does not parse `a::inline b::c`; it stops
at the `inline` and sees none of the declarations inside (cache/tiered_cache.hpp: 6 tags,
131 when nested). The nested form is what clang-format 14 (FixNamespaceComments) writes.

Only namespace opening lines and the lines of their matching closing braces change. The
closing brace is found by matching braces (comments, strings, character and raw-string
literals and preprocessor lines skipped), so a closing line without, or with a wrong,
`// namespace` comment is still found. Handled: one-line forms (`namespace a::inline b {}`,
`namespace a::inline b { class c; }`), several openings in one file, namespaces nested
inside. Left alone: `using namespace kvtier::...;`, namespace aliases, comments and prose,
nested definitions without `inline` (`namespace kvtier::test {`: ctags reads those).

Idempotent: a respelled tree has nothing left to change.

Usage:
  scripts/dev/respell_namespaces.py            rewrite the repository's include/ tests/ examples/
                                               bench/ python/src/ (from any directory)
  scripts/dev/respell_namespaces.py --check    change nothing; exit 1 naming each old form
  scripts/dev/respell_namespaces.py PATH...    only these files or folders
Exit status: 0 done (or nothing to do), 1 --check found old forms, 2 a form it cannot respell.
"""

import argparse
import os
import re
import sys

DEFAULT_ROOTS = ["include", "tests", "examples", "bench", "python/src"]
EXTENSIONS = (".hpp", ".h", ".hh", ".hxx", ".ipp", ".inl", ".tpp", ".cpp", ".cc", ".cxx", ".cu", ".cuh")
SKIP_DIRS = {".git", "build", "__pycache__", "node_modules"}

IDENT = r"[A-Za-z_]\w*"
# `namespace a::inline b::c {` (C++20): at least one `inline` component. Group 1: the
# indentation, 2: the components, 3: the text after the brace.
OPENING = re.compile(
    r"^([ \t]*)namespace\s+((?:(?:inline\s+)?" + IDENT + r"\s*::\s*)*inline\s+" + IDENT +
    r"(?:\s*::\s*(?:inline\s+)?" + IDENT + r")*)\s*\{(.*)$")
# A closing comment in the old form: `}  // namespace kvtier::inline KVTIER_ABI_TAG::x`.
OLD_CLOSING_COMMENT = re.compile(r"//\s*namespace\s+(?:" + IDENT + r"\s*::\s*)*inline\s+" + IDENT)
ANY_NAMESPACE_COMMENT = re.compile(r"^\s*//\s*namespace\b")
LITERAL_PREFIXES = {"L", "u", "U", "u8", "R", "LR", "uR", "UR", "u8R"}


class CannotRespell(Exception):
  pass


def braces(text):
  """Yields (offset, '{' or '}') for each brace of C++ code, outside comments, string and
  character literals (raw strings included) and preprocessor directives."""
  i, n = 0, len(text)
  line_start = True  # only whitespace since the last newline
  while i < n:
    c = text[i]
    if c == "\n":
      line_start = True
      i += 1
      continue
    if c in " \t\r\f\v":
      i += 1
      continue
    if line_start and c == "#":  # a directive, with its continuation lines
      while i < n and text[i] != "\n":
        if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
          i += 2
        elif text.startswith("/*", i):
          end = text.find("*/", i + 2)
          i = n if end < 0 else end + 2
        else:
          i += 1
      continue
    line_start = False
    if text.startswith("//", i):
      while i < n and text[i] != "\n":
        i += 2 if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n" else 1
      continue
    if text.startswith("/*", i):
      end = text.find("*/", i + 2)
      i = n if end < 0 else end + 2
      continue
    if c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
      # a pp-number, digit separators (1'000) included
      i += 1
      while i < n:
        if text[i] in "eEpP" and i + 1 < n and text[i + 1] in "+-":
          i += 2
        elif text[i].isalnum() or text[i] in "_.":
          i += 1
        elif text[i] == "'" and i + 1 < n and text[i + 1].isalnum():
          i += 1
        else:
          break
      continue
    if c.isalpha() or c == "_":
      j = i
      while j < n and (text[j].isalnum() or text[j] == "_"):
        j += 1
      word = text[i:j]
      i = j
      if i < n and text[i] in "\"'" and word in LITERAL_PREFIXES:
        if text[i] == '"' and word.endswith("R"):
          m = re.compile(r'"([^()\\\s]{0,16})\(').match(text, i)
          if m:
            end = text.find(")" + m.group(1) + '"', m.end())
            i = n if end < 0 else end + len(m.group(1)) + 2
            continue
        i = skip_quoted(text, i)
      continue
    if c in "\"'":
      i = skip_quoted(text, i)
      continue
    if c in "{}":
      yield i, c
    i += 1


def skip_quoted(text, i):
  quote, n = text[i], len(text)
  i += 1
  while i < n and text[i] != quote and text[i] != "\n":
    i += 2 if text[i] == "\\" else 1
  return i + 1


def brace_partners(text):
  """Maps the offset of each '{' to the offset of its '}'."""
  stack, partner = [], {}
  for pos, c in braces(text):
    if c == "{":
      stack.append(pos)
    elif stack:
      partner[stack.pop()] = pos
  return partner


def components(spelled):
  """'kvtier::inline KVTIER_ABI_TAG::l2' -> [('kvtier', False), ('KVTIER_ABI_TAG', True), ('l2', False)]"""
  out = []
  for part in spelled.split("::"):
    words = part.split()
    out.append((words[-1], len(words) == 2))
  return out


def opening_lines(indent, comps):
  return [indent + ("inline " if inline else "") + "namespace " + name + " {" for name, inline in comps]


def closing_lines(indent, comps):
  return [indent + "}  // namespace " + name for name, _ in reversed(comps)]


def line_of(offsets, pos):
  """The index of the line holding offset pos (offsets: each line's first offset)."""
  lo, hi = 0, len(offsets) - 1
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if offsets[mid] <= pos:
      lo = mid
    else:
      hi = mid - 1
  return lo


def respell(text, path):
  """Returns (new text, [(old line number, old line)] of the openings respelled)."""
  lines = text.split("\n")
  offsets, o = [], 0
  for line in lines:
    offsets.append(o)
    o += len(line) + 1
  partner = brace_partners(text)
  code_braces = set(partner)
  # line index -> replacement lines; an opening and its closing may share a line
  edits = {}
  changed = []
  for k, line in enumerate(lines):
    m = OPENING.match(line)
    if not m:
      continue
    brace = offsets[k] + m.start(3) - 1
    if brace not in code_braces:  # in a comment, a string or a directive
      continue
    if brace not in partner:
      raise CannotRespell(f"{path}:{k + 1}: no closing brace for: {line.strip()}")
    indent, comps, rest = m.group(1), components(m.group(2)), m.group(3)
    close = partner[brace]
    c = line_of(offsets, close)
    opening = opening_lines(indent, comps)
    if c == k:  # one line: namespace a::inline b { ... }
      inner = line[m.end(2):close - offsets[k]]
      inner = inner[inner.index("{") + 1:].strip()
      after = line[close - offsets[k] + 1:].strip()
      new = opening + ([indent + inner] if inner else []) + closing_lines(indent, comps)
      if after and not ANY_NAMESPACE_COMMENT.match(after):
        new.append(indent + after)
      edits[k] = new
    else:
      tail = rest.strip()
      if tail.startswith("//") or tail.startswith("/*"):
        opening[-1] += "  " + tail
      elif tail:
        opening.append(indent + tail)
      edits[k] = opening
      cline = lines[c]
      before, after = cline[:close - offsets[c]], cline[close - offsets[c] + 1:].strip()
      new = [before.rstrip()] if before.strip() else []
      new += closing_lines(indent, comps)
      if after and not ANY_NAMESPACE_COMMENT.match(after):
        if after.startswith("//") or after.startswith("/*"):
          new[-1] += "  " + after
        else:
          new.append(indent + after)
      if c in edits:
        raise CannotRespell(f"{path}:{c + 1}: two namespaces close on one line: {cline.strip()}")
      edits[c] = new
    changed.append((k + 1, line.strip()))
  if not edits:
    return text, changed
  out = []
  for k, line in enumerate(lines):
    out.extend(edits.get(k, [line]))
  return "\n".join(out), changed


def old_forms(text):
  """(line number, line) of each namespace line still in the old form: an opening (code,
  not a comment or `using`), or a closing brace whose comment names one."""
  found = []
  partner = brace_partners(text)
  starts, o = [], 0
  lines = text.split("\n")
  for line in lines:
    starts.append(o)
    o += len(line) + 1
  for k, line in enumerate(lines):
    m = OPENING.match(line)
    if m and starts[k] + m.start(3) - 1 in partner:
      found.append((k + 1, line.strip()))
    elif line.lstrip().startswith("}") and OLD_CLOSING_COMMENT.search(line):
      found.append((k + 1, line.strip()))
  return found


def files_under(paths):
  for p in paths:
    if os.path.isfile(p):
      yield p
      continue
    for root, dirs, names in os.walk(p):
      dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("build"))
      for name in sorted(names):
        base = name[:-3] if name.endswith(".in") else name
        if base.endswith(EXTENSIONS):
          yield os.path.join(root, name)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when an old form is left")
  ap.add_argument("--quiet", action="store_true", help="print only the summary and the problems")
  ap.add_argument("paths", nargs="*", help="files or folders (default: " + " ".join(DEFAULT_ROOTS) + ")")
  args = ap.parse_args()
  if not args.paths:  # the repository's folders, wherever it is run from
    os.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  paths = args.paths or [r for r in DEFAULT_ROOTS if os.path.isdir(r)]
  scanned = files = namespaces = 0
  problems = []
  for path in files_under(paths):
    scanned += 1
    with open(path, encoding="utf-8", newline="") as f:
      text = f.read()
    if "inline" not in text or "namespace" not in text:
      continue
    if args.check:
      for num, line in old_forms(text):
        problems.append(f"{path}:{num}: {line}")
      continue
    try:
      new, changed = respell(text, path)
    except CannotRespell as e:
      problems.append(str(e))
      continue
    left = old_forms(new)
    for num, line in left:  # e.g. an old closing comment whose opening was respelled by hand
      problems.append(f"{path}:{num}: cannot respell (no old opening matches it): {line}")
    if new != text:
      with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(new)
      files += 1
      namespaces += len(changed)
      if not args.quiet:
        for num, line in changed:
          print(f"{path}:{num}: {line}")
  if args.check:
    for p in problems:
      print(p)
    if problems:
      print(f"respell_namespaces --check: {len(problems)} namespace line(s) in the old form "
            f"(`namespace a::inline b::c`, which ctags cannot read) in {scanned} files; "
            "run scripts/dev/respell_namespaces.py", file=sys.stderr)
      return 1
    print(f"respell_namespaces --check: {scanned} files, no old form")
    return 0
  for p in problems:
    print(p, file=sys.stderr)
  print(f"respell_namespaces: {namespaces} namespace(s) respelled in {files} of {scanned} files")
  return 2 if problems else 0


if __name__ == "__main__":
  sys.exit(main())

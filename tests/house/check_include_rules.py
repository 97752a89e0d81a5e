#!/usr/bin/python3
"""Holds include/kvtier to its include rules (ctest house.include_rules).

Reads the rules table (tests/house/include_rules.txt: each module's floor and what it may
include) and checks, failing with one line per finding:
  - the table itself: known entries, no include above a module's own floor, no cycle;
  - the tree against the table: every module of include/kvtier is in the table and every
    module of the table is in the tree;
  - every `#include <kvtier/...>` (and every quoted include that resolves inside
    include/kvtier) of every file under include/kvtier: allowed by the table, naming
    file:line, the including module, the included module and the rule that forbids it;
  - no cycle between modules in the includes as written;
  - docs/architecture.md: its "Floors" table lists the same modules on the same floors as the
    rules table, and its "Modules" table the same modules (prose and table cannot drift).

Standard library only; reads files, builds nothing. Exit status 0 when all hold, 1 otherwise
(2 for bad arguments or a table that cannot be read).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
HEADER_SUFFIXES = (".hpp", ".cuh", ".h")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def show(path: str) -> str:
    """A path as findings print it: relative to the repository when inside it."""
    full = os.path.abspath(path)
    return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else full


@dataclass
class module_rule:
    name: str
    floor: int
    may_include: list[str]
    line: int


@dataclass
class rules_table:
    path: str
    modules: dict[str, module_rule] = field(default_factory=dict)
    # header -> (modules that may include it, line)
    header_rules: dict[str, tuple[list[str], int]] = field(default_factory=dict)

    def module_of(self, rel: str) -> str | None:
        """The module of a path relative to include/kvtier: the longest module that is a
        prefix of it (a folder module ends with '/', a header module is the file itself)."""
        best = None
        for m in self.modules:
            if (m.endswith("/") and rel.startswith(m)) or rel == m:
                if best is None or len(m) > len(best):
                    best = m
        return best


class findings:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, text: str) -> None:
        self.lines.append(text)


def is_header_entry(entry: str) -> bool:
    return not entry.endswith("/") and entry.endswith(HEADER_SUFFIXES) and "/" in entry


def read_table(path: str, out: findings) -> rules_table:
    t = rules_table(show(path))
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            words = raw.split("#", 1)[0].split()
            if not words:
                continue
            where = f"{t.path}:{n}"
            if words[0] == "header":
                if len(words) < 3:
                    out.add(f"{where}: a header line needs the header and the modules that may include it")
                    continue
                if words[1] in t.header_rules:
                    out.add(f"{where}: header {words[1]} listed twice")
                t.header_rules[words[1]] = (words[2:], n)
                continue
            if len(words) < 3:
                out.add(f"{where}: a module line needs <module> <floor> <may include...> ('-' for nothing)")
                continue
            name, floor, allowed = words[0], words[1], words[2:]
            if not floor.isdigit():
                out.add(f"{where}: floor of {name} is '{floor}', not a number")
                continue
            if name in t.modules:
                out.add(f"{where}: module {name} listed twice (first on line {t.modules[name].line})")
                continue
            if allowed == ["-"]:
                allowed = []
            t.modules[name] = module_rule(name, int(floor), allowed, n)
    return t


def check_table(t: rules_table, include_dir: str, out: findings) -> None:
    """Entries name listed modules (or existing headers of them), nothing above its own floor,
    no cycle among the modules' rules."""
    for m in t.modules.values():
        where = f"{t.path}:{m.line}"
        for entry in m.may_include:
            target = t.module_of(entry) if is_header_entry(entry) else entry
            if target not in t.modules:
                out.add(f"{where}: {m.name} may include '{entry}', which is no module of the table")
                continue
            if is_header_entry(entry) and not os.path.isfile(os.path.join(include_dir, entry)):
                out.add(f"{where}: {m.name} may include header {entry}, which is not in {show(include_dir)}")
            if target == m.name:
                out.add(f"{where}: {m.name} lists itself (a module always includes its own headers)")
            elif t.modules[target].floor > m.floor:
                out.add(f"{where}: {m.name} (floor {m.floor}) may include {entry} of floor "
                        f"{t.modules[target].floor}: a module includes only its own floor or below")
    for header, (users, n) in t.header_rules.items():
        if t.module_of(header) is None or not os.path.isfile(os.path.join(include_dir, header)):
            out.add(f"{t.path}:{n}: header {header} is not a header of a module in {show(include_dir)}")
        for u in users:
            if u not in t.modules:
                out.add(f"{t.path}:{n}: header {header}: '{u}' is no module of the table")
    graph = {m.name: {t.module_of(e) if is_header_entry(e) else e for e in m.may_include} - {m.name}
             for m in t.modules.values()}
    for cycle in cycles(graph):
        out.add(f"{t.path}: the rules form a cycle: {' -> '.join(cycle + [cycle[0]])}")


def tree_modules(include_dir: str, t: rules_table) -> set[str]:
    """The modules present in the tree: each top-level file and folder of include/kvtier, plus
    the table's sub-folder modules (l2/disk/) that exist."""
    found: set[str] = set()
    for name in os.listdir(include_dir):
        if name.startswith("."):
            continue
        path = os.path.join(include_dir, name)
        found.add(name + "/" if os.path.isdir(path) else name)
    for m in t.modules:
        if m.endswith("/") and m.count("/") > 1 and os.path.isdir(os.path.join(include_dir, m)):
            found.add(m)
    return found


def check_tree_modules(include_dir: str, t: rules_table, out: findings) -> None:
    present = tree_modules(include_dir, t)
    for m in sorted(present - set(t.modules)):
        out.add(f"{show(os.path.join(include_dir, m))}: module {m} is in the tree but not in {t.path}: "
                f"add it with its floor and what it may include (and to docs/architecture.md)")
    for m in sorted(set(t.modules) - present):
        out.add(f"{t.path}:{t.modules[m].line}: module {m} is in the table but not in {show(include_dir)}")


@dataclass
class include_edge:
    file: str  # path as printed
    line: int
    spelled: str  # as written, e.g. <kvtier/server/server.hpp>
    source: str  # including module
    target: str  # included module
    header: str  # included header, relative to include/kvtier


def scan_includes(include_dir: str, t: rules_table, out: findings) -> tuple[list[include_edge], int]:
    """Every include between files of include/kvtier, as edges between modules."""
    edges: list[include_edge] = []
    root = os.path.dirname(os.path.normpath(include_dir))  # the include/ directory
    nfiles = 0
    for dirpath, dirnames, filenames in os.walk(include_dir):
        dirnames.sort()
        for fname in sorted(filenames):
            path = os.path.join(dirpath, fname)
            rel = os.path.relpath(path, include_dir).replace(os.sep, "/")
            source = t.module_of(rel)
            if source is None:
                continue  # reported by check_tree_modules
            nfiles += 1
            shown_path = show(path)
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, text in enumerate(f, 1):
                    m = INCLUDE_RE.match(text)
                    if not m:
                        continue
                    bracket, spelled = m.group(1), m.group(2)
                    shown = f"<{spelled}>" if bracket == "<" else f'"{spelled}"'
                    header = resolve(spelled, bracket, os.path.dirname(path), root, include_dir)
                    if header is None:
                        if spelled.startswith("kvtier/"):
                            out.add(f"{shown_path}:{n}: includes {shown}, which is not in {show(include_dir)}")
                        continue  # a third-party or system header: not the subject here
                    target = t.module_of(header)
                    if target is None:
                        out.add(f"{shown_path}:{n}: includes {shown}, whose module is not in {t.path}")
                        continue
                    edges.append(include_edge(shown_path, n, shown, source, target, header))
    return edges, nfiles


def resolve(spelled: str, bracket: str, file_dir: str, root: str, include_dir: str) -> str | None:
    """The included file relative to include/kvtier, or None when it is not one of its files."""
    candidates = []
    if bracket == '"':
        candidates.append(os.path.join(file_dir, spelled))
    candidates.append(os.path.join(root, spelled))
    inc = os.path.normpath(include_dir)
    for c in candidates:
        c = os.path.normpath(c)
        if c.startswith(inc + os.sep) and os.path.isfile(c):
            return os.path.relpath(c, inc).replace(os.sep, "/")
    return None


def check_edges(edges: list[include_edge], t: rules_table, out: findings) -> None:
    for e in edges:
        if e.source == e.target:
            continue
        rule = t.modules[e.source]
        allowed_modules = {x for x in rule.may_include if not is_header_entry(x)}
        allowed_headers = {x for x in rule.may_include if is_header_entry(x)}
        if e.target not in allowed_modules and e.header not in allowed_headers:
            allowed = ", ".join(rule.may_include) or "nothing outside itself"
            only = sorted(h for h in allowed_headers if t.module_of(h) == e.target)
            upward = t.modules[e.target].floor > rule.floor
            why = (f"of {e.target} it may include only {', '.join(only)}" if only else
                   f"{e.source} (floor {rule.floor}) may include {allowed}"
                   + (f"; {e.target} is on floor {t.modules[e.target].floor}, above it" if upward else ""))
            out.add(f"{e.file}:{e.line}: {e.source} includes {e.target} ({e.spelled}): not allowed: "
                    f"{why} ({t.path}:{rule.line})")
            continue
        if e.header in t.header_rules:
            users, n = t.header_rules[e.header]
            if e.source not in users:
                out.add(f"{e.file}:{e.line}: {e.source} includes {e.header} ({e.spelled}): not allowed: "
                        f"only {', '.join(users)} may include it ({t.path}:{n})")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan), each as the
    list of its nodes in order along the cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    result = []
    for comp in sccs:
        # The shortest cycle of the component (breadth-first from each member, in name order).
        best: list[str] | None = None
        for start in sorted(comp):
            path = shortest_cycle(graph, set(comp), start)
            if path is not None and (best is None or len(path) < len(best)):
                best = path
        result.append(best)
    return result


def shortest_cycle(graph: dict[str, set[str]], members: set[str], start: str) -> list[str] | None:
    """The nodes of a shortest cycle through start inside members, from start on."""
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return list(reversed(path))
                if w in members and w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return None


def check_cycles(edges: list[include_edge], out: findings) -> None:
    graph: dict[str, set[str]] = {}
    first: dict[tuple[str, str], include_edge] = {}
    for e in edges:
        if e.source != e.target:
            graph.setdefault(e.source, set()).add(e.target)
            first.setdefault((e.source, e.target), e)
    for cycle in cycles(graph):
        ring = cycle + [cycle[0]]
        out.add(f"cycle between modules: {' -> '.join(ring)}")
        for a, b in zip(ring, ring[1:]):
            e = first[(a, b)]
            out.add(f"  {e.file}:{e.line}: {a} includes {b} ({e.spelled})")


def markdown_section(text: str, heading: str) -> list[str] | None:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## ") and line[3:].startswith(heading):
            body = []
            for rest in lines[i + 1:]:
                if rest.startswith("## "):
                    break
                body.append(rest)
            return body
    return None


def table_rows(section: list[str]) -> list[list[str]]:
    """The body rows of the first markdown table in the section, as cells."""
    rows: list[list[str]] = []
    started = False
    for line in section:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if all(re.fullmatch(r":?-+:?", c) for c in cells):
                started = True
                continue
            if started:
                rows.append(cells)
        elif started:
            break
    return rows


MODULE_NAME_RE = re.compile(r"`([a-z0-9_]+(?:/[a-z0-9_]+)*(?:/|\.hpp))`")


def check_docs(path: str, t: rules_table, out: findings) -> None:
    docs = show(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        out.add(f"{docs}: cannot be read: {e.strerror}")
        return
    # Floors: | floor | modules | may include | rule |, the modules in backquotes.
    section = markdown_section(text, "Floors")
    if section is None:
        out.add(f"{docs}: no '## Floors' section")
    else:
        documented: dict[str, int] = {}
        for cells in table_rows(section):
            if len(cells) < 2 or not cells[0].isdigit():
                out.add(f"{docs}: Floors row '| {' | '.join(cells)} |' has no floor number first")
                continue
            for name in MODULE_NAME_RE.findall(cells[1]):
                if name in documented:
                    out.add(f"{docs}: Floors lists {name} twice")
                documented[name] = int(cells[0])
        for m in sorted(set(t.modules) - set(documented)):
            out.add(f"{docs}: Floors lacks {m} (floor {t.modules[m].floor} in {t.path})")
        for m in sorted(set(documented) - set(t.modules)):
            out.add(f"{docs}: Floors lists {m}, which {t.path} does not")
        for m in sorted(set(documented) & set(t.modules)):
            if documented[m] != t.modules[m].floor:
                out.add(f"{docs}: Floors puts {m} on floor {documented[m]}, {t.path} on floor {t.modules[m].floor}")
    # Modules: the first column names the module(s) of each row.
    section = markdown_section(text, "Modules")
    if section is None:
        out.add(f"{docs}: no '## Modules' section")
    else:
        listed: set[str] = set()
        for cells in table_rows(section):
            listed.update(MODULE_NAME_RE.findall(cells[0]))
        for m in sorted(set(t.modules) - listed):
            out.add(f"{docs}: the Modules table has no row for {m}")
        for m in sorted(listed - set(t.modules)):
            out.add(f"{docs}: the Modules table has a row for {m}, which {t.path} does not list")


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    repo = REPO
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--include-dir", default=os.path.join(repo, "include", "kvtier"),
                   help="the include/kvtier directory to check")
    p.add_argument("--rules", default=os.path.join(here, "include_rules.txt"), help="the rules table")
    p.add_argument("--docs", default=os.path.join(repo, "docs", "architecture.md"),
                   help="the architecture page whose Floors and Modules tables must match (empty: not checked)")
    a = p.parse_args(argv)
    if not os.path.isdir(a.include_dir):
        print(f"check_include_rules: {a.include_dir} is not a directory", file=sys.stderr)
        return 2
    out = findings()
    try:
        t = read_table(a.rules, out)
    except OSError as e:
        print(f"check_include_rules: cannot read {a.rules}: {e.strerror}", file=sys.stderr)
        return 2
    check_table(t, a.include_dir, out)
    check_tree_modules(a.include_dir, t, out)
    edges, nfiles = scan_includes(a.include_dir, t, out)
    check_edges(edges, t, out)
    check_cycles(edges, out)
    if a.docs:
        check_docs(a.docs, t, out)
    between = {(e.source, e.target) for e in edges if e.source != e.target}
    if out.lines:
        for line in out.lines:
            print(line)
        print(f"include rules: FAILED, {len(out.lines)} finding(s) "
              f"({len(t.modules)} modules, {nfiles} files, {len(edges)} includes of kvtier headers)")
        return 1
    print(f"include rules: OK: {len(t.modules)} modules, {nfiles} files, {len(edges)} includes of kvtier "
          f"headers, {len(between)} module pairs, every one allowed by {t.path}; no cycle"
          + (f"; {show(a.docs)} lists the same modules and floors" if a.docs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

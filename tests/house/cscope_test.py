#!/usr/bin/python3
"""house.cscope: cscope follows a retrieve from the engine's connector to the session's
handler in the server. A cscope database over include/ (cscope -b -q -k), then line-oriented
queries (cscope -d -L -f DB -<n> SYMBOL):

  1. -1 connector          the definition of connector<Bus>::retrieve under engine/ (cscope
                           files an out-of-class member definition under its class's name)
  2. -0 retrieve_request   the connector sends it: a use under engine/
  3. -1 retrieve_request   its definition: `struct retrieve_request` under protocol/
  4. -1 session            `class session` under server/
  5. -0 retrieve_request   the session's handler: a server/ function declared with a
                           `const protocol::retrieve_request&` parameter (on_retrieve today;
                           found by the parameter, so a renamed handler is still found)
  6. -0 <handler>          its out-of-class definition `session::<handler>(` under server/,
                           and the call that hands it the decoded message

What this proves. cscope (15.9) is a lexical C scanner, it knows no namespaces: it finds a
function definition only at brace depth 0 (with quirks around class bodies), so no spelling
makes its function-definition (-1 on a function's own name) and caller (-3) queries work
inside kvtier's namespaces: -3 on_retrieve answers nothing with either spelling, and a
parameter list with a template argument (`std::span<const token_id>`) hides a definition
even at depth 0. What the spelling changes: with one namespace brace
(`namespace kvtier::inline KVTIER_ABI_TAG::x {`) cscope misses the first definition after
it, here steps 1 and 4 (connector<Bus>::retrieve, class session): this test fails on the old
spelling. Spelled nested, both are found. Steps 2, 3, 5 and 6 are lexical (symbol uses and a
struct definition) and pass with either spelling: they hold that the path stays traceable by
name, connector -> protocol message -> session handler, whatever the server's rooms become.
(The old spelling let `-1 on_retrieve` find the handler's definition by a cscope quirk after
a class body; the nested one does not: step 6 finds it with -0.)

Usage: cscope_test.py [--cscope PATH]"""

import os
import re
import subprocess
import sys
import tempfile

from code_tools import ROOT, finish, tool


def main():
  cscope = tool(sys.argv, "--cscope", "cscope")
  failures = []
  with tempfile.TemporaryDirectory(prefix="kvtier-cscope-") as tmp:
    files = sorted(
        os.path.relpath(os.path.join(d, f), ROOT) for d, _, names in os.walk(os.path.join(ROOT, "include"))
        for f in names if f.endswith((".hpp", ".h", ".cuh")))
    with open(os.path.join(tmp, "files"), "w", encoding="utf-8") as f:
      f.write("\n".join(files) + "\n")
    db = os.path.join(tmp, "cscope.out")
    subprocess.run([cscope, "-b", "-q", "-k", "-i", os.path.join(tmp, "files"), "-f", db], cwd=ROOT, check=True)

    def query(n, symbol):
      """[(file, function, line, text)] of `cscope -d -L -<n> symbol`."""
      out = subprocess.run([cscope, "-d", "-L", "-f", db, f"-{n}", symbol], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
      return [tuple(line.split(" ", 3)) for line in out.splitlines() if line.count(" ") >= 3]

    def pick(rows, folder, pattern):
      return [r for r in rows if r[0].startswith("include/kvtier/" + folder) and re.search(pattern, r[3])]

    def step(what, rows):
      if rows:
        print(f"  {what}: {rows[0][0]}:{rows[0][2]}  {rows[0][3].strip()}")
      else:
        failures.append(f"cscope does not find {what}")
      return rows

    step("1. the connector's retrieve defined (-1 connector)",
         pick(query(1, "connector"), "engine/", r"\bconnector<\w+>::retrieve\("))
    uses = query(0, "retrieve_request")
    step("2. the connector sending retrieve_request (-0 retrieve_request)",
         pick(uses, "engine/", r"protocol::retrieve_request\b"))
    step("3. retrieve_request defined (-1 retrieve_request)",
         pick(query(1, "retrieve_request"), "protocol/", r"\bstruct retrieve_request\b"))
    step("4. the session class defined (-1 session)", pick(query(1, "session"), "server/", r"\bclass session\b(?!::)"))
    handlers = step("5. the session's handler of retrieve_request (-0 retrieve_request)",
                    pick(uses, "server/", r"\b\w+\(\s*const protocol::retrieve_request&"))
    if handlers:
      name = re.search(r"\b(\w+)\(\s*const protocol::retrieve_request&", handlers[0][3]).group(1)
      rows = query(0, name)
      step(f"6. session::{name} defined (-0 {name})", pick(rows, "server/", r"\bsession::" + name + r"\("))
      step(f"6. session::{name} called (-0 {name})",
           [r for r in pick(rows, "server/", r"\b" + name + r"\(")
            if "retrieve_request&" not in r[3] and "session::" + name not in r[3]])
  return finish("house.cscope", failures,
                "house.cscope: cscope follows a retrieve from the connector to the session's handler")


if __name__ == "__main__":
  sys.exit(main())

#!/usr/bin/python3
"""house.ctags: Universal Ctags reads kvtier's headers. For each key header, the class is a
tag scoped in its module's namespace (kvtier::KVTIER_ABI_TAG::<module>: ctags takes the
inline namespace's macro for its name) and each named member function is a tag scoped in
that class. Spelled `namespace kvtier::inline KVTIER_ABI_TAG::cache {`, ctags found 6 tags
in tiered_cache.hpp (lambdas only), none of these.

Usage: ctags_test.py [--ctags PATH]"""

import re
import sys

from code_tools import ctags_tags, finish, tool

# header, module namespace, class, public member functions (declared or defined in the class)
EXPECTED = [
    ("include/kvtier/cache/tiered_cache.hpp", "cache", "tiered_cache",
     ["tiered_cache", "~tiered_cache", "start_lookup", "poll", "known", "async_wait", "async_wait_loaded",
      "pin_for_copy", "unpin_after_copy", "async_copy_out", "async_copy_in", "release", "release_all",
      "reserve_write", "finish_write", "expire", "clear", "status", "wait_idle", "async_stop", "l1",
      "prefetch", "store", "bus", "options"]),
    ("include/kvtier/engine/connector.hpp", "engine", "connector",
     ["connector", "~connector", "lookup", "lookup_hashes", "free_lookup_locks", "end_request", "retrieve",
      "retrieve_hashes", "store", "store_hashes", "layers_ready", "wait_layers", "wait_retrieves",
      "get_finished", "take_load_error_blocks", "block_reused", "wait_ready", "state", "stats"]),
    ("include/kvtier/l1/tier.hpp", "l1", "tier",
     ["tier", "reserve_write", "finish_write", "abandon_write", "reserve_read", "reserve_read_prefix",
      "finish_read", "contains", "remove", "expire", "clear", "evict", "info", "options"]),
]


def main():
  ctags = tool(sys.argv, "--ctags", "ctags")
  failures = []
  report = []
  for header, module, cls, members in EXPECTED:
    tags = ctags_tags(ctags, [header])
    class_re = re.compile(r"^kvtier(::\w+)?::" + module + "$")
    classes = [t for t in tags if t["name"] == cls and t["kind"] == "class" and class_re.match(t.get("scope", ""))]
    if not classes:
      failures.append(f"{header}: no class tag `{cls}` scoped kvtier::...::{module} ({len(tags)} tags in all: "
                      f"{', '.join(sorted({t['name'] for t in tags})[:8])}...)")
      continue
    scope = classes[0]["scope"] + "::" + cls
    found = {t["name"] for t in tags if t.get("scope") == scope and t["kind"] in ("function", "prototype")}
    missing = [m for m in members if m not in found]
    if missing:
      failures.append(f"{header}: class {scope} lacks member function tags {', '.join(missing)}")
    report.append(f"  {header}: {len(tags)} tags; class {scope} with {len(found)} member functions")
  print("\n".join(report))
  return finish("house.ctags", failures, "house.ctags: ctags lists the classes and their member functions")


if __name__ == "__main__":
  sys.exit(main())

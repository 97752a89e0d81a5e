"""What must hold at a quiet point (every engine idle, no fault active): the server holds
nothing for anybody, and its books balance. Read over HTTP (/status, /metrics), so that the
reading itself is no request in flight.

The books (counters since the server process started; a restart starts them again):

  l1_read_holds     kvtier_l1_read_holds_taken_total
                    = kvtier_l1_read_holds_released_total + kvtier_l1_read_holds_expired_total
  l1_write_locks    kvtier_l1_write_reserved_keys_total
                    = kvtier_l1_write_keys_total + kvtier_l1_evicted_keys_total{reason=abandoned}
                      + kvtier_l1_lock_expired_keys_total{lock=write}
  l1_objects        kvtier_l1_write_keys_total - kvtier_l1_evicted_keys_total{reason!=abandoned}
                    = kvtier_l1_objects
  cache_writes      kvtier_cache_write_succeeded_keys_total
                    = kvtier_cache_write_finished_keys_total + kvtier_cache_write_finish_failed_keys_total
  l2_store[b]       kvtier_l2_store_keys_total = succeeded + failed; tasks = completed
  prefetch_loads    kvtier_l2_prefetch_load_keys_total
                    = kvtier_l2_prefetch_loaded_keys_total + kvtier_l2_prefetch_failed_keys_total
  lookup_hits       hit chunks (all tiers) <= requested chunks
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections import defaultdict
from typing import Dict, List, Tuple

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Series = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def scrape(url: str, timeout_s: float = 10.0) -> Series:
    text = urllib.request.urlopen(url + "/metrics", timeout=timeout_s).read().decode()
    out: Series = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def status(url: str, timeout_s: float = 10.0) -> dict:
    return json.loads(urllib.request.urlopen(url + "/status", timeout=timeout_s).read())


def total(s: Series, name: str, **where: str) -> float:
    """The sum of a metric over the series whose labels match ``where`` (a value starting
    with ! excludes)."""
    acc = 0.0
    for (n, labels), v in s.items():
        if n != name:
            continue
        d = dict(labels)
        if all((d.get(k) != w[1:]) if w.startswith("!") else (d.get(k) == w) for k, w in where.items()):
            acc += v
    return acc


def by_label(s: Series, name: str, label: str) -> Dict[str, float]:
    out: Dict[str, float] = defaultdict(float)
    for (n, labels), v in s.items():
        if n == name:
            out[dict(labels).get(label, "")] += v
    return out


def held_now(st: dict, s: Series) -> List[str]:
    """What the server still holds: empty at a quiet point once its background work (L2
    stores, loads landing) has ended."""
    bad = []

    def zero(what: str, v) -> None:
        if v:
            bad.append(f"{what} = {v}")

    zero("status.lookups", st.get("lookups"))
    for c in st.get("clients", []):
        zero(f"client {c.get('client_id')} lookups", c.get("lookups"))
    l1 = st.get("l1", {})
    zero("l1 objects locked (objects - evictable)", l1.get("objects", 0) - l1.get("evictable", 0))
    zero("l1.removing", l1.get("removing"))
    for k, v in st.get("prefetch", {}).items():
        zero(f"prefetch.{k}", v)
    for k, v in st.get("store", {}).items():
        zero(f"store.{k}", v)
    for k, v in st.get("held", {}).items():
        zero(f"held.{k}", v)
    for g in ("kvtier_prefetch_requests_active", "kvtier_prefetch_inflight_load_bytes", "kvtier_store_inflight_bytes",
              "kvtier_store_inflight_tasks", "kvtier_store_staged_bytes", "kvtier_lookups_active"):
        zero(g, total(s, g))
    for t, v in by_label(s, "kvtier_server_requests_in_flight", "type").items():
        zero(f"kvtier_server_requests_in_flight{{type={t}}}", v)
    return bad


def books(s: Series) -> List[str]:
    """The identities of the module's doc that do not balance, with their figures."""
    bad = []

    def eq(name: str, lhs: float, rhs: float, how: str) -> None:
        if lhs != rhs:
            bad.append(f"{name}: {lhs:.0f} != {rhs:.0f} ({how})")

    t = lambda n, **w: total(s, n, **w)  # noqa: E731
    eq("l1_read_holds", t("kvtier_l1_read_holds_taken_total"),
       t("kvtier_l1_read_holds_released_total") + t("kvtier_l1_read_holds_expired_total"),
       "taken = released + expired (holds: keys x readers)")
    eq("l1_write_locks", t("kvtier_l1_write_reserved_keys_total"),
       t("kvtier_l1_write_keys_total") + t("kvtier_l1_evicted_keys_total", reason="abandoned")
       + t("kvtier_l1_lock_expired_keys_total", lock="write"),
       "write-locked = made readable + abandoned + expired")
    eq("l1_objects", t("kvtier_l1_write_keys_total") - t("kvtier_l1_evicted_keys_total", reason="!abandoned"),
       t("kvtier_l1_objects"), "written - removed = held")
    eq("cache_writes", t("kvtier_cache_write_succeeded_keys_total"),
       t("kvtier_cache_write_finished_keys_total") + t("kvtier_cache_write_finish_failed_keys_total"),
       "reserved = finished + abandoned")
    for b in by_label(s, "kvtier_l2_store_keys_total", "backend"):
        eq(f"l2_store[{b}]", t("kvtier_l2_store_keys_total", backend=b),
           t("kvtier_l2_store_succeeded_keys_total", backend=b) + t("kvtier_l2_store_failed_keys_total", backend=b),
           "submitted = stored + failed")
        eq(f"l2_store_tasks[{b}]", t("kvtier_l2_store_tasks_total", backend=b),
           t("kvtier_l2_store_completed_total", backend=b), "submitted = completed")
    eq("prefetch_loads", t("kvtier_l2_prefetch_load_keys_total"),
       t("kvtier_l2_prefetch_loaded_keys_total") + t("kvtier_l2_prefetch_failed_keys_total"),
       "submitted = loaded + failed")
    hit = t("kvtier_lookup_hit_chunks_total")
    req = t("kvtier_lookup_requested_chunks_total")
    if hit > req:
        bad.append(f"lookup_hits: {hit:.0f} hit chunks > {req:.0f} requested")
    return bad

"""KVTierConnector's statistics in vLLM's ``KVConnectorStats`` shape (:class:`KVTierConnectorStats`).

vLLM's path (vllm/distributed/kv_transfer/kv_connector/v1/metrics.py at the pinned commit): each
worker's ``get_kv_connector_stats()`` is pickled to the engine core and folded across ranks
with ``aggregate``; the scheduler's own ``get_kv_connector_stats()`` is folded in; only the
``data`` dict reaches the logger process, which rebuilds the object with the connector class's
``build_kv_connector_stats(data)``, aggregates the interval and logs ``reduce()``. So ``data``
is the whole state: a flat dict of numbers, self-describing by name (:data:`STATS_KEYS`):

* a key ending in ``_max`` is a maximum (``aggregate`` keeps the larger);
* every other key is a count or a duration, summed by ``aggregate`` (worker counts are
  therefore summed over the tensor-parallel ranks: one chunk loaded on 2 ranks counts 2).

Unknown keys (a newer kvtier in another process) follow the same rule, so mixed versions
merge instead of failing.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Union

from .vllm_base import KVConnectorStats

__all__ = ["KVTierConnectorStats", "STATS_KEYS"]

Number = Union[int, float]

#: Every key kvtier writes, with where it is counted and what it means (docs/integration.md,
#: "Statistics").
STATS_KEYS: Dict[str, str] = {
    # scheduler
    "lookups": "scheduler: lookups started (one per request with a full chunk; again after a preemption)",
    "lookup_tokens": "scheduler: tokens of the full chunks those lookups asked for",
    "lookup_hit_tokens": "scheduler: tokens the server answered as present (before vLLM's own prefix cache is taken off)",
    "hit_requests": "scheduler: requests admitted with tokens to load from kvtier",
    "hit_tokens": "scheduler: tokens those requests load from kvtier (vLLM's num_external_tokens)",
    "load_chunks_planned": "scheduler: chunks planned for loading (each retrieved by every rank)",
    "store_chunks_planned": "scheduler: chunks planned for storing (each stored by every rank)",
    # workers (summed over the ranks)
    "load_chunks": "workers: chunks asked from the server by retrieves",
    "loaded_chunks": "workers: chunks that landed (no block of them reported as a load error)",
    "load_error_blocks": "workers: blocks reported to vLLM as load errors (vLLM recomputes from the first)",
    "store_requests": "workers: store requests sent to the server (one per request and step that completed chunks)",
    "stores_dropped": "workers: store requests not sent because the request's load of that step failed (layerwise)",
    "fence_refusals": "workers: blocks vLLM was about to write while quarantined (never expected)",
    "quarantined_blocks_max": "workers: the most blocks one rank held quarantined at a report",
    # both
    "degraded_s": "seconds a connector spent without a registered server (its own clock of its outages: exact, whenever the steps come)",
    "reconnects": "registrations with a server after the first one (a restart, a lost connection)",
    "late_replies": "server replies to calls the connector had given up on",
}


def _is_max(key: str) -> bool:
    return key.endswith("_max")


class KVTierConnectorStats(KVConnectorStats):
    """kvtier's ``KVConnectorStats``: ``data`` maps the names of :data:`STATS_KEYS` to numbers."""

    def __init__(self, data: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__(data={k: v for k, v in (data or {}).items() if isinstance(v, (int, float))})

    def add(self, key: str, value: Number) -> None:
        """Counts ``value`` more under ``key`` (a maximum for ``*_max`` keys)."""
        if not value:
            return
        if _is_max(key):
            self.data[key] = max(self.data.get(key, 0), value)
        else:
            self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVTierConnectorStats":
        for key, value in (other.data or {}).items():
            if isinstance(value, (int, float)):
                self.add(key, value)
        return self

    def reduce(self) -> Dict[str, Number]:
        out: Dict[str, Number] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in sorted(self.data.items())}
        if self.data.get("lookup_tokens"):
            out["lookup_hit_rate"] = round(self.data.get("lookup_hit_tokens", 0) / self.data["lookup_tokens"], 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def __repr__(self) -> str:
        return f"KVTierConnectorStats({self.data})"

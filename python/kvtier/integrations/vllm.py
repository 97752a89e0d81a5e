"""kvtier as a vLLM KV connector (the V1 interface, ``KVConnectorBase_V1``).

Run vLLM with::

    vllm serve <model> --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket_path": "/run/kvtier/kvtier.sock", "chunk_tokens": 256}}'

Written against vLLM commit :data:`VLLM_COMMIT` (``vllm/distributed/kv_transfer/
kv_connector/v1/base.py``; the call order of ``vllm/v1/worker/kv_connector_model_runner_mixin.py``).
When vLLM is not importable the class derives from a local stand-in with the same method
signatures (:mod:`kvtier.integrations._vllm_standin`), which the replay tests drive.

This module is the connector class vLLM loads: it hands vLLM's calls to the logic of
:mod:`kvtier.integrations.core` (:class:`~kvtier.integrations.core.SchedulerSide`,
:class:`~kvtier.integrations.core.WorkerSide`) and keeps the statistics. What it reads of
vLLM's objects is in modules of their own: :mod:`.vllm_config` (the config and the KV cache
config), :mod:`.vllm_scheduler_output` (a step's schedule), :mod:`.vllm_base` (vLLM's base
classes, or the stand-in's).

Options (``kv_connector_extra_config``; docs/integration.md has the table):

===========================  ===============================================================
``socket_path``              the kvtier-server's socket (or the ``KVTIER_SOCKET`` variable)
``chunk_tokens``             the server's ``--chunk-size`` (default 256)
``model_name``               default: vLLM's model name
``kv_layout``                ``NHD``, ``HND`` or ``auto`` (the attention backend's)
``cache_salt``               a deployment-wide salt (vLLM's per-request salt is folded too)
``hash``                     ``xxh3_128`` (default) or ``sha256``
``prefill_tokens_per_second`` the engine's prefill rate (0: not declared)
``ready_timeout_s``          how long start-up waits for the server (default 5)
``lookup_wait_ms``           how long a step's lookups may wait for their answers (default 0:
                             never; an unanswered first ask delays the request by a step)
``load_mode``                ``async`` (default: loads complete between steps) or ``layerwise``
                             (synchronous loads; each layer computes as soon as it landed)
``*_timeout_ms`` ...         connector deadlines (``retrieve_timeout_ms``, ``ping_timeout_ms``,
                             ``quarantine_limit_ms``, ...: docs/fault-tolerance.md)
``rank``                     this worker's TP rank when vLLM cannot tell (stand-in runs)
``kv_cache_backend``         ``auto`` (vLLM's attention backend) or the backend whose layout
                             the KV tensors have (``FLASH_ATTN``, ``CPU_ATTN``, ...)
``engine_id``                default: ``kv_transfer_config.engine_id`` (one engine's scheduler and
                             workers share its lookups on the server; :func:`.vllm_config._engine_id`)
===========================  ===============================================================

vLLM's own settings it reads: ``kv_role`` (``kv_producer`` stores and never looks up,
``kv_consumer`` looks up and loads and never stores, ``kv_both``), the KV cache config (one
group of full-attention layers, else refused: :func:`check_kv_cache_config`; the connector is
not ``SupportsHMA``). Statistics travel through vLLM's ``KVConnectorStats`` path
(:class:`~kvtier.integrations.connector_stats.KVTierConnectorStats`, :data:`STATS_KEYS`).
docs/integration.md ("vLLM") says what each optional method of the interface does here.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Set, Tuple

from .config import KV_ROLES
from .connector_stats import STATS_KEYS, KVTierConnectorStats
from .kv_layouts import backend_of_layers
from .plan import StepPlan, _plan_from_tuples
from .request_keys import request_keys
from .scheduler_side import SchedulerSide
from .vllm_base import (
    VLLM_AVAILABLE,
    VLLM_COMMIT,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from .vllm_config import SERVED_KV_CACHE_SPECS, check_kv_cache_config, config_from_vllm
from .vllm_scheduler_output import first_group, preempted_ids, scheduled_rows, step_input_from
from .worker_side import WorkerSide

__all__ = [
    "VLLM_AVAILABLE",
    "VLLM_COMMIT",
    "SERVED_KV_CACHE_SPECS",
    "check_kv_cache_config",
    "KV_ROLES",
    "KVTierConnector",
    "KVTierConnectorMetadata",
    "KVTierConnectorStats",
    "STATS_KEYS",
    "config_from_vllm",
    "step_input_from",
]

log = logging.getLogger("kvtier")


# The cumulative counters get_kv_connector_stats reports the growth of, per role, in order.
_SCHEDULER_COUNTERS = ("lookups", "lookup_tokens", "lookup_hit_tokens", "reconnects", "late_replies", "degraded_s")
_WORKER_COUNTERS = ("fence_refusals", "reconnects", "late_replies", "degraded_s")


class KVTierConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`~kvtier.integrations.core.StepPlan`, sent to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        # Pickled every step (vLLM's multiproc executor sends it to each worker): one global
        # for the worker to look up (not the class and the plan's), and for a plan with nothing
        # in it (most decode steps) none of its lists: 135 -> 62 bytes, 3.7 -> 2.2 us for
        # dumps + loads warm (docs/performance.md, "vLLM connector: cost per step").
        if self.plan.is_empty():
            return (_empty_metadata, ())
        return (_metadata_from_tuples, self.plan.__reduce__()[1])

    def __repr__(self) -> str:
        p = self.plan
        return f"KVTierConnectorMetadata(loads={len(p.loads)}, stores={len(p.stores)}, fence={len(p.fence_blocks)})"


def _metadata_from_tuples(*fields: Any) -> KVTierConnectorMetadata:
    """A :class:`KVTierConnectorMetadata` from what its ``__reduce__`` pickled: the fields of
    ``StepPlan.__reduce__``, for ``_plan_from_tuples``."""
    return KVTierConnectorMetadata(_plan_from_tuples(*fields))


def _empty_metadata() -> KVTierConnectorMetadata:
    """The metadata of a plan with nothing in it (a fresh one each time: a worker may change it)."""
    return KVTierConnectorMetadata(StepPlan())


class KVTierConnector(KVConnectorBase_V1):
    """vLLM's KV connector for kvtier: loads prefix KV from a kvtier-server and stores every
    prompt chunk the engine computes (module docstring for the options).

    Not :class:`SupportsHMA` (vLLM's hybrid memory allocator): kvtier serves one group of
    full-attention layers, so vLLM runs it with the hybrid allocator off (and refuses to start
    when it is forced on); a ``kv_cache_config`` with anything else is refused here
    (:func:`check_kv_cache_config`). ``kv_role``: ``kv_producer`` stores and never looks up,
    ``kv_consumer`` looks up and loads and never stores, ``kv_both`` does both.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_kv_cache_config(kv_cache_config)
        self._config = config_from_vllm(vllm_config, role)
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        self._stats = KVTierConnectorStats()
        # The cumulative counters behind the stats (_COUNTERS' names, in order), as last reported.
        self._sampled: Tuple[float, ...] = ()
        # worker: chunk block sets of each retrieve not over yet, and whether each failed
        self._loads: Dict[str, List[List[Any]]] = {}
        self._recved: Set[str] = set()
        self._layerwise = self._config.layerwise
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self._config)
        else:
            self._worker = WorkerSide(self._config)

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a worker's KVTierConnector has no scheduler side"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "the scheduler's KVTierConnector has no worker side"
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store lost to a preemption is a future miss, never wrong KV
        # (the fence drops it), so vLLM need not recompute the preempted request for it.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        layout = str(extra.get("kv_layout", "auto")).upper()
        return layout if layout in ("NHD", "HND") else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        # Layerwise loads wait in wait_for_layer_load, which a captured CUDA graph skips.
        return str((extra_config or {}).get("load_mode", "async")) == "layerwise"

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(data)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        # The chunk keys cover what vLLM's block hash covers (tokens, salt, LoRA adapter,
        # multimodal inputs, prompt embeddings: request_keys.py), computed the same in every
        # process, once per lookup (vLLM asks every step while one is pending); stores and
        # loads of the request use the hashes named here.
        chunk_tokens = self._config.chunk_tokens
        return self.scheduler_side.num_new_matched_tokens(
            request.request_id, lambda: request_keys(request, chunk_tokens), int(num_computed_tokens)
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._stats.add("hit_requests", 1)
            self._stats.add("hit_tokens", int(num_external_tokens))
        self.scheduler_side.after_alloc(request.request_id, first_group(blocks), int(num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        # Every step: the rows are tuples, not StepInput's objects, and only the requests whose
        # step may plan something (docs/performance.md, "vLLM connector: cost per step").
        side = self.scheduler_side
        plan = side.plan_step(preempted_ids(scheduler_output), scheduled_rows(scheduler_output, side.watched))
        if plan.loads:
            self._stats.add("load_chunks_planned", sum(len(op.hashes) for op in plan.loads))
        if plan.stores:
            self._stats.add("store_chunks_planned", sum(len(op.hashes) for op in plan.stores))
        return KVTierConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        # A synchronous (layerwise) load's failed blocks: the request recomputes them, and its
        # chunks are stored from the recomputation.
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self.scheduler_side.on_load_errors(invalid)
        self.scheduler_side.on_finished_recving(getattr(connector_output, "finished_recving", None) or ())

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        # block_ids (the computed prefix, a partial tail included) are not what kvtier stores:
        # it stored each full prompt chunk, keyed by its own hash of the tokens, at the
        # wait_for_save of the step that computed it, so request.num_publishable_block_hashes
        # (vLLM's fence on ITS block hashes, for EAGLE) has nothing to gate. Freeing is
        # delayed until a worker reports the id (its stores and loads are over).
        return self.scheduler_side.request_finished(request.request_id), None

    def reset_cache(self) -> Optional[bool]:
        # vLLM's reset_prefix_cache(reset_connector=True): the kvtier-server's cache is shared
        # by every engine that uses it, so one engine does not clear it. False tells vLLM (and
        # its caller) that the connector's cache was NOT reset.
        log.warning(
            "kvtier: reset_cache: the kvtier-server's cache is shared by every engine connected to it and is "
            "not cleared by one engine's prefix-cache reset; restart the server (or use a new cache_salt) to "
            "drop what it holds"
        )
        return False

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        cache_dtype = getattr(self._vllm_config.cache_config, "cache_dtype", "auto")
        dtype = None
        if cache_dtype not in (None, "auto"):
            dtype = "fp8_e4m3" if cache_dtype == "fp8" else str(cache_dtype)
        # What the tensors' dimensions mean: vLLM's attention backend of these layers (None
        # when vLLM cannot tell: the kv_cache_backend option or the device decides).
        backend = backend_of_layers(self._vllm_config, list(kv_caches))
        self.worker_side.register(kv_caches, dtype=dtype, backend=backend)

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        # Refused (WorkerSide.register_cross_layers says why); vLLM calls it only when
        # prefer_cross_layer_blocks is True, which kvtier leaves at the base class's False.
        self.worker_side.register_cross_layers(kv_cache, attn_backend)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.worker_side.handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._get_connector_metadata().plan
        self.worker_side.start_step(plan)
        bpc = self._config.chunk_tokens // self._config.block_size
        for op in plan.loads:
            if op.hashes:
                self._stats.add("load_chunks", len(op.hashes))
                chunks = [set(op.block_ids[i * bpc : (i + 1) * bpc]) for i in range(len(op.hashes))]
                self._loads[op.request_id] = [[c, False] for c in chunks]

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Layerwise: until this layer of the step's retrieves landed; async: nothing (the
        # loads completed between steps). Called by every attention layer every step: the
        # asynchronous mode returns before any other call.
        if self._layerwise:
            self.worker_side.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # The KV already lives in the shared region and wait_for_save's stores never block the
        # engine: a store per layer would only send L times the messages (docs/performance.md,
        # "Layer-wise loading").
        return None

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            ws = self.worker_side
            issued, dropped = ws.stores_issued, ws.stores_dropped
            ws.end_step(self._get_connector_metadata().plan)
            self._stats.add("store_requests", ws.stores_issued - issued)
            self._stats.add("stores_dropped", ws.stores_dropped - dropped)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        sending, recving = self.worker_side.finished(finished_req_ids)
        self._recved |= recving or set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors = self.worker_side.load_error_blocks()
        self._stats.add("load_error_blocks", len(errors))
        # A retrieve is over once its id is reported finished receiving (asynchronous loads;
        # its errors come no later than that step, here) or, layerwise, at the end of its step.
        over = set(self._loads) if self._layerwise else self._recved.intersection(self._loads)
        if errors:
            for rid, chunks in self._loads.items():
                for c in chunks:
                    c[1] = c[1] or bool(c[0] & errors)
        for rid in over:
            self._stats.add("loaded_chunks", sum(1 for _, failed in self._loads.pop(rid) if not failed))
        self._recved.clear()
        return errors

    # ------------------------------------------------------------------ both
    def get_kv_connector_stats(self) -> Optional[KVTierConnectorStats]:
        """What happened since the last call (:data:`STATS_KEYS`; None when nothing did).
        vLLM calls it on every worker after each step and on the scheduler after each
        update_from_output, folds them with ``aggregate`` and hands ``data`` to its loggers."""
        # Called twice per step (the scheduler's and each worker's): the counters are compared
        # as one tuple, and only a changed one costs more (docs/performance.md, "vLLM
        # connector: cost per step").
        if self._scheduler is not None:
            s = self._scheduler
            conn = s.connector
            names = _SCHEDULER_COUNTERS
            counters: Tuple[float, ...] = (s.lookups_sent, s.lookup_tokens, s.lookup_hit_tokens)
        else:
            conn = self.worker_side.connector
            names = _WORKER_COUNTERS
            counters = (self.worker_side.fence_refusals,)
        if conn is not None:
            # One call (one lock in C++): a scheduler's connector quarantines nothing. The time
            # without a server is the connector's own clock of its outages, not a guess from
            # the health at this sample (an outage between two samples counts, and an idle
            # engine's time before one does not).
            registrations, late_replies, quarantined, unhealthy_ns = conn.counters
            counters += (max(registrations - 1, 0), late_replies, unhealthy_ns / 1e9)
            if self._scheduler is None:
                self._stats.add("quarantined_blocks_max", quarantined)
        else:
            counters += (0, 0, 0.0)
        if counters != self._sampled:
            before = self._sampled or (0,) * len(counters)
            for key, value, old in zip(names, counters, before):
                if value != old:
                    self._stats.add(key, value - old)
            self._sampled = counters
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KVTierConnectorStats()
        return out

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

"""kvtier as a vLLM KV connector (the V1 interface, ``KVConnectorBase_V1``).

Run vLLM with::

    vllm serve <model> --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket_path": "/run/kvtier/kvtier.sock", "chunk_tokens": 256}}'

Written against vLLM commit :data:`VLLM_COMMIT` (``vllm/distributed/kv_transfer/
kv_connector/v1/base.py``; the call order of ``vllm/v1/worker/kv_connector_model_runner_mixin.py``).
When vLLM is not importable the class derives from a local stand-in with the same method
signatures (:mod:`kvtier.integrations._vllm_standin`), which the replay tests drive.

This module only translates vLLM's objects; the logic is :mod:`kvtier.integrations.core`
(:class:`~kvtier.integrations.core.SchedulerSide`, :class:`~kvtier.integrations.core.WorkerSide`).

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
``load_mode``                ``async`` (default: loads complete between steps) or ``layerwise``
                             (synchronous loads; each layer computes as soon as it landed)
``*_timeout_ms`` ...         connector deadlines (``retrieve_timeout_ms``, ``ping_timeout_ms``,
                             ``quarantine_limit_ms``, ...: docs/fault-tolerance.md)
``rank``                     this worker's TP rank when vLLM cannot tell (stand-in runs)
``kv_cache_backend``         ``auto`` (vLLM's attention backend) or the backend whose layout
                             the KV tensors have (``FLASH_ATTN``, ``CPU_ATTN``, ...)
``engine_id``                default: ``kv_transfer_config.engine_id`` (one engine's scheduler and
                             workers share its lookups on the server; :func:`_engine_id`)
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
import os
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from .._kvtier import AttentionKind, DtypeKind, ModelShape
from ..views import dtype_kind_of
from .kv_layouts import backend_of_layers
from .core import (
    TIMEOUT_KEYS,
    KVTierConfig,
    ScheduledRequest,
    SchedulerSide,
    StepInput,
    StepPlan,
    WorkerSide,
)
from .request_keys import request_keys

from .config import KV_ROLES
from .connector_stats import STATS_KEYS, KVTierConnectorStats

try:  # pragma: no cover - vLLM is not installable in kvtier's CI
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    VLLM_AVAILABLE = True
except ImportError:
    from ._vllm_standin import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

    VLLM_AVAILABLE = False

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

#: The vLLM commit whose KV connector interface this adapter implements.
VLLM_COMMIT = "003df2961dd8830c317a61f9745ccd557da9fa06"


class KVTierConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`~kvtier.integrations.core.StepPlan`, sent to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan

    def __repr__(self) -> str:
        p = self.plan
        return f"KVTierConnectorMetadata(loads={len(p.loads)}, stores={len(p.stores)}, fence={len(p.fence_blocks)})"


def _model_shape(vllm_config: Any) -> ModelShape:
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    cache_dtype = getattr(cc, "cache_dtype", "auto") or "auto"
    if cache_dtype == "auto":
        dtype = dtype_kind_of(mc.dtype)
    elif cache_dtype == "fp8":
        dtype = DtypeKind.FP8_E4M3
    else:
        dtype = dtype_kind_of(str(cache_dtype))
    if getattr(mc, "use_mla", False):
        return ModelShape(mc.get_num_layers(pc), 1, mc.get_head_size(), dtype, AttentionKind.MLA)
    return ModelShape(mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), dtype, AttentionKind.MHA)


def _default_layout(vllm_config: Any) -> str:
    try:  # vLLM's own answer for the attention backend in use
        from vllm.v1.attention.backends.utils import get_kv_cache_layout  # type: ignore

        return str(get_kv_cache_layout())
    except Exception:
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")
        return "HND" if str(device) == "cpu" else "NHD"


def _worker_rank(vllm_config: Any, extra: Dict[str, Any]) -> int:
    if "rank" in extra:
        return int(extra["rank"])
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return int(getattr(vllm_config.parallel_config, "rank", 0))


def config_from_vllm(vllm_config: Any, role: Any) -> KVTierConfig:
    """The adapter's :class:`~kvtier.integrations.core.KVTierConfig` from vLLM's config."""
    extra: Dict[str, Any] = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
    pc = vllm_config.parallel_config
    if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
        raise ValueError("kvtier: pipeline parallelism is not supported by KVTierConnector (tensor parallelism is)")
    layout = str(extra.get("kv_layout", "auto"))
    if layout.lower() == "auto":
        layout = _default_layout(vllm_config)
    scheduler = role == KVConnectorRole.SCHEDULER
    cfg = KVTierConfig(
        socket_path=str(extra.get("socket_path") or os.environ.get("KVTIER_SOCKET", "")),
        model_name=str(extra.get("model_name") or vllm_config.model_config.model),
        block_size=int(vllm_config.cache_config.block_size),
        chunk_tokens=int(extra.get("chunk_tokens", 256)),
        world_size=int(getattr(pc, "tensor_parallel_size", 1)),
        rank=0 if scheduler else _worker_rank(vllm_config, extra),
        model=_model_shape(vllm_config),
        layout=layout,
        cache_salt=str(extra.get("cache_salt", "")),
        hash=str(extra.get("hash", "xxh3_128")),
        prefill_tokens_per_second=int(extra.get("prefill_tokens_per_second", 0)),
        ready_timeout_s=float(extra.get("ready_timeout_s", 5.0)),
        timeouts_ms={k: int(extra[k]) for k in TIMEOUT_KEYS if k in extra},
        load_mode=str(extra.get("load_mode", "async")),
        kv_role=str(getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both"),
        kv_cache_backend=str(extra.get("kv_cache_backend", "auto")),
        cache_dtype=str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto"),
        engine_id=_engine_id(vllm_config, extra),
    )
    cfg.validate()
    return cfg


#: The KV cache spec classes (vllm/v1/kv_cache_interface.py) whose layers kvtier serves:
#: full attention, MLA included. A sliding-window or chunked-local layer that vLLM runs as
#: full attention (hybrid allocator off) is a FullAttentionSpec with ``sliding_window`` /
#: ``attention_chunk_size`` set: every token's KV is kept, so it is served too.
SERVED_KV_CACHE_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")

#: Specs of the layers vLLM's hybrid allocator keeps apart (sliding window, chunked local
#: attention, Mamba state).
_HYBRID_SPECS = ("SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MambaSpec")

_HMA_HINT = (
    "kvtier serves one group of full-attention layers: run vLLM with its hybrid KV cache manager off "
    "(--disable-hybrid-kv-cache-manager; vLLM turns it off by itself for a connector without SupportsHMA "
    "unless it was forced on), which runs sliding-window layers as full attention; models with Mamba or "
    "other non-attention state cannot use kvtier"
)


def check_kv_cache_config(kv_cache_config: Any) -> None:
    """Raises ValueError unless vLLM's ``KVCacheConfig`` is one group of layers kvtier serves
    whole (:data:`SERVED_KV_CACHE_SPECS`, K and V of one head size). None (vLLM did not say:
    runs without vLLM) passes."""
    if kv_cache_config is None:
        return
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise ValueError(f"kvtier: vLLM's KV cache config has {len(groups)} KV cache groups: {_HMA_HINT}")
    spec = groups[0].kv_cache_spec
    specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
    for one in specs.values() if isinstance(specs, dict) else [spec]:
        name = type(one).__name__
        if name not in SERVED_KV_CACHE_SPECS:
            hybrid = any(k.__name__ in _HYBRID_SPECS for k in type(one).__mro__)
            raise ValueError(
                f"kvtier: a KV cache group of {name} layers: "
                + (_HMA_HINT if hybrid else f"kvtier serves {' and '.join(SERVED_KV_CACHE_SPECS)} layers only")
            )
        head_size_v = getattr(one, "head_size_v", None)
        if name == "FullAttentionSpec" and head_size_v not in (None, getattr(one, "head_size", None)):
            raise ValueError(
                f"kvtier: K and V of different head sizes (head_size {one.head_size}, head_size_v {head_size_v}): "
                "kvtier's chunks hold one head size for both"
            )


def _engine_id(vllm_config: Any, extra: Dict[str, Any]) -> str:
    """The id the scheduler and every worker of this engine instance register with, so the
    server serves a worker's retrieve from the scheduler's lookup (docs/server.md, "Engines").

    vLLM's ``kv_transfer_config.engine_id``: a uuid4 made once when the engine's config is
    built (``KVTransferConfig.__post_init__``) and pickled with it into the engine core and
    every worker process, suffixed ``_dp<rank>`` per data-parallel engine; so it is the same in
    every process of one engine and differs between engines. Without it (an older vLLM, a
    stand-in): ``vllm_config.instance_id`` when set, which vLLM makes the same way; else empty,
    and each connection is an engine of its own (a worker's retrieve then copies what L1 holds
    and cannot wait for L2 loads its scheduler started). ``engine_id`` in
    ``kv_connector_extra_config`` overrides both."""
    for value in (
        extra.get("engine_id"),
        getattr(vllm_config.kv_transfer_config, "engine_id", None),
        getattr(vllm_config, "instance_id", None),
    ):
        if value:
            return str(value)
    return ""


def _first_group(block_ids: Any) -> List[int]:
    """vLLM's block ids per KV cache group (a tuple of lists), or a plain list: group 0."""
    if block_ids is None:
        return []
    if hasattr(block_ids, "get_block_ids"):  # KVCacheBlocks
        block_ids = block_ids.get_block_ids()
    if isinstance(block_ids, tuple):
        return list(block_ids[0]) if block_ids else []
    return list(block_ids)


def step_input_from(scheduler_output: Any) -> StepInput:
    """The :class:`~kvtier.integrations.core.StepInput` of vLLM's ``SchedulerOutput``."""
    num_scheduled: Dict[str, int] = scheduler_output.num_scheduled_tokens
    step = StepInput(preempted=sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
    for new in scheduler_output.scheduled_new_reqs:
        step.scheduled.append(
            ScheduledRequest(
                new.req_id,
                _first_group(new.block_ids),
                int(new.num_computed_tokens),
                int(num_scheduled.get(new.req_id, 0)),
                replace_blocks=True,
            )
        )
    cached = scheduler_output.scheduled_cached_reqs
    resumed_set = getattr(cached, "resumed_req_ids", None)
    resumed_flags = getattr(cached, "resumed_from_preemption", None)  # older vLLM
    for i, rid in enumerate(cached.req_ids):
        resumed = (rid in resumed_set) if resumed_set is not None else bool(resumed_flags and resumed_flags[i])
        step.scheduled.append(
            ScheduledRequest(
                rid,
                _first_group(cached.new_block_ids[i]),
                int(cached.num_computed_tokens[i]),
                int(num_scheduled.get(rid, 0)),
                replace_blocks=resumed,
            )
        )
    return step


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
        self._sampled: Dict[str, float] = {}  # connector counters at the last stats report
        self._sampled_at: Optional[float] = None
        # worker: chunk block sets of each retrieve not over yet, and whether each failed
        self._loads: Dict[str, List[List[Any]]] = {}
        self._recved: Set[str] = set()
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
        self.scheduler_side.after_alloc(request.request_id, _first_group(blocks), int(num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        plan = self.scheduler_side.build_step(step_input_from(scheduler_output))
        self._stats.add("load_chunks_planned", sum(len(op.hashes) for op in plan.loads))
        self._stats.add("store_chunks_planned", sum(len(op.hashes) for op in plan.stores))
        return KVTierConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        # A synchronous (layerwise) load's failed blocks: the request recomputes them, and its
        # chunks are stored from the recomputation.
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self.scheduler_side.on_load_errors(invalid)

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
        # loads completed between steps).
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
        over = set(self._loads) if self._config.layerwise else self._recved & set(self._loads)
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
        if self._scheduler is not None:
            conn = self._scheduler.connector
            s = self._scheduler
            counters = {"lookups": s.lookups_sent, "lookup_tokens": s.lookup_tokens, "lookup_hit_tokens": s.lookup_hit_tokens}
        else:
            conn = self.worker_side.connector
            counters = {"fence_refusals": self.worker_side.fence_refusals}
            if conn is not None:
                self._stats.add("quarantined_blocks_max", len(conn.quarantined_blocks()))
        now = time.monotonic()
        if conn is not None:
            c = conn.stats()
            counters["reconnects"] = max(int(c["registrations"]) - 1, 0)
            counters["late_replies"] = int(c["late_replies"])
            if self._sampled_at is not None and not conn.healthy:
                self._stats.add("degraded_s", now - self._sampled_at)
        self._sampled_at = now
        for key, value in counters.items():
            self._stats.add(key, value - self._sampled.get(key, 0))
            self._sampled[key] = value
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, KVTierConnectorStats()
        return out

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

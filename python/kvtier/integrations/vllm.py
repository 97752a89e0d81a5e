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
``engine_id``                default: ``kv_transfer_config.engine_id`` (one engine's scheduler and
                             workers share its lookups on the server; :func:`_engine_id`)
===========================  ===============================================================
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Set, Tuple

from .._kvtier import AttentionKind, DtypeKind, ModelShape
from ..views import dtype_kind_of
from .core import (
    TIMEOUT_KEYS,
    KVTierConfig,
    ScheduledRequest,
    SchedulerSide,
    StepInput,
    StepPlan,
    WorkerSide,
)

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
    "KVTierConnector",
    "KVTierConnectorMetadata",
    "config_from_vllm",
    "step_input_from",
]

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
        engine_id=_engine_id(vllm_config, extra),
    )
    cfg.validate()
    return cfg


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
    prompt chunk the engine computes (module docstring for the options)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._config = config_from_vllm(vllm_config, role)
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
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

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        layout = str(extra.get("kv_layout", "auto")).upper()
        return layout if layout in ("NHD", "HND") else None

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        tokens = request.all_token_ids
        return self.scheduler_side.num_new_matched_tokens(
            request.request_id,
            list(tokens),
            int(num_computed_tokens),
            num_prompt_tokens=int(getattr(request, "num_prompt_tokens", len(tokens))),
            cache_salt=getattr(request, "cache_salt", None) or "",
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.after_alloc(request.request_id, _first_group(blocks), int(num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVTierConnectorMetadata:
        return KVTierConnectorMetadata(self.scheduler_side.build_step(step_input_from(scheduler_output)))

    def update_connector_output(self, connector_output: Any) -> None:
        # A synchronous (layerwise) load's failed blocks: the request recomputes them, and its
        # chunks are stored from the recomputation.
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self.scheduler_side.on_load_errors(invalid)

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self.scheduler_side.request_finished(request.request_id), None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        cache_dtype = getattr(self._vllm_config.cache_config, "cache_dtype", "auto")
        dtype = None
        if cache_dtype not in (None, "auto"):
            dtype = "fp8_e4m3" if cache_dtype == "fp8" else str(cache_dtype)
        self.worker_side.register(kv_caches, dtype=dtype)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.worker_side.handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.start_step(self._get_connector_metadata().plan)

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
            self.worker_side.end_step(self._get_connector_metadata().plan)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return self.worker_side.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self.worker_side.load_error_blocks()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

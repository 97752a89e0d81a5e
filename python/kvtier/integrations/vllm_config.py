"""vLLM's configuration read for kvtier: :func:`config_from_vllm` turns vLLM's ``VllmConfig``
(its model, cache, parallel and KV transfer configs, and the ``kv_connector_extra_config``
options :mod:`kvtier.integrations.vllm` lists) into the adapter's
:class:`~kvtier.integrations.config.KVTierConfig`; :func:`check_kv_cache_config` refuses a
``KVCacheConfig`` kvtier cannot serve whole (the connector is not ``SupportsHMA``)."""

from __future__ import annotations

import os
from typing import Any, Dict

from .._kvtier import AttentionKind, DtypeKind, ModelShape
from ..views import dtype_kind_of
from .config import TIMEOUT_KEYS, KVTierConfig
from .vllm_base import KVConnectorRole

__all__ = ["SERVED_KV_CACHE_SPECS", "check_kv_cache_config", "config_from_vllm"]


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
        lookup_wait_ms=float(extra.get("lookup_wait_ms", 0.0)),
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

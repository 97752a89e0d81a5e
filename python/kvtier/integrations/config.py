"""The adapter's configuration: what the scheduler side and the worker side both need
(:class:`KVTierConfig`), built from vLLM's config by
:func:`kvtier.integrations.vllm_config.config_from_vllm` or directly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from .._kvtier import ConnectorOptions, HashAlgorithm, KvLayoutKind, ModelShape, parse_kv_layout_kind

__all__ = ["KVTierConfig", "TIMEOUT_KEYS", "LOAD_MODES", "KV_ROLES"]

#: ``KVTierConfig.load_mode`` values: loads between steps, or synchronous and layer by layer.
LOAD_MODES = ("async", "layerwise")

#: ``KVTierConfig.kv_role`` values (vLLM's ``kv_role``): stores only, loads only, or both.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")

TIMEOUT_KEYS = (
    "ping_interval_ms",
    "ping_timeout_ms",
    "request_timeout_ms",
    "lookup_timeout_ms",
    "retrieve_timeout_ms",
    "store_timeout_ms",
    "reconnect_initial_ms",
    "reconnect_max_ms",
    "quarantine_limit_ms",
)


@dataclass
class KVTierConfig:
    """What both sides need; built from vLLM's config by
    :func:`kvtier.integrations.vllm_config.config_from_vllm` or directly.

    Attributes:
        socket_path: the kvtier-server's Unix socket.
        model_name: with the shape, the layout kind and ``cache_salt``, the model id.
        block_size: tokens per engine block.
        chunk_tokens: tokens per chunk (the server's ``--chunk-size``; a multiple of
            ``block_size``).
        world_size: tensor-parallel ranks; ``rank``: this worker's (0 in the scheduler).
        model: one rank's KV shape (the scheduler registers it; a worker checks its tensors
            against it when given).
        layout: ``"NHD"``, ``"HND"`` or ``"auto"`` (the worker takes what its tensors are; the
            scheduler then needs the engine's default, see the vLLM adapter).
        cache_salt: a deployment-wide salt folded into the model id.
        hash: ``"xxh3_128"`` or ``"sha256"``.
        prefill_tokens_per_second: the engine's declared prefill rate (0: not declared).
        ready_timeout_s: how long start-up waits for the server; past it the connector runs
            degraded (no hits, no stores) and keeps reconnecting.
        timeouts_ms: connector deadlines by name (``retrieve_timeout_ms``, ...; docs/
            fault-tolerance.md); missing ones keep their defaults.
        load_mode: ``"async"`` (loads complete between steps; the default) or ``"layerwise"``
            (synchronous loads, each layer usable as soon as the server copied it; module
            docstring).
        kv_role: vLLM's ``kv_role``: ``"kv_producer"`` stores and never looks up nor loads,
            ``"kv_consumer"`` looks up and loads and never stores, ``"kv_both"`` does both.
        kv_cache_backend: ``"auto"`` (vLLM's attention backend when it can be asked, else by
            the tensors' device and rank) or the name of the attention backend whose layout
            the KV tensors have (:data:`kvtier.integrations.kv_layouts.BACKENDS`:
            ``FLASH_ATTN``, ``CPU_ATTN``, ``FLASHMLA``, ...).
        cache_dtype: vLLM's ``cache_config.cache_dtype`` (``"auto"``, ``"fp8"``, ...): asked
            of the attention backend with its KV shape.
        lookup_wait_ms: how long the lookups of one scheduler step may wait, together, for the
            server's answers (0, the default: never). vLLM skips a request whose lookup is not
            answered yet and asks again in its next step, so an unanswered first ask costs
            every request one engine step of TTFT; a wait at least the lookup's round trip
            admits it in the step it arrived in, for that much of the engine thread's time.
            Shared by the step's lookups, so a server that does not answer costs at most this
            per step (module docstring of :mod:`kvtier.integrations.scheduler_side`).
        engine_id: the engine instance, the same on the scheduler side and every worker
            (vLLM's ``kv_transfer_config.engine_id``): the server serves a worker's retrieve
            from the scheduler's lookup (docs/server.md, "Engines"). Empty: each connection
            is an engine of its own.
    """

    socket_path: str
    model_name: str
    block_size: int = 16
    chunk_tokens: int = 256
    world_size: int = 1
    rank: int = 0
    model: Optional[ModelShape] = None
    layout: str = "auto"
    cache_salt: str = ""
    hash: str = "xxh3_128"
    prefill_tokens_per_second: int = 0
    ready_timeout_s: float = 5.0
    timeouts_ms: Dict[str, int] = field(default_factory=dict)
    load_mode: str = "async"
    kv_role: str = "kv_both"
    kv_cache_backend: str = "auto"
    cache_dtype: str = "auto"
    engine_id: str = ""
    lookup_wait_ms: float = 0.0

    @property
    def loads(self) -> bool:
        """Whether this engine looks chunks up and loads them (``kv_consumer``, ``kv_both``)."""
        return self.kv_role != "kv_producer"

    @property
    def stores(self) -> bool:
        """Whether this engine stores the chunks it computes (``kv_producer``, ``kv_both``)."""
        return self.kv_role != "kv_consumer"

    @property
    def layerwise(self) -> bool:
        """Whether loads are synchronous and layer by layer (``load_mode="layerwise"``)."""
        return self.load_mode == "layerwise"

    def validate(self) -> None:
        """Raises ValueError naming the first field that is wrong."""
        if not self.socket_path:
            raise ValueError("kvtier: socket_path is empty: set kv_connector_extra_config['socket_path'] or KVTIER_SOCKET")
        if not self.model_name:
            raise ValueError("kvtier: model_name is empty")
        if self.block_size <= 0 or self.chunk_tokens <= 0 or self.chunk_tokens % self.block_size != 0:
            raise ValueError(
                f"kvtier: chunk_tokens ({self.chunk_tokens}) must be a positive multiple of block_size "
                f"({self.block_size})"
            )
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"kvtier: rank {self.rank} is not below world_size {self.world_size}")
        if self.layout.upper() not in ("NHD", "HND", "MLA", "AUTO"):
            raise ValueError(f"kvtier: layout '{self.layout}': use NHD, HND or auto")
        if self.hash not in ("xxh3_128", "xxh3", "sha256"):
            raise ValueError(f"kvtier: hash '{self.hash}': use xxh3_128 or sha256")
        for key in self.timeouts_ms:
            if key not in TIMEOUT_KEYS:
                raise ValueError(f"kvtier: unknown timeout '{key}': use one of {', '.join(TIMEOUT_KEYS)}")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"kvtier: load_mode '{self.load_mode}': use {' or '.join(LOAD_MODES)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kvtier: kv_role '{self.kv_role}': use {', '.join(KV_ROLES)}")
        if not 0.0 <= self.lookup_wait_ms <= 1000.0:  # NaN fails too
            raise ValueError(f"kvtier: lookup_wait_ms {self.lookup_wait_ms}: use 0 (never wait) to 1000")
        if len(self.engine_id.encode()) > 128:
            raise ValueError(f"kvtier: engine_id '{self.engine_id[:40]}...' is longer than 128 bytes")

    def connector_options(self, scheduler: bool) -> ConnectorOptions:
        """The C++ connector's options for one side."""
        o = ConnectorOptions()
        o.socket_path = self.socket_path
        o.rank = 0 if scheduler else self.rank
        o.world_size = self.world_size
        o.scheduler = scheduler
        o.model_name = self.model_name
        o.chunk_tokens = self.chunk_tokens
        o.cache_salt = self.cache_salt
        o.prefill_tokens_per_second = self.prefill_tokens_per_second
        o.engine_id = self.engine_id
        if scheduler:
            o.block_size = self.block_size  # in its chunk descriptions (a worker's is its region's)
        o.hash = self.hash_algorithm()
        t = o.timeouts
        for key, value in self.timeouts_ms.items():
            setattr(t, key, int(value))
        o.timeouts = t
        return o

    def hash_algorithm(self) -> HashAlgorithm:
        """The chunk hash ``hash`` names (``"xxh3"`` is ``"xxh3_128"``)."""
        return HashAlgorithm.SHA256 if self.hash == "sha256" else HashAlgorithm.XXH3_128

    def layout_kind(self) -> Optional[KvLayoutKind]:
        """The configured layout kind, or None for ``auto``."""
        return None if self.layout.upper() == "AUTO" else parse_kv_layout_kind(self.layout.upper())


"""A stand-in for vLLM's KV connector base classes, used when vLLM is not importable.

It mirrors ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` at the commit
:data:`kvtier.integrations.vllm.VLLM_COMMIT` (and ``KVConnectorStats`` of ``.../v1/metrics.py``
beside it): every class, method, property and classmethod, with the same parameters,
defaults, abstract methods and default behaviour, so that a method KVTierConnector does not
override answers in the replay tests what it answers in vLLM. Annotations are strings (vLLM's
types are not importable here). tests/python/test_vllm_standin.py holds the upstream list
this file is checked against: change both together when the pinned commit moves.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Literal, Optional, Set, Tuple

__all__ = [
    "CopyBlocksOp",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "SupportsHMA",
    "supports_hma",
]

logger = logging.getLogger("kvtier")

# s_tensor_list, d_tensor_list, s_indices, d_indices, direction (torch tensors in vLLM)
CopyBlocksOp = Callable[[Dict[str, Any], Dict[str, Any], List[int], List[int], Literal["h2d", "d2h"]], None]


class SupportsHMA(ABC):
    """Marks a connector that supports vLLM's hybrid memory allocator (several KV cache groups)."""

    @abstractmethod
    def request_finished_all_groups(
        self, request: "Request", block_ids: "tuple[list[int], ...]"
    ) -> "tuple[bool, dict[str, Any] | None]":
        raise NotImplementedError


def supports_hma(connector: Any) -> bool:
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)


class KVConnectorRole(enum.Enum):
    # Connector running in the scheduler process
    SCHEDULER = 0
    # Connector running in the worker process
    WORKER = 1


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024 (vLLM's own: no abstract method)
    """Out-of-band handshake metadata between P/D workers (serializable)."""


class KVConnectorMetadata(ABC):  # noqa: B024
    """What the scheduler-side connector hands the workers each step."""


class KVConnectorWorkerMetadata(ABC):
    """What every worker hands back to the scheduler-side connector each step (folded with
    ``aggregate`` across workers)."""

    @abstractmethod
    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        pass


@dataclass
class KVConnectorStats:
    """vLLM's ``KVConnectorStats`` (v1/metrics.py): ``data`` travels from the workers and the
    scheduler to the logger process, which rebuilds the object with the connector class's
    ``build_kv_connector_stats(data)``. Every method must be overridden."""

    data: Dict[str, Any] = field(default_factory=dict)

    def reset(self):
        raise NotImplementedError

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        raise NotImplementedError

    def reduce(self) -> "dict[str, int | float]":
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError


class KVConnectorBase_V1(ABC):
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return False

    @property
    def supports_eagle_prefix_cache_hashing(self) -> bool:
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        return self._kv_transfer_config.is_kv_producer

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        logger.debug("Initializing KVConnectorBase_V1 (kvtier's stand-in of vLLM's base class)")
        self._connector_metadata: Optional[KVConnectorMetadata] = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is not None:
            self._kv_transfer_config = vllm_config.kv_transfer_config
        else:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_cache_config = kv_cache_config
        self._role = role
        self.use_eagle_prefix_cache_hashing = False

    def set_eagle_prefix_cache_hashing(self, enabled: bool) -> None:
        self.use_eagle_prefix_cache_hashing = enabled

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ============================== worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: "dict[str, torch.Tensor]"):
        return

    def register_cross_layers_kv_cache(self, kv_cache: "torch.Tensor", attn_backend: "type[AttentionBackend]"):
        return

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp):
        return

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata):
        return

    @abstractmethod
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        pass

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        pass

    @abstractmethod
    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return None, None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return set()

    def shutdown(self):
        return None

    def get_kv_connector_stats(self) -> "KVConnectorStats | None":
        return None

    def get_kv_connector_kv_cache_events(self) -> "KVConnectorKVEvents | None":
        return None

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        return None

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        return None

    # ============================== scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        return

    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        pass

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        pass

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        pass

    def on_new_request(self, request: "Request") -> None:
        return

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        return

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return False, None

    def take_events(self) -> Iterable["KVCacheEvent"]:
        return ()

    def has_pending_push_work(self) -> bool:
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout should not be called on the abstract base class")
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        return False

    def get_finished_count(self) -> Optional[int]:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> "KVConnectorStats | None":
        return None

    def set_xfer_handshake_metadata(self, metadata: Dict[int, KVConnectorHandshakeMetadata]) -> None:
        return None

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: Dict[Tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        if any(pp_rank != 0 for pp_rank, _ in metadata):
            raise ValueError(
                f"{type(self).__name__} received pp_rank > 0 handshake metadata "
                "but does not support PP-disaggregated KV transfer."
            )
        self.set_xfer_handshake_metadata({tp_rank: meta for (_, tp_rank), meta in metadata.items()})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: "dict[type[PromMetric], type[PromMetricT]]",
        labelnames: List[str],
        per_engine_labelvalues: Dict[int, List[object]],
    ) -> "KVConnectorPromMetrics | None":
        return None

    def reset_cache(self) -> Optional[bool]:
        logger.debug("Connector cache reset requested, but %s does not implement reset_cache().", type(self).__name__)
        return None

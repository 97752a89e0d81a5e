"""A stand-in for vLLM's KV connector base classes, used when vLLM is not importable.

It has the method names and signatures of ``vllm/distributed/kv_transfer/kv_connector/v1/
base.py`` at the commit :data:`kvtier.integrations.vllm.VLLM_COMMIT`, and the base class's
own behaviour (binding the per-step metadata), nothing else: the replay tests drive
:class:`kvtier.integrations.vllm.KVTierConnector` through it exactly as vLLM would.
"""

from __future__ import annotations

import enum
from typing import Any, Iterable, Optional, Set, Tuple

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole"]


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler-side connector hands the workers each step."""


class KVConnectorBase_V1:
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        self._connector_metadata: Optional[KVConnectorMetadata] = None
        self._vllm_config = vllm_config
        if getattr(vllm_config, "kv_transfer_config", None) is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # worker side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict) -> None:
        return None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        return None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return None, None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return set()

    def shutdown(self) -> None:
        return None

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        raise NotImplementedError

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        raise NotImplementedError

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        raise NotImplementedError

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def request_finished(self, request: Any, block_ids: list) -> Tuple[bool, Optional[dict]]:
        return False, None

    def take_events(self) -> Iterable[Any]:
        return ()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        return None

"""vLLM's configuration objects a KV connector reads, as the pinned commit has them
(kvtier.integrations.vllm.VLLM_COMMIT): ``KVTransferConfig`` (vllm/config/kv_transfer.py) and
the ``KVCacheConfig`` a connector is constructed with (vllm/v1/kv_cache_interface.py), with the
fields and properties the connector and the scheduler use."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    kv_connector: Optional[str] = None
    engine_id: Optional[str] = None
    kv_role: Optional[str] = None
    kv_connector_extra_config: Dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: Optional[str] = None
    kv_load_failure_policy: str = "fail"  # vLLM's default at the pinned commit

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())  # one per engine, shared by its scheduler and workers
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"Unsupported kv_role: {self.kv_role}. Supported roles are {KV_ROLES}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError("Please specify kv_role when kv_connector is set")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"kv_load_failure_policy {self.kv_load_failure_policy}")

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_ROLES

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


# vllm/v1/kv_cache_interface.py: the spec classes the connector tells apart by name.
@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int = 1
    head_size: int = 8
    dtype: str = "float32"


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    head_size_v: Optional[int] = None
    sliding_window: Optional[int] = None  # a sliding-window layer vLLM runs as full attention (hybrid manager off)
    attention_chunk_size: Optional[int] = None


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: Optional[str] = None


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 0


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    shapes: tuple = ()


@dataclass
class KVCacheTensor:
    size: int
    shared_by: List[str]


@dataclass
class KVCacheGroupSpec:
    layer_names: List[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: List[KVCacheTensor]
    kv_cache_groups: List[KVCacheGroupSpec]


#: Bytes per element of the KV cache dtypes the specs name (AttentionSpec.dtype; vLLM's is a
#: torch.dtype and its page size is computed from that dtype's element size).
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def full_attention_config(
    layer_names: List[str], num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: str = "float32"
) -> KVCacheConfig:
    """The KVCacheConfig of a model whose layers are all full attention (one group), with KV
    caches of ``dtype``."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    page = 2 * block_size * num_kv_heads * head_size * _DTYPE_BYTES[dtype]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(num_blocks * page, [n]) for n in layer_names],
        kv_cache_groups=[KVCacheGroupSpec(list(layer_names), spec)],
    )

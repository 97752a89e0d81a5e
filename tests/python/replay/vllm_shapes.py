"""vLLM's objects as the KV connector sees them, reduced to the fields it reads.

Shapes follow vLLM (vllm/v1/request.py, vllm/v1/core/sched/output.py, vllm/v1/outputs.py,
vllm/config) at the commit kvtier.integrations.vllm.VLLM_COMMIT names. The replay driver
builds these and hands them to ``KVTierConnector`` exactly where vLLM would.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .vllm_configs import KVTransferConfig


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class LoRARequest:
    """vllm.lora.request.LoRARequest (vLLM's block hash uses lora_name only)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass
class PlaceholderRange:
    """vllm.multimodal.inputs.PlaceholderRange: where an input's embeddings go."""

    offset: int
    length: int
    is_embed: Any = None


@dataclass
class MultiModalFeatureSpec:
    """vllm.multimodal.inputs.MultiModalFeatureSpec. ``data``: here the input's embeddings
    ((length, hidden) rows the TinyDecoder puts at the placeholder positions; vLLM's is the
    processed input its encoder turns into them); ``identifier``: the content's hash."""

    data: Any
    modality: str
    identifier: str
    mm_position: PlaceholderRange
    mm_hash: Optional[str] = None


class Request:
    """vllm.v1.request.Request: the fields the connector and the scheduler use.

    ``prompt_token_ids=None`` with ``prompt_embeds`` is an embeddings-only prompt: its token
    ids are zeros (``[0] * num_prompt_tokens``), as vLLM has them."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Optional[List[int]],
        max_tokens: int,
        cache_salt: Optional[str] = None,
        *,
        lora_request: Optional[LoRARequest] = None,
        mm_features: Optional[List[MultiModalFeatureSpec]] = None,
        prompt_embeds: Any = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = None if prompt_token_ids is None else list(prompt_token_ids)
        self.prompt_embeds = prompt_embeds
        if prompt_token_ids is None:
            assert prompt_embeds is not None, "a request has token ids, prompt embeddings or both"
            self._num_prompt_tokens = int(prompt_embeds.shape[0])
            self._all_token_ids = [0] * self._num_prompt_tokens
        else:
            self._num_prompt_tokens = len(prompt_token_ids)
            self._all_token_ids = list(prompt_token_ids)
        self.lora_request = lora_request
        self.mm_features: List[MultiModalFeatureSpec] = list(mm_features or [])
        self.output_token_ids: List[int] = []
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_external_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.num_publishable_block_hashes = 0  # advances only under EAGLE prefix hashing (never here)
        self.arrival_time = 0.0
        self.first_token_time: Optional[float] = None

    @property
    def all_token_ids(self) -> List[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    def block_extra_keys(self, start: int, end: int) -> Optional[Tuple[Any, ...]]:
        """vLLM's generate_block_hash_extra_keys for the block [start, end) (the replay's own
        prefix cache keys blocks with them, as vLLM's does): the adapter's name, each
        multimodal input overlapping the block as (identifier, offset - start), the prompt
        embeddings' SHA-256 (the salt is chained from the first block by the caller)."""
        keys: List[Any] = []
        if self.lora_request is not None:
            keys.append(self.lora_request.lora_name)
        for f in self.mm_features:
            off, n = f.mm_position.offset, f.mm_position.length
            if end > off and start < off + n:
                keys.append((f.identifier, off - start))
        if self.prompt_embeds is not None:
            rows = self.prompt_embeds[start:end].flatten().contiguous()
            keys.append(hashlib.sha256(rows.view(torch.uint8).numpy().tobytes()).digest())
        return tuple(keys) if keys else None

    def append_output_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._all_token_ids.append(token)

    def is_finished(self) -> bool:
        return self.status.finished


class KVCacheBlocks:
    """vllm.v1.core.kv_cache_manager.KVCacheBlocks: block ids per KV cache group (one here)."""

    def __init__(self, block_ids: List[int]):
        self._ids = list(block_ids)

    def get_block_ids(self) -> Tuple[List[int], ...]:
        return (list(self._ids),)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: Optional[List[int]]
    block_ids: Tuple[List[int], ...]
    num_computed_tokens: int
    mm_features: List[MultiModalFeatureSpec] = field(default_factory=list)
    lora_request: Optional[LoRARequest] = None
    prompt_embeds: Any = None


@dataclass
class CachedRequestData:
    req_ids: List[str] = field(default_factory=list)
    resumed_req_ids: Set[str] = field(default_factory=set)
    new_token_ids: List[List[int]] = field(default_factory=list)
    new_block_ids: List[Optional[Tuple[List[int], ...]]] = field(default_factory=list)
    num_computed_tokens: List[int] = field(default_factory=list)
    num_output_tokens: List[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: List[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: Set[str]
    preempted_req_ids: Optional[Set[str]] = None
    kv_connector_metadata: Any = None
    # Not vLLM's: the replay's workers get each scheduled request's tokens (all it has) here
    # (vLLM's workers keep them in their persistent batch).
    token_ids: Dict[str, List[int]] = field(default_factory=dict)


@dataclass
class KVConnectorOutput:
    finished_sending: Optional[Set[str]] = None
    finished_recving: Optional[Set[str]] = None
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    kv_connector_worker_meta: Any = None
    invalid_block_ids: Set[int] = field(default_factory=set)
    expected_finished_count: int = 0


class _ModelConfig:
    def __init__(self, model: str, num_layers: int, num_kv_heads: int, head_size: int, dtype: str):
        self.model = model
        self.dtype = dtype
        self.use_mla = False
        self._layers, self._heads, self._head_size = num_layers, num_kv_heads, head_size

    def get_num_layers(self, parallel_config: Any) -> int:
        return self._layers

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        return self._heads // parallel_config.tensor_parallel_size

    def get_head_size(self) -> int:
        return self._head_size


def vllm_config(
    *,
    model: str,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    tp: int = 1,
    rank: int = 0,
    dtype: str = "float32",
    extra: Optional[Dict[str, Any]] = None,
    device: str = "cpu",
    kv_role: str = "kv_both",
    kv_load_failure_policy: str = "fail",
    engine_id: Optional[str] = None,
) -> SimpleNamespace:
    """A VllmConfig with the attributes KVTierConnector reads (vllm/config).

    ``dtype``: the model's (``model_config.dtype``); ``cache_config.cache_dtype`` stays
    "auto", vLLM's default, under which the KV cache has the model's dtype: the connector
    keys chunks by it (``config_from_vllm``) and checks the registered tensors against it."""
    return SimpleNamespace(
        model_config=_ModelConfig(model, num_layers, num_kv_heads, head_size, dtype),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto", enable_prefix_caching=True),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, rank=rank),
        device_config=SimpleNamespace(device_type=device),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector",
            engine_id=engine_id,
            kv_role=kv_role,
            kv_connector_extra_config=dict(extra or {}),
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_load_failure_policy=kv_load_failure_policy,
        ),
    )

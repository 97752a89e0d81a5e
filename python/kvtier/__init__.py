"""kvtier: a tiered KV cache for LLM inference engines, from Python.

The C++ core (``kvtier._kvtier``, pybind11) gives the pieces an engine needs to talk to a
``kvtier-server``:

* layouts: :class:`ModelShape`, :class:`PagedKvLayout` (dense, or at :class:`KvStrides`),
  :class:`ChunkLayout` and the kinds :class:`DtypeKind`, :class:`KvLayoutKind` (NHD, HND,
  MLA), :class:`AttentionKind`;
* hashing: :class:`TokenHasher` (chunk hashes are ints), :func:`make_model_id`,
  :func:`salted_model_id`, :class:`ChunkKey`;
* memory: :class:`KvRegion`, the engine's paged KV cache in shared memory, whose layers
  :mod:`kvtier.views` turns into torch tensors or numpy arrays without a copy;
* the client: :class:`Connector` (a worker's, with a region, or a scheduler's, without) and
  its :class:`ConnectorOptions` / :class:`ConnectorTimeouts`.

Engine adapters live in :mod:`kvtier.integrations` (vLLM's KV connector:
``kvtier.integrations.vllm.KVTierConnector``); :mod:`kvtier.kv_events` decodes the KV events
routers read (docs/kv-events.md). docs/python.md is the guide.
"""

from ._kvtier import (
    PROTOCOL_VERSION,
    AttentionKind,
    ChunkKey,
    ChunkLayout,
    Connector,
    ConnectorOptions,
    ConnectorTimeouts,
    DtypeKind,
    HashAlgorithm,
    HealthState,
    KvLayoutKind,
    KvRegion,
    KvStrides,
    KvtierError,
    LayerBuffer,
    ModelShape,
    PagedKvLayout,
    TokenHasher,
    UsageError,
    __version__,
    dtype_bytes,
    make_model_id,
    parse_dtype_kind,
    parse_kv_layout_kind,
    salted_model_id,
)
from .views import dtype_kind_of, layer_shape, layer_strides, numpy_layers, torch_dtype, torch_layers

__all__ = [
    "PROTOCOL_VERSION",
    "AttentionKind",
    "ChunkKey",
    "ChunkLayout",
    "Connector",
    "ConnectorOptions",
    "ConnectorTimeouts",
    "DtypeKind",
    "HashAlgorithm",
    "HealthState",
    "KvLayoutKind",
    "KvRegion",
    "KvStrides",
    "KvtierError",
    "LayerBuffer",
    "ModelShape",
    "PagedKvLayout",
    "TokenHasher",
    "UsageError",
    "__version__",
    "dtype_bytes",
    "dtype_kind_of",
    "layer_shape",
    "layer_strides",
    "make_model_id",
    "numpy_layers",
    "parse_dtype_kind",
    "parse_kv_layout_kind",
    "salted_model_id",
    "torch_dtype",
    "torch_layers",
]

"""vLLM's KV connector base classes as the adapter derives from them: vLLM's own where vLLM
is importable, else the stand-ins of :mod:`kvtier.integrations._vllm_standin` (same methods,
same signatures), which the replay tests drive.

The one place that chooses between the two, so every module of the adapter sees the same
classes (:class:`KVConnectorRole` compared in one module is the enum another one passed).
"""

from __future__ import annotations

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

try:  # pragma: no cover - a vLLM with base.py may still lack metrics.py
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:
    from ._vllm_standin import KVConnectorStats

__all__ = [
    "VLLM_AVAILABLE",
    "VLLM_COMMIT",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorStats",
]

#: The vLLM commit whose KV connector interface this adapter implements.
VLLM_COMMIT = "003df2961dd8830c317a61f9745ccd557da9fa06"

"""Engine adapters over the kvtier bindings.

* :mod:`kvtier.integrations.vllm`: ``KVTierConnector``, a vLLM KV connector (V1 interface);
  its statistics are :mod:`kvtier.integrations.connector_stats` (``KVTierConnectorStats``),
  and :mod:`kvtier.integrations._vllm_standin` mirrors vLLM's base classes when vLLM is not
  importable.
* :mod:`kvtier.integrations.core`: the adapter's engine-independent logic (``SchedulerSide``,
  ``WorkerSide``, the per-step plan), usable and tested without vLLM; its parts are the
  modules ``config``, ``plan``, ``scheduler_side``, ``worker_side``, ``kv_layouts`` and
  ``request_keys``.
"""

__all__ = ["core", "vllm"]

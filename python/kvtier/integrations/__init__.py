"""Engine adapters over the kvtier bindings.

* :mod:`kvtier.integrations.vllm`: ``KVTierConnector``, a vLLM KV connector (V1 interface).
* :mod:`kvtier.integrations.core`: the adapter's engine-independent logic (``SchedulerSide``,
  ``WorkerSide``, the per-step plan), usable and tested without vLLM.
"""

__all__ = ["core", "vllm"]

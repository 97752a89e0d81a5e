"""Engine adapters over the kvtier bindings.

* :mod:`kvtier.integrations.core`: the adapter's engine-independent logic, usable and tested
  without vLLM; a facade (the contract in its docstring) over the modules of its parts:
  ``config`` (``KVTierConfig``), ``plan`` (the per-step plan), ``scheduler_side``
  (``SchedulerSide``), ``worker_side`` (``WorkerSide``), ``kv_layouts`` (a layer tensor's
  layout) and ``request_keys`` (what names a request's chunks besides its tokens).
* :mod:`kvtier.integrations.vllm`: ``KVTierConnector``, a vLLM KV connector (V1 interface),
  over that logic; what it reads of vLLM is in ``vllm_config`` (the config) and
  ``vllm_scheduler_output`` (a step's schedule), vLLM's base classes (or the stand-in's,
  :mod:`kvtier.integrations._vllm_standin`, when vLLM is not importable) come from
  ``vllm_base``, its statistics are ``connector_stats`` (``KVTierConnectorStats``), and
  ``vllm_plugin`` registers it with vLLM.

Imports run one way: ``config``, ``plan``, ``kv_layouts``, ``request_keys`` and
``_vllm_standin`` import no module of the package; ``vllm_base`` imports only the stand-in;
the sides, ``vllm_config``, ``vllm_scheduler_output`` and ``connector_stats`` import only
those; ``core`` and ``vllm`` import their parts, and nothing in the package imports them
(``vllm_plugin`` names the connector's module as a string). tests/python/test_integrations_layout.py
holds the table; docs/python.md has the module map.
"""

__all__ = ["core", "vllm"]

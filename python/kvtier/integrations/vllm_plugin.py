"""kvtier's vLLM plugin: registers :class:`~kvtier.integrations.vllm.KVTierConnector` with
vLLM's KV connector factory, so that

    --kv-transfer-config '{"kv_connector": "KVTierConnector", "kv_role": "kv_both", ...}'

works without ``kv_connector_module_path``.

The installed package declares :func:`register` as the ``kvtier`` entry point of the group
``vllm.general_plugins`` (pyproject.toml). vLLM's ``load_general_plugins``
(vllm/plugins/__init__.py) calls every such function once in each process it starts (the
front end, the engine core, every worker), before any connector is created; with
``VLLM_PLUGINS`` set it calls only those named there. The factory
(vllm/distributed/kv_transfer/kv_connector/factory.py) keeps name -> lazy loader in
``KVConnectorFactory._registry`` and raises ``ValueError`` for a name registered twice: a
second call (a process that loads the plugins again, or a vLLM that already knows the name)
leaves the registration as it is. The registration imports nothing of the connector: vLLM
imports ``kvtier.integrations.vllm`` when a config names ``KVTierConnector``.
"""

from __future__ import annotations

import logging

__all__ = ["CONNECTOR_NAME", "CONNECTOR_MODULE", "register"]

#: The name a vLLM config gives in ``kv_connector``, and where the class is.
CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm"

log = logging.getLogger("kvtier")


def register() -> None:
    """Registers ``KVTierConnector`` with vLLM's ``KVConnectorFactory``; does nothing when
    vLLM (or its factory) is not importable or the name is registered already."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError as e:  # a factory without _registry that has the name: vLLM's duplicate error
        log.debug("kvtier: %s is registered with vLLM already (%s)", CONNECTOR_NAME, e)

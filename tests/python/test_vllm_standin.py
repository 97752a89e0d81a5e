"""The stand-in of vLLM's KV connector base classes (kvtier.integrations._vllm_standin) against
vLLM's own, transcribed below from vllm/distributed/kv_transfer/kv_connector/v1/base.py and
.../v1/metrics.py at the pinned commit (kvtier.integrations.vllm.VLLM_COMMIT): every method,
property and classmethod with its parameters and defaults, and which are abstract. A drift of
the stand-in (a method lost, a default changed) fails here; when the pinned commit moves,
transcribe the new base.py and change both."""

from __future__ import annotations

import inspect

import pytest

from kvtier.integrations import _vllm_standin as standin
from kvtier.integrations import vllm as kv_vllm

PINNED = "003df2961dd8830c317a61f9745ccd557da9fa06"

_ = inspect.Parameter.empty

# name -> (kind, parameters): kind is "method", "abstract", "property" or "classmethod";
# parameters are (name, default) in order, self/cls left out, "*kwargs" for **kwargs.
KV_CONNECTOR_BASE_V1 = {
    "__init__": ("method", [("vllm_config", _), ("role", _), ("kv_cache_config", _)]),
    "prefer_cross_layer_blocks": ("property", None),
    "supports_eagle_prefix_cache_hashing": ("property", None),
    "requires_kv_delivery": ("property", None),
    "role": ("property", None),
    "set_eagle_prefix_cache_hashing": ("method", [("enabled", _)]),
    # worker side
    "bind_connector_metadata": ("method", [("connector_metadata", _)]),
    "clear_connector_metadata": ("method", []),
    "_get_connector_metadata": ("method", []),
    "has_connector_metadata": ("method", []),
    "register_kv_caches": ("method", [("kv_caches", _)]),
    "register_cross_layers_kv_cache": ("method", [("kv_cache", _), ("attn_backend", _)]),
    "set_host_xfer_buffer_ops": ("method", [("copy_operation", _)]),
    "handle_preemptions": ("method", [("kv_connector_metadata", _)]),
    "start_load_kv": ("abstract", [("forward_context", _), ("*kwargs", _)]),
    "wait_for_layer_load": ("abstract", [("layer_name", _)]),
    "save_kv_layer": ("abstract", [("layer_name", _), ("kv_layer", _), ("attn_metadata", _), ("*kwargs", _)]),
    "wait_for_save": ("abstract", []),
    "get_finished": ("method", [("finished_req_ids", _)]),
    "get_block_ids_with_load_errors": ("method", []),
    "shutdown": ("method", []),
    "get_kv_connector_stats": ("method", []),
    "get_kv_connector_kv_cache_events": ("method", []),
    "get_handshake_metadata": ("method", []),
    "build_connector_worker_meta": ("method", []),
    # scheduler side
    "bind_gpu_block_pool": ("method", [("gpu_block_pool", _)]),
    "get_num_new_matched_tokens": ("abstract", [("request", _), ("num_computed_tokens", _)]),
    "update_state_after_alloc": ("abstract", [("request", _), ("blocks", _), ("num_external_tokens", _)]),
    "build_connector_meta": ("abstract", [("scheduler_output", _)]),
    "on_new_request": ("method", [("request", _)]),
    "update_connector_output": ("method", [("connector_output", _)]),
    "request_finished": ("method", [("request", _), ("block_ids", _)]),
    "take_events": ("method", []),
    "has_pending_push_work": ("method", []),
    "get_required_kvcache_layout": ("classmethod", [("vllm_config", _)]),
    "requires_piecewise_for_cudagraph": ("classmethod", [("extra_config", _)]),
    "get_finished_count": ("method", []),
    "build_kv_connector_stats": ("classmethod", [("data", None)]),
    "set_xfer_handshake_metadata": ("method", [("metadata", _)]),
    "set_xfer_handshake_metadata_pp_aware": ("method", [("metadata", _)]),
    "build_prom_metrics": (
        "classmethod",
        [("vllm_config", _), ("metric_types", _), ("labelnames", _), ("per_engine_labelvalues", _)],
    ),
    "reset_cache": ("method", []),
}

SUPPORTS_HMA = {"request_finished_all_groups": ("abstract", [("request", _), ("block_ids", _)])}
KV_CONNECTOR_WORKER_METADATA = {"aggregate": ("abstract", [("other", _)])}
KV_CONNECTOR_STATS = {  # metrics.py: a dataclass with one field, data
    "reset": ("method", []),
    "aggregate": ("method", [("other", _)]),
    "reduce": ("method", []),
    "is_empty": ("method", []),
}
ROLES = {"SCHEDULER": 0, "WORKER": 1}


def _members(cls) -> dict:
    """The class's own members in the table's terms."""
    out = {}
    for name, raw in vars(cls).items():
        if name.startswith("__") and (name != "__init__" or hasattr(cls, "__dataclass_fields__")):
            continue  # a dataclass's __init__ is its fields, checked apart
        if isinstance(raw, property):
            out[name] = ("property", None)
            continue
        if isinstance(raw, classmethod):
            fn, kind = raw.__func__, "classmethod"
        elif inspect.isfunction(raw):
            fn, kind = raw, "abstract" if getattr(raw, "__isabstractmethod__", False) else "method"
        else:
            continue
        params = []
        for i, p in enumerate(inspect.signature(fn).parameters.values()):
            if i == 0:
                continue  # self / cls
            params.append(("*" + p.name if p.kind == p.VAR_KEYWORD else p.name, p.default))
        out[name] = (kind, params)
    return out


@pytest.mark.parametrize(
    "cls,upstream",
    [
        (standin.KVConnectorBase_V1, KV_CONNECTOR_BASE_V1),
        (standin.SupportsHMA, SUPPORTS_HMA),
        (standin.KVConnectorWorkerMetadata, KV_CONNECTOR_WORKER_METADATA),
        (standin.KVConnectorStats, KV_CONNECTOR_STATS),
    ],
    ids=["KVConnectorBase_V1", "SupportsHMA", "KVConnectorWorkerMetadata", "KVConnectorStats"],
)
def test_the_stand_in_has_every_member_of_the_pinned_vllm_class_and_nothing_else(cls, upstream):
    assert kv_vllm.VLLM_COMMIT == PINNED, "the pinned commit moved: transcribe base.py again"
    got = _members(cls)
    assert sorted(got) == sorted(upstream)
    for name, want in upstream.items():
        assert got[name] == want, name
    abstract = {n for n, (k, _) in upstream.items() if k == "abstract"}
    assert set(getattr(cls, "__abstractmethods__", ())) == abstract


def test_the_stand_in_modules_other_names_are_vllms():
    assert {r.name: r.value for r in standin.KVConnectorRole} == ROLES
    for cls in (standin.KVConnectorMetadata, standin.KVConnectorHandshakeMetadata):
        assert not getattr(cls, "__abstractmethods__", None)  # ABCs with nothing abstract: instantiable
        cls()
    assert [f for f in standin.KVConnectorStats.__dataclass_fields__] == ["data"]
    assert standin.KVConnectorStats().data == {}

    class Hybrid(standin.SupportsHMA):
        def request_finished_all_groups(self, request, block_ids):
            return False, None

    assert standin.supports_hma(Hybrid) and standin.supports_hma(Hybrid())
    assert not standin.supports_hma(kv_vllm.KVTierConnector)


def test_the_stand_ins_defaults_answer_what_vllms_do():
    from replay.vllm_shapes import vllm_config

    class Bare(standin.KVConnectorBase_V1):
        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return standin.KVConnectorMetadata()

    cfg = vllm_config(model="m", num_layers=1, num_kv_heads=1, head_size=8, block_size=4, kv_role="kv_both")
    c = Bare(cfg, standin.KVConnectorRole.WORKER, None)
    assert c.role == standin.KVConnectorRole.WORKER
    assert c.requires_kv_delivery is True  # vLLM's default: the producer role (kv_both included)
    assert c.prefer_cross_layer_blocks is False and c.supports_eagle_prefix_cache_hashing is False
    assert c.get_finished(set()) == (None, None) and c.get_block_ids_with_load_errors() == set()
    assert c.request_finished(None, []) == (False, None) and tuple(c.take_events()) == ()
    assert c.get_kv_connector_stats() is None and Bare.build_kv_connector_stats({"x": 1}) is None
    assert c.reset_cache() is None and c.get_finished_count() is None and not c.has_pending_push_work()
    assert Bare.get_required_kvcache_layout(cfg) is None
    with pytest.raises(TypeError):
        standin.KVConnectorBase_V1.get_required_kvcache_layout(cfg)
    with pytest.raises(ValueError, match="pp_rank > 0"):
        c.set_xfer_handshake_metadata_pp_aware({(1, 0): standin.KVConnectorHandshakeMetadata()})
    with pytest.raises(TypeError):
        standin.KVConnectorBase_V1(cfg, standin.KVConnectorRole.WORKER, None)  # abstract
    cfg.kv_transfer_config = None
    with pytest.raises(ValueError, match="kv_transfer_config must be set"):
        Bare(cfg, standin.KVConnectorRole.WORKER, None)


def test_kvtier_connector_leaves_no_abstract_method_and_keeps_vllms_parameter_names():
    assert not kv_vllm.KVTierConnector.__abstractmethods__
    base = _members(standin.KVConnectorBase_V1)
    for name, (kind, params) in _members(kv_vllm.KVTierConnector).items():
        if name in base and name != "__init__":
            want_kind, want_params = base[name]
            assert kind == ("method" if want_kind == "abstract" else want_kind), name
            # vLLM passes some arguments by name: the overrides keep them, defaults included.
            assert params == want_params, name

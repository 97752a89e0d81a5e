"""The stand-in of SGLang's HiCache storage interface (kvtier.integrations._sglang_standin)
against SGLang's own, transcribed below from python/sglang/srt/mem_cache/hicache_storage.py at
the pinned commit (SGLANG_COMMIT): every method of HiCacheStorage with its parameters,
defaults and annotations (strings: upstream has ``from __future__ import annotations``),
which are abstract, and the fields of the config and extra-info dataclasses. A drift of the
stand-in (a method lost, a default changed) fails here; when the pinned commit moves,
transcribe hicache_storage.py again and change both. SGLang is not installed here: the
fallback of load_hicache_base is what runs."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

import pytest

from kvtier.integrations import _sglang_standin as standin

PINNED = "001067fffe33427bee0ed2f007fb7551a1d76b44"

_ = inspect.Parameter.empty
PK = inspect.Parameter.POSITIONAL_OR_KEYWORD
XI = "Optional[HiCacheStorageExtraInfo]"  # the extra_info parameter's annotation

# hicache_storage.py, class HiCacheStorage(ABC), lines 159-344 at PINNED.
# name -> (kind, [(parameter, kind, default, annotation)] without self, return annotation);
# kind is "method" or "abstract".
HICACHE_STORAGE = {
    "register_mem_pool_host": ("method", [("mem_pool_host", PK, _, "HostKVCache")], _),
    "register_mem_host_pool_v2": ("method", [("host_pool", PK, _, "HostKVCache"), ("host_pool_name", PK, _, _)], _),
    "batch_exists_v2": (
        "method",
        [
            ("keys", PK, _, "List[str]"),
            ("pool_transfers", PK, None, "Optional[List[PoolTransfer]]"),
            ("extra_info", PK, None, XI),
        ],
        "PoolTransferResult",
    ),
    "batch_get_v2": (
        "method",
        [("transfers", PK, _, "List[PoolTransfer]"), ("extra_info", PK, None, XI)],
        "dict[str, List[bool]]",
    ),
    "batch_set_v2": (
        "method",
        [("transfers", PK, _, "List[PoolTransfer]"), ("extra_info", PK, None, XI)],
        "dict[str, List[bool]]",
    ),
    "batch_get_v1": (
        "method",
        [("keys", PK, _, "List[str]"), ("host_indices", PK, _, "torch.Tensor"), ("extra_info", PK, None, XI)],
        "List[bool]",
    ),
    "batch_set_v1": (
        "method",
        [("keys", PK, _, "List[str]"), ("host_indices", PK, _, "torch.Tensor"), ("extra_info", PK, None, XI)],
        "List[bool]",
    ),
    "get": (
        "abstract",
        [
            ("key", PK, _, "str"),
            ("target_location", PK, None, "Optional[Any]"),
            ("target_sizes", PK, None, "Optional[Any]"),
        ],
        "torch.Tensor | None",
    ),
    "batch_get": (
        "abstract",
        [
            ("keys", PK, _, "List[str]"),
            ("target_locations", PK, None, "Optional[Any]"),
            ("target_sizes", PK, None, "Optional[Any]"),
        ],
        "List[torch.Tensor | None] | int",
    ),
    "set": (
        "abstract",
        [
            ("key", PK, _, "str"),
            ("value", PK, None, "Optional[Any]"),
            ("target_location", PK, None, "Optional[Any]"),
            ("target_sizes", PK, None, "Optional[Any]"),
        ],
        "bool",
    ),
    "batch_set": (
        "abstract",
        [
            ("keys", PK, _, "List[str]"),
            ("values", PK, None, "Optional[Any]"),
            ("target_locations", PK, None, "Optional[Any]"),
            ("target_sizes", PK, None, "Optional[Any]"),
        ],
        "bool",
    ),
    "exists": ("abstract", [("key", PK, _, "str")], "bool"),
    "batch_exists": ("method", [("keys", PK, _, "List[str]"), ("extra_info", PK, None, XI)], "int"),
    "clear": ("method", [], "None"),
    "get_stats": ("method", [], _),
}

# The dataclasses: (field, default) in declaration order; _ for none.
HICACHE_STORAGE_CONFIG = [  # lines 26-47
    ("tp_rank", _),
    ("tp_size", _),
    ("pp_rank", _),
    ("pp_size", _),
    ("attn_cp_rank", _),
    ("attn_cp_size", _),
    ("is_mla_model", _),
    ("enable_storage_metrics", _),
    ("is_page_first_layout", _),
    ("model_name", _),
    ("dp_rank", 0),
    ("dp_size", 1),
    ("tp_lcm_size", None),
    ("should_split_heads", False),
    ("extra_config", None),
]
HICACHE_STORAGE_EXTRA_INFO = [("prefix_keys", None), ("extra_info", None)]  # lines 50-53
POOL_TRANSFER = [  # lines 101-116
    ("name", _),
    ("host_indices", None),
    ("device_indices", None),
    ("keys", None),
    ("hit_policy", standin.PoolHitPolicy.ALL_PAGES),
    ("nodes_to_load", None),
    ("indices_from_pool", None),
]
POOL_NAMES = {
    "KV": "kv",
    "MAMBA": "mamba",
    "SWA": "swa",
    "INDEXER": "indexer",
    "DEEPSEEK_V4_C4": "deepseek_v4_c4",
    "DEEPSEEK_V4_C4_INDEXER": "deepseek_v4_c4_indexer",
    "DEEPSEEK_V4_C128": "deepseek_v4_c128",
    "DEEPSEEK_V4_C4_STATE": "deepseek_v4_c4_state",
    "DEEPSEEK_V4_C4_INDEXER_STATE": "deepseek_v4_c4_indexer_state",
    "DEEPSEEK_V4_C128_STATE": "deepseek_v4_c128_state",
    "DRAFT": "draft",
    "DRAFT_INDEXER": "draft_indexer",
    "DRAFT_SWA": "draft_swa",
}
POOL_HIT_POLICIES = {"ALL_PAGES": "all_pages", "TRAILING_PAGES": "trailing_pages"}


def _methods(cls) -> dict:
    out = {}
    for name, raw in vars(cls).items():
        if name.startswith("__") or not inspect.isfunction(raw):
            continue
        sig = inspect.signature(raw)
        params = [(p.name, p.kind, p.default, p.annotation) for p in list(sig.parameters.values())[1:]]
        kind = "abstract" if getattr(raw, "__isabstractmethod__", False) else "method"
        out[name] = (kind, params, sig.return_annotation)
    return out


def _fields(cls) -> list:
    return [
        (f.name, f.default if f.default is not dataclasses.MISSING else _) for f in dataclasses.fields(cls)
    ]


def test_hicache_storage_has_every_method_of_the_pinned_sglang_class_and_nothing_else():
    assert standin.SGLANG_COMMIT == PINNED, "the pinned commit moved: transcribe hicache_storage.py again"
    got = _methods(standin.HiCacheStorage)
    assert sorted(got) == sorted(HICACHE_STORAGE)
    for name, want in HICACHE_STORAGE.items():
        assert got[name] == want, name
    abstract = {n for n, (k, _p, _r) in HICACHE_STORAGE.items() if k == "abstract"}
    assert set(standin.HiCacheStorage.__abstractmethods__) == abstract


def test_the_dataclasses_have_upstreams_fields_in_order_with_its_defaults():
    assert _fields(standin.HiCacheStorageConfig) == HICACHE_STORAGE_CONFIG
    assert _fields(standin.HiCacheStorageExtraInfo) == HICACHE_STORAGE_EXTRA_INFO
    assert _fields(standin.PoolTransfer) == POOL_TRANSFER
    assert _fields(standin.PoolTransferResult) == [("kv_hit_pages", _), ("extra_pool_hit_pages", _)]
    assert {m.name: m.value for m in standin.PoolName} == POOL_NAMES
    assert {m.name: m.value for m in standin.PoolHitPolicy} == POOL_HIT_POLICIES
    assert str(standin.PoolName.KV) == "kv" and standin.PoolName.KV == "kv"
    assert standin.STORAGE_BATCH_SIZE == 128
    # the config is built by keyword in SGLang (cache_controller.py), the defaults filled in
    cfg = standin.HiCacheStorageConfig(
        tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="m",
    )
    assert (cfg.dp_rank, cfg.dp_size, cfg.extra_config) == (0, 1, None)
    assert standin.HiCacheStorageExtraInfo().prefix_keys is None  # not the old (None,) tuple


class _Store(standin.HiCacheStorage):
    """Implements the abstract methods by deferring to the base, as a careless backend would."""

    def __init__(self, present=()):
        self.present = set(present)

    def get(self, key, target_location=None, target_sizes=None):
        return super().get(key, target_location, target_sizes)

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return super().batch_get(keys, target_locations, target_sizes)

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return super().set(key, value, target_location, target_sizes)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return super().batch_set(keys, values, target_locations, target_sizes)

    def exists(self, key):
        return key in self.present


def test_unimplemented_methods_raise_rather_than_return_none():
    with pytest.raises(TypeError):
        standin.HiCacheStorage()  # abstract
    s = _Store()
    for call in (
        lambda: s.get("k"),
        lambda: s.batch_get(["k"]),
        lambda: s.set("k", 1),
        lambda: s.batch_set(["k"], [1]),
        lambda: standin.HiCacheStorage.exists(s, "k"),
        lambda: s.batch_get_v1(["k"], None),
        lambda: s.batch_set_v1(["k"], None),
        lambda: s.batch_exists_v2(["k"]),
        lambda: s.batch_get_v2([]),
        lambda: s.batch_set_v2([]),
    ):
        with pytest.raises(NotImplementedError):
            call()


def test_the_base_classes_defaults_answer_what_sglangs_do():
    s = _Store(present={"a", "b", "d"})
    assert s.batch_exists(["a", "b", "c", "d"]) == 2  # leading keys present, not a count of all
    assert s.batch_exists([]) == 0 and s.batch_exists(["a", "b"], standin.HiCacheStorageExtraInfo()) == 2
    assert s.clear() is None and s.get_stats() is None
    pool = object()
    s.register_mem_pool_host(pool)
    assert s.mem_pool_host is pool
    s.register_mem_host_pool_v2(pool, standin.PoolName.KV)
    s.register_mem_host_pool_v2("other", "indexer")
    assert s.registered_pools == {standin.PoolName.KV: pool, "indexer": "other"}
    assert standin.count_pool_hits({"kv": [True, True, False, True], "x": [True], "y": []}) == {
        "kv": 2, "x": 1, "y": 0,
    }
    r = standin.PoolTransferResult.empty()
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {})
    r.update_kv_hit_pages(3)
    r.update_kv_hit_pages(1)
    r.update_extra_pool_hit_pages({"indexer": 2})
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (3, {"indexer": 2})


def test_load_hicache_base_falls_back_to_the_stand_ins_without_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang raises ImportError
    base = standin.load_hicache_base()
    assert base == (standin.HiCacheStorage, standin.HiCacheStorageConfig, standin.HiCacheStorageExtraInfo, False)
    assert base.from_sglang is False and base.HiCacheStorage is standin.HiCacheStorage


def test_load_hicache_base_takes_sglangs_classes_when_importable(monkeypatch):
    mod = types.ModuleType("sglang.srt.mem_cache.hicache_storage")

    class HiCacheStorage:  # what the factory's issubclass check names
        pass

    class HiCacheStorageConfig:
        pass

    class HiCacheStorageExtraInfo:
        pass

    mod.HiCacheStorage, mod.HiCacheStorageConfig, mod.HiCacheStorageExtraInfo = (
        HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo,
    )
    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    base = standin.load_hicache_base()
    assert base == (HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, True)

"""A stand-in for SGLang's HiCache storage backend interface, used when SGLang is not importable.

It mirrors ``python/sglang/srt/mem_cache/hicache_storage.py`` of sgl-project/sglang at the
commit :data:`SGLANG_COMMIT`: ``STORAGE_BATCH_SIZE``, ``HiCacheStorageConfig`` and
``HiCacheStorageExtraInfo`` (same fields, order and defaults), the v2 transfer types the
base class names (``PoolName``, ``PoolHitPolicy``, ``PoolTransfer``, ``PoolTransferResult``,
``count_pool_hits``) and the abstract ``HiCacheStorage`` (every method, same parameters,
defaults and annotations; PEP 563 keeps them strings, as upstream's ``from __future__``
does). Left out: ``PrefetchTimeoutConfig``, ``SidecarPoolSpec``, ``MetadataCache`` and the
file backend ``HiCacheFile``, which no backend needs. One deliberate difference: upstream's
five abstract methods (``get``, ``batch_get``, ``set``, ``batch_set``, ``exists``) have
``pass`` bodies; here they raise ``NotImplementedError``, so a ``super()`` call cannot hand
SGLang a ``None`` (below). :func:`load_hicache_base` picks SGLang's own classes when SGLang
is importable: its factory checks ``issubclass(cls, HiCacheStorage)`` against its own class.
tests/python/test_sglang_standin.py holds the upstream signatures this file is checked
against: change both together when the pinned commit moves.

The calling contract, read at the same commit (``cc`` = ``python/sglang/srt/managers/
cache_controller.py``, ``hs`` = ``.../mem_cache/hicache_storage.py``, ``bf`` =
``.../mem_cache/storage/backend_factory.py``; line numbers at :data:`SGLANG_COMMIT`):

* Loading. ``--hicache-storage-backend dynamic`` with ``backend_name``, ``module_path`` and
  ``class_name`` in ``--hicache-storage-backend-extra-config`` (bf:99,122): the class is
  imported, must subclass ``HiCacheStorage`` (bf:29) and is built as
  ``cls(storage_config, kwargs)`` (bf:145), ``kwargs`` an empty dict (cc:593); the
  controller then calls ``register_mem_pool_host(host_pool)`` (cc:596).
  ``storage_config.extra_config`` is that whole JSON dict (``tp_lcm_size`` popped).
* Zero-copy only on request: a dynamic backend gets ``batch_get_v1`` / ``batch_set_v1``
  only when ``extra_config["interface_v1"]`` is truthy (cc:624-632); otherwise SGLang calls
  ``batch_get(keys, flat_pages)`` / ``batch_set(keys, flat_pages)`` with one flat tensor per
  page (cc:1047-1070, 1302-1307).
* Threads and batches (``STORAGE_BATCH_SIZE`` = 128 pages, hs:23). The prefetch thread
  (cc:1251) calls ``batch_exists(keys, extra_info)`` on batches of up to 128 keys and stops at
  the first batch not wholly present (cc:1235-1247); the hit count is then all-reduced (MIN)
  across the TP/CP/PP ranks (cc:1264-1272). The prefetch I/O thread (cc:1160) calls
  ``batch_get_v1(keys, host_indices, extra_info)`` per batch of up to 128 pages (cc:1082),
  ``host_indices`` being the batch's host-pool *token* slots, ``len(keys) * page_size`` of
  them; the leading ``True`` results count as hits (cc:1030-1044). The backup thread
  (cc:1337) calls ``batch_set_v1`` per batch and reads ``all(result)``; a ``False``
  abandons the rest of that write (cc:1309-1331).
* ``batch_exists`` returns an ``int``: how many keys, from the first, are present
  (hs:327-338), not a list.
* Errors. These threads catch only ``queue.Empty`` (cc:1178, 1282, 1351): an exception out
  of a backend call, or a ``None`` result (``results[i]`` / ``all(None)`` raise
  ``TypeError``), ends the thread for the life of the process, silently disabling L3; a dead
  prefetch thread also leaves the other ranks waiting in the all-reduce. A backend must
  answer failures as misses (``0``, ``[False] * n``); only an unimplemented method should
  raise (upstream's v1/v2 defaults do, hs:205-260).
* Keys are SGLang's page hashes, hex SHA-256 chained over (the previous page's hash, the
  page's token ids) from ``sglang.srt.mem_cache.utils.get_hash_str(tokens, last_hash,
  page_size=...)`` (cc:1230); they are the same on every rank, so a backend adds its own
  model/rank suffix, as ``HiCacheFile`` does: ``_{model}``, ``_{tp_rank}_{tp_size}`` unless
  MLA, ``_{pp_size}_{pp_rank}`` when PP > 1, ``_cp{rank}_{size}`` when attention CP > 1
  (hs:398-406). ``extra_info.prefix_keys``, when set, holds the hashes before the batch.
* MLA: ``is_mla_model`` (also set for DeepSeek-V4's compressed pools, cc:765) makes every
  rank but TP rank 0 skip the backup thread's writes (cc:583-587); all ranks read.
  ``is_page_first_layout`` is true for ``page_first`` only, not ``page_first_direct``
  (cc:767).
* ``host_pool.get_page_buffer_meta(indices)`` (``indices``: token slots, a multiple of
  ``page_size``) returns ``(pointers, sizes)``, per page: MHA ``layer_first``, a K and a V
  pointer per layer, each ``page_size*heads*head_dim*itemsize`` bytes; MHA ``page_first`` /
  ``page_first_direct``, one K and one V pointer, each ``layer_num`` times that (V in the
  second half of the buffer); MLA ``layer_first``, one pointer per layer of
  ``page_size*kv_cache_dim*itemsize``; MLA ``page_first`` / ``page_first_direct``, one
  pointer of ``layer_num`` times that. (``mem_cache/pool_host/mha.py`` and ``mla.py``, read at
  0047d999bb3a3ad311df5a4b6356bfb5586e0d66 and 01c0ede38cc9645488fd2847dbea8a2f6a9241d8,
  not at the pinned commit.)
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional

if TYPE_CHECKING:  # annotations only, as upstream
    import torch
    from sglang.srt.mem_cache.pool_host import HostKVCache

__all__ = [
    "SGLANG_COMMIT",
    "STORAGE_BATCH_SIZE",
    "HiCacheBase",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "count_pool_hits",
    "load_hicache_base",
]

logger = logging.getLogger("kvtier")

#: The sgl-project/sglang commit whose HiCache storage interface this file mirrors.
SGLANG_COMMIT = "001067fffe33427bee0ed2f007fb7551a1d76b44"

#: Pages per batched storage call of SGLang's cache controller.
STORAGE_BATCH_SIZE = 128


@dataclass
class HiCacheStorageConfig:
    """What SGLang tells a backend about the rank that builds it (one backend per rank,
    each in its own process)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: Optional[str]
    # attention-DP coordinate; 0 / 1 unless attention DP is on
    dp_rank: int = 0
    dp_size: int = 1
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None


@dataclass
class HiCacheStorageExtraInfo:
    """Per-call extras: the page hashes before the batch, and a free-form dict."""

    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


class PoolName(str, enum.Enum):
    """Names of the host pools a v2 transfer addresses."""

    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DEEPSEEK_V4_C4 = "deepseek_v4_c4"
    DEEPSEEK_V4_C4_INDEXER = "deepseek_v4_c4_indexer"
    DEEPSEEK_V4_C128 = "deepseek_v4_c128"
    DEEPSEEK_V4_C4_STATE = "deepseek_v4_c4_state"
    DEEPSEEK_V4_C4_INDEXER_STATE = "deepseek_v4_c4_indexer_state"
    DEEPSEEK_V4_C128_STATE = "deepseek_v4_c128_state"
    DRAFT = "draft"
    DRAFT_INDEXER = "draft_indexer"
    DRAFT_SWA = "draft_swa"

    def __str__(self) -> str:
        return self.value


class PoolHitPolicy(str, enum.Enum):
    """How ``batch_exists_v2`` counts an extra pool: every page of the KV prefix, or only
    its trailing pages."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclass
class PoolTransfer:
    """One pool's part of a v2 transfer (host indices plus keys on the storage path)."""

    name: PoolName
    host_indices: Optional[torch.Tensor] = None
    device_indices: Optional[torch.Tensor] = None
    keys: Optional[List[str]] = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    nodes_to_load: Optional[List[Any]] = None
    indices_from_pool: Optional[PoolName] = None


@dataclass
class PoolTransferResult:
    """Pages found or moved: the KV prefix, and per extra pool."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict[str, int]

    @classmethod
    def empty(cls) -> PoolTransferResult:
        return cls(0, {})

    def update_kv_hit_pages(self, kv_hit_pages: int) -> None:
        self.kv_hit_pages = max(self.kv_hit_pages, kv_hit_pages)

    def update_extra_pool_hit_pages(self, results: dict[str, int]) -> None:
        self.extra_pool_hit_pages.update(results)


def count_pool_hits(results: dict[str, List[bool]]) -> dict[str, int]:
    """Per pool, the number of leading successes."""
    return {name: (rs.index(False) if False in rs else len(rs)) for name, rs in results.items()}


class HiCacheStorage(ABC):
    """SGLang's L3 storage backend: a key-value store of KV pages keyed by page hash."""

    def register_mem_pool_host(self, mem_pool_host: HostKVCache):
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: HostKVCache, host_pool_name):
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        """The usable KV prefix and each extra pool's pages found, per its hit policy."""
        raise NotImplementedError()

    def batch_get_v2(
        self,
        transfers: List[PoolTransfer],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> dict[str, List[bool]]:
        """Read each transfer's pages into its host pool; per pool, a success per entry."""
        raise NotImplementedError()

    def batch_set_v2(
        self,
        transfers: List[PoolTransfer],
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> dict[str, List[bool]]:
        """Write each transfer's pages from its host pool; per pool, a success per entry."""
        raise NotImplementedError()

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Read the pages of ``keys`` into the host pool at ``host_indices`` (token slots,
        ``page_size`` per key); a success per key. Raises when not implemented: SGLang
        indexes the result, and a ``None`` kills its prefetch thread."""
        raise NotImplementedError()

    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        """Write the host pool's pages at ``host_indices`` under ``keys``; a success per
        key. Raises when not implemented: SGLang calls ``all()`` on the result, and a
        ``None`` kills its backup thread."""
        raise NotImplementedError()

    @abstractmethod
    def get(
        self,
        key: str,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> torch.Tensor | None:
        """The page stored under ``key`` (into ``target_location``), None if absent."""
        raise NotImplementedError()

    @abstractmethod
    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> List[torch.Tensor | None] | int:
        """The pages of ``keys``, None for each one absent."""
        raise NotImplementedError()

    @abstractmethod
    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Store ``value`` under ``key``; True on success."""
        raise NotImplementedError()

    @abstractmethod
    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        """Store ``values`` under ``keys``; True when all succeeded."""
        raise NotImplementedError()

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored."""
        raise NotImplementedError()

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many of ``keys``, from the first, are stored (``exists`` one by one)."""
        for i in range(len(keys)):
            if not self.exists(keys[i]):
                return i
        return len(keys)

    def clear(self) -> None:
        pass

    def get_stats(self):
        return None


class HiCacheBase(NamedTuple):
    """The classes a kvtier backend derives from and is handed, and where they came from."""

    HiCacheStorage: type
    HiCacheStorageConfig: type
    HiCacheStorageExtraInfo: type
    from_sglang: bool


def load_hicache_base() -> HiCacheBase:
    """SGLang's own ``HiCacheStorage``, ``HiCacheStorageConfig`` and
    ``HiCacheStorageExtraInfo`` when SGLang is importable (its factory accepts only a
    subclass of its own base), else this module's stand-ins."""
    try:
        from sglang.srt.mem_cache.hicache_storage import (
            HiCacheStorage as _Storage,
        )
        from sglang.srt.mem_cache.hicache_storage import (
            HiCacheStorageConfig as _Config,
        )
        from sglang.srt.mem_cache.hicache_storage import (
            HiCacheStorageExtraInfo as _ExtraInfo,
        )
    except ImportError:
        return HiCacheBase(HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, False)
    return HiCacheBase(_Storage, _Config, _ExtraInfo, True)

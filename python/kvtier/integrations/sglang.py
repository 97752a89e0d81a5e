"""kvtier as SGLang's HiCache L3 storage backend: :class:`KVTierStorage`.

Loaded by SGLang (docs/integration.md, "SGLang")::

    python -m sglang.launch_server ... --enable-hierarchical-cache --page-size 64 \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
          "class_name": "KVTierStorage", "interface_v1": 1, "socket_path": "/run/kvtier.sock"}'

with a kvtier-server whose ``--chunk-size`` is SGLang's ``--page-size`` (one page is one
kvtier chunk). Each rank (one process each) builds one backend: SGLang calls
``KVTierStorage(storage_config, {})`` then ``register_mem_pool_host(host_pool)``.

How a page travels: SGLang's host pool is its own pinned memory, which the server cannot map,
so each backend owns a staging :class:`~kvtier.KvRegion` (registered with the server like a
vLLM worker's): ``batch_set_v1`` gathers the pool's pages into staging blocks (one
``index_select``) and stores them, ``batch_get_v1`` retrieves into staging blocks and
scatters them into the pool's pages (one ``index_copy_``). The staging layout is the pool's
own page (:mod:`.sglang_layouts`), so every SGLang layout is a kvtier layout described by its
strides. Two areas: one for gets (SGLang's prefetch I/O thread), one for sets (its backup
thread), so neither waits for the other.

Keys (:meth:`KVTierStorage.chunk_hash`): SGLang's page key (hex SHA-256 chained over the
previous page's key and the page's tokens) gives the chunk hash (its first 128 bits; any other
string is hashed with BLAKE2b-128). The model id keeps apart what the key does not name: the
model (``model_name``), pipeline and attention-CP stages (in the model name), the KV shape and
dtype, the layout kind and the deployment's ``cache_salt``; the chunk key's world size and
rank keep TP ranks apart. MLA (every TP rank holds the same latent): world size 1, so every
rank reads the object TP rank 0 writes, and the other ranks write nothing.

Guarantees (SGLang's threads catch nothing but ``queue.Empty``: an exception or a ``None``
ends them for the life of the process):

* no method SGLang calls at run time raises or returns ``None`` where SGLang expects a
  value: a failure (server gone, hung, restarted, refusing; a malformed call) is a miss:
  ``batch_exists`` 0, ``batch_get_v1`` ``False`` from the first page that did not land,
  ``batch_set_v1`` ``False`` (SGLang abandons the rest of that write); only the v2 methods,
  which kvtier does not implement, raise (as upstream's defaults do);
* a page is reported got only if its bytes landed whole in the pool; a retrieve the connector
  gave up on may still be written by a hung server: its staging blocks are quarantined (never
  copied to the pool, never reused) until the server answers or is proven gone;
* a staging block is reused for a store only after that store ended (``wait_stores``) and its
  generation was bumped, so a late copy by a hung server is dropped, never stored under
  another key.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from .._kvtier import Connector, KvRegion
from ._sglang_standin import STORAGE_BATCH_SIZE, load_hicache_base
from .config import TIMEOUT_KEYS, KVTierConfig
from .sglang_layouts import POOL_DIMS, PoolPages, StagingLayout, page_view, pool_kind

__all__ = ["KVTierStorage", "SGLangStorageOptions", "SGLANG_KEYS", "chunk_hash"]

log = logging.getLogger("kvtier")

_BASE = load_hicache_base()

#: Keys of SGLang's extra config that belong to SGLang (not warned about).
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "tp_lcm_size", "prefetch_threshold"}
)

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def chunk_hash(key: str) -> int:
    """The 128-bit kvtier chunk hash of SGLang's page key ``key``: the first 128 bits of its
    SHA-256 (hex) digest; BLAKE2b-128 of any other string."""
    if len(key) == 64 and _HEX64.fullmatch(key):
        return int(key[:32], 16)
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest(), "big")


@dataclass
class SGLangStorageOptions:
    """KVTierStorage's options, from SGLang's ``--hicache-storage-backend-extra-config``.

    Attributes:
        socket_path: the kvtier-server's socket (default: ``$KVTIER_SOCKET``).
        model_name: names the model in chunk keys (default: SGLang's ``model_name``).
        cache_salt: a deployment-wide salt: engines with different salts share nothing.
        staging_mb: the staging region (both areas), MiB; at least one page per area, at most
            ``STORAGE_BATCH_SIZE`` pages each (a batch larger than an area moves in parts).
        ready_timeout_s: how long ``register_mem_pool_host`` waits for the server; past it the
            backend answers misses and keeps reconnecting.
        timeouts_ms: connector deadlines by name (``lookup_timeout_ms``, ...; also accepted at
            the top level of the extra config).
    """

    socket_path: str = ""
    model_name: str = ""
    cache_salt: str = ""
    staging_mb: float = 256.0
    ready_timeout_s: float = 5.0
    timeouts_ms: Dict[str, int] = field(default_factory=dict)

    @staticmethod
    def from_extra_config(extra: Optional[dict], model_name: Optional[str]) -> "SGLangStorageOptions":
        """The options of ``extra`` (SGLang's parsed extra config); ValueError for a wrong
        value; keys neither kvtier's nor SGLang's are logged as ignored."""
        extra = dict(extra or {})
        o = SGLangStorageOptions()
        o.socket_path = str(extra.pop("socket_path", "") or os.environ.get("KVTIER_SOCKET", ""))
        o.model_name = str(extra.pop("model_name", "") or model_name or "")
        o.cache_salt = str(extra.pop("cache_salt", ""))
        o.staging_mb = float(extra.pop("staging_mb", o.staging_mb))
        o.ready_timeout_s = float(extra.pop("ready_timeout_s", o.ready_timeout_s))
        timeouts = extra.pop("timeouts_ms", {}) or {}
        if not isinstance(timeouts, dict):
            raise ValueError(f"kvtier: timeouts_ms must be an object of {', '.join(TIMEOUT_KEYS)}, not {timeouts!r}")
        o.timeouts_ms = {str(k): int(v) for k, v in timeouts.items()}
        for key in TIMEOUT_KEYS:
            if key in extra:
                o.timeouts_ms[key] = int(extra.pop(key))
        unknown = sorted(k for k in extra if k not in SGLANG_KEYS)
        if unknown:
            log.warning("kvtier: SGLang backend: ignoring unknown extra config keys %s", ", ".join(unknown))
        o.validate()
        return o

    def validate(self) -> None:
        if not self.socket_path:
            raise ValueError(
                "kvtier: no kvtier-server socket: set \"socket_path\" in --hicache-storage-backend-extra-config "
                "or KVTIER_SOCKET"
            )
        if not self.model_name:
            raise ValueError("kvtier: SGLang gave no model_name: set \"model_name\" in the extra config")
        if not self.staging_mb > 0:
            raise ValueError(f"kvtier: staging_mb must be positive, not {self.staging_mb}")
        for key in self.timeouts_ms:
            if key not in TIMEOUT_KEYS:
                raise ValueError(f"kvtier: unknown timeout '{key}': use one of {', '.join(TIMEOUT_KEYS)}")


class _Area:
    """Staging blocks [first, first + count) and the lock of the thread using them."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self.lock = threading.Lock()

    def blocks(self, quarantined: Sequence[int], want: int) -> List[int]:
        bad = set(quarantined)
        return [b for b in range(self.first, self.first + self.count) if b not in bad][:want]


class KVTierStorage(_BASE.HiCacheStorage):  # type: ignore[misc, valid-type]
    """SGLang's HiCache storage backend over a kvtier-server (module docstring).

    Counters (:meth:`kvtier_stats`): pages asked, found and moved per direction, calls that
    failed (answered as misses), and the time spent copying between the pool and the staging
    region."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None) -> None:
        self.storage_config = storage_config
        self.options = SGLangStorageOptions.from_extra_config(
            getattr(storage_config, "extra_config", None), getattr(storage_config, "model_name", None)
        )
        c = storage_config
        self.mla = bool(c.is_mla_model)
        self.tp_rank, self.tp_size = int(c.tp_rank), int(c.tp_size)
        # MLA: one object per chunk for all TP ranks (rank 0 writes it).
        self.world_size, self.rank = (1, 0) if self.mla else (self.tp_size, self.tp_rank)
        name = self.options.model_name
        if int(getattr(c, "pp_size", 1) or 1) > 1:
            name += f"#pp{c.pp_rank}/{c.pp_size}"
        if int(getattr(c, "attn_cp_size", 1) or 1) > 1:
            name += f"#cp{c.attn_cp_rank}/{c.attn_cp_size}"
        self.key_model_name = name
        self.writes = not (self.mla and self.tp_rank != 0)
        self.engine_id = f"sglang-{os.getpid()}-{uuid.uuid4().hex[:12]}-tp{self.tp_rank}"
        self.pool: Any = None
        self.pages: Optional[PoolPages] = None
        self.staging: Optional[StagingLayout] = None
        self.region: Optional[KvRegion] = None
        self.scheduler: Optional[Connector] = None
        self.worker: Optional[Connector] = None
        self._stage: Any = None
        self._ids = itertools.count()
        self._get_area = self._set_area = _Area(0, 0)
        self._stats_lock = threading.Lock()
        self._stats: Dict[str, int] = dict.fromkeys(
            (
                "exists_calls",
                "exists_pages",
                "exists_hits",
                "get_pages",
                "get_hits",
                "set_pages",
                "set_stored",
                "failures",
                "copy_in_ns",
                "copy_out_ns",
            ),
            0,
        )
        self._last_warning = 0.0

    # -- set-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: described (its layout, :mod:`.sglang_layouts`), a staging region
        made for its pages, both connectors started. Raises ValueError for a pool kvtier
        cannot serve (SGLang then fails at start-up, saying why)."""
        super().register_mem_pool_host(mem_pool_host)
        if self.worker is not None:
            raise RuntimeError("kvtier: register_mem_pool_host was called twice")
        page_size = int(mem_pool_host.page_size)
        kind = pool_kind(mem_pool_host, self.mla)
        pages = page_view(mem_pool_host.kv_buffer, POOL_DIMS[kind], page_size)
        per_area = int(self.options.staging_mb * (1 << 20) // (2 * pages.page_bytes))
        per_area = max(1, min(STORAGE_BATCH_SIZE, per_area))
        staging = StagingLayout.of(pages, 2 * per_area)
        config = KVTierConfig(
            socket_path=self.options.socket_path,
            model_name=self.key_model_name,
            block_size=page_size,
            chunk_tokens=page_size,
            world_size=self.world_size,
            rank=self.rank,
            model=staging.layout.model,
            layout=staging.kind.name,
            cache_salt=self.options.cache_salt,
            ready_timeout_s=self.options.ready_timeout_s,
            timeouts_ms=dict(self.options.timeouts_ms),
            engine_id=self.engine_id,
        )
        config.validate()
        region = KvRegion.create(staging.layout, f"kvtier-sglang-tp{self.tp_rank}")
        sched_options = config.connector_options(scheduler=True)
        sched_options.model = staging.layout.model
        sched_options.layout_kind = staging.kind
        sched_options.describe_chunks = False  # SGLang's keys carry no tokens to describe
        worker_options = config.connector_options(scheduler=False)
        worker_options.describe_chunks = False
        self.pool, self.pages, self.staging, self.region = mem_pool_host, pages, staging, region
        self._stage = staging.tensor(region, pages.tensor.dtype)
        self._get_area, self._set_area = _Area(0, per_area), _Area(per_area, per_area)
        self.worker = Connector(worker_options, region)
        self.scheduler = Connector(sched_options)
        ready = self.worker.wait_ready(self.options.ready_timeout_s) and self.scheduler.wait_ready(
            self.options.ready_timeout_s
        )
        log.info(
            "kvtier: SGLang rank tp%d/%d: host pool %s %s, pages of %d tokens (%d bytes), staging %d+%d pages (%s), "
            "key world %d rank %d, model '%s'%s",
            self.tp_rank,
            self.tp_size,
            kind[0].upper(),
            kind[1],
            page_size,
            staging.page_bytes,
            per_area,
            per_area,
            staging.layout.describe(),
            self.world_size,
            self.rank,
            self.key_model_name,
            "" if ready else f"; no kvtier-server at {self.options.socket_path} yet ({self.worker.last_error})",
        )

    def close(self) -> None:
        """Closes both connectors (SGLang has no hook for it; the process's end does it too)."""
        for c in (self.scheduler, self.worker):
            if c is not None:
                c.close()

    # -- helpers -------------------------------------------------------------------------------
    def _count(self, **kw: int) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                self._stats[k] += v

    def _failed(self, what: str, err: BaseException) -> None:
        """A call answered as misses because of ``err``: counted, logged (at most every 10 s)."""
        self._count(failures=1)
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning("kvtier: SGLang %s failed, answered as misses: %s: %s", what, type(err).__name__, err)

    def _rid(self, what: str) -> str:
        return f"sgl-{what}-tp{self.tp_rank}-{next(self._ids)}"

    def _deadline_s(self, key: str) -> float:
        """The connector's deadline ``key`` (``store_timeout_ms``, ...), scaled, in seconds."""
        o = self.worker.options
        return getattr(o.timeouts, key) * max(1, o.timeout_scale) / 1000.0

    def _bound_s(self, key: str) -> float:
        """A wait's bound: the connector's own deadline for it, plus slack (the deadline ends it)."""
        return self._deadline_s(key) + 5.0

    def _ready(self) -> bool:
        return self.worker is not None and self.scheduler is not None and self.worker.healthy

    def _pages_of(self, host_indices: Any, n: int) -> Any:
        """The pool pages of ``host_indices`` (token slots, ``page_size`` per page, each page
        whole and aligned); ValueError otherwise."""
        import torch

        ps = self.pages.page_size
        idx = torch.as_tensor(host_indices).to(device="cpu", dtype=torch.int64).reshape(-1)
        if idx.numel() != n * ps:
            raise ValueError(f"{idx.numel()} host indices for {n} pages of {ps} tokens")
        rows = idx.view(n, ps)
        pages = torch.div(rows[:, 0], ps, rounding_mode="floor")
        if bool((rows != pages[:, None] * ps + torch.arange(ps)).any()):
            raise ValueError("host indices that are not whole, aligned pages")
        if n and (int(pages.min()) < 0 or int(pages.max()) >= self.pages.num_pages):
            raise ValueError(f"host pages outside the pool's {self.pages.num_pages}")
        return pages

    def _lookup(self, rid: str, hashes: List[int]) -> int:
        """Looks ``hashes`` up as request ``rid`` and waits for the answer: how many of them,
        from the first, every rank's object of is stored. The caller ends ``rid``
        (``end_request``) once done with the lookup (a retrieve copies through it)."""
        s = self.scheduler
        s.lookup_hashes(rid, hashes, "")
        s.wait_lookups([rid], self._bound_s("lookup_timeout_ms"))
        return min(len(hashes), int(s.lookup_result(rid) or 0) // self.pages.page_size)

    def _fetch(self, hashes: List[int], deliver: Callable[[Any, List[int], int], None]) -> int:
        """Loads ``hashes`` (in parts of the get area) and hands each part's landed leading
        staging blocks to ``deliver(stage, blocks, first)``; the pages landed, from the first."""
        done = 0
        area = self._get_area
        with area.lock:
            while done < len(hashes):
                if not self._ready():
                    break
                blocks = area.blocks(self.worker.quarantined_blocks(), len(hashes) - done)
                if not blocks:
                    break  # every block waits for a hung server's answer: misses meanwhile
                part = hashes[done : done + len(blocks)]
                rid = self._rid("g")
                w = self.worker
                try:
                    hit = self._lookup(rid, part)
                    landed = 0
                    if hit:
                        w.retrieve_hashes(rid, part[:hit], done, blocks[:hit], 0, "", synchronous=True)
                        w.wait_retrieves([rid], self._bound_s("retrieve_timeout_ms"))
                        errors = set(w.take_load_error_blocks())
                        landed = next((i for i, b in enumerate(blocks[:hit]) if b in errors), hit)
                        if landed:
                            t0 = time.perf_counter_ns()
                            deliver(self._stage, blocks[:landed], done)
                            self._count(copy_out_ns=time.perf_counter_ns() - t0)
                finally:
                    self.scheduler.end_request(rid)
                done += landed
                if landed < len(part):
                    break
        return done

    def _put(self, hashes: List[int], fill: Callable[[Any, List[int], int], None], first_chunk: int) -> bool:
        """Stores ``hashes`` (in parts of the set area), ``fill(stage, blocks, first)`` putting
        each part's pages into its staging blocks; True when every part was handed to a healthy
        server and its store ended in time."""
        done = 0
        area = self._set_area
        with area.lock:
            while done < len(hashes):
                if not self._ready():
                    return False
                w = self.worker
                blocks = list(range(area.first, area.first + min(area.count, len(hashes) - done)))
                if w.blocks_reused(blocks):  # never: stores quarantine nothing
                    return False
                part = hashes[done : done + len(blocks)]
                t0 = time.perf_counter_ns()
                fill(self._stage, blocks, done)
                self._count(copy_in_ns=time.perf_counter_ns() - t0)
                rid = self._rid("s")
                started = time.monotonic()
                w.store_hashes(rid, part, first_chunk + done, blocks, "")
                if not w.wait_stores([rid], self._bound_s("store_timeout_ms")) or not w.healthy:
                    return False
                if time.monotonic() - started >= self._deadline_s("store_timeout_ms"):
                    return False  # it ended at its deadline: timed out, not stored
                done += len(part)
        return True

    # -- the zero-copy page API (SGLang calls it with "interface_v1": 1) ---------------------
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (for every TP rank; their L2 copies
        start loading into the server's memory). 0 on any failure."""
        try:
            self._count(exists_calls=1, exists_pages=len(keys))
            if not keys or not self._ready():
                return 0
            hashes = [chunk_hash(k) for k in keys]
            found = 0
            for i in range(0, len(hashes), 1024):
                part = hashes[i : i + 1024]
                rid = self._rid("x")
                try:
                    n = self._lookup(rid, part)
                finally:
                    self.scheduler.end_request(rid)
                found += n
                if n < len(part):
                    break
            self._count(exists_hits=found)
            return found
        except Exception as e:  # noqa: BLE001 - SGLang's prefetch thread must never see one
            self._failed("batch_exists", e)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Loads the pages of ``keys`` into the host pool at ``host_indices``: ``True`` for
        each page that landed, from the first; ``False`` from the first that did not."""
        n = len(keys)
        try:
            self._count(get_pages=n)
            if not n:
                return []
            if not self._ready():
                return [False] * n
            pages = self._pages_of(host_indices, n)
            view = self.pages.tensor.movedim(self.pages.page_dim, 0)

            def deliver(stage: Any, blocks: List[int], first: int) -> None:
                _scatter(stage, blocks, view, pages[first : first + len(blocks)])

            got = self._fetch([chunk_hash(k) for k in keys], deliver)
            self._count(get_hits=got)
            return [True] * got + [False] * (n - got)
        except Exception as e:  # noqa: BLE001
            self._failed("batch_get_v1", e)
            return [False] * n

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Stores the host pool's pages at ``host_indices`` under ``keys``: all ``True`` once
        the server took them, all ``False`` otherwise (SGLang then abandons the write). MLA
        ranks other than TP rank 0 store nothing and answer ``True``: rank 0 stores the same
        latent for them."""
        n = len(keys)
        try:
            self._count(set_pages=n)
            if not n:
                return []
            if not self.writes:
                return [True] * n
            if not self._ready():
                return [False] * n
            pages = self._pages_of(host_indices, n)
            view = self.pages.tensor.movedim(self.pages.page_dim, 0)

            def fill(stage: Any, blocks: List[int], first: int) -> None:
                _gather(view, pages[first : first + len(blocks)], stage, blocks)

            ok = self._put([chunk_hash(k) for k in keys], fill, _prefix_len(extra_info))
            if ok:
                self._count(set_stored=n)
            return [ok] * n
        except Exception as e:  # noqa: BLE001
            self._failed("batch_set_v1", e)
            return [False] * n

    # -- the flat-page API (SGLang calls it without "interface_v1") ---------------------------
    def _flat_page(self) -> Any:
        import torch

        return torch.empty(self.pages.page_shape(), dtype=self.pages.tensor.dtype).reshape(-1)

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Any]:
        """The pages of ``keys`` as flat tensors (SGLang's ``get_data_page(..., flat=True)``
        order), written into ``target_locations`` when given; ``None`` for each page from the
        first that did not land."""
        n = len(keys)
        try:
            if not n:
                return []
            if not self._ready():
                return [None] * n
            targets = list(target_locations) if target_locations is not None else [self._flat_page() for _ in keys]
            if len(targets) != n:
                raise ValueError(f"{len(targets)} target locations for {n} keys")

            def deliver(stage: Any, blocks: List[int], first: int) -> None:
                for i, b in enumerate(blocks):
                    targets[first + i].reshape(-1).copy_(stage[b].reshape(-1))

            self._count(get_pages=n)
            got = self._fetch([chunk_hash(k) for k in keys], deliver)
            self._count(get_hits=got)
            return targets[:got] + [None] * (n - got)
        except Exception as e:  # noqa: BLE001
            self._failed("batch_get", e)
            return [None] * n

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page of ``key`` as a flat tensor (into ``target_location``), ``None`` if absent."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Stores the flat pages ``values`` under ``keys``; True once the server took them all."""
        try:
            n = len(keys)
            if not n:
                return True
            if not self.writes:
                return True
            if values is None or len(values) != n:
                raise ValueError(f"{0 if values is None else len(values)} values for {n} keys")
            if not self._ready():
                return False
            self._count(set_pages=n)
            page_numel = self._stage[0].numel()

            def fill(stage: Any, blocks: List[int], first: int) -> None:
                for i, b in enumerate(blocks):
                    v = values[first + i].reshape(-1)
                    if v.numel() != page_numel:
                        raise ValueError(f"a page of {v.numel()} elements, not {page_numel}")
                    stage[b].reshape(-1).copy_(v)

            ok = self._put([chunk_hash(k) for k in keys], fill, 0)
            if ok:
                self._count(set_stored=n)
            return ok
        except Exception as e:  # noqa: BLE001
            self._failed("batch_set", e)
            return False

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores the flat page ``value`` under ``key``."""
        return self.batch_set([key], [value] if value is not None else None)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Nothing: the kvtier-server's cache is shared by every engine; evict with the
        server's admin command (``kvtier evict``) instead."""
        log.info("kvtier: SGLang asked to clear the storage backend: kvtier's cache is shared, nothing was removed")

    def get_stats(self) -> None:
        """``None`` (upstream's default: SGLang's storage metrics then log nothing for L3);
        kvtier's counters are :meth:`kvtier_stats` and the server's Prometheus metrics."""
        return None

    def kvtier_stats(self) -> Dict[str, Any]:
        """This backend's counters, and its connectors' (``worker`` / ``scheduler``)."""
        with self._stats_lock:
            out: Dict[str, Any] = dict(self._stats)
        if self.worker is not None:
            out["worker"] = self.worker.stats()
            out["healthy"] = self.worker.healthy
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.stats()
        return out


def _prefix_len(extra_info: Any) -> int:
    prefix = getattr(extra_info, "prefix_keys", None)
    return len(prefix) if isinstance(prefix, (list, tuple)) else 0


def _contiguous_run(blocks: List[int]) -> bool:
    return bool(blocks) and blocks[-1] - blocks[0] == len(blocks) - 1


def _scatter(stage: Any, blocks: List[int], view: Any, pages: Any) -> None:
    """Staging blocks ``blocks`` into pool pages ``pages`` (``view``: the pool, pages first):
    one copy per page, each as fast as memcpy; torch's ``index_copy_`` into the pool's strided
    view is about 3x slower (bench/sglang_hicache.py)."""
    for b, p in zip(blocks, pages.tolist()):
        view[p].copy_(stage[b])


def _gather(view: Any, pages: Any, stage: Any, blocks: List[int]) -> None:
    """Pool pages ``pages`` (``view``: the pool, pages first) into staging blocks ``blocks``."""
    import torch

    if _contiguous_run(blocks):
        torch.index_select(view, 0, pages, out=stage[blocks[0] : blocks[-1] + 1])
    else:
        stage.index_copy_(0, torch.tensor(blocks, dtype=torch.int64), view.index_select(0, pages))

"""SGLang's side of a HiCache storage backend, replayed without SGLang.

* :class:`HostPool`: a stand-in of SGLang's host KV pool (``MHATokenToKVPoolHost``,
  ``MLATokenToKVPoolHost`` in ``python/sglang/srt/mem_cache/pool_host/``): ``kv_buffer`` with
  the dimensions of each layout (``layer_first``, ``page_first``, ``page_first_direct``,
  ``page_head``; MLA without ``page_head``), ``page_size``, ``get_data_page`` /
  ``set_from_flat_data_page`` / ``get_dummy_flat_data_page`` (the flat-page API) and
  ``get_page_buffer_meta`` (the pointers a zero-copy backend is given).
* :func:`page_keys`: SGLang's page keys (``get_hash_str``: SHA-256 chained over the previous
  page's hex digest and the page's token ids, 4 bytes little-endian each).
* :class:`HiCacheModel`: the TinyDecoder served through a device KV cache, a host pool and a
  storage backend as SGLang's cache controller drives it: a request's prefix is looked up
  (``batch_exists`` in batches of 128 pages, stopping at the first short batch), loaded
  (``batch_get_v1`` per batch, the leading ``True`` pages count) into the host pool and from
  there into the device cache; the rest is computed, copied to the host pool and backed up
  (``batch_set_v1`` per batch, stopping at the first batch not all ``True``).
* :func:`controller_main`: one TP rank of the controller's thread pattern in its own process
  (a prefetch thread and a backup thread over a KVTierStorage), for the fault replay of
  tests/python/test_sglang_backend.py; it reports each round as a JSON line.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
from typing import Any, List, Optional, Tuple

import torch

STORAGE_BATCH_SIZE = 128


def get_hash_str(token_ids: List[int], prior_hash: Optional[str] = None) -> str:
    """SGLang's page hash (``sglang.srt.mem_cache.hicache_storage.get_hash_str``)."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(int(t).to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def page_keys(tokens: List[int], page_size: int) -> List[str]:
    """The keys of the full pages of ``tokens``, each chained on the one before."""
    keys: List[str] = []
    prior = None
    for i in range(len(tokens) // page_size):
        prior = get_hash_str(tokens[i * page_size : (i + 1) * page_size], prior)
        keys.append(prior)
    return keys


class HostPool:
    """SGLang's host KV pool, MHA or MLA, in one of its layouts (module docstring)."""

    def __init__(
        self,
        layout: str,
        layer_num: int,
        page_num: int,
        page_size: int,
        head_num: int = 1,
        head_dim: int = 8,
        dtype: torch.dtype = torch.float32,
        mla: bool = False,
    ) -> None:
        self.layout, self.layer_num, self.page_num, self.page_size = layout, layer_num, page_num, page_size
        self.head_num, self.head_dim, self.dtype, self.mla = head_num, head_dim, dtype, mla
        self.size = page_num * page_size
        L, S, P, ps, H, D = layer_num, self.size, page_num, page_size, head_num, head_dim
        if mla:
            self.kv_cache_dim = head_dim
            dims = {
                "layer_first": (L, S, 1, D),
                "page_first": (S, L, 1, D),
                "page_first_direct": (P, L, ps, 1, D),
            }[layout]
        else:
            dims = {
                "layer_first": (2, L, S, H, D),
                "page_first": (2, S, L, H, D),
                "page_first_direct": (2, P, L, ps, H, D),
                "page_head": (2, P, H, ps, L, D),
            }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    # -- per page and layer, as (planes, page_size, heads, head_dim) (MLA: (page_size, 1, latent))
    def page_kv(self, page: int, layer: int) -> torch.Tensor:
        kv, ps = self.kv_buffer, self.page_size
        a, b = page * ps, (page + 1) * ps
        if self.mla:
            return {"layer_first": lambda: kv[layer, a:b], "page_first": lambda: kv[a:b, layer],
                    "page_first_direct": lambda: kv[page, layer]}[self.layout]()
        return {
            "layer_first": lambda: kv[:, layer, a:b],
            "page_first": lambda: kv[:, a:b, layer],
            "page_first_direct": lambda: kv[:, page, layer],
            "page_head": lambda: kv[:, page, :, :, layer].transpose(1, 2),
        }[self.layout]()

    # -- SGLang's flat-page API
    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        kv, ps, page = self.kv_buffer, self.page_size, index // self.page_size
        if self.layout == "layer_first":
            t = kv[:, index : index + ps] if self.mla else kv[:, :, index : index + ps]
        elif self.layout == "page_first":
            t = kv[index : index + ps] if self.mla else kv[:, index : index + ps]
        else:
            t = kv[page : page + 1] if self.mla else kv[:, page : page + 1]
        return t.flatten() if flat else t

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.get_data_page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.get_data_page(index, flat=False).copy_(data_page.view(self.get_data_page(index, flat=False).shape))

    # -- the zero-copy API's addresses (pool_host/mha.py, mla.py)
    def get_page_buffer_meta(self, indices: torch.Tensor) -> Tuple[List[int], List[int]]:
        ptrs: List[int] = []
        sizes: List[int] = []
        e = self.kv_buffer.element_size()
        for index in indices[:: self.page_size].tolist():
            page = index // self.page_size
            if self.mla:
                if self.layout == "layer_first":
                    for layer in range(self.layer_num):
                        ptrs.append(self.kv_buffer[layer, index].data_ptr())
                        sizes.append(self.page_size * self.kv_cache_dim * e)
                else:
                    first = self.kv_buffer[index] if self.layout == "page_first" else self.kv_buffer[page]
                    ptrs.append(first.data_ptr())
                    sizes.append(self.layer_num * self.page_size * self.kv_cache_dim * e)
            elif self.layout == "layer_first":
                for layer in range(self.layer_num):
                    for plane in range(2):
                        ptrs.append(self.kv_buffer[plane, layer, index].data_ptr())
                        sizes.append(self.page_size * self.head_num * self.head_dim * e)
            else:
                for plane in range(2):
                    first = self.kv_buffer[plane, index] if self.layout == "page_first" else self.kv_buffer[plane, page]
                    ptrs.append(first.data_ptr())
                    sizes.append(self.layer_num * self.page_size * self.head_num * self.head_dim * e)
        return ptrs, sizes


def host_indices(pages: List[int], page_size: int) -> torch.Tensor:
    """The token slots of ``pages`` (what SGLang hands a v1 call)."""
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def prefetch(storage: Any, keys: List[str], pages: List[int], page_size: int) -> int:
    """The cache controller's prefetch of ``keys`` into host ``pages``: batch_exists per batch
    of 128 until a short one, then batch_get_v1 per batch; the pages that landed, from the
    first. Raises what the backend raises, and TypeError for a result SGLang cannot use."""
    hit = 0
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i : i + STORAGE_BATCH_SIZE]
        n = storage.batch_exists(batch, None)
        if not isinstance(n, int):
            raise TypeError(f"batch_exists returned {n!r}")
        hit += n
        if n < len(batch):
            break
    got = 0
    for i in range(0, hit, STORAGE_BATCH_SIZE):
        batch = keys[i : min(hit, i + STORAGE_BATCH_SIZE)]
        results = storage.batch_get_v1(batch, host_indices(pages[i : i + len(batch)], page_size), None)
        if not isinstance(results, list) or len(results) != len(batch):
            raise TypeError(f"batch_get_v1 returned {results!r}")
        n = results.index(False) if False in results else len(results)
        got += n
        if n < len(batch):
            break
    return got


def backup(storage: Any, keys: List[str], pages: List[int], page_size: int) -> int:
    """The backup thread's write of ``keys`` from host ``pages``: batch_set_v1 per batch of
    128, stopping at the first not all True; the pages written."""
    written = 0
    for i in range(0, len(keys), STORAGE_BATCH_SIZE):
        batch = keys[i : i + STORAGE_BATCH_SIZE]
        results = storage.batch_set_v1(batch, host_indices(pages[i : i + len(batch)], page_size), None)
        if not isinstance(results, list) or len(results) != len(batch):
            raise TypeError(f"batch_set_v1 returned {results!r}")
        if not all(results):
            break
        written += len(batch)
    return written


class HiCacheModel:
    """The TinyDecoder with a device KV cache (NHD blocks of ``page_size`` tokens, block i =
    host page i), a :class:`HostPool` and a storage backend (None: no L3). One request at a
    time (module docstring)."""

    def __init__(self, model: Any, pool: HostPool, storage: Any) -> None:
        from replay.model import PagedKV  # the replay package of tests/python

        self.model, self.pool, self.storage = model, pool, storage
        ps = pool.page_size
        shape = (2, pool.page_num, ps, model.local_kv, model.head_dim)
        self.device = [torch.zeros(shape, dtype=torch.float32) for _ in range(model.layers)]
        self.caches = [PagedKV(c, "NHD", ps) for c in self.device]

    def run(self, tokens: List[int]) -> Tuple[torch.Tensor, int]:
        """The last token's logits, and the pages loaded from L3."""
        ps = self.pool.page_size
        keys = page_keys(tokens, ps)
        pages = list(range(len(keys)))
        usable = (len(tokens) - 1) // ps  # the engine computes at least the last token
        hit = 0
        if self.storage is not None and usable:
            hit = min(usable, prefetch(self.storage, keys[:usable], pages, ps))
            for p in pages[:hit]:  # host -> device (SGLang's load_to_device_per_layer)
                for layer, dev in enumerate(self.device):
                    dev[:, p].copy_(self.pool.page_kv(p, layer))
        table = list(range(self.pool.page_num))
        logits = self.model.forward(tokens, hit * ps, len(tokens), table, self.caches)
        if self.storage is not None and len(keys) > hit:
            new = pages[hit:]
            for p in new:  # device -> host (SGLang's backup_from_device_all_layer)
                for layer, dev in enumerate(self.device):
                    self.pool.page_kv(p, layer).copy_(dev[:, p])
            backup(self.storage, keys[hit:], new, ps)
        return logits, hit


# -- the controller replay, one TP rank per process -----------------------------------------


def page_pattern(pool: HostPool, key: str, rank: int) -> torch.Tensor:
    """What page ``key`` holds on ``rank`` (MLA: the same on every rank), per layer as
    :meth:`HostPool.page_kv` gives it, so the same in every layout: distinct per key, rank,
    layer and element, exactly reproducible."""
    shape = (pool.layer_num, *pool.page_kv(0, 0).shape)
    n = 1
    for x in shape:
        n *= x
    base = int(key[:6], 16) % 4093 + (0 if pool.mla else 5000 * rank)
    return (torch.arange(n, dtype=torch.float32) * 0.25 + base).to(pool.dtype).view(shape)


def write_pattern(pool: HostPool, page: int, key: str, rank: int) -> None:
    for layer, rows in enumerate(page_pattern(pool, key, rank)):
        pool.page_kv(page, layer).copy_(rows)


def has_pattern(pool: HostPool, page: int, key: str, rank: int) -> bool:
    want = page_pattern(pool, key, rank)
    return all(torch.equal(pool.page_kv(page, layer), rows) for layer, rows in enumerate(want))


def controller_main(argv: List[str]) -> int:
    """``controller_main([spec_json])``: a prefetch thread and a backup thread over one
    KVTierStorage until the stop file appears; one JSON line per round on stdout: round,
    pages asked, hit, pages whose bytes were wrong, written, errors (exceptions, bad results)."""
    spec = json.loads(argv[0])
    sys.path.insert(0, spec["build_python"])
    from kvtier.integrations._sglang_standin import HiCacheStorageConfig
    from kvtier.integrations.sglang import KVTierStorage

    rank, tp = spec["rank"], spec["tp"]
    mla, ps = spec["mla"], spec["page_size"]
    cfg = HiCacheStorageConfig(
        tp_rank=rank, tp_size=tp, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=spec["layout"] == "page_first", model_name="replay-model",
        extra_config={"socket_path": spec["socket"], "interface_v1": 1, "ready_timeout_s": 10, **spec.get("extra", {})},
    )
    pages_per_prompt = spec["pages"]
    pool = HostPool(spec["layout"], 3, 2 * pages_per_prompt, ps, head_num=2, head_dim=8, mla=mla)
    storage = KVTierStorage(cfg, {})
    storage.register_mem_pool_host(pool)
    prompts = [[(p * 7919 + i * 31 + 3) % 50000 for i in range(pages_per_prompt * ps)] for p in range(spec["prompts"])]
    area_a = list(range(pages_per_prompt))  # the prefetch's pages
    area_b = list(range(pages_per_prompt, 2 * pages_per_prompt))  # the backup's pages
    jobs: "queue.Queue[Optional[List[str]]]" = queue.Queue()
    written = [0]
    errors: List[str] = []

    def backup_thread() -> None:
        while True:
            keys = jobs.get()
            try:
                if keys is None:
                    return
                written[0] += backup(storage, keys, area_b[: len(keys)], ps)
            except Exception as e:  # noqa: BLE001 - SGLang's thread would die: recorded
                errors.append(f"backup: {type(e).__name__}: {e}")
            finally:
                jobs.task_done()

    t = threading.Thread(target=backup_thread, daemon=True)
    t.start()
    rnd = 0
    stop = spec["stop_file"]
    while not os.path.exists(stop):
        tokens = prompts[rnd % len(prompts)]
        keys = page_keys(tokens, ps)
        pool.kv_buffer.fill_(-1.0)
        jobs.join()  # the backup area is free again
        wrong = hit = 0
        try:
            hit = prefetch(storage, keys, area_a, ps)
            for i in range(hit):
                if not has_pattern(pool, area_a[i], keys[i], rank):
                    wrong += 1
        except Exception as e:  # noqa: BLE001
            errors.append(f"prefetch: {type(e).__name__}: {e}")
        # "compute" the rest, then back it up from the backup area
        for i in range(hit, len(keys)):
            write_pattern(pool, area_b[i - hit], keys[i], rank)
        if hit < len(keys):
            jobs.put(keys[hit:])
        jobs.join()
        print(
            json.dumps(
                {"round": rnd, "asked": len(keys), "hit": hit, "wrong": wrong, "written": written[0],
                 "errors": list(errors), "healthy": storage.worker.healthy}
            ),
            flush=True,
        )
        rnd += 1
    jobs.put(None)
    t.join(timeout=30)
    print(json.dumps({"done": True, "stats": {k: v for k, v in storage.kvtier_stats().items() if isinstance(v, int)}}),
          flush=True)
    storage.close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(controller_main(sys.argv[1:]))

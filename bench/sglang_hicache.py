#!/usr/bin/python3
"""What the SGLang backend's staging copy costs (issue 29).

SGLang's host pool is its own pinned memory, which the server cannot map, so KVTierStorage
copies pages through a staging region (kvtier/integrations/sglang.py): batch_set_v1 gathers
the pool's pages into it (one index_select) and the server copies them into L1; batch_get_v1
is the reverse. This compares, on the same pages of an 8B-class model's host pool (one TP
rank: 32 layers, 8 KV heads of 128, bf16, pages of 64 tokens: 8 MiB a page; --layout), in
interleaved repeats:

  memcpy       glibc memcpy (ctypes.memmove) of each contiguous piece SGLang hands a
               zero-copy backend (get_page_buffer_meta) into one buffer: what moving the pages
               costs at least
  stage_in     the backend's gather of the pages into its staging blocks
  stage_out    its scatter of staging blocks into the pool's pages
  set_v1       batch_set_v1 end to end (gather, the server's copy into L1, the store's answer)
  get_v1       batch_get_v1 end to end (a lookup, the server's copy out of L1, the scatter)

  KVTIER_BUILD_DIR=build bench/sglang_hicache.py [--repeats 7] [--pages 16] [--layout page_first]

Prints RESULT lines: sglang_memcpy_gbps, sglang_stage_in_vs_memcpy, sglang_stage_out_vs_memcpy,
sglang_set_v1_vs_memcpy, sglang_get_v1_vs_memcpy, sglang_set_v1_gbps, sglang_get_v1_gbps
(medians of the per-repeat ratios). The bound of set_v1 and get_v1 is 2.0 memcpy: two copies
of the bytes, the staging one and the server's, one after the other (the store is waited for
before its staging blocks are reused).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("KVTIER_BUILD_DIR", REPO / "build")).resolve()
sys.path.insert(0, str(BUILD / "python"))
sys.path.insert(0, str(REPO / "tests" / "python"))

import torch  # noqa: E402

from kvtier.integrations._sglang_standin import HiCacheStorageConfig  # noqa: E402
from kvtier.integrations.sglang import KVTierStorage, _gather, _scatter  # noqa: E402
from kvtier_testing import wait_l1_settled  # noqa: E402
from replay.sglang import HostPool, host_indices, page_keys  # noqa: E402


def start_server(sock: Path, page_bytes: int, args) -> subprocess.Popen:
    cmd = [
        str(BUILD / "examples" / "kvtier-server"),
        "--socket", str(sock),
        "--chunk-size", str(args.page_size),
        "--l1-slot-bytes", str(page_bytes),
        "--l1-size-mb", str(max(256, 4 * args.pages * page_bytes >> 20)),
        "--log-level", "warn",
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    if not ready or not proc.stdout.readline():
        proc.kill()
        raise SystemExit("sglang_hicache: kvtier-server did not start")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--pages", type=int, default=16, help="pages per batch")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="page_first", choices=["layer_first", "page_first", "page_first_direct"])
    args = ap.parse_args()

    n = args.pages
    pool = HostPool(args.layout, args.layers, 2 * n, args.page_size, args.heads, args.head_dim, dtype=torch.bfloat16)
    pool.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, pool.kv_buffer.shape, dtype=torch.int16))
    page_bytes = pool.get_data_page(0).numel() * 2
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-sglang-bench-"))
    sock = tmp / "kvtier.sock"
    server = start_server(sock, page_bytes, args)
    try:
        wait_l1_settled(sock, who="sglang_hicache")  # no trial while the server faults its L1 in
        cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, args.layout == "page_first", "bench-8b",
                                   extra_config={"socket_path": str(sock), "staging_mb": 2 * n * page_bytes / (1 << 20)})
        storage = KVTierStorage(cfg, {})
        storage.register_mem_pool_host(pool)
        if not storage.worker.healthy:
            raise SystemExit("sglang_hicache: the backend did not connect")
        pages = list(range(n))
        idx = host_indices(pages, args.page_size)
        page_t = torch.tensor(pages, dtype=torch.int64)
        view = storage.pages.tensor.movedim(storage.pages.page_dim, 0)
        stage = storage._stage
        blocks = list(range(storage._set_area.first, storage._set_area.first + n))
        ptrs, sizes = pool.get_page_buffer_meta(idx)
        dest = torch.empty(n * page_bytes, dtype=torch.uint8)
        dptr = dest.data_ptr()

        def memcpy() -> None:
            off = 0
            for p, s in zip(ptrs, sizes):
                ctypes.memmove(dptr + off, p, s)
                off += s

        def stage_in() -> None:
            _gather(view, page_t, stage, blocks)

        def stage_out() -> None:
            _scatter(stage, blocks, view, page_t)

        rnd = [0]

        def set_v1() -> None:
            keys = page_keys([rnd[0] * 1_000_003 + i for i in range(n * args.page_size)], args.page_size)
            rnd[0] += 1
            if not all(storage.batch_set_v1(keys, idx)):
                raise SystemExit("sglang_hicache: a store failed")

        fixed = page_keys(list(range(7, 7 + n * args.page_size)), args.page_size)
        if not all(storage.batch_set_v1(fixed, idx)):
            raise SystemExit("sglang_hicache: the fixed store failed")

        def get_v1() -> None:
            if not all(storage.batch_get_v1(fixed, idx)):
                raise SystemExit("sglang_hicache: a load missed")

        cases = {"memcpy": memcpy, "stage_in": stage_in, "stage_out": stage_out, "set_v1": set_v1, "get_v1": get_v1}
        for f in cases.values():  # warm: page faults, the server's first copies
            f()
        times = {k: [] for k in cases}
        for _ in range(args.repeats):
            for name, f in cases.items():
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        total = n * page_bytes
        print(f"# {n} pages of {page_bytes >> 20} MiB ({args.layout}), {args.repeats} interleaved repeats; medians:")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"#   {name:10s} {med * 1e3:8.2f} ms  {total / med / 1e9:6.2f} GB/s  (min {min(ts) * 1e3:.2f})")

        def ratio(name: str) -> float:
            return statistics.median(a / b for a, b in zip(times[name], times["memcpy"]))

        print(f"RESULT sglang_memcpy_gbps={total / statistics.median(times['memcpy']) / 1e9:.3f}")
        for name in ("stage_in", "stage_out", "set_v1", "get_v1"):
            print(f"RESULT sglang_{name}_vs_memcpy={ratio(name):.3f}")
        for name in ("set_v1", "get_v1"):
            print(f"RESULT sglang_{name}_gbps={total / statistics.median(times[name]) / 1e9:.3f}")
        print("# bound of set_v1 / get_v1: 2.0 memcpy (the staging copy and the server's, in sequence)")
        storage.close()
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()

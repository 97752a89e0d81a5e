#!/usr/bin/python3
"""Time to first token of an L1 hit with layer-wise loading against whole-request loading.

A kvtier-server and one engine worker (a kvtier.Connector on a KvRegion, as
kvtier.integrations' WorkerSide drives it in ``load_mode="layerwise"``) run a small torch
decoder whose layers do real work on the CPU: per layer, attention of the new tokens over the
whole context, reading the context's K/V from the paged blocks the retrieve filled, then an
MLP. A long prompt is stored once; each repeat then retrieves its prefix (an L1 hit) into the
engine's blocks and computes the suffix, timed from the retrieve's issue to the logits:

  whole       the retrieve (the server copies it layer by layer and reports each layer, as
              every retrieve since protocol 5); all of it waited for before layer 0 computes
  layerwise   the same retrieve; layer l computes once layer l of every chunk
              landed (Connector.wait_layers: vLLM's wait_for_layer_load), so layer 0 computes
              while the server copies layer 1 and on

--l2: the same from an L2 (disk) hit. The server runs a disk L2 backend with
``--l2-store-policy skip_l1`` (L1 drops a chunk once the disk has it); every run uses a
prompt of its own, stored (to disk) before the repeats begin and never loaded before, so
each run's prefix comes from the disk: the engine's scheduler connection looks it up (the
server answers once the prefetch is decided, its loads in flight) and the worker retrieves
it at once, as vLLM's worker does in the step after the scheduler's lookup; the retrieve
copies each chunk as its load lands. The figures are named layerwise_l2_*; the bound is the same formula with the whole
L2 retrieve's time as the load.

Both orders alternate repeat by repeat (whole, layerwise, layerwise, whole, ...); the figures
are medians. The MLP's width is calibrated at start so that one layer's compute of the new
tokens takes about one layer's copy (the whole retrieve's time over the layer count), the
case the issue asks about; --compute-ratio changes the balance. Both modes must produce the
same logits bit for bit (checked every repeat).

  KVTIER_BUILD_DIR=build bench/layerwise_ttft.py [--repeats 9] [--layers 16] [--l2] ...

Prints RESULT lines: layerwise_ttft_s, whole_ttft_s, layerwise_ttft_vs_whole (the median of
the per-repeat ratios), whole_load_s (the whole retrieve alone), layer_compute_s (one layer's
compute), layerwise_bound_vs_whole (what perfect overlap would give:
(max(load, compute) + min(load, compute) / layers) / (load + compute)); then, for
save_kv_layer, store_issue_us (what the engine's step pays to issue one prompt's store:
vLLM's wait_for_save), store_complete_s (until the server finished it; the engine does not
wait) and store_issue_vs_step (the issue over the whole-mode step): a store issued per layer
could save the step at most that share.
"""

from __future__ import annotations

import argparse
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

import kvtier  # noqa: E402
from kvtier_testing import status, wait_l1_settled  # noqa: E402


def start_server(binary: Path, sock: Path, chunk_tokens: int, slot_bytes: int, l1_mb: int, worker_threads: int,
                 extra: list[str]):
    proc = subprocess.Popen(
        [
            str(binary),
            "--socket",
            str(sock),
            "--chunk-size",
            str(chunk_tokens),
            "--l1-slot-bytes",
            str(slot_bytes),
            "--l1-size-mb",
            str(l1_mb),
            "--worker-threads",
            str(worker_threads),
            "--log-level",
            "warn",
            *extra,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    if not ready or not proc.stdout.readline():
        proc.kill()
        raise SystemExit("layerwise_ttft: kvtier-server did not start")
    return proc


class Model:
    """Per layer: Q of the new tokens, attention over the whole context (its K/V read from the
    paged blocks), an output projection and a SiLU MLP of width `mlp`."""

    def __init__(self, layers: int, heads: int, head_dim: int, mlp: int, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        hidden = heads * head_dim
        self.layers, self.heads, self.head_dim, self.hidden = layers, heads, head_dim, hidden
        s = hidden**-0.5
        self.wq = [torch.randn(hidden, hidden, generator=g) * s for _ in range(layers)]
        self.wo = [torch.randn(hidden, hidden, generator=g) * s for _ in range(layers)]
        self.w1 = [torch.randn(hidden, mlp, generator=g) * s for _ in range(layers)]
        self.w2 = [torch.randn(mlp, hidden, generator=g) * mlp**-0.5 for _ in range(layers)]

    def layer(self, layer: int, x: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, context: int) -> torch.Tensor:
        """x: (new, hidden); kv: the layer's (2, blocks, block_size, heads, head_dim) tensor."""
        # Contiguous (heads, ctx, hd): a batched matmul over the strided view runs ~2x slower
        # on this torch, which would only add compute that no load overlaps.
        k = kv[0, table].reshape(-1, self.heads, self.head_dim)[:context].transpose(0, 1).contiguous()
        v = kv[1, table].reshape(-1, self.heads, self.head_dim)[:context].transpose(0, 1).contiguous()
        q = (x @ self.wq[layer]).view(-1, self.heads, self.head_dim).transpose(0, 1)  # (heads, new, hd)
        att = torch.softmax((q @ k.transpose(1, 2)) * self.head_dim**-0.5, dim=-1) @ v
        x = x + att.transpose(0, 1).reshape(-1, self.hidden) @ self.wo[layer]
        return x + torch.nn.functional.silu(x @ self.w1[layer]) @ self.w2[layer]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9, help="pairs of (whole, layerwise) runs (>= 5)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--prompt-chunks", type=int, default=8, help="chunks of the cached prefix")
    ap.add_argument("--new-tokens", type=int, default=1,
                    help="tokens computed after the prefix (1: a whole-prompt hit, where vLLM computes the last token)")
    ap.add_argument("--worker-threads", "--copy-threads", dest="worker_threads", type=int, default=1,
                    help="the server's worker threads")
    ap.add_argument("--compute-ratio", type=float, default=1.0, help="one layer's compute / one layer's copy")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--l2", action="store_true", help="an L2 (disk) hit instead of an L1 hit")
    ap.add_argument("--disk-dir", default=os.environ.get("KVTIER_BENCH_DIR", ""),
                    help="--l2: where the disk backend's directory goes (default: a temporary directory; not tmpfs)")
    args = ap.parse_args()
    if args.repeats < 5:
        raise SystemExit("layerwise_ttft: --repeats must be >= 5")
    torch.set_num_threads(args.threads)

    L, H, D, BS, CT = args.layers, args.kv_heads, args.head_dim, args.block_size, args.chunk_tokens
    shape = kvtier.ModelShape(L, H, D, kvtier.DtypeKind.FP32, kvtier.AttentionKind.MHA)
    chunk = kvtier.ChunkLayout(shape, CT)
    bpc = CT // BS
    nchunks = args.prompt_chunks
    context = nchunks * CT + args.new_tokens
    blocks_per_copy = -(-context // BS)
    layout = kvtier.PagedKvLayout(shape, BS, 2 * blocks_per_copy + 2, kvtier.KvLayoutKind.NHD)
    region = kvtier.KvRegion.create(layout, "kvtier-bench-layerwise")
    kv = kvtier.torch_layers(region)
    src = list(range(blocks_per_copy))
    dst = list(range(blocks_per_copy, 2 * blocks_per_copy))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in kv:
            t[:, src] = torch.randn(t[:, src].shape, generator=g) * 0.5

    server_bin = Path(os.environ.get("KVTIER_SERVER", BUILD / "examples" / "kvtier-server"))
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-layerwise-"))
    sock = tmp / "kvtier.sock"
    extra: list[str] = []
    if args.l2:
        disk = Path(tempfile.mkdtemp(prefix="kvtier-layerwise-disk-", dir=args.disk_dir or None))
        prompts = 5 + 2 * (args.repeats + 1)  # calibration, warm-up and every repeat: each its own
        cap_gb = max(1, -(-(prompts * nchunks * (chunk.object_bytes + (1 << 20))) // (1 << 30)) + 1)
        extra = ["--l2-backend", f'{{"type":"disk","path":"{disk}","capacity_gb":{cap_gb}}}',
                 "--l2-store-policy", "skip_l1", "--eviction-policy", "lru"]
    # L1: room for two prompts (L2 mode: the one loading and the one before; LRU drops the rest).
    l1_mb = max(64, (nchunks * chunk.object_bytes * 2) >> 20)
    proc = start_server(server_bin, sock, CT, chunk.object_bytes, l1_mb, args.worker_threads, extra)
    try:
        wait_l1_settled(sock, who="layerwise_ttft")  # no trial while the server faults its L1 in
        o = kvtier.ConnectorOptions()
        o.socket_path = str(sock)
        o.model_name = "bench/layerwise"
        o.chunk_tokens = CT
        o.scheduler = False
        o.engine_id = "bench-layerwise"
        conn = kvtier.Connector(o, region)
        if not conn.wait_ready(30):
            raise SystemExit(f"layerwise_ttft: the connector did not register: {conn.last_error}")
        sched = None
        if args.l2:
            # vLLM's scheduler: its own connection (same engine id), which looks the prompt up.
            so = kvtier.ConnectorOptions()
            so.socket_path = str(sock)
            so.model_name = o.model_name
            so.chunk_tokens = CT
            so.scheduler = True
            so.engine_id = o.engine_id
            so.model = shape
            sched = kvtier.Connector(so)
            if not sched.wait_ready(30):
                raise SystemExit(f"layerwise_ttft: the scheduler's connector did not register: {sched.last_error}")
        def prompt_hashes(n: int) -> list[int]:
            toks = [(i * 7919 + 104729 * n) % 50000 + 1 for i in range(context)]
            return conn.chunk_hashes(toks)[:nchunks]

        def store_and_wait(rid: str, h: list[int]) -> None:
            conn.store_hashes(rid, h, 0, src[: nchunks * bpc])
            deadline = time.monotonic() + 120
            while rid not in conn.get_finished([rid])[0]:
                if time.monotonic() > deadline:
                    raise SystemExit("layerwise_ttft: the store did not finish")
                time.sleep(0.01)

        hashes = prompt_hashes(0)
        fresh_prompts: list[list[int]] = []
        if args.l2:
            # Every run's prompt, stored now, one at a time: each waits until the disk has it
            # and L1 dropped it (skip_l1), so that each run loads its prefix from the disk.
            for n in range(1, prompts + 1):
                fresh_prompts.append(prompt_hashes(n))
                store_and_wait(f"prompt-{n}", fresh_prompts[-1])
                deadline = time.monotonic() + 120
                while True:
                    st = status(sock)
                    idle = st["store"]["inflight_tasks"] == 0 and st["store"]["pending_keys"] == 0
                    if idle and st["l1"]["objects"] == 0:
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit("layerwise_ttft: a store to disk did not drain")
                    time.sleep(0.02)
        else:
            store_and_wait("store", hashes)
        # The suffix's K/V (as the engine's earlier work would have them) sits after the
        # prefix in both block lists.
        with torch.no_grad():
            for t in kv:
                flat_src = t[:, src].reshape(2, -1, H, D)
                flat_dst = t[:, dst].reshape(2, -1, H, D)
                flat_dst[:, nchunks * CT : context] = flat_src[:, nchunks * CT : context]
                t[:, dst] = flat_dst.reshape(t[:, dst].shape)
        table = torch.tensor(dst, dtype=torch.long)
        x0 = torch.randn(args.new_tokens, H * D, generator=g)

        def load(rid: str) -> None:
            # Every retrieve reports its layers as they land (protocol 5); what differs between
            # the two modes is what the caller then does (run below). L2: a prompt never
            # loaded before, looked up (its loads start) and retrieved at once.
            if args.l2:
                h = fresh_prompts.pop(0)
                sched.lookup_hashes(rid, h)
                if not sched.wait_lookups([rid], 30) or sched.lookup_result(rid) != nchunks * CT:
                    raise SystemExit(f"layerwise_ttft: the lookup of {rid} found {sched.lookup_result(rid)} tokens")
                conn.retrieve_hashes(rid, h, 0, dst[: nchunks * bpc], 0, "", synchronous=True)
            else:
                conn.retrieve_hashes(rid, hashes, 0, dst[: nchunks * bpc], 0, "", synchronous=True)

        # Calibration: the whole retrieve's time, then an MLP width whose layer compute takes
        # that time over the layer count (times --compute-ratio).
        loads = []
        for i in range(5):
            t0 = time.perf_counter()
            load(f"cal-{i}")
            conn.wait_retrieves([f"cal-{i}"])
            loads.append(time.perf_counter() - t0)
            assert not conn.take_load_error_blocks(), "a calibration retrieve failed"
        load_s = statistics.median(loads)
        target = load_s / L * args.compute_ratio

        def layer_time(mlp: int) -> float:
            m = Model(1, H, D, mlp)
            times = []
            with torch.no_grad():
                for _ in range(5):
                    t0 = time.perf_counter()
                    m.layer(0, x0, kv[0], table, context)
                    times.append(time.perf_counter() - t0)
            return statistics.median(times)

        mlp, lo, hi = 64, 64, 64
        while layer_time(hi) < target and hi < (1 << 16):
            lo, hi = hi, hi * 2
        for _ in range(6):
            mid = (lo + hi) // 2
            if layer_time(mid) < target:
                lo = mid
            else:
                hi = mid
        mlp = hi
        model = Model(L, H, D, mlp)
        compute_s = layer_time(mlp)

        def run(rid: str, layerwise: bool):
            with torch.no_grad():
                t0 = time.perf_counter()
                load(rid)
                if not layerwise:
                    conn.wait_retrieves([rid])
                x = x0
                for layer in range(L):
                    if layerwise:
                        conn.wait_layers([rid], layer + 1)
                    x = model.layer(layer, x, kv[layer], table, context)
                conn.wait_retrieves([rid])  # the step's end: its load errors are known
                elapsed = time.perf_counter() - t0
            assert not conn.take_load_error_blocks(), f"retrieve {rid} failed"
            return elapsed, x

        run("warm-w", False)
        run("warm-l", True)
        whole, layer, ratios = [], [], []
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {}
            for lw in order:
                got[lw] = run(f"r{r}-{'l' if lw else 'w'}", lw)
            if not torch.equal(got[False][1], got[True][1]):
                raise SystemExit("layerwise_ttft: the two modes computed different outputs")
            whole.append(got[False][0])
            layer.append(got[True][0])
            ratios.append(got[True][0] / got[False][0])
        # Stores, for save_kv_layer: what the engine's step pays to issue a prompt's store
        # (wait_for_save -> WorkerSide.end_step -> store_hashes; the server copies afterwards,
        # the engine does not wait) and how long the server takes to finish it.
        issue, complete = [], []
        for r in range(0 if args.l2 else args.repeats):
            fresh = [(i * 7919 + 31 * (r + 1)) % 50000 + 1 for i in range(context)]
            rid = f"store-{r}"
            t0 = time.perf_counter()
            conn.store_hashes(rid, conn.chunk_hashes(fresh)[:nchunks], 0, src[: nchunks * bpc])
            issue.append(time.perf_counter() - t0)
            deadline = time.monotonic() + 60
            while rid not in conn.get_finished([rid])[0]:
                if time.monotonic() > deadline:
                    raise SystemExit("layerwise_ttft: a store did not finish")
                time.sleep(0.0005)
            complete.append(time.perf_counter() - t0)
        stats = conn.stats()
        conn.close()
        if sched is not None:
            sched.close()
    finally:
        proc.terminate()
        proc.wait(30)
        if args.l2:
            import shutil

            shutil.rmtree(disk, ignore_errors=True)

    w, lw, ratio = statistics.median(whole), statistics.median(layer), statistics.median(ratios)
    bound = (max(load_s, compute_s * L) + min(load_s, compute_s * L) / L) / (load_s + compute_s * L)
    print(
        f"# {L} layers, {H} KV heads x {D} fp32, {nchunks} chunks of {CT} tokens cached "
        f"({nchunks * chunk.object_bytes / 2**20:.0f} MiB), {args.new_tokens} new tokens, MLP {mlp}, "
        f"server worker threads {args.worker_threads}, torch threads {args.threads}, {args.repeats} repeats; "
        f"progress messages {stats['progress_messages']}"
    )
    print(f"# whole ttft per repeat (ms): {' '.join(f'{v * 1e3:.1f}' for v in whole)}")
    print(f"# layerwise ttft per repeat (ms): {' '.join(f'{v * 1e3:.1f}' for v in layer)}")
    if args.l2:
        print(f"RESULT layerwise_l2_whole_load_s={load_s:.6f}")
        print(f"RESULT layerwise_l2_layer_compute_s={compute_s:.6f}")
        print(f"RESULT layerwise_l2_whole_ttft_s={w:.6f}")
        print(f"RESULT layerwise_l2_ttft_s={lw:.6f}")
        print(f"RESULT layerwise_l2_ttft_vs_whole={ratio:.4f}")
        print(f"RESULT layerwise_l2_bound_vs_whole={bound:.4f}")
        return
    print(f"RESULT whole_load_s={load_s:.6f}")
    print(f"RESULT layer_compute_s={compute_s:.6f}")
    print(f"RESULT whole_ttft_s={w:.6f}")
    print(f"RESULT layerwise_ttft_s={lw:.6f}")
    print(f"RESULT layerwise_ttft_vs_whole={ratio:.4f}")
    print(f"RESULT layerwise_bound_vs_whole={bound:.4f}")
    print(f"RESULT store_issue_us={statistics.median(issue) * 1e6:.1f}")
    print(f"RESULT store_complete_s={statistics.median(complete):.6f}")
    print(f"RESULT store_issue_vs_step={statistics.median(issue) / w:.6f}")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""What publishing KV events costs the store path (issue 28).

One kvtier-server (L1 and a memory L2 backend, write-through) and one engine: a scheduler
connection that looks each request up (with KV events on, that lookup also describes the
request's chunks: its token ids) and a worker that stores every chunk, `--inflight` requests
at a time; the figure is the store throughput, chunks per second from the first lookup to the
last store finished. Three servers, started afresh for each run, in interleaved order (off, on,
stalled, off, on, ...):

  off      no kv_events
  on       kv_events on, a subscriber that reads every batch (a thread), L1 and the backend
           announced: every store is a BlockStored per tier, every eviction a BlockRemoved
  stalled  kv_events on, a subscriber connected that never reads (its receive HWM 16), send_hwm
           16: ZMQ drops what it cannot queue for it (the subscriber sees the seq jump); the
           server must not stall

  KVTIER_BUILD_DIR=build bench/kv_events_overhead.py [--repeats 7] [--requests 200] ...

Prints RESULT lines: kv_events_store_overhead (on's time over off's, the median of the
per-repeat ratios; the target is <= 1.03), kv_events_stalled_overhead (stalled over off),
kv_events_off_chunks_per_s, kv_events_on_chunks_per_s, kv_events_on_events_per_s (events the
subscriber, a process of its own, received per second of the run), kv_events_stalled_lost_batches (batches the stalled
subscriber lost, from the seq jumps it finds when it finally reads), kv_events_stalled_dropped
(events the server counted dropped: its queue full; 0 when the publisher's thread kept up).
"""

from __future__ import annotations

import argparse
import json
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

import kvtier  # noqa: E402
from kvtier_testing import status  # noqa: E402


def start_server(sock: Path, args, events: dict | None) -> subprocess.Popen:
    cmd = [
        str(BUILD / "examples" / "kvtier-server"),
        "--socket", str(sock),
        "--chunk-size", str(args.chunk_tokens),
        "--l1-slot-bytes", str(args.slot_bytes),
        "--l1-size-mb", str(args.l1_mb),
        "--l1-prefault", "off",
        "--log-level", "warn",
        "--l2-backend", json.dumps({"type": "memory", "name": "mem", "capacity_bytes": args.l2_mb << 20}),
    ]
    if events is not None:
        cmd += ["--kv-events", json.dumps(events)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    if not ready or not proc.stdout.readline():
        proc.kill()
        raise SystemExit("kv_events_overhead: kvtier-server did not start")
    return proc


# The `on` subscriber: a process of its own, as a router is (a thread here would share the
# engine's GIL). It decodes every batch and prints how many events it read once stdin closes.
READER = r"""
import select, sys
sys.path.insert(0, sys.argv[2])
from kvtier.kv_events import Subscriber
sub = Subscriber(sys.argv[1])
print("ready", flush=True)
events = 0
while True:
    got = sub.recv(20)
    if got is not None:
        events += len(got[1].events)
    elif select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.read(1):
        break
print(events, flush=True)
"""


def run_once(mode: str, args, tmp: Path, shape, prompts) -> dict:
    sock = tmp / f"{mode}.sock"
    ev = f"ipc://{tmp}/{mode}-events"
    events = None
    if mode == "on":
        events = {"endpoint": ev, "tiers": ["l1", "mem"]}
    elif mode == "stalled":
        events = {"endpoint": ev, "tiers": ["l1", "mem"], "send_hwm": 16}
    proc = start_server(sock, args, events)
    reader = stalled = None
    try:
        if mode == "on":
            reader = subprocess.Popen([sys.executable, "-c", READER, ev, str(BUILD / "python")], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            assert reader.stdout.readline().strip() == "ready"
        elif mode == "stalled":
            import zmq

            stalled = zmq.Context.instance().socket(zmq.SUB)
            stalled.setsockopt(zmq.RCVHWM, 16)  # before connecting: the pipe's size
            stalled.setsockopt(zmq.LINGER, 0)
            stalled.connect(ev)
            stalled.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.2)  # let the subscription reach the publisher
        layout = kvtier.PagedKvLayout(shape, args.block_size, args.inflight * args.chunks * args.chunk_tokens // args.block_size,
                                      kvtier.KvLayoutKind.NHD)
        region = kvtier.KvRegion.create(layout, "kvtier-bench-kv-events")
        o = kvtier.ConnectorOptions()
        o.socket_path, o.model_name, o.chunk_tokens = str(sock), "bench/model", args.chunk_tokens
        o.scheduler = False
        worker = kvtier.Connector(o, region)
        so = kvtier.ConnectorOptions()
        so.socket_path, so.model_name, so.chunk_tokens = str(sock), "bench/model", args.chunk_tokens
        so.scheduler, so.model, so.layout_kind = True, shape, kvtier.KvLayoutKind.NHD
        sched = kvtier.Connector(so)
        assert worker.wait_ready(30) and sched.wait_ready(30)
        bpr = args.chunks * args.chunk_tokens // args.block_size
        t0 = time.perf_counter()
        for first in range(0, len(prompts), args.inflight):
            batch = list(enumerate(prompts[first : first + args.inflight]))
            for i, tokens in batch:
                sched.lookup(f"r{first + i}", tokens)
            for i, tokens in batch:
                rid = f"r{first + i}"
                while sched.lookup_result(rid) is None:
                    time.sleep(0.0002)
                worker.store(rid, tokens, 0, args.chunks, list(range(i * bpr, (i + 1) * bpr)))
            pending = {f"r{first + i}" for i, _ in batch}
            while pending:
                sent, _ = worker.get_finished(list(pending))
                pending -= set(sent)
                if pending:
                    time.sleep(0.0002)
            for i, _ in batch:
                sched.end_request(f"r{first + i}")
        elapsed = time.perf_counter() - t0
        out = {"elapsed": elapsed, "chunks": len(prompts) * args.chunks}
        st = status(sock).get("kv_events") or {}
        out["dropped"] = st.get("events_dropped", 0)
        worker.close()
        sched.close()
        if reader is not None:
            time.sleep(0.3)  # what is in flight arrives
            reader.stdin.close()
            out["events"] = int(reader.stdout.readline())
            reader.wait(30)
        if stalled is not None:
            lost, last, n = 0, None, 0
            while stalled.poll(200):
                seq = int.from_bytes(stalled.recv_multipart()[1], "big", signed=True)
                n += 1
                if last is not None and seq > last + 1:
                    lost += seq - last - 1
                last = seq
            out["lost_batches"] = lost
            out["received_batches"] = n
            stalled.close()
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="rounds of (off, on, stalled), >= 5")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=4, help="chunks per request")
    ap.add_argument("--inflight", type=int, default=8, help="requests stored at a time")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--l1-mb", type=int, default=256, help="small enough to evict: removals are events too")
    ap.add_argument("--l2-mb", type=int, default=512)
    args = ap.parse_args()
    if args.repeats < 5:
        raise SystemExit("kv_events_overhead: --repeats must be >= 5")
    shape = kvtier.ModelShape(args.layers, args.kv_heads, args.head_dim, kvtier.DtypeKind.FP16, kvtier.AttentionKind.MHA)
    args.slot_bytes = kvtier.ChunkLayout(shape, args.chunk_tokens).object_bytes
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(1, 50000) for _ in range(args.chunks * args.chunk_tokens)] for _ in range(args.requests)]
    runs = {"off": [], "on": [], "stalled": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-kv-events-bench-") as d:
        for r in range(args.repeats):
            order = ["off", "on", "stalled"] if r % 2 == 0 else ["stalled", "on", "off"]
            for mode in order:
                runs[mode].append(run_once(mode, args, Path(d), shape, prompts))
            print(f"round {r + 1}: " + ", ".join(f"{m} {runs[m][-1]['elapsed']:.3f} s" for m in order), flush=True)
    ratio_on = statistics.median(a["elapsed"] / b["elapsed"] for a, b in zip(runs["on"], runs["off"]))
    ratio_stalled = statistics.median(a["elapsed"] / b["elapsed"] for a, b in zip(runs["stalled"], runs["off"]))

    def rate(mode):
        return statistics.median(x["chunks"] / x["elapsed"] for x in runs[mode])

    print(f"RESULT kv_events_store_overhead={ratio_on:.4f}")
    print(f"RESULT kv_events_stalled_overhead={ratio_stalled:.4f}")
    print(f"RESULT kv_events_off_chunks_per_s={rate('off'):.1f}")
    print(f"RESULT kv_events_on_chunks_per_s={rate('on'):.1f}")
    print(f"RESULT kv_events_on_events_per_s={statistics.median(x['events'] / x['elapsed'] for x in runs['on']):.1f}")
    print(f"RESULT kv_events_stalled_lost_batches={statistics.median(x['lost_batches'] for x in runs['stalled']):.0f}")
    print(f"RESULT kv_events_stalled_received_batches={statistics.median(x['received_batches'] for x in runs['stalled']):.0f}")
    print(f"RESULT kv_events_stalled_dropped={statistics.median(x['dropped'] for x in runs['stalled']):.0f}")


if __name__ == "__main__":
    main()

"""One engine across connections, driven the way vLLM drives it (issue 24, problems 3-5): a
scheduler-side kvtier.Connector in this process looks up, and worker-side Connectors, each in
a process of its own with its own connection, retrieve, all registered with one engine id.
The L2 is a memory backend with a bandwidth model slow enough that the loads are still
landing when the workers' retrieves arrive, and the server keeps nothing in L1 once L2 has
it (``--l2-store-policy skip_l1``): every hit comes from L2.

* a world-size-2 hit is served whole on both ranks, with 0 load errors, and the lookup's
  holds are given back once the last rank copied (L1 frees the objects it loaded);
* a 40k-token hit on an L2 slower than the connector's default retrieve_timeout is served
  whole (the retrieve's deadline follows the server's progress), and when the server stops
  mid-retrieve the chunks it reported ready are counted exactly: only the others are load
  errors, quarantined until the server runs again.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import List, Tuple

import pytest

import kvtier
from kvtier import DtypeKind, ModelShape, PagedKvLayout
from kvtier_testing import DEADLINE_S, options, wait_until

BS = 4  # tokens per block
ENGINE = "6f1c2d3e-4b5a-4978-8a9b-0c1d2e3f4a5b"


def _pattern(rank: int, block: int, layer: int, n: int) -> bytes:
    """The bytes of one block's segment (a plane of one layer) as a worker fills them."""
    seed = (rank * 7919 + block * 131 + layer * 17) & 0xFF
    return bytes((seed + i * 3) & 0xFF for i in range(n))


def _blocks_of(region: kvtier.KvRegion, block: int) -> List[bytes]:
    layout = region.layout
    seg = layout.segment_bytes
    out = []
    for layer in range(region.num_layers):
        mv = memoryview(region.layer(layer))
        for plane in range(2):
            off = layout.offset_in_layer(plane, block)
            out.append(bytes(mv[off : off + seg]))
    return out


def _fill(region: kvtier.KvRegion, rank: int, block: int) -> None:
    layout = region.layout
    seg = layout.segment_bytes
    for layer in range(region.num_layers):
        mv = memoryview(region.layer(layer))
        for plane in range(2):
            off = layout.offset_in_layer(plane, block)
            mv[off : off + seg] = _pattern(rank, block, layer * 2 + plane, seg)


def _worker_main(pipe, sock: str, rank: int, world_size: int, ct: int, shape: Tuple[int, int, int],
                 num_blocks: int, fast: bool) -> None:
    """A worker rank: its region and its own connection; runs the parent's commands. `fast`:
    the tests' short connector timeouts, else the connector's defaults."""
    region = kvtier.KvRegion.create(PagedKvLayout(ModelShape(*shape, DtypeKind.FP16), BS, num_blocks))
    o = options(sock, chunk_tokens=ct, rank=rank, world_size=world_size, scheduler=False, fast=fast)
    o.engine_id = ENGINE
    c = kvtier.Connector(o, region)
    pipe.send(("ready", c.wait_ready(DEADLINE_S), c.last_error))
    while True:
        cmd, args = pipe.recv()
        if cmd == "store":
            rid, tokens, chunks = args
            blocks = list(range(chunks * ct // BS))
            for b in blocks:
                _fill(region, rank, b)
            c.store(rid, tokens, 0, chunks, blocks)
            wait_until(lambda: rid in c.get_finished([rid])[0], what="the store")
            pipe.send(("stored", None, None))
        elif cmd == "retrieve":
            rid, tokens, first_chunk, chunks, dst_first, tell_progress = args
            bpc = ct // BS
            src = list(range(first_chunk * bpc, (first_chunk + chunks) * bpc))
            dst = list(range(dst_first, dst_first + chunks * bpc))
            start = time.monotonic()
            c.retrieve(rid, tokens, first_chunk, dst, synchronous=True)
            if tell_progress:  # the parent acts once the server reported some chunks
                wait_until(lambda: c.stats()["progress_messages"] >= tell_progress, what="progress")
                pipe.send(("progress", c.stats()["progress_messages"], None))
            done = c.wait_retrieves([rid], DEADLINE_S * 4)
            elapsed = time.monotonic() - start
            errors = sorted(c.take_load_error_blocks())
            # Every block not reported a load error holds exactly what this rank stored there.
            wrong = [
                d for s, d in zip(src, dst) if d not in errors and _blocks_of(region, d) != _blocks_of_source(region, rank, s)
            ]
            pipe.send(("retrieved", (done, errors, wrong, elapsed, c.stats(), dst), None))
        elif cmd == "quarantined":
            pipe.send(("quarantined", c.quarantined_blocks(), None))
        elif cmd == "wait_released":
            pipe.send(("released", c.wait_released(args, DEADLINE_S * 2), None))
        elif cmd == "stats":
            pipe.send(("stats", c.stats(), c.healthy))
        elif cmd == "close":
            c.close()
            pipe.send(("closed", None, None))
            return


def _blocks_of_source(region: kvtier.KvRegion, rank: int, block: int) -> List[bytes]:
    seg = region.layout.segment_bytes
    return [_pattern(rank, block, layer * 2 + plane, seg) for layer in range(region.num_layers) for plane in range(2)]


class _Worker:
    """A worker process and its pipe."""

    _ctx = None

    def __init__(self, sock, rank, world_size, ct, shape, num_blocks, fast=True):
        if _Worker._ctx is None:
            _Worker._ctx = multiprocessing.get_context("forkserver")
            _Worker._ctx.set_forkserver_preload(["kvtier"])
        self.pipe, child = _Worker._ctx.Pipe()
        self.proc = _Worker._ctx.Process(
            target=_worker_main, args=(child, str(sock), rank, world_size, ct, shape, num_blocks, fast), daemon=True
        )
        self.proc.start()
        child.close()
        kind, ok, why = self.recv()
        assert kind == "ready" and ok, why

    def send(self, cmd, args=None):
        self.pipe.send((cmd, args))

    def recv(self, timeout_s=DEADLINE_S * 4):
        assert self.pipe.poll(timeout_s), "a worker process did not answer in time"
        return self.pipe.recv()

    def call(self, cmd, args=None):
        self.send(cmd, args)
        return self.recv()

    def close(self):
        if self.proc.is_alive():
            try:
                self.call("close")
            except (AssertionError, OSError, EOFError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def _scheduler(sock, ct, shape, world_size, timeouts_fast=True):
    o = options(sock, chunk_tokens=ct, world_size=world_size, scheduler=True, fast=timeouts_fast)
    o.model = ModelShape(*shape, DtypeKind.FP16)
    o.engine_id = ENGINE
    c = kvtier.Connector(o)
    assert c.wait_ready(DEADLINE_S), c.last_error
    return c


def _slow_server(servers, ct, bytes_per_s, slot_bytes, l1_mb=16):
    return servers.start(
        chunk_tokens=ct,
        slot_bytes=slot_bytes,
        l1_mb=l1_mb,
        extra=[
            "--l2-backend",
            f'{{"type": "memory", "capacity_mb": 64, "bandwidth_gbps": {bytes_per_s / 1e9}}}',
            "--l2-store-policy",
            "skip_l1",
            "--prefetch-policy",
            "wait_complete",
        ],
    )


def _stored_in_l2(srv, objects):
    wait_until(
        lambda: (lambda st: st["backends"][0]["objects"] == objects and st["store"]["inflight_tasks"] == 0
                 and st["l1"]["objects"] == 0)(srv.status()),
        timeout_s=DEADLINE_S * 2,
        what=f"{objects} objects in L2 and none in L1",
    )


def test_a_split_engine_serves_an_l2_hit_on_every_rank_while_its_loads_land(servers):
    ct, chunks, shape = 16, 32, (2, 2, 8)  # 4 KiB objects; 64 of them across two ranks
    # 256 KiB at 200 KB/s: the loads land over about 1.3 s, long after the retrieves arrive.
    srv = _slow_server(servers, ct, 200e3, slot_bytes=4096)
    workers = [_Worker(srv.socket_path, r, 2, ct, shape, num_blocks=512) for r in range(2)]
    sched = _scheduler(srv.socket_path, ct, shape, 2)
    try:
        tokens = list(range(5000, 5000 + chunks * ct + 3))
        for w in workers:
            w.send("store", ("s", tokens, chunks))
        for w in workers:
            assert w.recv()[0] == "stored"
        _stored_in_l2(srv, 2 * chunks)
        st = srv.status()
        assert {c["engine_id"] for c in st["clients"] if c["registered"]} == {ENGINE} and st["engines"] == 1

        sched.lookup("r", tokens)
        wait_until(lambda: sched.lookup_result("r") is not None, what="the lookup's answer")
        assert sched.lookup_result("r") == chunks * ct  # decided, loads in flight
        # Both ranks retrieve the whole hit at once, each on its own connection.
        for w in workers:
            w.send("retrieve", ("r", tokens, 0, chunks, 256, 0))
        results = [w.recv()[1] for w in workers]
        for rank, (done, errors, wrong, elapsed, stats, _dst) in enumerate(results):
            assert done, f"rank {rank}: the retrieve did not complete"
            assert errors == [], f"rank {rank}: {len(errors)} load-error blocks"
            assert wrong == [], f"rank {rank}: blocks with the wrong bytes: {wrong}"
            assert stats["progress_messages"] >= 1  # chunk by chunk, as the loads landed
        # Every rank copied: the lookup holds nothing (L1 freed the objects loaded for it)
        # although the scheduler has not ended the request yet.
        wait_until(lambda: srv.status()["l1"]["objects"] == 0, what="the lookup's holds given back")
        assert srv.status()["lookups"] == 1
        sched.end_request("r")
        wait_until(lambda: srv.status()["lookups"] == 0, what="the lookup ended")
    finally:
        sched.close()
        for w in workers:
            w.close()


def _long_hit(servers, stop_midway: bool):
    """A 40960-token prompt (160 chunks of 256) on an L2 that takes about 7 s to load it,
    longer than the connector's default retrieve_timeout (5 s); default connector timeouts."""
    ct, chunks, shape = 256, 160, (2, 1, 8)  # 16 KiB objects, 2.5 MiB in all
    total = chunks * 16384
    srv = _slow_server(servers, ct, total / 7.0, slot_bytes=16384, l1_mb=8)
    worker = _Worker(srv.socket_path, 0, 1, ct, shape, num_blocks=2 * chunks * ct // BS, fast=False)
    sched = _scheduler(srv.socket_path, ct, shape, 1, timeouts_fast=False)
    tokens = list(range(1, chunks * ct + 1))
    worker.send("store", ("s", tokens, chunks))
    assert worker.recv(DEADLINE_S * 4)[0] == "stored"
    _stored_in_l2(srv, chunks)
    sched.lookup("long", tokens)
    wait_until(lambda: sched.lookup_result("long") is not None, what="the lookup's answer")
    assert sched.lookup_result("long") == chunks * ct
    worker.send("retrieve", ("long", tokens, 0, chunks, chunks * ct // BS, 2 if stop_midway else 0))
    return srv, worker, sched, chunks, ct


def test_a_40k_token_hit_on_a_slow_l2_is_served_whole_with_default_timeouts(servers):
    srv, worker, sched, chunks, ct = _long_hit(servers, stop_midway=False)
    try:
        done, errors, wrong, elapsed, stats, _ = worker.recv(DEADLINE_S * 4)[1]
        assert done
        assert errors == [], f"{len(errors)} load-error blocks"
        assert wrong == []
        # It outlived the 5 s retrieve_timeout because the server kept reporting chunks.
        print(f"RESULT split_l2_hit_40k_retrieve_s={elapsed:.2f}")
        assert stats["progress_messages"] >= 2
    finally:
        sched.close()
        worker.close()


def test_a_40k_token_hit_cut_short_by_a_stopped_server_counts_the_chunks_ready_exactly(servers):
    srv, worker, sched, chunks, ct = _long_hit(servers, stop_midway=True)
    bpc = ct // BS
    try:
        # Some chunks are in the worker's blocks (the server said so); then the server stops.
        assert worker.recv()[0] == "progress"
        srv.pause()
        done, errors, wrong, elapsed, stats, dst = worker.recv(DEADLINE_S * 4)[1]
        assert done
        assert wrong == []  # every block not reported is right: the chunks counted were final
        assert 0 < len(errors) < len(dst)
        ready = (len(dst) - len(errors)) // bpc
        assert ready >= 1
        # The load errors are exactly the blocks of the chunks past those the server reported.
        assert errors == dst[ready * bpc :]
        assert worker.call("quarantined")[1] == errors  # the stopped server may still write them
        print(f"RESULT split_l2_hit_40k_stopped_ready_chunks={ready}")
        srv.resume()
        # It answers late or reaps the connection: either proves its copies over.
        assert worker.call("wait_released", errors)[1]
    finally:
        srv.resume()
        sched.close()
        worker.close()


def test_the_vllm_adapter_registers_both_sides_with_vllms_engine_id():
    """``config_from_vllm`` takes ``kv_transfer_config.engine_id`` (vLLM makes it once per
    engine and pickles it into every process) for the scheduler and every worker; without
    it ``vllm_config.instance_id``, else empty (each connection an engine of its own)."""
    from kvtier.integrations.vllm import KVConnectorRole, config_from_vllm
    from replay.vllm_shapes import vllm_config

    def cfg(**extra):
        return vllm_config(model="m", num_layers=2, num_kv_heads=2, head_size=8, block_size=4, tp=2,
                           extra=dict({"socket_path": "/x", "chunk_tokens": 16, "rank": 1}, **extra))

    v = cfg()
    v.kv_transfer_config.engine_id = ENGINE + "_dp1"
    for role, scheduler in ((KVConnectorRole.SCHEDULER, True), (KVConnectorRole.WORKER, False)):
        c = config_from_vllm(v, role)
        assert c.engine_id == ENGINE + "_dp1"
        assert c.connector_options(scheduler).engine_id == ENGINE + "_dp1"
    v = cfg()
    v.kv_transfer_config.engine_id = None  # a vLLM without one (its KVTransferConfig makes one)
    assert config_from_vllm(v, KVConnectorRole.WORKER).engine_id == ""
    v.instance_id = "instance-7"
    assert config_from_vllm(v, KVConnectorRole.WORKER).engine_id == "instance-7"
    v = cfg(engine_id="pinned")
    v.kv_transfer_config.engine_id = "ignored"
    assert config_from_vllm(v, KVConnectorRole.WORKER).engine_id == "pinned"
    v = cfg(engine_id="e" * 129)
    with pytest.raises(ValueError, match="engine_id"):
        config_from_vllm(v, KVConnectorRole.WORKER)

"""The bound connector against a real kvtier-server: a scheduler without a region looks up
what workers stored, workers retrieve it byte for byte (NHD and HND), the finished-id
contract, the server refusing a scheduler's copies, and a layer-wise retrieve of a disk hit."""

from __future__ import annotations

import json
import sys
import threading
import time
from array import array
from collections import Counter

import pytest
import torch

import kvtier
from kvtier import DtypeKind, KvLayoutKind, ModelShape, PagedKvLayout
from kvtier_testing import finished, list_keys, options, status, wait_until

CT = 16  # chunk tokens
BS = 4  # block size
SHAPE = ModelShape(2, 2, 8, DtypeKind.FP32)  # 2 layers, 2 KV heads, head dim 8: 4 KiB objects


def worker(sock, order=KvLayoutKind.NHD, num_blocks=32, rank=0, world_size=1):
    region = kvtier.KvRegion.create(PagedKvLayout(SHAPE, BS, num_blocks, order))
    c = kvtier.Connector(options(sock, chunk_tokens=CT, rank=rank, world_size=world_size, scheduler=False), region)
    assert c.wait_ready(30), c.last_error
    return region, c


def scheduler(sock, order=KvLayoutKind.NHD, world_size=1):
    o = options(sock, chunk_tokens=CT, world_size=world_size, scheduler=True)
    o.model = SHAPE
    o.layout_kind = order
    c = kvtier.Connector(o)
    assert c.wait_ready(30), c.last_error
    return c


def lookup(sched, rid, tokens, salt=""):
    sched.lookup(rid, tokens, salt)
    wait_until(lambda: sched.lookup_result(rid) is not None, what="the lookup answer")
    return sched.lookup_result(rid)


@pytest.mark.parametrize("order", [KvLayoutKind.NHD, KvLayoutKind.HND])
def test_a_scheduler_finds_what_a_worker_stored_and_another_worker_gets_the_bytes(servers, order):
    srv = servers.start(chunk_tokens=CT)
    region_a, a = worker(srv.socket_path, order)
    region_b, b = worker(srv.socket_path, order)
    sched = scheduler(srv.socket_path, order)
    tokens = list(range(100, 100 + 3 * CT + 5))  # 3 full chunks and a tail
    ta, tb = kvtier.torch_layers(region_a), kvtier.torch_layers(region_b)
    torch.manual_seed(1)
    for t in ta:
        t.copy_(torch.randn_like(t))
    blocks_a = list(range(12))  # 3 chunks x 4 blocks
    a.store("req-a", tokens, 0, 3, blocks_a)
    finished(a, "req-a", "sending", ["req-a"])

    assert lookup(sched, "req-b", tokens) == 3 * CT
    blocks_b = [31 - i for i in range(12)]  # other blocks, reversed
    b.retrieve("req-b", tokens, 0, blocks_b, skip_tokens=0)
    seen = finished(b, "req-b", "recving")
    assert seen["recving"].count("req-b") == 1
    assert b.take_load_error_blocks() == []
    for la, lb in zip(ta, tb):
        for pa, pb in zip(blocks_a, blocks_b):
            assert torch.equal(la[:, pa], lb[:, pb])
    sched.end_request("req-b")
    # The server released the lookup.
    wait_until(lambda: srv.status()["lookups"] == 0, what="the lookup released")
    for c in (a, b, sched):
        c.close()


def test_nhd_and_hnd_engines_of_one_model_are_keyed_apart(servers):
    srv = servers.start(chunk_tokens=CT)
    _, nhd = worker(srv.socket_path, KvLayoutKind.NHD)
    tokens = list(range(2 * CT))
    nhd.store("s", tokens, 0, 2, list(range(8)))
    finished(nhd, "s", "sending", ["s"])
    assert lookup(scheduler(srv.socket_path, KvLayoutKind.NHD), "q1", tokens) == 2 * CT
    assert lookup(scheduler(srv.socket_path, KvLayoutKind.HND), "q2", tokens) == 0


def test_the_server_refuses_a_scheduler_registration_that_names_no_model(servers):
    srv = servers.start(chunk_tokens=CT)
    o = options(srv.socket_path, chunk_tokens=CT, scheduler=True)
    with pytest.raises(ValueError, match="options.model"):
        kvtier.Connector(o)


def test_cache_salts_separate_requests(servers):
    srv = servers.start(chunk_tokens=CT)
    _, w = worker(srv.socket_path)
    sched = scheduler(srv.socket_path)
    tokens = list(range(7, 7 + 2 * CT))
    w.store("s", tokens, 0, 2, list(range(8)), cache_salt="tenant-a")
    finished(w, "s", "sending", ["s"])
    assert lookup(sched, "a", tokens, "tenant-a") == 2 * CT
    assert lookup(sched, "b", tokens, "tenant-b") == 0
    assert lookup(sched, "c", tokens) == 0


def _answered(conn):
    return conn.stats()["pending_calls"] == 0


def _drain_recving(conn, polls=3):
    out = []
    for _ in range(polls):
        out += conn.get_finished([])[1]
    return out


def test_two_retrieves_in_one_step_finish_receiving_once_after_both(servers):
    srv = servers.start(chunk_tokens=CT)
    _, w = worker(srv.socket_path)
    tokens = list(range(3 * CT))
    w.store("s", tokens, 0, 3, list(range(12)))
    finished(w, "s", "sending", ["s"])
    # Both retrieves are issued while the server is stopped (for much less than the ping
    # timeout), so neither can complete before the other is issued.
    srv.pause()
    try:
        w.retrieve("r", tokens, 0, list(range(12, 16)))
        w.retrieve("r", tokens, 1, list(range(16, 24)))
        assert _drain_recving(w, 1) == []
    finally:
        srv.resume()
    wait_until(lambda: _answered(w), what="both retrieves answered")
    assert _drain_recving(w).count("r") == 1
    assert w.take_load_error_blocks() == []


def test_a_second_retrieve_of_a_request_does_not_report_it_finished_receiving_again(servers):
    """Each id is reported finished receiving exactly once (vLLM frees or reschedules a
    request on that report)."""
    srv = servers.start(chunk_tokens=CT)
    _, w = worker(srv.socket_path)
    tokens = list(range(3 * CT))
    w.store("s", tokens, 0, 3, list(range(12)))
    finished(w, "s", "sending", ["s"])
    w.retrieve("r", tokens, 0, list(range(12, 16)))
    wait_until(lambda: _answered(w), what="the first retrieve answered")
    reports = _drain_recving(w)
    w.retrieve("r", tokens, 1, list(range(16, 24)))
    wait_until(lambda: _answered(w), what="the second retrieve answered")
    reports += _drain_recving(w)
    assert reports.count("r") == 1


def test_a_layerwise_retrieve_makes_its_layers_ready_and_is_never_reported_receiving(servers):
    """retrieve(synchronous=True): the server copies layer by layer and
    says so; wait_layers / wait_retrieves block (the GIL released) until then; the request
    is never in finished_recving (vLLM asserts on a synchronous load there)."""
    srv = servers.start(chunk_tokens=CT)
    region, w = worker(srv.socket_path)
    tokens = list(range(3 * CT))
    layers = kvtier.torch_layers(region)
    torch.manual_seed(3)
    for t in layers:
        t[:, :12] = torch.randn_like(t[:, :12])
    w.store("s", tokens, 0, 3, list(range(12)))
    finished(w, "s", "sending", ["s"])
    w.retrieve("r", tokens, 0, list(range(12, 24)), synchronous=True)
    assert w.wait_layers(["r"], 1, timeout_s=30)
    assert w.wait_retrieves(["r"], timeout_s=30)
    assert w.layers_ready("r") == region.num_layers
    assert w.take_load_error_blocks() == []
    for t in layers:
        assert torch.equal(t[:, 12:24], t[:, :12])
    # Two layers, every chunk in L1: the server reported layer 1 before its answer. Progress
    # frames are coalesced, not counted out: one carrying the latest counts is queued at a
    # time, so the layers (1, 2) and leading chunks (1 to 3) come in one frame or several,
    # depending on when the I/O thread sends (seen: 2 in about 1 run of 20; this asserted
    # exactly 1).
    assert 1 <= w.stats()["progress_messages"] <= 5
    assert _drain_recving(w, 3) == []
    sending, recving = w.get_finished(["r"])
    assert sending == ["r"] and recving == []


def test_layer_waits_time_out_while_the_server_is_stopped_and_return_when_it_answers(servers):
    srv = servers.start(chunk_tokens=CT)
    _, w = worker(srv.socket_path)
    tokens = list(range(2 * CT))
    w.store("s", tokens, 0, 2, list(range(8)))
    finished(w, "s", "sending", ["s"])
    srv.pause()  # for much less than the ping timeout
    try:
        w.retrieve_hashes("r", w.chunk_hashes(tokens), 0, list(range(8, 16)), synchronous=True)
        assert w.layers_ready("r") == 0
        assert w.wait_layers(["r"], 1, timeout_s=0.2) is False
        assert w.wait_retrieves(["r"], timeout_s=0.0) is False
        assert w.wait_layers(["someone-else"], 2, timeout_s=0.0) is True
    finally:
        srv.resume()
    assert w.wait_retrieves(["r"])
    assert w.take_load_error_blocks() == []


def test_wait_progress_wakes_at_a_lookups_answer_and_times_out_with_nothing_in_flight(servers):
    # An engine with nothing to compute reads progress at the top of its step and sleeps in
    # wait_progress until the connector's next event (docs/python.md, "An idle engine's wait").
    srv = servers.start(chunk_tokens=CT)
    sched = scheduler(srv.socket_path)
    seen = sched.progress
    assert sched.wait_progress(seen, timeout_s=0.05) is False  # nothing in flight: the timeout
    assert sched.progress == seen
    sched.lookup("q", list(range(3 * CT)))
    assert sched.wait_progress(seen, timeout_s=30) is True
    assert sched.lookup_result("q") == 0  # answered (a miss) when the wait returned
    assert sched.progress != seen
    assert sched.wait_progress(seen, timeout_s=0) is True  # it moved before: at once, nothing missed

    ticks = [0]
    stop = threading.Event()

    def other_thread():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        time.sleep(0.01)
        before = ticks[0]
        assert sched.wait_progress(sched.progress, timeout_s=0.2) is False
        assert ticks[0] - before >= 5  # the wait released the GIL: the other thread ran meanwhile
    finally:
        stop.set()
        t.join()
    sched.end_request("q")
    sched.close()


def test_a_layerwise_retrieve_of_a_disk_hit_lands_every_byte_from_segmented_objects(servers, tmp_path):
    """The layer-wise L2 hit end to end (docs/performance.md, "From an L2 (disk) hit"):
    objects of 1 MiB stored on disk in 8 segments of 128 KiB (one layer each); after a
    restart, a scheduler's lookup answers once its loads are decided and a worker's
    layer-wise retrieve copies each layer as its segment is verified (or, for the chunks
    that landed before it started, layer by layer at once), reports its layers and lands
    every byte where the engine put it. Whether a chunk is still loading when the copy
    starts depends on the disk's speed: tests/cache/copy_test.cpp ("[partial]") drives the
    verified-prefix path step by step, tests/l2/disk_backend_test.cpp ("[segments]") the
    segments."""
    shape = ModelShape(8, 8, 128, DtypeKind.FP32)  # 64 KiB per token: 1 MiB objects of 16 tokens
    chunks = 16
    layout = PagedKvLayout(shape, BS, 2 * chunks * (CT // BS), KvLayoutKind.NHD)
    disk = json.dumps({"type": "disk", "name": "disk", "path": str(tmp_path / "l2"), "capacity_gb": 0.25})
    srv = servers.start(chunk_tokens=CT, slot_bytes=1 << 20, l1_mb=64,
                        extra=["--l2-backend", disk, "--prefetch-policy", "wait_complete"], name="layerwise-disk")
    region = kvtier.KvRegion.create(layout)
    w = kvtier.Connector(options(srv.socket_path, chunk_tokens=CT, scheduler=False), region)
    assert w.wait_ready(30), w.last_error
    tokens = list(range(500, 500 + chunks * CT))
    n = chunks * (CT // BS)  # blocks [0, n) hold the stored KV, [n, 2n) receive the retrieve
    layers = kvtier.torch_layers(region)
    torch.manual_seed(11)
    for t in layers:
        t[:, :n] = torch.randn_like(t[:, :n])
    w.store("s", tokens, 0, chunks, list(range(n)))
    finished(w, "s", "sending", ["s"])
    wait_until(lambda: len(list_keys(srv.socket_path, "disk")) == chunks, what="the chunks on disk")
    w.close()

    srv.terminate()  # L1 is gone; the disk keeps the objects
    srv.start()
    # One engine (vLLM's scheduler process and its worker): the worker's retrieve copies
    # through the scheduler's lookup, whose loads are in flight.
    so = _scheduler_options(srv.socket_path, shape)
    wo = options(srv.socket_path, chunk_tokens=CT, scheduler=False)
    so.engine_id = wo.engine_id = "layerwise-disk-engine"
    sched = kvtier.Connector(so)
    assert sched.wait_ready(30), sched.last_error
    w = kvtier.Connector(wo, region)
    assert w.wait_ready(30), w.last_error
    st = status(srv.socket_path)  # the hit can only come from the disk
    assert st["l1"]["objects"] == 0 and st["backends"][0]["objects"] == chunks
    assert lookup(sched, "r", tokens) == chunks * CT
    w.retrieve("r", tokens, 0, list(range(n, 2 * n)), synchronous=True)
    assert w.wait_retrieves(["r"], timeout_s=30)
    assert w.layers_ready("r") == shape.num_layers
    assert w.take_load_error_blocks() == []
    for t in layers:
        assert torch.equal(t[:, n : 2 * n], t[:, :n])
    assert w.stats()["progress_messages"] >= 1


def _scheduler_options(sock, shape):
    o = options(sock, chunk_tokens=CT, scheduler=True)
    o.model = shape
    o.layout_kind = KvLayoutKind.NHD
    return o



def test_counters_are_stats_registrations_late_replies_quarantined_blocks_and_unhealthy_ns_across_a_restart(servers):
    # What the vLLM connector samples every step (its reconnects, late replies, quarantined
    # blocks and time without a server) without stats()'s dict: the same four numbers.
    srv = servers.start(chunk_tokens=CT)
    s = scheduler(srv.socket_path)
    keys = ("registrations", "late_replies", "quarantined_blocks", "unhealthy_ns")
    try:
        st = s.stats()
        assert s.counters == tuple(st[k] for k in keys) == (1, 0, 0, 0)
        srv.restart()
        wait_until(lambda: s.counters[0] == 2, what="the scheduler registered with the new server")
        st = s.stats()
        assert s.counters == tuple(st[k] for k in keys)  # healthy: the outage's time stays put
        assert st["unhealthy_ns"] > 0  # the restart's outage (the old server's EOF to the registration)
    finally:
        s.close()


def test_a_call_that_cannot_block_keeps_the_gil(servers):
    # Releasing the GIL for a call that takes a microsecond hands it to any Python thread that
    # waits for it (vLLM's EngineCore serializes outputs in a thread of its own), and the caller
    # then waits for that thread: up to sys.getswitchinterval(), 5 ms (docs/python.md, "The
    # GIL"). Every call an engine makes per step keeps the GIL; the waits release it.
    srv = servers.start(chunk_tokens=CT)
    region, w = worker(srv.socket_path)
    sched = scheduler(srv.socket_path)
    hasher = kvtier.TokenHasher(CT)
    tokens = array("I", range(7, 7 + 2 * CT + 3))  # 2 full chunks and a tail
    hashes = hasher.chunk_hashes(tokens)
    w.store_hashes("stored", hashes, 0, list(range(8)))
    finished(w, "stored", "sending", ["stored"])
    calls = {
        "TokenHasher.chunk_hashes": lambda i: hasher.chunk_hashes(tokens),
        "chunk_hashes": lambda i: sched.chunk_hashes(tokens),
        "lookup": lambda i: sched.lookup(f"t{i}", tokens),
        "lookup_hashes": lambda i: sched.lookup_hashes(f"h{i}", hashes),
        "lookup_result": lambda i: sched.lookup_result(f"h{i}"),
        "wait_lookups(release_gil=False)": lambda i: sched.wait_lookups([f"h{i}"], 0.0, release_gil=False),
        "describes_chunks": lambda i: sched.describes_chunks,
        "free_lookup_locks": lambda i: sched.free_lookup_locks(f"t{i}"),
        "end_request": lambda i: (sched.end_request(f"t{i}"), sched.end_request(f"h{i}")),
        "counters": lambda i: sched.counters,
        "progress": lambda i: sched.progress,
        "stats": lambda i: sched.stats(),
        "state": lambda i: sched.state,
        "blocks_reused": lambda i: w.blocks_reused([16 + i % 8, 24 + i % 8]),
        "block_reused": lambda i: w.block_reused(16 + i % 8),
        "block_is_quarantined": lambda i: w.block_is_quarantined(i % 32),
        "quarantined_blocks": lambda i: w.quarantined_blocks(),
        "retrieve_hashes": lambda i: w.retrieve_hashes(f"r{i}", hashes, 0, list(range(8, 16))),
        "layers_ready": lambda i: w.layers_ready(f"r{i}"),
        "store_hashes": lambda i: w.store_hashes(f"s{i}", hashes, 0, list(range(8))),
        "get_finished": lambda i: w.get_finished([f"s{i}", f"r{i}"]),
        "take_load_error_blocks": lambda i: w.take_load_error_blocks(),
    }
    ticks = [0]
    stop = threading.Event()

    def other_thread():  # counts whenever it holds the GIL, then sleeps 0.1 ms and waits for it again
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.0001)

    interval = sys.getswitchinterval()
    # The other thread never asks for the GIL in this test: it runs only when a call releases it.
    sys.setswitchinterval(60.0)
    t = threading.Thread(target=other_thread)
    t.start()
    handed_over = Counter()
    try:
        time.sleep(0.05)  # a release: the other thread runs (the check can see one)
        seen = ticks[0]
        assert seen > 0
        for i in range(200):
            for name, call in calls.items():
                before = ticks[0]
                call(i)
                if ticks[0] != before:
                    handed_over[name] += 1
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        t.join()
    assert not handed_over, f"calls that released the GIL: {dict(handed_over)}"
    # The calls did their work: the stored chunks are found, the retrieves end without errors.
    assert lookup(sched, "final", tokens) == 2 * CT
    assert w.wait_retrieves([f"r{i}" for i in range(200)], 30)
    assert w.take_load_error_blocks() == []

"""KVTierConnector's scheduler-side semantics, called directly as vLLM's scheduler calls it
(a worker of the replay engine stores the prefix first)."""

from __future__ import annotations

import pickle
import time

import pytest

from kvtier.integrations import vllm as kv_vllm
from kvtier.integrations.core import StepPlan
from kvtier_testing import wait_until
from replay.engine import ReplayEngine
from replay.vllm_shapes import KVCacheBlocks, Request

CT = 16
BS = 4
DOC = list(range(1, 49))  # 48 tokens: 3 full chunks


@pytest.fixture
def warm(servers):
    """A server holding the 3 chunks of DOC, and an engine (TP=1, NHD) connected to it."""
    srv = servers.start(chunk_tokens=CT)
    e = ReplayEngine(socket_path=srv.socket_path, chunk_tokens=CT, block_size=BS)
    e.add("warm", DOC + [90, 91], 1)
    e.run()
    assert e.violations == []
    yield srv, e
    e.close()


def matched(conn, req, computed, polls=True):
    """get_num_new_matched_tokens until it is decided (vLLM asks again next step)."""
    if polls:
        wait_until(lambda: conn.get_num_new_matched_tokens(req, computed)[0] is not None, what="the lookup decided")
    return conn.get_num_new_matched_tokens(req, computed)


def test_the_connector_runs_on_the_stand_in_and_names_its_vllm_commit():
    assert kv_vllm.VLLM_COMMIT == "003df2961dd8830c317a61f9745ccd557da9fa06"
    assert issubclass(kv_vllm.KVTierConnector, kv_vllm.KVConnectorBase_V1)
    if not kv_vllm.VLLM_AVAILABLE:
        assert kv_vllm.KVConnectorBase_V1.__module__ == "kvtier.integrations._vllm_standin"
    # The metadata travels to the workers pickled.
    meta = kv_vllm.KVTierConnectorMetadata(StepPlan())
    assert isinstance(pickle.loads(pickle.dumps(meta)).plan, StepPlan)


def test_pending_is_none_true_and_asking_again_changes_nothing(warm):
    srv, e = warm
    conn = e.connector
    req = Request("q", DOC + [5, 6, 7], 1)
    srv.pause()  # the lookup cannot be answered
    try:
        for _ in range(5):
            assert conn.get_num_new_matched_tokens(req, 0) == (None, True)
    finally:
        srv.resume()
    got = matched(conn, req, 0)
    assert got == (48, True)
    for _ in range(5):
        assert conn.get_num_new_matched_tokens(req, 0) == (48, True)
    assert conn.scheduler_side.connector.stats()["lookups"] == 1  # one lookup, however often it was asked
    assert srv.status()["lookups"] == 1
    assert conn.scheduler_side.tracked() == 1
    conn.request_finished(req, [])
    wait_until(lambda: srv.status()["lookups"] == 0, what="the lookup ended")


def test_the_hit_excludes_the_engines_own_prefix_cache(warm):
    _, e = warm
    conn = e.connector
    req = Request("q", DOC + [5, 6, 7], 1)
    assert matched(conn, req, 0) == (48, True)
    assert conn.get_num_new_matched_tokens(req, 16) == (32, True)
    assert conn.get_num_new_matched_tokens(req, 44) == (4, True)
    assert conn.get_num_new_matched_tokens(req, 48) == (0, False)
    conn.request_finished(req, [])


def test_a_whole_prompt_hit_leaves_the_last_token_to_the_engine(warm):
    _, e = warm
    conn = e.connector
    req = Request("q", DOC, 1)  # exactly the stored 48 tokens
    assert matched(conn, req, 0) == (47, True)
    assert conn.get_num_new_matched_tokens(req, 32) == (15, True)
    conn.request_finished(req, [])


def test_a_miss_and_a_short_prompt_are_zero_and_synchronous(warm):
    _, e = warm
    conn = e.connector
    assert matched(conn, Request("miss", list(range(500, 548)), 1), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(Request("short", DOC[:10], 1), 0) == (0, False)


def test_the_load_plan_skips_the_engines_prefix_and_frees_locks_when_nothing_loads(warm):
    srv, e = warm
    conn = e.connector
    req = Request("q", DOC + [5, 6, 7], 1)
    assert matched(conn, req, 20) == (28, True)
    blocks = list(range(40, 53))  # 13 blocks: 51 tokens
    conn.update_state_after_alloc(req, KVCacheBlocks(blocks), 28)
    plan = conn.scheduler_side.build_step(kv_vllm.step_input_from(_empty_output()))
    (load,) = plan.loads
    assert load.first_chunk == 1 and load.skip_tokens == 4  # tokens 16..19 are the engine's
    assert load.block_ids == blocks[4:12] and len(load.hashes) == 2
    assert set(load.block_ids) <= set(plan.fence_blocks)
    # Called again after the load (vLLM may): no second load.
    conn.update_state_after_alloc(req, KVCacheBlocks(blocks), 0)
    assert conn.scheduler_side.build_step(kv_vllm.step_input_from(_empty_output())).loads == []
    conn.request_finished(req, [])
    # Nothing to load (all in the engine's prefix cache): the lookup's locks are freed at once.
    other = Request("p", DOC + [8], 1)
    assert matched(conn, other, 48) == (0, False)
    conn.update_state_after_alloc(other, KVCacheBlocks(list(range(13))), 0)
    wait_until(lambda: srv.status()["lookups"] == 0, what="the locks freed")
    conn.request_finished(other, [])
    assert conn.scheduler_side.tracked() == 0


def _empty_output():
    from replay.vllm_shapes import CachedRequestData, SchedulerOutput

    return SchedulerOutput([], CachedRequestData(), {}, 0, set())


def test_a_lookup_wait_answers_the_first_ask_and_a_silent_server_costs_one_budget_per_step(servers):
    # Without a wait the first ask of every request is None (vLLM skips it for a step: above);
    # lookup_wait_ms lets the ask wait for the answer, out of a budget the step's lookups share
    # and build_connector_meta refills (kvtier.integrations.scheduler_side's docstring).
    srv = servers.start(chunk_tokens=CT)
    # (Deadlines far beyond the test, so that the paused server is not found dead meanwhile.)
    extra = {"lookup_wait_ms": 500, "ping_timeout_ms": 60000, "lookup_timeout_ms": 60000}
    e = ReplayEngine(socket_path=srv.socket_path, chunk_tokens=CT, block_size=BS, extra=extra)
    e.add("warm", DOC + [90, 91], 1)
    e.run()
    assert e.violations == []
    conn = e.connector
    side = conn.scheduler_side
    hit, miss = Request("hit", DOC + [5, 6, 7], 1), Request("miss", list(range(500, 548)), 1)
    assert conn.get_num_new_matched_tokens(hit, 0) == (48, True)  # answered at the first ask
    assert conn.get_num_new_matched_tokens(miss, 0) == (0, False)
    left = side.lookup_wait_left_s
    assert 0 < left <= 0.5  # less what the two answers took
    a, b = Request("a", list(range(600, 648)), 1), Request("b", list(range(700, 748)), 1)
    srv.pause()  # answers nothing
    try:
        t0 = time.monotonic()
        assert conn.get_num_new_matched_tokens(a, 0) == (None, True)
        assert time.monotonic() - t0 >= left - 0.001  # it waited out what was left
        assert side.lookup_wait_left_s < 0.001  # spent: the step's next lookup does not wait
        assert conn.get_num_new_matched_tokens(b, 0) == (None, True)
        conn.build_connector_meta(_empty_output())  # the step's end
        assert side.lookup_wait_left_s == 0.5  # the next step's lookups wait afresh
    finally:
        srv.resume()
    assert matched(conn, a, 0) == (0, False)
    assert matched(conn, b, 0) == (0, False)
    for r in (hit, miss, a, b):
        conn.request_finished(r, [])
    wait_until(lambda: srv.status()["lookups"] == 0, what="the lookups ended")
    e.close()


def test_lookup_wait_ms_is_read_and_checked():
    from replay.vllm_shapes import vllm_config

    cfg = vllm_config(model="m", num_layers=2, num_kv_heads=2, head_size=8, block_size=BS,
                      extra={"socket_path": "/x", "chunk_tokens": CT})
    assert kv_vllm.config_from_vllm(cfg, kv_vllm.KVConnectorRole.SCHEDULER).lookup_wait_ms == 0.0
    cfg.kv_transfer_config.kv_connector_extra_config["lookup_wait_ms"] = "0.5"
    assert kv_vllm.config_from_vllm(cfg, kv_vllm.KVConnectorRole.SCHEDULER).lookup_wait_ms == 0.5
    for bad in (-1, 1001, float("nan")):
        cfg.kv_transfer_config.kv_connector_extra_config["lookup_wait_ms"] = bad
        with pytest.raises(ValueError, match="lookup_wait_ms"):
            kv_vllm.config_from_vllm(cfg, kv_vllm.KVConnectorRole.SCHEDULER)


def test_request_finished_delays_freeing_and_forgets_the_request(warm):
    _, e = warm
    conn = e.connector
    req = Request("q", DOC + [5], 1)
    matched(conn, req, 0)
    assert conn.request_finished(req, [1, 2]) == (True, None)
    assert conn.scheduler_side.tracked() == 0


def test_options_come_from_kv_connector_extra_config(servers):
    from replay.vllm_shapes import vllm_config

    srv = servers.start(chunk_tokens=CT)
    cfg = vllm_config(
        model="org/model",
        num_layers=2,
        num_kv_heads=4,
        head_size=8,
        block_size=BS,
        tp=2,
        extra={"socket_path": str(srv.socket_path), "chunk_tokens": CT, "kv_layout": "HND", "retrieve_timeout_ms": 777},
    )
    c = kv_vllm.config_from_vllm(cfg, kv_vllm.KVConnectorRole.SCHEDULER)
    assert c.model_name == "org/model" and c.world_size == 2 and c.layout == "HND"
    assert c.model.num_kv_heads == 2  # one rank's share
    assert c.timeouts_ms == {"retrieve_timeout_ms": 777}
    assert kv_vllm.KVTierConnector.get_required_kvcache_layout(cfg) == "HND"
    bad = vllm_config(model="m", num_layers=2, num_kv_heads=2, head_size=8, block_size=BS, extra={"chunk_tokens": 10})
    with pytest.raises(ValueError, match="socket_path"):
        kv_vllm.config_from_vllm(bad, kv_vllm.KVConnectorRole.SCHEDULER)
    bad.kv_transfer_config.kv_connector_extra_config["socket_path"] = "/x"
    with pytest.raises(ValueError, match="multiple of block_size"):
        kv_vllm.config_from_vllm(bad, kv_vllm.KVConnectorRole.SCHEDULER)
    bad.kv_transfer_config.kv_connector_extra_config.update(chunk_tokens=16, bogus_timeout_ms=1, ping_timeout_ms=5)
    assert kv_vllm.config_from_vllm(bad, kv_vllm.KVConnectorRole.SCHEDULER).timeouts_ms == {"ping_timeout_ms": 5}
    assert kv_vllm.config_from_vllm(bad, kv_vllm.KVConnectorRole.SCHEDULER).load_mode == "async"
    bad.kv_transfer_config.kv_connector_extra_config["load_mode"] = "layerwise"
    assert kv_vllm.config_from_vllm(bad, kv_vllm.KVConnectorRole.SCHEDULER).layerwise
    bad.kv_transfer_config.kv_connector_extra_config["load_mode"] = "sometimes"
    with pytest.raises(ValueError, match="load_mode"):
        kv_vllm.config_from_vllm(bad, kv_vllm.KVConnectorRole.SCHEDULER)


def test_layerwise_loads_are_synchronous_and_a_resumed_request_may_load_again(warm):
    """load_mode="layerwise": (n, False), the plan as for an asynchronous load; a request
    rolled back by a failed load stores what it recomputes; a resumed one loads again."""
    import kvtier
    from kvtier.integrations.core import KVTierConfig, ScheduledRequest, SchedulerSide, StepInput

    srv, _ = warm
    cfg = KVTierConfig(
        socket_path=str(srv.socket_path),
        model_name="replay/tiny",
        block_size=BS,
        chunk_tokens=CT,
        layout="NHD",
        model=kvtier.ModelShape(2, 2, 8, kvtier.DtypeKind.FP32),
        load_mode="layerwise",
    )
    side = SchedulerSide(cfg)
    try:
        prompt = DOC + [5, 6, 7]
        wait_until(lambda: side.num_new_matched_tokens("q", prompt, 0)[0] is not None, what="the lookup decided")
        assert side.num_new_matched_tokens("q", prompt, 0) == (48, False)
        blocks = list(range(40, 53))
        side.after_alloc("q", blocks, 48)
        plan = side.build_step(StepInput(scheduled=[ScheduledRequest("q", blocks, 48, 3, replace_blocks=True)]))
        (load,) = plan.loads
        assert load.block_ids == blocks[:12] and load.skip_tokens == 0
        assert plan.stores == []  # the loaded chunks are not stored again
        # The load's block 5 failed: vLLM rolls q back to token 20 and recomputes; the chunks it
        # recomputes are stored.
        side.on_load_errors({blocks[5]})
        plan = side.build_step(StepInput(scheduled=[ScheduledRequest("q", [], 20, 31)]))
        (store,) = plan.stores
        assert store.first_chunk == 1 and len(store.hashes) == 2
        # Preempted and resumed: looked up afresh, and loaded again (nothing was reported).
        side.build_step(StepInput(preempted=["q"]))
        wait_until(lambda: side.num_new_matched_tokens("q", prompt, 0)[0] is not None, what="the new lookup decided")
        assert side.num_new_matched_tokens("q", prompt, 0) == (48, False)
        side.request_finished("q")
        assert side.tracked() == 0
    finally:
        side.shutdown()


def _worker_side(srv, layout="NHD", num_blocks=32):
    import torch

    from kvtier.integrations.core import KVTierConfig, WorkerSide
    from kvtier_testing import FAST_TIMEOUTS_MS

    cfg = KVTierConfig(
        socket_path=str(srv.socket_path),
        model_name="replay/tiny",
        block_size=BS,
        chunk_tokens=CT,
        layout=layout,
        timeouts_ms=dict(FAST_TIMEOUTS_MS),
    )
    side = WorkerSide(cfg)
    shape = (2, num_blocks, BS, 2, 8) if layout == "NHD" else (2, num_blocks, 2, BS, 8)
    caches = {f"layer.{i}": torch.zeros(shape) for i in range(2)}
    side.register(caches)
    return side, caches


def _scheduler_connector(srv, layout="NHD"):
    import kvtier
    from kvtier_testing import options

    o = options(srv.socket_path, model_name="replay/tiny", chunk_tokens=CT, scheduler=True)
    o.model = kvtier.ModelShape(2, 2, 8, kvtier.DtypeKind.FP32)
    o.layout_kind = kvtier.parse_kv_layout_kind(layout)
    c = kvtier.Connector(o)
    assert c.wait_ready(30)
    return c


def _hit(sched, rid, hashes):
    sched.lookup_hashes(rid, hashes)
    wait_until(lambda: sched.lookup_result(rid) is not None, what="the lookup answer")
    return sched.lookup_result(rid)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_registering_moves_the_engines_tensors_into_the_region_in_place(servers, layout):
    import kvtier
    import torch

    srv = servers.start(chunk_tokens=CT)
    side, caches = _worker_side(srv, layout)
    assert side.region.layout.kind == kvtier.parse_kv_layout_kind(layout)
    t = caches["layer.1"]
    t[1, 3, 1, 1, 5] = 7.0  # through the engine's own tensor object
    assert kvtier.torch_layers(side.region)[1][1, 3, 1, 1, 5] == 7.0
    # A tensor handed over as a permuted view (a backend's stride order) keeps its shape and
    # strides, and the region takes its physical order.
    hnd = torch.zeros(2, 8, 2, BS, 8)  # physically HND
    logical = hnd.permute(0, 1, 3, 2, 4)  # seen as NHD
    from kvtier.integrations.core import KVTierConfig, WorkerSide

    other = WorkerSide(KVTierConfig(socket_path=str(srv.socket_path), model_name="m", block_size=BS, chunk_tokens=CT))
    other.register({"l0": logical})
    assert other.region.layout.kind == kvtier.KvLayoutKind.HND
    assert logical.shape == (2, 8, BS, 2, 8) and logical.stride() == hnd.permute(0, 1, 3, 2, 4).stride()
    other.shutdown()
    side.shutdown()


def test_a_block_reused_before_the_server_copied_it_is_never_stored(servers):
    from kvtier.integrations.core import StepPlan, StoreOp

    srv = servers.start(chunk_tokens=CT)
    side, _ = _worker_side(srv)
    sched = _scheduler_connector(srv)
    hashes = [11, 12]
    blocks = list(range(8))
    srv.pause()  # the store waits in the socket
    try:
        side.end_step(StepPlan(stores=[StoreOp("r", 0, hashes, blocks)]))
        # The next step writes block 5 (a preempted request's block, handed to another).
        side.start_step(StepPlan(fence_blocks=[5]))
    finally:
        srv.resume()
    wait_until(lambda: side.connector.stats()["pending_calls"] == 0, what="the store answered")
    # Chunk 0 (blocks 0-3) was stored; chunk 1 (blocks 4-7) read a reused block: dropped.
    assert _hit(sched, "q", hashes) == CT
    assert _hit(sched, "q2", [11]) == CT
    side.shutdown()


def test_a_quarantined_block_is_never_fenced_for_writing_nor_loaded_into(servers):
    from kvtier.integrations.core import LoadOp, StepPlan, StoreOp

    srv = servers.start(chunk_tokens=CT)
    side, _ = _worker_side(srv)
    side.end_step(StepPlan(stores=[StoreOp("s", 0, [21], [0, 1, 2, 3])]))
    wait_until(lambda: side.connector.stats()["pending_calls"] == 0, what="the store answered")
    srv.pause()
    try:
        side.start_step(StepPlan(loads=[LoadOp("r", 0, [21], [8, 9, 10, 11], 0)], fence_blocks=[8, 9, 10, 11]))
        wait_until(lambda: set(side.connector.quarantined_blocks()) == {8, 9, 10, 11}, what="the load's blocks quarantined")
        assert side.connector.counters[2] == 4 == side.connector.stats()["quarantined_blocks"]  # what vLLM's stats sample
        assert side.fence_refusals == 0
        side.start_step(StepPlan(loads=[LoadOp("x", 0, [21], [9, 12, 13, 14], 0)], fence_blocks=[9, 12, 13, 14]))
        assert side.fence_refusals == 1  # block 9: refused, and nothing is loaded into x's blocks
        assert {9, 12, 13, 14} <= side.load_error_blocks()
        # x (never sent) is finished receiving at once; r's report is held while its blocks
        # are quarantined.
        assert side.finished([]) == (None, {"x"})
        assert side.finished([]) == (None, None)
    finally:
        srv.resume()
    wait_until(lambda: not side.connector.quarantined_blocks(), what="the late answer releasing the blocks")
    assert side.connector.counters[2] == 0
    got = wait_until(lambda: side.finished([])[1], what="r finished receiving")
    assert got == {"r"}
    side.shutdown()


# --------------------------------------------------------------------------- roles, stats, the optional interface
def _engine(srv, **kw) -> ReplayEngine:
    from kvtier_testing import FAST_TIMEOUTS_MS

    kw.setdefault("chunk_tokens", CT)
    kw.setdefault("block_size", BS)
    extra = dict(FAST_TIMEOUTS_MS)
    extra.update(kw.pop("extra", {}))
    return ReplayEngine(socket_path=srv.socket_path, extra=extra, **kw)


def _doc(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % 97 + 1 for i in range(n)]


def _l1_objects(srv) -> int:
    return srv.status()["l1"]["objects"]


def _folded(e: ReplayEngine) -> dict:
    """Every step's stats data, folded as vLLM's logger does (in this process)."""
    acc = None
    for data in e.sched.kv_connector_stats:
        s = kv_vllm.KVTierConnector.build_kv_connector_stats(data)
        acc = s if acc is None else acc.aggregate(s)
    return dict(acc.data) if acc is not None else {}


def test_a_kv_consumer_loads_hits_but_never_stores(servers):
    srv = servers.start(chunk_tokens=CT)
    with _engine(srv) as warm:
        warm.add("warm", DOC + [90, 91], 1)
        warm.run()
    wait_until(lambda: _l1_objects(srv) == 3, what="the warm-up's 3 chunks stored")
    with _engine(srv, kv_role="kv_consumer") as e:
        e.add("hit", DOC + [5, 6, 7], 2)
        e.add("new", _doc(64, 9), 2)  # 4 chunks computed here
        e.run()
        assert e.violations == []
        assert e.sched.finished["hit"].num_external_computed_tokens == 48
        # Every request finished sending (its stores, if any, answered): nothing was stored.
        assert _l1_objects(srv) == 3
        st = _folded(e)
        assert st.get("store_requests", 0) == 0 and st.get("store_chunks_planned", 0) == 0
        assert st["loaded_chunks"] == 3


def test_a_kv_producer_stores_but_never_looks_up_nor_loads(servers):
    srv = servers.start(chunk_tokens=CT)
    with _engine(srv) as warm:
        warm.add("warm", DOC + [90, 91], 1)
        warm.run()
    with _engine(srv, kv_role="kv_producer") as e:
        conn = e.connector
        srv.pause()  # a lookup could not be answered: a producer answers at once
        try:
            assert conn.get_num_new_matched_tokens(Request("q", DOC + [5], 1), 0) == (0, False)
        finally:
            srv.resume()
        conn.request_finished(Request("q", DOC + [5], 1), [])
        assert conn.scheduler_side.lookups_sent == 0
        e.add("hit", DOC + [5, 6, 7], 2)
        e.add("new", _doc(64, 10), 2)
        e.run()
        assert e.violations == []
        assert e.sched.finished["hit"].num_external_computed_tokens == 0
        assert e.sched.reports["recving"] == []
        st = _folded(e)
        assert st.get("lookups", 0) == 0 and st.get("load_chunks", 0) == 0
        # A producer does not know what the server holds: it stores the hit's 3 chunks again
        # (the server keeps one copy) and the new document's 4.
        assert st["store_chunks_planned"] == 7
    assert _l1_objects(srv) == 7


def test_kv_role_is_read_and_checked():
    from replay.vllm_shapes import vllm_config

    for role in ("kv_producer", "kv_consumer", "kv_both"):
        cfg = vllm_config(model="m", num_layers=2, num_kv_heads=2, head_size=8, block_size=BS, kv_role=role,
                          extra={"socket_path": "/x", "chunk_tokens": CT})
        assert kv_vllm.config_from_vllm(cfg, kv_vllm.KVConnectorRole.SCHEDULER).kv_role == role
    cfg.kv_transfer_config.kv_role = "kv_sometimes"
    with pytest.raises(ValueError, match="kv_role"):
        kv_vllm.config_from_vllm(cfg, kv_vllm.KVConnectorRole.SCHEDULER)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_kv_delivery_is_never_required_a_dropped_save_is_a_future_miss(servers, role):
    srv = servers.start(chunk_tokens=CT)
    with _engine(srv, kv_role=role) as e:
        assert e.connector.requires_kv_delivery is False
        assert e.sched.requires_kv_delivery is False  # what vLLM's scheduler read at start


STATS_SCRIPT = r"""
import json, pickle, sys
from kvtier.integrations.vllm import KVTierConnector
acc = None
for data in pickle.load(sys.stdin.buffer):
    s = KVTierConnector.build_kv_connector_stats(data)
    acc = s if acc is None else acc.aggregate(s)
print(json.dumps({"data": acc.data, "reduced": acc.reduce(), "empty": acc.is_empty(), "type": type(acc).__name__}))
"""


def _kill_the_server_at_a_load(e: ReplayEngine, srv) -> None:
    """Stores DOC's chunks ("warm"), then runs "b" (DOC + 3 tokens: a hit) and SIGKILLs the
    server in the step whose plan loads it, before the workers run: "b"'s load fails."""
    e.add("warm", DOC + [90, 91], 1)
    e.run()
    fired = []

    def kill_at_load(so):
        if so.kv_connector_metadata.plan.loads and not fired:
            fired.append(srv.kill())

    e.add("b", DOC + [5, 6, 7], 2)
    e.run(before_workers=kill_at_load)
    assert fired and e.violations == []


def _stats_elsewhere(datas) -> dict:
    """The logger process: rebuilds each step's data with build_kv_connector_stats and folds."""
    import json
    import os
    import subprocess
    import sys

    import kvtier

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(kvtier.__file__)))
    out = subprocess.run([sys.executable, "-c", STATS_SCRIPT], input=pickle.dumps(list(datas)), env=env,
                         capture_output=True, check=True, timeout=120)
    return json.loads(out.stdout)


@pytest.mark.parametrize("world_size", [1, 2])
def test_stats_travel_as_vllm_carries_them_and_count_what_happened(servers, world_size):
    srv = servers.start(chunk_tokens=CT)
    with _engine(srv, world_size=world_size, kv_heads=2 * world_size) as e:
        e.add("warm", DOC + [90, 91], 1)
        e.run()
        e.add("b", DOC + [5, 6, 7], 2)
        e.run()
        assert e.violations == []
        datas = e.sched.kv_connector_stats
        assert datas and all(type(d) is dict for d in datas)  # only the dict travels on
        got = _stats_elsewhere(datas)
    assert got["type"] == "KVTierConnectorStats" and not got["empty"]
    d = got["data"]
    assert set(d) <= set(kv_vllm.STATS_KEYS)
    # scheduler: two lookups of 3 chunks (the warm-up missed), one hit of 48 tokens
    assert d["lookups"] == 2 and d["lookup_tokens"] == 96 and d["lookup_hit_tokens"] == 48
    assert d["hit_requests"] == 1 and d["hit_tokens"] == 48
    assert d["load_chunks_planned"] == 3 and d["store_chunks_planned"] == 3
    # workers, summed over the ranks: the 3 chunks retrieved and landed on each rank, the
    # warm-up's 3 chunks stored by each (one store request per chunk under chunked prefill)
    assert d["load_chunks"] == 3 * world_size and d["loaded_chunks"] == 3 * world_size
    assert d["store_requests"] == 3 * world_size
    assert d.get("load_error_blocks", 0) == 0
    assert got["reduced"]["lookup_hit_rate"] == 0.5


def test_stats_aggregate_sums_counts_and_keeps_maxima():
    S = kv_vllm.KVTierConnectorStats
    a = S({"lookups": 2, "quarantined_blocks_max": 5, "degraded_s": 0.5})
    b = S({"lookups": 1, "quarantined_blocks_max": 3, "future_key": 7, "degraded_s": 0.25})
    assert a.aggregate(b) is a
    assert a.data == {"lookups": 3, "quarantined_blocks_max": 5, "degraded_s": 0.75, "future_key": 7}
    assert pickle.loads(pickle.dumps(a)).data == a.data
    assert not a.is_empty() and S().is_empty() and S({"lookups": 0}).is_empty()
    a.reset()
    assert a.is_empty() and a.data == {}
    assert kv_vllm.KVTierConnector.build_kv_connector_stats(None).is_empty()
    if not kv_vllm.VLLM_AVAILABLE:
        from kvtier.integrations._vllm_standin import KVConnectorStats

        assert isinstance(a, KVConnectorStats)


def test_a_failed_load_is_counted_in_the_stats(servers):
    srv = servers.start(chunk_tokens=CT)
    with _engine(srv) as e:
        _kill_the_server_at_a_load(e, srv)
        # Steps without a server count as degraded time; a new server as a reconnection.
        wait_until(lambda: not any(o["healthy"] for o in e.worker_state()), what="the worker saw the server gone")
        e.step()
        e.step()
        srv.start()
        wait_until(lambda: all(o["healthy"] for o in e.worker_state()), what="the worker registered again")
        d = _folded(e)
    assert d["load_chunks"] == 3
    assert d.get("loaded_chunks", 0) + d["load_error_blocks"] // (CT // BS) == 3 and d["load_error_blocks"] > 0
    assert d["degraded_s"] > 0 and d["reconnects"] >= 1


def test_degraded_time_is_the_outage_itself_not_the_time_between_two_samples(servers):
    """degraded_s is the time the connector spent without a registered server since the last
    sample: an outage that ends between two samples counts, and the time an idle engine spent
    before the outage does not (vLLM samples once per step: an idle engine does not step)."""
    import time

    from replay.vllm_shapes import vllm_config

    srv = servers.start(chunk_tokens=CT)
    cfg = vllm_config(model="m", num_layers=2, num_kv_heads=2, head_size=8, block_size=BS,
                      extra={"socket_path": str(srv.socket_path), "chunk_tokens": CT, "kv_layout": "NHD"})
    sched = kv_vllm.KVTierConnector(cfg, kv_vllm.KVConnectorRole.SCHEDULER)
    try:
        conn = sched._scheduler.connector
        assert conn.wait_ready(30.0)
        sched.get_kv_connector_stats()  # the first sample: healthy
        srv.kill()
        wait_until(lambda: not conn.healthy, what="the scheduler saw the server gone")
        srv.start()
        wait_until(lambda: conn.healthy, what="the scheduler registered again")
        d = sched.get_kv_connector_stats().data
        assert d.get("degraded_s", 0) > 0 and d["reconnects"] == 1

        time.sleep(0.3)  # the engine idles (no step, no sample) with its server up
        killed = time.monotonic()
        srv.kill()
        wait_until(lambda: not conn.healthy, what="the scheduler saw the server gone again")
        d = sched.get_kv_connector_stats().data
        assert 0 < d["degraded_s"] <= time.monotonic() - killed
    finally:
        sched.shutdown()


def _kv_cache_config(*specs):
    from replay import vllm_configs as vc

    return vc.KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[vc.KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
    )


def test_kvtier_is_not_hma_capable_and_refuses_kv_cache_groups_it_cannot_serve(servers):
    """Not SupportsHMA: vLLM then runs with its hybrid allocator off (sliding-window layers as
    full attention), or refuses to start when it is forced on. A KV cache config kvtier cannot
    serve whole is refused at construction, on both sides."""
    from replay import vllm_configs as vc
    from replay.vllm_shapes import vllm_config

    from kvtier.integrations._vllm_standin import supports_hma

    assert not supports_hma(kv_vllm.KVTierConnector)
    srv = servers.start(chunk_tokens=CT)
    cfg = vllm_config(model="m", num_layers=2, num_kv_heads=2, head_size=8, block_size=BS,
                      extra={"socket_path": str(srv.socket_path), "chunk_tokens": CT, "kv_layout": "NHD"})
    full = vc.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8)
    for ok in (
        None,  # vLLM did not say (runs without vLLM)
        _kv_cache_config(full),
        _kv_cache_config(vc.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, sliding_window=32)),
        _kv_cache_config(vc.MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8)),
    ):
        kv_vllm.KVTierConnector(cfg, kv_vllm.KVConnectorRole.SCHEDULER, ok).shutdown()
    bad = {
        "2 KV cache groups": _kv_cache_config(full, full),
        "SlidingWindowSpec": _kv_cache_config(vc.SlidingWindowSpec(block_size=BS, sliding_window=32)),
        "MambaSpec": _kv_cache_config(vc.MambaSpec(block_size=BS)),
        "head_size_v": _kv_cache_config(vc.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, head_size_v=4)),
        "OtherSpec": _kv_cache_config(type("OtherSpec", (vc.AttentionSpec,), {})(block_size=BS)),
    }
    for what, kcc in bad.items():
        for role in (kv_vllm.KVConnectorRole.SCHEDULER, kv_vllm.KVConnectorRole.WORKER):
            with pytest.raises(ValueError, match=what) as info:
                kv_vllm.KVTierConnector(cfg, role, kcc)
            assert ("disable-hybrid-kv-cache-manager" in str(info.value)) == (what not in ("head_size_v", "OtherSpec"))


def test_the_optional_interface_answers_what_a_best_effort_shared_cache_should(warm):
    _, e = warm
    conn = e.connector
    assert conn.reset_cache() is False  # the server's cache is shared: not this engine's to clear
    assert tuple(conn.take_events()) == ()
    assert conn.get_finished_count() is None  # every rank reports each id
    assert conn.has_pending_push_work() is False
    assert conn.prefer_cross_layer_blocks is False and conn.supports_eagle_prefix_cache_hashing is False
    assert conn.on_new_request(Request("n", DOC, 1)) is None
    assert kv_vllm.KVTierConnector.requires_piecewise_for_cudagraph({"load_mode": "layerwise"}) is True
    assert kv_vllm.KVTierConnector.requires_piecewise_for_cudagraph({}) is False
    assert kv_vllm.KVTierConnector.build_prom_metrics(None, {}, [], {}) is None


# --------------------------------------------------------------------------- a request's life, as vLLM drives it
def test_a_request_retrieves_again_after_a_preemption_in_layerwise_mode_and_every_row_is_exact(servers):
    """Chunked prefill after a hit, a preemption, the resumption: the id's second retrieve (5
    chunks: the 3 it loaded and the 2 it stored meanwhile) is exact, and each store and load
    happened where the stats say."""
    srv = servers.start(chunk_tokens=CT)
    with _engine(srv, token_budget=16, extra={"load_mode": "layerwise"}) as e:
        d = _doc(96, 11)
        e.add("warm", d[:48] + [1], 1)
        e.run()
        e.add("a", list(d), 2)
        e.run(until=lambda: e.sched.requests["a"].num_computed_tokens >= 80)
        e.sched.preempt("a")
        e.run()
        assert e.violations == []
        a = e.sched.finished["a"]
        assert a.num_preemptions == 1 and a.num_external_computed_tokens == 80
        assert len(e.sched.request_finished_calls["a"]) == 1
        st = _folded(e)
    assert st["load_chunks"] == 3 + 5 and st["loaded_chunks"] == 8
    assert st["lookups"] == 3  # warm, a, a again after its preemption


def test_the_same_request_ids_in_two_engines_stay_apart(servers):
    """vLLM's offline engines number their requests "0", "1", ...: two engines on one server
    with the same ids and different documents each load their own chunks."""
    srv = servers.start(chunk_tokens=CT)
    d1, d2 = _doc(64, 21), _doc(64, 22)
    with _engine(srv) as e1, _engine(srv) as e2:
        assert e1.engine_id != e2.engine_id
        e1.add("0", d1 + [1], 1)
        e2.add("0", d2 + [1], 1)
        while e1.sched.has_requests() or e2.sched.has_requests():
            e1.step()
            e2.step()
        for e, d in ((e1, d1), (e2, d2)):
            e.add("1", d + [2, 3], 2)
        while e1.sched.has_requests() or e2.sched.has_requests():
            e1.step()
            e2.step()
        for e in (e1, e2):
            assert e.violations == []  # every KV row its own token's
            assert e.sched.finished["1"].num_external_computed_tokens == 64
            assert e.connector.scheduler_side.tracked() == 0
    wait_until(lambda: srv.status()["lookups"] == 0, what="every lookup released")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_an_abort_while_the_load_is_in_flight_is_finished_once_and_frees_its_blocks_after_the_load(servers, policy):
    srv = servers.start(chunk_tokens=CT)
    with _engine(srv, kv_load_failure_policy=policy) as e:
        e.add("warm", DOC + [90, 91], 1)
        e.run()
        noted = []

        def pause_at_load(so):
            if so.kv_connector_metadata.plan.loads and not noted:
                srv.pause()
                noted.append(so.kv_connector_metadata.plan.loads[0].block_ids)

        e.add("b", DOC + [5, 6, 7], 2)
        try:
            e.run(before_workers=pause_at_load, until=lambda: bool(noted))
            req = e.sched.requests["b"]
            assert req.status.name == "WAITING_FOR_REMOTE_KVS" and req.num_computed_tokens == 48
            e.sched.abort("b")
            # request_finished once, with the blocks of the 48 tokens counted as computed
            assert e.sched.request_finished_calls["b"] == [e.sched.tables["b"][:12]]
            e.step()
            assert not set(noted[0]) & set(e.sched.pool.free)  # held while the load may still land
        finally:
            srv.resume()
        e.run()
        assert e.violations == [] and e.sched.holds() == 0
        assert len(e.sched.request_finished_calls["b"]) == 1
        assert e.sched.reports["recving"].count("b") == 1 and "b" not in e.sched.reports["sending"]
        assert e.connector.scheduler_side.tracked() == 0


def test_an_aborted_waiting_request_is_finished_once_with_no_blocks(warm):
    srv, e = warm
    srv.pause()
    try:
        e.add("lookup", DOC + [2], 2)
        e.step()
        e.sched.abort("lookup")
    finally:
        srv.resume()
    e.run()
    assert e.sched.request_finished_calls["lookup"] == [[]]
    assert e.connector.scheduler_side.tracked() == 0


@pytest.mark.parametrize("load_mode", ["async", "layerwise"])
def test_under_the_fail_policy_a_failed_load_finishes_the_request_with_an_error_and_leaks_nothing(servers, load_mode):
    srv = servers.start(chunk_tokens=CT)
    with _engine(srv, kv_load_failure_policy="fail", extra={"load_mode": load_mode}) as e:
        _kill_the_server_at_a_load(e, srv)
        assert e.sched.finished["b"].status.name == "FINISHED_ERROR"
        assert e.sched.finished["b"].output_token_ids == []  # no token from KV that did not land
        assert len(e.sched.request_finished_calls["b"]) == 1
        assert len(e.sched.pool.free) == e.sched.pool.num_blocks
        assert e.connector.scheduler_side.tracked() == 0


def test_a_short_request_writing_a_preempted_requests_blocks_fences_them_so_its_late_store_is_dropped(servers):
    """vLLM frees a preempted request's blocks at once, while its store may still wait for the
    server. A request with no full chunk (nothing to look up or store) that is handed those
    blocks must fence them before writing, or the late store copies its rows under the
    preempted request's chunk key: wrong KV for every later hit."""
    srv = servers.start(chunk_tokens=CT)
    slow = {k: 60000 for k in ("ping_timeout_ms", "request_timeout_ms", "lookup_timeout_ms", "store_timeout_ms")}
    with _engine(srv, num_blocks=5, token_budget=16, extra=slow) as e:
        d = _doc(20, 31)
        e.add("a", list(d), 1)
        paused = []

        def pause_at_store(so):
            if so.kv_connector_metadata.plan.stores and not paused:
                paused.append(srv.pause())  # a's chunk 0 store waits in the socket

        try:
            e.run(before_workers=pause_at_store, until=lambda: bool(paused))
            e.sched.preempt("a")  # its 4 blocks go back to the pool at once
            freed = list(e.sched.pool.free)[-4:]  # a's blocks 0-3, behind the one a never used
            e.add("s", _doc(8, 32), 1)  # shorter than a chunk
            e.step()  # reports the preemption (vLLM admits nothing in that step)
            e.step()  # a's new lookup waits; s is handed a's freed blocks and writes them
            assert e.sched.requests["s"].num_computed_tokens == 8
            assert set(e.sched.tables["s"]) & set(freed)  # one of chunk 0's blocks
        finally:
            srv.resume()
        e.run()
        e.add("c", d[:16] + [3], 1)  # hits a's chunk 0 if it was stored
        e.run()
        assert e.violations == []


class _ScriptedConnector:
    """A worker's kvtier.Connector whose get_finished answers come from a script (the C++
    tracker's reports of one rank), with nothing quarantined."""

    def __init__(self, script):
        self.script = list(script)

    def get_finished(self, finished_by_engine):
        return self.script.pop(0) if self.script else ([], [])

    def quarantined_blocks(self):
        return []

    def blocks_reused(self, blocks):
        return []


def test_a_rank_whose_receiving_report_went_before_the_abort_reports_nothing_more(tmp_path):
    """Found by the soak (TP=2, a server SIGSTOPped): rank 0's load ended before the abort
    (receiving reported), rank 1's after it (its last report: receiving). Rank 0's tracker
    then gives sending as its last report; vLLM frees the request on the aggregated
    finished_recving, and rank 0's finished_sending stayed in its KVOutputAggregator for
    ever. With the scheduler's recv_last, rank 0 reports nothing more."""
    from kvtier.integrations.config import KVTierConfig
    from kvtier.integrations.plan import StepPlan
    from kvtier.integrations.worker_side import WorkerSide

    def rank(script):
        ws = WorkerSide(KVTierConfig(socket_path=str(tmp_path / "none.sock"), model_name="m", chunk_tokens=16,
                                     block_size=4))
        ws.connector = _ScriptedConnector(script)
        return ws

    rank0 = rank([([], ["r"]), (["r"], [])])  # receiving before the abort, then sending
    rank1 = rank([([], []), ([], ["r"])])  # its load still pending at the abort: receiving last
    assert rank0.finished([]) == (None, {"r"})
    assert rank1.finished([]) == (None, None)
    for ws in (rank0, rank1):  # the step after the abort: the plan says r's last report is receiving
        ws.start_step(StepPlan(recv_last=["r"]))
    assert rank0.finished(["r"]) == (None, None)
    assert rank1.finished(["r"]) == (None, {"r"})
    assert rank0.held() == 0 and rank1.held() == 0

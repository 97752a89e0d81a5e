"""The replay of vLLM's per-step call order (tests/python/replay): a scheduler (this process)
and one or two worker processes (TP=2), chunked prefill, preemption, abort, and the server
killed, stopped and restarted mid-run. The workers' synthetic model checks, every step, that
every KV row of every scheduled request is its token's (replay/model.py), so a wrong load, a
block overwritten by a late copy or reused while quarantined shows up as a violation. The KV
caches are float32 unless a test says otherwise (vLLM's float16 and bfloat16 caches: the
last section)."""

from __future__ import annotations

import pytest
import torch

from kvtier_testing import FAST_TIMEOUTS_MS, wait_until
from replay.engine import ReplayEngine
from replay.model import KV_DTYPES, PagedKV, RequestInputs, SyntheticRunner, make_kv_caches
from replay.vllm_shapes import RequestStatus

CT = 16
BS = 4


def doc(n: int, seed: int) -> list:
    return [(seed * 131 + i * 7) % 97 + 1 for i in range(n)]


def engine(srv, **kw) -> ReplayEngine:
    kw.setdefault("chunk_tokens", CT)
    kw.setdefault("block_size", BS)
    kw.setdefault("kv_heads", 4)
    extra = dict(FAST_TIMEOUTS_MS)
    extra.update(kw.pop("extra", {}))
    return ReplayEngine(socket_path=srv.socket_path if srv else None, extra=extra, **kw)


def at_first_load(action):
    """A before_workers hook that calls action(scheduler_output) once, at the first step whose
    connector plan has loads (the moment a load goes out to the workers). Returns the hook and
    the list of what action returned (empty until it fired)."""
    fired = []

    def hook(so):
        if so.kv_connector_metadata.plan.loads and not fired:
            fired.append(action(so))

    return hook, fired


def assert_clean(e: ReplayEngine, srv=None, loaded=()) -> None:
    """Nothing is left behind and every id was reported as vLLM needs it."""
    assert e.violations == []
    s = e.sched
    assert not s.has_unfinished() and s.holds() == 0
    assert len(s.pool.free) == s.pool.num_blocks, "blocks not back in the pool"
    assert sorted(s.reports["sending"]) == sorted(set(s.reports["sending"])), "an id finished sending twice"
    assert sorted(s.reports["recving"]) == sorted(set(s.reports["recving"])), "an id finished receiving twice"
    for rid in loaded:
        assert s.reports["recving"].count(rid) == 1
    assert e.partial_reports() == {}, "ids only some ranks reported finished"
    if e.connector is not None:
        assert e.connector.scheduler_side.tracked() == 0
    if srv is not None and srv.running():
        wait_until(lambda: srv.status()["lookups"] == 0, what="the server's lookups released")


@pytest.mark.parametrize("world_size,layout", [(1, "NHD"), (1, "HND"), (2, "NHD"), (2, "HND")])
def test_prefix_hits_load_exact_kv_on_every_rank(servers, world_size, layout):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, world_size=world_size, layout=layout) as e:
        d = doc(64, 1)
        e.add("a", d + [5, 6, 7], 2)
        e.run()
        e.add("b", d + [8, 9], 2)
        e.add("c", d[:40] + [10] * 20, 2)
        e.add("whole", list(d), 2)  # exactly the stored chunks
        e.run()
        f = e.sched.finished
        assert f["a"].num_external_computed_tokens == 0
        assert f["b"].num_external_computed_tokens == 64
        assert f["c"].num_external_computed_tokens == 32  # 2 full chunks shared
        assert f["whole"].num_external_computed_tokens == 63  # the last token is computed
        assert all(len(r.output_token_ids) == 2 for r in f.values())
        assert_clean(e, srv, loaded=["b", "c", "whole"])


def test_chunked_prefill_stores_each_chunk_in_the_step_that_completes_it(servers):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, token_budget=10, chunk_align=False) as e:
        e.keep_records = True
        d = doc(70, 2)
        e.add("a", d, 1)
        e.run()
        stores = []
        for step, rec in enumerate(e.steps):
            for op in rec.output.kv_connector_metadata.plan.stores:
                computed = sum(r.output.num_scheduled_tokens.get("a", 0) for r in e.steps[: step + 1])
                stores.append((op.first_chunk, len(op.hashes), computed))
        # 10 tokens a step: chunk c is stored in the step that reaches (c + 1) * 16 tokens.
        assert stores == [(0, 1, 20), (1, 1, 40), (2, 1, 50), (3, 1, 70)]
        e.add("b", d + [1], 1)
        e.run()
        assert e.sched.finished["b"].num_external_computed_tokens == 64
        assert_clean(e, srv, loaded=["b"])


def test_a_preempted_request_releases_its_lookup_and_resumes_exactly(servers):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, token_budget=16) as e:
        d = doc(80, 3)
        e.add("a", list(d), 3)  # nothing cached: computed, stored chunk by chunk
        e.run(until=lambda: e.sched.requests["a"].num_computed_tokens >= 64)
        e.sched.preempt("a")
        e.step()
        # The preemption ended the request's lookup (end_request is fire and forget: wait for it).
        wait_until(lambda: srv.status()["lookups"] == 0, what="the preempted request's lookup released")
        e.run()
        a = e.sched.finished["a"]
        assert a.num_preemptions == 1 and len(a.output_token_ids) == 3
        # Resumed, it was looked up afresh and loaded the 4 chunks it had stored (once).
        assert a.num_external_computed_tokens == 64
        assert_clean(e, srv, loaded=["a"])


def preempt_after_its_load(e, seed):
    """Request "a" (80 tokens) hits the 3 chunks a warm-up stored, loads them, computes past
    the 4th chunk and is preempted; returns it finished."""
    d = doc(80, seed)
    e.add("warm", d[:48] + [1], 1)
    e.run()
    e.add("a", list(d), 2)
    e.run(until=lambda: e.sched.requests["a"].num_computed_tokens >= 64)
    assert e.sched.requests["a"].num_external_computed_tokens == 48
    e.sched.preempt("a")
    e.run()
    return e.sched.finished["a"]


def test_a_request_that_loaded_before_its_preemption_recomputes_after_it(servers):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, token_budget=16) as e:
        a = preempt_after_its_load(e, 13)
        assert a.num_preemptions == 1 and a.num_external_computed_tokens == 0
        assert_clean(e, srv, loaded=["a"])


def test_running_out_of_blocks_preempts_and_everything_still_completes(servers):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, num_blocks=40, token_budget=48) as e:
        for i in range(4):
            e.add(f"r{i}", doc(60, 10 + i % 2), 4)
        e.run()
        assert sum(r.num_preemptions for r in e.sched.finished.values()) > 0
        assert all(len(r.output_token_ids) == 4 for r in e.sched.finished.values())
        assert_clean(e, srv)


def test_abort_while_looking_up_loading_or_running_releases_everything(servers):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, token_budget=16) as e:
        d = doc(64, 4)
        e.add("warm", d + [1], 1)
        e.run()
        # While the lookup is pending (the server is stopped for one step).
        srv.pause()
        try:
            e.add("lookup", d + [2], 2)
            e.step()
            assert e.sched.requests["lookup"].status == RequestStatus.WAITING
            e.sched.abort("lookup")
        finally:
            srv.resume()
        # While its KV is loading (WAITING_FOR_REMOTE_KVS: the server stops as the load goes out).
        e.add("loading", d + [3], 2)
        stop_at_load, paused = at_first_load(lambda so: srv.pause())
        try:
            e.run(before_workers=stop_at_load, until=lambda: bool(paused))
            assert e.sched.requests["loading"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
            e.sched.abort("loading")
            e.step()
        finally:
            srv.resume()
        # While running, mid-prefill.
        e.add("running", doc(64, 5), 2)
        e.run(until=lambda: e.sched.requests["running"].num_computed_tokens >= 32)
        e.sched.abort("running")
        e.run()
        assert {r.status for r in e.sched.finished.values() if r.request_id != "warm"} == {RequestStatus.FINISHED_ABORTED}
        assert_clean(e, srv)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_server_killed_with_loads_in_flight_costs_recomputation_only(servers, world_size):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, world_size=world_size) as e:
        d = doc(64, 6)
        e.add("warm", d + [1], 1)
        e.run()
        kill_at_load, killed = at_first_load(lambda so: srv.kill())
        e.add("b", d + [2], 3)
        e.add("c", d + [3, 4], 3)
        e.run(before_workers=kill_at_load)
        assert killed
        assert all(len(e.sched.finished[r].output_token_ids) == 3 for r in ("b", "c"))
        assert_clean(e)
        # A new server: the connectors register again; stores and hits resume.
        srv.start()
        # The scheduler's lookup connection too: it reconnects on its own backoff, and a lookup
        # made before it did is a miss (the hit asserted below would then be 0).
        wait_until(e.all_healthy, what="the scheduler and the workers registered again")
        e.add("d", d + [5], 1)
        e.run()
        e.add("e", d + [6], 1)
        e.run()
        assert e.sched.finished["e"].num_external_computed_tokens == 64, (
            "d hit", e.sched.finished["d"].num_external_computed_tokens, e.connector._scheduler.connector.stats())
        assert_clean(e, srv)


def load_with_the_server_stopped(e: ReplayEngine, srv, seed: int) -> list:
    """Stores a 64-token document, then sends request "b" (the document again) and stops the
    server in the step that loads it. Returns the load's blocks once every rank has them
    quarantined (the connectors found the server hung: the retrieve is a load error whose
    blocks the server may still write). The caller resumes the server."""
    d = doc(64, seed)
    e.add("warm", d + [1], 1)
    e.run()

    def pause_and_note_blocks(so):
        srv.pause()
        return [op.block_ids for op in so.kv_connector_metadata.plan.loads]

    stop_at_load, stopped = at_first_load(pause_and_note_blocks)
    e.add("b", d + [2], 2)
    e.run(before_workers=stop_at_load, until=lambda: bool(stopped))
    (blocks,) = stopped[0]
    try:
        wait_until(
            lambda: all(set(blocks) <= set(o["quarantined"]) for o in e.worker_state()),
            what="the load's blocks quarantined",
        )
    except BaseException:
        srv.resume()
        raise
    return blocks


def test_a_stopped_server_keeps_the_blocks_of_its_load_quarantined_until_it_answers(servers):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, world_size=2) as e:
        blocks = load_with_the_server_stopped(e, srv, 7)
        try:
            # The request's report is held back while its blocks are quarantined.
            for _ in range(20):
                outs = e.step().worker_outputs
                assert e.sched.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
                assert not set(blocks) & set(e.sched.pool.free)
                assert all(o["held"] >= 1 for o in outs)
            assert e.violations == []  # never a quarantined block in the free pool
        finally:
            srv.resume()
        e.run()
        assert len(e.sched.finished["b"].output_token_ids) == 2
        assert_clean(e, srv, loaded=["b"])


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_request_aborted_while_its_held_load_report_waits_gets_one_last_report(servers, world_size):
    """Found by the soak (bench/soak, a server SIGSTOPped): the load's blocks quarantined, the
    request's receiving report held back; the request is aborted, so its sending report comes
    and is held back too. When the quarantine ends both were released in one get_finished, and
    vLLM, which frees a finished request on finished_recving, then asserted on the
    finished_sending of a request it no longer holds."""
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, world_size=world_size) as e:
        load_with_the_server_stopped(e, srv, 9)
        try:
            e.sched.abort("b")  # the user gives up while the load's report is held back
            # vLLM has no finished_recving of it: every rank's last report is receiving.
            assert e.step().output.kv_connector_metadata.plan.recv_last == ["b"]
            for _ in range(5):
                e.step()
        finally:
            srv.resume()
        e.run()
        assert e.violations == []
        assert e.sched.finished["b"].status == RequestStatus.FINISHED_ABORTED
        assert "b" not in e.sched.requests
        assert_clean(e, srv, loaded=["b"])


def test_the_server_restarted_mid_prefill_loses_nothing_but_its_cache(servers):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, token_budget=16) as e:
        d = doc(96, 8)
        e.add("a", list(d), 2)
        e.run(until=lambda: e.sched.requests["a"].num_computed_tokens >= 48)
        srv.restart()
        e.run()
        assert len(e.sched.finished["a"].output_token_ids) == 2
        # The scheduler's lookup connection too: it reconnects on its own backoff, and a lookup
        # made before it did is a miss (the hit asserted below would then be 0).
        wait_until(e.all_healthy, what="the scheduler and the workers registered again")
        e.add("b", d + [1], 1)
        e.run()
        # The new server has what was stored after the restart (a prefix of those chunks may be
        # missing: the hit is the leading run present), and whatever it has is exact.
        assert e.sched.finished["b"].num_external_computed_tokens % CT == 0
        assert_clean(e, srv)


def test_without_a_server_the_engine_runs_degraded_and_exact(servers, tmp_path):
    class Absent:
        socket_path = tmp_path / "nobody.sock"

    with engine(Absent, extra={"ready_timeout_s": 0.2}) as e:
        d = doc(48, 9)
        e.add("a", d + [1], 2)
        e.add("b", d + [2], 2)
        e.run()
        assert all(r.num_external_computed_tokens == 0 for r in e.sched.finished.values())
        assert_clean(e)


# --- load_mode="layerwise": synchronous loads, each layer computed once it landed -----------

LAYERWISE = {"load_mode": "layerwise"}


def assert_never_receiving(e: ReplayEngine) -> None:
    """A synchronous load is never reported finished receiving (vLLM asserts: the request is
    running, not waiting for remote KV)."""
    assert e.sched.reports["recving"] == []


@pytest.mark.parametrize("world_size,layout", [(1, "NHD"), (1, "HND"), (2, "NHD")])
def test_layerwise_prefix_hits_load_exact_kv_in_the_step_that_runs_them(servers, world_size, layout):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, world_size=world_size, layout=layout, num_layers=3, extra=LAYERWISE) as e:
        e.keep_records = True
        d = doc(64, 21)
        e.add("a", d + [5, 6, 7], 2)
        e.run()
        e.add("b", d + [8, 9], 2)
        e.add("c", d[:40] + [10] * 20, 2)
        e.add("whole", list(d), 2)
        e.run()
        f = e.sched.finished
        assert f["b"].num_external_computed_tokens == 64
        assert f["c"].num_external_computed_tokens == 32
        assert f["whole"].num_external_computed_tokens == 63
        assert all(len(r.output_token_ids) == 2 for r in f.values())
        # Each load ran in the step that planned it: the request computed in that step.
        for rec in e.steps:
            for op in rec.output.kv_connector_metadata.plan.loads:
                assert rec.output.num_scheduled_tokens.get(op.request_id, 0) > 0
        assert e.discarded == 0
        assert_never_receiving(e)
        assert_clean(e, srv)


def test_layerwise_a_preempted_request_loads_again_when_resumed(servers):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, token_budget=16, extra=LAYERWISE) as e:
        a = preempt_after_its_load(e, 23)
        # Resumed, it loaded again what the server has now: the 4 chunks it stored before, or
        # the 3 of the warm-up where the 4th chunk's store (sent as it was computed) had not
        # landed yet when the resumed request looked up (seen once on a loaded machine: 48).
        # Either way it loads only what is there and computes the rest (assert_clean checks
        # the KV it ran with).
        assert a.num_preemptions == 1 and a.num_external_computed_tokens in (48, 64)
        assert len(a.output_token_ids) == 2
        assert_never_receiving(e)
        assert_clean(e, srv)


@pytest.mark.parametrize("world_size", [1, 2])
def test_layerwise_the_server_killed_with_loads_in_flight_rolls_back_and_recomputes(servers, world_size):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, world_size=world_size, extra=LAYERWISE) as e:
        d = doc(64, 26)
        e.add("warm", d + [1], 1)
        e.run()
        kill_at_load, killed = at_first_load(lambda so: srv.kill())
        e.add("b", d + [2], 3)
        e.add("c", d + [3, 4], 3)
        e.run(before_workers=kill_at_load)
        assert killed
        # The step that loaded ran on blocks that never landed: vLLM discarded its output of
        # those requests and they recomputed (a wrong KV row in what it kept is a violation).
        assert e.discarded >= 1
        assert all(len(e.sched.finished[r].output_token_ids) == 3 for r in ("b", "c"))
        assert_never_receiving(e)
        assert_clean(e)


def test_layerwise_a_stopped_server_costs_a_recomputation_and_no_block_goes_free_while_quarantined(servers):
    srv = servers.start(chunk_tokens=CT)
    with engine(srv, extra=LAYERWISE) as e:
        d = doc(64, 27)
        e.add("warm", d + [1], 1)
        e.run()
        stop_at_load, stopped = at_first_load(lambda so: srv.pause())
        e.add("b", d + [2], 2)
        try:
            # The step waits in wait_for_layer_load until the connector gives up on the
            # retrieve (the ping timeout); b's output of that step is discarded, and b
            # recomputes in place while its blocks stay quarantined.
            e.run(before_workers=stop_at_load, until=lambda: bool(stopped) and e.discarded >= 1)
            outs = e.step().worker_outputs
            assert any(o["quarantined"] for o in outs)
        finally:
            srv.resume()
        e.run()
        assert len(e.sched.finished["b"].output_token_ids) == 2
        assert e.violations == []  # never a quarantined block in the free pool, never a wrong row
        assert_never_receiving(e)
        assert_clean(e, srv)


# --- KV cache dtypes: vLLM's float16 and bfloat16 KV caches (model dtype, cache_dtype "auto") ---

#: The kvtier dtype kind each KV cache dtype registers as.
DTYPE_KIND = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16"}


@pytest.mark.parametrize(
    "dtype,world_size,layout",
    [
        ("float32", 1, "NHD"),
        ("float16", 1, "NHD"),
        ("bfloat16", 1, "HND"),
        ("float16", 2, "HND"),
        ("bfloat16", 2, "NHD"),
    ],
)
def test_a_prefix_stored_by_one_engine_loads_exactly_into_another_of_its_kv_dtype(servers, dtype, world_size, layout):
    srv = servers.start(chunk_tokens=CT)
    d = doc(64, 31)
    with engine(srv, dtype=dtype, world_size=world_size, layout=layout) as first:
        # The workers' tensors are of the dtype, and kvtier registered them (and the
        # scheduler keys its lookups) as that dtype.
        assert [o["kv_dtype"] for o in first.worker_state()] == [DTYPE_KIND[dtype]] * world_size
        assert first.connector.scheduler_side.config.model.dtype.name == DTYPE_KIND[dtype]
        first.add("a", d + [1], 2)
        first.run()
        assert first.sched.finished["a"].num_external_computed_tokens == 0
        assert_clean(first, srv)
    # A fresh engine (its own engine id and worker processes, zeroed caches) on the same server.
    with engine(srv, dtype=dtype, world_size=world_size, layout=layout) as second:
        wait_until(second.all_healthy, what="the second engine registered")
        second.add("b", d + [2], 2)
        second.run()
        b = second.sched.finished["b"]
        assert b.num_external_computed_tokens == 64 and len(b.output_token_ids) == 2
        assert_clean(second, srv, loaded=["b"])  # no violation: every row loaded is its token's


def test_engines_of_another_kv_dtype_miss_the_chunks(servers):
    """float16 and bfloat16 rows are both 2 bytes: only the dtype in the chunk keys keeps one
    from loading the other's bits."""
    srv = servers.start(chunk_tokens=CT)
    d = doc(64, 32)
    with engine(srv, dtype="bfloat16") as e:
        e.add("a", d + [1], 1)
        e.run()
        assert_clean(e, srv)
    for dtype, hit in (("float16", 0), ("float32", 0), ("bfloat16", 64)):
        with engine(srv, dtype=dtype) as e:
            wait_until(e.all_healthy, what="the engine registered")
            e.add("b", d + [2], 1)
            e.run()
            assert e.sched.finished["b"].num_external_computed_tokens == hit, dtype
            assert_clean(e, srv)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_synthetic_check_catches_a_wrong_row_in_a_16_bit_cache(dtype):
    """The pattern is computed in float32 and cast; a row of another token, position, layer,
    plane or rank, with its heads swapped or one element changed, differs after the cast and
    is a bad row."""
    heads, head_dim, bs = 4, 16, 4
    runner = SyntheticRunner("NHD", 0, bs, heads, head_dim, dtype)
    # Every identity's row (what a row's token, position, layer, plane and rank come to) is
    # exact in the dtype and distinct from every other's.
    every = torch.arange(65521)
    rows = runner.rows(every)
    assert torch.equal(rows.to(KV_DTYPES[dtype]).to(torch.float32), rows)
    assert torch.unique(rows.flatten(1), dim=0).shape[0] == 65521
    tensors = make_kv_caches("NHD", 2, 8, bs, heads, head_dim, dtype)
    assert all(t.dtype == KV_DTYPES[dtype] for t in tensors.values())
    caches = [PagedKV(t, "NHD", bs) for t in tensors.values()]
    tokens, table = doc(12, 33), [5, 2, 7]
    assert runner.forward(tokens, 0, 10, table, caches)[0] == 0
    at = torch.tensor([6])
    k, v = runner.pattern(tokens, at, 0, 0), runner.pattern(tokens, at, 0, 1)
    one_off = k.clone()
    one_off[0, 1, 5] += 1
    wrong = {
        "another token": runner.pattern([t + 1 for t in tokens], at, 0, 0),
        "another position": runner.pattern(tokens, torch.tensor([5]), 0, 0),
        "another layer": runner.pattern(tokens, at, 1, 0),
        "the V row": v,
        "another rank": SyntheticRunner("NHD", 1, bs, heads, head_dim, dtype).pattern(tokens, at, 0, 0),
        "its heads swapped": k.flip(1),
        "one element changed": one_off,
    }
    for what, row in wrong.items():
        assert row.dtype == KV_DTYPES[dtype]
        caches[0].write(table, at, row, v)
        # The next step writes position 10 and checks 0..10: position 6 of layer 0 is bad.
        assert runner.forward(tokens, 10, 11, table, caches)[0] == 1, what
        caches[0].write(table, at, k, v)
        assert runner.forward(tokens, 10, 11, table, caches)[0] == 0, what


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_synthetic_check_catches_kv_of_another_prefix_or_other_inputs(dtype):
    """Like a real model's K/V, a row's pattern depends on every earlier token and on the
    request's inputs at and before its position (adapter, image rows, prompt embeddings): a
    chunk served under a key that failed to cover them is a bad row, in every position after
    the difference; a difference only after the chunk changes nothing in it (causal)."""
    heads, head_dim, bs = 4, 16, 4
    runner = SyntheticRunner("NHD", 0, bs, heads, head_dim, dtype)
    tokens = doc(40, 16)
    torch.manual_seed(3)
    image = torch.randn(4, 8)
    embeds = torch.randn(16, 8)
    base = RequestInputs(lora_name="a", mm=[(4, image)])
    chunk = torch.arange(8, 12)  # the third block: after the image (positions 4..7)
    expected = runner.pattern(tokens, chunk, 0, 0, base)
    assert torch.equal(expected, runner.pattern(tokens, chunk, 0, 0, RequestInputs(lora_name="a", mm=[(4, image.clone())])))
    differs = {
        "an earlier token": (tokens[:2] + [tokens[2] + 1] + tokens[3:], base),
        "another adapter": (tokens, RequestInputs(lora_name="b", mm=[(4, image)])),
        "no adapter": (tokens, RequestInputs(mm=[(4, image)])),
        "another image": (tokens, RequestInputs(lora_name="a", mm=[(4, image + 1)])),
        "the image elsewhere": (tokens, RequestInputs(lora_name="a", mm=[(3, image)])),
        "no inputs at all": (tokens, None),
        "prompt embeddings": (tokens, RequestInputs(lora_name="a", mm=[(4, image)], prompt_embeds=embeds)),
    }
    for what, (toks, inputs) in differs.items():
        got = runner.pattern(toks, chunk, 0, 0, inputs)
        assert (got != expected).flatten(1).any(dim=1).all(), what
    # A later difference (a token after the chunk, an image after it) leaves the chunk alone.
    later = tokens[:14] + [tokens[14] + 1] + tokens[15:]
    assert torch.equal(runner.pattern(later, chunk, 0, 0, RequestInputs(lora_name="a", mm=[(4, image), (13, image)])), expected)

    # Through the cache: rows written for one request, checked as another's, are bad rows.
    caches = [PagedKV(t, "NHD", bs) for t in make_kv_caches("NHD", 1, 8, bs, heads, head_dim, dtype).values()]
    table = [3, 1, 6, 0]
    assert runner.forward_batch([(tokens, 0, 16, table, base)], caches)[0][0] == 0
    other = RequestInputs(lora_name="b", mm=[(4, image)])
    assert runner.forward_batch([(tokens, 16, 16, table, other)], caches)[0][0] == 2 * 16  # K and V of all 16


@pytest.mark.parametrize("keys_cover_the_adapter", [True, False])
def test_the_synthetic_runner_shows_kv_served_under_a_key_that_missed_the_adapter(servers, monkeypatch, keys_cover_the_adapter):
    """The soak's engines run the synthetic runner: a chunk key that failed to cover a
    request's adapter (here: extras switched off) serves one adapter's KV to the other, and the
    workers' checks see it, as the TinyDecoder's logits would."""
    from replay.vllm_shapes import LoRARequest

    if not keys_cover_the_adapter:
        import kvtier.integrations.request_keys as request_keys

        monkeypatch.setattr(request_keys, "chunk_extras", lambda *a, **k: None)
    srv = servers.start(chunk_tokens=CT)
    with engine(srv) as e:
        d = doc(48, 5)
        e.add("a", list(d), 2, lora_request=LoRARequest("adapter-a", 1))
        e.run()
        e.add("b", list(d), 2, lora_request=LoRARequest("adapter-b", 2))
        e.run()
        hit = e.sched.finished["b"].num_external_computed_tokens
        if keys_cover_the_adapter:
            assert hit == 0
            assert e.violations == []
        else:
            assert hit == 47  # a's three chunks (the last token computed), under keys that name the tokens only
            assert e.violations and all("KV rows not their token's" in v for v in e.violations), e.violations


def test_the_tiny_decoder_refuses_a_16_bit_kv_cache():
    for dtype in ("float16", "bfloat16"):
        with pytest.raises(ValueError, match="TinyDecoder.*float32 KV caches only"):
            ReplayEngine(socket_path=None, runner="model", dtype=dtype)
    with pytest.raises(ValueError, match="float64"):
        ReplayEngine(socket_path=None, dtype="float64")

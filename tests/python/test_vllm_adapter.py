"""KVTierConnector's scheduler-side semantics, called directly as vLLM's scheduler calls it
(a worker of the replay engine stores the prefix first)."""

from __future__ import annotations

import pickle

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

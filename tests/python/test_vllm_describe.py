"""The vLLM scheduler side describes the chunks it looks up (issue 28: KV events for routers):
once per lookup, with the token ids the hashes were computed from, the request's salt, the
engine's block size and its LoRA adapter (name and int id), and no block extra keys; a
request it does not look up is not described; once the server said it publishes no KV events,
no lookup is described (nothing converted, no call). Driven as vLLM's scheduler calls it, with
the scheduler's kvtier.Connector wrapped to record what it is asked to describe."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest

from kvtier.integrations import vllm as kv_vllm
from kvtier_testing import wait_until
from replay.engine import ReplayEngine
from replay.vllm_shapes import LoRARequest, Request

CT = 16
BS = 4
DOC = list(range(1, 49))  # 48 tokens: 3 full chunks


class RecordingConnector:
    """The scheduler's kvtier.Connector, recording each describe_chunks call (and making it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.described: List[Tuple[List[int], List[int], str, Dict[str, Any]]] = []

    def describe_chunks(self, hashes, tokens, cache_salt="", **kw):
        self.described.append((list(hashes), list(tokens), cache_salt, kw))
        return self.inner.describe_chunks(hashes, tokens, cache_salt, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _engine(srv):
    e = ReplayEngine(socket_path=srv.socket_path, chunk_tokens=CT, block_size=BS)
    rec = RecordingConnector(e.connector.scheduler_side.connector)
    e.connector.scheduler_side.connector = rec
    yield e.connector, rec
    e.connector.scheduler_side.connector = rec.inner
    e.close()


@pytest.fixture
def engine(servers, tmp_path):
    """An engine whose server publishes KV events (so it wants every description)."""
    srv = servers.start(chunk_tokens=CT, extra=["--kv-events", '{"endpoint": "ipc://%s/events"}' % tmp_path])
    yield from _engine(srv)


@pytest.fixture
def quiet_engine(servers):
    """An engine whose server publishes no KV events."""
    yield from _engine(servers.start(chunk_tokens=CT))


def decided(conn: kv_vllm.KVTierConnector, req: Request, computed: int = 0):
    wait_until(lambda: conn.get_num_new_matched_tokens(req, computed)[0] is not None, what="the lookup decided")
    return conn.get_num_new_matched_tokens(req, computed)


def test_a_lookup_describes_its_chunks_once_with_the_tokens_salt_block_size_and_adapter(engine):
    conn, rec = engine
    req = Request("q", DOC + [5, 6, 7], 1, "tenant", lora_request=LoRARequest("adapter-a", 3))
    decided(conn, req)
    for _ in range(3):  # vLLM asks again: no second lookup, no second description
        conn.get_num_new_matched_tokens(req, 0)
    assert len(rec.described) == 1
    hashes, tokens, salt, kw = rec.described[0]
    assert hashes == conn.scheduler_side._requests["q"].hashes  # the hashes the lookup named
    assert tokens == DOC  # the 3 full chunks' tokens, not the partial tail
    assert salt == "tenant"
    assert kw == {"block_size": BS, "lora_name": "adapter-a", "lora_id": 3}  # no block_extra_keys
    assert rec.inner.stats()["descriptions_sent"] == 1
    assert rec.inner.stats()["chunks_described"] == 3
    conn.request_finished(req, [])

    # A plain request: no adapter.
    plain = Request("p", list(range(100, 132)), 1)
    decided(conn, plain)
    assert len(rec.described) == 2
    hashes, tokens, salt, kw = rec.described[1]
    assert tokens == list(range(100, 132)) and salt == ""
    assert kw == {"block_size": BS, "lora_name": "", "lora_id": -1}
    assert rec.inner.stats()["descriptions_sent"] == 2 and rec.inner.describes_chunks
    conn.request_finished(plain, [])


def test_once_the_server_said_it_publishes_no_kv_events_lookups_are_not_described(quiet_engine):
    conn, rec = quiet_engine
    assert rec.inner.describes_chunks  # not known yet: the connection's first description asks
    req = Request("q", DOC + [5, 6, 7], 1)
    decided(conn, req)
    assert len(rec.described) == 1 and rec.inner.stats()["descriptions_sent"] == 1
    # Its server answered described=False (no KV events configured): from then on a lookup
    # converts and sends nothing for a description, and does not call describe_chunks.
    wait_until(lambda: not rec.inner.describes_chunks, what="the server's answer to the description")
    plain = Request("p", list(range(100, 132)), 1)
    decided(conn, plain)
    assert len(rec.described) == 1 and rec.inner.stats()["descriptions_sent"] == 1
    conn.request_finished(req, [])
    conn.request_finished(plain, [])


def test_requests_that_are_not_looked_up_are_not_described(engine):
    conn, rec = engine
    assert conn.get_num_new_matched_tokens(Request("short", DOC[:10], 1), 0) == (0, False)  # no full chunk
    # An adapter without a name cannot be keyed: neither looked up nor described.
    nameless = Request("nameless", DOC, 1, lora_request=LoRARequest(None, 4))  # type: ignore[arg-type]
    assert conn.get_num_new_matched_tokens(nameless, 0) == (0, False)
    assert rec.described == []
    assert rec.inner.stats()["descriptions_sent"] == 0


def test_a_resumed_request_is_looked_up_and_described_again(engine):
    conn, rec = engine
    req = Request("r", DOC + [1], 4)
    decided(conn, req)
    assert len(rec.described) == 1
    conn.scheduler_side._requests["r"].scheduled = True  # it ran a step, then vLLM preempted it
    req._all_token_ids = DOC + [1] + list(range(60, 76))  # grew by output tokens
    decided(conn, req)
    assert len(rec.described) == 2
    assert rec.described[1][1] == (DOC + [1] + list(range(60, 76)))[:64]
    conn.request_finished(req, [])

"""A real (small) model proves the cache exact: the TinyDecoder (replay/model.py; fp32, GQA,
rotary positions, paged attention over the kvtier region) runs under the replay engine
through KVTierConnector, and the logits and greedy tokens of a run that takes its prefix KV
from kvtier equal, bit for bit, those of a run that computes everything with the same chunk
split; the same with the server killed mid-run (the engine recomputes), and with vLLM's own
prefix cache serving part of the prefix. NHD and HND; loads between steps (the default) and
layer by layer within the step (load_mode="layerwise": each layer computes once it landed; a
load that fails has its step's output discarded and recomputed, never a wrong token).

Prints ``RESULT model_max_abs_logit_diff_<layout>=0`` and the mean time to first token of the
requests that share a cached prefix, with and without kvtier
(``RESULT model_ttft_cached_ms_<layout>``, ``RESULT model_ttft_uncached_ms_<layout>``,
``RESULT model_ttft_cached_vs_uncached_<layout>``).
"""

from __future__ import annotations

import statistics
from typing import Dict

import pytest
import torch

from kvtier_testing import FAST_TIMEOUTS_MS
from replay.engine import ReplayEngine

CT = 16
BS = 4
LAYERS = 3
KV_HEADS = 2
HEAD_DIM = 8
GEN = 4  # greedy tokens per request


def tokens(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(1, 100, (n,), generator=g)]


DOC = tokens(160, 1)  # 10 chunks
ROUND2 = {
    "b": DOC + tokens(7, 2),  # the whole document cached, its question computed
    "c": DOC[:100] + tokens(21, 3),  # 6 chunks shared, then a different text
    "whole": list(DOC),  # exactly the cached chunks: the last token is computed
}


def run(
    socket_path,
    layout: str,
    *,
    kill_at_load: bool = False,
    prefix_caching: bool = False,
    server=None,
    load_mode: str = "async",
) -> Dict:
    extra = dict(FAST_TIMEOUTS_MS, load_mode=load_mode)
    with ReplayEngine(
        socket_path=socket_path,
        layout=layout,
        runner="model",
        num_layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BS,
        num_blocks=256,
        chunk_tokens=CT,
        token_budget=64,
        prefix_caching=prefix_caching,
        extra=extra,
    ) as e:
        e.add("a", DOC + tokens(9, 4), GEN)
        e.run()
        killed = []

        def kill(so):
            if kill_at_load and so.kv_connector_metadata is not None and so.kv_connector_metadata.plan.loads and not killed:
                server.kill()
                killed.append(True)

        for rid, prompt in ROUND2.items():
            e.add(rid, prompt, GEN)
        e.run(before_workers=kill)
        assert e.violations == []
        if kill_at_load:
            assert killed, "the server was to be killed with loads in flight"
        if load_mode == "layerwise":
            assert e.sched.reports["recving"] == []  # synchronous loads are never reported
        f = e.sched.finished
        return {
            "discarded": e.discarded,
            "logits": dict(e.logits),
            "tokens": {rid: list(r.output_token_ids) for rid, r in f.items()},
            "ext": {rid: r.num_external_computed_tokens for rid, r in f.items()},
            "ttft": {rid: e.ttft[rid] for rid in ROUND2},
        }


def max_abs_diff(a: Dict, b: Dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_bit_equal(got: Dict, want: Dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["logits"].keys() == want["logits"].keys()
    for k in want["logits"]:
        assert torch.equal(got["logits"][k], want["logits"][k]), f"logits of {k} differ"


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_logits_with_the_prefix_from_kvtier_equal_a_full_recompute_bit_for_bit(servers, layout, capsys):
    baseline = run(None, layout)
    assert len(baseline["logits"]) == 4 * GEN
    assert all(v == 0 for v in baseline["ext"].values())

    srv = servers.start(chunk_tokens=CT, name="cached")
    cached = run(srv.socket_path, layout)
    assert cached["ext"] == {"a": 0, "b": 160, "c": 96, "whole": 159}
    assert_bit_equal(cached, baseline)

    # vLLM's prefix cache holds a's blocks: it serves part of the prefix, kvtier the rest.
    mixed = run(srv.socket_path, layout, prefix_caching=True)
    assert_bit_equal(mixed, baseline)

    srv2 = servers.start(chunk_tokens=CT, name="killed")
    killed = run(srv2.socket_path, layout, kill_at_load=True, server=srv2)
    assert_bit_equal(killed, baseline)

    diff = max(max_abs_diff(cached["logits"], baseline["logits"]), max_abs_diff(killed["logits"], baseline["logits"]))
    assert diff == 0.0
    with_cache = statistics.mean(cached["ttft"].values()) * 1000
    without = statistics.mean(baseline["ttft"].values()) * 1000
    with capsys.disabled():
        name = layout.lower()
        print()
        print(f"RESULT model_max_abs_logit_diff_{name}={diff:g}")
        print(f"RESULT model_ttft_cached_ms_{name}={with_cache:.3f}")
        print(f"RESULT model_ttft_uncached_ms_{name}={without:.3f}")
        print(f"RESULT model_ttft_cached_vs_uncached_{name}={with_cache / without:.4f}")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_layerwise_loading_gives_the_same_logits_bit_for_bit(servers, layout):
    baseline = run(None, layout)
    srv = servers.start(chunk_tokens=CT, name="layerwise")
    cached = run(srv.socket_path, layout, load_mode="layerwise")
    assert cached["ext"] == {"a": 0, "b": 160, "c": 96, "whole": 159}  # hits and a partial hit
    assert cached["discarded"] == 0
    assert_bit_equal(cached, baseline)

    mixed = run(srv.socket_path, layout, prefix_caching=True, load_mode="layerwise")
    assert_bit_equal(mixed, baseline)

    # The server killed as the loads go out: the steps that ran on blocks that never landed
    # are discarded (vLLM's load-error path) and recomputed.
    srv2 = servers.start(chunk_tokens=CT, name="layerwise-killed")
    killed = run(srv2.socket_path, layout, kill_at_load=True, server=srv2, load_mode="layerwise")
    assert killed["discarded"] >= 1
    assert_bit_equal(killed, baseline)

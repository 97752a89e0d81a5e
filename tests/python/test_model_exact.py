"""A real (small) model proves the cache exact: the TinyDecoder (replay/model.py; fp32, GQA,
rotary positions, paged attention over the kvtier region) runs under the replay engine
through KVTierConnector, and the logits and greedy tokens of a run that takes its prefix KV
from kvtier equal, bit for bit, those of a run that computes everything with the same chunk
split; the same with the server killed mid-run (the engine recomputes), and with vLLM's own
prefix cache serving part of the prefix. NHD and HND; loads between steps (the default) and
layer by layer within the step (load_mode="layerwise": each layer computes once it landed; a
load that fails has its step's output discarded and recomputed, never a wrong token).

Requests with the same token ids and another LoRA adapter, image or prompt embeddings (the
TinyDecoder takes each) get their own KV at tensor-parallel size 2 (a scheduler and two worker
processes, each on its own connection), from L1 on a second engine and from a disk L2 after a
server restart, never each other's: ``RESULT logits_max_abs_diff=0`` over every case.

Prints ``RESULT model_max_abs_logit_diff_<layout>=0`` and the mean time to first token of the
requests that share a cached prefix, with and without kvtier
(``RESULT model_ttft_cached_ms_<layout>``, ``RESULT model_ttft_uncached_ms_<layout>``,
``RESULT model_ttft_cached_vs_uncached_<layout>``).
"""

from __future__ import annotations

import json
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


def model_engine(socket_path, **kw) -> ReplayEngine:
    """A replay engine running the TinyDecoder of this file's shape (``kw``: layout, world
    size, prefix caching, the connector's extra config)."""
    return ReplayEngine(
        socket_path=socket_path,
        runner="model",
        num_layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BS,
        num_blocks=256,
        chunk_tokens=CT,
        token_budget=64,
        **kw,
    )


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
    with model_engine(socket_path, layout=layout, prefix_caching=prefix_caching, extra=extra) as e:
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


# --- keys beyond the tokens (issue 24): an adapter, an image, prompt embeddings ------------------
#
# Each kind has two variants "a" and "b" with the same token ids: another LoRA adapter (a
# low-rank delta on V), another image at the same placeholder tokens, other prompt embeddings
# (an embeddings-only prompt: its token ids are all zero). Their KV differs, so a request
# served the other variant's chunks would get other logits. The engine runs at tensor-parallel
# size 2: the scheduler and two worker processes, each on its own connection to the server.

KEY_PROMPT = tokens(70, 21)  # 4 full chunks: 64 tokens can hit
KEY_IMAGE_AT, KEY_IMAGE_LEN = 8, 20  # placeholder positions 8..27: chunks 0 and 1
KEY_KINDS = ["lora", "image", "embeds"]
TP = 2


def key_request(kind: str, v: str) -> Dict:
    from replay.vllm_shapes import LoRARequest, MultiModalFeatureSpec, PlaceholderRange

    seed = {"a": 1, "b": 2}[v]
    g = torch.Generator().manual_seed(1000 * seed + len(kind))
    if kind == "lora":
        return dict(prompt=KEY_PROMPT, lora_request=LoRARequest(f"adapter-{v}", seed))
    if kind == "image":
        prompt = list(KEY_PROMPT)
        prompt[KEY_IMAGE_AT : KEY_IMAGE_AT + KEY_IMAGE_LEN] = [7] * KEY_IMAGE_LEN
        rows = torch.randn(KEY_IMAGE_LEN, 32, generator=g)  # the TinyDecoder's hidden size
        mm = MultiModalFeatureSpec(rows, "image", f"image-{v}", PlaceholderRange(KEY_IMAGE_AT, KEY_IMAGE_LEN))
        return dict(prompt=prompt, mm_features=[mm])
    assert kind == "embeds"
    return dict(prompt=None, prompt_embeds=torch.randn(len(KEY_PROMPT), 32, generator=g))


def run_keys(socket_path, tag: str, variants) -> Dict:
    """One engine (TP 2) runs one request per kind and variant, variant by variant (each
    round to completion, so a later variant can only hit what an earlier one stored).
    Returns per (kind, variant): the logits, the greedy tokens, the hit the scheduler
    decided and the tokens the workers loaded."""
    with model_engine(socket_path, world_size=TP, layout="NHD", extra=dict(FAST_TIMEOUTS_MS)) as e:
        decided: Dict[str, int] = {}
        if e.connector is not None:
            inner = e.connector.get_num_new_matched_tokens

            def recorded(request, num_computed_tokens):
                n, load_async = inner(request, num_computed_tokens)
                if n is not None:
                    decided.setdefault(request.request_id, n + num_computed_tokens)
                return n, load_async

            e.connector.get_num_new_matched_tokens = recorded
        for v in variants:
            for kind in KEY_KINDS:
                args = key_request(kind, v)
                e.add(f"{tag}-{kind}-{v}", args.pop("prompt"), GEN, **args)
            e.run()
        assert e.violations == []
        out = {}
        for v in variants:
            for kind in KEY_KINDS:
                rid = f"{tag}-{kind}-{v}"
                r = e.sched.finished[rid]
                out[(kind, v)] = {
                    "logits": {n: t for (i, n), t in e.logits.items() if i == rid},
                    "tokens": list(r.output_token_ids),
                    "decided": decided.get(rid, 0),
                    "loaded": r.num_external_computed_tokens,
                }
        return out


def test_adapter_image_and_prompt_embeddings_get_their_own_kv_bit_for_bit(servers, tmp_path, capsys):
    baseline = run_keys(None, "base", ["a", "b"])
    for (kind, v), r in baseline.items():
        assert len(r["logits"]) == GEN and r["loaded"] == 0
    # Variant b's logits differ from a's (else the test could not see a wrong load).
    for kind in KEY_KINDS:
        first = min(baseline[(kind, "a")]["logits"])
        assert not torch.equal(baseline[(kind, "a")]["logits"][first], baseline[(kind, "b")]["logits"][first])

    disk = json.dumps({"type": "disk", "path": str(tmp_path / "l2"), "capacity_gb": 0.0625})
    srv = servers.start(chunk_tokens=CT, extra=["--l2-backend", disk], name="keys-exact")
    runs = {}
    # 1: a stores; b (the same tokens) must find none of a's chunks.
    runs["first"] = run_keys(srv.socket_path, "r1", ["a", "b"])
    # 2: another engine (new scheduler and worker connections): both hit every chunk (L1).
    runs["second engine"] = run_keys(srv.socket_path, "r2", ["a", "b"])
    # 3: a restarted server: every hit comes from the disk, named by keys a new process made.
    srv.terminate()
    srv.start()
    runs["after restart"] = run_keys(srv.socket_path, "r3", ["a", "b"])

    diff = 0.0
    for name, run in runs.items():
        for key, r in run.items():
            want = baseline[key]
            assert r["tokens"] == want["tokens"], f"{name} {key}: greedy tokens differ"
            assert r["logits"].keys() == want["logits"].keys()
            for n in want["logits"]:
                diff = max(diff, float((r["logits"][n] - want["logits"][n]).abs().max()))
                assert torch.equal(r["logits"][n], want["logits"][n]), f"{name} {key}: logits at {n} differ"
    hits = {name: {f"{k}-{v}": (r["decided"], r["loaded"]) for (k, v), r in run.items()} for name, run in runs.items()}
    for kind in KEY_KINDS:
        assert hits["first"][f"{kind}-a"] == (0, 0)
        assert hits["first"][f"{kind}-b"] == (0, 0), f"{kind}: b was offered a's chunks"
        for v in "ab":
            assert hits["second engine"][f"{kind}-{v}"] == (64, 64), hits
            decided, loaded = hits["after restart"][f"{kind}-{v}"]
            assert decided == 64, hits
            # The workers' retrieves use the scheduler's lookup (one engine on the server), so
            # every rank copies the whole decided hit as its loads from the disk land.
            assert loaded == 64, hits
    assert diff == 0.0
    with capsys.disabled():
        print()
        print(f"RESULT logits_max_abs_diff={diff:g}")
        loaded = sum(h[1] for h in hits["after restart"].values())
        print(f"RESULT keys_disk_hit_tokens_loaded={loaded}")
        print(f"RESULT keys_disk_hit_tokens_decided={sum(h[0] for h in hits['after restart'].values())}")

"""Chunk keys that know what vLLM's block hash knows (python/kvtier/integrations/request_keys.py).

Two requests with the same token ids and a different LoRA adapter, image, prompt embeddings or
cache salt compute different KV; vLLM's block hash tells them apart and so must kvtier's chunk
keys, or one is served the other's KV. Before the keys covered them, each of the first three
pairs hit 96 of 96 tokens of the other's chunks. Identical requests must still hit: across two
engines (separate scheduler and worker connections) and across a server restart with a disk
L2, which needs keys that are equal in every process (never Python's hash() or vLLM's
per-process NONE_HASH).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

import kvtier
from kvtier.integrations.config import KVTierConfig
from kvtier.integrations.request_keys import EXTRA_VERSION, MultiModalSpan, chunk_extras, request_keys
from kvtier.integrations.scheduler_side import SchedulerSide
from kvtier_testing import FAST_TIMEOUTS_MS
from replay.engine import ReplayEngine
from replay.vllm_shapes import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request

CT = 16
BS = 4
HIDDEN = 32  # the TinyDecoder's hidden size (the rows of images and prompt embeddings)


def tokens(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(1, 100, (n,), generator=g)]


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


PROMPT = tokens(100, 7)  # 6 full chunks: 96 tokens can hit
IMAGE_AT, IMAGE_LEN, PLACEHOLDER = 4, 24, 7  # positions 4..27: chunks 0 and 1


def image(identifier: str, seed: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(rows(IMAGE_LEN, seed), "image", identifier, PlaceholderRange(IMAGE_AT, IMAGE_LEN))


def image_prompt() -> list:
    p = list(PROMPT)
    p[IMAGE_AT : IMAGE_AT + IMAGE_LEN] = [PLACEHOLDER] * IMAGE_LEN
    return p


#: Per kind, the inputs of a request: variant "a", "b" (the same tokens, another adapter /
#: image / embeddings / salt) and "c" (a third one, first seen after the restart).
def variant(kind: str, v: str) -> Dict:
    seed = {"a": 1, "b": 2, "c": 3}[v]
    if kind == "lora":
        return dict(prompt=PROMPT, lora_request=LoRARequest(f"adapter-{v}", seed))
    if kind == "image":
        return dict(prompt=image_prompt(), mm_features=[image(f"image-{v}", seed)])
    if kind == "embeds":
        return dict(prompt=None, prompt_embeds=rows(len(PROMPT), 100 + seed))
    if kind == "salt":
        return dict(prompt=PROMPT, cache_salt=f"tenant-{v}")
    raise AssertionError(kind)


KINDS = ["lora", "image", "embeds", "salt"]


class Recorder:
    """The hits the scheduler's connector decided (get_num_new_matched_tokens' answer), by id."""

    def __init__(self, engine: ReplayEngine) -> None:
        self.decided: Dict[str, int] = {}
        c = engine.connector
        inner = c.get_num_new_matched_tokens

        def wrapped(request, num_computed_tokens):
            n, load_async = inner(request, num_computed_tokens)
            if n is not None:
                self.decided.setdefault(request.request_id, n + num_computed_tokens)
            return n, load_async

        c.get_num_new_matched_tokens = wrapped


def make_engine(socket_path: Path, world_size: int = 2) -> ReplayEngine:
    return ReplayEngine(
        socket_path=socket_path,
        world_size=world_size,
        block_size=BS,
        num_blocks=256,
        chunk_tokens=CT,
        token_budget=64,
        extra=dict(FAST_TIMEOUTS_MS),
    )


def run_round(engine: ReplayEngine, tag: str, v: str, kinds=KINDS) -> Dict[str, int]:
    """Runs one request per kind (variant v) to completion; returns the tokens each loaded."""
    for kind in kinds:
        args = variant(kind, v)
        prompt = args.pop("prompt")
        engine.add(f"{tag}-{kind}-{v}", prompt, 2, **args)
    engine.run()
    assert engine.violations == []
    f = engine.sched.finished
    return {kind: f[f"{tag}-{kind}-{v}"].num_external_computed_tokens for kind in kinds}


def test_requests_differing_only_in_adapter_image_embeddings_or_salt_never_share_a_chunk(servers, tmp_path):
    disk = json.dumps({"type": "disk", "path": str(tmp_path / "l2"), "capacity_gb": 0.0625})
    srv = servers.start(chunk_tokens=CT, extra=["--l2-backend", disk], name="keys")

    with make_engine(srv.socket_path) as e1:
        assert run_round(e1, "r1", "a") == dict.fromkeys(KINDS, 0)  # the first of each: stored
        # The same tokens with another adapter, image, embeddings or salt: no chunk of the
        # first may serve them (before the keys covered them: 96 of 96 tokens hit).
        assert run_round(e1, "r1", "b") == dict.fromkeys(KINDS, 0)

    # Identical requests on another engine (new scheduler and worker connections): every
    # full chunk hits (the last token is computed: 96 of 100).
    with make_engine(srv.socket_path) as e2:
        assert run_round(e2, "r2", "a") == dict.fromkeys(KINDS, 96)
        assert run_round(e2, "r2", "b") == dict.fromkeys(KINDS, 96)

    # A restart: L1 is empty, the chunks come from the disk, named by keys that a new process
    # computed. A third variant of each kind still finds nothing.
    srv.terminate()
    srv.start()
    with make_engine(srv.socket_path) as e3:
        rec = Recorder(e3)
        served = run_round(e3, "r3", "a")
        assert {k: rec.decided[f"r3-{k}-a"] for k in KINDS} == dict.fromkeys(KINDS, 96)
        # What the workers served of the decided hit: all of it. The scheduler's lookup and the
        # workers' retrieves are one engine on the server (engine_id), so each rank's retrieve
        # copies every chunk as its load from the disk lands (before: a rank stopped at the
        # first chunk still loading and recomputed the rest).
        assert served == dict.fromkeys(KINDS, 96), served
        assert run_round(e3, "r3", "c") == dict.fromkeys(KINDS, 0)
        assert {k: rec.decided[f"r3-{k}-c"] for k in KINDS} == dict.fromkeys(KINDS, 0)


# --- the key material itself -----------------------------------------------------------------


def test_a_plain_prompt_keeps_the_keys_it_always_had():
    # No adapter, image or embeddings: no extras at all, and the chunk hashes are the token
    # hashes of before (caches of C++ engines and the mini engine stay valid).
    req = Request("p", PROMPT, 2)
    keys = request_keys(req, CT)
    assert keys.extras is None and keys.uncacheable is None
    h = kvtier.TokenHasher(CT)
    assert h.chunk_hashes(keys.tokens, keys.extras) == h.chunk_hashes(PROMPT)
    assert h.chunk_hashes(PROMPT, [b""] * 6) == h.chunk_hashes(PROMPT)
    with pytest.raises(ValueError, match="5 extras for 6 full chunks"):
        h.chunk_hashes(PROMPT, [b""] * 5)
    with pytest.raises(TypeError, match="each extra is bytes"):
        h.chunk_hashes(PROMPT, ["x"] * 6)


def test_a_multimodal_input_keys_every_chunk_its_placeholders_touch_relative_to_the_chunk():
    span = MultiModalSpan("image-a", "image", 20, 20)  # positions 20..39: chunks 1 and 2
    ex = chunk_extras(64, CT, mm_spans=[span])
    assert ex is not None and len(ex) == 4
    assert ex[0] == b"" and ex[3] == b""  # before the image (causal) and after it (the chain has it)

    def m_field(offset: int) -> bytes:
        payload = (
            (5).to_bytes(4, "little") + b"image" + (7).to_bytes(4, "little") + b"image-a"
            + offset.to_bytes(8, "little", signed=True) + (20).to_bytes(8, "little")
        )
        return b"M" + len(payload).to_bytes(4, "little") + payload

    assert ex[1] == EXTRA_VERSION + m_field(4)  # starts 4 tokens into chunk 1
    assert ex[2] == EXTRA_VERSION + m_field(-12)  # began 12 tokens before chunk 2
    # Another image at the same placeholders: chunk 0 is shared, every chunk from 1 differs.
    other = chunk_extras(64, CT, mm_spans=[MultiModalSpan("image-b", "image", 20, 20)])
    h = kvtier.TokenHasher(CT)
    toks = tokens(64, 3)
    a, b = h.chunk_hashes(toks, ex), h.chunk_hashes(toks, other)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:]))
    # The same image one position later is another request too.
    moved = chunk_extras(64, CT, mm_spans=[MultiModalSpan("image-a", "image", 21, 20)])
    assert h.chunk_hashes(toks, moved)[1] != a[1]
    # The order the inputs are listed in does not matter; their places do.
    two = [MultiModalSpan("x", "image", 0, 4), MultiModalSpan("y", "audio", 8, 4)]
    assert chunk_extras(16, CT, mm_spans=two) == chunk_extras(16, CT, mm_spans=two[::-1])


def test_an_image_spanning_a_chunk_boundary_shares_the_chunks_before_it(servers):
    # Requests with the same text and different images share the chunks that end before the
    # image (their KV cannot depend on it), and nothing from the first chunk it touches.
    srv = servers.start(chunk_tokens=CT, name="boundary")
    prompt = list(PROMPT)
    prompt[40:60] = [PLACEHOLDER] * 20  # chunks 2 and 3
    with make_engine(srv.socket_path, world_size=1) as e:
        for rid, ident in (("a", "image-a"), ("b", "image-b"), ("a2", "image-a")):
            mm = MultiModalFeatureSpec(rows(20, 1), "image", ident, PlaceholderRange(40, 20))
            e.add(rid, prompt, 2, mm_features=[mm])
            e.run()
        ext = {rid: r.num_external_computed_tokens for rid, r in e.sched.finished.items()}
    assert ext == {"a": 0, "b": 32, "a2": 96}


def test_prompt_embeddings_key_the_rows_of_each_chunk_and_outputs_by_their_ids():
    emb = rows(40, 5)  # 40 prompt positions: chunk 2 holds 8 of them and 8 outputs
    ex = chunk_extras(48, CT, num_prompt_tokens=40, prompt_embeds=emb)
    assert ex is not None and all(x.startswith(EXTRA_VERSION + b"E") for x in ex)
    # A tensor of another dtype or with one row changed keys differently, from that chunk on.
    assert chunk_extras(48, CT, num_prompt_tokens=40, prompt_embeds=emb.to(torch.float16))[0] != ex[0]
    emb2 = emb.clone()
    emb2[20, 3] += 1.0
    ex2 = chunk_extras(48, CT, num_prompt_tokens=40, prompt_embeds=emb2)
    assert ex2[0] == ex[0] and ex2[1] != ex[1] and ex2[2] == ex[2]
    # bfloat16 (no numpy type) is hashed by its raw bytes too.
    assert chunk_extras(16, CT, prompt_embeds=emb[:16].to(torch.bfloat16)) is not None
    # The last chunk's embedding rows are its 8 prompt positions (the shape says so).
    assert (8).to_bytes(8, "little") + (HIDDEN).to_bytes(8, "little") in ex[2]


def test_a_preempted_request_keys_its_chunks_as_before_and_output_chunks_consistently():
    # After a preemption the scheduler looks the longer sequence (prompt + outputs) up: the
    # prompt's chunks must keep their keys (they name what was stored), and a chunk that holds
    # output tokens must be keyed the way a later prompt of the same inputs keys it.
    for kind in ("lora", "image", "embeds"):
        args = variant(kind, "a")
        prompt = args.pop("prompt")
        args.pop("cache_salt", None)
        req = Request("x", prompt, 40, **args)
        before = request_keys(req, CT)
        for t in tokens(30, 9):
            req.append_output_token(t)
        after = request_keys(req, CT)
        h = kvtier.TokenHasher(CT)
        hb, ha = h.chunk_hashes(before.tokens, before.extras), h.chunk_hashes(after.tokens, after.extras)
        assert len(hb) == 6 and len(ha) == 8
        assert ha[:6] == hb
        assert after.num_prompt_tokens == 100
    # A chunk of outputs after a text-only prompt: its key is its token ids' (no extra).
    req = Request("y", PROMPT, 40)
    for t in tokens(30, 9):
        req.append_output_token(t)
    assert request_keys(req, CT).extras is None


def test_a_request_that_cannot_be_keyed_is_neither_looked_up_nor_stored(caplog):
    class Lookups:  # a scheduler connector that records what it was asked
        describes_chunks = True

        def __init__(self) -> None:
            self.asked = []

        def lookup_hashes(self, rid, hashes, salt):
            self.asked.append(rid)

        def describe_chunks(self, hashes, tokens, salt="", **extras):
            self.asked.append(("described", list(hashes)))

        def lookup_result(self, rid):
            return 0

    conn = Lookups()
    side = SchedulerSide(KVTierConfig(socket_path="/nonexistent", model_name="m", chunk_tokens=CT, block_size=BS), connector=conn)
    nameless = MultiModalFeatureSpec(rows(4, 1), "image", "", PlaceholderRange(0, 4))
    req = Request("u", PROMPT, 2, mm_features=[nameless])
    keys = request_keys(req, CT)
    assert keys.uncacheable is not None and "identifier" in keys.uncacheable
    with caplog.at_level("WARNING", logger="kvtier"):
        assert side.num_new_matched_tokens("u", keys, 0) == (0, False)
    assert conn.asked == [] and side.tracked() == 0  # no state: build_step stores nothing of it
    assert "neither looked up nor stored" in caplog.text
    with pytest.raises(ValueError, match="in the RequestKeys"):
        side.num_new_matched_tokens("v", request_keys(Request("v", PROMPT, 2), CT), 0, cache_salt="s")


def test_the_key_material_is_built_once_per_lookup():
    # While a lookup is pending vLLM asks every step; a digest of prompt embeddings (hundreds
    # of MiB for a long prompt) must not be recomputed each time.
    class Pending:
        describes_chunks = True

        def __init__(self) -> None:
            self.asked = []
            self.described = []
            self.polls = 0

        def lookup_hashes(self, rid, hashes, salt):
            self.asked.append((rid, list(hashes)))

        def describe_chunks(self, hashes, tokens, salt="", **extras):
            self.described.append((list(hashes), list(tokens)))

        def lookup_result(self, rid):
            self.polls += 1
            return None if self.polls < 3 else 32

    conn = Pending()
    side = SchedulerSide(KVTierConfig(socket_path="/nonexistent", model_name="m", chunk_tokens=CT, block_size=BS), connector=conn)
    built = []
    req = Request("w", None, 2, prompt_embeds=rows(40, 3))

    def keys_of_w():
        built.append(1)
        return request_keys(req, CT)

    assert side.num_new_matched_tokens("w", keys_of_w, 0) == (None, True)
    assert side.num_new_matched_tokens("w", keys_of_w, 0) == (None, True)
    assert side.num_new_matched_tokens("w", keys_of_w, 0) == (32, True)
    assert len(built) == 1
    # One lookup, of the hashes with the embeddings' extras (not the zeros' plain hashes).
    h = kvtier.TokenHasher(CT)
    keys = request_keys(req, CT)
    assert conn.asked == [("w", h.chunk_hashes(keys.tokens, keys.extras))]
    assert conn.asked[0][1] != h.chunk_hashes([0] * 40)
    # Described once too, with those hashes and the (zero) token ids of the 2 full chunks.
    assert conn.described == [(conn.asked[0][1], [0] * 32)]


_KEYS_SCRIPT = r"""
import json, sys, torch
sys.path[:0] = json.loads(sys.argv[1])
import kvtier
from kvtier.integrations.request_keys import request_keys
from replay.vllm_shapes import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request
g = torch.Generator().manual_seed(11)
emb = torch.randn(40, 32, generator=g)
req = Request("k", None, 2, cache_salt="s", lora_request=LoRARequest("adapter-a", 1),
              mm_features=[MultiModalFeatureSpec(None, "image", "image-a", PlaceholderRange(6, 12))],
              prompt_embeds=emb)
keys = request_keys(req, 16)
print(json.dumps({"extras": [x.hex() for x in keys.extras],
                  "hashes": [hex(h) for h in kvtier.TokenHasher(16).chunk_hashes(keys.tokens, keys.extras)]}))
"""


def test_keys_are_the_same_in_every_process():
    # Two processes with different hash seeds (Python's hash() differs between them) compute
    # the same extras and the same chunk hashes; the first chunk's hash is pinned, so a change
    # of the encoding (which would orphan every stored chunk of such requests) fails here.
    path = json.dumps([p for p in sys.path if p])
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT, path], capture_output=True, text=True, env=env, check=True)
        outs.append(json.loads(r.stdout))
    assert outs[0] == outs[1]
    assert len(outs[0]["hashes"]) == 2
    assert outs[0]["extras"][0].startswith(EXTRA_VERSION.hex())
    # Computed independently from the encoding of docs/integration.md ("vLLM") with
    # Python's xxhash, struct and hashlib (not with kvtier).
    assert outs[0]["hashes"] == ["0x90593e0754c99c766c22a4d5f2e90031", "0x8b0c6394836b4cd1d15898541b320ca0"]

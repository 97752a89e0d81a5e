"""What one engine step costs the vLLM connector's scheduler side, as properties that hold on
any machine (the timings are bench/vllm_step_overhead.py's; docs/performance.md, "vLLM
connector: cost per step"):

* a decode step hashes nothing and reads no request's key material: a request's chunks are
  hashed once, at its lookup, however long it runs;
* the calls one step's plan makes do not grow with the requests' prompt length or age; a
  decode step of requests with nothing left to store makes none per request unless it hands
  the request a block (and then a constant number);
* the per-step path the connector takes (``plan_step`` over ``scheduled_rows(output,
  watched)``: tuples, no object per request, no row for a request whose step plans nothing)
  plans exactly what ``build_step`` over ``step_input_from`` (every row, as objects) plans, on
  random schedules with chunked prefill, hits, preemptions, resumptions, load errors, blocks
  allocated ahead of the tokens and requests too short to store;
* every block a step writes was fenced since its request got it, whatever rows were left out.

No server: the scheduler side runs on a stand-in of its connector (its lookups answer at once).
"""

from __future__ import annotations

import random
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import pytest

from kvtier import TokenHasher
from kvtier.integrations.config import KVTierConfig
from kvtier.integrations.plan import ScheduledRequest, StepInput
from kvtier.integrations.scheduler_side import SchedulerSide
from kvtier.integrations.vllm_scheduler_output import preempted_ids, scheduled_rows, step_input_from
from replay.vllm_shapes import CachedRequestData, NewRequestData, SchedulerOutput

BS, CT = 4, 16


class Lookups:
    """A scheduler connector whose lookups answer at once, with ``answer(request_id)`` tokens."""

    describes_chunks = True  # a server that publishes KV events

    def __init__(self, answer=lambda rid: 0) -> None:
        self.answer = answer
        self.answers: Dict[str, int] = {}

    def lookup_hashes(self, rid: str, hashes: Any, salt: str) -> None:
        self.answers[rid] = self.answer(rid)

    def describe_chunks(self, *args: Any, **kwargs: Any) -> None:
        pass

    def lookup_result(self, rid: str) -> int:
        return self.answers.get(rid, 0)

    def free_lookup_locks(self, rid: str) -> None:
        pass

    def end_request(self, rid: str) -> None:
        pass


class CountingHasher:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0
        self.given: List[Any] = []

    def chunk_hashes(self, tokens: Any, extras: Any = None) -> Any:
        self.calls += 1
        self.given.append(tokens)
        return self.inner.chunk_hashes(tokens, extras)


def make_side(answer=lambda rid: 0, kv_role: str = "kv_both", load_mode: str = "async") -> SchedulerSide:
    cfg = KVTierConfig(socket_path="/nonexistent", model_name="m", block_size=BS, chunk_tokens=CT, kv_role=kv_role,
                       load_mode=load_mode)
    return SchedulerSide(cfg, connector=Lookups(answer))


def decode_output(tables: Dict[str, List[int]], computed: Dict[str, int]) -> SchedulerOutput:
    """vLLM's SchedulerOutput of a step in which every request decodes one token (a new block
    when its token starts one)."""
    cached = CachedRequestData()
    for rid, table in tables.items():
        pos = computed[rid]
        new = None
        if pos // BS >= len(table):
            table.append(1000 + len(table) + 100 * int(rid[1:]))
            new = ([table[-1]],)
        cached.req_ids.append(rid)
        cached.new_block_ids.append(new)
        cached.num_computed_tokens.append(pos)
        cached.num_output_tokens.append(0)
        cached.new_token_ids.append([])
    return SchedulerOutput([], cached, {rid: 1 for rid in tables}, len(tables), set())


def running(side: SchedulerSide, n: int, prompt_tokens: int):
    """n requests looked up, admitted and prefilled whole (their full chunks stored); returns
    their block tables and computed token counts."""
    tables: Dict[str, List[int]] = {}
    new = []
    for i in range(n):
        rid = f"r{i}"
        tokens = [(i * 7919 + t) % 50000 + 1 for t in range(prompt_tokens)]
        assert side.num_new_matched_tokens(rid, lambda t=tokens: t, 0) == (0, False)
        tables[rid] = list(range(100 * i, 100 * i + -(-prompt_tokens // BS)))
        side.after_alloc(rid, tables[rid], 0)
        new.append(NewRequestData(rid, tokens, (list(tables[rid]),), 0))
    so = SchedulerOutput(new, CachedRequestData(), {r: prompt_tokens for r in tables}, n * prompt_tokens, set())
    plan = side.plan_step(preempted_ids(so), scheduled_rows(so, side.watched))
    assert len(plan.stores) == (n if prompt_tokens >= CT else 0)
    return tables, {rid: prompt_tokens for rid in tables}


def step_calls(side: SchedulerSide, so: SchedulerOutput) -> int:
    """Python and C functions called while the scheduler side plans ``so``."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        side.plan_step(preempted_ids(so), scheduled_rows(so, side.watched))
    finally:
        sys.setprofile(None)
    return calls


def test_a_decode_step_hashes_nothing_and_reads_no_key_material():
    side = make_side()
    side._hasher = CountingHasher(side._hasher)
    asked = []

    def keys(tokens: List[int]):
        def read() -> List[int]:
            asked.append(1)
            return tokens

        return read

    tables: Dict[str, List[int]] = {}
    prompt = 5 * CT + 3
    new = []
    for i in range(8):
        rid = f"r{i}"
        tokens = list(range(i * 100 + 1, i * 100 + 1 + prompt))
        side.num_new_matched_tokens(rid, keys(tokens), 0)
        side.num_new_matched_tokens(rid, keys(tokens), 0)  # vLLM asks again: nothing recomputed
        tables[rid] = list(range(100 * i, 100 * i + 21))
        side.after_alloc(rid, tables[rid], 0)
        new.append(NewRequestData(rid, tokens, (list(tables[rid]),), 0))
    assert side._hasher.calls == 8 and len(asked) == 8
    # The prefill, as vLLM first schedules a request: a new request, its whole table written
    # (and fenced) and its 5 full chunks stored.
    so = SchedulerOutput(new, CachedRequestData(), {rid: prompt for rid in tables}, 8 * prompt, set())
    plan = side.plan_step(preempted_ids(so), scheduled_rows(so, side.watched))
    assert len(plan.stores) == 8 and sorted(plan.fence_blocks) == sorted(b for t in tables.values() for b in t)
    computed = {rid: prompt for rid in tables}
    for step in range(3 * CT):
        plan = side.plan_step([], scheduled_rows(decode_output(tables, computed), side.watched))
        # A block is fenced by the first step that writes it since the request got it (each new
        # block's first token); the request's later tokens go into a block it already fenced.
        starts = computed["r0"] % BS == 0
        assert plan.stores == [] and len(plan.fence_blocks) == (8 if starts else 0)
        for rid in computed:
            computed[rid] += 1
    assert side._hasher.calls == 8 and len(asked) == 8  # decode steps hashed nothing


def test_a_decode_steps_calls_do_not_grow_with_the_prompt_nor_with_requests_that_get_no_block():
    def calls(n: int, prompt_tokens: int, new_block: bool) -> int:
        side = make_side()
        tables, computed = running(side, n, prompt_tokens)
        for rid in computed:  # every request's step the same: its token starts a new block, or not
            computed[rid] = -(-computed[rid] // BS) * BS if new_block else computed[rid] + 1
        return step_calls(side, decode_output(tables, computed))

    for new_block in (False, True):
        short, long = calls(32, CT + 1, new_block), calls(32, 40 * CT + 1, new_block)
        assert short == long, (new_block, short, long)  # no per-step work proportional to the prompt
    # Nothing left to store and no new block: the step plans nothing and its row is left out,
    # at no call (before: 4 per request, two dict lookups, a len and an append).
    c16, c32, c64 = (calls(n, 2 * CT + 1, False) for n in (16, 32, 64))
    assert c16 == c32 == c64, (c16, c32, c64)
    # A new block (a request's step in every block_size, in decode): a constant per request,
    # and a small one (first_group's list, the block's fence, the dict lookup, ...).
    c16, c32, c64 = (calls(n, 2 * CT + 1, True) for n in (16, 32, 64))
    assert c64 - c32 == 2 * (c32 - c16), (c16, c32, c64)
    assert (c32 - c16) / 16 <= 8, (c16, c32)


@pytest.mark.parametrize("waiting", [False, True])
def test_every_block_a_step_writes_was_fenced_since_the_request_got_it(waiting: bool):
    """The fence's contract (a store still reading a block handed over to another request is
    dropped): every block a step writes was fenced in that step or in an earlier step since
    the request got it (a block's generation bump on its new owner's first write is what the
    server checks). Random schedules: chunked prefill, decode across block boundaries, blocks
    allocated ahead of their tokens, preemptions and resumptions, blocks reused between
    requests. Planned as the connector plans (rows it needs no plan for left out); checked
    over every request the step runs."""
    checked = [0, 0]  # steps checked of requests out of and in `watched` after the step
    for seed in range(30):
        side = make_side()
        fenced: Dict[str, Set[int]] = {}

        def check(so: SchedulerOutput, plan: Any) -> None:
            for rid in so.preempted_req_ids or ():
                fenced.pop(rid, None)
            for rid, block_ids, start, num, replace in scheduled_rows(so):
                if rid not in side._requests:
                    continue  # untracked (no full chunk): it fences every new block it is given
                got = fenced.setdefault(rid, set())
                if replace:
                    got.clear()  # a new table: every block may be another request's old one
                table = side._requests[rid].blocks
                written = {table[b] for b in range(start // BS, -(-(start + num) // BS)) if b < len(table)}
                got.update(set(plan.fence_blocks) & set(table))
                missing = written - got
                assert not missing, (seed, rid, start, num, sorted(missing))
                checked[rid in side.watched] += 1
            assert len(set(plan.fence_blocks)) == len(plan.fence_blocks)  # each block once

        _random_schedule(seed, side, use_rows=True, observe=check, waiting=waiting)
    assert checked[0] > 1000 and checked[1] > 500, checked  # both kinds of step were checked


def _random_schedule(
    seed: int,
    side: SchedulerSide,
    use_rows: bool,
    observe: Optional[Callable[[SchedulerOutput, Any], None]] = None,
    waiting: bool = False,
) -> List[Any]:
    """A random vLLM schedule (arrivals with a local prefix hit or a kvtier hit, chunked
    prefill, decode with new blocks now and then, now and then a block ahead of the tokens,
    preemptions, resumptions, aborts, load errors) fed to ``side`` (``use_rows``: planned as
    the connector plans, ``plan_step`` over ``scheduled_rows(output, watched)``; else
    ``build_step`` over every request); returns each step's plan as plain values.
    ``observe(output, plan)`` is called with each step's. ``waiting``: half the arrivals are
    looked up one to three steps before they are first scheduled (as a request whose lookup
    or asynchronous load is pending waits in vLLM), and asked again each step meanwhile."""
    rng = random.Random(seed)
    reqs: Dict[str, Dict[str, Any]] = {}
    pending: Dict[str, Dict[str, Any]] = {}  # looked up, not scheduled yet
    next_block = [0]
    plans = []

    def alloc(n: int) -> List[int]:
        first = next_block[0]
        next_block[0] += n
        return list(range(first, first + n))

    for _ in range(40):
        new_reqs, cached, num = [], CachedRequestData(), {}
        preempted = set()

        def admit(rid: str, p: Dict[str, Any]) -> None:
            tokens, local = p["tokens"], p["local"]
            got: Optional[int] = side.num_new_matched_tokens(rid, tokens, local)[0]
            ext = got or 0
            table = alloc(-(-len(tokens) // BS))
            side.after_alloc(rid, table, ext)
            done = min(local + ext, len(tokens) - 1)
            n = min(len(tokens) - done, rng.choice([1, CT, 3 * CT, 10 ** 6]))
            reqs[rid] = {"tokens": tokens, "done": done, "table": table}
            new_reqs.append(NewRequestData(rid, tokens, (list(table),), done))
            num[rid] = n

        for rid, p in list(pending.items()):
            p["steps"] -= 1
            if p["steps"] == 0:
                del pending[rid]
                admit(rid, p)
            else:
                side.num_new_matched_tokens(rid, p["tokens"], p["local"])  # vLLM asks again
        for _ in range(rng.randrange(0, 3)):
            rid = f"q{len(reqs) + len(pending)}-{rng.randrange(10 ** 6)}"
            tokens = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6 * CT))]
            local = (rng.randrange(0, len(tokens)) // BS) * BS if rng.random() < 0.3 else 0
            p = {"tokens": tokens, "local": local}
            if waiting and rng.random() < 0.5:
                side.num_new_matched_tokens(rid, tokens, local)
                p["steps"] = rng.randrange(1, 4)
                pending[rid] = p
            else:
                admit(rid, p)
        for rid, r in list(reqs.items()):
            if rid in num:
                continue
            if rng.random() < 0.05:
                preempted.add(rid)
                del reqs[rid]
                continue
            resumed = rng.random() < 0.05 and r["done"] > 0
            if resumed:
                n, new = 1, (list(r["table"]),)
                cached.resumed_req_ids.add(rid)
            else:
                left = len(r["tokens"]) - r["done"]
                n = 1 if left <= 1 else min(left, rng.choice([1, CT, 2 * CT]))
                grow = -(-(r["done"] + n) // BS) - len(r["table"])
                if rng.random() < 0.1:
                    grow = max(grow, 0) + 1  # ahead of the tokens (speculative decoding's lookahead)
                blocks = alloc(grow) if grow > 0 else []
                r["table"] += blocks
                new = (blocks,) if blocks or rng.random() < 0.5 else None
            cached.req_ids.append(rid)
            cached.new_block_ids.append(new)
            cached.num_computed_tokens.append(r["done"])
            cached.num_output_tokens.append(0)
            cached.new_token_ids.append([])
            num[rid] = n
        so = SchedulerOutput(new_reqs, cached, num, sum(num.values()), set(), preempted_req_ids=preempted)
        if use_rows:
            plan = side.plan_step(preempted_ids(so), scheduled_rows(so, side.watched))
        else:
            plan = side.build_step(step_input_from(so))
        if observe is not None:
            observe(so, plan)
        plans.append(
            (
                [(o.request_id, o.first_chunk, list(o.hashes), o.block_ids, o.skip_tokens, o.error_blocks) for o in plan.loads],
                [(o.request_id, o.first_chunk, list(o.hashes), o.block_ids) for o in plan.stores],
                plan.fence_blocks,
                plan.preempted,
                plan.recv_last,
            )
        )
        for rid, n in num.items():
            r = reqs[rid]
            r["done"] += n
            if r["done"] >= len(r["tokens"]):
                r["tokens"].append(7)
        if reqs and rng.random() < 0.1:
            rid = rng.choice(sorted(reqs))
            side.request_finished(rid)
            del reqs[rid]
        if pending and rng.random() < 0.1:
            rid = rng.choice(sorted(pending))  # aborted while it waited
            side.request_finished(rid)
            del pending[rid]
        if plan.fence_blocks and rng.random() < 0.05:
            side.on_load_errors([rng.choice(plan.fence_blocks)])
        side.on_finished_recving([rid for rid in sorted(reqs) if rng.random() < 0.5])
    return plans


@pytest.mark.parametrize("waiting", [False, True])
def test_the_connectors_per_step_path_plans_what_build_step_plans(waiting: bool):
    stored = loaded = 0
    for seed in range(40):
        for kv_role in ("kv_both", "kv_consumer"):
            for load_mode in ("async", "layerwise"):
                def answer(rid: str) -> int:
                    return random.Random(rid).choice([0, BS, CT, 3 * CT, 10 ** 6])

                rows = _random_schedule(seed, make_side(answer, kv_role, load_mode), use_rows=True, waiting=waiting)
                objects = _random_schedule(seed, make_side(answer, kv_role, load_mode), use_rows=False, waiting=waiting)
                assert rows == objects, (seed, kv_role, load_mode)
                stored += sum(len(p[1]) for p in rows)
                loaded += sum(len(p[0]) for p in rows)
    assert stored > 100 and loaded > 100  # the schedules exercised both


def test_scheduled_rows_leave_out_exactly_the_rows_with_no_block_that_are_neither_watched_nor_resumed():
    # Whatever the number of watched ids (a few are found by position, many by a scan), ids
    # watched but not running, and blocks given as None or as a tuple of empty lists.
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randrange(0, 80)
        ids = [f"r{i}" for i in range(n)]
        cached = CachedRequestData()
        for rid in ids:
            cached.req_ids.append(rid)
            cached.new_block_ids.append(rng.choice([None, None, None, ([],), ([rng.randrange(100)],)]))
            cached.num_computed_tokens.append(rng.randrange(1000))
            cached.num_output_tokens.append(0)
            cached.new_token_ids.append([])
        cached.resumed_req_ids = set(rng.sample(ids, min(n, rng.randrange(0, 3))))
        so = SchedulerOutput([], cached, {rid: rng.randrange(1, 4) for rid in ids}, n, set())
        watched = set(rng.sample(ids, min(n, rng.choice([0, 1, 5, 16, 17, 40])))) | {f"absent{i}" for i in range(rng.randrange(3))}
        every = scheduled_rows(so)
        want = [row for row, new in zip(every, cached.new_block_ids) if new is not None or row[0] in watched or row[4]]
        assert scheduled_rows(so, watched) == want


def test_scheduled_rows_read_older_vllms_resumed_flags():
    cached = CachedRequestData(req_ids=["a", "b"], new_block_ids=[([1, 2],), None], num_computed_tokens=[8, 4],
                               num_output_tokens=[0, 0], new_token_ids=[[], []])
    old = SchedulerOutput([], cached, {"a": 1, "b": 1}, 2, set())
    del cached.resumed_req_ids
    cached.resumed_from_preemption = [True, False]
    assert scheduled_rows(old) == [("a", [1, 2], 8, 1, True), ("b", (), 4, 1, False)]
    step = step_input_from(old)
    assert [(s.request_id, s.block_ids, s.replace_blocks) for s in step.scheduled] == [("a", [1, 2], True), ("b", [], False)]


class Describing(Lookups):
    """Lookups that keep what describe_chunks was given."""

    def __init__(self) -> None:
        super().__init__()
        self.described: List[Any] = []

    def describe_chunks(self, hashes: Any, tokens: Any, *args: Any, **kwargs: Any) -> None:
        self.described.append((list(hashes), list(tokens)))


def test_a_lookup_hands_its_token_list_to_the_bindings_as_it_is_and_hashes_and_describes_what_it_holds():
    # The bindings read a list of token ids in one pass (no array('I') made in Python first,
    # no numpy): the scheduler side hashes and describes the request's own list. The hashes
    # and the described tokens are the list's.
    hasher = TokenHasher(CT)
    for tokens in ([(t * 7919) % 150000 + 1 for t in range(3 * CT + 5)], [2**32 - 1] * (2 * CT)):
        conn = Describing()
        side = SchedulerSide(KVTierConfig(socket_path="/nonexistent", model_name="m", block_size=BS, chunk_tokens=CT),
                             connector=conn)
        side._hasher = CountingHasher(side._hasher)
        assert side.num_new_matched_tokens("r", lambda t=tokens: t, 0) == (0, False)
        assert side._hasher.calls == 1 and side._hasher.given == [tokens]
        full = len(tokens) // CT
        assert side._requests["r"].hashes == hasher.chunk_hashes(tokens)
        assert conn.described == [(hasher.chunk_hashes(tokens), tokens[: full * CT])]


def test_the_bindings_hash_every_form_of_the_same_tokens_alike():
    # A list of uint32 ids and native uint32 buffers take the bindings' fast paths (no numpy);
    # every other form goes through numpy's conversion, as before. Each names the same chunks.
    from array import array

    import numpy

    hasher = TokenHasher(CT)
    ids = [(t * 7919) % 150000 + 1 for t in range(3 * CT + 5)] + [0, 2**32 - 1]
    want = hasher.chunk_hashes(tuple(ids))  # a tuple: numpy's conversion
    wide = numpy.array(ids, dtype=numpy.int64)
    forms = {
        "list": ids,
        "array('I')": array("I", ids),
        "memoryview": memoryview(array("I", ids)),
        "numpy uint32": numpy.array(ids, dtype=numpy.uint32),
        "numpy int64": wide,
        "strided": numpy.repeat(wide, 2)[::2],
        "unaligned": memoryview(b"\0" + array("I", ids).tobytes())[1:].cast("I"),
        "a bool for 1": [True] + ids[1:],  # not an exact int: numpy's conversion
    }
    assert ids[0] == 1
    for name, tokens in forms.items():
        assert hasher.chunk_hashes(tokens) == want, name
    assert hasher.chunk_hashes([]) == [] and hasher.chunk_hashes(array("I")) == []
    with pytest.raises(ValueError, match="one-dimensional"):
        hasher.chunk_hashes(numpy.array(ids[: 2 * CT], dtype=numpy.uint32).reshape(2, CT))
    # A list with an id that is no uint32 is numpy's to convert or refuse, as before: never
    # read as some other id.
    for odd in ([2**32] * CT, [-1] * CT):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(TypeError):
                hasher.chunk_hashes(odd)


class _SampledConnector:
    """A worker's kvtier.Connector as get_kv_connector_stats samples it: its counters (one
    call, under one lock in C++), its health and quarantine should anything ask; records what
    is asked of it."""

    def __init__(self, registrations: int, late_replies: int, quarantined: int, unhealthy_ns: int = 0) -> None:
        self.asked: List[str] = []
        self._counters = (registrations, late_replies, quarantined, unhealthy_ns)

    @property
    def counters(self) -> Tuple[int, int, int, int]:
        self.asked.append("counters")
        return self._counters

    @property
    def healthy(self) -> bool:
        self.asked.append("healthy")
        return True

    def quarantined_blocks(self) -> List[int]:
        self.asked.append("quarantined_blocks")
        return list(range(self._counters[2]))


def test_a_workers_stats_sample_is_one_call_for_its_counters_and_the_quarantine():
    # vLLM asks every worker for its stats after every step: the registrations, the late
    # replies, the quarantined blocks and the time without a server come from one call into
    # the bindings (one lock), not from a list of the quarantined blocks made only to be
    # counted, nor from a second call for the health.
    from kvtier.integrations.vllm import KVConnectorRole, KVTierConnector
    from replay.vllm_configs import full_attention_config
    from replay.vllm_shapes import vllm_config

    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    extra = {"socket_path": "/nonexistent/kvtier.sock", "chunk_tokens": 2 * BS, "rank": 0}
    worker = KVTierConnector(vllm_config(extra=extra, model="m", num_layers=2, num_kv_heads=2, head_size=8,
                                         block_size=BS, dtype="bfloat16"),
                             KVConnectorRole.WORKER, full_attention_config(names, 8, BS, 2, 8, "bfloat16"))
    assert worker.get_kv_connector_stats() is None  # no connector yet (register_kv_caches makes it)
    conn = worker.worker_side.connector = _SampledConnector(registrations=1, late_replies=0, quarantined=3)
    stats = worker.get_kv_connector_stats()
    assert conn.asked == ["counters"]
    assert stats is not None and stats.data == {"quarantined_blocks_max": 3}
    conn.asked.clear()
    conn._counters = (3, 2, 0, 0)  # two reconnections, two late replies, the quarantine released
    assert worker.get_kv_connector_stats().data == {"reconnects": 2, "late_replies": 2}  # a max of 0: not kept
    assert conn.asked == ["counters"]
    conn._counters = (3, 2, 0, 1_500_000_000)  # 1.5 s without a server since the last sample
    assert worker.get_kv_connector_stats().data == {"degraded_s": 1.5}


def test_the_step_plan_pickles_to_itself_as_tuples():
    """vLLM pickles the connector metadata to every worker each step: it comes back equal,
    every field of every op, in about half the bytes of the dataclasses' own pickle."""
    import pickle

    from kvtier.integrations.plan import LoadOp, StepPlan, StoreOp
    from kvtier.integrations.vllm import KVTierConnectorMetadata

    plan = StepPlan(
        loads=[LoadOp("a", 1, [1 << 100, 7], [4, 5, 6, 7], 3, "salt", [9]), LoadOp("b", 0, [], [], 0)],
        stores=[StoreOp("c", 2, [(1 << 127) + 5], [10, 11], "s2"), StoreOp("d", 0, [1], [12])],
        fence_blocks=[4, 5, 6, 7, 13],
        preempted=["e"],
        recv_last=["f", "g"],
    )
    meta = pickle.loads(pickle.dumps(KVTierConnectorMetadata(plan), protocol=pickle.HIGHEST_PROTOCOL))
    assert type(meta) is KVTierConnectorMetadata and meta.plan == plan
    assert pickle.loads(pickle.dumps(StepPlan())) == StepPlan()
    compact = len(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
    # The same plan's fields with the ops pickled as dataclasses (what StepPlan sent before).
    as_dataclasses = len(pickle.dumps((plan.loads, plan.stores, plan.fence_blocks, plan.preempted, plan.recv_last),
                                      protocol=pickle.HIGHEST_PROTOCOL))
    assert compact < 0.7 * as_dataclasses, (compact, as_dataclasses)


def test_the_metadata_pickles_with_one_global_and_an_empty_plan_with_no_list():
    """The metadata's pickle names one global to find at the worker (each costs a module
    lookup per step), and a plan with nothing in it (most decode steps) none of its five
    lists; every plan, empty or not, and every pickle protocol, comes back equal."""
    import pickle
    import pickletools

    from kvtier.integrations.plan import LoadOp, StepPlan, StoreOp
    from kvtier.integrations.vllm import KVTierConnectorMetadata

    def globals_named(data: bytes) -> int:
        return sum(op.name in ("GLOBAL", "STACK_GLOBAL") for op, _, _ in pickletools.genops(data))

    def lists_built(data: bytes) -> int:
        return sum(op.name in ("EMPTY_LIST", "LIST") for op, _, _ in pickletools.genops(data))

    import dataclasses

    # Each field alone (every field StepPlan has, so a field added later is covered too) must
    # not pickle as an empty plan.
    samples = {"loads": [LoadOp("x", 0, [1], [2], 0)], "stores": [StoreOp("y", 0, [1], [2])],
               "fence_blocks": [3], "preempted": ["p"], "recv_last": ["r"]}
    plans = [StepPlan(**{f.name: samples[f.name]}) for f in dataclasses.fields(StepPlan)]
    plans += [
        StepPlan(),
        StepPlan(loads=[LoadOp("a", 1, [1 << 100], [4, 5], 3, "salt", [9])]),
        StepPlan(stores=[StoreOp("c", 2, [(1 << 127) + 5], [10, 11], "s2")], fence_blocks=[10, 11]),
    ]
    for plan in plans:
        for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
            data = pickle.dumps(KVTierConnectorMetadata(plan), protocol=protocol)
            meta = pickle.loads(data)
            assert type(meta) is KVTierConnectorMetadata and meta.plan == plan, (plan, protocol)
            assert globals_named(data) == 1, (plan, protocol)
    empty = pickle.dumps(KVTierConnectorMetadata(StepPlan()), protocol=pickle.HIGHEST_PROTOCOL)
    assert lists_built(empty) == 0
    assert len(empty) <= 64, len(empty)
    # The plan a worker gets from an empty pickle is its own: appending to it changes no other.
    a, b = pickle.loads(empty).plan, pickle.loads(empty).plan
    a.fence_blocks.append(1)
    assert b.fence_blocks == [] and pickle.loads(empty).plan == StepPlan()


def test_watched_names_only_requests_that_have_run():
    """``scheduled_rows`` looks each watched id up among the step's running requests (a scan of
    up to n ids for each one absent). A request that was looked up and waits (its lookup or its
    asynchronous load pending: in vLLM it is not scheduled meanwhile, and at 256 running
    requests several such wait at any step) can only come back as a new request, whose row is
    always there: it is not watched until it has run."""
    seen = [0, 0]  # waiting requests seen; watched requests checked

    for seed in range(20):
        side = make_side(lambda rid: random.Random(rid).choice([0, CT, 3 * CT]))

        def check(so: SchedulerOutput, plan: Any) -> None:
            for rid, st in side._requests.items():
                if not st.scheduled:
                    seen[0] += 1
                    assert rid not in side.watched, (seed, rid)
                elif rid in side.watched:
                    seen[1] += 1

        _random_schedule(seed, side, use_rows=True, observe=check, waiting=True)
    assert seen[0] > 100 and seen[1] > 100, seen


def test_a_first_step_given_as_a_cached_row_still_stores():
    """An engine that drives ``SchedulerSide`` itself may give a request's first step as a row
    that appends blocks (``replace_blocks`` False) rather than as a new one: it is not in
    ``watched`` (it has not run), and its chunks are stored all the same."""
    side = make_side()
    tokens = list(range(1, 3 * CT + 2))
    side.num_new_matched_tokens("r", tokens, 0)
    table = list(range(-(-len(tokens) // BS)))
    side.after_alloc("r", table, 0)
    assert "r" not in side.watched
    plan = side.build_step(StepInput([ScheduledRequest("r", [], 0, len(tokens))]))
    assert [(op.request_id, op.first_chunk, len(op.hashes)) for op in plan.stores] == [("r", 0, 3)]
    assert sorted(plan.fence_blocks) == table

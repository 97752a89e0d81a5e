"""A small replica of vLLM's V1 scheduler (vllm/v1/core/sched/scheduler.py), as far as a KV
connector can tell: the same calls, in the same order, with the same consequences.

* requests wait, run, are preempted (blocks freed, computed tokens reset) and finish;
* a block pool with vLLM's prefix caching (full blocks by hash, freed blocks stay cached
  until reused, LRU);
* chunked prefill with a token budget per step (and, optionally, steps cut at chunk
  boundaries);
* the connector: ``get_num_new_matched_tokens`` for a request with no computed tokens (None:
  skip it this step), ``update_state_after_alloc`` after allocation, asynchronous loads in
  WAITING_FOR_REMOTE_KVS until the id comes back finished receiving, synchronous loads
  (``(n, False)``: the request runs in the step that loads it), ``build_connector_meta`` once
  per step, ``request_finished`` once per request (delayed freeing until finished sending),
  invalid (load error) blocks truncating a waiting request's computed tokens, and a running
  request's (a synchronous load): its output of the step is discarded and it recomputes from
  the first failed block (vLLM's ``kv_load_failure_policy="recompute"``).

It also checks what vLLM asserts: a finished_sending id must be a request it still holds, an id
finished receiving must be waiting for it (or finished), and records each report so that tests
can check that every id is reported once.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from .vllm_shapes import (
    CachedRequestData,
    KVCacheBlocks,
    KVConnectorOutput,
    NewRequestData,
    Request,
    RequestStatus,
    SchedulerOutput,
)


class BlockPool:
    """vLLM's block pool: ref-counted blocks, a free queue in eviction order, and the prefix
    cache (block hash -> block) of full blocks."""

    def __init__(self, num_blocks: int, prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.free: "OrderedDict[int, None]" = OrderedDict((b, None) for b in range(num_blocks))
        self.ref = [0] * num_blocks
        self.hash_of: Dict[int, Any] = {}
        self.block_of: Dict[Any, int] = {}
        self.handed_out = 0  # allocations, for tests

    def allocate(self, n: int) -> Optional[List[int]]:
        if len(self.free) < n:
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None and self.block_of.get(h) == b:
                del self.block_of[h]
            self.ref[b] = 1
            out.append(b)
        self.handed_out += n
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def release(self, blocks: List[int]) -> None:
        for b in reversed(blocks):  # the tail first: it is evicted first
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} freed twice"
            if self.ref[b] == 0:
                self.free[b] = None

    def cache(self, block: int, h: Any) -> None:
        if self.prefix_caching and h not in self.block_of:
            self.block_of[h] = block
            self.hash_of[block] = h


class MiniScheduler:
    def __init__(
        self,
        connector: Any,
        *,
        num_blocks: int,
        block_size: int,
        token_budget: int = 64,
        max_running: int = 16,
        prefix_caching: bool = False,
        chunk_align: Optional[int] = None,
    ) -> None:
        self.connector = connector
        self.bs = block_size
        self.pool = BlockPool(num_blocks, prefix_caching)
        self.token_budget = token_budget
        self.max_running = max_running
        self.chunk_align = chunk_align
        self.requests: Dict[str, Request] = {}
        self.waiting: "deque[Request]" = deque()
        self.running: List[Request] = []
        self.tables: Dict[str, List[int]] = {}
        self.cached_blocks: Dict[str, int] = {}  # id -> leading blocks registered in the prefix cache
        self.finished_req_ids: Set[str] = set()
        self.finished_recving_ids: Set[str] = set()
        self.failed_recving_ids: Set[str] = set()
        self.finished: Dict[str, Request] = {}  # every finished request, for the tests
        self.reports: Dict[str, List[str]] = {"sending": [], "recving": []}
        self.step_count = 0
        self._forced_preemptions: List[Request] = []

    # --- requests ---------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        """vLLM's finish_requests(..., FINISHED_ABORTED)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished():
            return
        delay = False
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            delay = request_id not in self.finished_recving_ids
            self.finished_recving_ids.discard(request_id)
            self.failed_recving_ids.discard(request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self._free_request(req, delay)

    def preempt(self, request_id: str) -> None:
        """Preempt a running request now (the tests' way to force a preemption; vLLM does it
        when it runs out of blocks, which the scheduler below does too)."""
        req = self.requests[request_id]
        assert req.status == RequestStatus.RUNNING, req.status
        self.running.remove(req)
        self._preempt(req)
        self._forced_preemptions.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def holds(self) -> int:
        """Requests whose blocks the scheduler still holds (finished ones waiting for their
        last report included)."""
        return len(self.requests)

    # --- blocks ---------------------------------------------------------------------
    def _block_hashes(self, req: Request, n_blocks: int) -> List[Any]:
        out, prev = [], req.cache_salt
        toks = req.all_token_ids
        for i in range(n_blocks):
            prev = hash((prev, tuple(toks[i * self.bs : (i + 1) * self.bs]), req.block_extra_keys(i * self.bs, (i + 1) * self.bs)))
            out.append(prev)
        return out

    def _computed_blocks(self, req: Request) -> Tuple[List[int], int]:
        if not self.pool.prefix_caching:
            return [], 0
        blocks = []
        for h in self._block_hashes(req, (req.num_tokens - 1) // self.bs):
            b = self.pool.block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.bs

    def _cache_blocks(self, req: Request, num_tokens: int) -> None:
        table = self.tables.get(req.request_id, [])
        n = min(num_tokens // self.bs, len(table))
        done = self.cached_blocks.get(req.request_id, 0)
        if n > done:
            for i, h in enumerate(self._block_hashes(req, n)):
                if i >= done:
                    self.pool.cache(table[i], h)
            self.cached_blocks[req.request_id] = n

    def _allocate(self, req: Request, total_tokens: int, local: Optional[List[int]] = None) -> Optional[List[int]]:
        """Grows the request's table to hold total_tokens; returns the new blocks or None."""
        table = self.tables.setdefault(req.request_id, [])
        if local:
            assert not table
            self.pool.touch(local)
            table.extend(local)
            self.cached_blocks[req.request_id] = len(local)
        need = -(-total_tokens // self.bs) - len(table)
        if need <= 0:
            return []
        new = self.pool.allocate(need)
        if new is None:
            if local:
                self.pool.release(local)
                del table[:]
                self.cached_blocks.pop(req.request_id, None)
            return None
        table.extend(new)
        return new

    def _free_blocks(self, req: Request) -> None:
        table = self.tables.pop(req.request_id, [])
        self.cached_blocks.pop(req.request_id, None)
        self.pool.release(table)
        del self.requests[req.request_id]

    def _free_request(self, req: Request, delay: bool = False) -> None:
        assert req.is_finished()
        if self.connector is not None:
            connector_delay, _ = self.connector.request_finished(req, list(self.tables.get(req.request_id, [])))
            delay = delay or connector_delay
        self.finished_req_ids.add(req.request_id)
        self.finished[req.request_id] = req
        if not delay:
            self._free_blocks(req)

    def _preempt(self, req: Request) -> None:
        table = self.tables.pop(req.request_id, [])
        self.cached_blocks.pop(req.request_id, None)
        self.pool.release(table)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _num_new(self, req: Request, computed: int, budget: int) -> int:
        n = min(req.num_tokens - computed, budget)
        if self.chunk_align and computed < req.num_prompt_tokens:
            boundary = (computed // self.chunk_align + 1) * self.chunk_align
            n = min(n, boundary - computed)
        return max(n, 0)

    # --- a step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        budget = self.token_budget
        num_scheduled: Dict[str, int] = {}
        new_reqs: List[Request] = []
        resumed: List[Request] = []
        running_sched: List[Tuple[Request, List[int]]] = []
        preempted: List[Request] = list(self._forced_preemptions)
        self._forced_preemptions = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new(req, req.num_computed_tokens, budget)
            if n == 0:
                i += 1
                continue
            new = self._allocate(req, req.num_computed_tokens + n)
            while new is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                new = self._allocate(req, req.num_computed_tokens + n)
            if new is None:
                break
            self._cache_blocks(req, req.num_computed_tokens + n)
            running_sched.append((req, new))
            num_scheduled[req.request_id] = n
            budget -= n
            i += 1

        if not preempted:
            skipped: List[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.max_running:
                req = self.waiting[0]
                if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if not self._update_waiting_for_remote_kv(req):
                        skipped.append(self.waiting.popleft())
                        continue
                    req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
                ext, load_async = 0, False
                local_blocks: List[int] = []
                if req.num_computed_tokens == 0:
                    local_blocks, local = self._computed_blocks(req)
                    if self.connector is not None:
                        ext, load_async = self.connector.get_num_new_matched_tokens(req, local)
                        if ext is None:
                            skipped.append(self.waiting.popleft())
                            continue
                        req.num_external_computed_tokens = ext
                    computed = local + ext
                else:
                    computed = req.num_computed_tokens
                n = 0 if load_async else self._num_new(req, computed, budget)
                if not load_async and n == 0:
                    break
                new = self._allocate(req, computed + n, local_blocks)
                if new is None:
                    break
                if not load_async:
                    self._cache_blocks(req, computed + n)
                if self.connector is not None:
                    self.connector.update_state_after_alloc(req, KVCacheBlocks(self.tables[req.request_id]), ext)
                self.waiting.popleft()
                if load_async:
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    skipped.append(req)
                    continue
                self.running.append(req)
                (new_reqs if req.status == RequestStatus.WAITING else resumed).append(req)
                num_scheduled[req.request_id] = n
                budget -= n
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = computed
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = computed
            for req in reversed(skipped):
                self.waiting.appendleft(req)

        cached = CachedRequestData()
        for req, new in running_sched:
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append((list(new),))
            cached.num_computed_tokens.append(req.num_computed_tokens)
            cached.num_output_tokens.append(len(req.output_token_ids))
            cached.new_token_ids.append([])
        for req in resumed:
            cached.req_ids.append(req.request_id)
            cached.resumed_req_ids.add(req.request_id)
            cached.new_block_ids.append((list(self.tables[req.request_id]),))
            cached.num_computed_tokens.append(req.num_computed_tokens)
            cached.num_output_tokens.append(len(req.output_token_ids))
            cached.new_token_ids.append([])
        out = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    r.request_id,
                    None if r.prompt_token_ids is None else list(r.prompt_token_ids),
                    (list(self.tables[r.request_id]),),
                    r.num_computed_tokens,
                    list(r.mm_features),
                    r.lora_request,
                    r.prompt_embeds,
                )
                for r in new_reqs
            ],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            token_ids={rid: list(self.requests[rid].all_token_ids) for rid in num_scheduled},
        )
        self.finished_req_ids = set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        return out

    def _update_waiting_for_remote_kv(self, req: Request) -> bool:
        rid = req.request_id
        if rid not in self.finished_recving_ids:
            return False
        if rid in self.failed_recving_ids:
            if req.num_computed_tokens:
                self._cache_blocks(req, req.num_computed_tokens)
            else:
                self.pool.release(self.tables.pop(rid, []))
                self.cached_blocks.pop(rid, None)
            self.failed_recving_ids.discard(rid)
        else:
            table = self.tables[rid]
            n = min(len(table) * self.bs, req.num_tokens)
            if n == req.num_tokens:
                n -= 1
            self._cache_blocks(req, n)
            req.num_computed_tokens = n
        self.finished_recving_ids.discard(rid)
        return True

    def _handle_invalid_blocks(self, invalid: Set[int], num_scheduled: Dict[str, int]) -> Set[str]:
        """vLLM's _handle_invalid_blocks under the recompute policy. Returns the running
        requests (synchronous loads) whose output of this step is discarded."""
        for req in self.waiting:
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            rid = req.request_id
            table = self.tables.get(rid, [])
            computed = req.num_computed_tokens if rid in self.failed_recving_ids else len(table) * self.bs
            for idx, b in enumerate(table[: -(-computed // self.bs)]):
                if b in invalid:
                    req.num_computed_tokens = idx * self.bs
                    req.num_external_computed_tokens -= computed - req.num_computed_tokens
                    self.failed_recving_ids.add(rid)
                    break
        # Synchronous loads: the running requests, over the tokens computed before this step.
        # A block shared with a request before it (vLLM's prefix cache) is recomputed by that
        # one; this one only goes back to what it had before the step.
        failed: Set[str] = set()
        marked: Set[int] = set()
        for req in self.running:
            rid = req.request_id
            table = self.tables.get(rid, [])
            before = req.num_computed_tokens - num_scheduled.get(rid, 0)
            affected = marked_here = False
            for idx, b in enumerate(table[: -(-before // self.bs)]):
                if b not in invalid:
                    continue
                affected = True
                if b in marked:
                    continue
                marked.add(b)
                if marked_here:
                    continue
                marked_here = True
                req.num_computed_tokens = idx * self.bs
                req.num_external_computed_tokens -= before - req.num_computed_tokens
            if affected:
                if not marked_here:
                    req.num_computed_tokens = before
                failed.add(rid)
        return failed

    def update_from_output(
        self, out: SchedulerOutput, sampled: Dict[str, int], kv: Optional[KVConnectorOutput]
    ) -> Set[str]:
        """vLLM's update_from_output: new tokens, stops, then the connector's reports. Returns
        the requests whose output of the step was discarded (failed synchronous loads)."""
        discarded: Set[str] = set()
        if kv is not None and kv.invalid_block_ids:
            discarded = self._handle_invalid_blocks(set(kv.invalid_block_ids), out.num_scheduled_tokens)
        for rid in out.num_scheduled_tokens:
            if rid in discarded:
                continue  # vLLM skips the requests it rolled back
            req = self.requests.get(rid)
            if req is None or req.is_finished() or req.status != RequestStatus.RUNNING:
                continue
            if req.num_computed_tokens >= req.num_tokens:  # this step produced a token
                req.append_output_token(sampled[rid])
                if len(req.output_token_ids) >= req.max_tokens:
                    self.running.remove(req)
                    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    self._free_request(req)
        if kv is None:
            return discarded
        if self.connector is not None:
            self.connector.update_connector_output(kv)
        for rid in sorted(kv.finished_recving or ()):
            self.reports["recving"].append(rid)
            assert rid in self.requests, f"{rid} reported finished receiving but vLLM no longer holds it"
            req = self.requests[rid]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_ids.add(rid)
            else:
                assert req.is_finished(), f"{rid} finished receiving while {req.status}"
                self._free_blocks(req)
        for rid in sorted(kv.finished_sending or ()):
            self.reports["sending"].append(rid)
            assert rid in self.requests, f"{rid} reported finished sending but vLLM no longer holds it"
            assert self.requests[rid].is_finished(), f"{rid} finished sending while not finished"
            self._free_blocks(self.requests[rid])
        return discarded

"""A small replica of vLLM's V1 scheduler (vllm/v1/core/sched/scheduler.py at the pinned commit,
kvtier.integrations.vllm.VLLM_COMMIT), as far as a KV connector can tell: the same calls, in the
same order, with the same arguments and consequences.

* requests wait, run, are preempted (blocks freed, computed tokens reset) and finish;
* a block pool with vLLM's prefix caching (full blocks by hash, freed blocks stay cached
  until reused, LRU);
* chunked prefill with a token budget per step (and, optionally, steps cut at chunk
  boundaries);
* the connector: ``bind_gpu_block_pool`` at start, ``on_new_request`` when a request arrives,
  ``get_num_new_matched_tokens`` for a request with no computed tokens, given the BLOCK-ALIGNED
  local prefix-cache hit (None: skip it this step), the partial-tail rule (a local hit that
  ends mid-block keeps its tail unless the connector offers more than the tail),
  ``update_state_after_alloc`` for EVERY admitted waiting request (also with 0 external
  tokens, and a second time once an asynchronous load completed), asynchronous loads in
  WAITING_FOR_REMOTE_KVS (their computed tokens counted at admission) until the id comes back
  finished receiving (a whole-prompt hit then computes its last token again), synchronous
  loads (``(n, False)``: the request runs in the step that loads it), ``build_connector_meta``
  once per step (empty steps too), preemption without any connector call,
  ``request_finished`` exactly once per request with the blocks of its computed tokens (an
  aborted waiting request: none; delayed freeing until finished sending),
  ``update_connector_output`` before the finished ids are processed, the workers' stats
  merged with ``get_kv_connector_stats()`` of the scheduler's connector, ``take_events``, and
  load errors under both ``kv_load_failure_policy`` values: ``"recompute"`` truncates a
  waiting request's computed tokens, and rolls a running one (a synchronous load) back to its
  first failed block with its output of the step discarded; ``"fail"`` finishes every request
  concerned with FINISHED_ERROR (and evicts the failed blocks from the prefix cache).

It also checks what vLLM asserts: a finished_sending id must be a request it still holds, an id
finished receiving must be waiting for it (or finished), and records each report so that tests
can check that every id is reported once.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

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

    def evict(self, blocks: Iterable[int]) -> None:
        """vLLM's evict_blocks: the blocks leave the prefix cache (their KV is not trusted)."""
        for b in blocks:
            h = self.hash_of.pop(b, None)
            if h is not None and self.block_of.get(h) == b:
                del self.block_of[h]


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
        kv_load_failure_policy: str = "recompute",
    ) -> None:
        self.connector = connector
        self.bs = block_size
        self.pool = BlockPool(num_blocks, prefix_caching)
        self.token_budget = token_budget
        self.max_running = max_running
        self.chunk_align = chunk_align
        assert kv_load_failure_policy in ("recompute", "fail"), kv_load_failure_policy
        self.recompute_kv_load_failures = kv_load_failure_policy == "recompute"
        # vLLM reads it once, at start (it decides whether a preempted request's in-flight
        # output is dropped; this replay has no output in flight at a preemption).
        self.requires_kv_delivery = bool(connector.requires_kv_delivery) if connector is not None else False
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
        # What vLLM hands its stats loggers each step (SchedulerStats.kv_connector_stats: the
        # merged stats' `data` dict only) and the KV events it publishes.
        self.kv_connector_stats: List[Dict[str, Any]] = []
        self.events: List[Any] = []
        self.request_finished_calls: Dict[str, List[List[int]]] = {}  # id -> block ids of each call
        self.step_count = 0
        self._forced_preemptions: List[Request] = []
        if connector is not None:
            connector.bind_gpu_block_pool(self.pool)

    # --- requests ---------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        assert req.request_id not in self.requests
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if self.connector is not None:
            self.connector.on_new_request(req)

    def finish_requests(self, request_ids: Union[str, Iterable[str]], status: RequestStatus) -> List[Request]:
        """vLLM's finish_requests: from outside the scheduler (an abort) or for failed loads."""
        ids = (request_ids,) if isinstance(request_ids, str) else list(request_ids)
        done = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            delay = False
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                delay = rid not in self.finished_recving_ids
                self.finished_recving_ids.discard(rid)
                self.failed_recving_ids.discard(rid)
            req.status = status
            self._free_request(req, delay)
            done.append(req)
        return done

    def abort(self, request_id: str) -> None:
        """vLLM's finish_requests(..., FINISHED_ABORTED)."""
        self.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

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

    def has_requests(self) -> bool:
        """vLLM's has_requests: unfinished requests, finished ones whose blocks it still holds,
        or the connector's push work keep the engine stepping."""
        return (
            self.has_unfinished()
            or self.holds() > 0
            or (self.connector is not None and self.connector.has_pending_push_work())
        )

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
            # vLLM: get_block_ids_for_computed_tokens (the blocks of the computed prefix, a
            # partial tail included; none for a request that never got blocks).
            table = self.tables.get(req.request_id, [])
            block_ids = list(table[: -(-req.num_computed_tokens // self.bs)])
            self.request_finished_calls.setdefault(req.request_id, []).append(block_ids)
            connector_delay, _ = self.connector.request_finished(req, block_ids)
            delay = delay or connector_delay
        self.finished_req_ids.add(req.request_id)
        self.finished[req.request_id] = req
        if not delay:
            self._free_blocks(req)

    def _preempt(self, req: Request) -> None:
        # No connector call: vLLM frees the blocks at once; the workers learn of it from
        # SchedulerOutput.preempted_req_ids (handle_preemptions).
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
                num_external, load_async = 0, False
                local_blocks: List[int] = []
                if req.num_computed_tokens == 0:
                    local_blocks, local = self._computed_blocks(req)
                    if self.connector is not None:
                        # vLLM hands the connector the block-aligned local hit; a local hit that
                        # ends mid-block keeps its tail unless the connector offers more.
                        partial_tail = local % self.bs
                        aligned = local - partial_tail
                        ext, load_async = self.connector.get_num_new_matched_tokens(req, aligned)
                        if ext is None:
                            skipped.append(self.waiting.popleft())
                            continue
                        if partial_tail and ext > partial_tail:
                            local_blocks, local = local_blocks[: aligned // self.bs], aligned
                            num_external = ext
                        elif partial_tail:
                            num_external, load_async = 0, False
                        else:
                            num_external = ext
                        req.num_external_computed_tokens = num_external
                    computed = local + num_external
                    assert computed <= req.num_tokens, (req.request_id, computed, req.num_tokens)
                else:
                    computed = req.num_computed_tokens  # an asynchronous load completed
                if load_async:
                    assert num_external > 0
                    n = 0
                else:
                    n = self._num_new(req, computed, budget)
                    if n == 0:
                        break
                new = self._allocate(req, computed + n, local_blocks)
                if new is None:
                    break
                if not load_async:
                    self._cache_blocks(req, computed + n)
                if self.connector is not None:
                    # Every admitted waiting request, also with 0 external tokens; the blocks
                    # are all of its blocks (vLLM's kv_cache_manager.get_blocks).
                    self.connector.update_state_after_alloc(req, KVCacheBlocks(self.tables[req.request_id]), num_external)
                self.waiting.popleft()
                if load_async:
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    req.num_computed_tokens = computed  # counted now, loaded later
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
            # Every step, empty ones too, before the scheduled tokens are counted as computed.
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        return out

    def _update_waiting_for_remote_kv(self, req: Request) -> bool:
        """vLLM's _try_promote_blocked_waiting_request + _update_waiting_for_remote_kv."""
        rid = req.request_id
        if rid not in self.finished_recving_ids:
            return False
        if rid in self.failed_recving_ids:
            # num_computed_tokens was truncated at the first failed block.
            if req.num_computed_tokens:
                self._cache_blocks(req, req.num_computed_tokens)
            else:
                self.pool.release(self.tables.pop(rid, []))
                self.cached_blocks.pop(rid, None)
            self.failed_recving_ids.discard(rid)
        else:
            self._cache_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                req.num_computed_tokens = req.num_tokens - 1  # recompute the last token to sample
        self.finished_recving_ids.discard(rid)
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return True

    def _update_requests_with_invalid_blocks(
        self, requests: Iterable[Request], invalid: Set[int], num_scheduled: Dict[str, int], evict_blocks: bool
    ) -> Tuple[Set[str], Set[int]]:
        """vLLM's: each request using an invalid block among its computed ones (before this
        step) goes back to its first failed block; a block shared with a request before it is
        recomputed by that one, and this one only goes back to what it had before the step."""
        affected: Set[str] = set()
        to_evict: Set[int] = set()
        marked: Set[int] = set()
        for req in requests:
            rid = req.request_id
            table = self.tables.get(rid, [])
            before = req.num_computed_tokens - num_scheduled.get(rid, 0)
            is_affected = marked_here = False
            for idx, b in zip(range(-(-before // self.bs)), table):
                if b not in invalid:
                    continue
                is_affected = True
                if b in marked:
                    continue
                marked.add(b)
                if marked_here:
                    continue
                marked_here = True
                req.num_computed_tokens = idx * self.bs
                if evict_blocks:
                    to_evict.update(table[idx:])
            if is_affected:
                if not marked_here:
                    req.num_computed_tokens = before
                affected.add(rid)
        return affected, to_evict

    def _handle_invalid_blocks(self, invalid: Set[int], num_scheduled: Dict[str, int]) -> Set[str]:
        """vLLM's _handle_invalid_blocks. Returns the requests whose output of the step is not
        used: under "recompute" the running ones rolled back (synchronous loads; the waiting
        ones retry once their load is reported over), under "fail" every request concerned
        (finished with FINISHED_ERROR by the caller)."""
        async_reqs = [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        async_failed, _ = self._update_requests_with_invalid_blocks(async_reqs, invalid, num_scheduled, False)
        sync_failed, to_evict = self._update_requests_with_invalid_blocks(self.running, invalid, num_scheduled, True)
        if not async_failed and not sync_failed:
            return set()
        if to_evict and not self.recompute_kv_load_failures:
            self.pool.evict(to_evict)
        if not self.recompute_kv_load_failures:
            return async_failed | sync_failed
        self.failed_recving_ids |= async_failed
        return sync_failed

    def update_from_output(
        self, out: SchedulerOutput, sampled: Dict[str, int], kv: Optional[KVConnectorOutput]
    ) -> Set[str]:
        """vLLM's update_from_output: load errors, new tokens and stops, requests failed by
        their load (policy "fail"), the connector's reports, then the stats and events.
        Returns the requests whose output of the step was not used."""
        failed: Set[str] = set()
        if kv is not None and kv.invalid_block_ids:
            failed = self._handle_invalid_blocks(set(kv.invalid_block_ids), out.num_scheduled_tokens)
        for rid in out.num_scheduled_tokens:
            if rid in failed:
                continue  # vLLM skips the requests whose load failed
            req = self.requests.get(rid)
            if req is None or req.is_finished() or req.status != RequestStatus.RUNNING:
                continue
            if req.num_computed_tokens >= req.num_tokens:  # this step produced a token
                req.append_output_token(sampled[rid])
                if len(req.output_token_ids) >= req.max_tokens:
                    self.running.remove(req)
                    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    self._free_request(req)
        if failed and not self.recompute_kv_load_failures:
            self.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        if kv is not None:
            self._update_from_kv_xfer_finished(kv)
        stats = kv.kv_connector_stats if kv is not None else None
        if self.connector is not None:
            sched_stats = self.connector.get_kv_connector_stats()
            if sched_stats is not None and not sched_stats.is_empty():
                stats = stats.aggregate(sched_stats) if stats is not None else sched_stats
            self.events.extend(self.connector.take_events() or ())
        if stats is not None:
            self.kv_connector_stats.append(stats.data)  # make_stats: only the dict travels on
        return failed

    def _update_from_kv_xfer_finished(self, kv: KVConnectorOutput) -> None:
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

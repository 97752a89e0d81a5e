"""The scheduler's half of the adapter (:class:`SchedulerSide`): lookups, hit counts and the
per-step plan. The semantics are in :mod:`kvtier.integrations.core`'s docstring.

The lookup's wait (``KVTierConfig.lookup_wait_ms``). A lookup is answered by the server, a
round trip after the first ``get_num_new_matched_tokens`` of a request sends it; until then
the call answers ``None`` and vLLM's scheduler skips the request for this step and asks again
in the next one, so without a wait every request, hit or miss, starts one engine step after it
could have. With ``lookup_wait_ms`` > 0 an unanswered call waits for the answer (the GIL kept:
a fraction of a millisecond, which releasing the GIL could stretch to another Python thread's
switch interval), out of a budget that the step's lookups share and that each
``build_connector_meta`` (the end of the scheduler's step) refills: a server that does not
answer costs the engine at most ``lookup_wait_ms`` per step, and a request whose answer did
not come within it is asked again next step as without the wait.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from .._kvtier import AttentionKind, Connector, KvLayoutKind, TokenHasher
from .config import KVTierConfig
from .plan import LoadOp, ScheduledRow, StepInput, StepPlan, StoreOp
from .request_keys import RequestKeys

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvtier")


@dataclass
class _Request:
    num_tokens: int  # tokens of the sequence the lookup names (prompt, plus outputs after a preemption)
    num_prompt_tokens: int
    hashes: List[int]
    cache_salt: str
    # What the chunks' description needs (the token ids the hashes were computed from, the
    # LoRA adapter), kept only until the lookup is sent.
    describe: Optional[Tuple[Sequence[int], Optional[str], int]] = None
    lookup_sent: bool = False
    hit: Optional[int] = None  # hit tokens, once answered
    blocks: List[int] = field(default_factory=list)
    load: Optional[LoadOp] = None  # planned, not yet in a StepPlan
    load_issued: bool = False
    locks_freed: bool = False
    scheduled: bool = False  # ran at least one step (a later lookup means a resumption)
    stored_chunks: Optional[int] = None  # leading chunks stored or not to store
    # The most leading chunks a store can ever cover (full prompt chunks that have a hash):
    # once stored_chunks reaches it, a step of the request has nothing to store (every
    # decode step), which plan_step tells without computing the step's chunk count.
    store_cap: int = 0
    # Blocks [0, fenced_to) of `blocks` were fenced since the request got them, or are never
    # written by it (its prefix-cache hit, a load's destinations, fenced by the load): a step
    # fences only the blocks it writes from there on, once each (plan_step).
    fenced_to: int = 0


class SchedulerSide:
    """The scheduler's half: lookups, hit counts and the per-step plan.

    Not thread-safe (vLLM's scheduler is single-threaded); the connector it owns is.
    """

    def __init__(self, config: KVTierConfig, connector: Optional[Connector] = None) -> None:
        config.validate()
        self.config = config
        self._bs = config.block_size
        self._ct = config.chunk_tokens
        self._bpc = config.chunk_tokens // config.block_size
        self._hasher = TokenHasher(config.chunk_tokens, config.hash_algorithm())
        if connector is None:
            if config.model is None:
                raise ValueError("kvtier: the scheduler needs config.model, one rank's KV shape")
            opts = config.connector_options(scheduler=True)
            opts.model = config.model
            kind = config.layout_kind()
            if config.model.attention == AttentionKind.MLA:
                kind = KvLayoutKind.MLA
            opts.layout_kind = kind if kind is not None else KvLayoutKind.NHD
            connector = Connector(opts)
            if not connector.wait_ready(config.ready_timeout_s):
                log.warning(
                    "kvtier: no kvtier-server at %s yet (%s): running without hits until it comes",
                    config.socket_path,
                    connector.last_error,
                )
        self.connector = connector
        self._async = not config.layerwise
        self._requests: Dict[str, _Request] = {}
        self._planned: List[str] = []  # ids with a load planned, in order
        # Ids whose every scheduled step plan_step must see: a request that has run and may
        # still store, or has blocks it got and did not write yet. Every other tracked request
        # (nothing left to store, every block it got fenced: a decode step's whole life) needs
        # a row only in a step that hands it a block, which it fences then (scheduled_rows
        # leaves the others out). A request that has not run yet is not in it: vLLM schedules
        # it first as a new request (a preempted one as resumed), whose row is always there.
        self.watched: Set[str] = set()
        self._loaded: Set[str] = set()  # ids that had a load (until request_finished)
        self._awaiting_recv: Set[str] = set()  # ids with an asynchronous load vLLM has no finished_recving of yet
        self._recv_last: List[str] = []  # finished while awaiting it: told to the workers in the next plan
        self._warned: Set[str] = set()  # reasons of uncacheable requests already logged
        # What the lookups of this step may still wait for their answers (module docstring).
        self._lookup_wait_s = config.lookup_wait_ms / 1000.0
        self._wait_left_s = self._lookup_wait_s
        self._describe_failed = False  # a description refused by the connector was logged
        # Counters (for the connector's stats): lookups sent, the tokens they asked for, the
        # tokens the server answered as present.
        self.lookups_sent = 0
        self.lookup_tokens = 0
        self.lookup_hit_tokens = 0

    @property
    def lookup_wait_left_s(self) -> float:
        """What this step's lookups may still wait for their answers (``lookup_wait_ms``, less
        what they waited; refilled at each :meth:`plan_step`)."""
        return self._wait_left_s

    # -- vLLM: get_num_new_matched_tokens --------------------------------------------------
    def num_new_matched_tokens(
        self,
        request_id: str,
        tokens: Union[RequestKeys, Callable[[], RequestKeys], Sequence[int]],
        num_computed_tokens: int,
        num_prompt_tokens: Optional[int] = None,
        cache_salt: str = "",
    ) -> Tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can load, and whether the load is
        asynchronous: ``(None, True)`` while pending, ``(n, True)`` for a hit, ``(0, False)``;
        in layerwise mode ``(None, False)`` and ``(n, False)`` (a synchronous load).

        ``tokens``: the request's key material (:class:`~kvtier.integrations.request_keys.
        RequestKeys`: tokens, per-chunk extras, prompt length and salt; ``num_prompt_tokens``
        and ``cache_salt`` are then taken from it), a callable returning it (called only when
        the request is looked up afresh: vLLM asks again every step while a lookup is pending,
        and a digest of prompt embeddings is worth computing once), or its bare token ids for
        a caller whose requests depend on nothing else (no adapter, multimodal input or
        prompt embeddings). The chunk hashes named here are the ones its stores and loads use.

        Repeated calls answer the same and change nothing (the first one starts the lookup,
        which the server runs in the background)."""
        st = self._requests.get(request_id)
        if st is not None and st.scheduled:
            # The engine asks again for a request it already ran: a preemption it resumes. The
            # old lookup is over; look the longer sequence up afresh.
            self._forget(request_id, st)
            st = None
        if st is None:
            if callable(tokens):
                tokens = tokens()
            if isinstance(tokens, RequestKeys):
                if num_prompt_tokens is not None or cache_salt:
                    raise ValueError("kvtier: give num_prompt_tokens and cache_salt in the RequestKeys, not beside them")
                if tokens.uncacheable is not None:
                    self._warn_uncacheable(tokens.uncacheable)
                    return 0, False  # never looked up, never stored (no state: build_step skips it)
                seq, extras = tokens.tokens, tokens.extras
                num_prompt_tokens, cache_salt = tokens.num_prompt_tokens, tokens.cache_salt
                lora_name, lora_id = tokens.lora_name, tokens.lora_id
            else:
                seq, extras = tokens, None
                lora_name, lora_id = None, -1
            n = len(seq)
            if n < self._ct:
                return 0, False  # no full chunk: nothing to look up (or ever to store)
            n_prompt = n if num_prompt_tokens is None else int(num_prompt_tokens)
            hashes = self._hasher.chunk_hashes(seq, extras)
            st = _Request(
                num_tokens=n,
                num_prompt_tokens=n_prompt,
                hashes=hashes,
                cache_salt=cache_salt or "",
                describe=(seq, lora_name, lora_id),
                store_cap=min(n_prompt // self._ct, len(hashes)),
            )
            # Not watched yet: until it has run, vLLM can only schedule it as a new request, whose
            # row scheduled_rows always keeps (plan_step plans any row of it in full, and watches
            # it from its first step if it may still store).
            self._requests[request_id] = st
        if not self.config.loads:
            return 0, False  # kv_producer: stores only, never looks up
        if st.load_issued or (self._async and request_id in self._loaded):
            # An asynchronous load happens at most once per request: vLLM learns that it is
            # over from the id's one finished_recving report, so a second load (after a
            # preemption, or a retry after a load that failed whole) is recomputed instead.
            # A synchronous load reports nothing: a resumed request may load again.
            return 0, False
        if st.hit is None:
            if not st.lookup_sent:
                self.connector.lookup_hashes(request_id, st.hashes, st.cache_salt)
                self._describe(st)
                st.lookup_sent = True
                self.lookups_sent += 1
                self.lookup_tokens += len(st.hashes) * self._ct
            answer = self.connector.lookup_result(request_id)
            if answer is None and self._wait_left_s > 0:
                t0 = time.perf_counter()
                self.connector.wait_lookups([request_id], self._wait_left_s, release_gil=False)
                self._wait_left_s -= time.perf_counter() - t0
                answer = self.connector.lookup_result(request_id)
            if answer is None:
                return None, self._async
            st.hit = min(int(answer), len(st.hashes) * self._ct)
            self.lookup_hit_tokens += st.hit
        usable = min(st.hit, st.num_tokens - 1)  # the engine computes at least the last token
        new = usable - num_computed_tokens
        if new <= 0:
            return 0, False
        return new, self._async

    # -- vLLM: update_state_after_alloc ----------------------------------------------------
    def after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The engine allocated ``block_ids`` (its whole table) for the request; load
        ``num_external_tokens`` into them when > 0. May be called again (0: no new load)."""
        st = self._requests.get(request_id)
        if st is None:
            return
        st.blocks = list(block_ids)
        if num_external_tokens > 0 and st.load is None and not st.load_issued and st.hit is not None:
            usable = min(st.hit, st.num_tokens - 1)
            start = usable - num_external_tokens  # the engine's own prefix
            end = usable
            first = start // self._ct
            last = -(-end // self._ct)
            have = len(st.blocks) // self._bpc
            errors: List[int] = []
            if last > have:  # block_size 1 and a whole hit: the last chunk has no room
                covered = max(first, have)
                errors = st.blocks[max(covered * self._bpc, start // self._bs) : -(-end // self._bs)]
                last = covered
            if last <= first:
                op = LoadOp(request_id, first, [], [], 0, st.cache_salt, errors)
            else:
                op = LoadOp(
                    request_id,
                    first,
                    st.hashes[first:last],
                    st.blocks[first * self._bpc : last * self._bpc],
                    start - first * self._ct,
                    st.cache_salt,
                    errors,
                )
            st.load = op
            self._planned.append(request_id)
        elif num_external_tokens == 0 and not st.load_issued and st.load is None and st.hit and not st.locks_freed:
            # Nothing will be retrieved: the server may let the prefetched chunks go.
            self.connector.free_lookup_locks(request_id)
            st.locks_freed = True

    # -- vLLM: build_connector_meta --------------------------------------------------------
    def build_step(self, step: StepInput) -> StepPlan:
        """This step's plan (consumes the loads planned since the last call)."""
        return self.plan_step(
            step.preempted,
            [(sr.request_id, sr.block_ids, sr.num_computed_tokens, sr.num_scheduled_tokens, sr.replace_blocks) for sr in step.scheduled],
        )

    def plan_step(self, preempted: Iterable[str], scheduled: Iterable[ScheduledRow]) -> StepPlan:
        """:meth:`build_step` with each scheduled request as a tuple of
        :class:`~kvtier.integrations.plan.ScheduledRequest`'s fields (:data:`~kvtier.
        integrations.plan.ScheduledRow`), as :func:`~kvtier.integrations.vllm_scheduler_output.
        scheduled_rows` reads them from vLLM's ``SchedulerOutput``.

        Runs every step, so it does a constant amount of work per row, and needs no row for
        most decode steps (docs/performance.md, "vLLM connector: cost per step"). A request
        that has not run, or one in :attr:`watched` (it may still store, or got blocks it has
        not written), fences the blocks the step writes that it had not written since it got
        them, and stores the chunks the step completes. Once nothing is left to store, it
        fences every block it got and did not write yet and leaves :attr:`watched`: from then
        on a step fences the blocks it is handed, when it is handed them (before their first
        write: a store of a previous owner still reading one is dropped then), and a step
        that hands it none plans nothing, so its row may be left out
        (``scheduled_rows(output, watched)``). A row that is there plans the same. No hash,
        no copy of a block table."""
        self._wait_left_s = self._lookup_wait_s  # the next step's lookups wait afresh
        plan = StepPlan(preempted=list(preempted))
        for rid in plan.preempted:
            st = self._requests.get(rid)
            if st is not None:
                self._forget(rid, st)
        for rid in self._planned:
            st = self._requests.get(rid)
            if st is None or st.load is None:
                continue
            plan.loads.append(st.load)
            plan.fence_blocks.extend(st.load.block_ids)
            st.load = None
            st.load_issued = True
            self._loaded.add(rid)
            if self._async:
                self._awaiting_recv.add(rid)
        self._planned.clear()
        plan.recv_last, self._recv_last = self._recv_last, []
        bs, ct, bpc = self._bs, self._ct, self._bpc
        stores = self.config.stores
        requests = self._requests
        fence = plan.fence_blocks
        fence_one = fence.append
        watched = self.watched
        for rid, block_ids, start, num, replace in scheduled:
            st = requests.get(rid)
            if st is None:
                # No full chunk in its prompt: nothing to store, but its writes are fenced like
                # any other's (it may be handed a preempted request's blocks that a store still
                # reads). Its new blocks, or those of the tokens it computes when the table is
                # whole (a new or resumed request).
                fence.extend(block_ids[start // bs : -(-(start + num) // bs)] if replace else block_ids)
                continue
            if not replace and rid not in watched and st.scheduled:
                # Nothing left to store, every block it got fenced: it fences what it is handed.
                # (A request that has not run is not watched either: vLLM gives its first step
                # as a new row, but an engine driving build_step may not, and it plans in full.)
                if block_ids:
                    blocks = st.blocks
                    blocks.extend(block_ids)
                    fence.extend(block_ids)
                    st.fenced_to = len(blocks)
                continue
            first = start // bs
            if replace:
                blocks = st.blocks = list(block_ids)
                st.fenced_to = first  # a new table: nothing of it written by this request yet
            else:
                blocks = st.blocks
                if block_ids:
                    blocks.extend(block_ids)
            st.scheduled = True
            # Each block is fenced once, by the first step that writes it since the request got
            # it (a store of its previous owner still reading it is then dropped): a decode step
            # writing into a block its request already wrote fences nothing, so a step fences
            # about one block in block_size per decoding request, not one per request.
            if num == 1:  # a decode step: the one block holding token `start`
                if first >= st.fenced_to and first < len(blocks):
                    fence_one(blocks[first])
                    st.fenced_to = first + 1
            else:
                lo = max(first, st.fenced_to)
                end = min(-(-(start + num) // bs), len(blocks))
                if end > lo:
                    fence.extend(blocks[lo:end])
                    st.fenced_to = end
            if stores:  # not kv_consumer (loads only, never stores)
                stored = st.stored_chunks
                if stored is None:
                    stored = st.stored_chunks = start // ct
                if stored < st.store_cap:
                    done = min(min(start + num, st.num_prompt_tokens) // ct, st.store_cap, len(blocks) // bpc)
                    if done > stored:
                        plan.stores.append(StoreOp(rid, stored, st.hashes[stored:done], blocks[stored * bpc : done * bpc], st.cache_salt))
                        st.stored_chunks = stored = done
                    if stored < st.store_cap:
                        watched.add(rid)  # (a whole table may come back to a request that had left)
                        continue
            # Every chunk it can store is stored (or not to store): it leaves `watched`, its
            # blocks got and not written yet fenced now (a lookahead's; none in most steps).
            if st.fenced_to < len(blocks):
                fence.extend(blocks[st.fenced_to :])
                st.fenced_to = len(blocks)
            watched.discard(rid)
        return plan

    # -- vLLM: update_connector_output -----------------------------------------------------
    def on_finished_recving(self, request_ids: Iterable[str]) -> None:
        """vLLM's aggregated finished_recving of a step: every rank reported these."""
        self._awaiting_recv.difference_update(request_ids)

    def on_load_errors(self, invalid_block_ids: Iterable[int]) -> None:
        """The workers' load errors of a step (vLLM's ``invalid_block_ids``): a request that
        ran a step on blocks that did not land (a synchronous load) recomputes from its first
        failed block, and what it computes then is stored afresh (the worker dropped that
        step's stores of it)."""
        bad = set(invalid_block_ids)
        if not bad:
            return
        for rid, st in self._requests.items():
            if st.stored_chunks is not None and bad.intersection(st.blocks):
                st.stored_chunks = None  # set again from the step that recomputes
                self.watched.add(rid)

    # -- vLLM: request_finished ------------------------------------------------------------
    def request_finished(self, request_id: str) -> bool:
        """The request is over (finished or aborted): the server forgets its lookup. Returns
        whether the engine must keep its blocks until a worker reports the id (always True:
        see the module docstring)."""
        st = self._requests.pop(request_id, None)
        self.watched.discard(request_id)
        if st is not None and st.lookup_sent:
            self.connector.end_request(request_id)
        if request_id in self._awaiting_recv:  # aborted while loading: its last report is receiving
            self._awaiting_recv.discard(request_id)
            self._recv_last.append(request_id)
        if request_id in self._planned:
            self._planned.remove(request_id)
        self._loaded.discard(request_id)
        return True

    def _describe(self, st: _Request) -> None:
        """Describes the chunks just looked up (their token ids, the block size, the LoRA
        adapter) for the KV events a server may publish for routers; the connector sends it
        fire and forget, once per chunk per connection, and not at all to a server that
        publishes none (docs/integration.md, "Routers").

        No block extra keys: vLLM's extra keys of a block are its multimodal inputs' hashes
        with their offsets in the block (plus the adapter's name and, in the first block, the
        salt), and vLLM keeps them per block only inside its own hasher
        (``generate_block_hash_extra_keys``); what the scheduler side holds is kvtier's own
        per-chunk extras (request_keys.py), whose bytes are not vLLM's tuples. So a
        description carries the tokens, the block size, the salt (in the model id) and
        ``lora_name``/``lora_id``, and a router sees BlockStored without extra_keys."""
        if st.describe is None:
            return
        seq, lora_name, lora_id = st.describe
        st.describe = None  # the tokens are vLLM's request's: not kept past the lookup
        if not self.connector.describes_chunks:
            return  # the server said it publishes no KV events: nothing to convert or send
        n = len(st.hashes) * self._ct
        try:
            self.connector.describe_chunks(
                st.hashes,
                seq[:n],
                st.cache_salt,
                block_size=self._bs,
                lora_name=lora_name or "",
                lora_id=lora_id,
            )
        except ValueError as e:  # e.g. a LoRA name above 256 bytes: the lookup goes on without it
            if not self._describe_failed:
                self._describe_failed = True
                log.warning("kvtier: a request's chunks cannot be described for KV events: %s (further ones are not logged)", e)

    def _warn_uncacheable(self, why: str) -> None:
        if why not in self._warned:
            self._warned.add(why)
            log.warning("kvtier: a request is neither looked up nor stored: %s (further ones are not logged)", why)

    def tracked(self) -> int:
        """Requests with state here (for tests: 0 once every request finished)."""
        return len(self._requests) + len(self._loaded) + len(self._awaiting_recv)

    def shutdown(self) -> None:
        self.connector.close()

    def _forget(self, request_id: str, st: _Request) -> None:
        if st.lookup_sent:
            self.connector.end_request(request_id)
        if request_id in self._planned:
            self._planned.remove(request_id)
        del self._requests[request_id]
        self.watched.discard(request_id)


"""The engine-independent logic of kvtier's engine adapters (vLLM's KV connector shape).

vLLM splits a KV connector in two: one instance in the scheduler process (no KV tensors)
and one per worker (tensor-parallel rank, owns its layer tensors). So does this module:

* :class:`SchedulerSide` looks requests up (a scheduler :class:`kvtier.Connector`, without a
  region), answers how many tokens beyond the engine's own prefix cache can be loaded, and
  plans each step: the loads (one retrieve per request), the stores (each newly completed
  full chunk of a prompt, chunk by chunk as chunked prefill computes it) and the blocks the
  step writes (to fence).
* :class:`WorkerSide` moves the engine's layer tensors into a :class:`kvtier.KvRegion`,
  registers it with its own worker :class:`kvtier.Connector`, executes each step's plan and
  reports finished ids and load errors.

:class:`StepPlan` is what travels from the scheduler to every worker each step (vLLM's
connector metadata); it holds plain ints, strings and lists, so it pickles.

Semantics the engine relies on (docs/integration.md, "vLLM"):

* ``num_new_matched_tokens`` answers ``(None, True)`` while the lookup is pending and has no
  effect but starting that lookup once; the hit excludes what the engine's own prefix cache
  holds, and is one token less when the whole prompt hits (the engine computes the last
  token). 0 means ``(0, False)``.
* ``load_mode="async"`` (the default): a request's KV loads asynchronously between steps
  (``(n, True)``); its id comes back in ``finished_recving`` once, after its retrieve
  completed. Blocks that did not land are load errors, reported no later than that step.
* ``load_mode="layerwise"``: the load is synchronous (``(n, False)``: the request runs in the
  step that loads it); the retrieve asks the server for layer progress, and the engine's
  ``wait_for_layer_load(layer)`` waits until that layer of every chunk of the step's retrieves
  is in its blocks, so layer 0 computes while the server copies the next layers. The id is
  never reported in ``finished_recving`` (vLLM expects only asynchronous loads there). At
  ``wait_for_save`` the worker waits for the step's retrieves to end and takes their load
  errors, which ``get_block_ids_with_load_errors`` reports in that same step: vLLM then
  discards the step's output of the requests concerned and recomputes from their first
  failed block (so a layer computed from blocks that did not land never reaches a token),
  and the worker does not store what those requests computed in that step.
* Fencing: before the engine writes a block (this step's tokens, a retrieve's destination) the
  worker bumps the block's generation (``block_reused``), so a store still reading a block that
  a preempted request left behind is dropped by the server instead of storing the new bytes.
* Quarantine: blocks of a retrieve the connector gave up on (timeout, server gone) may still
  be written by the server; the worker holds the request's ``finished_recving`` (and any
  ``finished_sending``) until none of its blocks is quarantined, so the engine keeps them
  allocated and never hands them back to its block pool before they are released (the
  server's late answer, or the proof that its process is gone).
* ``request_finished`` always delays freeing (returns True): every id the engine finishes
  comes back exactly once, in ``finished_sending`` when its stores are over, or as the last
  ``finished_recving`` of a request finished while its load was in flight.
* Preemption and abort release everything: the scheduler ends the lookup (the server drops
  its locks) and forgets the request; a resumed request is looked up afresh, and loads if it
  never loaded before: in async mode a request loads at most once in its life, since its one
  ``finished_recving`` report is how the engine learns that its load is over (a request that
  already loaded, or whose load failed whole, is recomputed). In layerwise mode a resumed
  request may load again (nothing is reported for a synchronous load). vLLM frees a
  preempted request's blocks at once: in layerwise mode ``handle_preemptions`` first waits
  until none of them is quarantined (a load the connector gave up on, which a hung server
  could still write), bounded by ``quarantine_limit_ms``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from .._kvtier import (
    AttentionKind,
    Connector,
    ConnectorOptions,
    HashAlgorithm,
    KvLayoutKind,
    KvRegion,
    ModelShape,
    PagedKvLayout,
    TokenHasher,
    parse_kv_layout_kind,
)
from ..views import dtype_kind_of, torch_layers

__all__ = [
    "KVTierConfig",
    "LoadOp",
    "StoreOp",
    "StepPlan",
    "ScheduledRequest",
    "StepInput",
    "SchedulerSide",
    "WorkerSide",
    "detect_layer_layout",
]

log = logging.getLogger("kvtier")

#: ``KVTierConfig.load_mode`` values: loads between steps, or synchronous and layer by layer.
_LOAD_MODES = ("async", "layerwise")

_TIMEOUT_KEYS = (
    "ping_interval_ms",
    "ping_timeout_ms",
    "request_timeout_ms",
    "lookup_timeout_ms",
    "retrieve_timeout_ms",
    "store_timeout_ms",
    "reconnect_initial_ms",
    "reconnect_max_ms",
    "quarantine_limit_ms",
)


@dataclass
class KVTierConfig:
    """What both sides need; built from vLLM's config by ``KVTierConfig.from_vllm_config`` (in
    :mod:`kvtier.integrations.vllm`) or directly.

    Attributes:
        socket_path: the kvtier-server's Unix socket.
        model_name: with the shape, the layout kind and ``cache_salt``, the model id.
        block_size: tokens per engine block.
        chunk_tokens: tokens per chunk (the server's ``--chunk-size``; a multiple of
            ``block_size``).
        world_size: tensor-parallel ranks; ``rank``: this worker's (0 in the scheduler).
        model: one rank's KV shape (the scheduler registers it; a worker checks its tensors
            against it when given).
        layout: ``"NHD"``, ``"HND"`` or ``"auto"`` (the worker takes what its tensors are; the
            scheduler then needs the engine's default, see the vLLM adapter).
        cache_salt: a deployment-wide salt folded into the model id.
        hash: ``"xxh3_128"`` or ``"sha256"``.
        prefill_tokens_per_second: the engine's declared prefill rate (0: not declared).
        ready_timeout_s: how long start-up waits for the server; past it the connector runs
            degraded (no hits, no stores) and keeps reconnecting.
        timeouts_ms: connector deadlines by name (``retrieve_timeout_ms``, ...; docs/
            fault-tolerance.md); missing ones keep their defaults.
        load_mode: ``"async"`` (loads complete between steps; the default) or ``"layerwise"``
            (synchronous loads, each layer usable as soon as the server copied it; module
            docstring).
    """

    socket_path: str
    model_name: str
    block_size: int = 16
    chunk_tokens: int = 256
    world_size: int = 1
    rank: int = 0
    model: Optional[ModelShape] = None
    layout: str = "auto"
    cache_salt: str = ""
    hash: str = "xxh3_128"
    prefill_tokens_per_second: int = 0
    ready_timeout_s: float = 5.0
    timeouts_ms: Dict[str, int] = field(default_factory=dict)
    load_mode: str = "async"

    @property
    def layerwise(self) -> bool:
        """Whether loads are synchronous and layer by layer (``load_mode="layerwise"``)."""
        return self.load_mode == "layerwise"

    def validate(self) -> None:
        """Raises ValueError naming the first field that is wrong."""
        if not self.socket_path:
            raise ValueError("kvtier: socket_path is empty: set kv_connector_extra_config['socket_path'] or KVTIER_SOCKET")
        if not self.model_name:
            raise ValueError("kvtier: model_name is empty")
        if self.block_size <= 0 or self.chunk_tokens <= 0 or self.chunk_tokens % self.block_size != 0:
            raise ValueError(
                f"kvtier: chunk_tokens ({self.chunk_tokens}) must be a positive multiple of block_size "
                f"({self.block_size})"
            )
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"kvtier: rank {self.rank} is not below world_size {self.world_size}")
        if self.layout.upper() not in ("NHD", "HND", "MLA", "AUTO"):
            raise ValueError(f"kvtier: layout '{self.layout}': use NHD, HND or auto")
        if self.hash not in ("xxh3_128", "xxh3", "sha256"):
            raise ValueError(f"kvtier: hash '{self.hash}': use xxh3_128 or sha256")
        for key in self.timeouts_ms:
            if key not in _TIMEOUT_KEYS:
                raise ValueError(f"kvtier: unknown timeout '{key}': use one of {', '.join(_TIMEOUT_KEYS)}")
        if self.load_mode not in _LOAD_MODES:
            raise ValueError(f"kvtier: load_mode '{self.load_mode}': use {' or '.join(_LOAD_MODES)}")

    def connector_options(self, scheduler: bool) -> ConnectorOptions:
        """The C++ connector's options for one side."""
        o = ConnectorOptions()
        o.socket_path = self.socket_path
        o.rank = 0 if scheduler else self.rank
        o.world_size = self.world_size
        o.scheduler = scheduler
        o.model_name = self.model_name
        o.chunk_tokens = self.chunk_tokens
        o.cache_salt = self.cache_salt
        o.prefill_tokens_per_second = self.prefill_tokens_per_second
        o.hash = HashAlgorithm.SHA256 if self.hash == "sha256" else HashAlgorithm.XXH3_128
        t = o.timeouts
        for key, value in self.timeouts_ms.items():
            setattr(t, key, int(value))
        o.timeouts = t
        return o

    def layout_kind(self) -> Optional[KvLayoutKind]:
        """The configured layout kind, or None for ``auto``."""
        return None if self.layout.upper() == "AUTO" else parse_kv_layout_kind(self.layout.upper())


# --- the per-step plan ------------------------------------------------------------------


@dataclass
class LoadOp:
    """Retrieve chunks ``[first_chunk, first_chunk + len(hashes))`` of a request into
    ``block_ids`` (chunk-major), but its first ``skip_tokens`` tokens (the engine's own
    prefix cache holds them). ``error_blocks``: blocks the engine counts as loaded that no
    chunk covers (reported as load errors at once)."""

    request_id: str
    first_chunk: int
    hashes: List[int]
    block_ids: List[int]
    skip_tokens: int
    cache_salt: str = ""
    error_blocks: List[int] = field(default_factory=list)


@dataclass
class StoreOp:
    """Store chunks ``[first_chunk, first_chunk + len(hashes))`` of a request from
    ``block_ids`` (chunk-major), after this step's forward pass wrote them."""

    request_id: str
    first_chunk: int
    hashes: List[int]
    block_ids: List[int]
    cache_salt: str = ""


@dataclass
class StepPlan:
    """What every worker does in one step (vLLM's KV connector metadata).

    ``fence_blocks``: blocks this step writes (tokens computed, retrieve destinations); the
    worker fences each before the forward pass. ``preempted``: ids preempted this step."""

    loads: List[LoadOp] = field(default_factory=list)
    stores: List[StoreOp] = field(default_factory=list)
    fence_blocks: List[int] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)


@dataclass
class ScheduledRequest:
    """One request the engine runs this step.

    ``block_ids``: blocks given to it this step (appended to its table), or its whole table
    when ``replace_blocks`` (a new or resumed request). ``num_computed_tokens``: tokens whose
    KV is in its blocks before this step; ``num_scheduled_tokens``: tokens this step computes.
    """

    request_id: str
    block_ids: List[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    replace_blocks: bool = False


@dataclass
class StepInput:
    """The engine's schedule of one step, as :meth:`SchedulerSide.build_step` needs it."""

    scheduled: List[ScheduledRequest] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)


# --- the scheduler side -----------------------------------------------------------------


@dataclass
class _Request:
    num_tokens: int  # tokens of the sequence the lookup names (prompt, plus outputs after a preemption)
    num_prompt_tokens: int
    hashes: List[int]
    cache_salt: str
    lookup_sent: bool = False
    hit: Optional[int] = None  # hit tokens, once answered
    blocks: List[int] = field(default_factory=list)
    load: Optional[LoadOp] = None  # planned, not yet in a StepPlan
    load_issued: bool = False
    locks_freed: bool = False
    scheduled: bool = False  # ran at least one step (a later lookup means a resumption)
    stored_chunks: Optional[int] = None  # leading chunks stored or not to store


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
        self._hasher = TokenHasher(config.chunk_tokens, HashAlgorithm.SHA256 if config.hash == "sha256" else HashAlgorithm.XXH3_128)
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
        self._loaded: Set[str] = set()  # ids that had a load (until request_finished)

    # -- vLLM: get_num_new_matched_tokens --------------------------------------------------
    def num_new_matched_tokens(
        self,
        request_id: str,
        tokens: Sequence[int],
        num_computed_tokens: int,
        num_prompt_tokens: Optional[int] = None,
        cache_salt: str = "",
    ) -> Tuple[Optional[int], bool]:
        """Tokens beyond ``num_computed_tokens`` that kvtier can load, and whether the load is
        asynchronous: ``(None, True)`` while pending, ``(n, True)`` for a hit, ``(0, False)``;
        in layerwise mode ``(None, False)`` and ``(n, False)`` (a synchronous load).

        Repeated calls answer the same and change nothing (the first one starts the lookup,
        which the server runs in the background)."""
        st = self._requests.get(request_id)
        if st is not None and st.scheduled:
            # The engine asks again for a request it already ran: a preemption it resumes. The
            # old lookup is over; look the longer sequence up afresh.
            self._forget(request_id, st)
            st = None
        if st is None:
            n = len(tokens)
            if n < self._ct:
                return 0, False  # no full chunk: nothing to look up (or ever to store)
            st = _Request(
                num_tokens=n,
                num_prompt_tokens=n if num_prompt_tokens is None else int(num_prompt_tokens),
                hashes=self._hasher.chunk_hashes(tokens),
                cache_salt=cache_salt or "",
            )
            self._requests[request_id] = st
        if st.load_issued or (self._async and request_id in self._loaded):
            # An asynchronous load happens at most once per request: vLLM learns that it is
            # over from the id's one finished_recving report, so a second load (after a
            # preemption, or a retry after a load that failed whole) is recomputed instead.
            # A synchronous load reports nothing: a resumed request may load again.
            return 0, False
        if st.hit is None:
            if not st.lookup_sent:
                self.connector.lookup_hashes(request_id, st.hashes, st.cache_salt)
                st.lookup_sent = True
            answer = self.connector.lookup_result(request_id)
            if answer is None:
                return None, self._async
            st.hit = min(int(answer), len(st.hashes) * self._ct)
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
        plan = StepPlan(preempted=list(step.preempted))
        for rid in step.preempted:
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
        self._planned.clear()
        for sr in step.scheduled:
            st = self._requests.get(sr.request_id)
            if st is None:
                continue  # no full chunk in its prompt: nothing to store
            if sr.replace_blocks:
                st.blocks = list(sr.block_ids)
            else:
                st.blocks.extend(sr.block_ids)
            st.scheduled = True
            start = sr.num_computed_tokens
            end = start + sr.num_scheduled_tokens
            plan.fence_blocks.extend(st.blocks[start // self._bs : -(-end // self._bs)])
            if st.stored_chunks is None:
                st.stored_chunks = start // self._ct
            done = min(min(end, st.num_prompt_tokens) // self._ct, len(st.hashes), len(st.blocks) // self._bpc)
            if done > st.stored_chunks:
                first = st.stored_chunks
                plan.stores.append(
                    StoreOp(
                        sr.request_id,
                        first,
                        st.hashes[first:done],
                        st.blocks[first * self._bpc : done * self._bpc],
                        st.cache_salt,
                    )
                )
                st.stored_chunks = done
        return plan

    # -- vLLM: update_connector_output -----------------------------------------------------
    def on_load_errors(self, invalid_block_ids: Iterable[int]) -> None:
        """The workers' load errors of a step (vLLM's ``invalid_block_ids``): a request that
        ran a step on blocks that did not land (a synchronous load) recomputes from its first
        failed block, and what it computes then is stored afresh (the worker dropped that
        step's stores of it)."""
        bad = set(invalid_block_ids)
        if not bad:
            return
        for st in self._requests.values():
            if st.stored_chunks is not None and bad.intersection(st.blocks):
                st.stored_chunks = None  # set again from the step that recomputes

    # -- vLLM: request_finished ------------------------------------------------------------
    def request_finished(self, request_id: str) -> bool:
        """The request is over (finished or aborted): the server forgets its lookup. Returns
        whether the engine must keep its blocks until a worker reports the id (always True:
        see the module docstring)."""
        st = self._requests.pop(request_id, None)
        if st is not None and st.lookup_sent:
            self.connector.end_request(request_id)
        if request_id in self._planned:
            self._planned.remove(request_id)
        self._loaded.discard(request_id)
        return True

    def tracked(self) -> int:
        """Requests with state here (for tests: 0 once every request finished)."""
        return len(self._requests) + len(self._loaded)

    def shutdown(self) -> None:
        self.connector.close()

    def _forget(self, request_id: str, st: _Request) -> None:
        if st.lookup_sent:
            self.connector.end_request(request_id)
        if request_id in self._planned:
            self._planned.remove(request_id)
        del self._requests[request_id]


# --- the worker side --------------------------------------------------------------------


def detect_layer_layout(shape: Sequence[int], stride: Sequence[int], block_size: int, want: Optional[KvLayoutKind]) -> Tuple[KvLayoutKind, Tuple[int, ...]]:
    """The physical layout kind of a layer tensor, and the permutation that puts its dims in
    physical order (outermost first).

    A 5-dim MHA tensor has dims (2, num_blocks, a, b, head_dim) where one of a, b is the
    block's tokens (size ``block_size``) and the other the KV heads; which one, and which is
    outer in memory, comes from the sizes and strides (a backend may hand out a permuted view).
    ``want`` (the configured kind) decides when heads == block_size and is checked otherwise.
    A 3-dim tensor is MLA."""
    if len(shape) == 3:
        return KvLayoutKind.MLA, (0, 1, 2)
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(
            f"kvtier: a layer tensor of shape {tuple(shape)} is neither (2, blocks, tokens|heads, heads|tokens, "
            "head_dim) nor MLA's (blocks, tokens, latent)"
        )
    if shape[2] == block_size and shape[3] != block_size:
        token_dim = 2
    elif shape[3] == block_size and shape[2] != block_size:
        token_dim = 3
    elif shape[2] == block_size and shape[3] == block_size:
        if want is None:
            raise ValueError(
                "kvtier: the KV heads equal the block size, so the layout cannot be told from the tensors: "
                "set kv_connector_extra_config['kv_layout'] to NHD or HND"
            )
        token_dim = 2 if want == KvLayoutKind.NHD else 3
    else:
        raise ValueError(f"kvtier: no dim of the layer tensor {tuple(shape)} is the block size {block_size}")
    head_dim_axis = 5 - token_dim  # the other of 2, 3
    if stride[token_dim] >= stride[head_dim_axis]:
        kind, order = KvLayoutKind.NHD, (0, 1, token_dim, head_dim_axis, 4)
    else:
        kind, order = KvLayoutKind.HND, (0, 1, head_dim_axis, token_dim, 4)
    if want is not None and want != KvLayoutKind.MLA and kind != want:
        raise ValueError(
            f"kvtier: the KV tensors are {kind.name} in memory but kv_layout says {want.name}: the scheduler "
            "would name other chunks; set kv_layout to match the attention backend"
        )
    return kind, order


@dataclass
class _WorkerState:
    load_blocks: Dict[str, Set[int]] = field(default_factory=dict)  # id -> blocks of its retrieve
    held_recving: List[str] = field(default_factory=list)
    held_sending: List[str] = field(default_factory=list)
    unissued: List[str] = field(default_factory=list)  # loads not sent: finished receiving at once
    extra_errors: Set[int] = field(default_factory=set)
    stored_plan: Optional["StepPlan"] = None  # the plan whose stores were issued
    step_loads: List[str] = field(default_factory=list)  # layerwise: this step's retrieves in flight
    step_failed: Set[str] = field(default_factory=set)  # layerwise: ids whose load of this step failed


class WorkerSide:
    """One worker's half: its region, its connector, the execution of each step's plan.

    Counters (attributes, for tests and logs): ``fence_refusals`` (blocks the engine was about
    to write while quarantined: never expected, but in layerwise mode a request's own blocks
    after its load failed with the server hung, which it recomputes in place),
    ``loads_issued``, ``stores_issued``, ``stores_dropped`` (layerwise: stores of a request
    whose load of the step failed), ``preemption_waits`` (layerwise: preemptions that waited
    for quarantined blocks)."""

    def __init__(self, config: KVTierConfig) -> None:
        config.validate()
        self.config = config
        self.region: Optional[KvRegion] = None
        self.connector: Optional[Connector] = None
        self.layer_names: List[str] = []
        self.fence_refusals = 0
        self.loads_issued = 0
        self.stores_issued = 0
        self.stores_dropped = 0
        self.preemption_waits = 0
        self._layerwise = config.layerwise
        self._layer_index: Dict[str, int] = {}
        self._st = _WorkerState()

    # -- vLLM: register_kv_caches ----------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any], dtype: Optional[str] = None) -> None:
        """Moves the engine's layer tensors (CPU torch tensors, one per layer, same shape and
        dtype) into a new kvtier region, in place (``Tensor.set_``: every reference the engine
        holds now sees the region; the contents start zeroed), and registers it.

        ``dtype``: the kvtier dtype name when the tensors' dtype is ambiguous (fp8 as uint8)."""
        import torch

        if self.region is not None:
            raise RuntimeError("kvtier: register_kv_caches was called twice")
        names = list(kv_caches)
        if not names:
            raise ValueError("kvtier: no KV caches to register")
        tensors = [kv_caches[n] for n in names]
        t0 = tensors[0]
        for name, t in zip(names, tensors):
            if t.device.type != "cpu":
                raise NotImplementedError(
                    f"kvtier: layer {name} is on {t.device}: GPU KV caches travel as cuda_ipc regions, which this "
                    "kvtier build does not open; run the engine's KV cache on the CPU"
                )
            if t.shape != t0.shape or t.dtype != t0.dtype or t.stride() != t0.stride():
                raise ValueError(f"kvtier: layer {name} differs from {names[0]} in shape, dtype or strides")
        want = self.config.layout_kind()
        kind, order = detect_layer_layout(list(t0.shape), list(t0.stride()), self.config.block_size, want)
        physical = t0.permute(order)
        if not physical.is_contiguous():
            raise ValueError("kvtier: the layer tensors have gaps or an unusual stride order; kvtier needs dense blocks")
        kind_dtype = dtype_kind_of(dtype) if dtype else dtype_kind_of(t0.dtype)
        if kind == KvLayoutKind.MLA:
            num_blocks, block_size, latent = (int(x) for x in physical.shape)
            shape = ModelShape(len(tensors), 1, latent, kind_dtype, AttentionKind.MLA)
        else:
            _, num_blocks, a, b, head_dim = (int(x) for x in physical.shape)
            heads, block_size = (b, a) if kind == KvLayoutKind.NHD else (a, b)
            shape = ModelShape(len(tensors), heads, head_dim, kind_dtype, AttentionKind.MHA)
        if block_size != self.config.block_size:
            raise ValueError(f"kvtier: the tensors' block size {block_size} is not the engine's {self.config.block_size}")
        if self.config.model is not None and self.config.model != shape:
            raise ValueError(f"kvtier: the KV tensors are {shape}, the scheduler registers {self.config.model}")
        layout = PagedKvLayout(shape, block_size, num_blocks, kind if kind != KvLayoutKind.MLA else KvLayoutKind.NHD)
        region = KvRegion.create(layout, "kvtier-kv-rank%d" % self.config.rank)
        inverse = [order.index(i) for i in range(len(order))]
        with torch.no_grad():
            for t, view in zip(tensors, torch_layers(region)):
                logical = view.permute(inverse)
                if logical.dtype != t.dtype:
                    logical = logical.view(t.dtype)
                t.set_(logical)
        self.region = region
        self.layer_names = names
        self._layer_index = {n: i for i, n in enumerate(names)}
        self.connector = Connector(self.config.connector_options(scheduler=False), region)
        if not self.connector.wait_ready(self.config.ready_timeout_s):
            log.warning(
                "kvtier: rank %d: no kvtier-server at %s yet (%s): running without loads and stores until it comes",
                self.config.rank,
                self.config.socket_path,
                self.connector.last_error,
            )

    def register_region(self, region: KvRegion, layer_names: Optional[Sequence[str]] = None) -> None:
        """Registers a region the engine allocated itself (its tensors are views of it,
        :func:`kvtier.torch_layers`). ``layer_names``: the names ``wait_layer`` is given, in the
        region's layer order (else it takes layer indices)."""
        if self.region is not None:
            raise RuntimeError("kvtier: a region is registered already")
        self.region = region
        self.layer_names = list(layer_names or [])
        self._layer_index = {n: i for i, n in enumerate(self.layer_names)}
        self.connector = Connector(self.config.connector_options(scheduler=False), region)
        self.connector.wait_ready(self.config.ready_timeout_s)

    def _conn(self) -> Connector:
        if self.connector is None:
            raise RuntimeError("kvtier: register_kv_caches must come first")
        return self.connector

    # -- vLLM: handle_preemptions ----------------------------------------------------------
    def handle_preemptions(self, plan: StepPlan) -> None:
        """Preempted requests' blocks go back to the engine now. Their stores need nothing: they
        read the blocks' generations when issued, and the fence before the next write of each
        block makes the server drop a store that had not copied it yet. In layerwise mode a
        preempted request that was running may hold blocks of a load the connector gave up on
        (the server hung): wait until none is quarantined, since vLLM hands them out at once."""
        if not self._layerwise or not plan.preempted:
            return None
        conn = self._conn()
        quarantined = set(conn.quarantined_blocks())
        if not quarantined:
            return None
        held: Set[int] = set()
        for rid in plan.preempted:
            held |= self._st.load_blocks.get(rid, set()) & quarantined
        if held:
            self.preemption_waits += 1
            log.warning(
                "kvtier: rank %d: a preempted request holds %d blocks a hung server may still write: waiting for "
                "their release (the server's answer or death, or quarantine_limit_ms)",
                self.config.rank,
                len(held),
            )
            conn.wait_released(sorted(held))
        return None

    # -- vLLM: start_load_kv ---------------------------------------------------------------
    def start_step(self, plan: StepPlan) -> None:
        """Before the forward pass: fence the blocks the step writes, issue the loads."""
        conn = self._conn()
        st = self._st
        refused = set(conn.blocks_reused(plan.fence_blocks)) if plan.fence_blocks else set()
        if refused:
            # The engine was handed a block the server may still write: never expected (the
            # requests owning quarantined blocks are held); load nothing into them. In
            # layerwise mode a running request whose load failed with the server hung
            # recomputes into its own quarantined blocks: expected, and harmless (a late copy
            # writes the same chunk's KV into the same positions).
            own = set().union(*st.load_blocks.values()) if self._layerwise and st.load_blocks else set()
            unexpected = refused - own
            if unexpected:
                self.fence_refusals += len(unexpected)
                log.error(
                    "kvtier: rank %d: %d quarantined blocks were scheduled for writing", self.config.rank, len(unexpected)
                )
        st.step_loads = []
        st.step_failed = set()
        for op in plan.loads:
            st.extra_errors.update(op.error_blocks)
            if op.error_blocks:
                st.step_failed.add(op.request_id)
            if not op.hashes or refused.intersection(op.block_ids):
                # Nothing to send (or nowhere safe to put it): every block is a load error and,
                # for an asynchronous load, the request is finished receiving at the next
                # report, as for a failed load.
                if op.hashes:
                    st.extra_errors.update(op.block_ids)
                    st.step_failed.add(op.request_id)
                if not self._layerwise:
                    st.unissued.append(op.request_id)
                continue
            st.load_blocks[op.request_id] = set(op.block_ids)
            conn.retrieve_hashes(
                op.request_id,
                op.hashes,
                op.first_chunk,
                op.block_ids,
                op.skip_tokens,
                op.cache_salt,
                layer_progress=self._layerwise,
                synchronous=self._layerwise,
            )
            if self._layerwise:
                st.step_loads.append(op.request_id)
            self.loads_issued += 1

    # -- vLLM: wait_for_layer_load -------------------------------------------------------
    def wait_layer(self, layer: Any) -> None:
        """Layerwise mode: blocks (the GIL released) until layer ``layer`` (a registered layer
        name, or an index) of every retrieve of this step is in the blocks, or the retrieve
        ended (its failures are load errors, taken at ``end_step``). Asynchronous mode: nothing
        (loads complete between steps)."""
        st = self._st
        if not self._layerwise or not st.step_loads:
            return
        index = layer if isinstance(layer, int) else self._layer_index.get(layer)
        if index is None:  # a name kvtier was not given: wait for every layer
            index = self.region.num_layers - 1 if self.region is not None else 0
        self._conn().wait_layers(st.step_loads, int(index) + 1)

    def _finish_step_loads(self) -> None:
        """Layerwise mode: waits for the end of this step's retrieves and takes their load
        errors (for this step's report), marking the requests whose blocks did not land."""
        st = self._st
        if not st.step_loads:
            return
        conn = self._conn()
        conn.wait_retrieves(st.step_loads)
        errors = set(conn.take_load_error_blocks())
        st.extra_errors |= errors
        if errors:
            for rid in st.step_loads:
                if st.load_blocks.get(rid, set()) & errors:
                    st.step_failed.add(rid)
        st.step_loads = []

    # -- vLLM: wait_for_save ---------------------------------------------------------------
    def end_step(self, plan: StepPlan) -> None:
        """After the forward pass wrote this step's blocks: issue the stores (non-blocking).
        Idempotent per plan."""
        if self._st.stored_plan is plan:
            return
        self._st.stored_plan = plan
        self._finish_step_loads()
        conn = self._conn()
        for op in plan.stores:
            if op.request_id in self._st.step_failed:
                # Computed this step from blocks that did not land: vLLM discards it and
                # recomputes; never stored.
                self.stores_dropped += 1
                continue
            conn.store_hashes(op.request_id, op.hashes, op.first_chunk, op.block_ids, op.cache_salt)
            self.stores_issued += 1

    # -- vLLM: get_finished ----------------------------------------------------------------
    def finished(self, finished_by_engine: Iterable[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """(finished sending, finished receiving) ids, each once; an id whose retrieve blocks
        are quarantined waits here until they are released."""
        conn = self._conn()
        sending, recving = conn.get_finished(sorted(finished_by_engine))
        st = self._st
        st.held_sending.extend(sending)
        st.held_recving.extend(recving)
        quarantined = set(conn.quarantined_blocks()) if (st.held_sending or st.held_recving) else set()

        def ready(rid: str) -> bool:
            blocks = st.load_blocks.get(rid)
            return not blocks or not (blocks & quarantined)

        out_recv = st.unissued + [r for r in st.held_recving if ready(r)]
        st.unissued = []
        out_send = [r for r in st.held_sending if ready(r)]
        st.held_recving = [r for r in st.held_recving if not ready(r)]
        st.held_sending = [r for r in st.held_sending if not ready(r)]
        for rid in out_recv + out_send:
            st.load_blocks.pop(rid, None)
        return (set(out_send) or None, set(out_recv) or None)

    # -- vLLM: get_block_ids_with_load_errors ----------------------------------------------
    def load_error_blocks(self) -> Set[int]:
        """Blocks whose KV did not land since the last call (each reported once); in layerwise
        mode every block of this step's loads that did not land."""
        self._finish_step_loads()
        out = set(self._conn().take_load_error_blocks())
        out |= self._st.extra_errors
        self._st.extra_errors = set()
        return out

    def held(self) -> int:
        """Finished reports held back for quarantined blocks (for tests)."""
        return len(self._st.held_recving) + len(self._st.held_sending)

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.close()

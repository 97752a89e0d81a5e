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

This module is the package's front door and its contract; each part lives in a module of its
own: :mod:`.config` (:class:`KVTierConfig`), :mod:`.plan` (the step plan),
:mod:`.scheduler_side`, :mod:`.worker_side`, :mod:`.kv_layouts` (a layer tensor's layout, read
from the tensor), :mod:`.request_keys` (what names a request's chunks besides its tokens).

Semantics the engine relies on (docs/integration.md, "vLLM"):

* Chunk keys: ``num_new_matched_tokens`` takes the request's key material
  (:mod:`.request_keys`: its tokens and, per chunk, the LoRA adapter, multimodal inputs and
  prompt embeddings at its positions; the cache salt goes into the model id), so requests
  whose KV differs never share a chunk; its stores and loads use the hashes named there.
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
* Fencing: before the engine first writes a block it handed to a request (a step's tokens
  starting the block, a prefill's blocks, a retrieve's destination) the worker bumps the
  block's generation (``block_reused``), so a store still reading a block that a preempted
  request left behind is dropped by the server instead of storing the new bytes. Later decode
  tokens into the same block are not fenced again (one fence per block, not per step).
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

from .config import LOAD_MODES, TIMEOUT_KEYS, KVTierConfig
from .kv_layouts import detect_layer_layout
from .plan import LoadOp, ScheduledRequest, StepInput, StepPlan, StoreOp
from .scheduler_side import SchedulerSide
from .worker_side import WorkerSide

__all__ = [
    "KVTierConfig",
    "LOAD_MODES",
    "TIMEOUT_KEYS",
    "LoadOp",
    "StoreOp",
    "StepPlan",
    "ScheduledRequest",
    "StepInput",
    "SchedulerSide",
    "WorkerSide",
    "detect_layer_layout",
]

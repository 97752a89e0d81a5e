"""The per-step plan: what travels from the scheduler side to every worker each step (vLLM's
connector metadata). Plain ints, strings and lists, so it pickles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Sequence, Tuple

__all__ = ["LoadOp", "StoreOp", "StepPlan", "ScheduledRequest", "ScheduledRow", "StepInput"]


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

    ``fence_blocks``: blocks this step writes that the request had not written since it got
    them (tokens computed into a new block, a prefill's or a resumed request's blocks, retrieve
    destinations); the worker fences each before the forward pass. A decode step writing into
    a block its request already wrote is not fenced again: the block's generation moved on its
    new owner's first write, which is what drops a store of its previous owner. ``preempted``: ids preempted this step.
    ``recv_last``: ids the engine finished while it still waited for their receiving report
    (aborted while loading): every rank's last report of them is receiving, never sending
    (vLLM frees them on the aggregated finished_recving; a rank's sending report would stay
    in its KVOutputAggregator for ever)."""

    loads: List[LoadOp] = field(default_factory=list)
    stores: List[StoreOp] = field(default_factory=list)
    fence_blocks: List[int] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)
    recv_last: List[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        """Nothing to do in any field (most decode steps); beside __reduce__, which pickles
        the same fields."""
        return not (self.loads or self.stores or self.fence_blocks or self.preempted or self.recv_last)

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        # Pickled every step (vLLM sends the metadata to each worker process): the ops as
        # tuples, not as dataclasses (a class reference and a dict of field names each), which
        # halves the bytes and the time.
        return (
            _plan_from_tuples,
            (
                [(o.request_id, o.first_chunk, o.hashes, o.block_ids, o.skip_tokens, o.cache_salt, o.error_blocks) for o in self.loads],
                [(o.request_id, o.first_chunk, o.hashes, o.block_ids, o.cache_salt) for o in self.stores],
                self.fence_blocks,
                self.preempted,
                self.recv_last,
            ),
        )


def _plan_from_tuples(loads: List[Tuple[Any, ...]], stores: List[Tuple[Any, ...]], fence_blocks: List[int],
                      preempted: List[str], recv_last: List[str]) -> StepPlan:
    """A :class:`StepPlan` from what its ``__reduce__`` pickled."""
    return StepPlan([LoadOp(*t) for t in loads], [StoreOp(*t) for t in stores], fence_blocks, preempted, recv_last)


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


#: A :class:`ScheduledRequest`'s fields as a tuple, in its order: ``(request_id, block_ids,
#: num_computed_tokens, num_scheduled_tokens, replace_blocks)``. What
#: :meth:`~kvtier.integrations.scheduler_side.SchedulerSide.plan_step` takes: the vLLM
#: connector reads one per running request every step, and a tuple costs a fraction of an
#: object (docs/performance.md, "vLLM connector: cost per step").
ScheduledRow = Tuple[str, Sequence[int], int, int, bool]


@dataclass
class StepInput:
    """The engine's schedule of one step, as :meth:`SchedulerSide.build_step` needs it."""

    scheduled: List[ScheduledRequest] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)

"""vLLM's ``SchedulerOutput`` read as the scheduler side's
:class:`~kvtier.integrations.plan.StepInput` (:func:`step_input_from`), and the block ids
kvtier uses of vLLM's per-group ones (:func:`first_group`)."""

from __future__ import annotations

from typing import Any, Dict, List

from .plan import ScheduledRequest, StepInput

__all__ = ["first_group", "step_input_from"]


def first_group(block_ids: Any) -> List[int]:
    """vLLM's block ids per KV cache group (a tuple of lists), or a plain list: group 0."""
    if block_ids is None:
        return []
    if hasattr(block_ids, "get_block_ids"):  # KVCacheBlocks
        block_ids = block_ids.get_block_ids()
    if isinstance(block_ids, tuple):
        return list(block_ids[0]) if block_ids else []
    return list(block_ids)


def step_input_from(scheduler_output: Any) -> StepInput:
    """The :class:`~kvtier.integrations.core.StepInput` of vLLM's ``SchedulerOutput``."""
    num_scheduled: Dict[str, int] = scheduler_output.num_scheduled_tokens
    step = StepInput(preempted=sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()))
    for new in scheduler_output.scheduled_new_reqs:
        step.scheduled.append(
            ScheduledRequest(
                new.req_id,
                first_group(new.block_ids),
                int(new.num_computed_tokens),
                int(num_scheduled.get(new.req_id, 0)),
                replace_blocks=True,
            )
        )
    cached = scheduler_output.scheduled_cached_reqs
    resumed_set = getattr(cached, "resumed_req_ids", None)
    resumed_flags = getattr(cached, "resumed_from_preemption", None)  # older vLLM
    for i, rid in enumerate(cached.req_ids):
        resumed = (rid in resumed_set) if resumed_set is not None else bool(resumed_flags and resumed_flags[i])
        step.scheduled.append(
            ScheduledRequest(
                rid,
                first_group(cached.new_block_ids[i]),
                int(cached.num_computed_tokens[i]),
                int(num_scheduled.get(rid, 0)),
                replace_blocks=resumed,
            )
        )
    return step

"""The replay engine: vLLM's engine-core loop over the mini scheduler (this process, with the
scheduler-side KVTierConnector) and one worker process per tensor-parallel rank (each with
its worker-side KVTierConnector), connected by pipes that carry the pickled
SchedulerOutput (the connector metadata in it) and the workers' outputs.

Per step: schedule -> every worker executes -> the outputs are aggregated as vLLM's
KVOutputAggregator does (an id is finished sending / receiving once every rank reported it,
or ``get_finished_count()`` ranks when the connector names a count; load-error blocks are the
union; the workers' stats folded with ``aggregate``, the first one the accumulator) ->
update_from_output. Checks on the way, collected in
``violations``: a synthetic worker finding a KV row that is not its token's (a wrong load,
a block overwritten), a quarantined block in the free block pool, a fence refused (the engine
about to write a quarantined block), a report vLLM would reject.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from kvtier.integrations.vllm import KVConnectorRole, KVTierConnector

from .model import check_runner_dtype
from .scheduler import MiniScheduler
from .vllm_configs import full_attention_config
from .vllm_shapes import KVConnectorOutput, Request, SchedulerOutput, vllm_config
from .worker import WorkerSpec, _layer_names, worker_main

_CONTEXT = None


def _mp():
    """A forkserver context that has imported torch and kvtier once: workers start in
    milliseconds instead of the seconds a spawn (re-importing torch) takes."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "kvtier", "kvtier.integrations.vllm", "replay.worker"])
        _CONTEXT = ctx
    return _CONTEXT


#: Seconds one worker step may take before the test fails (a hung worker).
STEP_TIMEOUT_S = 60.0


@dataclass
class StepRecord:
    output: SchedulerOutput
    sampled: Dict[str, int]
    kv: KVConnectorOutput
    worker_outputs: List[Dict[str, Any]]


class ReplayEngine:
    def __init__(
        self,
        *,
        socket_path: Optional[str],
        world_size: int = 1,
        layout: str = "NHD",
        runner: str = "synthetic",
        num_layers: int = 2,
        kv_heads: int = 2,
        head_dim: int = 8,
        block_size: int = 4,
        num_blocks: int = 64,
        chunk_tokens: int = 16,
        token_budget: int = 32,
        prefix_caching: bool = False,
        chunk_align: bool = True,
        extra: Optional[Dict[str, Any]] = None,
        kv_role: str = "kv_both",
        kv_load_failure_policy: str = "recompute",
        engine_id: Optional[str] = None,
        dtype: str = "float32",
    ) -> None:
        """``kv_load_failure_policy``: vLLM's default is "fail"; the replay runs "recompute"
        unless a test asks for "fail". ``engine_id``: vLLM's kv_transfer_config.engine_id (a
        fresh uuid when None), the same in the scheduler and every worker of this engine.
        ``dtype``: the model's dtype ("float32", "float16" or "bfloat16"), which vLLM's
        KV caches have (``cache_dtype`` "auto"): the workers allocate them so and the
        scheduler's and workers' vLLM configs say so; the TinyDecoder (``runner="model"``)
        runs in float32 only (ValueError otherwise)."""
        check_runner_dtype(runner, dtype)
        self.world_size = world_size
        self.kvtier = socket_path is not None
        self.engine_id = engine_id or str(uuid.uuid4())
        extra = dict(extra or {})
        if self.kvtier:
            extra.setdefault("socket_path", str(socket_path))
            extra.setdefault("chunk_tokens", chunk_tokens)
            extra.setdefault("kv_layout", layout)
            extra.setdefault("ready_timeout_s", 30)
        self._procs = []
        self._pipes = []
        self._dist_dir: Optional[str] = None
        if runner == "model" and world_size > 1:  # the ranks' gloo group (TinyDecoder's all-reduce)
            self._dist_dir = tempfile.mkdtemp(prefix="kvtier-replay-dist-")
        ctx = _mp()
        for rank in range(world_size):
            spec = WorkerSpec(
                rank=rank,
                world_size=world_size,
                layout=layout,
                runner=runner,
                num_layers=num_layers,
                kv_heads=kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                num_blocks=num_blocks,
                kvtier=self.kvtier,
                extra=dict(extra, rank=rank),
                dist_init=os.path.join(self._dist_dir, "group") if self._dist_dir else None,
                kv_role=kv_role,
                kv_load_failure_policy=kv_load_failure_policy,
                engine_id=self.engine_id,
                dtype=dtype,
            )
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, spec), daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._pipes.append(parent)
        for pipe in self._pipes:
            kind, payload = self._recv(pipe)
            assert kind == "ready", payload
        self.connector: Optional[KVTierConnector] = None
        if self.kvtier:
            cfg = vllm_config(
                model="replay/tiny",
                num_layers=num_layers,
                num_kv_heads=kv_heads,
                head_size=head_dim,
                block_size=block_size,
                tp=world_size,
                extra=extra,
                kv_role=kv_role,
                kv_load_failure_policy=kv_load_failure_policy,
                engine_id=self.engine_id,
                dtype=dtype,
            )
            kv_cache_config = full_attention_config(
                _layer_names(num_layers), num_blocks, block_size, kv_heads // world_size, head_dim, dtype
            )
            self.connector = KVTierConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.sched = MiniScheduler(
            self.connector,
            num_blocks=num_blocks,
            block_size=block_size,
            token_budget=token_budget,
            prefix_caching=prefix_caching,
            chunk_align=chunk_tokens if chunk_align else None,
            kv_load_failure_policy=kv_load_failure_policy,
        )
        # KVOutputAggregator.from_connector: the connector's count, else every worker.
        count = self.connector.get_finished_count() if self.connector is not None else None
        self.expected_finished_count = count or world_size
        self.violations: List[str] = []
        self.discarded = 0  # request outputs vLLM discarded (rolled back after a failed synchronous load)
        self.logits: Dict[Tuple[str, int], Any] = {}
        self.ttft: Dict[str, float] = {}
        self._arrival: Dict[str, float] = {}
        self._agg: Dict[str, Counter] = {"sending": Counter(), "recving": Counter()}
        self._sent_by_rank: List[set] = [set() for _ in range(world_size)]  # ids each rank reported finished sending
        self.reports_by_id: Dict[str, List[Tuple[int, int, str]]] = {}  # id -> (step, rank, "sending"/"recving")
        self.steps: List[StepRecord] = []
        self.keep_records = False

    # ------------------------------------------------------------------------------
    def _recv(self, pipe) -> Tuple[str, Any]:
        if not pipe.poll(STEP_TIMEOUT_S):
            raise AssertionError("a replay worker did not answer in time")
        kind, payload = pipe.recv()
        if kind == "error":
            raise AssertionError(f"a replay worker failed:\n{payload}")
        return kind, payload

    def add(
        self, request_id: str, prompt: Optional[List[int]], max_tokens: int = 2, cache_salt: Optional[str] = None, **inputs: Any
    ) -> Request:
        """Adds a request; ``inputs``: vLLM's lora_request, mm_features, prompt_embeds
        (``prompt=None`` with prompt_embeds: an embeddings-only prompt)."""
        req = Request(request_id, prompt, max_tokens, cache_salt, **inputs)
        self._arrival[request_id] = time.perf_counter()
        self.sched.add_request(req)
        return req

    def step(self, before_workers: Optional[Callable[[SchedulerOutput], None]] = None) -> StepRecord:
        so = self.sched.schedule()
        if before_workers is not None:
            before_workers(so)
        for pipe in self._pipes:
            pipe.send(("step", so))
        outs = [self._recv(pipe)[1] for pipe in self._pipes]
        kv = KVConnectorOutput(finished_sending=set(), finished_recving=set(), invalid_block_ids=set())
        for rank, out in enumerate(outs):
            for which in ("sending", "recving"):
                for rid in out.get(f"finished_{which}") or ():
                    self.reports_by_id.setdefault(rid, []).append((self.sched.step_count, rank, which))
            for rid in out.get("finished_sending") or ():
                if rid in self._sent_by_rank[rank]:
                    self.violations.append(f"step {self.sched.step_count}: rank {rank} reported {rid} finished sending twice")
                self._sent_by_rank[rank].add(rid)
            stats = out.get("kv_connector_stats")
            if stats is not None:
                kv.kv_connector_stats = stats if kv.kv_connector_stats is None else kv.kv_connector_stats.aggregate(stats)
            if out.get("fence_refusals"):
                self.violations.append(f"step {self.sched.step_count}: {out['fence_refusals']} fences refused")
            q = set(out.get("quarantined", ()))
            free_q = q & set(self.sched.pool.free)
            if free_q:
                self.violations.append(f"step {self.sched.step_count}: quarantined blocks {sorted(free_q)} are free")
            kv.invalid_block_ids |= set(out.get("invalid_block_ids") or ())
            for which, key in (("sending", "finished_sending"), ("recving", "finished_recving")):
                for rid in out.get(key) or ():
                    self._agg[which][rid] += 1
                    if self._agg[which][rid] == self.expected_finished_count:
                        getattr(kv, key).add(rid)
                        del self._agg[which][rid]
        sampled = outs[0]["sampled"]
        had = {rid: len(r.output_token_ids) for rid, r in self.sched.requests.items()}
        try:
            discarded = self.sched.update_from_output(so, sampled, kv if self.kvtier else None)
        except AssertionError as e:
            rid = str(e).split(" ")[0]
            history = self.reports_by_id.get(rid, [])
            req = self.sched.finished.get(rid) or self.sched.requests.get(rid)
            self.violations.append(f"step {self.sched.step_count}: {e} (reports (step, rank, kind): {history}; "
                                   f"status {req.status.name if req is not None else None})")
            raise
        # What vLLM keeps of the step: not the output of a request it rolled back (a synchronous
        # load with failed blocks); anything wrong in what it keeps is a violation.
        for out in outs:
            bad = {rid: n for rid, n in (out.get("bad_rows") or {}).items() if rid not in discarded}
            if bad:
                self.violations.append(f"step {self.sched.step_count}: KV rows not their token's: {bad}")
        self.discarded += len(discarded)
        for rid, logits in outs[0].get("logits", {}).items():
            if rid not in discarded:
                self.logits[(rid, len(so.token_ids[rid]))] = logits
        now = time.perf_counter()
        for rid, n in had.items():
            req = self.sched.requests.get(rid) or self.sched.finished.get(rid)
            if req is not None and n == 0 and req.output_token_ids and rid not in self.ttft:
                self.ttft[rid] = now - self._arrival[rid]
        rec = StepRecord(so, sampled, kv, outs)
        if self.keep_records:
            self.steps.append(rec)
        if so.total_num_scheduled_tokens == 0:
            time.sleep(0.001)  # nothing to compute: the engine is waiting on loads or lookups
        return rec

    def run(
        self,
        until: Optional[Callable[[], bool]] = None,
        max_steps: int = 20000,
        before_workers: Optional[Callable[[SchedulerOutput], None]] = None,
        timeout_s: float = 120.0,
    ) -> int:
        """Steps until `until()` (default: every request finished and released). Returns the
        number of steps."""
        done = until or (lambda: not self.sched.has_requests())
        deadline = time.monotonic() + timeout_s
        n = 0
        while not done():
            if n >= max_steps or time.monotonic() > deadline:
                raise AssertionError(
                    f"the replay did not finish: {n} steps, waiting {[(r.request_id, r.status.name) for r in self.sched.waiting]}, "
                    f"running {[r.request_id for r in self.sched.running]}, held {sorted(self.sched.requests)}"
                )
            self.step(before_workers)
            n += 1
        return n

    def scheduler_healthy(self) -> bool:
        """Whether the scheduler's own connection is registered with a server (it reconnects
        on its own backoff, apart from the workers')."""
        return self.connector is not None and self.connector._scheduler.connector.healthy

    def partial_reports(self) -> Dict[str, Dict[str, int]]:
        """Ids some ranks but not all reported finished (vLLM's KVOutputAggregator keeps their
        counts until the rest come): none at idle, or the aggregator holds them for ever."""
        return {which: dict(c) for which, c in self._agg.items() if c}

    def scheduler_connector_stats(self) -> Dict[str, int]:
        """The scheduler connection's own counters (kvtier.Connector.stats())."""
        return self.connector._scheduler.connector.stats() if self.connector is not None else {}

    def all_healthy(self) -> bool:
        """The scheduler's connection and every worker's: a lookup made now can hit."""
        return self.scheduler_healthy() and all(o["healthy"] for o in self.worker_state())

    def worker_state(self) -> List[Dict[str, Any]]:
        """Runs an empty step and returns each worker's output (quarantine, held reports)."""
        return self.step().worker_outputs

    def close(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.send(("stop",))
                self._recv(pipe)
            except Exception:
                pass
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if self.connector is not None:
            self.connector.shutdown()
        if self._dist_dir is not None:
            shutil.rmtree(self._dist_dir, ignore_errors=True)

    def __enter__(self) -> "ReplayEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

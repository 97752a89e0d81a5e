"""The replay engines' workload: vLLM's split (the scheduler here, each TP rank a worker
process with its own connection), fed with prompts that share prefixes, long documents
beyond L1, several salts, aborts and preemptions; and the kill of a worker in a step that
loads (an engine SIGKILLed mid-retrieve), after which the engine is started again."""

from __future__ import annotations

import inspect
import random
import signal
import threading
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from replay.engine import ReplayEngine
from replay.vllm_shapes import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, RequestStatus


@dataclass
class PromptPool:
    """Token lists drawn from the seed: shared prefixes (system prompts), documents that
    come back (hits), a few long ones (together far beyond L1), and a fresh tail per request."""

    rng: random.Random
    prefixes: List[List[int]] = field(default_factory=list)
    documents: List[List[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        r = self.rng
        tok = lambda n: [r.randrange(1, 30000) for _ in range(n)]  # noqa: E731
        self.prefixes = [tok(r.randrange(16, 97)) for _ in range(8)]
        self.documents = [tok(r.randrange(20, 400)) for _ in range(40)] + [tok(r.randrange(1000, 2400)) for _ in range(8)]

    def inputs(self, r: random.Random, prompt: List[int]) -> Dict[str, Any]:
        """What else a request may carry (vLLM's keys cover them): a LoRA adapter (1 in 10),
        an image over some of its positions (1 in 20), or only prompt embeddings (1 in 30).
        The synthetic KV does not depend on them; they exercise the key paths under faults."""
        x = r.random()
        if x < 0.10:
            n = r.randrange(2)
            return {"lora_request": LoRARequest(f"soak-adapter-{n}", n + 1)}
        if x < 0.15 and len(prompt) > 40:
            at, length = 8, 24
            prompt[at : at + length] = [7] * length
            n = r.randrange(3)
            rows = torch.randn(length, 32, generator=torch.Generator().manual_seed(n))
            return {"mm_features": [MultiModalFeatureSpec(rows, "image", f"soak-image-{n}", PlaceholderRange(at, length))]}
        if x < 0.183:
            n = r.randrange(2)
            return {"prompt_embeds": torch.randn(len(prompt), 32, generator=torch.Generator().manual_seed(100 + n))}
        return {}

    def prompt(self, r: random.Random) -> List[int]:
        """A prompt drawn with the engine's own stream (a seed replays it)."""
        doc = self.documents[min(int(r.paretovariate(1.2)) - 1, len(self.documents) - 1)] if r.random() < 0.7 else r.choice(self.documents)
        return r.choice(self.prefixes) + doc + [r.randrange(1, 30000) for _ in range(r.randrange(1, 20))]


@dataclass
class EngineSpec:
    name: str
    world_size: int
    layout: str
    block_size: int
    num_blocks: int
    dtype: str = "float32"
    salts: tuple = ("",)


class ReplayDriver:
    """One replay engine kept busy: ``in_flight`` requests at a time."""

    def __init__(self, spec: EngineSpec, socket_path: str, rng: random.Random, pool: PromptPool,
                 chunk_tokens: int, timeouts: Dict[str, int], in_flight: int = 5) -> None:
        self.spec, self.socket_path, self.rng, self.pool = spec, socket_path, rng, pool
        self.chunk_tokens, self.timeouts, self.in_flight = chunk_tokens, timeouts, in_flight
        self.generation = 0
        self.next_id = 0
        self.added = self.finished = self.aborted = self.preempted = self.killed = 0
        self.failures: List[str] = []
        self._kill_armed = False
        self._killed_now = False
        self.engine: Optional[ReplayEngine] = None
        self._seen_violations = 0
        self._start()

    def _start(self) -> None:
        kw: Dict[str, Any] = dict(
            socket_path=self.socket_path, world_size=self.spec.world_size, layout=self.spec.layout,
            block_size=self.spec.block_size, num_blocks=self.spec.num_blocks, chunk_tokens=self.chunk_tokens,
            token_budget=64, prefix_caching=True, extra=dict(self.timeouts))
        if "dtype" in inspect.signature(ReplayEngine.__init__).parameters:
            kw["dtype"] = self.spec.dtype
        self.engine = ReplayEngine(**kw)
        self.generation += 1
        self.next_id = 0  # the same request ids again: ids reused across engines
        self._seen_violations = 0

    # --- the work -----------------------------------------------------------------------
    def _admit(self) -> None:
        sched = self.engine.sched
        while len(sched.waiting) + len(sched.running) < self.in_flight:
            rid = f"req-{self.next_id}"
            self.next_id += 1
            salt = self.rng.choice(self.spec.salts)
            prompt = self.pool.prompt(self.rng)
            inputs = self.pool.inputs(self.rng, prompt)
            if "prompt_embeds" in inputs:
                prompt = None  # an embeddings-only prompt
            self.engine.add(rid, prompt, max_tokens=self.rng.randrange(1, 9), cache_salt=salt or None, **inputs)
            self.added += 1

    def _disturb(self) -> None:
        sched = self.engine.sched
        r = self.rng.random()
        live = [q for q in list(sched.waiting) + sched.running if not q.is_finished()]
        if r < 0.03 and live:
            sched.abort(self.rng.choice(live).request_id)
            self.aborted += 1
        elif r < 0.05 and sched.running:
            sched.preempt(self.rng.choice(sched.running).request_id)
            self.preempted += 1

    def arm_kill(self) -> None:
        """The next step that loads KV gets one of its workers SIGKILLed while it runs."""
        self._kill_armed = True

    def _before_workers(self, so: Any) -> None:
        if not self._kill_armed:
            return
        meta = so.kv_connector_metadata
        plan = getattr(meta, "plan", meta)
        if not getattr(plan, "loads", None):
            return
        self._kill_armed = False
        self._killed_now = True
        pid = self.rng.choice(self.engine._procs).pid
        t = threading.Timer(self.rng.uniform(0.0, 0.02), lambda: _kill(pid))
        t.daemon = True
        t.start()

    def tick(self, admit: bool) -> None:
        if admit:
            self._admit()
            self._disturb()
        before = len(self.engine.sched.finished)
        try:
            self.engine.step(self._before_workers)
        except (EOFError, BrokenPipeError, ConnectionResetError, AssertionError, OSError) as e:
            if not self._killed_now:
                last = self.engine.violations[self._seen_violations:]  # the replay's own account, when it has one
                self.failures.append(f"{self.spec.name}: a step failed: {last[-1] if last else f'{type(e).__name__}: {e}'}")
            self.restart()
            return
        self.finished += len(self.engine.sched.finished) - before
        self._check_violations()

    def _check_violations(self) -> None:
        v = self.engine.violations
        if len(v) > self._seen_violations:
            for msg in v[self._seen_violations:]:
                self.failures.append(f"{self.spec.name} (generation {self.generation}): {msg}")
            self._seen_violations = len(v)

    def restart(self) -> None:
        if self._killed_now:
            self.killed += 1
        self._killed_now = False
        self._kill_armed = False
        try:
            self.engine.close()
        except Exception:  # a dead worker: close() already tolerates it; nothing to keep
            pass
        self._start()

    # --- quiet points -------------------------------------------------------------------
    def drain(self, timeout_s: float) -> None:
        """Steps until every request finished and was released (no admission meanwhile)."""
        self.engine.run(timeout_s=timeout_s)
        self._check_violations()

    def idle_state(self) -> Dict[str, Any]:
        """What the engine still holds at idle: every value 0 (or empty) when nothing leaked."""
        outs = self.engine.worker_state()
        self._check_violations()
        sched = self.engine.sched
        conns = [self.engine.scheduler_connector_stats()] + [o.get("connector_stats", {}) for o in outs]
        return {
            # kvtier.Connector.stats() of the scheduler's connection and each worker's: calls
            # waiting for a reply, requests tracked for get_finished, lookup entries, and
            # connections kept open for late replies besides the current one.
            "connector_pending_calls": sum(c.get("pending_calls", 0) for c in conns),
            "connector_tracked_requests": sum(c.get("tracked_requests", 0) for c in conns),
            "connector_lookups": sum(c.get("lookups", 0) for c in conns),
            "connector_connections_kept": sum(max(c.get("open_connections", 1) - 1, 0) for c in conns),
            "scheduler_holds": sched.holds(),
            # ids only some ranks reported, with every report of theirs (step, rank, kind)
            "aggregator_partial_reports": {which: {rid: self.engine.reports_by_id.get(rid) for rid in ids}
                                           for which, ids in self.engine.partial_reports().items()},
            "scheduler_waiting_for_kv": sum(1 for q in sched.waiting if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS),
            "worker_quarantined_blocks": sum(len(o.get("quarantined", ())) for o in outs),
            "worker_held": sum(int(o.get("held", 0)) for o in outs),
            "blocks_in_use": self.spec.num_blocks - len(sched.pool.free),
        }

    def healthy(self) -> bool:
        return self.engine.all_healthy()

    def close(self) -> None:
        self.engine.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

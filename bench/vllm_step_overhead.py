#!/usr/bin/python3
"""What KVTierConnector costs vLLM per engine step (issue 30, part 4).

A kvtier-server (its own temporary directory, a Unix socket) and the two halves of the vLLM
connector the way vLLM runs them: one ``KVTierConnector`` with the SCHEDULER role (no KV
tensors) and one with the WORKER role, each with its own connection, registered as one engine.
The worker's KV caches have the shape of one rank of an 8B model (Llama-3.1-8B, TP=1): 32
layers of ``(2, blocks, 16, 8, 128)`` bf16 CPU tensors, which ``register_kv_caches`` moves into
the kvtier region. A driver in this file plays vLLM's engine loop (vllm/v1/core/sched/
scheduler.py + the worker's kv_connector_model_runner_mixin.py, at the commit
``kvtier.integrations.vllm.VLLM_COMMIT``) and calls every connector method where vLLM does:

  scheduler  get_num_new_matched_tokens (each waiting request, again while its lookup is
             pending), update_state_after_alloc (each admitted one), build_connector_meta (the
             SchedulerOutput: the running requests' decode tokens, the new requests' prefill),
             request_finished (each request that finished), update_connector_output,
             get_kv_connector_stats (+ aggregate with the worker's), take_events
  metadata   with --executor mp only: pickle.dumps + pickle.loads of the connector metadata
             (vLLM's multiproc executor, TP > 1, sends the SchedulerOutput to the workers
             pickled). The default, --executor uni, is what vLLM runs on one GPU
             (ParallelConfig: world_size 1 -> "uni"): UniProcExecutor calls the worker in the
             engine core's process with the SchedulerOutput as it is, nothing pickled
  worker     bind_connector_metadata, handle_preemptions, start_load_kv, per layer
             wait_for_layer_load + save_kv_layer (32 layers), then (after the forward pass)
             wait_for_save, get_finished, get_block_ids_with_load_errors,
             get_kv_connector_stats, get_kv_connector_kv_cache_events,
             build_connector_worker_meta, clear_connector_metadata

The figure of a step is the wall time of all those calls (the three groups added: the
scheduler and the workers run one after the other within a vLLM step); the driver's own work
(building the SchedulerOutput, the block tables) is not counted. The forward pass is a wait
of the assumed step time (below) between save_kv_layer and wait_for_save, during which the
server does the step's I/O as it would while the GPU computes; it is not counted either. The
wait spins (--wait spin, the default), as vLLM's processes do while the GPU computes (CUDA's
default synchronization spins, the engine core polls its queues): a sleep hands the core to
other processes, and on a shared 2-core machine the calls after it then run on cold caches,
two to three times slower (--wait sleep shows it).

--decode-only runs the n requests' decode steps (nothing finishes or arrives, no I/O) in two
interleaved ways: back to back, on warm caches, the floor of what a step of the connector
costs (RESULT vllm_decode_step_us_<n>, vllm_decode_step_vs_budget_256); and with the
forward-pass wait between save_kv_layer and wait_for_save as in the steady state
(vllm_decode_step_after_wait_us_<n>): the same calls, the same work, after the wait. Beside
them, a control without kvtier: the same Python work (a walk over 1024 small dicts of lists
and a pickle, about 1 MB touched) back to back and after the same spin as n = 256's wait
(machine_python_us, machine_python_after_wait_us, machine_after_wait_slowdown): what this
machine does to code that waited, whoever wrote it. On a shared VM the steady-state figure is
mostly that (docs/performance.md, "vLLM connector: cost per step").

--output-thread runs a second Python thread in the process, as vLLM's EngineCore has one
(process_output_sockets) that serializes each step's outputs: at the start of every step the
driver hands it the step's outputs (n small tuples, pickled), and it waits for the next. It
needs the GIL for that work: a connector call that releases the GIL lets it in, and the
engine thread then waits for it (up to sys.getswitchinterval(), 5 ms), in the step's figure.

The start-up heap is frozen before the first step, as vLLM's EngineCore.__init__ freezes it
(vllm/utils/gc_utils.py freeze_gc_heap: gc.collect of each generation, then gc.freeze()) once
its scheduler, its workers (at TP=1 in the same process) and their connectors exist and the KV
caches are registered, before any request: the garbage collector's passes then skip those
objects, in vLLM and here. --no-gc-freeze leaves the heap as it is.

The steady state prints the engine thread's CPU time in the same calls beside their wall time
(RESULT vllm_step_overhead_cpu_us_<n>: where it is well below, the thread waited for a core or
a mutex), and at n = 256 runs control windows of its own (mixed, not in the headline; off with
--no-steady-control): each step pickles its metadata twice right after it was built (the
second one timed: warm) and once more right after the forward-pass wait, outside the step's figure
(steady_repickle_us_256, steady_repickle_after_wait_us_256, steady_after_wait_slowdown_256):
the same work on the same object, warm and after a wait during which the server moved the
arrivals' KV. Then, without kvtier, one write to a pipe right after the same wait, read by a
process asleep in read() (the write wakes it) and by one spinning on non-blocking reads
(machine_wake_us, machine_write_no_wake_us): what a connector call's sendmsg to the server costs
the engine thread after the wait, and how much of it is the wake.

The workload: a steady state of n requests in the engine (n = 1, 64, 256). Each request has a
prompt of --prompt-tokens tokens (520: 2 chunks of 256 tokens and 8 more) and generates
--output-tokens tokens (256); a request that finishes is replaced by a new one at once, so
about n / 256 requests arrive and finish per step and every other request runs a decode step
(one token; a new block every 16 tokens). kvtier stores prompt chunks only, so a decode step
does no I/O; the arrivals do, by scenario:

  nohit   every new prompt is unseen: a lookup that misses, a prefill of 520 tokens, a store
          of 2 chunks (64 MiB) at that step's wait_for_save
  hit     every new prompt's first 512 tokens were stored before (a pool of 4 prefixes, put
          in the server's L1 before the window): a lookup that hits, an asynchronous load of
          2 chunks (64 MiB) into the request's blocks, a prefill of the last 8 tokens
  mixed   new requests alternate between the two (the headline)

The running population at the start of each n was admitted with its 512-token prefix in
vLLM's own prefix cache (looked up, nothing loaded or stored), so setting it up costs no
I/O; it turns over to the scenario's requests as the windows run.

Block ids: the region holds --region-blocks blocks (768: 1.5 GiB, which the server
prefaults); the driver hands out ids round robin over them, so requests share physical blocks
(their KV contents are never checked). To the connector a block id is an int whatever memory
it names, so its Python work is the same as with distinct blocks; every copy a store or load
makes has the full size. (256 requests of 648 tokens each would need 20 GiB of KV at 128 KiB
per token: more than this machine has.)

Each configuration (n, scenario) runs --repeats windows, interleaved (n fixed, the scenarios
in turn), of --steps measured steps after --warmup steps; the RESULT is the median of all its
measured steps. The mean is printed too (vllm_step_overhead_mean_us_<n>): on a busy 2-core
machine it is dominated by a few steps in which calls into the C++ connector took
milliseconds instead of microseconds, which the median leaves out. They come in runs, after
stores and loads were issued, when the server's copy threads (64 MiB per arrival) and other
processes leave the engine thread and the connectors' threads one core: the engine thread
waits for a core, or for the connector's mutex held by a connector thread that lost its core
(docs/performance.md, "vLLM connector: cost per step"). Comment lines give the split
(scheduler, metadata, worker), p90, p99, the mean per window, the window's I/O, and the mean
per step of each group of calls.

The assumed decode step (the budget: 1% of it). A decode step of an 8B model on one H100 is
bound by HBM bandwidth: it reads every weight once (Llama-3.1-8B: 8.03e9 parameters, 16.06 GB
in bf16) and every running request's KV (32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes =
128 KiB per token; this workload's requests hold 520 + 256 / 2 = 648 tokens on average), at
3.35 TB/s (H100 SXM5 HBM3, NVIDIA's datasheet):

  n = 1:   16.1 GB + 0.08 GB  -> 4.8 ms
  n = 64:  16.1 GB + 5.4 GB   -> 6.4 ms
  n = 256: 16.1 GB + 21.7 GB  -> 11.3 ms   (compute: 2 x 8e9 x 256 = 4.1 TFLOP, ~4-6 ms at
                                            the 700-990 TFLOPS bf16 an H100 reaches: below)

That is the floor (real kernels reach ~80% of the bandwidth; vLLM's own CPU work and
sampling add more), so 1% of it is a conservative budget: 48 us at n = 1, 64 us at 64, 113 us
at 256. RESULT vllm_step_budget_us_<n> prints it.

  KVTIER_BUILD_DIR=build bench/vllm_step_overhead.py [--quick] [--profile] [--decode-only] [--repeats 5] ...

Prints RESULT lines: vllm_step_overhead_us_<n> (mixed, the headline), its mean
vllm_step_overhead_mean_us_<n>, vllm_step_overhead_us_<n>_<scenario> for nohit, hit, mixed;
vllm_step_budget_us_<n>; vllm_step_overhead_vs_budget_256 (the headline at 256 over its
budget: <= 1 meets the target).
``--profile`` runs cProfile over the connector calls of the n = 256 mixed windows (nothing
else) and prints the top functions by total and by cumulative time instead.
``--time-calls`` wraps both connectors' C++ ``kvtier.Connector`` and the scheduler's
``TokenHasher`` and prints each method's count, median and mean wall time (us) over the whole
run (priming and the population included), cProfile's distortion aside.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pickle
import pstats
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Deque, Dict, List, Optional, Set

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("KVTIER_BUILD_DIR", REPO / "build")).resolve()
sys.path.insert(0, str(BUILD / "python"))
sys.path.insert(0, str(REPO / "tests" / "python"))

import torch  # noqa: E402

import kvtier  # noqa: E402
from kvtier.integrations.vllm import KVConnectorRole, KVTierConnector  # noqa: E402
from kvtier_testing import ServerFactory, server_binary, wait_l1_settled  # noqa: E402
from replay.vllm_configs import full_attention_config  # noqa: E402
from replay.vllm_shapes import (  # noqa: E402
    CachedRequestData,
    KVCacheBlocks,
    KVConnectorOutput,
    NewRequestData,
    Request,
    SchedulerOutput,
    vllm_config,
)

# One rank of Llama-3.1-8B at TP=1 (its config.json: 32 layers, 8 KV heads, head_dim 128).
LAYERS, KV_HEADS, HEAD_DIM, BLOCK, CHUNK = 32, 8, 128, 16, 256
KV_BYTES_PER_TOKEN = LAYERS * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16: 128 KiB
WEIGHT_BYTES = 8.03e9 * 2  # bf16
HBM_BYTES_PER_S = 3.35e12  # H100 SXM5 (NVIDIA's datasheet)
NS = (1, 64, 256)
SCENARIOS = ("nohit", "hit", "mixed")
DECODE_SCENARIOS = ("decode", "decode_wait")  # --decode-only: back to back, and after the forward-pass wait
POOL = 4  # prefixes the hit scenario's prompts start with


def freeze_startup_heap() -> int:
    """vLLM's freeze_gc_heap (vllm/utils/gc_utils.py), which EngineCore.__init__ calls once the
    engine is set up: every generation collected, then everything alive moved to the permanent
    generation, which collections skip. Returns the objects frozen."""
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()
    return gc.get_freeze_count()


def spin(seconds: float) -> None:
    """Busy-waits ``seconds``, as vLLM's processes wait while the GPU computes."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


class OutputThread:
    """--output-thread: vLLM's EngineCore's output thread reduced to its GIL use (module
    docstring): each step's n outputs built and pickled, then a blocking wait for the next."""

    def __init__(self) -> None:
        self.jobs: "queue.SimpleQueue[Optional[int]]" = queue.SimpleQueue()
        self.serialized = 0  # steps whose outputs it serialized
        self.thread = threading.Thread(target=self._run, name="output-thread", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            n = self.jobs.get()
            if n is None:
                return
            pickle.dumps([(f"req-{i}", [7], None, 0, None) for i in range(n)])
            self.serialized += 1

    def post(self, n: int) -> None:
        self.jobs.put(n)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


def assumed_step_s(n: int, context_tokens: float) -> float:
    """The HBM-bandwidth floor of one decode step of n requests (module docstring)."""
    return (WEIGHT_BYTES + n * context_tokens * KV_BYTES_PER_TOKEN) / HBM_BYTES_PER_S


class Engine:
    """vLLM's engine loop reduced to what the connector sees, with the connector calls timed."""

    def __init__(self, sched: KVTierConnector, worker: KVTierConnector, layers: List[Any], args: Any) -> None:
        self.sched = sched
        self.worker = worker
        self.layers = layers  # (name, tensor) per layer
        self.args = args
        self.rng = random.Random(1234)
        self.region_blocks = args.region_blocks
        self.next_block = 0
        self.tables: Dict[str, List[int]] = {}
        self.waiting: Deque[Request] = deque()
        self.loading: Dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS
        self.running: List[Request] = []
        self.recv_done: Set[str] = set()
        self.finished_ids: Set[str] = set()  # the next SchedulerOutput's finished_req_ids
        self.count = 0
        self.gap_s = 0.0  # the forward-pass wait of this step
        self.wait_s = 0.0  # the forward-pass wait of this n (the scenarios decide whether a step waits)
        self.spin = args.wait == "spin"
        self.pickle_metadata = args.executor == "mp"
        self.scenario = "mixed"
        self.priming = False  # prime() runs: arrivals are hits (no store evicts the pool)
        self.pool = [self._tokens(2 * CHUNK) for _ in range(POOL)]
        self.profiler: Optional[cProfile.Profile] = None
        # the last step's times (ns) and the window's counters
        self.sched_ns = self.xfer_ns = self.worker_ns = 0
        self.cpu_ns = 0  # the engine thread's CPU time in the timed calls, this step
        # Control windows (n = 256; --no-steady-control skips them): the step's metadata
        # pickled, untimed in the step's figure, twice right after it was built (the second
        # timed: warm) and once right after the forward-pass wait; ns of the last step's two.
        self.control = False
        self.control_ns = (0, 0)
        self._cpu0 = 0
        self.arrived = self.hits = self.misses = 0
        # Per arrival of the scenario whose lookup was answered: the steps whose schedule asked
        # get_num_new_matched_tokens until it answered (2 when the first ask is pending).
        self.asks: List[int] = []
        self.parts: Dict[str, int] = {}  # ns per group of calls, since the window began
        self.output_thread = OutputThread() if args.output_thread else None

    # --- requests ---------------------------------------------------------------------
    def _tokens(self, n: int) -> List[int]:
        return [self.rng.randrange(1, 128000) for _ in range(n)]

    def _request(self, prefix: List[int], target: int, local: int, tag: str) -> Request:
        self.count += 1
        rid = f"{tag}-{self.count}"
        tail = self.args.prompt_tokens - len(prefix)
        req = Request(rid, prefix + self._tokens(tail), target)
        req.target = target  # type: ignore[attr-defined]
        req.local = local  # type: ignore[attr-defined]  # tokens in vLLM's own prefix cache (block-aligned)
        req.saw_hit = False  # type: ignore[attr-defined]
        req.asks = 0  # type: ignore[attr-defined]
        return req

    def add_population(self, n: int) -> None:
        """n requests whose 512-token prefix vLLM's prefix cache holds, finishing evenly
        spread over the next --output-tokens steps."""
        prefix = self._tokens(2 * CHUNK)
        out = self.args.output_tokens
        for i in range(n):
            target = 10**9 if self.args.decode_only else 1 + (i * out) // n
            self.waiting.append(self._request(prefix, target, 2 * CHUNK, "pop"))

    def arrival(self, kind: Optional[str] = None) -> None:
        """One new request of the scenario (``kind``: force hit or nohit)."""
        if kind is None:
            kind = self.scenario if self.scenario != "mixed" else ("hit" if self.arrived % 2 else "nohit")
        self.arrived += 1
        if kind == "hit":
            req = self._request(self.pool[self.arrived % POOL], self.args.output_tokens, 0, "hit")
        else:
            req = self._request([], self.args.output_tokens, 0, "new")
        self.waiting.append(req)

    def alloc(self, n: int) -> List[int]:
        first = self.next_block
        self.next_block = (first + n) % self.region_blocks
        return [(first + i) % self.region_blocks for i in range(n)]

    # --- timing -----------------------------------------------------------------------
    def _on(self) -> int:
        if self.profiler is not None:
            self.profiler.enable()
        self._cpu0 = time.thread_time_ns()  # outside the wall time: a syscall
        return time.perf_counter_ns()

    def _off(self, t0: int, part: str) -> int:
        dt = time.perf_counter_ns() - t0
        self.cpu_ns += time.thread_time_ns() - self._cpu0
        if self.profiler is not None:
            self.profiler.disable()
        self.parts[part] = self.parts.get(part, 0) + dt
        return dt

    # --- one engine step --------------------------------------------------------------
    def step(self) -> None:
        s, w = self.sched, self.worker
        sched_ns = 0
        self.cpu_ns = 0
        num_sched: Dict[str, int] = {}
        new_reqs: List[NewRequestData] = []
        cached = CachedRequestData()
        if self.output_thread is not None:  # the last step's outputs, serialized meanwhile
            self.output_thread.post(len(self.running))
        # Running requests: one decode token each (a new block at each block boundary).
        for req in self.running:
            rid = req.request_id
            pos = req.num_computed_tokens
            table = self.tables[rid]
            new = None
            if pos // BLOCK >= len(table):
                b = self.alloc(1)
                table.extend(b)
                new = (b,)
            cached.req_ids.append(rid)
            cached.new_block_ids.append(new)
            cached.num_computed_tokens.append(pos)
            cached.num_output_tokens.append(len(req.output_token_ids))
            cached.new_token_ids.append([])
            num_sched[rid] = req.num_tokens - pos
        # Waiting requests: those whose load finished, then new ones (lookups).
        admitted: List[Request] = []
        for rid in [r for r in self.loading if r in self.recv_done]:
            req = self.loading.pop(rid)
            self.recv_done.discard(rid)
            if req.num_computed_tokens >= req.num_tokens:
                req.num_computed_tokens = req.num_tokens - 1
            blocks = KVCacheBlocks(self.tables[rid])
            t0 = self._on()
            s.update_state_after_alloc(req, blocks, 0)
            sched_ns += self._off(t0, "update_state_after_alloc")
            admitted.append(req)
        still: Deque[Request] = deque()
        while self.waiting:
            req = self.waiting.popleft()
            local = req.local  # type: ignore[attr-defined]
            t0 = self._on()
            ext, load_async = s.get_num_new_matched_tokens(req, local)
            sched_ns += self._off(t0, "get_num_new_matched_tokens")
            req.asks += 1  # type: ignore[attr-defined]
            if ext is None:
                still.append(req)  # the lookup is pending: asked again next step
                continue
            if ext > 0:
                req.saw_hit = True  # type: ignore[attr-defined]
            if req.request_id.startswith(("new", "hit")):  # the scenario's arrivals
                self.asks.append(req.asks)  # type: ignore[attr-defined]
                if ext > 0:
                    self.hits += 1
                else:
                    self.misses += 1
            table = self.alloc(-(-req.num_tokens // BLOCK))
            self.tables[req.request_id] = table
            blocks = KVCacheBlocks(table)
            t0 = self._on()
            s.update_state_after_alloc(req, blocks, ext)
            sched_ns += self._off(t0, "update_state_after_alloc")
            req.num_computed_tokens = local + ext
            if load_async and ext > 0:
                self.loading[req.request_id] = req
            else:
                admitted.append(req)
        self.waiting = still
        for req in admitted:
            rid = req.request_id
            new_reqs.append(NewRequestData(rid, list(req.prompt_token_ids), (list(self.tables[rid]),), req.num_computed_tokens))
            num_sched[rid] = req.num_tokens - req.num_computed_tokens
            self.running.append(req)
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=sum(num_sched.values()),
            finished_req_ids=self.finished_ids,
            preempted_req_ids=set(),
        )
        self.finished_ids = set()
        t0 = self._on()
        meta = s.build_connector_meta(so)
        sched_ns += self._off(t0, "build_connector_meta")
        xfer_ns = 0
        if self.pickle_metadata:  # --executor mp: to the workers through pickle
            t0 = self._on()
            meta = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
            xfer_ns = self._off(t0, "metadata pickle")
        if self.control:
            repickle_ns(meta)  # (untimed: the pickle's code and the metadata in cache, as after a send)
            warm_ns = repickle_ns(meta)

        # --- the worker: before and during the forward pass ---
        t0 = self._on()
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        w.start_load_kv(None)
        for name, kv in self.layers:
            w.wait_for_layer_load(name)
            w.save_kv_layer(name, kv, None)
        worker_ns = self._off(t0, "worker: bind..save_kv_layer")
        if self.gap_s > 0:  # the forward pass on the GPU
            if self.spin:
                spin(self.gap_s)
            else:
                time.sleep(self.gap_s)
        if self.control:
            self.control_ns = (warm_ns, repickle_ns(meta))
        t0 = self._on()
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        wstats = w.get_kv_connector_stats()
        w.get_kv_connector_kv_cache_events()
        w.build_connector_worker_meta()
        w.clear_connector_metadata()
        worker_ns += self._off(t0, "worker: wait_for_save..clear")

        # --- the scheduler: update_from_output ---
        done: List[Request] = []
        by_id = {r.request_id: r for r in self.running}
        for rid, n in num_sched.items():
            req = by_id[rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.append_output_token(7)
                if len(req.output_token_ids) >= req.target:  # type: ignore[attr-defined]
                    done.append(req)
        if done:
            gone = {r.request_id for r in done}
            self.running = [r for r in self.running if r.request_id not in gone]
        for req in done:
            table = self.tables[req.request_id]
            t0 = self._on()
            s.request_finished(req, table)
            sched_ns += self._off(t0, "request_finished")
            self.finished_ids.add(req.request_id)
        kv_out = KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid or set())
        t0 = self._on()
        s.update_connector_output(kv_out)
        sstats = s.get_kv_connector_stats()
        if wstats is not None and sstats is not None:
            wstats.aggregate(sstats)
        s.take_events()
        sched_ns += self._off(t0, "update_connector_output..take_events")
        self.recv_done |= recving or set()
        for rid in sending or ():
            self.tables.pop(rid, None)
        for rid in recving or ():
            if rid not in self.loading:
                self.tables.pop(rid, None)  # aborted while loading: its last report
        for req in done:
            if not req.request_id.startswith("prime"):
                # The steady state: a new request for each one that finished. While the pool is
                # primed they are hits (a miss stores a pool prefix): a store of a new prompt
                # would evict the prefixes being primed (L1 is 2 GiB, a nohit arrival 64 MiB).
                self.arrival("hit" if self.priming else None)
        self.sched_ns, self.xfer_ns, self.worker_ns = sched_ns, xfer_ns, worker_ns

    def in_engine(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.loading)

    def drain(self) -> None:
        """Every request aborted (request_finished), then steps until the connector tracks
        nothing (its reports all given)."""
        for req in list(self.running) + list(self.loading.values()) + list(self.waiting):
            self.sched.request_finished(req, self.tables.get(req.request_id, []))
            self.finished_ids.add(req.request_id)
        self.running, self.waiting = [], deque()
        self.loading.clear()
        for _ in range(2000):
            if self.sched.scheduler_side.tracked() == 0 and self.worker.worker_side.held() == 0 and not self.finished_ids:
                return
            self.step()
            time.sleep(0.002)
        raise SystemExit("vllm_step_overhead: the connector still tracks requests after the drain")


def prime(engine: Engine) -> None:
    """Puts the hit pool's prefixes in the server's L1: requests of each prefix until a round
    in which every one hit (the first round of an evicted prefix stores it). Meanwhile the
    running requests that finish are replaced by hits, not by the scenario's arrivals."""
    engine.priming = True
    try:
        prime_rounds(engine)
    finally:
        engine.priming = False


def prime_rounds(engine: Engine) -> None:
    for _ in range(10):
        reqs = []
        for p in engine.pool:
            req = engine._request(p, 1, 0, "prime")
            engine.waiting.append(req)
            reqs.append(req)
        ids = {r.request_id for r in reqs}
        for _ in range(500):  # until each was admitted, ran, finished and was released
            engine.step()
            if not ids & (set(engine.tables) | set(engine.loading) | {r.request_id for r in engine.waiting}):
                break
            time.sleep(0.002)
        if all(r.saw_hit for r in reqs):  # type: ignore[attr-defined]
            return
        time.sleep(0.2)  # the stores finish
    raise SystemExit("vllm_step_overhead: the hit pool's prefixes do not stay in L1")


def repickle_ns(meta: Any) -> int:
    """ns to pickle and unpickle ``meta`` (the steady-state control)."""
    t0 = time.perf_counter_ns()
    pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
    return time.perf_counter_ns() - t0


def window(engine: Engine, scenario: str, steps: int, warmup: int, profiler: Optional[cProfile.Profile] = None) -> Dict[str, Any]:
    """One window: the scenario's hit pool primed, ``warmup`` steps, then ``steps`` measured
    steps (under ``profiler`` when given). Returns each measured step's times (us). The
    scenario "control" is the mixed one with the control's two repickles in every step."""
    engine.control = scenario == "control"
    scenario = "mixed" if engine.control else scenario
    engine.scenario = scenario
    engine.gap_s = 0.0 if scenario == "decode" else engine.wait_s
    if scenario in ("hit", "mixed"):
        prime(engine)
    for _ in range(warmup):
        engine.step()
    ws = engine.worker.worker_side
    stores0, loads0, arrived0, hits0, misses0 = ws.stores_issued, ws.loads_issued, engine.arrived, engine.hits, engine.misses
    asks0 = len(engine.asks)
    out: Dict[str, Any] = {"total": [], "cpu": [], "sched": [], "xfer": [], "worker": [], "parts": []}
    engine.profiler = profiler
    try:
        for _ in range(steps):
            engine.parts = {}
            engine.step()
            out["total"].append((engine.sched_ns + engine.xfer_ns + engine.worker_ns) / 1e3)
            out["cpu"].append(engine.cpu_ns / 1e3)
            if engine.control:
                out.setdefault("control", []).append(engine.control_ns)
            out["sched"].append(engine.sched_ns / 1e3)
            out["xfer"].append(engine.xfer_ns / 1e3)
            out["worker"].append(engine.worker_ns / 1e3)
            out["parts"].append({k: v / 1e3 for k, v in engine.parts.items()})
    finally:
        engine.profiler = None
        engine.control = False
    out.update(
        stores=ws.stores_issued - stores0,
        loads=ws.loads_issued - loads0,
        arrived=engine.arrived - arrived0,
        hits=engine.hits - hits0,
        misses=engine.misses - misses0,
        asks=engine.asks[asks0:],
    )
    return out


def report(n: int, scenario: str, windows: List[Dict[str, Any]], name: str = "vllm_step_overhead_us") -> float:
    """Prints a configuration's comment lines and RESULT; returns its median step (us)."""
    pooled = lambda key: sorted(x for w in windows for x in w[key])  # noqa: E731
    total = pooled("total")
    pct = lambda q: total[min(len(total) - 1, int(len(total) * q))]  # noqa: E731
    med = statistics.median
    means = [statistics.fmean(w["total"]) for w in windows]
    per_window = lambda key: med(w[key] for w in windows)  # noqa: E731
    print(f"# n={n} {scenario}: median step {med(total):.1f} us (scheduler {med(pooled('sched')):.1f}, metadata "
          f"{med(pooled('xfer')):.1f}, worker {med(pooled('worker')):.1f}), p90 {pct(0.9):.1f}, p99 {pct(0.99):.1f}, "
          f"mean {statistics.fmean(total):.1f} (per window: {' '.join(f'{m:.0f}' for m in means)}); per window of "
          f"{len(windows[0]['total'])} steps: {per_window('arrived'):.0f} arrivals ({per_window('hits'):.0f} hits, "
          f"{per_window('misses'):.0f} misses), {per_window('stores'):.0f} stores, {per_window('loads'):.0f} loads")
    parts = sorted({k for w in windows for p in w["parts"] for k in p})
    steps = [p for w in windows for p in w["parts"]]
    mean_part = {k: statistics.fmean(p.get(k, 0.0) for p in steps) for k in parts}
    print("#   mean us/step by call: " + ", ".join(f"{k} {mean_part[k]:.1f}" for k in sorted(parts, key=lambda k: -mean_part[k])))
    cpu = pooled("cpu")
    print(f"#   the engine thread's CPU time in these calls: median {med(cpu):.1f} us, mean {statistics.fmean(cpu):.1f} "
          f"(the rest of the wall time it was off a core, or blocked)")
    asks = pooled("asks")
    if asks and scenario == "mixed":
        print(f"#   the arrivals' lookups: answered at the first ask for {sum(a == 1 for a in asks)} of {len(asks)}; "
              f"{statistics.fmean(asks):.2f} steps asked on average (each step after the first delays the request "
              f"by one engine step)")
        print(f"RESULT vllm_lookup_steps_{n}={statistics.fmean(asks):.2f}")
    print(f"RESULT {name}_{n}_{scenario}={med(total):.1f}" if scenario not in DECODE_SCENARIOS
          else f"RESULT {name}_{n}={med(total):.1f}")
    return med(total)


class CallTimer:
    """Stands in for an object and times every method call made through it (--time-calls)."""

    def __init__(self, inner: Any, tag: str, times: Dict[str, List[int]]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_tag", tag)
        object.__setattr__(self, "_times", times)

    def __getattr__(self, name: str) -> Any:
        v = getattr(self._inner, name)
        if not callable(v):
            return v
        samples = self._times.setdefault(f"{self._tag}.{name}", [])

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return v(*a, **k)
            finally:
                samples.append(time.perf_counter_ns() - t0)

        return timed


def print_call_times(times: Dict[str, List[int]]) -> None:
    print("# --- C++ calls (--time-calls): count, median and mean us, total ms ---")
    for key, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        v = sorted(v)
        print(f"#   {key:32s} {len(v):6d} {v[len(v) // 2] / 1e3:8.1f} {statistics.fmean(v) / 1e3:8.1f} "
              f"{sum(v) / 1e6:8.1f}")


def machine_after_wait(wait_s: float, repeats: int, steps: int) -> None:
    """The control without kvtier: a fixed piece of Python work (about 1 MB touched) timed
    back to back and right after a spin of ``wait_s``, ``repeats`` interleaved windows of
    ``steps`` each; prints the medians and their ratio."""
    data = [{"id": f"req-{i}", "blocks": list(range(i, i + 40)), "n": i} for i in range(1024)]

    def work() -> int:
        s = 0
        for r in data:
            s += r["n"] + len(r["blocks"]) + r["blocks"][-1]
        return s + len(pickle.dumps([r["blocks"][:2] for r in data]))

    times: Dict[bool, List[float]] = {False: [], True: []}
    for _ in range(repeats):
        for after in (False, True):
            for _ in range(steps):
                if after:
                    spin(wait_s)
                t0 = time.perf_counter_ns()
                work()
                times[after].append((time.perf_counter_ns() - t0) / 1e3)
    back, waited = statistics.median(times[False]), statistics.median(times[True])
    print(f"# control without kvtier: the same Python work (1024 dicts of lists + a pickle) {back:.1f} us back to "
          f"back, {waited:.1f} us after a {wait_s * 1e3:.2f} ms spin ({repeats} x {steps} each, interleaved)")
    print(f"RESULT machine_python_us={back:.1f}")
    print(f"RESULT machine_python_after_wait_us={waited:.1f}")
    print(f"RESULT machine_after_wait_slowdown={waited / back:.3f}")


WAKE_PEER = """
import os
# Asleep in read() until told to poll ("p"), then spinning on non-blocking reads until told to
# stop ("s"); each switch acknowledged on stdout once made. Bytes written back to back may
# arrive in one read ("xp"), so a command is looked for anywhere in what was read.
while True:
    m = os.read(0, 64)
    if not m or b"q" in m:
        break
    if b"p" in m:
        os.set_blocking(0, False)
        os.write(1, b"P")
        while True:
            try:
                m = os.read(0, 64)
            except BlockingIOError:
                continue
            if not m or b"s" in m or b"q" in m:
                break
        os.set_blocking(0, True)
        if not m or b"q" in m:
            break
        os.write(1, b"S")
"""


def machine_wake(wait_s: float, repeats: int, steps: int) -> None:
    """The control for what each arrival's calls into the server cost the engine thread beyond
    their work: one write of a few bytes to another process, timed right after a spin of
    ``wait_s``, while that process sleeps in read() (the write wakes it, as a connector's call
    wakes the server's thread that sleeps between steps) and while it spins on non-blocking
    reads (nothing to wake); ``repeats`` interleaved windows of ``steps`` each."""
    peer = subprocess.Popen([sys.executable, "-c", WAKE_PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert peer.stdin is not None and peer.stdout is not None
    fd, acks = peer.stdin.fileno(), peer.stdout.fileno()

    def switch(command: bytes, ack: bytes) -> None:  # returns once the peer made the switch
        os.write(fd, command)
        if os.read(acks, 1) != ack:
            raise SystemExit("vllm_step_overhead: the wake control's peer did not acknowledge " + command.decode())

    times: Dict[bool, List[float]] = {False: [], True: []}
    try:
        for _ in range(repeats):
            for awake in (False, True):
                if awake:
                    switch(b"p", b"P")
                for _ in range(steps):
                    spin(wait_s)
                    t0 = time.perf_counter_ns()
                    os.write(fd, b"x")
                    times[awake].append((time.perf_counter_ns() - t0) / 1e3)
                if awake:
                    switch(b"s", b"S")  # back to its blocking read before the next window
    finally:
        os.write(fd, b"q")
        peer.stdin.close()
        peer.wait()
        peer.stdout.close()
    wake, plain = statistics.median(times[False]), statistics.median(times[True])
    print(f"# control without kvtier: one write to another process after a {wait_s * 1e3:.2f} ms spin, {wake:.1f} us "
          f"when it wakes the process (asleep in read), {plain:.1f} us when the process is polling ({repeats} x {steps} "
          f"each, interleaved); an arrival's lookup and its load or store are two such wake-ups of the server")
    print(f"RESULT machine_wake_us={wake:.1f}")
    print(f"RESULT machine_write_no_wake_us={plain:.1f}")


def steady_control(windows: List[Dict[str, Any]]) -> None:
    """Prints the steady-state control: the same pickle of the same metadata right after a first
    pickle of it and right after the forward-pass wait, in mixed windows of their own."""
    pairs = [p for w in windows for p in w["control"]]
    warm = statistics.median(p[0] for p in pairs) / 1e3
    waited = statistics.median(p[1] for p in pairs) / 1e3
    print(f"# n=256 control (mixed windows of their own, {len(pairs)} steps): the step's metadata pickled "
          f"right after a first pickle {warm:.1f} us, right after the forward-pass wait {waited:.1f} us: the same "
          f"work, {waited / warm:.2f}x slower after the wait while the server moves the arrivals' KV")
    print(f"RESULT steady_repickle_us_256={warm:.1f}")
    print(f"RESULT steady_repickle_after_wait_us_256={waited:.1f}")
    print(f"RESULT steady_after_wait_slowdown_256={waited / warm:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, help="windows per configuration, interleaved (default 5, >= 5; --quick: 3, any)")
    ap.add_argument("--steps", type=int, help="measured steps per window (default 64; --quick: 24)")
    ap.add_argument("--warmup", type=int, help="steps before each window (default 8; --quick: 4)")
    ap.add_argument("--prompt-tokens", type=int, default=2 * CHUNK + 8)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--region-blocks", type=int, default=768, help="blocks of the KV region (2 MiB each)")
    ap.add_argument("--l1-mb", type=int, default=2048)
    ap.add_argument("--no-steady-control", dest="steady_control", action="store_false",
                    help="skip the steady-state control windows at n = 256 (steady_after_wait_slowdown_256)")
    ap.add_argument("--gap-scale", type=float, default=1.0, help="the emulated forward pass: this times the assumed step")
    ap.add_argument("--wait", choices=("spin", "sleep", "none"), default="spin",
                    help="how the engine waits out the emulated forward pass (none: steps back to back)")
    ap.add_argument("--ns", default=",".join(map(str, NS)), help="running requests, comma-separated")
    ap.add_argument("--quick", action="store_true", help="3 windows of 24 steps per configuration")
    ap.add_argument("--profile", action="store_true", help="cProfile the n=256 mixed windows' connector calls")
    ap.add_argument("--time-calls", action="store_true", help="time every C++ connector call (count, median, mean)")
    ap.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                    help="do not freeze the start-up heap (vLLM's EngineCore.__init__ does: freeze_gc_heap)")
    ap.add_argument("--output-thread", action="store_true",
                    help="a second Python thread serializes each step's outputs, as vLLM's EngineCore's does")
    ap.add_argument("--executor", choices=("uni", "mp"), default="uni",
                    help="vLLM's executor: uni (one GPU, TP=1: the worker in the engine core's process, the "
                    "metadata handed over as it is) or mp (TP > 1: the metadata pickled to the workers, counted)")
    ap.add_argument("--lookup-wait-ms", type=float, default=0.0,
                    help="the connector's lookup_wait_ms: how long a step's lookups may wait for their answers "
                    "(default 0: never; the first ask of each request is then pending)")
    ap.add_argument("--decode-only", action="store_true",
                    help="decode steps back to back, nothing arriving (module docstring)")
    args = ap.parse_args()
    for name, full, quick in (("repeats", 5, 3), ("steps", 64, 24), ("warmup", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if not args.quick and args.repeats < 5:
        raise SystemExit("vllm_step_overhead: --repeats must be >= 5 (or --quick)")
    if args.prompt_tokens < 2 * CHUNK + 1:
        raise SystemExit(f"vllm_step_overhead: --prompt-tokens must be > {2 * CHUNK}")
    ns = [int(x) for x in args.ns.split(",")]
    if args.profile:
        ns = [max(ns)]
    torch.set_num_threads(1)
    context = args.prompt_tokens + args.output_tokens / 2

    tmp = Path(tempfile.mkdtemp(prefix="kvtier-vllm-step-"))
    factory = ServerFactory(server_binary(BUILD), tmp)
    shape = kvtier.ModelShape(LAYERS, KV_HEADS, HEAD_DIM, kvtier.DtypeKind.BF16, kvtier.AttentionKind.MHA)
    slot = kvtier.ChunkLayout(shape, CHUNK).object_bytes
    srv = factory.start(chunk_tokens=CHUNK, slot_bytes=slot, l1_mb=args.l1_mb)
    wait_l1_settled(srv.socket_path, who="vllm_step_overhead")
    connectors: List[KVTierConnector] = []
    call_times: Dict[str, List[int]] = {}
    engine: Optional[Engine] = None
    try:
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        extra = {"socket_path": str(srv.socket_path), "chunk_tokens": CHUNK, "kv_layout": "NHD", "ready_timeout_s": 30,
                 "lookup_wait_ms": args.lookup_wait_ms}
        common = dict(model="bench/llama-3.1-8b", num_layers=LAYERS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                      block_size=BLOCK, dtype="bfloat16", engine_id="0b9f6c1e-5a7d-4c2b-9e13-7f0a6d2c4b81")
        kcc = full_attention_config(names, args.region_blocks, BLOCK, KV_HEADS, HEAD_DIM, "bfloat16")
        sched = KVTierConnector(vllm_config(extra=extra, **common), KVConnectorRole.SCHEDULER, kcc)
        connectors.append(sched)
        worker = KVTierConnector(vllm_config(extra=dict(extra, rank=0), **common), KVConnectorRole.WORKER, kcc)
        connectors.append(worker)
        kv = {n: torch.empty((2, args.region_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16) for n in names}
        worker.register_kv_caches(kv)
        if not (sched.scheduler_side.connector.healthy and worker.worker_side.connector.healthy):
            raise SystemExit("vllm_step_overhead: the connectors did not register")
        engine = Engine(sched, worker, list(kv.items()), args)
        if args.time_calls:
            ss, ws = sched.scheduler_side, worker.worker_side
            ss.connector = CallTimer(ss.connector, "scheduler", call_times)
            ss._hasher = CallTimer(ss._hasher, "hasher", call_times)
            ws.connector = CallTimer(ws.connector, "worker", call_times)
        if args.gc_freeze:
            frozen = freeze_startup_heap()
            print(f"# gc: the start-up heap frozen ({frozen} objects), as vLLM's EngineCore.__init__ freezes it")
        else:
            print("# gc: --no-gc-freeze: the start-up heap is not frozen (vLLM's EngineCore.__init__ freezes it)")
        print(f"# vLLM connector cost per step: {LAYERS} layers x (2, {args.region_blocks}, {BLOCK}, {KV_HEADS}, "
              f"{HEAD_DIM}) bf16, chunks of {CHUNK} tokens ({slot >> 20} MiB), prompts of {args.prompt_tokens} "
              f"tokens, {args.output_tokens} output tokens; {args.repeats} windows x {args.steps} steps per configuration")
        print(f"# python {sys.version.split()[0]}, torch {torch.__version__}, kvtier {kvtier.__version__}")
        print("# executor: " + ("mp (TP > 1): the connector metadata pickled to the workers each step, counted as metadata"
                                if args.executor == "mp" else
                                "uni (one GPU, vLLM's default at TP=1): the metadata handed to the worker as it is, nothing pickled"))
        print(f"# lookup_wait_ms {args.lookup_wait_ms:g}: " + ("a step's lookups wait up to that, together, for their answers"
              if args.lookup_wait_ms > 0 else "the first ask of each request is pending (vLLM asks again next step)"))
        if args.output_thread:
            print("# --output-thread: a second Python thread serializes each step's outputs (module docstring)")
        results: Dict[tuple, List[Dict[str, Any]]] = {}
        profiler = cProfile.Profile() if args.profile else None
        scenarios = DECODE_SCENARIOS if args.decode_only else ("mixed",) if args.profile else SCENARIOS
        for n in ns:
            engine.wait_s = 0.0 if args.wait == "none" else assumed_step_s(n, context) * args.gap_scale
            engine.gap_s = engine.wait_s  # the population's start-up steps
            engine.add_population(n)
            for _ in range(50):
                engine.step()
                if not any(r.request_id.startswith("pop") for r in engine.waiting):
                    break
                time.sleep(0.002)
            else:
                raise SystemExit(f"vllm_step_overhead: the population of {n} did not start")
            for _ in range(args.repeats):
                for scen in scenarios:
                    results.setdefault((n, scen), []).append(window(engine, scen, args.steps, args.warmup, profiler))
                if n == 256 and scenarios == SCENARIOS and args.steady_control:
                    results.setdefault((n, "control"), []).append(window(engine, "control", args.steps, args.warmup))
            engine.drain()
        if args.profile:
            for key in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(30)
                print(f"# --- cProfile of the connector calls, n={ns[0]} mixed, {args.repeats * args.steps} steps, by {key} ---")
                for line in out.getvalue().splitlines():
                    if line.strip():
                        print("# " + line)
            return
        if args.decode_only:
            for n in ns:
                budget = assumed_step_s(n, context) * 1e6 / 100
                got = report(n, "decode", results[(n, "decode")], "vllm_decode_step_us")
                waited = report(n, "decode_wait", results[(n, "decode_wait")], "vllm_decode_step_after_wait_us")
                print(f"# n={n}: assumed decode step {budget * 100 / 1e3:.2f} ms (HBM floor), budget (1%) {budget:.0f} us; "
                      f"after the wait the same decode step costs {waited / got:.2f}x")
                if n == 256:
                    print(f"RESULT vllm_decode_step_vs_budget_256={got / budget:.3f}")
                    print(f"RESULT vllm_decode_step_after_wait_vs_budget_256={waited / budget:.3f}")
            if args.wait == "spin":
                machine_after_wait(assumed_step_s(256, context) * args.gap_scale, args.repeats, args.steps)
            return
        for n in ns:
            budget = assumed_step_s(n, context) * 1e6 / 100
            for scen in SCENARIOS:
                got = report(n, scen, results[(n, scen)])
                if scen == "mixed":
                    headline = got
                    mean = statistics.fmean(x for w in results[(n, scen)] for x in w["total"])
                    cpu = statistics.median(x for w in results[(n, scen)] for x in w["cpu"])
            print(f"# n={n}: assumed decode step {budget * 100 / 1e3:.2f} ms (HBM floor), budget (1%) {budget:.0f} us")
            print(f"RESULT vllm_step_overhead_us_{n}={headline:.1f}")
            print(f"RESULT vllm_step_overhead_mean_us_{n}={mean:.1f}")
            print(f"RESULT vllm_step_overhead_cpu_us_{n}={cpu:.1f}")
            print(f"RESULT vllm_step_budget_us_{n}={budget:.0f}")
            if n == 256:
                print(f"RESULT vllm_step_overhead_vs_budget_256={headline / budget:.3f}")
                if (n, "control") in results:
                    steady_control(results[(n, "control")])
                    if args.wait == "spin":
                        machine_wake(assumed_step_s(n, context) * args.gap_scale, args.repeats, 16)
    finally:
        if call_times:
            print_call_times(call_times)
        if engine is not None and engine.output_thread is not None:
            engine.output_thread.close()
            print(f"# --output-thread: serialized the outputs of {engine.output_thread.serialized} steps")
        for c in connectors:
            c.shutdown()
        factory.close()


if __name__ == "__main__":
    main()

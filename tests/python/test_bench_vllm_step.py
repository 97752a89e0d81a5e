"""bench/vllm_step_overhead.py runs in every mode its docs name (docs/performance.md, "vLLM
connector: cost per step"): --profile runs only the n = 256 mixed windows, so it primes the
hit pool with no window before it; the population turning over while it primes must not
evict the prefixes it is putting in L1 (it did: "the hit pool's prefixes do not stay in L1").
--decode-only prints its steps back to back and after the forward-pass wait, and the control
without kvtier (the same Python work both ways); the steady state at n = 256 prints the engine
thread's CPU time and its own controls (the same repickle warm and after the wait; one write
to another process after the wait, waking it and not);
--output-thread runs the steps beside a second Python thread that serializes their outputs.
The start-up heap is frozen before the first step, as vLLM's EngineCore.__init__ freezes it
(--no-gc-freeze leaves it).
A kvtier-server with 2 GiB of L1 and a 1.5 GiB KV region; about 10 s (--quick).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, Tuple

from conftest import BUILD_DIR, REPO


def bench(*args: str) -> Tuple[str, Dict[str, float]]:
    """Runs the step bench with ``args``; returns its output and its RESULT lines."""
    env = dict(os.environ, KVTIER_BUILD_DIR=str(BUILD_DIR))
    r = subprocess.run([sys.executable, str(REPO / "bench" / "vllm_step_overhead.py"), *args],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = dict(line[len("RESULT "):].split("=") for line in r.stdout.splitlines() if line.startswith("RESULT "))
    return r.stdout, {name: float(value) for name, value in results.items()}


def check_results(results: Dict[str, float], names: Tuple[str, ...], ratio: Tuple[str, str, str]) -> None:
    """Each of ``names`` printed and positive; ``ratio`` = (name, over, under): the printed
    ratio is the quotient of the two printed values (to their rounding: 0.1 us)."""
    for name in names:
        assert results[name] > 0, name
    name, over, under = ratio
    assert abs(results[over] / results[under] - results[name]) <= 0.02 * results[name], ratio


def test_the_step_benchmark_profiles_the_256_request_windows():
    out, _ = bench("--profile", "--quick")
    assert "# --- cProfile of the connector calls, n=256 mixed" in out
    assert "lookup_hashes" in out  # the profile saw the arrivals' lookups


def test_decode_only_times_the_steps_back_to_back_and_after_the_wait_with_a_control_without_kvtier():
    out, results = bench("--decode-only", "--quick", "--ns", "1")
    check_results(results, ("vllm_decode_step_us_1", "vllm_decode_step_after_wait_us_1"),
                  ("machine_after_wait_slowdown", "machine_python_after_wait_us", "machine_python_us"))
    assert "# n=1 decode_wait: median step" in out


def test_the_steady_state_prints_the_engine_threads_cpu_time_and_the_control_of_its_own_windows():
    out, results = bench("--quick", "--ns", "256", "--repeats", "1", "--steps", "8", "--warmup", "2")
    check_results(results, ("vllm_step_overhead_us_256", "vllm_step_overhead_cpu_us_256"),
                  ("steady_after_wait_slowdown_256", "steady_repickle_after_wait_us_256", "steady_repickle_us_256"))
    assert "# n=256 control (mixed windows of their own, 8 steps)" in out
    # The write control: a write to a process asleep in read() and to one polling, both timed.
    for name in ("machine_wake_us", "machine_write_no_wake_us"):
        assert results[name] > 0, name
    assert "# control without kvtier: one write to another process" in out
    # vLLM's EngineCore.__init__ freezes the start-up heap (freeze_gc_heap) once the scheduler,
    # the workers (TP=1: in its process) and their connectors exist, before any request: the
    # bench replays that, so the garbage collector's full passes skip the same objects.
    frozen = int(out.split("# gc: the start-up heap frozen (")[1].split()[0])
    assert frozen > 1000  # torch, the connectors, the KV tensors' wrappers


def test_no_gc_freeze_leaves_the_heap_as_it_is():
    out, results = bench("--quick", "--ns", "1", "--repeats", "1", "--steps", "8", "--warmup", "2",
                         "--no-steady-control", "--no-gc-freeze")
    assert results["vllm_step_overhead_us_1"] > 0
    assert "# gc: --no-gc-freeze: the start-up heap is not frozen" in out
    assert "# gc: the start-up heap frozen (" not in out


def test_output_thread_serializes_every_steps_outputs_beside_the_connector_calls():
    out, results = bench("--quick", "--ns", "1", "--repeats", "1", "--steps", "8", "--warmup", "2",
                         "--no-steady-control", "--output-thread")
    assert results["vllm_step_overhead_us_1"] > 0
    assert "# --output-thread: a second Python thread serializes each step's outputs" in out
    served = int(out.split("# --output-thread: serialized the outputs of ")[1].split()[0])
    assert served >= 3 * (8 + 2)  # every step of the three scenarios' windows, and the start-up steps


def test_the_metadata_is_pickled_only_under_the_multiproc_executor():
    """On one GPU (TP=1) vLLM runs UniProcExecutor (ParallelConfig: world_size 1 -> "uni"), which
    hands the SchedulerOutput, the connector metadata in it, to the worker in the same process:
    nothing pickled, so the step counts no metadata time. The multiproc executor (TP > 1)
    pickles it to the workers: --executor mp counts the round trip."""
    common = ("--quick", "--ns", "1", "--repeats", "1", "--steps", "8", "--warmup", "2", "--no-steady-control")

    def metadata_us(out: str) -> float:
        line = next(l for l in out.splitlines() if l.startswith("# n=1 mixed: median step"))
        return float(line.split(", metadata ")[1].split(",")[0])

    out, results = bench(*common)
    assert "# executor: uni (one GPU" in out and results["vllm_step_overhead_us_1"] > 0
    assert metadata_us(out) == 0.0 and "metadata pickle" not in out
    out, results = bench(*common, "--executor", "mp")
    assert "# executor: mp (TP > 1)" in out and results["vllm_step_overhead_us_1"] > 0
    assert metadata_us(out) > 0.0 and "metadata pickle" in out

"""bench/vllm_step_overhead.py runs in every mode its docs name (docs/performance.md, "vLLM
connector: cost per step"): --profile runs only the n = 256 mixed windows, so it primes the
hit pool with no window before it; the population turning over while it primes must not
evict the prefixes it is putting in L1 (it did: "the hit pool's prefixes do not stay in L1").
A kvtier-server with 2 GiB of L1 and a 1.5 GiB KV region; about 10 s (--quick).
"""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import BUILD_DIR, REPO


def test_the_step_benchmark_profiles_the_256_request_windows():
    env = dict(os.environ, KVTIER_BUILD_DIR=str(BUILD_DIR))
    r = subprocess.run([sys.executable, str(REPO / "bench" / "vllm_step_overhead.py"), "--profile", "--quick"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "# --- cProfile of the connector calls, n=256 mixed" in r.stdout
    assert "lookup_hashes" in r.stdout  # the profile saw the arrivals' lookups

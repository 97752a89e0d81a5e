#!/usr/bin/env python3
"""The L1-hit figure derived from one kvtier_long_doc_qa report (an L1 run, --json REPORT)
and two limits measured by other benchmarks of the same bench/run_all.sh run:

  l1_hit_kvtier_s<sfx>              mean over the query round's requests of (TTFT - computed
                                    tokens / tokens per second), the median over trials
  l1_hit_copy_bound_s<sfx>          bytes per request / streaming-copy bandwidth + one lookup
                                    round trip
  l1_hit_ttft_vs_copy_bound<sfx>    time in kvtier / copy bound, per trial, median over trials

The streaming-copy bandwidth is kvtier_bench_gather's stream_copy_<shape>_gbps (one thread,
non-temporal stores, cold buffers) and the round trip kvtier_bench_rpc's lookup_rtt_us
(unpinned, as the engine and the server run here): RESULT lines read from FIGURES (files of
"benchmark name value" or "RESULT name=value" lines, or results.json; the first that has
the figure wins). Not the same process, so the bound is as good as those runs were.

  l1_hit_bound.py REPORT.json SUFFIX FIGURES...
Standard library only."""

import json
import statistics
import sys


def figures(paths):
    out = {}
    for path in paths:
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        got = {}
        if path.endswith(".json"):
            try:
                for bench in json.loads(text).get("results", {}).values():
                    got.update(bench)
            except ValueError:
                pass
        else:
            for line in text.splitlines():
                if line.startswith("RESULT ") and "=" in line:
                    name, _, value = line[7:].partition("=")
                else:
                    parts = line.split()
                    if len(parts) != 3:
                        continue
                    name, value = parts[1], parts[2]
                try:
                    got[name] = float(value)
                except ValueError:
                    pass
        for k, v in got.items():
            out.setdefault(k, v)
    return out


def main():
    if len(sys.argv) < 4:
        print("usage: l1_hit_bound.py REPORT.json SUFFIX FIGURES...", file=sys.stderr)
        return 2
    report, sfx, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    with open(report) as f:
        rep = json.load(f)
    cfg = rep.get("config", {})
    shape = "8b" if cfg.get("model") == "8b" else "05b"
    fig = figures(paths)
    stream, rtt = fig.get(f"stream_copy_{shape}_gbps"), fig.get("lookup_rtt_us")
    if not stream or rtt is None:
        print(f"l1_hit_bound.py: no stream_copy_{shape}_gbps or lookup_rtt_us in {paths}: nothing to derive",
              file=sys.stderr)
        return 0
    tps, token_bytes = cfg.get("tokens_per_second", 0), cfg.get("token_bytes", 0)
    kv, bound, ratio = [], [], []
    for t in rep.get("trials", []):
        q = t.get("query", {})
        n = q.get("requests", 0)
        if not n or not q.get("ttft_mean_s"):
            continue
        computed = (q.get("tokens_total", 0) - q.get("tokens_from_cache", 0)) / n
        k = q["ttft_mean_s"] - (computed / tps if tps else 0)
        b = q.get("tokens_from_cache", 0) / n * token_bytes / (stream * 1e9) + rtt / 1e6
        if b <= 0:
            continue
        kv.append(k)
        bound.append(b)
        ratio.append(k / b)
    for name, values in (("l1_hit_kvtier_s", kv), ("l1_hit_copy_bound_s", bound), ("l1_hit_ttft_vs_copy_bound", ratio)):
        if values:
            print(f"RESULT {name}{sfx}={statistics.median(values):.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

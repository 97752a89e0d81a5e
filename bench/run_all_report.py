#!/usr/bin/env python3
"""bench/run_all.sh's second half: gathers the RESULT lines of one run into
bench/results/results.json and results.csv (merged with the benchmarks a previous run measured
when --only ran a few), draws docs/images/*.png with gnuplot, and regenerates the summary
section of docs/performance.md between <!-- run_all:begin --> and <!-- run_all:end -->.
Standard library only (Debian's python3)."""

import argparse
import csv
import datetime
import glob
import json
import os
import statistics
import subprocess

BEGIN = "<!-- run_all:begin -->"
END = "<!-- run_all:end -->"


def load_raw(path):
    out = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) != 3:
                continue
            bench, name, value = parts
            out.setdefault(bench, {})[name] = float(value)
    return out


def merge(results_dir, raw, meta):
    path = os.path.join(results_dir, "results.json")
    old = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f).get("results", {})
        except (OSError, ValueError):
            old = {}
    merged = dict(old)
    merged.update(raw)  # a benchmark that ran replaces its previous figures whole
    doc = dict(meta)
    doc["ran"] = sorted(raw.keys())
    doc["results"] = merged
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(results_dir, "results.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["benchmark", "name", "value"])
        for bench in sorted(merged):
            for name in sorted(merged[bench]):
                w.writerow([bench, name, merged[bench][name]])
    return merged


def flat(results):
    out = {}
    for bench in results.values():
        out.update(bench)
    return out


# ---- plots -------------------------------------------------------------------------------


def gnuplot(script, cwd):
    try:
        subprocess.run(["gnuplot"], input=script, text=True, check=True, cwd=cwd)
        return True
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"run_all_report: gnuplot failed: {e}")
        return False


def longdoc_table(results_dir):
    """{shape: {tokens: {recompute, l1, l2}}} in seconds: medians over trials of the mean TTFT."""
    table = {}
    for path in glob.glob(os.path.join(results_dir, "longdoc", "*.json")):
        base = os.path.basename(path)[:-5]  # 05b_l1_10000
        try:
            shape, mode, tokens = base.split("_")
            with open(path) as f:
                rep = json.load(f)
        except (ValueError, OSError):
            continue
        trials = rep.get("trials", [])
        if not trials:
            continue
        row = table.setdefault(shape, {}).setdefault(int(tokens), {})
        warm = statistics.median(t["warmup"]["ttft_mean_s"] for t in trials)
        query = statistics.median(t["query"]["ttft_mean_s"] for t in trials)
        if mode == "l1":
            row["recompute"] = warm
            row["l1"] = query
        elif mode == "l2gated":  # L2 mode with the prefill rate declared: the gate chose
            row["l2_gated"] = query
            row["recompute_l2_gated_run"] = warm
        else:
            row.setdefault("recompute", warm)
            row["recompute_l2_run"] = warm  # the same documents, computed in the L2 run's warmup
            row["l2"] = query
            # Pairs whose two disk probes disagree (the disk changed mode around the round) are
            # left out, as the driver leaves them out of its medians.
            ios = [t["io_bound"] for t in trials
                   if t.get("io_bound") and t["io_bound"].get("disk_read_gbps") and t["io_bound"].get("memcpy_gbps")
                   and t["io_bound"].get("probes_agree", True)]
            if ios:
                # max(disk, copy): the two costs overlap (kvtier_long_doc_qa prints it).
                row["io_bound"] = statistics.median(
                    max(i["bytes_per_request"] / (i["disk_read_gbps"] * 1e9),
                        i["bytes_per_request"] / (i["memcpy_gbps"] * 1e9)) for i in ios)
                row["kvtier"] = statistics.median(i["kvtier_s"] for i in ios)
    return table


def plots(root, results_dir, res):
    images = os.path.join(root, "docs", "images")
    os.makedirs(images, exist_ok=True)
    data = os.path.join(results_dir, "plot")
    os.makedirs(data, exist_ok=True)
    made = []
    f = flat(res)

    # 1. TTFT against context length, per shape.
    table = longdoc_table(results_dir)
    panels = []
    for shape, title in (("05b", "0.5B KV shape (12 KiB/token)"), ("8b", "8B KV shape (128 KiB/token)")):
        rows = table.get(shape)
        if not rows:
            continue
        dat = os.path.join(data, f"ttft_{shape}.dat")
        with open(dat, "w") as out:
            out.write("# tokens recompute_ms l1_hit_ms l2_hit_ms io_bound_ms\n")
            for tokens in sorted(rows):
                r = rows[tokens]
                vals = [r.get(k) for k in ("recompute", "l1", "l2", "io_bound")]
                out.write(f"{tokens} " + " ".join("NaN" if v is None else f"{v * 1e3:.3f}" for v in vals) + "\n")
        panels.append((dat, title))
    if panels:
        script = [
            terminal(1100, 450),
            f"set output '{os.path.join(images, 'ttft_vs_context.png')}'",
            f"set multiplot layout 1,{len(panels)} title 'Long-document QA: TTFT against context length (mini engine at 50,000 tokens/s, one request in flight)'",
            "set xlabel 'context (tokens)'",
            "set ylabel 'TTFT (ms)'",
            "set key top left",
            "set grid",
            "set yrange [0:*]",
        ]
        for dat, title in panels:
            script.append(f"set title '{title}'")
            script.append(
                f"plot '{dat}' using 1:2 with linespoints lw 2 title 'recompute', "
                f"'' using 1:3 with linespoints lw 2 title 'L1 hit', "
                f"'' using 1:4 with linespoints lw 2 title 'L2 (disk) hit', "
                f"'' using 1:5 with lines dt 2 title 'max(disk, copy) bound'"
            )
        script.append("unset multiplot")
        if gnuplot("\n".join(script) + "\n", data):
            made.append("ttft_vs_context.png")

    # 2. L2 load bandwidth against chunk size, next to fio.
    if "l2_load_gbps" in f and "l2_load_3m_gbps" in f:
        dat = os.path.join(data, "l2_bw.dat")
        with open(dat, "w") as out:
            out.write("# chunk_mib label ours_gbps fio_gbps ours_pread_gbps\n")
            out.write(f"3 \"3 MiB (0.5B)\" {f['l2_load_3m_gbps']} {f['fio_read_3m_gbps']} NaN\n")
            out.write(f"32 \"32 MiB (8B)\" {f['l2_load_gbps']} {f['fio_read_gbps']} {f.get('l2_load_pread_gbps', 'NaN')}\n")
        script = f"""
{terminal(700, 450)}
set output '{os.path.join(images, 'l2_bandwidth_vs_chunk.png')}'
set title 'L2 disk load bandwidth against chunk size, fio on the same files (same run)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set ylabel 'GB/s'
set xlabel 'chunk object size'
set yrange [0:*]
set grid ytics
set key below
plot '{dat}' using 3:xtic(2) title 'kvtier disk backend (io_uring)', '' using 4 title 'fio (io_uring, O_DIRECT, 1 MiB, depth 16)', '' using 5 title 'kvtier (pread pool)'
"""
        if gnuplot(script, data):
            made.append("l2_bandwidth_vs_chunk.png")

    # 2b. The baselines of issue 17: copies against a streaming copy, lookup RTT pinned alike.
    if "stream_copy_8b_gbps" in f or "lookup_rtt_same_cpu_us" in f:
        d1 = os.path.join(data, "copy_baselines.dat")
        with open(d1, "w") as out:
            out.write("# shape stream_copy memcpy gather scatter (GB/s)\n")
            for sh, label in (("8b", "8B (32 KiB segments)"), ("05b", "0.5B (4 KiB segments)")):
                vals = [f.get(f"{k}_{sh}_gbps") for k in ("stream_copy", "memcpy", "gather", "scatter")]
                out.write(f'"{label}" ' + " ".join("NaN" if v is None else str(v) for v in vals) + "\n")
        d2 = os.path.join(data, "rpc_placements.dat")
        with open(d2, "w") as out:
            out.write("# placement lookup_us raw_us\n")
            for pl, label in (("_same_cpu", "one CPU"), ("_cross_cpu", "two CPUs"), ("", "unpinned")):
                vals = [f.get(f"lookup_rtt{pl}_us"), f.get(f"raw_rtt{pl}_us")]
                out.write(f'"{label}" ' + " ".join("NaN" if v is None else str(v) for v in vals) + "\n")
        script = f"""
{terminal(1100, 450)}
set output '{os.path.join(images, 'baselines.png')}'
set multiplot layout 1,2 title 'Baselines (same run): one-thread copies of 256-token chunks; lookup round trip pinned alike'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set grid ytics
set yrange [0:*]
set key below
set title 'copy bandwidth, cold source and destination'
set ylabel 'GB/s'
plot '{d1}' using 2:xtic(1) title 'streaming copy (the limit)', '' using 3 title 'glibc memcpy', '' using 4 title 'gather', '' using 5 title 'scatter'
set title 'lookup (39 chunks) vs raw socket ping-pong'
set ylabel 'round trip (us)'
plot '{d2}' using 2:xtic(1) title 'lookup', '' using 3 title 'raw ping-pong'
unset multiplot
"""
        if gnuplot(script, data):
            made.append("baselines.png")

    # 3. Hit ratio per eviction policy per trace.
    pol = res.get("l1_policies", {})
    policies = ["lru", "s3fifo", "arc", "noop"]
    traces = ["zipf_08", "zipf_10", "scan_zipf", "long_doc_qa", "scan_zipf_default_watermark"]
    if any(f"lru_{t}_hit_ratio" in pol for t in traces):
        dat = os.path.join(data, "hit_ratio.dat")
        with open(dat, "w") as out:
            out.write("# trace " + " ".join(policies) + "\n")
            for t in traces:
                vals = [pol.get(f"{p}_{t}_hit_ratio") for p in policies]
                label = "scan_zipf (watermark 0.8/0.7)" if t == "scan_zipf_default_watermark" else t
                out.write(f'"{label}" ' + " ".join("NaN" if v is None else str(v) for v in vals) + "\n")
        cols = ", ".join(
            (f"'{dat}' using 2:xtic(1) title '{p}'" if i == 0 else f"'' using {i + 2} title '{p}'")
            for i, p in enumerate(policies)
        )
        script = f"""
{terminal(900, 450)}
set output '{os.path.join(images, 'l1_hit_ratio.png')}'
set title 'L1 hit ratio per eviction policy per trace (cache = 10% of the reused keys)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set ylabel 'hit ratio'
set yrange [0:1]
set grid ytics
set key top right
set xtics noenhanced
plot {cols}
"""
        if gnuplot(script, data):
            made.append("l1_hit_ratio.png")

    # 4. Scaling: throughput and p99 TTFT against clients; server RSS against L1 size.
    sc = res.get("scaling", {})
    clients = sorted(int(k.split("_")[1]) for k in sc if k.startswith("clients_") and k.endswith("_tokens_per_s"))
    rss = sorted(
        (float(k[len("rss_l1_"):-len("gb_mib")].replace("p", ".")), v) for k, v in sc.items() if k.startswith("rss_l1_")
    )
    if clients or rss:
        d1 = os.path.join(data, "scaling_clients.dat")
        with open(d1, "w") as out:
            out.write("# clients tokens_per_s p99_ttft_ms\n")
            for c in clients:
                out.write(f"{c} {sc[f'clients_{c}_tokens_per_s']} {sc.get(f'clients_{c}_p99_ttft_s', float('nan')) * 1e3}\n")
        d2 = os.path.join(data, "scaling_rss.dat")
        with open(d2, "w") as out:
            out.write("# l1_gb rss_mib\n")
            for gb, v in rss:
                out.write(f"{gb} {v}\n")
        script = [terminal(1100, 450), f"set output '{os.path.join(images, 'scaling.png')}'",
                  "set multiplot layout 1,2 title 'One kvtier-server, several engines (L1 hits, 0.5B shape)'", "set grid"]
        if clients:
            script += ["set title 'throughput and p99 TTFT against engine clients'", "set xlabel 'engine clients'",
                       "set ylabel 'prompt tokens/s (query rounds)'", "set y2label 'p99 TTFT (ms)'", "set ytics nomirror",
                       "set y2tics", "set key top left", "set xtics (1,2,4,8)", "set yrange [0:*]", "set y2range [0:*]",
                       f"plot '{d1}' using 1:2 with linespoints lw 2 title 'tokens/s', '' using 1:3 axes x1y2 with linespoints lw 2 title 'p99 TTFT'"]
        if rss:
            script += ["set title 'server RSS against L1 size (L1 filled)'", "set xlabel 'L1 size (GiB)'",
                       "set ylabel 'RSS (MiB)'", "unset y2label", "unset y2tics", "set ytics mirror", "set xtics auto",
                       "set key top left",
                       f"plot '{d2}' using 1:2 with linespoints lw 2 title 'RSS', '' using 1:($1*1024) with lines dt 2 title 'L1 size'"]
        script.append("unset multiplot")
        if gnuplot("\n".join(script) + "\n", data):
            made.append("scaling.png")
    return made, table


_cairo = None


def has_cairo():
    global _cairo
    if _cairo is None:
        try:
            out = subprocess.run(["gnuplot", "-e", "set terminal"], capture_output=True, text=True).stderr + \
                subprocess.run(["gnuplot", "-e", "set terminal"], capture_output=True, text=True).stdout
            _cairo = "pngcairo" in out
        except OSError:
            _cairo = False
    return _cairo


def terminal(w, h):
    t = f"set terminal pngcairo size {w},{h} font ',10'" if has_cairo() else f"set terminal png size {w},{h}"
    return t + "\nset termoption noenhanced"


# ---- the summary table -------------------------------------------------------------------


def fmt(v, unit=""):
    if v is None:
        return "not run"
    a = abs(v)
    s = f"{v:.0f}" if a >= 100 else f"{v:.2f}" if a >= 1 else f"{v:.3f}"
    return s + (f" {unit}" if unit else "")


def summary(res, meta, table, made):
    f = flat(res)
    rows = []

    def row(figure, value, vunit, base, bunit, base_name, ratio, target, how=""):
        rows.append((figure, value, vunit, base, bunit, base_name, ratio, target, how))

    g = f.get

    def quotient(over, under):
        """g(over) / g(under), None when either is missing or zero."""
        a, b = g(over), g(under)
        return a / b if a and b else None
    row("event bus: publish an L2 event (exact metrics)", g("bus_publish_l2_ns"), "ns", g("atomic_fetch_add_ns"), "ns",
        "one relaxed atomic fetch_add", g("bus_vs_atomic"), "<= 2")
    row("event bus: LMCache-style runtime bus", g("runtime_bus_ns"), "ns", g("bus_publish_l2_ns"), "ns",
        "kvtier's bus", g("runtime_bus_vs_bus"), ">= 10 (theirs / ours)")
    for op in ("gather", "scatter"):
        for sh, tgt in (("8b", ">= 0.9"), ("05b", ">= 0.8")):
            row(f"**{op} 256-token chunk, {sh} shape** (`{op}_vs_stream_copy_{sh}`)", g(f"{op}_{sh}_gbps"), "GB/s",
                g(f"stream_copy_{sh}_gbps"), "GB/s", "streaming copy of the same bytes, 1 thread",
                g(f"{op}_vs_stream_copy_{sh}"), tgt)
    for op in ("gather", "scatter"):
        for sh, tgt in (("8b", ">= 0.85"), ("05b", ">= 0.6")):
            row(f"{op} 256-token chunk, {sh} shape", g(f"{op}_{sh}_gbps"), "GB/s", g(f"memcpy_{sh}_gbps"), "GB/s",
                "glibc memcpy of the same bytes: cached stores", g(f"{op}_vs_memcpy_{sh}"), tgt)
    if g("xxh3_best_is_portable") == 0:
        row("object checksum (XXH3), run-time AVX2 kernel, 1 MiB updates in cache (`xxh3_best_vs_portable`)",
            g("xxh3_best_gbps"), "GB/s", g("xxh3_portable_gbps"), "GB/s", "the build's own kernel, SSE2 at -O3",
            g("xxh3_best_vs_portable"), "")
        row("object checksum (XXH3), the same over cold memory (`xxh3_best_vs_portable_cold`)",
            g("xxh3_best_cold_gbps"), "GB/s", g("xxh3_portable_cold_gbps"), "GB/s",
            "the build's own kernel; both are bound by memory bandwidth", g("xxh3_best_vs_portable_cold"), "")
    for op, what in (("store", "engine blocks -> L1 (gather)"), ("retrieve", "L1 -> engine blocks (scatter)")):
        for sh in ("05b", "8b"):
            if g(f"server_{op}_{sh}_gbps") is not None:
                row(f"server, 10k-token {op}, {sh} shape: {what}", g(f"server_{op}_{sh}_gbps"), "GB/s",
                    None, "", "one memcpy of the same bytes", g(f"server_{op}_vs_memcpy_{sh}"), "")
    row("**server copy pool, 2 threads vs 1** (`copy_pool_2_vs_1`, 4 clients retrieving 10k tokens, 05b)",
        g("copy_pool_gbps_2"), "GB/s", g("copy_pool_gbps_1"), "GB/s", "the same with 1 copy thread, interleaved",
        g("copy_pool_2_vs_1"), ">= 1.5")
    row("server copy pool's 2-vs-1 against the machine's (`copy_pool_2_vs_1_vs_stream_copy`)", None, "", None, "",
        "a streaming copy on 2 threads over 1, same run: "
        + (f"{g('stream_copy_2_vs_1'):.2f}x (memory bandwidth caps it)" if g("stream_copy_2_vs_1") else "not measured"),
        g("copy_pool_2_vs_1_vs_stream_copy"), "")
    row("**ping p99 while the copy pool is saturated** (`ping_p99_under_copy_load_ms`, worse of 1 and 2 threads)",
        g("ping_p99_under_copy_load_ms"), "ms", g("ping_p99_idle_ms"), "ms", "ping p99 of the same server, idle",
        None, "<= 5 ms")
    row("io_uring vs pread pool, O_DIRECT 4 KiB reads, depth 32", None, "", None, "", "pread thread pool",
        g("io_direct_4k_uring_vs_pread_pool_qd32"), "")
    for trace in ("zipf_10", "scan_zipf", "long_doc_qa"):
        s3, lru = g(f"s3fifo_{trace}_hit_ratio"), g(f"lru_{trace}_hit_ratio")
        row(f"L1 hit ratio, S3-FIFO, trace {trace}", s3, "", lru, "", "LRU", s3 / lru if s3 and lru else None, "")
    row("L2 disk load, 32 MiB objects", g("l2_load_gbps"), "GB/s", g("fio_read_gbps"), "GB/s",
        "fio read, same files, registered buffers (fixedbufs)",
        g("l2_load_vs_fio"), ">= 0.9")
    row("L2 disk load, 3 MiB objects", g("l2_load_3m_gbps"), "GB/s", g("fio_read_3m_gbps"), "GB/s", "fio read, fixedbufs",
        g("l2_load_vs_fio_3m"), ">= 0.9")
    for sz, sfx in (("32 MiB", ""), ("3 MiB", "_3m")):
        if g(f"l2_load_vs_fio{sfx}_huge") is not None:
            row(f"L2 disk load, {sz} objects, both in huge pages (`l2_load_vs_fio{sfx}_huge`: into an L1 in THP, "
                "faulted in first, as the server's)", g(f"l2_load{sfx}_gbps_huge"), "GB/s", g(f"fio_read{sfx}_gbps_huge"),
                "GB/s", "fio read, fixedbufs, into hugetlb pages (iomem=shmhuge)", g(f"l2_load_vs_fio{sfx}_huge"), ">= 0.9")
    for sz, sfx in (("32 MiB", ""), ("3 MiB", "_3m")):
        if g(f"l2_load_vs_fio{sfx}_inflight4_huge") is not None:
            row(f"L2 disk load, {sz} objects, huge pages, 4 lookups in flight (`l2_load_vs_fio{sfx}_inflight4_huge`: "
                "as the server's prefetches of several requests overlap; the queue does not drain between lookups)",
                g(f"l2_load{sfx}_inflight4_gbps_huge"), "GB/s", g(f"fio_read{sfx}_inflight4_gbps_huge"), "GB/s",
                "fio read, fixedbufs, into hugetlb pages, same run", g(f"l2_load_vs_fio{sfx}_inflight4_huge"), "")
    def names(sfx=""):
        """How the stores made names durable (docs/l2-disk.md, "Durability")."""
        d = g(f"l2_store_directory_fsync{sfx}")
        return "" if d is None else ("; names: fdatasync + directory fsyncs" if d else "; names: the object's fsync")
    jobs = g("fio_store_jobs")
    fio_w = f"fio write, {jobs:.0f} jobs: {jobs:.0f} fsyncs in flight, depth 16 in all" if jobs else "fio write"
    row(f"**L2 disk store, 32 MiB objects** (`l2_store_vs_fio`, batches of 64{names()})", g("l2_store_gbps"), "GB/s",
        g("fio_write_gbps"), "GB/s", fio_w, g("l2_store_vs_fio"), ">= 0.9")
    row(f"**L2 disk store, 3 MiB objects** (`l2_store_vs_fio_3m`, batches of 64{names()})", g("l2_store_3m_gbps"),
        "GB/s", g("fio_write_3m_gbps"), "GB/s", fio_w, g("l2_store_vs_fio_3m"), ">= 0.9")
    for sz, sfx in (("32 MiB", ""), ("3 MiB", "_3m")):
        if g(f"l2_store_vs_fio{sfx}_huge") is not None:
            row(f"L2 disk store, {sz} objects, both in huge pages (`l2_store_vs_fio{sfx}_huge`: ours from THP, "
                f"as the server's L1{names('_huge')})", g(f"l2_store{sfx}_gbps_huge"), "GB/s", g(f"fio_write{sfx}_gbps_huge"), "GB/s",
                fio_w + ", from hugetlb pages (iomem=shmhuge)", g(f"l2_store_vs_fio{sfx}_huge"), ">= 0.9")
    for sz, sfx in (("32 MiB", ""), ("3 MiB", "_3m")):
        row(f"fio read of {sz} files: submissions at its full depth (16-31)", g(f"fio_read{sfx}_depth_full_pct"), "%",
            None, "", "fio's iodepth histogram", None, "")
    row("L2 Redis load, 3 MiB values", g("l2_redis_load_gbps"), "GB/s", g("redis_benchmark_get_gbps"), "GB/s",
        "redis-benchmark GET", g("l2_redis_vs_redis_benchmark"), ">= 0.8")
    row("lookup round trip (39 chunks), unpinned", g("lookup_rtt_us"), "us", g("raw_rtt_us"), "us",
        "raw Unix-socket ping-pong, unpinned", g("lookup_rtt_vs_raw"), "<= 2")
    for pl, what in (("same_cpu", "client and server on one CPU"), ("cross_cpu", "client and server on two CPUs")):
        row(f"**lookup round trip, {what}** (`lookup_rtt_vs_raw_{pl}`)", g(f"lookup_rtt_{pl}_us"), "us",
            g(f"raw_rtt_{pl}_us"), "us", "raw ping-pong, pinned alike", g(f"lookup_rtt_vs_raw_{pl}"), "<= 1.5")
    row("connector lookup, prompt all in L1 (`lookup_rtt_l1_hit_us`: lookup() to its answer, one round trip)",
        g("lookup_rtt_l1_hit_us"), "us", g("lookup_rtt_us"), "us", "a lookup on the raw protocol, unpinned",
        None, "")
    row("connector L2 hit: lookup + retrieve into the engine's blocks (`l2_hit_added_latency_us` over disk time)",
        g("l2_hit_latency_us"), "us", g("l2_hit_disk_time_us"), "us",
        "O_DIRECT read of the same object files, depth 16, into huge pages: the mean of a read right before "
        "and one right after each hit, agreeing pairs only", None, "")
    row("**kvtier-server start to its first answered lookup** (`server_start_to_first_lookup_ms`, the worst of "
        "1 and 8 GiB of L1, with and without a disk backend)",
        g("server_start_to_first_lookup_ms"), "ms", g("server_start_to_l1_prefaulted_8gib_ms")
        or g("server_start_to_l1_prefaulted_4gib_ms"), "ms",
        "spawn to \"L1 prefaulted\", the largest L1: the first answer before issue 25", None, "<= 100 ms")
    row("L1 registration with the disk backend: the longest I/O-thread step (`l1_register_longest_step_8gib_ms`)",
        g("l1_register_longest_step_8gib_ms") or g("l1_register_longest_step_4gib_ms"), "ms",
        g("l1_register_8gib_ms") or g("l1_register_4gib_ms"), "ms", "the whole registration, in 256 MiB steps",
        None, "")
    row("degraded mode (no server) throughput", None, "", None, "", "no connector at all", g("degraded_vs_nocache"),
        ">= 0.95")
    row("degraded mode throughput, free compute (`degraded_vs_nocache_free_compute`)", None, "", None, "",
        "no connector at all, --tokens-per-second 0", g("degraded_vs_nocache_free_compute"), ">= 0.95")
    for shape, sfx, tok in (("05b", "_05b", 10000), ("8b", "", 4112)):
        label = "0.5B" if shape == "05b" else "8B"
        r = table.get(shape, {}).get(tok, {})
        row(f"long-doc QA {label}, {tok} tokens: TTFT, L1 hit", r.get("l1"), "s", r.get("recompute"), "s",
            "recompute at 50,000 tokens/s", (r["l1"] / r["recompute"]) if "l1" in r and "recompute" in r else None, "< 1")
        row(f"**L1-hit time in kvtier, {label}** (`l1_hit_ttft_vs_copy_bound{sfx}`)", g(f"l1_hit_kvtier_s{sfx}"), "s",
            g(f"l1_hit_copy_bound_s{sfx}"), "s", "bytes / streaming copy (gather stage) + one lookup RTT (rpc stage)",
            g(f"l1_hit_ttft_vs_copy_bound{sfx}"), "<= 1.5")
        rc = r.get("recompute_l2_run", r.get("recompute"))
        row(f"long-doc QA {label}, {tok} tokens: TTFT, L2 (disk) hit (`l2_hit_vs_recompute{sfx}`)", r.get("l2"), "s",
            rc, "s", "recompute of the same documents, same run",
            g(f"l2_hit_vs_recompute{sfx}") or ((r["l2"] / rc) if "l2" in r and rc else None), "<= 1")
        if shape == "8b" and "l2_gated" in r:
            rg = r.get("recompute_l2_gated_run")
            row(f"**long-doc QA 8B, {tok} tokens: TTFT, L2 on with the prefill rate declared** "
                "(`l2_hit_vs_recompute_gated`: the lookup offers from L2 only what loads faster than it computes)",
                r["l2_gated"], "s", rg, "s", "recompute of the same documents, same run",
                g("l2_hit_vs_recompute_gated") or ((r["l2_gated"] / rg) if rg else None), "<= 1")
        mib = fmt((g(f"l2_hit_bytes_per_request{sfx}") or 0) / 2**20)
        pairs, split = g(f"l2_hit_pairs{sfx}"), g(f"l2_hit_pairs_split{sfx}")
        count = (lambda v: "?" if v is None else str(int(v)))
        paired = (f"medians over {count(pairs)} pairs (an O_DIRECT read of the hit's own object files right before "
                  f"and right after it){f', {count(split)} split pairs (probes > 1.5x apart) left out' if split else ''}"
                  f"{'; FEWER THAN 7 PAIRS AGREED' if pairs is not None and pairs < 7 else ''}")
        disk = (f"disk read {fmt(g(f'l2_hit_disk_read_gbps{sfx}'))} GB/s into one request's worth of memory in "
                f"huge pages (small reused buffers: {fmt(g(f'l2_hit_disk_read_small_buffers_gbps{sfx}'))} GB/s)")
        row(f"**L2-hit time in kvtier, {label}** (`l2_hit_ttft_vs_overlap_bound{sfx}`)", g(f"l2_hit_kvtier_s{sfx}"),
            "s", g(f"l2_hit_overlap_bound_s{sfx}"), "s",
            f"max(bytes / disk read, bytes / memcpy ({fmt(g(f'l2_hit_memcpy_gbps{sfx}'))} GB/s)), {mib} MiB; {disk}; "
            f"{paired}", g(f"l2_hit_ttft_vs_overlap_bound{sfx}"), "<= 1.2")
        p25, p75 = g(f"l2_hit_ttft_vs_disk_time{sfx}_p25"), g(f"l2_hit_ttft_vs_disk_time{sfx}_p75")
        spread = f"; pairs p25-p75 {fmt(p25)}-{fmt(p75)}" if p25 is not None and p75 is not None else ""
        small = g(f"l2_hit_ttft_vs_disk_time_small_buffers{sfx}")
        row(f"L2-hit time in kvtier, {label}, vs disk time alone (`l2_hit_ttft_vs_disk_time{sfx}`)",
            g(f"l2_hit_kvtier_s{sfx}"), "s", g(f"l2_hit_disk_time_s{sfx}"), "s",
            f"bytes / disk read of the same pair, {mib} MiB{spread}; vs the small-buffer probe: {fmt(small)}",
            g(f"l2_hit_ttft_vs_disk_time{sfx}"), "<= 1.15")
        if g(f"l2_hit_together_bound_s{sfx}"):
            row(f"L2-hit time in kvtier, {label}, vs disk and copy run together "
                f"(`l2_hit_ttft_vs_together_bound{sfx}`)",
                g(f"l2_hit_kvtier_s{sfx}"), "s", g(f"l2_hit_together_bound_s{sfx}"), "s",
                f"the same reads while a memcpy of as many bytes runs beside them, until both end: the overlapped "
                f"bound as this machine delivers it (the disk read "
                f"{fmt(g(f'l2_hit_disk_read_with_copy_gbps{sfx}'))} GB/s with the copy beside it, "
                f"{fmt(g(f'l2_hit_disk_read_gbps{sfx}'))} alone)",
                g(f"l2_hit_ttft_vs_together_bound{sfx}"), "")
        row(f"L2-hit time in kvtier, {label}, vs the serial sum (`l2_hit_ttft_vs_io_bound{sfx}`, old)",
            g(f"l2_hit_kvtier_s{sfx}"), "s", g(f"l2_hit_io_bound_s{sfx}"), "s",
            "bytes / disk read + bytes / memcpy, as if nothing overlapped", g(f"l2_hit_ttft_vs_io_bound{sfx}"), "")
    row("**layer-wise loading, torch model, L1 hit** (`layerwise_ttft_vs_whole`, bench/layerwise_ttft.py)",
        g("layerwise_ttft_s"), "s", g("whole_ttft_s"), "s",
        f"the same retrieve waited for whole before layer 0; perfect overlap would give "
        f"{fmt(g('layerwise_bound_vs_whole'))}", g("layerwise_ttft_vs_whole"), "< 1")
    row("**layer-wise loading, torch model, L2 (disk) hit** (`layerwise_l2_ttft_vs_whole`, bench/layerwise_ttft.py --l2)",
        g("layerwise_l2_ttft_s"), "s", g("layerwise_l2_whole_ttft_s"), "s",
        f"the same L2 retrieve waited for whole before layer 0; perfect overlap would give "
        f"{fmt(g('layerwise_l2_bound_vs_whole'))}", g("layerwise_l2_ttft_vs_whole"), "< 0.85")
    for n in (1, 64, 256):
        mark = "**" if n == 256 else ""
        row(f"{mark}vLLM connector, one engine step, {n} request(s), steady state "
            f"(`vllm_step_overhead_us_{n}`, median step, half the arrivals hit; TP=1: vLLM's UniProcExecutor, nothing pickled){mark}",
            g(f"vllm_step_overhead_us_{n}"), "us", g(f"vllm_step_budget_us_{n}"), "us",
            "1% of an 8B decode step on an H100 (HBM floor: weights + KV / 3.35 TB/s)",
            quotient(f"vllm_step_overhead_us_{n}", f"vllm_step_budget_us_{n}"), "<= 1")
    row("vLLM connector, decode steps alone, 256 requests (`vllm_decode_step_vs_budget_256`: warm, no I/O)",
        g("vllm_decode_step_us_256"), "us", g("vllm_step_budget_us_256"), "us",
        "1% of an 8B decode step on an H100 (HBM floor)", g("vllm_decode_step_vs_budget_256"), "<= 1")
    row("vLLM connector, the same decode steps after the forward-pass wait, 256 requests "
        "(`vllm_decode_step_after_wait_us_256`: no I/O)",
        g("vllm_decode_step_after_wait_us_256"), "us", g("vllm_decode_step_us_256"), "us",
        "the same steps back to back (warm)",
        quotient("vllm_decode_step_after_wait_us_256", "vllm_decode_step_us_256"), "")
    row("machine control, no kvtier: Python work (1 MB touched) after the same wait (`machine_after_wait_slowdown`)",
        g("machine_python_after_wait_us"), "us", g("machine_python_us"), "us", "the same work back to back",
        g("machine_after_wait_slowdown"), "")
    row("machine control, no kvtier: one write to a process asleep in read(), after the same wait "
        "(`machine_wake_us`: what telling the server something costs the engine thread here)",
        g("machine_wake_us"), "us", g("machine_write_no_wake_us"), "us",
        "the same write while that process polls (nothing to wake)",
        quotient("machine_wake_us", "machine_write_no_wake_us"), "")
    row("vLLM connector, 256 requests, the engine thread's CPU time in the step's calls "
        "(`vllm_step_overhead_cpu_us_256`: median; the wall time less what it spent off a core or blocked)",
        g("vllm_step_overhead_cpu_us_256"), "us", g("vllm_step_overhead_us_256"), "us", "the median step (wall)",
        quotient("vllm_step_overhead_cpu_us_256", "vllm_step_overhead_us_256"), "")
    row("steady-state control, 256 requests: the step's metadata pickled after the forward-pass wait "
        "(`steady_after_wait_slowdown_256`: the server moving the arrivals' KV meanwhile)",
        g("steady_repickle_after_wait_us_256"), "us", g("steady_repickle_us_256"), "us",
        "the same pickle right after a first one (warm)", g("steady_after_wait_slowdown_256"), "")
    row("vLLM connector, 256 requests: steps in which an arrival was asked until its lookup answered "
        "(`vllm_lookup_steps_256`, mean; `lookup_wait_ms` 0, the default)",
        g("vllm_lookup_steps_256"), "", 1, "", "answered at the first ask: admitted in the step it arrived in "
        "(each step more delays the request by an engine step)", None, "")
    row("vLLM connector, 256 requests, mean step (`vllm_step_overhead_mean_us_256`: C++ call outliers included)",
        g("vllm_step_overhead_mean_us_256"), "us", g("vllm_step_overhead_us_256"), "us", "the median step",
        None, "")
    for c in (1, 2, 4, 8):
        tp, tp1 = g(f"clients_{c}_tokens_per_s"), g("clients_1_tokens_per_s")
        if tp is not None:
            row(f"scaling: {c} engine client(s), throughput", tp, "tokens/s", tp1, "tokens/s", "1 client",
                tp / tp1 if tp1 else None, "")
            row(f"scaling: {c} engine client(s), p99 TTFT", g(f"clients_{c}_p99_ttft_s"), "s",
                g("clients_1_p99_ttft_s"), "s", "1 client",
                (g(f"clients_{c}_p99_ttft_s") / g("clients_1_p99_ttft_s")) if g("clients_1_p99_ttft_s") else None, "")
    for k in sorted(k for k in f if k.startswith("rss_l1_") and k.endswith("gb_mib")):
        gb = float(k[len("rss_l1_"):-len("gb_mib")].replace("p", "."))
        row(f"server RSS with a full {gb:g} GiB L1", f[k], "MiB", gb * 1024, "MiB", "the L1 size", f[k] / (gb * 1024), "")

    lines = [BEGIN, "## Summary (generated by bench/run_all.sh)", "",
             f"Generated {meta['generated']} by `bench/run_all.sh{' --quick' if meta['quick'] else ''}"
             f"{' --only ' + meta['only'] if meta['only'] else ''}` in "
             f"{meta['seconds'] // 60} min {meta['seconds'] % 60} s on {meta['machine']}"
             + (f" (only the rows of {meta['only']} come from this run; the others are the earlier runs' figures "
                "that results.json kept)" if meta['only'] else "")
             + ". Every baseline or limit was measured in the same run as its figure; a ratio is the benchmark's own (the median of per-repeat ratios, interleaved) where it "
             "prints one, else value / baseline. Raw figures: `bench/results/results.json` and `results.csv`; "
             "the sections below say what each benchmark measures. Do not edit between the markers: run_all "
             "rewrites it.", "",
             "| figure | value | baseline or limit (same run) | ratio | target |", "|---|---|---|---|---|"]
    for figure, value, vunit, base, bunit, base_name, ratio, target, _ in rows:
        b = f"{fmt(base, bunit)} ({base_name})" if base is not None else base_name
        lines.append(f"| {figure} | {fmt(value, vunit) if value is not None else ('-' if ratio is not None else 'not run')} "
                     f"| {b} | {fmt(ratio) if ratio is not None else '-'} | {target} |")
    lines.append("")
    if made:
        lines.append("Plots (`docs/images/`, gnuplot): " + ", ".join(f"[{m}](images/{m})" for m in made) + ".")
        lines.append("")
        for m in made:
            lines.append(f"![{m[:-4]}](images/{m})")
            lines.append("")
    lines.append(END)
    return "\n".join(lines)


def write_docs(root, text):
    path = os.path.join(root, "docs", "performance.md")
    with open(path) as f:
        doc = f.read()
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        doc = head + text + tail
    else:  # first run: after the introduction, before the first section
        i = doc.find("\n## ")
        doc = doc[: i + 1] + text + "\n\n" + doc[i + 1 :] if i >= 0 else doc + "\n" + text + "\n"
    with open(path, "w") as f:
        f.write(doc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--quick", type=int, default=0)
    ap.add_argument("--docs", type=int, default=1)
    ap.add_argument("--machine", default="")
    ap.add_argument("--only", default="", help="the stages --only ran (empty: every stage)")
    a = ap.parse_args()
    meta = {"generated": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "seconds": a.seconds,
            "quick": bool(a.quick), "machine": a.machine, "only": a.only}
    a.results, a.root = os.path.abspath(a.results), os.path.abspath(a.root)
    res = merge(a.results, load_raw(a.raw), meta)
    made, table = plots(a.root, a.results, res)
    if a.docs:
        write_docs(a.root, summary(res, meta, table, made))
    print(f"run_all: {sum(len(v) for v in res.values())} figures in {a.results}/results.json and results.csv; "
          f"plots: {', '.join(made) or 'none'}" + ("; docs/performance.md summary regenerated" if a.docs else ""))


if __name__ == "__main__":
    main()

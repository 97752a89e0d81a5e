#!/usr/bin/env python3
"""The L2-hit figures derived from one kvtier_long_doc_qa report (--l2-mode --io-bound-dir,
--json REPORT), per trial, then the median over trials (bench/run_all.sh runs it after each
L2 run and gathers its RESULT lines with the run's suffix):

  l2_hit_disk_time_s<sfx>            bytes per request / the disk read probe's bandwidth
  l2_hit_copy_time_s<sfx>            bytes per request / memcpy bandwidth
  l2_hit_overlap_bound_s<sfx>        max(disk time, copy time): the limit when the copy of one
                                     chunk overlaps the read of the next (the two costs
                                     overlap; the program's own l2_hit_io_bound_s adds them)
  l2_hit_ttft_vs_overlap_bound<sfx>  time in kvtier / overlap bound
  l2_hit_ttft_vs_disk_time<sfx>      time in kvtier / disk time
  l2_hit_vs_recompute<sfx>           query-round mean TTFT (served from L2) / warmup-round mean
                                     TTFT (the same documents computed, L2 empty)

The disk probe reads files the server wrote moments before (freshly written files on a VM
whose host may cache them): it is this virtual disk's speed for recent files.

  l2_hit_bounds.py REPORT.json [SUFFIX]
Standard library only."""

import json
import statistics
import sys


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__.split("\n\n")[-1].splitlines()[0].strip(), file=sys.stderr)
        return 2
    sfx = sys.argv[2] if len(sys.argv) == 3 else ""
    with open(sys.argv[1]) as f:
        rep = json.load(f)
    disk, copy, overlap, vs_overlap, vs_disk, vs_recompute = [], [], [], [], [], []
    for t in rep.get("trials", []):
        io = t.get("io_bound")
        if io and io.get("disk_read_gbps", 0) > 0 and io.get("memcpy_gbps", 0) > 0:
            b = io["bytes_per_request"]
            d = b / (io["disk_read_gbps"] * 1e9)
            c = b / (io["memcpy_gbps"] * 1e9)
            disk.append(d)
            copy.append(c)
            overlap.append(max(d, c))
            vs_overlap.append(io["kvtier_s"] / max(d, c))
            vs_disk.append(io["kvtier_s"] / d)
        w, q = t.get("warmup", {}).get("ttft_mean_s"), t.get("query", {}).get("ttft_mean_s")
        if w and q:
            vs_recompute.append(q / w)
    out = [("l2_hit_disk_time_s", disk), ("l2_hit_copy_time_s", copy), ("l2_hit_overlap_bound_s", overlap),
           ("l2_hit_ttft_vs_overlap_bound", vs_overlap), ("l2_hit_ttft_vs_disk_time", vs_disk),
           ("l2_hit_vs_recompute", vs_recompute)]
    for name, values in out:
        if values:
            print(f"RESULT {name}{sfx}={statistics.median(values):.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

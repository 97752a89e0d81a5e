#!/usr/bin/env bash
# A/B of --l1-huge-pages on the L2-hit figure: run_all's L2 long-document runs (0.5B 10,000
# tokens x 4 documents, 8B 4,112 x 2; --l2-mode --io-bound-dir pairs), the server with
# --l1-huge-pages false and true, alternating (odd rounds off first, even rounds on first).
# Prints per run the paired median l2_hit_ttft_vs_disk_time, its p25-p75, and the server's
# log line saying how much of L1 the kernel gave in huge pages. docs/performance.md,
# "L1 in huge pages".
#   KVTIER_BUILD_DIR=build bench/tools/l1_huge_pages_ab.sh [ROUNDS [SHAPES...]]   (05b 8b)
# TRIALS (default 7) pairs per run.
set -euo pipefail
b=${KVTIER_BUILD_DIR:-build}
rounds=${1:-3}
shift || true
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(05b 8b)
work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-thp-ab-XXXXXX")
server_pid=""
trap 'if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; fi; rm -rf "$work"' EXIT
for r in $(seq 1 "$rounds"); do
  for shape in "${shapes[@]}"; do
    if [ $((r % 2)) = 1 ]; then order=(false true); else order=(true false); fi
    for huge in "${order[@]}"; do
      d="$work/r$r-$shape-$huge"
      mkdir -p "$d"
      if [ "$shape" = 8b ]; then slot=33554432 model=8b tokens=4112 docs=2; else slot=3145728 model=0.5b tokens=10000 docs=4; fi
      "$b/examples/kvtier-server" --socket "$d/s.sock" --l1-size-gb 2 --l1-slot-bytes "$slot" \
        --l2-backend "{\"type\":\"disk\",\"path\":\"$d/disk\",\"capacity_gb\":16}" \
        --eviction-policy noop --l2-store-policy skip_l1 --prefetch-policy wait_complete \
        --l1-huge-pages "$huge" > "$d/server.log" 2>&1 &
      server_pid=$!
      for _ in $(seq 1 500); do [ -S "$d/s.sock" ] && break; sleep 0.02; done
      out=$("$b/examples/kvtier_long_doc_qa" --socket "$d/s.sock" --model "$model" --documents "$docs" \
        --tokens "$tokens" --max-inflight 1 --trials "${TRIALS:-7}" --verify-every 256 --l2-mode \
        --io-bound-dir "$d/disk" --result-suffix _ab 2>&1) || { echo "$out" | tail -5; exit 1; }
      kill "$server_pid"
      wait "$server_pid" 2>/dev/null || true
      server_pid=""
      fig() { echo "$out" | sed -n "s/^RESULT l2_hit_ttft_vs_disk_time_ab$1=//p"; }
      echo "round $r $shape huge_pages=$huge: ratio $(fig "") [$(fig _p25)-$(fig _p75)]" \
        "pairs $(echo "$out" | sed -n 's/^RESULT l2_hit_pairs_ab=//p');" \
        "$(grep -o 'L1 huge pages: .*' "$d/server.log" || echo 'L1 huge pages: off')"
      rm -rf "$d"
    done
  done
done

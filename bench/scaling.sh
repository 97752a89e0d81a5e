#!/usr/bin/env bash
# Scaling of one kvtier-server (bench/run_all.sh runs it; docs/performance.md, "Scaling"):
#  1. 1, 2, 4 and 8 engine clients (kvtier_long_doc_qa processes, each its own mini engine and
#     connector, distinct documents) started together on one server (L1 of 2 GiB, 0.5B shape,
#     documents of 2,576 tokens = 10 chunks). Each client runs a warmup round, then a query
#     round of its documents x --repeat-count 10 (5 with --quick; L1 hits), 2 requests in flight.
#     RESULT clients_<n>_tokens_per_s = the sum of the clients' query-round prompt tokens over
#     the longest query round (the rounds overlap: the warmups before them take the same time);
#     RESULT clients_<n>_p99_ttft_s = the highest p99 TTFT of the clients' query rounds.
#  2. The server's resident memory (VmRSS, shared memory included) with an L1 of 0.5, 1 and 2
#     GiB (--quick: 0.5 and 1), no L2, after a warmup that stores 1.5x the L1 size:
#     RESULT rss_l1_<gb>gb_mib (full) and rss_empty_l1_<gb>gb_mib (started, its L1 prefaulted); 0.5 -> 0p5.
#
#   bench/scaling.sh BUILD_DIR WORK_DIR RESULTS_DIR [--quick]
set -euo pipefail
build=$1 work=$2 results=$3
quick=0
[ "${4:-}" = --quick ] && quick=1
cd "$(dirname "$0")/.."
mkdir -p "$work" "$results/scaling"
rm -f "$results/scaling/"*.json
server_pid=""
trap 'kill "$server_pid" 2>/dev/null || true' EXIT

start_server() {  # DIR L1_GB [more server flags]
  local d=$1 gb=$2
  shift 2
  mkdir -p "$d"
  "$build/examples/kvtier-server" --socket "$d/s.sock" --l1-size-gb "$gb" --l1-slot-bytes 3145728 "$@" \
    > "$d/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 500); do
    if [ -S "$d/s.sock" ]; then
      # No client runs while the server faults its L1 in (status l1.residency), on these cores.
      /usr/bin/python3 -c "import sys; sys.path[:0] = ['tests/python', '$build/python']
from kvtier_testing import wait_l1_settled; wait_l1_settled('$d/s.sock', who='scaling')" && return 0
      exit 1
    fi
    kill -0 "$server_pid" 2>/dev/null || { echo "kvtier-server exited: $(tail -5 "$d/server.log")" >&2; exit 1; }
    sleep 0.02
  done
  echo "kvtier-server did not start" >&2
  exit 1
}
stop_server() { kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; server_pid=""; }
rss_mib() { awk '/^VmRSS:/ { printf "%.1f", $2 / 1024 }' "/proc/$server_pid/status"; }

docs=4 repeat=10
[ $quick = 1 ] && docs=3 repeat=5
for n in 1 2 4 8; do
  d="$work/clients-$n"
  start_server "$d" 2
  pids=()
  for c in $(seq 1 "$n"); do
    "$build/examples/kvtier_long_doc_qa" --socket "$d/s.sock" --model 0.5b --documents "$docs" --tokens 2576 \
      --repeat-count "$repeat" --max-inflight 2 --verify-every 256 --seed $((1000 * n + c)) \
      --json "$results/scaling/clients_${n}_$c.json" > "$d/client-$c.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "a client failed: $(tail -3 "$d"/client-*.log)" >&2; exit 1; }; done
  stop_server
  rm -rf "$d"
  python3 - "$n" "$results/scaling" << 'EOF'
import json, sys, glob
n, dir_ = sys.argv[1], sys.argv[2]
reps = [json.load(open(p)) for p in sorted(glob.glob(f"{dir_}/clients_{n}_*.json"))]
q = [r["trials"][0]["query"] for r in reps]
tokens = sum(x["tokens_total"] for x in q)
longest = max(x["round_time_s"] for x in q)
print(f"{n} clients: {tokens} query tokens, longest query round {longest:.3f} s, p99 TTFT {max(x['ttft_p99_s'] for x in q):.4f} s")
print(f"RESULT clients_{n}_tokens_per_s={tokens / longest:.1f}")
print(f"RESULT clients_{n}_p99_ttft_s={max(x['ttft_p99_s'] for x in q):.6f}")
EOF
done

sizes=(0.5 1 2)
[ $quick = 1 ] && sizes=(0.5 1)
for gb in "${sizes[@]}"; do
  d="$work/rss-$gb"
  start_server "$d" "$gb"
  sleep 0.5
  empty=$(rss_mib)
  # 1.5x the L1 size in 30 MiB documents (10 chunks of 3 MiB each).
  fill=$(python3 -c "import math; print(math.ceil($gb * 1024 * 1.5 / 30))")
  "$build/examples/kvtier_long_doc_qa" --socket "$d/s.sock" --model 0.5b --documents "$fill" --tokens 2576 \
    --max-inflight 4 --verify-every 256 --tokens-per-second 0 > "$d/client.log" 2>&1 ||
    { echo "the fill failed: $(tail -3 "$d/client.log")" >&2; exit 1; }
  full=$(rss_mib)
  stop_server
  rm -rf "$d"
  name=${gb/./p}
  echo "L1 $gb GiB: server RSS $empty MiB empty, $full MiB full"
  echo "RESULT rss_empty_l1_${name}gb_mib=$empty"
  echo "RESULT rss_l1_${name}gb_mib=$full"
done

#!/usr/bin/env bash
# Quick start, part 1: installs what is missing, builds and runs the main job (the demo):
#   1. starts kvtier-server with its embedded defaults on a socket in a temporary directory;
#   2. runs the mini engine (a stand-in inference engine) through the connector: every
#      document twice, the second round served from the cache (every block verified);
#   3. runs the fault-tolerance harness's warmup and kill phases (the server SIGKILLed
#      mid-run: the engine keeps serving, every output verified);
#   4. prints a report, with where the server's Prometheus metrics are and a few live figures.
#   ./scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

kvtier_ensure_packages "${KVTIER_BUILD_PACKAGES[@]}" curl
# build/ is shared with ./scripts/test.sh, in either order: the demo needs neither the Python
# package nor every test (AUTO: built where its packages are, now or at a later configure).
kvtier_configure build -DCMAKE_BUILD_TYPE=Release -DKVTIER_SANITIZE= -DKVTIER_BUILD_PYTHON=AUTO \
  -DKVTIER_REQUIRE_ALL_TESTS=OFF > /dev/null
cmake --build build -j"$(kvtier_jobs)" --target kvtier-server kvtier_mini_engine kvtier_fault_tolerance

bin=build/examples
work=$(mktemp -d /tmp/kvtier-demo-XXXXXX)
server_pid=
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2> /dev/null && wait "$server_pid" 2> /dev/null
  rm -rf "$work"
}
trap cleanup EXIT

echo
echo "== 1. kvtier-server, embedded defaults (1 GiB L1, LRU), socket $work/kvtier.sock, metrics on a free port"
"$bin/kvtier-server" --socket "$work/kvtier.sock" --metrics-port auto > "$work/server.out" 2> "$work/server.log" &
server_pid=$!
for _ in $(seq 1 300); do
  grep -q "listening on" "$work/server.out" 2> /dev/null && break
  kill -0 "$server_pid" 2> /dev/null || { cat "$work/server.log"; exit 1; }
  sleep 0.1
done
head -1 "$work/server.out"
metrics_url=$(grep -o 'http://[^ ]*/metrics' "$work/server.out" | head -1 || true)

echo
echo "== 2. mini engine: 6 documents of 8,192 tokens, sent twice (50,000 tokens/s of prefill)"
"$bin/kvtier_mini_engine" --socket "$work/kvtier.sock" --documents 6 --tokens 8192 --rounds 2 \
  --json "$work/engine.json" 2>&1 | sed 's/^/   /'

echo
echo "== 3. fault tolerance: warmup, then the server killed (SIGKILL) mid-run"
"$bin/kvtier_fault_tolerance" --quick --phases 1,2 2>&1 | sed 's/^/   /'

echo
echo "== report"
echo "   round 1 computed every token; round 2 took its KV from the cache (see 'tokens from"
echo "   cache' and 'mean TTFT' above). With the server killed the engine recomputed and every"
echo "   output stayed correct. Full harness: $bin/kvtier_fault_tolerance (docs/fault-tolerance.md)."
if [ -n "$metrics_url" ]; then
  echo
  echo "== the demo server's metrics (Prometheus text at $metrics_url; docs/metrics.md)"
  scripts/metrics_figures.sh "$metrics_url" | sed 's/^/   /' || true
fi
kill "$server_pid" && wait "$server_pid" || true
server_pid=
echo "   kvtier-server stopped cleanly (SIGTERM)."

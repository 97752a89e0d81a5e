#!/usr/bin/env bash
# A real Prometheus scrapes kvtier-server (issue 6): the server with a memory L2 backend and
# --metrics-port auto, a short kvtier_long_doc_qa run so that the counters move, then
#   - `promtool check metrics` passes on our /metrics text;
#   - Debian's `prometheus` on loopback (its own temp TSDB, a free port, scrape_interval 1s)
#     scrapes us, and its HTTP API answers our counters with the values /metrics shows (the
#     server is idle by then: they no longer move) and up{job="kvtier"} = 1.
# Every wait polls with a deadline (Prometheus may take a while to start on a loaded machine).
#
# Environment: KVTIER_BUILD_DIR (default build/). Exit status: 0 passed, 1 failed, 77 skipped
# (only when the prometheus or promtool binary is absent: install Debian's `prometheus`
# package; ./scripts/test.sh does), 2 the test could not run (programs not built, curl or jq
# missing).
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
build=${KVTIER_BUILD_DIR:-$here/build}
server_bin=$build/examples/kvtier-server
driver_bin=$build/examples/kvtier_long_doc_qa

say() { echo "prometheus_scrape_test: $*" >&2; }
prom=$(command -v prometheus) || { say "SKIPPED: no prometheus binary (Debian package prometheus)"; exit 77; }
promtool=$(command -v promtool) || { say "SKIPPED: no promtool binary (Debian package prometheus)"; exit 77; }
for t in curl jq; do command -v $t >/dev/null || { say "cannot run: $t is not installed"; exit 2; }; done
for b in "$server_bin" "$driver_bin"; do
  [ -x "$b" ] || { say "cannot run: $b is not built"; exit 2; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-prom.XXXXXX")
server_pid= prom_pid=
stop() {  # stop PID: SIGTERM, then wait for it
  [ -n "$1" ] && kill -0 "$1" 2>/dev/null && { kill -TERM "$1" 2>/dev/null; wait "$1" 2>/dev/null; }
  return 0
}
cleanup() { stop "$prom_pid"; stop "$server_pid"; rm -rf "$work"; }
trap cleanup EXIT
fail() { say "FAILED: $*"; exit 1; }

# Waits until `cmd` succeeds, up to $1 seconds; false on timeout.
wait_for() {
  local deadline=$((SECONDS + $1)); shift
  while [ $SECONDS -lt $deadline ]; do "$@" && return 0; sleep 0.1; done
  return 1
}

sock=$work/kvtier.sock
"$server_bin" --socket "$sock" --log-level warn --l1-size-mb 64 --l1-slot-bytes 524288 \
  --l2-backend '{"type":"memory","name":"mem","capacity_mb":64}' --metrics-port auto \
  >"$work/server.out" 2>"$work/server.err" &
server_pid=$!
metrics_url() { url=$(grep -o 'metrics http://[^ ]*/metrics' "$work/server.out" 2>/dev/null | head -1 | cut -d' ' -f2); [ -n "$url" ]; }
wait_for 60 metrics_url || { cat "$work/server.err" >&2; fail "kvtier-server did not start"; }
target=${url#http://}
target=${target%/metrics}
say "kvtier-server metrics at $url"

"$driver_bin" --socket "$sock" --model tiny --documents 2 --tokens 1000 --tokens-per-second 0 \
  --json "$work/driver.json" >/dev/null 2>"$work/driver.err" || { cat "$work/driver.err" >&2; fail "the driver failed"; }

curl -sf --max-time 30 "$url" -o "$work/metrics.txt" || fail "scrape of $url failed"
if ! "$promtool" check metrics <"$work/metrics.txt" >"$work/promtool.out" 2>&1; then
  cat "$work/promtool.out" >&2
  fail "promtool check metrics found problems in our exposition"
fi
say "promtool check metrics: clean"

# The counters to find in Prometheus, with the values we expose (idle server: stable).
declare -A expect
for series in kvtier_l1_write_keys_total 'kvtier_l2_store_keys_total{backend="mem"}' kvtier_lookups_total \
              kvtier_lookup_requested_tokens_total 'kvtier_lookup_hit_tokens_total{tier="l1"}' \
              'kvtier_server_requests_total{type="store"}'; do
  value=$(grep -F "$series " "$work/metrics.txt" | grep -v '^#' | head -1 | awk '{print $NF}')
  [ -n "$value" ] || fail "$series is not in our /metrics"
  expect[$series]=$value
done
[ "${expect[kvtier_l1_write_keys_total]}" != 0 ] || fail "the workload did not move kvtier_l1_write_keys_total"

cat >"$work/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvtier
    static_configs:
      - targets: ['$target']
EOF
"$promtool" check config "$work/prometheus.yml" >/dev/null || fail "promtool rejects our scrape config"

# A free loopback port: one nothing answers on; a lost race (Prometheus exits, address in
# use) tries another.
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
prom_ready() { curl -sf --max-time 2 "http://127.0.0.1:$prom_port/-/ready" >/dev/null; }
prom_up() { kill -0 "$prom_pid" 2>/dev/null; }
started=0
for attempt in 1 2 3 4 5; do
  prom_port=$((20000 + (RANDOM % 20000)))
  port_free "$prom_port" || continue
  rm -rf "$work/tsdb"
  "$prom" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$prom_port" --log.level=warn >"$work/prom.log" 2>&1 &
  prom_pid=$!
  ready_or_dead() { prom_ready || ! prom_up; }
  wait_for 90 ready_or_dead
  if prom_up && prom_ready; then started=1; break; fi
  stop "$prom_pid"; prom_pid=
  grep -q "address already in use" "$work/prom.log" || { cat "$work/prom.log" >&2; fail "prometheus did not start"; }
done
[ $started -eq 1 ] || fail "prometheus found no free port in 5 tries"
say "prometheus on 127.0.0.1:$prom_port"

# query EXPR: Prometheus's instant value of EXPR (one series), or empty.
query() {
  curl -sf --max-time 5 -G "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$1" |
    jq -r 'if .status == "success" and (.data.result | length) == 1 then .data.result[0].value[1] else empty end'
}
matches() { [ "$(query "$1")" = "$2" ]; }

wait_for 90 matches 'up{job="kvtier"}' 1 || fail "Prometheus never saw the target up (up{job=\"kvtier\"} = $(query 'up{job="kvtier"}'))"
for series in "${!expect[@]}"; do
  if ! wait_for 60 matches "$series" "${expect[$series]}"; then
    fail "Prometheus has $series = '$(query "$series")', /metrics said ${expect[$series]}"
  fi
  say "Prometheus scraped $series = ${expect[$series]}"
done
# A hit rate as the docs compute it evaluates (0..1).
rate_expr='sum(kvtier_lookup_hit_tokens_total) / sum(kvtier_lookup_requested_tokens_total)'
hr=$(query "$rate_expr")
[ -n "$hr" ] || fail "Prometheus could not evaluate $rate_expr"
say "token hit rate over the run: $hr"
say "PASSED"
exit 0

#!/usr/bin/env bash
# Prints a few live figures of a running kvtier-server from its /metrics endpoint: where the
# metrics are, token hit rates, L1 and L2 use, L2 traffic, in-flight work, clients, failures.
# For the demo and for a quick look by hand.
#
#   scripts/metrics_figures.sh http://127.0.0.1:9464        # the endpoint (or .../metrics)
#   scripts/metrics_figures.sh 9464                          # a port on 127.0.0.1
#
# Exit status: 0, or 1 when the endpoint does not answer (the message says so).
set -uo pipefail

arg=${1:?usage: $0 URL|PORT}
case "$arg" in
  http://* | https://*) base=${arg%/metrics} ;;
  *) base=http://127.0.0.1:$arg ;;
esac
text=$(curl -sf --max-time 10 "$base/metrics") || { echo "no kvtier metrics at $base/metrics (is kvtier-server running with --metrics-port?)" >&2; exit 1; }

# sum NAME [LABEL=VALUE]: the sum of NAME's series (matching the label when given), 0 if none.
sum() {
  awk -v n="$1" -v l="${2:-}" '
    /^#/ { next }
    { name = $1; sub(/\{.*/, "", name); if (name != n) next
      if (l != "") { split(l, kv, "="); if (index($1, kv[1] "=\"" kv[2] "\"") == 0) next }
      s += $NF }
    END { printf "%.0f", s }' <<<"$text"
}
pct() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.1f%%", 100 * a / b; else printf "n/a" }'; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

req=$(sum kvtier_lookup_requested_tokens_total)
h1=$(sum kvtier_lookup_hit_tokens_total tier=l1)
h2=$(sum kvtier_lookup_hit_tokens_total tier=l2)
echo "kvtier metrics: $base/metrics (health: $base/healthz, status: $base/status)"
echo "  lookups:        $(sum kvtier_lookups_total), tokens asked $req, hit $(pct $((h1 + h2)) "$req") (L1 $(pct "$h1" "$req"), L2 $(pct "$h2" "$req"))"
echo "  L1:             $(mib "$(sum kvtier_l1_bytes_used)") of $(mib "$(sum kvtier_l1_bytes_capacity)"), $(sum kvtier_l1_objects) objects"
echo "  L2:             $(mib "$(sum kvtier_l2_bytes_used)") used, $(sum kvtier_l2_objects) objects; stored $(sum kvtier_l2_store_succeeded_keys_total) keys ($(mib "$(sum kvtier_l2_store_bytes_total)")), prefetched $(sum kvtier_l2_prefetch_loaded_keys_total) keys ($(mib "$(sum kvtier_l2_prefetch_loaded_bytes_total)"))"
echo "  in flight:      $(sum kvtier_prefetch_requests_active) prefetches, $(mib "$(sum kvtier_store_inflight_bytes)") of stores"
echo "  clients:        $(sum kvtier_server_connections) connected, $(sum kvtier_server_registrations) registered"
echo "  failures:       store $(sum kvtier_l2_store_failed_keys_total) keys, prefetch $(sum kvtier_l2_prefetch_failure_keys_total) keys, request errors $(sum kvtier_server_request_errors_total), log events dropped $(sum kvtier_event_bus_dropped_events_total)"

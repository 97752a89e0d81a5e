#!/usr/bin/env bash
# docs/dashboards/kvtier.json names only metrics we export: every expression of every panel
# and template variable must name at least one kvtier_* metric, and each one it names must be
# a family in the /metrics of a kvtier-server with a disk and a memory L2 backend (histogram
# series: <family>_bucket/_sum/_count) and be documented in docs/metrics.md. With promtool,
# each expression (Grafana's $__rate_interval as 1m, $instance as .*) must also parse as
# PromQL (promtool check rules over a generated rule file; template variables are Grafana's
# label_values(), not PromQL, and are only checked for the names).
#
# Environment: KVTIER_BUILD_DIR (default build/). Exit status: 0 passed, 1 failed, 2 could
# not run (kvtier-server not built, curl or jq missing).
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
build=${KVTIER_BUILD_DIR:-$here/build}
server_bin=$build/examples/kvtier-server
dashboard=$here/docs/dashboards/kvtier.json
say() { echo "dashboard_metrics_test: $*" >&2; }
for t in curl jq; do command -v $t >/dev/null || { say "cannot run: $t is not installed"; exit 2; }; done
[ -x "$server_bin" ] || { say "cannot run: $server_bin is not built"; exit 2; }
jq -e . "$dashboard" >/dev/null || { say "FAILED: $dashboard is not valid JSON"; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-dash.XXXXXX")
server_pid=
cleanup() {
  [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null && { kill -TERM "$server_pid"; wait "$server_pid"; }
  rm -rf "$work"
}
trap cleanup EXIT

"$server_bin" --socket "$work/kvtier.sock" --log-level warn --l1-size-mb 16 --l1-slot-bytes 524288 --metrics-port auto \
  --l2-backend "{\"type\":\"disk\",\"path\":\"$work/disk\",\"capacity_gb\":1}" \
  --l2-backend '{"type":"memory","capacity_mb":16}' >"$work/server.out" 2>"$work/server.err" &
server_pid=$!
url=
deadline=$((SECONDS + 60))
while [ $SECONDS -lt $deadline ] && [ -z "$url" ] && kill -0 "$server_pid" 2>/dev/null; do
  url=$(grep -o 'metrics http://[^ ]*/metrics' "$work/server.out" 2>/dev/null | head -1 | cut -d' ' -f2)
  [ -n "$url" ] || sleep 0.05
done
[ -n "$url" ] || { cat "$work/server.err" >&2; say "cannot run: kvtier-server did not start"; exit 2; }
curl -sf --max-time 30 "$url" -o "$work/metrics.txt" || { say "FAILED: scrape of $url failed"; exit 1; }

# Families and their types, from the # TYPE lines.
declare -A type_of
while read -r _ _ name type; do type_of[$name]=$type; done < <(grep '^# TYPE ' "$work/metrics.txt")

# Every expression: panel targets (PromQL) and query variables (Grafana's label_values(...)).
jq -r '.. | objects | select(has("expr")) | .expr' "$dashboard" >"$work/promql.txt"
jq -r '.templating.list[]? | select(.type == "query") | (.query | if type == "object" then .query else . end)' \
  "$dashboard" >"$work/variables.txt"
cat "$work/promql.txt" "$work/variables.txt" >"$work/exprs.txt"
count=$(wc -l <"$work/exprs.txt")
[ "$count" -gt 0 ] || { say "FAILED: no expressions found in $dashboard"; exit 1; }

fails=0
declare -A seen
while IFS= read -r expr; do
  names=$(grep -o 'kvtier_[a-zA-Z0-9_:]*' <<<"$expr" | sort -u)
  if [ -z "$names" ]; then say "FAILED: names no kvtier metric: $expr"; fails=$((fails + 1)); continue; fi
  for n in $names; do
    family=$n
    for suffix in _bucket _sum _count; do
      base=${n%"$suffix"}
      [ "$base" != "$n" ] && [ "${type_of[$base]:-}" = histogram ] && family=$base
    done
    if [ -z "${type_of[$family]:-}" ]; then
      say "FAILED: $n is not exported by kvtier-server (in: $expr)"; fails=$((fails + 1))
    elif ! grep -qF "\`$family\`" "$here/docs/metrics.md"; then
      say "FAILED: $family is not documented in docs/metrics.md"; fails=$((fails + 1))
    fi
    seen[$family]=1
  done
done <"$work/exprs.txt"

if command -v promtool >/dev/null; then
  {
    echo "groups:"
    echo "  - name: dashboard"
    echo "    rules:"
    i=0
    while IFS= read -r expr; do
      i=$((i + 1))
      e=${expr//\$__rate_interval/1m}
      e=${e//\$instance/.*}
      echo "      - record: dashboard:expr_$i"
      echo "        expr: $(jq -Rn --arg e "$e" '$e')"
    done <"$work/promql.txt"
  } >"$work/rules.yml"
  if ! promtool check rules "$work/rules.yml" >"$work/promtool.out" 2>&1; then
    cat "$work/promtool.out" >&2
    say "FAILED: promtool rejects expressions of the dashboard (see above)"; fails=$((fails + 1))
  fi
else
  say "promtool not found: PromQL syntax not checked (install Debian's prometheus package)"
fi

[ $fails -eq 0 ] || { say "FAILED: $fails problems"; exit 1; }
say "PASSED: $count expressions over ${#seen[@]} metrics, all exported and documented"
exit 0

#!/usr/bin/env bash
# The L2 telemetry gate (issue 6): a kvtier-server with a disk L2 backend, the noop L1
# eviction policy and the skip_l1 store policy; kvtier_long_doc_qa in L2 mode (its query round
# can only be served by prefetch from L2); then one scrape of /metrics, checked for counts
# (never timings: those belong to the benchmarks):
#   - the scrape succeeds (a failed scrape fails the gate: no silent skip);
#   - kvtier_l1_write_keys_total, kvtier_l2_store_keys_total, kvtier_l2_store_succeeded_keys_total,
#     kvtier_l2_prefetch_lookups_total, kvtier_l2_prefetch_hit_keys_total and
#     kvtier_l2_prefetch_loaded_keys_total are present and above zero;
#   - they agree with each other: succeeded + failed store keys = store keys; loaded <= hit
#     <= lookup keys; loaded + failed = load keys; L1 writes = stores + prefetched keys
#     (skip_l1 stores every L1 write but the prefetched ones); no key failed;
#   - and with the driver's own count: loaded keys = the chunks the query round needed, store
#     keys = the chunks the engine stored, retrieve reads = the chunks the engine retrieved
#     times the world size (kvtier_cache_read_succeeded_keys_total counts only the prefix a
#     retrieve copies; none failed here);
#   - exact L1 read counts: a lookup read-locks only its L1 prefix, so the refused L1 reads
#     (kvtier_l1_read_failed_keys_total) are at most one per lookup (kvtier_lookups_total),
#     not every key after a miss; no prefetch key lacked an L1 slot
#     (kvtier_l2_prefetch_failure_keys_total{reason="l1_out_of_memory"} = 0) and no write was
#     abandoned (kvtier_cache_write_finish_failed_keys_total = 0).
#
#   tests/l2_telemetry_gate.sh                 run and check (./scripts/test.sh runs it via ctest)
#   tests/l2_telemetry_gate.sh --selftest      then also falsify each condition in a copy of the
#                                              scrape and require the checks to fail on it
#   tests/l2_telemetry_gate.sh --check METRICS DRIVER_JSON     check saved files only
#
# Environment: KVTIER_BUILD_DIR (default build/) holds examples/kvtier-server and
# examples/kvtier_long_doc_qa. KVTIER_GATE_BREAK=<metric>[=<value>] sets every series of that
# metric to <value> (default 0; "absent" removes it) in the scrape before checking: the gate
# must then fail (ctest gate.l2_telemetry_break does this). KVTIER_GATE_KEEP=DIR keeps the
# logs, the scrape and the driver's JSON there.
#
# Exit status: 0 passed, 1 a check failed (the scrape included), 2 the gate could not run
# (programs not built, jq or curl missing, the server did not start).
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
build=${KVTIER_BUILD_DIR:-$here/build}
server_bin=$build/examples/kvtier-server
driver_bin=$build/examples/kvtier_long_doc_qa
required=(kvtier_l1_write_keys_total kvtier_l2_store_keys_total kvtier_l2_store_succeeded_keys_total
          kvtier_l2_prefetch_lookups_total kvtier_l2_prefetch_hit_keys_total kvtier_l2_prefetch_loaded_keys_total)

say() { echo "l2_telemetry_gate: $*" >&2; }
die_setup() { say "cannot run: $*"; exit 2; }

# metric_sum NAME FILE: the sum over every series of NAME, or "absent".
metric_sum() {
  awk -v n="$1" '
    /^#/ { next }
    { name = $1; sub(/\{.*/, "", name); if (name == n) { s += $NF; f = 1 } }
    END { if (f) printf "%.0f\n", s; else print "absent" }' "$2"
}

# falsify FILE NAME VALUE: every series of NAME set to VALUE ("absent": removed, "+N": added).
falsify() {
  awk -v n="$2" -v v="$3" '
    /^#/ { print; next }
    { name = $1; sub(/\{.*/, "", name)
      if (name != n) { print; next }
      if (v == "absent") next
      if (v ~ /^\+/) { $NF = $NF + substr(v, 2); print; next }
      $NF = v; print }' "$1"
}

# check METRICS DRIVER_JSON: prints each failed condition; returns the number of failures.
check() {
  local m=$1 d=$2 fails=0
  fail() { say "FAILED: $*"; fails=$((fails + 1)); }
  if [ ! -s "$m" ]; then
    fail "the /metrics scrape is empty or missing ($m)"
    return $fails
  fi
  declare -A v
  for name in "${required[@]}" kvtier_l2_store_failed_keys_total kvtier_l2_prefetch_lookup_keys_total \
              kvtier_l2_prefetch_load_keys_total kvtier_l2_prefetch_failed_keys_total kvtier_l1_prefetched_keys_total \
              kvtier_cache_read_succeeded_keys_total kvtier_cache_read_failed_keys_total \
              kvtier_l1_read_failed_keys_total kvtier_lookups_total kvtier_cache_write_finish_failed_keys_total; do
    v[$name]=$(metric_sum "$name" "$m")
  done
  local l1_oom
  l1_oom=$(awk '/^kvtier_l2_prefetch_failure_keys_total\{.*reason="l1_out_of_memory"/ { s += $NF; f = 1 }
                END { if (f) printf "%.0f\n", s; else print "absent" }' "$m")
  for name in "${required[@]}"; do
    if [ "${v[$name]}" = absent ]; then fail "$name is missing from /metrics"
    elif [ "${v[$name]}" -le 0 ]; then fail "$name is ${v[$name]}: the workload must have moved it"
    fi
  done
  for name in "${!v[@]}"; do
    [ "${v[$name]}" = absent ] && { [[ " ${required[*]} " == *" $name "* ]] || fail "$name is missing from /metrics"; v[$name]=0; }
  done
  local stored=${v[kvtier_l2_store_keys_total]} ok=${v[kvtier_l2_store_succeeded_keys_total]}
  local bad=${v[kvtier_l2_store_failed_keys_total]}
  [ $((ok + bad)) -eq "$stored" ] ||
    fail "kvtier_l2_store_succeeded_keys_total ($ok) + kvtier_l2_store_failed_keys_total ($bad) != kvtier_l2_store_keys_total ($stored)"
  local lookup=${v[kvtier_l2_prefetch_lookup_keys_total]} hit=${v[kvtier_l2_prefetch_hit_keys_total]}
  local loaded=${v[kvtier_l2_prefetch_loaded_keys_total]} load=${v[kvtier_l2_prefetch_load_keys_total]}
  local lfail=${v[kvtier_l2_prefetch_failed_keys_total]}
  [ "$hit" -le "$lookup" ] ||
    fail "kvtier_l2_prefetch_hit_keys_total ($hit) > kvtier_l2_prefetch_lookup_keys_total ($lookup)"
  [ "$loaded" -le "$hit" ] ||
    fail "kvtier_l2_prefetch_loaded_keys_total ($loaded) > kvtier_l2_prefetch_hit_keys_total ($hit)"
  [ $((loaded + lfail)) -eq "$load" ] ||
    fail "kvtier_l2_prefetch_loaded_keys_total ($loaded) + kvtier_l2_prefetch_failed_keys_total ($lfail) != kvtier_l2_prefetch_load_keys_total ($load)"
  [ "$bad" -eq 0 ] || fail "kvtier_l2_store_failed_keys_total is $bad: no store may fail here"
  [ "$lfail" -eq 0 ] || fail "kvtier_l2_prefetch_failed_keys_total is $lfail: no load may fail here"
  local writes=${v[kvtier_l1_write_keys_total]} pre=${v[kvtier_l1_prefetched_keys_total]}
  [ $((writes - pre)) -eq "$stored" ] ||
    fail "kvtier_l1_write_keys_total ($writes) - kvtier_l1_prefetched_keys_total ($pre) != kvtier_l2_store_keys_total ($stored) (skip_l1 stores every written key)"
  # Exact counts: L1 reads of lookups, prefetch reservations, abandoned writes.
  local l1_refused=${v[kvtier_l1_read_failed_keys_total]} lookups=${v[kvtier_lookups_total]}
  [ "$l1_refused" -le "$lookups" ] ||
    fail "kvtier_l1_read_failed_keys_total ($l1_refused) > kvtier_lookups_total ($lookups): lookups read-lock keys after their first miss"
  if [ "$l1_oom" = absent ]; then fail "kvtier_l2_prefetch_failure_keys_total{reason=\"l1_out_of_memory\"} is missing from /metrics"
  elif [ "$l1_oom" -ne 0 ]; then fail "kvtier_l2_prefetch_failure_keys_total{reason=\"l1_out_of_memory\"} is $l1_oom: L1 has room for every prefetch here"
  fi
  [ "${v[kvtier_cache_write_finish_failed_keys_total]}" -eq 0 ] ||
    fail "kvtier_cache_write_finish_failed_keys_total is ${v[kvtier_cache_write_finish_failed_keys_total]}: no write is abandoned here"
  [ "${v[kvtier_cache_read_failed_keys_total]}" -eq 0 ] ||
    fail "kvtier_cache_read_failed_keys_total is ${v[kvtier_cache_read_failed_keys_total]}: every retrieve here asks for what its lookup holds"
  # The driver's own count.
  local want_loaded want_stored want_retrieved world
  want_loaded=$(jq -r '.expect.l2_prefetch_loaded_keys // "absent"' "$d" 2>/dev/null) || want_loaded=absent
  want_stored=$(jq -r '.expect.l2_store_keys // "absent"' "$d" 2>/dev/null) || want_stored=absent
  want_retrieved=$(jq -r '.expect.query_chunks_retrieved // "absent"' "$d" 2>/dev/null) || want_retrieved=absent
  world=$(jq -r '.config.world_size // "absent"' "$d" 2>/dev/null) || world=absent
  if [ "$want_retrieved" = absent ] || [ "$world" = absent ]; then
    fail "the driver's report ($d) has no expect.query_chunks_retrieved / config.world_size"
  else
    local reads=${v[kvtier_cache_read_succeeded_keys_total]}
    [ "$reads" -eq $((want_retrieved * world)) ] ||
      fail "kvtier_cache_read_succeeded_keys_total ($reads) != the chunks the engine retrieved x world size ($want_retrieved x $world, driver)"
  fi
  if [ "$want_loaded" = absent ] || [ "$want_stored" = absent ]; then
    fail "the driver's report ($d) has no expect.l2_prefetch_loaded_keys / expect.l2_store_keys"
  else
    [ "$loaded" -eq "$want_loaded" ] ||
      fail "kvtier_l2_prefetch_loaded_keys_total ($loaded) != the chunks the query round needed from L2 ($want_loaded, driver)"
    [ "$stored" -eq "$want_stored" ] ||
      fail "kvtier_l2_store_keys_total ($stored) != the chunks the engine stored ($want_stored, driver)"
  fi
  if [ $fails -eq 0 ]; then
    say "checks passed: stored $stored keys ($ok ok), prefetch lookups ${v[kvtier_l2_prefetch_lookups_total]}" \
        "($lookup keys, $hit hit), loaded $loaded = driver's $want_loaded, L1 writes $writes ($pre prefetched)"
  fi
  return $fails
}

command -v jq >/dev/null || die_setup "jq is not installed (Debian package jq; ./scripts/test.sh installs it)"

if [ "${1:-}" = --check ]; then
  [ $# -eq 3 ] || die_setup "usage: $0 --check METRICS DRIVER_JSON"
  check "$2" "$3" && exit 0 || exit 1
fi
selftest=0
[ "${1:-}" = --selftest ] && selftest=1

command -v curl >/dev/null || die_setup "curl is not installed (Debian package curl)"
for b in "$server_bin" "$driver_bin"; do
  [ -x "$b" ] || die_setup "$b is not built: cmake --build ${build} --target kvtier-server kvtier_long_doc_qa"
done

work=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-gate.XXXXXX")
server_pid=
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null
    wait "$server_pid" 2>/dev/null
  fi
  if [ -n "${KVTIER_GATE_KEEP:-}" ]; then
    mkdir -p "$KVTIER_GATE_KEEP" && cp -r "$work"/. "$KVTIER_GATE_KEEP"/ 2>/dev/null
    rm -rf "$work/disk"
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# Small and quick: a 2 KiB/token model (0.5 MiB chunks), 8 documents of 15 full chunks and two
# new documents in the query round (hit:miss 4:1): 130 chunks, 65 MiB on disk.
sock=$work/kvtier.sock
"$server_bin" --socket "$sock" --log-level warn --l1-size-mb 256 --l1-slot-bytes 524288 \
  --eviction-policy noop --l2-store-policy skip_l1 --prefetch-policy wait_complete \
  --l2-backend "{\"type\":\"disk\",\"name\":\"disk\",\"path\":\"$work/disk\",\"capacity_gb\":1}" \
  --metrics-port auto >"$work/server.out" 2>"$work/server.err" &
server_pid=$!
url=
deadline=$((SECONDS + 60))
while [ $SECONDS -lt $deadline ]; do
  url=$(grep -o 'metrics http://[^ ]*/metrics' "$work/server.out" 2>/dev/null | head -1 | cut -d' ' -f2)
  [ -n "$url" ] && break
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.05
done
[ -n "$url" ] || { cat "$work/server.err" >&2; die_setup "kvtier-server did not start (see above)"; }
say "server up, metrics at $url"

"$driver_bin" --socket "$sock" --l2-mode --model tiny --documents 8 --tokens 4000 --hit-miss-ratio 4:1 \
  --max-inflight 4 --json "$work/driver.json" >"$work/driver.out" 2>"$work/driver.err"
rc=$?
cat "$work/driver.err" >&2
if [ $rc -ne 0 ]; then
  say "FAILED: kvtier_long_doc_qa exited $rc (see above)"
  exit 1
fi

# One scrape, after the driver saw the server idle (its stores and prefetches landed).
if ! curl -sf --max-time 30 "$url" -o "$work/metrics.txt"; then
  say "FAILED: the scrape of $url failed"
  exit 1
fi
if [ -n "${KVTIER_GATE_BREAK:-}" ]; then
  b_name=${KVTIER_GATE_BREAK%%=*}
  b_value=0
  [[ "$KVTIER_GATE_BREAK" == *=* ]] && b_value=${KVTIER_GATE_BREAK#*=}
  say "KVTIER_GATE_BREAK: $b_name set to $b_value in the scrape (the gate must fail)"
  falsify "$work/metrics.txt" "$b_name" "$b_value" >"$work/metrics.broken" && mv "$work/metrics.broken" "$work/metrics.txt"
fi
check "$work/metrics.txt" "$work/driver.json"
fails=$?
if [ $fails -ne 0 ]; then
  say "GATE FAILED: $fails checks"
  exit 1
fi

if [ $selftest -eq 1 ]; then
  # Each condition on its own, falsified in a copy of the good scrape: every one must fail.
  cases=()
  for name in "${required[@]}"; do cases+=("$name=0" "$name=absent"); done
  cases+=("kvtier_l2_prefetch_loaded_keys_total=+1" "kvtier_l2_store_succeeded_keys_total=+-1"
          "kvtier_l2_store_keys_total=+1" "kvtier_l2_prefetch_hit_keys_total=+1000000"
          "kvtier_l1_write_keys_total=+1" "kvtier_l2_store_failed_keys_total=+1"
          "kvtier_cache_read_succeeded_keys_total=+1" "kvtier_l1_read_failed_keys_total=+1000000"
          "kvtier_l2_prefetch_failure_keys_total=+1" "kvtier_cache_write_finish_failed_keys_total=+1"
          "kvtier_cache_read_failed_keys_total=+1")
  missed=0
  for c in "${cases[@]}"; do
    falsify "$work/metrics.txt" "${c%%=*}" "${c#*=}" >"$work/metrics.case"
    if check "$work/metrics.case" "$work/driver.json" 2>/dev/null; then
      say "SELFTEST FAILED: the checks passed with $c"
      missed=$((missed + 1))
    fi
  done
  : >"$work/metrics.empty"
  if check "$work/metrics.empty" "$work/driver.json" 2>/dev/null; then
    say "SELFTEST FAILED: the checks passed on an empty scrape"; missed=$((missed + 1))
  fi
  if curl -sf --max-time 5 "http://127.0.0.1:1/metrics" -o /dev/null 2>/dev/null; then
    say "SELFTEST FAILED: a scrape of a closed port succeeded"; missed=$((missed + 1))
  fi
  [ $missed -eq 0 ] || exit 1
  say "selftest: the checks failed on each of ${#cases[@]} falsified scrapes, an empty one and a dead port"
fi
say "PASSED"
exit 0

#!/usr/bin/env bash
# Builds the libFuzzer targets with clang into build-fuzz/ and runs each for a fixed time
# (docs/fuzzing.md), one per core at a time (KVTIER_FUZZ_JOBS). Fails (exit 1) when a target
# finds a crash, a leak or a timeout; the input that did it is in build-fuzz/artifacts/<target>/.
#
#   ./scripts/fuzz.sh                      every target, KVTIER_FUZZ_SECONDS (20) s each
#   ./scripts/fuzz.sh --seconds 300 codec  one target, five minutes
#   ./scripts/fuzz.sh --build-only         build, run nothing
#   ./scripts/fuzz.sh --list               the target names
#
# New inputs that reach new coverage go to build-fuzz/corpus/<target>/ (kept between runs,
# never committed by the script); the committed seeds (tests/fuzz/corpus/<target>/) and past
# crashes (tests/fuzz/regressions/<target>/) are read as extra corpora. Extra libFuzzer flags:
# KVTIER_FUZZ_FLAGS, e.g. KVTIER_FUZZ_FLAGS="-jobs=2 -workers=2".
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

seconds=${KVTIER_FUZZ_SECONDS:-20}
build_only=0
list=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --list) list=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1 (--help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done

all=(frame_decoder codec cuda_descriptor config disk_object redis_reply)
if [ "$list" = 1 ]; then printf '%s\n' "${all[@]}"; exit 0; fi
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")
for t in "${targets[@]}"; do
  case " ${all[*]} " in *" $t "*) ;; *) echo "fuzz.sh: no target '$t' (--list)" >&2; exit 2 ;; esac
done

kvtier_ensure_packages "${KVTIER_BUILD_PACKAGES[@]}" "${KVTIER_CLANG_PACKAGES[@]}"
clangxx=$(kvtier_clangxx)
build=build-fuzz
kvtier_configure "$build" -DCMAKE_CXX_COMPILER="$clangxx" -DCMAKE_BUILD_TYPE=Debug -DKVTIER_BUILD_FUZZERS=ON \
  -DKVTIER_BUILD_TESTS=OFF -DKVTIER_BUILD_EXAMPLES=OFF -DKVTIER_BUILD_BENCH=OFF -DKVTIER_WITH_CUDA=OFF >/dev/null
# A target the configuration left out (redis_reply without hiredis) fails the run: a fuzz
# stage that did not fuzz everything asked for did not pass.
available=$(ninja -C "$build" -t targets all 2>/dev/null | sed -n 's/^\(kvtier_fuzz_[a-z_]*\): .*/\1/p')
bins=()
for t in "${targets[@]}"; do
  if ! grep -qx "kvtier_fuzz_$t" <<<"$available"; then
    echo "fuzz.sh: $t is not built in this configuration (redis_reply needs hiredis: Debian's libhiredis-dev;" \
         "the configure output: cmake -S . -B $build)" >&2
    exit 1
  fi
  bins+=("kvtier_fuzz_$t")
done
cmake --build "$build" -j"$(kvtier_jobs)" --target "${bins[@]}"
[ "$build_only" = 1 ] && exit 0

# abort_on_error: a crash ends the run with the input saved; detect_leaks: a leak is a bug.
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# fuzz_one <target>: runs it, output in $build/fuzz-<target>.log; the exit status is libFuzzer's.
fuzz_one() {
  local t=$1
  local work=$build/corpus/$t artifacts=$build/artifacts/$t
  mkdir -p "$work" "$artifacts"
  local dirs=("$work" tests/fuzz/corpus/"$t" tests/fuzz/regressions/"$t")
  # The disk target's files are a 4 KiB header block and a payload; the link target sends
  # objects of up to 20000 bytes. The others stay at libFuzzer's default (4096). A target's
  # dictionary (tests/fuzz/dict/<target>.dict: tokens of its format) when it has one.
  local extra=()
  case "$t" in disk_object|redis_reply) extra=(-max_len=65536) ;; esac
  [ -f tests/fuzz/dict/"$t".dict ] && extra+=(-dict=tests/fuzz/dict/"$t".dict)
  # shellcheck disable=SC2086
  "$build/tests/fuzz/kvtier_fuzz_$t" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 \
    "${extra[@]}" -print_final_stats=1 -artifact_prefix="$artifacts/" ${KVTIER_FUZZ_FLAGS:-} \
    "${dirs[@]}" >"$build/fuzz-$t.log" 2>&1
}

# The targets run side by side, KVTIER_FUZZ_JOBS at a time (default: one per core; each
# libFuzzer process uses one core), each for its full time.
parallel=${KVTIER_FUZZ_JOBS:-$(kvtier_jobs)}
echo "== fuzz ${targets[*]}: ${seconds}s each, $parallel at a time"
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do
    wait -n || true
  done
  rm -f "$build/fuzz-$t.status"
  ( rc=0; fuzz_one "$t" || rc=$?; echo "$rc" > "$build/fuzz-$t.status" ) &
done
wait
status=0
for t in "${targets[@]}"; do
  log=$build/fuzz-$t.log
  artifacts=$build/artifacts/$t
  if [ "$(cat "$build/fuzz-$t.status" 2>/dev/null)" != 0 ]; then
    echo "== fuzz $t: FAILED"
    tail -n 60 "$log"
    echo "fuzz.sh: $t FAILED; the input is in $artifacts/ (full log: $log)." >&2
    echo "  Reproduce: $build/tests/fuzz/kvtier_fuzz_$t $artifacts/<file>; keep it under" >&2
    echo "  tests/fuzz/regressions/$t/ once fixed (docs/fuzzing.md)." >&2
    status=1
    continue
  fi
  # The summary: the last status line and the final stats.
  echo "== fuzz $t"
  grep -E '^#[0-9]+.*(DONE|cov:)' "$log" | tail -n 1
  grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' "$log" | tr '\n' ' '
  echo
done
exit $status

#!/usr/bin/env bash
# Quick start, part 2: installs what is missing, then
#   1. main build (Release) into build/, and the whole ctest suite there;
#   2. the Python suite (tests/python, with /usr/bin/python3) against that build;
#   3. ASan+UBSan (clang, Debug) build of the tests of the code that takes outside bytes or whose
#      bugs are lifetimes, and those tests (all but label long);
#   4. TSan (clang, Debug) build of the [concurrency] tests, and those tests;
#   5. every libFuzzer target for a short fixed time (scripts/fuzz.sh, clang; docs/fuzzing.md).
#   ./scripts/test.sh
#
# What each stage builds and runs (CI runs this on a fresh 2-core machine; the budget is well
# under 30 minutes, docs/architecture.md "Build" has the stage times):
#   main      everything but the benchmarks, which no test runs: `all` only checks that their
#             sources compile (-fsyntax-only, KVTIER_BENCH_IN_ALL=OFF; bench/run_all.sh and
#             the bench scripts build them at -O3 when they run them). Every test runs here.
#   ASan      kvtier_asan_tests (tests/CMakeLists.txt), ctest label asan or fuzz: core,
#             protocol, engine, l2 (the disk backend's trust checks), cache (shutdown with work
#             in flight), server_parts (HTTP and JSON parsers), server (with the kvtier-server
#             and mini engine processes it runs) and the fuzz replays. Not here (they run in
#             the main suite, and their [concurrency] tests under TSan): bus, telemetry, l1,
#             io, pipeline and the examples: no outside bytes, and their memory is reached
#             through the cache, L2 and server tests that do run here.
#   TSan      kvtier_concurrency_tests, ctest label concurrency; each binary is built from the
#             files that have a [concurrency] test only (tests/CMakeLists.txt).
# KVTIER_SKIP_SANITIZERS=1 stops after the main suite (for quick local iterations);
# KVTIER_SKIP_FUZZ=1 skips only the fuzz stage; KVTIER_FUZZ_SECONDS (default 10 here, 20 in
# scripts/fuzz.sh run alone) is its time per target.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

sanitizers=1
[ "${KVTIER_SKIP_SANITIZERS:-0}" = 1 ] && sanitizers=0
fuzz=$sanitizers
[ "${KVTIER_SKIP_FUZZ:-0}" = 1 ] && fuzz=0
packages=("${KVTIER_BUILD_PACKAGES[@]}" "${KVTIER_TEST_PACKAGES[@]}" "${KVTIER_PYTHON_PACKAGES[@]}")
[ "$sanitizers" = 1 ] && packages+=("${KVTIER_CLANG_PACKAGES[@]}")
kvtier_ensure_packages "${packages[@]}"
jobs=$(kvtier_jobs)
start=$(date +%s)
stage() { echo; echo "== [$(( $(date +%s) - start ))s] $*"; }

# clang 14, Debug, -O0 (cmake/kvtier_build.cmake): the sanitizer builds are compile-bound
# (their suites run in about a minute), and clang instruments and emits unoptimised code in a
# third of g++ 12's time (CPU-s, ASan+UBSan: the first server-test unity batch 32 against 116,
# the whole ASan build ~340 against ~900; docs/architecture.md "Build"). The main build stays
# g++, so both compilers build every test.
sanitizer_args=(-DCMAKE_CXX_COMPILER="$(kvtier_clangxx)" -DCMAKE_BUILD_TYPE=Debug -DKVTIER_BUILD_BENCH=OFF -DKVTIER_WITH_CUDA=OFF -DKVTIER_BUILD_PYTHON=OFF
                -DKVTIER_REQUIRE_ALL_TESTS=ON)
asan_env=(ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1)

# Every build directory is configured first, so that a missing package stops the script now.
# Every stage needs its parts: the Python package (KVTIER_BUILD_PYTHON=ON fails the configure
# naming what is missing, where AUTO would leave it out) and every test registered
# (KVTIER_REQUIRE_ALL_TESTS: a missing redis-server or promtool fails here, not as a skip).
stage "configure build/ (Release)$([ "$sanitizers" = 1 ] && echo ", build-asan/ (ASan+UBSan), build-tsan/ (TSan)")"
kvtier_configure build -DCMAKE_BUILD_TYPE=Release -DKVTIER_BENCH_IN_ALL=OFF -DKVTIER_SANITIZE= \
  -DKVTIER_BUILD_PYTHON=ON -DKVTIER_REQUIRE_ALL_TESTS=ON
if [ "$sanitizers" = 1 ]; then
  kvtier_configure build-asan "${sanitizer_args[@]}" -DKVTIER_SANITIZE=address,undefined >/dev/null
  kvtier_configure build-tsan "${sanitizer_args[@]}" -DKVTIER_SANITIZE=thread >/dev/null
fi

# The background builds: the sanitizer builds and the fuzz build, one after another, start now
# and run beside everything else at the lowest CPU priority (nice 19): the foreground (the
# main build, then the suites) keeps all the CPU it asks for, and they take every cycle it
# leaves idle (link steps, a build's last long compile, the suites' waits). The test command is
# compile-bound on 2 cores: this keeps both cores busy from start to end (docs/architecture.md
# "Build"). Each build's output goes to its log; the chain reports "<name> <exit status>" on
# fd 3 as each ends and stops at the first failure; bg_wait <name> waits for that report (a
# blocking read, no polling) and stops the script with the log's tail when it failed. An exit
# kills the chain (its own process group).
bg_names=()
bg_logs=()
if [ "$sanitizers" = 1 ]; then
  bg_names+=(asan tsan)
  bg_logs+=(build-asan/test-build.log build-tsan/test-build.log)
fi
if [ "$fuzz" = 1 ]; then
  mkdir -p build-fuzz
  bg_names+=(fuzz)
  bg_logs+=(build-fuzz/test-build.log)
fi
bg_build() {
  case "$1" in
    asan) cmake --build build-asan -j"$jobs" --target kvtier_asan_tests ;;
    tsan) cmake --build build-tsan -j"$jobs" --target kvtier_concurrency_tests ;;
    fuzz) ./scripts/fuzz.sh --build-only ;;
  esac
}
bg_pid=""
if [ ${#bg_names[@]} -gt 0 ]; then
  fifo=$(mktemp -u "${TMPDIR:-/tmp}/kvtier-test-XXXXXX")
  mkfifo "$fifo"
  exec 3<>"$fifo"  # read-write: opening does not wait for a writer; the fd outlives the name
  rm -f "$fifo"
  echo "   (building in the background at nice 19, one after another: ${bg_names[*]}; logs: ${bg_logs[*]})"
  set -m
  (
    renice -n 19 -p "$BASHPID" >/dev/null
    for i in "${!bg_names[@]}"; do
      rc=0
      { bg_build "${bg_names[$i]}" && echo "== finished at [$(( $(date +%s) - start ))s]"; } >"${bg_logs[$i]}" 2>&1 || rc=$?
      echo "${bg_names[$i]} $rc" >&3
      [ "$rc" = 0 ] || exit "$rc"
    done
  ) &
  bg_pid=$!
  set +m
fi
bg_wait() {  # bg_wait <name>: the builds finish in order, so the next report is <name>'s
  local name rc i log=""
  for i in "${!bg_names[@]}"; do [ "${bg_names[$i]}" = "$1" ] && log=${bg_logs[$i]}; done
  read -r -u 3 name rc
  if [ "$name" != "$1" ] || [ "$rc" != 0 ]; then
    tail -n 80 "$log"
    echo "test.sh: the background build '$name' failed (exit $rc; log: $log)" >&2
    exit 1
  fi
  tail -n 2 "$log"
}
# (An if, not "[ ... ] && kill": under set -e a failed kill, the chain having ended, made
# the script's status 1 after "all passed".)
trap 'if [ -n "$bg_pid" ]; then kill -- "-$bg_pid" 2>/dev/null || true; fi' EXIT

stage "main build (Release): build/"
cmake --build build -j"$jobs"

stage "main suite"
ctest --test-dir build --output-on-failure --timeout 900 -j"$jobs"

# The Python package (built into build/python by the main build) against the build's
# kvtier-server: adapter semantics, the vLLM replay with faults, exact logits. The tests
# marked `long` run with: KVTIER_BUILD_DIR=build /usr/bin/python3 -m pytest tests/python -m long
stage "Python suite: /usr/bin/python3 -m pytest tests/python"
KVTIER_BUILD_DIR="$PWD/build" /usr/bin/python3 -m pytest tests/python -q -m "not long"

if [ "$sanitizers" = 0 ]; then
  stage "sanitizer and fuzz stages skipped (KVTIER_SKIP_SANITIZERS=1)"
  exit 0
fi

stage "ASan+UBSan build (build-asan/, kvtier_asan_tests): waiting for it"
bg_wait asan
stage "ASan+UBSan suite (label asan, without label long)"
env "${asan_env[@]}" ctest --test-dir build-asan --output-on-failure --timeout 900 -j"$jobs" -L asan -LE long

stage "TSan build (build-tsan/, kvtier_concurrency_tests): waiting for it"
bg_wait tsan
stage "TSan suite (label concurrency)"
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  ctest --test-dir build-tsan --output-on-failure --timeout 900 -j"$jobs" -L concurrency

if [ "$fuzz" = 0 ]; then
  stage "fuzz stage skipped (KVTIER_SKIP_FUZZ=1)"
else
  stage "fuzz build (clang, libFuzzer + ASan + UBSan: build-fuzz/): waiting for it"
  bg_wait fuzz
  # Runs each target KVTIER_FUZZ_SECONDS s (one per core at a time), first on every seed and
  # past crash (tests/fuzz/corpus, tests/fuzz/regressions): this is where those run under
  # ASan+UBSan. Fails on a crash, leak or timeout (the input is saved under
  # build-fuzz/artifacts/).
  export KVTIER_FUZZ_SECONDS=${KVTIER_FUZZ_SECONDS:-10}
  stage "fuzz targets: build-fuzz/, ${KVTIER_FUZZ_SECONDS} s each"
  ./scripts/fuzz.sh
fi

stage "all passed"

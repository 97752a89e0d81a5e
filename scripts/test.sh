#!/usr/bin/env bash
# Quick start, part 2: installs what is missing, builds into build/ and runs the whole ctest
# suite and the Python suite (tests/python, with /usr/bin/python3), then an ASan+UBSan build
# of the tests (all but the long-running ones), then a TSan build of the tests labelled
# `concurrency`, then every libFuzzer target for a short fixed time (scripts/fuzz.sh,
# clang; docs/fuzzing.md).
#   ./scripts/test.sh
# KVTIER_SKIP_SANITIZERS=1 stops after the main suite (for quick local iterations);
# KVTIER_SKIP_FUZZ=1 skips only the fuzz stage; KVTIER_FUZZ_SECONDS (default 10 here, 20 in
# scripts/fuzz.sh run alone) is its time per target.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

kvtier_ensure_packages "${KVTIER_BUILD_PACKAGES[@]}" "${KVTIER_TEST_PACKAGES[@]}" "${KVTIER_PYTHON_PACKAGES[@]}"
jobs=$(kvtier_jobs)
start=$(date +%s)
stage() { echo; echo "== [$(( $(date +%s) - start ))s] $*"; }

stage "main build (Release): build/"
kvtier_configure build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$jobs"
stage "main suite"
ctest --test-dir build --output-on-failure --timeout 900 -j"$jobs"

# The Python package (built into build/python by the main build) against the build's
# kvtier-server: adapter semantics, the vLLM replay with faults, exact logits. The tests
# marked `long` run with: KVTIER_BUILD_DIR=build /usr/bin/python3 -m pytest tests/python -m long
stage "Python suite: /usr/bin/python3 -m pytest tests/python"
KVTIER_BUILD_DIR="$PWD/build" /usr/bin/python3 -m pytest tests/python -q -m "not long"

if [ "${KVTIER_SKIP_SANITIZERS:-0}" = 1 ]; then
  stage "sanitizer builds skipped (KVTIER_SKIP_SANITIZERS=1)"
  exit 0
fi

# -O0 (Debug): the sanitizer builds are compile-bound (their suites run in under a minute).
sanitizer_args=(-DCMAKE_BUILD_TYPE=Debug -DKVTIER_BUILD_BENCH=OFF -DKVTIER_WITH_CUDA=OFF)

stage "ASan+UBSan build: build-asan/"
kvtier_configure build-asan "${sanitizer_args[@]}" -DKVTIER_SANITIZE=address,undefined
cmake --build build-asan -j"$jobs" --target kvtier_all_tests
stage "ASan+UBSan suite (without label long)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure --timeout 900 -j"$jobs" -LE 'long|consumer'

stage "TSan build: build-tsan/"
kvtier_configure build-tsan "${sanitizer_args[@]}" -DKVTIER_SANITIZE=thread
cmake --build build-tsan -j"$jobs" --target kvtier_concurrency_tests
stage "TSan suite (label concurrency)"
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  ctest --test-dir build-tsan --output-on-failure --timeout 900 -j"$jobs" -L concurrency

if [ "${KVTIER_SKIP_FUZZ:-0}" = 1 ]; then
  stage "fuzz stage skipped (KVTIER_SKIP_FUZZ=1)"
else
  # Builds build-fuzz/ with clang and runs each target KVTIER_FUZZ_SECONDS s; fails on
  # the first crash, leak or timeout (the input is saved under build-fuzz/artifacts/).
  export KVTIER_FUZZ_SECONDS=${KVTIER_FUZZ_SECONDS:-10}
  stage "fuzz targets (clang, libFuzzer + ASan + UBSan): build-fuzz/, ${KVTIER_FUZZ_SECONDS} s each"
  ./scripts/fuzz.sh
fi

stage "all passed"

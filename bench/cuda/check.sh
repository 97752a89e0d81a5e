#!/usr/bin/env bash
# bench/cuda/check.sh: the GPU check of kvtier's CUDA path, for a machine with one GPU and
# nothing but nvcc, CMake and a C++ compiler (no network). Builds the standalone project in
# bench/cuda (into $KVTIER_CUDA_BUILD_DIR, else a fresh temporary directory), then runs
#   1. kvtier_test_cuda --require-device: kernels, copy engine, pinned registration and CUDA
#      IPC against the CPU implementation, byte for byte (MHA, MLA, skip-first-n, batches);
#   2. kvtier_bench_cuda: gather+D2H and H2D+scatter vs cudaMemcpyAsync of the same bytes
#      (8B and 0.5B shapes), ending with
#        RESULT cuda_gather_d2h_vs_memcpy=<number>
#        RESULT cuda_h2d_scatter_vs_memcpy=<number>      (target: >= 0.9 each)
# Exits non-zero on any build failure, mismatch or missing GPU (never skips silently).
# Under 5 minutes on an H100/H200, build included (~1-2 min of it nvcc).
#
#   KVTIER_CUDA_ARCH=native bench/cuda/check.sh        # another GPU than sm_90
#   bench/cuda/check.sh --quick                        # arguments go to kvtier_bench_cuda
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
arch=${KVTIER_CUDA_ARCH:-90}
if [[ -n "${KVTIER_CUDA_BUILD_DIR:-}" ]]; then
  build=$KVTIER_CUDA_BUILD_DIR
else
  build=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-cuda-XXXXXX")
fi

if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
command -v nvcc >/dev/null 2>&1 || { echo "FAILED: nvcc not found (PATH or /usr/local/cuda/bin)" >&2; exit 1; }
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader || true
fi

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
start=$(date +%s)
echo "== configure and build in $build (CUDA architectures: $arch)"
cmake -S "$here" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" >/dev/null
cmake --build "$build" -j "$(nproc)"
echo "== build took $(( $(date +%s) - start )) s"

echo "== correctness: kvtier_test_cuda --require-device"
if ! "$build/kvtier_test_cuda" --require-device; then
  echo "FAILED: kvtier_test_cuda (see above)" >&2
  exit 1
fi

echo "== bandwidth: kvtier_bench_cuda $*"
"$build/kvtier_bench_cuda" "$@"
echo "== done in $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# The disk L2 backend against fio on one file system: loads (through the prefetch pipeline
# into L1) and stores of 32 MiB and 3 MiB objects, and loads through the pread fallback, in
# interleaved repeats; prints RESULT l2_load_vs_fio, l2_store_vs_fio, l2_load_vs_fio_3m,
# l2_store_vs_fio_3m, l2_load_pread_vs_fio (medians of per-repeat ratios, ours over fio)
# plus the absolute GB/s figures. See docs/performance.md ("L2 disk vs fio").
#
#   bench/l2_vs_fio.sh [--quick] [--gib X] [--repeats N]
#
# Uses the build in $KVTIER_BUILD_DIR when set, else builds build/ (Release). The files go
# to $KVTIER_BENCH_DIR, else <build>/l2-disk-bench (removed at the end); that directory must
# be on the disk to measure (not tmpfs). Needs fio (Debian package fio).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${KVTIER_BUILD_DIR:-}"
if [ -z "$build" ]; then
  build="$root/build"
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
  fi
  cmake --build "$build" -j2 --target kvtier_bench_l2_disk
fi
bin="$build/bench/kvtier_bench_l2_disk"
if [ ! -x "$bin" ]; then
  echo "l2_vs_fio.sh: $bin not found (build the kvtier_bench_l2_disk target)" >&2
  exit 1
fi
if ! command -v fio > /dev/null; then
  echo "l2_vs_fio.sh: fio not found (apt-get install fio)" >&2
  exit 1
fi
dir="${KVTIER_BENCH_DIR:-$build/l2-disk-bench}"
mkdir -p "$dir"
if [ "$(stat -f -c %T "$dir")" = tmpfs ]; then
  echo "l2_vs_fio.sh: warning: $dir is on tmpfs; the figures will not describe a disk" >&2
fi
cleanup() { rm -rf "$dir"; }
[ -z "${KVTIER_BENCH_DIR:-}" ] && trap cleanup EXIT
echo "fio: $(fio --version); kernel $(uname -r); file system: $(df -hT "$dir" | tail -1)"
"$bin" --dir "$dir" "$@"

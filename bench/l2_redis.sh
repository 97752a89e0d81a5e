#!/usr/bin/env bash
# Load throughput from a standalone Redis through kvtier's prefetch pipeline next to
# redis-benchmark GET throughput, values of 3 MiB, same number of connections, interleaved
# (bench/l2_redis_bench.cpp says what is measured). Starts its own redis-server on a free
# loopback port (27100-27199) in a temporary directory and stops it at the end.
#
#   bench/l2_redis.sh [kvtier_bench_l2_redis options: --connections=4 --objects=128 --quick ...]
#
# Uses $KVTIER_BUILD_DIR when set, else build/ (configured as a Release build if absent).
# Ends with RESULT lines, the last being RESULT l2_redis_vs_redis_benchmark=<ratio>.
set -euo pipefail
cd "$(dirname "$0")/.."

build="${KVTIER_BUILD_DIR:-build}"
for tool in redis-server redis-cli redis-benchmark; do
  command -v "$tool" >/dev/null || { echo "l2_redis.sh: $tool not found (Debian: redis-server, redis-tools)" >&2; exit 1; }
done
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build" -j2 --target kvtier_bench_l2_redis

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port=""
for p in $(seq 27100 27199); do
  if ! port_in_use "$p"; then port=$p; break; fi
done
[ -n "$port" ] || { echo "l2_redis.sh: no free port in 27100-27199" >&2; exit 1; }

dir=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-l2-redis-XXXXXX")
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" \
  --logfile "$dir/redis.log" --daemonize no --protected-mode no &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT

for _ in $(seq 1 500); do  # up to ~10 s
  if [ "$(redis-cli -p "$port" ping 2>/dev/null)" = "PONG" ]; then break; fi
  kill -0 "$pid" 2>/dev/null || { echo "l2_redis.sh: redis-server exited: $(cat "$dir/redis.log")" >&2; exit 1; }
  sleep 0.02
done
echo "redis-server $(redis-server --version | sed -n 's/.*v=\([^ ]*\).*/\1/p') on 127.0.0.1:$port"

"$build/bench/kvtier_bench_l2_redis" --port="$port" "$@"

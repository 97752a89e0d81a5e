#!/usr/bin/env bash
# Quick start, part 1: installs what is missing, builds and runs the main job (the demo).
#   ./scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

kvtier_ensure_packages "${KVTIER_BUILD_PACKAGES[@]}"
kvtier_configure build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(kvtier_jobs)" --target kvtier_example_in_process

echo "== kvtier demo: one request's events through L1 and L2, exported as Prometheus metrics =="
./build/examples/kvtier_example_in_process --log-level info

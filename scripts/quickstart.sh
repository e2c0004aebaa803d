#!/usr/bin/env bash
# From a fresh Debian 12 machine to a local Loom cluster answering a prompt:
# install the dependencies, build, start a coordinator with two tensor-
# parallel workers on the tiny stories260K model, stream one completion,
# and stop the cluster.
#   scripts/quickstart.sh [MODEL_DIR]   (default: ../shared/models/stories260K)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
model=${1:-$root/../shared/models/stories260K}
cd "$root"
scripts/setup-debian.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)"
run_dir=$(mktemp -d)
trap 'deploy/local/launch.sh --stop --run-dir "$run_dir"' EXIT
addr=$(deploy/local/launch.sh --model "$model" --tp 2 --pp 1 --run-dir "$run_dir")
prompt="Once upon a time"
echo "prompt: $prompt" >&2
echo "completion (greedy, streamed from the cluster at $addr):" >&2
build/bin/loom generate --addr "$addr" --prompt "$prompt" --temperature 0 --max-tokens 100

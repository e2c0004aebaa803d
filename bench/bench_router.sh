#!/usr/bin/env bash
# The router's own cost, against fake replicas that answer at once
# (tests/fake_replica): `loom bench` straight to one fake replica, then
# through loom-router in front of two, with the router's CPU time from
# /proc. Added latency = the TTFT difference; decisions per core-second =
# requests / router CPU seconds. See docs/benchmarks.md.
#
#   bench/bench_router.sh [BUILD_DIR] [REQUESTS] [CONCURRENCY] [RATE]   (RATE: requests/s, Poisson; default inf)
#
# ROUTER_CPUS=1 OTHER_CPUS=0 pins the router to its own core(s) and the
# client and fake replicas to the others (taskset), as a router would run.
set -euo pipefail
build=${1:-build}
n=${2:-5000}
conc=${3:-8}
rate=${4:-inf}
model=${LOOM_MODELS_DIR:-$(dirname "$0")/../../shared/models}/stories260K
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
pa=$(port) pb=$(port) pr=$(port)
pin_router=() pin_other=()
[ -n "${ROUTER_CPUS:-}" ] && pin_router=(taskset -c "$ROUTER_CPUS")
[ -n "${OTHER_CPUS:-}" ] && pin_other=(taskset -c "$OTHER_CPUS")
fake=(--mode model --model-name stories260K --vocab 512 --context 512)
"${pin_other[@]}" "$build/tests/fake_replica" --listen "tcp://127.0.0.1:$pa" "${fake[@]}" & fa=$!
"${pin_other[@]}" "$build/tests/fake_replica" --listen "tcp://127.0.0.1:$pb" "${fake[@]}" & fb=$!
"${pin_router[@]}" "$build/bin/loom-router" --listen "tcp://127.0.0.1:$pr" --replica "tcp://127.0.0.1:$pa" \
    --replica "tcp://127.0.0.1:$pb" --model "$model" 2>/dev/null & rp=$!
trap 'kill $rp $fa $fb 2>/dev/null' EXIT
sleep 1
bench() {
    "${pin_other[@]}" "$build/bin/loom" bench --addr "$1" --num-requests "$n" --rate "$rate" --max-concurrency "$conc" \
        --prompt-len 128 --output-len 1 --vocab 512 --model stories260K | grep -E "^(TTFT|request throughput)"
}
echo "== direct to one fake replica (TTFT ms: mean median std p90 p99)"
bench "tcp://127.0.0.1:$pa"
c0=$(awk '{print $14 + $15}' /proc/$rp/stat)
echo "== through loom-router, two fake replicas, policy prefix"
bench "tcp://127.0.0.1:$pr"
c1=$(awk '{print $14 + $15}' /proc/$rp/stat)
hz=$(getconf CLK_TCK)
python3 -c "import sys; c=($c1-$c0)/$hz; print('router CPU %.2f s for %d requests: %.0f decisions per core-second' % (c, $n, $n / max(c, 1e-9)))"

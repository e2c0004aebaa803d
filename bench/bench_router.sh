#!/usr/bin/env bash
# The router's own cost, against fake replicas that answer at once
# (tests/fake_replica): `loom bench` straight to one fake replica, then
# through bench/null_proxy (a proxy that only moves frames: the cost of the
# ZeroMQ hop itself), then through loom-router in front of two, with the
# router's CPU time from /proc and its residence time (request in to request
# out, chunk in to chunk out: loom_router_overhead_seconds). Added latency =
# the TTFT difference against the direct run; decisions per core-second =
# requests / router CPU seconds. See docs/benchmarks.md.
#
#   bench/bench_router.sh [BUILD_DIR] [REQUESTS] [CONCURRENCY] [RATE]   (RATE: requests/s, Poisson; default inf)
#
# ROUTER_CPUS=1 OTHER_CPUS=0 pins the router (and the null proxy) to its own
# core(s) and the client and fake replicas to the others (taskset), as a
# router would run. ROUTER_BIN=PATH runs another loom-router build (an A/B
# of two builds on one machine), ROUTER_ARGS adds its options, DUMP_METRICS=FILE
# keeps the router's /metrics page of the run.
set -euo pipefail
build=${1:-build}
n=${2:-5000}
conc=${3:-8}
rate=${4:-inf}
model=${LOOM_MODELS_DIR:-$(dirname "$0")/../../shared/models}/stories260K
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
pa=$(port) pb=$(port) pr=$(port) pn=$(port) ph=$(port)
pin_router=() pin_other=()
[ -n "${ROUTER_CPUS:-}" ] && pin_router=(taskset -c "$ROUTER_CPUS")
[ -n "${OTHER_CPUS:-}" ] && pin_other=(taskset -c "$OTHER_CPUS")
fake=(--mode model --model-name stories260K --vocab 512 --context 512)
"${pin_other[@]}" "$build/tests/fake_replica" --listen "tcp://127.0.0.1:$pa" "${fake[@]}" & fa=$!
"${pin_other[@]}" "$build/tests/fake_replica" --listen "tcp://127.0.0.1:$pb" "${fake[@]}" & fb=$!
"${pin_router[@]}" "$build/bin/null_proxy" --listen "tcp://127.0.0.1:$pn" --replica "tcp://127.0.0.1:$pa" & np=$!
"${pin_router[@]}" "${ROUTER_BIN:-$build/bin/loom-router}" --listen "tcp://127.0.0.1:$pr" --replica "tcp://127.0.0.1:$pa" \
    --replica "tcp://127.0.0.1:$pb" --model "$model" --http "127.0.0.1:$ph" ${ROUTER_ARGS:-} 2>/dev/null & rp=$!
trap 'kill $rp $np $fa $fb 2>/dev/null' EXIT
sleep 1
declare -A p50 p99
bench() { # bench NAME ADDR: TTFT columns are mean median std p90 p99 (ms)
    local out
    out=$("${pin_other[@]}" "$build/bin/loom" bench --addr "$2" --num-requests "$n" --rate "$rate" \
          --max-concurrency "$conc" --prompt-len 128 --output-len 1 --vocab 512 --model stories260K |
          grep -E "^(TTFT|request throughput)")
    echo "$out"
    read -r p50["$1"] p99["$1"] < <(echo "$out" | awk '/^TTFT/ {print $3, $6}')
}
echo "== direct to one fake replica (TTFT ms: mean median std p90 p99)"
bench direct "tcp://127.0.0.1:$pa"
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
echo "== through null_proxy (frames only), one fake replica"
n0=$(cpu $np)
bench proxy "tcp://127.0.0.1:$pn"
n1=$(cpu $np)
c0=$(cpu $rp)
echo "== through loom-router, two fake replicas, policy prefix"
bench router "tcp://127.0.0.1:$pr"
c1=$(cpu $rp)
hz=$(getconf CLK_TCK)
sleep 0.5 # the metrics page is rendered every 250 ms
metrics=$(curl -s "http://127.0.0.1:$ph/metrics")
[ -n "${DUMP_METRICS:-}" ] && echo "$metrics" > "$DUMP_METRICS"
python3 - "$n" "$c0" "$c1" "$hz" "$n0" "$n1" "${p50[direct]}" "${p99[direct]}" "${p50[proxy]}" "${p99[proxy]}" \
    "${p50[router]}" "${p99[router]}" <<PY
import sys
n, c0, c1, hz = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
n0, n1 = float(sys.argv[5]), float(sys.argv[6])
d50, d99, x50, x99, r50, r99 = map(float, sys.argv[7:13])
c, cn = (c1 - c0) / hz, (n1 - n0) / hz
print('added TTFT ms (p50 p99): null_proxy %.3f %.3f, loom-router %.3f %.3f' %
      (x50 - d50, x99 - d99, r50 - d50, r99 - d99))
print('router CPU %.2f s for %d requests: %.0f decisions per core-second (%.0f us a request; null_proxy %.0f us)' %
      (c, n, n / max(c, 1e-9), c / n * 1e6, cn / n * 1e6))
q = {}
for line in """$metrics""".splitlines():
    if line.startswith('loom_router_overhead_seconds{quantile='):
        q[line.split('"')[1]] = float(line.split()[-1]) * 1e6
if q:
    print('router residence us (p50 p99 p999): %.1f %.1f %.1f' % (q['0.5'], q['0.99'], q['0.999']))
PY

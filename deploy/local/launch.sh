#!/usr/bin/env bash
# Starts a Loom cluster on this machine: one coordinator and tp x pp workers,
# waits until the grid is ready, and prints the client address. `--stop`
# ends exactly the processes a previous launch started (from their pid files).
#
#   deploy/local/launch.sh --model DIR [--tp N] [--pp M] [options] [-- coordinator options]
#   deploy/local/launch.sh --stop [--run-dir DIR]
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

model="" tp=1 pp=1 port=5555 host=127.0.0.1 threads="" device=cpu timeout=120 stop=0 pin=1 etcd="" cluster=""
cpu_offset=0
insecure=0 client_keys=""
bin="${LOOM_BIN:-$root/build/bin}"
run_dir="${LOOM_RUN_DIR:-${XDG_RUNTIME_DIR:-/tmp}/loom-$(id -un)-local}"
worker_args=()
coord_args=()

usage() {
    cat <<EOF
usage: $0 --model DIR [--tp N] [--pp M] [options] [-- coordinator options]
       $0 --stop [--run-dir DIR]

Starts loom-coordinator and N x M loom-worker processes on this machine, waits
until the grid is ready and prints the client API address on stdout.

options:
  --model DIR        Hugging Face model directory (config.json, *.safetensors, tokenizer.json)
  --tp N             tensor-parallel ranks per stage (default 1)
  --pp M             pipeline stages (default 1)
  --port P           client API port; workers register on P+1 (default 5555)
  --host ADDR        address to bind (default 127.0.0.1)
  --threads N        compute threads per worker (default: cores / workers, at least 1)
  --device DEV       worker device: cpu or cuda (workers get cuda:0, cuda:1, ...) (default cpu)
  --no-pin           do not pin workers to cores
  --cpu-offset K     pin this cluster's workers from core K on (default 0), so clusters on one
                     machine get cores of their own
  --worker-arg ARG   extra argument for every worker (repeatable)
  --etcd URL         membership in etcd: workers find the coordinator there (e.g. http://127.0.0.1:2379)
  --cluster NAME     cluster name in etcd (default: loom-<port>)
  --client-keys M    key the client API too: M client key pairs (client-0.key ...) in RUN_DIR/keys;
                     clients then need --curve-server-key RUN_DIR/keys/coordinator.pub --curve-secret
                     RUN_DIR/keys/client-0.key (default: 0 on a loopback --host, 1 on any other)
  --insecure         do not key the control plane (CURVE is on by default: a fresh key set per
                     launch in RUN_DIR/keys; workers get theirs, no other process can join)
  --bin DIR          where the binaries are (default build/bin)
  --run-dir DIR      pid files and logs (default $run_dir)
  --timeout S        give up when the grid is not ready after S seconds (default 120);
                     a process that exits or a worker that cannot load its shard ends it at once
  --stop             stop the cluster started from --run-dir
Everything after -- goes to loom-coordinator (e.g. -- --max-num-seqs 32).
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        --model) model=$2; shift 2 ;;
        --tp) tp=$2; shift 2 ;;
        --pp) pp=$2; shift 2 ;;
        --port) port=$2; shift 2 ;;
        --host) host=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --device) device=$2; shift 2 ;;
        --no-pin) pin=0; shift ;;
        --cpu-offset) cpu_offset=$2; shift 2 ;;
        --worker-arg) worker_args+=("$2"); shift 2 ;;
        --etcd) etcd=$2; shift 2 ;;
        --cluster) cluster=$2; shift 2 ;;
        --client-keys) client_keys=$2; shift 2 ;;
        --insecure) insecure=1; shift ;;
        --bin) bin=$2; shift 2 ;;
        --run-dir) run_dir=$2; shift 2 ;;
        --timeout) timeout=$2; shift 2 ;;
        --stop) stop=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; coord_args=("$@"); break ;;
        *) echo "launch.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
done

# Whether pid is a live process. One that has exited is gone even before its
# parent reaps it: after launch.sh exits that parent is init, which may
# collect zombies late (or, as PID 1 of some containers, never).
running() {
    local key value
    [ -r "/proc/$1/status" ] || return 1
    while read -r key value _; do
        [ "$key" = State: ] && { [ "$value" != Z ]; return; }
    done <"/proc/$1/status" 2>/dev/null
    return 1
}

stop_cluster() {
    local found=0
    for f in "$run_dir"/worker-*.pid "$run_dir"/coordinator.pid; do
        [ -f "$f" ] || continue
        found=1
        local pid name
        pid=$(cat "$f")
        name=$(basename "$f" .pid)
        # only signal the process we started: same pid and still a loom binary
        if running "$pid" && grep -q "loom-" "/proc/$pid/cmdline" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 250); do running "$pid" || break; sleep 0.02; done
            if running "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
            echo "stopped $name (pid $pid)" >&2
        fi
        rm -f "$f"
    done
    rm -f "$run_dir/ready"
    [ $found = 1 ] || echo "launch.sh: no cluster recorded in $run_dir" >&2
}

if [ $stop = 1 ]; then
    stop_cluster
    exit 0
fi

[ -n "$model" ] || { echo "launch.sh: --model is required (see --help)" >&2; exit 2; }
[ -f "$model/config.json" ] || { echo "launch.sh: $model/config.json not found: is --model a Hugging Face model directory?" >&2; exit 2; }
for b in loom-coordinator loom-worker loom; do
    [ -x "$bin/$b" ] || { echo "launch.sh: $bin/$b not found: build first (cmake --build build)" >&2; exit 2; }
done
mkdir -p "$run_dir"
if ls "$run_dir"/*.pid >/dev/null 2>&1; then
    echo "launch.sh: $run_dir already holds a cluster's pid files; run '$0 --stop --run-dir $run_dir' first" >&2
    exit 1
fi

n=$((tp * pp))
cores=$(nproc)
if [ -z "$threads" ]; then
    threads=$((cores / n))
    [ "$threads" -ge 1 ] || threads=1
fi
# Pin only when every worker can have cores of its own.
case $cpu_offset in '' | *[!0-9]*) echo "launch.sh: --cpu-offset takes a core number, not '$cpu_offset'" >&2; exit 2 ;; esac
[ $((cpu_offset + threads * n)) -le "$cores" ] || pin=0
command -v taskset >/dev/null || pin=0

api="tcp://$host:$port"
ctl="tcp://$host:$((port + 1))"
membership=()
if [ -n "$etcd" ]; then
    membership=(--etcd "$etcd" --cluster "${cluster:-loom-$port}")
fi
rm -f "$run_dir/ready"
cleanup_on_error() {
    echo "launch.sh: the cluster did not come up; logs are in $run_dir" >&2
    for log in "$run_dir"/coordinator.log "$run_dir"/worker-*.log; do
        [ -f "$log" ] && { echo "--- $log" >&2; tail -n 5 "$log" >&2; }
    done
    stop_cluster
}

# CURVE: a fresh key set for this cluster (coordinator, worker-I, client-J),
# readable by this user only; the workers' ids are their key names.
keys="$run_dir/keys"
security=()
case "$host" in 127.*|localhost|::1) local_host=1 ;; *) local_host=0 ;; esac
[ -n "$client_keys" ] || { [ $local_host = 1 ] && client_keys=0 || client_keys=1; }
rm -rf "$keys"
if [ $insecure = 0 ] || [ "$client_keys" -gt 0 ]; then
    "$bin/loom" keygen --cluster --dir "$keys" --workers "$n" --clients "$client_keys" >/dev/null
    security=(--curve-secret "$keys/coordinator.key")
    [ $insecure = 1 ] || security+=(--worker-keys "$keys/workers.allow")
    [ "$client_keys" -eq 0 ] || security+=(--client-keys "$keys/clients.allow")
fi
[ $local_host = 1 ] || [ "$client_keys" -gt 0 ] || security+=(--insecure-api)
[ $insecure = 0 ] || security+=(--insecure) # the coordinator refuses an unkeyed control plane off loopback without it

"$bin/loom-coordinator" --model "$model" --tp "$tp" --pp "$pp" --listen "$api" --control "$ctl" \
    --ready-file "$run_dir/ready" ${membership[@]+"${membership[@]}"} ${security[@]+"${security[@]}"} \
    ${coord_args[@]+"${coord_args[@]}"} \
    >"$run_dir/coordinator.log" 2>&1 &
echo $! >"$run_dir/coordinator.pid"

for ((i = 0; i < n; i++)); do
    dev=$device
    [ "$device" = cuda ] && dev="cuda:$i"
    # with etcd the workers find the coordinator there instead of being told
    if [ -n "$etcd" ]; then where=("${membership[@]}"); else where=(--coordinator "$ctl"); fi
    wkeys=()
    [ $insecure = 1 ] || wkeys=(--curve-server-key "$keys/coordinator.pub" --curve-secret "$keys/worker-$i.key")
    cmd=("$bin/loom-worker" "${where[@]}" --device "$dev" --threads "$threads" --id "worker-$i"
         ${wkeys[@]+"${wkeys[@]}"} ${worker_args[@]+"${worker_args[@]}"})
    if [ $pin = 1 ]; then
        first=$((cpu_offset + i * threads))
        cmd=(taskset -c "$first-$((first + threads - 1))" "${cmd[@]}")
    fi
    "${cmd[@]}" >"$run_dir/worker-$i.log" 2>&1 &
    echo $! >"$run_dir/worker-$i.pid"
done

deadline=$((SECONDS + timeout))
while [ ! -f "$run_dir/ready" ]; do
    for f in "$run_dir"/*.pid; do
        if ! running "$(cat "$f")"; then
            echo "launch.sh: $(basename "$f" .pid) exited during start-up" >&2
            cleanup_on_error
            exit 1
        fi
    done
    # a worker that failed to load keeps its slot: this grid will not come up
    if grep -q "failed to load its shard" "$run_dir/coordinator.log" 2>/dev/null; then
        echo "launch.sh: a worker could not load its shard" >&2
        cleanup_on_error
        exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
        echo "launch.sh: the grid was not ready after ${timeout}s" >&2
        cleanup_on_error
        exit 1
    fi
    sleep 0.05
done
echo "launch.sh: $n worker(s) ($tp x $pp, $threads thread(s) each) ready; logs in $run_dir; stop with: $0 --stop --run-dir $run_dir" >&2
if [ $insecure = 0 ]; then
    echo "launch.sh: control plane keyed (CURVE; keys in $keys)" >&2
else
    echo "launch.sh: --insecure: the control plane is NOT keyed" >&2
fi
if [ "$client_keys" -gt 0 ]; then
    echo "launch.sh: client API keyed: clients need --curve-server-key $keys/coordinator.pub --curve-secret $keys/client-0.key" >&2
fi
echo "$api"

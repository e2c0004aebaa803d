#!/usr/bin/env bash
# A private etcd for Loom's tests: loopback only, on free ports, with its data
# in a temp dir, so several can run at once. Its state lives in one directory:
# url (the client URL), pid, ports ("client peer"), datadir, log.
#
#   etcd_fixture.sh start DIR    start a fresh etcd; prints its client URL
#   etcd_fixture.sh restart DIR  start it again on the same ports and data
#   etcd_fixture.sh stop DIR     stop it (SIGTERM, SIGKILL after 5 s); keeps the data
#   etcd_fixture.sh clean DIR    stop it and remove its data and DIR
#   etcd_fixture.sh url DIR      print the client URL
# DIR defaults to $LOOM_ETCD_DIR. $ETCD names the etcd binary (default: etcd on PATH).
set -euo pipefail

die() { echo "etcd_fixture: $*" >&2; exit 1; }

cmd=${1:-}
dir=${2:-${LOOM_ETCD_DIR:-}}
[ -n "$cmd" ] && [ -n "$dir" ] || die "usage: $0 start|restart|stop|clean|url DIR"

find_etcd() {
    etcd_bin=${ETCD:-$(command -v etcd || true)}
    [ -z "$etcd_bin" ] && [ -x /usr/bin/etcd ] && etcd_bin=/usr/bin/etcd
    if [ -z "$etcd_bin" ] || [ ! -x "$etcd_bin" ]; then
        die "etcd not found. Install it: 'sudo apt-get install etcd-server' (Debian/Ubuntu), or take
etcd 3.4+ from https://github.com/etcd-io/etcd/releases and put it on PATH (or set ETCD=/path/to/etcd)"
    fi
}

# True when something accepts connections on 127.0.0.1:$1.
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

healthy() {
    timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1 &&
        printf 'GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3 &&
        grep -q '\"health\":\"true\"' <&3" 2>/dev/null
}

# Whether pid is a live process: one that has exited is gone (its ports are
# free) even before init, its parent once this script exits, reaps it.
running() {
    local key value
    [ -r "/proc/$1/status" ] || return 1
    while read -r key value _; do
        [ "$key" = State: ] && { [ "$value" != Z ]; return; }
    done <"/proc/$1/status" 2>/dev/null
    return 1
}

alive() {
    [ -f "$dir/pid" ] || return 1
    local pid
    pid=$(cat "$dir/pid")
    [ -n "$pid" ] && running "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = etcd ]
}

# Launches etcd on $cport/$pport over $datadir and waits until it is healthy.
# Returns 2 when a port was taken (the caller may retry), 1 on other failures.
launch() {
    local url=http://127.0.0.1:$cport peer=http://127.0.0.1:$pport
    : >"$dir/log"
    "$etcd_bin" --name loom-test --data-dir "$datadir" --logger=zap --log-level=error \
        --listen-client-urls "$url" --advertise-client-urls "$url" \
        --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
        --initial-cluster "loom-test=$peer" --heartbeat-interval=10 --election-timeout=50 \
        </dev/null >>"$dir/log" 2>&1 &
    local pid=$!
    echo "$pid" >"$dir/pid"
    local deadline=$((SECONDS + 15))
    while [ $SECONDS -lt $deadline ]; do
        if ! running "$pid"; then
            rm -f "$dir/pid"
            grep -qi "address already in use" "$dir/log" && return 2
            echo "etcd_fixture: etcd exited at start-up; its log:" >&2
            tail -n 20 "$dir/log" >&2
            return 1
        fi
        healthy "$cport" && { echo "$url" >"$dir/url"; return 0; }
        sleep 0.02
    done
    echo "etcd_fixture: etcd on $url not healthy after 15 s; its log:" >&2
    tail -n 20 "$dir/log" >&2
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$dir/pid"
    return 1
}

stop() {
    alive || { rm -f "$dir/pid"; return 0; }
    local pid i
    pid=$(cat "$dir/pid")
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 250; i++)); do
        running "$pid" || break
        sleep 0.02
    done
    kill -KILL "$pid" 2>/dev/null || true
    while running "$pid"; do sleep 0.02; done
    rm -f "$dir/pid"
}

case "$cmd" in
start)
    find_etcd
    mkdir -p "$dir"
    stop
    [ -f "$dir/datadir" ] && rm -rf "$(cat "$dir/datadir")"
    datadir=$(mktemp -d "${TMPDIR:-/tmp}/loom-etcd.XXXXXX")
    echo "$datadir" >"$dir/datadir"
    rm -f "$dir/url" "$dir/ports"
    for ((try = 0; try < 20; try++)); do
        # Below Linux's ephemeral range (32768+), so outgoing connections don't take them.
        cport=$((20000 + (RANDOM * 32768 + RANDOM) % 12000))
        pport=$((cport + 1))
        port_busy "$cport" || port_busy "$pport" && continue
        echo "$cport $pport" >"$dir/ports"
        rc=0
        launch || rc=$?
        [ $rc = 0 ] && { cat "$dir/url"; exit 0; }
        [ $rc = 2 ] || exit 1
        rm -rf "$datadir" && mkdir -p "$datadir"
    done
    die "no free port pair found for etcd after 20 tries"
    ;;
restart)
    find_etcd
    [ -f "$dir/ports" ] && [ -f "$dir/datadir" ] || die "$dir holds no etcd to restart (run start first)"
    stop
    read -r cport pport <"$dir/ports"
    datadir=$(cat "$dir/datadir")
    launch || die "restart on ports $cport/$pport failed"
    cat "$dir/url"
    ;;
stop)
    [ -d "$dir" ] || exit 0
    stop
    ;;
clean)
    [ -d "$dir" ] || exit 0
    stop
    [ -f "$dir/datadir" ] && rm -rf "$(cat "$dir/datadir")"
    rm -rf "$dir"
    ;;
url)
    [ -f "$dir/url" ] || die "no etcd started in $dir"
    cat "$dir/url"
    ;;
*)
    die "unknown command '$cmd' (start|restart|stop|clean|url)"
    ;;
esac

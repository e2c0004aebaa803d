#!/usr/bin/env python3
"""A soak of a local Loom cluster under mixed hostile and normal load.

Starts a cluster with deploy/local/launch.sh (stories260K, 1 x 2 workers,
the HTTP gateway on loopback), then for --minutes keeps a bounded mix of
clients on it: normal streams, streams cancelled mid-way, huge and deep
JSON schemas, malformed JSON, oversize bodies, slow-loris connections that
never finish their headers, and idle strangers on the workers' listening
ports. Every --interval seconds it samples the coordinator's and workers'
RSS, open fds and threads into a CSV, and times a health probe and a small
completion. It fails (exit 1) when the cluster stops answering, a process
exits, or a resource grows without bound: a least-squares slope over the
second half of the run whose growth across that half exceeds a floor
(RSS: 16 MiB and 10 %; fds: 16; threads: 4). Each huge schema is new, so
the grammar cache fills: the soak gives it 64 MiB (--grammar-cache-mb), a
bound reached in the first minutes, where the default 1 GiB would still
be filling after 30.

    bench/soak.py [--minutes 30] [--model DIR] [--csv soak.csv] [--bin build/bin]

Loopback only; every client is bounded in count and time; the cluster is
stopped (launch.sh --stop) on every exit.
"""
import argparse
import csv
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HOST = "127.0.0.1"

# How many clients of each kind run at once, and the pause between two of them.
MIX = {
    "stream": (4, 0.0),
    "cancel": (2, 0.2),
    "schema_huge": (1, 0.5),
    "schema_deep": (1, 0.5),
    "malformed": (1, 0.1),
    "oversize": (1, 0.5),
    "slowloris": (8, 0.5),
    "stranger": (4, 0.5),
}
# Growth across the second half that fails the run (absolute and relative to its mean).
LIMITS = {"rss_kb": (16 * 1024, 0.10), "fds": (16, 0.0), "threads": (4, 0.0)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default 30)")
    p.add_argument("--interval", type=float, default=3.0, help="seconds between samples (default 3)")
    p.add_argument("--model", default=os.environ.get("LOOM_MODELS_DIR", os.path.join(ROOT, "..", "shared", "models"))
                   + "/stories260K", help="model directory (default: the shared stories260K)")
    p.add_argument("--bin", default=os.environ.get("LOOM_BIN", os.path.join(ROOT, "build", "bin")))
    p.add_argument("--port", type=int, default=0, help="client API port (default: a free one)")
    p.add_argument("--csv", default="soak.csv", help="samples, one row per process per interval")
    p.add_argument("--grammar-cache-mb", type=int, default=64,
                   help="the coordinator's --grammar-cache-bytes in MiB (default 64: every huge schema is new, so "
                        "the cache fills; a bound reached in the first half leaves the second half flat)")
    p.add_argument("--run-dir", default=None, help="the cluster's pid files and logs (default: a fresh temp dir)")
    return p.parse_args(argv)


def free_port(n=1):
    """A port p with p .. p+n-1 free (checked, not reserved)."""
    for _ in range(100):
        s = socket.socket()
        s.bind((HOST, 0))
        p = s.getsockname()[1]
        s.close()
        ok = True
        for k in range(1, n):
            t = socket.socket()
            try:
                t.bind((HOST, p + k))
            except OSError:
                ok = False
            t.close()
        if ok and p + n < 65536:
            return p
    raise RuntimeError("no free ports")


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}

    def add(self, kind, outcome):
        with self.lock:
            k = (kind, outcome)
            self.counts[k] = self.counts.get(k, 0) + 1


def post(port, path, body, timeout=30.0, headers=None):
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request("POST", path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def completion(prompt, **kw):
    d = {"prompt": prompt, "max_tokens": kw.pop("max_tokens", 16), "temperature": 0.8}
    d.update(kw)
    return json.dumps(d).encode()


def c_stream(port, rnd):
    c = http.client.HTTPConnection(HOST, port, timeout=60)
    c.request("POST", "/v1/completions", body=completion("Once upon a time", max_tokens=rnd.randint(8, 64),
                                                         stream=True), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        r.read()
        c.close()
        return "http%d" % r.status
    done = False
    while True:
        line = r.readline()
        if not line:
            break
        if line.strip() == b"data: [DONE]":
            done = True
            break
    c.close()
    return "ok" if done else "no-done"


def c_cancel(port, rnd):
    s = socket.create_connection((HOST, port), timeout=30)
    body = completion("Once upon a time there was", max_tokens=200, stream=True)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % len(body) + body)
    got = b""
    want = rnd.randint(1, 2000)
    while len(got) < want:
        b = s.recv(512)
        if not b:
            break
        got += b
    s.close()  # the client leaves mid-stream: the coordinator cancels the request
    return "ok" if got.startswith(b"HTTP/1.1 200") else "other"


def c_schema_huge(port, rnd):
    props = {"p%05d" % i: {"type": ["string", "integer", "boolean"][i % 3]} for i in range(rnd.randint(2000, 12000))}
    schema = {"type": "object", "properties": props, "required": list(props)[:50]}
    st, _ = post(port, "/v1/completions", completion("{", max_tokens=4, guided_json=schema), timeout=60)
    return "http%d" % st


def c_schema_deep(port, rnd):
    k = rnd.choice([100, 500, 990, 5000])
    s = '{"type":"array","items":' * k + '{"type":"integer"}' + "}" * k
    body = b'{"prompt":"[","max_tokens":4,"guided_json":' + s.encode() + b"}"
    st, _ = post(port, "/v1/completions", body, timeout=60)
    return "http%d" % st


def c_malformed(port, rnd):
    bad = rnd.choice([b"{", b'{"prompt": "x", "max_tokens": }', b"\xff\xfe\x00garbage", b'{"prompt":"a","prompt":"b"}',
                      b"[" * 5000, b'{"prompt": "x", "max_tokens": 1e400}'])
    st, _ = post(port, "/v1/completions", bad, timeout=30)
    return "http%d" % st


def c_oversize(port, rnd):
    s = socket.create_connection((HOST, port), timeout=30)
    n = 64 << 20
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % n)
    try:
        chunk = b"x" * 65536
        for _ in range(64):  # 4 MiB at most, then read the verdict
            s.sendall(chunk)
    except OSError:
        pass
    try:
        got = s.recv(256)
    except OSError:
        got = b""
    s.close()
    return "http" + got[9:12].decode("ascii", "replace") if got.startswith(b"HTTP/1.1 ") else "closed"


def c_slowloris(port, rnd):
    s = socket.create_connection((HOST, port), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.time()
    try:
        while time.time() - t0 < 40:  # one header byte a second, until the server hangs up
            s.sendall(b"X")
            time.sleep(1.0)
            s.settimeout(0.01)
            try:
                if s.recv(256) == b"":
                    break
            except socket.timeout:
                pass
            except OSError:
                break
            s.settimeout(5)
    except OSError:
        pass
    s.close()
    return "hung-up" if time.time() - t0 < 40 else "held"


def listening_ports(pids):
    """TCP ports the given processes listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir("/proc/%d/fd" % pid):
                try:
                    l = os.readlink("/proc/%d/fd/%s" % (pid, fd))
                except OSError:
                    continue
                if l.startswith("socket:["):
                    inodes.add(l[8:-1])
        except OSError:
            pass
    ports = []
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(f) as fh:
                next(fh)
                for line in fh:
                    x = line.split()
                    if x[3] == "0A" and x[9] in inodes:
                        ports.append(int(x[1].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return sorted(set(ports))


def c_stranger(ports, rnd):
    if not ports:
        return "no-ports"
    s = socket.create_connection((HOST, rnd.choice(ports)), timeout=5)
    if rnd.random() < 0.5:
        s.sendall(os.urandom(rnd.randint(1, 64)))  # a few bytes of nothing, then idle
    time.sleep(rnd.uniform(5, 20))
    s.close()
    return "ok"


def proc_sample(pid):
    with open("/proc/%d/status" % pid) as f:
        st = dict(l.split(":", 1) for l in f if ":" in l)
    return {"rss_kb": int(st["VmRSS"].split()[0]), "threads": int(st["Threads"]), "fds": len(os.listdir(
        "/proc/%d/fd" % pid))}


def probe(port):
    t0 = time.time()
    try:
        c = http.client.HTTPConnection(HOST, port, timeout=10)
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        c.close()
        if r.status != 200:
            return None
        st, _ = post(port, "/v1/completions", completion("Once", max_tokens=4, temperature=0), timeout=10)
        return (time.time() - t0) * 1e3 if st == 200 else None
    except OSError:
        return None


def slope(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def main(argv=None):
    a = parse_args(argv)
    model = os.path.abspath(a.model)
    if not os.path.isfile(os.path.join(model, "config.json")):
        print("soak: no model at %s (--model)" % model, file=sys.stderr)
        return 2
    import tempfile
    run_dir = a.run_dir or tempfile.mkdtemp(prefix="loom-soak-")
    api = a.port or free_port(2)
    http_port = free_port()
    launch = os.path.join(ROOT, "deploy", "local", "launch.sh")
    env = dict(os.environ, LOOM_BIN=a.bin)
    p = subprocess.run([launch, "--model", model, "--pp", "2", "--threads", "1", "--no-pin", "--port", str(api),
                        "--run-dir", run_dir, "--timeout", "120", "--", "--http", "%s:%d" % (HOST, http_port),
                        "--http-header-timeout-s", "5", "--http-max-connections-per-ip", "48",
                        "--grammar-cache-bytes", str(a.grammar_cache_mb << 20)],
                       env=env, capture_output=True, text=True, timeout=180)
    if p.returncode != 0:
        print("soak: launch failed: %s" % p.stderr[-2000:], file=sys.stderr)
        return 1
    stop = threading.Event()
    failed = []

    def stop_cluster():
        subprocess.run([launch, "--stop", "--run-dir", run_dir], capture_output=True, timeout=60)

    try:
        procs = {}
        for f in sorted(os.listdir(run_dir)):
            if f.endswith(".pid"):
                with open(os.path.join(run_dir, f)) as fh:
                    procs[f[:-4]] = int(fh.read().strip())
        worker_ports = listening_ports([v for k, v in procs.items() if k.startswith("worker")])
        print("soak: %s; http %d; worker ports %s; %.1f min; samples every %g s -> %s" %
              (", ".join("%s %d" % kv for kv in procs.items()), http_port, worker_ports, a.minutes, a.interval,
               a.csv), flush=True)
        stats = Stats()
        kinds = {"stream": c_stream, "cancel": c_cancel, "schema_huge": c_schema_huge, "schema_deep": c_schema_deep,
                 "malformed": c_malformed, "oversize": c_oversize, "slowloris": c_slowloris}

        def loop(kind, seed):
            rnd = random.Random(seed)
            pause = MIX[kind][1]
            while not stop.is_set():
                try:
                    out = c_stranger(worker_ports, rnd) if kind == "stranger" else kinds[kind](http_port, rnd)
                except (OSError, http.client.HTTPException) as e:
                    out = type(e).__name__
                stats.add(kind, out)
                stop.wait(pause)

        threads = []
        for kind, (n, _) in MIX.items():
            for i in range(n):
                t = threading.Thread(target=loop, args=(kind, sum(map(ord, kind)) * 100 + i), daemon=True)
                t.start()
                threads.append(t)

        rows, t0, misses = [], time.time(), 0
        end = t0 + a.minutes * 60
        with open(a.csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["t_s", "process", "pid", "rss_kb", "fds", "threads", "probe_ms"])
            while time.time() < end and not failed:
                ms = probe(http_port)
                misses = misses + 1 if ms is None else 0
                if misses >= 3:
                    failed.append("the cluster stopped answering (3 probes in a row)")
                t = time.time() - t0
                for name, pid in procs.items():
                    try:
                        s = proc_sample(pid)
                    except (OSError, KeyError):
                        failed.append("%s (pid %d) exited" % (name, pid))
                        continue
                    row = [round(t, 1), name, pid, s["rss_kb"], s["fds"], s["threads"],
                           "" if ms is None else round(ms, 1)]
                    rows.append(row)
                    w.writerow(row)
                fh.flush()
                time.sleep(max(0.0, a.interval - (time.time() - t0 - t)))
        stop.set()
        for t in threads:
            t.join(timeout=45)

        # the slope test over the second half
        half = a.minutes * 60 / 2
        print("soak: %d samples; per process over the second half (first -> last, fitted growth):" % len(rows))
        for name in procs:
            pts = [r for r in rows if r[1] == name and r[0] >= half]
            if len(pts) < 4:
                continue
            xs = [r[0] for r in pts]
            line = []
            for i, key in ((3, "rss_kb"), (4, "fds"), (5, "threads")):
                ys = [r[i] for r in pts]
                grow = slope(xs, ys) * (xs[-1] - xs[0])
                floor, rel = LIMITS[key]
                lim = max(floor, rel * sum(ys) / len(ys))
                line.append("%s %d -> %d (%+.1f)" % (key, ys[0], ys[-1], grow))
                if grow > lim:
                    failed.append("%s: %s grows %.1f over the second half (limit %.1f)" % (name, key, grow, lim))
            print("  %-12s %s" % (name, ", ".join(line)))
        probes = [r[6] for r in rows if r[6] != ""]
        if probes:
            probes.sort()
            print("soak: probe (health + 4-token completion) median %.1f ms, max %.1f ms" %
                  (probes[len(probes) // 2], probes[-1]))
        print("soak: clients: " + ", ".join("%s/%s %d" % (k[0], k[1], v) for k, v in sorted(stats.counts.items())))
    finally:
        stop.set()
        stop_cluster()
    if failed:
        for f in failed:
            print("soak FAIL: " + f, file=sys.stderr)
        return 1
    print("soak ok")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())

#!/usr/bin/env python3
"""Multi-turn chats through loom-router: four stories260K replicas, `loom
bench --dataset-name multiturn` (sessions over a few shared system prompts,
Poisson session arrivals, every turn resending the conversation and its
answers) once per routing policy on fresh replicas, then once more under
the prefix policy with kill -9 of one replica (coordinator and worker)
midway: every request must still succeed. Prints a table for
docs/benchmarks.md and exits 1 when a request failed.

    bench/bench_multiturn.py [--build DIR] [--sessions N] [--turns T] [--rate R] [--out DIR]

Everything binds 127.0.0.1; every process started here is stopped at the
end, also on failure."""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(os.environ.get("LOOM_MODELS_DIR", os.path.join(ROOT, "..", "shared", "models")), "stories260K")
POLICIES = ["prefix", "round-robin", "least-loaded"]  # --policies adds e.g. session


def free_port(pair=False):
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if not pair:
            return p
        with socket.socket() as s2:  # launch.sh takes P and P+1
            try:
                s2.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue


class Replica:
    """One coordinator + one worker from deploy/local/launch.sh."""

    def __init__(self, args, work, i):
        self.args, self.i = args, i
        self.run_dir = os.path.join(work, "replica-%d" % i)
        self.addr = None

    def start(self):
        self.port = free_port(pair=True)
        cmd = [os.path.join(ROOT, "deploy", "local", "launch.sh"), "--model", MODEL, "--port", str(self.port),
               "--run-dir", self.run_dir, "--bin", os.path.join(self.args.build, "bin"), "--threads", "1",
               "--no-pin", "--timeout", "60"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        if p.returncode != 0:
            raise RuntimeError("replica %d did not start: %s" % (self.i, p.stderr[-1000:]))
        self.addr = p.stdout.strip()

    def pid(self, name):
        with open(os.path.join(self.run_dir, name + ".pid")) as f:
            return int(f.read())

    def kill9(self):
        for name in ("coordinator", "worker-0"):
            try:
                os.kill(self.pid(name), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    def stop(self):
        subprocess.run([os.path.join(ROOT, "deploy", "local", "launch.sh"), "--stop", "--run-dir", self.run_dir],
                       capture_output=True, timeout=60)


class Router:
    def __init__(self, args, work, replicas, policy):
        self.port, self.http = free_port(), free_port()
        self.addr = "tcp://127.0.0.1:%d" % self.port
        self.log = open(os.path.join(work, "router-%s.log" % policy), "w")
        cmd = [os.path.join(args.build, "bin", "loom-router"), "--listen", self.addr, "--model", MODEL,
               "--policy", policy, "--http", "127.0.0.1:%d" % self.http]
        for r in replicas:
            cmd += ["--replica", r.addr]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)

    def metrics(self):
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.http, timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                out[name_labels] = float(value)
        return out

    def metric(self, name, label_part=""):
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name and label_part in k)

    def wait_up(self, n, timeout=20):
        t_end = time.time() + timeout
        while time.time() < t_end:
            try:
                if self.metric("loom_router_replica_up") == n:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the router does not see %d replicas up" % n)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def bench_cmd(args, addr, json_path):
    return [os.path.join(args.build, "bin", "loom"), "bench", "--addr", addr, "--dataset-name", "multiturn",
            "--multiturn-sessions", str(args.sessions), "--multiturn-turns", str(args.turns),
            "--multiturn-system-len", "256", "--multiturn-num-system", "4", "--multiturn-user-len", "32",
            "--multiturn-output-len", "16", "--multiturn-think-s", str(args.think), "--request-rate",
            str(args.rate), "--seed", "7", "--timeout-s", "120", "--metric-percentiles", "50,99", "--json",
            json_path]


def start_replicas(args, work, tag):
    reps = [Replica(args, os.path.join(work, tag), i) for i in range(4)]
    errs = []

    def start(r):
        try:
            r.start()
        except Exception as e:  # noqa: BLE001 -- reported below
            errs.append(str(e))
    threads = [threading.Thread(target=start, args=(r,)) for r in reps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return reps, errs


def one_run(args, work, policy, kill_at=None):
    tag = policy + ("-kill" if kill_at is not None else "")
    reps, errs = start_replicas(args, work, tag)
    router = None
    try:
        if errs:
            raise RuntimeError("; ".join(errs))
        router = Router(args, work, reps, policy)
        router.wait_up(4)
        path = os.path.join(work, tag + ".json")
        with open(os.path.join(work, tag + ".txt"), "w") as out:
            p = subprocess.Popen(bench_cmd(args, router.addr, path), stdout=out, stderr=subprocess.STDOUT)
            try:
                victim, inflight_at_kill = None, 0
                if kill_at is not None:  # the replica with the most requests in flight, once one has some
                    time.sleep(kill_at)
                    t_end = time.time() + 3
                    while True:
                        m = router.metrics()
                        busy = [(m.get('loom_router_replica_inflight{replica="%s",state="up"}' % r.addr, 0), r)
                                for r in reps]
                        inflight_at_kill, victim = max(busy, key=lambda x: x[0])
                        if inflight_at_kill > 0 or time.time() > t_end:
                            break
                        time.sleep(0.02)
                    victim.kill9()
                rc = p.wait(timeout=180)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if not os.path.exists(path):
            with open(os.path.join(work, tag + ".txt")) as f:
                raise RuntimeError("loom bench (%s) wrote no result, rc %d:\n%s" % (tag, rc, f.read()[-2000:]))
        with open(path) as f:
            res = json.load(f)
        res["rc"] = rc
        res["failovers"] = router.metric("loom_router_failovers_total")
        res["victim"] = victim.addr if victim else None
        res["inflight_at_kill"] = inflight_at_kill
        return res
    finally:
        if router:
            router.stop()
        for r in reps:
            r.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rate", type=float, default=10, help="sessions/s (Poisson)")
    ap.add_argument("--think", type=float, default=0.2, help="mean think time between turns, s")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, the first three compared "
                    "per turn (default %(default)s)")
    ap.add_argument("--out", help="keep the JSON results and logs here")
    args = ap.parse_args()
    work = args.out or tempfile.mkdtemp(prefix="loom-bench-mt-")
    os.makedirs(work, exist_ok=True)
    t0 = time.time()
    policies = [p for p in args.policies.split(",") if p]
    if "round-robin" not in policies:
        ap.error("--policies must include round-robin (the baseline)")
    rows = {}
    for policy in policies:
        rows[policy] = one_run(args, work, policy)
    # about 40% into the load: every session has started and most are mid-chat
    span = args.sessions / args.rate + args.turns * args.think
    rows["prefix, kill -9 one replica"] = one_run(args, work, "prefix", kill_at=0.4 * span)
    print("%d sessions x %d turns (%d requests), 4 shared system prompts of 256 tokens, 32 user + 16 output tokens "
          "a turn, %.3g sessions/s Poisson, think %.2g s; 4 x stories260K replicas, 1 thread each (%.0f s in all)\n"
          % (args.sessions, args.turns, args.sessions * args.turns, args.rate, args.think, time.time() - t0))
    base = rows["round-robin"]
    print("| policy | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | output tok/s | req/s | failed | "
          "TTFT p50 vs round-robin |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print("| %s | %.1f%% | %.2f | %.2f | %.0f | %.2f | %d | %.2fx |" % (
            name, 100 * r.get("prefix_cache_hit_rate", 0), r["p50_ttft_ms"], r["p99_ttft_ms"],
            r["output_throughput"], r["request_throughput"], r["failed"], r["p50_ttft_ms"] / base["p50_ttft_ms"]))
    print("\nper turn, prefix-cache hit rate (%s):" % " / ".join(policies))
    for k in range(args.turns):
        print("  turn %d: %s" % (k + 1, " / ".join("%.1f%%" % (100 * (rows[p]["turns"][k]["prefix_cache_hit_rate"]
                                                                       or 0)) for p in policies)))
    kill = rows["prefix, kill -9 one replica"]
    print("\nkill -9 of %s (%d request(s) in flight on it by the router's /metrics): %d completed, %d failed, "
          "%d failover(s)" % (kill["victim"], kill["inflight_at_kill"], kill["completed"], kill["failed"],
                              kill["failovers"]))
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    bad = [n for n, r in rows.items() if r["failed"] or r["rc"]]
    if bad:
        print("FAILED requests in: %s" % ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

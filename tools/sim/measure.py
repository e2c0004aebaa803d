#!/usr/bin/python3
"""The real measurement the simulator is checked against: N replicas (a
coordinator and one worker each, stories260K, deploy/local/launch.sh) behind
loom-router, a prefix_repetition workload from `loom bench`, once per policy.
Every process is stopped at the end, also on failure. Prints and writes JSON:
per policy the bench's summary and the replicas' prefix-cache blocks (queries,
hits) and KV blocks.

  tools/sim/measure.py --out FILE [--policies prefix,round-robin] [--replicas 4]
                       [--rate 40] [--num-requests 600] [--kv-blocks 256] ...
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAUNCH = os.path.join(ROOT, "deploy", "local", "launch.sh")


def scrape(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as f:
        text = f.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(loom_[a-z_]+)(?:\{[^}]*\})? (\S+)$', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def wait_for(fn, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if fn():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("timed out waiting for " + what)


class Cluster:
    """n replicas on ports base, base+10, ...; metrics on port + 5."""

    def __init__(self, args):
        self.args = args
        self.dirs = []
        self.ports = [args.port + 10 * i for i in range(args.replicas)]

    def __enter__(self):
        env = dict(os.environ, LOOM_BIN=self.args.bin)
        try:
            for p in self.ports:
                d = tempfile.mkdtemp(prefix="loomsim-rep-")
                self.dirs.append(d)
                coord = ["--http", "127.0.0.1:%d" % (p + 5), "--kv-events", "tcp://127.0.0.1:0"]
                if self.args.kv_blocks:
                    coord += ["--num-kv-blocks", str(self.args.kv_blocks)]
                subprocess.run([LAUNCH, "--model", self.args.model, "--port", str(p), "--threads", "1",
                                "--no-pin", "--run-dir", d, "--"] + coord,
                               check=True, env=env, stdout=subprocess.DEVNULL)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for d in self.dirs:
            subprocess.run([LAUNCH, "--stop", "--run-dir", d], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        self.dirs = []
        return False

    def totals(self):
        keys = ("loom_prefix_cache_queries_total", "loom_prefix_cache_hits_total",
                "loom_step_seconds_sum", "loom_step_seconds_count", "loom_num_preemptions_total")
        t = dict.fromkeys(keys, 0.0)
        for p in self.ports:
            m = scrape(p + 5)
            for k in keys:
                t[k] += m.get(k, 0.0)
        return t


def run_policy(args, cluster, policy):
    rport = args.port + 10 * args.replicas + 1
    log = tempfile.NamedTemporaryFile(prefix="loomsim-router-", suffix=".log", delete=False)
    cmd = [os.path.join(args.bin, "loom-router"), "--listen", "tcp://127.0.0.1:%d" % rport,
           "--http", "127.0.0.1:%d" % (rport + 1), "--model", args.model, "--policy", policy]
    for p in cluster.ports:
        cmd += ["--replica", "tcp://127.0.0.1:%d" % p]
    router = subprocess.Popen(cmd, stdout=log, stderr=log)
    try:
        wait_for(lambda: scrape(rport + 1).get("loom_router_replica_up", 0) >= args.replicas, 30,
                 "%d replicas up behind the router" % args.replicas)
        before = cluster.totals()
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        b = [os.path.join(args.bin, "loom"), "bench", "--addr", "tcp://127.0.0.1:%d" % rport,
             "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
             "--prefix-repetition-suffix-len", str(args.suffix_len),
             "--prefix-repetition-num-prefixes", str(args.num_prefixes),
             "--prefix-repetition-output-len", str(args.output_len), "--rate", str(args.rate),
             "--burstiness", str(args.burstiness), "--num-requests", str(args.num_requests),
             "--seed", str(args.seed), "--metric-percentiles", "50,90,99", "--json", out,
             "--timeout-s", "240"]
        p = subprocess.run(b, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError("loom bench failed: %s" % p.stderr[-2000:])
        with open(out) as f:
            d = json.load(f)
        os.unlink(out)
        after = cluster.totals()
        delta = {k: after[k] - before[k] for k in after}
        rm = scrape(rport + 1)
        keep = ("completed", "failed", "duration", "request_throughput", "ttft_ms", "tpot_ms", "e2e_ms",
                "total_input_tokens", "total_output_tokens")
        res = {k: d[k] for k in keep if k in d}
        res["replica"] = delta
        res["hit_rate_blocks"] = (delta["loom_prefix_cache_hits_total"] /
                                  max(1.0, delta["loom_prefix_cache_queries_total"]))
        res["mean_step_ms"] = 1e3 * delta["loom_step_seconds_sum"] / max(1.0, delta["loom_step_seconds_count"])
        res["router_index_hit_blocks"] = rm.get("loom_router_prefix_index_hit_blocks_total", 0)
        return res
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(timeout=10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
        log.close()
        os.unlink(log.name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("LOOM_BIN", os.path.join(ROOT, "build", "bin")))
    ap.add_argument("--model", default=os.path.join(os.path.dirname(ROOT), "shared", "models", "stories260K"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--policies", default="prefix,round-robin")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--port", type=int, default=27400)
    ap.add_argument("--kv-blocks", type=int, default=256, help="KV blocks per replica (0: from memory)")
    ap.add_argument("--rate", type=float, default=40)
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--num-prefixes", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    results = {"config": vars(args), "load_average_before": os.getloadavg(), "policies": {}}
    with Cluster(args) as c:
        for pol in args.policies.split(","):
            # a fresh cache for each policy: restart would be slow, so the seed
            # differs per policy (other prompts, same shape)
            r = run_policy(args, c, pol)
            results["policies"][pol] = r
            print("%-12s TTFT p50 %.2f ms p90 %.2f p99 %.2f  TPOT p50 %.3f ms  hit rate %.2f  mean step %.2f ms  "
                  "%.1f req/s" % (pol, r["ttft_ms"]["p50"], r["ttft_ms"]["p90"], r["ttft_ms"]["p99"],
                                  r["tpot_ms"]["p50"], r["hit_rate_blocks"], r["mean_step_ms"],
                                  r["request_throughput"]), flush=True)
            args.seed += 1
    results["load_average_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

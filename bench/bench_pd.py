#!/usr/bin/env python3
"""TPOT of chat streams while long prompts arrive: two unified replicas
behind loom-router (prefix policy) against one prefill and one decode
replica behind loom-router --pd, on the random 76M model (dim 768, hidden
2048, 4 layers, 12/4 heads, vocab 32000), one worker thread each.

In both setups the same load runs for --seconds: --streams chat streams
back to back (a --chat-prompt-token prompt, --chat-tokens streamed tokens
each) and, every --long-every seconds, a long prompt of --long-prompt
tokens (max_tokens 8). TPOT is the gap between consecutive streamed chunks
of a chat stream, pooled over all streams; the table row gives its p50 and
p99 for each setup and the ratio of the p99s (unified / disaggregated), and
the long prompts' mean TTFT.

    bench/bench_pd.py [--seconds 30] [--streams 3] [--threads 1] [--work DIR]
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from harness import BIN, Cluster, free_port, wait_for  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_kv_offload import model  # noqa: E402

B = 16


def stream(port, body, out):
    """Streams one completion; appends the arrival times of its chunks to out."""
    body = dict(body, stream=True)
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                o = json.loads(line[6:])
                if o.get("choices") and o["choices"][0].get("finish_reason") is None:
                    out.append(time.perf_counter())


def run_load(port, a, seed):
    rng = random.Random(seed)
    stop = time.perf_counter() + a.seconds
    gaps, ttfts = [], []
    lock = threading.Lock()

    def chat():
        while time.perf_counter() < stop:
            t = []
            p = [rng.randrange(3, 500) for _ in range(a.chat_prompt_tokens)]
            stream(port, {"prompt": p, "max_tokens": a.chat_tokens, "temperature": 0, "ignore_eos": True}, t)
            with lock:
                gaps.extend(t[k + 1] - t[k] for k in range(len(t) - 1))

    def long_prompts():
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            t = []
            p = [rng.randrange(3, 500) for _ in range(a.long_prompt)]
            stream(port, {"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}, t)
            if t:
                with lock:
                    ttfts.append(t[0] - t0)
            time.sleep(max(0.0, a.long_every - (time.perf_counter() - t0)))

    th = [threading.Thread(target=chat) for _ in range(a.streams)] + [threading.Thread(target=long_prompts)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    return sorted(gaps), ttfts


def pct(x, p):
    return x[min(len(x) - 1, int(p / 100.0 * len(x)))] if x else float("nan")


def router(args, http):
    log = open(os.path.join(tempfile.gettempdir(), "loom-bench-pd-router.log"), "w")
    p = subprocess.Popen([os.path.join(BIN, "loom-router"), "--listen", "tcp://127.0.0.1:%d" % free_port(),
                          "--http", "127.0.0.1:%d" % http] + args, stdout=log, stderr=log)
    return p


def wait_up(http, n):
    def up():
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % http, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return False
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("loom_router_replica_up")) == n
    wait_for(up, 60, "%d replicas up" % n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--chat-prompt-tokens", type=int, default=48)
    ap.add_argument("--chat-tokens", type=int, default=48)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--long-every", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", help="a model directory (default: the random 76M model, made in --work)")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "loom-bench-kv-offload"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    m = a.model or model(a.work)
    common = ["--block-size", str(B), "--max-num-batched-tokens", "512"]
    res = {}
    for setup in ("unified", "disaggregated"):
        tier = tempfile.mkdtemp(prefix="tier-", dir=a.work)
        if setup == "unified":
            args = [common, common]
            flags = lambda p, d: ["--replica", p, "--replica", d]  # noqa: E731
        else:
            cfg = lambda role: json.dumps({"kv_connector": "LoomConnector", "kv_role": role})  # noqa: E731
            args = [common + ["--kv-offloading-dir", tier, "--kv-transfer-config", cfg("kv_producer")],
                    common + ["--kv-offloading-dir", tier, "--kv-transfer-config", cfg("kv_consumer")]]
            flags = lambda p, d: ["--pd", "--prefill-replica", p, "--replica", d,  # noqa: E731
                                  "--pd-min-prompt-tokens", str(a.long_prompt // 2)]
        http = free_port()
        try:
            # each replica's worker on cores of its own (launch.sh pins every cluster from core 0 otherwise)
            with Cluster(m, 1, 1, threads=a.threads, timeout=300, coord_args=args[0],
                         launch_args=["--cpu-offset", "0"]) as p, \
                 Cluster(m, 1, 1, threads=a.threads, timeout=300, coord_args=args[1],
                         launch_args=["--cpu-offset", str(a.threads)]) as d:
                r = router(["--model", m] + flags(p.addr, d.addr), http)
                try:
                    wait_up(http, 2)
                    res[setup] = run_load(http, a, 11)
                finally:
                    r.send_signal(signal.SIGTERM)
                    r.wait(timeout=30)
        finally:
            shutil.rmtree(tier, ignore_errors=True)
        g, t = res[setup]
        print("%s: %d gaps, TPOT p50 %.1f ms p99 %.1f ms; %d long prompts, TTFT mean %.0f ms" %
              (setup, len(g), pct(g, 50) * 1e3, pct(g, 99) * 1e3, len(t), 1e3 * sum(t) / max(1, len(t))),
              file=sys.stderr)
    (gu, tu), (gd, td) = res["unified"], res["disaggregated"]
    print("| setup | TPOT p50 | TPOT p99 | long-prompt TTFT (mean) |")
    print("|---|---|---|---|")
    for name, g, t in (("2 unified replicas", gu, tu), ("1 prefill + 1 decode (--pd)", gd, td)):
        print("| %s | %.1f ms | %.1f ms | %.0f ms (%d) |" %
              (name, pct(g, 50) * 1e3, pct(g, 99) * 1e3, 1e3 * sum(t) / max(1, len(t)), len(t)))
    print("TPOT p99 ratio (unified / disaggregated): %.2fx" % (pct(gu, 99) / pct(gd, 99)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

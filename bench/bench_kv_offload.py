#!/usr/bin/env python3
"""TTFT of a conversation's next turn when its prefix is in the directory
tier (--kv-offloading-dir) against the same turn recomputed, on the random
76M model (dim 768, hidden 2048, 4 layers, 12/4 heads, vocab 32000).

Each round draws a fresh random prefix of --prefix tokens. Replica A (the
tier, write-through) runs it once (max_tokens 1), which writes its blocks;
replica B (the tier, an empty pool: another coordinator and worker on the
same directory) then runs the next turn, prefix + --suffix new tokens,
loading the prefix from the tier; replica C (no tier) runs the same next
turn computing it all. TTFT is the wall time of the max_tokens 1 request
seen by the client (HTTP, non-streamed); B's and C's greedy first tokens
are compared (they must agree). Rounds alternate B and C first; prints the
medians and their ratio (recomputed / tier) as a table row for
docs/kv-offload.md.

    bench/bench_kv_offload.py [--prefix 2048] [--suffix 32] [--rounds 5] [--threads 2] [--work DIR]
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from harness import STORIES, Cluster, free_port  # noqa: E402

PY = os.environ.get("LOOM_PYTHON", "/usr/bin/python3")
B = 16


def post(port, body):
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


def model(work):
    m = os.path.join(work, "m76")
    if not os.path.exists(os.path.join(m, "config.json")):
        subprocess.run([PY, os.path.join(ROOT, "tests", "reference", "gen_model.py"), "--out", m, "--dim", "768",
                        "--hidden-dim", "2048", "--layers", "4", "--heads", "12", "--kv-heads", "4", "--vocab", "32000",
                        "--max-pos", "8192", "--seed", "1", "--tokenizer-from", STORIES], check=True,
                       stdout=subprocess.DEVNULL)
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "loom-bench-kv-offload"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    m = model(a.work)
    tier = tempfile.mkdtemp(prefix="tier-", dir=a.work)
    common = ["--block-size", str(B), "--max-model-len", str(a.prefix + a.suffix + 64), "--max-num-batched-tokens",
              "4096"]
    ports = [free_port() for _ in range(3)]
    tiered = ["--kv-offloading-dir", tier, "--kv-offloading-write-through"]
    rng = random.Random(7)
    t_tier, t_full, same = [], [], 0
    try:
        with Cluster(m, 1, 1, threads=a.threads, timeout=300,
                     coord_args=common + tiered + ["--http", "127.0.0.1:%d" % ports[0]]), \
             Cluster(m, 1, 1, threads=a.threads, timeout=300,
                     coord_args=common + tiered + ["--http", "127.0.0.1:%d" % ports[1]]), \
             Cluster(m, 1, 1, threads=a.threads, timeout=300,
                     coord_args=common + ["--http", "127.0.0.1:%d" % ports[2]]):
            for r in range(a.rounds + 1):  # round 0 warms every replica up
                prefix = [rng.randrange(3, 500) for _ in range(a.prefix)]
                turn = prefix + [rng.randrange(3, 500) for _ in range(a.suffix)]
                post(ports[0], {"prompt": prefix, "max_tokens": 1, "temperature": 0})
                order = [1, 2] if r % 2 else [2, 1]
                res = {}
                for p in order:
                    res[p] = post(ports[p], {"prompt": turn, "max_tokens": 1, "temperature": 0})
                cached = res[1][1]["usage"]["prompt_tokens_details"]["cached_tokens"]
                if r == 0:
                    continue
                t_tier.append(res[1][0])
                t_full.append(res[2][0])
                same += res[1][1]["choices"][0]["text"] == res[2][1]["choices"][0]["text"]
                print("round %d: tier %.1f ms (%d cached), recomputed %.1f ms" %
                      (r, res[1][0] * 1e3, cached, res[2][0] * 1e3), file=sys.stderr)
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    mt, mf = statistics.median(t_tier), statistics.median(t_full)
    print("| prefix | suffix | rounds | TTFT tier (median) | TTFT recomputed (median) | ratio | same first token |")
    print("|---|---|---|---|---|---|---|")
    print("| %d | %d | %d | %.1f ms | %.1f ms | %.2fx | %d/%d |" %
          (a.prefix, a.suffix, a.rounds, mt * 1e3, mf * 1e3, mf / mt, same, a.rounds))
    return 0 if same == a.rounds else 1


if __name__ == "__main__":
    sys.exit(main())

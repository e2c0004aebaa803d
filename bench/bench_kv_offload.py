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

--host: the next turn on the same replica, its prefix pushed out of a pool
of --pool blocks by a filler prompt as long as the prefix, on three
replicas: the host-memory tier (--kv-offloading-size), the directory tier
(write-back) and no tier (recomputed). Each round: the prefix (max_tokens
1), the filler, then the timed next turn, on each replica (the order
rotates); prints the three medians and the ratios of recomputed and
directory over host.

    bench/bench_kv_offload.py [--prefix 2048] [--suffix 32] [--rounds 5] [--threads 2] [--work DIR] [--host]
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
    ap.add_argument("--host", action="store_true", help="the host tier against the directory tier and recompute")
    ap.add_argument("--pool", type=int, default=0, help="KV pool blocks with --host (default: the turn's + 12)")
    a = ap.parse_args()
    if a.host:
        return main_host(a)
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


def main_host(a):
    os.makedirs(a.work, exist_ok=True)
    m = model(a.work)
    tier = tempfile.mkdtemp(prefix="tier-", dir=a.work)
    pool = a.pool or (a.prefix + a.suffix) // B + 12
    common = ["--block-size", str(B), "--max-model-len", str(a.prefix + a.suffix + 64), "--max-num-batched-tokens",
              "4096", "--num-kv-blocks", str(pool)]
    names = ["host", "dir", "recomputed"]
    tiers = [["--kv-offloading-size", "1", "--kv-offloading-backend", "native"], ["--kv-offloading-dir", tier], []]
    ports = [free_port() for _ in names]
    rng = random.Random(7)
    times = {n: [] for n in names}
    texts, cached = {n: [] for n in names}, {n: [] for n in names}
    try:
        with Cluster(m, 1, 1, threads=a.threads, timeout=300,
                     coord_args=common + tiers[0] + ["--http", "127.0.0.1:%d" % ports[0]]), \
             Cluster(m, 1, 1, threads=a.threads, timeout=300,
                     coord_args=common + tiers[1] + ["--http", "127.0.0.1:%d" % ports[1]]), \
             Cluster(m, 1, 1, threads=a.threads, timeout=300,
                     coord_args=common + tiers[2] + ["--http", "127.0.0.1:%d" % ports[2]]):
            for r in range(a.rounds + 1):  # round 0 warms every replica up
                prefix = [rng.randrange(3, 500) for _ in range(a.prefix)]
                filler = [rng.randrange(500, 1000) for _ in range(a.prefix)]
                turn = prefix + [rng.randrange(3, 500) for _ in range(a.suffix)]
                for i in [(r + k) % 3 for k in range(3)]:
                    post(ports[i], {"prompt": prefix, "max_tokens": 1, "temperature": 0})
                    post(ports[i], {"prompt": filler, "max_tokens": 1, "temperature": 0})
                    t, out = post(ports[i], {"prompt": turn, "max_tokens": 1, "temperature": 0})
                    if r == 0:
                        continue
                    times[names[i]].append(t)
                    texts[names[i]].append(out["choices"][0]["text"])
                    cached[names[i]].append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
                if r:
                    print("round %d: %s" % (r, ", ".join("%s %.1f ms (%d cached)" % (n, times[n][-1] * 1e3,
                                                                                     cached[n][-1]) for n in names)),
                          file=sys.stderr)
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    med = {n: statistics.median(times[n]) for n in names}
    same = sum(texts["host"][i] == texts["recomputed"][i] == texts["dir"][i] for i in range(a.rounds))
    print("| prefix | suffix | pool | rounds | TTFT host (median) | TTFT dir (median) | TTFT recomputed (median) "
          "| recomputed / host | dir / host | same first token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("| %d | %d | %d | %d | %.1f ms | %.1f ms | %.1f ms | %.2fx | %.2fx | %d/%d |" %
          (a.prefix, a.suffix, pool, a.rounds, med["host"] * 1e3, med["dir"] * 1e3, med["recomputed"] * 1e3,
           med["recomputed"] / med["host"], med["dir"] / med["host"], same, a.rounds))
    return 0 if same == a.rounds else 1


if __name__ == "__main__":
    sys.exit(main())

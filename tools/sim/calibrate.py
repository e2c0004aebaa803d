#!/usr/bin/python3
"""Fits the simulator's `cpu-tiny` step-time model from steps measured on this
machine: one replica (a coordinator and one worker, stories260K) started with
deploy/local/launch.sh, driven by `loom bench`, its step time read from the
coordinator's /metrics (loom_step_seconds: plan sent to result received).

Two sweeps, each point with its own seed so that no prompt hits the prefix
cache:
  prefill  one request at a time, output 1: every step is one whole prompt of
           P tokens (attention over P(P+1)/2 positions);
  decode   C requests at once, 16-token prompts, 128 output tokens: almost every
           step is C decodes at contexts 17..144.
Fitted by least squares on relative error:
  step_s = c0 + c_tok * tokens + c_attn * attended_positions + c_seq * seqs
and two overheads the step histogram does not see: the gap between the end of
one step and the start of the next (TPOT at C = 1 minus the step), and the
request's own overhead (TTFT at P = 16 minus its step: client, socket,
tokenize, queue). Writes tools/sim/calib/cpu-tiny.json (or --out).

  tools/sim/calibrate.py [--bin build/bin] [--model DIR] [--out FILE]
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def metrics(url):
    with urllib.request.urlopen(url, timeout=5) as f:
        text = f.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(loom_step_seconds_(?:sum|count)|loom_kv_cache_blocks)\{([^}]*)\} (\S+)$', line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def step_totals(url):
    m = metrics(url)
    s = sum(v for (k, _), v in m.items() if k == "loom_step_seconds_sum")
    n = sum(v for (k, _), v in m.items() if k == "loom_step_seconds_count")
    return s, n


def bench(bin_dir, addr, seed, n, conc, prompt, output):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [os.path.join(bin_dir, "loom"), "bench", "--addr", addr, "--num-requests", str(n), "--rate", "inf",
           "--max-concurrency", str(conc), "--prompt-len", str(prompt), "--output-len", str(output),
           "--seed", str(seed), "--json", path, "--metric-percentiles", "50,99"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit("loom bench failed: %s" % p.stderr[-2000:])
    with open(path) as f:
        d = json.load(f)
    os.unlink(path)
    if d.get("failed"):
        sys.exit("loom bench: %s requests failed" % d["failed"])
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("LOOM_BIN", os.path.join(ROOT, "build", "bin")))
    ap.add_argument("--model", default=os.path.join(os.path.dirname(ROOT), "shared", "models", "stories260K"))
    ap.add_argument("--out", default=os.path.join(HERE, "calib", "cpu-tiny.json"))
    ap.add_argument("--port", type=int, default=27300)
    ap.add_argument("--repeat", type=int, default=20, help="requests per prefill point")
    args = ap.parse_args()

    run_dir = tempfile.mkdtemp(prefix="loomsim-calib-")
    addr = "tcp://127.0.0.1:%d" % args.port
    murl = "http://127.0.0.1:%d/metrics" % (args.port + 80)
    launch = os.path.join(ROOT, "deploy", "local", "launch.sh")
    env = dict(os.environ, LOOM_BIN=args.bin)
    subprocess.run([launch, "--model", args.model, "--port", str(args.port), "--threads", "1", "--no-pin",
                    "--run-dir", run_dir, "--", "--http", "127.0.0.1:%d" % (args.port + 80)],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    rows = []  # (kind, x, tokens, attended, seqs, step_s)
    seed = 1000
    try:
        # warm-up: first steps touch cold memory
        bench(args.bin, addr, seed, 10, 1, 64, 8)
        seed += 1
        ttft16 = None
        for P in (16, 32, 64, 96, 128, 192, 256, 320, 384, 448):
            s0, n0 = step_totals(murl)
            d = bench(args.bin, addr, seed, args.repeat, 1, P, 1)
            seed += 1
            s1, n1 = step_totals(murl)
            step = (s1 - s0) / (n1 - n0)
            rows.append(("prefill", P, P, P * (P + 1) / 2, 1, step))
            if P == 16:
                ttft16 = (d["ttft_ms"]["p50"] / 1e3, step)
            print("prefill P=%4d  step %.3f ms  TTFT p50 %.3f ms" % (P, step * 1e3, d["ttft_ms"]["p50"]))
        tpot1 = None
        for C in (1, 2, 4, 8, 16, 32, 48, 64):
            s0, n0 = step_totals(murl)
            d = bench(args.bin, addr, seed, C, C, 16, 128)
            seed += 1
            s1, n1 = step_totals(murl)
            n_steps = n1 - n0
            step = (s1 - s0) / n_steps
            # 127 decode steps at contexts 17..143 (mean 80) and the prefill
            # step(s) of C x 16 tokens, averaged as the histogram does
            dec = 127
            tokens = (C * dec + C * 16) / n_steps
            attended = (C * dec * 80 + C * 16 * 17 / 2) / n_steps
            seqs = (C * dec + C) / n_steps
            rows.append(("decode", C, tokens, attended, seqs, step))
            if C == 1:
                tpot1 = (d["tpot_ms"]["p50"] / 1e3, step)
            print("decode  C=%4d  step %.3f ms  TPOT p50 %.3f ms  (%d steps)" %
                  (C, step * 1e3, d["tpot_ms"]["p50"], n_steps))
        m = metrics(murl)
        kv_blocks = int(sum(v for (k, _), v in m.items() if k == "loom_kv_cache_blocks"))
    finally:
        subprocess.run([launch, "--stop", "--run-dir", run_dir], stdout=subprocess.DEVNULL)

    A = np.array([[1.0, r[2], r[3], r[4]] for r in rows])
    y = np.array([r[5] for r in rows])
    W = 1.0 / y  # relative error
    coef, *_ = np.linalg.lstsq(A * W[:, None], y * W, rcond=None)
    coef = np.maximum(coef, 0.0)  # a negative cost would be nonsense; refit without it
    keep = coef > 0
    c2, *_ = np.linalg.lstsq((A * W[:, None])[:, keep], y * W, rcond=None)
    coef = np.zeros(4)
    coef[keep] = np.maximum(c2, 0.0)
    pred = A @ coef
    err = (pred - y) / y
    for r, p, e in zip(rows, pred, err):
        print("  %-7s %4d  measured %.3f ms  fitted %.3f ms  (%+.0f%%)" % (r[0], r[1], r[5] * 1e3, p * 1e3, e * 100))
    gap = max(0.0, tpot1[0] - tpot1[1])
    req_overhead = max(0.0, ttft16[0] - ttft16[1])
    out = {
        "name": "cpu-tiny",
        "kind": "fit",
        "about": "stories260K, one worker with one thread, fitted by tools/sim/calibrate.py",
        "measured": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                     "host": platform.node(), "cores": os.cpu_count(),
                     "load_average": os.getloadavg()},
        "step": {"c0_s": coef[0], "c_tok_s": coef[1], "c_attn_s": coef[2], "c_seq_s": coef[3]},
        "step_gap_s": gap,
        "request_overhead_s": req_overhead,
        "fit_max_rel_error": float(np.max(np.abs(err))),
        "fit_mean_rel_error": float(np.mean(np.abs(err))),
        # replicas simulated with this calibration share this machine's cores
        "host_cores": os.cpu_count(),
        # the router's cost, measured by bench/bench_router.sh (docs/benchmarks.md): 0.4-0.7 ms
        # added at p50, 9-16k decisions per core-second on this machine
        "router": {"added_latency_s": 0.0005, "decisions_per_core_s": 12500.0,
                   "source": "docs/benchmarks.md, router overhead against fake replicas"},
        "replica": {"max_num_seqs": 64, "max_batched_tokens": 512, "block_size": 16, "kv_blocks": kv_blocks,
                    "max_model_len": 512},
        "points": [{"kind": r[0], "x": r[1], "tokens": r[2], "attended": r[3], "seqs": r[4], "step_s": r[5]}
                   for r in rows],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("step = %.4f ms + %.5f ms/token + %.3g ms/attended position + %.5f ms/seq; gap %.3f ms; request %.3f ms"
          % (coef[0] * 1e3, coef[1] * 1e3, coef[2] * 1e3, coef[3] * 1e3, gap * 1e3, req_overhead * 1e3))
    print("fit: max |error| %.0f%%, mean %.0f%%; wrote %s" % (out["fit_max_rel_error"] * 100,
                                                           out["fit_mean_rel_error"] * 100, args.out))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Overlapped scheduling (--async-scheduling) on a 1x1 grid against `loom run`,
in interleaved rounds of one run: batch-1 greedy decode time per token on
stories260K (one worker thread), the grid with the flag off, on (3 steps
planned ahead, the default) and on with one step ahead.

    /usr/bin/python3 bench/bench_overlap.py [--model DIR] [--tokens 256] [--rounds 5]

`loom run` gives its decode rate; the grid's figure is the median time per
output token of `loom bench` at concurrency 1 (inter-token latency p50), so
both leave the prefill out.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import harness  # noqa: E402

LAUNCH = os.path.join(ROOT, "deploy", "local", "launch.sh")
PROMPT = "Sam found a shiny stone by the river. He showed the stone to his mom and said"


def loom_run_ms(model, tokens):
    p = subprocess.run([os.path.join(harness.BIN, "loom"), "run", "--model", model, "--prompt", PROMPT,
                        "--max-tokens", str(tokens), "--temperature", "0", "--ignore-eos", "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(p.stderr)
    return 1000.0 / float(re.search(r"decode ([\d.]+) tokens/s", p.stderr).group(1))


def launch(model, run_dir, coord_args):
    port = harness.free_port_pair()
    cmd = [LAUNCH, "--model", model, "--tp", "1", "--pp", "1", "--threads", "1", "--port", str(port),
           "--run-dir", run_dir, "--bin", harness.BIN, "--"] + list(coord_args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(p.stderr)
    return p.stdout.strip()


def stop(run_dir):
    subprocess.run([LAUNCH, "--stop", "--run-dir", run_dir], capture_output=True, timeout=60)


def grid_ms(addr, tokens, requests):
    out = tempfile.mktemp(suffix=".json")
    subprocess.run([os.path.join(harness.BIN, "loom"), "bench", "--addr", addr, "--rate", "inf", "--num-requests",
                    str(requests), "--max-concurrency", "1", "--prompt-len", "16", "--output-len", str(tokens),
                    "--vocab", "512", "--json", out], check=True, capture_output=True, timeout=600)
    with open(out) as f:
        r = json.load(f)
    os.unlink(out)
    return r["tpot_ms"]["p50"], r["output_throughput"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=harness.STORIES)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=4)
    a = ap.parse_args()
    flags = {"off": [], "on": ["--async-scheduling"], "on1": ["--async-scheduling-steps", "1"]}
    dirs = {k: tempfile.mkdtemp(prefix="loom-bench-overlap-") for k in flags}
    addrs = {k: launch(a.model, dirs[k], f) for k, f in flags.items()}
    res = {"run": []}
    for k in flags:
        res[k], res[k + "_tps"] = [], []
    try:
        for _ in range(a.rounds):
            res["run"].append(loom_run_ms(a.model, a.tokens))
            for k in flags:
                ms, tps = grid_ms(addrs[k], a.tokens, a.requests)
                res[k].append(ms)
                res[k + "_tps"].append(tps)
    finally:
        for d in dirs.values():
            stop(d)
    med = {k: statistics.median(v) for k, v in res.items()}
    print("load average %s" % " ".join(open("/proc/loadavg").read().split()[:3]))
    print("per-token ms (median of %d rounds): loom run %.4f, grid off %.4f (+%.4f), grid on %.4f (+%.4f), "
          "on with 1 step ahead %.4f (+%.4f)" % (a.rounds, med["run"], med["off"], med["off"] - med["run"], med["on"],
                                                 med["on"] - med["run"], med["on1"], med["on1"] - med["run"]))
    print("concurrency-1 output tok/s: grid off %.0f, on %.0f (%.2fx), on with 1 step ahead %.0f (%.2fx)"
          % (med["off_tps"], med["on_tps"], med["on_tps"] / med["off_tps"], med["on1_tps"],
             med["on1_tps"] / med["off_tps"]))
    print(json.dumps(res))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Continuous batching on one cluster, in one run: output tokens/s with 32
concurrent streams against the same requests one at a time, then a sweep of
Poisson arrival rates with `loom bench` (TTFT/TPOT/ITL/E2E percentiles, JSON
and a PNG plot of latency against load).

    /usr/bin/python3 bench/bench_serving.py [--model DIR] [--tp 1] [--pp 1] [--out DIR] [--api zmq|http]

The model defaults to the generated ~125M-parameter model of bench_grid.py.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_grid  # noqa: E402
import harness  # noqa: E402  (tests/integration, put on the path by bench_grid)


def run_bench(addr, out, *args):
    cmd = [os.path.join(harness.BIN, "loom"), "bench", "--addr", addr, "--json", out] + list(args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    sys.stdout.write(p.stdout)
    if p.returncode not in (0, 1):
        raise RuntimeError(p.stderr)
    with open(out) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "build", "bench-models", "m100"))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rates", default="0.5,1,2,4,8,inf")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench-serving"))
    args = ap.parse_args()
    model = bench_grid.ensure_model(args.model)
    with open(os.path.join(model, "config.json")) as f:
        vocab = min(json.load(f)["vocab_size"], 512)
    os.makedirs(args.out, exist_ok=True)
    threads = max(1, os.cpu_count() // (args.tp * args.pp))
    run_dir = tempfile.mkdtemp(prefix="loom-bench-")
    addr = bench_grid.launch(model, args.tp, args.pp, threads, run_dir)
    common = ["--prompt-len", "64", "--prompt-len-range", "0.5", "--output-len", "64", "--output-len-range", "0.5",
              "--vocab", str(vocab), "--seed", "7"]
    try:
        run_bench(addr, os.path.join(args.out, "warmup.json"), "--num-requests", "4", *common)
        one = run_bench(addr, os.path.join(args.out, "one_at_a_time.json"), "--num-requests", "32",
                        "--max-concurrency", "1", "--rate", "inf", *common)
        many = run_bench(addr, os.path.join(args.out, "concurrent32.json"), "--num-requests", "32",
                         "--max-concurrency", "32", "--rate", "inf", *common)
        ratio = many["output_throughput"] / one["output_throughput"]
        print("continuous batching: %.1f output tokens/s with 32 concurrent streams, %.1f one at a time: x%.1f"
              % (many["output_throughput"], one["output_throughput"], ratio), flush=True)
        sweep = run_bench(addr, os.path.join(args.out, "sweep.json"), "--num-requests", str(args.requests),
                          "--rates", args.rates, "--plot", os.path.join(args.out, "latency_vs_load.png"), *common)
    finally:
        bench_grid.stop(run_dir)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"one_at_a_time": one, "concurrent32": many, "ratio": ratio, "sweep": sweep}, f, indent=2)
    print("results in %s (summary.json, sweep.json, latency_vs_load.png)" % args.out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Mixture-of-Experts grids on this machine: batch-1 decode tokens/s and
prefill time (TTFT of a long prompt) of a 2x1 grid with the experts
TP-sliced against the same grid with --expert-parallel (whole experts per
rank), one thread per worker, next to a 1x1 grid of two threads.

    /usr/bin/python3 bench/bench_moe.py [--model DIR] [--tokens 64] [--prompt 256] [--json FILE]

The model defaults to a generated Mixtral-shaped fp32 model (8 experts,
top-2, dim 512, intermediate 1408, 8 layers; 592 MB, 168 MB read per
token) in build/bench-models/moe8x2.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_grid  # noqa: E402
import harness  # noqa: E402


def ensure_model(path):
    if not os.path.exists(os.path.join(path, "config.json")):
        subprocess.run([harness.PYTHON, os.path.join(ROOT, "tests", "reference", "gen_model.py"), "--out", path,
                        "--arch", "mixtral", "--experts", "8", "--top-k", "2", "--dim", "512", "--hidden-dim", "1408",
                        "--layers", "8", "--heads", "8", "--kv-heads", "2", "--vocab", "4096", "--expert-spread",
                        "0.35", "--seed", "1", "--tokenizer-from", harness.STORIES], check=True)
    return path


def loom_bench(addr, prompt, tokens, requests, vocab):
    out = tempfile.mktemp(suffix=".json")
    subprocess.run([os.path.join(harness.BIN, "loom"), "bench", "--addr", addr, "--rate", "inf", "--num-requests",
                    str(requests), "--max-concurrency", "1", "--prompt-len", str(prompt), "--output-len", str(tokens),
                    "--vocab", str(vocab), "--json", out], check=True, capture_output=True, timeout=600)
    with open(out) as f:
        r = json.load(f)
    os.unlink(out)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "build", "bench-models", "moe8x2"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = ensure_model(args.model)
    with open(os.path.join(model, "config.json")) as f:
        vocab = min(json.load(f)["vocab_size"], 512)
    results = {}
    for name, tp, threads, coord in [("1x1", 1, 2, []), ("tp=2", 2, 1, []), ("ep=2", 2, 1, ["--expert-parallel"])]:
        run_dir = tempfile.mkdtemp(prefix="loom-bench-")
        port = harness.free_port_pair()
        cmd = [bench_grid.LAUNCH, "--model", model, "--tp", str(tp), "--pp", "1", "--threads", str(threads), "--port",
               str(port), "--run-dir", run_dir, "--bin", harness.BIN, "--"] + coord
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError(p.stderr)
        addr = p.stdout.strip()
        try:
            loom_bench(addr, 32, 8, 1, vocab)  # warm-up
            dec = loom_bench(addr, 32, args.tokens, 3, vocab)
            pre = loom_bench(addr, args.prompt, 1, 3, vocab)
        finally:
            bench_grid.stop(run_dir)
        s = bench_grid.summaries(run_dir)
        steps = max(v[0] for v in s.values())
        comm_ms = max(v[2] for v in s.values()) * 1e3 / steps
        tpot, ttft = dec["tpot_ms"]["p50"], pre["ttft_ms"]["p50"]
        results[name] = {"decode_tok_s": 1000.0 / tpot, "tpot_ms_p50": tpot, "prefill_ttft_ms_p50": ttft,
                         "prefill_tok_s": args.prompt * 1000.0 / ttft, "comm_ms_per_step": comm_ms}
        print("%s (%d thread(s) per worker): decode %.1f tokens/s (TPOT p50 %.2f ms); prefill of %d tokens TTFT "
              "p50 %.1f ms (%.0f tokens/s); %.3f ms per step in the data plane"
              % (name, threads, 1000.0 / tpot, tpot, args.prompt, ttft, args.prompt * 1000.0 / ttft, comm_ms),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

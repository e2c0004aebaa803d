#!/usr/bin/env python3
"""Grid efficiency on this machine, in one run: batch-1 decode tokens/s of a
1x1 grid (2 threads) against 2x1 (tensor parallel) and 1x2 (pipeline), one
thread per worker, with the time per step spent in the data plane; then
pipeline overlap: per-stage busy time of a 1x2 grid under concurrent load,
from the workers' step traces.

    /usr/bin/python3 bench/bench_grid.py [--model DIR] [--tokens 128] [--json FILE]

The model defaults to a generated ~125M-parameter fp32 model (dim 768, 12
layers, 12/4 heads, vocab 32000) in build/bench-models/m100.
"""
import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import harness  # noqa: E402

LAUNCH = os.path.join(ROOT, "deploy", "local", "launch.sh")


def ensure_model(path):
    if not os.path.exists(os.path.join(path, "config.json")):
        subprocess.run([harness.PYTHON, os.path.join(ROOT, "tests", "reference", "gen_model.py"), "--out", path,
                        "--dim", "768", "--hidden-dim", "2048", "--layers", "12", "--heads", "12", "--kv-heads", "4",
                        "--vocab", "32000", "--max-pos", "2048", "--seed", "1", "--tokenizer-from", harness.STORIES],
                       check=True)
    return path


def launch(model, tp, pp, threads, run_dir, worker_args=(), launch_args=()):
    port = harness.free_port_pair()
    cmd = [LAUNCH, "--model", model, "--tp", str(tp), "--pp", str(pp), "--threads", str(threads), "--port", str(port),
           "--run-dir", run_dir, "--bin", harness.BIN] + list(launch_args)
    for a in worker_args:
        cmd += ["--worker-arg", a]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(p.stderr)
    return p.stdout.strip()


def stop(run_dir):
    subprocess.run([LAUNCH, "--stop", "--run-dir", run_dir], capture_output=True, timeout=60)


def bench(addr, tokens, requests, concurrency, vocab):
    out = tempfile.mktemp(suffix=".json")
    subprocess.run([os.path.join(harness.BIN, "loom"), "bench", "--addr", addr, "--rate", "inf", "--num-requests",
                    str(requests), "--max-concurrency", str(concurrency), "--prompt-len", "32", "--output-len",
                    str(tokens), "--vocab", str(vocab), "--json", out], check=True, capture_output=True, timeout=600)
    with open(out) as f:
        r = json.load(f)
    os.unlink(out)
    return r


def summaries(run_dir):
    """Per worker: (steps, busy s, comm s) from the exit summary line."""
    out = {}
    for log in sorted(glob.glob(os.path.join(run_dir, "worker-*.log"))):
        with open(log) as f:
            m = re.search(r"summary: (\d+) steps, ([\d.]+) s computing, ([\d.]+) s of it in the data plane", f.read())
        if m:
            out[os.path.basename(log)[:-4]] = (int(m.group(1)), float(m.group(2)), float(m.group(3)))
    return out


def overlap(run_dir):
    """From the traces of a 1x2 grid: wall time, each stage's busy time, time both were busy."""
    spans = []
    for f in sorted(glob.glob(os.path.join(run_dir, "trace-*.json"))):
        with open(f) as fh:
            ev = json.load(fh)
        spans.append(sorted((e["ts"], e["ts"] + e["dur"]) for e in ev))
    if len(spans) != 2:
        return None
    t0 = min(s[0][0] for s in spans)
    t1 = max(s[-1][1] for s in spans)
    busy = [sum(b - a for a, b in s) for s in spans]
    both, i, j = 0.0, 0, 0
    a, b = spans
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            both += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return {"wall_s": (t1 - t0) / 1e6, "stage_busy_s": [x / 1e6 for x in busy], "both_busy_s": both / 1e6}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "build", "bench-models", "m100"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = ensure_model(args.model)
    with open(os.path.join(model, "config.json")) as f:
        vocab = min(json.load(f)["vocab_size"], 512)
    results = {}
    for name, tp, pp, threads in [("1x1", 1, 1, 2), ("2x1", 2, 1, 1), ("1x2", 1, 2, 1)]:
        run_dir = tempfile.mkdtemp(prefix="loom-bench-")
        addr = launch(model, tp, pp, threads, run_dir)
        try:
            bench(addr, 8, 1, 1, vocab)  # warm-up
            r = bench(addr, args.tokens, 3, 1, vocab)
        finally:
            stop(run_dir)
        s = summaries(run_dir)
        steps = max(v[0] for v in s.values())
        comm_ms = max(v[2] for v in s.values()) * 1e3 / steps
        busy_ms = max(v[1] for v in s.values()) * 1e3 / steps
        tpot = r["tpot_ms"]["p50"]
        results[name] = {"decode_tok_s": 1000.0 / tpot, "tpot_ms_p50": tpot, "step_ms": busy_ms, "comm_ms_per_step": comm_ms}
        print("%s (%d thread(s) per worker): decode %.1f tokens/s (TPOT p50 %.2f ms), %.2f ms per step of which "
              "%.3f ms in the data plane" % (name, threads, 1000.0 / tpot, tpot, busy_ms, comm_ms), flush=True)
    base = results["1x1"]["decode_tok_s"]
    for name in ("2x1", "1x2"):
        results[name]["vs_1x1"] = results[name]["decode_tok_s"] / base
    print("TP efficiency (2x1 / 1x1): %.2f    PP (1x2 / 1x1, batch 1): %.2f"
          % (results["2x1"]["vs_1x1"], results["1x2"]["vs_1x1"]))

    # pipeline overlap under load: 8 concurrent streams on 1x2
    run_dir = tempfile.mkdtemp(prefix="loom-bench-")
    addr = launch(model, 1, 2, 1, run_dir, worker_args=["--trace=%s/trace-%%i.json" % run_dir])
    try:
        r8 = bench(addr, 64, 16, 8, vocab)
    finally:
        stop(run_dir)
    ov = overlap(run_dir)
    if ov:
        results["pipeline_1x2_load8"] = dict(ov, output_tok_s=r8["output_throughput"])
        print("1x2 under 8 concurrent streams: wall %.2f s, stage busy %.2f s and %.2f s, both stages busy at once "
              "%.2f s (%.0f%% of the wall time); %.1f output tokens/s"
              % (ov["wall_s"], ov["stage_busy_s"][0], ov["stage_busy_s"][1], ov["both_busy_s"],
                 100 * ov["both_busy_s"] / ov["wall_s"], r8["output_throughput"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

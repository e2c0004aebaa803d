#!/usr/bin/env python3
"""What CURVE costs the scheduler: two launched clusters of the tiny model
(stories260K, one worker), one with the control plane keyed (the default)
and one --insecure, driven in turn by the same `loom bench` load (64
sequences running at once: --max-concurrency 64, all arriving at once,
ignore_eos). The step time at 64 running sequences is the mean TPOT; the
runs alternate (off, on, off, on, ...) so both see the same machine load.

    /usr/bin/python3 bench/bench_curve.py [--rounds 5] [--output-len 64] [--json FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import harness  # noqa: E402


def bench(addr, args, out_json):
    cmd = [os.path.join(harness.BIN, "loom"), "bench", "--addr", addr, "--rate", "inf",
           "--num-requests", "64", "--max-concurrency", "64", "--prompt-len", str(args.prompt_len),
           "--output-len", str(args.output_len), "--json", out_json]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit("loom bench failed: %s" % p.stderr[-2000:])
    with open(out_json) as f:
        r = json.load(f)
    return r["tpot_ms"]["mean"] if isinstance(r.get("tpot_ms"), dict) else r["mean_tpot_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    coord = ["--max-num-seqs", "64", "--num-kv-blocks", "2048"]
    tmp = tempfile.mkdtemp(prefix="loom-bench-curve-")
    off = harness.Cluster(harness.STORIES, 1, 1, coord_args=coord, launch_args=["--insecure"])
    on = harness.Cluster(harness.STORIES, 1, 1, coord_args=coord)
    res = {"off": [], "on": []}
    with off, on:
        for k in range(args.rounds):
            for name, c in (("off", off), ("on", on)) if k % 2 == 0 else (("on", on), ("off", off)):
                t = bench(c.addr, args, os.path.join(tmp, "%s-%d.json" % (name, k)))
                res[name].append(t)
                print("round %d  CURVE %-3s  step (mean TPOT) %.3f ms" % (k, name, t), flush=True)
    m_off, m_on = statistics.median(res["off"]), statistics.median(res["on"])
    b_off, b_on = min(res["off"]), min(res["on"])
    print("median step at 64 running sequences: CURVE off %.3f ms, on %.3f ms: %+.1f%%"
          % (m_off, m_on, 100.0 * (m_on - m_off) / m_off))
    print("best step at 64 running sequences:   CURVE off %.3f ms, on %.3f ms: %+.1f%%"
          % (b_off, b_on, 100.0 * (b_on - b_off) / b_off))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": res, "median_off_ms": m_off, "median_on_ms": m_on,
                       "overhead_pct": 100.0 * (m_on - m_off) / m_off,
                       "best_off_ms": b_off, "best_on_ms": b_on}, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""What CURVE costs the scheduler: two launched clusters of the tiny model
(stories260K, one worker), one with the control plane keyed (the default)
and one --insecure, driven in turn by the same `loom bench` load (64
sequences running at once: --max-concurrency 64, all arriving at once,
ignore_eos). The step time at 64 running sequences is the mean TPOT; the
runs alternate (off, on, off, on, ...) so both see the same machine load.
On a loaded machine wall time varies far more than CURVE costs, so the
coordinator's and the worker's CPU time (all threads, from
/proc/PID/task/*/schedstat) per step is reported too: that is what CURVE
adds to, and it hardly depends on what else the machine runs.

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


def cpu_ns(pids):
    total = 0
    for pid in pids:
        d = "/proc/%d/task" % pid
        for t in os.listdir(d):
            try:
                with open(os.path.join(d, t, "schedstat")) as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass
    return total


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
    cpu = {"off": [], "on": []}
    with off, on:
        for k in range(args.rounds):
            for name, c in (("off", off), ("on", on)) if k % 2 == 0 else (("on", on), ("off", off)):
                pids = [c.pid("coordinator"), c.pid("worker-0")]
                c0 = cpu_ns(pids)
                t = bench(c.addr, args, os.path.join(tmp, "%s-%d.json" % (name, k)))
                us = (cpu_ns(pids) - c0) / 1e3 / args.output_len  # ~output_len decode steps of 64 sequences
                res[name].append(t)
                cpu[name].append(us)
                print("round %d  CURVE %-3s  step (mean TPOT) %.3f ms, CPU per step %.0f us" % (k, name, t, us),
                      flush=True)
    m_off, m_on = statistics.median(res["off"]), statistics.median(res["on"])
    b_off, b_on = min(res["off"]), min(res["on"])
    print("median step at 64 running sequences: CURVE off %.3f ms, on %.3f ms: %+.1f%%"
          % (m_off, m_on, 100.0 * (m_on - m_off) / m_off))
    print("best step at 64 running sequences:   CURVE off %.3f ms, on %.3f ms: %+.1f%%"
          % (b_off, b_on, 100.0 * (b_on - b_off) / b_off))
    c_off, c_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    print("median CPU per step (coordinator + worker): CURVE off %.0f us, on %.0f us: %+.1f%%"
          % (c_off, c_on, 100.0 * (c_on - c_off) / c_off))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": res, "median_off_ms": m_off, "median_on_ms": m_on,
                       "overhead_pct": 100.0 * (m_on - m_off) / m_off,
                       "best_off_ms": b_off, "best_on_ms": b_on,
                       "cpu_us": cpu, "median_cpu_off_us": c_off, "median_cpu_on_us": c_on}, f, indent=1)


if __name__ == "__main__":
    main()

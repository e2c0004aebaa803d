#!/usr/bin/env python3
"""Tensor parallelism on one host against one process, in interleaved rounds:
a 1x1 grid with 2 threads and a 2x1 grid (TP=2) with one thread per worker,
each at concurrency 1 and 16, every round launching both clusters in turn
(which goes first alternates), then the TP/1x1 ratio of the median rounds.

    /usr/bin/python3 bench/bench_tp.py [--model DIR] [--rounds 4] [--tokens 128] [--conc 1,16]
                                       [--configs 1x1,2x1,2x1:spin=2,2x1:nopin,2x1:async] [--json FILE]

The model defaults to bench_grid.py's (build/bench-models/m100: dim 768,
hidden 2048, 12 layers, 12/4 heads, vocab 32000; 76M matmul parameters, so
a TP=2 decode token runs 24 all-reduces of 768 floats). The load average is
printed beside every round: on a shared machine the ratios of one round
move with it. --configs names the clusters of a round (the first is the
base of the ratios): 1x1 (2 threads) or 2x1 (one thread per worker), with
":spin=US" for the workers' LOOM_COMM_SPIN_US, ":nopin" for the
launcher's --no-pin (the workers then float over the cores) and ":async"
for the coordinator's --async-scheduling (on a TP group rank 0 shares the
sampled ids, so the next step is planned while one runs).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_grid  # noqa: E402


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def parse_config(spec):
    parts = spec.split(":")
    tp, threads = {"1x1": (1, 2), "2x1": (2, 1)}[parts[0]]
    env, launch_args, coord_args = {}, [], []
    for p in parts[1:]:
        if p.startswith("spin="):
            env["LOOM_COMM_SPIN_US"] = p[5:]
        elif p == "nopin":
            launch_args.append("--no-pin")
        elif p == "async":
            coord_args.append("--async-scheduling")
        else:
            raise SystemExit("bench_tp: unknown option %r in %r" % (p, spec))
    return spec, tp, threads, env, launch_args + (["--"] + coord_args if coord_args else [])


def run_config(model, tp, threads, concs, tokens, vocab, env=None, launch_args=()):
    run_dir = tempfile.mkdtemp(prefix="loom-bench-")
    saved = dict(os.environ)
    if env:
        os.environ.update(env)
    try:
        addr = bench_grid.launch(model, tp, 1, threads, run_dir, launch_args=launch_args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    out = {}
    try:
        bench_grid.bench(addr, 8, 1, 1, vocab)  # warm-up
        for c in concs:
            r = bench_grid.bench(addr, tokens, max(3, 2 * c), c, vocab)
            out[c] = {"tpot_ms": r["tpot_ms"]["p50"], "output_tok_s": r["output_throughput"]}
    finally:
        bench_grid.stop(run_dir)
    s = bench_grid.summaries(run_dir)
    if s:
        steps = max(v[0] for v in s.values())
        out["comm_ms_per_step"] = max(v[2] for v in s.values()) * 1e3 / max(steps, 1)
        out["busy_ms_per_step"] = max(v[1] for v in s.values()) * 1e3 / max(steps, 1)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(bench_grid.ROOT, "build", "bench-models", "m100"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--conc", default="1,16")
    ap.add_argument("--configs", default="1x1,2x1")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = bench_grid.ensure_model(args.model)
    with open(os.path.join(model, "config.json")) as f:
        vocab = min(json.load(f)["vocab_size"], 512)
    concs = [int(x) for x in args.conc.split(",")]
    configs = [parse_config(c) for c in args.configs.split(",")]
    rows = {c[0]: [] for c in configs}
    for rnd in range(args.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        for name, tp, threads, env, launch_args in order:
            la = loadavg()
            r = run_config(model, tp, threads, concs, args.tokens, vocab, env, launch_args)
            r["load"] = la
            rows[name].append(r)
            print("round %d %-14s load %5.2f  " % (rnd, name, la) +
                  "  ".join("c%d: %.2f ms/tok %.1f tok/s" % (c, r[c]["tpot_ms"], r[c]["output_tok_s"]) for c in concs) +
                  ("  data plane %.3f of %.2f ms/step" % (r["comm_ms_per_step"], r["busy_ms_per_step"])
                   if "comm_ms_per_step" in r else ""), flush=True)
    base_name = configs[0][0]
    base = rows[base_name]
    summary = {}
    for name in [c[0] for c in configs[1:]]:
        for c in concs:
            # per-round ratios (the two ran minutes apart at most) and the ratio of the medians
            per_round = [b[c]["tpot_ms"] / r[c]["tpot_ms"] if c == 1 else r[c]["output_tok_s"] / b[c]["output_tok_s"]
                         for b, r in zip(base, rows[name])]
            if c == 1:
                med = statistics.median(b[c]["tpot_ms"] for b in base) / statistics.median(r[c]["tpot_ms"] for r in rows[name])
            else:
                med = statistics.median(r[c]["output_tok_s"] for r in rows[name]) / statistics.median(b[c]["output_tok_s"] for b in base)
            summary["%s/%s c%d" % (name, base_name, c)] = {"per_round": per_round, "of_medians": med}
            print("%s / %s at concurrency %d: %.3f of the medians (per round: %s)"
                  % (name, base_name, c, med, " ".join("%.3f" % x for x in per_round)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=2, default=str)


if __name__ == "__main__":
    main()

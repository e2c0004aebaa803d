#!/usr/bin/python3
"""The simulator's results for docs/scale-out.md: goodput under the SLO
(TTFT <= 1 s, TPOT <= 50 ms) against the request rate, per router policy
(h200-8b calibration, Poisson arrivals):
  multiturn  4, 64 and 1024 replicas;
  rag        4 and 64 replicas, Poisson and bursty (gamma shape 0.25).
Writes tools/sim/results/results.jsonl (one line per run; runs already there
are kept, so an interrupted sweep goes on where it stopped) and
goodput_<workload>_<replicas>_<variant>.dat; tools/sim/plot.sh draws them.

  tools/sim/sweep.py [--replicas 4,64,1024] [--workloads multiturn,rag] [--jobs 2] [--dat]
"""
import argparse
import json
import multiprocessing
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import loomsim  # noqa: E402

OUT = os.path.join(HERE, "results")
POLICY = {
    "prefix": ["--policy", "prefix"],
    "prefix-l0.02": ["--policy", "prefix", "--prefix-lambda", "0.02"],
    "prefix-l0.02-ix4M": ["--policy", "prefix", "--prefix-lambda", "0.02", "--prefix-index-blocks", str(1 << 22)],
    "round-robin": ["--policy", "round-robin"],
    "least-loaded": ["--policy", "least-loaded"],
    "session": ["--policy", "session"],
}
# per (workload, replicas): [(variants, requests/s per replica, timing)]
MT = [20, 40, 60, 80, 90, 100, 110, 120, 135]
RAG = [10, 20, 35, 50, 60, 70, 85]
RAG_VARIANTS = ["prefix", "prefix-l0.02", "round-robin", "prefix@0.25", "round-robin@0.25"]
PLAN = {
    ("multiturn", 4): [(["prefix", "prefix-l0.02", "round-robin", "least-loaded", "session"], [40, 80, 100, 120],
                        ["--duration", "20", "--warmup", "5"])],
    ("multiturn", 64): [(list(POLICY), MT, ["--duration", "14", "--warmup", "5"])],
    # 1024 replicas cost ~40 CPU seconds a simulated second (every replica steps every ~20 ms): one rate, a
    # short window, for the hit rate and the latencies below the knee, not the knee itself
    ("multiturn", 1024): [(["prefix-l0.02", "prefix-l0.02-ix4M", "round-robin"], [100],
                           ["--duration", "1.5", "--warmup", "0.5", "--stop-when-measured"])],
    ("rag", 4): [(RAG_VARIANTS, [20, 50, 70], ["--duration", "30", "--warmup", "8"])],
    ("rag", 64): [(RAG_VARIANTS, RAG, ["--duration", "20", "--warmup", "6"])],
}


def job(spec):
    wl, n, label, per, timing = spec
    pol, _, k = label.partition("@")
    argv = ["--calib", "h200-8b", "--replicas", str(n), "--workload", wl, "--rate", str(per * n),
            "--seed", "1"] + timing + POLICY[pol] + (["--burstiness", k] if k else [])
    r = loomsim.simulate(argv)
    r.update(variant=label, per_replica_rate=per)
    return r


def key(r):
    return (r["workload"], r["replicas"], r["variant"], r["per_replica_rate"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="4,64,1024")
    ap.add_argument("--workloads", default="multiturn,rag")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dat", action="store_true", help="only write the .dat files from results.jsonl")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    ns = [int(x) for x in args.replicas.split(",")]
    wls = args.workloads.split(",")
    specs = [(wl, n, label, per, timing) for (wl, n), plan in PLAN.items() if wl in wls and n in ns
             for labels, pers, timing in plan for label in labels for per in pers]
    path = os.path.join(OUT, "results.jsonl")
    done = {}
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            done[key(r)] = r
    if args.dat:
        write_dat(done)
        return
    todo = [s for s in specs if s[:4] not in done]
    todo.sort(key=lambda s: -s[1] * s[3])  # the biggest first: the pool does not end on one long run
    print("%d runs to do (%d already in %s)" % (len(todo), len(specs) - len(todo), path), flush=True)
    with multiprocessing.Pool(args.jobs) as pool, open(path, "a") as f:
        for r in pool.imap_unordered(job, todo):
            done[key(r)] = r
            f.write(json.dumps(r) + "\n")
            f.flush()
            print("%-9s %5d %-18s %7.0f req/s: goodput %8.1f (%3.0f%%)  TTFT p50 %7.1f p99 %8.1f ms  "
                  "TPOT p50 %5.1f ms  hits %.2f" %
                  (r["workload"], r["replicas"], r["variant"], r["rate"], r["goodput"], 100 * r["good_fraction"],
                   r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p50"], r["prefix_hit_rate_blocks"]),
                  flush=True)
    write_dat(done)


def write_dat(done):
    by = {}
    for (wl, n, label, per), r in done.items():
        by.setdefault((wl, n, label), []).append(r)
    for (wl, n, label), rows in by.items():
        rows.sort(key=lambda r: r["per_replica_rate"])
        with open(os.path.join(OUT, "goodput_%s_%d_%s.dat" % (wl, n, label)), "w") as f:
            f.write("# %s, %d replicas, %s. rate/replica, offered, goodput (req/s), goodput/replica, "
                    "TTFT p50, p99, TPOT p50, p99 (ms), prefix-cache hit rate\n" % (wl, n, label))
            for r in rows:
                f.write("%g %.1f %.1f %.2f %.2f %.2f %.2f %.2f %.3f\n" % (
                    r["per_replica_rate"], r["offered_rate"], r["goodput"], r["goodput"] / n, r["ttft_ms"]["p50"],
                    r["ttft_ms"]["p99"], r["tpot_ms"]["p50"], r["tpot_ms"]["p99"], r["prefix_hit_rate_blocks"]))


if __name__ == "__main__":
    main()

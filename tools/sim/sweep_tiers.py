#!/usr/bin/python3
"""The KV tier comparison for docs/scale-out.md: 0, 1 and 2 tiers where the
pools fill. The scale sweep (sweep_scale.py) could not tell the tiers apart:
an H200's 54,000 blocks a replica hold its working set for the windows it
can simulate. Here every replica keeps 6,000 blocks (96k tokens: a ninth of
that, the case of a longer context or a larger model per GPU), everything
else as sweep_scale.py's runs (h200-8b, prefix policy, the same tiers: 1 =
the shared directory at 10 GB/s a replica, 4 x the full-size pools' blocks;
2 = 120,000 blocks of host memory a replica at 50 GB/s above it; "wt": the
directory written through, each block as it is computed), and the warm-up
is long enough for the pools to fill before the measured window.

Writes tools/sim/results/tiers.jsonl (runs already there are kept).

  tools/sim/sweep_tiers.py [--replicas 4,16,64] [--jobs 2]
  tools/sim/sweep_tiers.py --table
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import loomsim  # noqa: E402
import sweep_scale  # noqa: E402

OUT = os.path.join(HERE, "results")
POOL = 6000
CONFIGS = ["unified", "unified+t1", "unified+t2", "unified+t1wt", "unified+t2wt"]
RATES = {"multiturn": [20, 40, 60, 70, 80, 90, 110], "rag": [10, 20, 30, 40, 60]}  # requests/s a replica
# simulated seconds of arrivals and of warm-up (the pools fill in the warm-up at these rates)
TIMING = {4: ("24", "10"), 16: ("16", "6"), 64: ("8", "3")}


def config(label, n):
    """sweep_scale's configurations; a "wt" suffix: the directory tier written through
    (--kv-offloading-write-through: each block as it is computed, not as the tier above gives it up)."""
    if label.endswith("wt"):
        return sweep_scale.config(label[:-2], n) + ["--tier-write-through"]
    return sweep_scale.config(label, n)


def job(spec):
    wl, n, label, per = spec
    dur, warm = TIMING[n]
    argv = (sweep_scale.BASE + sweep_scale.WORKLOAD[wl] +
            ["--replicas", str(n), "--rate", str(per * n), "--duration", dur, "--warmup", warm,
             "--stop-when-measured", "--kv-blocks", str(POOL)] + config(label, n))
    r = loomsim.simulate(argv)
    r.update(variant=label, per_replica_rate=per, duration=float(dur), warmup_s=float(warm), pool_blocks=POOL)
    return r


def table(path):
    runs = {}
    for line in open(path):
        r = json.loads(line)
        runs[sweep_scale.key(r)] = r
    print("| workload | replicas | req/s a replica | " + " | ".join(CONFIGS) + " |")
    print("|---|---:|---:|" + "---|" * len(CONFIGS))
    for wl in ("multiturn", "rag"):
        for n, per in sorted({(k[1], k[3]) for k in runs if k[0] == wl}):
            row = []
            for c in CONFIGS:
                r = runs.get((wl, n, c, per))
                row.append("" if r is None else "%.0f%%, TTFT p50 %.0f ms, cached %.2f, read %d/%d" % (
                    100 * r["good_fraction"], r["ttft_ms"]["p50"], r["cached_prompt_fraction"],
                    r["host_tier_hit_blocks"], r["tier_hit_blocks"]))
            print("| %s | %d | %d | %s |" % (wl, n, per, " | ".join(row)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="4,16,64")
    ap.add_argument("--workloads", default="multiturn,rag")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--table", action="store_true", help="only print the table from tiers.jsonl")
    args = ap.parse_args()
    path = os.path.join(OUT, "tiers.jsonl")
    if args.table:
        table(path)
        return
    specs = [(wl, n, c, per) for n in (int(x) for x in args.replicas.split(","))
             for wl in args.workloads.split(",") for c in CONFIGS for per in RATES[wl]]
    sweep_scale.run_pending(path, specs, job, args.jobs)


if __name__ == "__main__":
    main()

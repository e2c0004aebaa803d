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

Past 64 replicas (256, 1,024) the workload grows with the replicas so that
each replica's working set stays what it was at 64: multi-turn
conversations already start at a rate a replica; RAG has 128 documents a
replica (8,192 at 64) and the router's prefix index 4M blocks for each 64
replicas. Those runs take one rate a workload (multi-turn 80, RAG 40 a
replica: the knee at 64), a shorter measured window, and two more
configurations: "@640", the directory's reads shared at 640 GB/s in all
(what gives 64 replicas their 10 GB/s each; every block read twice, the
check and the load: loomsim --tier-total-gbps).

Writes tools/sim/results/tiers.jsonl (runs already there are kept).

  tools/sim/sweep_tiers.py [--replicas 4,16,64] [--jobs 2]
  nice -n 10 tools/sim/sweep_tiers.py --replicas 256 --jobs 1 --wall-limit-s 900
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
# simulated seconds of arrivals and of warm-up (the pools fill in the warm-up at these rates); past 64 the
# warm-up of 64 and a shorter window (a run at 1,024 costs ~0.1 CPU second a simulated replica-second)
TIMING = {4: ("24", "10"), 16: ("16", "6"), 64: ("8", "3"), 256: ("5.5", "3"), 1024: ("4.5", "3")}
# past 64 replicas: the rate a replica, and the configurations (the shared directory at 640 GB/s in all too)
SCALE_RATES = {"multiturn": [80], "rag": [40]}
SCALE_CONFIGS = CONFIGS + ["unified+t1@640", "unified+t2wt@640"]
DIR_TOTAL_GBPS = 640
TIMING_OF = 0  # --timing-of: every run with the simulated times of this many replicas' runs
WALL_LIMIT_S = 0  # --wall-limit-s: a run stops past it, flagged wall_limited (and left out of the table)


def config(label, n):
    """sweep_scale's configurations; a "wt" suffix: the directory tier written through
    (--kv-offloading-write-through: each block as it is computed, not as the tier above gives it up);
    "@G": the directory's reads shared at G GB/s by all replicas."""
    label, _, total = label.partition("@")
    argv = ["--tier-total-gbps", total] if total else []
    if label.endswith("wt"):
        return sweep_scale.config(label[:-2], n) + ["--tier-write-through"] + argv
    return sweep_scale.config(label, n) + argv


def workload(wl, n):
    """sweep_scale's workloads, grown past 64 replicas: RAG 128 documents a replica (8,192 at 64), the
    prefix index 4M blocks for each 64 replicas."""
    argv = list(sweep_scale.BASE + sweep_scale.WORKLOAD[wl])
    if n > 64:
        argv[argv.index("--prefix-index-blocks") + 1] = str((1 << 22) * (n // 64))
        if wl == "rag":
            argv[argv.index("--docs") + 1] = str(128 * n)
    return argv


def job(spec):
    wl, n, label, per = spec
    dur, warm = TIMING[TIMING_OF or n]
    argv = (workload(wl, n) +
            ["--replicas", str(n), "--rate", str(per * n), "--duration", dur, "--warmup", warm,
             "--stop-when-measured", "--kv-blocks", str(POOL), "--wall-limit-s", str(WALL_LIMIT_S)] +
            config(label, n))
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


def scale_table(path):
    """Markdown: at the rates of the runs past 64 (SCALE_RATES), per workload and replica count, each
    configuration's share within the SLO, TTFT p50 and cached share; then the directory's traffic: reads
    (GB/s in all, each block read --tier-read-copies times), the share of its blocks read that another
    replica wrote, writes (GB/s in all), over the simulated time."""
    runs = {}
    for line in open(path):
        r = json.loads(line)
        runs[sweep_scale.key(r)] = r
    mib2 = 2 * 1024 * 1024
    for wl, (per,) in SCALE_RATES.items():
        ns = sorted({k[1] for k in runs if k[0] == wl and k[3] == per})
        print("\n%s at %d req/s a replica: within the SLO, TTFT p50, cached share of the prompts\n" % (wl, per))
        print("| replicas | " + " | ".join(SCALE_CONFIGS) + " |")
        print("|---:|" + "---|" * len(SCALE_CONFIGS))
        for n in ns:
            row = []
            for c in SCALE_CONFIGS:
                r = runs.get((wl, n, c, per))
                row.append("" if r is None else "%s%.0f%%, %.0f ms, %.2f" % (
                    "(stopped) " if r.get("wall_limited") else "", 100 * r["good_fraction"], r["ttft_ms"]["p50"],
                    r["cached_prompt_fraction"]))
            print("| %d | %s |" % (n, " | ".join(row)))
        dirs = [c for c in SCALE_CONFIGS if "t" in c.partition("+")[2]]
        print("\n%s at %d req/s a replica, the directory: reads GB/s in all (x2: check and load), share of the "
              "blocks read another replica wrote, writes GB/s in all, reads' wait for the shared bandwidth "
              "(s a replica)\n" % (wl, per))
        print("| replicas | " + " | ".join(dirs) + " |")
        print("|---:|" + "---|" * len(dirs))
        for n in ns:
            row = []
            for c in dirs:
                r = runs.get((wl, n, c, per))
                if r is None or "tier_write_blocks" not in r:
                    row.append("")
                    continue
                t = r["sim_end_s"]
                row.append("%.0f, %.0f%%, %.0f, %.2f" % (
                    r["tier_hit_blocks"] * 2 * mib2 / t / 1e9,
                    100 * r["tier_hit_blocks_other"] / max(1, r["tier_hit_blocks"]),
                    r["tier_write_blocks"] * mib2 / t / 1e9, r["tier_queue_s"] / n))
            print("| %d | %s |" % (n, " | ".join(row)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="4,16,64")
    ap.add_argument("--workloads", default="multiturn,rag")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--configs", help="only these configurations (comma-separated)")
    ap.add_argument("--rates", help="only these rates a replica (comma-separated)")
    ap.add_argument("--wall-limit-s", type=float, default=0, help="stop a run past this wall time (flagged)")
    ap.add_argument("--timing-of", type=int, default=0,
                    help="simulate the times of the runs at this many replicas (a window the same length as "
                         "theirs), into tiers_windowN.jsonl, N that many")
    ap.add_argument("--table", action="store_true", help="only print the table from tiers.jsonl")
    args = ap.parse_args()
    path = os.path.join(OUT, "tiers_window%d.jsonl" % args.timing_of if args.timing_of else "tiers.jsonl")
    if args.table:
        table(path)
        scale_table(path)
        return
    global WALL_LIMIT_S, TIMING_OF
    WALL_LIMIT_S, TIMING_OF = args.wall_limit_s, args.timing_of
    specs = []
    for n in (int(x) for x in args.replicas.split(",")):
        for wl in args.workloads.split(","):
            configs, rates = (CONFIGS, RATES[wl]) if n <= 64 else (SCALE_CONFIGS, SCALE_RATES[wl])
            specs += [(wl, n, c, per) for c in configs for per in rates
                      if (not args.configs or c in args.configs.split(",")) and
                      (not args.rates or per in [float(x) for x in args.rates.split(",")])]
    sweep_scale.run_pending(path, specs, job, args.jobs)


if __name__ == "__main__":
    main()

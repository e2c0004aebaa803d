#!/usr/bin/python3
"""The scale-out sweep for docs/scale-out.md: goodput under the SLO (TTFT <=
1 s, mean TPOT <= 50 ms a request) of unified replicas against prefill/decode
pools (P:D 1:3, 1:1, 3:1), and of 0, 1 and 2 KV tiers, at 4 to 1,024
replicas, for multi-turn chat and RAG, h200-8b calibration, prefix policy
(lambda 0.02), Poisson arrivals, the rate scaled with the replicas.

Tiers: 1 = the shared directory tier (4 x the pools' blocks, read at
10 GB/s a replica); 2 = a host-memory tier of 120,000 blocks a replica
(~250 GB: 2 MiB blocks) read at 50 GB/s above it; with unified replicas and
with pools 1:1. Decode replicas batch up to 512 sequences.
Rates: five a replica up to 16 replicas, three at 64 (the tiers one); past 64
unified and the best split of 64, each at its capacity there (whether it
holds at scale).
RAG here: 8,192 documents of ~2k tokens (~1M blocks: more than the pools of
16 replicas hold, less than those of 64).

Writes tools/sim/results/scale.jsonl (one line a run; runs already there are
kept, so an interrupted sweep goes on where it stopped).

  tools/sim/sweep_scale.py [--replicas 4,16,64,256,1024] [--workloads multiturn,rag] [--jobs 2]
  tools/sim/sweep_scale.py --table      # the tables of docs/scale-out.md from scale.jsonl
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
KV_BLOCKS = 54000  # h200-8b's pool a replica
BASE = ["--calib", "h200-8b", "--policy", "prefix", "--prefix-lambda", "0.02", "--prefix-index-blocks",
        str(1 << 22), "--seed", "1"]
WORKLOAD = {"multiturn": ["--workload", "multiturn"],
            "rag": ["--workload", "rag", "--docs", "8192"]}
RATES = {"multiturn": [40, 60, 80, 110, 140], "rag": [20, 30, 40, 60, 80]}  # requests/s a replica
# simulated seconds of arrivals and of warm-up: the big runs cost ~40 CPU seconds a simulated second at 1024
TIMING = {4: ("20", "6"), 16: ("16", "5"), 64: ("8", "3"), 256: ("3", "1"), 1024: ("1.2", "0.4")}


def config(label, n):
    """argv of a configuration: "unified" or "pd1:3", then "+t1" or "+t2" for tiers."""
    pools, _, tiers = label.partition("+")
    argv = [] if pools == "unified" else ["--pd", pools[2:], "--decode-max-num-seqs", "512"]
    if tiers in ("t1", "t2"):
        argv += ["--tier-blocks", str(4 * KV_BLOCKS * n), "--tier-gbps", "10"]
    if tiers == "t2":
        argv += ["--host-tier-blocks", "120000", "--host-tier-gbps", "50"]
    return argv


CONFIGS = ["unified", "pd1:3", "pd1:1", "pd3:1", "unified+t1", "unified+t2", "pd1:1+t1", "pd1:1+t2"]


def plan(n, wl):
    """[(configs, rates a replica)] at n replicas: more of them where a run is cheap; past 64 replicas each
    configuration at its capacity at 64 (the highest rate tried there with >= 95% within the SLO), whether
    it holds."""
    pools, tiers = CONFIGS[:4], CONFIGS[4:]
    r = RATES[wl]
    if n <= 16:
        return [(CONFIGS, r)]
    if n <= 64:
        return [(pools, r[1:4]), (tiers, r[2:3])]
    cap = capacity(wl, 64)
    pds = sorted((c for c in pools[1:] if c in cap), key=lambda c: -cap[c])
    configs = ["unified"] + pds[:1]  # the tiers read nothing from 64 replicas up: the pools hold the working set
    return [([c], [cap[c]]) for c in configs if c in cap]


def capacity(wl, n):
    """config -> the highest rate a replica tried at n replicas with >= 95% of requests within the SLO."""
    path = os.path.join(OUT, "scale.jsonl")
    cap = {}
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            if r["workload"] == wl and r["replicas"] == n and r["good_fraction"] >= 0.95:
                cap[r["variant"]] = max(cap.get(r["variant"], 0), r["per_replica_rate"])
    return cap


def job(spec):
    wl, n, label, per = spec
    dur, warm = TIMING[n]
    argv = BASE + WORKLOAD[wl] + ["--replicas", str(n), "--rate", str(per * n), "--duration", dur,
                                  "--warmup", warm, "--stop-when-measured"] + config(label, n)
    r = loomsim.simulate(argv)
    r.update(variant=label, per_replica_rate=per, duration=float(dur), warmup_s=float(warm))
    return r


def key(r):
    return (r["workload"], r["replicas"], r["variant"], r["per_replica_rate"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="4,16,64,256,1024")
    ap.add_argument("--workloads", default="multiturn,rag")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--table", action="store_true", help="only print the tables from scale.jsonl")
    args = ap.parse_args()
    if args.table:
        table(os.path.join(OUT, "scale.jsonl"))
        return
    os.makedirs(OUT, exist_ok=True)
    specs = []
    for n in (int(x) for x in args.replicas.split(",")):
        for wl in args.workloads.split(","):
            specs += [(wl, n, c, per) for configs, rates in plan(n, wl) for c in configs for per in rates]
    run_pending(os.path.join(OUT, "scale.jsonl"), specs, job, args.jobs)


def run_pending(path, specs, job, jobs):
    """Runs the (workload, replicas, variant, rate) specs that path (JSON lines) lacks on a pool of jobs
    processes, the biggest first (the pool does not end on one long run), appending each result."""
    done = {key(json.loads(line)) for line in open(path)} if os.path.exists(path) else set()
    todo = sorted((s for s in specs if s not in done), key=lambda s: -s[1] * s[3])
    print("%d runs to do (%d already in %s)" % (len(todo), len(specs) - len(todo), path), flush=True)
    with multiprocessing.Pool(jobs) as pool, open(path, "a") as f:
        for r in pool.imap_unordered(job, todo):
            f.write(json.dumps(r) + "\n")
            f.flush()
            print("%-9s %5d %-12s %4d/replica: good %5.1f%% (TPOT<=20 ms %5.1f%%)  TTFT p50 %7.1f p99 %8.1f ms  "
                  "TPOT p50 %5.1f p99 %5.1f ms  hits %.2f host %d dir %d" %
                  (r["workload"], r["replicas"], r["variant"], r["per_replica_rate"], 100 * r["good_fraction"],
                   100 * r["good_fraction_tpot_ms"]["20"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"],
                   r["tpot_ms"]["p50"], r["tpot_ms"]["p99"], r["cached_prompt_fraction"],
                   r["host_tier_hit_blocks"], r["tier_hit_blocks"]), flush=True)

def table(path):
    """Markdown: per workload and replica count, the good share (TTFT <= 1 s, mean TPOT <= 50 ms) at each
    rate tried, per configuration, with TPOT p50 (ms) in brackets; then the TPOT <= 20 ms share."""
    runs = {}
    for line in open(path):
        r = json.loads(line)
        runs[key(r)] = r
    print("Capacity: the highest rate tried (req/s a replica) with >= 95% of requests within TTFT 1 s and mean TPOT "
          "50 ms; '<x': not even the lowest rate tried, x; '≥x': the highest rate tried, x.\n")
    print("| workload | replicas | " + " | ".join(CONFIGS) + " |")
    print("|---|---:|" + "---|" * len(CONFIGS))
    for wl in ("multiturn", "rag"):
        for n in sorted({k[1] for k in runs if k[0] == wl}):
            row = []
            for c in CONFIGS:
                rates = sorted((k[3], r["good_fraction"]) for k, r in runs.items() if k[:3] == (wl, n, c))
                ok = [per for per, g in rates if g >= 0.95]
                cell = "" if not rates else "<%d" % rates[0][0] if not ok else \
                    ("≥%d" if max(ok) == rates[-1][0] else "%d") % max(ok)
                row.append(cell + (" (1 rate)" if len(rates) == 1 else ""))
            print("| %s | %d | %s |" % (wl, n, " | ".join(row)))
    for wl in ("multiturn", "rag"):
        for tpot in ("50", "20"):
            print("\n%s, share within TTFT 1 s and mean TPOT %s ms (TPOT p50 ms):\n" % (wl, tpot))
            print("| replicas | req/s a replica | " + " | ".join(CONFIGS) + " |")
            print("|---:|---:|" + "---|" * len(CONFIGS))
            cells = sorted({(k[1], k[3]) for k in runs if k[0] == wl})
            for n, per in cells:
                row = []
                for c in CONFIGS:
                    r = runs.get((wl, n, c, per))
                    row.append("" if r is None else "%.0f%% (%.0f)" % (100 * r["good_fraction_tpot_ms"][tpot],
                                                                       r["tpot_ms"]["p50"]))
                print("| %d | %d | %s |" % (n, per, " | ".join(row)))


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""The router's own cost as replicas grow: router cores needed to route the
request rate that N replicas serve within the SLO (from the simulator's
results, tools/sim/results/results.jsonl), at the measured per-core rates.

Per decision (CPU seconds):
  base      1 / (decisions per core-second measured by bench/bench_router.sh
            with 2 replicas: 9k-16k, docs/benchmarks.md), everything a
            request costs the router;
  + score   per candidate replica, and
  + match   per prompt block and replica (loom_prefix_index_match walks
            every replica for every block), both from bench/bench_route
            (--match-ns, --score-ns: the slopes of its table);
  + probes  Health and Stats every 200 ms and KV events (at most every
            100 ms) from each replica: 20 messages a second a replica, at
            --message-us each (an assumption: not measured yet).
The "linear match" variant is the same with a match of O(blocks + replicas)
(what tools/sim does: a replica's count is set when its bit drops out).
Writes results/router_cost.dat:
  replicas, rate (req/s), cores (base 12.5k/s), cores at 16k/s, at 9k/s, cores with a linear match.

  tools/sim/router_cost.py [--match-ns 0.82] [--score-ns 2.9] [--message-us 20] [--blocks 150]
"""
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results")


def capacity_table(rows):
    """Per (workload, replicas, variant): the highest rate per replica tried at which >= 95% of
    requests met the SLO, the goodput per replica there and the prefix-cache hit rate."""
    best = {}
    for r in rows:
        k = (r["workload"], r["replicas"], r["variant"])
        if r["good_fraction"] >= 0.95 and r["per_replica_rate"] > best.get(k, (0,))[0]:
            best[k] = (r["per_replica_rate"], r["goodput"] / r["replicas"], r["prefix_hit_rate_blocks"])
    print("workload  replicas variant              SLO capacity (req/s a replica)  goodput/replica  hit rate")
    for k in sorted(best):
        print("%-9s %8d %-20s %12g %20.1f %12.2f" % (k + best[k]))


def slo_capacity(rows, n):
    """The highest rate per replica at which the best variant serves >= 95% of requests within the SLO."""
    best = 0.0
    for r in rows:
        if r["replicas"] == n and r["workload"] == "multiturn" and r["good_fraction"] >= 0.95:
            best = max(best, r["per_replica_rate"])
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--match-ns", type=float, default=0.82, help="match cost per block and replica (ns)")
    ap.add_argument("--score-ns", type=float, default=2.9, help="score cost per candidate (ns)")
    ap.add_argument("--message-us", type=float, default=20.0, help="CPU per probe reply or KV event (us)")
    ap.add_argument("--blocks", type=int, default=150, help="prompt blocks per request (multiturn: ~150)")
    ap.add_argument("--per-replica", type=float, default=0,
                    help="req/s per replica (default: the SLO capacity the simulator found)")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(os.path.join(OUT, "results.jsonl"))]
    capacity_table(rows)
    caps = {n: slo_capacity(rows, n) for n in (4, 64, 1024)}
    per = args.per_replica or max(c for c in caps.values())
    print("SLO capacity per replica (multiturn, best policy): %s; using %g req/s a replica" %
          (", ".join("%d: %g" % kv for kv in sorted(caps.items())), per))
    with open(os.path.join(OUT, "router_cost.dat"), "w") as f:
        f.write("# replicas rate cores(12.5k/s) cores(16k/s) cores(9k/s) cores(12.5k/s, linear match) "
                "(multiturn at %g req/s a replica, %d blocks a prompt)\n" % (per, args.blocks))
        n = 4
        while n <= 4096:
            rate = per * n
            extra = (args.score_ns * n + args.match_ns * args.blocks * max(0, n - 2)) * 1e-9
            extra_lin = (args.score_ns * n + args.match_ns * (args.blocks + n)) * 1e-9
            msgs = 20.0 * n * args.message_us * 1e-6

            def cores(base_rate, x):
                return rate * (1.0 / base_rate + x) + msgs
            f.write("%d %.0f %.3f %.3f %.3f %.3f\n" % (n, rate, cores(12500, extra), cores(16000, extra),
                                                     cores(9000, extra), cores(12500, extra_lin)))
            print("%5d replicas  %8.0f req/s  router cores %7.2f (%.2f-%.2f); with a linear match %.2f" %
                  (n, rate, cores(12500, extra), cores(16000, extra), cores(9000, extra), cores(12500, extra_lin)))
            n *= 2


if __name__ == "__main__":
    main()

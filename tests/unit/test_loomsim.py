#!/usr/bin/python3
"""Invariants of the simulator (tools/sim/loomsim.py) that a broken model
would fail: an idle replica's TTFT is its prefill step; the prefix policy
finds more cached blocks than round robin on a shared-prefix workload; every
request finishes exactly once and the KV ledgers balance at the end; the same
seed gives the same run; bursty arrivals raise p99 over Poisson at the same
mean rate; the prefix index matches leading blocks as router/prefix_index.c;
the session policy keeps a conversation on one replica; a shared directory
tier raises the cached share of the prompts, and lowers TTFT when it reads
faster than the replicas compute (raises it when slower)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "sim"))
import loomsim  # noqa: E402

failures = []


def check(cond, what):
    print("%s  %s" % ("ok  " if cond else "FAIL", what))
    if not cond:
        failures.append(what)


def run(argv):
    sim = loomsim.Sim(loomsim.parser().parse_args(argv))
    return sim, sim.run()


def test_idle_ttft_is_prefill():
    for calib, P in (("cpu-tiny", 128), ("h200-8b", 1024)):
        sim, r = run(["--calib", calib, "--replicas", "2", "--workload", "random", "--prompt-len", str(P),
                      "--prompt-len-range", "0", "--output-len", "4", "--output-len-range", "0", "--rate", "1",
                      "--num-requests", "40", "--seed", "3"])
        step = sim.model.time(P, P * (P + 1) // 2, 1, P)  # P fits one step's token budget
        want = (sim.route_lat + sim.req_overhead + step) * 1e3
        got = r["ttft_ms"]["p50"]
        check(abs(got / want - 1) < 0.02,
              "%s: TTFT p50 at 1 req/s %.3f ms = router + request overhead + one prefill step of %d tokens %.3f ms"
              % (calib, got, P, want))


def test_prefix_beats_round_robin():
    base = ["--calib", "cpu-tiny", "--replicas", "4", "--workload", "prefix-rep", "--num-prefixes", "24",
            "--prefix-len", "256", "--suffix-len", "64", "--output-len", "32", "--rate", "40",
            "--num-requests", "400", "--kv-blocks", "256", "--seed", "5"]
    _, p = run(base + ["--policy", "prefix"])
    _, rr = run(base + ["--policy", "round-robin"])
    check(p["prefix_hit_rate_blocks"] > rr["prefix_hit_rate_blocks"] + 0.15,
          "prefix-cache hit rate: prefix %.2f > round-robin %.2f + 0.15" %
          (p["prefix_hit_rate_blocks"], rr["prefix_hit_rate_blocks"]))
    check(p["ttft_ms"]["p50"] < rr["ttft_ms"]["p50"],
          "TTFT p50: prefix %.2f ms < round-robin %.2f ms" % (p["ttft_ms"]["p50"], rr["ttft_ms"]["p50"]))


def test_conservation():
    for pol in loomsim.POLICIES:
        sim, r = run(["--calib", "h200-8b", "--replicas", "8", "--policy", pol, "--workload", "multiturn",
                      "--rate", "600", "--duration", "4", "--kv-blocks", "3000", "--seed", "2"])
        reqs = sim.requests
        once = all(q.t_done is not None and q.t_first is not None and q.t_arrive <= q.t_first <= q.t_done
                   for q in reqs)
        ledgers = all(rep.private == 0 and rep.n_running == 0 and not rep.waiting and not rep.prefilling
                      and rep.n_dec == 0 and rep.sum_ctx == 0 and len(rep.lru) == len(rep.cache)
                      and all(v == 0 for v in rep.cache.values()) and len(rep.cache) <= rep.n_blocks
                      for rep in sim.reps)
        router = not sim.inflight.any() and not sim.prompt_sum.any()
        check(once and r["completed"] == len(reqs) == sim.completed and ledgers and router,
              "%s: %d requests, each finished once; KV ledgers and the router's counts back to zero" %
              (pol, len(reqs)))


def test_sessions():
    sim, r = run(["--calib", "h200-8b", "--replicas", "8", "--policy", "session", "--workload", "multiturn",
                  "--rate", "300", "--duration", "12", "--warmup", "4", "--seed", "6"])
    where = {}
    for q in sim.requests:
        where.setdefault(q.session.id, set()).add(q.rep)
    check(all(len(v) == 1 for v in where.values()) and len(where) > 100,
          "session policy: each of %d conversations stays on one replica" % len(where))
    check(abs(r["offered_rate"] / 300 - 1) < 0.15,
          "multiturn starts in a steady state: %.0f turns/s offered for 300 asked" % r["offered_rate"])


def test_determinism():
    argv = ["--calib", "h200-8b", "--replicas", "16", "--workload", "rag", "--rate", "800", "--duration", "3",
            "--policy", "prefix"]
    _, a = run(argv + ["--seed", "9"])
    _, b = run(argv + ["--seed", "9"])
    _, c = run(argv + ["--seed", "10"])
    check(a == b, "the same seed gives the same results")
    check(a != c, "another seed gives other results")


def test_bursty_p99():
    argv = ["--calib", "h200-8b", "--replicas", "4", "--workload", "random", "--rate", "60", "--duration", "20",
            "--policy", "least-loaded", "--seed", "4"]
    _, poisson = run(argv + ["--burstiness", "1"])
    _, bursty = run(argv + ["--burstiness", "0.1"])
    check(bursty["ttft_ms"]["p99"] > 1.5 * poisson["ttft_ms"]["p99"],
          "TTFT p99 at 60 req/s: gamma k=0.1 %.1f ms > 1.5 x Poisson %.1f ms" %
          (bursty["ttft_ms"]["p99"], poisson["ttft_ms"]["p99"]))


def test_prefix_index():
    ix = loomsim.PrefixIndex(8)
    ix.insert([11, 12, 13], 0)
    ix.insert([11, 12], 2)
    ix.insert([11, 12, 13, 14], 1)
    m = [0] * 4
    ix.match([11, 12, 13, 14, 15], m)
    check(m == [3, 4, 2, 0], "match: leading blocks held per replica %r == [3, 4, 2, 0]" % m)
    ix.remove(12, 1)  # an evicted block ends replica 1's chain there
    m = [0] * 4
    ix.match([11, 12, 13, 14], m)
    check(m == [3, 1, 2, 0], "after replica 1 evicts block 2: %r == [3, 1, 2, 0]" % m)
    ix.insert([21, 22, 23, 24, 25], 3)  # over capacity 8: the least recently touched go first
    check(len(ix.od) == 8 and 11 not in ix.od, "capacity 8 kept, the oldest hash forgotten")


def test_tier():
    base = ["--calib", "h200-8b", "--replicas", "4", "--policy", "prefix", "--workload", "multiturn", "--rate", "150",
            "--duration", "4", "--warmup", "1", "--kv-blocks", "800", "--seed", "3"]
    _, none = run(base)
    sim, fast = run(base + ["--tier-blocks", "200000", "--tier-gbps", "50"])
    _, slow = run(base + ["--tier-blocks", "200000", "--tier-gbps", "1"])
    check(none["tier_hit_blocks"] == 0 and fast["tier_hit_blocks"] > 0 and
          fast["cached_prompt_fraction"] > none["cached_prompt_fraction"] + 0.2,
          "tier: cached prompt share %.2f -> %.2f, %d blocks read" %
          (none["cached_prompt_fraction"], fast["cached_prompt_fraction"], fast["tier_hit_blocks"]))
    check(fast["ttft_ms"]["p50"] < none["ttft_ms"]["p50"] < slow["ttft_ms"]["p50"],
          "TTFT p50: tier at 50 GB/s %.0f ms < none %.0f ms < tier at 1 GB/s %.0f ms" %
          (fast["ttft_ms"]["p50"], none["ttft_ms"]["p50"], slow["ttft_ms"]["p50"]))
    check(len(sim.tier) <= 200000 and fast["completed"] == len(sim.requests),
          "the tier within its bound; every request finished")


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
    if failures:
        print("%d check(s) failed" % len(failures))
        sys.exit(1)
    print("all simulator checks passed")

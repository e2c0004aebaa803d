#!/usr/bin/python3
"""Invariants of the simulator (tools/sim/loomsim.py) that a broken model
would fail: an idle replica's TTFT is its prefill step; the prefix policy
finds more cached blocks than round robin on a shared-prefix workload; every
request finishes exactly once and the KV ledgers balance at the end; the same
seed gives the same run; bursty arrivals raise p99 over Poisson at the same
mean rate; the prefix index matches leading blocks as router/prefix_index.c;
the session policy keeps a conversation on one replica; a shared directory
tier raises the cached share of the prompts, and lowers TTFT when it reads
faster than the replicas compute (raises it when slower); prefill/decode
pools move each request through both and charge the KV transfer to its
TTFT, keep long prefill chunks off the decode replicas, let short prompts
skip the prefill pool; a host tier above the directory tier takes the
pools' evictions and is read first; goodput counts what meets the SLO; the
directory's shared read bandwidth queues reads past it, and the directory
knows which replica wrote a block."""
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


def pd_base(extra):
    return ["--calib", "h200-8b", "--replicas", "4", "--pd", "1:1", "--workload", "random", "--rate", "1",
            "--num-requests", "30", "--seed", "3"] + extra


def test_pd_idle_ttft():
    P = 1024
    sim, r = run(pd_base(["--prompt-len", str(P), "--prompt-len-range", "0", "--output-len", "4",
                          "--output-len-range", "0"]))
    B, m = sim.B, sim.model
    upto = (P - 1) // B
    xfer = sim.a.kv_handshake_ms / 1e3 + upto * sim.block_bytes / sim.link_Bps
    last = P - upto * B  # the decode side computes the last partial block itself
    want = (2 * sim.route_lat + sim.req_overhead + m.time(P, P * (P + 1) // 2, 1, P) + xfer +
            m.time(last, last * (P - last) + last * (last + 1) // 2, 1, P)) * 1e3
    got = r["ttft_ms"]["p50"]
    check(abs(got / want - 1) < 0.02 and xfer > 0.003,
          "pd idle: TTFT p50 %.3f ms = prefill step + handoff + %d blocks at %g GB/s (%.2f ms) + decode step "
          "= %.3f ms" % (got, upto, sim.a.kv_link_gbps, xfer * 1e3, want))
    _, slow = run(pd_base(["--prompt-len", str(P), "--prompt-len-range", "0", "--output-len", "4",
                           "--output-len-range", "0", "--kv-link-gbps", "5"]))
    more = upto * sim.block_bytes * (1 / 5e9 - 1 / sim.link_Bps) * 1e3
    check(abs(slow["ttft_ms"]["p50"] - got - more) < 0.05 * more,
          "pd idle: a 5 GB/s link adds %.2f ms to TTFT (bytes / rate: %.2f ms)" %
          (slow["ttft_ms"]["p50"] - got, more))


def test_pd_pools():
    argv = ["--calib", "h200-8b", "--replicas", "8", "--pd", "3:1", "--workload", "rag", "--policy", "prefix",
            "--prefix-lambda", "0.02", "--rate", "240", "--duration", "6", "--warmup", "2", "--seed", "4"]
    sim, r = run(argv)
    k = sim.n_prefill
    both = all(q.t_handoff is not None and q.t_arrive < q.t_handoff < q.t_first <= q.t_done and q.rep >= k
               for q in sim.requests)
    check(k == 6 and r["handoffs"] == len(sim.requests) and both,
          "pd 3:1 of 8: 6 prefill replicas; each of %d requests prefilled there, then decoded on a decode "
          "replica after it" % len(sim.requests))
    pre = max(rep.max_chunk for rep in sim.reps[:k])
    check(r["decode_max_chunk"] <= sim.B < pre and all(rep.steps for rep in sim.reps),
          "the decode replicas' longest prefill chunk %d <= a block (%d); the prefill replicas' %d" %
          (r["decode_max_chunk"], sim.B, pre))
    check(r["kv_xfer_blocks"] > 0 and r["handoff_to_first_ms_mean"] > sim.a.kv_handshake_ms,
          "%d blocks moved; handoff to first token %.2f ms > the %.1f ms handshake" %
          (r["kv_xfer_blocks"], r["handoff_to_first_ms_mean"], sim.a.kv_handshake_ms))
    # the same decode load a replica: 4 unified replicas against 4 prefill + 4 decode
    argv = argv[:argv.index("--rate")] + ["--rate", "120", "--duration", "6", "--warmup", "2", "--seed", "4"]
    _, pd = run(argv + ["--replicas", "8", "--prefill-replicas", "4"])
    _, uni = run([x for x in argv if x not in ("--pd", "3:1")] + ["--replicas", "4"])
    check(pd["tpot_ms"]["p50"] < 0.7 * uni["tpot_ms"]["p50"],
          "rag at 30 req/s a decode replica: TPOT p50 4+4 pd %.1f ms < 0.7 x 4 unified %.1f ms (no prefill "
          "chunks beside the decodes)" % (pd["tpot_ms"]["p50"], uni["tpot_ms"]["p50"]))


def test_pd_bypass():
    sim, r = run(pd_base(["--prompt-len", "64", "--prompt-len-range", "0.9", "--num-requests", "200",
                          "--rate", "50"]))
    k = sim.n_prefill
    short = [q for q in sim.requests if q.n_prompt < 64]
    long_ = [q for q in sim.requests if q.n_prompt >= 64]
    check(len(short) > 20 and len(long_) > 20 and all(q.t_handoff is None and q.rep >= k for q in short) and
          all(q.t_handoff is not None and q.rep >= k for q in long_) and r["handoffs"] == len(long_),
          "pd: %d prompts under 64 tokens go straight to a decode replica, the %d others through a prefill "
          "replica" % (len(short), len(long_)))
    sim, r = run(pd_base(["--prompt-len", "32", "--prompt-len-range", "0", "--num-requests", "40"]))
    check(r["handoffs"] == 0 and not any(rep.steps for rep in sim.reps[:sim.n_prefill]) and
          r["completed"] == 40, "pd: with every prompt short, the prefill replicas take no step")


def test_pd_conservation():
    for pol in ("prefix", "session", "round-robin"):
        sim, r = run(["--calib", "h200-8b", "--replicas", "8", "--pd", "1:3", "--policy", pol,
                      "--workload", "multiturn", "--rate", "500", "--duration", "4", "--kv-blocks", "3000",
                      "--host-tier-blocks", "500", "--tier-blocks", "20000", "--seed", "2"])
        reqs = sim.requests
        once = all(q.t_done is not None and q.t_handoff is not None and q.t_arrive <= q.t_first <= q.t_done
                   for q in reqs)
        ledgers = all(rep.private == 0 and rep.n_running == 0 and not rep.waiting and not rep.prefilling
                      and rep.n_dec == 0 and len(rep.lru) == len(rep.cache) and len(rep.cache) <= rep.n_blocks
                      and len(rep.host) <= 500 for rep in sim.reps)
        router = not sim.inflight.any() and not sim.prompt_sum.any()
        check(once and r["completed"] == len(reqs) == sim.completed == r["handoffs"] and ledgers and router and
              r["host_tier_hit_blocks"] > 0,
              "pd 1:3, %s, two tiers: %d requests, each handed off and finished once; ledgers and the router's "
              "counts back to zero" % (pol, len(reqs)))


def test_two_tiers():
    sim = loomsim.Sim(loomsim.parser().parse_args(["--replicas", "1", "--kv-blocks", "64", "--host-tier-blocks",
                                                   "2", "--tier-blocks", "10"]))
    rep = sim.reps[0]
    ch = loomsim.Chain(sim.B).extend(7, 8 * sim.B + 3)
    h = ch.hashes
    for x in h[:5]:  # cached, no reference: the pool evicts them oldest first
        rep.cache[x] = 0
        rep.lru[x] = None
    for _ in range(4):
        sim.kv_evict_one(rep)
    check(list(rep.cache) == [h[4]] and list(rep.host) == [h[2], h[3]] and list(sim.tier) == [h[0], h[1]],
          "evictions: the pool's go to host memory (2 blocks), the host's to the directory")
    sim.tier[h[2]] = None  # in both: read from host
    sim.tier[h[5]] = None
    q = loomsim.Request(0, ch, 4, 0.0)
    # no local hit (the pool has h4, not h0); then h0 h1 from the directory, h2 (in both) and h3 from host;
    # the run of tiered blocks ends at h4, in no tier
    ok = sim.try_admit(rep, q)
    check(ok and (q.host_n, q.tier_n) == (2, 2) and q.computed == 4 * sim.B,
          "admission: h0 h1 from the directory, h2 (in both) and h3 from host: host %d, directory %d" %
          (q.host_n, q.tier_n))
    base = ["--calib", "h200-8b", "--replicas", "4", "--policy", "prefix", "--workload", "multiturn", "--rate",
            "150", "--duration", "4", "--warmup", "1", "--kv-blocks", "800", "--seed", "3",
            "--tier-blocks", "200000", "--tier-gbps", "1"]
    _, one = run(base)
    _, two = run(base + ["--host-tier-blocks", "4000"])
    check(two["host_tier_hit_blocks"] > two["tier_hit_blocks"] and two["tier_hit_blocks"] < one["tier_hit_blocks"]
          and two["ttft_ms"]["p50"] < one["ttft_ms"]["p50"],
          "2 tiers: %d host and %d directory blocks read (1 tier: %d directory); TTFT p50 %.0f < %.0f ms" %
          (two["host_tier_hit_blocks"], two["tier_hit_blocks"], one["tier_hit_blocks"], two["ttft_ms"]["p50"],
           one["ttft_ms"]["p50"]))


def test_tier_write_through():
    """Write-through puts a block in the shared tier as it is computed, so a
    second replica hits it while the first still holds it in its pool (with
    write-back the tier only gets what a pool gives up)."""
    for wt in (False, True):
        sim = loomsim.Sim(loomsim.parser().parse_args(["--replicas", "2", "--kv-blocks", "64", "--tier-blocks", "100"]
                                                      + (["--tier-write-through"] if wt else [])))
        a, b = sim.reps
        ch = loomsim.Chain(sim.B).extend(11, 4 * sim.B + 3)
        q = loomsim.Request(0, ch, 4, 0.0)
        check(sim.try_admit(a, q), "admitted on replica 0")
        sim.register(a, q, q.hashes, 4)
        check(list(a.cache) == ch.hashes[:4], "replica 0 computed and cached 4 blocks")
        check((list(sim.tier) == ch.hashes[:4]) == wt, "write-through %s: the tier holds %d blocks" % (wt, len(sim.tier)))
        r = loomsim.Request(1, ch, 4, 0.0)
        check(sim.try_admit(b, r), "admitted on replica 1")
        check(r.tier_n == (4 if wt else 0), "write-through %s: replica 1 read %d blocks from the tier" % (wt, r.tier_n))
    base = ["--calib", "h200-8b", "--replicas", "4", "--policy", "prefix", "--workload", "rag", "--docs", "2000",
            "--rate", "160", "--duration", "4", "--warmup", "1", "--kv-blocks", "3000", "--seed", "3",
            "--tier-blocks", "200000", "--tier-gbps", "10", "--host-tier-blocks", "120000"]
    _, back = run(base)
    _, through = run(base + ["--tier-write-through"])
    check(through["tier_hit_blocks"] > back["tier_hit_blocks"] and
          through["cached_prompt_fraction"] > back["cached_prompt_fraction"],
          "two tiers, write-through: %d directory blocks read, cached %.2f (write-back: %d, %.2f)" %
          (through["tier_hit_blocks"], through["cached_prompt_fraction"], back["tier_hit_blocks"],
           back["cached_prompt_fraction"]))


def test_goodput():
    argv = ["--calib", "h200-8b", "--replicas", "4", "--workload", "rag", "--rate", "260", "--duration", "4",
            "--warmup", "1", "--seed", "5"]
    sim, r = run(argv)
    meas = [q for q in sim.requests if q.measured]
    # the SLO of the run, then one that only TPOT binds (its median): each counted here from the requests' times
    for ttft, tpot in ((1.0, 0.05), (1e6, r["tpot_ms"]["p50"] / 1e3)):
        sim.a.slo_ttft_ms, sim.a.slo_tpot_ms = ttft * 1e3, tpot * 1e3
        got = sim.summary()
        good = sum(1 for q in meas if q.t_first - q.t_arrive <= ttft and
                   (q.n_out <= 1 or (q.t_done - q.t_first) / (q.n_out - 1) <= tpot))
        check(0.1 * len(meas) < good < 0.9 * len(meas) and got["good_fraction"] == good / len(meas) and
              abs(got["goodput"] * (sim.arrival_end - 1) - good) < 1e-6,
              "goodput: %d of %d measured requests within TTFT %g s and mean TPOT %.1f ms, as counted" %
              (good, len(meas), ttft, tpot * 1e3))
    _, tight = run(argv + ["--slo-tpot-ms", "5"])
    _, loose = run(argv + ["--slo-ttft-ms", "1e6", "--slo-tpot-ms", "1e6"])
    check(tight["good_fraction"] == 0 and loose["good_fraction"] == 1 and
          r["good_fraction_tpot_ms"]["50"] == r["good_fraction"],
          "goodput: 0 under a 5 ms TPOT bound, all under none")


def test_shared_directory():
    """--tier-total-gbps: the directory's reads queue for one bandwidth shared by all replicas (each
    block read --tier-read-copies times); the directory remembers which replica wrote a block, so a
    read of another replica's block is counted apart; blocks written are counted once each."""
    sim = loomsim.Sim(loomsim.parser().parse_args(["--replicas", "2", "--calib", "h200-8b", "--tier-blocks", "100",
                                                   "--tier-gbps", "10", "--tier-total-gbps", "8"]))
    bb = sim.block_bytes
    own, shared = 4 * bb / 10e9, 4 * bb * 2 / 8e9  # 4 blocks: 0.84 ms at 10 GB/s, 2.1 ms of the directory
    sim.now = 1.0
    first = sim.dir_read(4)
    second = sim.dir_read(4)  # at the same time, from another replica: after the first
    check(abs(first - shared) < 1e-12 and abs(second - 2 * shared) < 1e-12 and abs(sim.dir_wait_s - (
        first - own) - (second - own)) < 1e-12,
          "shared directory: 4 blocks wait %.2f ms (own rate %.2f ms), the next 4 at once %.2f ms" %
          (first * 1e3, own * 1e3, second * 1e3))
    sim.now = 2.0  # the directory idle again: the replica's own rate binds when the shared one is faster
    sim.dir_block_s = bb * 2 / 1000e9
    check(sim.dir_read(4) == own, "shared directory idle and fast: the replica's own rate")
    free = loomsim.Sim(loomsim.parser().parse_args(["--replicas", "2", "--calib", "h200-8b", "--tier-blocks", "100",
                                                    "--tier-gbps", "10"]))
    free.now = 1.0
    check(free.dir_read(4) == free.dir_read(4) == own and free.dir_wait_s == 0,
          "no --tier-total-gbps: every read at the replica's own rate")
    # who wrote what: replica 0 computes 4 blocks (written through), replica 1 reads them
    sim = loomsim.Sim(loomsim.parser().parse_args(["--replicas", "2", "--kv-blocks", "64", "--tier-blocks", "100",
                                                   "--tier-write-through"]))
    a, b = sim.reps
    ch = loomsim.Chain(sim.B).extend(11, 4 * sim.B + 3)
    q = loomsim.Request(0, ch, 4, 0.0)
    sim.try_admit(a, q)
    sim.register(a, q, q.hashes, 4)
    sim.register(a, q, q.hashes, 4)
    r = loomsim.Request(1, ch, 4, 0.0)
    sim.try_admit(b, r)
    check(sim.tier_writes == 4 and list(sim.tier.values()) == [0] * 4 and sim.tier_hits == 4 and
          sim.tier_hits_other == 4, "written through: 4 blocks written once, by replica 0; replica 1 read "
          "%d of them, %d another's" % (sim.tier_hits, sim.tier_hits_other))
    base = ["--calib", "h200-8b", "--replicas", "4", "--policy", "prefix", "--workload", "multiturn", "--rate", "150",
            "--duration", "4", "--warmup", "1", "--kv-blocks", "800", "--seed", "3", "--tier-blocks", "200000",
            "--tier-gbps", "10"]
    _, wide = run(base)
    _, same = run(base + ["--tier-total-gbps", "1000"])
    _, narrow = run(base + ["--tier-total-gbps", "5"])
    check(wide["tier_queue_s"] == 0 and same["ttft_ms"] == wide["ttft_ms"] and 0 < wide["tier_hit_blocks_other"]
          < wide["tier_hit_blocks"] and wide["tier_write_blocks"] > 0,
          "directory at 1,000 GB/s for 4 replicas: as unbounded (TTFT p50 %.0f ms); %d of %d blocks read "
          "another replica's, %d written" % (wide["ttft_ms"]["p50"], wide["tier_hit_blocks_other"],
                                             wide["tier_hit_blocks"], wide["tier_write_blocks"]))
    check(narrow["tier_queue_s"] > 0 and narrow["ttft_ms"]["p50"] > wide["ttft_ms"]["p50"],
          "directory at 5 GB/s for 4 replicas: reads wait %.1f s in all, TTFT p50 %.0f ms > %.0f ms" %
          (narrow["tier_queue_s"], narrow["ttft_ms"]["p50"], wide["ttft_ms"]["p50"]))


def test_rag_documents_and_wall_limit():
    """RAG's document draw is numpy's choice with the Zipf weights (the same draws, without its per-call
    cost); --wall-limit-s stops a run and says so."""
    import numpy as np
    sim = loomsim.Sim(loomsim.parser().parse_args(["--workload", "rag", "--docs", "500", "--seed", "4"]))
    w = 1.0 / np.arange(1, 501) ** 1.0
    rng = np.random.default_rng(9)
    want = [int(rng.choice(500, p=w / w.sum())) for _ in range(2000)]
    sim.wl.rng = np.random.default_rng(9)
    got = [int(sim.wl.doc_cdf.searchsorted(sim.wl.rng.random(), side="right")) for _ in range(2000)]
    check(got == want, "RAG documents: the draws of numpy's choice (%d distinct of 2000)" % len(set(got)))
    _, r = run(["--calib", "h200-8b", "--replicas", "4", "--workload", "rag", "--rate", "400", "--duration", "30",
                "--wall-limit-s", "1e-9"])
    check(r["wall_limited"] and r["completed"] < r["requests"] < 400 * 30, "--wall-limit-s: stopped early (%d of "
          "%d requests made finished, of 12,000 to come), flagged" % (r["completed"], r["requests"]))


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
    if failures:
        print("%d check(s) failed" % len(failures))
        sys.exit(1)
    print("all simulator checks passed")

#!/usr/bin/python3
"""loomsim: a discrete-event simulator of loom-router in front of N replicas.

What it models, and where the real thing lives:
  router    the four policies of router/router.c with the score of
            router/prefix_index.c (uncached prompt tokens + lambda * (tokens in
            flight + 64 * waiting) + a penalty past 90% KV use; ties to fewer
            requests in flight, then round robin), the prefix index (block
            chain hashes -> replicas, LRU-bounded, fed by routing history and
            by the replicas' KV events), Stats polled every 200 ms (waiting, KV
            use), and a per-decision cost (latency; optionally a finite number
            of router cores, a FIFO queue in front of them).
  replica   coordinator/sched.c: per step all running decodes, then running
            prefills in chunks, then FCFS admissions, within max_batched_tokens
            and max_num_seqs; coordinator/kv_ledger.c: paged KV with an LRU
            prefix cache of full blocks keyed by chain hash (free blocks first,
            then the least recently released cached block is evicted).
  step time t = overhead + f(tokens, attended positions, sequences, KV read),
            from a calibration file (tools/sim/calib/*.json): `fit` (constants
            fitted to steps measured by tools/sim/calibrate.py) or `roofline`
            (max(bytes / bandwidth, FLOPs / peak) for a GPU and a model).
  tier      --tier-blocks: the directory tier below every replica's pool
            (docs/kv-offload.md), shared by all: blocks the pools evict are
            written to it (write-back, LRU of --tier-blocks; with
            --tier-write-through each block as it is computed); an admission
            takes the prompt's blocks after its local hit from the tier while
            it has them (never the block of the last position), and the step
            that admits it is longer by their read (bytes / --tier-gbps).
            --host-tier-blocks: a host-memory tier per replica above it:
            the pool's evictions go to host memory, host memory's to the
            directory; each block after the local hit is read from the
            highest tier holding it (--host-tier-gbps, --tier-gbps).
            --tier-total-gbps: the directory's read bandwidth shared by all
            replicas (one FIFO server, each block read --tier-read-copies
            times: the coordinator's check and the worker's load); a step's
            reads end no earlier than it serves them.
  pools     --pd P:D (or --prefill-replicas): loom-router --pd
            (docs/disaggregation.md): a prompt of at least
            --pd-min-prompt-tokens is prefilled on a prefill replica (the
            policy among them; max_tokens 1 there), then the router picks a
            decode replica (the policy among those), which pulls the prompt's
            full blocks it lacks (a handshake, then bytes / --kv-link-gbps,
            one transfer at a time into a replica) and computes the last
            partial block and the first token itself; shorter prompts go to
            the decode replicas directly.
  goodput   requests with TTFT <= --slo-ttft-ms and mean TPOT (a request's
            time after its first token / tokens after it, as DistServe and
            vLLM's benchmarks) <= --slo-tpot-ms, per second of arrivals.
Differences from the real system, on purpose: a sequence reserves KV blocks
for its whole prompt and max_tokens at admission (the real scheduler grows
and preempts); KV events reach the router at once (real: batched, <= 100 ms);
the router's replica mask is unbounded (real: 64 replicas); a handoff's
blocks move over a link into the decode replica (real: through the directory
tier both sides mount) and its second routing decision costs no router time.

Decodes are simulated per step, not per token: a replica keeps the count and
the summed context of its decoding sequences and a heap of the steps at which
each finishes, so a step costs O(1 + sequences changing state).

  tools/sim/loomsim.py --calib h200-8b --replicas 64 --policy prefix --workload multiturn --rate 400
  tools/sim/loomsim.py --help
"""
import argparse
import collections
import heapq
import json
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WAITING_TOKENS = 64  # LOOM_WAITING_TOKENS in router/prefix_index.h
POLICIES = ("prefix", "round-robin", "least-loaded", "session")


# ---- step-time model ------------------------------------------------------------------------

def load_calib(name):
    path = name if os.path.exists(name) else os.path.join(HERE, "calib", name + ".json")
    with open(path) as f:
        c = json.load(f)
    c["path"] = path
    return c


class StepModel:
    """Seconds one step takes, from a calibration (see the module comment)."""

    def __init__(self, cal):
        self.kind = cal["kind"]
        if self.kind == "fit":
            s = cal["step"]
            self.c0, self.tok, self.attn, self.seq = s["c0_s"], s["c_tok_s"], s["c_attn_s"], s["c_seq_s"]
            self.c0 += cal.get("step_gap_s", 0.0)
        elif self.kind == "roofline":
            g, m = cal["gpu"], cal["model"]
            self.c0 = cal["step_overhead_s"]
            self.bw, self.peak = g["bandwidth_Bps"], g["peak_flops"]
            self.wbytes = m["weight_bytes"]
            self.ftok = m["flops_per_token"]
            self.fattn = m["attn_flops_per_position"]
            self.kvb = m["kv_bytes_per_token"]
        else:
            raise ValueError("unknown calibration kind %r" % self.kind)

    def time(self, tokens, attended, seqs, kv_read):
        if self.kind == "fit":
            return self.c0 + self.tok * tokens + self.attn * attended + self.seq * seqs
        mem = (self.wbytes + self.kvb * kv_read) / self.bw
        flops = (self.ftok * tokens + self.fattn * attended) / self.peak
        return self.c0 + (mem if mem > flops else flops)


# ---- prompts as block-hash chains -----------------------------------------------------------

class Chain:
    """The chain hashes of a token sequence's full blocks, built from segments
    (a segment: `length` tokens of content `seg`, an int; two prompts share a
    block exactly when its pieces are the same, as loom_kv_chain_hash does for
    token ids). Python's hash of a tuple of ints is the same on every run."""
    __slots__ = ("hashes", "pend", "pend_len", "n", "B")

    def __init__(self, B):
        self.B, self.hashes, self.pend, self.pend_len, self.n = B, [], [], 0, 0

    def copy(self):
        c = Chain(self.B)
        c.hashes, c.pend, c.pend_len, c.n = list(self.hashes), list(self.pend), self.pend_len, self.n
        return c

    def extend(self, seg, length):
        off, B = 0, self.B
        self.n += length
        while length > 0:
            take = min(B - self.pend_len, length)
            self.pend.append((seg, off, take))
            self.pend_len += take
            off += take
            length -= take
            if self.pend_len == B:
                parent = self.hashes[-1] if self.hashes else 0
                self.hashes.append(hash((parent, tuple(self.pend))))
                self.pend, self.pend_len = [], 0
        return self


class Request:
    __slots__ = ("id", "session", "chain", "hashes", "n_prompt", "n_out", "t_arrive", "t_first", "t_done",
                 "rep", "cached", "computed", "n_reg", "held", "private", "dec_start", "measured",
                 "queried", "turn", "tier_n", "host_n", "phase", "xfer_upto", "t_handoff")

    def __init__(self, rid, chain, n_out, t, session=None, turn=0):
        self.id, self.chain, self.n_out, self.t_arrive = rid, chain, n_out, t
        self.hashes = chain.hashes
        self.n_prompt = chain.n
        self.session, self.turn = session, turn
        self.t_first = self.t_done = None
        self.rep = -1
        self.cached = self.computed = self.n_reg = self.private = self.dec_start = self.queried = 0
        self.tier_n = self.host_n = 0
        self.phase = 0      # 0 unified, 1 on a prefill replica, 2 on a decode replica after its prefill
        self.xfer_upto = 0  # phase 2: the prompt's blocks [0, xfer_upto) came over the KV link
        self.t_handoff = None  # when its prefill finished on the prefill replica
        self.held = []
        self.measured = True


# ---- workloads ------------------------------------------------------------------------------

class Workload:
    """Makes requests. Segment ids: shared content (documents, system prompts,
    prefixes) below 1e9, content of one request (suffixes, questions, user
    turns, answers) from 1e9 up."""

    def __init__(self, args, rng, B):
        self.a, self.rng, self.B = args, rng, B
        self.next_seg = 10 ** 9
        self.shared = {}  # shared segment -> its Chain (built once)
        if args.workload == "rag":
            w = 1.0 / np.arange(1, args.docs + 1) ** args.zipf
            # rng.choice(docs, p=w / w.sum()) without its per-call checks and cumsum (the same draws:
            # numpy's choice takes one random() and searches the normalised cumulative sum)
            cdf = np.cumsum(w / w.sum())
            self.doc_cdf = cdf / cdf[-1]
            self.doc_len = [self.length(args.doc_len, args.doc_len_range) for _ in range(args.docs)]

    def length(self, mean, frac):
        if frac <= 0:
            return max(1, int(mean))
        lo, hi = int(mean * (1 - frac)), int(mean * (1 + frac))
        return max(1, int(self.rng.integers(lo, hi + 1)))

    def fresh(self):
        self.next_seg += 1
        return self.next_seg

    def shared_chain(self, seg, n):
        c = self.shared.get(seg)
        if c is None:
            c = self.shared[seg] = Chain(self.B).extend(seg, n)
        return c.copy()

    def one_shot(self):
        """(chain, n_out) of a request with no session."""
        a = self.a
        if a.workload == "random":
            ch = Chain(self.B).extend(self.fresh(), self.length(a.prompt_len, a.prompt_len_range))
            return ch, self.length(a.output_len, a.output_len_range)
        if a.workload == "prefix-rep":  # loom bench --dataset-name prefix_repetition
            p = int(self.rng.integers(0, a.num_prefixes))
            ch = self.shared_chain(p, a.prefix_len)
            if a.suffix_len:
                ch.extend(self.fresh(), a.suffix_len)
            return ch, a.output_len
        if a.workload == "rag":  # a document (Zipf popularity) and a short question
            d = int(self.doc_cdf.searchsorted(self.rng.random(), side="right"))
            ch = self.shared_chain(d, self.doc_len[d])
            ch.extend(self.fresh(), self.length(a.question_len, 0.5))
            return ch, self.length(a.output_len, a.output_len_range)
        raise ValueError(a.workload)


class Session:
    """A multi-turn conversation: a shared system prompt, then user turns and
    the answers to them; each turn's prompt is the whole history."""
    __slots__ = ("id", "chain", "turns_left", "turn", "last")

    def __init__(self, sid, chain, turns):
        self.id, self.chain, self.turns_left, self.turn, self.last = sid, chain, turns, 0, 0.0


# ---- the prefix index (router/prefix_index.c) -----------------------------------------------

class PrefixIndex:
    """Block hash -> bit mask of replicas, at most `capacity` hashes, the least
    recently inserted forgotten first."""

    def __init__(self, capacity):
        self.cap = capacity
        self.od = collections.OrderedDict()

    def insert(self, hashes, rep):
        od, bit = self.od, 1 << rep
        get, touch = od.get, od.move_to_end
        for h in hashes:
            m = get(h)
            if m is None:
                if len(od) >= self.cap:
                    od.popitem(last=False)
                od[h] = bit
            else:
                if not m & bit:
                    od[h] = m | bit
                touch(h)

    def remove(self, h, rep):
        m = self.od.get(h)
        if m is not None:
            m &= ~(1 << rep)
            if m:
                self.od[h] = m
            else:
                del self.od[h]

    def match(self, hashes, match):
        """match[r] = leading blocks of hashes replica r holds (match zeroed by the caller)."""
        od = self.od
        alive = None
        for k, h in enumerate(hashes):
            m = od.get(h, 0)
            new = m if alive is None else alive & m
            died = alive & ~new if alive is not None else 0
            while died:
                low = died & -died
                match[low.bit_length() - 1] = k
                died ^= low
            alive = new
            if not alive:
                return
        while alive:
            low = alive & -alive
            match[low.bit_length() - 1] = len(hashes)
            alive ^= low


# ---- a replica ------------------------------------------------------------------------------

class Replica:
    __slots__ = ("idx", "waiting", "prefilling", "n_dec", "sum_ctx", "sum_start", "finish", "step",
                 "busy", "chunks", "step_dec", "cache", "lru", "private", "n_blocks", "n_running",
                 "busy_s", "steps", "tokens", "host", "max_chunk", "link_free", "max_seqs")

    def __init__(self, idx, n_blocks):
        self.idx = idx
        self.waiting = collections.deque()
        self.prefilling = []          # running, prompt not all computed (admission order)
        self.n_dec = 0                # running decodes
        self.sum_ctx = 0              # their context lengths at the next step
        self.sum_start = 0            # sum of their dec_start
        self.finish = []              # heap (finish step, id, request)
        self.step = 0                 # steps completed
        self.busy = False
        self.chunks = []              # (request, tokens) of the step in progress
        self.step_dec = 0             # decodes of the step in progress
        self.cache = {}               # chain hash -> references (prefix cache, held or not)
        self.lru = collections.OrderedDict()  # cached hashes with no reference, oldest first
        self.private = 0              # blocks held outside the cache (reserved or not registered)
        self.n_blocks = n_blocks
        self.n_running = 0
        self.busy_s = 0.0
        self.steps = 0
        self.tokens = 0
        self.host = None              # the host-memory tier: chain hash -> None, LRU first
        self.max_chunk = 0            # the longest prefill chunk a step of this replica carried
        self.link_free = 0.0          # when its KV link (into it) is free
        self.max_seqs = 0             # running sequences it takes at most

    def free_blocks(self):
        return self.n_blocks - self.private - len(self.cache)

    def used_blocks(self):
        return self.private + len(self.cache) - len(self.lru)


# ---- the simulation -------------------------------------------------------------------------

EV_ARRIVE, EV_AT_REPLICA, EV_STEP_END, EV_POLL, EV_ROUTED = range(5)


def pd_split(spec, n, n_prefill):
    """Prefill replicas of n for --pd P:D (or --prefill-replicas); 0: unified."""
    if n_prefill:
        k = n_prefill
    elif spec:
        p, _, d = spec.partition(":")
        p, d = float(p), float(d)
        k = int(round(n * p / (p + d)))
    else:
        return 0
    if n < 2:
        raise ValueError("prefill/decode pools need at least 2 replicas")
    return min(max(k, 1), n - 1)


class Sim:
    def __init__(self, args):
        self.a = args
        cal = load_calib(args.calib)
        self.cal = cal
        rc = cal["replica"]
        self.B = args.block_size or rc["block_size"]
        self.max_seqs = args.max_num_seqs or rc["max_num_seqs"]
        self.max_tokens = max(args.max_batched_tokens or rc["max_batched_tokens"], self.max_seqs)
        self.max_len = args.max_model_len or rc["max_model_len"]
        n_blocks = args.kv_blocks or rc["kv_blocks"]
        self.max_len = min(self.max_len, n_blocks * self.B)  # a longer request could never be admitted
        self.model = StepModel(cal)
        self.req_overhead = cal.get("request_overhead_s", 0.0) if args.request_overhead_ms is None \
            else args.request_overhead_ms / 1e3
        rt = cal.get("router", {})
        self.route_lat = (args.router_latency_ms if args.router_latency_ms is not None
                          else rt.get("added_latency_s", 0.0005) * 1e3) / 1e3
        self.route_rate = args.router_decisions_per_core_s or rt.get("decisions_per_core_s", 12500.0)
        self.route_service = 1.0 / self.route_rate
        self.router_free = [0.0] * args.router_cores if args.router_cores > 0 else None
        self.host_cores = args.host_cores if args.host_cores is not None else cal.get("host_cores", 0)
        self.n_busy = 0
        self.rng = np.random.default_rng(args.seed)
        # the shared directory tier: chain hash -> the replica that wrote it last, least recently used first
        self.tier = collections.OrderedDict() if args.tier_blocks > 0 else None
        kv_tok = cal.get("model", {}).get("kv_bytes_per_token", 0)
        self.tier_block_s = (args.tier_block_bytes or kv_tok * self.B) / (args.tier_gbps * 1e9)
        self.tier_hits = self.tier_reads_s = 0
        self.tier_hits_other = 0   # blocks read from the directory that another replica wrote
        self.tier_writes = 0       # blocks written to the directory (a file not there yet)
        # the directory's read bandwidth shared by all replicas (--tier-total-gbps; 0: none): one FIFO
        # server, each block read --tier-read-copies times (the coordinator's check, the worker's load)
        self.dir_free = 0.0
        self.dir_wait_s = 0.0
        self.query_blocks = self.hit_blocks = 0
        self.block_bytes = args.tier_block_bytes or kv_tok * self.B
        self.dir_block_s = self.block_bytes * args.tier_read_copies / (args.tier_total_gbps * 1e9) \
            if args.tier_total_gbps > 0 else 0.0
        # the host-memory tier of each replica, above the directory tier
        self.host_block_s = self.block_bytes / (args.host_tier_gbps * 1e9)
        self.host_hits = 0
        # prefill/decode pools: replicas [0, n_prefill) prefill, the rest decode
        N = args.replicas
        self.n_prefill = pd_split(args.pd, N, args.prefill_replicas)
        self.link_Bps = args.kv_link_gbps * 1e9
        self.xfer_blocks = self.xfer_s = self.handoffs = 0
        self.reps = [Replica(i, n_blocks) for i in range(N)]
        for rep in self.reps:
            rep.max_seqs = args.decode_max_num_seqs if self.n_prefill and rep.idx >= self.n_prefill and \
                args.decode_max_num_seqs else self.max_seqs
            if args.host_tier_blocks > 0:
                rep.host = collections.OrderedDict()
        self.index = PrefixIndex(args.prefix_index_blocks) if args.policy == "prefix" else None
        # the router's view of each replica (numpy, for the score over N replicas)
        self.inflight = np.zeros(N, np.int64)
        self.prompt_sum = np.zeros(N, np.int64)   # prompt tokens in flight
        self.n_dec = np.zeros(N, np.int64)        # decoding requests (for generated tokens)
        self.sum_start = np.zeros(N, np.int64)
        self.step_arr = np.zeros(N, np.int64)
        self.waiting_seen = np.zeros(N, np.int64)  # from the last Stats poll
        self.kv_seen = np.zeros(N, np.float64)
        self.rr = 0
        self.sessions_map = {}
        self.events = []
        self.seq = 0
        self.now = 0.0
        self.wl = Workload(args, self.rng, self.B)
        self.requests = []
        self.next_id = 0
        self.routed_hit_blocks = 0
        self.routed_query_blocks = 0
        self.decisions = 0
        self.router_wait = 0.0
        self.index_ops = 0

    # -- event queue --
    def push(self, t, kind, obj):
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    # -- arrivals --
    def gaps(self, n, rate):
        k = self.a.burstiness
        if math.isinf(rate):
            return np.zeros(n)
        return self.rng.gamma(k, 1.0 / (rate * k), n)

    def schedule_arrivals(self):
        a = self.a
        if a.workload == "multiturn":
            mean_turns = (a.turns_min + a.turns_max) / 2.0
            srate = a.rate / mean_turns  # sessions/s: turns/s = rate in the steady state
            n_sessions = a.num_requests // max(1, int(round(mean_turns))) if a.num_requests else \
                int(a.duration * srate)
            t = np.cumsum(self.gaps(n_sessions, srate))
            t -= t[0] if len(t) else 0
            sid = 0
            if a.steady_start:
                sid = self.prepopulate(srate)
            for ts in t:
                self.push(float(ts), EV_ARRIVE, self.new_session(sid, 0))
                sid += 1
            self.arrival_end = float(t[-1]) if len(t) else 0.0
            return
        n = a.num_requests or int(a.duration * a.rate)
        t = np.concatenate([[0.0], np.cumsum(self.gaps(n - 1, a.rate))])
        if a.bench_span and n > 1 and t[-1] > 0 and not math.isinf(a.rate):
            t *= (n / a.rate) / t[-1]  # as loom bench does: the run spans n / rate
        for ts in t:
            self.push(float(ts), EV_ARRIVE, None)
        self.arrival_end = float(t[-1])

    def new_session(self, sid, done_turns, turns=0):
        """A conversation on one of the shared system prompts, with done_turns turns behind it
        (their content is no one else's, and no cache holds it)."""
        a = self.a
        ch = self.wl.shared_chain(10 ** 6 + int(self.rng.integers(0, a.system_prompts)), a.system_len)
        turns = turns or int(self.rng.integers(a.turns_min, a.turns_max + 1))
        for _ in range(done_turns):
            ch.extend(self.wl.fresh(), self.wl.length(a.user_len, a.user_len_range))
            ch.extend(self.wl.fresh(), self.wl.length(a.output_len, a.output_len_range))
        s = Session(sid, ch, turns - done_turns)
        s.turn = done_turns
        return s

    def prepopulate(self, srate):
        """The conversations a steady state has going at time 0: sessions started in the past
        (same arrivals, same gaps between turns); those not over by 0 come in at their next turn,
        with the turns before it as their history (taken as answered). Without them the load would
        ramp up over a conversation's whole length. Returns the next session id."""
        a = self.a
        past = a.turns_max * a.think_s * 8.0
        n = int(past * srate * 1.2) + 10
        starts = -np.cumsum(self.gaps(n, srate))
        sid = 0
        for ts in starts[starts > -past]:
            turns = int(self.rng.integers(a.turns_min, a.turns_max + 1))
            t, k = float(ts), 0
            while k < turns and t < 0:
                t += self.turn_gap()
                k += 1
            if k < turns and t >= 0:
                s = self.new_session(sid, k, turns)
                s.last = t
                self.push(t, EV_ARRIVE, s)
                sid += 1
        return sid

    def turn_gap(self):
        return float(self.rng.exponential(self.a.think_s)) if self.a.think_s > 0 else 0.0

    def new_request(self, t, session=None):
        if session is None:
            ch, n_out = self.wl.one_shot()
            q = Request(self.next_id, ch, n_out, t)
        else:
            a = self.a
            ch = session.chain.extend(self.wl.fresh(), self.wl.length(a.user_len, a.user_len_range))
            n_out = self.wl.length(a.output_len, a.output_len_range)
            q = Request(self.next_id, ch.copy(), n_out, t, session, session.turn)
            session.turns_left -= 1
            session.turn += 1
            session.last = t
        # a prompt longer than the model takes is cut from the front of what is left (never happens
        # within the defaults; counted as is)
        if q.n_prompt + q.n_out > self.max_len:
            q.n_out = max(1, self.max_len - q.n_prompt)
            if q.n_prompt + q.n_out > self.max_len:
                return None
        self.next_id += 1
        q.measured = self.a.warmup <= t <= self.arrival_end
        self.meas_left += q.measured
        self.requests.append(q)
        return q

    # -- the router --
    def pool(self, q):
        """The replicas [lo, hi) q goes to next: all (unified); the prefill pool, for a prompt of at least
        --pd-min-prompt-tokens not yet prefilled; else the decode pool (as loom-router --pd)."""
        k = self.n_prefill
        if not k:
            return 0, len(self.reps)
        if q.phase == 0 and q.n_prompt >= self.a.pd_min_prompt_tokens:
            q.phase = 1
        return (0, k) if q.phase == 1 else (k, len(self.reps))

    def route(self, q):
        """The policy among the replicas of q's pool (the router's policy, over the pool's replicas)."""
        a = self.a
        lo, hi = self.pool(q)
        N = hi - lo
        rr = self.rr % N
        self.rr += 1
        self.decisions += 1
        pol = a.policy
        if pol == "round-robin":
            return lo + rr
        skey = (q.session.id, q.phase) if q.session is not None else None
        if pol == "session" and skey is not None:
            r = self.sessions_map.get(skey)
            if r is not None:
                return r
        if pol in ("least-loaded", "session"):
            load = self.inflight[lo:hi] + self.waiting_seen[lo:hi]
            r = lo + self.first_min(load, rr)
            if pol == "session" and skey is not None:
                self.sessions_map[skey] = r
            return r
        # prefix
        hashes = q.hashes
        match = np.zeros(len(self.reps), np.int64)
        if hashes:
            self.index.match(hashes, match)
        match = match[lo:hi]
        n = q.n_prompt
        cached = np.minimum(match * self.B, n)
        gen = self.n_dec[lo:hi] * (self.step_arr[lo:hi] + 1) - self.sum_start[lo:hi]
        load = self.prompt_sum[lo:hi] + gen + WAITING_TOKENS * self.waiting_seen[lo:hi]
        cost = (n - cached) + a.prefix_lambda * load
        kv = self.kv_seen[lo:hi]
        over = kv > 0.9
        if over.any():
            cost = cost + np.where(over, n * 10.0 * (kv - 0.9), 0.0)
        best = cost.min()
        cand = cost == best
        if cand.sum() > 1:  # ties: fewer in flight, then round robin from rr
            infl = np.where(cand, self.inflight[lo:hi], np.iinfo(np.int64).max)
            k = self.first_min(infl, rr)
        else:
            k = int(np.argmax(cand))
        self.routed_hit_blocks += int(match[k])
        self.routed_query_blocks += len(hashes)
        r = lo + k
        if hashes:  # routing history
            self.index.insert(hashes, r)
        return r

    @staticmethod
    def first_min(v, rr):
        """The first index at or after rr (circularly) where v is smallest."""
        m = v.min()
        idx = np.flatnonzero(v == m)
        after = idx[idx >= rr]
        return int(after[0]) if len(after) else int(idx[0])

    def arrive(self, q):
        """q reaches the router: a decision (now, or after the router's queue)."""
        if self.router_free is None:
            self.routed(q, self.now)
            return
        free = heapq.heappop(self.router_free)
        start = max(self.now, free)
        end = start + self.route_service
        heapq.heappush(self.router_free, end)
        self.router_wait += start - self.now
        self.push(end, EV_ROUTED, q)

    def routed(self, q, t):
        r = self.route(q)
        q.rep = r
        self.inflight[r] += 1
        self.prompt_sum[r] += q.n_prompt
        lat = max(0.0, self.route_lat - (self.route_service if self.router_free is not None else 0.0))
        self.push(t + lat + self.req_overhead, EV_AT_REPLICA, q)

    # -- KV ledger of one replica --
    def kv_evict_one(self, rep):
        h, _ = rep.lru.popitem(last=False)
        evicted = h
        del rep.cache[h]
        host = rep.host
        if host is not None:  # write-back to the replica's host memory; what it evicts goes down
            host[h] = None
            host.move_to_end(h)
            if len(host) <= self.a.host_tier_blocks:
                h = None
            else:
                h, _ = host.popitem(last=False)
        t = self.tier
        if t is not None and h is not None:  # write-back: the block goes to the shared tier
            if h not in t:
                self.tier_writes += 1
            t[h] = rep.idx
            t.move_to_end(h)
            if len(t) > self.a.tier_blocks:
                t.popitem(last=False)
        if self.index is not None:
            self.index.remove(evicted, rep.idx)

    def try_admit(self, rep, q):
        """Prefix lookup and the reservation of q's blocks; False: no room (q waits)."""
        B = self.B
        cache = rep.cache
        hits = 0
        pinned_lru = 0
        for h in q.hashes:
            ref = cache.get(h)
            if ref is None:
                break
            hits += 1
            if ref == 0:
                pinned_lru += 1
        tier_n = host_n = 0
        t, host = self.tier, rep.host
        upto = min((q.n_prompt - 1) // B, len(q.hashes))  # never the last position's block
        if q.phase == 2:  # the blocks after the local hit came over the KV link
            tier_n = max(0, q.xfer_upto - hits)
        elif t is not None or host is not None:  # the tiers' run after the local hit, each block
            while hits + host_n + tier_n < upto:  # from the highest tier holding it
                h = q.hashes[hits + host_n + tier_n]
                if host is not None and h in host:
                    host_n += 1
                elif t is not None and h in t:
                    tier_n += 1
                else:
                    break
        n_out = 1 if q.phase == 1 else q.n_out  # the prefill side runs with max_tokens 1
        need = -(-(q.n_prompt + n_out) // B) - hits
        if need > rep.free_blocks() + len(rep.lru) - pinned_lru:
            return False
        if q.phase != 2:
            for h in q.hashes[hits:hits + host_n + tier_n]:
                if host is not None and h in host:
                    host.move_to_end(h)
                else:
                    if t[h] != rep.idx:
                        self.tier_hits_other += 1
                    t.move_to_end(h)
            q.tier_n, q.host_n = tier_n, host_n
            self.tier_hits += tier_n
            self.host_hits += host_n
        tier_n += host_n
        for h in q.hashes[:hits]:
            ref = cache[h]
            if ref == 0:
                del rep.lru[h]
            cache[h] = ref + 1
        q.held = list(q.hashes[:hits])
        while rep.free_blocks() < need:
            self.kv_evict_one(rep)
        rep.private += need
        q.private = need
        q.n_reg = hits
        q.computed = min((hits + tier_n) * B, q.n_prompt - 1)  # the last prompt token always runs
        if not q.queried:
            q.queried = 1
            q.cached = q.computed if hits + tier_n else 0
            self.query_blocks += q.n_prompt // B
            self.hit_blocks += hits
        return True

    def register(self, rep, q, hashes, upto):
        """Registers q's full blocks hashes[q.n_reg:upto] in the prefix cache."""
        cache = rep.cache
        new = []
        for h in hashes[q.n_reg:upto]:
            if h in cache or q.private <= 0:
                continue  # the same content is cached already: this block stays private
            cache[h] = 1
            q.private -= 1
            rep.private -= 1
            q.held.append(h)
            new.append(h)
        q.n_reg = max(q.n_reg, upto)
        t = self.tier
        if t is not None and self.a.tier_write_through:  # each block to the shared tier as it is computed
            for h in new:
                if h not in t:
                    self.tier_writes += 1
                t[h] = rep.idx
                t.move_to_end(h)
            while len(t) > self.a.tier_blocks:
                t.popitem(last=False)
        if new and self.index is not None:
            self.index.insert(new, rep.idx)  # a KV event

    def release(self, rep, q):
        """q's blocks back to the ledger: in table order, as sched.c's seq_free does, so the first
        block of a chain becomes the least recently used (--release-reverse: the last first)."""
        cache, lru = rep.cache, rep.lru
        for h in (reversed(q.held) if self.a.release_reverse else q.held):
            ref = cache[h] - 1
            cache[h] = ref
            if not ref:
                lru[h] = None
        q.held = None
        rep.private -= q.private
        q.private = 0

    # -- steps --
    def maybe_start(self, rep):
        if rep.busy:
            return
        budget = self.max_tokens - rep.n_dec
        tokens = seqs = rep.n_dec
        attended = kv_read = rep.sum_ctx
        chunks = []
        for q in rep.prefilling:
            if budget <= 0:
                break
            take = min(q.n_prompt - q.computed, budget)
            s = q.computed
            chunks.append((q, take))
            budget -= take
            tokens += take
            seqs += 1
            attended += take * s + take * (take + 1) // 2
            kv_read += s + take
        loads = dir_n = 0
        while rep.waiting and budget > 0 and rep.n_running < rep.max_seqs:
            q = rep.waiting[0]
            if not self.try_admit(rep, q):
                break  # strict FCFS: the head waits for memory
            if q.phase != 2:
                loads += q.host_n * self.host_block_s
                dir_n += q.tier_n
            rep.waiting.popleft()
            rep.prefilling.append(q)
            rep.n_running += 1
            take = min(q.n_prompt - q.computed, budget)
            s = q.computed
            chunks.append((q, take))
            budget -= take
            tokens += take
            seqs += 1
            attended += take * s + take * (take + 1) // 2
            kv_read += s + take
        if tokens == 0:
            return
        if dir_n:
            loads += self.dir_read(dir_n)
        dt = self.model.time(tokens, attended, seqs, kv_read) + loads
        self.tier_reads_s += loads
        if self.host_cores:
            self.n_busy += 1
            dt *= max(1.0, self.n_busy / self.host_cores)
        rep.busy = True
        rep.chunks = chunks
        rep.step_dec = rep.n_dec
        rep.busy_s += dt
        rep.steps += 1
        rep.tokens += tokens
        self.push(self.now + dt, EV_STEP_END, rep)

    def dir_read(self, n):
        """Seconds a step waits for n blocks from the directory: at the replica's --tier-gbps; with
        --tier-total-gbps, no earlier than the shared directory serves them after the reads before
        (one FIFO server for all replicas, each block read --tier-read-copies times)."""
        own = n * self.tier_block_s
        if not self.dir_block_s:
            return own
        self.dir_free = max(self.dir_free, self.now) + n * self.dir_block_s
        wait = self.dir_free - self.now
        if wait > own:
            self.dir_wait_s += wait - own
            return wait
        return own

    def step_end(self, rep):
        now = self.now
        rep.busy = False
        if self.host_cores:
            self.n_busy -= 1
        rep.step += 1
        self.step_arr[rep.idx] = rep.step
        B = self.B
        # the decodes of this step: every context grows by one
        rep.sum_ctx += rep.step_dec
        # finishes
        fh = rep.finish
        while fh and fh[0][0] <= rep.step:
            _, _, q = heapq.heappop(fh)
            rep.n_dec -= 1
            rep.sum_start -= q.dec_start
            rep.sum_ctx -= q.n_prompt + 1 + (rep.step - q.dec_start)
            self.done(rep, q)
        # prefill chunks
        for q, take in rep.chunks:
            if take > rep.max_chunk:
                rep.max_chunk = take
            q.computed += take
            self.register(rep, q, q.hashes, q.computed // B)
            if q.computed >= q.n_prompt:
                rep.prefilling.remove(q)
                if q.phase == 1:
                    self.handoff(rep, q)
                    continue
                q.t_first = now
                if q.n_out <= 1:
                    self.done(rep, q)
                else:
                    q.dec_start = rep.step
                    rep.n_dec += 1
                    rep.sum_ctx += q.n_prompt + 1
                    rep.sum_start += rep.step
                    heapq.heappush(fh, (rep.step + q.n_out - 1, q.id, q))
        rep.chunks = []
        self.n_dec[rep.idx] = rep.n_dec
        self.sum_start[rep.idx] = rep.sum_start
        self.maybe_start(rep)

    def handoff(self, rep, q):
        """q's prefill is done on a prefill replica: it leaves it (its blocks stay cached there), the
        router picks a decode replica, which pulls the prompt's full blocks it lacks over its KV link
        (a handshake, then bytes / --kv-link-gbps, one transfer at a time into a replica)."""
        now = self.now
        q.t_handoff = now
        rep.n_running -= 1
        self.release(rep, q)
        r = rep.idx
        self.inflight[r] -= 1
        self.prompt_sum[r] -= q.n_prompt
        self.handoffs += 1
        q.phase = 2
        d = self.route(q)
        q.rep = d
        self.inflight[d] += 1
        self.prompt_sum[d] += q.n_prompt
        dst = self.reps[d]
        upto = min((q.n_prompt - 1) // self.B, len(q.hashes))
        have = 0
        for h in q.hashes[:upto]:
            if h not in dst.cache:
                break
            have += 1
        q.xfer_upto = upto
        n = upto - have
        start = max(now + self.route_lat + self.a.kv_handshake_ms / 1e3, dst.link_free)
        end = start + n * self.block_bytes / self.link_Bps
        if n:
            dst.link_free = end
        self.xfer_blocks += n
        self.xfer_s += end - now
        self.push(end, EV_AT_REPLICA, q)

    def done(self, rep, q):
        assert q.t_done is None, "request %d finished twice" % q.id
        q.t_done = self.now
        rep.n_running -= 1
        # the answer's full blocks are registered too (the next turn of a conversation finds them)
        full = q.chain.copy().extend(self.wl.fresh(), q.n_out)
        q.computed = full.n
        self.register(rep, q, full.hashes, (q.n_prompt + q.n_out - 1) // self.B)
        self.release(rep, q)
        q.chain = q.hashes = None  # what is left of a finished request: its times and counts
        r = rep.idx
        self.inflight[r] -= 1
        self.prompt_sum[r] -= q.n_prompt
        self.completed += 1
        self.meas_left -= q.measured
        s = q.session
        if s is not None:
            s.chain = full
            if s.turns_left > 0:  # the next turn: a gap after this one came, and never before its answer
                self.push(max(self.now, s.last + self.turn_gap()), EV_ARRIVE, s)

    def poll(self, _):
        for rep in self.reps:
            self.waiting_seen[rep.idx] = len(rep.waiting)
            self.kv_seen[rep.idx] = rep.used_blocks() / rep.n_blocks
        self.push(self.now + self.a.probe_interval_ms / 1e3, EV_POLL, None)

    # -- the loop --
    def run(self):
        self.completed = 0
        self.query_blocks = self.hit_blocks = 0
        self.n_made = 0
        self.meas_left = 0
        self.wall_limited = False
        wall_end = time.monotonic() + self.a.wall_limit_s if self.a.wall_limit_s > 0 else math.inf
        self.schedule_arrivals()
        self.push(0.0, EV_POLL, None)
        ev = self.events
        pop = heapq.heappop
        while ev:
            t, _, kind, obj = pop(ev)
            self.now = t
            if kind == EV_STEP_END:
                self.step_end(obj)
            elif kind == EV_AT_REPLICA:
                rep = self.reps[obj.rep]
                rep.waiting.append(obj)
                self.maybe_start(rep)
            elif kind == EV_ARRIVE:
                q = self.new_request(t, obj)
                if q is not None:
                    self.n_made += 1
                    self.arrive(q)
            elif kind == EV_ROUTED:
                self.routed(obj, t)
            elif kind == EV_POLL:
                if not ev:
                    break  # nothing else left to happen
                if self.a.stop_when_measured and self.meas_left == 0 and t > self.arrival_end:
                    break  # what comes after cannot change a measured request
                if time.monotonic() > wall_end:
                    self.wall_limited = True  # measured requests not finished are left out: flagged
                    break
                self.poll(obj)
        return self.summary()

    # -- results --
    def summary(self):
        a = self.a
        done = [q for q in self.requests if q.t_done is not None]
        meas = [q for q in done if q.measured]
        ttft = np.array([q.t_first - q.t_arrive for q in meas])
        tpot = np.array([(q.t_done - q.t_first) / (q.n_out - 1) for q in meas if q.n_out > 1])
        good = [q for q in meas if meets_slo(q, a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3)]
        good_at = {"%g" % ms: sum(meets_slo(q, a.slo_ttft_ms / 1e3, ms / 1e3) for q in meas) / max(1, len(meas))
                   for ms in (20, 30, 50)}
        hand = [q for q in meas if q.t_handoff is not None]
        xfer = np.array([q.t_first - q.t_handoff for q in hand])
        pre = np.array([q.t_handoff - q.t_arrive for q in hand])
        k = self.n_prefill
        # the window: from --warmup to the last first arrival (of a request, or a session's first turn)
        span = max(self.arrival_end - a.warmup, 1e-9)
        end = max((q.t_done for q in done), default=0.0)
        prompt = sum(q.n_prompt for q in meas)
        cached = sum(q.cached for q in meas)

        def pct(x, p):
            return float(np.percentile(x, p)) * 1e3 if len(x) else float("nan")
        busy = np.array([r.busy_s for r in self.reps])
        return {
            "policy": a.policy, "replicas": a.replicas, "calib": self.cal["name"], "workload": a.workload,
            "rate": a.rate, "burstiness": a.burstiness, "seed": a.seed,
            "requests": len(self.requests), "completed": len(done), "measured": len(meas),
            "offered_rate": len(meas) / span, "goodput": len(good) / span, "good_fraction": len(good) / max(1, len(meas)),
            "slo": "per request: TTFT <= %g ms and mean TPOT (time after the first token / tokens after it) "
                   "<= %g ms" % (a.slo_ttft_ms, a.slo_tpot_ms),
            "good_fraction_tpot_ms": good_at,
            "prefill_replicas": k, "decode_replicas": len(self.reps) - k if k else 0, "pd": a.pd,
            "handoffs": self.handoffs, "kv_xfer_blocks": self.xfer_blocks,
            "prefill_ms_mean": float(pre.mean() * 1e3) if len(pre) else 0.0,
            "handoff_to_first_ms_mean": float(xfer.mean() * 1e3) if len(xfer) else 0.0,
            "decode_max_chunk": max((r.max_chunk for r in self.reps[k:]), default=0) if k else None,
            "host_tier_hit_blocks": self.host_hits,
            "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99),
                        "mean": float(ttft.mean() * 1e3) if len(ttft) else float("nan")},
            "tpot_ms": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)},
            "prefix_hit_rate_blocks": self.hit_blocks / max(1, self.query_blocks),
            "tier_hit_blocks": self.tier_hits, "tier_read_s": self.tier_reads_s,
            "tier_hit_blocks_other": self.tier_hits_other, "tier_write_blocks": self.tier_writes,
            "tier_queue_s": self.dir_wait_s, "wall_limited": self.wall_limited,
            "cached_prompt_fraction": cached / max(1, prompt),
            "router_index_hit_blocks": self.routed_hit_blocks,
            "decisions": self.decisions, "router_wait_mean_ms": 1e3 * self.router_wait / max(1, self.decisions),
            "sim_end_s": end, "replica_busy_mean": float(busy.mean() / max(end, 1e-9)),
            "steps": int(sum(r.steps for r in self.reps)),
        }


def meets_slo(q, ttft_s, tpot_s):
    """Goodput's test of one finished request, as DistServe and vLLM's benchmarks define it: its TTFT,
    and its mean time per output token after the first."""
    return q.t_first - q.t_arrive <= ttft_s and (q.n_out <= 1 or (q.t_done - q.t_first) / (q.n_out - 1) <= tpot_s)


def parser():
    ap = argparse.ArgumentParser(prog="loomsim.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("cluster")
    g.add_argument("--calib", default="h200-8b", help="cpu-tiny, h200-8b or a calibration JSON file")
    g.add_argument("--replicas", type=int, default=4)
    g.add_argument("--policy", choices=POLICIES, default="prefix")
    g.add_argument("--prefix-lambda", type=float, default=1.0, help="the router's --prefix-lambda")
    g.add_argument("--prefix-index-blocks", type=int, default=1 << 18, help="the router's --prefix-index-blocks")
    g.add_argument("--probe-interval-ms", type=float, default=200.0, help="the router's Stats poll")
    g.add_argument("--router-latency-ms", type=float, default=None,
                   help="latency the router adds to a request (default: the calibration's, 0.5 ms)")
    g.add_argument("--router-cores", type=int, default=0,
                   help="router cores deciding, a FIFO queue in front (0: as many as needed)")
    g.add_argument("--router-decisions-per-core-s", type=float, default=None,
                   help="decisions one router core makes per second (default: the calibration's)")
    g.add_argument("--request-overhead-ms", type=float, default=None,
                   help="client, socket and tokenizer time before a request is queued (default: calibration)")
    g.add_argument("--host-cores", type=int, default=None,
                   help="replicas share this many cores: a step runs slower by busy replicas / cores "
                        "(0: a device each; default: the calibration's)")
    g = ap.add_argument_group("replica (default: the calibration's)")
    g.add_argument("--max-num-seqs", type=int, default=0)
    g.add_argument("--max-batched-tokens", type=int, default=0)
    g.add_argument("--block-size", type=int, default=0)
    g.add_argument("--kv-blocks", type=int, default=0)
    g.add_argument("--release-reverse", action="store_true",
                   help="a finished sequence releases its last block first (the real ledger: first first)")
    g.add_argument("--max-model-len", type=int, default=0)
    g = ap.add_argument_group("directory tier (docs/kv-offload.md)")
    g.add_argument("--tier-blocks", type=int, default=0, help="blocks the shared tier holds (0: no tier)")
    g.add_argument("--tier-gbps", type=float, default=2.0, help="a replica's read rate from the tier, GB/s")
    g.add_argument("--tier-write-through", action="store_true",
                   help="blocks go to the shared tier as they are computed (--kv-offloading-write-through), "
                        "not when the pool (or the host tier above) gives them up")
    g.add_argument("--tier-total-gbps", type=float, default=0.0,
                   help="the directory's read bandwidth, GB/s, shared by all replicas (reads queue for it; "
                        "0: unbounded, each replica reads at --tier-gbps)")
    g.add_argument("--tier-read-copies", type=float, default=2.0,
                   help="times the directory serves a block's bytes for one load (Loom: the coordinator's "
                        "read-through check, then the worker's load)")
    g.add_argument("--tier-block-bytes", type=int, default=0,
                   help="bytes of a block (default: the calibration's KV bytes per token x block size)")
    g.add_argument("--host-tier-blocks", type=int, default=0,
                   help="blocks each replica's host-memory tier holds, above the directory tier (0: none)")
    g.add_argument("--host-tier-gbps", type=float, default=50.0,
                   help="a replica's read rate from its host tier, GB/s (PCIe 5.0 x16: 64 GB/s a direction)")
    g = ap.add_argument_group("prefill/decode pools (loom-router --pd, docs/disaggregation.md)")
    g.add_argument("--pd", default="", metavar="P:D",
                   help="split the replicas into prefill and decode pools in this ratio (e.g. 1:3)")
    g.add_argument("--prefill-replicas", type=int, default=0, help="or: this many prefill replicas, the rest decode")
    g.add_argument("--pd-min-prompt-tokens", type=int, default=64,
                   help="shorter prompts skip the prefill pool (the router's option)")
    g.add_argument("--decode-max-num-seqs", type=int, default=0,
                   help="a decode replica's max_num_seqs (default: as the others); with no prefill beside them "
                        "its steps can batch more")
    g.add_argument("--kv-link-gbps", type=float, default=50.0,
                   help="the rate a decode replica pulls KV at, GB/s (one 400 Gb/s InfiniBand NIC a GPU)")
    g.add_argument("--kv-handshake-ms", type=float, default=1.0,
                   help="fixed time of a handoff before the KV moves (the decode request, the transfer's setup)")
    g = ap.add_argument_group("arrivals")
    g.add_argument("--rate", type=float, default=10.0, help="requests/s (multiturn: turns/s)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 Poisson, < 1 bursty (as loom bench)")
    g.add_argument("--num-requests", type=int, default=0, help="requests (or --duration)")
    g.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals when --num-requests is 0")
    g.add_argument("--bench-span", action="store_true",
                   help="stretch arrivals to span n/rate exactly, as loom bench does")
    g.add_argument("--warmup", type=float, default=0.0, help="requests arriving before this many seconds "
                   "are simulated but not counted")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--wall-limit-s", type=float, default=0.0,
                   help="stop at the first Stats poll after this many seconds of wall time (0: never); "
                        "the summary says wall_limited, and its figures leave out what had not finished")
    g.add_argument("--stop-when-measured", action="store_true",
                   help="end at the first Stats poll after the last measured request finished (the "
                        "measured figures are the same; completed, sim_end_s, replica_busy_mean and the "
                        "prefix hit rate, over all requests routed, are not)")
    g = ap.add_argument_group("workload")
    g.add_argument("--workload", choices=("random", "prefix-rep", "multiturn", "rag"), default="random")
    g.add_argument("--prompt-len", type=int, default=512)
    g.add_argument("--prompt-len-range", type=float, default=0.5)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--output-len-range", type=float, default=0.5)
    g.add_argument("--num-prefixes", type=int, default=10, help="prefix-rep: shared prefixes")
    g.add_argument("--prefix-len", type=int, default=256, help="prefix-rep")
    g.add_argument("--suffix-len", type=int, default=256, help="prefix-rep")
    g.add_argument("--system-prompts", type=int, default=16, help="multiturn: distinct system prompts")
    g.add_argument("--system-len", type=int, default=1024, help="multiturn")
    g.add_argument("--user-len", type=int, default=128, help="multiturn: tokens of a user turn")
    g.add_argument("--user-len-range", type=float, default=0.5)
    g.add_argument("--turns-min", type=int, default=2)
    g.add_argument("--turns-max", type=int, default=6)
    g.add_argument("--think-s", type=float, default=3.0,
                   help="multiturn: mean time (exponential) from one turn to the next of a conversation; "
                        "a turn never comes before the answer to the one before it")
    g.add_argument("--no-steady-start", dest="steady_start", action="store_false",
                   help="multiturn: every conversation starts at 0 (the load ramps up over a conversation's "
                        "length) instead of starting with the conversations a steady state has going")
    g.add_argument("--docs", type=int, default=1024, help="rag: shared documents")
    g.add_argument("--doc-len", type=int, default=2048, help="rag")
    g.add_argument("--doc-len-range", type=float, default=0.25)
    g.add_argument("--zipf", type=float, default=1.0, help="rag: document popularity exponent")
    g.add_argument("--question-len", type=int, default=64, help="rag")
    g = ap.add_argument_group("output")
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=50.0)
    g.add_argument("--json", help="write the summary here")
    return ap


def simulate(argv=None, **over):
    """Runs one simulation; argv as on the command line, keyword overrides after."""
    args = parser().parse_args(argv or [])
    for k, v in over.items():
        setattr(args, k, v)
    return Sim(args).run()


def main():
    args = parser().parse_args()
    res = Sim(args).run()
    print("%s %s %d replicas, %s, rate %g (k=%g): TTFT p50 %.2f p99 %.2f ms, TPOT p50 %.2f p99 %.2f ms, "
          "goodput %.2f req/s of %.2f, prefix hits %.2f" %
          (res["calib"], res["policy"], res["replicas"], res["workload"], res["rate"], res["burstiness"],
           res["ttft_ms"]["p50"], res["ttft_ms"]["p99"], res["tpot_ms"]["p50"], res["tpot_ms"]["p99"],
           res["goodput"], res["offered_rate"], res["prefix_hit_rate_blocks"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

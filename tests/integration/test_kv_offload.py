"""KV blocks that move (docs/kv-offload.md), on real processes with stories260K.

- usage.prompt_tokens_details.cached_tokens (input_tokens_details on
  /v1/responses) counts the prompt tokens whose KV was not computed for the
  request: 0 on a cold prompt; on a repeat, the full blocks the prefix cache
  held (block 16), the last position always recomputed; the same number
  streamed (the usage chunk) and not, for chat, completions and responses;
  with n = 2 the prompt's once (not the forked sibling's).
- The directory tier (--kv-offloading-dir): with a KV pool of a few blocks
  and conversations whose working set is several times the pool, each next
  turn loads the blocks its prefix left in the directory: cached_tokens
  counts them, the greedy outputs equal a run without the tier, and fewer
  prompt tokens are computed; a second replica (its own coordinator and
  workers) on the same directory hits the blocks the first wrote; corrupted
  and truncated block files are misses (logged, deleted), never wrong
  output; a TP=2 grid saves each shard's slice in its own file; a tier
  that cannot be written (its directory replaced by a file) stops saving
  with a log line and the replica serves on with the same outputs; a tier
  bounded by --kv-offloading-disk-size stays within it.
- The directory tier's first-sight checks run off the scheduler's thread
  (LOOM_TEST_KV_CHECK_DELAY_MS slows each block's): while a long prefix's
  files are checked, short requests and /health keep being answered (no
  wait near the checks' total); with a long --kv-offloading-prefetch-timeout-ms
  the request then loads its prefix (cached_tokens > 0), with a short one
  it is admitted before the checks end and computes the prompt, the same
  greedy output either way.
- Prefill/decode disaggregation driven as vLLM's proxy drives it: a prefill
  replica answers kv_transfer_params do_remote_decode (max_tokens 1) with
  the decode side's params; the decode replica, given them, loads the
  prompt's blocks (cached_tokens: all but the last block's), and its greedy
  and seeded outputs equal a unified replica's token for token; forged block
  ids, a stranger's engine id and a replica without --kv-transfer-config
  are refused; blocks missing from the tier are recomputed
  (kv_load_failure_policy recompute) or refused (fail).
- loom-router --pd: the same through the router (prefill replica, then
  decode replica with the params; a short prompt skips the prefill): the
  outputs equal a unified replica's, the decode side computes at most one
  block of each long prompt.
- KV events: replicas sharing a tier publish its identity and the blocks
  they write to it; loom-router counts those blocks as cached on every
  replica sharing the tier, so a prompt in the tier is a prefix hit on both
  (the load decides between them) and each loads it.
- The host-memory tier (--kv-offloading-size GiB, --kv-offloading-backend
  native): the same conversations with the pool of a few blocks; each next
  turn loads its prefix from the workers' host arenas (the coordinator's
  slots): greedy outputs equal the run without a tier, the host tier's hit
  counter (tier="host") is above 0, fewer prompt tokens are computed; the
  worker killed and a replacement joining: the tier is empty (memory: the
  first turns hit nothing, nothing fails) and fills again; a tier smaller
  than the working set stays within its slots with the same outputs; the
  same on a TP=2 grid and on two pipeline stages.
- Both tiers (--kv-offloading-size above --kv-offloading-dir): with a host
  tier of 6 slots and the pool of 24 blocks, a working set larger than
  both: greedy outputs equal the run without a tier; blocks load from both
  tiers (tier="host" and tier="dir" hits), the directory's only through the
  host tier's evictions (written down from its slots); every later turn
  loads its prefix; a new replica (the host tier empty) on the directory
  loads the first turns' blocks from it; with write-through the same
  outputs, the host tier still filled by evictions; the same on a TP=2
  grid and on two pipeline stages (a file per shard).
- Bad flags are refused at start with a message naming them."""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (BIN, PYTHON, ROOT, STORIES, Cluster, Etcd, check, kill, run_tests, scaled, wait_for,  # noqa: E402
                     with_env)
from test_http import KEY, free_port, get_metrics, post  # noqa: E402

B = 16
STORY = ("Once upon a time there was a little girl named Lily. She loved to play outside in the sun. "
         "One day she saw a big red ball in the park and ran to get it. Her friend Tom came too and "
         "they played together all day until the sun went down and it was time to go home. ")


# first letters all different: no two prompts share a block (the chat template's own tokens stay under one)
WORDS = ["Kite", "Moon", "Pear", "Rose", "Sand", "Tree", "Vase", "Wolf", "Yarn", "Goat"]


def text(word):
    """A prompt of ~100 tokens none of whose blocks another word's prompt shares."""
    return word + " " + STORY * 2


def expected_cached(prompt_tokens):
    """What a repeat finds: its full blocks, less the last position when it ends a block."""
    full = prompt_tokens // B * B
    return prompt_tokens - 1 if full == prompt_tokens else full


def call(port, path, body):
    status, data = post(port, path, body, timeout=120)
    check(status == 200, "%s %r: %d %r" % (path, body, status, data[:300]))
    return json.loads(data)


def streamed_usage(port, path, body):
    body = dict(body, stream=True, stream_options={"include_usage": True})
    status, data = post(port, path, body, timeout=120)
    check(status == 200, "%s: %d %r" % (path, status, data[:300]))
    usage = None
    for line in data.decode().split("\n"):
        if line.startswith("data: ") and line[6:] != "[DONE]":
            o = json.loads(line[6:])
            if o.get("usage"):
                usage = o["usage"]
            if o.get("response", {}).get("usage"):  # responses: response.completed
                usage = o["response"]["usage"]
    check(usage is not None, "%s: no usage chunk in %r" % (path, data[-500:]))
    return usage


def details(u):
    if "input_tokens" in u:
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens():
    port = free_port()
    with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml",
                                            "--api-key", KEY, "--block-size", str(B)]):
        cases = [
            ("/v1/completions", lambda w: {"prompt": text(w), "max_tokens": 4, "temperature": 0}),
            ("/v1/chat/completions",
             lambda w: {"messages": [{"role": "user", "content": text(w)}], "max_tokens": 4, "temperature": 0}),
            ("/v1/responses", lambda w: {"input": text(w), "max_output_tokens": 4, "temperature": 0}),
        ]
        for k, (path, body) in enumerate(cases):
            for streamed in (0, 1):
                word = WORDS[2 * k + streamed]
                get = (lambda b: streamed_usage(port, path, b)) if streamed else (lambda b: call(port, path, b)["usage"])
                p0, c0 = details(get(body(word)))
                check(c0 == 0, "%s streamed=%d: a cold prompt says %d cached" % (path, streamed, c0))
                p1, c1 = details(get(body(word)))
                check(p1 == p0 and c1 == expected_cached(p1),
                      "%s streamed=%d: repeat of %d tokens says %d cached, want %d"
                      % (path, streamed, p1, c1, expected_cached(p1)))
        for path, body in cases[:2]:  # n = 2: the prompt counted once, cold then warm
            for streamed in (0, 1):
                word = WORDS[6 + 2 * (path == "/v1/chat/completions") + streamed]
                b = dict(body(word), n=2, temperature=0.8, seed=3)
                get = (lambda b: streamed_usage(port, path, b)) if streamed else (lambda b: call(port, path, b)["usage"])
                p0, c0 = details(get(b))
                check(c0 == 0, "%s n=2 streamed=%d: a cold prompt says %d cached" % (path, streamed, c0))
                p1, c1 = details(get(b))
                check(c1 == expected_cached(p1), "%s n=2 streamed=%d: repeat of %d tokens says %d cached, want %d"
                      % (path, streamed, p1, c1, expected_cached(p1)))


# A pool of 24 blocks (384 tokens) for conversations of up to ~250 tokens:
# turns of the other conversations evict a conversation's prefix between its
# turns (working set ~4 x 15 blocks against 24).
POOL = 24
CONVERSATIONS = ["Kite", "Moon", "Pear", "Rose"]
TURNS = 3


def conversation_prompt(word, history):
    return word + " " + STORY + "".join(history)


def run_conversations(port, turns=TURNS):
    """The conversations' turns interleaved (each next turn after the other
    conversations' turn, so its prefix left the pool meanwhile): per turn, the
    greedy text and the usage."""
    history = {w: [] for w in CONVERSATIONS}
    out = []
    for t in range(turns):
        for w in CONVERSATIONS:
            r = call(port, "/v1/completions", {"prompt": conversation_prompt(w, history[w]), "max_tokens": 12,
                                               "temperature": 0})
            text_out = r["choices"][0]["text"]
            history[w].append(text_out + " And then")
            out.append((w, t, text_out, r["usage"]["prompt_tokens"],
                        r["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return out


def counters(port, *names):
    """The values of these unlabelled-by-us counters on the coordinator's /metrics (None: absent)."""
    _, samples = get_metrics(port)
    got = {}
    for name, _, value in samples:
        if name in names:
            got[name] = got.get(name, 0) + float(value)
    return [got.get(n) for n in names]


def tier_cluster(tp, port, tier=None, extra=(), pp=1, model=STORIES):
    args = ["--http", "127.0.0.1:%d" % port, "--api-key", KEY, "--block-size", str(B), "--num-kv-blocks", str(POOL)]
    if tier:
        args += ["--kv-offloading-dir", tier]
    return Cluster(model, tp, pp, coord_args=args + list(extra))


def coordinator_log(cl):
    with open(os.path.join(cl.run_dir, "coordinator.log")) as f:
        return f.read()


def check_same_text(a, b, what):
    for x, y in zip(a, b):
        check(x[2] == y[2], "%s: %s turn %d differs: %r vs %r" % (what, x[0], x[1], x[2], y[2]))


def check_tier(tp, pp=1):
    tier = tempfile.mkdtemp(prefix="loom-kv-tier-")
    try:
        port = free_port()
        with tier_cluster(tp, port, pp=pp):
            base = run_conversations(port)
            computed0, absent = counters(port, "loom_prompt_tokens_computed_total", "loom_kv_offload_hits_total")
        check(absent is None, "tp %d: offload counters without a tier" % tp)
        port = free_port()
        with tier_cluster(tp, port, tier, pp=pp):
            first = run_conversations(port)
            computed1, hits, saves = counters(port, "loom_prompt_tokens_computed_total", "loom_kv_offload_hits_total",
                                              "loom_kv_offload_saves_total")
        check_same_text(base, first, "tp %d with the tier" % tp)
        check(hits > 0 and saves > 0, "tp %d: tier hits %r, saves %r" % (tp, hits, saves))
        # every loaded block is a block's worth of prompt positions not run
        check(computed1 <= computed0 - hits * B,
              "tp %d: %d prompt tokens computed with %d blocks loaded, %d without the tier"
              % (tp, computed1, hits, computed0))
        files = glob.glob(os.path.join(tier, "*.kvb"))
        check(files, "tp %d: no block files in the tier" % tp)
        shards = sorted({f.rsplit("-", 1)[1] for f in files})
        check(shards == ["%d.kvb" % r for r in range(tp * pp)], "tp %d: block files of shards %r" % (tp, shards))
        # later turns: the prefix (the previous turn's prompt) was evicted from the
        # pool, and comes back from the tier
        later = [(r, b) for r, b in zip(first, base) if r[1] > 0]
        check(all(b[4] == 0 for _, b in later),
              "tp %d: the pool alone should not hold the earlier turns: %r" % (tp, [b[4] for _, b in later]))
        for r, _ in later:
            check(r[4] >= (r[3] - 40) // B * B,
                  "tp %d: %s turn %d: %d of %d prompt tokens cached" % (tp, r[0], r[1], r[4], r[3]))
        # a second replica: its own coordinator and workers on the same directory
        port = free_port()
        with tier_cluster(tp, port, tier, pp=pp):
            second = run_conversations(port, turns=1)
        check_same_text(base, second, "tp %d, second replica" % tp)
        check(all(r[4] >= (r[3] - 1) // B * B - B for r in second),
              "tp %d: the second replica's first turns should hit the first's blocks: %r" %
              (tp, [(r[3], r[4]) for r in second]))
        return tier, base
    except BaseException:
        shutil.rmtree(tier, ignore_errors=True)
        raise


def test_dir_tier():
    tier, base = check_tier(1)
    try:
        # corrupt every other block file and truncate the rest of every third:
        # each is a miss (recomputed), never wrong output, never a crash
        files = sorted(glob.glob(os.path.join(tier, "*.kvb")))
        for i, f in enumerate(files):
            if i % 2 == 0:
                with open(f, "r+b") as fh:
                    fh.seek(100)
                    b = fh.read(1)
                    fh.seek(100)
                    fh.write(bytes([b[0] ^ 0x5a]))
            elif i % 3 == 0:
                with open(f, "r+b") as fh:
                    fh.truncate(os.path.getsize(f) // 2)
        port = free_port()
        with tier_cluster(1, port, tier) as cl:
            again = run_conversations(port)
            log = coordinator_log(cl)
        check_same_text(base, again, "with corrupted block files")
        check("deleted" in log and ("checksum" in log or "not a whole block" in log),
              "no log line for the bad block files: %r" % log[-2000:])
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def meanwhile(port, body, short):
    """Sends body on a thread and, while it runs, a short completion then
    /health, again and again: (its response, the slowest short call with
    its /health in s, how many)."""
    import threading
    import time
    from test_http import request
    got = []
    t = threading.Thread(target=lambda: got.append(call(port, "/v1/completions", body)))
    t.start()
    worst, n_calls = 0.0, 0
    while t.is_alive():
        a = time.monotonic()
        call(port, "/v1/completions", short)
        check(request(port, "GET", "/health", timeout=60)[0] == 200, "/health while checking")
        worst = max(worst, time.monotonic() - a)
        n_calls += 1
    t.join()
    return (got[0] if got else None), worst, n_calls


CHECK_DELAY_MS = int(scaled(400))  # each block's first-sight check, in the test hook (longer on a slower machine,
# so the checks still outlast a short request there by far)


def test_dir_tier_prefetch():
    tier = tempfile.mkdtemp(prefix="loom-kv-tier-")
    long_prompt = {"prompt": "Lamp " + STORY * 3, "max_tokens": 16, "temperature": 0}
    short = {"prompt": "Zebra went to the park.", "max_tokens": 4, "temperature": 0}
    old_env = os.environ.get("LOOM_TEST_KV_CHECK_DELAY_MS")
    try:
        port = free_port()
        args = ["--http", "127.0.0.1:%d" % port, "--api-key", KEY, "--block-size", str(B),
                "--kv-offloading-dir", tier, "--kv-offloading-write-through"]
        with Cluster(STORIES, 1, 1, coord_args=args):
            want = call(port, "/v1/completions", long_prompt)
        n_prompt = want["usage"]["prompt_tokens"]
        n_blocks = (n_prompt - 1) // B
        check(n_blocks >= 8, "a long prompt: %d tokens" % n_prompt)
        check(len(glob.glob(os.path.join(tier, "*.kvb"))) >= n_blocks, "the prompt's blocks written through")
        os.environ["LOOM_TEST_KV_CHECK_DELAY_MS"] = str(CHECK_DELAY_MS)
        total_s = n_blocks * CHECK_DELAY_MS / 1e3

        for timeout_ms in (60000, 100):
            port = free_port()
            args = ["--http", "127.0.0.1:%d" % port, "--api-key", KEY, "--block-size", str(B),
                    "--kv-offloading-dir", tier, "--kv-offloading-prefetch-timeout-ms", str(timeout_ms)]
            with Cluster(STORIES, 1, 1, coord_args=args):
                call(port, "/v1/completions", short)  # warm
                got, worst, n_calls = meanwhile(port, long_prompt, short)
            check(got and got["choices"][0]["text"] == want["choices"][0]["text"],
                  "timeout %d ms: %r vs %r" % (timeout_ms, got and got["choices"][0]["text"],
                                               want["choices"][0]["text"]))
            cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
            print("  timeout %d ms: %d of %d prompt tokens cached; %.1f s of checks; %d short requests, the slowest "
                  "with /health %.2f s" % (timeout_ms, cached, n_prompt, total_s, n_calls, worst))
            if timeout_ms == 60000:
                # it waited for the checks, then loaded its prefix
                check(cached >= n_blocks * B, "long timeout: %d of %d prompt tokens cached" % (cached, n_prompt))
                # the reactor kept turning: a short request and /health took far less than the checks
                check(n_calls >= 2 and worst < total_s / 2,
                      "while %.1f s of checks ran: %d short requests, the slowest with /health %.2f s"
                      % (total_s, n_calls, worst))
            else:
                # admitted when its wait ran out, long before the checks end: computed
                check(cached < n_blocks * B, "short timeout: %d of %d prompt tokens cached" % (cached, n_prompt))
    finally:
        if old_env is None:
            os.environ.pop("LOOM_TEST_KV_CHECK_DELAY_MS", None)
        else:
            os.environ["LOOM_TEST_KV_CHECK_DELAY_MS"] = old_env
        shutil.rmtree(tier, ignore_errors=True)


HOST_GIB = "0.01"  # about 520 blocks of stories260K (20,480 bytes each): the whole working set


def host_cluster(tp, port, size=HOST_GIB, extra=()):
    return tier_cluster(tp, port, extra=["--kv-offloading-size", size, "--kv-offloading-backend", "native"]
                        + list(extra))


def host_metrics(port):
    """The host tier's counters by name, and its two gauges."""
    _, samples = get_metrics(port)
    got = {}
    for name, labels, value in samples:
        if name.startswith("loom_kv_offload_"):
            key = name + ("{tier=%s}" % labels.get("tier") if "tier" in labels else "")
            got[key] = got.get(key, 0) + float(value)
    return got


def check_later_turns_loaded(first, base, what):
    later = [(r, b) for r, b in zip(first, base) if r[1] > 0]
    check(all(b[4] == 0 for _, b in later),
          "%s: the pool alone should not hold the earlier turns: %r" % (what, [b[4] for _, b in later]))
    for r, _ in later:
        check(r[4] >= (r[3] - 40) // B * B, "%s: %s turn %d: %d of %d prompt tokens cached" % (what, r[0], r[1], r[4], r[3]))


def test_host_tier():
    port = free_port()
    with tier_cluster(1, port):
        base = run_conversations(port)
        computed0, = counters(port, "loom_prompt_tokens_computed_total")
    port = free_port()
    with host_cluster(1, port) as cl:
        first = run_conversations(port)
        computed1, = counters(port, "loom_prompt_tokens_computed_total")
        m = host_metrics(port)
        hits, saves = m.get("loom_kv_offload_hits_total{tier=host}"), m.get("loom_kv_offload_saves_total{tier=host}")
        held, slots = m.get("loom_kv_offload_host_blocks"), m.get("loom_kv_offload_host_capacity_blocks")
        check_same_text(base, first, "with the host tier")
        check(hits and hits > 0 and saves and saves > 0, "host tier hits %r, saves %r: %r" % (hits, saves, m))
        check(slots and slots >= 400 and 0 < held <= slots, "host tier of %r slots holding %r" % (slots, held))
        check(computed1 <= computed0 - hits * B,
              "%d prompt tokens computed with %d blocks loaded, %d without the tier" % (computed1, hits, computed0))
        check_later_turns_loaded(first, base, "host tier")
        # the worker killed, a replacement joins: its arena is new and the
        # coordinator's slots are empty again (the tier is memory)
        kill(cl.pid("worker-0"))
        wait_for(lambda: "waiting for a worker to take its place" in coordinator_log(cl), 60, "the lost worker noticed")
        ctl = "tcp://127.0.0.1:%d" % (cl.port + 1)
        wlog = os.path.join(cl.run_dir, "replacement.log")
        with open(wlog, "w") as lf:
            w = subprocess.Popen([os.path.join(BIN, "loom-worker"), "--coordinator", ctl, "--threads", "1",
                                  "--id", "replacement"] + cl.worker_keys("replacement"), stdout=lf, stderr=lf)
        try:
            wait_for(lambda: "grid ready (epoch 2)" in coordinator_log(cl), 60, "the grid back with the replacement")
            again = run_conversations(port)
            m2 = host_metrics(port)
        finally:
            w.terminate()
            w.wait(timeout=30)
        with open(wlog) as f:
            logs = f.read() + coordinator_log(cl)
    check_same_text(base, again, "after the worker's restart")
    check(all(r[4] == 0 for r in again if r[1] == 0),
          "after the restart the first turns hit a tier that is gone: %r" % [r[4] for r in again if r[1] == 0])
    check_later_turns_loaded(again, base, "host tier after the restart")
    check("host slot" not in logs and "could not be loaded" not in logs,
          "a load from the lost tier was tried: %s" % [l for l in logs.splitlines() if "slot" in l][:5])
    check("host tier of" in logs, "the replacement's host tier is not in the logs")
    check(m2.get("loom_kv_offload_hits_total{tier=host}", 0) > 0, "no hits after the restart: %r" % m2)


def test_host_tier_grids():
    # TP=2 (each rank its own arena of the same slots) and two pipeline stages
    for tp, pp in ((2, 1), (1, 2)):
        port = free_port()
        with tier_cluster(tp, port, pp=pp):
            base = run_conversations(port)
        port = free_port()
        with host_cluster(tp, port, extra=()) if pp == 1 else \
                tier_cluster(tp, port, pp=pp, extra=["--kv-offloading-size", HOST_GIB]):
            first = run_conversations(port)
            m = host_metrics(port)
        what = "host tier, tp %d pp %d" % (tp, pp)
        check_same_text(base, first, what)
        check(m.get("loom_kv_offload_hits_total{tier=host}", 0) > 0, "%s: no hits: %r" % (what, m))
        check_later_turns_loaded(first, base, what)


def test_host_tier_bounded():
    # 12 blocks of 20,480 bytes: a third of the working set
    size = "%.9f" % (12.5 * 20480 / 2 ** 30)
    port = free_port()
    with tier_cluster(1, port):
        base = run_conversations(port)
    port = free_port()
    with host_cluster(1, port, size):
        first = run_conversations(port)
        m = host_metrics(port)
    check_same_text(base, first, "with a small host tier")
    check(m.get("loom_kv_offload_host_capacity_blocks") == 12, "host tier capacity: %r" % m)
    check(0 < m.get("loom_kv_offload_host_blocks", 0) <= 12, "host tier holds %r" % m)
    check(m.get("loom_kv_offload_saves_total{tier=host}", 0) > 12, "saves %r: the tier never wrapped" % m)


def test_host_tier_over_dir():
    size = "%.9f" % (6.5 * 20480 / 2 ** 30)  # 6 slots of stories260K's blocks
    tier = tempfile.mkdtemp(prefix="loom-kv-tier-")
    try:
        port = free_port()
        with tier_cluster(1, port):
            base = run_conversations(port)
            computed0, = counters(port, "loom_prompt_tokens_computed_total")
        port = free_port()
        with host_cluster(1, port, size, extra=["--kv-offloading-dir", tier]) as cl:
            first = run_conversations(port)
            computed1, = counters(port, "loom_prompt_tokens_computed_total")
            m = host_metrics(port)
            log = coordinator_log(cl)
        check_same_text(base, first, "host tier over the directory")
        hh, hd = m.get("loom_kv_offload_hits_total{tier=host}", 0), m.get("loom_kv_offload_hits_total{tier=dir}", 0)
        sh, sd = m.get("loom_kv_offload_saves_total{tier=host}", 0), m.get("loom_kv_offload_saves_total{tier=dir}", 0)
        check(hh > 0 and hd > 0, "hits: host %r, dir %r: %r" % (hh, hd, m))
        # the directory gets blocks only as the host tier gives them up (no write-through)
        check(sh > 6 and sd > 0, "saves: host %r (6 slots), dir %r" % (sh, sd))
        check(m.get("loom_kv_offload_host_capacity_blocks") == 6 and 0 < m.get("loom_kv_offload_host_blocks", 0) <= 6,
              "host tier: %r" % m)
        check(m.get("loom_kv_offload_queries_total{tier=dir}", 0) > 0, "the directory never asked: %r" % m)
        check(computed1 <= computed0 - (hh + hd) * B,
              "%d prompt tokens computed with %d blocks loaded, %d without a tier" % (computed1, hh + hd, computed0))
        check_later_turns_loaded(first, base, "host tier over the directory")
        check("tier 1, above the directory" in log, "the start-up line: %r" % log[:2000])
        files = glob.glob(os.path.join(tier, "*.kvb"))
        check(len(files) == sd, "%d block files for %r saves to the directory" % (len(files), sd))
        # a new replica: its host tier is empty, the directory is not
        port = free_port()
        with host_cluster(1, port, size, extra=["--kv-offloading-dir", tier]):
            again = run_conversations(port, turns=1)
            m2 = host_metrics(port)
        check_same_text(base, again, "host tier over the directory, a new replica")
        check(m2.get("loom_kv_offload_hits_total{tier=dir}", 0) > 0
              and m2.get("loom_kv_offload_hits_total{tier=host}", 0) == 0,
              "after the restart the hits should come from the directory: %r" % m2)
        check(sum(r[4] for r in again) > 0, "no cached tokens after the restart: %r" % [r[4] for r in again])
        # write-through: the directory gets each block as computed, the host tier as it leaves the pool
        shutil.rmtree(tier)
        os.mkdir(tier)
        port = free_port()
        with host_cluster(1, port, size, extra=["--kv-offloading-dir", tier, "--kv-offloading-write-through"]):
            through = run_conversations(port)
            m3 = host_metrics(port)
        check_same_text(base, through, "host tier over the directory, write-through")
        check(m3.get("loom_kv_offload_saves_total{tier=host}", 0) > 6
              and m3.get("loom_kv_offload_hits_total{tier=host}", 0) > 0
              and m3.get("loom_kv_offload_saves_total{tier=dir}", 0) >= len(glob.glob(os.path.join(tier, "*.kvb"))) > 0,
              "write-through: %r" % m3)
        check_later_turns_loaded(through, base, "host tier over the directory, write-through")
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def test_host_tier_over_dir_grids():
    # TP=2 and two pipeline stages: each worker spills its own shard's file from its own arena
    size = "%.9f" % (6.5 * 20480 / 2 ** 30)
    for tp, pp in ((2, 1), (1, 2)):
        what = "host tier over the directory, tp %d pp %d" % (tp, pp)
        tier = tempfile.mkdtemp(prefix="loom-kv-tier-")
        try:
            port = free_port()
            with tier_cluster(tp, port, pp=pp):
                base = run_conversations(port)
            port = free_port()
            with tier_cluster(tp, port, pp=pp, extra=["--kv-offloading-size", size, "--kv-offloading-dir", tier]):
                first = run_conversations(port)
                m = host_metrics(port)
            check_same_text(base, first, what)
            check(m.get("loom_kv_offload_hits_total{tier=host}", 0) > 0
                  and m.get("loom_kv_offload_hits_total{tier=dir}", 0) > 0, "%s: %r" % (what, m))
            check_later_turns_loaded(first, base, what)
            shards = sorted({f.rsplit("-", 1)[1] for f in glob.glob(os.path.join(tier, "*.kvb"))})
            check(shards == ["%d.kvb" % r for r in range(tp * pp)], "%s: block files of shards %r" % (what, shards))
        finally:
            shutil.rmtree(tier, ignore_errors=True)


def test_deepseek_tiers():
    """DeepSeek's latent cache (one row of kv_lora_rank + rope values a token
    and layer; a layer-major pool) in both tiers: the directory through the
    workers' staging span (a block's file is its latent span, packed), the
    host tier alone and over the directory; the same greedy text as without a
    tier, and blocks loaded, on 1x1 and TP 2."""
    import test_deepseek
    os.makedirs(test_deepseek.WORK, exist_ok=True)
    model = test_deepseek.v3()
    for tp in (1, 2):
        port = free_port()
        with tier_cluster(tp, port, model=model):
            base = run_conversations(port)
        for what, extra, with_dir in (("dir", [], True),
                                      ("host", ["--kv-offloading-size", HOST_GIB, "--kv-offloading-backend", "native"],
                                       False),
                                      ("host over dir", ["--kv-offloading-size", "0.0002",
                                                         "--kv-offloading-backend", "native"], True)):
            tier = tempfile.mkdtemp(prefix="loom-kv-ds-")
            try:
                port = free_port()
                with tier_cluster(tp, port, tier if with_dir else None, extra=extra, model=model) as cl:
                    got = run_conversations(port)
                    hits, = counters(port, "loom_kv_offload_hits_total")
                    log = coordinator_log(cl)
                check_same_text(base, got, "deepseek tp %d, %s" % (tp, what))
                cached = sum(r[4] for r in got[len(CONVERSATIONS):])
                print("  deepseek tp %d, %s tier: %s blocks loaded, %d later-turn prompt tokens cached"
                      % (tp, what, hits, cached))
                check(hits and hits > 0 and cached > 0,
                      "deepseek tp %d, %s: hits %r, cached %d" % (tp, what, hits, cached))
                if with_dir:
                    check(glob.glob(os.path.join(tier, "*.kvb")), "deepseek tp %d, %s: no block files" % (tp, what))
                check("needs KV blocks that are one contiguous span" not in log, "refused: %s" % log[-500:])
            finally:
                shutil.rmtree(tier, ignore_errors=True)


def test_dir_tier_unwritable():
    tier = tempfile.mkdtemp(prefix="loom-kv-tier-")
    try:
        port = free_port()
        with tier_cluster(1, port):
            base = run_conversations(port)
        port = free_port()
        with tier_cluster(1, port, tier) as cl:
            shutil.rmtree(tier)
            with open(tier, "w") as f:  # what was the directory: writes and reads now fail
                f.write("not a directory\n")
            again = run_conversations(port)
            log = cl.log("worker-0")
        check_same_text(base, again, "with an unwritable tier")
        check("no more blocks are saved" in log, "no log line for the failed save: %r" % log[-2000:])
    finally:
        if os.path.isdir(tier):
            shutil.rmtree(tier, ignore_errors=True)
        elif os.path.exists(tier):
            os.unlink(tier)


def test_dir_tier_bounded():
    tier = tempfile.mkdtemp(prefix="loom-kv-tier-")
    bound = 200000  # ten block files of stories260K (20 KiB and a header each): less than the workload writes
    try:
        port = free_port()
        with tier_cluster(1, port):
            base = run_conversations(port)
        port = free_port()
        with tier_cluster(1, port, tier, extra=["--kv-offloading-disk-size", "%g" % (bound / 1e9)]):
            again = run_conversations(port)
            _, hits, saves = counters(port, "loom_prompt_tokens_computed_total", "loom_kv_offload_hits_total",
                                      "loom_kv_offload_saves_total")
        check_same_text(base, again, "with a bounded tier")
        held = sum(os.path.getsize(f) for f in glob.glob(os.path.join(tier, "*.kvb")))
        check(0 < held <= bound and saves * 20480 > bound,
              "the tier holds %d bytes for a bound of %d after %d saves" % (held, bound, saves))
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def test_dir_tier_tp2():
    tier, _ = check_tier(2)
    shutil.rmtree(tier, ignore_errors=True)


def test_dir_tier_pp2():
    """Two pipeline stages: each stage's worker saves and loads its layers' slice."""
    tier, _ = check_tier(1, pp=2)
    shutil.rmtree(tier, ignore_errors=True)


PD_PROMPTS = [word + " " + STORY + ("and then " * k) for k, word in enumerate(["Kite", "Moon", "Pear", "Rose"])]
LOST = "Vase " + STORY  # prefilled, then its blocks lost before the decode


def pd_cluster(port, tier, role, policy="recompute", extra=(), launch_args=()):
    cfg = json.dumps({"kv_connector": "LoomConnector", "kv_role": role, "kv_load_failure_policy": policy})
    args = ["--block-size", str(B), "--kv-offloading-dir", tier, "--kv-transfer-config", cfg] + list(extra)
    if port:
        args += ["--http", "127.0.0.1:%d" % port, "--api-key", KEY]
    return Cluster(STORIES, 1, 1, coord_args=args, launch_args=launch_args)


def unified_answers(bodies):
    """What one unified replica (no tier) answers to each body."""
    port = free_port()
    with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % port, "--api-key", KEY,
                                            "--block-size", str(B)]):
        return [call(port, "/v1/completions", b) for b in bodies]


def check_pd_answer(got, want, min_prompt):
    """got (through a --pd router) says what want (unified) says; a prompt of
    min_prompt tokens or more was prefilled elsewhere: the decode side
    computed at most one block of it."""
    check(got["choices"][0]["text"] == want["choices"][0]["text"],
          "through the router %r != unified %r" % (got["choices"][0]["text"], want["choices"][0]["text"]))
    n_prompt = got["usage"]["prompt_tokens"]
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    if n_prompt >= min_prompt:
        check(n_prompt - cached <= B, "the decode side computed %d of %d prompt tokens" % (n_prompt - cached,
                                                                                           n_prompt))
    else:
        check(cached == 0, "a short prompt came with %d cached tokens" % cached)


def refused(port, body, status, words):
    st, data = post(port, "/v1/completions", body, timeout=120)
    check(st == status and all(w in data.decode() for w in words),
          "%r: want %d with %r, got %d %r" % (body.get("kv_transfer_params"), status, words, st, data[:300]))


def test_disaggregated():
    tier = tempfile.mkdtemp(prefix="loom-kv-pd-")
    try:
        bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in PD_PROMPTS]
        bodies += [{"prompt": p, "max_tokens": 16, "temperature": 0.8, "seed": 11} for p in PD_PROMPTS[:2]]
        bodies.append({"prompt": LOST, "max_tokens": 16, "temperature": 0})
        port = free_port()
        with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % port, "--api-key", KEY,
                                                "--block-size", str(B)]):
            unified = [call(port, "/v1/completions", b)["choices"][0]["text"] for b in bodies]
            refused(port, dict(bodies[0], kv_transfer_params={"do_remote_decode": True}), 400,
                    ["--kv-transfer-config"])
        pport, dport = free_port(), free_port()
        with pd_cluster(pport, tier, "kv_producer"), pd_cluster(dport, tier, "kv_consumer"):
            params = []
            call(pport, "/v1/completions", bodies[0])  # in the prefill side's pool, not in the tier
            for b, want in zip(bodies[:-1], unified):
                pre = call(pport, "/v1/completions", dict(b, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
                kv = pre.get("kv_transfer_params")
                n_prompt = pre["usage"]["prompt_tokens"]
                check(kv and kv["do_remote_prefill"] and kv["remote_engine_id"].startswith("loom-")
                      and len(kv["remote_block_ids"]) == (n_prompt - 1) // B, "prefill's params: %r" % kv)
                got = call(dport, "/v1/completions", dict(b, kv_transfer_params=kv))
                check(got["choices"][0]["text"] == want, "decode %r != unified %r" % (got["choices"][0]["text"], want))
                cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                check(cached == len(kv["remote_block_ids"]) * B and n_prompt - cached <= B,
                      "decode computed %d of %d prompt tokens" % (n_prompt - cached, n_prompt))
                params.append(kv)
            kv = params[0]
            forged = dict(kv, remote_block_ids=kv["remote_block_ids"][:1] + ["%016x" % 12345])
            refused(dport, dict(bodies[0], kv_transfer_params=forged), 400, ["remote_block_ids[1]"])
            refused(dport, dict(bodies[0], kv_transfer_params=dict(kv, remote_engine_id="loom-0123456789abcdef")), 400,
                    ["remote_engine_id"])
            refused(dport, dict(bodies[0], kv_transfer_params={"do_remote_decode": True}), 400, ["kv_consumer"])
            refused(dport, dict(bodies[0], kv_transfer_params=[1]), 400, ["kv_transfer_params"])
            # the prefill's blocks gone (its replica died before writing, the tier trimmed them): recomputed
            lost = call(pport, "/v1/completions", dict(bodies[-1], max_tokens=1,
                                                       kv_transfer_params={"do_remote_decode": True}))
            lost = lost["kv_transfer_params"]
            for f in glob.glob(os.path.join(tier, "*.kvb")):
                os.unlink(f)
            got = call(dport, "/v1/completions", dict(bodies[-1], kv_transfer_params=lost))
            check(got["choices"][0]["text"] == unified[-1] and got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
                  "recomputed decode: %r" % got)
        fport = free_port()
        with pd_cluster(fport, tier, "kv_both", policy="fail"):
            refused(fport, dict(bodies[2], kv_transfer_params=params[2]), 503, ["kv_load_failure_policy fail"])
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def test_disaggregated_check_off_reactor():
    """The decode side reads the prefill's block files through (their
    checksums) on its preparation pool, not on the reactor: with each block's
    read slowed by the test hook, /health and short requests answer while a
    decode's check runs, and the decode still loads every block."""
    tier = tempfile.mkdtemp(prefix="loom-kv-pd-check-")
    try:
        body = {"prompt": "Lamp " + STORY * 2, "max_tokens": 16, "temperature": 0}
        short = {"prompt": "Zebra went to the park.", "max_tokens": 4, "temperature": 0}
        port = free_port()
        with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % port, "--api-key", KEY,
                                                "--block-size", str(B)]):
            want = call(port, "/v1/completions", body)["choices"][0]["text"]
        pport = free_port()
        with pd_cluster(pport, tier, "kv_producer"):
            pre = call(pport, "/v1/completions", dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        kv = pre["kv_transfer_params"]
        n_blocks = len(kv["remote_block_ids"])
        check(n_blocks >= 8, "a long prompt: %d blocks" % n_blocks)
        total_s = n_blocks * CHECK_DELAY_MS / 1e3
        dport = free_port()

        def decode_side():
            with pd_cluster(dport, tier, "kv_consumer"):
                call(dport, "/v1/completions", short)  # warm
                return meanwhile(dport, dict(body, kv_transfer_params=kv), short)

        got, worst, n_calls = with_env("LOOM_TEST_KV_CHECK_DELAY_MS", str(CHECK_DELAY_MS), decode_side)
        check(got and got["choices"][0]["text"] == want, "decode %r != unified %r" % (got, want))
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        print("  %d blocks checked in %.1f s: %d short requests meanwhile, the slowest with /health %.2f s; "
              "%d prompt tokens cached" % (n_blocks, total_s, n_calls, worst, cached))
        check(cached == n_blocks * B, "decode loaded %d of %d blocks' tokens" % (cached, n_blocks * B))
        check(n_calls >= 2 and worst < total_s / 2,
              "while %.1f s of checks ran: %d short requests, the slowest with /health %.2f s"
              % (total_s, n_calls, worst))
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def test_disaggregated_lora():
    """A LoRA adapter's request hands its blocks over too: the prefill's
    remote_block_ids are chained from the adapter's seed (its blocks are not
    the base model's), the decode side loads them and answers as one replica
    serving the adapter does; the base model's prompt beside it keeps its own."""
    work = tempfile.mkdtemp(prefix="loom-kv-pd-lora-")
    tier = os.path.join(work, "tier")
    ad = os.path.join(work, "ad")
    os.makedirs(tier)
    try:
        subprocess.run([PYTHON, os.path.join(ROOT, "tests", "reference", "gen_lora.py"), "adapter", STORIES, ad,
                        "--r", "8", "--alpha", "16", "--std", "0.1", "--seed", "31"], check=True, capture_output=True,
                       timeout=300)
        lora = ["--enable-lora", "--lora-modules", "ad=" + ad]
        bodies = [{"model": m, "prompt": PD_PROMPTS[1], "max_tokens": 16, "temperature": 0} for m in ("ad", "stories")]
        port = free_port()
        with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % port, "--api-key", KEY,
                                                "--block-size", str(B), "--served-model-name", "stories"] + lora):
            unified = [call(port, "/v1/completions", b)["choices"][0]["text"] for b in bodies]
        check(unified[0] != unified[1], "the adapter does not change the output: the test would see nothing")
        pport, dport = free_port(), free_port()
        extra = lora + ["--served-model-name", "stories"]
        with pd_cluster(pport, tier, "kv_producer", extra=extra), pd_cluster(dport, tier, "kv_consumer", extra=extra):
            ids = []
            for b, want in zip(bodies, unified):
                pre = call(pport, "/v1/completions", dict(b, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
                kv = pre["kv_transfer_params"]
                n_prompt = pre["usage"]["prompt_tokens"]
                got = call(dport, "/v1/completions", dict(b, kv_transfer_params=kv))
                check(got["choices"][0]["text"] == want, "%s: decode %r != unified %r" % (
                    b["model"], got["choices"][0]["text"], want))
                cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                check(cached == len(kv["remote_block_ids"]) * B and n_prompt - cached <= B,
                      "%s: decode computed %d of %d prompt tokens" % (b["model"], n_prompt - cached, n_prompt))
                ids.append(kv["remote_block_ids"])
            check(ids[0] and ids[0][0] != ids[1][0], "the adapter's blocks are named as the base model's: %r" % ids)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_router_tier_events():
    from test_router import Router
    tier = tempfile.mkdtemp(prefix="loom-kv-events-")
    try:
        args = ["--block-size", str(B), "--kv-offloading-dir", tier, "--kv-offloading-write-through",
                "--kv-events", "tcp://127.0.0.1:0"]
        with Cluster(STORIES, 1, 1, coord_args=args) as a, Cluster(STORIES, 1, 1, coord_args=args) as b:
            # a tier token priced as a pool hit: the replicas tie, and their load decides
            with Router(["--replica", a.addr, "--replica", b.addr, "--policy", "prefix", "--prefix-tier-cost", "0"],
                        http=True, expect_up=2) as router:
                body = {"prompt": PD_PROMPTS[0], "max_tokens": 8, "temperature": 0}
                first = call(router.http, "/v1/completions", body)
                wait_for(lambda: router.metric_sum("loom_router_kv_events_tier_blocks_total") > 0, 20,
                         "the tier's blocks in the router's KV events")
                got = [call(router.http, "/v1/completions", body) for _ in range(4)]
                wait_for(lambda: router.metric_sum("loom_router_replica_routed_total") == 5, 20,
                         "the router's metrics to count the five requests")
                routed = [v for (n, _), v in router.metrics().items() if n == "loom_router_replica_routed_total"]
        check(all(g["choices"][0]["text"] == first["choices"][0]["text"] for g in got), "outputs differ")
        check(all(g["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for g in got),
              "cached tokens %r" % [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got])
        check(len(routed) == 2 and min(routed) >= 2,
              "a prompt in the shared tier goes to both replicas (the load decides): routed %r" % routed)
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def test_flags():
    coord = [os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES, "--listen", "tcp://127.0.0.1:0",
             "--control", "tcp://127.0.0.1:0"]
    router = [os.path.join(BIN, "loom-router"), "--listen", "tcp://127.0.0.1:0"]
    cases = [
        (coord + ["--kv-transfer-config", '{"kv_connector":"NixlConnector"}'], "LoomConnector"),
        (coord + ["--kv-transfer-config", "not json"], "not a JSON object"),
        (coord + ["--kv-transfer-config", '{"kv_connector":"LoomConnector","kv_role":"kv_x"}'], "kv_role"),
        (coord + ["--kv-transfer-config", '{"kv_connector":"LoomConnector","kv_load_failure_policy":"retry"}'],
         "kv_load_failure_policy"),
        (coord + ["--kv-transfer-config", '{"kv_connector":"LoomConnector"}'], "--kv-offloading-dir"),
        (coord + ["--kv-offloading-dir", tempfile.gettempdir(), "--no-prefix-cache"], "prefix cache"),
        (coord + ["--kv-offloading-dir", "/nonexistent/loom-kv"], "not a writable directory"),
        (coord + ["--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"], "lmcache is not available"),
        (coord + ["--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"], "accepted: native"),
        (coord + ["--kv-offloading-size", "1", "--kv-offloading-backend", "offload"], "offload is not available"),
        (coord + ["--kv-offloading-backend", "native"], "needs --kv-offloading-size"),
        (coord + ["--kv-offloading-size", "0"], "--kv-offloading-size expects a number"),
        (coord + ["--kv-offloading-size", "lots"], "--kv-offloading-size"),
        (coord + ["--kv-offloading-size", "1", "--no-prefix-cache"], "prefix cache"),
        (coord + ["--kv-offloading-size", "1", "--kv-offloading-dir", tempfile.gettempdir(), "--no-prefix-cache"],
         "prefix cache"),
        ([os.path.join(BIN, "loom"), "serve", STORIES, "--kv-offloading-size", "1", "--kv-offloading-backend",
          "lmcache"], "lmcache is not available"),
        (router + ["--replica", "tcp://127.0.0.1:1", "--prefill-replica", "tcp://127.0.0.1:2"], "--pd"),
        (router + ["--pd", "--replica", "tcp://127.0.0.1:1"], "--prefill-replica"),
        (router + ["--replica", "tcp://127.0.0.1:1", "--prefix-tier-cost", "2"], "--prefix-tier-cost"),
        (coord + ["--kv-offloading-dir", tempfile.gettempdir(), "--kv-offloading-prefetch-timeout-ms", "-5"],
         "--kv-offloading-prefetch-timeout-ms"),
    ]
    for argv, words in cases:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and words in p.stderr, "%r: exit %d, %r" % (argv[1:], p.returncode, p.stderr[-300:]))


def test_router_pd():
    from test_router import Router
    tier = tempfile.mkdtemp(prefix="loom-kv-pd-router-")
    try:
        bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in PD_PROMPTS[:3]]
        bodies.append({"prompt": PD_PROMPTS[3], "max_tokens": 16, "temperature": 0.8, "seed": 5})
        bodies.append({"prompt": "Kite", "max_tokens": 8, "temperature": 0})  # short: no prefill
        port = free_port()
        unified = unified_answers(bodies)
        with pd_cluster(0, tier, "kv_producer") as pre, pd_cluster(0, tier, "kv_consumer") as dec:
            with Router(["--pd", "--prefill-replica", pre.addr, "--replica", dec.addr, "--pd-min-prompt-tokens", "32"],
                        http=True, expect_up=2) as router:
                for b, want in zip(bodies, unified):
                    check_pd_answer(call(router.http, "/v1/completions", b), want, 32)
                # the prefill replica killed: the decode side computes the prompts itself
                for name in ("coordinator", "worker-0"):
                    os.kill(pre.pid(name), signal.SIGKILL)
                wait_for(lambda: router.metric_sum("loom_router_replica_up") == 1, 30, "the prefill replica down")
                fresh = {"prompt": "Zebra " + STORY, "max_tokens": 16, "temperature": 0}
                got = call(router.http, "/v1/completions", fresh)
                with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % port, "--api-key", KEY,
                                                        "--block-size", str(B)]):
                    want = call(port, "/v1/completions", fresh)
                check(got["choices"][0]["text"] == want["choices"][0]["text"]
                      and got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
                      "without its prefill replica: %r vs %r" % (got, want))
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def test_router_pd_etcd():
    """loom-router --pd --etcd: the coordinators publish their kv_role in
    etcd; the kv_producer ones prefill, the others decode, as with
    --prefill-replica / --replica."""
    from test_router import Router
    tier = tempfile.mkdtemp(prefix="loom-kv-pd-etcd-")
    try:
        bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in PD_PROMPTS[:2]]
        bodies.append({"prompt": PD_PROMPTS[2], "max_tokens": 16, "temperature": 0.8, "seed": 3})
        bodies.append({"prompt": "Kite", "max_tokens": 8, "temperature": 0})  # short: no prefill
        unified = unified_answers(bodies)
        p = subprocess.run([os.path.join(BIN, "loom-router"), "--pd", "--replica", "tcp://127.0.0.1:1"],
                           capture_output=True, text=True, timeout=30)
        check(p.returncode == 2 and "--pd needs a --prefill-replica, or --etcd" in p.stderr,
              "--pd with neither prefill replicas nor etcd: %d %s" % (p.returncode, p.stderr))
        with Etcd() as etcd:
            with pd_cluster(0, tier, "kv_producer", launch_args=["--etcd", etcd.url, "--cluster", "pd-p"]), \
                 pd_cluster(0, tier, "kv_consumer", launch_args=["--etcd", etcd.url, "--cluster", "pd-d"]):
                for name, role in (("pd-p", "kv_producer"), ("pd-d", "kv_consumer")):
                    v = etcd.get("/loom/%s/coordinator" % name)
                    check(v and json.loads(v).get("kv_role") == role, "etcd /loom/%s/coordinator: %r" % (name, v))
                with Router(["--pd", "--etcd", etcd.url, "--cluster", "pd", "--pd-min-prompt-tokens", "32"],
                            http=True, expect_up=2) as router:
                    for b, want in zip(bodies, unified):
                        check_pd_answer(call(router.http, "/v1/completions", b), want, 32)
                    log = router.log()
                    check(log.count("prefills (kv_role in etcd)") == 1, "the router did not say which prefills")
    finally:
        shutil.rmtree(tier, ignore_errors=True)


if __name__ == "__main__":
    run_tests([test_cached_tokens, test_host_tier, test_host_tier_grids, test_host_tier_bounded,
               test_host_tier_over_dir, test_host_tier_over_dir_grids, test_dir_tier,
               test_dir_tier_unwritable, test_dir_tier_bounded, test_dir_tier_prefetch, test_dir_tier_tp2,
               test_dir_tier_pp2, test_disaggregated, test_disaggregated_check_off_reactor, test_disaggregated_lora,
               test_router_pd, test_router_pd_etcd, test_router_tier_events, test_deepseek_tiers, test_flags])

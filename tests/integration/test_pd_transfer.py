"""Prefill/decode disaggregation on transport tcp (docs/disaggregation.md):
the prefill's blocks pulled worker to worker, no shared directory.

- Flags: transport tcp needs no --kv-offloading-dir; without a secret file
  (or insecure: true, asked for by name) it is refused at start; a secret
  file too short, a bad transport and a bad lease_ms are refused naming the
  field, and so is an shm other than auto or off; transport dir (the
  default) still needs the directory; --pp 2, MTP speculation and
  (DeepSeek) --enable-dp-attention are refused by name (not built).
- The prefill side holds its blocks (delayed free, the lease): a request
  with do_remote_decode answers vLLM's kv_transfer_params with
  remote_block_ids the pool's block ids (ints) and remote_block_hashes the
  chain hashes; loom_kv_transfer_held_blocks counts the held blocks while no
  decode side reads them and returns to 0 once lease_ms has passed; the
  held blocks are not handed to other requests meanwhile (a second prefill
  of another prompt gets other block ids).
- The decode side pulls, driven as vLLM's proxy drives it: a prefill replica
  (TP 1) and decode replicas of TP 1 and TP 2 (each rank reads its half of
  the heads, through shared memory: one host): greedy and seeded outputs
  equal a unified replica's token for token, the decode side computes at most one block of each prompt,
  cached_tokens counts the pulled tokens, and the prefill's held blocks are
  freed once the decode side reports them read (the gauge back to 0 long
  before the lease); forged block hashes are refused (400 naming the
  entry). The TP 1 decode runs with --async-scheduling; on the TP 2 one
  (without it) a pull of a transfer the prefill does not hold is
  recomputed with equal output.
- Failures (the two decode sides with --async-scheduling: nothing is
  planned ahead of a step that pulls): params naming a service that does not hold the secret (a
  forged host) are refused by the decode side's check of its proof: the
  prompt is recomputed (recompute, equal output, cached_tokens 0) or the
  request fails with 503 (fail); a decode side with
  another KV dtype, or of another model (its checkpoint's digest differs),
  is refused by the handshake naming the field (503 under fail); a transfer
  the prefill does not hold (unknown blocks) the same; the prefill replica
  killed (SIGKILL) during the decode's pull (each block served slowly by a
  test hook): recompute gives equal output, fail 503.
- A TP=2 prefill and a TP=1 decode behind loom-router --pd: the decode
  reads each prefill rank's heads; outputs equal a unified replica's. A
  prefill replica killed mid-transfer behind a second router, the decode
  under fail: the client gets the decode side's 503 (relayed, not failed
  over), and the router serves on.
- DeepSeek-V3's latent KV (MLA): a TP 1 prefill and a TP 2 decode (each
  rank reads the whole replicated latent block; shm off: over the socket):
  outputs equal a unified replica's, at most one block of each prompt
  computed on the decode side; from a TP 2 prefill (a prompt the decode
  side has not cached) the two decode ranks read the two prefill ranks, one
  each."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, STORIES, Cluster, check, parse_stats, run_tests, scaled, wait_for, with_env  # noqa: E402
from test_http import KEY, free_port, get_metrics, post  # noqa: E402

B = 16
STORY = ("Once upon a time there was a little girl named Lily. She loved to play outside in the sun. "
         "One day she saw a big red ball in the park and ran to get it. Her friend Tom came too and "
         "they played together all day until the sun went down and it was time to go home. ")
PROMPTS = ["Kite " + STORY, "Moon " + STORY * 2]
PD_PROMPTS = [word + " " + STORY + ("and then " * k) for k, word in enumerate(["Kite", "Moon", "Pear", "Rose"])]


def call(port, path, body):
    status, data = post(port, path, body, timeout=120)
    check(status == 200, "%s %r: %d %r" % (path, body, status, data[:300]))
    return json.loads(data)


def gauge(port, name):
    _, samples = get_metrics(port)
    vals = [float(v) for n, _, v in samples if n == name]
    return sum(vals) if vals else None


_WORK = []


def workdir(prefix):
    """A temporary directory removed when the script ends (run_tests returns)."""
    d = tempfile.mkdtemp(prefix=prefix)
    _WORK.append(d)
    return d


def secret_file(work, data=b"0123456789abcdef0123456789abcdef\n"):
    path = os.path.join(work, "kv-secret")
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)
    return path


def tcp_config(role, secret=None, policy="recompute", **extra):
    x = {"transport": "tcp"}
    if secret:
        x["secret_file"] = secret
    x.update(extra)
    return json.dumps({"kv_connector": "LoomConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": x})


def tcp_cluster(port, role, secret, tp=1, policy="recompute", extra=(), model=STORIES, **x):
    args = ["--block-size", str(B), "--kv-transfer-config", tcp_config(role, secret, policy, **x)] + list(extra)
    if port:
        args += ["--http", "127.0.0.1:%d" % port, "--api-key", KEY, "--served-model-name", "stories260K"]
    return Cluster(model, tp, 1, coord_args=args)


def refused(port, body, status, words):
    st, data = post(port, "/v1/completions", body, timeout=120)
    check(st == status and all(w in data.decode() for w in words),
          "%r: want %d with %r, got %d %r" % (body.get("kv_transfer_params"), status, words, st, data[:300]))


def unified_outputs(bodies, model=STORIES):
    port = free_port()
    with Cluster(model, 1, 1, coord_args=["--http", "127.0.0.1:%d" % port, "--api-key", KEY,
                                            "--block-size", str(B)]):
        return [call(port, "/v1/completions", b)["choices"][0]["text"] for b in bodies]


def prefill(port, body):
    pre = call(port, "/v1/completions", dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    return pre["kv_transfer_params"], pre["usage"]["prompt_tokens"]


def test_pull():
    work = workdir("loom-pd-pull-")
    secret = secret_file(work)
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in PD_PROMPTS]
    bodies += [{"prompt": p, "max_tokens": 16, "temperature": 0.8, "seed": 11} for p in PD_PROMPTS[:2]]
    fresh = {"prompt": "Plum " + STORY + "and so on " * 3, "max_tokens": 16, "temperature": 0}  # new to the decode
    unified = unified_outputs(bodies + [fresh, {"prompt": "Kite", "max_tokens": 8, "temperature": 0}])
    short_want = unified.pop()
    fresh_want = unified.pop()
    pport = free_port()
    with tcp_cluster(pport, "kv_producer", secret, lease_ms=600000):  # only the decode side's done frees them
        for tp in (1, 2):
            dport = free_port()
            # TP 1 with overlapped scheduling: nothing is planned ahead of a step that pulls, the rest as usual
            extra = ["--async-scheduling"] if tp == 1 else []
            with tcp_cluster(dport, "kv_consumer", secret, tp=tp, extra=extra) as dec:
                base = gauge(pport, "loom_kv_transfer_held_blocks")  # the refused decodes' holds below stay
                for b, want in zip(bodies, unified):
                    kv, n_prompt = prefill(pport, b)
                    check(len(kv["loom_remote_ranks"]) == 1 and kv["loom_remote_ranks"][0].endswith(
                        ":%d" % kv["remote_port"]), "prefill's params: %r" % kv)
                    got = call(dport, "/v1/completions", dict(b, kv_transfer_params=kv))
                    check(got["choices"][0]["text"] == want,
                          "TP %d decode %r != unified %r" % (tp, got["choices"][0]["text"], want))
                    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                    check(cached == len(kv["remote_block_ids"]) * B and n_prompt - cached <= B,
                          "TP %d decode computed %d of %d prompt tokens" % (tp, n_prompt - cached, n_prompt))
                if extra:  # the decodes after each pulling step were planned ahead
                    st = subprocess.run([os.path.join(BIN, "loom"), "stats", "--addr", dec.addr, "--api-key", KEY],
                                        capture_output=True, text=True, timeout=30)
                    check(st.returncode == 0 and parse_stats(st.stdout)["ahead_tokens"] > 0,
                          "TP 1 with --async-scheduling: nothing planned ahead: %s" % (st.stdout + st.stderr)[-300:])
                # one host: every decode rank's pulls went through shared memory (shm "auto", the default)
                for r in range(tp):
                    log = dec.log("worker-%d" % r)
                    check("over shared memory" in log and "over tcp in" not in log,
                          "TP %d rank %d did not pull through shared memory" % (tp, r))
                # read (the seeded bodies' prompts were in the decode's prefix cache: nothing pulled, done still
                # sent): the prefill frees them all, long before the lease
                wait_for(lambda: gauge(pport, "loom_kv_transfer_held_blocks") == base, 10, "the blocks freed once read")
                # a prompt shorter than a block: nothing held, nothing pulled
                short = {"prompt": "Kite", "max_tokens": 8, "temperature": 0}
                kv, _ = prefill(pport, short)
                check(kv["remote_block_ids"] == [] and gauge(pport, "loom_kv_transfer_held_blocks") == base,
                      "a short prompt's params: %r" % kv)
                got = call(dport, "/v1/completions", dict(short, kv_transfer_params=kv))
                check(got["choices"][0]["text"] == short_want and got["usage"]["prompt_tokens_details"]["cached_tokens"]
                      == 0, "a short prompt's decode: %r" % got)
                kv, _ = prefill(pport, bodies[0])
                forged = dict(kv, remote_block_hashes=kv["remote_block_hashes"][:1] + ["%016x" % 12345])
                refused(dport, dict(bodies[0], kv_transfer_params=forged), 400, ["remote_block_hashes[1]"])
                refused(dport, dict(bodies[0], kv_transfer_params=dict(kv, remote_block_ids=kv["remote_block_ids"][:1])),
                        400, ["remote_block_ids"])
                if tp == 2:  # without the flag (test_failures' decodes have it): a failed pull recomputed the same
                    kv, _ = prefill(pport, fresh)
                    stale = dict(kv, loom_transfer_id="%016x" % (int(kv["loom_transfer_id"], 16) ^ 1))
                    got = call(dport, "/v1/completions", dict(fresh, kv_transfer_params=stale))
                    check(got["choices"][0]["text"] == fresh_want and
                          got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
                          "a failed pull without --async-scheduling, recompute: %r" % got)


def test_pull_deepseek():
    """DeepSeek-V3's latent KV (MLA, one replicated row a token and layer):
    a TP 1 prefill replica and a TP 2 decode replica (each rank reads the
    whole latent block from the prefill's rank): greedy and seeded outputs
    equal a unified replica's, the decode side computes at most one block of
    each prompt, the prefill's blocks are freed once read; both replicas with
    --encrypt-data-plane: the decode's pulls over the socket, sealed."""
    from test_deepseek import v3
    model = v3()
    work = workdir("loom-pd-mla-")
    secret = secret_file(work)
    bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in PD_PROMPTS[:2]]
    bodies.append({"prompt": PD_PROMPTS[2], "max_tokens": 12, "temperature": 0.8, "seed": 7})
    fresh = {"prompt": PD_PROMPTS[3], "max_tokens": 12, "temperature": 0}  # not in the decode's prefix cache
    unified = unified_outputs(bodies + [fresh], model)
    fresh_want = unified.pop()
    pport, dport = free_port(), free_port()
    seal = ["--encrypt-data-plane"]  # the KV transfer's messages sealed too
    with tcp_cluster(pport, "kv_producer", secret, lease_ms=600000, model=model, extra=seal), \
            tcp_cluster(dport, "kv_consumer", secret, tp=2, model=model, shm="off", extra=seal) as dec:
        for b, want in zip(bodies, unified):
            kv, n_prompt = prefill(pport, b)
            got = call(dport, "/v1/completions", dict(b, kv_transfer_params=kv))
            check(got["choices"][0]["text"] == want, "MLA TP 2 decode %r != unified %r"
                  % (got["choices"][0]["text"], want))
            cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
            check(len(kv["remote_block_ids"]) > 0 and cached == len(kv["remote_block_ids"]) * B
                  and n_prompt - cached <= B, "MLA decode computed %d of %d prompt tokens" % (n_prompt - cached,
                                                                                           n_prompt))
        wait_for(lambda: gauge(pport, "loom_kv_transfer_held_blocks") == 0, 10, "the latent blocks freed once read")
        for r in range(2):  # shm "off" on the decode side: over the socket although on one host, sealed
            log = dec.log("worker-%d" % r)
            check("over tcp (sealed) in" in log and "over shared memory" not in log and "over tcp in" not in log,
                  "rank %d's pulls: not over tcp, sealed" % r)
        # a TP 2 prefill: the latent block is on both its ranks; decode rank r reads it from prefill rank r, so the
        # group's reads spread
        pport2 = free_port()
        with tcp_cluster(pport2, "kv_producer", secret, tp=2, lease_ms=600000, model=model, extra=seal):
            kv, n_prompt = prefill(pport2, fresh)
            got = call(dport, "/v1/completions", dict(fresh, kv_transfer_params=kv))
            check(got["choices"][0]["text"] == fresh_want and got["usage"]["prompt_tokens_details"]["cached_tokens"]
                  == len(kv["remote_block_ids"]) * B, "MLA from a TP 2 prefill: %r" % got)
            tid = kv["loom_transfer_id"]
            srcs = [[ln.split(" from ")[1].split(" ")[0] for ln in dec.log("worker-%d" % r).splitlines()
                     if "KV pull of transfer %s" % tid in ln] for r in range(2)]
            # (a worker's name is not its TP rank: the two ranks read the two prefill ranks, one each)
            check(all(len(x) == 1 for x in srcs) and sorted(x[0] for x in srcs) == sorted(kv["loom_remote_ranks"]),
                  "each decode rank reads its own prefill rank: %r, ranks %r" % (srcs, kv["loom_remote_ranks"]))


def test_failures():
    work = workdir("loom-pd-fail-")
    secret = secret_file(work)
    other = os.path.join(work, "other")
    with open(other, "wb") as f:
        f.write(b"a different secret, 32 bytes....\n")
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in PD_PROMPTS[:3]]
    unified = unified_outputs(bodies)
    pport, fport, rport, xport, iport = free_port(), free_port(), free_port(), free_port(), free_port()

    def recomputed(body, kv, want, what):
        got = call(rport, "/v1/completions", dict(body, kv_transfer_params=kv))
        check(got["choices"][0]["text"] == want and got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
              "%s, recompute: %r != %r (cached %r)" % (what, got["choices"][0]["text"], want,
                                                       got["usage"]["prompt_tokens_details"]["cached_tokens"]))

    # both decode sides with overlapped scheduling: the failed pull's step is not planned ahead of, so it is recomputed
    # or fails its request as without the flag (test_pull's TP 2 decode and iport below run without it)
    ahead = ["--async-scheduling"]
    with tcp_cluster(rport, "kv_consumer", secret, extra=ahead), \
            tcp_cluster(xport, "kv_consumer", secret, policy="fail", extra=ahead):
        with tcp_cluster(pport, "kv_producer", secret), tcp_cluster(fport, "kv_producer", other):
            # a forged host: params naming a service that does not hold the secret
            kv, _ = prefill(fport, bodies[0])
            recomputed(bodies[0], kv, unified[0], "a forged host")
            refused(xport, dict(bodies[0], kv_transfer_params=kv), 503, ["does not hold the secret"])
            # unknown blocks: a transfer the prefill does not hold (a stale or made-up id)
            kv, _ = prefill(pport, bodies[1])
            stale = dict(kv, loom_transfer_id="%016x" % (int(kv["loom_transfer_id"], 16) ^ 1))
            recomputed(bodies[1], stale, unified[1], "unknown blocks")
            refused(xport, dict(bodies[1], kv_transfer_params=stale), 503, ["unknown blocks"])
            # the real one still pulls after those
            got = call(rport, "/v1/completions", dict(bodies[1], kv_transfer_params=kv))
            check(got["choices"][0]["text"] == unified[1] and got["usage"]["prompt_tokens_details"]["cached_tokens"]
                  > 0, "the held transfer after refused reads: %r" % got["usage"])
            # a decode side whose KV differs (another dtype): the handshake names the field
            with tcp_cluster(iport, "kv_consumer", secret, policy="fail", extra=["--kv-cache-dtype", "int8"]):
                kv, _ = prefill(pport, bodies[2])
                refused(iport, dict(bodies[2], kv_transfer_params=kv), 503, ["kv_dtype: int8 here, f32 there"])
            # another model (its checkpoint's digest differs: here its config.json's bytes; the same tokenizer)
            other_model = os.path.join(work, "other-model")
            shutil.copytree(STORIES, other_model)
            with open(os.path.join(other_model, "config.json"), "a") as f:
                f.write("\n")
            with tcp_cluster(iport, "kv_consumer", secret, policy="fail", model=other_model):
                kv, _ = prefill(pport, bodies[2])
                refused(iport, dict(bodies[2], kv_transfer_params=kv), 503, ["handshake refused, model: digest"])
        # the prefill replica killed with SIGKILL in the middle of the transfer (each block served slowly)
        for port, policy in ((rport, "recompute"), (xport, "fail")):
            def killed():
                with tcp_cluster(pport, "kv_producer", secret) as pre:
                    kv, _ = prefill(pport, bodies[2])
                    result = {}

                    def decode():
                        result["r"] = post(port, "/v1/completions", dict(bodies[2], kv_transfer_params=kv),
                                           timeout=120)
                    t = threading.Thread(target=decode)
                    t.start()
                    time.sleep(scaled(0.5))
                    for name in ("worker-0", "coordinator"):
                        os.kill(pre.pid(name), signal.SIGKILL)
                    t.join(scaled(60))
                    return result.get("r")
            r = with_env("LOOM_TEST_KV_SERVE_DELAY_MS", str(int(scaled(1000))), killed)
            check(r is not None, "%s: the decode did not answer after the kill" % policy)
            st, data = r
            if policy == "recompute":
                got = json.loads(data) if st == 200 else None
                check(got and got["choices"][0]["text"] == unified[2], "killed mid-transfer, recompute: %d %r"
                      % (st, data[:300]))
            else:
                check(st == 503 and b"could not be pulled" in data, "killed mid-transfer, fail: %d %r" % (st, data[:300]))


def test_router_tp2_prefill():
    """A TP=2 prefill replica and a TP=1 decode replica behind loom-router --pd
    (the router passes the params on unchanged): the decode reads each
    prefill rank's half of the heads; outputs equal a unified replica's, the
    decode side computes at most one block of each prompt. Then, behind a
    second router, a prefill replica killed (SIGKILL) during the decode's
    pull under kv_load_failure_policy fail: the client gets the decode
    side's 503, not a hang, and the router goes on serving (the next
    request computed on the decode side, equal output)."""
    from test_router import Router
    work = workdir("loom-pd-router-")
    secret = secret_file(work)
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in PD_PROMPTS[:3]]
    bodies.append({"prompt": PD_PROMPTS[3], "max_tokens": 16, "temperature": 0.8, "seed": 5})
    unified = unified_outputs(bodies)
    with tcp_cluster(0, "kv_producer", secret, tp=2) as pre, \
            tcp_cluster(0, "kv_consumer", secret, policy="fail") as dec:
        with Router(["--pd", "--prefill-replica", pre.addr, "--replica", dec.addr, "--pd-min-prompt-tokens", "32"],
                    http=True, expect_up=2) as router:
            for b, want in zip(bodies, unified):
                got = call(router.http, "/v1/completions", b)
                check(got["choices"][0]["text"] == want, "through the router %r != unified %r"
                      % (got["choices"][0]["text"], want))
                n_prompt = got["usage"]["prompt_tokens"]
                cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                check(n_prompt - cached <= B, "the decode side computed %d of %d prompt tokens"
                      % (n_prompt - cached, n_prompt))

        fresh = {"prompt": "Plum " + STORY * 2, "max_tokens": 16, "temperature": 0}  # not in the decode's cache

        def killed():  # each block served slowly (a test hook): the kill lands mid-pull
            with tcp_cluster(0, "kv_producer", secret) as slow, \
                    Router(["--pd", "--prefill-replica", slow.addr, "--replica", dec.addr, "--pd-min-prompt-tokens",
                            "32"], http=True, expect_up=2) as router:
                result = {}

                def decode():
                    result["r"] = post(router.http, "/v1/completions", fresh, timeout=120)
                t = threading.Thread(target=decode)
                t.start()
                time.sleep(scaled(1.0))  # the prefill is done in a fraction of that; the pull takes a second a block
                for name in ("worker-0", "coordinator"):
                    os.kill(slow.pid(name), signal.SIGKILL)
                t.join(scaled(60))
                check("r" in result, "fail, through the router: no answer after the prefill was killed")
                st, data = result["r"]
                check(st == 503 and b"could not be pulled" in data, "killed mid-transfer, fail, through the router: "
                      "%d %r" % (st, data[:300]))
                # the router serves on: the prefill replica gone, the decode side computes
                got = call(router.http, "/v1/completions", bodies[2])
                check(got["choices"][0]["text"] == unified[2], "after the kill, through the router %r != unified %r"
                      % (got["choices"][0]["text"], unified[2]))
        with_env("LOOM_TEST_KV_SERVE_DELAY_MS", str(int(scaled(1000))), killed)


def test_flags():
    work = workdir("loom-pd-flags-")
    coord = [os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES, "--listen", "tcp://127.0.0.1:0",
             "--control", "tcp://127.0.0.1:0"]
    short = secret_file(work, b"tiny\n")

    def cfg(**x):
        return ["--kv-transfer-config", json.dumps({"kv_connector": "LoomConnector", "kv_connector_extra_config": x})]
    cases = [
        (coord + cfg(transport="tcp"), "secret_file"),
        (coord + cfg(transport="tcp"), "insecure: true"),
        (coord + cfg(transport="tcp", secret_file=short), "at least 16"),
        (coord + cfg(transport="tcp", secret_file=os.path.join(work, "none")), "No such file"),
        (coord + cfg(transport="rdma"), "transport"),
        (coord + cfg(transport="tcp", insecure=True, shm="on"), "kv_connector_extra_config.shm"),
        (coord + cfg(transport="tcp", insecure=True, lease_ms=0), "lease_ms"),
        (coord + cfg(transport="tcp", insecure=True, encrypt=True), "encrypt needs secret_file"),
        (coord + ["--encrypt-data-plane"] + cfg(transport="tcp", insecure=True), "not insecure: true"),
        (coord + cfg(transport="dir"), "--kv-offloading-dir"),
        (coord + cfg(secret_file=short), "transport tcp"),
        (coord + ["--pp", "2"] + cfg(transport="tcp", insecure=True), "--pp 1"),
        (coord + ["--speculative-method", "mtp"] + cfg(transport="tcp", insecure=True), "MTP module's latent cache"),
    ]
    from test_deepseek import v3
    mla = [a if a != STORIES else v3() for a in coord]
    cases.append((mla + ["--tp", "2", "--enable-dp-attention"] + cfg(transport="tcp", insecure=True),
                  "--enable-dp-attention does not serve the KV offload tiers"))
    for argv, words in cases:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and words in p.stderr, "%r: exit %d, %r" % (argv[-1], p.returncode, p.stderr[-300:]))


def test_lease():
    work = workdir("loom-pd-lease-")
    secret = secret_file(work)
    lease_ms = int(scaled(3000))
    port = free_port()
    with tcp_cluster(port, "kv_producer", secret, lease_ms=lease_ms):
        check(gauge(port, "loom_kv_transfer_held_blocks") == 0, "held blocks before any prefill")
        kvs = []
        t0 = time.monotonic()
        for p in PROMPTS:
            pre = call(port, "/v1/completions", {"prompt": p, "max_tokens": 1, "temperature": 0,
                                                  "kv_transfer_params": {"do_remote_decode": True}})
            kv = pre["kv_transfer_params"]
            n_prompt = pre["usage"]["prompt_tokens"]
            n = (n_prompt - 1) // B
            check(kv["do_remote_prefill"] and not kv["do_remote_decode"] and len(kv["remote_block_ids"]) == n
                  and all(isinstance(b, int) for b in kv["remote_block_ids"])
                  and len(kv["remote_block_hashes"]) == n and kv["loom_transfer_id"] and kv["tp_size"] == 1
                  and kv["remote_host"] and kv["remote_port"] > 0,
                  "prefill's params: %r" % kv)
            kvs.append(kv)
        held = sum(len(k["remote_block_ids"]) for k in kvs)
        check(not set(kvs[0]["remote_block_ids"]) & set(kvs[1]["remote_block_ids"]),
              "the second prefill was given held blocks: %r" % kvs)
        got = gauge(port, "loom_kv_transfer_held_blocks")
        if time.monotonic() - t0 < lease_ms / 1e3:
            check(got == held, "held blocks %r, want %d" % (got, held))
        wait_for(lambda: gauge(port, "loom_kv_transfer_held_blocks") == 0, 30, "the lease to free the blocks")
        check(time.monotonic() - t0 >= lease_ms / 1e3 * 0.9, "freed before the lease passed")


if __name__ == "__main__":
    try:
        run_tests([test_flags, test_lease, test_pull, test_pull_deepseek, test_failures, test_router_tp2_prefill])
    finally:
        for d in _WORK:
            shutil.rmtree(d, ignore_errors=True)

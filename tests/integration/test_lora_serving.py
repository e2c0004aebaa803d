"""LoRA adapters served over a grid of real workers (docs/lora.md): requests
over the base model and several adapters run concurrently in mixed batches
(--max-loras below the adapters in use, so adapters are evicted and loaded
again while others run), on 1x1 and 2x2 grids, and with the workers'
adapter preparation slowed; each request's greedy ids
equal `loom run` on the merged weights (tests/reference/gen_lora.py merge,
float64, the independent reference) or on the base model. An unknown model
is NOT_FOUND with OpenAI's message. Over HTTP: the OpenAI SDK selects an
adapter by "model" and lists them in /v1/models; vLLM's runtime
/v1/load_lora_adapter and /v1/unload_lora_adapter; a reload under the same
name with other weights gets the new output and no prefix-cache hits from
the old adapter's blocks; /metrics reports the adapters. A runtime load's
read runs off the coordinator's reactor: streams keep producing tokens and
/health answers while a slow one (a test hook's delay) is pending; two
concurrent loads of one name: one is registered, the other told the name
is taken."""
import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (BIN, PYTHON, ROOT, STORIES, Cluster, check, free_port, generate, run_local, run_tests, parse_ids,  # noqa: E402
                     scaled, wait_for)

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-lora-serving")
GEN = os.path.join(ROOT, "tests", "reference", "gen_lora.py")
PROMPTS = ["Once upon a time", "The little dog", "She went to the park"]
N = 24


def gen(*args):
    subprocess.run([PYTHON, GEN] + [str(a) for a in args], check=True, capture_output=True, timeout=300)


def adapter(name, *flags):
    d = os.path.join(WORK, name)
    if not os.path.exists(os.path.join(d, "adapter_config.json")):
        gen("adapter", STORIES, d, *flags)
    return d


def merged(ad, name):
    d = os.path.join(WORK, name)
    if not os.path.exists(os.path.join(d, "config.json")):
        gen("merge", STORIES, ad, d)
    return d


ADAPTERS = {}  # name -> (adapter dir, merged model dir)


def setup():
    os.makedirs(WORK, exist_ok=True)
    for i, (name, flags) in enumerate([("a", ("--r", 8, "--alpha", 16, "--std", 0.1)),
                                       ("b", ("--r", 8, "--alpha", 16, "--rslora", "--std", 0.1)),
                                       ("c", ("--r", 16, "--alpha", 32, "--targets", "q_proj,v_proj,down_proj",
                                              "--std", 0.15))]):
        ad = adapter("serve_" + name, *flags, "--seed", 21 + i)
        ADAPTERS[name] = (ad, merged(ad, "serve_%s_merged" % name))


def reference():
    """(model name or None, prompt) -> the greedy ids of loom run on the merged weights."""
    want = {}
    for p in PROMPTS:
        _, want[(None, p)] = run_local(STORIES, p, N, extra=["--ignore-eos"])
        for name, (_, m) in ADAPTERS.items():
            _, want[(name, p)] = run_local(m, p, N, extra=["--ignore-eos"])
    for name in ADAPTERS:
        check(want[(name, PROMPTS[0])] != want[(None, PROMPTS[0])],
              "adapter %s does not change the output: the test would not see a lost delta" % name)
    return want


def lora_args(max_loras):
    # both of vLLM's forms: name=path, and the JSON object with base_model_name
    mods = ["%s=%s" % (n, a) for n, (a, _) in sorted(ADAPTERS.items()) if n != "c"]
    mods.append(json.dumps({"name": "c", "path": ADAPTERS["c"][0], "base_model_name": "stories260K"}))
    return ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", "16", "--lora-modules"] + mods


def mixed_batch(c, want, rounds=2):
    """Every (model, prompt) pair at once, twice over: base rows and every adapter in flight together."""
    for r in range(rounds):
        jobs = []
        for p in PROMPTS:
            for name in [None] + sorted(ADAPTERS):
                extra = ["--ignore-eos"] + (["--lora", name] if name else [])
                jobs.append((name, p, c.generate_async(p, N, 0.0, extra)))
        for name, p, proc in jobs:
            out, err = proc.communicate(timeout=scaled(120))
            check(proc.returncode == 0, "generate %s %r failed: %s" % (name, p, err[-1000:]))
            got = parse_ids(err)
            check(got == want[(name, p)], "round %d, %s on %r: %s, the merged weights: %s" %
                  (r, name or "base", p, got, want[(name, p)]))
    print("  %d requests over the base and %d adapters, %d rounds: each equals its merged model" %
          (len(PROMPTS) * (len(ADAPTERS) + 1), len(ADAPTERS), rounds))


def test_mixed_1x1():
    want = reference()
    # 3 adapters, 2 slots: an adapter waits for a slot while the others run, then is loaded into an evicted one
    with Cluster(STORIES, 1, 1, coord_args=lora_args(2), threads=2) as c:
        mixed_batch(c, want)
        rc, _, _, err = c.generate(PROMPTS[0], 4, extra=["--lora", "nope"])
        check(rc != 0 and "The model `nope` does not exist." in err, "an unknown adapter: %d %r" % (rc, err))
        # SGLang's base:adapter names the same adapter
        base_name = os.path.basename(STORIES.rstrip("/"))
        rc, _, got, err = c.generate(PROMPTS[1], N, extra=["--ignore-eos", "--model", "%s:b" % base_name])
        check(rc == 0 and got == want[("b", PROMPTS[1])], "base:adapter: %d %s %r" % (rc, got, err[-300:]))


def test_mixed_slow_prepare():
    """The mixed batches with every worker's adapter preparation slowed (LOOM_TEST_LORA_PREPARE_DELAY_MS, as a
    busy machine or a slow disk does): while one slot waits for its adapter the other takes the cached ones in
    turn, and the adapter prepared meanwhile is installed, not dropped from the host cache as the least recently
    used one."""
    want = reference()
    with HookCluster({"LOOM_TEST_LORA_PREPARE_DELAY_MS": "100"}, STORIES, 1, 1, coord_args=lora_args(2),
                     threads=2) as c:
        mixed_batch(c, want, rounds=4)


def test_mixed_2x2():
    want = reference()
    with Cluster(STORIES, 2, 2, coord_args=lora_args(2), threads=1) as c:
        mixed_batch(c, want, rounds=1)


def request(port, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=scaled(60))
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"} if body is not None else {})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def complete(port, model, prompt, n=N):
    status, data = request(port, "POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                                              "temperature": 0, "ignore_eos": True})
    return status, (json.loads(data)["choices"][0]["text"] if status == 200 else data)


def zmq_text(c, prompt, name):
    rc, out, _, err = c.generate(prompt, N, extra=["--ignore-eos"] + (["--lora", name] if name else []))
    check(rc == 0, "loom generate --lora %s failed: %s" % (name, err[-500:]))
    return out[:-1] if out.endswith("\n") else out


def error_of(status, data, want):
    check(status == want, "expected %d, got %d: %s" % (want, status, data[:300]))
    return json.loads(data)["error"]


def metric(text, name):
    """The sum of a metric's samples in a Prometheus exposition."""
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{") or
               l.startswith(name + " "))


def test_http_sdk():
    node = shutil.which("node") is not None and os.path.isdir(os.path.join(ROOT, "tests", "reference",
                                                                           "node_modules", "openai"))
    port = free_port()
    with Cluster(STORIES, 1, 1, coord_args=lora_args(2) + ["--http", "127.0.0.1:%d" % port]) as c:
        want = {name: zmq_text(c, PROMPTS[0], name) for name in sorted(ADAPTERS)}
        if node:
            spec = {"prompt": PROMPTS[0], "max_tokens": N, "adapters": sorted(ADAPTERS)}
            p = subprocess.run(["node", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdk_lora.mjs"),
                                "http://127.0.0.1:%d/v1" % port, json.dumps(spec)], capture_output=True, text=True,
                               timeout=scaled(120))
            check(p.returncode == 0, "the OpenAI SDK client failed: %s" % (p.stderr[-2000:] or p.stdout[-500:]))
            out = json.loads(p.stdout)
            base = os.path.basename(STORIES.rstrip("/"))
            check(out["models"][0] == {"id": base, "parent": None, "root": None}, "the base model: %r" % out["models"])
            listed = {m["id"]: m for m in out["models"][1:]}
            for name, (ad, _) in ADAPTERS.items():
                check(listed.get(name) == {"id": name, "parent": base, "root": ad}, "adapter %s listed as %r" %
                      (name, listed.get(name)))
                got = out["text"][name]
                check(got["text"] == want[name] and got["model"] == name, "SDK with model %s: %r, over ZeroMQ %r" %
                      (name, got, want[name]))
            u = out["unknown"]
            check(u["status"] == 404 and u["not_found"] and u["code"] == "model_not_found" and
                  "The model `no-such-adapter` does not exist." in u["message"], "an unknown model: %r" % u)
            print("  openai SDK: /v1/models lists %d adapters; model=NAME selects each; an unknown one is 404" %
                  len(ADAPTERS))
        else:
            print("  (node or the openai SDK is missing: the SDK part is skipped)")
        # runtime updating is off here: a clear 400
        e = error_of(*request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": ADAPTERS["a"][0]}),
                     400)
        check("--allow-runtime-lora-updating" in e["message"], "updating off: %r" % e)
        # metrics: every adapter requested, the slots
        status, text = request(port, "GET", "/metrics")
        check(status == 200, "/metrics: %d" % status)
        check(metric(text, "loom_lora_requests_total") >= len(ADAPTERS), "loom_lora_requests_total in %s" %
              [l for l in text.splitlines() if "lora" in l])
        check('vllm:lora_requests_info{' in text and 'max_lora="2"' in text, "vllm:lora_requests_info missing")
        check(metric(text, "loom_lora_loads_total") >= len(ADAPTERS), "loom_lora_loads_total")


def test_runtime_updates():
    """vLLM's runtime endpoints; a reload under one name with other weights: the new output, no stale KV."""
    d1 = adapter("rt_d1", "--r", 8, "--alpha", 16, "--std", 0.1, "--seed", 31)
    d2 = adapter("rt_d2", "--r", 8, "--alpha", 16, "--std", 0.1, "--seed", 32)
    long_prompt = " ".join(PROMPTS * 4)  # several KV blocks: the prefix cache has whole blocks to share
    _, want1 = run_local(merged(d1, "rt_d1_merged"), long_prompt, N, extra=["--ignore-eos"])
    _, want2 = run_local(merged(d2, "rt_d2_merged"), long_prompt, N, extra=["--ignore-eos"])
    check(want1 != want2, "two adapters with the same output: the reload would not be seen")
    port = free_port()
    env_args = lora_args(1) + ["--allow-runtime-lora-updating", "--http", "127.0.0.1:%d" % port]
    with Cluster(STORIES, 1, 1, coord_args=env_args) as c:
        status, text = request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": d1})
        check(status == 200 and "Success: LoRA adapter 'd' added successfully." in text, "load: %d %s" % (status, text))
        e = error_of(*request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": d1}), 400)
        check("already been loaded" in e["message"], "a second load: %r" % e)
        e = error_of(*request(port, "POST", "/v1/load_lora_adapter",
                              {"lora_name": "bad", "lora_path": os.path.join(WORK, "no_such_dir")}), 404)
        check("no_such_dir" in e["message"], "a missing directory (vLLM: 404): %r" % e)
        e = error_of(*request(port, "POST", "/v1/load_lora_adapter",
                              {"lora_name": "big", "lora_path": adapter("rt_r32", "--r", 32, "--seed", 33)}), 400)
        check("rank 32 is greater than max_lora_rank 16" in e["message"], "rank over the limit: %r" % e)
        e = error_of(*request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "stories260K", "lora_path": d1}),
                     400)
        check("served model's name" in e["message"], "the base model's name: %r" % e)
        e = error_of(*request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "x"}), 400)
        check("lora_path" in e["message"], "no lora_path: %r" % e)
        status, data = request(port, "GET", "/v1/models")
        check(status == 200 and "d" in [m["id"] for m in json.loads(data)["data"]], "d not listed: %s" % data)
        rc, _, got, err = c.generate(long_prompt, N, extra=["--ignore-eos", "--lora", "d"])
        check(rc == 0 and got == want1, "d (first weights): %s, merged %s" % (got, want1))
        hits0 = c.stats()["prefix_cache_hits"]
        rc, _, got, err = c.generate(long_prompt, N, extra=["--ignore-eos", "--lora", "d"])
        hits1 = c.stats()["prefix_cache_hits"]
        check(rc == 0 and got == want1 and hits1 > hits0, "d again: %s, hits %d -> %d" % (got, hits0, hits1))
        status, text = request(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "d"})
        check(status == 200 and "removed successfully" in text, "unload: %d %s" % (status, text))
        e = error_of(*complete(port, "d", long_prompt), 404)
        check(e["code"] == "model_not_found" and "The model `d` does not exist." in e["message"], "after unload: %r" % e)
        e = error_of(*request(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "d"}), 404)
        check("cannot be found" in e["message"], "a second unload: %r" % e)
        # the same name, other weights: another content digest, so another prefix-cache key
        status, text = request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": d2})
        check(status == 200, "reload: %d %s" % (status, text))
        rc, _, got, err = c.generate(long_prompt, N, extra=["--ignore-eos", "--lora", "d"])
        hits2 = c.stats()["prefix_cache_hits"]
        check(rc == 0 and got == want2, "d reloaded with other weights: %s, merged %s (old %s)" % (got, want2, want1))
        check(hits2 == hits1, "the reloaded adapter hit %d cached blocks of the old one" % (hits2 - hits1))
        # the static adapters and the base still run next to it (1 slot: each swaps in)
        rc, _, got, _ = c.generate(PROMPTS[0], N, extra=["--ignore-eos", "--lora", "a"])
        _, wa = run_local(ADAPTERS["a"][1], PROMPTS[0], N, extra=["--ignore-eos"])
        check(rc == 0 and got == wa, "a after the reload: %s, merged %s" % (got, wa))
    print("  load, use, 400 on a second load, unload, 404, reload with other weights: new ids, 0 stale hits")


def stream_gaps(port, model, prompt, n):
    """A streamed completion: its chunks' texts and the longest wait for one (the first counted from the send)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=scaled(60))
    try:
        t = time.monotonic()
        conn.request("POST", "/v1/completions", body=json.dumps({"model": model, "prompt": prompt, "max_tokens": n,
                                                                 "temperature": 0, "ignore_eos": True,
                                                                 "stream": True}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            check(False, "stream: %d %s" % (r.status, r.read()[:300]))
        texts, gap = [], 0.0
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            now = time.monotonic()
            gap, t = max(gap, now - t), now
            if line.strip() == b"data: [DONE]":
                break
            texts.append(json.loads(line[6:])["choices"][0]["text"])
        return texts, gap
    finally:
        conn.close()


class Load(threading.Thread):
    """A /v1/load_lora_adapter call on its own thread: (status, text) and the moment it was answered."""
    def __init__(self, port, name, path):
        super().__init__(daemon=True)
        self.port, self.body, self.result, self.done_at = port, {"lora_name": name, "lora_path": path}, None, None

    def run(self):
        try:
            self.result = request(self.port, "POST", "/v1/load_lora_adapter", self.body)
        except Exception as e:  # noqa: BLE001 - the test reports it
            self.result = (0, repr(e))
        self.done_at = time.monotonic()


class HookCluster(Cluster):
    """A Cluster whose processes start with ENV (test hooks) in their environment."""
    def __init__(self, env, *args, **kw):
        super().__init__(*args, **kw)
        self.env = env

    def start(self):
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            super().start()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v


def slow_load_cluster(port, delay_ms):
    """1x1, runtime updates on, each runtime load's read sleeping delay_ms first (LOOM_TEST_LORA_LOAD_DELAY_MS)."""
    return HookCluster({"LOOM_TEST_LORA_LOAD_DELAY_MS": str(delay_ms)}, STORIES, 1, 1,
                       coord_args=lora_args(1) + ["--allow-runtime-lora-updating", "--http", "127.0.0.1:%d" % port])


def test_runtime_load_off_reactor():
    """A runtime load whose read takes long (the test hook sleeps first) stalls nothing: streams started
    after it finish with every token's wait well under the delay, and /health answers 200, all before
    the load is answered; then the adapter serves its merged weights' output."""
    d1 = adapter("rt_d1", "--r", 8, "--alpha", 16, "--std", 0.1, "--seed", 31)
    _, want = run_local(merged(d1, "rt_d1_merged"), PROMPTS[0], N, extra=["--ignore-eos"])
    delay = max(3.0, scaled(1.0))  # a slow machine stretches the token gaps this must stand well above
    port = free_port()
    with slow_load_cluster(port, int(delay * 1000)) as c:
        base = os.path.basename(STORIES.rstrip("/"))
        stream_gaps(port, base, PROMPTS[1], 8)  # warm: a first request's set-up is not the load's doing
        load = Load(port, "slow", d1)
        t0 = time.monotonic()
        load.start()
        time.sleep(min(0.3, delay / 10))  # the load reaches the coordinator
        streams, health, worst = 0, None, 0.0
        while load.is_alive():
            texts, gap = stream_gaps(port, base, PROMPTS[streams % len(PROMPTS)], 64)
            check(len(texts) >= 64, "a stream during the load ended after %d chunks" % len(texts))
            worst = max(worst, gap)  # begun while the load was pending
            streams += load.is_alive()  # and finished before it was answered
            if health is None:
                status, text = request(port, "GET", "/health")
                health = (status, text[:200], load.is_alive())
        load.join()
        took = load.done_at - t0
        check(worst < delay / 2, "a stream waited %.2f s for a token while the load (%.2f s) was pending" %
              (worst, took))
        check(health and health[0] == 200 and health[2], "/health during the load: %r" % (health,))
        check(streams >= 2, "only %d stream(s) finished while the load was pending (%.2f s)" % (streams, took))
        status, text = load.result
        check(status == 200 and "Success: LoRA adapter 'slow' added successfully." in text, "the load: %d %s" %
              (status, text))
        check(took >= delay, "the load was answered in %.2f s, before the test hook's %.2f s delay" % (took, delay))
        rc, _, got, err = c.generate(PROMPTS[0], N, extra=["--ignore-eos", "--lora", "slow"])
        check(rc == 0 and got == want, "the loaded adapter: %s, merged %s %s" % (got, want, err[-300:]))
    print("  a %.1f s load: %d streams finished meanwhile, the longest wait for a token %.0f ms; /health 200; "
          "then the adapter serves" % (took, streams, worst * 1e3))


def test_concurrent_loads_one_name():
    """Two loads of one name at once (other directories), both past the registry's check before either
    read is back: the first registered, the second vLLM's "already been loaded"; the name serves the
    registered one's weights."""
    d1 = adapter("rt_d1", "--r", 8, "--alpha", 16, "--std", 0.1, "--seed", 31)
    d2 = adapter("rt_d2", "--r", 8, "--alpha", 16, "--std", 0.1, "--seed", 32)
    want = {d: run_local(merged(d, m), PROMPTS[0], N, extra=["--ignore-eos"])[1]
            for d, m in ((d1, "rt_d1_merged"), (d2, "rt_d2_merged"))}
    check(want[d1] != want[d2], "two adapters with the same output: the registered one would not be seen")
    port = free_port()
    with slow_load_cluster(port, 1000) as c:  # the reads take turns: the second is back a second after the first
        loads = [Load(port, "twin", d) for d in (d1, d2)]
        for ld in loads:
            ld.start()
        for ld in loads:
            ld.join(scaled(120))
        ok = [ld for ld in loads if ld.result and ld.result[0] == 200]
        check(len(ok) == 1, "two loads of one name: %r" % [ld.result for ld in loads])
        lost = loads[1] if ok[0] is loads[0] else loads[0]
        e = error_of(*lost.result, 400)
        check("The lora adapter 'twin' has already been loaded." in e["message"], "the other load: %r" % e)
        winner = ok[0].body["lora_path"]
        status, data = request(port, "GET", "/v1/models")
        roots = [m.get("root") for m in json.loads(data)["data"] if m["id"] == "twin"] if status == 200 else data
        check(roots == [winner], "twin listed as %r, the registered load's directory %s" % (roots, winner))
        rc, _, got, err = c.generate(PROMPTS[0], N, extra=["--ignore-eos", "--lora", "twin"])
        check(rc == 0 and got == want[winner], "twin: %s, the registered weights' %s %s" %
              (got, want[winner], err[-300:]))
    print("  two concurrent loads of one name: one registered (its weights serve), the other 400")


def test_loom_serve():
    """`loom serve` hands vLLM's LoRA flags to its coordinator (both --lora-modules forms, and
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True from the environment)."""
    port = free_port()
    log_path = os.path.join(WORK, "serve.log")
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([os.path.join(BIN, "loom"), "serve", STORIES, "--port", str(port), "--threads", "1"] +
                                lora_args(2), stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        def ready():
            check(proc.poll() is None, "loom serve exited: %s" % open(log_path).read()[-3000:])
            return "OpenAI API at" in open(log_path).read()
        wait_for(ready, scaled(120), "loom serve to be ready")
        for name in ("b", "c"):
            out, _ = run_local(ADAPTERS[name][1], PROMPTS[2], N, extra=["--ignore-eos"])
            status, text = complete(port, name, PROMPTS[2])
            check(status == 200 and text == out[:-1], "loom serve, model %s: %d %r, merged %r" % (name, status, text,
                                                                                                  out[:-1]))
        status, text = request(port, "POST", "/v1/load_lora_adapter", {"lora_name": "e", "lora_path": ADAPTERS["a"][0]})
        check(status == 200, "runtime load allowed by the environment: %d %s" % (status, text))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log = open(log_path, errors="replace").read()
    check(not any(x in log for x in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:")),
          "a sanitizer report from loom serve or its children: %s" % log[-3000:])
    print("  loom serve: --lora-modules (both forms) and VLLM_ALLOW_RUNTIME_LORA_UPDATING reach the coordinator")


def test_router_prefers_resident():
    """loom-router lists the replicas' adapters and sends a request for an adapter to the replica that
    holds it in its engine now (round robin would alternate): two replicas, one slot each, one holding
    a and the other b; the ids equal the merged weights'."""
    import test_router  # its Router helper
    want = {n: run_local(m, PROMPTS[0], N, extra=["--ignore-eos"])[1] for n, (_, m) in ADAPTERS.items()}
    with Cluster(STORIES, 1, 1, coord_args=lora_args(1)) as a, Cluster(STORIES, 1, 1, coord_args=lora_args(1)) as b:
        for c, name in ((a, "a"), (b, "b")):  # a resident on replica a, b on replica b
            rc, _, got, err = c.generate(PROMPTS[0], N, extra=["--ignore-eos", "--lora", name])
            check(rc == 0 and got == want[name], "priming %s: %s %s" % (name, got, err[-300:]))
        with test_router.Router(["--replica", a.addr, "--replica", b.addr, "--policy", "round-robin"], http=True,
                                expect_up=2) as r:
            def finished():
                return a.stats()["requests_finished"], b.stats()["requests_finished"]
            for name, on_a in (("a", 1), ("b", 0), ("a", 1)):
                before = finished()
                for _ in range(3):
                    rc, _, got, err = generate(r.addr, PROMPTS[0], N, extra=["--ignore-eos", "--lora", name])
                    check(rc == 0 and got == want[name], "via the router, %s: %s %s" % (name, got, err[-300:]))
                after = finished()
                moved = (after[0] - before[0], after[1] - before[1])
                check(moved == ((3, 0) if on_a else (0, 3)), "adapter %s went to (a, b) = %s, not to the replica "
                      "holding it" % (name, moved))
            status, data = request(r.http, "GET", "/v1/models")
            ids = {m["id"]: m for m in json.loads(data)["data"]} if status == 200 else {}
            check(all(n in ids and ids[n].get("parent") == "stories260K" for n in ADAPTERS),
                  "the router's /v1/models: %s %s" % (status, data[:500]))
            e = error_of(*complete(r.http, "no-such", PROMPTS[0]), 404)
            check("does not exist" in e["message"], "an unknown model through the router: %r" % e)
            e = error_of(*request(r.http, "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
                         400)
            check("each replica" in e["message"], "a runtime load through the router: %r" % e)
    print("  the router sends each adapter's requests to the replica holding it; lists them; 404 otherwise")


if __name__ == "__main__":
    setup()
    run_tests([test_mixed_1x1, test_mixed_slow_prepare, test_mixed_2x2, test_http_sdk, test_runtime_updates, test_runtime_load_off_reactor,
               test_concurrent_loads_one_name, test_loom_serve, test_router_prefers_resident])

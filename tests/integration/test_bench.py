"""`loom bench` as a peer of `vllm bench serve`, on real processes.

- Against an independent OpenAI-compatible server written here (a stub on
  http.server whose SSE is formatted unlike Loom's: "data:" without a
  space, CRLF line ends, comment lines, each JSON event pretty-printed over
  several data lines with other key orders, usage only in a last chunk with
  no choices): completions and chat, the per-request results exact
  (tokens, texts, inter-token gaps), so nothing depends on Loom's output.
- The JSON result compared key by key with the keys `vllm bench serve
  --save-result --save-detailed` writes (vllm/benchmarks/serve.py), with
  goodput, percentile metrics and percentiles.
- Datasets: ShareGPT (the prompts the server saw are the file's human
  turns), random, prefix_repetition against Loom (its prefix cache hits),
  chat against Loom; gamma burstiness changes the spread of arrival gaps.
- Multi-turn chats: every turn's prompt is the one before, the answer that
  came back and new user tokens, one session key across a chat's turns
  (the stub sees the text and the OpenAI user field); against Loom the
  prompts grow turn by turn and later turns hit the prefix cache.
- Bad input: a dataset that is not JSON, a rate of 0 or below, an unknown
  flag, bad --goodput, multiturn options out of range or without
  multiturn: a clear error and exit status 2."""
import http.server
import json
import math
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import STORIES, Cluster, check, run_tests  # noqa: E402
from test_http import free_port, get_metrics, loom, metric  # noqa: E402

# The keys of vLLM's result JSON for a generation benchmark (serve.py: the
# setup keys of main(), the result dict of benchmark(), and the mean_/
# median_/std_/pNN_ keys of each --percentile-metrics metric). Left out:
# rtfx (audio), ramp-up, speculative decoding, diffusion and probe keys.
VLLM_SETUP = {"date": str, "endpoint_type": str, "backend": str, "label": str, "model_id": str,
              "tokenizer_id": str, "num_prompts": int, "request_rate": (int, float, str), "burstiness": (int, float),
              "max_concurrency": (int, type(None))}
VLLM_RESULT = {"duration": (int, float), "completed": int, "failed": int, "total_input_tokens": int,
               "total_output_tokens": int, "request_throughput": (int, float),
               "request_goodput": (int, float, type(None)), "output_throughput": (int, float),
               "total_token_throughput": (int, float), "max_output_tokens_per_s": (int, float),
               "max_concurrent_requests": int}
VLLM_DETAILED = {"input_lens": list, "output_lens": list, "ttfts": list, "itls": list, "latencies": list,
                 "start_times": list, "queue_times": list, "generated_texts": list, "errors": list}


def vllm_metric_keys(metrics, pcts):
    keys = []
    for m in metrics:
        keys += ["mean_%s_ms" % m, "median_%s_ms" % m, "std_%s_ms" % m]
        keys += ["p%s_%s_ms" % (str(int(p)) if int(p) == p else str(p), m) for p in pcts]
    return keys


class Stub(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server: GET /v1/models, streaming POST
    /v1/completions and /v1/chat/completions answering "tok0 tok1 ..."."""
    protocol_version = "HTTP/1.1"
    seen = []
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def send_json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"object": "model", "owned_by": "stub", "id": "stub-model"}]})
        else:
            self.send_json(404, {"error": {"message": "no such path", "type": "not_found"}})

    def event(self, obj):
        # pretty-printed over several data lines, CRLF ends, a comment first
        lines = json.dumps(obj, indent=1, sort_keys=True).split("\n")
        out = ": keep-alive\r\n" + "".join("data:%s\r\n" % ln for ln in lines) + "\r\n"
        self.chunk(out.encode())

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        try:
            req = json.loads(self.rfile.read(n))
        except ValueError:
            return self.send_json(400, {"error": {"message": "bad JSON"}})
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/completions", "/v1/chat/completions") or req.get("model") != "stub-model" or \
                not req.get("stream") or not isinstance(req.get("max_tokens"), int) or \
                (chat and not isinstance(req.get("messages"), list)) or (not chat and "prompt" not in req):
            return self.send_json(400, {"error": {"message": "unexpected request %r" % req}})
        with Stub.lock:
            Stub.seen.append((self.path, req))
        prompt = req["messages"][-1]["content"] if chat else req["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = {"id": "cmpl-stub", "created": int(time.time()), "model": "stub-model",
                "object": "chat.completion.chunk" if chat else "text_completion"}
        if chat:  # a first chunk with the role and no content, as OpenAI sends
            self.event(dict(base, choices=[{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]))
        for i in range(req["max_tokens"]):
            time.sleep(0.004)
            piece = "tok%d " % i
            ch = {"index": 0, "delta": {"content": piece}} if chat else {"text": piece, "index": 0, "logprobs": None}
            ch["finish_reason"] = "length" if i == req["max_tokens"] - 1 else None
            self.event(dict(base, choices=[ch]))
        self.event(dict(base, choices=[], usage={"total_tokens": n_prompt + req["max_tokens"],
                                                 "completion_tokens": req["max_tokens"], "prompt_tokens": n_prompt}))
        self.chunk(b"data:[DONE]\r\n\r\n")
        self.chunk(b"")


class StubServer:
    def __enter__(self):
        Stub.seen = []
        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.srv.shutdown()
        self.srv.server_close()
        return False

    @property
    def url(self):
        return "http://127.0.0.1:%d" % self.port


def bench(*args, timeout=120):
    return loom("bench", *args, timeout=timeout)


def bench_json(args, tmp, name="r.json", expect_rc=0):
    path = os.path.join(tmp, name)
    p = bench(*args, "--json", path)
    check(p.returncode == expect_rc, "loom bench %s: rc %d\n%s\n%s" % (" ".join(args), p.returncode, p.stdout[-1500:],
                                                                     p.stderr[-1500:]))
    with open(path) as f:
        return json.load(f), p


def check_vllm_keys(res, metrics, pcts, detailed):
    want = dict(VLLM_SETUP, **VLLM_RESULT)
    if detailed:
        want.update(VLLM_DETAILED)
    for k in vllm_metric_keys(metrics, pcts):
        want[k] = (int, float)
    for k, typ in want.items():
        check(k in res, "the result lacks vLLM's key %s" % k)
        check(isinstance(res[k], typ) and not isinstance(res[k], bool), "%s = %r, vLLM writes %s" % (k, res[k], typ))
    if not detailed:
        for k in VLLM_DETAILED:
            check(k not in res, "%s without --save-detailed (vLLM drops it)" % k)
    for k in ("mean_e2el_ms", "p99_e2el_ms") if "e2el" not in metrics else ():
        check(k not in res, "%s although e2el is not in --percentile-metrics" % k)


def test_stub_completions_and_chat():
    with StubServer() as s, tempfile.TemporaryDirectory() as tmp:
        n = 6
        common = ["--base-url", s.url, "--num-prompts", str(n), "--random-input-len", "8", "--random-output-len", "5",
                  "--random-range-ratio", "0.4", "--seed", "7", "--save-detailed", "--vocab", "500",
                  "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99.9",
                  "--goodput", "ttft:20000", "tpot:5000", "e2el:60000", "--request-rate", "100", "--burstiness", "2"]
        for backend, path in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
            Stub.seen = []
            res, p = bench_json(common + ["--backend", backend], tmp)
            check_vllm_keys(res, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99.9], True)
            check(res["backend"] == backend and res["model_id"] == "stub-model" and res["num_prompts"] == n,
                  "setup keys %s" % {k: res[k] for k in VLLM_SETUP})
            check(res["completed"] == n and res["failed"] == 0 and res["errors"] == [""] * n, "%s: %s" % (backend,
                                                                                                         p.stdout))
            check(len(Stub.seen) == n and all(pth == path for pth, _ in Stub.seen), "the stub saw %s" %
                  [pth for pth, _ in Stub.seen])
            wanted = sorted(r["max_tokens"] for _, r in Stub.seen)
            check(sorted(res["output_lens"]) == wanted and res["total_output_tokens"] == sum(wanted),
                  "output lens %s, asked %s" % (res["output_lens"], wanted))
            check(all(3 <= w <= 7 for w in wanted), "output lengths outside 5 +- 40%%: %s" % wanted)
            for text, out, itl, ttft, lat in zip(res["generated_texts"], res["output_lens"], res["itls"],
                                                 res["ttfts"], res["latencies"]):
                check(text == "".join("tok%d " % i for i in range(out)), "generated text %r for %d tokens" % (text, out))
                check(len(itl) == out - 1 and all(g > 0 for g in itl), "itls %s for %d tokens" % (itl, out))
                check(0 < ttft < lat, "ttft %g, latency %g" % (ttft, lat))
            if backend == "openai":
                check(all(isinstance(r["prompt"], list) and all(3 <= i < 500 for i in r["prompt"]) and
                          4 <= len(r["prompt"]) <= 12 for _, r in Stub.seen), "prompt ids %s" % Stub.seen[0][1])
                check(res["input_lens"] == [len(r["prompt"]) for _, r in Stub.seen] or
                      sorted(res["input_lens"]) == sorted(len(r["prompt"]) for _, r in Stub.seen), "input lens")
            else:
                check(all(isinstance(r["messages"][0]["content"], str) for _, r in Stub.seen), "chat messages")
            check(res["request_goodput"] == res["request_throughput"], "goodput %r with objectives everyone meets, "
                  "throughput %r" % (res["request_goodput"], res["request_throughput"]))
            check(res["p50_ttft_ms"] <= res["p90_ttft_ms"] <= res["p99.9_ttft_ms"], "percentiles out of order")
            check(abs(res["mean_e2el_ms"] - 1000 * sum(res["latencies"]) / n) < 0.01 * res["mean_e2el_ms"] + 0.01,
                  "mean_e2el_ms %g vs latencies" % res["mean_e2el_ms"])
            itls = [g for r in res["itls"] for g in r]
            check(abs(res["mean_itl_ms"] - 1000 * sum(itls) / len(itls)) < 0.01 * res["mean_itl_ms"] + 0.01, "ITL mean")
            check(res["stages"]["prefill_ms"]["n"] == 0, "a stage breakdown from a server that sends none")
            check("request goodput" in p.stdout, "no goodput line: %s" % p.stdout)
        # objectives nobody meets: goodput 0
        res, _ = bench_json(["--base-url", s.url, "--num-prompts", "3", "--random-input-len", "4",
                             "--random-output-len", "4", "--vocab", "100", "--goodput", "tpot:0.001"], tmp)
        check(res["request_goodput"] == 0 and res["completed"] == 3, "goodput %r under tpot:0.001" %
              res["request_goodput"])
        check_vllm_keys(res, ["ttft", "tpot", "itl"], [99], False)
        # a server without vocab_size: random ids need --vocab, and it says so
        p = bench("--base-url", s.url, "--num-prompts", "2")
        check(p.returncode == 2 and "--vocab" in p.stderr, "no vocabulary: rc %d %s" % (p.returncode, p.stderr))


def test_sharegpt_and_bad_input():
    with StubServer() as s, tempfile.TemporaryDirectory() as tmp:
        convs = [{"id": "a", "conversations": [{"from": "human", "value": "Tell me about the sea"},
                                              {"from": "gpt", "value": "The sea is wide and deep and blue."}]},
                 {"id": "b", "conversations": [{"from": "human", "value": "Why is the sky blue?"},
                                              {"from": "gpt", "value": "Because of Rayleigh scattering."}]},
                 {"id": "c", "conversations": [{"from": "human", "value": "only a question"}]}]
        ds = os.path.join(tmp, "sharegpt.json")
        with open(ds, "w") as f:
            json.dump(convs, f)
        Stub.seen = []
        res, p = bench_json(["--base-url", s.url, "--backend", "openai-chat", "--dataset-name", "sharegpt",
                             "--dataset-path", ds, "--num-prompts", "4", "--save-detailed"], tmp)
        check(res["completed"] == 4, p.stdout)
        prompts = sorted(r["messages"][0]["content"] for _, r in Stub.seen)
        check(prompts == sorted(["Tell me about the sea", "Why is the sky blue?"] * 2), "prompts %s" % prompts)
        lens = {r["messages"][0]["content"]: r["max_tokens"] for _, r in Stub.seen}
        check(lens == {"Tell me about the sea": 9, "Why is the sky blue?": 8}, "output lengths from replies %s" % lens)
        res, _ = bench_json(["--base-url", s.url, "--dataset-name", "sharegpt", "--dataset-path", ds,
                             "--num-prompts", "2", "--sharegpt-output-len", "3"], tmp)
        check(res["total_output_tokens"] == 6, "--sharegpt-output-len: %s" % res["total_output_tokens"])

        bad = os.path.join(tmp, "bad.json")
        with open(bad, "w") as f:
            f.write("this is { not JSON")
        obj = os.path.join(tmp, "obj.json")
        with open(obj, "w") as f:
            json.dump({"conversations": []}, f)
        cases = [(["--dataset-name", "sharegpt", "--dataset-path", bad], "is not JSON"),
                 (["--dataset-name", "sharegpt", "--dataset-path", obj], "not a list of conversations"),
                 (["--dataset-name", "sharegpt", "--dataset-path", os.path.join(tmp, "none.json")], "cannot read"),
                 (["--dataset-name", "sharegpt"], "needs --dataset-path"),
                 (["--dataset-name", "sonnet"], "--dataset-name must be"),
                 (["--request-rate", "0"], "--rate expects a positive number"),
                 (["--rate", "-2"], "--rate expects a positive number"),
                 (["--rates", "1,0"], "--rates expects"),
                 (["--no-such-flag"], "no-such-flag"),
                 (["--burstiness", "0"], "burstiness"),
                 (["--goodput", "latency:5"], "--goodput expects"),
                 (["--goodput", "ttft:-1"], "--goodput expects"),
                 (["--metric-percentiles", "0,101"], "--metric-percentiles"),
                 (["--percentile-metrics", "ttft,speed"], "--percentile-metrics"),
                 (["--backend", "tgi"], "--backend must be"),
                 (["--multiturn-turns", "3"], "are for --dataset-name multiturn"),
                 (["--dataset-name", "multiturn", "--multiturn-turns", "0"], "--multiturn-turns expects"),
                 (["--dataset-name", "multiturn", "--multiturn-turns", "65"], "--multiturn-turns expects"),
                 (["--dataset-name", "multiturn", "--multiturn-think-s", "-1"], "--multiturn-think-s expects"),
                 (["--dataset-name", "multiturn", "--multiturn-num-system", "0"], "--multiturn-num-system"),
                 (["--dataset-name", "multiturn", "--multiturn-sessions", "3"], "leave out --num-requests")]
        for extra, want in cases:
            p = bench("--base-url", s.url, "--vocab", "100", "--num-prompts", "1", *extra)
            check(p.returncode == 2 and want in p.stderr, "%s: rc %d, stderr %r" % (extra, p.returncode, p.stderr))


def test_burstiness_spreads_arrivals():
    def gaps_cv(burst, tmp):
        res, _ = bench_json(["--base-url", s.url, "--num-prompts", "40", "--random-input-len", "2",
                             "--random-output-len", "1", "--vocab", "50", "--request-rate", "100", "--burstiness",
                             burst, "--seed", "11", "--save-detailed"], tmp, name="b%s.json" % burst)
        st = sorted(res["start_times"])
        check(0.2 <= st[-1] - st[0] <= 1.5, "40 requests at 100/s spanned %.3f s" % (st[-1] - st[0]))
        g = [b - a for a, b in zip(st, st[1:])]
        mean = sum(g) / len(g)
        return math.sqrt(sum((x - mean) ** 2 for x in g) / len(g)) / mean
    with StubServer() as s, tempfile.TemporaryDirectory() as tmp:
        bursty, even = gaps_cv("0.25", tmp), gaps_cv("16", tmp)
        check(bursty > 2 * even, "gap CV with burstiness 0.25: %.2f, with 16: %.2f" % (bursty, even))


def test_multiturn_stub():
    """Over HTTP the answers come back as text, so a chat's prompts are text: turn 2 of a session is its
    turn-1 prompt, the stub's answer to it and new words, with the session in the user field."""
    with StubServer() as s, tempfile.TemporaryDirectory() as tmp:
        res, p = bench_json(["--base-url", s.url, "--dataset-name", "multiturn", "--vocab", "100",
                             "--multiturn-sessions", "3", "--multiturn-turns", "3", "--multiturn-system-len", "5",
                             "--multiturn-user-len", "2", "--multiturn-output-len", "3", "--multiturn-think-s", "0.01",
                             "--request-rate", "50"], tmp)
        check(res["completed"] == 9 and [t["completed"] for t in res["turns"]] == [3, 3, 3], p.stdout)
        by_user = {}
        for _, r in Stub.seen:
            by_user.setdefault(r.get("user"), []).append(r["prompt"])
        check(len(by_user) == 3 and None not in by_user, "session keys %s" % list(by_user))
        for user, prompts in by_user.items():
            check([len(x.split()) for x in prompts] == [7, 12, 17], "%s: prompt words %s" % (user, prompts))
            for a, b in zip(prompts, prompts[1:]):
                check(b.startswith(a + " tok0 tok1 tok2 "), "%s: %r does not follow %r and its answer" % (user, b, a))


def test_multiturn_against_loom():
    with Cluster(STORIES, 1, 1) as c, tempfile.TemporaryDirectory() as tmp:
        res, p = bench_json(["--addr", c.addr, "--dataset-name", "multiturn", "--multiturn-sessions", "6",
                             "--multiturn-turns", "3", "--multiturn-system-len", "64", "--multiturn-user-len", "16",
                             "--multiturn-output-len", "16", "--multiturn-think-s", "0.05", "--request-rate", "20",
                             "--save-detailed"], tmp)
        check(res["completed"] == 18 and res["failed"] == 0, p.stdout)
        turns = res["turns"]
        check([t["completed"] for t in turns] == [6, 6, 6] and "per turn of the chats" in p.stdout, p.stdout)
        lens = res["input_lens"]  # session-major: a session's turns are consecutive
        for sess in range(6):
            ln = lens[3 * sess:3 * sess + 3]
            check(ln[1] - ln[0] == 32 and ln[2] - ln[1] == 32, "session %d prompt lengths %s (each turn adds its "
                  "16 answer and 16 user tokens)" % (sess, ln))
        check(turns[0]["mean_prompt_len"] < turns[1]["mean_prompt_len"] < turns[2]["mean_prompt_len"], turns)
        check(turns[1]["prefix_cache_hit_rate"] > 0 and turns[2]["prefix_cache_hit_rate"] > 0,
              "later turns hit the prefix cache: %s" % turns)
        check(res["prefix_cache_hit_rate"] > 0 and res["cached_prompt_tokens"] > 0, p.stdout)


def test_against_loom():
    port = free_port()
    args = ["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml"]
    with Cluster(STORIES, 1, 1, coord_args=args) as c, tempfile.TemporaryDirectory() as tmp:
        url = "http://127.0.0.1:%d" % port
        _, m0 = get_metrics(port)
        res, p = bench_json(["--base-url", url, "--dataset-name", "prefix_repetition",
                             "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
                             "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "6",
                             "--num-prompts", "8", "--request-rate", "40", "--burstiness", "0.5", "--seed", "5",
                             "--save-detailed"], tmp)
        check_vllm_keys(res, ["ttft", "tpot", "itl"], [99], True)
        check(res["completed"] == 8 and res["total_output_tokens"] == 48, p.stdout)
        check(len(set(res["input_lens"])) == 1 and res["input_lens"][0] in (56, 57), "input lens %s (48 + 8 ids, "
              "BOS or not)" % res["input_lens"])
        check(res["stages"]["prefill_ms"]["n"] == 8, "Loom's stage breakdown over HTTP: %s" % res["stages"])
        _, m1 = get_metrics(port)
        hits = metric(m1, "vllm:prefix_cache_hits_total") - metric(m0, "vllm:prefix_cache_hits_total")
        check(hits >= 16 * 4, "8 requests over 2 prefixes of 3 blocks hit %g cached tokens" % hits)
        res, p = bench_json(["--base-url", url, "--backend", "openai-chat", "--num-prompts", "4",
                             "--random-input-len", "6", "--random-output-len", "5", "--save-detailed"], tmp)
        check(res["completed"] == 4 and res["total_output_tokens"] == 20 and all(res["generated_texts"]),
              "chat against Loom: %s" % p.stdout)
        res, p = bench_json(["--addr", c.addr, "--dataset-name", "prefix_repetition", "--num-prompts", "4",
                             "--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "4",
                             "--prefix-repetition-output-len", "3", "--save-detailed"], tmp)
        check(res["backend"] == "zmq" and res["completed"] == 4 and res["total_output_tokens"] == 12,
              "zmq: %s" % p.stdout)


if __name__ == "__main__":
    run_tests([test_stub_completions_and_chat, test_sharegpt_and_bad_input, test_burstiness_spreads_arrivals,
               test_multiturn_stub, test_multiturn_against_loom, test_against_loom])

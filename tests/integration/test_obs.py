"""Observability and hardening of the HTTP gateway on real processes: the
per-stage timings in responses and streams, the stage histograms under
Loom's and vLLM's names (counts equal the requests served), X-Request-Id
(echoed, generated, in the completion id and the JSON log lines), JSON logs
that parse, 503 over the connection limit, 400 naming each unimplemented
field, stop_token_ids, /tokenize and /detokenize with the real tokenizer,
/version, and the stage breakdown of `loom bench`."""
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import STORIES, Cluster, check, run_tests  # noqa: E402
from test_http import (CHAT, KEY, PROMPT, expect_error, free_port, get_metrics, loom, metric,  # noqa: E402
                       post, request)

STAGES = ("queue_ms", "tokenize_ms", "prefill_ms", "decode_ms", "detokenize_ms", "send_ms", "ttft_ms", "total_ms")


def with_cluster(fn, extra=()):
    port = free_port()
    args = ["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml", "--api-key", KEY,
            "--log-format", "json"] + list(extra)
    with Cluster(STORIES, 1, 1, coord_args=args, worker_args=["--log-format", "json"]) as c:
        fn(c, port)


def check_timings(t, completion_tokens, what):
    check(isinstance(t, dict) and all(k in t for k in STAGES), "%s: timings %r" % (what, t))
    for k in STAGES:
        check(isinstance(t[k], (int, float)) and t[k] >= 0, "%s: %s = %r" % (what, k, t[k]))
    # the stages follow each other: tokenize, queue, prefill, decode make the whole (up to bookkeeping)
    parts = t["tokenize_ms"] + t["queue_ms"] + t["prefill_ms"] + t["decode_ms"]
    check(parts <= t["total_ms"] + 0.05 and parts >= t["total_ms"] * 0.8 - 0.5,
          "%s: stages sum to %.3f ms, total %.3f ms: %r" % (what, parts, t["total_ms"], t))
    ttft = t["tokenize_ms"] + t["queue_ms"] + t["prefill_ms"]
    check(abs(ttft - t["ttft_ms"]) <= 0.5 + 0.1 * t["ttft_ms"], "%s: ttft %.3f vs stages %.3f" % (what, t["ttft_ms"],
                                                                                              ttft))
    check(t["prefill_ms"] > 0, "%s: no prefill time: %r" % (what, t))
    if completion_tokens > 1:
        check(t["decode_ms"] > 0, "%s: no decode time for %d tokens: %r" % (what, completion_tokens, t))
    check(t["detokenize_ms"] <= t["prefill_ms"] + t["decode_ms"] + 0.05, "%s: detokenize outside: %r" % (what, t))


def sse_events(data):
    out = []
    for block in data.decode().split("\n\n"):
        if block.startswith("data: ") and block[6:] != "[DONE]":
            out.append(json.loads(block[6:]))
    return out


HISTS = [("loom_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
         ("loom_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
         ("loom_request_queue_time_seconds", "vllm:request_queue_time_seconds"),
         ("loom_request_prefill_time_seconds", "vllm:request_prefill_time_seconds"),
         ("loom_request_decode_time_seconds", "vllm:request_decode_time_seconds"),
         ("loom_request_inference_time_seconds", "vllm:request_inference_time_seconds"),
         ("loom_request_tokenize_time_seconds", None), ("loom_request_detokenize_time_seconds", None),
         ("loom_request_send_time_seconds", None)]


def test_timings_metrics_and_request_ids():
    def run(c, port):
        types, before = get_metrics(port)
        for loom_name, vllm_name in HISTS + [("loom_inter_token_latency_seconds", "vllm:inter_token_latency_seconds")]:
            for n in (loom_name, vllm_name):
                if n:
                    check(types.get(n) == "histogram", "%s is %r" % (n, types.get(n)))
        for n in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            check(types.get(n) == "gauge", "%s is %r" % (n, types.get(n)))
        check(types.get("vllm:generation_tokens_total") == "counter", "vllm:generation_tokens_total")

        tokens = 0
        rid = "trace-7f3a/obs:1"
        status, hdrs, data = request(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                     "temperature": 0}, key=KEY, headers={"X-Request-Id": rid})
        check(status == 200, "completion: %d %r" % (status, data[:300]))
        check(hdrs.get("x-request-id") == rid, "X-Request-Id not echoed: %r" % hdrs)
        body = json.loads(data)
        check(body["id"] == "cmpl-" + rid, "completion id %r" % body["id"])
        check_timings(body.get("timings"), body["usage"]["completion_tokens"], "completion")
        tokens += body["usage"]["completion_tokens"]

        # no id, or one too long or not printable: a generated one
        for h in ({}, {"X-Request-Id": "x" * 129}, {"X-Request-Id": "bad\x7fid"}):
            status, hdrs, data = request(port, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6},
                                         key=KEY, headers=h)
            check(status == 200, "chat: %d %r" % (status, data[:300]))
            gen = hdrs.get("x-request-id", "")
            check(re.fullmatch(r"[0-9a-f]{24}", gen), "generated X-Request-Id %r for %r" % (gen, h))
            body = json.loads(data)
            check(body["id"] == "chatcmpl-" + gen, "chat id %r, request id %r" % (body["id"], gen))
            check_timings(body.get("timings"), body["usage"]["completion_tokens"], "chat")
            tokens += body["usage"]["completion_tokens"]

        # a stream: timings in the chunk with the finish reason, and only there
        status, hdrs, data = request(port, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 10,
                                     "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
                                     key=KEY, headers={"X-Request-Id": "stream-1"})
        check(status == 200 and hdrs.get("x-request-id") == "stream-1", "stream: %d %r" % (status, hdrs))
        ev = sse_events(data)
        with_t = [e for e in ev if "timings" in e]
        check(len(with_t) == 1 and with_t[0]["choices"][0]["finish_reason"] == "length",
              "timings in %d chunks: %r" % (len(with_t), ev[-3:]))
        check(all(e["id"] == "cmpl-stream-1" for e in ev), "stream ids: %r" % {e["id"] for e in ev})
        usage = ev[-1]["usage"]
        check_timings(with_t[0]["timings"], usage["completion_tokens"], "stream")
        tokens += usage["completion_tokens"]
        n_requests = 5

        time.sleep(0.3)  # the reactor publishes gauges once per loop turn
        types, after = get_metrics(port)

        def delta(name, **labels):
            return metric(after, name, **labels) - metric(before, name, **labels)
        for loom_name, vllm_name in HISTS:
            for n in (loom_name, vllm_name):
                if not n:
                    continue
                check(delta(n + "_count") == n_requests, "%s_count moved by %g, %d requests" % (n, delta(n + "_count"),
                                                                                               n_requests))
                check(metric(after, n + "_bucket", le="+Inf") == metric(after, n + "_count"), "%s +Inf bucket" % n)
                check(delta(n + "_sum") >= 0, "%s_sum went down" % n)
            if vllm_name:
                check(metric(after, loom_name + "_sum") == metric(after, vllm_name + "_sum"),
                      "%s and %s differ" % (loom_name, vllm_name))
        itl = delta("vllm:inter_token_latency_seconds_count")
        check(itl == tokens - n_requests, "inter-token latencies %g for %d tokens in %d requests" % (itl, tokens,
                                                                                                 n_requests))
        check(delta("vllm:generation_tokens_total") == tokens, "vllm:generation_tokens_total")
        check(delta("vllm:request_success_total", finished_reason="length") +
              delta("vllm:request_success_total", finished_reason="stop") == n_requests, "vllm:request_success_total")
        check(metric(after, "vllm:num_requests_running") == 0, "running after")
        usage = metric(after, "vllm:kv_cache_usage_perc")
        check(0 <= usage <= 1, "vllm:kv_cache_usage_perc %g" % usage)

        # the logs: every line is JSON with the fields; the request's lines carry its id
        time.sleep(0.2)
        for name in ("coordinator", "worker-0"):
            lines = [ln for ln in c.log(name).splitlines() if ln.strip()]
            check(lines, "%s logged nothing" % name)
            for ln in lines:
                try:
                    o = json.loads(ln)
                except ValueError:
                    raise AssertionError("%s: not a JSON line: %r" % (name, ln))
                for k in ("ts", "level", "component", "msg"):
                    check(k in o, "%s: line without %s: %r" % (name, k, ln))
                check(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", o["ts"]), "ts %r" % o["ts"])
        mine = [json.loads(ln) for ln in c.log("coordinator").splitlines() if '"request_id":"%s"' % rid in ln]
        check(any("POST /v1/completions -> 200" in o["msg"] for o in mine),
              "no access log line for request %s: %r" % (rid, mine))
    with_cluster(run)


def test_refused_fields_and_stop_token_ids():
    def run(c, port):
        # (the sampling controls are implemented now: tests/integration/test_sampling.py)
        # (so is constrained decoding: test_structured.py, and tool calling: test_tools.py)
        # (and prompt_logprobs: test_prompt_logprobs.py)
        refused = {"spaces_between_special_tokens": False, "truncate_prompt_tokens": 3,
                   "use_beam_search": True, "length_penalty": 0.5, "suffix": "x", "request_id": "abc"}
        for k, v in refused.items():
            status, data = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, k: v})
            e = expect_error(status, data, 400, param=k)
            check(k in e["message"], "message does not name %s: %r" % (k, e["message"]))
        chat_refused = {"top_logprobs": 2, "chat_template": "{{x}}",  # (without --trust-request-chat-template)
                        "prompt": "not a chat field", "chat_template_kwargs": "not an object"}
        for k, v in chat_refused.items():
            status, data = post(port, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, k: v})
            expect_error(status, data, 400, param=k)
        # the values that turn a feature off are accepted
        off = {"repetition_penalty": 1, "min_p": 0, "min_tokens": 0, "guided_json": None, "logprobs": None,
               "prompt_logprobs": None, "echo": False, "presence_penalty": 0, "spaces_between_special_tokens": True,
               "user": "u-1",
               "include_stop_str_in_output": False, "skip_special_tokens": True}
        status, data = post(port, "/v1/completions", dict({"prompt": PROMPT, "max_tokens": 2}, **off))
        check(status == 200, "neutral values refused: %d %r" % (status, data[:300]))
        status, data = post(port, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "tool_choice": "none",
                                                           "parallel_tool_calls": True, "metadata": {"a": "b"}})
        check(status == 200, "neutral chat values refused: %d %r" % (status, data[:300]))

        # stop_token_ids: the 4th greedy token ends the request, its text left out
        rc, _, ids, err = c.generate(PROMPT, max_tokens=8, extra=("--api-key", KEY))
        check(rc == 0 and ids and len(ids) >= 8, "loom generate: %r %s" % (ids, err[-300:]))
        ids = ids[-8:]
        k = next((i for i in range(1, 8) if ids[i] not in ids[:i]), None)
        check(k is not None, "no token that is new in %r" % ids)
        status, data = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": k, "temperature": 0})
        want = json.loads(data)["choices"][0]["text"]
        status, data = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                      "stop_token_ids": [ids[k]]})
        check(status == 200, "stop_token_ids: %d %r" % (status, data[:300]))
        body = json.loads(data)
        check(body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["text"] == want and
              body["usage"]["completion_tokens"] == k + 1,
              "stop at id %d (token %d): %r, expected text %r" % (ids[k], k, body, want))
        for bad in ([-1], [10 ** 7], "5", [1.5]):
            status, data = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop_token_ids": bad})
            check(status == 400, "stop_token_ids %r answered %d" % (bad, status))
    with_cluster(run)


def test_tokenize_detokenize_version():
    def run(c, port):
        status, hdrs, data = request(port, "GET", "/version")
        check(status == 200 and re.fullmatch(r"\d+\.\d+\.\d+", json.loads(data)["version"]), "/version %r" % data)
        expect_error(*post(port, "/tokenize", {"prompt": PROMPT}, key=None), 401)
        status, data = post(port, "/tokenize", {"model": "stories260K", "prompt": PROMPT})
        check(status == 200, "/tokenize: %d %r" % (status, data))
        tok = json.loads(data)
        check(tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0, "/tokenize: %r" % tok)
        with open(os.path.join(STORIES, "config.json")) as f:
            bos = json.load(f).get("bos_token_id", 1)
        check(tok["tokens"][0] == bos, "no BOS first: %r" % tok)
        # the same ids the coordinator counts for a completion
        status, data = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        check(json.loads(data)["usage"]["prompt_tokens"] == tok["count"], "prompt_tokens differ from /tokenize")
        status, data = post(port, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
        plain = json.loads(data)["tokens"]
        check(plain == tok["tokens"][1:], "without special tokens: %r vs %r" % (plain, tok["tokens"]))
        for text in (PROMPT, "Lily and Tom went to the park. They saw a big dog!", "caf\u00e9 \u2603"):
            status, data = post(port, "/tokenize", {"prompt": text, "add_special_tokens": False})
            ids = json.loads(data)["tokens"]
            status, data = post(port, "/detokenize", {"tokens": ids})
            check(status == 200 and json.loads(data)["prompt"] == text, "round trip of %r: %r" % (text, data))
        # chat: through the template; the count is the chat completion's prompt_tokens
        status, data = post(port, "/tokenize", {"messages": CHAT})
        n_chat = json.loads(data)["count"]
        status, data = post(port, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
        check(json.loads(data)["usage"]["prompt_tokens"] == n_chat, "chat prompt_tokens differ from /tokenize")
        expect_error(*post(port, "/detokenize", {"tokens": [1, 100000]}), 400, param="tokens")
        expect_error(*post(port, "/detokenize", {"tokens": "1 2"}), 400, param="tokens")
        expect_error(*post(port, "/tokenize", {"prompt": PROMPT, "truncate": 3}), 400, param="truncate")
        expect_error(*post(port, "/tokenize", {"prompt": PROMPT, "model": "other"}), 404, param="model")
        expect_error(*post(port, "/tokenize", "[1, 2]"), 400)
    with_cluster(run)


def test_connection_limit_503_under_load():
    """Twice the limit of concurrent connections: every one gets an HTTP
    status (200 or 503 with Retry-After), none is reset."""
    def run(c, port):
        limit = 4
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(limit)]
        time.sleep(0.3)
        results = []

        def one():
            try:
                status, hdrs, data = request(port, "GET", "/v1/models", key=KEY, timeout=15)
                results.append((status, hdrs.get("retry-after"), data))
            except Exception as e:  # a reset is a failure
                results.append((None, None, repr(e)))
        threads = [threading.Thread(target=one) for _ in range(2 * limit)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for status, retry, data in results:
            check(status == 503 and retry == "1", "over the limit: %r %r %r" % (status, retry, data[:200]))
            expect_error(status, data, 503, code="service_unavailable")
        check(len(results) == 2 * limit, "%d answers" % len(results))
        for s in held:
            s.close()
        deadline = time.time() + 5
        while request(port, "GET", "/v1/models", key=KEY)[0] != 200:
            check(time.time() < deadline, "not served again after the held connections closed")
            time.sleep(0.1)
    with_cluster(run, ["--http-max-connections", "4"])


def test_bench_stage_breakdown():
    def run(c, port):
        out = tempfile.mkdtemp(prefix="loom-obs-bench-")
        try:
            for api, extra in (("http", ["--url", "http://127.0.0.1:%d" % port]), ("zmq", ["--addr", c.addr])):
                js, png = os.path.join(out, api + ".json"), os.path.join(out, api + "-stages.png")
                p = loom("bench", "--api", api, *extra, "--api-key", KEY, "--num-requests", "6", "--prompt-len", "16",
                         "--output-len", "12", "--seed", "3", "--rates", "50,inf", "--json", js, "--stage-plot", png,
                         timeout=120)
                check(p.returncode == 0, "bench --api %s: %s %s" % (api, p.stdout[-800:], p.stderr[-800:]))
                check("stage breakdown on the server, 6 requests" in p.stdout, "no breakdown: %s" % p.stdout)
                for st in ("tokenize", "queue", "prefill", "decode", "detokenize", "send", "ttft"):
                    check(re.search(r"^%s\s+\d" % st, p.stdout, re.M), "no %s row: %s" % (st, p.stdout))
                with open(js) as f:
                    res = json.load(f)
                for r in res:
                    s = r["stages"]
                    check(all(s[k]["n"] == 6 for k in s), "stage counts %r" % s)
                    check(s["decode_ms"]["mean"] > 0 and s["prefill_ms"]["mean"] > 0, "stages %r" % s)
                check(os.path.exists(png[:-4] + ".dat") and os.path.exists(png[:-4] + ".gp"), "no plot data")
                if shutil.which("gnuplot"):
                    with open(png, "rb") as f:
                        check(f.read(8) == b"\x89PNG\r\n\x1a\n", "%s is not a PNG" % png)
                else:
                    print("  gnuplot not installed: the PNG is not checked")
        finally:
            shutil.rmtree(out, ignore_errors=True)
    with_cluster(run)


if __name__ == "__main__":
    run_tests([test_timings_metrics_and_request_ids, test_refused_fields_and_stop_token_ids,
               test_tokenize_detokenize_version, test_connection_limit_503_under_load, test_bench_stage_breakdown])

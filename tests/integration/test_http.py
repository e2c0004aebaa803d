"""The coordinator's HTTP gateway on real processes: the official OpenAI
Node SDK against a cluster (answers equal to the ZeroMQ client's), every
error status, the API key, /health before and after the grid is ready,
/metrics as Prometheus text, disconnects that free their requests, 429 on
a full queue, hostile and slow clients, and clean shutdown."""
import http.client
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import BIN, Cluster, ROOT, STORIES, check, gen_model, open_stream, run_tests, wait_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-http")
KEY = "sk-loom-test-key"
CHAT = [{"role": "user", "content": "Tell me a story."}]
# what the chatml template makes of CHAT (tests/unit/test_chat_template.c checks the renderer itself)
CHAT_RENDERED = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
PROMPT = "Once upon a time"


def free_port():
    return harness.free_port()


def request(port, method, path, body=None, key=None, headers=None, timeout=30):
    """One HTTP request on a fresh connection: (status, headers dict, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = dict(headers or {})
    if key:
        h["Authorization"] = "Bearer " + key
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    if body is not None:
        h.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def post(port, path, body, key=KEY, **kw):
    status, hdrs, data = request(port, "POST", path, body, key=key, **kw)
    return status, data


def expect_error(status, data, want, param=None, contains=None, code=None):
    """An OpenAI-style error body with the expected status."""
    check(status == want, "expected %d, got %d: %r" % (want, status, data[:300]))
    try:
        e = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError("not an OpenAI error body: %r" % data[:300])
    for k in ("message", "type", "param", "code"):
        check(k in e, "error body without %s: %r" % (k, e))
    check(isinstance(e["message"], str) and e["message"], "empty error message: %r" % e)
    if param is not None:
        check(e["param"] == param, "param %r, expected %r (%s)" % (e["param"], param, e["message"]))
    if contains is not None:
        check(contains in e["message"], "%r not in %r" % (contains, e["message"]))
    if code is not None:
        check(e["code"] == code, "code %r, expected %r" % (e["code"], code))
    return e


def loom(*args, timeout=60):
    return subprocess.run([os.path.join(BIN, "loom")] + list(args), capture_output=True, text=True, timeout=timeout)


def zmq_stats(addr, key=None):
    p = loom("stats", "--addr", addr, *(["--api-key", key] if key else []))
    check(p.returncode == 0, "loom stats failed: %s" % p.stderr)
    return json.loads(p.stdout)


def wait_idle(addr, key=None, within=5.0):
    """Stats over the ZeroMQ API until nothing runs, waits or holds KV blocks."""
    deadline = time.time() + within
    while True:
        st = zmq_stats(addr, key)
        if st["running"] == 0 and st["waiting"] == 0 and st["kv_blocks_used"] == 0:
            return st
        if time.time() > deadline:
            raise AssertionError("request not freed after %.1f s: %s" % (within, st))
        time.sleep(0.05)




def send_raw(port, body, key=None, path="/v1/completions"):
    """Sends a request and does not read the answer."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    auth = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
    s.sendall(b"POST %s HTTP/1.1\r\nHost: loom\r\nContent-Type: application/json\r\n" % path.encode() + auth +
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


# ---- Prometheus text format ------------------------------------------------------------------

METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE_RE = re.compile(r"^(%s)(?:\{(.*)\})? (\S+)(?: -?\d+)?$" % METRIC_NAME)
LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"\s*(,|$)')


def parse_labels(s):
    out, pos = {}, 0
    while pos < len(s):
        m = LABEL_RE.match(s, pos)
        check(m is not None, "bad label set {%s}" % s)
        check(m.group(1) not in out, "label %s twice in {%s}" % (m.group(1), s))
        out[m.group(1)] = m.group(2)
        pos = m.end()
    return out


def parse_prometheus(text):
    """Checks the text exposition format (0.0.4) line by line; returns
    {name: type} and [(name, labels, value)]."""
    types, helps, samples = {}, set(), []
    check(text.endswith("\n"), "the exposition must end with a newline")
    for line in text.split("\n")[:-1]:
        check(line != "" and line == line.strip(), "blank or padded line %r" % line)
        if line.startswith("# HELP "):
            parts = line.split(" ", 3)
            check(len(parts) == 4 and re.fullmatch(METRIC_NAME, parts[2]), "bad HELP line %r" % line)
            check(parts[2] not in helps, "HELP twice for %s" % parts[2])
            helps.add(parts[2])
        elif line.startswith("# TYPE "):
            parts = line.split(" ")
            check(len(parts) == 4 and re.fullmatch(METRIC_NAME, parts[2]), "bad TYPE line %r" % line)
            check(parts[3] in ("counter", "gauge", "histogram", "summary", "untyped"), "bad type in %r" % line)
            check(parts[2] not in types, "TYPE twice for %s" % parts[2])
            types[parts[2]] = parts[3]
        elif line.startswith("#"):
            continue
        else:
            m = SAMPLE_RE.match(line)
            check(m is not None, "malformed sample line %r" % line)
            name, labels, value = m.group(1), parse_labels(m.group(2) or ""), m.group(3)
            try:
                v = float(value)
            except ValueError:
                raise AssertionError("bad value in %r" % line)
            family = name
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix) and types.get(name[:-len(suffix)]) == "histogram":
                    family = name[:-len(suffix)]
            check(family in types, "sample %s before (or without) its TYPE line" % name)
            samples.append((name, labels, v))
    # histograms: cumulative buckets ending in +Inf equal to _count
    for fam, typ in types.items():
        if typ != "histogram":
            continue
        series = {}
        for name, labels, v in samples:
            if name == fam + "_bucket":
                check("le" in labels, "%s bucket without le" % fam)
                key = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
                series.setdefault(key, []).append((float(labels["le"]), v))
        check(series, "histogram %s has no buckets" % fam)
        for key, buckets in series.items():
            les = [le for le, _ in buckets]
            check(les == sorted(les), "%s buckets out of order" % fam)
            check(math.isinf(les[-1]) and les[-1] > 0, "%s buckets do not end with +Inf" % fam)
            counts = [c for _, c in buckets]
            check(all(a <= b for a, b in zip(counts, counts[1:])), "%s buckets not cumulative: %s" % (fam, counts))
            count = [v for name, labels, v in samples if name == fam + "_count" and
                     tuple(sorted(labels.items())) == key]
            check(len(count) == 1 and count[0] == counts[-1], "%s +Inf bucket %s != _count %s" % (fam, counts[-1], count))
            check(any(name == fam + "_sum" and tuple(sorted(labels.items())) == key for name, labels, _ in samples),
                  "%s without _sum" % fam)
    return types, samples


def metric(samples, name, **labels):
    vals = [v for n, l, v in samples if n == name and all(l.get(k) == x for k, x in labels.items())]
    check(len(vals) == 1, "%s %s: %d samples" % (name, labels, len(vals)))
    return vals[0]


def get_metrics(port):
    status, hdrs, data = request(port, "GET", "/metrics")
    check(status == 200, "/metrics answered %d" % status)
    check(hdrs.get("content-type", "").startswith("text/plain; version=0.0.4"), "content type %r" % hdrs)
    return parse_prometheus(data.decode())


# ---- cluster A: stories260K with a chat template and an API key -------------------------------

def with_main_cluster(fn):
    port = free_port()
    args = ["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml", "--api-key", KEY]
    with Cluster(STORIES, 1, 1, coord_args=args) as c:
        fn(c, port)


def test_openai_sdk_matches_zmq():
    def run(c, port):
        spec = {"prompt": PROMPT, "messages": CHAT, "max_tokens": 32, "seed": 7}
        p = subprocess.run(["node", os.path.join(HERE, "openai_client.mjs"), "http://127.0.0.1:%d/v1" % port, KEY,
                            json.dumps(spec)], capture_output=True, text=True, timeout=120)
        check(p.returncode == 0, "the OpenAI SDK client failed: %s" % (p.stderr[-2000:] or p.stdout[-500:]))
        out = json.loads(p.stdout)
        check(out["models"] == ["stories260K"], "models %r" % out["models"])
        # completions: the same greedy text as the ZeroMQ client
        rc = loom("generate", "--addr", c.addr, "--api-key", KEY, "--prompt", PROMPT, "--max-tokens", "32",
                  "--temperature", "0")
        check(rc.returncode == 0, "loom generate failed: %s" % rc.stderr)
        zmq_text = rc.stdout[:-1] if rc.stdout.endswith("\n") else rc.stdout
        comp, comp_s = out["completion"], out["completion_stream"]
        check(comp["text"] == zmq_text, "completion %r != loom generate %r" % (comp["text"], zmq_text))
        check(comp_s["text"] == zmq_text, "streamed completion %r != %r" % (comp_s["text"], zmq_text))
        check(comp["object"] == "text_completion" and comp["id"].startswith("cmpl-"), "completion %r" % comp)
        check(comp["finish_reason"] == "length" and comp_s["finish_reason"] == "length", "finish reasons")
        u = comp["usage"]
        check(u["completion_tokens"] == 32 and u["prompt_tokens"] == 5 and u["total_tokens"] == 37, "usage %r" % u)
        check(comp_s["usage"] and comp_s["usage"]["completion_tokens"] == 32, "stream usage %r" % comp_s["usage"])
        check(comp_s["chunks"] >= 2 and comp_s["objects"] == ["text_completion"], "stream chunks %r" % comp_s)
        # chat: streaming equals non-streaming equals a raw completion of the rendered conversation
        chat, chat_s = out["chat"], out["chat_stream"]
        check(chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-"), "chat %r" % chat)
        check(chat["role"] == "assistant" and chat_s["role"] == "assistant", "roles")
        check(chat["content"] == chat_s["text"], "chat %r != streamed %r" % (chat["content"], chat_s["text"]))
        check(chat_s["objects"] == ["chat.completion.chunk"] and chat_s["usage"] is None, "chat stream %r" % chat_s)
        status, data = post(port, "/v1/completions", {"prompt": CHAT_RENDERED, "add_special_tokens": False,
                                                      "max_tokens": 32, "temperature": 0})
        check(status == 200, "raw completion: %d %r" % (status, data))
        raw = json.loads(data)
        check(raw["choices"][0]["text"] == chat["content"], "raw %r != chat %r" % (raw["choices"][0]["text"],
                                                                                   chat["content"]))
        check(raw["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"], "prompt tokens differ")
        check(out["seeded_same"], "the same seed gave different texts")
        # sampling parameters reach the coordinator unchanged: the ZeroMQ client agrees
        status, data = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.9,
                                                      "top_p": 0.95, "top_k": 20, "seed": 11})
        check(status == 200, "sampled completion: %d" % status)
        rc = loom("generate", "--addr", c.addr, "--api-key", KEY, "--prompt", PROMPT, "--max-tokens", "24",
                  "--temperature", "0.9", "--top-p", "0.95", "--top-k", "20", "--seed", "11")
        check(rc.returncode == 0 and json.loads(data)["choices"][0]["text"] == rc.stdout[:-1],
              "sampled: http %r, zmq %r" % (json.loads(data)["choices"][0]["text"], rc.stdout))
        # stop strings and token-id prompts
        stop = zmq_text[10:14]
        status, data = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 32, "temperature": 0,
                                                      "stop": [stop, "zzz"]})
        j = json.loads(data)
        check(status == 200 and j["choices"][0]["finish_reason"] == "stop" and
              j["choices"][0]["text"] == zmq_text[:zmq_text.index(stop)], "stop: %r" % data)
        status, data = post(port, "/v1/completions", {"prompt": [1, 300, 301, 302], "max_tokens": 4})
        check(status == 200 and json.loads(data)["usage"]["prompt_tokens"] == 4, "token-id prompt: %r" % data)
        for name in ("err_n", "err_model", "err_key"):
            print("  SDK %s: %s" % (name, out[name]))
        check(out["err_n"]["status"] == 400, "n=0: %r" % out["err_n"])
        check(out["err_model"]["status"] == 404 and out["err_model"]["code"] == "model_not_found", "model")
        check(out["err_key"]["status"] == 401, "wrong key: %r" % out["err_key"])
    with_main_cluster(run)


def test_errors_and_api_key():
    def run(c, port):
        C, H = "/v1/completions", "/v1/chat/completions"
        ok = {"prompt": PROMPT, "max_tokens": 4}
        # the API key: none, wrong, right; /health and /metrics stay open
        status, hdrs, data = request(port, "POST", C, ok)
        expect_error(status, data, 401, code="invalid_api_key", contains="API key")
        check(hdrs.get("www-authenticate") == "Bearer", "401 without WWW-Authenticate")
        expect_error(*post(port, C, ok, key=KEY + "x"), 401, code="invalid_api_key")
        status, hdrs, data = request(port, "GET", "/v1/models", headers={"Authorization": "Basic abc"})
        expect_error(status, data, 401)
        check(post(port, C, ok)[0] == 200, "the right key was refused")
        check(request(port, "GET", "/v1/models", key=KEY)[0] == 200, "models with the key")
        check(request(port, "GET", "/health")[0] == 200, "/health needs no key")
        check(request(port, "GET", "/metrics")[0] == 200, "/metrics needs no key")
        # 400: bad JSON and bad parameters
        expect_error(*post(port, C, "{\"prompt\": "), 400, contains="JSON")
        expect_error(*post(port, C, "[1, 2]"), 400, contains="object")
        expect_error(*post(port, C, ""), 400)
        expect_error(*post(port, C, dict(ok, temperature=-1)), 400, param="temperature")
        expect_error(*post(port, C, dict(ok, temperature="hot")), 400, param="temperature")
        expect_error(*post(port, C, dict(ok, top_p=2)), 400, param="top_p")
        expect_error(*post(port, C, dict(ok, max_tokens=-5)), 400, param="max_tokens")
        expect_error(*post(port, C, dict(ok, max_tokens=2.5)), 400, param="max_tokens")
        expect_error(*post(port, C, dict(ok, n=0)), 400, param="n")
        # n > 1 streams (test_responses.py), but not with the prompt's logprobs (echo)
        expect_error(*post(port, C, dict(ok, n=2, stream=True, echo=True, logprobs=1)), 400, param="n")
        expect_error(*post(port, C, dict(ok, stream="yes")), 400, param="stream")
        expect_error(*post(port, C, dict(ok, stop=5)), 400, param="stop")
        # stop strings: 64 pass the gateway and the coordinator alike (common/request_limits.h), 65 are a 400 on
        # both endpoints before anything is sent on
        stops = ["zq%dx" % i for i in range(65)]
        for path, body in ((C, ok), (H, {"messages": CHAT, "max_tokens": 4})):
            expect_error(*post(port, path, dict(body, stop=stops)), 400, param="stop", contains="at most 64 stop")
            status, data = post(port, path, dict(body, stop=stops[:64]))
            check(status == 200, "%s with 64 stop strings: %d %r" % (path, status, data[:300]))
        expect_error(*post(port, C, dict(ok, top_k=-3)), 400, param="top_k")
        expect_error(*post(port, C, dict(ok, logprobs=21)), 400, param="logprobs")
        expect_error(*post(port, C, {"max_tokens": 4}), 400, param="prompt")
        expect_error(*post(port, C, dict(ok, prompt=5)), 400, param="prompt")
        expect_error(*post(port, C, dict(ok, prompt="")), 400, param="prompt")
        expect_error(*post(port, C, dict(ok, prompt=["a", 5])), 400, param="prompt")
        expect_error(*post(port, C, dict(ok, prompt=[1, -2])), 400, param="prompt")
        expect_error(*post(port, H, {"max_tokens": 4}), 400, param="messages")
        expect_error(*post(port, H, {"messages": "hi"}), 400, param="messages")
        expect_error(*post(port, H, {"messages": []}), 400, param="messages")
        # (any role string goes to the template, as in vLLM: the template decides what it renders)
        expect_error(*post(port, H, {"messages": [{"role": 5, "content": "x"}]}), 400, param="messages")
        expect_error(*post(port, H, {"messages": [{"role": "user"}]}), 400, param="messages")
        expect_error(*post(port, H, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400)
        expect_error(*post(port, H, {"messages": CHAT, "max_completion_tokens": 0}), 400,
                     param="max_completion_tokens")
        # over the context: the coordinator's INVALID_ARGUMENT, its message passed through
        e = expect_error(*post(port, C, dict(ok, max_tokens=100000)), 400)
        check("context length" in e["message"], "context message %r" % e["message"])
        e = expect_error(*post(port, C, {"prompt": [5] * 500, "max_tokens": 100}), 400)
        check("500" in e["message"] and "context" in e["message"], "prompt+max_tokens message %r" % e["message"])
        # 404 / 405
        expect_error(*post(port, C, dict(ok, model="gpt-4")), 404, param="model", code="model_not_found")
        expect_error(*post(port, "/v1/nothing", ok), 404)
        status, hdrs, data = request(port, "GET", "/v1/models/gpt-4", key=KEY)
        expect_error(status, data, 404, code="model_not_found")
        status, hdrs, data = request(port, "GET", "/v1/models/stories260K", key=KEY)
        check(status == 200 and json.loads(data)["id"] == "stories260K", "model object %r" % data)
        status, hdrs, data = request(port, "GET", C, key=KEY)
        expect_error(status, data, 405)
        check(hdrs.get("allow") == "POST", "405 without Allow: %r" % hdrs)
        status, hdrs, data = request(port, "DELETE", "/health")
        expect_error(status, data, 405)
        # bytes that are not text
        expect_error(*post(port, C, b'{"prompt": "\xff\xfe once", "max_tokens": 4}'), 400, contains="UTF-8")
        expect_error(*post(port, C, b'{"prompt": "a\x00b", "max_tokens": 4}'), 400, contains="NUL")
        expect_error(*post(port, C, '{"prompt": "a\\u0000b", "max_tokens": 4}'), 400, contains="NUL")
        expect_error(*post(port, C, '{"prompt": "a\\ud800b", "max_tokens": 4}'), 400)
        expect_error(*post(port, C, "[" * 100000 + "]" * 100000), 400)
        # unknown fields are ignored, as the SDK may send some
        status, data = post(port, C, dict(ok, user="me", metadata={"a": 1}, frequency_penalty=0, logprobs=None))
        check(status == 200, "unknown fields refused: %d %r" % (status, data))
        # after all that the gateway and the coordinator still serve
        status, data = post(port, H, {"messages": CHAT, "max_tokens": 4})
        check(status == 200 and json.loads(data)["choices"][0]["finish_reason"] == "length", "after: %r" % data)
        rc = loom("generate", "--addr", c.addr, "--api-key", KEY, "--prompt", PROMPT, "--max-tokens", "4")
        check(rc.returncode == 0, "the ZeroMQ API after the abuse: %s" % rc.stderr)
    with_main_cluster(run)


def test_metrics_prometheus():
    def run(c, port):
        types, before = get_metrics(port)
        for name, typ in [("loom_time_to_first_token_seconds", "histogram"),
                          ("loom_time_per_output_token_seconds", "histogram"),
                          ("loom_e2e_request_latency_seconds", "histogram"),
                          ("loom_request_queue_time_seconds", "histogram"),
                          ("loom_num_requests_running", "gauge"), ("loom_num_requests_waiting", "gauge"),
                          ("loom_kv_cache_usage_ratio", "gauge"), ("loom_prompt_tokens_total", "counter"),
                          ("loom_generation_tokens_total", "counter"), ("loom_prefix_cache_hits_total", "counter"),
                          ("loom_num_preemptions_total", "counter"), ("loom_request_success_total", "counter")]:
            check(types.get(name) == typ, "%s is %r, expected %s" % (name, types.get(name), typ))
        check(any(n.startswith("loom_stage_") for n in types), "no per-stage step time")
        long_prompt = " ".join([PROMPT] * 6)  # over one KV block, so the repeats hit the prefix cache
        for _ in range(3):
            check(post(port, "/v1/completions", {"prompt": long_prompt, "max_tokens": 8, "temperature": 0})[0] == 200,
                  "request")
        check(post(port, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8})[0] == 200, "chat")
        # the reactor publishes its counters once per loop turn
        time.sleep(0.2)
        _, after = get_metrics(port)

        def delta(name, **labels):
            return metric(after, name, **labels) - metric(before, name, **labels)
        check(delta("loom_generation_tokens_total") == 32, "generation tokens moved by %g" %
              delta("loom_generation_tokens_total"))
        check(delta("loom_prompt_tokens_total") >= 15, "prompt tokens moved by %g" % delta("loom_prompt_tokens_total"))
        check(delta("loom_request_success_total", finished_reason="length") == 4, "finished requests")
        check(delta("loom_time_to_first_token_seconds_count") == 4, "TTFT count")
        check(delta("loom_e2e_request_latency_seconds_count") == 4, "E2E count")
        check(metric(after, "loom_num_requests_running") == 0, "running after")
        check(delta("loom_prefix_cache_hits_total") >= 1, "the repeated prompt found no prefix-cache hit")
    with_main_cluster(run)


def test_bench_http_mode():
    def run(c, port):
        for api, extra in (("http", ["--url", "http://127.0.0.1:%d" % port]), ("zmq", ["--addr", c.addr])):
            p = loom("bench", "--api", api, *extra, "--api-key", KEY, "--num-requests", "6", "--prompt-len", "16",
                     "--output-len", "12", "--seed", "3", timeout=120)
            check(p.returncode == 0, "loom bench --api %s failed (%d): %s %s" % (api, p.returncode, p.stdout[-800:],
                                                                              p.stderr[-800:]))
            check("successful requests          6" in p.stdout and "output tokens                72" in p.stdout,
                  "bench --api %s report: %s" % (api, p.stdout))
        p = loom("bench", "--api", "http", "--url", "http://127.0.0.1:%d" % port, "--num-requests", "2")
        check(p.returncode != 0 and "401" in p.stdout + p.stderr, "bench without the key: %s %s" % (p.stdout,
                                                                                                p.stderr))
    with_main_cluster(run)


# ---- cluster B: a coordinator alone, then a worker; no chat template ----------------------------

class Coordinator:
    """loom-coordinator started directly (no workers yet), with the HTTP gateway."""

    def __init__(self, model, extra=()):
        self.api, self.http = free_port(), free_port()
        self.ctl = free_port()
        self.dir = tempfile.mkdtemp(prefix="loom-it-http-")
        self.log_path = os.path.join(self.dir, "coordinator.log")
        self.log = open(self.log_path, "w")
        self.addr = "tcp://127.0.0.1:%d" % self.api
        self.proc = subprocess.Popen([os.path.join(BIN, "loom-coordinator"), "--insecure",
                                      "--model", model, "--listen", self.addr,
                                      "--control", "tcp://127.0.0.1:%d" % self.ctl,
                                      "--http", "127.0.0.1:%d" % self.http] + list(extra),
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.worker = None

    def wait_http(self):
        def up():
            check(self.proc.poll() is None, "the coordinator exited: %s" % self.text())
            try:
                socket.create_connection(("127.0.0.1", self.http), timeout=1).close()
                return True
            except OSError:
                return False
        wait_for(up, 10, "the HTTP port")

    def start_worker(self):
        self.worker = subprocess.Popen([os.path.join(BIN, "loom-worker"), "--coordinator",
                                        "tcp://127.0.0.1:%d" % self.ctl, "--threads", "1"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def text(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        for p in (self.worker, self.proc):
            if p and p.poll() is None:
                p.kill()
                p.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_health_before_ready_and_no_template():
    co = Coordinator(STORIES, ["--max-body-bytes", "65536", "--http-max-connections", "8", "--http-timeout-s", "2"])
    try:
        co.wait_http()
        status, hdrs, data = request(co.http, "GET", "/health")
        j = json.loads(data)
        check(status == 503 and j["state"] == "waiting_for_workers" and j["workers_ready"] == 0,
              "/health without workers: %d %r" % (status, j))
        expect_error(*post(co.http, "/v1/completions", {"prompt": PROMPT}, key=None), 503, contains="not ready")
        check(request(co.http, "GET", "/v1/models")[0] == 200, "models before the grid is ready")
        co.start_worker()
        wait_for(lambda: request(co.http, "GET", "/health")[0] == 200, 30, "/health to turn 200")
        j = json.loads(request(co.http, "GET", "/health")[2])
        check(j["status"] == "ok" and j["workers_ready"] == 1, "/health when ready: %r" % j)
        # no chat template in stories260K: chat says how to get one; completions work
        e = expect_error(*post(co.http, "/v1/chat/completions", {"messages": CHAT}, key=None), 400)
        check("--chat-template" in e["message"], "no-template message: %r" % e["message"])
        status, data = post(co.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16}, key=None)
        check(status == 200 and json.loads(data)["usage"]["completion_tokens"] == 16,
              "completions default max_tokens: %r" % data)
        # 413: by Content-Length before the body is read, and for a chunked body once it ends
        big = json.dumps({"prompt": "x" * 70000})
        expect_error(*post(co.http, "/v1/completions", big, key=None), 413)
        conn = http.client.HTTPConnection("127.0.0.1", co.http, timeout=30)
        conn.request("POST", "/v1/completions", body=(big[i:i + 8192].encode() for i in range(0, len(big), 8192)),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        r = conn.getresponse()
        expect_error(r.status, r.read(), 413)
        conn.close()
        # very many headers: refused by libmicrohttpd's per-connection memory limit
        s = socket.create_connection(("127.0.0.1", co.http), timeout=10)
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" +
                      b"".join(b"X-Filler-%d: %s\r\n" % (i, b"v" * 40) for i in range(3000)) + b"\r\n")
            answer = s.recv(200)
        except OSError:
            answer = b""
        s.close()
        check(not answer.startswith(b"HTTP/1.1 200"), "3000 headers were accepted: %r" % answer)
        print("  3000 headers: %r" % answer.split(b"\r\n")[0])
        # a slow client is dropped after --http-timeout-s; others are served meanwhile
        slow = socket.create_connection(("127.0.0.1", co.http), timeout=10)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        check(request(co.http, "GET", "/health")[0] == 200, "served while a client dawdles")
        t0 = time.time()
        check(slow.recv(100) == b"", "the slow client got an answer")
        print("  slow client dropped after %.1f s" % (time.time() - t0))
        check(time.time() - t0 < 6, "the slow client kept its connection %.1f s" % (time.time() - t0))
        slow.close()
        # the connection limit: the 9th connection gets 503 (not a reset); all is well once they close.
        # Connections closed above may still hold a slot for a moment (their
        # threads are finishing), so take the 8 again until all are served.
        def hold_all():
            held = [socket.create_connection(("127.0.0.1", co.http), timeout=5) for _ in range(8)]
            for h in held:  # one 200 each on a kept-alive connection: the server holds them all
                got = b""
                try:
                    h.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    while b"\r\n\r\n" not in got:
                        chunk = h.recv(4096)
                        if not chunk:
                            break
                        got += chunk
                except OSError:
                    pass
                # a slot still held by a closing connection answers 503 and
                # closes this one: then the 8 are not all held; take them again
                if not got.startswith(b"HTTP/1.1 200"):
                    for s in held:
                        s.close()
                    return None
            return held
        deadline = time.time() + 10
        held = hold_all()
        while held is None and time.time() < deadline:
            time.sleep(0.2)
            held = hold_all()
        check(held is not None, "8 connections (the limit) were not all served within 10 s")
        status, hdrs, data = request(co.http, "GET", "/health", timeout=5)
        expect_error(status, data, 503, code="service_unavailable", contains="too many connections")
        check(hdrs.get("retry-after") == "1" and hdrs.get("connection") == "close",
              "a 9th connection's answer lacks Retry-After or Connection: close: %r" % hdrs)
        for s in held:
            s.close()

        def served():
            try:
                return request(co.http, "GET", "/health", timeout=5)[0] == 200
            except (OSError, http.client.HTTPException):
                return False
        wait_for(served, 5, "service after the held connections closed")
        # SIGTERM with a keep-alive connection open: a clean, quick exit
        conn = http.client.HTTPConnection("127.0.0.1", co.http, timeout=10)
        conn.request("GET", "/v1/models")
        conn.getresponse().read()
        t0 = time.time()
        co.proc.send_signal(signal.SIGTERM)
        rc = co.proc.wait(timeout=15)
        conn.close()
        check(rc == 0, "the coordinator exited with %d: %s" % (rc, co.text()[-1500:]))
        check(time.time() - t0 < 5, "shutdown took %.1f s" % (time.time() - t0))
    except Exception:
        sys.stderr.write("---- coordinator log\n%s\n" % co.text()[-3000:])
        raise
    finally:
        co.stop()


def test_chat_template_at_startup():
    """Any template compiles and is announced; one with a syntax error is a
    start-up error naming file:line:col; --chat-template takes a shipped
    name or a file, and refuses anything else naming the choices."""
    d = tempfile.mkdtemp(prefix="loom-it-tmpl-")
    try:
        for name in os.listdir(STORIES):
            if name != "tokenizer_config.json":
                os.symlink(os.path.join(STORIES, name), os.path.join(d, name))
        with open(os.path.join(STORIES, "tokenizer_config.json")) as f:
            cfg = json.load(f)

        def start(template, extra=()):
            cfg["chat_template"] = template
            with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                json.dump(cfg, f)
            return Coordinator(d, extra)
        alpaca = ("{{ bos_token }}{% for message in messages %}{{ '### ' + message['role'] + ':\\n' + "
                  "message['content'] | trim + '\\n\\n' }}{% endfor %}")  # no family Loom knew: rendered as written
        co = start(alpaca)
        try:
            co.wait_http()
            wait_for(lambda: "chat template: tokenizer_config.json" in co.text(), 10, "the template line in the log")
            status, data = post(co.http, "/tokenize", {"messages": CHAT}, key=None)
            check(status == 200, "alpaca /tokenize: %d %r" % (status, data[:300]))
            status, data2 = post(co.http, "/tokenize", {"prompt": "<s>### user:\nTell me a story.\n\n",
                                                        "add_special_tokens": False}, key=None)
            check(json.loads(data)["tokens"] == json.loads(data2)["tokens"], "alpaca render: %r vs %r" % (data, data2))
        finally:
            co.stop()
        co = start(alpaca, ["--chat-template", "chatml"])
        try:
            co.wait_http()
            wait_for(lambda: "chat template: chatml" in co.text(), 10, "the template line in the log")
        finally:
            co.stop()
        co = start(alpaca, ["--chat-template", "vicuna"])
        try:
            rc = co.proc.wait(timeout=20)
            check(rc == 1 and "vicuna" in co.text() and "chatml" in co.text(), "bad name: %s" % co.text()[-500:])
        finally:
            co.stop()
        co = start("{% if messages %}\n  {{ messages[0].content }\n{% endif %}")
        try:
            rc = co.proc.wait(timeout=20)
            check(rc == 1 and re.search(r"tokenizer_config\.json:\d+:\d+: ", co.text()),
                  "syntax error: %s" % co.text()[-500:])
        finally:
            co.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- cluster C: a slower model, one sequence at a time, a queue of one -------------------------

def slow_model():
    return gen_model(os.path.join(WORK, "slow"), "--dim", "256", "--hidden-dim", "768", "--layers", "8", "--heads",
                     "8", "--kv-heads", "4", "--vocab", "512", "--max-pos", "4096", "--seed", "3")


def test_disconnect_429_and_shutdown():
    port = free_port()
    long_req = {"prompt": PROMPT, "max_tokens": 3500, "ignore_eos": True, "temperature": 0}
    with Cluster(slow_model(), 1, 1, coord_args=["--http", "127.0.0.1:%d" % port, "--max-num-seqs", "1",
                                                 "--max-queue", "1"]) as c:
        _, m0 = get_metrics(port)
        # a streaming client that disconnects mid-stream: its request is cancelled and freed
        s, got = open_stream(port, long_req, events=5)
        st = zmq_stats(c.addr)
        check(st["running"] == 1 and st["kv_blocks_used"] > 0, "while streaming: %s" % st)
        t0 = time.time()
        s.close()
        wait_idle(c.addr, within=3)
        print("  streaming disconnect freed in %.2f s" % (time.time() - t0))
        # the same for a non-streaming request (noticed while the gateway waits)
        s = send_raw(port, dict(long_req, stream=False))
        wait_for(lambda: zmq_stats(c.addr)["running"] == 1, 5, "the request to run")
        time.sleep(0.3)
        t0 = time.time()
        s.close()
        wait_idle(c.addr, within=3)
        print("  non-streaming disconnect freed in %.2f s" % (time.time() - t0))
        time.sleep(0.2)
        _, m1 = get_metrics(port)
        check(metric(m1, "loom_request_success_total", finished_reason="abort") -
              metric(m0, "loom_request_success_total", finished_reason="abort") == 2, "cancelled count")
        # 429: one runs, one waits, the third finds the queue full
        a, _ = open_stream(port, long_req, events=2)
        b = send_raw(port, long_req)
        wait_for(lambda: zmq_stats(c.addr)["waiting"] == 1, 5, "the second request to queue")
        e = expect_error(*post(port, "/v1/completions", dict(long_req, max_tokens=4), key=None), 429,
                         code="rate_limit_exceeded")
        check("queue" in e["message"], "429 message %r" % e["message"])
        b.close()
        wait_for(lambda: zmq_stats(c.addr)["waiting"] == 0, 3, "the queued request to leave")
        a.close()
        wait_idle(c.addr, within=3)
        # the gateway still answers, then a second SIGTERM (the first drains) during a stream ends it and
        # the process quickly
        check(post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, key=None)[0] == 200, "after")
        # more choices than the queue ever holds: a 400 (a 429 would be retried forever), even when idle
        e = expect_error(*post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 2}, key=None), 400,
                         param="n")
        check("--max-queue" in e["message"], "400 message %r" % e["message"])
        s, got = open_stream(port, long_req, events=2)
        t0 = time.time()
        os.kill(c.pid("coordinator"), signal.SIGTERM)
        time.sleep(0.1)
        os.kill(c.pid("coordinator"), signal.SIGTERM)
        s.settimeout(10)
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
        s.close()
        # it ends with an error event, then [DONE] (not a silent close)
        check(b'data: {"error"' in got and b"data: [DONE]" in got and b"shutting down" in got and
              got.index(b'data: {"error"') < got.index(b"data: [DONE]"), "a stream cut by shutdown: %r" % got[-300:])
        deadline = time.time() + 10
        while time.time() < deadline and os.path.exists("/proc/%d" % c.pid("coordinator")):
            with open("/proc/%d/stat" % c.pid("coordinator")) as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        print("  shutdown with a stream in flight: %.2f s" % (time.time() - t0))
        check(time.time() - t0 < 5, "shutdown took %.1f s" % (time.time() - t0))
        log = c.log("coordinator")
        check("shutting down" in log, "no orderly shutdown in the log")
        check("Sanitizer" not in log and "runtime error" not in log, "sanitizer report: %s" % log[-2000:])


if __name__ == "__main__":
    if shutil.which("node") is None or not os.path.isdir(os.path.join(ROOT, "tests", "reference", "node_modules",
                                                                      "openai")):
        print("the OpenAI SDK is missing: run npm ci --prefix tests/reference")
        sys.exit(1)
    run_tests([test_openai_sdk_matches_zmq, test_errors_and_api_key, test_metrics_prometheus, test_bench_http_mode,
               test_health_before_ready_and_no_template, test_chat_template_at_startup,
               test_disconnect_429_and_shutdown])

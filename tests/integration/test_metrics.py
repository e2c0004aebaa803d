"""/metrics against what dashboards expect, on a live server after traffic.

1. vLLM's series (vllm/v1/metrics/loggers.py, PrometheusStatLogger): each
   one Loom has a meaning for is there with vLLM's type, labels
   (model_name, engine; finished_reason stop|length|abort|error) and bucket
   boundaries.
2. Every PromQL expression of vLLM's example Grafana dashboard
   (examples/online_serving/prometheus_grafana/grafana.json in the vLLM
   repository) and of deploy/grafana/loom.json resolves: each series it
   names exists, with the type its use needs (rate/increase over a counter
   or a histogram's parts, plain selectors over gauges) and the labels it
   matches on; the histograms they read have observations.
3. Loom's own loom_* names pass the naming rules promtool checks
   (counters end in _total, nothing else does, base units, no reserved
   suffixes), and the exposition parses (test_http.parse_prometheus)."""
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, STORIES, Cluster, Failure, check, open_stream, run_tests  # noqa: E402
from test_http import CHAT, KEY, PROMPT, free_port, get_metrics, metric, post, request  # noqa: E402

# vLLM's boundaries (loggers.py)
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
           1920.0, 7680.0]
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREFILL_PER_TOKEN = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
LEN = "1-2-5"  # vLLM's build_1_2_5_buckets(max_model_len)


def buckets_125(top):
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > top:
                return out
            out.append(float(m * scale))
        scale *= 10


# name: (type, buckets or None)
VLLM = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:gpu_cache_usage_perc": ("gauge", None),
    "vllm:prefix_cache_queries_total": ("counter", None),
    "vllm:prefix_cache_hits_total": ("counter", None),
    "vllm:num_preemptions_total": ("counter", None),
    "vllm:prompt_tokens_total": ("counter", None),
    "vllm:generation_tokens_total": ("counter", None),
    "vllm:request_success_total": ("counter", None),
    "vllm:request_prompt_tokens": ("histogram", LEN),
    "vllm:request_generation_tokens": ("histogram", LEN),
    "vllm:iteration_tokens_total": ("histogram", ITERATION),
    "vllm:request_max_num_generation_tokens": ("histogram", LEN),
    "vllm:request_params_n": ("histogram", [1, 2, 5, 10, 20]),
    "vllm:request_params_max_tokens": ("histogram", LEN),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT),
    "vllm:time_per_output_token_seconds": ("histogram", PER_TOKEN),
    "vllm:request_time_per_output_token_seconds": ("histogram", PER_TOKEN),
    "vllm:inter_token_latency_seconds": ("histogram", PER_TOKEN),
    "vllm:time_per_prefill_token_request_seconds": ("histogram", PREFILL_PER_TOKEN),
    "vllm:e2e_request_latency_seconds": ("histogram", REQUEST),
    "vllm:request_queue_time_seconds": ("histogram", REQUEST),
    "vllm:request_inference_time_seconds": ("histogram", REQUEST),
    "vllm:request_prefill_time_seconds": ("histogram", REQUEST),
    "vllm:request_decode_time_seconds": ("histogram", REQUEST),
    "vllm:cache_config_info": ("gauge", None),
}

# The expressions of vLLM's example dashboard, as written there.
VLLM_DASHBOARD = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
    'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
]

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "le"}
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


def selectors(expr):
    """The series selectors of a PromQL expression: [(name, {label: value}, ranged)]."""
    out, i = [], 0
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)
    while i < len(expr):
        if expr[i] == '"':
            j = expr.index('"', i + 1)
            i = j + 1
            continue
        m = IDENT.match(expr, i)
        if not m or (i > 0 and (expr[i - 1].isalnum() or expr[i - 1] in "_.$")):
            i += 1
            continue
        name, j = m.group(0), m.end()
        rest = expr[j:].lstrip()
        if rest.startswith("(") or name in PROMQL_WORDS:
            i = j
            continue
        labels = {}
        k = j + (len(expr[j:]) - len(rest))
        if rest.startswith("{"):
            end = expr.index("}", k)
            body, pos = expr[k + 1:end], 0
            while pos < len(body):
                mm = MATCHER.match(body, pos)
                check(mm is not None, "bad matcher in %r" % expr)
                check(mm.group(2) == "=", "only = matchers are checked: %r" % expr)
                labels[mm.group(1)] = mm.group(3)
                pos = mm.end()
            k = end + 1
        ranged = expr[k:].lstrip().startswith("[")
        out.append((name, labels, ranged))
        i = k
    return out


def resolve(expr, types, samples, model, observed):
    """Checks every series of expr against the exposition; returns the names it read."""
    sels = selectors(expr)
    check(sels, "no series found in %r" % expr)
    for name, labels, ranged in sels:
        labels = {k: v.replace("$model_name", model) for k, v in labels.items()}
        family, part = name, None
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and types.get(name[:-len(suffix)]) == "histogram":
                family, part = name[:-len(suffix)], suffix
        check(family in types, "%r: %s is not in /metrics" % (expr, name))
        typ = types[family]
        check(typ != "histogram" or part, "%r: histogram %s used without _bucket/_sum/_count" % (expr, name))
        if ranged:
            check(typ in ("counter", "histogram"), "%r: rate/increase over %s, a %s" % (expr, name, typ))
        else:
            check(typ == "gauge", "%r: %s (a %s) read as a gauge" % (expr, name, typ))
        hits = [(ls, v) for n, ls, v in samples if n == name and all(ls.get(a) == b for a, b in labels.items())]
        check(hits, "%r: no %s sample with labels %s" % (expr, name, labels))
        if typ == "histogram" and family in observed:
            check(any(v > 0 for _, v in hits), "%r: %s has no observations after traffic" % (expr, name))
    return [n for n, _, _ in sels]


def lint_loom_names(types, samples):
    """The naming rules promtool's `check metrics` applies, on Loom's own names."""
    for name, typ in types.items():
        if not name.startswith("loom_"):
            continue
        check(re.fullmatch(r"[a-z][a-z0-9_]*", name) is not None, "%s: not snake_case" % name)
        if typ == "counter":
            check(name.endswith("_total"), "counter %s should end in _total" % name)
        else:
            check(not name.endswith("_total"), "%s %s should not end in _total" % (typ, name))
        for reserved in ("_bucket", "_count", "_sum"):
            check(not name.endswith(reserved), "%s ends in the reserved suffix %s" % (name, reserved))
        for unit in ("_ms", "_milliseconds", "_microseconds", "_us", "_percent", "_perc", "_minutes", "_hours"):
            check(unit + "_" not in name + "_", "%s: use base units (seconds, ratio)" % name)
        for word in ("_gauge", "_counter", "_histogram"):
            check(word not in name, "%s names its type" % name)
    for name, labels, _ in samples:
        for k in labels:
            check(re.fullmatch(r"[a-z_][a-z0-9_]*", k) is not None, "%s: label %s not snake_case" % (name, k))


def check_vllm(types, samples, max_model_len):
    for name, (typ, buckets) in VLLM.items():
        check(types.get(name) == typ, "%s is %r, vLLM has a %s" % (name, types.get(name), typ))
        series = [ls for n, ls, _ in samples if n == (name + "_count" if typ == "histogram" else name)]
        check(series, "%s has no samples" % name)
        for ls in series:
            want = {"engine"} if name == "vllm:cache_config_info" else {"model_name", "engine"}
            check(want <= set(ls), "%s labels %s lack %s" % (name, ls, want))
            check(ls["engine"] == "0", "%s engine=%r" % (name, ls["engine"]))
        if buckets:
            want = buckets_125(max_model_len) if buckets == LEN else [float(b) for b in buckets]
            les = [float(ls["le"]) for n, ls, _ in samples if n == name + "_bucket"]
            check(les[:-1] == want and les[-1] == float("inf"), "%s buckets %s, vLLM's %s" % (name, les, want))
    reasons = {ls["finished_reason"] for n, ls, _ in samples if n == "vllm:request_success_total"}
    check(reasons == {"stop", "length", "abort", "error"}, "finished_reason values %s" % reasons)
    info = [ls for n, ls, _ in samples if n == "vllm:cache_config_info"][0]
    check(info.get("block_size") == "16" and int(info.get("num_gpu_blocks", "0")) > 0, "cache_config_info %s" % info)


def traffic(port):
    long_prompt = " ".join([PROMPT] * 6)  # over one KV block: the repeats hit the prefix cache
    for i in range(3):
        status, data = post(port, "/v1/completions", {"prompt": long_prompt, "max_tokens": 6 + i,
                                                         "temperature": 0})
        check(status == 200, "completion %d: %d %s" % (i, status, data[:200]))
    status, _ = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "stream": True})
    check(status == 200, "streamed completion: %d" % status)
    check(post(port, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5})[0] == 200, "chat")
    # a client that leaves mid-stream: its request ends as "abort"
    sock, _ = open_stream(port, {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}, key=KEY, events=2)
    sock.close()


def test_vllm_series_and_dashboards():
    port = free_port()
    args = ["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml", "--api-key", KEY]
    with Cluster(STORIES, 1, 1, coord_args=args):
        status, _, data = request(port, "GET", "/v1/models", key=KEY)
        check(status == 200, "/v1/models %d" % status)
        model_info = json.loads(data)["data"][0]
        model, max_model_len = model_info["id"], model_info["max_model_len"]
        types, before = get_metrics(port)
        lint_loom_names(types, before)
        check_vllm(types, before, max_model_len)
        traffic(port)
        deadline = time.time() + 20
        while True:  # the aborted request is counted once the gateway noticed the disconnect
            types, after = get_metrics(port)
            aborted = metric(after, "vllm:request_success_total", finished_reason="abort") - \
                metric(before, "vllm:request_success_total", finished_reason="abort")
            if aborted >= 1 or time.time() > deadline:
                break
            time.sleep(0.2)
        check(aborted == 1, "the client that left was counted %g times as abort" % aborted)
        lint_loom_names(types, after)
        check_vllm(types, after, max_model_len)

        def delta(name, **labels):
            return metric(after, name, **labels) - metric(before, name, **labels)
        ended = delta("vllm:request_success_total", finished_reason="length") + \
            delta("vllm:request_success_total", finished_reason="stop")
        check(ended == 5, "5 requests ended at max_tokens or a stop, counted %g" % ended)
        check(delta("vllm:request_success_total", finished_reason="error") == 0, "errors counted")
        check(delta("vllm:request_prompt_tokens_count") == 6, "request_prompt_tokens counts every finished request")
        check(delta("vllm:request_params_max_tokens_sum") == 6 + 7 + 8 + 12 + 5 + 200, "max_tokens sum")
        check(delta("vllm:request_params_n_count") == 6, "request_params_n count")
        gen = delta("vllm:generation_tokens_total")
        check(delta("vllm:request_generation_tokens_sum") == gen, "generation tokens: histogram sum %g, counter %g"
              % (delta("vllm:request_generation_tokens_sum"), gen))
        # each step's input: the prompt tokens not found in the cache, then one token per later output token
        computed = delta("vllm:prompt_tokens_total") - delta("vllm:prefix_cache_hits_total") + gen - 6
        check(delta("vllm:iteration_tokens_total_sum") >= computed > 0,
              "tokens per step sum %g, at least %g computed" % (delta("vllm:iteration_tokens_total_sum"), computed))
        block = 16
        check(delta("vllm:prefix_cache_hits_total") == block * delta("loom_prefix_cache_hits_total") and
              delta("vllm:prefix_cache_hits_total") >= block, "prefix cache hits in tokens: %g" %
              delta("vllm:prefix_cache_hits_total"))
        check(delta("vllm:time_to_first_token_seconds_count") == 6, "TTFT for each request")
        check(metric(after, "vllm:time_per_output_token_seconds_sum") ==
              metric(after, "vllm:inter_token_latency_seconds_sum"), "the older ITL name carries the same data")
        observed = {"vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                    "vllm:time_per_output_token_seconds", "vllm:request_prompt_tokens",
                    "vllm:request_generation_tokens", "vllm:request_queue_time_seconds",
                    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                    "vllm:request_max_num_generation_tokens", "vllm:inter_token_latency_seconds",
                    "vllm:request_time_per_output_token_seconds", "vllm:iteration_tokens_total",
                    "vllm:request_params_max_tokens", "loom_request_tokenize_time_seconds",
                    "loom_request_queue_time_seconds", "loom_request_prefill_time_seconds",
                    "loom_request_decode_time_seconds", "loom_request_detokenize_time_seconds",
                    "loom_request_send_time_seconds", "loom_step_seconds"}
        read = set()
        for expr in VLLM_DASHBOARD:
            read.update(resolve(expr, types, after, model, observed))
        with open(os.path.join(ROOT, "deploy", "grafana", "loom.json")) as f:
            dash = json.load(f)
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        check(len(exprs) >= 30, "deploy/grafana/loom.json has %d expressions" % len(exprs))
        for expr in exprs:
            read.update(resolve(expr, types, after, model, observed))
        stage_hists = {n for n in read if n.startswith("loom_request_") and n.endswith("_time_seconds_bucket")}
        check(len(stage_hists) == 6, "the Loom dashboard reads %d stage histograms" % len(stage_hists))
        var = dash["templating"]["list"][1]["query"]["query"]
        m = re.fullmatch(r"label_values\((\w+), model_name\)", var)
        check(m and types.get(m.group(1)) == "gauge", "model_name variable %r" % var)
        # a chat request's prompt is rendered and tokenized by the gateway: that time is the tokenize stage's
        _, before = get_metrics(port)
        status, _, data = request(port, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Tell me a story. " * 40}], "max_tokens": 1}, key=KEY)
        check(status == 200, "chat: %d %r" % (status, data[:200]))
        deadline = time.time() + 5
        while True:  # (the request is observed when the reactor ends it, which may be just after the answer)
            _, after = get_metrics(port)
            if metric(after, "loom_request_tokenize_time_seconds_count") > \
                    metric(before, "loom_request_tokenize_time_seconds_count") or time.time() > deadline:
                break
            time.sleep(0.05)
        tok = metric(after, "loom_request_tokenize_time_seconds_sum") - \
            metric(before, "loom_request_tokenize_time_seconds_sum")
        check(tok > 0 and metric(after, "loom_request_tokenize_time_seconds_count") -
              metric(before, "loom_request_tokenize_time_seconds_count") == 1,
              "a chat request's gateway tokenization was not counted (%g s)" % tok)


def test_selector_parser():
    """The checker itself: it finds names, labels and ranges, and refuses what is not there."""
    sels = selectors('histogram_quantile(0.9, sum by(le, stage) (rate(a_b_bucket{model_name="x", s="y"}[5m]))) '
                     '/ on(x) vllm:c{q="1,2"} + d offset 5m')
    check(sels == [("a_b_bucket", {"model_name": "x", "s": "y"}, True), ("vllm:c", {"q": "1,2"}, False),
                   ("d", {}, False)], "selectors: %s" % sels)
    types = {"g": "gauge", "c_total": "counter", "h": "histogram"}
    samples = [("g", {"model_name": "m"}, 1.0), ("c_total", {"model_name": "m"}, 1.0),
               ("h_bucket", {"model_name": "m", "le": "+Inf"}, 0.0)]
    resolve('g{model_name="$model_name"}', types, samples, "m", set())
    resolve('rate(c_total{model_name="$model_name"}[1m])', types, samples, "m", set())
    for bad in ('rate(g[1m])', 'c_total', 'missing', 'g{model_name="other"}', 'h'):
        try:
            resolve(bad, types, samples, "m", set())
        except Failure:
            continue
        raise Failure("resolve accepted %r" % bad)
    try:
        resolve('rate(h_bucket[1m])', types, samples, "m", {"h"})
    except Failure:
        pass
    else:
        raise Failure("an empty histogram passed as observed")
    for bad in ({"loom_x_total": "gauge"}, {"loom_y": "counter"}, {"loom_z_ms": "gauge"}, {"loom_w_count": "gauge"}):
        try:
            lint_loom_names(bad, [])
        except Failure:
            continue
        raise Failure("the lint accepted %s" % bad)


if __name__ == "__main__":
    run_tests([test_selector_parser, test_vllm_series_and_dashboards])

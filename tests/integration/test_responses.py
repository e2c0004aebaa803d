"""The Responses API (/v1/responses) on real processes: a generated model
with the stories260K tokenizer and a 2048-token context (the tools'
preamble does not fit the tiny model's 512), chat template chatml.

- A plain response equals the chat completion it maps onto (instructions a
  system turn, input a user turn, max_output_tokens, temperature 0): same
  text, same token counts; the object has OpenAI's shape (resp_ id,
  message item with output_text, usage with the details).
- Streamed: the event sequence the SDKs consume (created, in_progress,
  output_item.added, content_part.added, output_text.delta..., done
  events, completed/incomplete), sequence_number 0, 1, 2, ...; the deltas
  add up to the unstreamed text.
- Logprobs (include message.output_text.logprobs, top_logprobs): the
  output_text part has the chat's logprobs for the same request, streamed
  on the output_text.delta events; bad values are a 400.
- Function tools with tool_choice required: function_call items whose
  arguments validate against the tool's schema, streamed (arguments deltas
  adding up to the done event) and not; function_call + function_call_output
  items in a later input render into the prompt.
- text.format json_schema: the output validates against the schema.
- store + previous_response_id: the second turn's prompt holds the first;
  GET /v1/responses/{id}, DELETE, store false; an unknown id is a 404 with
  OpenAI's error body; bad input is a 400 naming the field, and the server
  keeps serving.
- Streamed n = 2 on chat and completions: choices indexed 0 and 1, each
  equal to the unstreamed seeded twin.
- loom-router serves it too (the same gateway library, its own store).
- The SDKs (sdk_responses.mjs): openai responses.create (plain, streamed,
  the stream helper, a tool call and its output, json_schema,
  previous_response_id, an unknown id), the AI SDK's responses model and
  LangChain's ChatOpenAI with useResponsesApi; streamed n = 2 through the
  openai SDK's chat.completions and completions."""
import http.client
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, STORIES, Cluster, check, run_tests  # noqa: E402
from test_http import KEY, expect_error, free_port, post, request  # noqa: E402
from test_structured import validate  # noqa: E402
from test_router import Router  # noqa: E402
from test_tools import WEATHER, make_model  # noqa: E402

RTOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER}]


def sse(port, path, body, timeout=120):
    """(status, [(event name, data dict)]) of a streamed request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read().decode()
        if r.status != 200:
            return r.status, data
        events = []
        for block in data.split("\n\n"):
            name, payload = None, None
            for line in block.split("\n"):
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    payload = line[6:]
            if payload is None:
                continue
            events.append((name, None if payload == "[DONE]" else json.loads(payload)))
        return r.status, events
    finally:
        conn.close()


def respond(port, body, want=200):
    status, data = post(port, "/v1/responses", body, timeout=120)
    check(status == want, "%r: %d %r" % (body, status, data[:400]))
    return json.loads(data)


def message_text(r):
    out = [o for o in r["output"] if o["type"] == "message"]
    return "".join(p["text"] for o in out for p in o["content"] if p["type"] == "output_text")


def check_plain(port):
    body = {"instructions": "Tell a story.", "input": "Once upon a time", "max_output_tokens": 16, "temperature": 0}
    r = respond(port, body)
    check(r["object"] == "response" and r["id"].startswith("resp_") and r["status"] in ("completed", "incomplete"),
          "shape: %r" % r)
    check(r["output"][0]["type"] == "message" and r["output"][0]["role"] == "assistant" and
          r["output"][0]["content"][0]["type"] == "output_text", "output: %r" % r["output"])
    u = r["usage"]
    for k in ("input_tokens", "output_tokens", "total_tokens"):
        check(isinstance(u.get(k), int), "usage %r" % u)
    check(u["total_tokens"] == u["input_tokens"] + u["output_tokens"] and
          "cached_tokens" in u["input_tokens_details"] and "reasoning_tokens" in u["output_tokens_details"],
          "usage %r" % u)
    check(r["instructions"] == "Tell a story." and r["max_output_tokens"] == 16 and r["store"] is True, "echo %r" % r)
    # the chat completion it maps onto
    status, data = post(port, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}],
        "max_completion_tokens": 16, "temperature": 0})
    check(status == 200, "chat: %d %r" % (status, data[:300]))
    c = json.loads(data)
    check(message_text(r) == c["choices"][0]["message"]["content"], "text %r vs chat %r" % (
        message_text(r), c["choices"][0]["message"]["content"]))
    check(u["input_tokens"] == c["usage"]["prompt_tokens"] and u["output_tokens"] == c["usage"]["completion_tokens"],
          "usage %r vs chat %r" % (u, c["usage"]))
    check((r["status"] == "incomplete") == (c["choices"][0]["finish_reason"] == "length"), "status %s vs %s" % (
        r["status"], c["choices"][0]["finish_reason"]))
    if r["status"] == "incomplete":
        check(r["incomplete_details"] == {"reason": "max_output_tokens"}, "incomplete %r" % r["incomplete_details"])
    # streamed: the events, in order, adding up to the same text
    status, events = sse(port, "/v1/responses", dict(body, stream=True))
    check(status == 200, "stream: %d %r" % (status, events))
    types = [d["type"] for _, d in events]
    check([n for n, _ in events] == types, "event names differ from the types")
    check([d["sequence_number"] for _, d in events] == list(range(len(events))), "sequence numbers %r" % types)
    want = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    check(types[:4] == want, "first events %r" % types[:6])
    check(types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                         "response.completed" if r["status"] == "completed" else "response.incomplete"],
          "last events %r" % types[-5:])
    deltas = "".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta")
    check(deltas == message_text(r), "streamed %r vs %r" % (deltas, message_text(r)))
    final = events[-1][1]["response"]
    tokens = ("input_tokens", "output_tokens", "total_tokens")  # (cached_tokens grows: the prefix cache)
    check(message_text(final) == deltas and [final["usage"][k] for k in tokens] == [r["usage"][k] for k in tokens] and
          final["id"] != r["id"], "final %r" % final)
    check(events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == [],
          "created %r" % events[0][1])
    print("  plain: %r (%s), %d events streamed" % (message_text(r), r["status"], len(events)))


def same_logprobs(a, b, tol=1e-4):
    """The same tokens with the same log probabilities, up to float noise
    (two requests may run in different batches)."""
    def close(x, y):
        return x["token"] == y["token"] and x.get("bytes") == y.get("bytes") and abs(x["logprob"] - y["logprob"]) <= tol
    return len(a) == len(b) and all(close(x, y) and len(x["top_logprobs"]) == len(y["top_logprobs"]) and
                                    all(close(u, v) for u, v in zip(x["top_logprobs"], y["top_logprobs"]))
                                    for x, y in zip(a, b))


def check_logprobs(port):
    """include message.output_text.logprobs with top_logprobs: the output_text
    part carries the chat's logprobs.content for the same request, streamed
    on the output_text.delta events (adding up to the same list, as the done
    event has it); without include, empty lists; bad values are a 400."""
    body = {"input": "Once upon a time", "max_output_tokens": 12, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 3}
    r = respond(port, body)
    part = r["output"][0]["content"][0]
    status, data = post(port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Once upon a time"}], "max_completion_tokens": 12,
        "temperature": 0, "logprobs": True, "top_logprobs": 3})
    check(status == 200, "chat: %d %r" % (status, data[:300]))
    want = json.loads(data)["choices"][0]["logprobs"]["content"]
    check(same_logprobs(part["logprobs"], want) and len(want) == r["usage"]["output_tokens"] and r["top_logprobs"] == 3,
          "logprobs %r vs chat %r" % (part["logprobs"][:3], want[:3]))
    check(all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in want), "top_logprobs %r" % want[:2])
    status, events = sse(port, "/v1/responses", dict(body, stream=True))
    check(status == 200, "stream: %d %r" % (status, events))
    streamed = [e for _, d in events if d["type"] == "response.output_text.delta" for e in d["logprobs"]]
    done = [d for _, d in events if d["type"] == "response.output_text.done"][0]
    final = events[-1][1]["response"]["output"][0]["content"][0]
    check(streamed == done["logprobs"] == final["logprobs"] and same_logprobs(streamed, want), "streamed logprobs %r vs %r" % (
        streamed[:3], want[:3]))
    plain = respond(port, dict(body, include=[], top_logprobs=None))
    check(plain["output"][0]["content"][0]["logprobs"] == [], "no include: %r" % plain["output"][0])
    for bad, param in (({"include": "message.output_text.logprobs"}, "include"), ({"top_logprobs": 21}, "top_logprobs"),
                       ({"top_logprobs": 1.5}, "top_logprobs")):
        status, data = post(port, "/v1/responses", dict(body, **bad))
        expect_error(status, data, 400, param=param)
    print("  logprobs: %d tokens, streamed on the deltas" % len(want))


def check_tools(port):
    pairs = []
    base = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is the weather?"}]}],
            "tools": RTOOLS, "tool_choice": "required", "max_output_tokens": 150, "temperature": 0,
            "parallel_tool_calls": False}
    r = respond(port, base)
    calls = [o for o in r["output"] if o["type"] == "function_call"]
    if r["status"] == "completed":
        check(len(calls) == 1, "one call: %r" % r["output"])
        c = calls[0]
        check(c["name"] == "get_weather" and c["call_id"].startswith("call_") and c["id"].startswith("fc_") and
              c["status"] == "completed", "call %r" % c)
        pairs.append((WEATHER, c["arguments"]))
        # streamed: argument deltas add up to the done event and to the unstreamed call
        status, events = sse(port, "/v1/responses", dict(base, stream=True))
        check(status == 200, "stream: %r" % events)
        types = [d["type"] for _, d in events]
        check("response.function_call_arguments.done" in types and types[-1] == "response.completed", "%r" % types)
        args = "".join(d["delta"] for _, d in events if d["type"] == "response.function_call_arguments.delta")
        done = [d for _, d in events if d["type"] == "response.function_call_arguments.done"][0]
        item = [d["item"] for _, d in events if d["type"] == "response.output_item.done"][-1]
        check(args == done["arguments"] == c["arguments"] == item["arguments"] and item["call_id"].startswith("call_")
              and item["id"] == done["item_id"],
              "streamed %r / %r vs %r" % (args, done, c))
        # the call and its output in a later input render into the prompt
        hist = base["input"] + [c, {"type": "function_call_output", "call_id": c["call_id"], "output": "21 C"}]
        r2 = respond(port, {"input": hist, "tools": RTOOLS, "max_output_tokens": 4})
        check(r2["usage"]["input_tokens"] > r["usage"]["input_tokens"] + 5, "history not rendered: %r vs %r" % (
            r2["usage"], r["usage"]))
    else:
        print("  the forced call ran out of tokens: %r" % r["output"])
    # a named function
    r = respond(port, dict(base, tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0, seed=3))
    for c in (o for o in r["output"] if o["type"] == "function_call"):
        pairs.append((WEATHER, c["arguments"]))
    # json_schema
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    for seed in range(3):
        r = respond(port, {"input": "A person as JSON.", "max_output_tokens": 80, "temperature": 1.0, "seed": seed,
                           "text": {"format": {"type": "json_schema", "name": "person", "schema": schema,
                                               "strict": True}}})
        check(r["text"]["format"]["type"] == "json_schema", "text echo %r" % r["text"])
        if r["status"] == "completed":
            pairs.append((schema, message_text(r)))
    r = respond(port, {"input": "JSON please.", "max_output_tokens": 60, "temperature": 0,
                       "text": {"format": {"type": "json_object"}}})
    if r["status"] == "completed":
        check(isinstance(json.loads(message_text(r)), dict), "json_object: %r" % message_text(r))
    check(len(pairs) >= 2, "too few finished structured answers: %d" % len(pairs))
    validate(pairs)
    print("  tools and json_schema: %d outputs validated" % len(pairs))


def check_store_and_errors(port):
    r1 = respond(port, {"input": "Lily had a red ball.", "max_output_tokens": 8, "temperature": 0})
    r2 = respond(port, {"input": "What next?", "previous_response_id": r1["id"], "max_output_tokens": 8,
                        "temperature": 0})
    solo = respond(port, {"input": "What next?", "max_output_tokens": 8, "temperature": 0})
    check(r2["previous_response_id"] == r1["id"], "echo %r" % r2["previous_response_id"])
    check(r2["usage"]["input_tokens"] >= solo["usage"]["input_tokens"] + r1["usage"]["input_tokens"] +
          r1["usage"]["output_tokens"] - 6, "the first turn is not in the second's prompt: %r %r %r" % (
              r1["usage"], r2["usage"], solo["usage"]))
    # a third turn continues the second (which holds the first)
    r3 = respond(port, {"input": "And then?", "previous_response_id": r2["id"], "max_output_tokens": 4})
    check(r3["usage"]["input_tokens"] > r2["usage"]["input_tokens"], "third turn %r" % r3["usage"])
    status, _, data = request(port, "GET", "/v1/responses/" + r1["id"], key=KEY)
    check(status == 200 and json.loads(data) == r1, "GET: %d %r" % (status, data[:200]))
    status, _, data = request(port, "DELETE", "/v1/responses/" + r1["id"], key=KEY)
    check(status == 200 and json.loads(data)["deleted"] is True, "DELETE: %d %r" % (status, data[:200]))
    status, _, data = request(port, "GET", "/v1/responses/" + r1["id"], key=KEY)
    expect_error(status, data, 404)
    nostore = respond(port, {"input": "x", "max_output_tokens": 2, "store": False})
    status, _, data = request(port, "GET", "/v1/responses/" + nostore["id"], key=KEY)
    expect_error(status, data, 404)
    status, data = post(port, "/v1/responses", {"input": "x", "previous_response_id": "resp_unknown"})
    expect_error(status, data, 404, param="previous_response_id", code="previous_response_not_found")
    status, _, data = request(port, "PUT", "/v1/responses/" + r2["id"], key=KEY)
    expect_error(status, data, 405)
    bad = [
        ({"input": 42}, "input", "string or a non-empty array"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "input_text"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "role"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id"),
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"tools": [{"type": "function"}]}, "tools", "name"),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
        ({"max_output_tokens": 0}, "max_output_tokens", "positive"),
        ({"stream": "yes"}, "stream", "boolean"),
        ({"background": True}, "background", "not supported"),
        ({"instructions": 3}, "instructions", "string"),
        ({"temperature": 9}, "temperature", None),
    ]
    for extra, param, want in bad:
        status, data = post(port, "/v1/responses", dict({"input": "x", "max_output_tokens": 2}, **extra))
        expect_error(status, data, 400, param=param, contains=want)
    status, data = post(port, "/v1/responses", "{not json")
    expect_error(status, data, 400)
    respond(port, {"input": "still serving", "max_output_tokens": 2})
    print("  store, previous_response_id, %d bad inputs refused" % len(bad))


def check_streamed_n(port):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Once upon a time"}]}),
                       ("/v1/completions", {"prompt": "Once upon a time"})):
        body = dict(body, n=2, max_tokens=12, temperature=1.0, seed=11)
        status, data = post(port, path, body)
        check(status == 200, "%s n=2: %d %r" % (path, status, data[:300]))
        whole = json.loads(data)
        status, events = sse(port, path, dict(body, stream=True, stream_options={"include_usage": True}))
        check(status == 200, "%s stream n=2: %d %r" % (path, status, events))
        check(events[-1][1] is None, "no [DONE]")
        text, finish = {0: "", 1: ""}, {}
        usage = None
        for _, d in events[:-1]:
            if d.get("usage"):
                usage = d["usage"]
            for c in d["choices"]:
                i = c["index"]
                check(i in (0, 1), "index %r" % i)
                text[i] += (c["delta"].get("content") or "") if "delta" in c else c["text"]
                if c.get("finish_reason"):
                    finish[i] = c["finish_reason"]
        for c in whole["choices"]:
            i = c["index"]
            got = c["message"]["content"] if "message" in c else c["text"]
            check(text[i] == got and finish.get(i) == c["finish_reason"], "%s choice %d: streamed %r %r, whole %r %r"
                  % (path, i, text[i], finish.get(i), got, c["finish_reason"]))
        tokens = ("prompt_tokens", "completion_tokens", "total_tokens")  # (cached_tokens grows: the prefix cache)
        check(usage and [usage[k] for k in tokens] == [whole["usage"][k] for k in tokens],
              "%s usage %r vs %r" % (path, usage, whole["usage"]))
    # a client that leaves a streamed n = 4 early: its choices are cancelled, the server goes on
    for path in ("/v1/completions", "/v1/responses"):
        body = {"prompt": "Once", "n": 4, "max_tokens": 1500, "stream": True, "ignore_eos": True}
        if path == "/v1/responses":
            body = {"input": "Once", "max_output_tokens": 1500, "stream": True, "ignore_eos": True}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
        r = conn.getresponse()
        check(r.status == 200 and r.read(200), "%s: %d" % (path, r.status))
        conn.close()
    status, data = post(port, "/v1/completions", {"prompt": "Once", "n": 2, "max_tokens": 4, "stream": True})
    check(status == 200 and data.endswith(b"data: [DONE]\n\n"), "after the disconnects: %d %r" % (status, data[-80:]))
    print("  streamed n = 2 on chat and completions equals the seeded unstreamed answers")


def test_responses():
    d, model = make_model()
    try:
        port = free_port()
        with Cluster(model, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml",
                                        "--api-key", KEY]):
            check_plain(port)
            check_logprobs(port)
            check_tools(port)
            check_store_and_errors(port)
            check_streamed_n(port)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_sdks():
    d, model = make_model()
    try:
        port = free_port()
        with Cluster(model, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml",
                                        "--api-key", KEY]):
            p = subprocess.run(["node", os.path.join(ROOT, "tests", "integration", "sdk_responses.mjs"),
                                "http://127.0.0.1:%d/v1" % port, KEY], capture_output=True, text=True, timeout=400)
            check(p.returncode == 0, "sdk_responses.mjs failed (%d): %s %s" % (p.returncode, p.stdout[-1500:],
                                                                             p.stderr[-1500:]))
            out = json.loads(p.stdout.strip().split("\n")[-1])
            res = out["results"]
            for name, r in sorted(res.items()):
                check(r.get("error") is None, "%s failed: %s" % (name, r.get("error")))
            plain, st = res["plain"], res["stream"]
            check(plain["object"] == "response" and plain["id"].startswith("resp_") and plain["text"],
                  "plain %r" % plain)
            check(st["text"] == plain["text"] and st["seqs"] == list(range(len(st["seqs"]))) and
                  st["types"][0] == "response.created", "stream %r vs %r" % (st, plain["text"]))
            check(res["stream_helper"]["text"] == plain["text"], "stream helper %r" % res["stream_helper"])
            lp = res["logprobs"]
            check(lp["text"] == plain["text"] and len(lp["logprobs"]) == plain["usage"]["output_tokens"] and
                  lp["top_logprobs"] == 2 and all(len(e["top_logprobs"]) == 2 for e in lp["logprobs"]),
                  "SDK logprobs %r" % lp)
            check(lp["streamed"] == lp["done"] and same_logprobs(lp["streamed"], lp["logprobs"]),
                  "SDK streamed logprobs %r" % lp)
            tc = res["tool_call"]
            if tc["status"] == "completed":
                check(len(tc["calls"]) == 1 and tc["calls"][0]["name"] == "get_weather", "tool call %r" % tc)
                validate([(out["schema"], tc["calls"][0]["arguments"])])
                check(tc["after"]["input_tokens"] > tc["input_tokens"] and isinstance(tc["after"]["text"], str),
                      "after the call's output %r" % tc)
                ts = res["tool_call_stream"]
                check(ts["done"] and ts["args"] == ts["done"]["arguments"] == tc["calls"][0]["arguments"],
                      "streamed call %r vs %r" % (ts, tc["calls"]))
            js = res["json_schema"]
            if js["status"] == "completed":
                validate([(out["schema"], js["text"])])
            pr = res["previous"]
            check(pr["second"]["input_tokens"] > pr["solo"]["input_tokens"] + pr["first"]["output_tokens"] and
                  pr["retrieved"] is True, "previous %r" % pr)
            check(res["unknown_previous"]["status"] == 404 and
                  res["unknown_previous"]["param"] == "previous_response_id", "unknown %r" % res["unknown_previous"])
            check(res["ai_sdk"]["text"] == plain["text"] and res["ai_sdk_stream"]["text"] == plain["text"],
                  "AI SDK %r %r vs %r" % (res["ai_sdk"], res["ai_sdk_stream"], plain["text"]))
            check(res["ai_sdk"]["usage"]["outputTokens"] == plain["usage"]["output_tokens"], "AI SDK usage %r" %
                  res["ai_sdk"]["usage"])
            check(res["langchain"]["text"] == plain["text"], "LangChain %r vs %r" % (res["langchain"], plain["text"]))
            for name in ("chat_n2_stream", "completions_n2_stream"):
                r = res[name]
                check(r["indexes"] == [0, 1] and r["streamed"] == r["whole"], "%s: %r" % (name, r))
            print("  SDKs: openai (plain, streamed, helper, tools, json_schema, previous), AI SDK, LangChain")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_router():
    # loom-router serves /v1/responses with the same gateway library (its own store)
    port = free_port()
    with Cluster(STORIES, 1, 1, coord_args=["--api-key", KEY, "--http", "127.0.0.1:%d" % port,
                                            "--chat-template", "chatml"]) as a:
        with Router(["--api-key", KEY, "--replica-api-key", KEY, "--replica", a.addr, "--chat-template", "chatml",
                     "--responses-store", "3"], http=True, expect_up=1) as r:
            body = {"instructions": "Tell a story.", "input": "Once upon a time", "max_output_tokens": 12,
                    "temperature": 0}
            direct, routed = respond(port, body), respond(r.http, body)
            check(message_text(direct) == message_text(routed) and direct["usage"]["output_tokens"] ==
                  routed["usage"]["output_tokens"], "router %r vs coordinator %r" % (routed, direct))
            nxt = respond(r.http, {"input": "Then?", "previous_response_id": routed["id"], "max_output_tokens": 4})
            check(nxt["usage"]["input_tokens"] > routed["usage"]["input_tokens"], "router store %r" % nxt["usage"])
            status, data = post(port, "/v1/responses", {"input": "x", "previous_response_id": routed["id"]})
            expect_error(status, data, 404, param="previous_response_id")  # each process has its own store
            # the store keeps 3: two more responses (and a GET, which counts as a use) evict the oldest
            status, _, _ = request(r.http, "GET", "/v1/responses/" + nxt["id"], key=KEY)
            check(status == 200, "GET %d" % status)
            for _ in range(2):
                respond(r.http, {"input": "x", "max_output_tokens": 2})
            status, _, data = request(r.http, "GET", "/v1/responses/" + routed["id"], key=KEY)
            expect_error(status, data, 404)
            status, _, _ = request(r.http, "GET", "/v1/responses/" + nxt["id"], key=KEY)
            check(status == 200, "the most recently used one was evicted: %d" % status)
            status, events = sse(r.http, "/v1/responses", dict(body, stream=True))
            check(status == 200 and events[-1][1]["type"] in ("response.incomplete", "response.completed"),
                  "router stream %r" % (events[-1:],))
            check("".join(d["delta"] for _, d in events if d["type"] == "response.output_text.delta") ==
                  message_text(direct), "router stream text")
    print("  loom-router: the same answers, its own store (LRU of 3)")


if __name__ == "__main__":
    run_tests([test_responses, test_sdks, test_router])

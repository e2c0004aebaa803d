"""Tool calling on real processes: a generated model with the stories260K
tokenizer and a 2048-token context (the tools' preamble does not fit the
tiny model's 512), the chat template Loom ships as chatml (tools in the
system turn, calls in Hermes's <tool_call> blocks).

- tool_choice "required" and a named function force the call through the
  grammar engine, in the model's own syntax (<tool_call> blocks): every call's arguments validate against the tool's schema
  (tests/reference/validate_json_schema.py), streamed (delta.tool_calls as
  OpenAI sends them: index, id, type, function name and arguments) and not,
  parallel_tool_calls false giving one call; finish_reason tool_calls
  (required) or stop (named), else length; on 1x1 and tp 2.
- tool_choice "auto" and "none" answer as text when the model writes no
  call; assistant tool_calls and tool messages in the history render.
- Bad tools / tool_choice are a 400 naming the field; the server keeps
  serving.
- Streamed tool calls arrive incrementally as OpenAI sends them: a call's
  first delta {index, id, type, function: {name, arguments: ""}}, then
  {index, function: {arguments}} pieces, adding up to the unstreamed
  answer to the same request (same seed), finish_reason included.
- The three SDKs (sdk_tools.mjs): openai tool_choice required / named,
  streamed and not (the SDK's accumulation equals the unstreamed call, and
  the deltas have OpenAI's shape), LangChain bindTools, Vercel generateText
  with toolChoice required."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import PYTHON, ROOT, STORIES, Cluster, check, run_tests  # noqa: E402
from test_http import KEY, expect_error, free_port, post  # noqa: E402
from test_structured import validate  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather?"}]


def make_model():
    d = tempfile.mkdtemp(prefix="loom-tools-")
    model = os.path.join(d, "m")
    subprocess.run([PYTHON, os.path.join(ROOT, "tests", "reference", "gen_model.py"), "--out", model, "--dim", "64",
                    "--hidden-dim", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "512",
                    "--max-pos", "2048", "--seed", "5", "--tokenizer-from", STORIES], check=True, capture_output=True,
                   timeout=120)
    return d, model


def chat(port, body, stream=False):
    """(message-like dict {content, tool_calls}, finish) of one chat request."""
    body = dict({"messages": MSGS, "tools": TOOLS, "max_tokens": 200}, **body)  # (room for the <tool_call> markup)
    if not stream:
        status, data = post(port, "/v1/chat/completions", body, timeout=120)
        check(status == 200, "%r: %d %r" % (body, status, data[:300]))
        ch = json.loads(data)["choices"][0]
        return ch["message"], ch["finish_reason"]
    body["stream"] = True
    status, data = post(port, "/v1/chat/completions", body, timeout=120)
    check(status == 200, "stream %r: %d %r" % (body, status, data[:300]))
    content, calls, finish, deltas = "", {}, None, {}
    for line in data.decode().split("\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for ch in json.loads(line[6:]).get("choices", []):
            d = ch.get("delta", {})
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                check(isinstance(tc.get("index"), int), "a tool_calls delta without index: %r" % tc)
                deltas.setdefault(tc["index"], []).append(tc)
                c = calls.setdefault(tc["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
                if tc.get("id"):
                    c["id"] = tc["id"]
                if tc.get("type"):
                    c["type"] = tc["type"]
                f = tc.get("function") or {}
                c["function"]["name"] += f.get("name") or ""
                c["function"]["arguments"] += f.get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    msg = {"content": content or None, "tool_calls": [calls[k] for k in sorted(calls)] or None,
           "_deltas": [deltas[k] for k in sorted(deltas)]}
    return msg, finish


def check_streamed(streamed, fs, whole, fw):
    """A streamed answer arrived as OpenAI streams tool calls, and adds up to
    the unstreamed answer to the same request (same seed): a call's first
    delta has index, id, type and the name, with arguments "" (or a first
    piece); the later ones only index and an arguments piece; arguments of
    more than a couple of characters come in more than one piece."""
    check(fs == fw, "finish streamed %r, not %r" % (fs, fw))
    if fw == "length":  # cut short: unstreamed it is text, streamed the pieces sent stay (docs/http-api.md)
        return 0
    check(streamed.get("content") == whole.get("content"), "content streamed %r, not %r" % (
        streamed.get("content"), whole.get("content")))
    sc, wc = streamed.get("tool_calls") or [], whole.get("tool_calls") or []
    check(len(sc) == len(wc), "%d calls streamed, %d not" % (len(sc), len(wc)))
    pieces = 0
    for i, (a, b) in enumerate(zip(sc, wc)):
        check(a["function"] == b["function"] and a["type"] == b["type"],
              "call %d streamed %r, not %r" % (i, a["function"], b["function"]))
        ds = streamed["_deltas"][i]
        first = ds[0]
        check(set(first) == {"index", "id", "type", "function"} and first["id"].startswith("call_") and
              first["type"] == "function" and first["function"].get("name") == b["function"]["name"] and
              b["function"]["arguments"].startswith(first["function"].get("arguments", "")),
              "first delta of call %d: %r" % (i, first))
        for d in ds[1:]:
            check(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"},
                  "later delta of call %d: %r" % (i, d))
        if len(b["function"]["arguments"]) > 2:
            check(len(ds) >= 3, "call %d's arguments %r came in %d delta(s)" % (i, b["function"]["arguments"], len(ds)))
        pieces += len(ds) - 1
    return pieces


def check_calls(msg, finish, want_finish, pairs, one=False, name=None):
    if finish == "length":
        return 0
    check(finish == want_finish, "finish %r, expected %r: %r" % (finish, want_finish, msg))
    calls = msg.get("tool_calls") or []
    check(calls, "no tool_calls: %r" % msg)
    check(not one or len(calls) == 1, "parallel_tool_calls false gave %d calls" % len(calls))
    ids = set()
    for c in calls:
        check(c["type"] == "function" and c["id"] and c["id"].startswith("call_"), "call %r" % c)
        ids.add(c["id"])
        fn = c["function"]["name"]
        check(fn in SCHEMAS and (name is None or fn == name), "call of %r" % fn)
        pairs.append((SCHEMAS[fn], c["function"]["arguments"]))
    check(len(ids) == len(calls), "repeated call ids: %r" % calls)
    return 1


def test_forced_calls():
    d, model = make_model()
    try:
        for tp in (1, 2):
            port = free_port()
            with Cluster(model, tp=tp, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml"]):
                pairs, done, total, pieces = [], 0, 0, 0
                for seed in range(3):
                    base = {"temperature": 1.0, "seed": seed}
                    for extra, want, kw in ((dict(tool_choice="required"), "tool_calls", {}),
                                            (dict(tool_choice="required", parallel_tool_calls=False), "tool_calls",
                                             {"one": True}),
                                            (dict(tool_choice={"type": "function", "function": {"name": "get_time"}}),
                                             "stop", {"one": True, "name": "get_time"})):
                        answers = []
                        for stream in (False, True):
                            m, f = chat(port, dict(base, **extra), stream)
                            done += check_calls(m, f, want, pairs, **kw)
                            answers.append((m, f))
                            total += 1
                        (mw, fw), (ms, fs) = answers
                        pieces += check_streamed(ms, fs, mw, fw)
                check(pieces > 0, "no streamed arguments pieces")
                validate(pairs)
                check(done >= total // 2, "tp %d: only %d of %d forced calls finished" % (tp, done, total))
                print("  tp %d: %d of %d forced calls finished, %d argument objects validated, %d streamed pieces" % (
                    tp, done, total, len(pairs), pieces))
                if tp == 1:
                    check_auto_history_bad(port)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def check_auto_history_bad(port):
    # auto and none: text when the model writes no call
    for choice in ("auto", "none"):
        m, f = chat(port, {"tool_choice": choice, "max_tokens": 12, "temperature": 0})
        check(f in ("stop", "length") and isinstance(m.get("content"), str), "%s: %r %r" % (choice, m, f))
    # the history's calls and results render (into the prompt: longer than without them)
    hist = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    status, data = post(port, "/v1/chat/completions", {"messages": hist, "tools": TOOLS, "max_tokens": 8})
    check(status == 200, "history: %d %r" % (status, data[:300]))
    n_hist = json.loads(data)["usage"]["prompt_tokens"]
    status, data = post(port, "/v1/chat/completions", {"messages": MSGS, "tools": TOOLS, "max_tokens": 8})
    check(status == 200 and json.loads(data)["usage"]["prompt_tokens"] + 10 < n_hist, "the history was not rendered")
    bad = [
        ({"tools": "x"}, "tools", "must be an array"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 1}}}}}], "tool_choice": "required"}, None, "unsupported keyword"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
        ({"parallel_tool_calls": 3}, "parallel_tool_calls", "boolean"),
        ({"n": 2}, "n", "n = 1"),
    ]
    for extra, param, want in bad:
        body = dict({"messages": MSGS, "tools": TOOLS, "max_tokens": 8}, **extra)
        status, data = post(port, "/v1/chat/completions", body)
        expect_error(status, data, 400, param=param, contains=want)
    status, data = post(port, "/v1/completions", {"prompt": "a", "tools": TOOLS, "max_tokens": 4})
    expect_error(status, data, 400, param="tools")
    m, f = chat(port, {"tool_choice": "required", "temperature": 0})
    check(f in ("tool_calls", "length"), "after the bad input: %r" % f)


def test_sdks():
    d, model = make_model()
    try:
        port = free_port()
        with Cluster(model, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml",
                                        "--api-key", KEY]):
            p = subprocess.run(["node", os.path.join(ROOT, "tests", "integration", "sdk_tools.mjs"),
                                "http://127.0.0.1:%d/v1" % port, KEY], capture_output=True, text=True, timeout=400)
            check(p.returncode == 0, "sdk_tools.mjs failed (%d): %s %s" % (p.returncode, p.stdout[-1500:],
                                                                         p.stderr[-1500:]))
            out = json.loads(p.stdout.strip().split("\n")[-1])
            pairs, ok = [], []
            for name, r in sorted(out["results"].items()):
                if r.get("finish") == "length":
                    continue
                check(r.get("error") is None, "%s failed: %s" % (name, r.get("error")))
                check(r["calls"], "%s: no calls: %r" % (name, r))
                for c in r["calls"]:
                    check(c["name"] == "get_weather", "%s: call of %r" % (name, c["name"]))
                    pairs.append((out["schema"], c["arguments"]))
                ok.append(name)
            validate(pairs)
            check(len(ok) >= 3, "only %s of the SDK calls finished: %r" % (ok, out))
            res = out["results"]
            for st, whole in (("openai_required_stream", "openai_required"), ("openai_named_stream", "openai_named")):
                r, w = res[st], res[whole]
                if r.get("finish") == "length" or w.get("finish") == "length" or r.get("error"):
                    continue
                # the SDK's accumulation equals the unstreamed answer (temperature 0)
                check(r["calls"] == w["calls"] and r["finish"] == w["finish"], "%s %r differs from %s %r" % (
                    st, r, whole, w))
                ds = r["deltas"]
                check(ds and set(ds[0]) == {"index", "id", "type", "function"} and ds[0]["id"].startswith("call_")
                      and ds[0]["function"]["name"] == "get_weather"
                      and w["calls"][0]["arguments"].startswith(ds[0]["function"].get("arguments", "")),
                      "%s: first delta %r" % (st, ds[:1]))
                later = ds[1:]
                check(len(later) >= 2 and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                                              for d in later), "%s: later deltas %r" % (st, later[:4]))
                print("  %s: %d argument deltas add up to the unstreamed call" % (st, len(later)))
            print("  SDK tool calls validated: %s" % ", ".join(ok))
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    run_tests([test_forced_calls, test_sdks])

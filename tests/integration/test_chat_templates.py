"""Chat templates, tool-call syntaxes and reasoning on real processes: a
generated model with the stories260K tokenizer (2048-token context) whose
tokenizer_config.json carries a real model's chat template
(../shared/chat_templates, next to the models directory).

- The rendered prompt equals the reference: /tokenize with messages (and
  tools, chat_template_kwargs) gives the ids of the python3-jinja2 render
  (set up as transformers' apply_chat_template) tokenized as a plain prompt,
  for Llama 3.1 (with tools), Qwen3 (enable_thinking false), Mistral v0.3
  (with tools and a tool round trip) and Hermes 3 (its tool_use template
  when tools are given). BOS comes once, from the template. Special-token
  text in message content stays plain text.
- Forced tool calls (tool_choice required / named) come out in the model's
  own syntax (Hermes: <tool_call> blocks; Mistral: [TOOL_CALLS][...];
  DeepSeek V3: its marked blocks; Llama 3.1: {"name", "parameters"}; each
  detected from its template), the
  grammar holding them to the tool's schema, and parse back into
  tool_calls, streamed and not; a tool-result turn renders and answers.
- --reasoning-parser splits reasoning_content off, streamed and not (qwen3,
  forced with a regex guide so the tiny model writes <think>...</think>);
  with deepseek_r1 (whose template opens <think>) a json_object guide
  leaves the reasoning free: it holds only after </think>; /v1/responses
  answers with a reasoning item, streamed too (response.reasoning_text.*
  events, through the OpenAI Node SDK as well) with its reasoning_tokens;
  n = 2 splits each choice, streamed and not.
- GPT-OSS (harmony): the openai tool-call parser detected from the
  template; forced calls as commentary messages to functions.NAME.
- Forced calls in the pythonic, llama4_pythonic and qwen3_coder syntaxes
  parse back; with [TOOL_CALLS] a special token of the tokenizer, a forced
  call's first token is that token (not the marker spelled), which the
  parser still sees.
- A marked syntax streams incrementally (DeepSeek V3 through the OpenAI
  Node SDK): the call's name delta well before the end, the arguments in
  pieces adding up to the unstreamed call of the same seed.
- Bad input: a template with a syntax error refuses start-up naming
  file:line:col; an endless loop or a huge string is bounded (400);
  chat_template_kwargs not an object (400); raise_exception's message
  (400); a request's own chat_template without
  --trust-request-chat-template (400); an unknown --tool-call-parser or
  --reasoning-parser refuses start-up listing the names."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import MODELS, PYTHON, ROOT, STORIES, Cluster, check, gen_model, run_tests, wait_for  # noqa: E402
from test_http import KEY, Coordinator, expect_error, free_port, post  # noqa: E402
from test_responses import sse  # noqa: E402

TEMPLATES = os.path.join(os.path.dirname(MODELS), "chat_templates")
WORK = tempfile.mkdtemp(prefix="loom-it-chat-")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}]
REF = r'''
import json, sys, datetime
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.ext import loopcontrols

def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)

def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda f: datetime.datetime.now().strftime(f)
job = json.load(sys.stdin)
sys.stdout.write(env.from_string(job["template"]).render(**job["vars"]))
'''


def index():
    with open(os.path.join(TEMPLATES, "index.json")) as f:
        return {e["name"]: e for e in json.load(f)}


def template_texts(entry):
    """{name or None: text} of a model's template files."""
    out = {}
    for f in entry["files"]:
        with open(os.path.join(TEMPLATES, f["file"])) as fh:
            out[f["name"]] = fh.read()
    return out


def base_model():
    return gen_model(os.path.join(WORK, "base"), "--dim", "64", "--hidden-dim", "128", "--layers", "2", "--heads",
                     "4", "--kv-heads", "2", "--vocab", "512", "--max-pos", "2048", "--seed", "5")


MISTRAL_SPECIAL = ["[TOOL_CALLS]"]
HARMONY_SPECIAL = ["<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>"]
ADDED = ["<tool_call>", "</tool_call>"]  # added tokens that are not special (Qwen's, Hermes')


def special_marker_model(tag, specials):
    """The base model with stories260K's tokenizer plus these special tokens
    (ids 512, 513, ...), as Mistral v0.3's tokenizer has [TOOL_CALLS] and
    GPT-OSS's the harmony markers."""
    tok_dir = os.path.join(WORK, "tok-" + tag)
    if not os.path.isdir(tok_dir):
        os.makedirs(tok_dir)
        shutil.copyfile(os.path.join(STORIES, "tokenizer_config.json"), os.path.join(tok_dir, "tokenizer_config.json"))
        with open(os.path.join(STORIES, "tokenizer.json")) as f:
            tok = json.load(f)
        for i, text in enumerate(specials):
            tok["added_tokens"].append({"id": 512 + i, "content": text, "single_word": False, "lstrip": False,
                                        "rstrip": False, "normalized": False, "special": text not in ADDED})
        with open(os.path.join(tok_dir, "tokenizer.json"), "w") as f:
            json.dump(tok, f)
    return gen_model(os.path.join(WORK, "base-" + tag), "--tokenizer-from", tok_dir, "--dim", "64", "--hidden-dim",
                     "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "520", "--max-pos", "2048",
                     "--seed", "5")


def first_token_is(port, text, n=2):
    """A forced call cut to one token: that token's text is the marker, so
    it is the special token (stories260K has no ordinary token for it)."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}})[:n]:
        body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
                "tool_choice": choice, "max_tokens": 1, "temperature": 0.8, "seed": 11}
        status, data = post(port, "/v1/chat/completions", body, key=None, timeout=120)
        check(status == 200, "%d %r" % (status, data[:300]))
        r = json.loads(data)
        m = r["choices"][0]["message"]
        check(r["usage"]["completion_tokens"] == 1 and m.get("content") == text and
              r["choices"][0]["finish_reason"] == "length", "the first token is not %s: %r" % (text, r))


def model_with(name, template=None, base=None):
    """A model directory whose tokenizer_config.json carries the template of
    index entry NAME (or the given template text) and its special tokens."""
    base = base or base_model()
    d = os.path.join(WORK, "m-" + (name or "custom") + "-%d" % len(os.listdir(WORK)))
    os.makedirs(d)
    for f in os.listdir(base):
        if f != "tokenizer_config.json":
            os.symlink(os.path.join(base, f), os.path.join(d, f))
    with open(os.path.join(base, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    if name:
        e = index()[name]
        texts = template_texts(e)
        cfg["chat_template"] = texts[None] if None in texts else [
            {"name": k, "template": v} for k, v in texts.items()]
        cfg["bos_token"], cfg["eos_token"] = e["bos"], e["eos"]
    else:
        cfg["chat_template"] = template
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def ref_render(name, body):
    """The reference render of a chat request with model NAME's template."""
    e = index()[name]
    texts = template_texts(e)
    tmpl = texts.get(None) or (texts.get("tool_use") if body.get("tools") else None) or texts.get("default")
    msgs = json.loads(json.dumps(body["messages"]))
    for m in msgs:  # as vLLM: no content is "", the arguments' JSON string parsed for the template
        if m.get("content") is None:
            m["content"] = ""
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    v = {"messages": msgs, "tools": body.get("tools"), "add_generation_prompt": body.get("add_generation_prompt", True),
         "continue_final_message": False, "bos_token": e["bos"] or "", "eos_token": e["eos"] or "",
         "unk_token": "<unk>", "pad_token": ""}
    v.update(body.get("chat_template_kwargs") or {})
    p = subprocess.run([PYTHON, "-c", REF], input=json.dumps({"template": tmpl, "vars": v}), capture_output=True,
                       text=True, timeout=60)
    check(p.returncode == 0, "reference render failed: %s" % p.stderr[-800:])
    return p.stdout


def tokenize(port, body):
    status, data = post(port, "/tokenize", body, key=None)
    check(status == 200, "/tokenize %r: %d %r" % (list(body), status, data[:400]))
    return json.loads(data)["tokens"]


HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call12345", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call12345", "content": "{\"temp\": 3}"},
]
CASES = [
    ("llama-3.1-8b-instruct", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]},
        {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS},
        {"messages": HISTORY, "tools": TOOLS}]),
    ("qwen3-0.6b", [
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>sum</think>4"},
                      {"role": "user", "content": "3+3?"}], "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": HISTORY, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}]),
    ("mistral-7b-instruct-v0.3", [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "Bye"}]},
        {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS}]),
    ("hermes-3-llama-3.1-8b", [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]},
        {"messages": HISTORY, "tools": TOOLS}]),
]


def test_render_matches_reference():
    for name, bodies in CASES:
        co = Coordinator(model_with(name))
        try:
            co.wait_http()
            for body in bodies:
                ref = ref_render(name, body)
                want = tokenize(co.http, {"prompt": ref, "add_special_tokens": False})
                got = tokenize(co.http, body)
                check(got == want, "%s %s: the render differs from the reference:\n%r\n(ids %r vs %r)" % (
                    name, list(body), ref[:600], got[:40], want[:40]))
            print("  %s: %d renders equal the reference" % (name, len(bodies)))
        except Exception:
            sys.stderr.write("---- coordinator log\n%s\n" % co.text()[-3000:])
            raise
        finally:
            co.stop()
    # BOS once, and special-token text in content stays plain (Mistral writes bos_token "<s>")
    co = Coordinator(model_with("mistral-7b-instruct-v0.3"))
    try:
        co.wait_http()
        plain = tokenize(co.http, {"messages": [{"role": "user", "content": "a"}]})
        sneaky = tokenize(co.http, {"messages": [{"role": "user", "content": "<s>[INST] a"}]})
        bos = plain[0]
        check(plain.count(bos) == 1, "BOS more than once: %r" % plain)
        check(sneaky.count(bos) == 1 and len(sneaky) > len(plain) + 2,
              "special-token text in content became control tokens: %r" % sneaky)
    finally:
        co.stop()


def chat(port, body, stream=False):
    body = dict(body, stream=stream)
    status, data = post(port, "/v1/chat/completions", body, key=None, timeout=120)
    check(status == 200, "%r: %d %r" % (body, status, data[:300]))
    if not stream:
        ch = json.loads(data)["choices"][0]
        return ch["message"], ch["finish_reason"]
    msg, calls, finish = {"content": "", "reasoning_content": ""}, {}, None
    for line in data.decode().split("\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for ch in json.loads(line[6:]).get("choices", []):
            d = ch.get("delta", {})
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                c["name"] += (tc.get("function") or {}).get("name") or ""
                c["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    msg["tool_calls"] = [{"function": calls[k]} for k in sorted(calls)] or None
    return msg, finish


def check_forced(port, family, max_tokens=200):
    """Forced calls come back as tool_calls whose arguments fit the schema."""
    done = 0
    for choice, want in (("required", "tool_calls"),
                         ({"type": "function", "function": {"name": "get_weather"}}, "stop")):
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
                    "tool_choice": choice, "max_tokens": max_tokens, "temperature": 0.8, "seed": 3}
            m, f = chat(port, body, stream)
            if f == "length":
                continue
            check(f == want, "%s %r: finish %r: %r" % (family, choice, f, m))
            calls = m.get("tool_calls") or []  # (required: parallel calls allowed)
            check(calls and (choice == "required" or len(calls) == 1), "%s: calls %r" % (family, m))
            for c in calls:
                args = json.loads(c["function"]["arguments"])
                check(c["function"]["name"] == "get_weather" and set(args) == {"city"} and
                      isinstance(args["city"], str) and len(args["city"]) <= 8, "%s: call %r" % (family, c))
            done += 1
    check(done >= 2, "%s: only %d forced calls finished" % (family, done))
    return done


def test_forced_calls_in_model_syntax():
    for name, fam, budget in (("hermes-3-llama-3.1-8b", "hermes", 200), ("mistral-7b-instruct-v0.3", "mistral", 200),
                              ("deepseek-v3", "deepseek_v3", 500), ("llama-3.1-8b-instruct", "llama3_json", 200)):
        port = free_port()
        with Cluster(model_with(name), coord_args=["--http", "127.0.0.1:%d" % port]) as c:
            wait_for(lambda: fam in c.log("coordinator"), 10, "the parser in the log")
            check("tool calls: %s," % fam in c.log("coordinator"), "parser not detected: %s" %
                  c.log("coordinator")[-600:])
            n = check_forced(port, fam, budget)
            # the round trip: the call and its result rendered into the next turn
            body = {"messages": HISTORY, "tools": TOOLS, "max_tokens": 8, "temperature": 0}
            m, f = chat(port, body)
            check(f in ("stop", "length") and isinstance(m.get("content"), str), "round trip: %r %r" % (m, f))
            print("  %s: %d forced calls in the model's syntax parsed back; a tool-result turn answered" % (fam, n))


def test_forced_pythonic_and_coder():
    """tool_choice required / named with the pythonic, llama4_pythonic and
    qwen3_coder parsers: the grammar writes the syntax's own calls (Python
    literals; typed <parameter=...> blocks) and they parse back."""
    for name, fam in (("hermes-3-llama-3.1-8b", "pythonic"), ("hermes-3-llama-3.1-8b", "llama4_pythonic"),
                      ("qwen3-0.6b", "qwen3_coder")):
        port = free_port()
        with Cluster(model_with(name), coord_args=["--http", "127.0.0.1:%d" % port, "--tool-call-parser", fam]) as c:
            wait_for(lambda: "tool calls: %s," % fam in c.log("coordinator"), 10, "the parser in the log")
            n = check_forced(port, fam)
            print("  %s: %d forced calls in its syntax parsed back" % (fam, n))


def test_special_token_marker():
    """A tokenizer with [TOOL_CALLS] as a special token: a forced call's first
    token is that token (one token whose text is the marker: stories260K has
    no ordinary token for it), not the marker spelled with ordinary tokens;
    the marker reaches the parser though special tokens are skipped, so the
    calls parse back, streamed and not. The same for Hermes' <tool_call> as
    an added (not special) token and GPT-OSS's harmony markers."""
    port = free_port()
    model = model_with("mistral-7b-instruct-v0.3", base=special_marker_model("mistral", MISTRAL_SPECIAL))
    with Cluster(model, coord_args=["--http", "127.0.0.1:%d" % port]) as c:
        wait_for(lambda: "tool calls: mistral," in c.log("coordinator"), 10, "the parser in the log")
        status, data = post(port, "/detokenize", {"tokens": [512]}, key=None)
        check(status == 200 and json.loads(data)["prompt"] == "[TOOL_CALLS]", "detokenize 512: %r" % data[:200])
        first_token_is(port, "[TOOL_CALLS]")
        # a plain request still leaves special tokens out of the text
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
                "allowed_token_ids": [512]}
        status, data = post(port, "/v1/chat/completions", body, key=None, timeout=120)
        check(status == 200 and json.loads(data)["choices"][0]["message"]["content"] == "",
              "special tokens in plain text: %r" % data[:300])
        n = check_forced(port, "mistral")
        print("  [TOOL_CALLS] as a special token: forced calls start with its id (1 token), "
              "%d parsed back" % n)
    # Hermes: <tool_call> an added token that is not special: one token too
    port = free_port()
    with Cluster(model_with("hermes-3-llama-3.1-8b", base=special_marker_model("hermes", ADDED)),
                 coord_args=["--http", "127.0.0.1:%d" % port]) as c:
        wait_for(lambda: "tool calls: hermes," in c.log("coordinator"), 10, "the parser in the log")
        first_token_is(port, "<tool_call>")
        n = check_forced(port, "hermes")
        print("  <tool_call> as an added token: forced calls start with its id, %d parsed back" % n)
    # GPT-OSS: the harmony markers as special tokens, with and without the
    # openai reasoning parser (which reads them from the text too)
    model = model_with("gpt-oss-120b", base=special_marker_model("harmony", HARMONY_SPECIAL))
    for reasoning in ([], ["--reasoning-parser", "openai"]):
        port = free_port()
        with Cluster(model, coord_args=["--http", "127.0.0.1:%d" % port] + reasoning) as c:
            wait_for(lambda: "tool calls: openai," in c.log("coordinator"), 10, "the parser in the log")
            if not reasoning:
                first_token_is(port, "<|channel|>", 1)
            else:
                # no tools: the reasoning parser's own markers stay in the text it reads (the
                # parser takes a whole analysis header out; a lone one stays as content)
                channel = 512 + HARMONY_SPECIAL.index("<|channel|>")
                body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
                        "logit_bias": {str(channel): 100}}
                status, data = post(port, "/v1/chat/completions", body, key=None, timeout=120)
                check(status == 200, "%d %r" % (status, data[:300]))
                m = json.loads(data)["choices"][0]["message"]
                check(m.get("content") == "<|channel|><|channel|>", "harmony markers dropped: %r" % m)
            n = check_forced(port, "openai")
            print("  harmony markers as special tokens%s: %d forced calls parsed back" % (
                " (reasoning parser openai)" if reasoning else "", n))


def test_reasoning_parser():
    port = free_port()
    model = model_with("qwen3-0.6b")
    with Cluster(model, coord_args=["--http", "127.0.0.1:%d" % port, "--reasoning-parser", "qwen3"]):
        # enable_thinking false: the template closed the reasoning, the guide holds from the start and
        # makes the tiny model write a think block anyway, which the parser splits off
        body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 60, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False},
                "structured_outputs": {"regex": "<think>[a-z ]{1,12}</think>[a-z ]{1,10}"}}
        whole, f = chat(port, body)
        check(f == "stop", "finish %r: %r" % (f, whole))
        check(whole["reasoning_content"] and "<think>" not in whole["content"] and
              "think>" not in whole["reasoning_content"], "not split: %r" % whole)
        streamed, fs = chat(port, body, stream=True)
        check(streamed["reasoning_content"] == whole["reasoning_content"] and
              streamed["content"] == whole["content"], "streamed %r, not %r" % (streamed, whole))
        print("  qwen3: reasoning %r, content %r" % (whole["reasoning_content"], whole["content"]))
    # DeepSeek R1's template opens <think>: a guide holds only after </think>, so the reasoning is free text
    port = free_port()
    with Cluster(model_with("deepseek-r1"), coord_args=["--http", "127.0.0.1:%d" % port, "--reasoning-parser",
                                                        "deepseek_r1"]):
        free = 0
        for seed in range(4):
            body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 16, "temperature": 1.0,
                    "seed": seed, "response_format": {"type": "json_object"}}
            m, f = chat(port, body)
            r = m.get("reasoning_content") or ""
            check(f == "length" and r and not m.get("content"), "deepseek_r1: %r %r" % (m, f))
            free += not r.lstrip().startswith("{")
            s, fs = chat(port, body, stream=True)
            check(s["reasoning_content"] == r and fs == f, "streamed %r, not %r" % (s, m))
        check(free > 0, "the reasoning was held to the JSON grammar")
        # the Responses API splits it too: a reasoning item ahead of the message
        status, data = post(port, "/v1/responses", {"input": "2+2?", "max_output_tokens": 16, "temperature": 0},
                            key=None)
        check(status == 200, "/v1/responses: %d %r" % (status, data[:300]))
        out = json.loads(data)["output"]
        check(out and out[0]["type"] == "reasoning" and out[0]["content"][0]["text"], "responses output %r" % out)
        u = json.loads(data)["usage"]
        check(u["output_tokens_details"]["reasoning_tokens"] == u["output_tokens"], "reasoning tokens %r" % u)
        check_responses_stream(port, out[0]["content"][0]["text"], u)
        check_reasoning_n2(port)
        print("  deepseek_r1: %d of 4 reasoning texts free of the json_object guide" % free)


def check_responses_stream(port, reasoning, usage):
    """A streamed /v1/responses answer of a reasoning model: a reasoning item
    whose reasoning_text deltas add up to the unstreamed reasoning, then the
    (empty) message; the same through the OpenAI Node SDK."""
    body = {"input": "2+2?", "max_output_tokens": 16, "temperature": 0, "stream": True}
    status, events = sse(port, "/v1/responses", body)
    check(status == 200, "stream: %d %r" % (status, events))
    types = [d["type"] for _, d in events]
    check(types[2:4] == ["response.output_item.added", "response.content_part.added"] and
          events[2][1]["item"]["type"] == "reasoning" and events[3][1]["part"]["type"] == "reasoning_text",
          "first events %r" % events[:4])
    deltas = "".join(d["delta"] for _, d in events if d["type"] == "response.reasoning_text.delta")
    done = [d for _, d in events if d["type"] == "response.reasoning_text.done"]
    check(deltas == reasoning and len(done) == 1 and done[0]["text"] == reasoning, "streamed reasoning %r vs %r" % (
        deltas, reasoning))
    final = events[-1][1]["response"]
    check([o["type"] for o in final["output"]] == ["reasoning", "message"] and
          final["output"][0]["content"][0]["text"] == reasoning and
          final["usage"]["output_tokens_details"]["reasoning_tokens"] == usage["output_tokens"], "final %r" % final)
    p = subprocess.run(["node", os.path.join(ROOT, "tests", "integration", "sdk_reasoning.mjs"),
                        "http://127.0.0.1:%d/v1" % port], capture_output=True, text=True, timeout=120)
    check(p.returncode == 0, "sdk_reasoning.mjs failed (%d): %s %s" % (p.returncode, p.stdout[-800:], p.stderr[-800:]))
    r = json.loads(p.stdout.strip().split("\n")[-1])
    check(r["deltas"] == reasoning == r["done"] and r["item"]["content"][0]["text"] == reasoning and
          r["usage"]["output_tokens_details"]["reasoning_tokens"] == usage["output_tokens"], "SDK %r" % r)
    print("  /v1/responses streamed: %d reasoning deltas (also through the OpenAI SDK)" %
          types.count("response.reasoning_text.delta"))


def check_reasoning_n2(port):
    """n = 2: each choice's reasoning split off, streamed and not alike."""
    body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2}
    status, data = post(port, "/v1/chat/completions", body, key=None, timeout=120)
    check(status == 200, "n=2: %d %r" % (status, data[:300]))
    whole = {c["index"]: c["message"] for c in json.loads(data)["choices"]}
    check(sorted(whole) == [0, 1] and all(m["reasoning_content"] and not m["content"] for m in whole.values()),
          "n=2 %r" % whole)
    status, data = post(port, "/v1/chat/completions", dict(body, stream=True), key=None, timeout=120)
    check(status == 200, "n=2 streamed: %d" % status)
    got = {}
    for line in data.decode().split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            for ch in json.loads(line[6:]).get("choices", []):
                g = got.setdefault(ch["index"], {"reasoning_content": "", "content": ""})
                for k in g:
                    g[k] += ch.get("delta", {}).get(k) or ""
    check(all(got[i]["reasoning_content"] == whole[i]["reasoning_content"] and not got[i]["content"] for i in (0, 1)),
          "n=2 streamed %r vs %r" % (got, whole))
    print("  n = 2: each choice's reasoning split, streamed and not")


def test_harmony():
    """GPT-OSS's harmony format: the openai tool-call parser detected from the
    template, forced calls written as commentary messages to functions.NAME
    and parsed back, with the openai reasoning parser on."""
    port = free_port()
    with Cluster(model_with("gpt-oss-120b"), coord_args=["--http", "127.0.0.1:%d" % port, "--reasoning-parser",
                                                         "openai"]) as c:
        wait_for(lambda: "tool calls: openai," in c.log("coordinator"), 10, "the openai parser in the log")
        n = check_forced(port, "openai")
        print("  openai (harmony): %d forced calls as commentary messages parsed back" % n)


def test_bad_input():
    # a syntax error refuses start-up, naming where
    co = Coordinator(model_with(None, "{% for m in messages %}\n{{ m.content }"))
    try:
        rc = co.proc.wait(timeout=20)
        check(rc != 0 and "tokenizer_config.json:2:" in co.text(), "syntax error: rc %d %s" % (rc, co.text()[-600:]))
    finally:
        co.stop()
    for flag, names in (("--tool-call-parser", "hermes, llama3_json, mistral"),
                        ("--reasoning-parser", "deepseek_r1, qwen3")):
        co = Coordinator(model_with("hermes-3-llama-3.1-8b"), [flag, "nonesuch"])
        try:
            rc = co.proc.wait(timeout=20)
            check(rc != 0 and "nonesuch" in co.text() and names in co.text(), "%s: rc %d %s" % (
                flag, rc, co.text()[-600:]))
        finally:
            co.stop()
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    co = Coordinator(model_with(None, "{% if messages[0].content == 'loop' %}" + loop + "{% endif %}"
                                "{% if messages[0].content == 'boom' %}{{ raise_exception('Boom: ' + messages[0].role) }}"
                                "{% endif %}{% if messages[0].content == 'big' %}{% set s = namespace(t='x') %}"
                                "{% for i in range(64) %}{% set s.t = s.t + s.t %}{% endfor %}{{ s.t }}{% endif %}"
                                "{{ messages[0].content }}"))
    try:
        co.wait_http()
        for content, want in (("loop", "limit"), ("big", "limit"), ("boom", "Boom: user")):
            status, data = post(co.http, "/tokenize", {"messages": [{"role": "user", "content": content}]}, key=None)
            expect_error(status, data, 400, contains=want)
        for extra, param in (({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                             ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                             ({"chat_template": "{{ 1 }}"}, "chat_template")):
            body = dict({"messages": [{"role": "user", "content": "hi"}]}, **extra)
            status, data = post(co.http, "/tokenize", body, key=None)
            expect_error(status, data, 400, param=param)
        check(tokenize(co.http, {"messages": [{"role": "user", "content": "hi"}]}), "served after the bad input")
    except Exception:
        sys.stderr.write("---- coordinator log\n%s\n" % co.text()[-3000:])
        raise
    finally:
        co.stop()


def test_sdks():
    port = free_port()
    with Cluster(model_with("hermes-3-llama-3.1-8b"),
                 coord_args=["--http", "127.0.0.1:%d" % port, "--api-key", KEY, "--tool-call-parser", "hermes",
                             "--enable-auto-tool-choice"]):
        p = subprocess.run(["node", os.path.join(ROOT, "tests", "integration", "sdk_chat_templates.mjs"),
                            "http://127.0.0.1:%d/v1" % port, KEY], capture_output=True, text=True, timeout=400)
        check(p.returncode == 0, "sdk_chat_templates.mjs failed (%d): %s %s" % (
            p.returncode, p.stdout[-1500:], p.stderr[-1500:]))
        print("  " + p.stdout.strip().split("\n")[-1][:300])


def test_sdk_tool_stream():
    """A marked syntax streams incrementally: DeepSeek V3's forced call through
    the OpenAI Node SDK, its name delta early, its arguments in pieces that
    add up to the unstreamed arguments (sdk_tool_stream.mjs)."""
    port = free_port()
    with Cluster(model_with("deepseek-v3"), coord_args=["--http", "127.0.0.1:%d" % port, "--api-key", KEY]) as c:
        wait_for(lambda: "tool calls: deepseek_v3," in c.log("coordinator"), 10, "the parser in the log")
        p = subprocess.run(["node", os.path.join(ROOT, "tests", "integration", "sdk_tool_stream.mjs"),
                            "http://127.0.0.1:%d/v1" % port, KEY], capture_output=True, text=True, timeout=400)
        check(p.returncode == 0, "sdk_tool_stream.mjs failed (%d): %s %s" % (
            p.returncode, p.stdout[-1500:], p.stderr[-1500:]))
        print("  deepseek_v3 streamed: " + p.stdout.strip().split("\n")[-1][:300])


if __name__ == "__main__":
    try:
        run_tests([test_bad_input, test_render_matches_reference, test_forced_calls_in_model_syntax,
                   test_forced_pythonic_and_coder, test_special_token_marker, test_reasoning_parser, test_harmony, test_sdks,
                   test_sdk_tool_stream])
    finally:
        shutil.rmtree(WORK, ignore_errors=True)

"""Constrained decoding on real processes (stories260K).

- Over HTTP, on /v1/completions and /v1/chat/completions, streamed and not:
  response_format json_object / json_schema, guided_json, guided_regex,
  guided_choice, guided_grammar and structured_outputs. Every output that
  finishes with "stop" parses and validates (JSON Schema through
  tests/reference/validate_json_schema.py with Debian's python3-jsonschema;
  regexes with Python's re; choices by membership); the only other finish
  is "length".
- Property: 50 generated schemas x seeds on a tp-2 grid, every finished
  output valid, most of them finished.
- A batch mix of constrained and free requests running at once: the free
  ones give exactly their text when run alone.
- Bad specs (not JSON, an unsupported keyword, a $ref cycle, an
  unsatisfiable schema, a grammar syntax error, two specs at once, an
  unknown response_format type) are a 400 naming the problem, and the server
  keeps serving.
- The official SDKs' own structured-output calls (sdk_structured.mjs):
  openai response_format json_schema, LangChain withStructuredOutput,
  Vercel generateObject / streamObject; results validated the same way."""
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import PYTHON, ROOT, STORIES, Cluster, check, run_tests  # noqa: E402
from test_http import KEY, expect_error, free_port, post, request  # noqa: E402

VALIDATOR = os.path.join(ROOT, "tests", "reference", "validate_json_schema.py")
NODE_MODULES = os.path.join(ROOT, "tests", "reference", "node_modules")
PROMPT = "Once upon a time"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer"},
                                           "pet": {"enum": ["cat", "dog", "bird"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
GRAMMAR = 'root ::= "The " animal " is " color "."\nanimal ::= "cat" | "dog"\ncolor ::= "red" | "blue" | "green"'
REGEX = "[a-z]{2,8}-[0-9]{2}"


def validate(pairs):
    """pairs: [(schema, output)]; every output parses and validates."""
    if not pairs:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for schema, out in pairs:
            f.write(json.dumps({"schema": schema, "output": out}) + "\n")
        name = f.name
    try:
        p = subprocess.run([PYTHON, VALIDATOR, name], capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, "invalid outputs: %s %s" % (p.stdout[-1500:], p.stderr[-500:]))
    finally:
        os.unlink(name)


def gen(port, body, chat=False, stream=False):
    """(text, finish_reason) of one request, streamed or not."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = dict(body)
    if chat:
        body.setdefault("messages", [{"role": "user", "content": "Tell me a story."}])
    else:
        body.setdefault("prompt", PROMPT)
    if not stream:
        status, data = post(port, path, body, timeout=120)
        check(status == 200, "%s %r: %d %r" % (path, body, status, data[:300]))
        ch = json.loads(data)["choices"][0]
        return (ch["message"]["content"] if chat else ch["text"]), ch["finish_reason"]
    body["stream"] = True
    status, data = post(port, path, body, timeout=120)
    check(status == 200, "%s stream %r: %d %r" % (path, body, status, data[:300]))
    text, finish = "", None
    for line in data.decode().split("\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for ch in json.loads(line[6:]).get("choices", []):
            text += (ch.get("delta", {}).get("content") or "") if chat else (ch.get("text") or "")
            finish = ch.get("finish_reason") or finish
    return text, finish


def test_http_specs():
    port = free_port()
    with Cluster(STORIES, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml"]):
        json_pairs, finished, total = [], 0, 0
        for chat in (False, True):
            for stream in (False, True):
                for seed in (1, 2):
                    base = {"max_tokens": 120, "temperature": 0.8, "seed": seed}
                    cases = [
                        ("schema", PERSON, dict(base, guided_json=PERSON)),
                        ("schema", PERSON, dict(base, response_format={
                            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                   "strict": True}})),
                        ("schema", PERSON, dict(base, structured_outputs={"json": json.dumps(PERSON)})),
                        ("object", {"type": "object"}, dict(base, response_format={"type": "json_object"})),
                        ("regex", REGEX, dict(base, guided_regex=REGEX)),
                        ("regex", REGEX, dict(base, structured_outputs={"regex": REGEX})),
                        ("choice", ["yes", "no", "maybe"], dict(base, guided_choice=["yes", "no", "maybe"])),
                        ("grammar", None, dict(base, guided_grammar=GRAMMAR)),
                    ]
                    for kind, spec, body in cases:
                        text, finish = gen(port, body, chat, stream)
                        total += 1
                        check(finish in ("stop", "length"), "%s: finish %r" % (kind, finish))
                        if finish != "stop":
                            continue
                        finished += 1
                        if kind in ("schema", "object"):
                            json_pairs.append((spec, text))
                        elif kind == "regex":
                            check(re.fullmatch(spec, text), "regex %r: %r" % (spec, text))
                        elif kind == "choice":
                            check(text in spec, "choice: %r" % text)
                        else:
                            check(re.fullmatch(r"The (cat|dog) is (red|blue|green)\.", text), "grammar: %r" % text)
        validate(json_pairs)
        check(finished >= total * 3 // 4, "only %d of %d constrained outputs finished" % (finished, total))
        print("  %d of %d finished, %d JSON documents validated" % (finished, total, len(json_pairs)))

        # bad specs: 400 naming the problem; the server keeps serving
        bad = [
            ({"guided_json": "{not json"}, "not valid JSON"),
            ({"guided_json": {"type": "integer", "minimum": 3}}, "unsupported keyword 'minimum'"),
            ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, "no finite output"),
            ({"guided_json": {"type": "array", "minItems": 3, "maxItems": 1}}, "unsatisfiable"),
            ({"guided_grammar": 'root ::= "a'}, "grammar syntax error"),
            ({"guided_grammar": "root ::= foo"}, "undefined rule 'foo'"),
            ({"guided_regex": "(?=a)b"}, "lookaround"),
            ({"guided_choice": "yes"}, "non-empty array of strings"),
            ({"guided_regex": "a", "guided_choice": ["a"]}, "only one of"),
            ({"response_format": {"type": "xml"}}, "response_format type 'xml'"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
            ({"structured_outputs": {"json": PERSON, "regex": "a"}}, "only one of"),
            ({"structured_outputs": {"foo": 1}}, "structured_outputs.foo"),
        ]
        for chat in (False, True):
            for extra, want in bad:
                body = dict({"max_tokens": 8}, **extra)
                if chat:
                    body["messages"] = [{"role": "user", "content": "hi"}]
                else:
                    body["prompt"] = PROMPT
                status, data = post(port, "/v1/chat/completions" if chat else "/v1/completions", body)
                expect_error(status, data, 400, contains=want)
        text, finish = gen(port, {"max_tokens": 8, "temperature": 0})
        check(text and finish == "length", "after the bad specs: %r %r" % (text, finish))


def random_schema(rng, depth=0):
    """A schema whose documents a 260K-parameter model can finish: bounded
    strings and arrays, enums, numbers, nesting, optional properties, anyOf."""
    kinds = ["string", "integer", "number", "boolean", "enum", "null", "const"]
    if depth < 2:
        kinds += ["object", "array", "anyOf"]
    k = rng.choice(kinds)
    if k == "string":
        s = {"type": "string", "maxLength": rng.randint(1, 8)}
        if rng.random() < 0.3:
            s["minLength"] = 1
        if rng.random() < 0.2:
            s = {"type": "string", "format": rng.choice(["date", "uuid", "email"])}
        return s
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, True, None], rng.randint(1, 3))}
    if k == "const":
        return {"const": rng.choice(["x", 7, False])}
    if k == "object":
        props = {"p%d" % i: random_schema(rng, depth + 1) for i in range(rng.randint(1, 3))}
        req = [n for n in props if rng.random() < 0.6]
        return {"type": "object", "properties": props, "required": req, "additionalProperties": False}
    if k == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if k == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), {"type": "null"}]}
    return {"type": k}


def test_property_tp2_and_mix():
    port = free_port()
    with Cluster(STORIES, tp=2, pp=1, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml"]):
        rng = random.Random(16)
        pairs, finished = [], 0
        n = 50
        for i in range(n):
            schema = random_schema(rng)
            text, finish = gen(port, {"max_tokens": 160, "temperature": 1.0, "seed": i, "guided_json": schema},
                               chat=i % 2 == 1)
            check(finish in ("stop", "length"), "schema %d: finish %r" % (i, finish))
            if finish == "stop":
                finished += 1
                pairs.append((schema, text))
        validate(pairs)
        check(finished >= n * 7 // 10, "only %d of %d generated schemas finished" % (finished, n))
        print("  property: %d of %d finished and validated" % (finished, n))

        # a batch mix: free requests running beside constrained ones equal their text alone
        free = [{"max_tokens": 30, "temperature": 0, "prompt": p} for p in (PROMPT, "The little dog", "Lily was")]
        alone = [gen(port, b)[0] for b in free]
        got, errors = {}, []

        def run(key, body):
            try:
                got[key] = gen(port, body)
            except Exception as e:  # reported below
                errors.append("%s: %s" % (key, e))

        threads = [threading.Thread(target=run, args=(("free", i), b)) for i, b in enumerate(free)]
        threads += [threading.Thread(target=run, args=(("guided", i), {
            "max_tokens": 120, "temperature": 0.8, "seed": i, "guided_json": PERSON})) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        check(not errors, "mix: %s" % errors)
        for i, text in enumerate(alone):
            check(got[("free", i)][0] == text, "free request %d beside constrained ones: %r, alone %r" % (
                i, got[("free", i)][0], text))
        validate([(PERSON, got[("guided", i)][0]) for i in range(6) if got[("guided", i)][1] == "stop"])


def test_padded_vocabulary():
    """A model whose vocabulary is longer than its tokenizer's (padded rows,
    as Qwen's): the mask covers the model's rows, the padding never allowed."""
    d = tempfile.mkdtemp(prefix="loom-padded-")
    model = os.path.join(d, "m")
    subprocess.run([PYTHON, os.path.join(ROOT, "tests", "reference", "gen_model.py"), "--out", model, "--dim", "64",
                    "--hidden-dim", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "1000",
                    "--max-pos", "512", "--seed", "3", "--tokenizer-from", STORIES], check=True, capture_output=True,
                   timeout=120)
    port = free_port()
    with Cluster(model, tp=2, coord_args=["--http", "127.0.0.1:%d" % port]):
        pairs = []
        for seed in range(4):
            text, finish = gen(port, {"max_tokens": 60, "temperature": 1.0, "seed": seed, "guided_json": PERSON})
            check(finish in ("stop", "length"), "finish %r" % finish)
            if finish == "stop":
                pairs.append((PERSON, text))
            text, finish = gen(port, {"max_tokens": 20, "temperature": 1.0, "seed": seed,
                                      "guided_choice": ["alpha", "beta"]})
            check(finish == "stop" and text in ("alpha", "beta"), "choice on the padded model: %r %r" % (text, finish))
        validate(pairs)
    shutil.rmtree(d, ignore_errors=True)


def test_sdks():
    if not os.path.isdir(os.path.join(NODE_MODULES, "openai")):
        raise AssertionError("tests/reference/node_modules is missing: run scripts/setup-debian.sh")
    port = free_port()
    with Cluster(STORIES, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml",
                                      "--api-key", KEY]):
        p = subprocess.run(["node", os.path.join(ROOT, "tests", "integration", "sdk_structured.mjs"),
                            "http://127.0.0.1:%d/v1" % port, KEY], capture_output=True, text=True, timeout=400)
        check(p.returncode == 0, "sdk_structured.mjs failed (%d): %s %s" % (p.returncode, p.stdout[-1500:],
                                                                          p.stderr[-1500:]))
        out = json.loads(p.stdout.strip().split("\n")[-1])
        pairs = []
        for name, r in sorted(out["results"].items()):
            check(r.get("finish") in ("stop", "length", None), "%s: %r" % (name, r))
            if r.get("finish") == "length":
                continue
            check(r.get("error") is None, "%s failed: %s" % (name, r.get("error")))
            pairs.append((out["schema"], r["text"]))
        validate(pairs)
        check(len(pairs) >= 4, "only %d SDK results finished: %r" % (len(pairs), out))
        print("  SDK results validated: %s" % ", ".join(sorted(out["results"])))
        status, data = post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        check(status == 200, "after the SDKs: %d %r" % (status, data[:200]))


if __name__ == "__main__":
    run_tests([test_http_specs, test_property_tp2_and_mix, test_padded_vocabulary, test_sdks])

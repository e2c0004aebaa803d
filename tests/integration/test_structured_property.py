"""Property test of constrained decoding (stories260K): hundreds of generated
JSON Schemas x sampling seeds x grids (1x1, 2x1, 1x2, 2x2).

Every schema is drawn from the coverage docs/grammar.md promises (object
with required / optional properties and additionalProperties false or
true, array with minItems / maxItems, string with lengths, pattern or a
format, number, integer, boolean, null, enum, const, anyOf, oneOf of
disjoint branches, a type list, $ref to $defs, recursive too). On each grid
every (schema, seed) runs as a request, many at once (so constrained rows
share steps), half on /v1/completions and half on /v1/chat/completions.
The guarantee checked: 100% of the outputs that finish with "stop" parse
and validate against their schema (Debian's python3-jsonschema through
tests/reference/validate_json_schema.py); the only other finish is
"length", and most finish. The same (schema, seed) gives the same text on
every grid, as seeded sampling does unconstrained (a few may differ where
float sums in another order flip a near tie: their share is printed and
bounded: at most 1 in 20)."""
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import PYTHON, ROOT, STORIES, Cluster, check, run_tests  # noqa: E402
from test_http import free_port, post  # noqa: E402

VALIDATOR = os.path.join(ROOT, "tests", "reference", "validate_json_schema.py")
GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2)]
N_SCHEMAS = 250
SEEDS = [3, 41]
CONCURRENCY = 24
PROMPTS = ["Once upon a time", "The little dog", "Lily was"]
WORDS = ["red", "green", "blue", "cat", "dog", 1, 2, 3.5, True, False, None]


def leaf(rng):
    k = rng.choice(["string", "string", "integer", "number", "boolean", "null", "enum", "const", "pattern",
                    "format", "types"])
    if k == "string":
        s = {"type": "string", "maxLength": rng.randint(1, 8)}
        if rng.random() < 0.4:
            s["minLength"] = rng.randint(0, 1)
        return s
    if k == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[0-9]{2}-[a-z]{2}$", "^(yes|no)$",
                                                         "^[A-Z][a-z]{0,3}$"])}
    if k == "format":
        return {"type": "string", "format": rng.choice(["date", "date-time", "time", "uuid", "email"])}
    if k == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if k == "const":
        return {"const": rng.choice(WORDS)}
    if k == "types":
        return {"type": rng.sample(["integer", "boolean", "null"], 2)}
    return {"type": k}


def node(rng, depth, defs):
    if depth >= 3 or rng.random() < 0.35:
        return leaf(rng)
    k = rng.choice(["object", "object", "array", "anyOf", "oneOf", "ref"])
    if k == "object":
        props = {"k%d" % i: node(rng, depth + 1, defs) for i in range(rng.randint(1, 3))}
        req = [n for n in props if rng.random() < 0.6]
        o = {"type": "object", "properties": props, "required": req}
        o["additionalProperties"] = rng.random() >= 0.8
        return o
    if k == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": node(rng, depth + 1, defs), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    if k == "anyOf":
        return {"anyOf": [node(rng, depth + 1, defs) for _ in range(rng.randint(2, 3))]}
    if k == "oneOf":  # disjoint branches, as discriminated unions are
        return {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": rng.randint(1, 6)},
                          {"type": "object", "properties": {"t": {"const": "x"}}, "required": ["t"],
                           "additionalProperties": False}][:rng.randint(2, 3)]}
    name = "d%d" % len(defs)
    defs[name] = None  # reserved before the nested nodes name theirs
    if rng.random() < 0.3:  # recursive: a linked list that may end
        defs[name] = {"type": "object", "properties": {"v": leaf(rng), "next": {"anyOf": [
            {"type": "null"}, {"$ref": "#/$defs/%s" % name}]}}, "required": ["v", "next"],
            "additionalProperties": False}
    else:
        defs[name] = node(rng, depth + 1, defs)
    return {"$ref": "#/$defs/%s" % name}


def random_schema(rng):
    defs = {}
    root = node(rng, 0, defs)
    if defs:
        root = {"$defs": defs, **root} if "$ref" not in root else {"$defs": defs, "allOf": [root]}
    return root


def validate(pairs):
    """pairs: [(schema, output)]; every output parses and validates."""
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for schema, out in pairs:
            f.write(json.dumps({"schema": schema, "output": out}) + "\n")
        name = f.name
    try:
        p = subprocess.run([PYTHON, VALIDATOR, name], capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, "invalid outputs: %s %s" % (p.stdout[-2000:], p.stderr[-500:]))
    finally:
        os.unlink(name)


def run_all(port, jobs):
    """{key: (text, finish)} of every job, CONCURRENCY at a time."""
    out, errors, lock = {}, [], threading.Lock()
    it = iter(jobs)

    def worker():
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            key, chat, body = job
            path = "/v1/chat/completions" if chat else "/v1/completions"
            try:
                status, data = post(port, path, body, timeout=120)
                if status != 200:
                    raise RuntimeError("%d %r" % (status, data[:300]))
                ch = json.loads(data)["choices"][0]
                out[key] = (ch["message"]["content"] if chat else ch["text"]), ch["finish_reason"]
            except Exception as e:  # reported below
                errors.append("%s %s: %s" % (key, json.dumps(body.get("guided_json"))[:300], e))

    threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    check(not errors, "%d requests failed, e.g. %s" % (len(errors), errors[:3]))
    return out


def test_property_every_grid():
    rng = random.Random(1616)
    schemas = [random_schema(rng) for _ in range(N_SCHEMAS)]
    jobs = []
    for i, schema in enumerate(schemas):
        for seed in SEEDS:
            chat = (i + seed) % 2 == 1
            body = {"max_tokens": 120, "temperature": 1.0, "seed": seed * 1000 + i, "guided_json": schema}
            if chat:
                body["messages"] = [{"role": "user", "content": PROMPTS[i % 3]}]
            else:
                body["prompt"] = PROMPTS[i % 3]
            jobs.append(((i, seed), chat, body))
    results = {}
    for tp, pp in GRIDS:
        port = free_port()
        with Cluster(STORIES, tp=tp, pp=pp, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml",
                                                        "--max-num-seqs", "32"]):
            t0 = time.time()
            got = run_all(port, jobs)
            wall = time.time() - t0
        bad = {k: f for k, (_, f) in got.items() if f not in ("stop", "length")}
        check(not bad, "%dx%d: finishes other than stop / length: %r" % (tp, pp, list(bad.items())[:5]))
        done = [(schemas[k[0]], text) for k, (text, f) in got.items() if f == "stop"]
        validate(done)
        check(len(done) >= len(jobs) * 7 // 10, "%dx%d: only %d of %d finished" % (tp, pp, len(done), len(jobs)))
        print("  %dx%d: %d requests (%d schemas x %d seeds) in %.1f s, %d finished, all valid" %
              (tp, pp, len(jobs), N_SCHEMAS, len(SEEDS), wall, len(done)))
        results[(tp, pp)] = got
    base = results[GRIDS[0]]
    for g in GRIDS[1:]:
        same = sum(results[g][k][0] == base[k][0] for k in base)
        print("  %dx%d: %d of %d texts equal to 1x1's" % (g + (same, len(base))))
        check(same >= len(base) * 19 // 20, "%dx%d: only %d of %d seeded constrained texts equal 1x1's" %
              (g + (same, len(base))))


if __name__ == "__main__":
    run_tests([test_property_every_grid])

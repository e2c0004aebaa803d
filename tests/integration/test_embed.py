"""/v1/embeddings and the Embed method on real processes (stories260K).

- Last-token and mean pooling of the final-normed hidden state, L2-normalised,
  equal the float64 torch reference (tests/reference/llama_ref.py
  --embed-out) with cosine > 0.99999 on grids 1x1, 2x1 and 1x2, with the
  prompts prefilled in several chunks (--max-num-batched-tokens 8) and
  batched with each other and with a generation (whose ids do not change).
- Every input shape OpenAI takes (a string, strings, token ids, lists of
  token ids) gives the same vectors; base64 is the float32 values; usage
  counts the prompt tokens; the prefix cache gives the same last-token
  vector.
- The openai SDK's embeddings.create, LangChain's OpenAIEmbeddings and
  `loom embed` (the C client's Embed) get the same vectors (embed_sdk.mjs).
- Bad input (empty input, an empty string, a too-long input, a bad
  encoding_format, dimensions other than the model's) is a 400 naming the
  field, and the server keeps serving."""
import base64
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, PYTHON, ROOT, STORIES, Cluster, check, parse_ids, run_tests  # noqa: E402
from test_http import expect_error, free_port, request  # noqa: E402

TEXTS = ["Once upon a time", "The little dog ran to the park and played with a red ball all day long.",
         "Lily was happy."]
GRIDS = [(1, 1), (2, 1), (1, 2)]
CHUNK = ["--max-num-batched-tokens", "8"]
_refs = {}


def reference(ids, pooling):
    key = (tuple(ids), pooling)
    if key not in _refs:
        with tempfile.NamedTemporaryFile(suffix=".f64") as f:
            p = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "reference", "llama_ref.py"), "--model", STORIES,
                                "--ids", ",".join(map(str, ids)), "--embed-out", f.name, "--pooling", pooling],
                               capture_output=True, text=True, timeout=600)
            check(p.returncode == 0, "llama_ref.py failed: %s" % p.stderr[-500:])
            _refs[key] = np.fromfile(f.name, dtype="<f8")
    return _refs[key]


def tokenize(port, text):
    status, _, data = request(port, "POST", "/tokenize", {"prompt": text})
    check(status == 200, "/tokenize: %d %r" % (status, data[:200]))
    return json.loads(data)["tokens"]


def embed(port, body, want=200):
    status, hdrs, data = request(port, "POST", "/v1/embeddings", body, timeout=120)
    check(status == want, "/v1/embeddings %r: %d %r" % (body, status, data[:300]))
    return json.loads(data)


def vectors(out, b64=False):
    check(out["object"] == "list" and [d["index"] for d in out["data"]] == list(range(len(out["data"]))),
          "embeddings list: %r" % {k: v for k, v in out.items() if k != "data"})
    rows = []
    for d in out["data"]:
        check(d["object"] == "embedding", "data item %r" % d.get("object"))
        if b64:
            raw = base64.b64decode(d["embedding"])
            rows.append(np.array(struct.unpack("<%df" % (len(raw) // 4), raw), dtype=np.float64))
        else:
            rows.append(np.array(d["embedding"], dtype=np.float64))
    return rows


def check_close(got, want, what):
    cos = float(np.dot(got, want) / (np.linalg.norm(got) * np.linalg.norm(want)))
    check(abs(np.linalg.norm(got) - 1) < 1e-5, "%s: norm %r" % (what, np.linalg.norm(got)))
    check(cos > 0.99999, "%s: cosine %.8f with the float64 reference" % (what, cos))
    return cos


def run_grid(tp, pp, pooling):
    port = free_port()
    args = ["--http", "127.0.0.1:%d" % port] + CHUNK + (["--embedding-pooling", pooling] if pooling != "last" else [])
    worst = 1.0
    with Cluster(STORIES, tp=tp, pp=pp, coord_args=args) as c:
        ids = [tokenize(port, t) for t in TEXTS]
        check(len(ids[1]) > 16, "the long text is only %d tokens" % len(ids[1]))
        refs = [reference(i, pooling) for i in ids]
        rc, _, plain, err = c.generate(TEXTS[0], max_tokens=24, extra=["--ignore-eos"])
        check(rc == 0 and plain, "loom generate: %s" % err[-300:])
        # a generation batched with the embeddings keeps its ids
        gen = c.generate_async(TEXTS[0], max_tokens=24, extra=["--ignore-eos"])
        out = embed(port, {"input": TEXTS, "model": ""})
        so, se = gen.communicate(timeout=120)
        check(gen.returncode == 0 and parse_ids(se) == plain, "%dx%d: the generation beside embeddings changed" %
              (tp, pp))
        check(out["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))},
              "usage %r" % out["usage"])
        got = vectors(out)
        for i, (g, r) in enumerate(zip(got, refs)):
            worst = min(worst, check_close(g, r, "%dx%d %s input %d" % (tp, pp, pooling, i)))
        # the other input shapes give the same vectors
        for body, n in [({"input": TEXTS[1]}, 1), ({"input": ids[1]}, 1), ({"input": ids}, 3),
                        ({"input": TEXTS, "encoding_format": "float", "dimensions": len(got[0])}, 3)]:
            other = vectors(embed(port, body))
            check(len(other) == n, "%r: %d vectors" % (body, len(other)))
            want = got[1:2] if n == 1 else got
            for a, b in zip(other, want):
                check(np.max(np.abs(a - b)) < 1e-6, "%dx%d %r: differs from the batched vectors" % (tp, pp, body))
        b64 = vectors(embed(port, {"input": TEXTS, "encoding_format": "base64"}), b64=True)
        for a, b in zip(b64, got):
            check(np.max(np.abs(a - b)) < 1e-6, "base64 differs from float")
    return worst, got


def test_last_pooling_on_grids():
    first = None
    for tp, pp in GRIDS:
        worst, got = run_grid(tp, pp, "last")
        print("  %dx%d last pooling: cosine >= %.9f with the float64 reference" % (tp, pp, worst))
        if first is None:
            first = got
        for a, b in zip(got, first):
            check(np.max(np.abs(a - b)) < 1e-5, "%dx%d differs from 1x1" % (tp, pp))


def test_mean_pooling():
    for tp, pp in [(1, 1), (2, 1)]:
        worst, _ = run_grid(tp, pp, "mean")
        print("  %dx%d mean pooling: cosine >= %.9f with the float64 reference" % (tp, pp, worst))


def test_bad_input_and_sdks():
    port = free_port()
    with Cluster(STORIES, coord_args=["--http", "127.0.0.1:%d" % port]) as c:
        ids = tokenize(port, TEXTS[0])
        good = vectors(embed(port, {"input": TEXTS[0]}))[0]
        # the prefix cache (full blocks of the repeated prompt) gives the same vector
        long_ids = tokenize(port, TEXTS[1])
        a = vectors(embed(port, {"input": long_ids}))[0]
        b = vectors(embed(port, {"input": long_ids}))[0]
        check(np.max(np.abs(a - b)) < 1e-6, "a prefix-cache hit changed the embedding")
        check(c.stats()["prefix_cache_hits"] > 0, "no prefix-cache hit: %r" % c.stats())
        ctx = json.loads(request(port, "GET", "/v1/models")[2])["data"][0]["max_model_len"]
        for body, param, contains in [
                ({"input": []}, "input", "empty"),
                ({"input": ""}, "input", "empty"),
                ({"input": ["a", ""]}, "input", "input 1"),
                ({"input": [[]]}, "input", "empty"),
                ({"input": [1, -2]}, "input", "token ids"),
                ({"input": 5}, "input", "string"),
                ({}, "input", "required"),
                ({"input": [ids[0]] * (ctx + 1)}, "input", "context length"),
                ({"input": [10 ** 6]}, "input", "vocabulary"),
                ({"input": "x", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
                ({"input": "x", "dimensions": 7}, "dimensions", "dimensions"),
                ({"input": "x", "dimensions": 0}, "dimensions", None)]:
            status, _, data = request(port, "POST", "/v1/embeddings", body)
            expect_error(status, data, 400, param=param, contains=contains)
        status, _, data = request(port, "POST", "/v1/embeddings", {"input": "x", "model": "nope"})
        expect_error(status, data, 404, param="model")
        status, hdrs, data = request(port, "POST", "/v1/embeddings", {"input": TEXTS[0], "future_field": 1})
        check(status == 200 and "future_field" in {k.lower(): v for k, v in hdrs.items()}.get("x-loom-ignored-fields", ""), "unknown field: %d %r" %
              (status, hdrs))
        # the C client through `loom embed`
        p = subprocess.run([os.path.join(BIN, "loom"), "embed", "--addr", c.addr, "--text", TEXTS[0]],
                           capture_output=True, text=True, timeout=60)
        check(p.returncode == 0, "loom embed: %s" % p.stderr)
        cli = json.loads(p.stdout)
        check(cli["pooling"] == "last" and cli["prompt_tokens"] == len(ids), "loom embed: %r" % p.stdout[:200])
        check(np.max(np.abs(np.array(cli["embedding"]) - good)) < 1e-6, "loom embed differs from /v1/embeddings")
        p = subprocess.run([os.path.join(BIN, "loom"), "embed", "--addr", c.addr, "--text", ""],
                           capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and "empty" in p.stderr, "loom embed of an empty text: %d %r" % (p.returncode,
                                                                                             p.stderr))
        after = vectors(embed(port, {"input": TEXTS[0]}))[0]
        check(np.max(np.abs(after - good)) < 1e-6, "the server answers differently after bad requests")
        node_modules = os.path.join(ROOT, "tests", "reference", "node_modules")
        for pkg in ("openai", "@langchain/openai"):
            check(os.path.isdir(os.path.join(node_modules, pkg)), "%s is missing: run npm ci --prefix tests/reference"
                  % pkg)
        p = subprocess.run(["node", os.path.join(os.path.dirname(os.path.abspath(__file__)), "embed_sdk.mjs"),
                            "http://127.0.0.1:%d/v1" % port, "sk-none", json.dumps(TEXTS)],
                           capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, "embed_sdk.mjs failed: %s" % p.stderr[-1500:])
        out = json.loads(p.stdout)
        want = vectors(embed(port, {"input": TEXTS}))
        check(out["openai_usage"] == sum(len(tokenize(port, t)) for t in TEXTS), "openai usage %r" % out["openai_usage"])
        for name in ("openai", "openai_float", "langchain_docs"):
            check(len(out[name]) == len(TEXTS), "%s: %d vectors" % (name, len(out[name])))
            for a, b in zip(out[name], want):
                check(np.max(np.abs(np.array(a) - b)) < 1e-6, "%s differs from /v1/embeddings" % name)
        check(np.max(np.abs(np.array(out["langchain_query"]) - want[0])) < 1e-6, "langchain embedQuery differs")
        check(out["openai_bad"]["status"] == 400 and "encoding_format" in out["openai_bad"]["message"],
              "openai bad encoding_format: %r" % out["openai_bad"])


if __name__ == "__main__":
    run_tests([t for t in [test_last_pooling_on_grids, test_mean_pooling, test_bad_input_and_sdks]
               if len(sys.argv) < 2 or t.__name__ in sys.argv[1:]])

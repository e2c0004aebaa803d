"""Sampling controls on real processes (stories260K).

- Greedy ids with presence / frequency / repetition penalties and a logit
  bias equal the float64 torch reference (tests/reference/llama_ref.py,
  vLLM's formulas) on grids 1x1, 2x1, 1x2 and 2x2: the edits are applied on
  each TP rank's slice of the vocabulary before the winners are merged.
- Seeded sampling with penalties, min_p and top_p gives the same ids on
  every grid.
- Over HTTP (/v1/completions and /v1/chat/completions): logit_bias,
  allowed_token_ids, bad_words, min_tokens (EOS and stop ids masked on the
  workers), include_stop_str_in_output, min_p; a field no one knows is
  ignored and named in X-Loom-Ignored-Fields; bad values are a 400 naming
  the field, and the server keeps serving."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import PYTHON, ROOT, STORIES, Cluster, check, run_tests  # noqa: E402
from test_http import CHAT, expect_error, free_port, get_metrics, metric, post, request  # noqa: E402

PROMPT = "Once upon a time"
N = 40
GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2)]
# (loom generate flags, llama_ref.py flags)
PENALTIES = [
    (["--presence-penalty", "1.5"], ["--presence-penalty", "1.5"]),
    (["--frequency-penalty", "0.8"], ["--frequency-penalty", "0.8"]),
    (["--repetition-penalty", "1.6"], ["--repetition-penalty", "1.6"]),
    (["--presence-penalty", "0.5", "--frequency-penalty", "0.5", "--repetition-penalty", "1.2",
      "--logit-bias", "267:-3", "--logit-bias", "400:2.5"],
     ["--presence-penalty", "0.5", "--frequency-penalty", "0.5", "--repetition-penalty", "1.2",
      "--logit-bias", "267:-3", "--logit-bias", "400:2.5"]),
]
SAMPLED = ["--temperature", "0.9", "--top-k", "0", "--top-p", "0.9", "--min-p", "0.05", "--seed", "17",
           "--presence-penalty", "0.7", "--repetition-penalty", "1.1"]


def prompt_ids(port):
    status, _, data = request(port, "POST", "/tokenize", {"prompt": PROMPT})
    check(status == 200, "/tokenize: %d %r" % (status, data[:200]))
    return json.loads(data)["tokens"]


def reference(ids, flags):
    p = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "reference", "llama_ref.py"), "--model", STORIES,
                        "--ids", ",".join(map(str, ids)), "--greedy", str(N)] + flags,
                       capture_output=True, text=True, timeout=600)
    check(p.returncode == 0, "llama_ref.py failed: %s" % p.stderr[-500:])
    return [int(x) for x in p.stdout.strip().split(",")]


def reference_logprobs(ids, n_prompt):
    """float64 log_softmax of the reference's logits at positions n_prompt-1 .. len(ids)-2."""
    with tempfile.NamedTemporaryFile(suffix=".f32") as f:
        p = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "reference", "llama_ref.py"), "--model", STORIES,
                            "--ids", ",".join(map(str, ids)), "--logits-out", f.name,
                            "--positions-from", str(n_prompt - 1)], capture_output=True, text=True, timeout=600)
        check(p.returncode == 0, "llama_ref.py failed: %s" % p.stderr[-500:])
        x = np.fromfile(f.name, dtype="<f4").astype(np.float64).reshape(len(ids) - n_prompt + 1, -1)
    m = x.max(axis=1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:-1]


def check_logprobs(port, grid, pids, body, ids, ref, chat=False):
    """token_logprobs and top_logprobs of a completion equal the reference within 1e-4."""
    status, _, data = request(port, "POST", "/v1/completions", dict({"prompt": pids, "max_tokens": len(ids),
                                                                     "logprobs": 5}, **body))
    check(status == 200, "%s logprobs: %d %r" % (grid, status, data[:300]))
    lp = json.loads(data)["choices"][0]["logprobs"]
    check(len(lp["token_logprobs"]) == len(ids), "%s: %d logprobs for %d tokens" % (grid, len(lp["token_logprobs"]),
                                                                                     len(ids)))
    worst = 0.0
    for i, t in enumerate(ids):
        worst = max(worst, abs(lp["token_logprobs"][i] - ref[i][t]))
        want_top = np.sort(ref[i])[::-1][:5]
        got_top = sorted(lp["top_logprobs"][i].values(), reverse=True)
        check(len(got_top) >= 1, "%s: empty top_logprobs at %d" % (grid, i))
        for g in got_top:  # two ids reading alike collapse into one key
            worst = max(worst, min(abs(g - w) for w in want_top))
        worst = max(worst, abs(got_top[0] - want_top[0]))
    check(worst < 1e-4, "%s %s: logprobs differ from the float64 reference by %.3g" % (grid, body, worst))
    check(lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"]), "text_offset %r" %
          lp["text_offset"])
    return worst


def texts(port, body):
    status, _, data = request(port, "POST", "/v1/completions", body)
    check(status == 200, "%r: %d %r" % (body, status, data[:300]))
    o = json.loads(data)
    check([c["index"] for c in o["choices"]] == list(range(len(o["choices"]))), "choice indexes %r" % o["choices"])
    return [c["text"] for c in o["choices"]], o["usage"]


def check_multi(port, grid):
    """n = 3 with a seed, and a two-prompt batch (text and token ids) with n = 2: choices in OpenAI's index
    order, choice 0 of each prompt equal to the single request, usage counting each prompt once."""
    sampled = {"max_tokens": 24, "temperature": 1.5, "top_p": 1, "seed": 11}
    n3, usage = texts(port, dict(sampled, prompt=PROMPT, n=3))
    one, u1 = texts(port, dict(sampled, prompt=PROMPT))
    check(len(n3) == 3 and n3[0] == one[0] and len(set(n3)) == 3, "%s n=3: %r (single %r)" % (grid, n3, one))
    check(usage["prompt_tokens"] == u1["prompt_tokens"], "%s n=3 counts the prompt %r" % (grid, usage))
    ids = prompt_ids(port)
    batch, ub = texts(port, {"prompt": [PROMPT, ids[:3]], "max_tokens": 8, "temperature": 0, "n": 2})
    a, ua = texts(port, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    b, ub1 = texts(port, {"prompt": ids[:3], "max_tokens": 8, "temperature": 0})
    check(batch == [a[0], a[0], b[0], b[0]], "%s batch: %r vs %r, %r" % (grid, batch, a, b))
    check(ub["prompt_tokens"] == ua["prompt_tokens"] + ub1["prompt_tokens"] and
          ub["completion_tokens"] == 2 * (ua["completion_tokens"] + ub1["completion_tokens"]),
          "%s batch usage %r (singles %r, %r)" % (grid, ub, ua, ub1))
    return n3 + batch


def gen_ids(c, extra, temperature=0.0):
    rc, _, ids, err = c.generate(PROMPT, max_tokens=N, temperature=temperature,
                                 extra=["--top-k", "0", "--top-p", "1", "--ignore-eos"] + list(extra))
    check(rc == 0 and ids is not None, "loom generate %s failed: %s" % (extra, err[-400:]))
    return ids


def test_penalties_on_every_grid():
    refs, plain_ref, sampled, lp_refs, multi = None, None, {}, {}, {}
    for tp, pp in GRIDS:
        port = free_port()
        with Cluster(STORIES, tp=tp, pp=pp, coord_args=["--http", "127.0.0.1:%d" % port]) as c:
            if refs is None:
                ids = prompt_ids(port)
                plain_ref = reference(ids, [])
                refs = [reference(ids, rf) for _, rf in PENALTIES]
                check(all(r != plain_ref for r in refs), "a penalty changed nothing in the reference: %r" % refs)
            check(gen_ids(c, []) == plain_ref, "%dx%d: plain greedy differs from the reference" % (tp, pp))
            for (flags, _), want in zip(PENALTIES, refs):
                got = gen_ids(c, flags)
                check(got == want, "%dx%d %s:\n  loom %r\n  ref  %r" % (tp, pp, " ".join(flags), got, want))
            sampled[(tp, pp)] = gen_ids(c, SAMPLED, temperature=0.9)
            # logprobs: raw (before temperature and penalties), greedy and sampled, against float64
            pids = prompt_ids(port)
            for flags, body in [([], {"temperature": 0}),
                                (["--seed", "9"], {"temperature": 1.0, "seed": 9, "top_p": 1}),
                                (["--presence-penalty", "1.5"], {"temperature": 0, "presence_penalty": 1.5})]:
                rc, _, ids, err = c.generate(PROMPT, max_tokens=12, temperature=body["temperature"],
                                             extra=["--top-k", "0", "--top-p", "1", "--ignore-eos"] + flags)
                check(rc == 0 and ids, "loom generate: %s" % err[-300:])
                key = (tuple(flags), tuple(ids))
                if key not in lp_refs:
                    lp_refs[key] = reference_logprobs(pids + ids, len(pids))
                worst = check_logprobs(port, "%dx%d" % (tp, pp), pids, dict(body, ignore_eos=True), ids, lp_refs[key])
                print("  %dx%d %s: logprobs within %.2g of the float64 reference" % (tp, pp, body, worst))
            multi[(tp, pp)] = check_multi(port, "%dx%d" % (tp, pp))
    for g, m in multi.items():
        check(m == multi[GRIDS[0]], "n and batched prompts differ on %dx%d: %r vs %r" % (g + (m, multi[GRIDS[0]])))
    first = sampled[GRIDS[0]]
    for g, ids in sampled.items():
        check(ids == first, "seeded sampling with penalties and min_p differs on %dx%d: %r vs %r" % (g + (ids, first)))


def completion(port, body, chat=False):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"messages": CHAT} if chat else {"prompt": PROMPT}
    status, hdrs, data = request(port, "POST", path, dict(base, **body))
    return status, hdrs, data


def tokens_of(port, text):
    status, _, data = request(port, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    check(status == 200, "/tokenize: %d" % status)
    return json.loads(data)["tokens"]


def ok_text(port, body, chat=False):
    status, hdrs, data = completion(port, body, chat)
    check(status == 200, "%r: %d %r" % (body, status, data[:300]))
    ch = json.loads(data)["choices"][0]
    return (ch["message"]["content"] if chat else ch["text"]), ch["finish_reason"], hdrs


def mix64(x):
    """gateway/http.c's mix64: choice j > 0 of a seeded n > 1 request samples with seed ^ mix64(j)."""
    m = (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & m
    x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & m
    return x ^ (x >> 31)


def test_n_forks_the_prompt():
    """n = 4 with a seed: the prompt is prefilled once and forked (loom_prompt_tokens_computed_total grows by
    the prompt plus one token per other choice), and each choice is the text a single request with its seed
    gives; greedy n = 4 gives four copies of the n = 1 text."""
    port = free_port()
    with Cluster(STORIES, tp=1, pp=1, coord_args=["--http", "127.0.0.1:%d" % port]) as c:
        prompt = "Once upon a time there was a little dog named Max who loved to run in the park"
        status, _, data = request(port, "POST", "/tokenize", {"prompt": prompt})
        check(status == 200, "/tokenize: %d" % status)
        n_prompt = len(json.loads(data)["tokens"])
        sampled = {"prompt": prompt, "max_tokens": 24, "temperature": 1.2, "top_p": 1, "seed": 5}
        _, before = get_metrics(port)
        n4, _ = texts(port, dict(sampled, n=4))
        _, after = get_metrics(port)

        def delta(name):
            return metric(after, name) - metric(before, name)
        computed, forked = delta("loom_prompt_tokens_computed_total"), delta("loom_kv_fork_tokens_total")
        print("n=4, prompt of %d tokens: %d prompt tokens computed, %d forked" % (n_prompt, computed, forked))
        check(delta("loom_kv_forks_total") == 3 and forked == 3 * (n_prompt - 1),
              "forks %g, fork tokens %g (prompt %d)" % (delta("loom_kv_forks_total"), forked, n_prompt))
        check(computed == n_prompt + 3, "%g prompt tokens computed for n = 4 (prompt %d)" % (computed, n_prompt))
        # choice j's seed is 5 ^ mix64(j), beyond a JSON number's exact range: the CLI sends it as an integer
        singles = []
        for j in range(4):
            rc, out, _, err = c.generate(prompt, max_tokens=24, temperature=1.2,
                                         extra=["--top-p", "1", "--top-k", "0", "--seed", str(5 ^ mix64(j) if j else 5)])
            check(rc == 0, "loom generate: %s" % err[-300:])
            singles.append(out)
        check([t.strip() for t in n4] == [t.strip() for t in singles] and len(set(n4)) == 4,
              "forked choices %r, single requests %r" % (n4, singles))
        greedy = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        g4, _ = texts(port, dict(greedy, n=4))
        g1, _ = texts(port, greedy)
        check(g4 == g1 * 4, "greedy n=4 %r, n=1 %r" % (g4, g1))


def test_http_controls():
    port = free_port()
    with Cluster(STORIES, tp=2, pp=1, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml"]) as c:
        greedy = {"max_tokens": 24, "temperature": 0}
        plain, _, _ = ok_text(port, greedy)
        check(len(plain) > 20, "plain text %r" % plain)
        # logit_bias +100 on one token: only that token, on both routes
        a_id = tokens_of(port, "a")[-1]
        for chat in (False, True):
            text, _, _ = ok_text(port, dict(greedy, max_tokens=6, logit_bias={str(a_id): 100}), chat)
            one, _, _ = ok_text(port, dict(greedy, max_tokens=1, logit_bias={str(a_id): 100}), chat)
            check(one and text == one * 6, "logit_bias +100 (chat %s): %r" % (chat, text))
        # allowed_token_ids: the output decodes from those ids only
        allowed = tokens_of(port, " the cat sat on a mat.")
        text, _, _ = ok_text(port, dict(greedy, max_tokens=12, allowed_token_ids=allowed))
        ids = tokens_of(port, text)
        check(set(ids) <= set(allowed), "allowed_token_ids: %r gave ids %r outside %r" % (text, ids, allowed))
        # bad_words: a word of the plain greedy text never comes, the text changes
        word = "Lily"
        check(word in plain, "plain greedy text %r lacks %r" % (plain, word))
        text, _, _ = ok_text(port, dict(greedy, bad_words=[word]))
        check(word not in text and text != plain, "bad_words %r: %r" % (word, text))
        # min_tokens with a stop id: the stop id (the 3rd greedy token) is masked until then
        rc, _, gids, err = c.generate(PROMPT, max_tokens=8)
        check(rc == 0 and gids, "loom generate: %s" % err[-300:])
        stop_id = next(t for i, t in enumerate(gids) if i >= 2 and t not in gids[:i])
        cut, fin, _ = ok_text(port, dict(greedy, stop_token_ids=[stop_id]))
        check(fin == "stop" and len(cut) < len(plain), "stop_token_ids alone: %r %s" % (cut, fin))
        text, fin, _ = ok_text(port, dict(greedy, stop_token_ids=[stop_id], min_tokens=24))
        check(fin == "length" and len(tokens_of(port, text)) >= 20 and text != cut,
              "min_tokens 24 with stop id %d: %r %s" % (stop_id, text, fin))
        # include_stop_str_in_output: the stop string stays in the text
        stop = plain[10:14]
        without, fin1, _ = ok_text(port, dict(greedy, stop=[stop]))
        with_, fin2, _ = ok_text(port, dict(greedy, stop=[stop], include_stop_str_in_output=True))
        check(fin1 == fin2 == "stop" and with_ == without + stop, "include_stop_str_in_output: %r / %r" %
              (without, with_))
        # min_tokens also holds stop strings back
        text, _, _ = ok_text(port, dict(greedy, stop=[stop], min_tokens=24))
        check(text == plain, "min_tokens with a stop string: %r" % text)
        # penalties and min_p are accepted on chat; seeded sampling repeats itself
        body = {"max_tokens": 16, "temperature": 1.0, "seed": 5, "min_p": 0.2, "presence_penalty": 1.0,
                "frequency_penalty": 0.5, "repetition_penalty": 1.3}
        t1, _, _ = ok_text(port, body, chat=True)
        t2, _, _ = ok_text(port, body, chat=True)
        check(t1 == t2 and t1, "seeded chat with controls: %r vs %r" % (t1, t2))
        # unknown fields: accepted, ignored, named in a header and the log
        text, _, hdrs = ok_text(port, dict(greedy, no_such_field=1, another_new_one={"x": 1}))
        check(text == plain, "an unknown field changed the answer: %r" % text)
        check(hdrs.get("x-loom-ignored-fields") == "no_such_field, another_new_one",
              "X-Loom-Ignored-Fields: %r" % hdrs.get("x-loom-ignored-fields"))
        check("ignoring the unknown field 'no_such_field'" in c.log("coordinator"), "no warning logged")
        _, _, hdrs = ok_text(port, greedy)
        check("x-loom-ignored-fields" not in hdrs, "header without unknown fields")
        # chat logprobs, streamed and not: one entry per token, top_logprobs of the asked size, best first
        body = {"max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}
        status, _, data = completion(port, body, chat=True)
        check(status == 200, "chat logprobs: %d %r" % (status, data[:300]))
        ch = json.loads(data)["choices"][0]
        content = ch["logprobs"]["content"]
        check(len(content) == 5 and "".join(t["token"] for t in content) == ch["message"]["content"],
              "chat logprobs tokens %r vs %r" % ([t["token"] for t in content], ch["message"]["content"]))
        for t in content:
            tops = [x["logprob"] for x in t["top_logprobs"]]
            check(len(tops) == 3 and tops == sorted(tops, reverse=True) and abs(tops[0] - t["logprob"]) < 1e-6,
                  "greedy: the token is the top one: %r" % t)
            check(bytes(t["bytes"]).decode() == t["token"], "bytes of %r" % t)
        status, _, data = completion(port, dict(body, stream=True), chat=True)
        events = [json.loads(ln[6:]) for ln in data.decode().splitlines() if ln.startswith("data: {")]
        streamed = [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["content"]]
        check([t["logprob"] for t in streamed] == [t["logprob"] for t in content],
              "streamed logprobs differ: %r vs %r" % (streamed, content))
        # echo: the prompt's text starts the choice, streamed or not, text or token ids
        text, _, _ = ok_text(port, dict(greedy, echo=True))
        check(text == PROMPT + plain, "echo: %r" % text)
        status, _, data = completion(port, dict(greedy, echo=True, stream=True))
        events = [json.loads(ln[6:]) for ln in data.decode().splitlines() if ln.startswith("data: {")]
        streamed = "".join(c["text"] for e in events for c in e["choices"])
        check(streamed == PROMPT + plain, "streamed echo: %r" % streamed)
        status, _, data = request(port, "POST", "/v1/completions", dict(greedy, echo=True, prompt=prompt_ids(port)))
        check(status == 200 and json.loads(data)["choices"][0]["text"] == PROMPT + plain, "echo of ids: %r" % data[:300])
        # bad input: 400 naming the problem, and the server keeps serving
        # (echo with logprobs is answered: test_prompt_logprobs.py)
        for body, chat, name in [({"echo": True}, True, "echo"),
({"n": 0}, False, "n"), ({"n": 0}, True, "n"), ({"n": 65}, True, "n"),
                                 ({"prompt": ["a", ""]}, False, "prompt"), ({"prompt": ["a", [1, -1]]}, False, "prompt"),
({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
                                 ({"top_logprobs": 2}, True, "top_logprobs"),
                                 ({"logprobs": 21}, False, "logprobs"), ({"logprobs": True}, False, "logprobs"),
                                 ({"logprobs": 2}, True, "logprobs")]:
            status, _, data = completion(port, dict(greedy, **body), chat)
            expect_error(status, data, 400, param=name)
        bad = [({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
               ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
               ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"presence_penalty": 2.5}, "presence_penalty"),
               ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
               ({"min_p": 1.5}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
               ({"min_tokens": 30, "max_tokens": 10}, "min_tokens"), ({"allowed_token_ids": []}, "allowed_token_ids"),
               ({"allowed_token_ids": [1, 1e9]}, "allowed_token_ids"), ({"bad_words": "x"}, "bad_words"),
               ({"include_stop_str_in_output": 1}, "include_stop_str_in_output")]
        for body, name in bad:
            status, _, data = completion(port, dict(greedy, **body))
            expect_error(status, data, 400, contains=name)
        text, _, _ = ok_text(port, greedy)
        check(text == plain, "the server answers differently after bad requests: %r" % text)


def test_sdks():
    """The OpenAI SDK, LangChain JS and the Vercel AI SDK: logprobs, penalties, bad input."""
    node_modules = os.path.join(ROOT, "tests", "reference", "node_modules")
    for pkg in ("openai", "@langchain/openai", "ai", "@ai-sdk/openai-compatible"):
        check(os.path.isdir(os.path.join(node_modules, pkg)), "%s is missing: run npm ci --prefix tests/reference" % pkg)
    port = free_port()
    with Cluster(STORIES, tp=2, pp=1, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml"]):
        p = subprocess.run(["node", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdk_sampling.mjs"),
                            "http://127.0.0.1:%d/v1" % port, "sk-none"], capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, "sdk_sampling.mjs failed: %s" % p.stderr[-1500:])
        out = json.loads(p.stdout)
    lp = out["openai_logprobs"]["logprobs"]
    check(out["openai_logprobs"]["text"] == out["openai_plain"], "logprobs changed the text")
    check(len(lp["token_logprobs"]) == 24 and all(x <= 0 for x in lp["token_logprobs"]) and
          "".join(lp["tokens"]) == out["openai_plain"] and all(len(t) == 3 for t in lp["top_logprobs"]),
          "openai completions logprobs: %r" % lp)
    check(out["openai_penalized"] != out["openai_long"], "penalties changed nothing: %r" % out["openai_penalized"])
    content = out["openai_chat"]["logprobs"]["content"]
    check(len(content) == 24 and all(len(t["top_logprobs"]) == 2 for t in content), "openai chat logprobs: %r" %
          content[:2])
    check(out["openai_top21"]["status"] == 400 and "top_logprobs" in out["openai_top21"]["message"],
          "top_logprobs 21: %r" % out["openai_top21"])
    check(out["openai_bad_bias"]["status"] == 400 and "logit_bias" in out["openai_bad_bias"]["message"],
          "bad logit_bias: %r" % out["openai_bad_bias"])
    check(out["openai_after"] == out["openai_plain"], "the server answers differently after bad requests")
    lc = out["langchain"]
    check(len(out["openai_n2"]) == 2 and out["openai_n2"][0] != out["openai_n2"][1], "openai n=2: %r" % out["openai_n2"])
    check(out["openai_batch"] == [out["openai_plain"], out["openai_batch_b"]], "openai batch: %r" % out["openai_batch"])
    check(out["openai_n0"]["status"] == 400, "openai n=0: %r" % out["openai_n0"])
    check(lc["plain"] and lc["penalized"] != lc["plain"], "langchain penalties: %r" % lc)
    check(lc["logprobs"] and len(lc["logprobs"]["content"]) > 0 and
          all(len(t["top_logprobs"]) == 2 for t in lc["logprobs"]["content"]), "langchain logprobs: %r" % lc["logprobs"])
    v = out["vercel"]
    check(v["plain"] and v["penalized"] != v["plain"], "vercel penalties: %r" % v)


if __name__ == "__main__":
    run_tests([test_penalties_on_every_grid, test_n_forks_the_prompt, test_http_controls, test_sdks])

"""Prompt log probabilities on real processes (stories260K).

- vLLM's prompt_logprobs on /v1/completions (in the choice) and
  /v1/chat/completions (in the response): the first entry null, then for
  each prompt token its logprob, rank and the k most likely, equal to the
  float64 reference (tests/reference/llama_ref.py, full-sequence
  log-softmax) within 1e-4 on grids 1x1, 2x1, 1x2 and 2x2, for a prompt
  longer than a step's token budget (chunked prefill: each chunk brings its
  positions) and more positions per step than the workers' logit rows.
- OpenAI's legacy echo with logprobs: the prompt's tokens open tokens /
  token_logprobs / top_logprobs / text_offset (the first logprob null),
  streamed or not, then the generated tokens as without echo.
- The prefix cache cannot hide positions: a prompt cached by an earlier
  request still gets every position.
- Bad input (prompt_logprobs over 20, negative, not an integer, streamed;
  echo on chat) is a 400 naming the field, and the server keeps serving.
- The official openai SDK: completions with echo: true, logprobs: 2 and
  prompt_logprobs passed through."""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import PYTHON, ROOT, STORIES, Cluster, check, run_tests  # noqa: E402
from test_http import CHAT, expect_error, free_port, request  # noqa: E402

# about 40 tokens: three chunks of 16 (--max-num-batched-tokens 16)
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
          "One day, she saw a big")
GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2)]
# a step holds at most 16 tokens; the workers compute 4 logit rows at a time
COORD = ["--max-num-batched-tokens", "16", "--max-num-seqs", "4", "--chat-template", "chatml"]
K = 5


def tokenize(port, text):
    status, _, data = request(port, "POST", "/tokenize", {"prompt": text})
    check(status == 200, "/tokenize: %d %r" % (status, data[:200]))
    return json.loads(data)["tokens"]


def ref_logsoftmax(ids):
    """float64 log_softmax of the reference's logits at positions 0 .. len(ids)-1."""
    with tempfile.NamedTemporaryFile(suffix=".f32") as f:
        p = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "reference", "llama_ref.py"), "--model", STORIES,
                            "--ids", ",".join(map(str, ids)), "--logits-out", f.name, "--positions-from", "0"],
                           capture_output=True, text=True, timeout=600)
        check(p.returncode == 0, "llama_ref.py failed: %s" % p.stderr[-500:])
        x = np.fromfile(f.name, dtype="<f4").astype(np.float64).reshape(len(ids), -1)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def check_prompt_lps(grid, plp, ids, ref, k):
    """vLLM's list: null, then {id: {logprob, rank, decoded_token}} with the prompt token and the k most likely."""
    check(isinstance(plp, list) and len(plp) == len(ids) and plp[0] is None,
          "%s: prompt_logprobs has %s entries for %d tokens (first %r)" % (grid, len(plp) if isinstance(plp, list)
                                                                           else plp, len(ids), plp and plp[0]))
    worst = 0.0
    for i in range(1, len(ids)):
        row, t, d = ref[i - 1], ids[i], plp[i]
        check(str(t) in d, "%s: position %d lacks its token %d: %r" % (grid, i, t, d))
        e = d[str(t)]
        worst = max(worst, abs(e["logprob"] - row[t]))
        want_rank = int((row > row[t]).sum()) + 1
        check(abs(e["rank"] - want_rank) <= 1 and (e["rank"] == want_rank or
                                                   np.sort(np.abs(row - row[t]))[1] < 1e-5),
              "%s: position %d rank %d, reference %d" % (grid, i, e["rank"], want_rank))
        order = np.argsort(-row, kind="stable")[:k]
        tops = {int(j): v for j, v in d.items() if int(j) != t or v["rank"] <= k}
        check(len(tops) == k, "%s: position %d has %d top entries, not %d: %r" % (grid, i, len(tops), k, d))
        for r, j in enumerate(order):
            if str(int(j)) in d:
                worst = max(worst, abs(d[str(int(j))]["logprob"] - row[j]))
            else:  # a near tie at the edge of the top k may swap
                check(r == k - 1 or abs(row[order[r]] - row[order[min(r + 1, k - 1)]]) < 1e-5,
                      "%s: position %d misses top %d id %d: %r" % (grid, i, r, j, d))
        ranks = sorted(v["rank"] for j, v in d.items() if int(j) != t)
        check(all(1 <= x <= k for x in ranks), "%s: top ranks %r" % (grid, ranks))
    check(worst < 1e-4, "%s: prompt logprobs differ from the float64 reference by %.3g" % (grid, worst))
    return worst


def completion(port, body, chat=False):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, hdrs, data = request(port, "POST", path, body)
    check(status == 200, "%s %r: %d %r" % (path, {k: v for k, v in body.items() if k != "prompt"}, status,
                                           data[:300]))
    return json.loads(data)


def check_echo(grid, port, ids, ref_full, n_gen):
    """echo + logprobs 2: prompt tokens then generated ones, streamed and not, the generated part as without echo."""
    body = {"prompt": PROMPT, "max_tokens": n_gen, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    plain = completion(port, body)["choices"][0]
    ch = completion(port, dict(body, echo=True))["choices"][0]
    lp, n = ch["logprobs"], len(ids)
    check(ch["text"] == PROMPT + plain["text"], "%s echo text %r" % (grid, ch["text"]))
    check(len(lp["tokens"]) == n + n_gen and len(lp["token_logprobs"]) == n + n_gen and
          len(lp["top_logprobs"]) == n + n_gen and len(lp["text_offset"]) == n + n_gen,
          "%s: echo logprobs cover %d entries for %d + %d tokens" % (grid, len(lp["tokens"]), n, n_gen))
    check(lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, "%s: first entry %r %r" %
          (grid, lp["token_logprobs"][0], lp["top_logprobs"][0]))
    worst = 0.0
    for i in range(1, n):
        worst = max(worst, abs(lp["token_logprobs"][i] - ref_full[i - 1][ids[i]]))
        want = np.sort(ref_full[i - 1])[::-1][:2]
        got = sorted(lp["top_logprobs"][i].values(), reverse=True)
        check(1 <= len(got) <= 2, "%s: echo top_logprobs at %d: %r" % (grid, i, lp["top_logprobs"][i]))
        worst = max(worst, abs(got[0] - want[0]))
    check(worst < 1e-4, "%s: echo prompt logprobs differ from the reference by %.3g" % (grid, worst))
    gen = plain["logprobs"]
    check(lp["tokens"][n:] == gen["tokens"] and
          max(abs(a - b) for a, b in zip(lp["token_logprobs"][n:], gen["token_logprobs"])) < 1e-6,
          "%s: echo changed the generated logprobs" % grid)
    offs = lp["text_offset"]
    check(offs[0] == 0 and offs[:n] == sorted(offs[:n]) and
          offs[n:] == [o + len(PROMPT) for o in gen["text_offset"]], "%s: text_offset %r" % (grid, offs))
    # streamed: the first event holds the prompt's text and tokens
    status, _, data = request(port, "POST", "/v1/completions", dict(body, echo=True, stream=True))
    check(status == 200, "%s streamed echo: %d" % (grid, status))
    events = [json.loads(x[6:]) for x in data.decode().splitlines() if x.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    toks = [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["tokens"]]
    tlps = [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["token_logprobs"]]
    check(text == ch["text"] and toks == lp["tokens"] and tlps[0] is None and
          max(abs(a - b) for a, b in zip(tlps[1:], lp["token_logprobs"][1:])) < 1e-6,
          "%s: streamed echo differs: %r %r" % (grid, text, toks[:5]))
    return worst


def test_prompt_logprobs_on_every_grid():
    ids = ref = None
    for tp, pp in GRIDS:
        grid = "%dx%d" % (tp, pp)
        port = free_port()
        with Cluster(STORIES, tp=tp, pp=pp, coord_args=["--http", "127.0.0.1:%d" % port] + COORD):
            if ids is None:
                ids = tokenize(port, PROMPT)
                check(len(ids) > 32, "the prompt is %d tokens: not over two chunks" % len(ids))
                ref = ref_logsoftmax(ids)
            # text prompt, twice: the second finds its blocks in the prefix cache and must not use them
            o = completion(port, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})  # fills the prefix cache
            for _ in range(2):
                o = completion(port, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": K})
                worst = check_prompt_lps(grid, o["choices"][0]["prompt_logprobs"], ids, ref, K)
            print("  %s: prompt_logprobs within %.2g of the float64 reference" % (grid, worst))
            # k = 0: the prompt token alone; token ids as the prompt
            o = completion(port, {"prompt": ids[:20], "max_tokens": 1, "prompt_logprobs": 0})
            plp = o["choices"][0]["prompt_logprobs"]
            check(len(plp) == 20 and all(len(d) == 1 for d in plp[1:]), "%s prompt_logprobs 0: %r" % (grid, plp[:3]))
            check(max(abs(plp[i][str(ids[i])]["logprob"] - ref[i - 1][ids[i]]) for i in range(1, 20)) < 1e-4,
                  "%s prompt_logprobs 0 differ" % grid)
            # echo with logprobs, against the reference over the prompt and what follows
            gen = completion(port, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            gen_ids = tokenize(port, PROMPT + gen["choices"][0]["text"])
            check(gen_ids[:len(ids)] == ids, "the prompt retokenizes differently")
            worst = check_echo(grid, port, ids, ref, 6)
            print("  %s: echo logprobs within %.2g of the float64 reference" % (grid, worst))
            if (tp, pp) == (2, 1):
                # chat: the response's prompt_logprobs, as many as the prompt's tokens
                o = completion(port, {"messages": CHAT, "max_tokens": 3, "prompt_logprobs": 2}, chat=True)
                plp = o.get("prompt_logprobs")
                check(isinstance(plp, list) and len(plp) == o["usage"]["prompt_tokens"] and plp[0] is None and
                      all(2 <= len(d) <= 3 for d in plp[1:]), "chat prompt_logprobs: %r" % (plp and plp[:3]))
                # n = 2 and a two-prompt batch: each choice its own prompt's
                o = completion(port, {"prompt": [PROMPT, ids[:9]], "n": 2, "max_tokens": 2, "prompt_logprobs": 1})
                lens = [len(c["prompt_logprobs"]) for c in o["choices"]]
                check(lens == [len(ids), len(ids), 9, 9], "batched prompt_logprobs lengths %r" % lens)
                check(max(abs(c["prompt_logprobs"][i][str(ids[i])]["logprob"] - ref[i - 1][ids[i]])
                          for c in o["choices"] for i in range(1, 9)) < 1e-4, "batched prompt_logprobs differ")
                # bad input: a 400 naming the field, and the server keeps serving
                base = {"prompt": PROMPT, "max_tokens": 2}
                for body, chat, name in [({"prompt_logprobs": 21}, False, "prompt_logprobs"),
                                         ({"prompt_logprobs": -1}, False, "prompt_logprobs"),
                                         ({"prompt_logprobs": 1.5}, False, "prompt_logprobs"),
                                         ({"prompt_logprobs": "2"}, False, "prompt_logprobs"),
                                         ({"prompt_logprobs": 2, "stream": True}, False, "prompt_logprobs"),
                                         ({"prompt_logprobs": 21}, True, "prompt_logprobs"),
                                         ({"echo": True, "logprobs": True}, True, "echo")]:
                    b = dict({"messages": CHAT, "max_tokens": 2} if chat else base, **body)
                    status, _, data = request(port, "POST", "/v1/chat/completions" if chat else "/v1/completions", b)
                    expect_error(status, data, 400, param=name)
                o = completion(port, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": K})
                check_prompt_lps(grid + " after bad input", o["choices"][0]["prompt_logprobs"], ids, ref, K)
                # the official openai SDK
                p = subprocess.run(["node", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "sdk_prompt_logprobs.mjs"),
                                    "http://127.0.0.1:%d/v1" % port, "sk-none", PROMPT],
                                   capture_output=True, text=True, timeout=120)
                check(p.returncode == 0, "sdk_prompt_logprobs.mjs failed: %s" % p.stderr[-1500:])
                out = json.loads(p.stdout)
                lp = out["echo"]["logprobs"]
                check(out["echo"]["text"].startswith(PROMPT) and len(lp["tokens"]) == len(ids) + 4 and
                      lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:]) and
                      lp["top_logprobs"][0] is None and all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:]),
                      "openai SDK echo + logprobs 2: %r" % out["echo"])
                check(max(abs(lp["token_logprobs"][i] - ref[i - 1][ids[i]]) for i in range(1, len(ids))) < 1e-4,
                      "openai SDK echo logprobs differ from the reference")
                check_prompt_lps(grid + " openai SDK", out["prompt_logprobs"], ids, ref, 2)
                check(out["bad"]["status"] == 400 and "prompt_logprobs" in out["bad"]["message"],
                      "openai SDK prompt_logprobs 21: %r" % out["bad"])


if __name__ == "__main__":
    run_tests([test_prompt_logprobs_on_every_grid])

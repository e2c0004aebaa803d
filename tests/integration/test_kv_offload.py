"""KV blocks that move (docs/kv-offload.md), on real processes with stories260K.

- usage.prompt_tokens_details.cached_tokens (input_tokens_details on
  /v1/responses) counts the prompt tokens whose KV was not computed for the
  request: 0 on a cold prompt; on a repeat, the full blocks the prefix cache
  held (block 16), the last position always recomputed; the same number
  streamed (the usage chunk) and not, for chat, completions and responses;
  with n = 2 the prompt's once (not the forked sibling's)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import STORIES, Cluster, check, run_tests  # noqa: E402
from test_http import KEY, free_port, post  # noqa: E402

B = 16
STORY = ("Once upon a time there was a little girl named Lily. She loved to play outside in the sun. "
         "One day she saw a big red ball in the park and ran to get it. Her friend Tom came too and "
         "they played together all day until the sun went down and it was time to go home. ")


# first letters all different: no two prompts share a block (the chat template's own tokens stay under one)
WORDS = ["Kite", "Moon", "Pear", "Rose", "Sand", "Tree", "Vase", "Wolf", "Yarn", "Goat"]


def text(word):
    """A prompt of ~100 tokens none of whose blocks another word's prompt shares."""
    return word + " " + STORY * 2


def expected_cached(prompt_tokens):
    """What a repeat finds: its full blocks, less the last position when it ends a block."""
    full = prompt_tokens // B * B
    return prompt_tokens - 1 if full == prompt_tokens else full


def call(port, path, body):
    status, data = post(port, path, body, timeout=120)
    check(status == 200, "%s %r: %d %r" % (path, body, status, data[:300]))
    return json.loads(data)


def streamed_usage(port, path, body):
    body = dict(body, stream=True, stream_options={"include_usage": True})
    status, data = post(port, path, body, timeout=120)
    check(status == 200, "%s: %d %r" % (path, status, data[:300]))
    usage = None
    for line in data.decode().split("\n"):
        if line.startswith("data: ") and line[6:] != "[DONE]":
            o = json.loads(line[6:])
            if o.get("usage"):
                usage = o["usage"]
            if o.get("response", {}).get("usage"):  # responses: response.completed
                usage = o["response"]["usage"]
    check(usage is not None, "%s: no usage chunk in %r" % (path, data[-500:]))
    return usage


def details(u):
    if "input_tokens" in u:
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens():
    port = free_port()
    with Cluster(STORIES, 1, 1, coord_args=["--http", "127.0.0.1:%d" % port, "--chat-template", "chatml",
                                            "--api-key", KEY, "--block-size", str(B)]):
        cases = [
            ("/v1/completions", lambda w: {"prompt": text(w), "max_tokens": 4, "temperature": 0}),
            ("/v1/chat/completions",
             lambda w: {"messages": [{"role": "user", "content": text(w)}], "max_tokens": 4, "temperature": 0}),
            ("/v1/responses", lambda w: {"input": text(w), "max_output_tokens": 4, "temperature": 0}),
        ]
        for k, (path, body) in enumerate(cases):
            for streamed in (0, 1):
                word = WORDS[2 * k + streamed]
                get = (lambda b: streamed_usage(port, path, b)) if streamed else (lambda b: call(port, path, b)["usage"])
                p0, c0 = details(get(body(word)))
                check(c0 == 0, "%s streamed=%d: a cold prompt says %d cached" % (path, streamed, c0))
                p1, c1 = details(get(body(word)))
                check(p1 == p0 and c1 == expected_cached(p1),
                      "%s streamed=%d: repeat of %d tokens says %d cached, want %d"
                      % (path, streamed, p1, c1, expected_cached(p1)))
        for path, body in cases[:2]:  # n = 2: the prompt counted once, cold then warm
            for streamed in (0, 1):
                word = WORDS[6 + 2 * (path == "/v1/chat/completions") + streamed]
                b = dict(body(word), n=2, temperature=0.8, seed=3)
                get = (lambda b: streamed_usage(port, path, b)) if streamed else (lambda b: call(port, path, b)["usage"])
                p0, c0 = details(get(b))
                check(c0 == 0, "%s n=2 streamed=%d: a cold prompt says %d cached" % (path, streamed, c0))
                p1, c1 = details(get(b))
                check(c1 == expected_cached(p1), "%s n=2 streamed=%d: repeat of %d tokens says %d cached, want %d"
                      % (path, streamed, p1, c1, expected_cached(p1)))


if __name__ == "__main__":
    run_tests([test_cached_tokens])

#!/usr/bin/env python3
"""Throughput of constrained decoding under load: CONC concurrent requests,
each constrained by a JSON Schema (guided_json), against the same load
unconstrained, on one grid. Both loads generate exactly --tokens tokens per
request (the schema's string is long enough; the free load uses
ignore_eos), so the ratio of generated tokens per second is the cost of the
masks: the coordinator's matcher and mask per row and step, the mask in the
plan, and its application on the workers.

    /usr/bin/python3 bench/bench_structured.py [--model DIR] [--tp 1] [--conc 32] [--tokens 64] [--rounds 2] [--reps 3]

The model defaults to stories260K (vocabulary 512: the forward pass is tiny,
so the coordinator's share is as large as it gets).
"""
import argparse
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from harness import STORIES, Cluster  # noqa: E402
from test_http import free_port, post  # noqa: E402

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000, "maxLength": 4000}},
          "required": ["story"], "additionalProperties": False}


def load(port, conc, tokens, rounds, guided):
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0.8}
    if guided:
        body["guided_json"] = SCHEMA
    else:
        body["ignore_eos"] = True
    done, errors = [], []

    def one(i):
        try:
            status, data = post(port, "/v1/completions", dict(body, seed=i), timeout=600)
            if status != 200:
                errors.append("%d %r" % (status, data[:200]))
                return
            done.append(json.loads(data)["usage"]["completion_tokens"])
        except Exception as e:  # reported below
            errors.append(str(e))

    t0 = time.time()
    for r in range(rounds):
        ts = [threading.Thread(target=one, args=(r * conc + i,)) for i in range(conc)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    wall = time.time() - t0
    if errors:
        raise SystemExit("errors: %s" % errors[:3])
    return sum(done), wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=STORIES)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--conc", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="measurements of each load, interleaved; the best counts")
    a = ap.parse_args()
    port = free_port()
    with Cluster(a.model, tp=a.tp, coord_args=["--http", "127.0.0.1:%d" % port], timeout=300):
        load(port, a.conc, a.tokens, 1, True)  # warm: the vocabulary index and the schema's masks
        load(port, a.conc, a.tokens, 1, False)
        res = {}
        for guided in (False, True) * a.reps:  # interleaved against drift in this machine's load
            toks, wall = load(port, a.conc, a.tokens, a.rounds, guided)
            res.setdefault(guided, []).append(toks / wall)
            print("%-12s %6d tokens in %6.2f s: %8.1f tokens/s" % ("guided" if guided else "free", toks, wall,
                                                                   toks / wall), flush=True)
        free, guided = max(res[False]), max(res[True])
        print("ratio guided/free (best of %d each): %.3f" % (a.reps, guided / free))


if __name__ == "__main__":
    main()

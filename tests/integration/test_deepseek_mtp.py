"""DeepSeek's MTP module as the speculative draft of the grid and `loom serve` (docs/speculative.md).

The module runs on the last stage's workers, TP-sliced like a decoder layer, reading the target's
final-normed rows where they are; each step's result carries one draft per sequence.

- A generated V3-shaped model with one MTP module (tests/reference/gen_deepseek.py --mtp 1): several
  requests at once (greedy, seeded, one with speculation off) give `loom run`'s ids without
  speculation on 1x1, 2x1 (TP 2), 1x2 (PP 2) and 2x2 expert-parallel grids, with drafts verified in
  the requests' usage and vLLM's spec_decode counters.
- The random module guesses nothing, so acceptance is checked on a variant that counts (the next
  token is the current one plus 1, the module guesses the token after the one it reads; see
  successor()): on every grid every greedy draft is accepted, and the requests' usage and /metrics
  agree (how many are tried is adaptive K's choice).
- Under preemption (a 28-block pool for three 400-token generations, 24-token steps: chunked prefills
  and re-prefills) the same ids
  and every greedy draft of the counting variant accepted, on 1x1 and 2x1.
- `loom serve` with vLLM's '{"method": "deepseek_mtp", "num_speculative_tokens": 1}' on TP 2: the same
  greedy text with and without speculation, the counters moving; every draft accepted on the counting
  variant.
- A checkpoint without an MTP module is refused at start naming num_nextn_predict_layers.
"""
import json
import os
import re
import subprocess
import sys
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import BIN, PYTHON, ROOT, SANITIZED, STORIES, Cluster, check, parse_ids, run_local, run_tests  # noqa: E402
from test_http import free_port, get_metrics, metric  # noqa: E402
from test_serve import Serve, http  # noqa: E402
import test_models  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-deepseek-mtp")
test_models.WORK = WORK
MTP = ["--speculative-method", "mtp"]
PROMPTS = ["Once upon a time", "Tom had a red ball. Tom had a", "The cat sat on the mat. The dog"]
N = 32


def v3_mtp():
    out = os.path.join(WORK, "deepseek_v3-mtp")
    if not os.path.exists(os.path.join(out, "config.json")):
        subprocess.run([PYTHON, os.path.join(ROOT, "tests", "reference", "gen_deepseek.py"), "--out", out,
                        "--shape", "v3", "--seed", "5", "--mtp", "1", "--tokenizer-from", STORIES],
                       check=True, capture_output=True, timeout=300)
    return out


def successor(model):
    """A variant of model whose next token is the current one plus 1 (mod the vocabulary), and whose
    MTP module guesses the token after the one it reads: the LM heads are the embedding shifted by a
    row, the decoder layers' outputs (o_proj, the MLPs' and experts' down_proj) scaled by 0.02 so the
    residual stays the token's embedding while every layer still adds to it, and eh_proj passes the
    embedding half through. A draft is then right exactly when the module read the token after its
    position (the id sampled there), at the right row, through the vocabulary-sliced head."""
    def edit(hdr, raw):
        t = {k: np.frombuffer(v, dtype="<f4").reshape(hdr[k]["shape"]).copy() for k, v in raw.items()}
        dim = t["model.embed_tokens.weight"].shape[1]
        shifted = np.roll(t["model.embed_tokens.weight"], 1, axis=0)  # row j = embedding j - 1
        t["lm_head.weight"] = t["model.layers.5.shared_head.head.weight"] = shifted
        for k in ("model.norm.weight", "model.layers.5.shared_head.norm.weight", "model.layers.5.enorm.weight"):
            t[k] = np.ones(dim, np.float32)
        t["model.layers.5.eh_proj.weight"] = np.hstack([np.eye(dim), np.zeros((dim, dim))]).astype(np.float32)
        for k in t:
            if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
                t[k] *= 0.02
        for k in raw:
            raw[k] = t[k].astype("<f4").tobytes()
    return test_models.variant("deepseek-mtp-successor", model, tensors=edit)


def usage(err):
    """loom generate's speculation line: (draft tokens, accepted), or None."""
    m = re.search(r"^speculative: (\d+) draft tokens, (\d+) accepted", err, re.M)
    return (int(m.group(1)), int(m.group(2))) if m else None


def served(model, tp, pp, coord, expect, seeded):
    """The requests at once on one grid: ids as expected; returns ({request: usage}, /metrics drafted,
    accepted)."""
    port = free_port()
    use = {}
    with Cluster(model, tp, pp, coord_args=MTP + coord + ["--http", "127.0.0.1:%d" % port]) as c:
        procs = [(p, c.generate_async(p, N, extra=["--ignore-eos"])) for p in PROMPTS]
        procs.append(("seeded", c.generate_async(PROMPTS[1], N, 0.9, extra=["--ignore-eos", "--seed", "7"])))
        procs.append(("off", c.generate_async(PROMPTS[2], N, extra=["--ignore-eos", "--no-speculation"])))
        for p, proc in procs:
            out, err = proc.communicate(timeout=180)
            check(proc.returncode == 0, "%dx%d: generate failed: %s" % (tp, pp, err))
            want = seeded if p == "seeded" else expect[PROMPTS[2]] if p == "off" else expect[p]
            check(parse_ids(err) == want, "%dx%d %r: ids %s differ from loom run's %s" % (tp, pp, p, parse_ids(err),
                                                                                       want))
            use[p] = usage(err) or (0, 0)
            if p == "off":
                check(usage(err) is None, "speculation reported for a request that turned it off: %r" % err)
        _, samples = get_metrics(port)
        # the module reads the target's embedding where the last stage holds it (one stage), else its own
        logs = "".join(c.log("worker-%d" % i) for i in range(tp * pp))
        want = "the embedding shared with the target" if pp == 1 else "its own copy of the embedding"
        loads = re.findall(r"MTP module loaded as the speculative draft: .*\((.*)\)", logs)
        check(loads == [want] * tp, "%dx%d: the last stage's ranks loaded the module as %s" % (tp, pp, loads))
        return (use, metric(samples, "vllm:spec_decode_num_draft_tokens_total"),
                metric(samples, "vllm:spec_decode_num_accepted_tokens_total"))


def test_grids():
    model = v3_mtp()
    expect = {p: run_local(model, p, N, extra=["--ignore-eos"])[1] for p in PROMPTS}
    seeded = run_local(model, PROMPTS[1], N, temperature=0.9, extra=["--ignore-eos", "--seed", "7"])[1]
    grids = [(1, 1, []), (2, 1, []), (1, 2, []), (2, 2, ["--expert-parallel"])]
    for tp, pp, coord in grids[1:2] if SANITIZED else grids:
        use, m_drafted, m_accepted = served(model, tp, pp, coord, expect, seeded)
        drafted, accepted = sum(u[0] for u in use.values()), sum(u[1] for u in use.values())
        print("  %dx%d%s: ids equal loom run's; %d draft tokens in the requests' usage, /metrics %d drafted, "
              "%d accepted" % (tp, pp, "".join(" " + a for a in coord), drafted, m_drafted, m_accepted), flush=True)
        check(drafted > 0 and m_drafted == drafted and m_accepted == accepted <= drafted,
              "%dx%d: %d draft tokens in usage, %d in /metrics" % (tp, pp, drafted, m_drafted))


def test_acceptance():
    model = successor(v3_mtp())
    expect = {p: run_local(model, p, N, extra=["--ignore-eos"])[1] for p in PROMPTS}
    seeded = run_local(model, PROMPTS[1], N, temperature=0.9, extra=["--ignore-eos", "--seed", "7"])[1]
    ids = expect[PROMPTS[0]]
    check(all(b == (a + 1) % 512 for a, b in zip(ids, ids[1:])), "the successor model does not count: %s" % ids)
    grids = [(1, 1, []), (2, 1, []), (1, 2, []), (2, 2, ["--expert-parallel"])]
    for tp, pp, coord in grids[:2] if SANITIZED else grids:
        use, m_drafted, m_accepted = served(model, tp, pp, coord, expect, seeded)
        greedy = [use[p] for p in PROMPTS]
        print("  successor %dx%d%s: greedy requests %s (draft tokens, accepted), seeded %s; /metrics %d of %d"
              % (tp, pp, "".join(" " + a for a in coord), greedy, use["seeded"], m_accepted, m_drafted), flush=True)
        # every greedy draft is right; usage and vLLM's counters agree
        check(sum(u[0] for u in greedy) > 0 and all(u[0] == u[1] for u in greedy) and
              m_drafted == sum(u[0] for u in use.values()) and m_accepted == sum(u[1] for u in use.values()),
              "%dx%d: greedy %s, /metrics %d of %d" % (tp, pp, greedy, m_accepted, m_drafted))
    # one greedy request alone: every draft accepted (how many are tried is adaptive K's choice: on a
    # model this small a verify row costs about what a step does, so it probes rarely)
    with Cluster(model, 1, 1, coord_args=MTP) as c:
        rc, _, ids, err = c.generate(PROMPTS[0], N, extra=["--ignore-eos"])
        u = usage(err)
        check(rc == 0 and ids == expect[PROMPTS[0]] and u and u[0] > 0 and u[1] == u[0],
              "one request: rc %d, %r" % (rc, err[-500:]))


def test_preemption():
    """Three 400-token generations at once over a pool of 28 blocks of 16 (one needs 26) and 24-token
    steps: chunked prefills (the module's rows past a chunk read StepPlan.mtp_next), preemptions and
    re-prefills; the same ids, and the counting variant's greedy drafts still all accepted."""
    model = successor(v3_mtp())
    n = 400
    expect = {p: run_local(model, p, n, extra=["--ignore-eos"])[1] for p in PROMPTS}
    for tp in (1, 2):
        port = free_port()
        with Cluster(model, tp, 1, coord_args=MTP + ["--num-kv-blocks", "28", "--block-size", "16",
                                                     "--max-num-batched-tokens", "24",
                                                     "--http", "127.0.0.1:%d" % port]) as c:
            procs = [(p, c.generate_async(p, n, extra=["--ignore-eos"])) for p in PROMPTS]
            use = []
            for p, proc in procs:
                out, err = proc.communicate(timeout=300)
                check(proc.returncode == 0 and parse_ids(err) == expect[p],
                      "%dx1 %r: ids differ from loom run's: %s" % (tp, p, err[-300:]))
                use.append(usage(err) or (0, 0))
            _, samples = get_metrics(port)
            pre = metric(samples, "vllm:num_preemptions_total")
        print("  %dx1, 28 blocks: %d preemptions, drafts %s (draft tokens, accepted)" % (tp, pre, use), flush=True)
        check(pre > 0 and sum(u[0] for u in use) > 0 and all(u[0] == u[1] for u in use),
              "%dx1: %d preemptions, drafts %s" % (tp, pre, use))


def metrics_value(port, name):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=30) as r:
        text = r.read().decode()
    vals = [float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(name) and line[len(name)] in " {"]
    return vals[0] if vals else None


def test_serve():
    model = v3_mtp()
    cfg = json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 1})
    body = {"model": os.path.basename(model), "prompt": PROMPTS[1], "max_tokens": N, "temperature": 0,
            "ignore_eos": True}
    with Serve("--speculative-config", cfg, "--tensor-parallel-size", "2", model=model) as s:
        s.wait_ready()
        check("MTP module loaded as the speculative draft" in s.log(), "no MTP module loaded: %s" % s.log()[-2000:])
        st, on = http(s.port, "POST", "/v1/completions", body, key=None)
        st2, off = http(s.port, "POST", "/v1/completions", dict(body, speculative=False), key=None)
        check(st == st2 == 200 and on["choices"][0]["text"] == off["choices"][0]["text"],
              "speculation changed the text: %s %s" % (on, off))
        drafted = metrics_value(s.port, "vllm:spec_decode_num_draft_tokens_total")
        check(drafted and drafted > 0, "no drafts in /metrics: %s" % drafted)
    with Serve("--speculative-config", cfg, "--tensor-parallel-size", "2", model=successor(model)) as s:
        s.wait_ready()
        st, on = http(s.port, "POST", "/v1/completions", dict(body, model="bad-deepseek-mtp-successor"), key=None)
        check(st == 200, "completion failed: %s" % on)
        acc = metrics_value(s.port, "vllm:spec_decode_num_accepted_tokens_total")
        drafted = metrics_value(s.port, "vllm:spec_decode_num_draft_tokens_total")
        check(acc and acc == drafted, "accepted drafts in /metrics: %s of %s" % (acc, drafted))


def test_refused():
    p = subprocess.run([os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES, "--listen",
                        "tcp://127.0.0.1:%d" % free_port(), "--control", "tcp://127.0.0.1:%d" % free_port()] + MTP,
                       capture_output=True, text=True, timeout=60)
    check(p.returncode != 0 and "num_nextn_predict_layers >= 1" in p.stderr, "coordinator: %r" % p.stderr)
    p = subprocess.run([os.path.join(BIN, "loom"), "serve", STORIES, "--port", "0", "--speculative-config",
                        '{"method": "deepseek_mtp", "num_speculative_tokens": 1}'],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode != 0 and "num_nextn_predict_layers >= 1" in p.stderr, "loom serve: %r" % p.stderr[-800:])


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_refused, test_grids, test_acceptance, test_preemption, test_serve])

"""DeepSeek's MTP module as the speculative draft of the grid and `loom serve` (docs/speculative.md).

The module runs on the last stage's workers, TP-sliced like a decoder layer, reading the target's
final-normed rows where they are; each step's result carries one draft per sequence.

- A generated V3-shaped model with one MTP module (tests/reference/gen_deepseek.py --mtp 1): several
  requests at once (greedy, seeded, one with speculation off) give `loom run`'s ids without
  speculation on 1x1, 2x1 (TP 2), 1x2 (PP 2) and 2x2 expert-parallel grids, with drafts verified in
  the requests' usage and vLLM's spec_decode counters.
- The random module guesses nothing, so acceptance is checked on a variant whose final norms (the
  target's and the module's shared_head.norm) are zero: every logit is 0, greedy decoding repeats one
  id and the module drafts it; there every draft is accepted, and usage, /metrics and tokens per
  target step say so (how many are tried is adaptive K's choice).
- `loom serve` with vLLM's '{"method": "deepseek_mtp", "num_speculative_tokens": 1}' on TP 2: the same
  greedy text with and without speculation, the counters moving.
- A checkpoint without an MTP module is refused at start naming num_nextn_predict_layers.
"""
import json
import os
import re
import struct
import subprocess
import sys
import urllib.request

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


def constant_head(model):
    """model with the target's and the module's final norms zeroed: every logit 0."""
    def zero_norms(hdr, raw):
        for name in ("model.norm.weight", "model.layers.5.shared_head.norm.weight"):
            check(name in raw, "%s missing" % name)
            raw[name] = struct.pack("<%df" % (len(raw[name]) // 4), *([0.0] * (len(raw[name]) // 4)))
    return test_models.variant("deepseek-mtp-constant", model, tensors=zero_norms)


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
    model = constant_head(v3_mtp())
    expect = {p: run_local(model, p, N, extra=["--ignore-eos"])[1] for p in PROMPTS}
    seeded = run_local(model, PROMPTS[1], N, temperature=0.9, extra=["--ignore-eos", "--seed", "7"])[1]
    check(len(set(expect[PROMPTS[0]])) == 1, "the constant-head model does not repeat one id: %s" % expect[PROMPTS[0]])
    for tp, pp, coord in [(1, 1, []), (2, 1, [])]:
        use, m_drafted, m_accepted = served(model, tp, pp, coord, expect, seeded)
        greedy = [use[p] for p in PROMPTS]
        print("  constant head %dx%d: greedy requests %s (draft tokens, accepted), seeded %s; /metrics %d of %d"
              % (tp, pp, greedy, use["seeded"], m_accepted, m_drafted), flush=True)
        # greedy requests accept every draft; the seeded one samples uniformly over the vocabulary
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
    with Serve("--speculative-config", cfg, model=constant_head(model)) as s:
        s.wait_ready()
        st, on = http(s.port, "POST", "/v1/completions", dict(body, model="bad-deepseek-mtp-constant"), key=None)
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
    run_tests([test_refused, test_grids, test_acceptance, test_serve])

"""Speculative decoding in `loom run` (ngram prompt lookup): the ids are the
same as without speculation (greedy and seeded sampling, any K, tiny
chunks and contexts, max_tokens and EOS respected), the acceptance and
`tokens per target step` lines are printed, and bad settings are refused
with a clear message."""
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import json  # noqa: E402
from test_http import free_port, get_metrics, metric, post  # noqa: E402
from harness import BIN, STORIES, Cluster, check, gen_model, kill, parse_ids, run_local, run_tests  # noqa: E402
from test_grammar_load import turn_buckets, turn_stats  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-spec")
LOOM = os.path.join(BIN, "loom")
PROMPTS = [
    "Once upon a time",
    "Tom had a red ball. Tom had a red ball. Tom had a",
    "The cat sat on the mat. The dog sat on the log. The cat",
]


def run(model, prompt, *extra, max_tokens=80, temperature="0", env=None):
    p = subprocess.run([LOOM, "run", "--model", model, "--prompt", prompt, "--max-tokens", str(max_tokens),
                        "--temperature", temperature, "--threads", "1", "--ids"] + list(extra),
                       capture_output=True, text=True, timeout=120, env=env)
    check(p.returncode == 0, "loom run failed: %s" % p.stderr)
    return p.stdout, parse_ids(p.stderr), p.stderr


def tokens_per_step(stderr):
    m = re.search(r"^tokens per target step: (\d+\.\d\d)$", stderr, re.M)
    check(m, "no 'tokens per target step' line: %r" % stderr)
    check(re.search(r"acceptance rate \d+\.\d%", stderr), "no acceptance rate: %r" % stderr)
    return float(m.group(1))


def test_greedy_identical():
    best = 0.0
    for prompt in PROMPTS:
        _, base, err = run(STORIES, prompt, "--ignore-eos")
        check(len(base) == 80, "expected 80 ids, got %d" % len(base))
        check("tokens per target step" not in err, "speculation line printed with speculation off")
        for extra in (["--num-speculative-tokens", "1"], ["--num-speculative-tokens", "4"],
                      ["--num-speculative-tokens", "16", "--speculative-fixed-k"],
                      ["--num-speculative-tokens", "8", "--ngram-min", "2", "--ngram-max", "3"],
                      ["--num-speculative-tokens", "16", "--speculative-fixed-k", "--chunk", "3"]):
            _, ids, err = run(STORIES, prompt, "--ignore-eos", "--speculative-method", "ngram", *extra)
            check(ids == base, "%r %s: ids differ from non-speculative\n%s\n%s" % (prompt, extra, base, ids))
            best = max(best, tokens_per_step(err))
    check(best > 1.2, "ngram never got more than one token per target step (best %.2f)" % best)


def test_reference_story():
    # the reference implementation's greedy continuation (as in test_cli.py)
    out, _, _ = run(STORIES, "Once upon a time", "--speculative-method", "ngram", max_tokens=64)
    check(out.startswith(", there was a little girl named Lily. She loved to play outside in the park."),
          "not the reference story: %r" % out)


def test_sampled_identical():
    # the rule accepts a draft iff the row's seeded sample equals it, so the
    # same seed gives the same ids with speculation on and off
    for prompt in PROMPTS[1:]:
        for seed, extra in ((3, []), (4, ["--top-k", "0", "--top-p", "1"]), (5, ["--top-p", "0.5"])):
            args = ["--seed", str(seed), "--ignore-eos"] + extra
            _, base, _ = run(STORIES, prompt, *args, temperature="0.9")
            _, ids, _ = run(STORIES, prompt, *args, "--speculative-method", "ngram", "--num-speculative-tokens",
                            "6", temperature="0.9")
            check(ids == base, "seed %d %s: sampled ids differ" % (seed, extra))


def test_limits():
    prompt = PROMPTS[1]
    for n in (1, 2, 5, 17):  # never more than asked, whatever K
        _, ids, _ = run(STORIES, prompt, "--ignore-eos", "--speculative-method", "ngram",
                        "--num-speculative-tokens", "16", "--speculative-fixed-k", max_tokens=n)
        check(len(ids) == n, "max_tokens %d gave %d ids" % (n, len(ids)))
    # a context that ends mid-draft: the same ids as without speculation
    _, base, _ = run(STORIES, prompt, "--ignore-eos", "--ctx", "40", max_tokens=200)
    _, ids, _ = run(STORIES, prompt, "--ignore-eos", "--ctx", "40", "--speculative-method", "ngram",
                    "--num-speculative-tokens", "16", "--speculative-fixed-k", max_tokens=200)
    check(ids == base and len(ids) > 0, "context limit: %s vs %s" % (base, ids))
    # stopping at EOS: same ids, EOS last
    _, base, _ = run(STORIES, PROMPTS[0], max_tokens=400)
    _, ids, _ = run(STORIES, PROMPTS[0], "--speculative-method", "ngram", max_tokens=400)
    check(ids == base, "EOS stop: ids differ")


def test_gqa_random_model():
    # a random GQA model with other shapes (stories260K's tokenizer)
    model = gen_model(os.path.join(WORK, "spec-gqa"), "--dim", "96", "--hidden-dim", "160", "--layers", "3",
                      "--heads", "6", "--kv-heads", "2", "--vocab", "512", "--seed", "19")
    for prompt in PROMPTS[1:]:
        _, base, _ = run(model, prompt, "--ignore-eos", max_tokens=60)
        _, ids, _ = run(model, prompt, "--ignore-eos", "--speculative-method", "ngram",
                        "--num-speculative-tokens", "8", "--speculative-fixed-k", max_tokens=60)
        check(ids == base, "random GQA model: ids differ")


def test_draft_self_int8():
    # a quantized self-draft: the same ids (greedy and seeded), and with int8
    # at least 2.5 tokens per target step
    best = 0.0
    for prompt in PROMPTS:
        _, base, _ = run(STORIES, prompt, "--ignore-eos", max_tokens=96)
        for q in ("int8", "q4"):
            _, ids, err = run(STORIES, prompt, "--ignore-eos", "--speculative-method", "draft",
                              "--speculative-quantization", q, "--num-speculative-tokens", "4", max_tokens=96)
            check(ids == base, "%r draft %s: ids differ" % (prompt, q))
            if q == "int8":  # the draft's acceptance, past the wall-time gate (which may turn it off here)
                _, ids, err = run(STORIES, prompt, "--ignore-eos", "--speculative-method", "draft",
                                  "--speculative-quantization", q, "--num-speculative-tokens", "4",
                                  "--speculative-fixed-k", max_tokens=96)
                check(ids == base, "%r draft %s, fixed K: ids differ" % (prompt, q))
                best = max(best, tokens_per_step(err))
    check(best >= 2.5, "int8 self-draft: %.2f tokens per target step" % best)
    _, base, _ = run(STORIES, PROMPTS[0], "--ignore-eos", "--seed", "9", max_tokens=64, temperature="0.8")
    _, ids, _ = run(STORIES, PROMPTS[0], "--ignore-eos", "--seed", "9", "--speculative-method", "draft",
                    "--speculative-quantization", "int8", "--speculative-fixed-k", max_tokens=64, temperature="0.8")
    check(ids == base, "seeded sampling with the int8 self-draft: ids differ")
    # a separate draft checkpoint with the same vocabulary (a random model: few accepted, same ids)
    draft = gen_model(os.path.join(WORK, "spec-draft"), "--dim", "32", "--hidden-dim", "64", "--layers", "2",
                      "--heads", "4", "--vocab", "512", "--seed", "5")
    _, ids, err = run(STORIES, PROMPTS[1], "--ignore-eos", "--speculative-method", "draft", "--speculative-model",
                      draft, "--speculative-fixed-k", max_tokens=64)
    _, base, _ = run(STORIES, PROMPTS[1], "--ignore-eos", max_tokens=64)
    check(ids == base and "tokens per target step" in err, "draft model: ids differ")


def test_draft_expensive():
    # a draft made expensive by the test hook (each draft forward of the
    # start-up estimate, and each proposal, sleeps 30 ms, ~100 target steps
    # of this model): the gate starts off and the draft runs no forward but
    # the estimate's 3 (no prefill of the prompt); the ids are the same
    _, base, _ = run(STORIES, PROMPTS[0], "--ignore-eos", max_tokens=96)
    env = dict(os.environ, LOOM_TEST_DRAFT_DELAY_MS="30")
    _, ids, err = run(STORIES, PROMPTS[0], "--ignore-eos", "--speculative-method", "draft",
                      "--speculative-quantization", "int8", max_tokens=96, env=env)
    check(ids == base, "expensive draft: ids differ")
    m = re.search(r"speculative draft: (\d+) drafts", err)
    gate = re.search(r"speculation gate: (\w+) .*turned off (\d+).*drafting started off: at best ([\d.]+)x", err)
    fwd = re.search(r"draft model: (\d+) forwards, (\d+) tokens read", err)
    check(m and gate and fwd, "no speculation lines in: %s" % err[-400:])
    check(gate.group(1) == "off" and float(gate.group(3)) < 1.0, "the gate did not start off: %s" % gate.group(0))
    check(int(m.group(1)) == 0 and fwd.group(1) == "3" and fwd.group(2) == "3",
          "expensive draft: %s drafting steps, %s" % (m.group(1), fwd.group(0)))
    # without the estimate (another test hook) the gate drafts after its
    # warm-up, turns off, and its probe 64 plain steps later catches up
    # with the last 64 tokens only (it missed more)
    env["LOOM_TEST_SPEC_NO_ESTIMATE"] = "1"
    _, ids, err = run(STORIES, PROMPTS[0], "--ignore-eos", "--speculative-method", "draft",
                      "--speculative-quantization", "int8", max_tokens=96, env=env)
    check(ids == base, "expensive draft without the estimate: ids differ")
    m = re.search(r"speculative draft: (\d+) drafts", err)
    gate = re.search(r"speculation gate: (\w+) .*turned off (\d+)", err)
    probe = re.search(r"a probe's catch-up: (\d+) at most", err)
    check(m and gate and probe, "no speculation lines in: %s" % err[-400:])
    check(gate.group(1) == "off" and int(gate.group(2)) >= 1, "the gate did not turn off: %s" % gate.group(0))
    check(probe.group(1) == "64", "a probe's catch-up read %s tokens" % probe.group(1))
    # warm-up 3 plain, then at most 5 drafting steps (1 unmeasured), a probe of 3 after 64 plain steps
    check(int(m.group(1)) <= 12, "expensive draft: %s drafting steps of 96 tokens" % m.group(1))


def other_tokenizer_draft():
    """A draft with the target's vocabulary size and special ids but another tokenizer (two pieces swapped)."""
    d = gen_model(os.path.join(WORK, "spec-othertok"), "--dim", "32", "--hidden-dim", "64", "--layers", "1",
                  "--heads", "4", "--vocab", "512", "--seed", "4")
    with open(os.path.join(STORIES, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    by_id = {i: p for p, i in vocab.items()}
    a, b = by_id[300], by_id[301]
    vocab[a], vocab[b] = 301, 300
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    return d, "token 300 is '%s' in the draft's and '%s' in the target's" % (b, a)


def test_bad_input():
    othertok, othertok_msg = other_tokenizer_draft()
    for extra, want in ((["--num-speculative-tokens", "0"], "[1, 16]"),
                        (["--num-speculative-tokens", "64"], "[1, 16]"),
                        (["--speculative-method", "eagle"], "must be none, ngram, draft or mtp"),
                        (["--speculative-method", "mtp"], "an MTP draft needs a DeepSeek checkpoint"),
                        (["--speculative-config", '{"method": "deepseek_mtp"}'], "an MTP draft needs a DeepSeek"),
                        (["--speculative-config", '{"method": "eagle"}'], "method 'eagle' is not supported"),
                        (["--speculative-method", "ngram", "--ngram-min", "4", "--ngram-max", "2"], "ngram_min"),
                        (["--speculative-method", "draft"], "needs --speculative-model"),
                        (["--speculative-quantization", "int8"], "need --speculative-method draft"),
                        (["--speculative-method", "draft", "--speculative-quantization", "int3"], "int3"),
                        (["--speculative-method", "draft", "--speculative-model", "/nonexistent"],
                         "the draft model /nonexistent cannot be loaded"),
                        (["--speculative-method", "draft", "--speculative-model",
                          gen_model(os.path.join(WORK, "spec-v1024"), "--dim", "32", "--hidden-dim", "64", "--layers",
                                    "1", "--heads", "4", "--vocab", "1024", "--seed", "3")],
                         "vocabulary of 1024 tokens, the target's has 512"),
                        (["--speculative-method", "draft", "--speculative-model", othertok], othertok_msg)):
        p = subprocess.run([LOOM, "run", "--model", STORIES, "--prompt", "hi"] + extra,
                           capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and want in p.stderr and "Traceback" not in p.stderr,
              "%s: rc %d, %r" % (extra, p.returncode, p.stderr))
    # the coordinator refuses them too, also when `loom serve` passes them on
    v1024 = os.path.join(WORK, "spec-v1024")
    for extra, want in ((["--num-speculative-tokens", "64"], "[1, 16]"),
                        (["--speculative-method", "eagle"], "must be none, ngram, draft or mtp"),
                        (["--speculative-method", "mtp"], "needs a DeepSeek checkpoint"),
                        (["--speculative-method", "draft"], "needs --speculative-model"),
                        (["--speculative-quantization", "int8"], "need --speculative-method draft"),
                        (["--speculative-device", "cuda:0"], "need --speculative-method draft"),
                        (["--speculative-method", "draft", "--speculative-quantization", "int8",
                          "--speculative-device", "tpu:0"], "unknown device 'tpu:0'"),
                        (["--speculative-method", "draft", "--speculative-quantization", "int8",
                          "--speculative-device", "cuda:9"], "cannot be loaded"),
                        (["--speculative-method", "draft", "--speculative-quantization", "int3"], "int3"),
                        (["--speculative-method", "draft", "--speculative-model", "/nonexistent"],
                         "cannot be loaded"),
                        (["--speculative-method", "draft", "--speculative-model", v1024],
                         "vocabulary of 1024 tokens, the target's has 512"),
                        (["--speculative-method", "draft", "--speculative-model", othertok], othertok_msg)):
        p = subprocess.run([os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES, "--listen",
                            "tcp://127.0.0.1:%d" % free_port(), "--control", "tcp://127.0.0.1:%d" % free_port(),
                            ] + extra, capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and want in p.stderr and "Sanitizer" not in p.stderr,
              "coordinator %s: rc %d, %r" % (extra, p.returncode, p.stderr))
    p = subprocess.run([LOOM, "serve", STORIES, "--port", "0", "--speculative-method", "ngram",
                        "--num-speculative-tokens", "0"], capture_output=True, text=True, timeout=120)
    check(p.returncode != 0 and "[1, 16]" in p.stderr, "loom serve with K 0: rc %d, %r" % (p.returncode, p.stderr[-500:]))
    p = subprocess.run([LOOM, "serve", STORIES, "--port", "0", "--speculative-method", "draft",
                        "--speculative-quantization", "int8", "--speculative-device", "tpu:0"],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode != 0 and "unknown device 'tpu:0'" in p.stderr,
          "loom serve --speculative-device tpu:0: rc %d, %r" % (p.returncode, p.stderr[-500:]))


GRID_PROMPTS = PROMPTS + ["Lily and Ben went to the park. They saw", "Once upon a time, there was a boy. The boy"]
SPEC_ARGS = ["--speculative-method", "ngram", "--num-speculative-tokens", "8"]


def grid_identity(spec_args, grids=((1, 1), (2, 1), (1, 2), (2, 2)), min_best=1.0, accepts=True):
    """Several requests at once on each grid (a batch mix of decodes, drafts
    and prefills): greedy and seeded ids equal `loom run` without
    speculation; returns the best tokens per target step seen."""
    n = 48
    expect = {p: run_local(STORIES, p, n, extra=["--ignore-eos"])[1] for p in GRID_PROMPTS}
    seeded = run_local(STORIES, GRID_PROMPTS[1], n, temperature=0.9, extra=["--ignore-eos", "--seed", "7"])[1]
    best = 0.0
    for tp, pp in grids:
        port = free_port()
        with Cluster(STORIES, tp, pp, coord_args=spec_args + ["--http", "127.0.0.1:%d" % port]) as c:
            procs = [(p, c.generate_async(p, n, extra=["--ignore-eos"])) for p in GRID_PROMPTS]
            procs.append(("seeded", c.generate_async(GRID_PROMPTS[1], n, 0.9, extra=["--ignore-eos", "--seed", "7"])))
            procs.append(("off", c.generate_async(GRID_PROMPTS[2], n, extra=["--ignore-eos", "--no-speculation"])))
            lines = 0
            for p, proc in procs:
                out, err = proc.communicate(timeout=120)
                m = re.search(r"^tokens per target step: (\d+\.\d\d)$", err, re.M)
                if p != "off" and m:
                    lines += 1
                    best = max(best, float(m.group(1)))
                if p == "off":
                    check("tokens per target step" not in err, "speculation reported for a request that turned it off")
                check(proc.returncode == 0, "%dx%d: generate failed: %s" % (tp, pp, err))
                want = seeded if p == "seeded" else expect[GRID_PROMPTS[2]] if p == "off" else expect[p]
                check(parse_ids(err) == want, "%dx%d %r: ids %s differ from loom run %s" %
                      (tp, pp, p, parse_ids(err), want))
            check(lines > 0, "%dx%d: loom generate printed no 'tokens per target step' line" % (tp, pp))
            # max_tokens is never exceeded, and a short one ends exactly
            rc, _, ids, err = c.generate(GRID_PROMPTS[1], 3, extra=["--ignore-eos"])
            check(rc == 0 and ids == expect[GRID_PROMPTS[1]][:3], "%dx%d: max_tokens 3 gave %s" % (tp, pp, ids))
            # vLLM's spec_decode counters: drafts were verified and some accepted
            _, samples = get_metrics(port)
            drafts = metric(samples, "vllm:spec_decode_num_draft_tokens_total")
            acc = metric(samples, "vllm:spec_decode_num_accepted_tokens_total")
            pos0 = metric(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0")
            last = str(int(spec_args[spec_args.index("--num-speculative-tokens") + 1]) - 1)
            pos7 = metric(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=last)
            check(metric(samples, "vllm:spec_decode_num_drafts_total") > 0 and drafts >= acc and (acc > 0 or not accepts),
                  "%dx%d: %s draft tokens, %s accepted" % (tp, pp, drafts, acc))
            check(pos0 >= pos7 and (pos0 > 0 or not accepts), "per-position acceptance %s .. %s" % (pos0, pos7))
    check(best >= min_best, "%s: best %.2f tokens per target step, want >= %.2f" % (spec_args, best, min_best))
    return best


def test_grids():
    grid_identity(SPEC_ARGS)


def test_grids_draft():
    # method draft on the grid: the draft runs in the coordinator (an int8
    # self-draft; three slots for the seven requests, so some decode without
    # drafts), the same ids on every grid; then separate draft checkpoints:
    # one that agrees (the target's own f32 weights) and a random one that
    # (almost) never does. K is fixed: the wall-time gate would (rightly)
    # turn off a draft as dear as its target, and these check drafts verified
    best = grid_identity(["--speculative-method", "draft", "--speculative-quantization", "int8",
                          "--num-speculative-tokens", "4", "--speculative-max-seqs", "3",
                          "--speculative-fixed-k"], min_best=2.0)
    print("int8 self-draft on the grids: best %.2f tokens per target step" % best)
    best = grid_identity(["--speculative-method", "draft", "--speculative-model", STORIES,
                          "--num-speculative-tokens", "6", "--speculative-threads", "2",
                          "--speculative-device", "cpu", "--speculative-fixed-k"], grids=((1, 2),), min_best=3.0)
    print("the target's checkpoint as the draft, 1x2: best %.2f tokens per target step" % best)
    draft = gen_model(os.path.join(WORK, "spec-draft"), "--dim", "32", "--hidden-dim", "64", "--layers", "2",
                      "--heads", "4", "--vocab", "512", "--seed", "5")
    grid_identity(["--speculative-method", "draft", "--speculative-model", draft, "--num-speculative-tokens", "2"],
                  grids=((2, 1),), accepts=False)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer"},
                                           "pet": {"enum": ["cat", "dog", "bird"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


def test_controls_identical(tp=1, pp=1, spec_args=SPEC_ARGS + ["--speculative-fixed-k"]):
    # rows with penalties, logit_bias, min_tokens or a grammar mask speculate
    # too (each verify row's controls see the earlier drafts as output):
    # the same ids, logprobs and text with speculation on and off
    port = free_port()
    with Cluster(STORIES, tp, pp, coord_args=spec_args + ["--http", "127.0.0.1:%d" % port]) as c:
        best = 0.0
        # ngram drafts repeat earlier ids, so presence and repetition penalties
        # see the same set with or without them: the frequency counts, bans and
        # masks are what a verify row gets wrong if it ignores its drafts (the
        # seeded cases below differ then)
        cases = [(PROMPTS[1], 0.0, ["--frequency-penalty", "-1", "--ignore-eos"]),
                 (PROMPTS[2], 0.0, ["--repetition-penalty", "0.8", "--logit-bias", "13:-2", "--min-tokens", "60"]),
                 (PROMPTS[0], 0.9, ["--seed", "11", "--frequency-penalty", "-1", "--ignore-eos"]),
                 (PROMPTS[1], 0.9, ["--seed", "12", "--frequency-penalty", "-1.5", "--ignore-eos"]),
                 (PROMPTS[2], 0.9, ["--seed", "12", "--frequency-penalty", "-1.5", "--repetition-penalty", "1.05", "--ignore-eos"])]
        for prompt, temp, ctl in cases:
            outs = []
            for off in ([], ["--no-speculation"]):
                rc, _, ids, err = c.generate(prompt, 64, temp, extra=ctl + off)
                check(rc == 0, "generate %s failed: %s" % (ctl, err))
                outs.append(ids)
                if not off:
                    m = re.search(r"^tokens per target step: (\d+\.\d\d)$", err, re.M)
                    check(m, "no 'tokens per target step' for a request with controls %s" % ctl)
                    best = max(best, float(m.group(1)))
            check(outs[0] == outs[1], "%r %s: ids differ with speculation\n%s\n%s" % (prompt, ctl, outs[0], outs[1]))
        check(best > 1.2, "rows with sampling controls were not speculated (best %.2f)" % best)
        _, samples = get_metrics(port)
        drafts0 = metric(samples, "vllm:spec_decode_num_draft_tokens_total")
        # a json_schema request (greedy and seeded) and logprobs: the same text and logprobs
        for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                      "temperature": 0},
                     {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                      "temperature": 0.8, "seed": 5},
                     {"guided_json": PERSON, "temperature": 0.7, "seed": 2, "frequency_penalty": 0.2},
                     {"prompt": PROMPTS[1], "temperature": 0, "logprobs": 2, "presence_penalty": 0.1,
                      "ignore_eos": True}):
            got = []
            for spec in (True, False):
                b = dict({"prompt": PROMPTS[0], "max_tokens": 64, "speculative": spec}, **body)
                status, data = post(port, "/v1/completions", b, timeout=120)
                check(status == 200, "%r: %d %r" % (body, status, data[:300]))
                ch = json.loads(data)["choices"][0]
                got.append((ch["text"], ch["finish_reason"], ch.get("logprobs")))
            check(got[0] == got[1], "%r: speculation changed the output\n%r\n%r" % (body, got[0], got[1]))
            if "response_format" in body and got[0][1] == "stop":
                json.loads(got[0][0])
        _, samples = get_metrics(port)
        check(metric(samples, "vllm:spec_decode_num_draft_tokens_total") > drafts0,
              "no drafts were verified for the constrained requests")


def test_controls_identical_draft():
    # the same with the coordinator's int8 self-draft on a 2x1 grid (its
    # drafts are the target's likely tokens, so the masks and counts see
    # drafts that ngram would not propose)
    test_controls_identical(2, 1, ["--speculative-method", "draft", "--speculative-quantization", "int8",
                                   "--num-speculative-tokens", "4", "--speculative-fixed-k"])


def failover(spec_args):
    # kill -9 a worker mid-stream with speculation on: the requests wait for
    # the grid to be restored, re-prefill their accepted tokens and go on;
    # greedy ids equal an uninterrupted run without speculation
    n = 450
    expect = {p: run_local(STORIES, p, n, extra=["--ignore-eos"])[1] for p in PROMPTS[1:]}
    with Cluster(STORIES, 2, 1, coord_args=spec_args + ["--recovery-timeout-ms", "30000"]) as c:
        procs = [(p, c.generate_async(p, n, extra=["--ignore-eos", "--timeout-ms", "30000"]))
                 for p in PROMPTS[1:] * 2]
        for _, proc in procs:  # every stream has begun (a request sent to a broken grid is refused)
            proc.stdout.read(1)
        check(all(proc.poll() is None for _, proc in procs), "a stream ended before the kill")
        kill(c.pid("worker-1"))
        time.sleep(0.3)
        w = subprocess.Popen([os.path.join(BIN, "loom-worker"), "--coordinator", "tcp://127.0.0.1:%d" % (c.port + 1),
                              "--threads", "1", "--id", "replacement"] + c.worker_keys("replacement"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            best = 0.0
            for p, proc in procs:
                out, err = proc.communicate(timeout=120)
                check(proc.returncode == 0, "a stream did not survive: %s" % err[-300:])
                check(parse_ids(err) == expect[p], "%r: after recovery the ids differ from an uninterrupted run" % p)
                m = re.search(r"^tokens per target step: (\d+\.\d\d)$", err, re.M)
                best = max(best, float(m.group(1)) if m else 0.0)
        finally:
            w.terminate()
            w.wait(timeout=30)
        check(best > 1.0, "no stream accepted a draft (best %.2f tokens per target step)" % best)
        check("resume" in c.log("coordinator"), "no recovery in the coordinator log")


def test_failover():
    failover(SPEC_ARGS + ["--speculative-fixed-k"])  # drafts in flight when the worker dies


def test_failover_draft():
    # the coordinator's draft keeps its slots across the grid's loss; the
    # re-prefilled sequences draft on from what their slots hold
    failover(["--speculative-method", "draft", "--speculative-quantization", "int8", "--num-speculative-tokens", "4",
              "--speculative-fixed-k"])

def test_draft_off_the_reactor():
    """The coordinator's draft model runs off the reactor: with the test hook
    making it slow (LOOM_TEST_DRAFT_DELAY_MS: 2 s before each sequence's
    drafts, so a step of two drafted sequences waits 4 s for them), Health
    and Stats over ZeroMQ answer in less than one sequence's delay, no
    reactor turn takes as long as it, the two streams end with the ids of a
    run without speculation, and their drafts were verified. With the
    forwards on the reactor every probe sent while a step drafts waits for
    the rest of that step's drafts."""
    delay_ms, n = 2000, 8
    expect = {p: run_local(STORIES, p, n, extra=["--ignore-eos"])[1] for p in PROMPTS[:2]}
    port = free_port()
    os.environ["LOOM_TEST_DRAFT_DELAY_MS"] = str(delay_ms)
    try:
        with Cluster(STORIES, 1, 1, coord_args=["--speculative-method", "draft", "--speculative-quantization", "int8",
                                                "--num-speculative-tokens", "2", "--speculative-fixed-k",  # (the gate would stop so slow a draft)
                                                "--http", "127.0.0.1:%d" % port]) as c:
            m0 = turn_buckets(port)
            procs = [(p, c.generate_async(p, n, extra=["--ignore-eos"])) for p in PROMPTS[:2]]
            probes = []
            while any(proc.poll() is None for _, proc in procs):
                for name, call in (("Health", c.health), ("Stats", c.stats)):
                    t0 = time.time()
                    out = call()
                    probes.append((name, time.time() - t0))
                    check(name != "Health" or out[0] == 0, "Health failed while the draft ran: %s" % (out,))
            for p, proc in procs:
                out, err = proc.communicate(timeout=120)
                check(proc.returncode == 0, "generate %r failed: %s" % (p, err))
                check(parse_ids(err) == expect[p], "%r: ids %s differ from loom run %s" % (p, parse_ids(err), expect[p]))
            t99, top, turns = turn_stats(m0, turn_buckets(port))
            _, samples = get_metrics(port)
            drafts = metric(samples, "vllm:spec_decode_num_drafts_total")
            longest = max(t for _, t in probes)
            print("slow draft (%d ms per sequence): %d probes, the longest %.0f ms; %d reactor turns, p99 <= %g s, "
                  "longest <= %g s; %d drafts verified" % (delay_ms, len(probes), longest * 1e3, turns, t99, top,
                                                           drafts))
            check(drafts >= 2, "the slow draft drafted nothing (%s drafts verified)" % drafts)
            check(len(probes) >= 4, "only %d probes ran while the requests drafted" % len(probes))
            check(longest < delay_ms / 1e3, "a probe waited %.0f ms while the draft ran" % (longest * 1e3))
            check(top < delay_ms / 1e3, "a reactor turn took up to %g s while the draft ran" % top)
            check("the reactor stalled" not in c.log("coordinator"), "the reactor stalled:\n" +
                  c.log("coordinator")[-1500:])
    finally:
        del os.environ["LOOM_TEST_DRAFT_DELAY_MS"]


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_greedy_identical, test_reference_story, test_sampled_identical, test_limits,
               test_gqa_random_model, test_draft_self_int8, test_draft_expensive, test_bad_input, test_grids,
               test_grids_draft, test_controls_identical, test_controls_identical_draft, test_failover,
               test_failover_draft, test_draft_off_the_reactor])

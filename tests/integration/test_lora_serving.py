"""LoRA adapters served over a grid of real workers (docs/lora.md): requests
over the base model and several adapters run concurrently in mixed batches
(--max-loras below the adapters in use, so adapters are evicted and loaded
again while others run), on 1x1 and 2x2 grids; each request's greedy ids
equal `loom run` on the merged weights (tests/reference/gen_lora.py merge,
float64, the independent reference) or on the base model. An unknown model
is NOT_FOUND with OpenAI's message."""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import PYTHON, ROOT, STORIES, Cluster, check, run_local, run_tests, parse_ids, scaled  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-lora-serving")
GEN = os.path.join(ROOT, "tests", "reference", "gen_lora.py")
PROMPTS = ["Once upon a time", "The little dog", "She went to the park"]
N = 24


def gen(*args):
    subprocess.run([PYTHON, GEN] + [str(a) for a in args], check=True, capture_output=True, timeout=300)


def adapter(name, *flags):
    d = os.path.join(WORK, name)
    if not os.path.exists(os.path.join(d, "adapter_config.json")):
        gen("adapter", STORIES, d, *flags)
    return d


def merged(ad, name):
    d = os.path.join(WORK, name)
    if not os.path.exists(os.path.join(d, "config.json")):
        gen("merge", STORIES, ad, d)
    return d


ADAPTERS = {}  # name -> (adapter dir, merged model dir)


def setup():
    os.makedirs(WORK, exist_ok=True)
    for i, (name, flags) in enumerate([("a", ("--r", 8, "--alpha", 16, "--std", 0.1)),
                                       ("b", ("--r", 8, "--alpha", 16, "--rslora", "--std", 0.1)),
                                       ("c", ("--r", 16, "--alpha", 32, "--targets", "q_proj,v_proj,down_proj",
                                              "--std", 0.15))]):
        ad = adapter("serve_" + name, *flags, "--seed", 21 + i)
        ADAPTERS[name] = (ad, merged(ad, "serve_%s_merged" % name))


def reference():
    """(model name or None, prompt) -> the greedy ids of loom run on the merged weights."""
    want = {}
    for p in PROMPTS:
        _, want[(None, p)] = run_local(STORIES, p, N, extra=["--ignore-eos"])
        for name, (_, m) in ADAPTERS.items():
            _, want[(name, p)] = run_local(m, p, N, extra=["--ignore-eos"])
    for name in ADAPTERS:
        check(want[(name, PROMPTS[0])] != want[(None, PROMPTS[0])],
              "adapter %s does not change the output: the test would not see a lost delta" % name)
    return want


def lora_args(max_loras):
    mods = ["%s=%s" % (n, a) for n, (a, _) in sorted(ADAPTERS.items())]
    return ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", "16", "--lora-modules"] + mods


def mixed_batch(c, want, rounds=2):
    """Every (model, prompt) pair at once, twice over: base rows and every adapter in flight together."""
    for r in range(rounds):
        jobs = []
        for p in PROMPTS:
            for name in [None] + sorted(ADAPTERS):
                extra = ["--ignore-eos"] + (["--lora", name] if name else [])
                jobs.append((name, p, c.generate_async(p, N, 0.0, extra)))
        for name, p, proc in jobs:
            out, err = proc.communicate(timeout=scaled(120))
            check(proc.returncode == 0, "generate %s %r failed: %s" % (name, p, err[-1000:]))
            got = parse_ids(err)
            check(got == want[(name, p)], "round %d, %s on %r: %s, the merged weights: %s" %
                  (r, name or "base", p, got, want[(name, p)]))
    print("  %d requests over the base and %d adapters, %d rounds: each equals its merged model" %
          (len(PROMPTS) * (len(ADAPTERS) + 1), len(ADAPTERS), rounds))


def test_mixed_1x1():
    want = reference()
    # 3 adapters, 2 slots: an adapter waits for a slot while the others run, then is loaded into an evicted one
    with Cluster(STORIES, 1, 1, coord_args=lora_args(2), threads=2) as c:
        mixed_batch(c, want)
        rc, _, _, err = c.generate(PROMPTS[0], 4, extra=["--lora", "nope"])
        check(rc != 0 and "The model `nope` does not exist." in err, "an unknown adapter: %d %r" % (rc, err))
        # SGLang's base:adapter names the same adapter
        base_name = os.path.basename(STORIES.rstrip("/"))
        rc, _, got, err = c.generate(PROMPTS[1], N, extra=["--ignore-eos", "--model", "%s:b" % base_name])
        check(rc == 0 and got == want[("b", PROMPTS[1])], "base:adapter: %d %s %r" % (rc, got, err[-300:]))


def test_mixed_2x2():
    want = reference()
    with Cluster(STORIES, 2, 2, coord_args=lora_args(2), threads=1) as c:
        mixed_batch(c, want, rounds=1)


if __name__ == "__main__":
    setup()
    run_tests([test_mixed_1x1, test_mixed_2x2])

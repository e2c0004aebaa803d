"""LoRA adapters against the merged weights, the independent reference
(tests/reference/gen_lora.py merge folds W + scale * B @ A in float64):
`loom run --lora DIR` and `loom run` on the merged model give the same greedy
ids, and so does every TP x PP grid of the adapter (lora_grid: the engine's
shard layout of A and B, the partial deltas summed by the all-reduce), for an
adapter on every linear, rsLoRA with rank and alpha patterns, a zero-B
adapter (the base model's ids), and a Phi-3 layout (fused qkv_proj and
gate_up_proj, partial rotary with longrope's attention factor). Bad adapters
end `loom run` with a message naming the problem."""
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, PYTHON, ROOT, SANITIZED, STORIES, check, gen_model, run_local, run_tests  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-lora")
GEN = os.path.join(ROOT, "tests", "reference", "gen_lora.py")
GRID = os.path.join(os.path.dirname(BIN), "tests", "lora_grid")
PROMPT = "Once upon a time"
N = 40
# every grid under Release; the sanitized build checks fewer (each cell is a backend with its own threads)
GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2)] if SANITIZED else [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (8, 1)]


def gen(*args):
    subprocess.run([PYTHON, GEN] + [str(a) for a in args], check=True, capture_output=True, timeout=300)


def adapter(model, name, *flags):
    d = os.path.join(WORK, name)
    shutil.rmtree(d, ignore_errors=True)
    gen("adapter", model, d, *flags)
    return d


def merged(model, ad, name):
    d = os.path.join(WORK, name)
    shutil.rmtree(d, ignore_errors=True)
    gen("merge", model, ad, d)
    return d


def grid_ids(model, tp, pp, ad=None, *extra):
    cmd = [GRID, model, str(tp), str(pp), str(N), PROMPT] + ([ad] if ad else []) + [str(e) for e in extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, "lora_grid %dx%d failed: %s" % (tp, pp, p.stderr[-2000:]))
    return [int(x) for x in p.stdout.split()]


def check_exact(model, ad, ref_model, grids=GRIDS, max_rank=None, differs_from=None):
    """loom run with the adapter, and every grid, equal the merged model's greedy ids."""
    extra = ["--max-lora-rank", str(max_rank)] if max_rank else []
    _, want = run_local(ref_model, PROMPT, N, extra=["--ignore-eos"])
    _, got = run_local(model, PROMPT, N, extra=["--lora", ad, "--ignore-eos"] + extra)
    check(len(want) == N, "the merged model gave %d ids" % len(want))
    check(got == want, "loom run --lora %s: %s, the merged weights: %s" % (ad, got, want))
    if differs_from is not None:
        check(want != differs_from, "the adapter does not change the output: the test would not see a bad delta")
    for tp, pp in grids:
        g = grid_ids(model, tp, pp, ad, *([max_rank] if max_rank else []))
        check(g == want, "grid %dx%d with %s: %s, the merged weights: %s" % (tp, pp, ad, g, want))
    print("  %s: %d ids equal on loom run and grids %s" % (os.path.basename(ad), N,
                                                         " ".join("%dx%d" % g for g in grids)))


def base_ids(model):
    _, ids = run_local(model, PROMPT, N, extra=["--ignore-eos"])
    return ids


def test_every_linear():
    base = base_ids(STORIES)
    ad = adapter(STORIES, "all_r8", "--r", 8, "--alpha", 16, "--std", 0.1, "--seed", 1)
    check_exact(STORIES, ad, merged(STORIES, ad, "all_r8_merged"), differs_from=base)


def test_with_speculation():
    """ngram speculation's verify steps (several rows of one sequence) carry the adapter too: same ids."""
    ad = os.path.join(WORK, "all_r8")
    _, plain = run_local(STORIES, PROMPT, N, extra=["--lora", ad, "--ignore-eos"])
    _, spec = run_local(STORIES, PROMPT, N, extra=["--lora", ad, "--ignore-eos", "--speculative-method", "ngram"])
    check(spec == plain, "with ngram speculation: %s, without: %s" % (spec, plain))


def test_rslora_patterns():
    base = base_ids(STORIES)
    ad = adapter(STORIES, "rs", "--r", 8, "--alpha", 16, "--rslora", "--rank-pattern", '{"q_proj": 16, "down_proj": 4}',
                 "--alpha-pattern", '{"v_proj": 32, "o_proj": 8}', "--std", 0.1, "--seed", 2)
    check_exact(STORIES, ad, merged(STORIES, ad, "rs_merged"), differs_from=base)


def test_some_targets():
    base = base_ids(STORIES)
    ad = adapter(STORIES, "qv", "--r", 16, "--alpha", 32, "--targets", "q_proj,v_proj,down_proj", "--std", 0.15,
                 "--seed", 3)
    check_exact(STORIES, ad, merged(STORIES, ad, "qv_merged"), differs_from=base)


def test_zero_b():
    """PEFT's initialisation (B = 0): exactly the base model."""
    ad = adapter(STORIES, "zero", "--r", 8, "--zero-b", "--seed", 4)
    check_exact(STORIES, ad, STORIES, grids=[(1, 1), (2, 2)])


def test_phi3_layout():
    """Fused qkv_proj / gate_up_proj split into parts, partial rotary (each q and k head's rows permuted) and
    longrope's attention factor folded into B's rotary rows, as the loader does to W's."""
    model = gen_model(os.path.join(WORK, "phi4mini"), "--arch", "phi3", "--partial-rotary", "0.75", "--rope-scaling",
                      "longrope", "--rope-original-max-pos", "128", "--max-pos", "1024", "--dim", "64",
                      "--hidden-dim", "96", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--vocab", "512",
                      "--seed", "37")
    base = base_ids(model)
    ad = adapter(model, "phi_all", "--r", 8, "--alpha", 16, "--std", 0.2, "--seed", 5)
    check_exact(model, ad, merged(model, ad, "phi_merged"), grids=[(1, 1), (2, 1), (4, 1), (2, 2)],
                differs_from=base)


def run_err(*extra):
    p = subprocess.run([os.path.join(BIN, "loom"), "run", "--model", STORIES, "--prompt", PROMPT, "--temperature", "0",
                        "--max-tokens", "8", "--threads", "1"] + list(extra), capture_output=True, text=True,
                       timeout=60)
    check(p.returncode not in (0, -11, -6, 134, 139), "%s: exit %d (a crash or a success)" % (extra, p.returncode))
    return p.stderr


def test_bad_adapters():
    err = run_err("--lora", os.path.join(WORK, "no_such_adapter"))
    check("no_such_adapter" in err, "a missing directory is not named: %r" % err)
    big = adapter(STORIES, "r128", "--r", 128, "--alpha", 16, "--seed", 6)
    err = run_err("--lora", big, "--max-lora-rank", "64")
    check("rank 128 is greater than max_lora_rank 64" in err, "rank 128 over 64: %r" % err)
    err = run_err("--lora", big, "--max-lora-rank", "100")
    check("--max-lora-rank must be one of" in err, "rank 100: %r" % err)
    trunc = adapter(STORIES, "trunc", "--r", 8, "--seed", 7)
    f = os.path.join(trunc, "adapter_model.safetensors")
    with open(f, "rb") as fh:
        data = fh.read()
    with open(f, "wb") as fh:
        fh.write(data[:len(data) // 2])
    err = run_err("--lora", trunc)
    check("adapter_model.safetensors" in err or "truncated" in err, "a truncated safetensors: %r" % err)
    dora = adapter(STORIES, "dora", "--r", 8, "--seed", 8, "--extra", json.dumps({"use_dora": True}))
    err = run_err("--lora", dora)
    check("use_dora" in err, "DoRA is not refused by name: %r" % err)


def coord_err(*args, env=None):
    """loom-coordinator's start-up with LoRA flags: it exits 2 before listening; returns stderr."""
    p = subprocess.run([os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES]
                       + [str(a) for a in args],
                       capture_output=True, text=True, timeout=60, env=env)
    check(p.returncode == 2, "%s: exit %d, %r" % (args, p.returncode, p.stderr[-500:]))
    return p.stderr


def test_coordinator_startup_checks():
    """loom-coordinator reads vLLM's LoRA flags and checks every --lora-modules adapter at start-up,
    naming the bad one."""
    a = adapter(STORIES, "serve_a", "--r", 8, "--seed", 11)
    b = adapter(STORIES, "serve_b", "--r", 8, "--seed", 12)
    missing = os.path.join(WORK, "serve_missing")
    err = coord_err("--enable-lora", "--lora-modules", "a=" + a, "gone=" + missing)
    check("LoRA adapter gone" in err and "serve_missing" in err, "a missing adapter is not named: %r" % err)
    big = adapter(STORIES, "serve_r128", "--r", 128, "--seed", 13)
    err = coord_err("--enable-lora", "--max-lora-rank", "64", "--lora-modules", "big=" + big)
    check("rank 128 is greater than max_lora_rank 64" in err and "big" in err, "rank 128 over 64: %r" % err)
    err = coord_err("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1")
    check("--max-cpu-loras 1 must be at least --max-loras 2" in err, "max-cpu-loras: %r" % err)
    err = coord_err("--enable-lora", "--max-lora-rank", "100")
    check("--max-lora-rank 100: must be one of" in err, "rank 100: %r" % err)
    err = coord_err("--lora-modules", "a=" + a)
    check("--lora-modules needs --enable-lora" in err, "modules without --enable-lora: %r" % err)
    err = coord_err("--enable-lora", "--lora-modules", "a=" + a, "a=" + b)
    check("the name a is given twice" in err, "a duplicate name: %r" % err)
    # good adapters start serving: test_lora_serving.py
    # loom generate --lora NAME is the request's model
    p = subprocess.run([os.path.join(BIN, "loom"), "generate", "--addr", "127.0.0.1:1", "--prompt", "x", "--lora", "a",
                        "--model", "b"], capture_output=True, text=True, timeout=60)
    check(p.returncode == 2 and "not both" in p.stderr, "loom generate --lora --model: %r" % p.stderr)
    # loom serve checks the same before it starts anything
    p = subprocess.run([os.path.join(BIN, "loom"), "serve", STORIES, "--port", "0", "--enable-lora",
                        "--max-lora-rank", "64", "--lora-modules", "big=" + big], capture_output=True, text=True,
                       timeout=60)
    check(p.returncode == 2 and "rank 128 is greater than max_lora_rank 64" in p.stderr, "loom serve: %r" % p.stderr)
    p = subprocess.run([os.path.join(BIN, "loom"), "serve", STORIES, "--port", "0", "--enable-lora",
                        "--max-loras", "3", "--max-cpu-loras", "2"], capture_output=True, text=True, timeout=60)
    check(p.returncode == 2 and "--max-cpu-loras 2 must be at least --max-loras 3" in p.stderr,
          "loom serve: %r" % p.stderr)


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_every_linear, test_with_speculation, test_rslora_patterns, test_some_targets, test_zero_b, test_phi3_layout,
               test_bad_adapters, test_coordinator_startup_checks])

"""`loom perplexity` on stories260K and tests/data/story.txt.

The f32 scheme against its own f32 reference: perplexity sane for a tiny
TinyStories model on a TinyStories-like text (measured 4.78), KL exactly 0,
top-1 agreement 1. A bf16 KV cache: KL small but above 0, top-1 agreement
high; int8 KV: KL above bf16's, still small. Weights quantized on load:
int8 close to f32, 4-bit further off but still a sane model. Every token
after the first is scored once whatever the window. Bad flags are clear
errors.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, ROOT, STORIES, check, run_tests  # noqa: E402

TEXT = os.path.join(ROOT, "tests", "data", "story.txt")


def perplexity(*args, expect_rc=0):
    p = subprocess.run([os.path.join(BIN, "loom"), "perplexity", "--model", STORIES, "--text", TEXT,
                        "--threads", "2"] + list(args), capture_output=True, text=True, timeout=300)
    check(p.returncode == expect_rc, "loom perplexity %s: exit %d, want %d: %s" %
          (" ".join(args), p.returncode, expect_rc, p.stderr))
    return p


def scores(*args):
    r = json.loads(perplexity("--json", *args).stdout)
    print("  %-24s ppl %.4f (ref %.4f)  KL %.3g  top-1 %.4f  %d windows" %
          (" ".join(args) or "f32", r["perplexity"], r["reference_perplexity"], r["mean_kl"],
           r["top1_agreement"], r["windows"]), flush=True)
    check(r["scored"] == r["tokens"] - 1, "%d of %d tokens scored" % (r["scored"], r["tokens"]))
    return r


def test_f32_against_itself():
    r = scores()
    check(2.0 < r["perplexity"] < 10.0, "perplexity %g" % r["perplexity"])
    check(r["perplexity"] == r["reference_perplexity"], "the same scheme scored differently")
    check(r["mean_kl"] == 0.0 and r["top1_agreement"] == 1.0, "f32 vs f32: %s" % r)
    check(r["tokens"] > 1000 and r["windows"] > 1, "a window per 256 tokens: %s" % r)
    # the text form carries the same numbers
    out = perplexity().stdout
    check("perplexity" in out and "top-1 agreement     1.0000" in out, "text output: %r" % out)


def test_kv_dtypes():
    bf16 = scores("--kv-cache-dtype", "bf16")
    check(0.0 < bf16["mean_kl"] < 5e-3, "bf16 KV: KL %g" % bf16["mean_kl"])
    check(bf16["top1_agreement"] > 0.97, "bf16 KV: top-1 %g" % bf16["top1_agreement"])
    check(abs(bf16["perplexity"] / bf16["reference_perplexity"] - 1) < 0.01, "bf16 KV: %s" % bf16)
    int8 = scores("--kv-cache-dtype", "int8")
    check(bf16["mean_kl"] < int8["mean_kl"] < 2e-2, "int8 KV: KL %g (bf16 %g)" % (int8["mean_kl"], bf16["mean_kl"]))
    check(int8["top1_agreement"] > 0.95, "int8 KV: top-1 %g" % int8["top1_agreement"])
    # short windows: more of them, every token still scored once
    short = scores("--kv-cache-dtype", "int8", "--ctx", "64", "--stride", "48")
    check(short["windows"] >= (short["tokens"] - 64) // 48 + 1, "windows: %s" % short)
    check(short["perplexity"] > int8["perplexity"], "less context should not predict better: %s" % short)


def test_weight_schemes():
    int8 = scores("--quantization", "int8")
    check(0.0 < int8["mean_kl"] < 5e-3 and int8["top1_agreement"] > 0.95, "int8 weights: %s" % int8)
    q4 = scores("--quantization", "q4", "--kv-cache-dtype", "int8")
    check(int8["mean_kl"] < q4["mean_kl"] < 0.5, "q4 weights: KL %g (int8 %g)" % (q4["mean_kl"], int8["mean_kl"]))
    check(q4["perplexity"] < 2 * q4["reference_perplexity"] and q4["top1_agreement"] > 0.6, "q4 weights: %s" % q4)
    check(q4["quantization"] == "q4" and q4["kv_cache_dtype"] == "int8", "the scheme's names: %s" % q4)


def test_errors():
    for args, rc, words in [(["--quantization", "q5"], 2, "--quantization must be"),
                            (["--kv-cache-dtype", "fp8"], 1, "no fp8 KV cache"),
                            (["--kv-cache-dtype", "f64"], 1, "unknown KV cache dtype"),
                            (["--ctx", "64", "--stride", "65"], 1, "unscored"),
                            (["--ctx", "100000"], 1, "over the model's context")]:
        p = perplexity(*args, expect_rc=rc)
        check(words in p.stderr, "%s: %r" % (args, p.stderr))
    p = subprocess.run([os.path.join(BIN, "loom"), "perplexity", "--model", STORIES, "--text", "/nonexistent"],
                       capture_output=True, text=True, timeout=60)
    check(p.returncode == 1 and "/nonexistent" in p.stderr, "missing text: %r" % p.stderr)


if __name__ == "__main__":
    run_tests([test_f32_against_itself, test_kv_dtypes, test_weight_schemes, test_errors])

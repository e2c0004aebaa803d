"""DeepSeek's MLA over the latent cache with the prefill decompressed (LOOM_MLA_PREFILL_ROWS, CPU): a sequence
with that many rows in a step attends through per-head K and V decompressed from the cached latent, context
chunk by context chunk (LOOM_MLA_PREFILL_CHUNK=16 here, so a long prompt spans several), merged by log-sum-exp;
decodes stay absorbed.

- The tiny V3 and V2-Lite shapes on 1x1 and 2x1: the absorbed grid's greedy ids and its logits within 1e-4,
  the float64 reference's within 1e-4, over short prompts and one of 61 tokens (4 context chunks).
- Chunked prefill (--max-num-batched-tokens 24: later chunks attend over cached context), a prefix-cache hit
  (a second request sharing the long prompt), TP 2, KV f32, bf16 and int8: the ids of loom run absorbed.
"""
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import BIN, Cluster, check, parse_ids, run_local, run_tests  # noqa: E402
import test_deepseek  # noqa: E402
from test_deepseek import ref_logits, v2lite, v3  # noqa: E402
import test_models  # noqa: E402
from test_models import grid_vs_reference  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-deepseek")
test_deepseek.WORK = test_models.WORK = WORK
LONG = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park with her "
        "friends. One day, she saw a big red ball under a tree and ran to get it.")
PROMPTS = ["Once upon a time", "Lily and Ben went to the park. They saw", LONG]


def mode(decompressed):
    """The workers and loom run inherit the environment: decompressed prefill with 16-token context chunks."""
    os.environ["LOOM_MLA_PREFILL_ROWS"] = "2" if decompressed else "0"
    os.environ["LOOM_MLA_PREFILL_CHUNK"] = "16"


def rel(a, b):
    return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max())


def test_equals_absorbed():
    test_models.ref_logits = ref_logits
    test_models.PROMPTS = PROMPTS
    for model in (v3(), v2lite()):
        name = os.path.basename(model)
        mode(False)
        absorbed = grid_vs_reference(model, 1, 1, [])
        check(len(absorbed[-1][0]) > 3 * 16, "the long prompt is %d tokens" % len(absorbed[-1][0]))
        mode(True)
        for tp in (1, 2):
            dec = grid_vs_reference(model, tp, 1, [])
            worst_abs = worst_ref = 0.0
            for (prompt, ids_a, got_a, ref), (_, ids_d, got_d, _) in zip(absorbed, dec):
                check(ids_d == ids_a, "%s %dx1 (%d tokens): ids %s, absorbed %s" % (name, tp, len(prompt), ids_d, ids_a))
                worst_abs = max(worst_abs, rel(got_d, got_a))
                worst_ref = max(worst_ref, rel(got_d, ref))
            print("  %s %dx1 prefill decompressed (prompts of %s tokens): ids equal the absorbed; worst logit "
                  "relative error %.2e against the absorbed, %.2e against the float64 reference"
                  % (name, tp, "/".join(str(len(r[0])) for r in dec), worst_abs, worst_ref), flush=True)
            check(worst_abs <= 1e-4, "%s %dx1: logits differ from the absorbed by %.3g" % (name, tp, worst_abs))
            check(worst_ref <= 1e-4, "%s %dx1: logits differ from the reference by %.3g" % (name, tp, worst_ref))


def test_chunked_prefix_kv_dtypes():
    n_tok = 16
    second = LONG + " Then she went home."
    for kv in (None, "bf16", "int8"):
        kvargs = ["--kv-cache-dtype", kv] if kv else []
        mode(False)
        expect = [run_local(v3(), p, n_tok, extra=["--ignore-eos"] + kvargs)[1] for p in (LONG, second)]
        if kv is None:  # a value that is not a row count: said, and the prefill stays absorbed
            os.environ["LOOM_MLA_PREFILL_ROWS"] = "2x"
            r = subprocess.run([os.path.join(BIN, "loom"), "run", "--model", v3(), "--prompt", LONG, "--max-tokens",
                                str(n_tok), "--temperature", "0", "--threads", "1", "--ids", "--ignore-eos"],
                               capture_output=True, text=True, timeout=120)
            check(r.returncode == 0 and "LOOM_MLA_PREFILL_ROWS='2x' is not a row count" in r.stderr
                  and "prefill decompressed" not in r.stderr, "LOOM_MLA_PREFILL_ROWS=2x: %s" % r.stderr[-2000:])
            check(parse_ids(r.stderr) == expect[0], "LOOM_MLA_PREFILL_ROWS=2x: ids %s, absorbed %s"
                  % (parse_ids(r.stderr), expect[0]))
        mode(True)
        with Cluster(v3(), 2, 1, coord_args=["--block-size", "16", "--max-num-batched-tokens", "24"] + kvargs) as c:
            for p, want in zip((LONG, second), expect):
                rc, _, ids, err = c.generate(p, n_tok, extra=["--ignore-eos"])
                check(rc == 0, "generate failed: %s" % err)
                check(ids == want, "2x1 %s %r: ids %s, loom run absorbed %s" % (kv or "f32", p[-20:], ids, want))
            st = c.stats()
            logs = "".join(c.log("worker-%d" % i) for i in range(2))
        check(st.get("prefix_cache_hits", 0) > 0, "%s: no prefix hit: %s" % (kv or "f32", st))
        check("MLA: prefill decompressed (runs of 2 rows or more)" in logs, "no decompressed prefill line in the logs")
        print("  2x1 KV %s, prefill in chunks of 24 tokens, %d prefix hits: loom run absorbed's ids"
              % (kv or "f32", st["prefix_cache_hits"]), flush=True)


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_chunked_prefix_kv_dtypes, test_equals_absorbed])

"""DeepSeek-V3 and DeepSeek-V2 (deepseek_v3, deepseek_v2) on the grid, against the float64 reference.

- transformers' DeepseekV3 test shape (tests/reference/gen_deepseek.py --shape v3: q_lora_rank 32,
  kv_lora_rank 16, nope 32 + rope 16 dims, yarn with mscale 1, a sigmoid router with
  e_score_correction_bias choosing 2 of 8 experts in 1 of 2 groups, 2 dense layers, 1 shared expert)
  gives loom run's ids and logits within 1e-5 on every grid, with the experts TP-sliced and with
  --expert-parallel (the latent computed whole on every rank, the heads split), a latent cache of
  kv_lora_rank + rope values a token and layer (float and int8), and the float64
  reference's ids and logits within 1e-4 (tests/reference/deepseek_ref.py, written from
  modeling_deepseek_v3.py).
- a V2-Lite-shaped model (one q_proj, softmax greedy top-3 of 8, 2 shared experts) the same against
  the reference on 1x1 and a 2x2 expert-parallel grid.
- A V3-routed shape whose MLA output is smaller as W_UV per head then o_proj than folded
  (tests/reference/gen_deepseek.py --shape v3split) takes that path and equals the reference on 1x1
  and 2x1.
- An FP8 block checkpoint (float8_e4m3fn weights, a weight_scale_inv per 16 x 16 block) on a 2x1 grid
  equals the reference on the same dequantized weights.
- Refused with a message naming what is wrong: a missing e_score_correction_bias, an FP8 scale grid
  of the wrong shape.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import BIN, PYTHON, ROOT, SANITIZED, STORIES, check, run_tests  # noqa: E402
from test_grid import N_TOKENS, check_model  # noqa: E402
import test_models  # noqa: E402
from test_models import GRIDS, expert_logs, grid_vs_reference, run_fails  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-deepseek")
test_models.WORK = WORK
REF = os.path.join(ROOT, "tests", "reference", "deepseek_ref.py")


def gen(name, *flags):
    out = os.path.join(WORK, name)
    if not os.path.exists(os.path.join(out, "config.json")):
        subprocess.run([PYTHON, os.path.join(ROOT, "tests", "reference", "gen_deepseek.py"), "--out", out,
                        "--tokenizer-from", STORIES] + list(flags), check=True, capture_output=True, timeout=300)
    return out


def v3():
    return gen("deepseek_v3", "--shape", "v3", "--seed", "5")


def v2lite():
    return gen("deepseek_v2lite", "--shape", "v2lite", "--seed", "5")


def ref_logits(model, ids, first):
    """deepseek_ref.py's logits at positions first .. len(ids)-1."""
    with tempfile.NamedTemporaryFile(suffix=".f32") as f:
        p = subprocess.run([PYTHON, REF, "--model", model, "--ids", ",".join(map(str, ids)), "--logits-out", f.name,
                            "--positions-from", str(first)], capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, "deepseek_ref.py failed: %s" % p.stderr[-500:])
        return np.fromfile(f.name, dtype="<f4").reshape(len(ids) - first, -1)


def reference_ids(model, prompt):
    p = subprocess.run([PYTHON, REF, "--model", model, "--ids", ",".join(map(str, prompt)), "--greedy",
                        str(N_TOKENS)], capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, "deepseek_ref.py failed: %s" % p.stderr[-500:])
    return [int(t) for t in p.stdout.strip().split(",")]


def against_reference(model, grids):
    test_models.ref_logits = ref_logits  # grid_vs_reference's reference: DeepSeek's
    for tp, pp, coord in grids:
        worst = 0.0
        for prompt, ids, got, ref in grid_vs_reference(model, tp, pp, coord):
            want = reference_ids(model, prompt)
            check(ids == want, "%s %dx%d: ids %s, the reference %s" % (os.path.basename(model), tp, pp, ids, want))
            worst = max(worst, float((np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1)).max()))
        print("  %s %dx%d%s: ids equal the float64 reference, worst logit relative error %.2e"
              % (os.path.basename(model), tp, pp, "".join(" " + a for a in coord), worst), flush=True)
        check(worst <= 1e-4, "%dx%d: logits differ from the reference by %.3g" % (tp, pp, worst))


def test_deepseek_grids():
    m = v3()
    # the latent cache: one row of kv_lora_rank + rope = 32 floats a token and layer, K and V the same
    # memory, replicated on the TP ranks: 5 layers x 16 tokens x 32 x 4 B = 10.2 KB a block (int8: 32 codes
    # and a float scale, 2.9 KB)
    check_model(m, [(1, 1), (2, 2)] if SANITIZED else GRIDS)
    check_model(m, [(2, 1)], logs=lambda tp: ["(10.2 KB per block)"])
    check_model(m, [(2, 1)], kv="int8", logs=lambda tp: ["(2.9 KB per block)"])
    check_model(m, [(1, 1), (2, 1), (2, 2)], coord=["--expert-parallel"], logs=expert_logs(8))


def test_deepseek_reference():
    grids = [(1, 1, []), (2, 1, []), (1, 2, []), (2, 2, ["--expert-parallel"])]
    against_reference(v3(), grids[-1:] if SANITIZED else grids)
    against_reference(v2lite(), [(2, 2, ["--expert-parallel"])] if SANITIZED else
                      [(1, 1, []), (2, 2, ["--expert-parallel"])])
    # FP8 blocks (16 x 16 here, partial at the edges), dequantized at load; the reference dequantizes alike
    against_reference(gen("deepseek_v3-fp8", "--shape", "v3", "--seed", "5", "--fp8"), [(2, 1, [])])
    # a shape where W_UV then o_proj holds fewer weights than the folded o': the engine takes that path
    split = gen("deepseek_v3-split", "--shape", "v3split", "--seed", "3")
    p = subprocess.run([os.path.join(BIN, "loom"), "run", "--model", split, "--prompt", "Once upon a time",
                        "--max-tokens", "4", "--threads", "1"], capture_output=True, text=True, timeout=120)
    check(p.returncode == 0 and "MLA: W_UV per head then o_proj" in p.stderr,
          "the split path was not taken: %r" % p.stderr[-800:])
    against_reference(split, [(2, 1, [])] if SANITIZED else [(1, 1, []), (2, 1, [])])


def test_deepseek_refusals():
    m = v3()

    def drop(name):
        def edit(hdr, raw):
            del hdr[name], raw[name]
        return edit
    run_fails(test_models.variant("deepseek-no-bias", m,
                                  tensors=drop("model.layers.3.mlp.gate.e_score_correction_bias")),
              "model.layers.3.mlp.gate.e_score_correction_bias", "noaux_tc")
    fp8 = gen("deepseek_v3-fp8", "--shape", "v3", "--seed", "5", "--fp8")

    def shrink_scale(hdr, raw):  # a scale grid of the wrong shape: [16, 1] read as [1, 16] (the same bytes)
        name = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
        hdr[name]["shape"] = hdr[name]["shape"][::-1]
    run_fails(test_models.variant("deepseek-fp8-scale", fp8, tensors=shrink_scale),
              "model.layers.1.self_attn.kv_b_proj.weight_scale_inv", "needs a float")


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_deepseek_refusals, test_deepseek_grids, test_deepseek_reference])

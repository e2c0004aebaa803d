"""DeepSeek's MLA decompressed (--disable-mla, LOOM_MLA_DISABLE=1; vLLM's VLLM_MLA_DISABLE): per-head keys
(nope + rope) and values (v_head_dim) in the KV pool, ordinary paged attention, the heads split across TP
ranks.

- The tiny V3 shape and the V2-Lite shape (tests/reference/gen_deepseek.py) on 1x1 and 2x1 give the latent
  grid's greedy ids and its logits within 1e-4, and the float64 reference's ids and logits within 1e-4
  (tests/reference/deepseek_ref.py).
- The KV pool's block bytes are the decompressed size: heads x (nope + rope + v) values a token and layer
  (V3-tiny: 4 x (48 + 32) x 4 B x 5 layers x 16 tokens = 102.4 KB a block, 51.2 KB a TP rank; int8 28.2 KB),
  in the worker log and the coordinator's stats (kv_block_bytes), f32, bf16 and int8, the ids those of
  loom run --disable-mla with the same KV dtype.
- Concurrent requests over a pool of a few blocks (chunked prefill, the prefix cache, preemption and
  recompute): the ids of loom run, every block back.
- LOOM_MLA_DISABLE=1 turns it on in loom run and the coordinator; refused by name with
  --enable-dp-attention, MTP speculation and LoRA; a model without MLA ignores it.
"""
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import BIN, STORIES, Cluster, check, check_concurrent_ids, free_port, run_local, run_tests  # noqa: E402
import test_deepseek  # noqa: E402
from test_deepseek import ref_logits, v2lite, v3  # noqa: E402
import test_models  # noqa: E402
from test_models import grid_vs_reference  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-deepseek")
test_deepseek.WORK = test_models.WORK = WORK
OFF = ["--disable-mla"]


def rel(a, b):
    return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max())


def test_decompressed_equals_latent():
    test_models.ref_logits = ref_logits  # grid_vs_reference's reference: DeepSeek's float64 one
    for model in (v3(), v2lite()):
        name = os.path.basename(model)
        latent = grid_vs_reference(model, 1, 1, [])
        for tp in (1, 2):
            dec = grid_vs_reference(model, tp, 1, OFF)
            worst_latent = worst_ref = 0.0
            for (prompt, ids_l, got_l, ref), (_, ids_d, got_d, _) in zip(latent, dec):
                check(ids_d == ids_l, "%s %dx1 --disable-mla: ids %s, the latent's %s" % (name, tp, ids_d, ids_l))
                worst_latent = max(worst_latent, rel(got_d, got_l))
                worst_ref = max(worst_ref, rel(got_d, ref))
            print("  %s %dx1 --disable-mla: ids equal the latent's; worst logit relative error %.2e against the "
                  "latent, %.2e against the float64 reference" % (name, tp, worst_latent, worst_ref), flush=True)
            check(worst_latent <= 1e-4, "%s %dx1: logits differ from the latent's by %.3g" % (name, tp, worst_latent))
            check(worst_ref <= 1e-4, "%s %dx1: logits differ from the reference by %.3g" % (name, tp, worst_ref))


def test_kv_block_bytes():
    # V3-tiny: 4 heads of K (32 nope + 16 rope) and V (32), 5 layers, blocks of 16 tokens
    per_token_layer = 4 * (48 + 32)
    cases = [(1, None, 5 * 16 * per_token_layer * 4), (2, None, 5 * 16 * per_token_layer * 4 // 2),
             (2, "bf16", 5 * 16 * per_token_layer * 2 // 2), (1, "int8", 5 * 16 * (per_token_layer + 4 * 2 * 4))]
    for tp, kv, want in cases:
        kvargs = ["--kv-cache-dtype", kv] if kv else []
        args = OFF + ["--block-size", "16"] + kvargs
        _, expect = run_local(v3(), "Once upon a time", 12, extra=["--ignore-eos"] + OFF + kvargs)
        with Cluster(v3(), tp, 1, coord_args=args) as c:
            rc, _, ids, err = c.generate("Once upon a time", 12, extra=["--ignore-eos"])
            check(rc == 0, "generate failed: %s" % err)
            check(ids == expect, "%dx1 %s: ids %s, loom run --disable-mla %s" % (tp, kv or "f32", ids, expect))
            st = c.stats()
            logs = "".join(c.log("worker-%d" % i) for i in range(tp))
        check(st["kv_block_bytes"] == want, "%dx1 %s: kv_block_bytes %d, want %d (heads x (qk + v))"
              % (tp, kv or "f32", st["kv_block_bytes"], want))
        check("(%.1f KB per block)" % (want / 1e3) in logs, "%dx1: no worker logged %.1f KB per block" % (tp, want / 1e3))
        check("MLA decompressed: %d heads of K (48) and V (32)" % (4 // tp) in logs, "%dx1: no decompressed line" % tp)
        latent = 5 * 16 * {None: 32 * 4, "bf16": 32 * 2, "int8": 36}[kv]
        print("  %dx1 KV %s: %d B a block (the latent: %d), loom run's ids" % (tp, kv or "f32", want, latent),
              flush=True)


def test_small_pool():
    # 6 blocks of 16 tokens: concurrent sequences of ~50 tokens (4 blocks each) do not all fit, so some are
    # preempted and recomputed; prompts sharing a prefix hit the prefix cache; prefill in chunks of 8 tokens
    n_tok = 36
    prompts = ["Once upon a time", "Once upon a time there was", "The cat sat", "Tom had a red ball",
               "One day, a little bird", "Sue and her mom"]
    expect = {p: run_local(v3(), p, n_tok, extra=["--ignore-eos"])[1] for p in prompts}
    port = free_port()
    with Cluster(v3(), 2, 1, coord_args=OFF + ["--http", "127.0.0.1:%d" % port, "--num-kv-blocks", "6",
                                               "--block-size", "16", "--max-num-batched-tokens", "8"]) as c:
        procs = {p: c.generate_async(p, n_tok, extra=["--ignore-eos"]) for p in prompts}
        check_concurrent_ids(procs, expect)
        st = c.stats()
        print("  2x1 --disable-mla, %d concurrent requests over 6 blocks: %d preemptions, %d prefix hits"
              % (len(prompts), st.get("preemptions", 0), st.get("prefix_cache_hits", 0)), flush=True)
        check(st.get("preemptions", 0) > 0, "no preemption with 6 blocks: %s" % st)
        check(st.get("kv_blocks_used", 0) == 0, "blocks still held after the requests: %s" % st)
        logs = "".join(c.log("worker-%d" % i) for i in range(2))
        check("refused step" not in logs, "a worker refused a step: %s" % logs[-600:])


def test_env_and_refusals():
    m = v3()
    env = dict(os.environ, LOOM_MLA_DISABLE="1")
    run = [os.path.join(BIN, "loom"), "run", "--model", m, "--prompt", "Once upon a time", "--max-tokens", "8",
           "--temperature", "0", "--ignore-eos", "--ids", "--threads", "1"]
    on = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env)
    off = subprocess.run(run, capture_output=True, text=True, timeout=120)
    check(on.returncode == 0 and "MLA decompressed" in on.stderr, "LOOM_MLA_DISABLE=1: %s" % on.stderr[-400:])
    check("MLA decompressed" not in off.stderr, "decompressed without the flag: %s" % off.stderr[-400:])
    ids = [ln for ln in on.stderr.splitlines() if ln.startswith("ids:")]
    check(ids and ids == [ln for ln in off.stderr.splitlines() if ln.startswith("ids:")],
          "LOOM_MLA_DISABLE=1 ids differ: %r" % ids)
    mtp = test_deepseek.gen("deepseek_v3-mtp", "--shape", "v3", "--seed", "5", "--mtp", "1")
    p = subprocess.run(run[:3] + [mtp] + run[4:] + ["--disable-mla", "--speculative-method", "mtp"],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode != 0 and "--disable-mla" in p.stderr and "MTP" in p.stderr,
          "loom run --disable-mla with MTP: exit %d, %r" % (p.returncode, p.stderr[-300:]))
    print("  refused: %s" % p.stderr.strip().splitlines()[-1][:150])
    coord = [os.path.join(BIN, "loom-coordinator"), "--insecure", "--listen", "tcp://127.0.0.1:0",
             "--control", "tcp://127.0.0.1:0", "--disable-mla"]
    cases = [
        (["--model", m, "--tp", "2", "--enable-dp-attention"], "--disable-mla does not serve --enable-dp-attention"),
        (["--model", mtp, "--speculative-method", "mtp"], "--disable-mla does not serve --speculative-method mtp"),
        (["--model", m, "--enable-lora"], "--disable-mla does not serve LoRA adapters"),
    ]
    for extra, words in cases:
        for e, args in ((None, coord + extra), (env, [a for a in coord if a != "--disable-mla"] + extra)):
            p = subprocess.run(args, capture_output=True, text=True, timeout=60, env=e)
            check(p.returncode != 0 and words in p.stderr, "%r: exit %d, %r" % (extra, p.returncode, p.stderr[-300:]))
        print("  refused: %s" % p.stderr.strip().splitlines()[-1][:150])
    # a model without MLA: ignored, as vLLM ignores VLLM_MLA_DISABLE
    with Cluster(STORIES, 1, 1, coord_args=OFF) as c:
        rc, _, ids, err = c.generate("Once upon a time", 4)
        check(rc == 0, "stories260K with --disable-mla: %s" % err)
        check("has no latent attention; ignored" in c.log("coordinator"), "no ignored line")


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    tests = [test_env_and_refusals, test_kv_block_bytes, test_small_pool, test_decompressed_equals_latent]
    run_tests(tests)

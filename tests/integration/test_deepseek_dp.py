"""DeepSeek with data-parallel attention (--enable-dp-attention): each TP rank of a stage holds the whole MLA
block and runs it for its own sequences, its KV pool holding only their latent blocks; the MoE layers run
expert-parallel, dense MLPs and the head stay TP-sliced.

- The tiny V3 shape (tests/reference/gen_deepseek.py --shape v3) on 2x1 and 2x2 gives loom run's ids and its
  logits within 1e-5, the workers saying they hold every head and their experts; 1x1 ignores the flag.
- V3 and the V2-Lite shape (one q_proj, softmax routing, 2 shared experts) give the float64 reference's ids
  and logits within 1e-4 (tests/reference/deepseek_ref.py, as tests/integration/test_deepseek.py).
- Concurrent requests on a pool of a few blocks per rank: the ids of loom run, admissions on both ranks
  (loom_dp_attention_admissions_total), preemptions, the ledger holding both ranks' pools
  (loom_kv_cache_capacity_blocks = 2 x the workers' pool) and every block back at the end.
- Refused at start by name: a model other than DeepSeek, MTP speculation, the KV offload tiers, LoRA.
"""
import os
import re
import subprocess
import sys
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import (BIN, SANITIZED, STORIES, Cluster, check, check_concurrent_ids, free_port, run_local,  # noqa: E402
                     run_tests, wait_for)
import test_deepseek  # noqa: E402
from test_deepseek import against_reference, v2lite, v3  # noqa: E402
from test_grid import check_model  # noqa: E402
import test_models  # noqa: E402
from test_models import expert_logs  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-deepseek")
test_deepseek.WORK = test_models.WORK = WORK
DP = ["--enable-dp-attention"]


def dp_logs(heads, experts):
    """What the ranks of a data-parallel attention stage log: every head, and their experts."""
    def logs(tp):
        if tp == 1:
            return []
        return ["data-parallel attention: tp rank %d/%d holds all %d heads" % (r, tp, heads)
                for r in range(tp)] + expert_logs(experts)(tp)
    return logs


def test_dp_grids():
    check_model(v3(), [(1, 1), (2, 1)] if SANITIZED else [(1, 1), (2, 1), (2, 2)], coord=DP, logs=dp_logs(4, 8))


def test_dp_reference():
    against_reference(v3(), [(2, 1, DP)] if SANITIZED else [(2, 1, DP), (2, 2, DP)])
    against_reference(v2lite(), [(2, 1, DP)] if SANITIZED else [(2, 1, DP), (2, 2, DP)])


PROMPTS = ["Once upon a time", "The cat sat", "Tom had a red ball", "One day, a little bird",
           "Sue and her mom", "The sun was hot"]


def metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=30) as r:
        return r.read().decode()


def series(text, name):
    """{labels string: value} of a metric's samples."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^%s\{([^}]*)\} (\S+)$" % re.escape(name), text, re.M)}


def by_rank(text, name):
    return {int(re.search(r'rank="(\d+)"', k).group(1)): v for k, v in series(text, name).items()}


def test_dp_concurrent_small_pool():
    # 6 blocks of 16 tokens a rank: three concurrent sequences of ~50 tokens (4 blocks each) on a rank do not
    # fit, so some are preempted and recomputed; the ids stay those of loom run. The requests arrive while
    # the coordinator's reactor is held (the stall hook), so they run together however fast the model is.
    n_tok = 36
    expect = {p: run_local(v3(), p, n_tok, extra=["--ignore-eos"])[1] for p in PROMPTS}
    port = free_port()
    stall = os.path.join(tempfile.mkdtemp(prefix="loom-dp-stall-"), "stall")
    os.environ["LOOM_TEST_STALL_FILE"] = stall  # read by the coordinator at its start
    try:
        with Cluster(v3(), 2, 1, coord_args=DP + ["--http", "127.0.0.1:%d" % port, "--num-kv-blocks", "6",
                                                  "--block-size", "16"]) as c:
            os.environ.pop("LOOM_TEST_STALL_FILE")
            with open(stall + ".tmp", "w") as f:
                f.write("2000")  # the six clients start and send meanwhile
            os.rename(stall + ".tmp", stall)
            wait_for(lambda: not os.path.exists(stall), 10, "the reactor to take the stall")
            procs = {p: c.generate_async(p, n_tok, extra=["--ignore-eos"]) for p in PROMPTS}
            check_concurrent_ids(procs, expect)
            text = metrics(port)
            adm = by_rank(text, "loom_dp_attention_admissions_total")
            held = by_rank(text, "loom_dp_attention_kv_blocks")
            pre = sum(series(text, "loom_num_preemptions_total").values())
            cap = sum(series(text, "loom_kv_cache_capacity_blocks").values())
            print("  2x1 %d concurrent requests, 6 blocks a rank: admissions by rank %s, %d preemptions"
                  % (len(PROMPTS), adm, pre), flush=True)
            check(sorted(adm) == [0, 1] and all(v > 0 for v in adm.values()),
                  "requests did not land on both ranks: %s" % adm)
            check(pre > 0, "no preemption with 6 blocks a rank")
            check(cap == 12, "the ledger holds %d blocks; 2 ranks x 6 expected" % cap)
            check(held == {0: 0, 1: 0}, "blocks still held after the requests: %s" % held)
            logs = "".join(c.log("worker-%d" % i) for i in range(2))
            check("refused step" not in logs, "a worker refused a step: %s" % logs[-600:])
    finally:
        os.environ.pop("LOOM_TEST_STALL_FILE", None)


def test_dp_refusals():
    coord = [os.path.join(BIN, "loom-coordinator"), "--insecure", "--listen", "tcp://127.0.0.1:0",
             "--control", "tcp://127.0.0.1:0", "--tp", "2", "--enable-dp-attention"]
    m = v3()
    tier = tempfile.mkdtemp(prefix="loom-dp-tier-")
    cases = [
        (["--model", STORIES], "--enable-dp-attention does not serve a model other than DeepSeek"),
        (["--model", test_deepseek.gen("deepseek_v3-mtp", "--shape", "v3", "--seed", "5", "--mtp", "1"),
          "--speculative-method", "mtp"], "--enable-dp-attention does not serve --speculative-method mtp"),
        (["--model", m, "--kv-offloading-dir", tier], "does not serve the KV offload tiers"),
        (["--model", m, "--kv-offloading-size", "1"], "does not serve the KV offload tiers"),
        (["--model", m, "--enable-lora"], "LoRA adapters"),
    ]
    for extra, words in cases:
        p = subprocess.run(coord + extra, capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and words in p.stderr, "%r: exit %d, %r" % (extra, p.returncode, p.stderr[-300:]))
        print("  refused: %s" % p.stderr.strip().splitlines()[-1][:150])
    os.rmdir(tier)


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_dp_refusals, test_dp_grids, test_dp_concurrent_small_pool, test_dp_reference])

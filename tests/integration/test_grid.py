"""Distributed runtime: every grid gives the single-process answer.

For grids 1x1, 2x1, 1x2, 2x2 and 1x3 (uneven: 5 layers over 3 stages), on
stories260K and on a random GQA model: greedy ids through the cluster equal
`loom run` in one process, and each step's logits (dumped by the last-stage
workers, merged over the vocab-parallel shards) agree with the 1x1 cluster
within 1e-5 relative error. With weights quantized on load (int8, fp8, q4,
q4_min) the ids equal `loom run`'s with the same scheme, and the logits agree
within the int8 rounding of the activations. The same holds with a bf16 and
an int8 KV cache (against `loom run` with that KV cache; logits within 1e-3
of its 1x1 run, since a last-bit difference in a TP shard's keys can move a
rounding). With a fixed KV memory the block count grows by the dtype's
ratio, shown in Stats and /metrics; prefix caching and its copy-on-write
(block copy with the int8 scales) give the same ids as a fresh prefill.
"""
import glob
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BIN, Cluster, Failure, STORIES, check, gen_model, parse_ids, run_local, run_tests  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-grid")
PROMPTS = ["Once upon a time", "The little dog ran to the", "Lily and Ben went to the park. They saw"]
GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 3)]
N_TOKENS = 40


def read_dump(path):
    """[(step_id, vocab_begin, rows x vocab_len array)] from a worker's --dump-logits file."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    off = 0
    while off < len(data):
        step, rows, vb, vl = struct.unpack_from("<Qiii", data, off)
        off += 20
        a = np.frombuffer(data, dtype=np.float32, count=rows * vl, offset=off).reshape(rows, vl)
        off += rows * vl * 4
        out.append((step, vb, a))
    return out


def merged_logits(run_dir):
    """Per step (in order): the full-vocabulary logit rows, merged over TP shards."""
    shards = [read_dump(p) for p in sorted(glob.glob(os.path.join(run_dir, "dump-*.bin")))]
    shards = [s for s in shards if s]  # only last-stage workers write
    check(shards, "no logits dumped in %s" % run_dir)
    n = len(shards[0])
    check(all(len(s) == n for s in shards), "shards dumped different step counts")
    steps = []
    for i in range(n):
        parts = sorted((s[i][1], s[i][2]) for s in shards)
        steps.append(np.concatenate([p[1] for p in parts], axis=1))
    return steps


def check_shard_reads(c, tp, pp):
    """Each worker read only its shard: about 1/(tp*pp) of the layer weights
    plus the embedding (first stage) or LM head (last stage) slices."""
    fractions = []
    for i in range(tp * pp):
        m = re.search(r"read (\d+) of the checkpoint's (\d+) bytes", c.log("worker-%d" % i))
        check(m, "worker-%d did not log its reads" % i)
        read, total = int(m.group(1)), int(m.group(2))
        fractions.append(read / total)
    if tp * pp == 1:  # everything, the tied embedding twice (as the embedding and as the LM head)
        check(fractions[0] >= 1.0, "1x1 read %.3f of the checkpoint" % fractions[0])
    else:
        # layers split tp*pp ways; the embedding / head rows are split tp ways (or read once per stage)
        bound = 1.0 / (tp * pp) + 0.35
        check(max(fractions) <= bound, "%dx%d: a worker read %.2f of the checkpoint (bound %.2f)"
              % (tp, pp, max(fractions), bound))
        print("  %dx%d: each worker read %s of the checkpoint" % (tp, pp, ", ".join("%.2f" % f for f in fractions)))


def check_model(model, grids=GRIDS, quant=None, kv=None, coord=(), logs=None):
    """coord: options for the coordinator only (loom run has no grid); logs:
    tp -> the lines the grid's worker logs must hold between them."""
    qargs = (["--quantization", quant] if quant else []) + (["--kv-cache-dtype", kv] if kv else [])
    what = os.path.basename(model) + (" " + quant if quant else "") + (" KV " + kv if kv else "") + \
        "".join(" " + a for a in coord)
    tol = 1e-3 if kv else 1e-5
    expect = {p: run_local(model, p, N_TOKENS, extra=["--ignore-eos"] + qargs) for p in PROMPTS}
    for text, ids in expect.values():
        check(ids and len(ids) == N_TOKENS, "loom run gave %r" % (ids,))
    ref = None
    for tp, pp in grids:
        c = Cluster(model, tp, pp, coord_args=qargs + list(coord))
        c.worker_args = ["--dump-logits=%s/dump-%%i.bin" % c.run_dir]
        with c:
            for p in PROMPTS:
                rc, text, ids, err = c.generate(p, N_TOKENS, extra=["--ignore-eos"])
                check(rc == 0, "%dx%d: generate failed (%d): %s" % (tp, pp, rc, err))
                check(ids == expect[p][1], "%dx%d on %s: ids %s differ from loom run %s" %
                      (tp, pp, what, ids, expect[p][1]))
                check(text.rstrip("\n") == expect[p][0].rstrip("\n"), "%dx%d: text differs" % (tp, pp))
            c.stop()  # flush the dumps
            steps = merged_logits(c.run_dir)
            worker_logs = "".join(c.log("worker-%d" % i) for i in range(tp * pp))
            for text in logs(tp) if logs else ():
                check(text in worker_logs, "%dx%d: no worker logged %r" % (tp, pp, text))
            if not quant:  # int8 and fp8 read whole rows of o and down for their scales
                check_shard_reads(c, tp, pp)
        if ref is None:
            ref = steps
            continue
        check(len(steps) == len(ref), "%dx%d ran %d steps with logits, 1x1 ran %d" % (tp, pp, len(steps), len(ref)))
        worst = 0.0
        for a, b in zip(steps, ref):
            check(a.shape == b.shape, "logit shapes %s vs %s" % (a.shape, b.shape))
            err = np.max(np.abs(a - b), axis=1) / np.max(np.abs(b), axis=1)
            worst = max(worst, float(err.max()))
        print("  %s %dx%d: %d prompts x %d ids identical, %d steps, worst logit relative error %.2e"
              % (what, tp, pp, len(PROMPTS), N_TOKENS, len(steps), worst), flush=True)
        # Quantized matmuls on the CPU round activations to int8: a last-bit
        # difference of a TP all-reduce sum can move one code, so the logits
        # agree to about 1/127 of a block's range, and the ids must be equal.
        bound = 5e-2 if quant else tol
        check(worst <= bound, "%dx%d: logits differ from 1x1 by %.3g (relative)" % (tp, pp, worst))


def test_stories260k_grids():
    check_model(STORIES)


def test_random_gqa_grids():
    # 8 query heads over 2 KV heads (tp 2 splits them 1 each), untied embeddings,
    # intermediate size 100 (not a power of two), 5 layers for the 1x3 split.
    model = gen_model(os.path.join(WORK, "gqa"), "--dim", "64", "--hidden-dim", "100", "--layers", "5",
                      "--heads", "8", "--kv-heads", "2", "--vocab", "512", "--seed", "11")
    check_model(model)


def test_qwen2_bias_grids():
    # Qwen2 layout: q/k/v biases sliced with their heads; tp 4 over 2 KV heads
    # replicates the KV heads (and their biases).
    model = gen_model(os.path.join(WORK, "qwen2"), "--qwen2", "--dim", "64", "--hidden-dim", "96", "--layers", "4",
                      "--heads", "8", "--kv-heads", "2", "--vocab", "512", "--tie", "--rope-theta", "1000000",
                      "--seed", "13")
    check_model(model, [(1, 1), (4, 1), (2, 2)])


def test_quantized_grids():
    # Weights quantized on load give every grid the one-process ids. On
    # stories260K (dim 64, intermediate 172) 4-bit groups of 32 divide every
    # input dimension but down_proj's 172, which falls back to int8; TP 2
    # splits o_proj's 64 input columns into one group of 32 per rank.
    for quant in ["int8", "q4", "q4_min", "fp8"]:
        check_model(STORIES, [(1, 1), (2, 1), (1, 2), (2, 2)], quant=quant)


def refused_grid_logs(tp, coord_args, what):
    """Starts a tp x 1 grid whose workers must refuse their shards: launch.sh
    fails naming the load failure. Returns (coordinator log, workers' logs)."""
    c = Cluster(STORIES, tp, 1, coord_args=coord_args, timeout=20)
    try:
        c.start()
        c.stop()
        raise Failure("%s started" % what)
    except Failure as e:
        if "started" in str(e):
            raise
        check("could not load its shard" in str(e), "launch.sh did not name the load failure: %s" % e)
    finally:
        c.stop()
        logs = c.log("coordinator"), "".join(c.log("worker-%d" % i) for i in range(tp))
        shutil.rmtree(c.run_dir, ignore_errors=True)
    return logs


def test_quantized_grid_misaligned():
    # q4:64 on TP 2: o_proj's 32 input columns per rank are not a whole group:
    # the workers refuse to load, naming the tensor, and the coordinator says so.
    logs = "".join(refused_grid_logs(2, ["--quantization", "q4:64"], "q4:64 over TP 2"))
    check("model.layers.0.self_attn.o_proj" in logs and "whole 4-bit groups" in logs,
          "no error naming o_proj in the logs:\n%s" % logs[-2000:])
    print("  q4:64 over TP 2 refused: o_proj's columns are not whole groups")


def test_kv_dtype_grids():
    for kv in ("bf16", "int8"):
        check_model(STORIES, [(1, 1), (2, 1), (1, 2), (2, 2)], kv=kv)
    model = gen_model(os.path.join(WORK, "gqa"), "--dim", "64", "--hidden-dim", "100", "--layers", "5",
                      "--heads", "8", "--kv-heads", "2", "--vocab", "512", "--seed", "11")
    check_model(model, [(1, 1), (2, 2)], kv="int8")


def loom_json(*args):
    p = subprocess.run([os.path.join(BIN, "loom")] + list(args), capture_output=True, text=True, timeout=60)
    check(p.returncode == 0, "loom %s failed: %s" % (args[0], p.stderr))
    return p


def prompt_of_blocks(blocks, kv):
    """A prompt of exactly blocks * 16 tokens (BOS included): a second
    request for it finds every block cached and copies the last one."""
    words = "the cat saw a big dog and ran to the park with her mom".split()

    def size(text):
        p = subprocess.run([os.path.join(BIN, "loom"), "run", "--model", STORIES, "--prompt", text, "--max-tokens",
                            "1", "--threads", "1", "--kv-cache-dtype", kv], capture_output=True, text=True, timeout=60)
        m = re.search(r"prompt: (\d+) tokens", p.stderr)
        check(m, "no prompt size in %r" % p.stderr)
        return int(m.group(1))
    text, i = "Once", 0
    while size(text) != blocks * 16:
        check(i < 300, "no prompt of %d tokens" % (blocks * 16))
        for j in range(len(words)):  # the first word that does not overshoot
            cand = text + " " + words[(i + j) % len(words)]
            if size(cand) <= blocks * 16:
                text = cand
                break
        i += 1
    return text


def test_kv_blocks_stats_metrics_prefix():
    blocks = {}
    for kv in ("f32", "bf16", "int8"):
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            port = so.getsockname()[1]
        with Cluster(STORIES, 1, 1, coord_args=["--kv-cache-dtype", kv, "--kv-cache-memory", "1M",
                                                "--http", "127.0.0.1:%d" % port]) as c:
            st = json.loads(loom_json("stats", "--addr", c.addr).stdout)
            check(st["kv_cache_dtype"] == kv, "Stats says KV %r, asked %s" % (st["kv_cache_dtype"], kv))
            blocks[kv] = st["kv_blocks_total"]
            # stories260K: 5 layers, 4 KV heads of 8, block 16: K and V per block
            per_head = {"f32": 32, "bf16": 16, "int8": 12}[kv]
            check(st["kv_block_bytes"] == 2 * 5 * 16 * 4 * per_head, "block bytes %d" % st["kv_block_bytes"])
            check(blocks[kv] == 1000000 // st["kv_block_bytes"], "%s: %d blocks" % (kv, blocks[kv]))
            text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10).read().decode()
            check('loom_kv_cache_capacity_blocks{model_name="stories260K"} %d' % blocks[kv] in text,
                  "/metrics lacks the block count %d" % blocks[kv])
            check('dtype="%s",block_size="16"} 1' % kv in text, "/metrics lacks loom_kv_cache_info for %s" % kv)
            if kv == "int8":
                prompt = prompt_of_blocks(2, kv)
                _, want = run_local(STORIES, prompt, 24, extra=["--ignore-eos", "--kv-cache-dtype", kv])
                for i in range(3):  # the 2nd and 3rd find both blocks cached and copy the last one
                    rc, _, ids, err = c.generate(prompt, 24, extra=["--ignore-eos"])
                    check(rc == 0 and ids == want, "int8 KV, request %d: ids %s, loom run %s (%s)" %
                          (i, ids, want, err))
                st = json.loads(loom_json("stats", "--addr", c.addr).stdout)
                check(st["prefix_cache_hits"] >= 4, "prefix cache hits %d" % st["prefix_cache_hits"])
    print("  KV blocks in 1 MB: %s" % blocks, flush=True)
    check(blocks["bf16"] >= 2 * blocks["f32"], "bf16 %d blocks vs f32 %d" % (blocks["bf16"], blocks["f32"]))
    check(blocks["int8"] > 2.5 * blocks["f32"], "int8 %d blocks vs f32 %d" % (blocks["int8"], blocks["f32"]))


def test_kv_dtype_errors():
    p = subprocess.run([os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES,
                        "--kv-cache-dtype", "q4"],
                       capture_output=True, text=True, timeout=30)
    check(p.returncode == 2 and "--kv-cache-dtype" in p.stderr, "coordinator took q4: %s" % p.stderr)
    p = subprocess.run([os.path.join(BIN, "loom"), "run", "--model", STORIES, "--prompt", "Hi", "--kv-cache-dtype",
                        "fp8"], capture_output=True, text=True, timeout=30)
    check(p.returncode != 0 and "no fp8 KV cache" in p.stderr, "loom run on cpu took fp8: %s" % p.stderr)
    # a CPU grid asked for fp8: the worker refuses its shard, the coordinator logs why
    log, _ = refused_grid_logs(1, ["--kv-cache-dtype", "fp8"], "a CPU grid with an fp8 KV cache")
    check("no fp8 KV cache (it has f32, bf16, int8)" in log, "no clear error in the log:\n%s" % log[-2000:])


def summary(err):
    """(completion tokens, finish reason) from `loom generate`'s summary line."""
    m = re.search(r"completion (\d+) tokens, finish (\w+)", err)
    return (int(m.group(1)), m.group(2)) if m else None


def test_async_scheduling():
    """--async-scheduling on a 1x1 grid and a TP 2 grid (rank 0 shares the
    sampled ids with the group, Assign.share_sampled_ids): every request
    gives what it gives without the flag (text, ids, completion tokens,
    finish reason) and greedy ids equal `loom run`'s. A request ended by a
    stop string in a step whose successors were already planned ahead emits
    nothing more: those rows are dropped (Stats ahead_dropped), its usage
    counts the tokens it emitted. Penalties (and min_tokens until it is
    reached) make the next row depend on the token, so those rows wait for
    it; a pipeline of 2 stages turns the flag off."""
    for bad in ("0", "9"):  # steps ahead out of [1, 8]: refused at start, naming the flag
        p = subprocess.run([os.path.join(BIN, "loom-coordinator"), "--insecure", "--model", STORIES,
                            "--async-scheduling-steps", bad], capture_output=True, text=True, timeout=30)
        check(p.returncode == 2 and "--async-scheduling-steps" in p.stderr,
              "coordinator took --async-scheduling-steps %s: %s" % (bad, p.stderr))
    ref_text, ref_ids = run_local(STORIES, PROMPTS[2], 200, extra=["--ignore-eos"])
    cut = ref_text.index(" ", 60) + 1
    stop = ref_text[cut:cut + 6]  # a stop string well inside the output
    cases = [
        ("greedy", PROMPTS[2], 200, 0.0, ["--ignore-eos"]),
        ("stop string", PROMPTS[2], 200, 0.0, ["--ignore-eos", "--stop", stop]),
        ("seeded", PROMPTS[0], 120, 0.9, ["--seed", "5", "--ignore-eos"]),
        ("seeded with a stop", PROMPTS[0], 120, 0.9, ["--seed", "5", "--ignore-eos", "--stop", "."]),
        ("penalties", PROMPTS[1], 80, 0.0, ["--presence-penalty", "0.5", "--frequency-penalty", "0.3"]),
        ("min_tokens", PROMPTS[1], 80, 0.0, ["--min-tokens", "30", "--stop", "."]),
    ]
    for tp in (1, 2):
        grid = "%dx1" % tp
        want = {}
        with Cluster(STORIES, tp=tp) as c:
            for name, prompt, n, temp, extra in cases:
                rc, out, ids, err = c.generate(prompt, n, temperature=temp, extra=extra)
                check(rc == 0 and ids, "%s %s without the flag: %s" % (grid, name, err))
                want[name] = (out, ids, summary(err))
        check(want["greedy"][1] == ref_ids, "the %s grid's greedy ids differ from loom run's" % grid)
        check(want["stop string"][2][1] == "stop" and len(want["stop string"][1]) < 200,
              "the stop string %r ended nothing: %s" % (stop, want["stop string"][2]))
        with Cluster(STORIES, tp=tp, coord_args=["--async-scheduling"]) as c:
            dropped = 0
            for name, prompt, n, temp, extra in cases:
                before = json.loads(loom_json("stats", "--addr", c.addr).stdout)
                rc, out, ids, err = c.generate(prompt, n, temperature=temp, extra=extra)
                got = (out, ids, summary(err))
                check(rc == 0 and got == want[name], "%s %s with --async-scheduling: %r, without: %r" %
                      (grid, name, got, want[name]))
                check(got[2][0] == len(ids), "%s: usage counts %d tokens, %d were emitted" % (name, got[2][0],
                                                                                             len(ids)))
                after = json.loads(loom_json("stats", "--addr", c.addr).stdout)
                ahead = after["ahead_tokens"] - before["ahead_tokens"]
                dropped_now = after["ahead_dropped"] - before["ahead_dropped"]
                if name in ("penalties",):
                    check(ahead == 0, "%s: %d tokens planned ahead" % (name, ahead))
                elif name == "min_tokens":  # planned ahead once min_tokens is reached
                    check(0 < ahead < got[2][0] - 1, "%s: %d of %d tokens planned ahead" % (name, ahead, got[2][0]))
                else:  # every decode but the first (its predecessor was the prefill)
                    check(ahead >= got[2][0] - 2, "%s %s: %d of %d tokens planned ahead" %
                          (grid, name, ahead, got[2][0]))
                if got[2][1] == "length":
                    check(dropped_now == 0, "%s: %d rows dropped at max_tokens" % (name, dropped_now))
                else:  # its rows in the steps planned ahead of the one that ended it (3 by default)
                    check(1 <= dropped_now <= 3, "%s ended by a stop: %d rows dropped" % (name, dropped_now))
                dropped += dropped_now
            # concurrent requests: batches mix rows planned ahead with admissions
            procs = [c.generate_async(p, 60, extra=["--ignore-eos"]) for p in PROMPTS * 2]
            for p, prompt in zip(procs, PROMPTS * 2):
                _, err = p.communicate(timeout=120)
                _, ids = run_local(STORIES, prompt, 60, extra=["--ignore-eos"])
                check(p.returncode == 0 and parse_ids(err) == ids, "%s concurrent %r: %s" %
                      (grid, prompt, err[-500:]))
            st = json.loads(loom_json("stats", "--addr", c.addr).stdout)
            check(st["ahead_dropped"] == dropped, "stats: %d dropped, counted %d" % (st["ahead_dropped"], dropped))
    with Cluster(STORIES, pp=2, coord_args=["--async-scheduling"]) as c:  # off there, with a warning
        rc, out, ids, err = c.generate(PROMPTS[2], 200, extra=["--ignore-eos"])
        check(rc == 0 and ids == ref_ids, "pp 2 with the flag: %s" % err)
        check("--async-scheduling needs one pipeline stage" in c.log("coordinator"), "no warning on pp 2")
        check(json.loads(loom_json("stats", "--addr", c.addr).stdout)["ahead_tokens"] == 0, "pp 2 planned ahead")


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_stories260k_grids, test_random_gqa_grids, test_qwen2_bias_grids, test_quantized_grids,
               test_quantized_grid_misaligned, test_kv_dtype_grids, test_kv_blocks_stats_metrics_prefix,
               test_kv_dtype_errors, test_async_scheduling])

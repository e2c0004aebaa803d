#!/usr/bin/env python3
"""DeepSeek's latent KV cache against the decompressed one (--disable-mla) on one model, whole-model: output
tokens/s of N concurrent streams (fixed prompt and output lengths, ignore_eos) on two 1x1 grids (coordinator
+ one worker of --threads threads each), one latent and one decompressed, both up at once and measured in
turn, round by round; and the KV cache each holds in the same memory (--kv-cache-memory).

    /usr/bin/python3 bench/bench_mla.py [--model /tmp/ds-bench1b] [--streams 32] [--prompt-len 128]
        [--output-len 32] [--rounds 3] [--threads 2] [--kv-cache-memory 1G] [--kv-cache-dtype f32] [--json FILE]

The model is docs/benchmarks.md's generated 1.28 B DeepSeek-V3 shape (tests/reference/gen_deepseek.py --shape
bench1b); with no tokenizer of its own it gets stories260K's (prompts are random ids below 512, outputs are
ids). Prints, per way and round, output tokens/s over the whole run (prefill included), the decode rate
(streams / mean TPOT), mean TTFT, the load average, and the capacity in tokens.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_grid  # noqa: E402
import harness  # noqa: E402  (tests/integration, put on the path by bench_grid)

WAYS = [("latent", []), ("decompressed", ["--disable-mla"])]


def loom(*args, timeout=60):
    p = subprocess.run([os.path.join(harness.BIN, "loom")] + list(args), capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError("loom %s: %s" % (args[0], p.stderr[-800:]))
    return p.stdout


def run_bench(addr, a, seed):
    out = tempfile.mktemp(suffix=".json")
    try:
        loom("bench", "--addr", addr, "--rate", "inf", "--num-requests", str(a.streams), "--max-concurrency",
             str(a.streams), "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len), "--vocab", "512",
             "--seed", str(seed), "--timeout-s", "3000", "--json", out, timeout=3600)
        with open(out) as f:
            return json.load(f)
    finally:
        if os.path.exists(out):
            os.unlink(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/tmp/ds-bench1b")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="1G")
    ap.add_argument("--kv-cache-dtype", default="f32")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.model, "tokenizer.json")):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(harness.STORIES, f), a.model)
    grids = {}
    try:
        for name, flags in WAYS:
            run_dir = tempfile.mkdtemp(prefix="loom-bench-mla-")
            coord = flags + ["--kv-cache-memory", a.kv_cache_memory, "--kv-cache-dtype", a.kv_cache_dtype,
                             "--max-num-seqs", str(max(a.streams, 8))]
            grids[name] = (bench_grid.launch(a.model, 1, 1, a.threads, run_dir, launch_args=["--"] + coord), run_dir)
        cap = {}
        need = a.streams * (a.prompt_len + a.output_len)
        for name, (addr, _) in grids.items():
            st = json.loads(loom("stats", "--addr", addr))
            cap[name] = dict(blocks=st["kv_blocks_total"], block_bytes=st["kv_block_bytes"],
                             tokens=st["kv_blocks_total"] * st["kv_block_size"],
                             bytes_per_token=st["kv_block_bytes"] / st["kv_block_size"])
            print("%-12s KV: %d blocks of %d B (%d B a token) in %s: %d tokens" % (
                name, st["kv_blocks_total"], st["kv_block_bytes"], cap[name]["bytes_per_token"], a.kv_cache_memory,
                cap[name]["tokens"]), flush=True)
            if cap[name]["tokens"] < need:
                print("  (fewer than the %d tokens %d streams hold at the end: the run preempts)" % (need, a.streams))
        for name, (addr, _) in grids.items():  # warm-up: page in the weights
            run_bench(addr, argparse.Namespace(streams=2, prompt_len=16, output_len=4), 99)
        res = {name: [] for name, _ in WAYS}
        for r in range(a.rounds):
            order = WAYS if r % 2 == 0 else WAYS[::-1]
            for name, _ in order:
                load0 = os.getloadavg()[0]
                b = run_bench(grids[name][0], a, r)
                load1 = os.getloadavg()[0]
                row = dict(out_tps=b["output_throughput"], tpot_ms=b["mean_tpot_ms"], ttft_ms=b["mean_ttft_ms"],
                           decode_tps=a.streams * 1e3 / b["mean_tpot_ms"], duration_s=b["duration"],
                           load=(load0 + load1) / 2, completed=b["completed"])
                res[name].append(row)
                print("round %d %-12s %6.2f out tok/s, decode %6.2f tok/s (TPOT %.0f ms), TTFT %.1f s, %.0f s, "
                      "%d/%d done, load %.1f" % (r + 1, name, row["out_tps"], row["decode_tps"], row["tpot_ms"],
                                                 row["ttft_ms"] / 1e3, row["duration_s"], row["completed"], a.streams,
                                                 row["load"]), flush=True)
    finally:
        for _, run_dir in grids.values():
            bench_grid.stop(run_dir)
    summary = {}
    for name, _ in WAYS:
        rows = res[name]
        summary[name] = {k: dict(best=max(x[k] for x in rows) if k.endswith("tps") else min(x[k] for x in rows),
                                 median=statistics.median(x[k] for x in rows))
                         for k in ("out_tps", "decode_tps", "tpot_ms", "ttft_ms")}
        summary[name]["kv"] = cap[name]
    lat, dec = summary["latent"], summary["decompressed"]
    print("%d streams, prompt %d, output %d, %d rounds (best, median):" % (a.streams, a.prompt_len, a.output_len,
                                                                          a.rounds))
    for k in ("out_tps", "decode_tps"):
        print("  %-10s latent %.2f (%.2f), decompressed %.2f (%.2f): latent %.2fx (%.2fx)" % (
            k, lat[k]["best"], lat[k]["median"], dec[k]["best"], dec[k]["median"], lat[k]["best"] / dec[k]["best"],
            lat[k]["median"] / dec[k]["median"]))
    print("  KV capacity in %s: latent %d tokens, decompressed %d (%.1fx)" % (
        a.kv_cache_memory, lat["kv"]["tokens"], dec["kv"]["tokens"], lat["kv"]["tokens"] / dec["kv"]["tokens"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), rounds=res, summary=summary), f, indent=2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Speculative decoding on stories260K, over prompts the tests do not use:
tokens per target step and batch-1 decode speed-up of `loom run` (ngram, int8 and q4 self-drafts), then output
tokens per target step and wall-clock of requests with sampling controls on a 1x1 cluster (ngram), and of
plain requests on a 1x1 cluster whose coordinator runs an int8 self-draft, then output
throughput of a 1x1 cluster at 32 concurrent streams with speculation on
against off (`loom bench`, random prompts, rounds interleaved), for ngram and the int8 self-draft.

    /usr/bin/python3 bench/bench_spec.py [--model DIR] [--tokens 256] [--rounds 3] [--k 4] [--grid-only] [--draft-only]
    /usr/bin/python3 bench/bench_spec.py --gate-only [--fixed-k] [--methods "int8 self-draft"] [--model DIR]
        (random against repetitive prompts, the wall-time gate; --fixed-k: drafting every step in the same rounds)

The verify-cost side (K+1 tokens against one, on a model beyond the L3) is
build/bin/bench_spec; docs/speculative.md has the figures.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import harness  # noqa: E402

PROMPTS = [  # held out: no test uses these
    "Sam found a shiny stone by the river. He showed the stone to his mom and said",
    "The bird sang a song every morning. One morning the bird did not sing, so",
    "Anna had a big box of crayons. She drew a sun, a tree and a house. Then she",
    "Max the dog liked to dig. He dug in the garden and found an old bone. Max",
]


def loom_run(model, prompt, tokens, extra, want_gate=False):
    p = subprocess.run([os.path.join(harness.BIN, "loom"), "run", "--model", model, "--prompt", prompt,
                        "--max-tokens", str(tokens), "--temperature", "0", "--ignore-eos", "--threads", "1"] + extra,
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(p.stderr)
    rate = float(re.search(r"decode ([\d.]+) tokens/s", p.stderr).group(1))
    m = re.search(r"tokens per target step: ([\d.]+)", p.stderr)
    acc = re.search(r"acceptance rate ([\d.]+)%", p.stderr)
    res = (rate, float(m.group(1)) if m else 1.0, float(acc.group(1)) if acc else 0.0)
    if want_gate:  # decode tokens a CPU second (what a loaded machine's waits for a core do not move),
        # and the gate's end state: on, off, or off from the start (the estimate)
        res += (float(re.search(r"decode [\d.]+ tokens/s \(([\d.]+) a CPU second\)", p.stderr).group(1)),)
        g = re.search(r"speculation gate: (\w+)", p.stderr)
        state = g.group(1) if g else "-"
        if state == "off" and "started off" in p.stderr and "turned off 0, on 0" in p.stderr:
            state = "start-off"
        res += (state,)
    return res


def bench_local(model, tokens, rounds, k, name, spec):
    print("loom run, batch 1, greedy, %d tokens per prompt, %s K=%d (adaptive)" % (tokens, name, k))
    print("%-40s %10s %10s %8s %8s %8s" % ("prompt", "off tok/s", "on tok/s", "speedup", "tok/step", "accept%"))
    speedups, tps = [], []
    for prompt in PROMPTS:
        off, on, steps, accs = [], [], [], []
        for _ in range(rounds):
            off.append(loom_run(model, prompt, tokens, [])[0])
            r, t, a = loom_run(model, prompt, tokens, spec)
            on.append(r)
            steps.append(t)
            accs.append(a)
        o, n = statistics.median(off), statistics.median(on)
        speedups.append(n / o)
        tps.append(statistics.median(steps))
        print("%-40s %10.0f %10.0f %8.2f %8.2f %8.1f" % (prompt[:40], o, n, n / o, tps[-1], statistics.median(accs)))
    print("mean: speed-up %.2fx, %.2f tokens per target step" % (statistics.mean(speedups), statistics.mean(tps)))


def bench_load(model, rounds, k, spec):
    with open(os.path.join(model, "config.json")) as f:
        vocab = min(json.load(f)["vocab_size"], 512)
    out = tempfile.mkdtemp(prefix="loom-bench-spec-")
    args = ["--num-requests", "64", "--max-concurrency", "32", "--rate", "inf", "--prompt-len", "64",
            "--output-len", "64", "--vocab", str(vocab), "--seed", "7"]
    clusters = {"off": [], "on": spec + ["--num-speculative-tokens", str(k)]}
    res = {"off": [], "on": []}
    threads = max(1, (os.cpu_count() or 2))
    for name, coord in clusters.items():
        with harness.Cluster(model, 1, 1, coord_args=coord, threads=threads) as c:
            for r in range(rounds + 1):
                path = os.path.join(out, "%s-%d.json" % (name, r))
                p = subprocess.run([os.path.join(harness.BIN, "loom"), "bench", "--addr", c.addr, "--json", path] + args,
                                   capture_output=True, text=True, timeout=1800)
                if p.returncode not in (0, 1):
                    raise RuntimeError(p.stderr)
                with open(path) as f:
                    if r:  # the first round warms up
                        res[name].append(json.load(f)["output_throughput"])
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    print("32 concurrent streams, %s: off %.0f tok/s, on %.0f tok/s, ratio %.3f" % (" ".join(spec), off, on, on / off))


def bench_grid(model, tokens, rounds, k, spec, controls, title):
    """1x1 cluster, batch 1: each prompt x controls case with speculation on and off per request, interleaved."""
    print("1x1 cluster, batch 1, greedy, %d tokens, %s K=%d (adaptive), %s" % (tokens, " ".join(spec), k, title))
    print("%-34s %-28s %9s %9s %8s %8s" % ("prompt", "controls", "off s", "on s", "speedup", "tok/step"))
    coord = spec + ["--num-speculative-tokens", str(k)]
    speedups, tps = [], []
    with harness.Cluster(model, 1, 1, coord_args=coord) as c:
        for prompt in PROMPTS:
            for ctl in controls:
                t = {"off": [], "on": []}
                steps = []
                for _ in range(rounds):  # interleaved
                    for name, extra in (("off", ["--no-speculation"]), ("on", [])):
                        p = subprocess.run(harness.loom_generate_cmd(c.addr, prompt, tokens, 0.0,
                                                                     ctl + extra + ["--ignore-eos"]),
                                           capture_output=True, text=True, timeout=300)
                        if p.returncode != 0:
                            raise RuntimeError(p.stderr)
                        t[name].append(float(re.search(r"([\d.]+) s total", p.stderr).group(1)))
                        m = re.search(r"tokens per target step: ([\d.]+)", p.stderr)
                        if name == "on":
                            steps.append(float(m.group(1)) if m else 1.0)
                o, n = statistics.median(t["off"]), statistics.median(t["on"])
                speedups.append(o / n)
                tps.append(statistics.median(steps))
                print("%-34s %-28s %9.3f %9.3f %8.2f %8.2f" % (prompt[:34], " ".join(ctl), o, n, o / n, tps[-1]))
    print("mean: speed-up %.2fx, %.2f tokens per target step" % (statistics.mean(speedups), statistics.mean(tps)))


NGRAM = ["--speculative-method", "ngram"]
SELF_INT8 = ["--speculative-method", "draft", "--speculative-quantization", "int8"]

GATE_PROMPTS = {  # low acceptance: words in no order; high: a sentence repeated
    "random": "plate river seven quietly orange jump cloud pencil under hat brave spoon later tiny",
    "repetitive": "The cat sat on the mat. " * 8,
}


def load_average():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def bench_gate(model, tokens, rounds, k, fixed_k=False, methods=None, extra=()):
    """The wall-time gate (common/spec_gate.h): speed with speculation on
    (adaptive K, the start-up estimate and the gate) against off, per prompt
    kind, rounds interleaved; the ratio is the median's, the range each
    round's (off then on, one after the other), with the load average; the
    same ratio of decode tokens a CPU second (`cpu`), which the waits of a
    loaded machine do not move. With fixed_k, each round also runs
    `--speculative-fixed-k` (drafting every step, no gate): its wall and CPU
    ratios against off, and its tokens per target step."""
    print("loom run, batch 1, greedy, %d tokens, K=%d adaptive with the wall-time gate, %d interleaved rounds, %s"
          % (tokens, k, rounds, os.path.basename(model.rstrip("/"))))
    print("%-16s %-11s %10s %10s %8s %13s %8s %8s %8s %-9s %-9s %s" % (
        "method", "prompt", "off tok/s", "on tok/s", "on/off", "rounds", "cpu", "tok/step", "accept%", "gate", "load",
        "fixed-K: wall cpu tok/step" if fixed_k else ""))
    runs = [("ngram", NGRAM), ("int8 self-draft", SELF_INT8),
            ("q4 self-draft", ["--speculative-method", "draft", "--speculative-quantization", "q4"])]
    for name, spec in runs:
        if name not in (methods or ["ngram", "int8 self-draft"]):
            continue
        spec = spec + ["--num-speculative-tokens", str(k)] + list(extra)
        for kind, prompt in GATE_PROMPTS.items():
            off, on, steps, accs, gates, loads, cpu_off, cpu_on = [], [], [], [], [], [], [], []
            fixed, cpu_fixed, steps_fixed = [], [], []
            for _ in range(rounds):
                loads.append(load_average())
                r, _, _, c, _ = loom_run(model, prompt, tokens, list(extra), want_gate=True)
                off.append(r)
                cpu_off.append(c)
                r, t, acc, c, gate = loom_run(model, prompt, tokens, spec, want_gate=True)
                on.append(r)
                cpu_on.append(c)
                steps.append(t)
                accs.append(acc)
                gates.append(gate)
                if fixed_k:
                    r, t, _, c, _ = loom_run(model, prompt, tokens, spec + ["--speculative-fixed-k"], want_gate=True)
                    fixed.append(r)
                    cpu_fixed.append(c)
                    steps_fixed.append(t)
            loads.append(load_average())
            ratios = [n / o for n, o in zip(on, off)]
            print("%-16s %-11s %10.1f %10.1f %7.2fx %13s %7.3fx %8.2f %8.1f %-9s %.1f-%.1f %s" % (
                name, kind, statistics.median(off), statistics.median(on),
                statistics.median(on) / statistics.median(off),
                "%.2f-%.2fx" % (min(ratios), max(ratios)), statistics.median(cpu_on) / statistics.median(cpu_off),
                statistics.median(steps),
                statistics.median(accs), max(set(gates), key=gates.count), min(loads), max(loads),
                "%.2fx %.3fx %.2f" % (statistics.median(fixed) / statistics.median(off),
                                      statistics.median(cpu_fixed) / statistics.median(cpu_off),
                                      statistics.median(steps_fixed)) if fixed_k else ""), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=harness.STORIES)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--grid-only", action="store_true", help="only the cluster parts (controls, draft, 32 streams)")
    ap.add_argument("--draft-only", action="store_true", help="only the cluster parts with the coordinator's draft")
    ap.add_argument("--gate-only", action="store_true", help="only loom run on random and repetitive prompts")
    ap.add_argument("--fixed-k", action="store_true",
                    help="--gate-only: also --speculative-fixed-k in each round; grid: the coordinator drafts fixed K")
    ap.add_argument("--methods", default="ngram,int8 self-draft",
                    help="--gate-only: which of ngram, int8 self-draft, q4 self-draft (comma-separated)")
    ap.add_argument("--threads", type=int, default=1, help="--gate-only: loom run's --threads")
    a = ap.parse_args()
    if a.gate_only:
        bench_gate(a.model, a.tokens, a.rounds, a.k, a.fixed_k, a.methods.split(","),
                   ["--threads", str(a.threads)] if a.threads != 1 else [])
        return
    methods = {"ngram": NGRAM, "int8 self-draft": SELF_INT8,
               "q4 self-draft": ["--speculative-method", "draft", "--speculative-quantization", "q4"]}
    for name, spec in ({} if a.grid_only or a.draft_only else methods).items():
        bench_local(a.model, a.tokens, a.rounds, a.k, name, spec + ["--num-speculative-tokens", str(a.k)])
    if not a.draft_only:
        controls = [["--frequency-penalty", "0.3"], ["--presence-penalty", "-0.5"], ["--repetition-penalty", "0.9"]]
        bench_grid(a.model, a.tokens, a.rounds, a.k, NGRAM, controls, "requests with sampling controls")
    bench_grid(a.model, a.tokens, a.rounds, a.k, SELF_INT8 + (["--speculative-fixed-k"] if a.fixed_k else []), [[]],
               "the draft in the coordinator")
    if not a.skip_load:
        for spec in ([SELF_INT8] if a.draft_only else [NGRAM, SELF_INT8]):
            bench_load(a.model, a.rounds, a.k, spec)


if __name__ == "__main__":
    main()

"""Quantized checkpoints end to end.

- `loom quantize` output loads (one process and a 2x1 / 1x2 grid) and gives
  the same greedy ids as quantizing the float checkpoint on load.
- Corrupt or inconsistent quantized checkpoints (Loom's layout, AWQ, GPTQ)
  fail to load with an error naming the tensor; a cluster given one keeps
  its coordinator up and reports the workers' load failure.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "reference"))
from harness import BIN, PYTHON, STORIES, Cluster, check, check_refused_shard, run_local, run_tests  # noqa: E402
import gen_quant_ckpt  # noqa: E402

WORK = os.environ.get("LOOM_TEST_WORK", "/tmp/loom-it-quant")
PROMPT = "Once upon a time"
N_TOKENS = 32


def loom_quantize(out, scheme):
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run([os.path.join(BIN, "loom"), "quantize", STORIES, out, "--quantization", scheme],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode == 0, "loom quantize %s failed: %s" % (scheme, p.stderr))
    return out


def read_st(path):
    """-> (header dict with __metadata__, {name: raw bytes})."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack_from("<Q", data)[0]
    hdr = json.loads(data[8:8 + n])
    base = 8 + n
    raw = {k: data[base + v["data_offsets"][0]:base + v["data_offsets"][1]]
           for k, v in hdr.items() if k != "__metadata__"}
    return hdr, raw


def write_st(path, hdr, raw):
    """Rewrites a file from (possibly edited) header entries and raw bytes."""
    tensors = []
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        a = np.frombuffer(raw[k], dtype=np.uint8)
        tensors.append((k, a, v["dtype"], v["shape"]))
    out = {"__metadata__": hdr.get("__metadata__", {})}
    off = 0
    for k, a, dt, shape in tensors:
        out[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    hb = json.dumps(out, separators=(",", ":")).encode()
    hb += b" " * ((8 - (8 + len(hb)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, a, _, _ in tensors:
            f.write(a.tobytes())


def run_fails(model, *names):
    p = subprocess.run([os.path.join(BIN, "loom"), "run", "--model", model, "--prompt", PROMPT,
                        "--max-tokens", "4", "--threads", "1", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode != 0, "loom run on %s succeeded" % model)
    check("Sanitizer" not in p.stderr and "runtime error" not in p.stderr, "sanitizer report: %s" % p.stderr)
    for n in names:
        check(n in p.stderr, "error for %s does not name %r: %s" % (os.path.basename(model), n, p.stderr.strip()))
    return p.stderr.strip()


def test_quantize_matches_load():
    for scheme in ["int8", "fp8", "q4", "q4_min", "q4_min:64"]:
        out = loom_quantize(os.path.join(WORK, "stories-" + scheme.replace(":", "-")), scheme)
        _, on_load = run_local(STORIES, PROMPT, N_TOKENS, extra=["--ignore-eos", "--quantization", scheme])
        _, stored = run_local(out, PROMPT, N_TOKENS, extra=["--ignore-eos"])
        check(len(on_load) == N_TOKENS and stored == on_load,
              "%s: loom quantize output gives %s, quantize on load %s" % (scheme, stored, on_load))
        hdr, _ = read_st(os.path.join(out, "model.safetensors"))
        check(hdr["__metadata__"]["quantization"] == scheme, "metadata %r" % hdr["__metadata__"])
        with open(os.path.join(out, "config.json")) as f:
            qc = json.load(f)["quantization_config"]
        check(qc["quant_method"] == "loom" and qc["scheme"] == scheme, "quantization_config %r" % qc)
        print("  %s: loom quantize output and quantize-on-load agree on %d ids" % (scheme, N_TOKENS))
    # the stored file is smaller than the float one
    q4 = os.path.getsize(os.path.join(WORK, "stories-q4", "model.safetensors"))
    f32 = os.path.getsize(os.path.join(STORIES, "model.safetensors"))
    check(q4 < 0.6 * f32, "q4 file %d bytes vs float %d" % (q4, f32))
    # refusals: an unknown scheme, an already quantized input, a bad --quantization on loom run
    loom = os.path.join(BIN, "loom")
    for cmd, want in [([loom, "quantize", STORIES, os.path.join(WORK, "x"), "--quantization", "q4:48"], "q4:48"),
                      ([loom, "quantize", os.path.join(WORK, "stories-q4"), os.path.join(WORK, "x")],
                       "already quantized"),
                      ([loom, "run", "--model", STORIES, "--prompt", "x", "--quantization", "int4"], "int4")]:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and want in p.stderr, "%s: rc %d, %s" % (" ".join(cmd[1:3]), p.returncode, p.stderr))


def test_quantized_dir_grids():
    out = os.path.join(WORK, "stories-q4")
    if not os.path.exists(out):
        loom_quantize(out, "q4")
    _, expect = run_local(out, PROMPT, N_TOKENS, extra=["--ignore-eos"])
    for tp, pp in [(2, 1), (1, 2)]:
        with Cluster(out, tp, pp) as c:
            rc, _, ids, err = c.generate(PROMPT, N_TOKENS, extra=["--ignore-eos"])
            check(rc == 0, "%dx%d generate failed: %s" % (tp, pp, err))
            check(ids == expect, "%dx%d on the q4 directory: %s vs %s" % (tp, pp, ids, expect))
            logs = c.log("worker-0")
            check("matmul weights quantized" in logs and "(0 matmul weights quantized)" not in logs,
                  "worker-0 did not load quantized weights")
        print("  q4 directory on %dx%d: %d ids identical to loom run" % (tp, pp, N_TOKENS))


def corrupt_loom(name, edit):
    src = os.path.join(WORK, "stories-q4")
    if not os.path.exists(src):
        loom_quantize(src, "q4")
    dst = os.path.join(WORK, "bad-loom-" + name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    hdr, raw = read_st(path)
    edit(hdr, raw)
    write_st(path, hdr, raw)
    return dst


def test_bad_loom_checkpoints():
    t = "model.layers.1.self_attn.q_proj"

    def missing_scales(hdr, raw):
        del hdr[t + ".scales"]

    def qweight_shape(hdr, raw):
        hdr[t + ".qweight"]["shape"] = [32, 64]  # 64 x 32 bytes stored as 32 x 64: rows wrong

    def groups_not_dividing(hdr, raw):
        # 64 rows x 3 scales: 3 groups do not divide 64 columns
        hdr[t + ".scales"]["shape"] = [64, 3]
        raw[t + ".scales"] = raw[t + ".scales"] + bytes(64 * 4)

    def qweight_dtype(hdr, raw):
        hdr[t + ".qweight"]["dtype"] = "I16"
        hdr[t + ".qweight"]["shape"] = [64, 16]

    def mins_on_int8(hdr, raw):
        down = "model.layers.0.mlp.down_proj"  # int8 (172 inputs)
        hdr[down + ".mins"] = {"dtype": "F32", "shape": [64, 1]}
        raw[down + ".mins"] = b"\0" * 256

    cases = [("missing_scales", missing_scales, t + ".scales"), ("qweight_shape", qweight_shape, t + ".qweight"),
             ("groups", groups_not_dividing, (t + ".scales", "do not divide")), ("qweight_dtype", qweight_dtype, t + ".qweight"),
             ("mins_int8", mins_on_int8, "model.layers.0.mlp.down_proj.mins")]
    for name, edit, tensor in cases:
        msg = run_fails(corrupt_loom(name, edit), *(tensor if isinstance(tensor, tuple) else (tensor,)))
        print("  %s: %s" % (name, msg.splitlines()[-1]))


def test_bad_awq_gptq_checkpoints():
    gen = os.path.join(os.path.dirname(HERE), "reference", "gen_quant_ckpt.py")
    t = "model.layers.0.self_attn.q_proj"
    cases = [("awq", "qweight_shape", t + ".qweight"), ("gptq", "missing_scales", t + ".scales"),
             ("awq", "missing_qzeros", t + ".qzeros"), ("gptq", "scales_dtype", t + ".scales"),
             ("awq", "group_not_dividing", t), ("gptq", "act_order", t + ".g_idx")]
    for fmt, kind, tensor in cases:
        out = os.path.join(WORK, "bad-%s-%s" % (fmt, kind))
        shutil.rmtree(out, ignore_errors=True)
        p = subprocess.run([PYTHON, gen, "--src", STORIES, "--format", fmt, "--out", out, "--corrupt", kind],
                           capture_output=True, text=True, timeout=120)
        check(p.returncode == 0, "gen_quant_ckpt failed: %s" % p.stderr)
        msg = run_fails(out, tensor)
        print("  %s %s: %s" % (fmt, kind, msg.splitlines()[-1]))


def test_cluster_reports_bad_checkpoint():
    # A coordinator and one worker on a checkpoint without scales: the worker
    # refuses to load, and the coordinator stays up and tells clients why.
    bad = corrupt_loom("missing_scales_cluster", lambda hdr, raw: hdr.pop("model.layers.1.self_attn.q_proj.scales"))
    check_refused_shard(bad, os.path.join(WORK, "bad-cluster"), ["model.layers.1.self_attn.q_proj.scales"],
                        "model.layers.1.self_attn.q_proj.scales")


if __name__ == "__main__":
    os.makedirs(WORK, exist_ok=True)
    run_tests([test_quantize_matches_load, test_quantized_dir_grids, test_bad_loom_checkpoints,
               test_bad_awq_gptq_checkpoints, test_cluster_reports_bad_checkpoint])

"""Write a 4-bit AWQ or GPTQ checkpoint of a float model, in the layouts those
tools publish (docs/model-format.md), and its dequantized float twin.

Every linear whose input dimension the group size divides, and whose output
dimension 8 divides (8 codes a packed word), is quantized (asymmetric or
--sym, round to nearest, f16 scales); the others (stories260K's MLP: 172
hidden units) stay float, as AWQ's modules_to_not_convert allows.
The twin holds w = s * (q - z) in float32 for the torch reference
(llama_ref.py). --corrupt writes a deliberately broken variant instead, for
the loader's error tests.

  gen_quant_ckpt.py --src DIR --format awq|gptq|gptq_v2 --out DIR [--dequantized-out DIR]
                    [--group 32] [--sym] [--g-idx trivial|shuffled] [--corrupt KIND]
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k of a word holds column 8c + AWQ_ORDER[k]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
CORRUPT = ["qweight_shape", "group_not_dividing", "missing_scales", "scales_dtype", "missing_qzeros",
           "act_order"]


def write_raw(path, tensors, metadata=None):
    """tensors: list of (name, numpy array, safetensors dtype string)."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, a, dt in tensors:
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - (8 + len(hb)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, a, _ in tensors:
            f.write(np.ascontiguousarray(a).tobytes())


def quantize(w, group, sym, min_zero=0):
    """w (out, in) -> q (out, in) ints 0..15, z (out, groups) ints, s (out, groups) f16.
    min_zero 1 keeps zero points of GPTQ v1 (stored minus one) off 0, which
    that format cannot represent."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group).astype(np.float64)
    if sym:
        s = np.max(np.abs(g), axis=2) / 7.0
        z = np.full(s.shape, 8, dtype=np.int64)
    else:
        lo, hi = np.minimum(g.min(axis=2), 0), np.maximum(g.max(axis=2), 0)
        s = (hi - lo) / 15.0
    s = np.where(s == 0, 1e-4, s).astype(np.float16)
    sf = s.astype(np.float64)
    if not sym:
        z = np.clip(np.round(-lo / sf), min_zero, 15).astype(np.int64)
    q = np.clip(np.round(g / sf[:, :, None]) + z[:, :, None], 0, 15).astype(np.int64)
    return q.reshape(out_f, in_f), z, s


def pack_cols(v, order=None):
    """(rows, cols) ints 0..15 -> (rows, cols/8) int32, 8 columns a word."""
    rows, cols = v.shape
    out = np.zeros((rows, cols // 8), dtype=np.uint32)
    for k in range(8):
        j = order[k] if order else k
        out |= (v[:, j::8].astype(np.uint32) & 15) << np.uint32(4 * k)
    return out.view(np.int32)


def pack_rows(v):
    """(rows, cols) ints 0..15 -> (rows/8, cols) int32, 8 rows a word (GPTQ qweight)."""
    rows, cols = v.shape
    out = np.zeros((rows // 8, cols), dtype=np.uint32)
    for k in range(8):
        out |= (v[k::8, :].astype(np.uint32) & 15) << np.uint32(4 * k)
    return out.view(np.int32)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True)
    p.add_argument("--format", required=True, choices=["awq", "gptq", "gptq_v2"])
    p.add_argument("--out", required=True)
    p.add_argument("--dequantized-out")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--sym", action="store_true")
    p.add_argument("--g-idx", choices=["none", "trivial", "shuffled"], default="none")
    p.add_argument("--corrupt", choices=CORRUPT)
    a = p.parse_args()

    with open(os.path.join(a.src, "config.json")) as f:
        cfg = json.load(f)
    tensors, _ = safetensors_io.read_model_dir(a.src)
    awq = a.format == "awq"
    group = a.group
    if a.corrupt == "group_not_dividing":
        group = 48  # does not divide 64
    out, deq, skipped = [], [], []
    for name in sorted(tensors):
        w = np.asarray(tensors[name], dtype=np.float32)
        prefix = name[:-len(".weight")] if name.endswith(".weight") else None
        is_lin = prefix and any(prefix.endswith(l) for l in LINEARS)
        if not is_lin or w.shape[1] % a.group or w.shape[0] % 8:
            out.append((name, w, "F32"))
            deq.append((name, w))
            if is_lin:
                skipped.append(prefix.split(".", 3)[-1])
            continue
        q, z, s = quantize(w, a.group, a.sym, 1 if a.format == "gptq" else 0)
        deq.append((name, (s.astype(np.float32).repeat(a.group, axis=1) *
                           (q - z.repeat(a.group, axis=1)).astype(np.float32)).astype(np.float32)))
        zs = z - 1 if a.format == "gptq" else z  # GPTQ v1 stores zero points minus one
        zs = zs & 15
        if awq:
            qw = pack_cols(q.T, AWQ_ORDER)            # (in, out/8)
            qz = pack_cols(zs.T, AWQ_ORDER)           # (groups, out/8)
        else:
            qw = pack_rows(q.T)                       # (in/8, out)
            qz = pack_cols(zs.T)                      # (groups, out/8)
        sc = s.T.copy()                               # (groups, out) f16
        if a.corrupt == "qweight_shape":
            qw = qw[:-1]
        if a.corrupt == "scales_dtype":
            sc = sc.view(np.int16)
        out.append((prefix + ".qweight", qw, "I32"))
        if a.corrupt != "missing_qzeros":
            out.append((prefix + ".qzeros", qz, "I32"))
        if a.corrupt != "missing_scales":
            out.append((prefix + ".scales", sc, "I16" if a.corrupt == "scales_dtype" else "F16"))
        if not awq and (a.g_idx != "none" or a.corrupt == "act_order"):
            gi = np.arange(w.shape[1], dtype=np.int32) // a.group
            if a.g_idx == "shuffled" or a.corrupt == "act_order":
                gi = np.random.default_rng(3).permutation(gi).astype(np.int32)
            out.append((prefix + ".g_idx", gi, "I32"))

    os.makedirs(a.out, exist_ok=True)
    write_raw(os.path.join(a.out, "model.safetensors"), out, {"format": "pt"})
    qc = {"quant_method": "awq" if awq else "gptq", "bits": 4, "group_size": group}
    if awq:
        qc.update({"version": "gemm", "zero_point": not a.sym, "modules_to_not_convert": sorted(set(skipped))})
    else:
        qc.update({"sym": a.sym, "desc_act": a.g_idx == "shuffled", "checkpoint_format": a.format})
    qcfg = dict(cfg, quantization_config=qc)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(qcfg, f, indent=2)
    for extra in ["tokenizer.json", "tokenizer_config.json"]:
        if os.path.exists(os.path.join(a.src, extra)):
            shutil.copy(os.path.join(a.src, extra), os.path.join(a.out, extra))
    if a.dequantized_out:
        os.makedirs(a.dequantized_out, exist_ok=True)
        safetensors_io.write(os.path.join(a.dequantized_out, "model.safetensors"), deq)
        with open(os.path.join(a.dequantized_out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


if __name__ == "__main__":
    main()

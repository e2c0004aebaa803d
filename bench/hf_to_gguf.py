#!/usr/bin/env python3
"""Writes a generated Llama checkpoint (tests/reference/gen_model.py: config.json +
model.safetensors, f32) as an f32 GGUF file for llama.cpp's tools, with numpy only.

Only what bench/vs_llamacpp.sh needs: arch "llama", untied or tied LM head, a
placeholder SentencePiece-style vocabulary (<unk>, <s>, </s>, 256 byte tokens,
then t<i>) of the config's size, since the benchmarks feed random token ids.
With --hf-tokenizer it also writes that vocabulary into MODEL_DIR as an HF
tokenizer.json (BPE, no merges, byte fallback), so a server that needs one
(Loom's coordinator) and llama-server hold the same 32,000 tokens: what
`MODE=serve bench/vs_llamacpp.sh` serves.
Q and K rows are permuted from the checkpoint's rotate-half order to GGUF's
interleaved RoPE order, as llama.cpp's own converter does, so the file is a
faithful model and not only the right shapes.

    hf_to_gguf.py MODEL_DIR OUT.gguf
    hf_to_gguf.py --hf-tokenizer MODEL_DIR
"""
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
import safetensors_io  # noqa: E402

ALIGN = 32
T_U32, T_I32, T_F32, T_STR, T_ARR = 4, 5, 6, 8, 9
GGML_F32 = 0


def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, value):
    out = gstr(key) + struct.pack("<I", vtype)
    if vtype == T_STR:
        return out + gstr(value)
    if vtype == T_ARR:
        etype, items = value
        out += struct.pack("<IQ", etype, len(items))
        if etype == T_STR:
            return out + b"".join(gstr(s) for s in items)
        fmt = {T_I32: "<i", T_F32: "<f", T_U32: "<I"}[etype]
        return out + b"".join(struct.pack(fmt, v) for v in items)
    return out + struct.pack({T_U32: "<I", T_I32: "<i", T_F32: "<f"}[vtype], value)


def permute_rope(w, n_head):
    """HF rotate-half rows -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def placeholder_vocab(vocab):
    """The token strings and GGUF token types: <unk>, <s>, </s>, 256 bytes, t<i>."""
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % i for i in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, control, byte
    tokens += ["t%d" % i for i in range(vocab - len(tokens))]
    types += [1] * (vocab - len(types))
    return tokens, types


def write_hf_tokenizer(src, vocab):
    """The placeholder vocabulary as tokenizer.json (Llama-style: SentencePiece
    space marker, byte fallback, no merges) and a tokenizer_config.json."""
    tokens, _ = placeholder_vocab(vocab)
    special = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for i in range(3)]
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": []},
    }
    with open(os.path.join(src, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                   "model_max_length": 2048}, f)
    print("hf_to_gguf: %s/tokenizer.json: %d placeholder tokens" % (src, vocab))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--hf-tokenizer":
        with open(os.path.join(sys.argv[2], "config.json")) as f:
            write_hf_tokenizer(sys.argv[2], json.load(f)["vocab_size"])
        return
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out_path = sys.argv[1], sys.argv[2]
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type", "llama") != "llama":
        sys.exit("hf_to_gguf: only llama checkpoints (got %s)" % cfg.get("model_type"))
    t, _ = safetensors_io.read_model_dir(src)
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dim, vocab = cfg["hidden_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or dim // n_head

    tensors = [("token_embd.weight", t["model.embed_tokens.weight"])]
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        b = "blk.%d." % i
        tensors += [
            (b + "attn_norm.weight", t[p + "input_layernorm.weight"]),
            (b + "attn_q.weight", permute_rope(t[p + "self_attn.q_proj.weight"], n_head)),
            (b + "attn_k.weight", permute_rope(t[p + "self_attn.k_proj.weight"], n_kv)),
            (b + "attn_v.weight", t[p + "self_attn.v_proj.weight"]),
            (b + "attn_output.weight", t[p + "self_attn.o_proj.weight"]),
            (b + "ffn_norm.weight", t[p + "post_attention_layernorm.weight"]),
            (b + "ffn_gate.weight", t[p + "mlp.gate_proj.weight"]),
            (b + "ffn_up.weight", t[p + "mlp.up_proj.weight"]),
            (b + "ffn_down.weight", t[p + "mlp.down_proj.weight"]),
        ]
    tensors.append(("output_norm.weight", t["model.norm.weight"]))
    if "lm_head.weight" in t:
        tensors.append(("output.weight", t["lm_head.weight"]))

    tokens, types = placeholder_vocab(vocab)
    meta = [
        kv("general.architecture", T_STR, "llama"),
        kv("general.name", T_STR, os.path.basename(os.path.normpath(src))),
        kv("general.alignment", T_U32, ALIGN),
        kv("llama.context_length", T_U32, cfg.get("max_position_embeddings", 2048)),
        kv("llama.embedding_length", T_U32, dim),
        kv("llama.block_count", T_U32, cfg["num_hidden_layers"]),
        kv("llama.feed_forward_length", T_U32, cfg["intermediate_size"]),
        kv("llama.attention.head_count", T_U32, n_head),
        kv("llama.attention.head_count_kv", T_U32, n_kv),
        kv("llama.attention.key_length", T_U32, head_dim),
        kv("llama.attention.value_length", T_U32, head_dim),
        kv("llama.rope.dimension_count", T_U32, head_dim),
        kv("llama.rope.freq_base", T_F32, float(cfg.get("rope_theta", 10000.0))),
        kv("llama.attention.layer_norm_rms_epsilon", T_F32, float(cfg.get("rms_norm_eps", 1e-5))),
        kv("llama.vocab_size", T_U32, vocab),
        kv("general.file_type", T_U32, 0),
        kv("tokenizer.ggml.model", T_STR, "llama"),
        kv("tokenizer.ggml.tokens", T_ARR, (T_STR, tokens)),
        kv("tokenizer.ggml.scores", T_ARR, (T_F32, [0.0] * vocab)),
        kv("tokenizer.ggml.token_type", T_ARR, (T_I32, types)),
        kv("tokenizer.ggml.bos_token_id", T_U32, 1),
        kv("tokenizer.ggml.eos_token_id", T_U32, 2),
        kv("tokenizer.ggml.unknown_token_id", T_U32, 0),
    ]

    infos, offset = [], 0
    for name, a in tensors:
        a = np.ascontiguousarray(a, dtype=np.float32)
        dims = list(reversed(a.shape))  # GGUF: innermost dimension first
        infos.append(gstr(name) + struct.pack("<I", len(dims)) + struct.pack("<%dQ" % len(dims), *dims)
                     + struct.pack("<IQ", GGML_F32, offset))
        offset += (a.nbytes + ALIGN - 1) // ALIGN * ALIGN
    with open(out_path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
        for m in meta:
            f.write(m)
        for info in infos:
            f.write(info)
        f.write(b"\0" * (-f.tell() % ALIGN))
        for _, a in tensors:
            b = np.ascontiguousarray(a, dtype=np.float32).tobytes()
            f.write(b)
            f.write(b"\0" * (-len(b) % ALIGN))
    print("hf_to_gguf: %s: %d tensors, %.1f MB" % (out_path, len(tensors), os.path.getsize(out_path) / 1e6))


if __name__ == "__main__":
    main()

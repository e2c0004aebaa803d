"""Independent reference for Loom's tests: the Hugging Face Llama forward pass in float64.

Also the dense relatives as Transformers defines them: Qwen2 (q/k/v biases),
Qwen3 (RMSNorm of each q and k head before RoPE), Mistral (a sliding window
of `sliding_window` positions, the latest ones, the query's own included),
Gemma 3 and Gemma 2 ((1+w) norms around both blocks, scaled embeddings,
alternating sliding and global layers; Gemma 2's tanh soft caps on the
attention scores and the final logits),
the gated MLP with any hidden_act below, and RoPE scaling default, llama3,
linear and yarn (whose attention factor multiplies cos and sin).
The Mixture-of-Experts families: Mixtral, Qwen3-MoE, Qwen2-MoE, and GPT-OSS
(GptOssForCausalLM: q/k/v/o biases, a learned sink logit per head in every
softmax, alternating sliding and full layers, and in every layer a biased
router whose top-k logits are softmaxed, over experts with biases and a
clamped SwiGLU; float experts or MXFP4 ones, dequantized here).

Reads a model directory in Hugging Face layout (config.json plus safetensors,
single or sharded; F32, F16 or BF16), runs the full forward pass with torch in
float64 (no KV cache: every step recomputes the whole sequence), and writes
per-position logits and/or greedy ids. stdout carries only the greedy ids (or
OK for --self-test); everything else goes to stderr.
"""

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

DT = torch.float64

# GptOssConfig's rope_scaling when config.json has none
OSS_DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "truncate": False, "original_max_position_embeddings": 4096}
# What each family's Transformers config class (models/<family>/configuration_<family>.py) gives the keys a
# config.json leaves out, where they are not Llama's (LlamaConfig: num_key_value_heads and head_dim derived from
# the heads, 2048 positions, eps 1e-6, rope_theta 10000). An explicit null stays None (derived, for kv heads and
# head_dim), as in the classes.
CLASS_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 4096 * 32},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    "phi3": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "gemma2": {"num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
               "query_pre_attn_scalar": 256},
    "gemma3_text": {"num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
                    "rope_theta": 1000000.0, "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000.0,
                    "sliding_window_pattern": 6, "sliding_window": 4096},
    "mixtral": {"num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                "rope_theta": 1000000.0},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768},
    "qwen2_moe": {"num_key_value_heads": 16, "max_position_embeddings": 32768},
    "gpt_oss": {"num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_theta": 150000.0},
}
# MXFP4's E2M1 codes (the high bit the sign) -> values
FP4_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def log(*args):
    print(*args, file=sys.stderr)


# ---------------------------------------------------------------- loading

def read_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    mt = c.get("model_type")
    for key, v in CLASS_DEFAULTS.get(mt, {}).items():
        c.setdefault(key, v)
    gemma = mt in ("gemma2", "gemma3_text")
    if gemma:  # Gemma2MLP / Gemma3MLP read hidden_activation (a released Gemma 2 config also says hidden_act)
        c["hidden_act"] = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    oss = mt == "gpt_oss"
    if oss:  # GptOssExperts has its own activation; hidden_act is not read
        c["hidden_act"] = "silu"
    if mt not in ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe",
                  "qwen2_moe", "gpt_oss", None):
        log("warning: model_type %r, treating it as llama" % mt)
    act = c.get("hidden_act", "silu")
    if act not in ACTS:
        raise ValueError("unsupported hidden_act %r" % act)
    if c.get("mlp_bias"):
        raise ValueError("mlp biases are not supported")
    # Qwen2 has q/k/v biases without saying so in config.json; GptOssConfig's attention_bias defaults to true
    qkv_bias = bool(c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe", "gpt_oss")))
    dim = c["hidden_size"]
    heads = c["num_attention_heads"]
    cfg = {
        "dim": dim,
        "hidden_dim": c["intermediate_size"],
        "n_layers": c["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": c.get("num_key_value_heads") or heads,
        # Gemma2Config / Gemma3TextConfig: 256; GptOssConfig: 64
        "head_dim": c.get("head_dim") or (256 if gemma else 64 if oss else dim // heads),
        "vocab": c["vocab_size"],
        "eps": float(c.get("rms_norm_eps", 1e-5 if oss else 1e-6)),
        "theta": float(c.get("rope_theta", 150000.0 if oss else 10000.0)),
        # GptOssConfig: an absent rope_scaling is gpt-oss's yarn (factor 32 over 4096, not truncated); null is none
        "rope_scaling": c.get("rope_scaling", OSS_DEFAULT_YARN if oss else None),
        "tie": bool(c.get("tie_word_embeddings", gemma)),  # the Gemma configs tie by default
        "max_pos": c.get("max_position_embeddings"),
        "qkv_bias": qkv_bias,
        "act": act,
        "qk_norm": mt in ("qwen3", "gemma3_text", "qwen3_moe"),
        # MistralConfig: an absent sliding_window is 4096, null is none (MixtralConfig, Phi3Config: none)
        "window": (c.get("sliding_window", 4096) if mt == "mistral" else
                   c.get("sliding_window") if mt in ("phi3", "mixtral") else None),
        "fused": mt == "phi3",
        "gemma": gemma,
        "orig_max_pos": c.get("original_max_position_embeddings"),
        "gpt_oss": oss,
        "o_bias": oss and qkv_bias,  # GptOssAttention: o_proj has bias=attention_bias too
        "sinks": oss,
    }
    if cfg["rope_scaling"] is not None:
        cfg["rope_scaling"] = dict(cfg["rope_scaling"])  # read_config adds "kind"; keep the defaults untouched
    # Phi3Config's partial_rotary_factor (Phi-4-mini 0.75): RoPE turns the first int(factor * head_dim) dims of
    # each head (apply_rotary_pos_emb splits q into q_rot and q_pass by cos.shape[-1]); the frequencies are those
    # of a head that wide (dim = int(head_dim * partial_rotary_factor) in the rope initialisers)
    cfg["rotary_dim"] = int(cfg["head_dim"] * float(c.get("partial_rotary_factor", 1.0))) if mt == "phi3" \
        else cfg["head_dim"]
    # Mixture of Experts. MixtralSparseMoeBlock: every layer, experts of intermediate_size, the top-k
    # weights always renormalised. Qwen3MoeSparseMoeBlock: layer i sparse when i is not in mlp_only_layers,
    # num_experts > 0 and (i + 1) % decoder_sparse_step == 0; experts of moe_intermediate_size; renormalised
    # only when norm_topk_prob.
    cfg["moe_layers"] = [False] * cfg["n_layers"]
    if mt == "mixtral":
        cfg.update(n_experts=c.get("num_local_experts", 8), top_k=c.get("num_experts_per_tok", 2),
                   moe_hidden=c["intermediate_size"], norm_topk=True, moe_prefix="block_sparse_moe.",
                   expert_names=("w1", "w3", "w2"))
        cfg["moe_layers"] = [True] * cfg["n_layers"]
    elif mt in ("qwen3_moe", "qwen2_moe"):  # Qwen2MoeConfig: 60 experts, top-4, 1408; shared expert 5632
        q2 = mt == "qwen2_moe"
        cfg.update(n_experts=c.get("num_experts", 60 if q2 else 128), top_k=c.get("num_experts_per_tok", 4 if q2 else 8),
                   moe_hidden=c.get("moe_intermediate_size", 1408 if q2 else 768),
                   norm_topk=bool(c.get("norm_topk_prob", False)),
                   moe_prefix="mlp.", expert_names=("gate_proj", "up_proj", "down_proj"),
                   shared_hidden=c.get("shared_expert_intermediate_size", 5632) if q2 else 0)
        step, only = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
        cfg["moe_layers"] = [i not in only and cfg["n_experts"] > 0 and (i + 1) % step == 0
                             for i in range(cfg["n_layers"])]
    elif oss:  # GptOssMLP in every layer: GptOssTopKRouter over num_local_experts, GptOssExperts of intermediate_size
        cfg.update(n_experts=c.get("num_local_experts", 128), top_k=c.get("num_experts_per_tok", 4),
                   moe_hidden=c["intermediate_size"], norm_topk=True, moe_prefix="mlp.",
                   swiglu_limit=float(c.get("swiglu_limit", 7.0)), swiglu_alpha=float(c.get("swiglu_alpha", 1.702)))
        cfg["moe_layers"] = [True] * cfg["n_layers"]
        # GptOssAttention: sliding_window on the layers layer_types calls sliding (GptOssConfig: the even ones)
        n = cfg["n_layers"]
        types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ValueError("layer_types must say sliding_attention or full_attention for each of the %d layers"
                             % n)
        sw = c.get("sliding_window", 128)
        cfg["layer_window"] = [sw if t == "sliding_attention" else None for t in types]
        qc = c.get("quantization_config")
        cfg["mxfp4"] = bool(qc) and qc.get("quant_method") == "mxfp4"
        if qc and not cfg["mxfp4"]:
            raise ValueError("gpt_oss: quantization_config.quant_method %r is not supported" % qc.get("quant_method"))
    if any(cfg["moe_layers"]) and not 1 <= cfg["top_k"] <= cfg["n_experts"]:
        raise ValueError("num_experts_per_tok must be between 1 and the number of experts")
    rs = cfg["rope_scaling"]
    if rs is not None:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "default":
            cfg["rope_scaling"] = None
        elif kind == "su":
            rs["kind"] = "longrope"
        elif kind not in ("llama3", "linear", "yarn", "longrope"):
            raise ValueError("unsupported rope_scaling type %r" % kind)
        else:
            rs["kind"] = kind
    if mt == "gemma2":
        # Gemma2Config: absent caps are 50 (attention) and 30 (final), null is none; the even layers slide
        # (Gemma2Attention: sliding_window if not layer_idx % 2), the odd ones are global; one RoPE base
        n = cfg["n_layers"]
        types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        sw = c.get("sliding_window", 4096)
        cfg["layer_window"] = [sw if t == "sliding_attention" else None for t in types]
        cfg["local_theta"] = cfg["theta"]
        cfg["scale"] = float(c.get("query_pre_attn_scalar", 256)) ** -0.5
        cfg["attn_softcap"] = c.get("attn_logit_softcapping", 50.0)
        cfg["final_softcap"] = c.get("final_logit_softcapping", 30.0)
        cfg["qk_norm"] = False
        if cfg["rope_scaling"] is not None:
            raise ValueError("gemma2 with rope_scaling is not supported here")
    elif gemma:  # Gemma3TextConfig: sliding layers (every layer but each pattern-th) and their RoPE base
        n, pat = cfg["n_layers"], c.get("sliding_window_pattern", 6)
        types = c.get("layer_types") or ["full_attention" if (i + 1) % pat == 0 else "sliding_attention"
                                         for i in range(n)]
        cfg["layer_window"] = [c.get("sliding_window", 4096) if t == "sliding_attention" else None for t in types]
        cfg["local_theta"] = float(c.get("rope_local_base_freq", 10000.0))
        cfg["scale"] = float(c.get("query_pre_attn_scalar", cfg["head_dim"])) ** -0.5
        cfg["attn_softcap"] = c.get("attn_logit_softcapping")
        cfg["final_softcap"] = c.get("final_logit_softcapping")
    for key in ("attn_softcap", "final_softcap"):
        v = cfg.get(key)
        if v is not None and not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
            raise ValueError("%s must be a positive number or null, got %r" % (key, v))
    if cfg["n_heads"] % cfg["n_kv_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    return cfg


def mxfp4_dequantize(blocks, scales):
    """MXFP4 (OCP microscaling) -> float64: blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32].
    Byte b of a group holds element 2b in its low nibble and element 2b + 1 in its high one; each E2M1 code
    is a FP4_TABLE value, times 2^(scale - 127) for the group's E8M0 scale (255 is NaN there)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError("MXFP4 blocks and scales must be U8 tensors")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError("MXFP4 blocks %s do not match scales %s" % (blocks.shape, scales.shape))
    if (scales == 255).any():
        raise ValueError("MXFP4 scale 255 (NaN)")
    codes = np.empty(blocks.shape[:-1] + (32,), dtype=np.int64)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    vals = np.array(FP4_TABLE, dtype=np.float64)[codes] * np.exp2(scales.astype(np.float64) - 127.0)[..., None]
    return vals.reshape(blocks.shape[:-2] + (blocks.shape[-2] * 32,))


# gpt_oss: the experts' matrices, out-major (one row per output unit), under these names
OSS_GATE_UP = "mlp.experts.gate_up.out_major"  # (E, 2I, H): row 2j is gate unit j, row 2j + 1 up unit j
OSS_DOWN = "mlp.experts.down.out_major"  # (E, H, I)


def oss_experts(cfg, tensors):
    """GptOssExperts' matrices -> float64 out-major, in place: from the float layout (gate_up_proj (E, H, 2I) and
    down_proj (E, I, H), as x @ W uses them: transposed) or from MXFP4 _blocks/_scales, already out-major."""
    E, H, I = cfg["n_experts"], cfg["dim"], cfg["moe_hidden"]
    for i in range(cfg["n_layers"]):
        p = "model.layers.%d.mlp.experts." % i
        for src, out, n_out, n_in in (("gate_up_proj", OSS_GATE_UP, 2 * I, H), ("down_proj", OSS_DOWN, H, I)):
            if cfg["mxfp4"]:
                b, sc = p + src + "_blocks", p + src + "_scales"
                for name, shape in ((b, (E, n_out, n_in // 32, 16)), (sc, (E, n_out, n_in // 32))):
                    if n_in % 32:
                        raise ValueError("MXFP4 %s: %d inputs are not whole groups of 32" % (name, n_in))
                    if name not in tensors:
                        raise ValueError("missing tensor %s" % name)
                    if tuple(tensors[name].shape) != shape:
                        raise ValueError("tensor %s has shape %s, expected %s"
                                         % (name, tuple(tensors[name].shape), shape))
                tensors["model.layers.%d.%s" % (i, out)] = mxfp4_dequantize(tensors.pop(b), tensors.pop(sc))
            else:
                name = p + src
                if name not in tensors:
                    raise ValueError("missing tensor %s" % name)
                if tuple(tensors[name].shape) != (E, n_in, n_out):
                    raise ValueError("tensor %s has shape %s, expected %s"
                                     % (name, tuple(tensors[name].shape), (E, n_in, n_out)))
                w = np.array(tensors.pop(name), dtype=np.float64)
                tensors["model.layers.%d.%s" % (i, out)] = np.ascontiguousarray(w.transpose(0, 2, 1))


def load_model(model_dir):
    """-> dict with "cfg", "inv_freq" and float64 weights under their HF names (gpt_oss's experts:
    out-major under OSS_GATE_UP / OSS_DOWN)."""
    cfg = read_config(model_dir)
    tensors, dtypes = safetensors_io.read_model_dir(model_dir)
    if cfg["gpt_oss"]:
        oss_experts(cfg, tensors)
    if cfg["fused"]:  # Phi-3: split qkv_proj and gate_up_proj by rows, as Phi3Attention / Phi3MLP do
        hd0 = cfg["head_dim"]
        for i in range(cfg["n_layers"]):
            p = "model.layers.%d." % i
            qkv = tensors.pop(p + "self_attn.qkv_proj.weight")
            nq, nk = cfg["n_heads"] * hd0, cfg["n_kv_heads"] * hd0
            tensors[p + "self_attn.q_proj.weight"] = qkv[:nq]
            tensors[p + "self_attn.k_proj.weight"] = qkv[nq:nq + nk]
            tensors[p + "self_attn.v_proj.weight"] = qkv[nq + nk:]
            gu = tensors.pop(p + "mlp.gate_up_proj.weight")
            tensors[p + "mlp.gate_proj.weight"] = gu[:cfg["hidden_dim"]]
            tensors[p + "mlp.up_proj.weight"] = gu[cfg["hidden_dim"]:]
    hd = cfg["head_dim"]
    want = {"model.embed_tokens.weight": (cfg["vocab"], cfg["dim"]),
            "model.norm.weight": (cfg["dim"],)}
    for i in range(cfg["n_layers"]):
        p = "model.layers.%d." % i
        want[p + "input_layernorm.weight"] = (cfg["dim"],)
        want[p + "self_attn.q_proj.weight"] = (cfg["n_heads"] * hd, cfg["dim"])
        want[p + "self_attn.k_proj.weight"] = (cfg["n_kv_heads"] * hd, cfg["dim"])
        want[p + "self_attn.v_proj.weight"] = (cfg["n_kv_heads"] * hd, cfg["dim"])
        if cfg["qkv_bias"]:
            want[p + "self_attn.q_proj.bias"] = (cfg["n_heads"] * hd,)
            want[p + "self_attn.k_proj.bias"] = (cfg["n_kv_heads"] * hd,)
            want[p + "self_attn.v_proj.bias"] = (cfg["n_kv_heads"] * hd,)
        if cfg["qk_norm"]:
            want[p + "self_attn.q_norm.weight"] = (hd,)
            want[p + "self_attn.k_norm.weight"] = (hd,)
        if cfg["gemma"]:
            want[p + "pre_feedforward_layernorm.weight"] = (cfg["dim"],)
            want[p + "post_feedforward_layernorm.weight"] = (cfg["dim"],)
        want[p + "self_attn.o_proj.weight"] = (cfg["dim"], cfg["n_heads"] * hd)
        want[p + "post_attention_layernorm.weight"] = (cfg["dim"],)
        if cfg["o_bias"]:
            want[p + "self_attn.o_proj.bias"] = (cfg["dim"],)
        if cfg["sinks"]:
            want[p + "self_attn.sinks"] = (cfg["n_heads"],)
        if cfg["gpt_oss"]:  # GptOssTopKRouter (weight and bias) and GptOssExperts
            E, I, D = cfg["n_experts"], cfg["moe_hidden"], cfg["dim"]
            want.update({p + "mlp.router.weight": (E, D), p + "mlp.router.bias": (E,),
                         p + OSS_GATE_UP: (E, 2 * I, D), p + "mlp.experts.gate_up_proj_bias": (E, 2 * I),
                         p + OSS_DOWN: (E, D, I), p + "mlp.experts.down_proj_bias": (E, D)})
            continue
        if cfg["moe_layers"][i]:
            mp, (g, u, d), mh = p + cfg["moe_prefix"], cfg["expert_names"], cfg["moe_hidden"]
            want[mp + "gate.weight"] = (cfg["n_experts"], cfg["dim"])
            if cfg.get("shared_hidden"):
                sh = cfg["shared_hidden"]
                want[mp + "shared_expert.gate_proj.weight"] = (sh, cfg["dim"])
                want[mp + "shared_expert.up_proj.weight"] = (sh, cfg["dim"])
                want[mp + "shared_expert.down_proj.weight"] = (cfg["dim"], sh)
                want[mp + "shared_expert_gate.weight"] = (1, cfg["dim"])
            for j in range(cfg["n_experts"]):
                want[mp + "experts.%d.%s.weight" % (j, g)] = (mh, cfg["dim"])
                want[mp + "experts.%d.%s.weight" % (j, u)] = (mh, cfg["dim"])
                want[mp + "experts.%d.%s.weight" % (j, d)] = (cfg["dim"], mh)
            continue
        want[p + "mlp.gate_proj.weight"] = (cfg["hidden_dim"], cfg["dim"])
        want[p + "mlp.up_proj.weight"] = (cfg["hidden_dim"], cfg["dim"])
        want[p + "mlp.down_proj.weight"] = (cfg["dim"], cfg["hidden_dim"])
    if not cfg["tie"] or "lm_head.weight" in tensors:
        want["lm_head.weight"] = (cfg["vocab"], cfg["dim"])
    w = {}
    for name, shape in want.items():
        if name not in tensors:
            raise ValueError("missing tensor %s" % name)
        if tuple(tensors[name].shape) != shape:
            raise ValueError("tensor %s has shape %s, expected %s"
                             % (name, tuple(tensors[name].shape), shape))
        w[name] = torch.from_numpy(np.array(tensors[name], dtype=np.float64))
    extra = sorted(set(tensors) - set(want))
    if extra:
        log("note: ignoring %d unused tensors (%s...)" % (len(extra), extra[0]))
    if cfg["tie"]:
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
    log("loaded %s: %d layers, dim %d, heads %d/%d, head_dim %d, vocab %d, dtypes %s"
        % (model_dir, cfg["n_layers"], cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"], hd,
           cfg["vocab"], ",".join(sorted(set(dtypes.values())))))
    inv_freq, attn_factor = rope_params(cfg)
    model = {"cfg": cfg, "w": w, "inv_freq": inv_freq, "attn_factor": attn_factor}
    if cfg["gemma"]:
        model["inv_freq_local"] = rope_inv_freq(dict(cfg, theta=cfg["local_theta"], rope_scaling=None))
    return model


# ---------------------------------------------------------------- the model

# ACT2FN's definitions of the activations Loom runs.
ACTS = {
    "silu": lambda x: x * torch.sigmoid(x),
    "swish": lambda x: x * torch.sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_python": lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
    "gelu_pytorch_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": torch.relu,
    "relu2": lambda x: torch.relu(x) ** 2,
}


def rope_params(cfg):
    """-> (inv_freq, attention factor) for the config's rope_scaling."""
    rs = cfg["rope_scaling"]
    if rs is not None and rs["kind"] == "linear":
        return rope_inv_freq(dict(cfg, rope_scaling=None)) / float(rs["factor"]), 1.0
    if rs is not None and rs["kind"] == "yarn":
        return yarn_inv_freq(cfg)
    if rs is not None and rs["kind"] == "longrope":
        return longrope_inv_freq(cfg)
    return rope_inv_freq(cfg), 1.0


def yarn_inv_freq(cfg):
    """_compute_yarn_parameters: the NTK-by-parts blend of interpolated and
    original frequencies, and the attention factor 0.1 ln(factor) + 1."""
    rs, hd, base = cfg["rope_scaling"], rot_dim(cfg), cfg["theta"]
    factor = float(rs["factor"])
    orig = rs.get("original_max_position_embeddings") or cfg["max_pos"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rot):
        return hd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(hd // 2, dtype=DT) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, hd, 2, dtype=DT) / hd)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    af = rs.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, af


def longrope_inv_freq(cfg):
    """_compute_longrope_parameters for sequences within original_max_position_embeddings
    (the short factors), and its attention factor sqrt(1 + ln(factor) / ln(original))."""
    rs, hd = cfg["rope_scaling"], rot_dim(cfg)
    orig = rs.get("original_max_position_embeddings") or cfg["orig_max_pos"] or cfg["max_pos"]
    factor = rs.get("factor") or cfg["max_pos"] / orig
    af = rs.get("attention_factor") or (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))
    ext = torch.tensor(rs["short_factor"], dtype=DT)
    return 1.0 / (ext * cfg["theta"] ** (torch.arange(0, hd, 2, dtype=DT) / hd)), af


def rope_inv_freq(cfg):
    """inv_freq as HF computes it, including _compute_llama3_parameters."""
    hd = rot_dim(cfg)
    inv_freq = 1.0 / (cfg["theta"] ** (torch.arange(0, hd, 2, dtype=DT) / hd))
    rs = cfg["rope_scaling"]
    if rs is None:
        return inv_freq
    factor = float(rs["factor"])
    low = float(rs["low_freq_factor"])
    high = float(rs["high_freq_factor"])
    orig = float(rs["original_max_position_embeddings"])
    low_freq_wavelen = orig / low
    high_freq_wavelen = orig / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rot_dim(cfg):
    return cfg.get("rotary_dim") or cfg["head_dim"]


def rope_cos_sin(inv_freq, n):
    pos = torch.arange(n, dtype=DT)
    freqs = pos[:, None] * inv_freq[None, :]  # (n, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (n, hd)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rmsnorm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def bias(w, p, n):
    """The q/k/v projection's bias (Qwen2), or 0."""
    return w.get(p + "self_attn.%s_proj.bias" % n, 0.0)


def gemma_norm(x, weight, eps):
    """Gemma3RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * (1.0 + weight)


def moe_block(cfg, w, p, h, act):
    """A sparse MoE block as Transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock define it: softmax
    over all the router's logits, torch.topk of the probabilities, the k weights renormalised to sum 1
    (Mixtral always, Qwen3-MoE when norm_topk_prob), and each token's output the weighted sum of its
    experts' gated MLPs."""
    mp, (g, u, d) = p + cfg["moe_prefix"], cfg["expert_names"]
    probs = torch.softmax(h @ w[mp + "gate.weight"].T, dim=-1)  # (T, E)
    top_w, top_e = torch.topk(probs, cfg["top_k"], dim=-1)
    if cfg["norm_topk"]:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(h)
    for j in range(cfg["n_experts"]):
        tok, slot = torch.nonzero(top_e == j, as_tuple=True)
        if len(tok) == 0:
            continue
        e = mp + "experts.%d." % j
        x = h[tok]
        y = (act(x @ w[e + g + ".weight"].T) * (x @ w[e + u + ".weight"].T)) @ w[e + d + ".weight"].T
        out.index_add_(0, tok, y * top_w[tok, slot, None])
    if cfg.get("shared_hidden"):  # Qwen2MoeSparseMoeBlock: + sigmoid(shared_expert_gate(x)) * shared_expert(x)
        s = mp + "shared_expert."
        y = (act(h @ w[s + "gate_proj.weight"].T) * (h @ w[s + "up_proj.weight"].T)) @ w[s + "down_proj.weight"].T
        out = out + torch.sigmoid(h @ w[mp + "shared_expert_gate.weight"].T) * y
    return out


def topk_lowest(x, k):
    """torch.topk along the last axis with ties going to the lower index: -> (values, indices)."""
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def oss_moe_block(cfg, w, p, h, stats=None):
    """GptOssMLP as Transformers defines it. GptOssTopKRouter: logits = x W^T + b, the top_k logits, softmax over
    those k. GptOssExperts, per chosen expert: gate_up = W x + b (out-major here), gate = the even units and up =
    the odd ones, gate clamped from above and up on both sides at swiglu_limit, glu = gate * sigmoid(alpha *
    gate), (up + 1) * glu through down_proj plus its bias; the outputs summed with the router's weights.
    stats: a dict that counts the gate and up values the clamp changed ("gate", "up") and all of them ("n")."""
    limit, alpha = cfg["swiglu_limit"], cfg["swiglu_alpha"]
    logits = h @ w[p + "mlp.router.weight"].T + w[p + "mlp.router.bias"]  # (T, E)
    top_v, top_e = topk_lowest(logits, cfg["top_k"])
    top_w = torch.softmax(top_v, dim=-1)
    gu_w, gu_b = w[p + OSS_GATE_UP], w[p + "mlp.experts.gate_up_proj_bias"]
    dn_w, dn_b = w[p + OSS_DOWN], w[p + "mlp.experts.down_proj_bias"]
    out = torch.zeros_like(h)
    for j in range(cfg["n_experts"]):
        tok, slot = torch.nonzero(top_e == j, as_tuple=True)
        if len(tok) == 0:
            continue
        gu = h[tok] @ gu_w[j].T + gu_b[j]  # (n, 2I)
        gate, up = gu[:, 0::2], gu[:, 1::2]
        if stats is not None:
            stats["gate"] = stats.get("gate", 0) + int((gate > limit).sum())
            stats["up"] = stats.get("up", 0) + int((up.abs() > limit).sum())
            stats["n"] = stats.get("n", 0) + gate.numel()
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        y = ((up + 1) * glu) @ dn_w[j].T + dn_b[j]
        out.index_add_(0, tok, y * top_w[tok, slot, None])
    return out


def forward(model, ids, hidden=False, taps=None, moe_stats=None):
    """-> float64 logits (len(ids), vocab) for every position (hidden: the
    final-normed hidden states (len(ids), dim), the LM head's input).
    taps: a list that receives each layer's attention output (heads, T, hd).
    moe_stats: a dict for gpt_oss's clamp counts (oss_moe_block)."""
    cfg, w = model["cfg"], model["w"]
    T = len(ids)
    H, KV, hd = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    gemma = cfg.get("gemma")
    norm = gemma_norm if gemma else rmsnorm
    for t in ids:
        if not 0 <= t < cfg["vocab"]:
            raise ValueError("token id %d out of range [0, %d)" % (t, cfg["vocab"]))
    x = w["model.embed_tokens.weight"][torch.tensor(ids, dtype=torch.long)]  # (T, dim)
    if gemma:  # Gemma3TextScaledWordEmbedding (the checkpoints here are F32)
        x = x * math.sqrt(cfg["dim"])
    af = model.get("attn_factor", 1.0)
    causal = torch.full((T, T), float("-inf"), dtype=DT).triu(1)
    act = ACTS[cfg.get("act", "silu")]
    scale = cfg.get("scale") or 1.0 / math.sqrt(hd)
    for i in range(cfg["n_layers"]):
        p = "model.layers.%d." % i
        window = cfg["layer_window"][i] if cfg.get("layer_window") else cfg.get("window")
        mask = causal
        if window:  # key j is seen by query i when i - window < j <= i
            mask = mask + torch.full((T, T), float("-inf"), dtype=DT).tril(-window)
        inv = model["inv_freq_local"] if gemma and window else model["inv_freq"]
        cos, sin = rope_cos_sin(inv, T)  # (T, hd)
        if not (gemma and window):
            cos, sin = cos * af, sin * af
        h = norm(x, w[p + "input_layernorm.weight"], cfg["eps"])
        q, k, v = (h @ w[p + "self_attn.%s_proj.weight" % n].T + bias(w, p, n) for n in "qkv")
        q = q.view(T, H, hd).transpose(0, 1)
        k = k.view(T, KV, hd).transpose(0, 1)
        v = v.view(T, KV, hd).transpose(0, 1)
        if cfg.get("qk_norm"):
            q = norm(q, w[p + "self_attn.q_norm.weight"], cfg["eps"])
            k = norm(k, w[p + "self_attn.k_norm.weight"], cfg["eps"])
        rd = cos.shape[-1]  # partial rotary: the dims past rd pass through
        q = torch.cat([q[..., :rd] * cos + rotate_half(q[..., :rd]) * sin, q[..., rd:]], dim=-1)
        k = torch.cat([k[..., :rd] * cos + rotate_half(k[..., :rd]) * sin, k[..., rd:]], dim=-1)
        k = k.repeat_interleave(H // KV, dim=0)  # (H, T, hd): head j reads kv head j // (H/KV)
        v = v.repeat_interleave(H // KV, dim=0)
        scores = q @ k.transpose(1, 2) * scale
        if cfg.get("attn_softcap"):  # Gemma 2: cap * tanh(scores / cap), before the mask
            scores = torch.tanh(scores / cfg["attn_softcap"]) * cfg["attn_softcap"]
        if cfg.get("sinks"):  # GPT-OSS: each head's sink logit joins every row's softmax, then is dropped
            sink = w[p + "self_attn.sinks"].view(H, 1, 1).expand(H, T, 1)
            att = torch.softmax(torch.cat([scores + mask, sink], dim=-1), dim=-1)[..., :-1]
        else:
            att = torch.softmax(scores + mask, dim=-1)
        if taps is not None:
            taps.append(att @ v)
        o = (att @ v).transpose(0, 1).reshape(T, H * hd) @ w[p + "self_attn.o_proj.weight"].T
        if cfg.get("o_bias"):
            o = o + w[p + "self_attn.o_proj.bias"]
        if gemma:  # post-attention norm, then the feed-forward between its pre and post norms
            x = x + norm(o, w[p + "post_attention_layernorm.weight"], cfg["eps"])
            h = norm(x, w[p + "pre_feedforward_layernorm.weight"], cfg["eps"])
        else:
            x = x + o
            h = norm(x, w[p + "post_attention_layernorm.weight"], cfg["eps"])
        if cfg.get("gpt_oss"):
            f = oss_moe_block(cfg, w, p, h, moe_stats)
        elif cfg["moe_layers"][i]:
            f = moe_block(cfg, w, p, h, act)
        else:
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            f = (act(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = x + (norm(f, w[p + "post_feedforward_layernorm.weight"], cfg["eps"]) if gemma else f)
    x = norm(x, w["model.norm.weight"], cfg["eps"])
    if hidden:
        return x
    logits = x @ w["lm_head.weight"].T
    if cfg.get("final_softcap"):  # Gemma2ForCausalLM: the same tanh cap on the logits
        logits = torch.tanh(logits / cfg["final_softcap"]) * cfg["final_softcap"]
    return logits


def embedding(model, ids, pooling):
    """vLLM's embed task for a decoder LM: the last token's (or the mean of
    all) final-normed hidden state(s), L2-normalised; float64 (dim,)."""
    h = forward(model, ids, hidden=True)
    v = h[-1] if pooling == "last" else h.mean(dim=0)
    return v / v.norm()


def argmax_lowest(row):
    """argmax with ties going to the lowest id, and the top1-top2 gap."""
    m = row.max()
    best = int((row == m).nonzero()[0, 0])
    rest = row.clone()
    rest[best] = float("-inf")
    return best, float(m - rest.max()) if row.numel() > 1 else float("inf")


def penalize(row, prompt, out, pen):
    """vLLM's logits processing, written from its documented formulas:
    logit_bias added, then repetition_penalty over prompt and output tokens
    (a positive logit divided, a negative one multiplied), then
    frequency_penalty * count and presence_penalty over output tokens."""
    row = row.clone()
    for tid, b in pen.get("logit_bias", {}).items():
        row[tid] += b
    rep = pen.get("repetition", 1.0)
    if rep != 1.0:
        for tid in set(prompt) | set(out):
            row[tid] = row[tid] / rep if row[tid] > 0 else row[tid] * rep
    counts = {}
    for t in out:
        counts[t] = counts.get(t, 0) + 1
    for tid, c in counts.items():
        row[tid] -= pen.get("frequency", 0.0) * c + pen.get("presence", 0.0)
    return row


def greedy(model, ids, n, pen=None):
    """-> (n generated ids, smallest top1-top2 gap seen); pen: penalize()'s controls."""
    seq = list(ids)
    out = []
    min_gap = float("inf")
    for _ in range(n):
        logits = forward(model, seq)
        row = penalize(logits[-1], ids, out, pen) if pen else logits[-1]
        tok, gap = argmax_lowest(row)
        min_gap = min(min_gap, gap)
        out.append(tok)
        seq.append(tok)
    return out, min_gap


# ---------------------------------------------------------------- detokenizer

def decode_text(tok_dir, ids, strip_leading_space=True):
    """Map ids through tokenizer.json's vocab: "▁" -> space, <0xNN> -> byte.

    Like the Llama decoder, one leading space of the text is dropped."""
    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    pieces = {i: s for s, i in tok["model"]["vocab"].items()}
    special = set()
    for t in tok.get("added_tokens", []) or []:
        pieces[t["id"]] = t["content"]
        if t.get("special"):
            special.add(t["id"])
    buf = bytearray()
    for i in ids:
        if i in special:
            continue
        s = pieces.get(i)
        if s is None:
            buf += ("<%d?>" % i).encode()
            continue
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", s)
        if m:
            buf.append(int(m.group(1), 16))
        else:
            buf += s.replace("\u2581", " ").encode("utf-8")
    text = buf.decode("utf-8", errors="replace")
    return text[1:] if strip_leading_space and text.startswith(" ") else text


# ---------------------------------------------------------------- self-test

def alt_inv_freq(cfg):
    """Second formulation of RoPE frequencies: scalar loop with explicit bands."""
    hd = cfg["head_dim"]
    rs = cfg["rope_scaling"]
    out = []
    bands = {"high": 0, "low": 0, "medium": 0}
    for j in range(hd // 2):
        f = cfg["theta"] ** (-2.0 * j / hd)
        if rs is not None:
            period = 2 * math.pi / f
            orig = rs["original_max_position_embeddings"]
            lo, hi, factor = rs["low_freq_factor"], rs["high_freq_factor"], rs["factor"]
            if period < orig / hi:
                bands["high"] += 1
            elif period > orig / lo:
                f = f / factor
                bands["low"] += 1
            else:
                a = (orig / period - lo) / (hi - lo)
                f = a * f + (1 - a) * (f / factor)
                bands["medium"] += 1
        out.append(f)
    return torch.tensor(out, dtype=DT), bands


def alt_yarn(cfg):
    """Second formulation of yarn: per frequency, a scalar blend of itself and itself / factor by where its
    pair index falls between the pairs that turn beta_fast and beta_slow times over the original context
    (those ends rounded outwards only when truncate), and the attention factor; -> (freqs, factor)."""
    rs, hd, base = cfg["rope_scaling"], cfg["head_dim"], cfg["theta"]
    factor = float(rs["factor"])
    orig = rs.get("original_max_position_embeddings") or cfg["max_pos"]

    def pair_turning(rot):  # orig * base^(-2j/hd) / (2 pi) = rot, solved for j
        return math.log(orig / (2 * math.pi * rot), base) * hd / 2
    lo, hi = pair_turning(rs.get("beta_fast") or 32), pair_turning(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        lo, hi = float(math.floor(lo)), float(math.ceil(hi))
    lo, hi = max(lo, 0.0), min(hi, hd - 1.0)
    if hi == lo:
        hi += 0.001
    out = []
    for j in range(hd // 2):
        f = base ** (-2.0 * j / hd)
        r = min(1.0, max(0.0, (j - lo) / (hi - lo)))  # 0: the original frequency kept, 1: fully interpolated
        out.append(f * (1 - r) + (f / factor) * r)
    af = rs.get("attention_factor") or (1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0)
    return torch.tensor(out, dtype=DT), af


def alt_sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def alt_oss_moe(cfg, w, p, h):
    """Second formulation of GptOssMLP for one token: router logits expert by expert, the chosen ones ranked
    by (logit, index), their weights by hand; the clamped SwiGLU element by element on separate gate / up rows."""
    E, k = cfg["n_experts"], cfg["top_k"]
    limit, alpha = cfg["swiglu_limit"], cfg["swiglu_alpha"]
    wr, br = w[p + "mlp.router.weight"], w[p + "mlp.router.bias"]
    logit = [float(wr[e] @ h) + float(br[e]) for e in range(E)]
    chosen = sorted(range(E), key=lambda e: (-logit[e], e))[:k]
    top = max(logit[e] for e in chosen)
    z = sum(math.exp(logit[e] - top) for e in chosen)
    out = torch.zeros_like(h)
    for e in chosen:
        wgu, bgu = w[p + OSS_GATE_UP][e], w[p + "mlp.experts.gate_up_proj_bias"][e]
        g = wgu[0::2] @ h + bgu[0::2]
        u = wgu[1::2] @ h + bgu[1::2]
        mid = []
        for gv, uv in zip(g.tolist(), u.tolist()):
            gv = gv if gv < limit else limit
            uv = -limit if uv < -limit else limit if uv > limit else uv
            mid.append((uv + 1.0) * gv * alt_sigmoid(alpha * gv))
        y = w[p + OSS_DOWN][e] @ torch.tensor(mid, dtype=DT) + w[p + "mlp.experts.down_proj_bias"][e]
        out += (math.exp(logit[e] - top) / z) * y
    return out


def alt_rope(vec, pos, freqs):
    """Rotate one head vector: pairs (j, j + hd/2) as a complex number times e^(i*pos*f_j)."""
    half = vec.shape[0] // 2
    z = torch.complex(vec[:half], vec[half:])
    z = z * torch.polar(torch.ones_like(freqs), pos * freqs)
    return torch.cat([z.real, z.imag])


def alt_act(name, g):
    """The activations element by element with the math module."""
    def one(x):
        if name in ("silu", "swish"):
            return x / (1 + math.exp(-x))
        if name in ("gelu", "gelu_python"):
            return 0.5 * x * (1 + math.erf(x / math.sqrt(2)))
        if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
            return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
        if name == "quick_gelu":
            return x / (1 + math.exp(-1.702 * x))
        if name == "relu":
            return max(x, 0.0)
        if name == "relu2":
            return max(x, 0.0) ** 2
        raise ValueError(name)
    return torch.tensor([one(float(v)) for v in g], dtype=DT)


def alt_forward(model, ids):
    """Second formulation of the forward pass: per-row norms, per-head per-query loops."""
    cfg, w = model["cfg"], model["w"]
    rs = cfg["rope_scaling"]
    if rs is not None and rs.get("kind") == "yarn":  # q and k each scaled by the factor: the scores by its square
        freqs, af = alt_yarn(cfg)
    else:
        (freqs, _), af = alt_inv_freq(cfg), 1.0
    H, KV, hd = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    group = H // KV
    T = len(ids)

    def norm(row, weight):
        return row / math.sqrt(float((row * row).sum()) / row.shape[0] + cfg["eps"]) * weight

    x = torch.stack([w["model.embed_tokens.weight"][t].clone() for t in ids])
    for i in range(cfg["n_layers"]):
        p = "model.layers.%d." % i
        wq = w[p + "self_attn.q_proj.weight"]
        wk = w[p + "self_attn.k_proj.weight"]
        wv = w[p + "self_attn.v_proj.weight"]
        hs = [norm(x[t], w[p + "input_layernorm.weight"]) for t in range(T)]
        qs = [wq @ h + bias(w, p, "q") for h in hs]
        ks = [wk @ h + bias(w, p, "k") for h in hs]
        if cfg.get("qk_norm"):  # each head of hd on its own
            qs = [torch.cat([norm(r[j * hd:(j + 1) * hd], w[p + "self_attn.q_norm.weight"]) for j in range(H)])
                  for r in qs]
            ks = [torch.cat([norm(r[j * hd:(j + 1) * hd], w[p + "self_attn.k_norm.weight"]) for j in range(KV)])
                  for r in ks]
        vs = [wv @ h + bias(w, p, "v") for h in hs]
        attn_out = torch.zeros(T, H * hd, dtype=DT)
        win = cfg["layer_window"][i] if cfg.get("layer_window") else cfg.get("window")
        for head in range(H):
            kvh = head // group
            q_rot = [alt_rope(qs[t][head * hd:(head + 1) * hd], t, freqs) for t in range(T)]
            k_rot = [alt_rope(ks[t][kvh * hd:(kvh + 1) * hd], t, freqs) for t in range(T)]
            sink = float(w[p + "self_attn.sinks"][head]) if cfg.get("sinks") else None
            for t in range(T):
                first = max(0, t - win + 1) if win else 0
                seen = range(first, t + 1)
                s = [float(q_rot[t] @ k_rot[u]) * af * af / math.sqrt(hd) for u in seen]
                top = max(s) if sink is None else max(max(s), sink)
                e = [math.exp(v - top) for v in s]
                z = sum(e) + (0.0 if sink is None else math.exp(sink - top))  # the sink's share goes nowhere
                acc = torch.zeros(hd, dtype=DT)
                for ei, u in zip(e, seen):
                    acc += (ei / z) * vs[u][kvh * hd:(kvh + 1) * hd]
                attn_out[t, head * hd:(head + 1) * hd] = acc
        ob = w[p + "self_attn.o_proj.bias"] if cfg.get("o_bias") else 0.0
        x = x + torch.stack([w[p + "self_attn.o_proj.weight"] @ attn_out[t] + ob for t in range(T)])
        rows = []
        for t in range(T):
            h = norm(x[t], w[p + "post_attention_layernorm.weight"])
            if cfg.get("gpt_oss"):
                rows.append(x[t] + alt_oss_moe(cfg, w, p, h))
                continue
            if cfg["moe_layers"][i]:  # per token: the experts ranked by probability, the first top_k kept
                mp, (gn, un, dn) = p + cfg["moe_prefix"], cfg["expert_names"]
                logit = [float(v) for v in w[mp + "gate.weight"] @ h]
                top = max(logit)
                z = sum(math.exp(v - top) for v in logit)
                prob = [math.exp(v - top) / z for v in logit]
                chosen = sorted(range(len(prob)), key=lambda e: -prob[e])[:cfg["top_k"]]
                ksum = sum(prob[e] for e in chosen) if cfg["norm_topk"] else 1.0
                out = torch.zeros_like(h)
                for e in chosen:
                    ep = mp + "experts.%d." % e
                    g = w[ep + gn + ".weight"] @ h
                    u = w[ep + un + ".weight"] @ h
                    out += prob[e] / ksum * (w[ep + dn + ".weight"] @ (alt_act(cfg.get("act", "silu"), g) * u))
                if cfg.get("shared_hidden"):
                    sp = mp + "shared_expert."
                    g = w[sp + "gate_proj.weight"] @ h
                    u = w[sp + "up_proj.weight"] @ h
                    z = float(w[mp + "shared_expert_gate.weight"][0] @ h)
                    out += (w[sp + "down_proj.weight"] @ (alt_act(cfg.get("act", "silu"), g) * u)) / (1 + math.exp(-z))
                rows.append(x[t] + out)
                continue
            g = w[p + "mlp.gate_proj.weight"] @ h
            u = w[p + "mlp.up_proj.weight"] @ h
            rows.append(x[t] + w[p + "mlp.down_proj.weight"] @ (alt_act(cfg.get("act", "silu"), g) * u))
        x = torch.stack(rows)
    emb = w["lm_head.weight"] if not cfg["tie"] else w["model.embed_tokens.weight"]
    return torch.stack([emb @ norm(x[t], w["model.norm.weight"]) for t in range(T)])


def self_test_gpt_oss(tmp, check, gen_model):
    """GPT-OSS: the config read, forward against alt_forward, each of its parts biting, and MXFP4."""
    mo = load_model(os.path.join(tmp, "gpt_oss"))
    mx = load_model(os.path.join(tmp, "gpt_oss_mxfp4"))
    my = load_model(os.path.join(tmp, "gpt_oss_yarn"))
    oc = mo["cfg"]
    check(oc["gpt_oss"] and oc["layer_window"] == [4, None, 4, None] and oc["qkv_bias"] and oc["o_bias"]
          and oc["sinks"] and oc["n_experts"] == 4 and oc["top_k"] == 2 and oc["moe_hidden"] == 32
          and oc["swiglu_limit"] == 7.0 and oc["swiglu_alpha"] == 1.702 and not oc["mxfp4"] and mx["cfg"]["mxfp4"]
          and oc["rope_scaling"] is None and my["cfg"]["rope_scaling"]["truncate"] is False, "gpt_oss config read")
    ids = [1, 5, 17, 3, 96, 40, 2, 11, 64, 7, 0, 33]  # longer than the window of 4
    ref = {}
    for name, model in (("float", mo), ("mxfp4", mx), ("bf16 + yarn (untruncated)", my)):
        ref[name] = forward(model, ids)
        err = float((ref[name] - alt_forward(model, ids)).abs().max() / ref[name].abs().max())
        check(err < 1e-10, "gpt_oss %s: batched forward matches the per-token loops (rel err %.1e)" % (name, err))
        std = float(ref[name].std(dim=-1).mean())
        check(0.5 < std < 20, "gpt_oss %s logits are healthy (row std %.2f)" % (name, std))
    base = ref["float"]

    def rel(other):
        return float((base - other).abs().max() / base.abs().max())

    # the sinks: at -inf they take no share, which is attention without them; at their values they change it
    w_nosink = dict(mo["w"], **{k: torch.full_like(v, float("-inf")) for k, v in mo["w"].items()
                               if k.endswith("self_attn.sinks")})
    d_inf = rel(forward(dict(mo, w=w_nosink), ids))
    d_off = float((forward(dict(mo, w=w_nosink), ids) - forward(dict(mo, cfg=dict(oc, sinks=False)), ids))
                  .abs().max())
    check(d_inf > 1e-2 and d_off < 1e-12, "gpt_oss sinks change the logits (rel %.2g); at -inf they are none (%.1e)"
          % (d_inf, d_off))
    # the clamp: a share of gate and up values passes the limit, and lifting it changes the logits
    st = {}
    forward(mo, ids[:6], moe_stats=st)
    d = rel(forward(dict(mo, cfg=dict(oc, swiglu_limit=float("inf"))), ids))
    check(st["gate"] > 0 and st["up"] > 0 and d > 1e-2,
          "gpt_oss clamp bites: %.1f%% of gates above 7, %.1f%% of ups beyond +-7 on 6 tokens; no limit: rel %.2g"
          % (100.0 * st["gate"] / st["n"], 100.0 * st["up"] / st["n"], d))
    # o_proj's bias, the router's bias, the second expert, and the window
    d_ob = rel(forward(dict(mo, cfg=dict(oc, o_bias=False)), ids))
    w_norb = dict(mo["w"], **{k: torch.zeros_like(v) for k, v in mo["w"].items() if k.endswith("mlp.router.bias")})
    d_rb = rel(forward(dict(mo, w=w_norb), ids))
    d_k1 = rel(forward(dict(mo, cfg=dict(oc, top_k=1)), ids))
    check(d_ob > 1e-2 and d_rb > 1e-2 and d_k1 > 1e-2, "gpt_oss o_proj bias (rel %.2g), router bias (%.2g) and the "
          "second expert (%.2g) change the logits" % (d_ob, d_rb, d_k1))
    full = forward(dict(mo, cfg=dict(oc, layer_window=[None] * oc["n_layers"])), ids)
    check(float((base[:4] - full[:4]).abs().max()) < 1e-12 and float((base[4:] - full[4:]).abs().max()) > 1e-3,
          "gpt_oss window 4 on the even layers: the first 4 positions see everything, later ones less")
    tv, ti = topk_lowest(torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0], dtype=DT), 2)
    check(ti.tolist() == [1, 2] and tv.tolist() == [3.0, 3.0], "gpt_oss router ties go to the lower expert")
    # yarn as gpt-oss has it: truncate false keeps the ramp's ends where they fall; the scalar version agrees
    yc = my["cfg"]
    f_alt, af_alt = alt_yarn(yc)
    f_trunc, _ = yarn_inv_freq(dict(yc, rope_scaling=dict(yc["rope_scaling"], truncate=True)))
    check(float((my["inv_freq"] - f_alt).abs().max() / f_alt.max()) < 1e-14 and af_alt == my["attn_factor"] > 1
          and float((my["inv_freq"] - f_trunc).abs().max() / f_trunc.max()) > 1e-6,
          "gpt_oss yarn: scalar formulation agrees, attention factor %.4f, truncate false differs from true"
          % my["attn_factor"])

    # MXFP4: every dequantized value is the nearest E2M1 value of the float weight at its group's scale, and
    # that scale the smallest that holds the group's largest magnitude (amax / scale in (3, 6])
    raw, _ = safetensors_io.read_model_dir(os.path.join(tmp, "gpt_oss_mxfp4"))
    mags = torch.tensor(FP4_TABLE[:8], dtype=DT)
    worst_pick, worst_scale, n_exact = 0.0, 0, 0
    for i in range(oc["n_layers"]):
        for src, name in (("gate_up_proj", OSS_GATE_UP), ("down_proj", OSS_DOWN)):
            key = "model.layers.%d.%s" % (i, name)
            sc = torch.from_numpy(np.exp2(raw["model.layers.%d.mlp.experts.%s_scales" % (i, src)].astype(np.float64)
                                          - 127))
            x = mo["w"][key].reshape(*sc.shape, 32)
            q = mx["w"][key].reshape(*sc.shape, 32)
            y = x / sc[..., None]  # exact: a power of two
            best = (y.abs()[..., None] - mags).abs().min(dim=-1).values
            worst_pick = max(worst_pick, float(((q / sc[..., None] - y).abs() - best).max()))
            amax = x.abs().amax(dim=-1) / sc
            worst_scale += int(((amax <= 3) | (amax > 6)).sum())
            n_exact += int((q == x).sum())
    check(worst_pick < 1e-15 and worst_scale == 0, "mxfp4 file holds the nearest E2M1 values (excess %.1e) at the "
          "tightest scales (%d off); %d weights exactly representable" % (worst_pick, worst_scale, n_exact))
    check(torch.equal(mx["w"]["model.layers.1.mlp.experts.down_proj_bias"],
                      mo["w"]["model.layers.1.mlp.experts.down_proj_bias"]), "mxfp4 model keeps the float biases")
    d = rel(ref["mxfp4"])
    corr = float(torch.corrcoef(torch.stack([base.flatten(), ref["mxfp4"].flatten()]))[0, 1])
    check(d > 1e-4 and corr > 0.7, "mxfp4 logits differ from the float model's (rel %.2g) but follow them "
          "(correlation %.3f)" % (d, corr))
    # representable values round-trip exactly through gen_model's quantizer and this dequantizer; a zero group
    # gets scale 127; the low nibble is the even element
    rng = np.random.default_rng(5)
    e = rng.integers(-20, 20, size=(3, 5, 4))
    codes = rng.integers(0, 16, size=(3, 5, 4, 32))
    codes[..., 7] = 7  # one 6 in each group: the scale is exactly 2^e
    vals = np.array(FP4_TABLE)[codes] * np.exp2(e)[..., None]
    vals[1, 2, 3] = 0.0
    vals = vals.reshape(3, 5, 128)
    blocks, scales = gen_model.mxfp4_quantize(vals)
    back = mxfp4_dequantize(blocks, scales)
    want_s = e + 127
    want_s[1, 2, 3] = 127
    check(np.array_equal(back, vals) and np.array_equal(scales.astype(np.int64), want_s),
          "mxfp4: representable values round-trip exactly, the scales are their exponents, a zero group has 127")
    hand = mxfp4_dequantize(np.array([[0x71] + [0xF8] + [0] * 14], dtype=np.uint8), np.array([128], dtype=np.uint8))
    check(hand.shape == (32,) and hand[:4].tolist() == [1.0, 12.0, -0.0, -12.0] and not hand[4:].any(),
          "mxfp4 nibbles: low first (0x71 -> 0.5, 6), sign bit (0xF8 -> -0, -6), times 2^(128-127)")


def self_test():
    import gen_model

    failures = []

    def check(ok, what):
        log("%s: %s" % ("ok  " if ok else "FAIL", what))
        if not ok:
            failures.append(what)

    # bf16 encoding rounds to nearest even and decodes exactly.
    vals = np.array([1.0, 1.00390625, 1.005859375, -3.0e-3, 65504.0, 1.0 + 2 ** -8], np.float32)
    back = safetensors_io.bf16_bits_to_f32(safetensors_io.f32_to_bf16_bits(vals))
    expect = np.array([1.0, 1.0, 1.0078125, -0.0030059814453125, 65536.0, 1.0], np.float32)
    check(np.array_equal(back, expect), "bf16 round to nearest even")

    with tempfile.TemporaryDirectory() as tmp:
        d_main = os.path.join(tmp, "gqa")
        d_shard = os.path.join(tmp, "gqa_bf16_sharded")
        d_tied = os.path.join(tmp, "tied")
        common = ["--dim", "32", "--hidden-dim", "50", "--layers", "2", "--heads", "4",
                  "--kv-heads", "2", "--head-dim", "16", "--vocab", "97", "--seed", "7",
                  "--max-pos", "64", "--rope-scaling", "llama3", "--rope-original-max-pos", "256"]
        with contextlib.redirect_stdout(sys.stderr):
            gen_model.main(["--out", d_main] + common)
            gen_model.main(["--out", d_shard, "--dtype", "bf16", "--shards", "3"] + common)
            gen_model.main(["--out", d_tied, "--dim", "24", "--hidden-dim", "40", "--layers", "2",
                            "--heads", "3", "--vocab", "61", "--tie", "--seed", "3",
                            "--rope-theta", "500"])
            gen_model.main(["--out", os.path.join(tmp, "qwen2"), "--qwen2"] + common)
            gen_model.main(["--out", os.path.join(tmp, "qwen3"), "--arch", "qwen3", "--hidden-act",
                            "gelu_pytorch_tanh"] + common[:-4])
            gen_model.main(["--out", os.path.join(tmp, "mistral"), "--arch", "mistral", "--sliding-window", "5",
                            "--hidden-act", "gelu"] + common[:-4])
            gen_model.main(["--out", os.path.join(tmp, "gemma2"), "--arch", "gemma2", "--sliding-window", "5",
                            "--qk-gain", "6", "--final-softcap", "8"] + common[:-4])
            gen_model.main(["--out", os.path.join(tmp, "mixtral"), "--arch", "mixtral", "--experts", "4",
                            "--top-k", "2"] + common[:-4])
            gen_model.main(["--out", os.path.join(tmp, "qwen2_moe"), "--arch", "qwen2_moe", "--experts", "4",
                            "--top-k", "2", "--moe-hidden-dim", "16", "--shared-hidden-dim", "40"] + common[:-4])
            gen_model.main(["--out", os.path.join(tmp, "qwen3_moe"), "--arch", "qwen3_moe", "--experts", "6",
                            "--top-k", "3", "--moe-hidden-dim", "24", "--norm-topk-prob", "false",
                            "--mlp-only-layers", "0"] + common[:-4] + ["--layers", "3"])
            # gpt_oss: float experts, the same weights in MXFP4, and a bf16 copy with gpt-oss's untruncated yarn
            oss = ["--arch", "gpt_oss", "--dim", "64", "--hidden-dim", "32", "--layers", "4", "--heads", "4",
                   "--kv-heads", "2", "--head-dim", "16", "--vocab", "97", "--experts", "4", "--top-k", "2",
                   "--sliding-window", "4", "--seed", "11"]
            gen_model.main(["--out", os.path.join(tmp, "gpt_oss")] + oss)
            gen_model.main(["--out", os.path.join(tmp, "gpt_oss_mxfp4"), "--mxfp4"] + oss)
            gen_model.main(["--out", os.path.join(tmp, "gpt_oss_yarn"), "--rope-scaling", "yarn", "--rope-factor", "8",
                            "--rope-original-max-pos", "256", "--dtype", "bf16"] + oss)
            gen_model.main(["--out", os.path.join(tmp, "gemma3_bare"), "--arch", "gemma3", "--omit",
                            "rope_theta,query_pre_attn_scalar,max_position_embeddings,num_key_value_heads"]
                           + common[:-4])
        # keys a config leaves out take the class's defaults (Gemma3TextConfig: the global layers' base 1e6,
        # query_pre_attn_scalar 256 whatever head_dim is, 131072 positions, 4 KV heads)
        with open(os.path.join(tmp, "gemma3_bare", "config.json")) as f:
            bare = json.load(f)
        gc = read_config(os.path.join(tmp, "gemma3_bare"))
        check(not {"rope_theta", "query_pre_attn_scalar", "max_position_embeddings"} & set(bare)
              and gc["theta"] == 1e6 and gc["local_theta"] == 1e4 and gc["scale"] == 256 ** -0.5
              and gc["max_pos"] == 131072 and gc["n_kv_heads"] == 4 and gc["head_dim"] == 16,
              "gemma3_text: absent keys read as Gemma3TextConfig's defaults")
        m = load_model(d_main)
        ms = load_model(d_shard)
        mt = load_model(d_tied)
        mq = load_model(os.path.join(tmp, "qwen2"))
        check(mq["cfg"]["qkv_bias"] and "model.layers.1.self_attn.k_proj.bias" in mq["w"],
              "qwen2: q/k/v biases implied by model_type and loaded")

        # llama3 frequencies: both formulations, and all three bands exercised.
        f_alt, bands = alt_inv_freq(m["cfg"])
        err = float((m["inv_freq"] - f_alt).abs().max() / f_alt.abs().max())
        check(err < 1e-14, "llama3 inv_freq matches the scalar formulation (rel err %.1e)" % err)
        check(min(bands.values()) > 0, "llama3 bands all exercised %s" % bands)
        f_plain, _ = alt_inv_freq(mt["cfg"])
        check(float((mt["inv_freq"] - f_plain).abs().max()) < 1e-15, "plain inv_freq matches")

        # rotate-half RoPE against complex RoPE at a large position.
        v = torch.randn(5, 16, dtype=DT, generator=torch.Generator().manual_seed(1))
        cos, sin = rope_cos_sin(m["inv_freq"], 1000)
        a = v * cos[999] + rotate_half(v) * sin[999]
        b = torch.stack([alt_rope(v[r], 999, f_alt) for r in range(5)])
        check(float((a - b).abs().max()) < 1e-12, "rotate-half RoPE matches complex RoPE")
        # Rotated dot products depend only on the position difference.
        qa = alt_rope(v[0], 10, f_alt) @ alt_rope(v[1], 3, f_alt)
        qb = alt_rope(v[0], 110, f_alt) @ alt_rope(v[1], 103, f_alt)
        check(abs(float(qa - qb)) < 1e-12, "RoPE scores depend on relative position only")

        m3 = load_model(os.path.join(tmp, "qwen3"))
        mm = load_model(os.path.join(tmp, "mistral"))
        mx = load_model(os.path.join(tmp, "mixtral"))
        mqm = load_model(os.path.join(tmp, "qwen3_moe"))
        mq2 = load_model(os.path.join(tmp, "qwen2_moe"))
        check(mq2["cfg"]["shared_hidden"] == 40 and mq2["cfg"]["qkv_bias"], "qwen2_moe shared expert and biases read")
        check(mx["cfg"]["moe_layers"] == [True, True] and mx["cfg"]["norm_topk"]
              and mqm["cfg"]["moe_layers"] == [False, True, True] and not mqm["cfg"]["norm_topk"]
              and mqm["cfg"]["qk_norm"] and mqm["cfg"]["moe_hidden"] == 24, "mixtral and qwen3_moe configs read")
        check(m3["cfg"]["qk_norm"] and mm["cfg"]["window"] == 5, "qwen3 q/k norms and mistral window read")
        ids = [1, 5, 17, 3, 96, 40, 2, 11, 64, 7, 0, 33]
        for name, model, toks in (("GQA+llama3", m, ids), ("tied MHA", mt, [t % 61 for t in ids]),
                                  ("qwen2 biases", mq, ids), ("qwen3 q/k norms + gelu tanh", m3, ids),
                                  ("mistral window 5 + gelu", mm, ids), ("mixtral 4 experts top-2", mx, ids),
                                  ("qwen3_moe 6 experts top-3, unnormalised, a dense layer", mqm, ids),
                                  ("qwen2_moe shared expert + biases", mq2, ids)):
            ref = forward(model, toks)
            alt = alt_forward(model, toks)
            err = float((ref - alt).abs().max() / ref.abs().max())
            check(err < 1e-12, "%s batched forward matches per-head loops (rel err %.1e)" % (name, err))
            std = float(ref.std(dim=-1).mean())
            check(0.5 < std < 20, "%s logits are healthy (row std %.2f)" % (name, std))

        # The biases matter: the same weights without them give other logits.
        nob = {"cfg": dict(mq["cfg"], qkv_bias=False), "inv_freq": mq["inv_freq"],
               "w": {k: v for k, v in mq["w"].items() if not k.endswith("_proj.bias")}}
        diff = float((forward(mq, ids) - forward(nob, ids)).abs().max() / forward(mq, ids).abs().max())
        check(diff > 1e-2, "qwen2 biases change the logits (rel %.2g)" % diff)

        # The renormalisation matters (qwen3_moe's norm_topk_prob), and so does each chosen expert.
        renorm = dict(mqm, cfg=dict(mqm["cfg"], norm_topk=True))
        diff = float((forward(mqm, ids) - forward(renorm, ids)).abs().max() / forward(mqm, ids).abs().max())
        check(diff > 1e-2, "norm_topk_prob changes the logits (rel %.2g)" % diff)
        top1 = dict(mx, cfg=dict(mx["cfg"], top_k=1))
        diff = float((forward(mx, ids) - forward(top1, ids)).abs().max() / forward(mx, ids).abs().max())
        check(diff > 1e-2, "mixtral's second expert changes the logits (rel %.2g)" % diff)

        # The q/k norms and the window matter.
        plain = {"cfg": dict(m3["cfg"], qk_norm=False), "inv_freq": m3["inv_freq"], "w": m3["w"]}
        diff = float((forward(m3, ids) - forward(plain, ids)).abs().max() / forward(m3, ids).abs().max())
        check(diff > 1e-2, "qwen3 q/k norms change the logits (rel %.2g)" % diff)
        full_att = {"cfg": dict(mm["cfg"], window=None), "inv_freq": mm["inv_freq"], "w": mm["w"]}
        a, b = forward(mm, ids), forward(full_att, ids)
        check(float((a[:5] - b[:5]).abs().max()) < 1e-12 and float((a[5:] - b[5:]).abs().max()) > 1e-3,
              "window 5: the first 5 positions see everything, later ones less")

        # Gemma 2: the even layers slide, the odd ones do not; both caps bite here (scores far above 50,
        # logits above 8), the logits stay within the final cap, and a huge cap is no cap.
        mg = load_model(os.path.join(tmp, "gemma2"))
        gc = mg["cfg"]
        check(gc["layer_window"] == [5, None] and not gc["qk_norm"] and gc["attn_softcap"] == 50.0
              and gc["final_softcap"] == 8.0 and gc["act"] == "gelu_pytorch_tanh", "gemma2 config read")
        capped = forward(mg, ids)
        check(float(capped.abs().max()) < 8.0, "gemma2 logits within the final cap (%.3f)" % float(capped.abs().max()))
        for key in ("attn_softcap", "final_softcap"):
            off = forward(dict(mg, cfg=dict(gc, **{key: None})), ids)
            huge = forward(dict(mg, cfg=dict(gc, **{key: 1e12})), ids)
            d_off = float((capped - off).abs().max())
            d_huge = float((huge - off).abs().max() / off.abs().max())
            check(d_off > 1e-1 and d_huge < 1e-9, "gemma2 %s bites (%.2g) and a cap of 1e12 is none (%.1e)"
                  % (key, d_off, d_huge))
        # a second formulation of the capped attention of layer 0: one query at a time, scalar tanh
        w = mg["w"]
        T, H, KV, hd = len(ids), gc["n_heads"], gc["n_kv_heads"], gc["head_dim"]
        x0 = w["model.embed_tokens.weight"][torch.tensor(ids)] * math.sqrt(gc["dim"])
        h0 = gemma_norm(x0, w["model.layers.0.input_layernorm.weight"], gc["eps"])
        cos, sin = rope_cos_sin(mg["inv_freq"], T)
        qs = (h0 @ w["model.layers.0.self_attn.q_proj.weight"].T).view(T, H, hd)
        ks = (h0 @ w["model.layers.0.self_attn.k_proj.weight"].T).view(T, KV, hd)
        vs = (h0 @ w["model.layers.0.self_attn.v_proj.weight"].T).view(T, KV, hd)
        qs = qs * cos[:, None] + rotate_half(qs) * sin[:, None]
        ks = ks * cos[:, None] + rotate_half(ks) * sin[:, None]
        taps = []
        forward(mg, ids, taps=taps)
        worst = 0.0
        for t in range(T):
            for head in range(H):
                kvh = head // (H // KV)
                seen = range(max(0, t - 4), t + 1)  # window 5: the query and the 4 before it
                sc = [50.0 * math.tanh(float(qs[t, head] @ ks[u, kvh]) * gc["scale"] / 50.0) for u in seen]
                e = [math.exp(v - max(sc)) for v in sc]
                o = sum((ei / sum(e)) * vs[u, kvh] for ei, u in zip(e, seen))
                worst = max(worst, float((o - taps[0][head, t]).abs().max()))
        check(worst < 1e-12, "gemma2 capped sliding attention matches the scalar loop (%.1e)" % worst)

        self_test_gpt_oss(tmp, check, gen_model)

        # Causality: the prefix's logits do not change when tokens are appended.
        full = forward(m, ids)
        part = forward(m, ids[:5])
        check(float((full[:5] - part).abs().max()) < 1e-12, "causal mask: prefix logits unchanged")

        # bf16 sharded files hold the same weights rounded to bf16.
        worst = 0.0
        for name, t in m["w"].items():
            rel = float(((ms["w"][name] - t).abs() / t.abs().clamp_min(1e-30)).max())
            worst = max(worst, rel)
        check(worst <= 2 ** -8, "bf16 sharded weights equal f32 weights to bf16 rounding (%.1e)" % worst)
        with open(os.path.join(d_shard, "model.safetensors.index.json")) as f:
            files = set(json.load(f)["weight_map"].values())
        check(len(files) == 3, "3 shards written")

        # Greedy picks the lowest id on ties.
        tok, gap = argmax_lowest(torch.tensor([0.5, 2.0, -1.0, 2.0], dtype=DT))
        check(tok == 1 and gap == 0.0, "argmax ties go to the lowest id")

    if failures:
        log("self-test FAILED: %d check(s)" % len(failures))
        return 1
    print("OK")
    return 0


# ---------------------------------------------------------------- main

def parse_ids(s):
    try:
        return [int(t) for t in s.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError("--ids wants comma-separated integers")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (config.json + safetensors)")
    p.add_argument("--ids", type=parse_ids, help="prompt token ids, e.g. 1,403,407")
    p.add_argument("--logits-out", help="write float32 LE logits (rows, vocab) of the --ids positions")
    p.add_argument("--positions-from", type=int, default=0,
                   help="--logits-out holds only positions K..n_ids-1")
    p.add_argument("--greedy", type=int, default=0, help="greedy-generate N ids, printed on stdout")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="--greedy with vLLM's presence penalty")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="--greedy with vLLM's frequency penalty")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="--greedy with vLLM's repetition penalty")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID:B", help="--greedy with a logit bias")
    p.add_argument("--embed-out", help="write the float64 LE embedding (dim,) of --ids (see --pooling)")
    p.add_argument("--pooling", choices=("last", "mean"), default="last", help="--embed-out pooling")
    p.add_argument("--decode-with", help="tokenizer directory: print decoded text to stderr")
    p.add_argument("--self-test", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.self_test:
        return self_test()
    if not a.model or not a.ids:
        p.error("--model and --ids are required")
    if not 0 <= a.positions_from < len(a.ids):
        p.error("--positions-from must be in [0, %d)" % len(a.ids))
    t0 = time.time()
    model = load_model(a.model)
    if a.logits_out:
        logits = forward(model, a.ids)[a.positions_from:]
        np.ascontiguousarray(logits.numpy(), dtype="<f4").tofile(a.logits_out)
        log("wrote %s: %d x %d float32 logits (positions %d..%d)"
            % (a.logits_out, logits.shape[0], logits.shape[1], a.positions_from, len(a.ids) - 1))
    if a.embed_out:
        v = embedding(model, a.ids, a.pooling)
        np.ascontiguousarray(v.numpy(), dtype="<f8").tofile(a.embed_out)
        log("wrote %s: a %s-pooled embedding of %d values" % (a.embed_out, a.pooling, v.shape[0]))
    gen = []
    if a.greedy > 0:
        pen = {"presence": a.presence_penalty, "frequency": a.frequency_penalty,
               "repetition": a.repetition_penalty,
               "logit_bias": {int(x.split(":")[0]): float(x.split(":")[1]) for x in a.logit_bias}}
        gen, min_gap = greedy(model, a.ids, a.greedy, pen)
        print(",".join(str(t) for t in gen))
        sys.stdout.flush()
        log("greedy: %d ids, smallest top1-top2 gap %.4g" % (len(gen), min_gap))
    if a.decode_with:
        log("prompt:       %r" % decode_text(a.decode_with, a.ids))
        if gen:
            log("continuation: %r" % decode_text(a.decode_with, gen, False))
            log("full text:    %r" % decode_text(a.decode_with, a.ids + gen))
    log("done in %.2f s" % (time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())

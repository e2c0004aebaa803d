"""Write a random-weight Llama-family model in Hugging Face layout, for Loom's tests.

--arch gpt_oss writes GptOssForCausalLM (attention biases and sinks, alternating
sliding and full layers, every layer a biased top-k MoE with clamped SwiGLU
experts in GptOssExperts' fused, transposed layout, or with --mxfp4 those
experts as MXFP4 _blocks/_scales byte tensors).

The weights are deterministic from --seed (each tensor draws from its own
generator seeded by (seed, name), so the dtype and sharding do not change the
values beyond rounding). They are scaled so the model is numerically healthy
and its logits are peaky: a logit row has a std of a few units, so greedy
argmax gaps sit far above float32 noise. --stats prints those figures.
"""

import argparse
import json
import os
import shutil
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

TORCH_DTYPE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# Gains on 1/sqrt(fan_in). QK_GAIN makes attention scores std ~QK_GAIN^2, so
# attention is visibly non-uniform; LOGIT_GAIN sets the std of a logit row.
QK_GAIN = 1.5
LOGIT_GAIN = 4.0
NORM_NOISE = 0.05
BIAS_STD = 0.5  # q/k/v biases (--qwen2)
ROUTER_GAIN = 2.0  # MoE router logits of std ~2: the chosen experts stand apart from the rest
# gpt_oss: gate/up pre-activations of std ~4, so a good share passes the swiglu_limit of 7 and the clamp bites;
# sinks of std 1 (next to scores of std ~QK_GAIN^2) take a visible share of each softmax
OSS_GATE_UP_GAIN = 4.0
# (up + 1) * glu has an rms near 12 at that gain, so down_proj takes 1/8 of 1/sqrt(I): the experts' output is then
# about as large as attention's (rms ~1) and the residual stream stays balanced; at 1/sqrt(I) it would be ~9 and
# drown attention after the first layer
OSS_DOWN_GAIN = 0.125
OSS_SINK_STD = 1.0
OSS_ROUTER_BIAS_STD = 0.5
OSS_BIAS_STD = 0.3  # o_proj and the experts' biases
OSS_SWIGLU_LIMIT = 7.0
# MXFP4 (OCP microscaling): E2M1 code -> value; the high bit is the sign
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_GROUP = 32


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--hidden-dim", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=None, help="default: dim / heads")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--max-pos", type=int, default=None,
                   help="max_position_embeddings (default 1024; gpt_oss with yarn: factor * original)")
    p.add_argument("--tie", action="store_true", help="tie lm_head to the embedding")
    p.add_argument("--qwen2", action="store_true",
                   help="a Qwen2 layout: model_type qwen2, with q/k/v projection biases (= --arch qwen2)")
    p.add_argument("--arch", choices=["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "mixtral",
                                      "qwen3_moe", "qwen2_moe", "gpt_oss"], default=None,
                   help="config layout and tensor names: qwen3 adds per-head q_norm/k_norm, "
                        "mistral and phi3 take --sliding-window, phi3 fuses qkv_proj and gate_up_proj, "
                        "mixtral and qwen3_moe have Mixture-of-Experts blocks (--experts, --top-k), "
                        "gpt_oss too (experts of --hidden-dim, attention sinks, --sliding-window on even layers)")
    p.add_argument("--mxfp4", action="store_true",
                   help="gpt_oss: store the experts' gate_up_proj and down_proj as MXFP4 _blocks/_scales (U8), "
                        "with a quantization_config (needs --dim and --hidden-dim multiples of 32)")
    p.add_argument("--experts", type=int, default=4,
                   help="mixtral, qwen3_moe, gpt_oss: num_local_experts / num_experts")
    p.add_argument("--top-k", type=int, default=2, help="mixtral, qwen3_moe, gpt_oss: num_experts_per_tok")
    p.add_argument("--moe-hidden-dim", type=int, default=None,
                   help="qwen3_moe: moe_intermediate_size (default --hidden-dim; mixtral's experts use --hidden-dim); "
                        "gpt_oss: the experts' intermediate_size, in place of --hidden-dim")
    p.add_argument("--shared-hidden-dim", type=int, default=None,
                   help="qwen2_moe: shared_expert_intermediate_size (default --hidden-dim)")
    p.add_argument("--norm-topk-prob", choices=["true", "false"], default="true", help="qwen3_moe: norm_topk_prob")
    p.add_argument("--sparse-step", type=int, default=1, help="qwen3_moe: decoder_sparse_step")
    p.add_argument("--mlp-only-layers", default="", help="qwen3_moe: mlp_only_layers, comma-separated")
    p.add_argument("--expert-spread", type=float, default=1.0,
                   help="mixtral, qwen3_moe: each expert weight is sqrt(1-s^2) * a part all experts of the layer "
                        "share + s * its own (1: independent experts; below 1 they resemble each other, as "
                        "experts upcycled from one dense MLP do, and a token routed elsewhere moves less)")
    p.add_argument("--hidden-act", default="silu", help="config.json hidden_act (gelu, gelu_pytorch_tanh, relu...)")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="mistral: sliding_window (default null); gpt_oss: the even layers' window (default 8)")
    p.add_argument("--sliding-pattern", type=int, default=2,
                   help="gemma3: every Nth layer is global, the others slide (sliding_window_pattern)")
    p.add_argument("--query-pre-attn-scalar", type=int, default=None, help="gemma2, gemma3 (default: head dim)")
    p.add_argument("--attn-softcap", default="50", help="gemma2: attn_logit_softcapping (a number, none: null, "
                   "absent: the key left out)")
    p.add_argument("--final-softcap", default="30", help="gemma2: final_logit_softcapping (as --attn-softcap)")
    p.add_argument("--qk-gain", type=float, default=QK_GAIN,
                   help="gain of q/k_proj on 1/sqrt(fan_in): attention scores have std about gain^2")
    p.add_argument("--partial-rotary", type=float, default=None,
                   help="phi3: partial_rotary_factor (Phi-4-mini: 0.75); RoPE turns that share of each head")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rope-scaling", choices=["none", "llama3", "linear", "yarn", "longrope"], default="none")
    p.add_argument("--rope-factor", type=float, default=8.0)
    p.add_argument("--rope-low-freq-factor", type=float, default=1.0)
    p.add_argument("--rope-high-freq-factor", type=float, default=4.0)
    p.add_argument("--rope-original-max-pos", type=int, default=256)
    p.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="f32")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--tokenizer-from", default=None,
                   help="copy tokenizer.json and tokenizer_config.json from this directory")
    p.add_argument("--bos", type=int, default=1)
    p.add_argument("--eos", type=int, default=2)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--omit", default="",
                   help="config.json keys to leave out, comma-separated (a reader then takes the class's defaults)")
    p.add_argument("--stats", action="store_true",
                   help="run the reference forward pass and print logit statistics")
    a = p.parse_args(argv)
    if a.arch is None:
        a.arch = "qwen2" if a.qwen2 else "llama"
    a.qwen2 = a.arch in ("qwen2", "qwen2_moe")
    if a.kv_heads is None:
        a.kv_heads = a.heads
    if a.head_dim is None:
        if a.dim % a.heads:
            p.error("--dim must be a multiple of --heads unless --head-dim is given")
        a.head_dim = a.dim // a.heads
    if a.heads % a.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if a.head_dim % 2:
        p.error("head dim must be even for RoPE")
    if a.shards < 1:
        p.error("--shards must be >= 1")
    if a.arch == "gpt_oss":  # intermediate_size is the experts' width; --moe-hidden-dim, if given, says it too
        if a.moe_hidden_dim is not None:
            a.hidden_dim = a.moe_hidden_dim
        if a.sliding_window is None:
            a.sliding_window = 8
        if a.sliding_window < 1:
            p.error("--sliding-window must be >= 1")
        if not 1 <= a.top_k <= a.experts:
            p.error("gpt_oss needs 1 <= --top-k <= --experts")
        if a.rope_scaling not in ("none", "yarn"):
            p.error("gpt_oss takes --rope-scaling none or yarn")
        if a.mxfp4 and (a.dim % MXFP4_GROUP or a.hidden_dim % MXFP4_GROUP):
            p.error("--mxfp4 needs --dim and the experts' --hidden-dim to be multiples of %d (got %d and %d)"
                    % (MXFP4_GROUP, a.dim, a.hidden_dim))
    elif a.mxfp4:
        p.error("--mxfp4 is for --arch gpt_oss only")
    if a.max_pos is None:  # yarn as gpt-oss ships it: max_position_embeddings = factor * original
        a.max_pos = (int(round(a.rope_factor * a.rope_original_max_pos))
                     if a.arch == "gpt_oss" and a.rope_scaling == "yarn" else 1024)
    if a.moe_hidden_dim is None:
        a.moe_hidden_dim = a.hidden_dim
    if a.shared_hidden_dim is None:
        a.shared_hidden_dim = a.hidden_dim
    a.mlp_only = [int(x) for x in a.mlp_only_layers.split(",") if x]
    for name in ("dim", "hidden_dim", "layers", "heads", "kv_heads", "vocab", "max_pos"):
        if getattr(a, name) < 1:
            p.error("--%s must be >= 1" % name.replace("_", "-"))
    return a


def tensor_specs(a):
    """-> list of (name, shape, kind) in HF LlamaForCausalLM order."""
    if a.arch == "gpt_oss":
        return oss_specs(a)
    hd = a.head_dim
    specs = [("model.embed_tokens.weight", (a.vocab, a.dim), "embed")]
    for i in range(a.layers):
        pre = "model.layers.%d." % i
        specs += [
            (pre + "input_layernorm.weight", (a.dim,), "norm"),
            (pre + "self_attn.q_proj.weight", (a.heads * hd, a.dim), "qk"),
            (pre + "self_attn.k_proj.weight", (a.kv_heads * hd, a.dim), "qk"),
            (pre + "self_attn.v_proj.weight", (a.kv_heads * hd, a.dim), "linear"),
        ]
        if a.qwen2:
            specs += [(pre + "self_attn.%s_proj.bias" % n, (rows * hd,), "bias")
                      for n, rows in (("q", a.heads), ("k", a.kv_heads), ("v", a.kv_heads))]
        if a.arch in ("qwen3", "qwen3_moe"):  # per-head RMSNorm gains of q and k
            specs += [(pre + "self_attn.q_norm.weight", (hd,), "qknorm"),
                      (pre + "self_attn.k_norm.weight", (hd,), "qknorm")]
        if a.arch == "gemma3":  # (1+w) gains: stored near 0
            specs += [(pre + "self_attn.q_norm.weight", (hd,), "gqknorm"),
                      (pre + "self_attn.k_norm.weight", (hd,), "gqknorm")]
        if a.arch in ("gemma2", "gemma3"):
            specs += [(pre + "pre_feedforward_layernorm.weight", (a.dim,), "gnorm"),
                      (pre + "post_feedforward_layernorm.weight", (a.dim,), "gnorm")]
        specs += [
            (pre + "self_attn.o_proj.weight", (a.dim, a.heads * hd), "linear"),
            (pre + "post_attention_layernorm.weight", (a.dim,), "norm"),
        ]
        ex = "expert:%r" % a.expert_spread
        if a.arch == "mixtral":  # MixtralSparseMoeBlock: gate (the router), experts.J.w1 / w3 / w2
            specs.append((pre + "block_sparse_moe.gate.weight", (a.experts, a.dim), "router"))
            for j in range(a.experts):
                e = pre + "block_sparse_moe.experts.%d." % j
                specs += [(e + "w1.weight", (a.hidden_dim, a.dim), ex),
                          (e + "w2.weight", (a.dim, a.hidden_dim), ex),
                          (e + "w3.weight", (a.hidden_dim, a.dim), ex)]
            continue
        if a.arch in ("qwen3_moe", "qwen2_moe") and moe_layer(a, i):  # Qwen3MoeSparseMoeBlock / Qwen2Moe...
            specs.append((pre + "mlp.gate.weight", (a.experts, a.dim), "router"))
            if a.arch == "qwen2_moe":  # the shared expert and its sigmoid gate
                sh = a.shared_hidden_dim
                specs += [(pre + "mlp.shared_expert.gate_proj.weight", (sh, a.dim), "linear"),
                          (pre + "mlp.shared_expert.up_proj.weight", (sh, a.dim), "linear"),
                          (pre + "mlp.shared_expert.down_proj.weight", (a.dim, sh), "linear"),
                          (pre + "mlp.shared_expert_gate.weight", (1, a.dim), "router")]
            for j in range(a.experts):
                e = pre + "mlp.experts.%d." % j
                specs += [(e + "gate_proj.weight", (a.moe_hidden_dim, a.dim), ex),
                          (e + "up_proj.weight", (a.moe_hidden_dim, a.dim), ex),
                          (e + "down_proj.weight", (a.dim, a.moe_hidden_dim), ex)]
            continue
        specs += [
            (pre + "mlp.gate_proj.weight", (a.hidden_dim, a.dim), "linear"),
            (pre + "mlp.up_proj.weight", (a.hidden_dim, a.dim), "linear"),
            (pre + "mlp.down_proj.weight", (a.dim, a.hidden_dim), "linear"),
        ]
    specs.append(("model.norm.weight", (a.dim,), "norm"))
    if not a.tie:
        specs.append(("lm_head.weight", (a.vocab, a.dim), "lm_head"))
    if a.arch == "gemma2":  # every norm a (1+w) gain stored near 0, as in the released checkpoints
        specs = [(n, sh, "gnorm" if k == "norm" else k) for n, sh, k in specs]
    return fuse_specs(a, specs) if a.arch == "phi3" else specs


def oss_specs(a):
    """GptOssForCausalLM's tensors. The experts' matrices are held as GptOssExperts holds them, (in, out):
    gate_up_proj [E, H, 2I] with gate unit j in column 2j and up unit j in column 2j+1, down_proj [E, I, H].
    With --mxfp4 each is replaced by _blocks [E, out, in/32, 16] and _scales [E, out, in/32] (out-major),
    quantized from the very values the float layout would hold."""
    H, I, E, hd = a.dim, a.hidden_dim, a.experts, a.head_dim
    specs = [("model.embed_tokens.weight", (a.vocab, H), "embed")]
    for i in range(a.layers):
        pre = "model.layers.%d." % i
        specs += [(pre + "input_layernorm.weight", (H,), "norm"),
                  (pre + "self_attn.q_proj.weight", (a.heads * hd, H), "qk"),
                  (pre + "self_attn.q_proj.bias", (a.heads * hd,), "bias"),
                  (pre + "self_attn.k_proj.weight", (a.kv_heads * hd, H), "qk"),
                  (pre + "self_attn.k_proj.bias", (a.kv_heads * hd,), "bias"),
                  (pre + "self_attn.v_proj.weight", (a.kv_heads * hd, H), "linear"),
                  (pre + "self_attn.v_proj.bias", (a.kv_heads * hd,), "bias"),
                  (pre + "self_attn.o_proj.weight", (H, a.heads * hd), "linear"),
                  (pre + "self_attn.o_proj.bias", (H,), "std:%r" % OSS_BIAS_STD),
                  (pre + "self_attn.sinks", (a.heads,), "std:%r" % OSS_SINK_STD),
                  (pre + "post_attention_layernorm.weight", (H,), "norm"),
                  (pre + "mlp.router.weight", (E, H), "router"),
                  (pre + "mlp.router.bias", (E,), "std:%r" % OSS_ROUTER_BIAS_STD)]
        ex = pre + "mlp.experts."
        gate_up = (ex + "gate_up_proj", (E, H, 2 * I), "in_out:%r" % OSS_GATE_UP_GAIN)
        down = (ex + "down_proj", (E, I, H), "in_out:%r" % OSS_DOWN_GAIN)
        for spec in (gate_up, down):
            name, (_, n_in, n_out), _ = spec
            if a.mxfp4:
                groups = n_in // MXFP4_GROUP
                specs += [(name + "_blocks", (E, n_out, groups, MXFP4_GROUP // 2), ("mxfp4", "blocks", spec)),
                          (name + "_scales", (E, n_out, groups), ("mxfp4", "scales", spec))]
            else:
                specs.append(spec)
            specs.append((name + "_bias", (E, n_out), "std:%r" % OSS_BIAS_STD))
    specs.append(("model.norm.weight", (H,), "norm"))
    if not a.tie:
        specs.append(("lm_head.weight", (a.vocab, H), "lm_head"))
    return specs


def mxfp4_quantize(w):
    """Out-major float weights [..., rows, n] (n a multiple of 32) -> (blocks uint8 [..., rows, n/32, 16],
    scales uint8 [..., rows, n/32]). Per group of 32 consecutive values: the E8M0 scale s = 127 +
    ceil(log2(amax / 6)) (clamped to 0..254; an all-zero group gets 127), then each value / 2^(s-127)
    rounded to the nearest E2M1 value (ties to the even code), two codes a byte, the low nibble first."""
    w = np.asarray(w, dtype=np.float64)
    *lead, n = w.shape
    if n % MXFP4_GROUP:
        raise ValueError("MXFP4 wants rows of a multiple of %d values, got %d" % (MXFP4_GROUP, n))
    g = w.reshape(*lead, n // MXFP4_GROUP, MXFP4_GROUP)
    amax = np.abs(g).max(axis=-1)
    # ceil(log2(amax / 6)) exactly: amax / 6 = m * 2^e with m in [0.5, 1), a power of two when m == 0.5
    m, e = np.frexp(amax / 6.0)
    exp = np.where(m == 0.5, e - 1, e)
    s = np.where(amax > 0, np.clip(127 + exp, 0, 254), 127).astype(np.int64)
    y = np.abs(g) / np.ldexp(1.0, s - 127)[..., None]
    mags = FP4_VALUES[:8]
    dist = np.abs(y[..., None] - mags)
    nearest = dist.min(axis=-1, keepdims=True)
    # among the (at most two, adjacent) nearest codes prefer the even one
    code = np.argmin(np.where(dist == nearest, np.arange(8) & 1, 2), axis=-1)
    code = np.where((g < 0) & (code > 0), code | 8, code).astype(np.uint8)  # a zero stays +0
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return blocks, s.astype(np.uint8)


def moe_layer(a, i):
    """Qwen3MoeDecoderLayer: sparse unless in mlp_only_layers, on every decoder_sparse_step-th layer."""
    return i not in a.mlp_only and a.experts > 0 and (i + 1) % a.sparse_step == 0


def fuse_specs(a, specs):
    """Phi-3's layout: q/k/v stacked into qkv_proj, gate/up into gate_up_proj.
    Each part keeps its own name's values (and gain)."""
    out = []
    for name, shape, kind in specs:
        for first, rest, fused in (("self_attn.q_proj.weight", ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                                    "self_attn.qkv_proj.weight"),
                                   ("mlp.gate_proj.weight", ("mlp.up_proj.weight",), "mlp.gate_up_proj.weight")):
            if name.endswith(first):
                pre = name[:-len(first)]
                parts = [(name, shape, kind)] + [s for s in specs if s[0] in [pre + r for r in rest]]
                rows = sum(p[1][0] for p in parts)
                out.append((pre + fused, (rows, shape[1]), ("fused", parts)))
                break
        else:
            if not any(name.endswith(r) for r in ("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                                   "mlp.up_proj.weight")):
                out.append((name, shape, kind))
    return out


def make_tensor(seed, name, shape, kind, qk_gain=QK_GAIN):
    if isinstance(kind, tuple) and kind[0] == "mxfp4":  # the float tensor's values, out-major, quantized
        fname, fshape, fkind = kind[2]
        w = make_tensor(seed, fname, fshape, fkind, qk_gain).transpose(0, 2, 1)  # (E, in, out) -> (E, out, in)
        blocks, scales = mxfp4_quantize(w)
        return blocks if kind[1] == "blocks" else scales
    if isinstance(kind, tuple):  # fused: the parts stacked by rows
        return np.concatenate([make_tensor(seed, n, s, k, qk_gain) for n, s, k in kind[1]], axis=0)
    if isinstance(kind, str) and kind.startswith("expert:"):  # sqrt(1-s^2) * shared + s * own
        s = float(kind[7:])
        x = make_tensor(seed, name, shape, "linear")
        if s < 1.0:
            pre, rest = name.split(".experts.", 1)
            shared = make_tensor(seed, pre + ".experts.shared." + rest.split(".", 1)[1], shape, "linear")
            x = (np.float32(np.sqrt(1.0 - s * s)) * shared + np.float32(s) * x).astype(np.float32)
        return x
    rng = np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])
    x = rng.standard_normal(shape, dtype=np.float32)
    fan_in = shape[-1]
    if kind == "bias":  # large enough to move the attention pattern
        return x * np.float32(BIAS_STD)
    if kind.startswith("std:"):  # plain N(0, std^2)
        return x * np.float32(float(kind[4:]))
    if kind.startswith("in_out:"):  # (E, in, out) stacks of experts: the fan-in is axis 1
        return x * np.float32(float(kind[7:]) / np.sqrt(shape[1]))
    if kind == "norm":
        x *= np.float32(NORM_NOISE)
        x += np.float32(1.0)
        return x
    if kind == "gnorm":  # Gemma scales by 1 + w
        return x * np.float32(NORM_NOISE)
    if kind == "gqknorm":
        return x * np.float32(0.5) + np.float32(0.5)
    if kind == "qknorm":  # far from 1, so a loader that skips them gives other logits
        x *= np.float32(0.5)
        x += np.float32(1.5)
        return x
    # The embedding rows double as lm_head rows when tied; the final RMSNorm
    # makes the hidden state's rms ~1, so std LOGIT_GAIN/sqrt(dim) per weight
    # gives logits of std ~LOGIT_GAIN. The input side is renormalised anyway.
    gain = {"embed": LOGIT_GAIN, "lm_head": LOGIT_GAIN, "qk": qk_gain, "linear": 1.0, "router": ROUTER_GAIN}[kind]
    x *= np.float32(gain / np.sqrt(fan_in))
    return x


def make_config(a, st_dtype):
    rope_scaling = None
    if a.rope_scaling == "llama3":
        rope_scaling = {
            "factor": a.rope_factor,
            "low_freq_factor": a.rope_low_freq_factor,
            "high_freq_factor": a.rope_high_freq_factor,
            "original_max_position_embeddings": a.rope_original_max_pos,
            "rope_type": "llama3",
        }
    elif a.rope_scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": a.rope_factor}
    elif a.rope_scaling == "yarn" and a.arch == "gpt_oss":  # as gpt-oss ships it: the ramp's ends not rounded
        rope_scaling = {"rope_type": "yarn", "factor": a.rope_factor, "beta_fast": 32.0, "beta_slow": 1.0,
                        "original_max_position_embeddings": a.rope_original_max_pos, "truncate": False}
    elif a.rope_scaling == "yarn":  # max_position_embeddings = factor * original
        rope_scaling = {"rope_type": "yarn", "factor": a.rope_factor,
                        "original_max_position_embeddings": a.rope_original_max_pos}
    elif a.rope_scaling == "longrope":  # Phi-3: factors per frequency; max_pos is the extended context
        rng = np.random.default_rng([a.seed, 2])
        pairs = int(a.head_dim * (a.partial_rotary or 1.0)) // 2  # one factor per rotary frequency
        rope_scaling = {"type": "longrope",
                        "short_factor": [float(x) for x in np.round(rng.uniform(1.0, 4.0, pairs), 3)],
                        "long_factor": [float(x) for x in np.round(rng.uniform(4.0, 16.0, pairs), 3)]}
    arch_names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}
    c = {
        "architectures": [arch_names[a.arch]],
        "model_type": a.arch,
        "hidden_size": a.dim,
        "intermediate_size": a.hidden_dim,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "vocab_size": a.vocab,
        "max_position_embeddings": a.max_pos,
        "rms_norm_eps": 1e-05,
        "rope_theta": a.rope_theta,
        "rope_scaling": rope_scaling,
        "hidden_act": a.hidden_act,
        "tie_word_embeddings": bool(a.tie),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": a.bos,
        "eos_token_id": a.eos,
        "torch_dtype": TORCH_DTYPE[st_dtype],
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    }
    if a.qwen2:  # as Qwen2's (and Qwen2-MoE's) config.json: biases implied, sliding window off
        del c["attention_bias"], c["mlp_bias"], c["pretraining_tp"]
        c.update({"use_sliding_window": False, "sliding_window": a.max_pos, "max_window_layers": a.layers})
    if a.arch == "qwen3":  # as Qwen3's config.json
        del c["mlp_bias"], c["pretraining_tp"]
        c.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": a.layers})
    if a.arch == "phi3":  # as Phi-3's config.json
        del c["attention_bias"], c["mlp_bias"], c["pretraining_tp"], c["head_dim"]
        c.update({"sliding_window": a.sliding_window, "original_max_position_embeddings": a.rope_original_max_pos,
                  "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attention_dropout": 0.0})
        if a.partial_rotary is not None:  # as Phi-4-mini's config.json
            c["partial_rotary_factor"] = a.partial_rotary
    if a.arch == "gemma3":  # as Gemma3TextConfig's config.json
        del c["mlp_bias"], c["pretraining_tp"], c["hidden_act"]
        c.update({"model_type": "gemma3_text", "hidden_activation": a.hidden_act if a.hidden_act != "silu"
                  else "gelu_pytorch_tanh", "query_pre_attn_scalar": a.query_pre_attn_scalar or a.head_dim,
                  "sliding_window": a.sliding_window or 16, "sliding_window_pattern": a.sliding_pattern,
                  "rope_local_base_freq": 10000.0, "final_logit_softcapping": None,
                  "attn_logit_softcapping": None, "rms_norm_eps": 1e-06})
    if a.arch == "gemma2":  # as a released Gemma 2 config.json (both activation keys, the hybrid cache)
        del c["mlp_bias"], c["pretraining_tp"]
        act = a.hidden_act if a.hidden_act != "silu" else "gelu_pytorch_tanh"
        c.update({"hidden_act": act, "hidden_activation": act,
                  "query_pre_attn_scalar": a.query_pre_attn_scalar or a.head_dim,
                  "sliding_window": a.sliding_window or 16, "sliding_window_size": a.sliding_window or 16,
                  "cache_implementation": "hybrid", "rms_norm_eps": 1e-06, "attention_dropout": 0.0})
        for key, v in (("attn_logit_softcapping", a.attn_softcap), ("final_logit_softcapping", a.final_softcap)):
            if v != "absent":
                c[key] = None if v == "none" else float(v)
    if a.arch == "mistral":
        del c["attention_bias"], c["mlp_bias"], c["pretraining_tp"]
        c["sliding_window"] = a.sliding_window
    if a.arch == "mixtral":  # as Mixtral's config.json
        del c["attention_bias"], c["mlp_bias"], c["pretraining_tp"]
        c.update({"sliding_window": a.sliding_window, "num_local_experts": a.experts,
                  "num_experts_per_tok": a.top_k, "output_router_logits": False, "router_aux_loss_coef": 0.02,
                  "router_jitter_noise": 0.0, "attention_dropout": 0.0})
    if a.arch == "qwen2_moe":  # as Qwen2-MoE's (Qwen1.5-MoE) config.json: q/k/v biases implied
        c.update({"num_experts": a.experts, "num_experts_per_tok": a.top_k,
                  "moe_intermediate_size": a.moe_hidden_dim, "shared_expert_intermediate_size": a.shared_hidden_dim,
                  "norm_topk_prob": a.norm_topk_prob == "true", "decoder_sparse_step": a.sparse_step,
                  "mlp_only_layers": a.mlp_only, "output_router_logits": False, "router_aux_loss_coef": 0.001})
    if a.arch == "qwen3_moe":  # as Qwen3-MoE's config.json
        del c["mlp_bias"], c["pretraining_tp"]
        c.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": a.layers,
                  "num_experts": a.experts, "num_experts_per_tok": a.top_k,
                  "moe_intermediate_size": a.moe_hidden_dim, "norm_topk_prob": a.norm_topk_prob == "true",
                  "decoder_sparse_step": a.sparse_step, "mlp_only_layers": a.mlp_only,
                  "output_router_logits": False, "router_aux_loss_coef": 0.001, "attention_dropout": 0.0})
    if a.arch == "gpt_oss":  # as gpt-oss's config.json: biased attention with sinks, even layers slide
        del c["mlp_bias"], c["pretraining_tp"]
        c.update({"hidden_act": "silu", "attention_bias": True, "attention_dropout": 0.0,
                  "num_local_experts": a.experts, "num_experts_per_tok": a.top_k, "experts_per_token": a.top_k,
                  "sliding_window": a.sliding_window,
                  "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(a.layers)],
                  "swiglu_limit": OSS_SWIGLU_LIMIT, "router_aux_loss_coef": 0.9, "output_router_logits": False})
        if a.mxfp4:  # the experts' two matrices only; attention, router, embedding and head stay float
            c["quantization_config"] = {"quant_method": "mxfp4",
                                        "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                   "model.layers.*.mlp.router",
                                                                   "model.embed_tokens", "lm_head"]}
    for key in filter(None, a.omit.split(",")):
        if key not in c:
            raise SystemExit("--omit %s: config.json has no such key" % key)
        del c[key]
    return c


def tokenizer_size(tok_path):
    with open(tok_path, encoding="utf-8") as f:
        tok = json.load(f)
    ids = list(tok.get("model", {}).get("vocab", {}).values())
    ids += [t["id"] for t in tok.get("added_tokens", []) or []]
    return max(ids) + 1 if ids else 0


def split_shards(specs, n):
    """Contiguous groups of tensors with roughly equal byte counts."""
    sizes = [int(np.prod(shape)) for _, shape, _ in specs]
    total = sum(sizes)
    groups = [[] for _ in range(n)]
    acc = 0
    for spec, size in zip(specs, sizes):
        k = min(n - 1, acc * n // total) if total else 0
        groups[k].append(spec)
        acc += size
    return groups


def stored(a, name, shape, kind):
    """-> (name, array) for safetensors_io.write, or (name, array, "U8") for byte tensors (MXFP4)."""
    x = make_tensor(a.seed, name, shape, kind, a.qk_gain)
    if tuple(x.shape) != tuple(shape):
        raise AssertionError("%s: made %s, wanted %s" % (name, x.shape, shape))
    return (name, x, "U8") if x.dtype == np.uint8 else (name, x)


def write_model(a):
    st_dtype = {"f32": "F32", "f16": "F16", "bf16": "BF16"}[a.dtype]
    os.makedirs(a.out, exist_ok=True)
    if a.tokenizer_from:
        for fname in ("tokenizer.json", "tokenizer_config.json"):
            src = os.path.join(a.tokenizer_from, fname)
            if not os.path.exists(src):
                sys.exit("gen_model: %s not found" % src)
        n_tok = tokenizer_size(os.path.join(a.tokenizer_from, "tokenizer.json"))
        if a.vocab < n_tok:
            sys.exit("gen_model: --vocab %d is smaller than the tokenizer's %d tokens" % (a.vocab, n_tok))
        for fname in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(a.tokenizer_from, fname), os.path.join(a.out, fname))
    for fname in os.listdir(a.out):
        if fname.startswith("model") and (fname.endswith(".safetensors") or fname.endswith(".index.json")):
            os.remove(os.path.join(a.out, fname))

    specs = tensor_specs(a)
    metadata = {"format": "pt"}
    total_bytes = 0
    if a.shards == 1:
        tensors = [stored(a, name, shape, kind) for name, shape, kind in specs]
        total_bytes = safetensors_io.write(os.path.join(a.out, "model.safetensors"),
                                           tensors, st_dtype, metadata)
    else:
        weight_map = {}
        groups = split_shards(specs, a.shards)
        for i, group in enumerate(groups):
            fname = "model-%05d-of-%05d.safetensors" % (i + 1, a.shards)
            tensors = [stored(a, name, shape, kind) for name, shape, kind in group]
            total_bytes += safetensors_io.write(os.path.join(a.out, fname), tensors, st_dtype, metadata)
            for name, _, _ in group:
                weight_map[name] = fname
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(make_config(a, st_dtype), f, indent=2)
        f.write("\n")
    n_params = sum(int(np.prod(shape)) * (2 if kind[1] == "blocks" else 0)  # MXFP4: two weights a byte
                   if isinstance(kind, tuple) and kind[0] == "mxfp4" else int(np.prod(shape))
                   for _, shape, kind in specs)
    return n_params, total_bytes


def llama3_bands(a):
    """How many RoPE frequencies fall in each llama3 band (high kept, medium smoothed, low scaled)."""
    inv_freq = 1.0 / (a.rope_theta ** (np.arange(0, a.head_dim, 2) / a.head_dim))
    wavelen = 2 * np.pi / inv_freq
    high = int((wavelen < a.rope_original_max_pos / a.rope_high_freq_factor).sum())
    low = int((wavelen > a.rope_original_max_pos / a.rope_low_freq_factor).sum())
    return high, len(inv_freq) - high - low, low


def print_stats(a):
    import llama_ref

    model = llama_ref.load_model(a.out)
    n = min(64, a.max_pos)
    rng = np.random.default_rng([a.seed, 1])
    ids = [a.bos] + [int(t) for t in rng.integers(0, a.vocab, n - 1)]
    logits = llama_ref.forward(model, ids)
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1])
    print("stats over %d positions: logit std %.3f (min %.3f, max %.3f), "
          "top1-top2 gap mean %.3f min %.4f median %.3f"
          % (n, logits.std(dim=-1).mean().item(), logits.std(dim=-1).min().item(),
             logits.std(dim=-1).max().item(), gaps.mean().item(), gaps.min().item(),
             gaps.median().item()))
    greedy, min_gap = llama_ref.greedy(model, [a.bos], 16)
    print("greedy 16 from bos: %s (min gap %.4f)" % (",".join(map(str, greedy)), min_gap))


def main(argv=None):
    a = parse_args(argv)
    t0 = time.time()
    n_params, total_bytes = write_model(a)
    print("wrote %s: %d parameters, %.1f MB of %s weights in %d file(s), %.2f s"
          % (a.out, n_params, total_bytes / 1e6, a.dtype, a.shards, time.time() - t0))
    if a.rope_scaling == "llama3":
        print("llama3 rope: %d high / %d medium (smoothed) / %d low frequencies" % llama3_bands(a))
    if a.stats:
        print_stats(a)


if __name__ == "__main__":
    main()

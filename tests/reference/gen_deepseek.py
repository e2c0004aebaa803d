"""Write a random-weight DeepSeek-V3 or DeepSeek-V2 model in Hugging Face layout, for Loom's tests.

--shape v3: transformers' own test shape for DeepseekV3 (hidden 32, 5 layers, 4 heads, q_lora_rank 32,
kv_lora_rank 16, nope 32, rope 16, v 32, 8 routed experts top-2 in 2 groups of which 1 is kept, 2 dense
layers, 1 shared expert) with V3's yarn (mscale and mscale_all_dim 1) and a sigmoid router with
e_score_correction_bias. --shape v2lite: DeepSeek-V2-Lite's layout in small (no q compression, a softmax
router, greedy top-3 of 8, 2 shared experts, 1 dense layer, yarn with mscale 0.707 on both sides).

Tensor names are the checkpoints' own: model.layers.{i}.self_attn.{q_proj | q_a_proj, q_a_layernorm,
q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; mlp.{gate,up,down}_proj (dense layers) or
mlp.gate.weight (+ e_score_correction_bias), mlp.experts.{j}.{gate,up,down}_proj, mlp.shared_experts.*.
--fp8 stores every projection as float8_e4m3fn codes with a weight_scale_inv per --fp8-block square block
(ceil-sized at the edges) and a quantization_config of fp8, as DeepSeek-V3 ships.
Values come from gen_model.make_tensor: deterministic from --seed and each tensor's name.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_model  # noqa: E402
import safetensors_io  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STORIES = os.path.join(HERE, "..", "..", "..", "shared", "models", "stories260K")

SHAPES = {
    "v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=32,
               intermediate_size=37, moe_intermediate_size=12, num_hidden_layers=5, num_attention_heads=4,
               num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=32, qk_rope_head_dim=16,
               v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
               first_k_dense_replace=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
               topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True, max_position_embeddings=512,
               rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
               num_nextn_predict_layers=0,
               rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32,
                                 beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    "v2lite": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=32,
                   intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=1,
                   topk_group=1, first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=1.0,
                   norm_topk_prob=False, topk_method="greedy", scoring_func="softmax", max_position_embeddings=512,
                   rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                   rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32,
                                     beta_slow=1, mscale=0.707, mscale_all_dim=0.707)),
    # V3's routing with MLA proportions where W_UV then o_proj holds fewer weights than the folded o'
    # (v (kv_lora + rope + hidden) = 16 x 112 < hidden (kv_lora + rope) = 64 x 48): the engine's split path
    "v3split": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=64,
                    intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                    topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                    norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True,
                    max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
                    tie_word_embeddings=False, num_nextn_predict_layers=0),
    # docs/benchmarks.md's DeepSeek-shaped model: 1.28 B parameters (48 experts of 512 in 15 MoE layers hold
    # 1.13 B), about 0.2 B read a token (4 routed + 1 shared expert, attention, the head)
    "bench1b": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=1024,
                    intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=16, num_attention_heads=16,
                    num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
                    qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=48, num_experts_per_tok=4, n_group=8,
                    topk_group=4, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                    norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True,
                    max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
                    tie_word_embeddings=False, num_nextn_predict_layers=0),
}


def tensor_specs(c):
    """-> [(name, shape, kind)] in gen_model.make_tensor's kinds."""
    D, H = c["hidden_size"], c["num_attention_heads"]
    dn, dr, dv, r, ql = (c[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank",
                                         "q_lora_rank"))
    E, I, Im = c["n_routed_experts"], c["intermediate_size"], c["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], D), "embed")]
    for i in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % i
        a = p + "self_attn."
        out += [(p + "input_layernorm.weight", (D,), "norm"), (p + "post_attention_layernorm.weight", (D,), "norm")]
        if ql:
            out += [(a + "q_a_proj.weight", (ql, D), "linear"), (a + "q_a_layernorm.weight", (ql,), "norm"),
                    (a + "q_b_proj.weight", (H * (dn + dr), ql), "qk")]
        else:
            out += [(a + "q_proj.weight", (H * (dn + dr), D), "qk")]
        out += [(a + "kv_a_proj_with_mqa.weight", (r + dr, D), "qk"), (a + "kv_a_layernorm.weight", (r,), "norm"),
                (a + "kv_b_proj.weight", (H * (dn + dv), r), "qk"), (a + "o_proj.weight", (D, H * dv), "linear")]
        m = p + "mlp."
        if i < c["first_k_dense_replace"]:
            out += [(m + "gate_proj.weight", (I, D), "linear"), (m + "up_proj.weight", (I, D), "linear"),
                    (m + "down_proj.weight", (D, I), "linear")]
            continue
        out += [(m + "gate.weight", (E, D), "router")]
        if c["topk_method"] == "noaux_tc":
            out += [(m + "gate.e_score_correction_bias", (E,), "std:0.3")]
        for j in range(E):
            e = "%sexperts.%d." % (m, j)
            out += [(e + "gate_proj.weight", (Im, D), "linear"), (e + "up_proj.weight", (Im, D), "linear"),
                    (e + "down_proj.weight", (D, Im), "linear")]
        if c["n_shared_experts"]:
            Is = Im * c["n_shared_experts"]
            out += [(m + "shared_experts.gate_proj.weight", (Is, D), "linear"),
                    (m + "shared_experts.up_proj.weight", (Is, D), "linear"),
                    (m + "shared_experts.down_proj.weight", (D, Is), "linear")]
    out += [("model.norm.weight", (D,), "norm"), ("lm_head.weight", (c["vocab_size"], D), "lm_head")]
    return out


def fp8_quantize(w, block):
    """float (R, C) -> (uint8 e4m3fn codes, float32 scale_inv (ceil(R/b), ceil(C/b))): each block's amax maps
    to 448, every value rounds to the nearest e4m3 value."""
    import deepseek_ref
    table = deepseek_ref.fp8_e4m3_values()
    finite = np.array([k for k in range(256) if not np.isnan(table[k])])
    order = finite[np.argsort(table[finite], kind="stable")]
    vals = table[order]
    R, C = w.shape
    sr, sc = -(-R // block), -(-C // block)
    scale = np.zeros((sr, sc), dtype=np.float32)
    codes = np.zeros((R, C), dtype=np.uint8)
    for bi in range(sr):
        for bj in range(sc):
            blk = w[bi * block:(bi + 1) * block, bj * block:(bj + 1) * block].astype(np.float64)
            s = np.float32(max(np.abs(blk).max(), 1e-12) / 448.0)
            scale[bi, bj] = s
            x = blk / np.float64(s)
            k = np.clip(np.searchsorted(vals, x), 1, len(vals) - 1)
            near = np.where(np.abs(vals[k - 1] - x) <= np.abs(vals[k] - x), k - 1, k)
            codes[bi * block:(bi + 1) * block, bj * block:(bj + 1) * block] = order[near]
    return codes, scale


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="v3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    p.add_argument("--fp8", action="store_true", help="projections as float8_e4m3fn + weight_scale_inv blocks")
    p.add_argument("--fp8-block", type=int, default=16, help="the square block of one scale (DeepSeek-V3: 128)")
    p.add_argument("--tokenizer-from", default=STORIES, help="copy tokenizer.json and tokenizer_config.json")
    p.add_argument("--vocab", type=int, default=0, help="vocab_size (default: the tokenizer's size)")
    p.add_argument("--mtp", type=int, default=0,
                   help="num_nextn_predict_layers: MTP modules stored after the last layer (not part of the forward "
                        "pass), as DeepSeek-V3's checkpoint holds model.layers.61.*")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override one config key of the shape (repeatable), e.g. kv_lora_rank=512 with "
                        "qk_rope_head_dim=64 for DeepSeek-V3's 576-wide latent rows")
    a = p.parse_args(argv)
    c = json.loads(json.dumps(SHAPES[a.shape]))
    for kv in a.set:
        key, eq, val = kv.partition("=")
        if not eq or key not in c:
            sys.exit("gen_deepseek: --set %r: want KEY=JSON with a key of the shape" % kv)
        c[key] = json.loads(val)
    os.makedirs(a.out, exist_ok=True)
    n_tok = 0
    if a.tokenizer_from and os.path.exists(os.path.join(a.tokenizer_from, "tokenizer.json")):
        for fname in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(a.tokenizer_from, fname), os.path.join(a.out, fname))
        n_tok = gen_model.tokenizer_size(os.path.join(a.tokenizer_from, "tokenizer.json"))
    c["vocab_size"] = a.vocab or n_tok or 512
    if c["vocab_size"] < n_tok:
        sys.exit("gen_deepseek: --vocab %d is smaller than the tokenizer's %d tokens" % (c["vocab_size"], n_tok))
    c["bos_token_id"], c["eos_token_id"] = 1, 2
    st_dtype = {"f32": "F32", "bf16": "BF16"}[a.dtype]
    c["torch_dtype"] = gen_model.TORCH_DTYPE[st_dtype]
    specs = tensor_specs(c)
    if a.mtp:  # an MTP module: a MoE layer plus its embedding/hidden norms, eh_proj and shared head
        c["num_nextn_predict_layers"] = a.mtp
        n, D = c["num_hidden_layers"], c["hidden_size"]
        last = [(nm.replace("layers.%d." % (n - 1), "layers.%d." % (n + k)), s, kd)
                for k in range(a.mtp) for nm, s, kd in specs if nm.startswith("model.layers.%d." % (n - 1))]
        extra = [("model.layers.%d.%s" % (n + k, t), s, kd) for k in range(a.mtp)
                 for t, s, kd in (("enorm.weight", (D,), "norm"), ("hnorm.weight", (D,), "norm"),
                                  ("eh_proj.weight", (D, 2 * D), "linear"),
                                  ("shared_head.norm.weight", (D,), "norm"),
                                  ("shared_head.head.weight", (c["vocab_size"], D), "lm_head"))]
        specs = specs + last + extra
    tensors = []
    for name, shape, kind in specs:
        x = gen_model.make_tensor(a.seed, name, shape, kind)
        quant = a.fp8 and len(shape) == 2 and ".layers." in name and not name.endswith("gate.weight")
        if quant:
            codes, scale = fp8_quantize(x, a.fp8_block)
            tensors += [(name, codes, "F8_E4M3"), (name + "_scale_inv", scale, "F32")]
        else:
            tensors.append((name, x))
    if a.fp8:
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [a.fp8_block, a.fp8_block]}
    safetensors_io.write(os.path.join(a.out, "model.safetensors"), tensors, st_dtype, {"format": "pt"})
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

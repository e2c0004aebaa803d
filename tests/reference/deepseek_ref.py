"""Independent reference for Loom's tests: DeepSeek-V3 and DeepSeek-V2 forward passes in float64.

Written from the math of Transformers' DeepseekV3ForCausalLM and
DeepseekV2ForCausalLM (modeling_deepseek_v3.py, modeling_deepseek_v2.py) and
their config classes, sharing no code with Loom's C engine:

- multi-head latent attention (MLA): q from q_proj, or q_a_proj ->
  q_a_layernorm -> q_b_proj when q_lora_rank is set; kv_a_proj_with_mqa gives
  a latent of kv_lora_rank values (RMS-normed by kv_a_layernorm) and one
  rope key of qk_rope_head_dim values shared by every head; kv_b_proj turns
  the latent into each head's k_nope and v. RoPE turns only the rope dims:
  consecutive pairs (2j, 2j+1) when rope_interleave (V3's default; V2
  always), else rotate-half pairs (j, j + d/2). The scores are scaled by
  qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn.
  The two latent norms use eps 1e-6 whatever rms_norm_eps says (the modules
  are built without it).
- YaRN as _compute_yarn_parameters: NTK-by-parts inv_freq over the rope dims
  with the correction range from original_max_position_embeddings, and cos
  and sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim)
  (when both are given; else mscale(factor)).
- DeepSeekMoE: V3 scores experts with a sigmoid; e_score_correction_bias is
  added for the choice only; a group's score is the sum of its two best
  biased scores; the topk_group best groups are kept and the top-k experts
  chosen among them; their weights are the unbiased scores, divided by their
  sum when norm_topk_prob, times routed_scaling_factor. V2 softmaxes the
  router logits and takes the top-k (greedy) or the top-k within the
  topk_group groups of highest maximum (group_limited_greedy), times
  routed_scaling_factor. Experts outside the kept groups are never chosen
  (DeepSeek's own inference code masks them with -inf; Transformers fills
  0.0, the same choice whenever the kept experts' scores are positive).
  Shared experts (one MLP of n_shared_experts x moe_intermediate_size) add
  to every token; layers below first_k_dense_replace are a dense MLP.
- FP8 checkpoints: float8_e4m3fn weights with a weight_scale_inv per
  128x128 block (ceil-sized at the edges) are dequantized at load.

CLI as llama_ref.py: --logits-out, --positions-from, --greedy (stdout carries
only the ids). --pieces FILE writes the inputs and expected outputs of the
C unit tests (router, YaRN, FP8 blocks, one MLA layer) as text lines
"name count v0 v1 ...". --self-test checks the batched forward pass against
a per-token version that runs MLA absorbed over a latent cache.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

DT = torch.float64
LATENT_NORM_EPS = 1e-6

# DeepseekV3Config's defaults (transformers configuration_deepseek_v3.py); topk_method and
# scoring_func are what DeepseekV3TopkRouter always does (DeepSeek's own config spells them).
V3_DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                   routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                   v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                   first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096,
                   rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, rope_interleave=True,
                   attention_bias=False, topk_method="noaux_tc", scoring_func="sigmoid")
# DeepseekV2Config's defaults (transformers configuration_deepseek_v2.py); num_experts_per_tok has none
V2_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False, mlp_bias=False,
                   first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536, n_group=None, n_routed_experts=64,
                   n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64, routed_scaling_factor=1.0,
                   topk_group=None, topk_method="greedy", norm_topk_prob=False, v_head_dim=128,
                   num_experts_per_tok=None, moe_intermediate_size=1407, scoring_func="softmax",
                   rope_interleave=True)


def log(*args):
    print(*args, file=sys.stderr)


# ---------------------------------------------------------------- config

def resolve_config(c):
    """config.json dict -> the same with every key the forward pass reads (the class defaults filled in)."""
    mt = c.get("model_type")
    if mt not in ("deepseek_v3", "deepseek_v2"):
        raise ValueError("model_type %r is not deepseek_v2 or deepseek_v3" % mt)
    d = dict(V3_DEFAULTS if mt == "deepseek_v3" else V2_DEFAULTS)
    for k, v in c.items():
        if k == "q_lora_rank" or v is not None:  # q_lora_rank null: a single q_proj
            d[k] = v
    d["q_lora_rank"] = d["q_lora_rank"] or 0
    rs = c.get("rope_scaling") or c.get("rope_parameters")
    if rs and "rope_theta" in rs:
        d["rope_theta"] = rs["rope_theta"]
    d["rope"] = rs if rs and rs.get("rope_type", rs.get("type")) not in (None, "default") else None
    if d["rope"] and d["rope"].get("rope_type", d["rope"].get("type")) != "yarn":
        raise ValueError("rope_scaling other than yarn is not modelled here")
    if mt == "deepseek_v2":
        d["rope_interleave"] = True  # DeepseekV2's apply_rotary_emb: complex pairs, always
    if d["num_experts_per_tok"] is None:
        raise ValueError("num_experts_per_tok is required")
    if d["hidden_act"] != "silu" or d.get("mlp_bias") or d["attention_bias"]:
        raise ValueError("only silu, no biases")
    d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    return d


def read_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return resolve_config(json.load(f))


# ---------------------------------------------------------------- RoPE (yarn with mscale)

def yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_params(cfg):
    """-> (inv_freq float64 (rope/2,), cos/sin factor, softmax scale)."""
    d = cfg["qk_rope_head_dim"]
    base = float(cfg["rope_theta"])
    j = np.arange(0, d, 2, dtype=np.float64) / d
    inv = 1.0 / base ** j
    scale = cfg["qk_head_dim"] ** -0.5
    rs = cfg["rope"]
    if not rs:
        return inv, 1.0, scale
    factor = float(rs["factor"])
    orig = rs.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    af = rs.get("attention_factor")
    if af is None:
        af = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all \
            else yarn_mscale(factor)

    def corr_dim(rot):  # the pair index whose wavelength turns `rot` times over `orig` positions
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
    extra = 1.0 - ramp  # 1: keep the frequency, 0: divide it by the factor
    inv = inv / factor * (1 - extra) + inv * extra
    if mscale_all:
        m = yarn_mscale(factor, mscale_all)
        scale *= m * m
    return inv, float(af), scale


def rope(x, pos, inv, af, interleave):
    """x (..., T, d) at positions pos (T,): pairs (2j, 2j+1) or (j, j+d/2) turned by pos * inv[j], times af."""
    ang = torch.tensor(np.outer(np.asarray(pos, dtype=np.float64), inv), dtype=DT)  # (T, d/2)
    c, s = torch.cos(ang) * af, torch.sin(ang) * af
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat((a * c - b * s, a * s + b * c), dim=-1)


# ---------------------------------------------------------------- FP8

def fp8_e4m3_values():
    """float8_e4m3fn code -> value (float64; 0x7f and 0xff are NaN, no infinities)."""
    out = np.zeros(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 7
        if e == 15 and m == 7:
            out[code] = np.nan
        elif e == 0:
            out[code] = sign * m / 8.0 * 2.0 ** -6
        else:
            out[code] = sign * (1 + m / 8.0) * 2.0 ** (e - 7)
    return out


def fp8_block_dequant(codes, scale_inv, block=(128, 128)):
    """codes (R, C) uint8, scale_inv (ceil(R/br), ceil(C/bc)) -> float64 (R, C)."""
    r, c = codes.shape
    br, bc = block
    want = (-(-r // br), -(-c // bc))
    if tuple(scale_inv.shape) != want:
        raise ValueError("weight_scale_inv has shape %s, expected %s" % (tuple(scale_inv.shape), want))
    s = np.repeat(np.repeat(np.asarray(scale_inv, dtype=np.float64), br, axis=0), bc, axis=1)[:r, :c]
    return fp8_e4m3_values()[codes] * s


# ---------------------------------------------------------------- loading

def load_model(model_dir):
    cfg = read_config(model_dir)
    raw, dtypes = safetensors_io.read_model_dir(model_dir)[:2]
    block = tuple((cfg.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    w = {}
    for name, a in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if dtypes[name] == "F8_E4M3":
            a = fp8_block_dequant(a, raw[name + "_scale_inv"], block)
        w[name] = torch.tensor(np.asarray(a, dtype=np.float64), dtype=DT)
    if cfg["tie_word_embeddings"] and "lm_head.weight" not in w:
        w["lm_head.weight"] = w["model.embed_tokens.weight"]
    return {"cfg": cfg, "w": w, "rope": rope_params(cfg)}


# ---------------------------------------------------------------- forward

def rmsnorm(x, weight, eps):
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def mla_project(cfg, w, p, x, pos, rp):
    """x (T, dim) normed -> q_nope (H, T, dn), q_pe (H, T, dr) roped, latent (T, r) normed, k_pe (T, dr) roped."""
    H, dn, dr = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    T = x.shape[0]
    if cfg["q_lora_rank"]:
        q = rmsnorm(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], LATENT_NORM_EPS)
        q = q @ w[p + "q_b_proj.weight"].T
    else:
        q = x @ w[p + "q_proj.weight"].T
    q = q.view(T, H, dn + dr).transpose(0, 1)
    inv, af, _ = rp
    q_nope, q_pe = q[..., :dn], rope(q[..., dn:], pos, inv, af, cfg["rope_interleave"])
    ckv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
    r = cfg["kv_lora_rank"]
    latent = rmsnorm(ckv[:, :r], w[p + "kv_a_layernorm.weight"], LATENT_NORM_EPS)
    k_pe = rope(ckv[:, r:], pos, inv, af, cfg["rope_interleave"])
    return q_nope, q_pe, latent, k_pe


def mla(cfg, w, p, x, pos, rp):
    """Decompressed MLA over the whole sequence (causal): (T, dim) -> (T, dim)."""
    H, dn, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    T = x.shape[0]
    q_nope, q_pe, latent, k_pe = mla_project(cfg, w, p, x, pos, rp)
    kv = (latent @ w[p + "kv_b_proj.weight"].T).view(T, H, dn + dv).transpose(0, 1)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    scores = (q_nope @ k_nope.transpose(1, 2) + q_pe @ k_pe.T) * rp[2]  # (H, T, T)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # (H, T, dv)
    return out.transpose(0, 1).reshape(T, H * dv) @ w[p + "o_proj.weight"].T


def route(cfg, logits, bias=None):
    """One token's router logits (E,) -> (expert ids ascending, their weights)."""
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    logits = np.asarray(logits, dtype=np.float64)
    if cfg["scoring_func"] == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max())
        scores = e / e.sum()
    choice = scores + (np.asarray(bias, dtype=np.float64) if bias is not None else 0.0)
    method = cfg["topk_method"]
    if method in ("noaux_tc", "group_limited_greedy"):
        g, tg = cfg["n_group"], cfg["topk_group"]
        grouped = choice.reshape(g, E // g)
        if method == "noaux_tc":
            gs = np.sort(grouped, axis=1)[:, ::-1][:, :2].sum(axis=1)
        else:
            gs = grouped.max(axis=1)
        keep = sorted(range(g), key=lambda i: (-gs[i], i))[:tg]
        allowed = np.zeros(E, dtype=bool)
        for i in keep:
            allowed[i * (E // g):(i + 1) * (E // g)] = True
        choice = np.where(allowed, choice, -np.inf)
    ids = sorted(sorted(range(E), key=lambda i: (-choice[i], i))[:k])
    wts = scores[ids]
    if cfg["norm_topk_prob"] and cfg["scoring_func"] == "sigmoid":
        wts = wts / (wts.sum() + 1e-20)
    return ids, wts * cfg["routed_scaling_factor"]


def mlp(w, p, x):
    g = x @ w[p + "gate_proj.weight"].T
    return (g * torch.sigmoid(g) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def moe(cfg, w, p, x):
    out = torch.zeros_like(x)
    bias = w.get(p + "gate.e_score_correction_bias")
    logits = x @ w[p + "gate.weight"].T
    for t in range(x.shape[0]):
        ids, wts = route(cfg, logits[t].numpy(), None if bias is None else bias.numpy())
        for e, wt in zip(ids, wts):
            out[t] += float(wt) * mlp(w, "%sexperts.%d." % (p, e), x[t:t + 1])[0]
    if cfg["n_shared_experts"]:
        out += mlp(w, p + "shared_experts.", x)
    return out


def forward(model, ids, latent_taps=None):
    """ids -> float64 logits (T, vocab); the whole sequence, no cache."""
    cfg, w = model["cfg"], model["w"]
    eps = cfg["rms_norm_eps"]
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]
    pos = list(range(len(ids)))
    for i in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        h = h + mla(cfg, w, p + "self_attn.", rmsnorm(h, w[p + "input_layernorm.weight"], eps), pos, model["rope"])
        x = rmsnorm(h, w[p + "post_attention_layernorm.weight"], eps)
        h = h + (mlp(w, p + "mlp.", x) if i < cfg["first_k_dense_replace"] else moe(cfg, w, p + "mlp.", x))
    h = rmsnorm(h, w["model.norm.weight"], eps)
    return h @ w["lm_head.weight"].T


def argmax_lowest(row):
    m = row.max()
    best = int((row == m).nonzero()[0, 0])
    rest = row.clone()
    rest[best] = float("-inf")
    return best, float(m - rest.max())


def greedy(model, ids, n):
    seq, out, gap = list(ids), [], float("inf")
    for _ in range(n):
        tok, g = argmax_lowest(forward(model, seq)[-1])
        gap = min(gap, g)
        out.append(tok)
        seq.append(tok)
    return out, gap


# ---------------------------------------------------------------- the absorbed path (self-test)

def mla_absorbed_step(cfg, w, p, x_t, t, cache, rp):
    """One token at position t, written the other way: W_UK folded into q, W_UV after the latent sum,
    MQA over the cache of (latent, k_pe) rows (appended here). x_t (dim,) -> (dim,)."""
    H, dn, dv, r = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    q_nope, q_pe, latent, k_pe = mla_project(cfg, w, p, x_t[None, :], [t], rp)
    cache.append(torch.cat((latent[0], k_pe[0])))
    C = torch.stack(cache)  # (t+1, r + dr)
    wkv = w[p + "kv_b_proj.weight"].view(H, dn + dv, r)
    out = []
    for h in range(H):
        q_lat = wkv[h, :dn].T @ q_nope[h, 0]  # (r,)
        s = (C[:, :r] @ q_lat + C[:, r:] @ q_pe[h, 0]) * rp[2]
        pr = torch.exp(s - s.max())
        pr = pr / pr.sum()
        out.append(wkv[h, dn:] @ (pr @ C[:, :r]))
    return torch.cat(out) @ w[p + "o_proj.weight"].T


def forward_absorbed(model, ids):
    cfg, w = model["cfg"], model["w"]
    eps = cfg["rms_norm_eps"]
    caches = [[] for _ in range(cfg["num_hidden_layers"])]
    rows = []
    for t, tok in enumerate(ids):
        h = w["model.embed_tokens.weight"][tok].clone()
        for i in range(cfg["num_hidden_layers"]):
            p = "model.layers.%d." % i
            h = h + mla_absorbed_step(cfg, w, p + "self_attn.", rmsnorm(h, w[p + "input_layernorm.weight"], eps),
                                      t, caches[i], model["rope"])
            x = rmsnorm(h, w[p + "post_attention_layernorm.weight"], eps)[None, :]
            h = h + (mlp(w, p + "mlp.", x) if i < cfg["first_k_dense_replace"] else moe(cfg, w, p + "mlp.", x))[0]
        rows.append(rmsnorm(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T)
    return torch.stack(rows)


def self_test():
    import gen_deepseek
    ok = True

    def check(cond, what):
        nonlocal ok
        log(("ok   " if cond else "FAIL ") + what)
        ok = ok and cond

    with tempfile.TemporaryDirectory() as tmp:
        for shape in ("v3", "v2lite"):
            d = os.path.join(tmp, shape)
            gen_deepseek.main(["--out", d, "--shape", shape, "--seed", "3"])
            model = load_model(d)
            ids = [1, 7, 300, 42, 5, 99, 17]
            a = forward(model, ids)
            b = forward_absorbed(model, ids)
            err = float((a - b).abs().max() / a.abs().max())
            check(err < 1e-12, "%s: absorbed per-token MLA equals the decompressed batch (rel %.2g)" % (shape, err))
            check(float(a.std()) > 1.0, "%s: logits are not flat (std %.2f)" % (shape, float(a.std())))
        d = os.path.join(tmp, "fp8")
        gen_deepseek.main(["--out", d, "--shape", "v3", "--seed", "3", "--fp8"])
        fw, ew = load_model(d)["w"], load_model(os.path.join(tmp, "v3"))["w"]
        rel = max(float((fw[n] - ew[n]).norm() / ew[n].norm()) for n in ew if n.endswith("kv_b_proj.weight")
                  or n.endswith("down_proj.weight"))
        check(0 < rel < 0.05, "fp8 blocks: dequantized weights within e4m3's rounding (worst rel %.3f)" % rel)
    # the router: the V3 example the C test uses changes its choice with the bias
    cfg = dict(n_routed_experts=8, num_experts_per_tok=2, scoring_func="sigmoid", topk_method="noaux_tc",
               n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    logits = [2.0, 1.9, 0.0, -1.0, 1.0, 1.0, 1.0, 1.0]
    check(route(cfg, logits)[0] == [0, 1], "router: group 0 (2.0 + 1.9) wins without the bias")
    ids, wts = route(cfg, logits, [0, 0, 0, 0, 0.5, 0.4, 0, 0])
    check(ids == [4, 5] and abs(sum(wts) - 2.5) < 1e-12, "router: the bias moves the choice to group 1")
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


# ---------------------------------------------------------------- pieces for the C unit tests

def put(f, name, values):
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    f.write("%s %d %s\n" % (name, v.size, " ".join("%.17g" % x for x in v)))


def find_bias_flip(rng, cfg):
    """Random router logits and a bias for which the bias changes the choice."""
    E = cfg["n_routed_experts"]
    while True:
        logits = rng.standard_normal(E) * 2.0
        bias = rng.standard_normal(E) * 0.3 + 0.5  # positive biased scores, as trained biases leave them
        if route(cfg, logits)[0] != route(cfg, logits, bias)[0]:
            return logits, bias


def write_pieces(path):
    rng = np.random.default_rng(1234)
    with open(path, "w") as f:
        # routers: sigmoid + correction bias + group top-2 sums (V3's shape and a small one), V2's softmax
        cases = [
            ("r_v3", dict(n_routed_experts=256, num_experts_per_tok=8, scoring_func="sigmoid", topk_method="noaux_tc",
                          n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)),
            ("r_small", dict(n_routed_experts=8, num_experts_per_tok=2, scoring_func="sigmoid",
                             topk_method="noaux_tc", n_group=2, topk_group=1, norm_topk_prob=True,
                             routed_scaling_factor=2.5)),
            ("r_nonorm", dict(n_routed_experts=16, num_experts_per_tok=3, scoring_func="sigmoid",
                              topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=False,
                              routed_scaling_factor=1.5)),
            ("r_v2greedy", dict(n_routed_experts=64, num_experts_per_tok=6, scoring_func="softmax",
                                topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
                                routed_scaling_factor=1.0)),
            ("r_v2group", dict(n_routed_experts=160, num_experts_per_tok=6, scoring_func="softmax",
                               topk_method="group_limited_greedy", n_group=8, topk_group=3, norm_topk_prob=False,
                               routed_scaling_factor=16.0)),
        ]
        methods = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
        for name, c in cases:
            sig = c["scoring_func"] == "sigmoid"
            put(f, name + "_params", [c["n_routed_experts"], c["num_experts_per_tok"], int(sig),
                                      methods[c["topk_method"]], c["n_group"], c["topk_group"],
                                      int(c["norm_topk_prob"]), c["routed_scaling_factor"]])
            if sig:
                logits, bias = find_bias_flip(rng, c)
                put(f, name + "_logits", logits)
                put(f, name + "_bias", bias)
                ids0, w0 = route(c, logits)
                put(f, name + "_ids_nobias", ids0)
                put(f, name + "_w_nobias", w0)
                ids, w = route(c, logits, bias)
            else:
                logits = rng.standard_normal(c["n_routed_experts"]) * 2.0
                put(f, name + "_logits", logits)
                ids, w = route(c, logits)
            put(f, name + "_ids", ids)
            put(f, name + "_w", w)
        # YaRN: DeepSeek-V3's rope_scaling and DeepSeek-V2-Lite's (mscale 0.707 on both sides)
        for name, rs in (("y_v3", dict(rope_type="yarn", factor=40, original_max_position_embeddings=4096,
                                       beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
                         ("y_v2lite", dict(rope_type="yarn", factor=40, original_max_position_embeddings=4096,
                                           beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)),
                         ("y_nomsall", dict(rope_type="yarn", factor=8, original_max_position_embeddings=2048,
                                            beta_fast=32, beta_slow=1))):
            cfg = dict(qk_rope_head_dim=64, qk_head_dim=192, rope_theta=10000.0, rope=rs,
                       max_position_embeddings=163840)
            inv, af, scale = rope_params(cfg)
            put(f, name + "_params", [rs["factor"], rs["original_max_position_embeddings"], rs.get("mscale", 0),
                                      rs.get("mscale_all_dim", 0)])
            put(f, name + "_inv_freq", inv)
            put(f, name + "_attn_factor", [af])
            put(f, name + "_softmax_scale", [scale])
            for pos in (0, 4095, 4096, 100000):
                ang = pos * inv
                put(f, "%s_cos_%d" % (name, pos), np.cos(ang) * af)
                put(f, "%s_sin_%d" % (name, pos), np.sin(ang) * af)
        # FP8: every code, and a 200 x 300 weight in 128 x 128 blocks (2 x 3 scales, the edge ones partial)
        put(f, "fp8_table", fp8_e4m3_values())
        codes = rng.integers(0, 256, size=(200, 300)).astype(np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaNs in the weight
        scale_inv = rng.uniform(0.5, 2.0, size=(2, 3)) * 2.0 ** rng.integers(-8, 8, size=(2, 3))
        put(f, "fp8_codes", codes)
        put(f, "fp8_scale_inv", scale_inv.astype(np.float32))
        put(f, "fp8_out", fp8_block_dequant(codes, scale_inv.astype(np.float32)))
        # One MLA layer, two shapes: q compressed + yarn + interleaved pairs; one q_proj + rotate-half, no scaling
        for name, c in (("mla_a", dict(hidden_size=32, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
                                       qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, rope_interleave=True,
                                       rope_theta=10000.0, max_position_embeddings=64,
                                       rope=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4,
                                                 beta_fast=8, beta_slow=1, mscale=0.9, mscale_all_dim=0.8))),
                        ("mla_b", dict(hidden_size=24, num_attention_heads=3, q_lora_rank=0, kv_lora_rank=20,
                                       qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=8, rope_interleave=False,
                                       rope_theta=500.0, max_position_embeddings=64, rope=None))):
            c["qk_head_dim"] = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
            D, H, dn, dr, dv, r = (c[k] for k in ("hidden_size", "num_attention_heads", "qk_nope_head_dim",
                                                   "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
            ql = c["q_lora_rank"]
            shapes = {"kv_a_proj_with_mqa.weight": (r + dr, D), "kv_a_layernorm.weight": (r,),
                      "kv_b_proj.weight": (H * (dn + dv), r), "o_proj.weight": (D, H * dv)}
            if ql:
                shapes.update({"q_a_proj.weight": (ql, D), "q_a_layernorm.weight": (ql,),
                               "q_b_proj.weight": (H * (dn + dr), ql)})
            else:
                shapes["q_proj.weight"] = (H * (dn + dr), D)
            w = {}
            for k in sorted(shapes):
                s = shapes[k]
                a = 1.0 + 0.1 * rng.standard_normal(s) if k.endswith("layernorm.weight") \
                    else rng.standard_normal(s) * (1.5 / math.sqrt(s[-1]))
                a = a.astype(np.float32)
                w[k] = torch.tensor(a.astype(np.float64), dtype=DT)
                put(f, "%s_%s" % (name, k.replace(".weight", "")), a)
            T = 7
            x = rng.standard_normal((T, D)).astype(np.float32)
            rp = rope_params(c)
            put(f, name + "_dims", [D, H, ql, r, dn, dr, dv, int(c["rope_interleave"]), T])
            put(f, name + "_inv_freq", rp[0])
            put(f, name + "_rope", [rp[1], rp[2]])
            put(f, name + "_x", x)
            xt = torch.tensor(x.astype(np.float64), dtype=DT)
            put(f, name + "_out", mla(c, w, "", xt, list(range(T)), rp))
            _, _, latent, k_pe = mla_project(c, w, "", xt, list(range(T)), rp)
            put(f, name + "_cache", torch.cat((latent, k_pe), dim=1))


def parse_ids(s):
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (config.json + safetensors)")
    p.add_argument("--ids", type=parse_ids, help="prompt token ids, e.g. 1,403,407")
    p.add_argument("--logits-out", help="write float32 LE logits (rows, vocab) of the --ids positions")
    p.add_argument("--positions-from", type=int, default=0, help="--logits-out holds only positions K..n_ids-1")
    p.add_argument("--greedy", type=int, default=0, help="greedy-generate N ids, printed on stdout")
    p.add_argument("--pieces", help="write the C unit tests' inputs and expected outputs to this file")
    p.add_argument("--self-test", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.self_test:
        return self_test()
    if a.pieces:
        write_pieces(a.pieces)
        log("wrote %s" % a.pieces)
        return 0
    if not a.model or not a.ids:
        p.error("--model and --ids are required")
    t0 = time.time()
    model = load_model(a.model)
    if a.logits_out:
        logits = forward(model, a.ids)[a.positions_from:]
        np.ascontiguousarray(logits.numpy(), dtype="<f4").tofile(a.logits_out)
        log("wrote %s: %d x %d float32 logits" % (a.logits_out, logits.shape[0], logits.shape[1]))
    if a.greedy > 0:
        gen, gap = greedy(model, a.ids, a.greedy)
        print(",".join(str(t) for t in gen))
        sys.stdout.flush()
        log("greedy: %d ids, smallest top1-top2 gap %.4g" % (len(gen), gap))
    log("done in %.2f s" % (time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())

/* DeepSeek-V3 and DeepSeek-V2 (deepseek_v3, deepseek_v2): multi-head latent
 * attention (worker/engine/attn_mla.c; decompressed with opt.mla_disable,
 * attn_mla_mha.c) and DeepSeekMoE (the MoE block with
 * worker/moe_ds.c's router and ungated shared experts), dense MLPs below
 * first_k_dense_replace. A layer is
 *   x += mla(norm(x));  x += ffn(norm(x)) */
#include "common/util.h"
#include "worker/engine/model_impl.h"

#define LIN LOOM_TN_LINEAR
#define TEN LOOM_TN_TENSOR

static const loom_tensor_name_t k_names[] = {
    {LOOM_TN_EMBED, "model.embed_tokens.weight", TEN, LOOM_TN_TOP},
    {LOOM_TN_FINAL_NORM, "model.norm.weight", TEN, LOOM_TN_TOP},
    {LOOM_TN_LM_HEAD, "lm_head", LIN, LOOM_TN_TOP},
    {LOOM_TN_ATTN_NORM, "input_layernorm.weight", TEN, 0},
    {LOOM_TN_FFN_NORM, "post_attention_layernorm.weight", TEN, 0},
    {LOOM_TN_Q, "self_attn.q_proj", LIN, LOOM_TN_Q_FULL},
    {LOOM_TN_Q_A, "self_attn.q_a_proj", LIN, LOOM_TN_Q_LORA},
    {LOOM_TN_Q_A_NORM, "self_attn.q_a_layernorm.weight", TEN, LOOM_TN_Q_LORA},
    /* q_b_proj, kv_b_proj and o_proj are rebuilt into the per-head matrices at load (attn_mla.c): read
     * as float tensors, so `loom quantize` leaves them float */
    {LOOM_TN_Q_B, "self_attn.q_b_proj.weight", TEN, LOOM_TN_Q_LORA},
    {LOOM_TN_KV_A, "self_attn.kv_a_proj_with_mqa", LIN, 0},
    {LOOM_TN_KV_A_NORM, "self_attn.kv_a_layernorm.weight", TEN, 0},
    {LOOM_TN_KV_B, "self_attn.kv_b_proj.weight", TEN, 0},
    {LOOM_TN_O, "self_attn.o_proj.weight", TEN, 0},
    {LOOM_TN_GATE, "mlp.gate_proj", LIN, LOOM_TN_DENSE},
    {LOOM_TN_UP, "mlp.up_proj", LIN, LOOM_TN_DENSE},
    {LOOM_TN_DOWN, "mlp.down_proj", LIN, LOOM_TN_DENSE},
    {LOOM_TN_ROUTER, "mlp.gate.weight", TEN, LOOM_TN_MOE},
    {LOOM_TN_ROUTER_CORR, "mlp.gate.e_score_correction_bias", TEN, LOOM_TN_MOE | LOOM_TN_NOAUX},
    {LOOM_TN_EXPERT_GATE, "mlp.experts.%d.gate_proj", LIN, LOOM_TN_MOE},
    {LOOM_TN_EXPERT_UP, "mlp.experts.%d.up_proj", LIN, LOOM_TN_MOE},
    {LOOM_TN_EXPERT_DOWN, "mlp.experts.%d.down_proj", LIN, LOOM_TN_MOE},
    {LOOM_TN_SHARED_GATE, "mlp.shared_experts.gate_proj", LIN, LOOM_TN_MOE | LOOM_TN_SHARED},
    {LOOM_TN_SHARED_UP, "mlp.shared_experts.up_proj", LIN, LOOM_TN_MOE | LOOM_TN_SHARED},
    {LOOM_TN_SHARED_DOWN, "mlp.shared_experts.down_proj", LIN, LOOM_TN_MOE | LOOM_TN_SHARED},
};

static const loom_arch_type_t k_types[] = {
    /* the latent rows are kv_lora_rank + rope wide (576 as released): attention heads above 256, and
     * above 768 for a config with a larger latent */
    {"deepseek_v3", LOOM_CAP_MOE, LOOM_CAP_ATTN_WIDE | LOOM_CAP_ATTN_HUGE},
    {"deepseek_v2", LOOM_CAP_MOE, LOOM_CAP_ATTN_WIDE | LOOM_CAP_ATTN_HUGE},
    {NULL, 0, 0},
};

static uint32_t deepseek_needs(const loom_model_config_t *c, const loom_shard_spec_t *spec) {
    return loom_arch_needs_common(c, spec);
}

static loom_status_t deepseek_load_layer(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    const loom_model_config_t *c = &L->m->cfg;
    LOOM_CHECK(loom_blk_prenorm_load_norms(L, gl, ly, err));
    LOOM_CHECK(L->m->opt.mla_disable ? loom_blk_attn_mla_mha_load(L, gl, ly, err) : loom_blk_attn_mla_load(L, gl, ly, err));
    if (loom_model_config_layer_moe(c, gl)) return loom_blk_moe_load(L, gl, &ly->ffn, err);
    return loom_blk_ffn_load(L, gl, &ly->ffn, err);
}

static loom_status_t deepseek_layer(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    return loom_blk_prenorm_layer(m, so, l, m->opt.mla_disable ? loom_blk_attn_mla_mha : loom_blk_attn_mla, err);
}

const loom_arch_t loom_arch_deepseek = {
    .name = "deepseek",
    .types = k_types,
    .names = k_names,
    .n_names = (int)LOOM_ARRAY_LEN(k_names),
    .needs = deepseek_needs,
    .load_layer = deepseek_load_layer,
    .layer = deepseek_layer,
};

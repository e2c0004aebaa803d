/* The Llama family and those that share its layer: Llama, Mistral, Qwen2,
 * Qwen3 (q/k norms), Phi-3 (fused q/k/v and gate/up), and the Mixture-of-
 * Experts families on the same attention (Mixtral, Qwen3-MoE, Qwen2-MoE's
 * shared expert). A layer is
 *   x += attn(norm(x));  x += ffn(norm(x))
 * with the dense MLP or the MoE block as the layer's config says. */
#include "common/util.h"
#include "worker/engine/model_impl.h"

#define LIN LOOM_TN_LINEAR
#define TEN LOOM_TN_TENSOR

static const loom_tensor_name_t k_names[] = {
    {LOOM_TN_EMBED, "model.embed_tokens.weight", TEN, LOOM_TN_TOP},
    {LOOM_TN_FINAL_NORM, "model.norm.weight", TEN, LOOM_TN_TOP},
    /* a tied head reads the embedding; a stored lm_head is then not read
     * (as in Transformers), except one `loom quantize` wrote */
    {LOOM_TN_LM_HEAD, "lm_head", LIN, LOOM_TN_TOP},
    {LOOM_TN_ATTN_NORM, "input_layernorm.weight", TEN, 0},
    {LOOM_TN_FFN_NORM, "post_attention_layernorm.weight", TEN, 0},
    {LOOM_TN_Q, "self_attn.q_proj", LIN, LOOM_TN_SPLIT},
    {LOOM_TN_K, "self_attn.k_proj", LIN, LOOM_TN_SPLIT},
    {LOOM_TN_V, "self_attn.v_proj", LIN, LOOM_TN_SPLIT},
    {LOOM_TN_QKV, "self_attn.qkv_proj", LIN, LOOM_TN_FUSED},
    {LOOM_TN_O, "self_attn.o_proj", LIN, 0},
    {LOOM_TN_Q_BIAS, "self_attn.q_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_K_BIAS, "self_attn.k_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_V_BIAS, "self_attn.v_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_Q_NORM, "self_attn.q_norm.weight", TEN, LOOM_TN_QK_NORM},
    {LOOM_TN_K_NORM, "self_attn.k_norm.weight", TEN, LOOM_TN_QK_NORM},
    {LOOM_TN_GATE, "mlp.gate_proj", LIN, LOOM_TN_DENSE | LOOM_TN_SPLIT},
    {LOOM_TN_UP, "mlp.up_proj", LIN, LOOM_TN_DENSE | LOOM_TN_SPLIT},
    {LOOM_TN_GATE_UP, "mlp.gate_up_proj", LIN, LOOM_TN_DENSE | LOOM_TN_FUSED},
    {LOOM_TN_DOWN, "mlp.down_proj", LIN, LOOM_TN_DENSE},
    /* Mixtral's names */
    {LOOM_TN_ROUTER, "block_sparse_moe.gate.weight", TEN, LOOM_TN_MOE | LOOM_TN_MIXTRAL},
    {LOOM_TN_EXPERT_GATE, "block_sparse_moe.experts.%d.w1", LIN, LOOM_TN_MOE | LOOM_TN_MIXTRAL},
    {LOOM_TN_EXPERT_UP, "block_sparse_moe.experts.%d.w3", LIN, LOOM_TN_MOE | LOOM_TN_MIXTRAL},
    {LOOM_TN_EXPERT_DOWN, "block_sparse_moe.experts.%d.w2", LIN, LOOM_TN_MOE | LOOM_TN_MIXTRAL},
    /* Qwen3-MoE's and Qwen2-MoE's */
    {LOOM_TN_ROUTER, "mlp.gate.weight", TEN, LOOM_TN_MOE | LOOM_TN_QWEN_MOE},
    {LOOM_TN_EXPERT_GATE, "mlp.experts.%d.gate_proj", LIN, LOOM_TN_MOE | LOOM_TN_QWEN_MOE},
    {LOOM_TN_EXPERT_UP, "mlp.experts.%d.up_proj", LIN, LOOM_TN_MOE | LOOM_TN_QWEN_MOE},
    {LOOM_TN_EXPERT_DOWN, "mlp.experts.%d.down_proj", LIN, LOOM_TN_MOE | LOOM_TN_QWEN_MOE},
    {LOOM_TN_SHARED_GATE_W, "mlp.shared_expert_gate.weight", TEN, LOOM_TN_MOE | LOOM_TN_SHARED},
    {LOOM_TN_SHARED_GATE, "mlp.shared_expert.gate_proj", LIN, LOOM_TN_MOE | LOOM_TN_SHARED},
    {LOOM_TN_SHARED_UP, "mlp.shared_expert.up_proj", LIN, LOOM_TN_MOE | LOOM_TN_SHARED},
    {LOOM_TN_SHARED_DOWN, "mlp.shared_expert.down_proj", LIN, LOOM_TN_MOE | LOOM_TN_SHARED},
};

static const loom_arch_type_t k_types[] = {
    {"llama", 0, LOOM_CAP_ACT},
    {"mistral", 0, LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ACT},
    {"qwen2", 0, LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ACT},
    {"qwen3", 0, LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ACT},
    {"phi3", 0, LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ACT},
    {"mixtral", LOOM_CAP_MOE, LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ACT},
    {"qwen3_moe", LOOM_CAP_MOE, LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ACT},
    {"qwen2_moe", LOOM_CAP_MOE, LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ACT},
    {NULL, 0, 0},
};

static uint32_t llama_needs(const loom_model_config_t *c, const loom_shard_spec_t *spec) {
    return loom_arch_needs_common(c, spec);
}

static loom_status_t llama_load_layer(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    LOOM_CHECK(loom_blk_prenorm_load_norms(L, gl, ly, err));
    LOOM_CHECK(loom_blk_attn_load(L, gl, ly, err));
    if (loom_model_config_layer_moe(&L->m->cfg, gl)) return loom_blk_moe_load(L, gl, &ly->ffn, err);
    return loom_blk_ffn_load(L, gl, &ly->ffn, err);
}

static loom_status_t llama_layer(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    return loom_blk_prenorm_layer(m, so, l, loom_blk_attn, err);
}

const loom_arch_t loom_arch_llama = {
    .name = "llama",
    .types = k_types,
    .names = k_names,
    .n_names = (int)LOOM_ARRAY_LEN(k_names),
    .needs = llama_needs,
    .load_layer = llama_load_layer,
    .layer = llama_layer,
};

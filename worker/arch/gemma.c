/* Gemma 2 and Gemma 3 text: Llama's attention and dense MLP with (1+w)
 * RMSNorms around both blocks -- a norm before and after each -- and
 * embeddings scaled by sqrt(hidden) (config), Gemma 3's q/k norms and
 * sliding layers with their own RoPE base, Gemma 2's attention soft cap
 * (the attention block reads it from the config) and final soft cap (the
 * head hook below). A layer is
 *   x += post_attn_norm(attn(norm(x)));  x += post_ffn_norm(ffn(pre_ffn_norm(x))) */
#include "common/util.h"
#include "worker/engine/model_impl.h"

#define LIN LOOM_TN_LINEAR
#define TEN LOOM_TN_TENSOR

static const loom_tensor_name_t k_names[] = {
    {LOOM_TN_EMBED, "model.embed_tokens.weight", TEN, LOOM_TN_TOP},
    {LOOM_TN_FINAL_NORM, "model.norm.weight", TEN, LOOM_TN_TOP},
    {LOOM_TN_LM_HEAD, "lm_head", LIN, LOOM_TN_TOP},
    {LOOM_TN_ATTN_NORM, "input_layernorm.weight", TEN, 0},
    {LOOM_TN_POST_ATTN_NORM, "post_attention_layernorm.weight", TEN, 0},
    {LOOM_TN_FFN_NORM, "pre_feedforward_layernorm.weight", TEN, 0},
    {LOOM_TN_POST_FFN_NORM, "post_feedforward_layernorm.weight", TEN, 0},
    {LOOM_TN_Q, "self_attn.q_proj", LIN, LOOM_TN_SPLIT},
    {LOOM_TN_K, "self_attn.k_proj", LIN, LOOM_TN_SPLIT},
    {LOOM_TN_V, "self_attn.v_proj", LIN, LOOM_TN_SPLIT},
    {LOOM_TN_O, "self_attn.o_proj", LIN, 0},
    {LOOM_TN_Q_BIAS, "self_attn.q_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_K_BIAS, "self_attn.k_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_V_BIAS, "self_attn.v_proj.bias", TEN, LOOM_TN_BIAS},
    {LOOM_TN_Q_NORM, "self_attn.q_norm.weight", TEN, LOOM_TN_QK_NORM},
    {LOOM_TN_K_NORM, "self_attn.k_norm.weight", TEN, LOOM_TN_QK_NORM},
    {LOOM_TN_GATE, "mlp.gate_proj", LIN, LOOM_TN_DENSE | LOOM_TN_SPLIT},
    {LOOM_TN_UP, "mlp.up_proj", LIN, LOOM_TN_DENSE | LOOM_TN_SPLIT},
    {LOOM_TN_DOWN, "mlp.down_proj", LIN, LOOM_TN_DENSE},
};

static const loom_arch_type_t k_types[] = {
    {"gemma2", LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ATTN_SOFTCAP | LOOM_CAP_LOGIT_SOFTCAP | LOOM_CAP_ACT, 0},
    {"gemma3_text", LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ACT, 0},
    {NULL, 0, 0},
};

static uint32_t gemma_needs(const loom_model_config_t *c, const loom_shard_spec_t *spec) {
    return loom_arch_needs_common(c, spec);
}

static loom_status_t gemma_load_layer(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    const int dim = L->m->cfg.dim;
    char name[256];
#define TNAME(role) loom_load_name(L, gl, role, -1, name, sizeof name)
    LOOM_CHECK(loom_load_upload_norm(L, TNAME(LOOM_TN_ATTN_NORM), dim, &ly->attn_norm, err));
    /* post_attention_layernorm normalises the attention output; the MLP has its own pair */
    LOOM_CHECK(loom_load_upload_norm(L, TNAME(LOOM_TN_POST_ATTN_NORM), dim, &ly->post_attn_norm, err));
    LOOM_CHECK(loom_load_upload_norm(L, TNAME(LOOM_TN_FFN_NORM), dim, &ly->ffn_norm, err));
    LOOM_CHECK(loom_load_upload_norm(L, TNAME(LOOM_TN_POST_FFN_NORM), dim, &ly->post_ffn_norm, err));
#undef TNAME
    LOOM_CHECK(loom_blk_attn_load(L, gl, ly, err));
    return loom_blk_ffn_load(L, gl, &ly->ffn, err);
}

static loom_status_t gemma_layer(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    const loom_layer_t *ly = &m->layers[l];
    const int n = so->n, dim = m->cfg.dim;
    const float eps = m->cfg.norm_eps;
    LOOM_CHECK(loom_blk_attn(m, so, l, err));
    loom_op_rmsnorm(m->be, m->xb2, m->xb2, ly->post_attn_norm, n, dim, eps);
    loom_op_add_rmsnorm(m->be, m->x, m->xb2, m->xb, ly->ffn_norm, n, dim, eps);
    LOOM_CHECK(loom_blk_ffn(m, so, l, err));
    loom_op_rmsnorm(m->be, m->xb2, m->xb2, ly->post_ffn_norm, n, dim, eps);
    loom_blk_ffn_residual(m, so, l);
    return LOOM_OK;
}

/* Gemma 2's final_logit_softcapping on the first n_rows rows of logits:
 * element-wise, so each TP rank caps its own slice of the vocabulary, and
 * everything downstream (logprobs, logit processors, grammar masks,
 * sampling) reads the capped values. */
static void gemma_head(loom_model_t *m, int n_rows) {
    if (m->cfg.final_softcap > 0)
        loom_op_softcap(m->be, m->logits, (int64_t)n_rows * m->dims.vocab, m->cfg.final_softcap);
}

const loom_arch_t loom_arch_gemma = {
    .name = "gemma",
    .types = k_types,
    .names = k_names,
    .n_names = (int)LOOM_ARRAY_LEN(k_names),
    .needs = gemma_needs,
    .load_layer = gemma_load_layer,
    .layer = gemma_layer,
    .head = gemma_head,
};

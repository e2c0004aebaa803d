/* Mixture-of-Experts blocks (Mixtral, Qwen3-MoE, Qwen2-MoE's shared
 * expert; GPT-OSS's biases and clamped SwiGLU): which experts and rows a
 * TP rank holds, the Mixtral / Qwen layout's loader, the backend's expert
 * tables for device-routed decode steps, and the block's run. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "worker/engine/model_impl.h"
#include "worker/moe_ds.h"

/* Which experts this rank holds and which slice of their intermediate
 * rows: all of them sliced like a dense MLP (plain TP), or whole experts
 * {J : J*tp/E == rank} (expert parallelism), logged. */
loom_status_t loom_blk_moe_split(loom_model_t *m, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_spec_t *sp = &m->spec;
    int any = 0;
    for (int l = sp->layer_begin; l < sp->layer_end; l++) any |= loom_model_config_layer_moe(c, l);
    if (!any) return LOOM_OK;
    int tp = sp->tp_size > 0 ? sp->tp_size : 1, E = c->n_experts;
    m->expert_begin = 0;
    m->expert_end = E;
    m->moe_hb = 0;
    m->moe_hn = c->moe_hidden_dim;
    if (c->moe_shared_hidden) {
        if (c->moe_shared_hidden < tp)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "shared_expert_intermediate_size %d is smaller than %d TP ranks", c->moe_shared_hidden,
                                tp);
        loom_split_range(c->moe_shared_hidden, tp, sp->tp_rank, &m->shared_hb, &m->shared_hn);
        LOOM_CHECK(loom_load_align_split(c, sp, &m->opt, c->moe_shared_hidden, &m->shared_hb, &m->shared_hn, err));
    }
    if (m->opt.expert_parallel && tp > 1) {
        if (E % tp)
            return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                                "expert parallelism: num_experts %d is not divisible by the %d tensor-parallel ranks "
                                "of the stage",
                                E, tp);
        m->expert_begin = sp->tp_rank * (E / tp);
        m->expert_end = m->expert_begin + E / tp;
        LOOM_INFO("expert parallel: tp rank %d/%d holds experts [%d, %d) of %d", sp->tp_rank, tp, m->expert_begin,
                  m->expert_end, E);
        return LOOM_OK;
    }
    if (c->moe_hidden_dim < tp)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "moe_intermediate_size %d is smaller than %d TP ranks",
                            c->moe_hidden_dim, tp);
    loom_split_range(c->moe_hidden_dim, tp, sp->tp_rank, &m->moe_hb, &m->moe_hn);
    LOOM_CHECK(loom_load_align_split(c, sp, &m->opt, c->moe_hidden_dim, &m->moe_hb, &m->moe_hn, err));
    LOOM_INFO("experts: tp rank %d/%d holds all %d experts, intermediate rows [%d, %d) of %d", sp->tp_rank, tp, E,
              m->moe_hb, m->moe_hb + m->moe_hn, c->moe_hidden_dim);
    return LOOM_OK;
}

/* A Mixture-of-Experts block: the router whole, and each held expert's
 * gate / up rows and down columns [moe_hb, moe_hb+moe_hn) (all of them under
 * expert parallelism), through loom_load_linear as a dense MLP's are, so
 * quantization on load and stored quantized experts work the same way. */
loom_status_t loom_blk_moe_load(loom_loader_t *L, int gl, loom_ffn_t *f, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const int E = c->n_experts, dim = c->dim, mx = c->moe_mixtral_names;
    const char *blk = mx ? "block_sparse_moe" : "mlp";
    char name[256], pg[256], pu[256], what[256];
    f->moe = 1;
    loom_load_name(L, gl, LOOM_TN_ROUTER, -1, name, sizeof name);
    float *h = loom_load_staging(L, (size_t)E * dim);
    if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading %s", name);
    LOOM_CHECK(loom_load_read_block(L, name, E, dim, 0, E, 0, dim, h, err));
    LOOM_CHECK(loom_load_upload_weight(L, &f->router, E, dim, name, err));
    f->e13 = loom_xcalloc((size_t)E, sizeof *f->e13);
    f->e2 = loom_xcalloc((size_t)E, sizeof *f->e2);
    if (c->deepseek && c->topk_method == LOOM_DS_TOPK_NOAUX_TC) { /* the choice's bias, kept on the host */
        loom_load_name(L, gl, LOOM_TN_ROUTER_CORR, -1, name, sizeof name);
        f->ds_bias = loom_xmalloc((size_t)E * sizeof *f->ds_bias);
        LOOM_CHECK(loom_load_read_slice(L, name, E, 0, E, f->ds_bias, err));
    }
    if (c->moe_shared_hidden) { /* DeepSeek's shared experts are ungated */
        if (!c->deepseek) {
            loom_load_name(L, gl, LOOM_TN_SHARED_GATE_W, -1, name, sizeof name);
            LOOM_CHECK(loom_load_read_block(L, name, 1, dim, 0, 1, 0, dim, h, err));
            LOOM_CHECK(loom_load_upload_weight(L, &f->sgate, 1, dim, name, err));
        }
        loom_load_name(L, gl, LOOM_TN_SHARED_GATE, -1, pg, sizeof pg);
        loom_load_name(L, gl, LOOM_TN_SHARED_UP, -1, pu, sizeof pu);
        loom_lin_part_t gu[2] = {{pg, c->moe_shared_hidden, m->shared_hb, m->shared_hn},
                                 {pu, c->moe_shared_hidden, m->shared_hb, m->shared_hn}};
        snprintf(what, sizeof what, "model.layers.%d.mlp.shared_expert.gate_up", gl);
        LOOM_CHECK(loom_load_linear(L, &f->s13, what, gu, 2, dim, 0, dim, err));
        loom_load_name(L, gl, LOOM_TN_SHARED_DOWN, -1, pg, sizeof pg);
        loom_lin_part_t dn = {pg, dim, 0, dim};
        LOOM_CHECK(loom_load_linear(L, &f->s2, pg, &dn, 1, c->moe_shared_hidden, m->shared_hb, m->shared_hn, err));
    }
    for (int j = m->expert_begin; j < m->expert_end; j++) {
        loom_load_name(L, gl, LOOM_TN_EXPERT_GATE, j, pg, sizeof pg);
        loom_load_name(L, gl, LOOM_TN_EXPERT_UP, j, pu, sizeof pu);
        loom_lin_part_t gu[2] = {{pg, c->moe_hidden_dim, m->moe_hb, m->moe_hn},
                                 {pu, c->moe_hidden_dim, m->moe_hb, m->moe_hn}};
        snprintf(what, sizeof what, "model.layers.%d.%s.experts.%d.%s", gl, blk, j, mx ? "w1+w3" : "gate_up");
        LOOM_CHECK(loom_load_linear(L, &f->e13[j], what, gu, 2, dim, 0, dim, err));
        loom_load_name(L, gl, LOOM_TN_EXPERT_DOWN, j, pg, sizeof pg);
        loom_lin_part_t dn = {pg, dim, 0, dim};
        LOOM_CHECK(loom_load_linear(L, &f->e2[j], pg, &dn, 1, c->moe_hidden_dim, m->moe_hb, m->moe_hn, err));
        m->expert_bytes += loom_weight_bytes(&f->e13[j]) + loom_weight_bytes(&f->e2[j]);
    }
    return LOOM_OK;
}

/* DeepSeekMoE's router for the backend (loom_op_moe_route_ds), f's bias on the device. */
static loom_moe_ds_args_t ds_args(const loom_model_config_t *c, const loom_ffn_t *f) {
    const loom_moe_ds_route_t r = loom_moe_ds_route_of(c);
    return (loom_moe_ds_args_t){.n_experts = r.n_experts, .top_k = r.top_k, .sigmoid = r.sigmoid,
                                .method = (int)r.method, .n_group = r.n_group, .topk_group = r.topk_group,
                                .norm_topk_prob = r.norm_topk_prob, .routed_scaling_factor = r.routed_scaling_factor,
                                .bias = f->d_ds_bias};
}

/* The backend's tables of loom_op_moe_gemv for every MoE layer whose held
 * experts it can run per (token, choice) pair (loom_backend_moe_device: the
 * CUDA backend up to 4 tokens, float experts; the CPU backend 1 token, where
 * a pair reads what its group would), so those decode steps route, run the
 * experts and combine without the host. Not Qwen2-MoE's layers (their
 * shared expert's gate is applied on the host); GPT-OSS's (expert biases,
 * the clamped SwiGLU) only where the backend adds biases per pair
 * (loom_backend_moe_add_bias_supported: CUDA); DeepSeek's only where the
 * backend routes them (loom_backend_moe_route_ds_supported: CUDA), its
 * shared experts then added ungated on the device. */
loom_status_t loom_blk_moe_tables(loom_model_t *m, loom_err_t *err) {
    const int E = m->cfg.n_experts, K = m->cfg.n_experts_per_tok;
    int n_moe = 0, n_dev = 0, max_n = 1 << 30;
    for (int l = 0; l < m->dims.n_layers; l++) {
        loom_ffn_t *f = &m->layers[l].ffn;
        if (!f->moe) continue;
        n_moe++;
        const loom_moe_ds_args_t ds = ds_args(&m->cfg, f);
        if ((m->cfg.moe_shared_hidden && !m->cfg.deepseek) ||
            (m->cfg.deepseek && !loom_backend_moe_route_ds_supported(m->be, &ds)) ||
            m->expert_end <= m->expert_begin || ((f->b13 || f->b2) && !loom_backend_moe_add_bias_supported(m->be)))
            continue;
        int n13 = loom_backend_moe_device(m->be, f->e13, E, K),
            n2 = loom_backend_moe_device(m->be, f->e2, E, K);
        int dn = LOOM_MIN(n13, n2);
        if (dn <= 0) continue;
        if (f->ds_bias && !f->d_ds_bias) {
            f->d_ds_bias = loom_backend_alloc(m->be, (size_t)E * sizeof(float));
            if (!f->d_ds_bias) return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for the router bias");
            loom_backend_upload(m->be, f->d_ds_bias, f->ds_bias, (size_t)E * sizeof(float));
        }
        f->t13 = loom_backend_moe_table(m->be, f->e13, E);
        f->t2 = loom_backend_moe_table(m->be, f->e2, E);
        if (!f->t13 || !f->t2)
            return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for the expert tables");
        f->dev_n = dn;
        max_n = LOOM_MIN(max_n, dn);
        n_dev++;
    }
    m->moe_device_n = n_moe > 0 && n_dev == n_moe ? max_n : 0;
    if (n_dev > 0)
        LOOM_INFO("Mixture of Experts: decode steps of up to %d token(s) route and run the experts "
                  "on the %s device "
                  "(%d of %d MoE layers)",
                  max_n, loom_backend_name(m->be), n_dev, n_moe);
    return LOOM_OK;
}

/* A Mixture-of-Experts block: xb -> xb2, all-reduced. Every rank routes
 * every token (the router is replicated). Decode steps on a backend with
 * the device ops (loom_backend_moe_device) route, run the chosen experts (a
 * batched expert GEMV for gate/up and for down) and combine on the device.
 * Otherwise the router's logits come to the host (n x E floats), which
 * routes and groups the (token, choice) pairs by expert; the rows stay on
 * the device: they are gathered grouped, each held expert's group runs
 * through its MLP as one matmul (a GEMM, or GEMVs for a decode step's single
 * rows), and each token's outputs are summed, weighted, in ascending expert
 * order. */
loom_status_t loom_blk_moe(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    loom_backend_t *be = m->be;
    const loom_ffn_t *f = &m->layers[l].ffn;
    const loom_blk_adapters_t *ad = so->adapters;
    const int n = so->n;
    const loom_model_config_t *c = &m->cfg;
    const int E = c->n_experts, K = c->n_experts_per_tok, dim = c->dim, H = m->moe_hn;
    const loom_act_t act = (loom_act_t)c->hidden_act;
    const loom_blk_linear_t router = {.w = &f->router, .bias = f->rbias, .proj = LOOM_PROJ_ROUTER, .layer = l,
                                      .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, ad, &router, m->rl, m->xb, n, err));
    if (f->t13 && n <= f->dev_n) {
        if (c->deepseek) {
            const loom_moe_ds_args_t r = ds_args(c, f);
            loom_op_moe_route_ds(be, m->rl, n, &r, m->d_sel, m->d_w);
        } else {
            loom_op_moe_route(be, m->rl, n, E, K, c->norm_topk_prob, m->d_sel, m->d_w);
        }
        const loom_blk_linear_t e13 = {.w = &f->e13[m->expert_begin], .proj = LOOM_PROJ_EXPERT_GATE_UP,
                                       .layer = l, .expert = -1};
        const loom_blk_linear_t e2 = {.w = &f->e2[m->expert_begin], .proj = LOOM_PROJ_EXPERT_DOWN, .layer = l,
                                      .expert = -1};
        loom_blk_linear_experts(m, ad, &e13, m->mgu, m->xb, K, m->d_sel, n * K, f->t13);
        if (f->b13) loom_op_moe_add_bias(be, m->mgu, m->d_sel, n * K, f->b13, 2 * H);
        if (f->swiglu_clamp)
            loom_op_swiglu_clamp(be, m->mhb, m->mgu, n * K, H, c->swiglu_alpha, c->swiglu_limit);
        else
            loom_op_act_mul(be, act, m->mhb, m->mgu, n * K, H);
        loom_blk_linear_experts(m, ad, &e2, m->xg, m->mhb, 1, m->d_sel, n * K, f->t2);
        if (f->b2) loom_op_moe_add_bias(be, m->xg, m->d_sel, n * K, f->b2, dim);
        loom_op_moe_combine(be, m->xb2, m->xg, m->d_ident, m->d_w, n, K, dim, 0);
        if (c->moe_shared_hidden) { /* DeepSeek's shared experts, ungated: + shared(x), as the host path adds */
            const loom_blk_linear_t s13 = {.w = &f->s13, .proj = LOOM_PROJ_SHARED_GATE_UP, .layer = l, .expert = -1};
            const loom_blk_linear_t s2 = {.w = &f->s2, .proj = LOOM_PROJ_SHARED_DOWN, .layer = l, .expert = -1};
            LOOM_CHECK(loom_blk_linear(m, ad, &s13, m->gu, m->xb, n, err));
            loom_op_act_mul(be, act, m->hb, m->gu, n, m->shared_hn);
            LOOM_CHECK(loom_blk_linear(m, ad, &s2, m->xg, m->hb, n, err));
            loom_op_add(be, m->xb2, m->xg, (int64_t)n * dim);
        }
        return loom_blk_allreduce(m, m->xb2, (int64_t)n * dim, err);
    }
    loom_backend_download(be, m->h_probs, m->rl, (size_t)n * E * sizeof(float));
    if (c->deepseek) { /* DeepSeekMoE: grouped top-k, the correction bias for the choice only */
        const loom_moe_ds_route_t r = loom_moe_ds_route_of(c);
        float scratch[2 * 4096];
        LOOM_ASSERT(E <= 4096);
        for (int t = 0; t < n; t++)
            loom_moe_route_deepseek(&r, m->h_probs + (size_t)t * E, f->ds_bias, scratch, m->h_sel + (size_t)t * K,
                                    m->h_w + (size_t)t * K);
    } else {
        for (int t = 0; t < n; t++) {
            float *p = m->h_probs + (size_t)t * E;
            loom_moe_route_row(p, E, K, c->norm_topk_prob, p, m->h_sel + (size_t)t * K, m->h_w + (size_t)t * K);
        }
    }
    /* group the (token, expert) pairs by expert: CSR offsets in h_cnt */
    memset(m->h_cnt, 0, (size_t)(E + 1) * sizeof(int32_t));
    for (int i = 0; i < n * K; i++) m->h_cnt[m->h_sel[i] + 1]++;
    for (int e = 0; e < E; e++) m->h_cnt[e + 1] += m->h_cnt[e];
    for (int t = 0; t < n; t++)
        for (int j = 0; j < K; j++) {
            int e = m->h_sel[(size_t)t * K + j];
            int at = m->h_cnt[e]++;
            m->h_rows[at] = t;
            m->h_rw[at] = m->h_w[(size_t)t * K + j];
        }
    for (int e = E; e > 0; e--) m->h_cnt[e] = m->h_cnt[e - 1]; /* back to begin offsets */
    m->h_cnt[0] = 0;
    /* each token's choices in ascending expert order: row of xg (from the
     * held experts' first) and weight; another rank's experts last, -1 */
    const int i0 = m->h_cnt[m->expert_begin], nl = m->h_cnt[m->expert_end] - i0;
    memset(m->h_fill, 0, (size_t)n * sizeof(int32_t));
    for (int i = i0; i < i0 + nl; i++) {
        int t = m->h_rows[i], at = t * K + m->h_fill[t]++;
        m->h_pos[at] = i - i0;
        m->h_pw[at] = m->h_rw[i];
    }
    for (int t = 0; t < n; t++)
        for (int j = m->h_fill[t]; j < K; j++) {
            m->h_pos[t * K + j] = -1;
            m->h_pw[t * K + j] = 0.0f;
        }
    if (nl > 0) {
        loom_backend_upload(be, m->d_rows, m->h_rows + i0, (size_t)nl * sizeof(int32_t));
        loom_op_gather_rows(be, m->xg, m->xb, m->d_rows, nl, dim);
        for (int e = m->expert_begin; e < m->expert_end; e++) {
            int b = m->h_cnt[e] - i0, g = m->h_cnt[e + 1] - m->h_cnt[e];
            const loom_blk_linear_t e13 = {.w = &f->e13[e], .bias = f->b13 ? f->b13 + (size_t)e * 2 * H : NULL,
                                           .proj = LOOM_PROJ_EXPERT_GATE_UP, .layer = l, .expert = e};
            if (g > 0)
                LOOM_CHECK(loom_blk_linear(m, ad, &e13, m->mgu + (size_t)b * 2 * H, m->xg + (size_t)b * dim, g,
                                           err));
        }
        if (f->swiglu_clamp)
            loom_op_swiglu_clamp(be, m->mhb, m->mgu, nl, H, c->swiglu_alpha, c->swiglu_limit);
        else
            loom_op_act_mul(be, act, m->mhb, m->mgu, nl, H);
        for (int e = m->expert_begin; e < m->expert_end;
             e++) { /* xg's rows are read: the outputs go there */
            int b = m->h_cnt[e] - i0, g = m->h_cnt[e + 1] - m->h_cnt[e];
            const loom_blk_linear_t e2 = {.w = &f->e2[e], .bias = f->b2 ? f->b2 + (size_t)e * dim : NULL,
                                          .proj = LOOM_PROJ_EXPERT_DOWN, .layer = l, .expert = e};
            if (g > 0)
                LOOM_CHECK(loom_blk_linear(m, ad, &e2, m->xg + (size_t)b * dim, m->mhb + (size_t)b * H, g, err));
        }
    }
    loom_backend_upload(be, m->d_pos, m->h_pos, (size_t)n * K * sizeof(int32_t));
    loom_backend_upload(be, m->d_pw, m->h_pw, (size_t)n * K * sizeof(float));
    loom_op_moe_combine(be, m->xb2, m->xg, m->d_pos, m->d_pw, n, K, dim, 0);
    if (c->moe_shared_hidden) { /* Qwen2-MoE: + sigmoid(shared_gate . x) * shared_expert(x), this rank's slice */
        const loom_blk_linear_t sg = {.w = &f->sgate, .proj = LOOM_PROJ_SHARED_GATE, .layer = l, .expert = -1};
        const loom_blk_linear_t s13 = {.w = &f->s13, .proj = LOOM_PROJ_SHARED_GATE_UP, .layer = l, .expert = -1};
        const loom_blk_linear_t s2 = {.w = &f->s2, .proj = LOOM_PROJ_SHARED_DOWN, .layer = l, .expert = -1};
        if (!c->deepseek) {
            LOOM_CHECK(loom_blk_linear(m, ad, &sg, m->sgl, m->xb, n, err));
            loom_backend_download(be, m->h_sg, m->sgl, (size_t)n * sizeof(float));
        }
        LOOM_CHECK(loom_blk_linear(m, ad, &s13, m->gu, m->xb, n, err));
        loom_op_act_mul(be, act, m->hb, m->gu, n, m->shared_hn);
        LOOM_CHECK(loom_blk_linear(m, ad, &s2, m->xg, m->hb, n, err));
        for (int t = 0; t < n; t++)
            m->h_sg[t] = c->deepseek ? 1.0f : 1.0f / (1.0f + expf(-m->h_sg[t]));
        loom_backend_upload(be, m->d_w, m->h_sg, (size_t)n * sizeof(float));
        loom_op_moe_combine(be, m->xb2, m->xg, m->d_ident, m->d_w, n, 1, dim, 1);
    }
    return loom_blk_allreduce(m, m->xb2, (int64_t)n * dim, err);
}


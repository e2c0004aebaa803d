/* The feed-forward block: the dense gated MLP down(act(gate(x)) * up(x))
 * (gate/up column-parallel and stacked, down row-parallel), or the layer's
 * Mixture of Experts (moe.c); and the residual add that closes a layer. */
#include <stdio.h>

#include "worker/engine/model_impl.h"

loom_status_t loom_blk_ffn_load(loom_loader_t *L, int gl, loom_ffn_t *f, loom_err_t *err) {
    const loom_model_config_t *c = &L->m->cfg;
    const loom_shard_dims_t *d = &L->m->dims;
    const int dim = c->dim;
    char name[256], pg[256], pu[256];
#define TNAME(buf, role) loom_load_name(L, gl, role, -1, buf, sizeof buf)
    /* gate and up: column-parallel, stacked */
    loom_lin_part_t gu[2];
    if (c->fused_qkv) { /* Phi-3: gate_up_proj holds the gate rows, then the up rows */
        const char *fu = TNAME(pg, LOOM_TN_GATE_UP);
        gu[0] = (loom_lin_part_t){fu, 2 * (int64_t)c->hidden_dim, d->hidden_begin, d->hidden};
        gu[1] = (loom_lin_part_t){fu, 2 * (int64_t)c->hidden_dim, c->hidden_dim + d->hidden_begin, d->hidden};
    } else {
        gu[0] = (loom_lin_part_t){TNAME(pg, LOOM_TN_GATE), c->hidden_dim, d->hidden_begin, d->hidden};
        gu[1] = (loom_lin_part_t){TNAME(pu, LOOM_TN_UP), c->hidden_dim, d->hidden_begin, d->hidden};
    }
    snprintf(name, sizeof name, "model.layers.%d.mlp.gate_up", gl);
    LOOM_CHECK(loom_load_linear(L, &f->w13, name, gu, 2, dim, 0, dim, err));

    /* down: row-parallel */
    loom_lin_part_t dn = {TNAME(pg, LOOM_TN_DOWN), dim, 0, dim};
    LOOM_CHECK(loom_load_linear(L, &f->w2, pg, &dn, 1, c->hidden_dim, d->hidden_begin, d->hidden, err));
#undef TNAME
    return LOOM_OK;
}

loom_status_t loom_blk_ffn(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    const loom_ffn_t *f = &m->layers[l].ffn;
    const int n = so->n;
    if (f->moe) return loom_blk_moe(m, so, l, err);
    const loom_blk_linear_t w13 = {.w = &f->w13, .proj = LOOM_PROJ_GATE_UP, .layer = l, .expert = -1};
    const loom_blk_linear_t w2 = {.w = &f->w2, .reduce = 1, .proj = LOOM_PROJ_DOWN, .layer = l, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, so->adapters, &w13, m->gu, m->xb, n, err));
    loom_op_act_mul(m->be, (loom_act_t)m->cfg.hidden_act, m->hb, m->gu, n, m->dims.hidden);
    return loom_blk_linear(m, so->adapters, &w2, m->xb2, m->hb, n, err);
}

/* Each residual add is fused with the norm that follows it (the next
 * layer's attention norm); backends without the fused op run the two
 * plain ops. */
void loom_blk_ffn_residual(loom_model_t *m, const loom_step_ops_t *so, int l) {
    const int n = so->n, dim = m->cfg.dim;
    if (l + 1 < m->dims.n_layers)
        loom_op_add_rmsnorm(m->be, m->x, m->xb2, m->xb, m->layers[l + 1].attn_norm, n, dim, m->cfg.norm_eps);
    else
        loom_op_add(m->be, m->x, m->xb2, (int64_t)n * dim);
}

loom_status_t loom_blk_prenorm_layer(loom_model_t *m, const loom_step_ops_t *so, int l, loom_blk_attn_fn attn,
                                     loom_err_t *err) {
    LOOM_CHECK(so->dp ? loom_blk_attn_dp(m, so, l, attn, err) : attn(m, so, l, err));
    loom_op_add_rmsnorm(m->be, m->x, m->xb2, m->xb, m->layers[l].ffn_norm, so->n, m->cfg.dim, m->cfg.norm_eps);
    LOOM_CHECK(loom_blk_ffn(m, so, l, err));
    loom_blk_ffn_residual(m, so, l);
    return LOOM_OK;
}

loom_status_t loom_blk_prenorm_load_norms(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    char name[256];
    const int dim = L->m->cfg.dim;
    LOOM_CHECK(loom_load_upload_norm(L, loom_load_name(L, gl, LOOM_TN_ATTN_NORM, -1, name, sizeof name), dim,
                                     &ly->attn_norm, err));
    return loom_load_upload_norm(L, loom_load_name(L, gl, LOOM_TN_FFN_NORM, -1, name, sizeof name), dim,
                                 &ly->ffn_norm, err);
}

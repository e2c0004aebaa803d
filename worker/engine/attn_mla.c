/* Multi-head latent attention (DeepSeek-V2/V3) in the engine, through the
 * shared ops: two projections and the paged attention of the other
 * families.
 *
 *   z  = [q_a_proj | kv_a_proj_with_mqa] x     (or this rank's q_proj rows
 *                                               in place of q_a_proj)
 *   z's q_a part and latent part RMS-normed in place (eps 1e-6)
 *   qkv = B z                                  (B built at load, below)
 *   RoPE + KV write, attention (QK dim nope + rope), o (+ all-reduce)
 *
 * B holds per head of this rank: the q rows (q_b_proj's, or a selection of
 * z's q_proj part), k rows (kv_b_proj's k_nope rows over the latent, and the
 * shared rope key picked from z), and v rows (kv_b_proj's v rows, padded
 * with zero rows to the QK dim; o_proj gets zero columns there). Each head's
 * q and k dims are placed so the kernels' rotate-half pairs (j, j + hd/2)
 * are the checkpoint's RoPE pairs and the nope dims sit in the slots the
 * RoPE table leaves unturned (frequency 0); yarn's cos/sin factor is folded
 * into the rope rows, and the softmax scale is the config's
 * (qk_head_dim^-0.5 x mscale^2). The latent is computed whole on every TP
 * rank (replicated); each rank's B makes only its heads.
 *
 * This is the decompressed path: the paged cache holds each head's k and v
 * (2 x heads x (nope + rope) values a token and layer); the absorbed path
 * over a latent cache of kv_lora + rope values (worker/mla.c, the reference)
 * is not in the engine yet. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "worker/engine/model_impl.h"

int loom_blk_attn_mla_zdim(const loom_model_config_t *c, const loom_shard_dims_t *d) {
    int qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    return (c->q_lora_rank ? c->q_lora_rank : d->n_heads * qk) + c->kv_lora_rank + c->qk_rope_head_dim;
}

/* Slot s of a head of qk dims: *rope = 1 and *idx the rope dim for the RoPE pairs' slots (pair j at
 * j and j + qk/2, j < rope/2), else *rope = 0 and *idx the nope dim. */
static void slot_src(const loom_model_config_t *c, int s, int *rope, int *idx) {
    const int qk = c->qk_nope_head_dim + c->qk_rope_head_dim, half = qk / 2, pr = c->qk_rope_head_dim / 2;
    int j = s < half ? s : s - half, second = s >= half;
    if (j < pr) {
        *rope = 1;
        *idx = c->rope_interleave ? 2 * j + second : j + second * pr;
    } else {
        *rope = 0;
        *idx = second ? (half - pr) + (j - pr) : j - pr;
    }
}

loom_status_t loom_blk_attn_mla_load(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    const int dim = c->dim, H = c->n_heads, Hr = d->n_heads, hb = d->q_head_begin;
    const int nope = c->qk_nope_head_dim, rope = c->qk_rope_head_dim, v = c->v_head_dim, r = c->kv_lora_rank;
    const int qk = nope + rope, ql = c->q_lora_rank, qoff = ql ? ql : Hr * qk;
    const int zdim = loom_blk_attn_mla_zdim(c, d);
    const float af = c->rope_attn_factor;
    char name[256], pq[256], pkv[256], what[256];
    loom_status_t s = LOOM_OK;
    if (qk % 2) return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "MLA: qk_nope_head_dim + qk_rope_head_dim is odd");

    /* the latent projection: q_a rows (or this rank's q_proj rows), then kv_a's */
    loom_lin_part_t za[2];
    if (ql)
        za[0] = (loom_lin_part_t){loom_load_name(L, gl, LOOM_TN_Q_A, -1, pq, sizeof pq), ql, 0, ql};
    else
        za[0] = (loom_lin_part_t){loom_load_name(L, gl, LOOM_TN_Q, -1, pq, sizeof pq), (int64_t)H * qk,
                                  (int64_t)hb * qk, (int64_t)Hr * qk};
    za[1] = (loom_lin_part_t){loom_load_name(L, gl, LOOM_TN_KV_A, -1, pkv, sizeof pkv), r + rope, 0, r + rope};
    snprintf(what, sizeof what, "model.layers.%d.self_attn.latent", gl);
    LOOM_CHECK(loom_load_linear(L, &ly->wkv_a, what, za, 2, dim, 0, dim, err));
    if (ql)
        LOOM_CHECK(loom_load_upload_norm(L, loom_load_name(L, gl, LOOM_TN_Q_A_NORM, -1, name, sizeof name), ql,
                                         &ly->q_norm, err));
    LOOM_CHECK(loom_load_upload_norm(L, loom_load_name(L, gl, LOOM_TN_KV_A_NORM, -1, name, sizeof name), r,
                                     &ly->k_norm, err));

    /* B: (3 Hr qk, zdim), from q_b_proj's and kv_b_proj's rows of this rank's heads */
    const int kvw = nope + v;
    float *qb = ql ? loom_xmalloc((size_t)Hr * qk * ql * sizeof(float)) : NULL;
    float *kvb = loom_xmalloc((size_t)Hr * kvw * r * sizeof(float));
    if (ql)
        s = loom_load_read_block(L, loom_load_name(L, gl, LOOM_TN_Q_B, -1, name, sizeof name),
                                 (int64_t)H * qk, ql, (int64_t)hb * qk, (int64_t)Hr * qk, 0, ql, qb, err);
    if (s == LOOM_OK)
        s = loom_load_read_block(L, loom_load_name(L, gl, LOOM_TN_KV_B, -1, name, sizeof name),
                                 (int64_t)H * kvw, r, (int64_t)hb * kvw, (int64_t)Hr * kvw, 0, r, kvb, err);
    const int64_t rows = 3 * (int64_t)Hr * qk;
    float *B = s == LOOM_OK ? loom_load_staging(L, (size_t)rows * zdim) : NULL;
    if (s == LOOM_OK && !B) s = loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
    if (s == LOOM_OK) {
        memset(B, 0, (size_t)rows * zdim * sizeof(float));
        for (int h = 0; h < Hr; h++)
            for (int sl = 0; sl < qk; sl++) {
                int is_rope, idx;
                slot_src(c, sl, &is_rope, &idx);
                const int src = is_rope ? nope + idx : idx; /* the dim within the checkpoint's q head */
                const float g = is_rope ? af : 1.0f;
                float *qrow = B + ((size_t)h * qk + sl) * zdim;
                float *krow = B + ((size_t)(Hr + h) * qk + sl) * zdim;
                float *vrow = B + ((size_t)(2 * Hr + h) * qk + sl) * zdim;
                if (ql)
                    for (int i = 0; i < ql; i++) qrow[i] = g * qb[((size_t)h * qk + src) * ql + i];
                else
                    qrow[h * qk + src] = g;
                if (is_rope)
                    krow[qoff + r + idx] = af; /* the shared rope key */
                else
                    memcpy(krow + qoff, kvb + ((size_t)h * kvw + idx) * r, (size_t)r * sizeof(float));
                if (sl < v) memcpy(vrow + qoff, kvb + ((size_t)h * kvw + nope + sl) * r, (size_t)r * sizeof(float));
            }
        snprintf(what, sizeof what, "model.layers.%d.self_attn.mla_qkv", gl);
        s = loom_load_upload_weight(L, &ly->wqkv, rows, zdim, what, err);
    }
    free(qb);
    free(kvb);
    LOOM_CHECK(s);

    /* o: this rank's heads' v columns, each head widened to qk with zero columns */
    float *o = loom_xmalloc((size_t)dim * Hr * v * sizeof(float));
    s = loom_load_read_block(L, loom_load_name(L, gl, LOOM_TN_O, -1, name, sizeof name), dim,
                             (int64_t)H * v, 0, dim, (int64_t)hb * v, (int64_t)Hr * v, o, err);
    float *W = s == LOOM_OK ? loom_load_staging(L, (size_t)dim * Hr * qk) : NULL;
    if (s == LOOM_OK && !W) s = loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
    if (s == LOOM_OK) {
        memset(W, 0, (size_t)dim * Hr * qk * sizeof(float));
        for (int i = 0; i < dim; i++)
            for (int h = 0; h < Hr; h++)
                memcpy(W + (size_t)i * Hr * qk + (size_t)h * qk, o + (size_t)i * Hr * v + (size_t)h * v,
                       (size_t)v * sizeof(float));
        snprintf(what, sizeof what, "model.layers.%d.self_attn.o_proj", gl);
        s = loom_load_upload_weight(L, &ly->wo, dim, (int64_t)Hr * qk, what, err);
    }
    free(o);
    ly->window = 0;
    return s;
}

loom_status_t loom_blk_attn_mla(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    loom_backend_t *be = m->be;
    const loom_layer_t *ly = &m->layers[l];
    const int n = so->n, Hr = d->n_heads, qk = c->head_dim, qd = m->qkv_dim;
    const int zdim = loom_blk_attn_mla_zdim(c, d), qoff = c->q_lora_rank ? c->q_lora_rank : Hr * qk;
    const loom_blk_linear_t za = {.w = &ly->wkv_a, .proj = LOOM_PROJ_QKV, .layer = l, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, so->adapters, &za, m->mla_z, m->xb, n, err));
    if (c->q_lora_rank) loom_op_head_rmsnorm(be, m->mla_z, zdim, n, 1, c->q_lora_rank, ly->q_norm, 1e-6f);
    loom_op_head_rmsnorm(be, m->mla_z + qoff, zdim, n, 1, c->kv_lora_rank, ly->k_norm, 1e-6f);
    const loom_blk_linear_t b = {.w = &ly->wqkv, .proj = LOOM_PROJ_QKV, .layer = l, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, so->adapters, &b, m->qkv, m->mla_z, n, err));
    float *q = m->qkv, *k = q + Hr * qk, *v = k + Hr * qk;
    loom_op_rope_kv_write(be, q, k, v, qd, n, Hr, Hr, qk, so->d_pos, ly->inv_freq, &ly->kv, so->d_slots);
    loom_attn_args_t a = {
        .n = n,
        .n_heads = Hr,
        .n_kv_heads = Hr,
        .head_dim = qk,
        .scale = c->attn_scale,
        .q = q,
        .q_stride = qd,
        .out = m->att,
        .out_stride = Hr * qk,
        .kv = ly->kv,
        .block_size = m->block_size,
        .tok_seq = so->d_seq,
        .tok_pos = so->d_pos,
        .block_tables = so->d_bt,
        .max_blocks = so->max_blocks,
        .max_ctx = so->max_ctx,
    };
    loom_op_attention(be, &a);
    const loom_blk_linear_t o = {.w = &ly->wo, .reduce = 1, .proj = LOOM_PROJ_O, .layer = l, .expert = -1};
    return loom_blk_linear(m, so->adapters, &o, m->xb2, m->att, n, err);
}

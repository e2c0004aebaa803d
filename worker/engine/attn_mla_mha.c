/* Multi-head latent attention (DeepSeek-V2/V3) decompressed
 * (opt.mla_disable, `--disable-mla`, vLLM's VLLM_MLA_DISABLE): the model
 * runs standard attention over a per-head K and V cache.
 *
 *   zq  = q_a_proj x, RMS-normed   (V2-Lite: no q_a; q = Q' x directly)
 *   zkv = kv_a_proj_with_mqa x, its latent part RMS-normed
 *   q   = Q' zq                     (Hr heads of nope + rope)
 *   [k | v] = KV' zkv               (Hr heads of nope + rope, Hr of v)
 *   RoPE on q and k, the cache write, paged MHA, o_proj (+ all-reduce)
 *
 * Q' is q_b_proj's (or q_proj's) rows of this rank's heads, each head's
 * rows moved to the kernels' slots (attn_mla.c's loom_blk_attn_mla_slot:
 * the rotate-half pairs (j, j + qk/2) are the checkpoint's RoPE pairs,
 * whether interleaved or not) and the rope rows times yarn's factor. KV'
 * stacks, per head, W_UK (kv_b_proj's k rows) over the latent in the nope
 * slots and a selection of the rope key (times the factor) in the rope
 * slots: the shared k_pe broadcast to every head; then W_UV (kv_b_proj's
 * v rows). Each costs a zero block: the rope key's columns in W_UK's and
 * W_UV's rows, the latent's in the selection rows (Hr x rope x
 * (kv_lora + rope) weights). The heads split across TP ranks (the latent
 * projection is computed whole on each); the cache holds this rank's heads
 * only, K rows of nope + rope and V rows of v_head_dim (kv.c,
 * loom_kv_layer_t.v_dim). worker/mla.c's decompressed path is the plain
 * reference of the same arithmetic. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "worker/engine/model_impl.h"

loom_status_t loom_blk_attn_mla_mha_load(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    const int dim = c->dim, H = c->n_heads, Hr = d->n_heads, hb = d->q_head_begin;
    const int nope = c->qk_nope_head_dim, rope = c->qk_rope_head_dim, v = c->v_head_dim, r = c->kv_lora_rank;
    const int qk = nope + rope, ql = c->q_lora_rank, kvw = nope + v, rr = r + rope;
    const float af = c->rope_attn_factor;
    char name[256], what[256];
    LOOM_ASSERT(c->head_dim == qk); /* loom_model_load sets it for the decompressed cache */

    /* the latent projections: q_a_proj (absent in V2-Lite) and kv_a_proj_with_mqa, each whole */
    if (ql) {
        loom_lin_part_t qa = {loom_load_name(L, gl, LOOM_TN_Q_A, -1, name, sizeof name), ql, 0, ql};
        snprintf(what, sizeof what, "model.layers.%d.self_attn.q_a_proj", gl);
        LOOM_CHECK(loom_load_linear(L, &ly->mla_q_a, what, &qa, 1, dim, 0, dim, err));
        LOOM_CHECK(loom_load_upload_norm(L, loom_load_name(L, gl, LOOM_TN_Q_A_NORM, -1, name, sizeof name), ql,
                                         &ly->q_norm, err));
    }
    loom_lin_part_t kva = {loom_load_name(L, gl, LOOM_TN_KV_A, -1, name, sizeof name), rr, 0, rr};
    snprintf(what, sizeof what, "model.layers.%d.self_attn.kv_a_proj_with_mqa", gl);
    LOOM_CHECK(loom_load_linear(L, &ly->wkv_a, what, &kva, 1, dim, 0, dim, err));
    LOOM_CHECK(loom_load_upload_norm(L, loom_load_name(L, gl, LOOM_TN_KV_A_NORM, -1, name, sizeof name), r,
                                     &ly->k_norm, err));

    /* Q' (Hr qk, qin): this rank's q rows, each head's moved to the kernels' slots */
    const int qin = ql ? ql : dim;
    float *qsrc = loom_xmalloc((size_t)Hr * qk * qin * sizeof(float));
    float *kvb = loom_xmalloc((size_t)Hr * kvw * r * sizeof(float));
    loom_status_t s = LOOM_OK;
    if (ql) {
        s = loom_load_read_block(L, loom_load_name(L, gl, LOOM_TN_Q_B, -1, name, sizeof name), (int64_t)H * qk, ql,
                                 (int64_t)hb * qk, (int64_t)Hr * qk, 0, ql, qsrc, err);
    } else { /* q_proj as a float tensor (a checkpoint storing it quantized is refused by name) */
        char pq[256];
        snprintf(name, sizeof name, "%s.weight", loom_load_name(L, gl, LOOM_TN_Q, -1, pq, sizeof pq));
        s = loom_load_read_block(L, name, (int64_t)H * qk, dim, (int64_t)hb * qk, (int64_t)Hr * qk, 0, dim, qsrc,
                                 err);
    }
    if (s == LOOM_OK)
        s = loom_load_read_block(L, loom_load_name(L, gl, LOOM_TN_KV_B, -1, name, sizeof name), (int64_t)H * kvw, r,
                                 (int64_t)hb * kvw, (int64_t)Hr * kvw, 0, r, kvb, err);
    float *W = NULL;
    if (s == LOOM_OK) {
        W = loom_load_staging(L, LOOM_MAX((size_t)Hr * qk * qin, (size_t)Hr * (qk + v) * rr));
        if (!W) s = loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
    }
    if (s == LOOM_OK) {
        for (int h = 0; h < Hr; h++)
            for (int sl = 0; sl < qk; sl++) {
                int is_rope, idx;
                loom_blk_attn_mla_slot(qk, rope, c->rope_interleave, sl, &is_rope, &idx);
                const float *src = qsrc + ((size_t)h * qk + (is_rope ? nope : 0) + idx) * qin;
                float *dst = W + ((size_t)h * qk + sl) * qin;
                for (int i = 0; i < qin; i++) dst[i] = is_rope ? af * src[i] : src[i];
            }
        snprintf(what, sizeof what, "model.layers.%d.self_attn.q", gl);
        s = loom_load_upload_weight(L, &ly->wqkv, (int64_t)Hr * qk, qin, what, err);
    }
    if (s == LOOM_OK) { /* KV' (Hr (qk + v), kv_lora + rope): the K heads, then the V heads */
        memset(W, 0, (size_t)Hr * (qk + v) * rr * sizeof(float));
        for (int h = 0; h < Hr; h++) {
            for (int sl = 0; sl < qk; sl++) {
                int is_rope, idx;
                loom_blk_attn_mla_slot(qk, rope, c->rope_interleave, sl, &is_rope, &idx);
                float *dst = W + ((size_t)h * qk + sl) * rr;
                if (is_rope) /* k_pe's dim idx, shared by every head */
                    dst[r + idx] = af;
                else /* W_UK: kv_b_proj's k row idx of head h */
                    memcpy(dst, kvb + ((size_t)h * kvw + idx) * r, (size_t)r * sizeof(float));
            }
            for (int k = 0; k < v; k++) /* W_UV: kv_b_proj's v rows of head h */
                memcpy(W + ((size_t)Hr * qk + (size_t)h * v + k) * rr, kvb + ((size_t)h * kvw + nope + k) * r,
                       (size_t)r * sizeof(float));
        }
        snprintf(what, sizeof what, "model.layers.%d.self_attn.kv_b", gl);
        s = loom_load_upload_weight(L, &ly->mla_kv_b, (int64_t)Hr * (qk + v), rr, what, err);
    }
    free(qsrc);
    free(kvb);
    LOOM_CHECK(s);
    /* o_proj: this rank's heads' columns, as stored */
    W = loom_load_staging(L, (size_t)dim * Hr * v);
    if (!W) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
    LOOM_CHECK(loom_load_read_block(L, loom_load_name(L, gl, LOOM_TN_O, -1, name, sizeof name), dim, (int64_t)H * v,
                                    0, dim, (int64_t)hb * v, (int64_t)Hr * v, W, err));
    snprintf(what, sizeof what, "model.layers.%d.self_attn.o_proj", gl);
    LOOM_CHECK(loom_load_upload_weight(L, &ly->wo, dim, (int64_t)Hr * v, what, err));
    ly->window = 0;
    return LOOM_OK;
}

loom_status_t loom_blk_attn_mla_mha(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    loom_backend_t *be = m->be;
    const loom_layer_t *ly = &m->layers[l];
    const int n = so->n, Hr = m->dims.n_heads, qk = c->head_dim, v = c->v_head_dim;
    const int ql = c->q_lora_rank, rr = c->kv_lora_rank + c->qk_rope_head_dim, kvs = Hr * (qk + v);
    /* mla_z: zq (n, ql) then zkv (n, kv_lora + rope); qkv: q (n, Hr qk) then [k | v] (n, Hr (qk + v)) */
    float *zq = m->mla_z, *zkv = m->mla_z + (size_t)n * ql, *q = m->qkv, *k = m->qkv + (size_t)n * Hr * qk;
    if (ql) {
        const loom_blk_linear_t qa = {.w = &ly->mla_q_a, .proj = LOOM_PROJ_QKV, .layer = l, .expert = -1};
        LOOM_CHECK(loom_blk_linear(m, so->adapters, &qa, zq, m->xb, n, err));
        loom_op_head_rmsnorm(be, zq, ql, n, 1, ql, ly->q_norm, 1e-6f);
    }
    const loom_blk_linear_t kva = {.w = &ly->wkv_a, .proj = LOOM_PROJ_QKV, .layer = l, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, so->adapters, &kva, zkv, m->xb, n, err));
    loom_op_head_rmsnorm(be, zkv, rr, n, 1, c->kv_lora_rank, ly->k_norm, 1e-6f);
    const loom_blk_linear_t qb = {.w = &ly->wqkv, .proj = LOOM_PROJ_QKV, .layer = l, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, so->adapters, &qb, q, ql ? zq : m->xb, n, err));
    const loom_blk_linear_t kvb = {.w = &ly->mla_kv_b, .proj = LOOM_PROJ_QKV, .layer = l, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, so->adapters, &kvb, k, zkv, n, err));
    loom_op_rope(be, q, Hr * qk, n, Hr, qk, so->d_pos, ly->inv_freq);
    loom_op_rope(be, k, kvs, n, Hr, qk, so->d_pos, ly->inv_freq);
    loom_op_kv_write(be, &ly->kv, k, k + (size_t)Hr * qk, kvs, so->d_slots, n, Hr, qk);
    loom_attn_args_t a = {
        .n = n,
        .n_heads = Hr,
        .n_kv_heads = Hr,
        .head_dim = qk,
        .scale = c->attn_scale,
        .q = q,
        .q_stride = Hr * qk,
        .out = m->att,
        .out_stride = Hr * v,
        .kv = ly->kv,
        .block_size = m->block_size,
        .tok_seq = so->d_seq,
        .tok_pos = so->d_pos,
        .block_tables = so->d_bt,
        .max_blocks = so->max_blocks,
        .max_ctx = so->max_ctx,
    };
    loom_op_attention(be, &a);
    const loom_blk_linear_t o = {.w = &ly->wo, .reduce = !so->local, .proj = LOOM_PROJ_O, .layer = l, .expert = -1};
    return loom_blk_linear(m, so->adapters, &o, m->xb2, m->att, n, err);
}

/* Multi-head latent attention (DeepSeek-V2/V3) in the engine, absorbed,
 * through the shared ops over a latent cache:
 *
 *   z  = [q_a_proj | kv_a_proj_with_mqa] x     (or this rank's q_proj rows
 *                                               in place of q_a_proj)
 *   z's q_a part and latent part RMS-normed in place (eps 1e-6)
 *   [q | k] = B z                              (B built at load, below)
 *   RoPE, the cache write, attention as MQA (one KV head of kv_lora + rope
 *   dims, its value the same row), o' (+ all-reduce)
 *
 * The KV head is the cache row itself, c (the normed latent) and k_pe (the
 * rope key): kv.c's latent layout keeps one row of kv_lora + rope values a
 * token and layer, K and V the same memory. Each query head is
 * [W_UK_h^T q_nope_h, q_pe_h], W_UK (kv_b_proj's k rows of head h) folded
 * into B's q rows at load (q_b_proj's, or a selection of z's q_proj part);
 * the head's output is the softmax-weighted sum of the rows, whose latent
 * part o_lat_h goes through W_UV_h (kv_b_proj's v rows) and o_proj: folded
 * into one matrix o' = W_o_h W_UV_h at load (zero columns for the rope
 * part) where that is smaller, else applied in sequence (W_UV per head on
 * the grouped GEMV, then o_proj as stored; mla_o_split). Dims are placed
 * so the kernels' rotate-half pairs (j, j + hd/2) are the checkpoint's
 * RoPE pairs (interleaved or not) and the latent sits in the slots the
 * RoPE table leaves unturned (frequency 0); yarn's cos/sin
 * factor is folded into the rope rows, and the softmax scale is the
 * config's (qk_head_dim^-0.5 x mscale^2). The latent is computed whole on
 * every TP rank (replicated); each rank's B and o' make only its heads.
 * worker/mla.c is the plain reference of both the absorbed and the
 * decompressed path. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "worker/engine/model_impl.h"

int loom_blk_attn_mla_zdim(const loom_model_config_t *c, const loom_shard_dims_t *d) {
    int qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    return (c->q_lora_rank ? c->q_lora_rank : d->n_heads * qk) + c->kv_lora_rank + c->qk_rope_head_dim;
}

void loom_blk_attn_mla_slot(int hd, int rope, int interleave, int s, int *is_rope, int *idx) {
    const int half = hd / 2, pr = rope / 2;
    int j = s < half ? s : s - half, second = s >= half;
    if (j < pr) {
        *is_rope = 1;
        *idx = interleave ? 2 * j + second : j + second * pr;
    } else {
        *is_rope = 0;
        *idx = second ? (half - pr) + (j - pr) : j - pr;
    }
}

/* Whether this shard applies W_UV and o_proj in sequence (LOOM_MLA_O_SPLIT)
 * rather than as one folded o': per head, W_UV (v, D) then o_proj's
 * columns (dim, v) hold v (D + dim) weights against the folded dim D.
 * DeepSeek-V3 (dim 7168, v 128, D 576): 0.99 M against 4.13 M a head, 4.2x
 * fewer, and as many fewer multiply-adds a token; a tiny model (D close to v,
 * dim small) keeps the fold. The split runs on the grouped GEMV (a pair per
 * token and head), where the backend has one for float weights. */
static int mla_o_split(const loom_model_t *m, int Hr, int v) {
    const loom_model_config_t *c = &m->cfg;
    const int64_t D = c->head_dim, dim = c->dim;
    if (m->opt.mla_o == LOOM_MLA_O_FOLDED || v > D) return 0; /* the split's (n, heads x v) rows go in qkv */
    /* the decompressed prefill's v-space rows go to o_proj as stored: it takes the split */
    if (m->opt.mla_o != LOOM_MLA_O_SPLIT && !m->opt.mla_prefill_rows && v * (D + dim) >= dim * D) return 0;
    return Hr > 0;
}

/* o' (dim, Hr D): head h's latent slot of dim idx holds W_o_h W_UV_h[:, idx]; its rope slots 0. */
static loom_status_t load_o_folded(loom_loader_t *L, int gl, loom_layer_t *ly, const float *kvb, const float *o,
                                   loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const int dim = c->dim, Hr = m->dims.n_heads, D = c->head_dim, rope = c->qk_rope_head_dim;
    const int v = c->v_head_dim, r = c->kv_lora_rank, kvw = c->qk_nope_head_dim + v;
    char what[256];
    float *W = loom_load_staging(L, (size_t)dim * Hr * D);
    if (!W) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
    memset(W, 0, (size_t)dim * Hr * D * sizeof(float));
    for (int h = 0; h < Hr; h++)
        for (int sl = 0; sl < D; sl++) {
            int is_rope, idx;
            loom_blk_attn_mla_slot(D, rope, c->rope_interleave, sl, &is_rope, &idx);
            if (is_rope) continue;
            const float *wuv = kvb + ((size_t)h * kvw + c->qk_nope_head_dim) * r; /* (v, r) */
            for (int i = 0; i < dim; i++) {
                double a = 0;
                const float *orow = o + (size_t)i * Hr * v + (size_t)h * v;
                for (int k = 0; k < v; k++) a += (double)orow[k] * wuv[(size_t)k * r + idx];
                W[(size_t)i * Hr * D + (size_t)h * D + sl] = (float)a;
            }
        }
    snprintf(what, sizeof what, "model.layers.%d.self_attn.o_proj", gl);
    return loom_load_upload_weight(L, &ly->wo, dim, (int64_t)Hr * D, what, err);
}

/* The split: W_UV_h (v, D) per head, its latent slot of dim idx holding
 * W_UV_h[:, idx] and its rope slots 0, then o_proj's slice as stored. */
static loom_status_t load_o_split(loom_loader_t *L, int gl, loom_layer_t *ly, const float *kvb, const float *o,
                                  loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const int dim = c->dim, Hr = m->dims.n_heads, D = c->head_dim, rope = c->qk_rope_head_dim;
    const int v = c->v_head_dim, r = c->kv_lora_rank, kvw = c->qk_nope_head_dim + v;
    char what[256];
    float *W = loom_load_staging(L, LOOM_MAX((size_t)dim * Hr * v, (size_t)v * D));
    if (!W) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
    ly->mla_uv = loom_xcalloc((size_t)Hr, sizeof *ly->mla_uv);
    for (int h = 0; h < Hr; h++) {
        memset(W, 0, (size_t)v * D * sizeof(float));
        const float *wuv = kvb + ((size_t)h * kvw + c->qk_nope_head_dim) * r; /* (v, r) */
        for (int sl = 0; sl < D; sl++) {
            int is_rope, idx;
            loom_blk_attn_mla_slot(D, rope, c->rope_interleave, sl, &is_rope, &idx);
            for (int k = 0; !is_rope && k < v; k++) W[(size_t)k * D + sl] = wuv[(size_t)k * r + idx];
        }
        snprintf(what, sizeof what, "model.layers.%d.self_attn.w_uv.%d", gl, h);
        LOOM_CHECK(loom_load_upload_weight(L, &ly->mla_uv[h], v, D, what, err));
    }
    if (!loom_backend_moe_device(m->be, ly->mla_uv, Hr, 1))
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "MLA: the %s backend has no grouped GEMV for W_UV and o_proj in sequence",
                            loom_backend_name(m->be));
    ly->mla_uv_table = loom_backend_moe_table(m->be, ly->mla_uv, Hr);
    if (!ly->mla_uv_table) return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for W_UV's table");
    if (!m->mla_sel) { /* pair p = token * Hr + head reads W_UV of head p % Hr */
        const size_t n = (size_t)m->opt.max_tokens * Hr;
        int32_t *sel = loom_xmalloc(n * sizeof *sel);
        for (size_t p = 0; p < n; p++) sel[p] = (int32_t)(p % (size_t)Hr);
        m->mla_sel = loom_backend_alloc(m->be, n * sizeof *sel);
        if (m->mla_sel) loom_backend_upload(m->be, m->mla_sel, sel, n * sizeof *sel);
        free(sel);
        if (!m->mla_sel) return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for MLA's head table");
        LOOM_INFO("MLA: W_UV per head then o_proj, %lld weights a layer against %lld folded",
                  (long long)Hr * v * (D + dim), (long long)dim * Hr * D);
    }
    memcpy(W, o, (size_t)dim * Hr * v * sizeof(float));
    snprintf(what, sizeof what, "model.layers.%d.self_attn.o_proj", gl);
    return loom_load_upload_weight(L, &ly->wo, dim, (int64_t)Hr * v, what, err);
}

/* The decompressed prefill's weights (opt.mla_prefill_rows), beside the folded ones:
 *   mla_dq (Hr qk, zdim): head h's q_nope and q_pe from z, in the kernels' slots of a qk-wide head
 *     (q_b_proj's rows, or a selection of z's q_proj part; the rope rows times yarn's factor);
 *   mla_dk (Hr qk, D): from a cache row, W_UK_h's rows over the latent's slots in the nope slots and a
 *     selection of the row's roped k_pe in the rope slots (the factor is in the row already);
 *   mla_dv (Hr v, D): W_UV_h's rows over the latent's slots.
 * A qk-wide head's rotate-half pairs (j, j + qk/2), j < rope/2, hold the same rope dims as the cache
 * row's (j, j + D/2) and turn by the same frequency, so the selected k_pe is the rope key of a
 * decompressed head at its position, and q_pe roped as a qk-wide head matches it. */
static loom_status_t load_dec(loom_loader_t *L, int gl, loom_layer_t *ly, const float *qb, const float *kvb,
                              loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const int Hr = m->dims.n_heads, D = c->head_dim, nope = c->qk_nope_head_dim, rope = c->qk_rope_head_dim;
    const int v = c->v_head_dim, r = c->kv_lora_rank, qk = nope + rope, ql = c->q_lora_rank, kvw = nope + v;
    const int zdim = loom_blk_attn_mla_zdim(c, &m->dims);
    const float af = c->rope_attn_factor;
    char what[256];
    int *lat = loom_xmalloc((size_t)(r + rope) * sizeof *lat), *rot = lat + r; /* the row's slot of each dim */
    for (int sl = 0; sl < D; sl++) {
        int is_rope, idx;
        loom_blk_attn_mla_slot(D, rope, c->rope_interleave, sl, &is_rope, &idx);
        (is_rope ? rot : lat)[idx] = sl;
    }
    loom_status_t s = LOOM_OK;
    float *W = loom_load_staging(L, LOOM_MAX((size_t)Hr * qk * zdim, (size_t)Hr * LOOM_MAX(qk, v) * D));
    if (!W) s = loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
    if (s == LOOM_OK) {
        memset(W, 0, (size_t)Hr * qk * zdim * sizeof(float));
        for (int h = 0; h < Hr; h++)
            for (int sl = 0; sl < qk; sl++) {
                int is_rope, idx;
                loom_blk_attn_mla_slot(qk, rope, c->rope_interleave, sl, &is_rope, &idx);
                const int src = h * qk + (is_rope ? nope : 0) + idx; /* the head's row in q_b_proj / q_proj */
                const float f = is_rope ? af : 1.0f;
                float *dst = W + ((size_t)h * qk + sl) * zdim;
                if (ql)
                    for (int i = 0; i < ql; i++) dst[i] = f * qb[(size_t)src * ql + i];
                else
                    dst[src] = f;
            }
        snprintf(what, sizeof what, "model.layers.%d.self_attn.mla_dq", gl);
        s = loom_load_upload_weight(L, &ly->mla_dq, (int64_t)Hr * qk, zdim, what, err);
    }
    if (s == LOOM_OK) {
        memset(W, 0, (size_t)Hr * qk * D * sizeof(float));
        for (int h = 0; h < Hr; h++)
            for (int sl = 0; sl < qk; sl++) {
                int is_rope, idx;
                loom_blk_attn_mla_slot(qk, rope, c->rope_interleave, sl, &is_rope, &idx);
                float *dst = W + ((size_t)h * qk + sl) * D;
                if (is_rope) {
                    dst[rot[idx]] = 1.0f;
                    continue;
                }
                const float *wuk = kvb + ((size_t)h * kvw + idx) * r; /* W_UK_h's row idx */
                for (int j = 0; j < r; j++) dst[lat[j]] = wuk[j];
            }
        snprintf(what, sizeof what, "model.layers.%d.self_attn.mla_dk", gl);
        s = loom_load_upload_weight(L, &ly->mla_dk, (int64_t)Hr * qk, D, what, err);
    }
    if (s == LOOM_OK) {
        memset(W, 0, (size_t)Hr * v * D * sizeof(float));
        for (int h = 0; h < Hr; h++)
            for (int k = 0; k < v; k++) {
                const float *wuv = kvb + ((size_t)h * kvw + nope + k) * r; /* W_UV_h's row k */
                for (int j = 0; j < r; j++) W[((size_t)h * v + k) * D + lat[j]] = wuv[j];
            }
        snprintf(what, sizeof what, "model.layers.%d.self_attn.mla_dv", gl);
        s = loom_load_upload_weight(L, &ly->mla_dv, (int64_t)Hr * v, D, what, err);
    }
    free(lat);
    if (s == LOOM_OK && ly == &m->layers[0])
        LOOM_INFO("MLA: prefill decompressed (runs of %d rows or more), %lld weights a layer beside the absorbed ones",
                  m->opt.mla_prefill_rows, (long long)Hr * qk * zdim + (long long)Hr * (qk + v) * D);
    return s;
}

loom_status_t loom_blk_attn_mla_load(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    const int dim = c->dim, H = c->n_heads, Hr = d->n_heads, hb = d->q_head_begin;
    const int nope = c->qk_nope_head_dim, rope = c->qk_rope_head_dim, v = c->v_head_dim, r = c->kv_lora_rank;
    const int qk = nope + rope, ql = c->q_lora_rank, qoff = ql ? ql : Hr * qk, D = c->head_dim, kvw = nope + v;
    const int zdim = loom_blk_attn_mla_zdim(c, d);
    const float af = c->rope_attn_factor;
    char name[256], pq[256], pkv[256], what[256];
    loom_status_t s = LOOM_OK;
    if (D != r + rope || D % 2)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "MLA: the cache row (kv_lora_rank + qk_rope_head_dim = %d) "
                            "must be the config's head_dim (%d) and even", r + rope, D);

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

    /* B: (m->qkv_dim = (Hr + 2) D, zdim): Hr query heads, the KV head, and D zero rows where the other
     * families keep V (the latent layout reads the value from the KV head's row) */
    float *qb = ql ? loom_xmalloc((size_t)Hr * qk * ql * sizeof(float)) : NULL;
    float *kvb = loom_xmalloc((size_t)Hr * kvw * r * sizeof(float));
    float *o = loom_xmalloc((size_t)dim * Hr * v * sizeof(float));
    double *acc = loom_xmalloc((size_t)(ql > dim ? ql : dim) * sizeof(double));
    if (ql)
        s = loom_load_read_block(L, loom_load_name(L, gl, LOOM_TN_Q_B, -1, name, sizeof name), (int64_t)H * qk, ql,
                                 (int64_t)hb * qk, (int64_t)Hr * qk, 0, ql, qb, err);
    if (s == LOOM_OK)
        s = loom_load_read_block(L, loom_load_name(L, gl, LOOM_TN_KV_B, -1, name, sizeof name), (int64_t)H * kvw, r,
                                 (int64_t)hb * kvw, (int64_t)Hr * kvw, 0, r, kvb, err);
    if (s == LOOM_OK)
        s = loom_load_read_block(L, loom_load_name(L, gl, LOOM_TN_O, -1, name, sizeof name), dim, (int64_t)H * v, 0,
                                 dim, (int64_t)hb * v, (int64_t)Hr * v, o, err);
    const int64_t rows = m->qkv_dim;
    float *B = s == LOOM_OK ? loom_load_staging(L, (size_t)rows * zdim) : NULL;
    if (s == LOOM_OK && !B) s = loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
    if (s == LOOM_OK) {
        memset(B, 0, (size_t)rows * zdim * sizeof(float));
        for (int sl = 0; sl < D; sl++) {
            int is_rope, idx;
            loom_blk_attn_mla_slot(D, rope, c->rope_interleave, sl, &is_rope, &idx);
            float *krow = B + ((size_t)Hr * D + sl) * zdim; /* the cache row: [c, k_pe] */
            krow[qoff + (is_rope ? r : 0) + idx] = is_rope ? af : 1.0f;
            for (int h = 0; h < Hr; h++) {
                float *qrow = B + ((size_t)h * D + sl) * zdim;
                const float *wuk = kvb + (size_t)h * kvw * r; /* (nope, r) */
                if (is_rope) { /* q_pe: the head's rope row, times yarn's factor */
                    if (ql)
                        for (int i = 0; i < ql; i++) qrow[i] = af * qb[((size_t)h * qk + nope + idx) * ql + i];
                    else
                        qrow[h * qk + nope + idx] = af;
                    continue;
                }
                if (ql) { /* latent dim idx: sum_i W_UK[i][idx] q_b[nope row i] */
                    for (int col = 0; col < ql; col++) acc[col] = 0;
                    for (int i = 0; i < nope; i++) {
                        const double wk = wuk[(size_t)i * r + idx];
                        const float *qr = qb + ((size_t)h * qk + i) * ql;
                        for (int col = 0; col < ql; col++) acc[col] += wk * qr[col];
                    }
                    for (int col = 0; col < ql; col++) qrow[col] = (float)acc[col];
                } else {
                    for (int i = 0; i < nope; i++) qrow[h * qk + i] = wuk[(size_t)i * r + idx];
                }
            }
        }
        snprintf(what, sizeof what, "model.layers.%d.self_attn.mla_qk", gl);
        s = loom_load_upload_weight(L, &ly->wqkv, rows, zdim, what, err);
    }
    const int split = mla_o_split(m, Hr, v);
    if (s == LOOM_OK && split && m->opt.mla_prefill_rows) s = load_dec(L, gl, ly, qb, kvb, err);
    if (s == LOOM_OK && split)
        s = load_o_split(L, gl, ly, kvb, o, err);
    else if (s == LOOM_OK)
        s = load_o_folded(L, gl, ly, kvb, o, err);
    free(qb);
    free(kvb);
    free(o);
    free(acc);
    ly->window = 0;
    return s;
}

/* ---- the decompressed prefill (opt.mla_prefill_rows) ------------------------------------------------- */

#ifndef LOOM_MLA_PREFILL_ROWS_DEFAULT
#define LOOM_MLA_PREFILL_ROWS_DEFAULT 0
#endif

int loom_blk_attn_mla_prefill_rows(const loom_model_t *m, const loom_model_options_t *opt) {
    const loom_model_config_t *c = &m->cfg;
    if (!c->deepseek || m->opt.mla_disable || opt->max_loras > 0 || !loom_backend_attn_lse_supported(m->be) ||
        !loom_backend_kv_v_dim(m->be) || !loom_backend_kv_gather_supported(m->be) ||
        (c->qk_nope_head_dim + c->qk_rope_head_dim) % 2 || opt->mla_prefill_rows < 0)
        return 0;
    /* CUDA's kernels for V rows of their own width stop at 256 (docs/cuda.md): wider heads stay absorbed */
    if (loom_backend_kind(m->be) == LOOM_DEVICE_CUDA &&
        (c->qk_nope_head_dim + c->qk_rope_head_dim > 256 || c->v_head_dim > 256))
        return 0;
    if (opt->mla_prefill_rows > 0) return opt->mla_prefill_rows;
    const char *e = getenv("LOOM_MLA_PREFILL_ROWS");
    if (!e || !*e) return LOOM_MLA_PREFILL_ROWS_DEFAULT > 0 ? LOOM_MLA_PREFILL_ROWS_DEFAULT : 0;
    char *end;
    const long rows = strtol(e, &end, 10);
    if (*end || rows < 0 || rows > INT_MAX) {
        LOOM_WARN("LOOM_MLA_PREFILL_ROWS='%s' is not a row count (an integer >= 0); the prefill stays absorbed", e);
        return 0;
    }
    return (int)rows;
}

/* The end of the run of rows from i: the same sequence at consecutive positions. */
static int dec_run_end(const loom_step_ops_t *so, int i) {
    int e = i + 1;
    while (e < so->n && so->h_seq[e] == so->h_seq[i] && so->h_pos[e] == so->h_pos[e - 1] + 1) e++;
    return e;
}

/* Whether any run of the step is long enough to attend decompressed (the step's host metadata). */
static int dec_any(const loom_model_t *m, const loom_step_ops_t *so) {
    for (int i = 0; i < so->n;) {
        const int e = dec_run_end(so, i);
        if (e - i >= m->opt.mla_prefill_rows) return 1;
        i = e;
    }
    return 0;
}

/* The context chunk: LOOM_MLA_PREFILL_CHUNK tokens (a test hook), else what 64 MiB of decompressed K and
 * V hold, in whole blocks, at most 4096. */
static int dec_chunk(const loom_model_t *m) {
    const loom_model_config_t *c = &m->cfg;
    const char *e = getenv("LOOM_MLA_PREFILL_CHUNK");
    if (e && atoi(e) > 0) return atoi(e);
    const int64_t per = (int64_t)m->dims.n_heads * (c->qk_nope_head_dim + c->qk_rope_head_dim + c->v_head_dim) * 4;
    int64_t C = LOOM_MIN((int64_t)4096, ((int64_t)64 << 20) / per) / m->block_size * m->block_size;
    return (int)LOOM_MAX(C, (int64_t)m->block_size);
}

typedef struct {
    float *q, *rows, *k, *v, *o, *lse, *lse_run, *freq;
    int32_t *pos, *seq, *bt;
} dec_scratch_t;

static loom_status_t dec_scratch(loom_model_t *m, dec_scratch_t *sc, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    const int64_t T = m->opt.max_tokens, Hr = m->dims.n_heads, qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    const int64_t v = c->v_head_dim;
    if (!m->mla_dec_chunk) m->mla_dec_chunk = dec_chunk(m);
    const int64_t C = m->mla_dec_chunk, nb = (C + m->block_size - 1) / m->block_size;
    const int64_t sizes[] = {T * Hr * qk, C * c->head_dim, C * Hr * qk, C * Hr * v, T * Hr * v, T * Hr, T * Hr,
                             qk / 2, T, T, nb};
    int64_t total = 0;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(sizes); i++) total += (sizes[i] + 15) / 16 * 16;
    const int fresh = !m->mla_dec;
    if (fresh) {
        m->mla_dec = loom_backend_alloc(m->be, (size_t)total * sizeof(float));
        if (!m->mla_dec) return loom_err_set(err, LOOM_ERR_NOMEM, "out of memory for MLA's decompressed prefill");
    }
    float *p = m->mla_dec, **f[] = {&sc->q, &sc->rows, &sc->k, &sc->v, &sc->o, &sc->lse, &sc->lse_run, &sc->freq};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(f); i++) *f[i] = p, p += (sizes[i] + 15) / 16 * 16;
    sc->pos = (int32_t *)p, p += (sizes[8] + 15) / 16 * 16;
    sc->seq = (int32_t *)p, p += (sizes[9] + 15) / 16 * 16;
    sc->bt = (int32_t *)p;
    if (!fresh) return LOOM_OK;
    /* the identity block table, one sequence; the RoPE table of a qk-wide head: the rope pairs' frequencies
     * (the cache row's table, whose pairs past rope/2 are the latent's, unturned), 0 past them. Device
     * memory: filled through the backend (a host staging of nb entries, freed at once: once per model) */
    int32_t *ident = loom_xmalloc((size_t)nb * sizeof *ident);
    for (int64_t b = 0; b < nb; b++) ident[b] = (int32_t)b;
    loom_backend_upload(m->be, sc->bt, ident, (size_t)nb * sizeof *ident);
    free(ident);
    loom_backend_memset(m->be, sc->seq, 0, (size_t)T * sizeof *sc->seq);
    const int pr = c->qk_rope_head_dim / 2;
    loom_backend_memset(m->be, sc->freq, 0, (size_t)(qk / 2) * sizeof(float));
    loom_backend_copy(m->be, sc->freq, m->inv_freq, (size_t)pr * sizeof(float));
    m->mla_dec_pos = loom_xmalloc((size_t)T * sizeof *m->mla_dec_pos);
    return LOOM_OK;
}

/* Rows [i0, i1) of the step, one sequence at consecutive positions, attend decompressed: their queries
 * unabsorbed (mla_dq from z, roped as qk-wide heads); the context [0, last position] read from the latent
 * cache C tokens at a time, each chunk decompressed to per-head K (mla_dk) and V (mla_dv) in scratch and
 * attended with causal masking (a query sees the chunk's positions up to its own); the chunks' outputs
 * merged by their log-sum-exp. Output: (i1 - i0, Hr v) rows at out, v-space (o_proj's input). */
static void dec_run(loom_model_t *m, const loom_step_ops_t *so, int l, const loom_attn_args_t *abs,
                    const dec_scratch_t *sc, int i0, int i1, float *out) {
    const loom_model_config_t *c = &m->cfg;
    loom_backend_t *be = m->be;
    const loom_layer_t *ly = &m->layers[l];
    const int Hr = m->dims.n_heads, qk = c->qk_nope_head_dim + c->qk_rope_head_dim, v = c->v_head_dim;
    const int zdim = loom_blk_attn_mla_zdim(c, &m->dims), nr = i1 - i0, C = m->mla_dec_chunk;
    const int first = so->h_pos[i0], ctx = so->h_pos[i1 - 1] + 1;
    const int32_t *bt = so->d_bt + (int64_t)so->h_seq[i0] * so->max_blocks; /* device */
    loom_op_matmul(be, sc->q, m->mla_z + (int64_t)i0 * zdim, &ly->mla_dq, nr);
    loom_op_rope(be, sc->q, Hr * qk, nr, Hr, qk, so->d_pos + i0, sc->freq);
    for (int p0 = 0; p0 < ctx; p0 += C) {
        const int cn = LOOM_MIN(C, ctx - p0), j0 = LOOM_MAX(0, p0 - first); /* rows before j0 see none of it */
        loom_op_kv_gather(be, &ly->kv, bt, p0, cn, 1, c->head_dim, sc->rows);
        loom_op_matmul(be, sc->k, sc->rows, &ly->mla_dk, cn);
        loom_op_matmul(be, sc->v, sc->rows, &ly->mla_dv, cn);
        for (int j = j0; j < nr; j++) m->mla_dec_pos[j - j0] = LOOM_MIN(first + j - p0, cn - 1);
        loom_backend_upload(be, sc->pos, m->mla_dec_pos, (size_t)(nr - j0) * sizeof *sc->pos);
        const int merge = p0 > 0;
        loom_attn_args_t a = {
            .n = nr - j0,
            .n_heads = Hr,
            .n_kv_heads = Hr,
            .head_dim = qk,
            .scale = abs->scale,
            .q = sc->q + (int64_t)j0 * Hr * qk,
            .q_stride = Hr * qk,
            .out = (merge ? sc->o : out) + (int64_t)j0 * Hr * v,
            .out_stride = Hr * v,
            .kv = {.k = sc->k, .v = sc->v, .dtype = LOOM_DT_F32, .block_size = m->block_size, .v_dim = v},
            .block_size = m->block_size,
            .tok_seq = sc->seq,
            .tok_pos = sc->pos,
            .block_tables = sc->bt,
            .max_blocks = (cn + m->block_size - 1) / m->block_size,
            .max_ctx = cn,
            .lse = (merge ? sc->lse : sc->lse_run) + (int64_t)j0 * Hr,
        };
        loom_op_attention(be, &a);
        if (merge) /* online softmax across chunks: weigh each part by its exp(lse) */
            loom_op_attn_merge(be, out + (int64_t)j0 * Hr * v, sc->lse_run + (int64_t)j0 * Hr,
                               sc->o + (int64_t)j0 * Hr * v, sc->lse + (int64_t)j0 * Hr, nr - j0, Hr, v);
    }
}

/* Attention of a step with prefill rows: absorbed for the short runs (as loom_blk_attn_mla, over ranges
 * of rows), W_UV on their outputs into qkv; decompressed for the runs of opt.mla_prefill_rows rows or
 * more, straight into qkv's v-space rows. o_proj then reads qkv (the split layout). */
static loom_status_t attend_mixed(loom_model_t *m, const loom_step_ops_t *so, int l, const loom_attn_args_t *a,
                                  loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    const loom_layer_t *ly = &m->layers[l];
    const int n = so->n, Hr = m->dims.n_heads, D = c->head_dim, qd = m->qkv_dim, v = c->v_head_dim;
    dec_scratch_t sc;
    LOOM_CHECK(dec_scratch(m, &sc, err));
    /* absorbed ranges first: they read q from qkv, which the v-space rows then overwrite */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n;) {
            int e = dec_run_end(so, i);
            const int dec = e - i >= m->opt.mla_prefill_rows;
            if (!dec) /* and the short runs after it */
                for (int e2; e < n && (e2 = dec_run_end(so, e)) - e < m->opt.mla_prefill_rows;) e = e2;
            if (pass == 0 && !dec) {
                loom_attn_args_t r = *a;
                r.n = e - i;
                r.q = a->q + (int64_t)i * qd;
                r.out = a->out + (int64_t)i * Hr * D;
                r.tok_seq = a->tok_seq + i;
                r.tok_pos = a->tok_pos + i;
                loom_op_attention(m->be, &r);
            } else if (pass == 1 && dec) {
                dec_run(m, so, l, a, &sc, i, e, m->qkv + (int64_t)i * Hr * v);
            } else if (pass == 1) { /* W_UV of the absorbed rows, at most 65535 pairs a call */
                const int per = (65535 / Hr) * Hr;
                for (int p0 = i * Hr; p0 < e * Hr; p0 += per)
                    loom_op_moe_gemv(m->be, m->qkv + (size_t)p0 * v, m->att + (size_t)p0 * D, 1, m->mla_sel + p0,
                                     LOOM_MIN(per, e * Hr - p0), ly->mla_uv_table, ly->mla_uv[0].dtype, v, D);
            }
            i = e;
        }
    return LOOM_OK;
}

loom_status_t loom_blk_attn_mla(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    loom_backend_t *be = m->be;
    const loom_layer_t *ly = &m->layers[l];
    const int n = so->n, Hr = d->n_heads, D = c->head_dim, qd = m->qkv_dim;
    const int zdim = loom_blk_attn_mla_zdim(c, d),
              qoff = c->q_lora_rank ? c->q_lora_rank : Hr * (c->qk_nope_head_dim + c->qk_rope_head_dim);
    const loom_blk_linear_t za = {.w = &ly->wkv_a, .proj = LOOM_PROJ_QKV, .layer = l, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, so->adapters, &za, m->mla_z, m->xb, n, err));
    if (c->q_lora_rank) loom_op_head_rmsnorm(be, m->mla_z, zdim, n, 1, c->q_lora_rank, ly->q_norm, 1e-6f);
    loom_op_head_rmsnorm(be, m->mla_z + qoff, zdim, n, 1, c->kv_lora_rank, ly->k_norm, 1e-6f);
    const loom_blk_linear_t b = {.w = &ly->wqkv, .proj = LOOM_PROJ_QKV, .layer = l, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, so->adapters, &b, m->qkv, m->mla_z, n, err));
    float *q = m->qkv, *k = q + (size_t)Hr * D;
    /* RoPE, then the row written as K and as V (the same memory in the latent layout; the same values
     * either way, so the order of the two writes does not matter) */
    loom_op_rope(be, q, qd, n, Hr, D, so->d_pos, ly->inv_freq);
    loom_op_rope(be, k, qd, n, 1, D, so->d_pos, ly->inv_freq);
    loom_op_kv_write(be, &ly->kv, k, k, qd, so->d_slots, n, 1, D);
    loom_attn_args_t a = {
        .n = n,
        .n_heads = Hr,
        .n_kv_heads = 1,
        .head_dim = D,
        .scale = c->attn_scale,
        .q = q,
        .q_stride = qd,
        .out = m->att,
        .out_stride = Hr * D,
        .kv = ly->kv,
        .block_size = m->block_size,
        .tok_seq = so->d_seq,
        .tok_pos = so->d_pos,
        .block_tables = so->d_bt,
        .max_blocks = so->max_blocks,
        .max_ctx = so->max_ctx,
    };
    const loom_blk_linear_t o = {.w = &ly->wo, .reduce = !so->local, .proj = LOOM_PROJ_O, .layer = l, .expert = -1};
    if (ly->mla_dk.data && dec_any(m, so)) { /* some rows are a prefill chunk's */
        LOOM_CHECK(attend_mixed(m, so, l, &a, err));
        return loom_blk_linear(m, so->adapters, &o, m->xb2, m->qkv, n, err);
    }
    loom_op_attention(be, &a);
    if (!ly->mla_uv_table) return loom_blk_linear(m, so->adapters, &o, m->xb2, m->att, n, err);
    /* split: (token, head) pairs through W_UV into qkv (free once attention has read q), then o_proj;
     * at most 65535 pairs a call (the CUDA kernel's grid), whole tokens each */
    const int v = c->v_head_dim, per = (65535 / Hr) * Hr;
    for (int p0 = 0; p0 < n * Hr; p0 += per)
        loom_op_moe_gemv(be, m->qkv + (size_t)p0 * v, m->att + (size_t)p0 * D, 1, m->mla_sel + p0,
                         LOOM_MIN(per, n * Hr - p0), ly->mla_uv_table, ly->mla_uv[0].dtype, v, D);
    return loom_blk_linear(m, so->adapters, &o, m->xb2, m->qkv, n, err);
}

/* The attention block, shared by every family: its weights (q/k/v stacked
 * for this rank's heads, biases, q/k norms, o) and its run: qkv -> bias ->
 * q/k norm -> RoPE + KV write -> attention (sliding window, sinks, soft
 * cap) -> o (+ bias) -> all-reduce. A family's extras (sinks, o's bias)
 * are fields of its layer the loader of the family fills. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/safetensors.h"
#include "common/util.h"
#include "common/weights_check.h"
#include "worker/engine/model_impl.h"

/* An fp8 KV cache's per-tensor scales of this layer's K and V: the
 * checkpoint's `k_scale` and `v_scale` beside the q projection
 * (model.layers.N.self_attn.k_scale, the names FP8-KV checkpoints carry for
 * vLLM), scalars; 1 where it has none. Other cache dtypes ignore them. */
static loom_status_t load_fp8_kv_scales(loom_loader_t *L, const char *qname, loom_layer_t *ly, loom_err_t *err) {
    ly->kv.fp8_scale[0] = ly->kv.fp8_scale[1] = 0.0f;
    if (L->m->opt.kv_dtype != LOOM_DT_F8_E4M3) return LOOM_OK;
    char prefix[256], name[300];
    snprintf(prefix, sizeof prefix, "%s", qname);
    char *end = strstr(prefix, ".weight");
    if (end) *end = 0;
    end = strrchr(prefix, '.'); /* drop q_proj / qkv_proj */
    if (!end) return LOOM_OK;
    *end = 0;
    static const char *const which[2] = {"k_scale", "v_scale"};
    for (int i = 0; i < 2; i++) {
        snprintf(name, sizeof name, "%s.%s", prefix, which[i]);
        const loom_st_tensor_t *t = loom_st_find(L->st, name);
        if (!t) continue;
        int64_t numel = 1;
        for (int d = 0; d < t->n_dims; d++) numel *= t->shape[d];
        if (numel != 1)
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s: a per-tensor KV scale has one element, "
                                "not %lld", name, t->file, (long long)numel);
        float v = 0.0f;
        LOOM_CHECK(loom_st_read_f32(L->st, t, 0, 1, 0, 1, &v, err));
        if (!(v > 0.0f && v < INFINITY))
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s: the KV scale %g is not a positive finite "
                                "number", name, t->file, (double)v);
        ly->kv.fp8_scale[i] = v;
    }
    return LOOM_OK;
}

loom_status_t loom_blk_attn_load(loom_loader_t *L, int gl, loom_layer_t *ly, loom_err_t *err) {
    loom_model_t *m = L->m;
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    int hd = c->head_dim, dim = c->dim;
    char name[256], pq[256], pk[256], pv[256];
    loom_status_t s;
#define TNAME(buf, role) loom_load_name(L, gl, role, -1, buf, sizeof buf)

    /* q, k, v: this rank's heads stacked into one (qkv_dim, dim) matrix */
    int64_t qrows = (int64_t)c->n_heads * hd, kvrows = (int64_t)c->n_kv_heads * hd;
    loom_lin_part_t qkv[3];
    if (c->fused_qkv) { /* Phi-3: one qkv_proj of q rows, then k rows, then v rows; this rank's heads of each */
        const char *f = TNAME(pq, LOOM_TN_QKV);
        int64_t all = qrows + 2 * kvrows;
        qkv[0] = (loom_lin_part_t){f, all, (int64_t)d->q_head_begin * hd, (int64_t)d->n_heads * hd};
        qkv[1] = (loom_lin_part_t){f, all, qrows + (int64_t)d->kv_head_begin * hd, (int64_t)d->n_kv_heads * hd};
        qkv[2] = (loom_lin_part_t){f, all, qrows + kvrows + (int64_t)d->kv_head_begin * hd,
                                   (int64_t)d->n_kv_heads * hd};
    } else {
        qkv[0] = (loom_lin_part_t){TNAME(pq, LOOM_TN_Q), qrows, (int64_t)d->q_head_begin * hd, (int64_t)d->n_heads * hd};
        qkv[1] = (loom_lin_part_t){TNAME(pk, LOOM_TN_K), kvrows, (int64_t)d->kv_head_begin * hd,
                                   (int64_t)d->n_kv_heads * hd};
        qkv[2] = (loom_lin_part_t){TNAME(pv, LOOM_TN_V), kvrows, (int64_t)d->kv_head_begin * hd,
                                   (int64_t)d->n_kv_heads * hd};
    }
    /* partial rotary: the q and k heads' rows to their kernel slots (rotary_slot) */
    L->rotary_rows = c->rotary_dim < hd ? (int64_t)(d->n_heads + d->n_kv_heads) * hd : 0;
    snprintf(name, sizeof name, "model.layers.%d.self_attn.qkv", gl);
    s = loom_load_linear(L, &ly->wqkv, name, qkv, 3, dim, 0, dim, err);
    L->rotary_rows = 0;
    LOOM_CHECK(s);
    if (c->attention_bias) {
        /* the biases of the same rows, stacked the same way */
        float *h = loom_load_staging(L, (size_t)m->qkv_dim);
        if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading layer %d", gl);
        LOOM_CHECK(loom_load_read_slice(L, TNAME(name, LOOM_TN_Q_BIAS), qrows, (int64_t)d->q_head_begin * hd,
                                        (int64_t)d->n_heads * hd, h, err));
        LOOM_CHECK(loom_load_read_slice(L, TNAME(name, LOOM_TN_K_BIAS), kvrows, (int64_t)d->kv_head_begin * hd,
                                        (int64_t)d->n_kv_heads * hd, h + (size_t)d->n_heads * hd, err));
        LOOM_CHECK(loom_load_read_slice(L, TNAME(name, LOOM_TN_V_BIAS), kvrows, (int64_t)d->kv_head_begin * hd,
                                        (int64_t)d->n_kv_heads * hd, h + (size_t)(d->n_heads + d->n_kv_heads) * hd,
                                        err));
        if (c->rotary_dim < hd)
            loom_load_rotary_permute_f32(h, (int64_t)(d->n_heads + d->n_kv_heads) * hd, 1, hd, c->rotary_dim,
                                         c->rope_attn_factor);
        snprintf(name, sizeof name, "model.layers.%d.self_attn.q/k/v biases", gl);
        if (c->rotary_dim < hd)
            LOOM_CHECK(loom_weights_check_finite(name, "the rotary attention factor", h,
                                                 (size_t)(d->n_heads + d->n_kv_heads) * (size_t)hd, err));
        LOOM_CHECK(loom_load_upload_host(L, h, (size_t)m->qkv_dim, &ly->bqkv, name, err));
    }
    if (c->qk_norm) { /* Qwen3: one gain per head dimension, shared by the heads */
        LOOM_CHECK(loom_load_upload_norm(L, TNAME(name, LOOM_TN_Q_NORM), hd, &ly->q_norm, err));
        LOOM_CHECK(loom_load_upload_norm(L, TNAME(name, LOOM_TN_K_NORM), hd, &ly->k_norm, err));
    }
    ly->window = loom_model_config_layer_window(c, gl);
    LOOM_CHECK(load_fp8_kv_scales(L, c->fused_qkv ? TNAME(pq, LOOM_TN_QKV) : TNAME(pq, LOOM_TN_Q), ly, err));

    /* o: row-parallel, this rank's input columns */
    loom_lin_part_t o = {TNAME(pk, LOOM_TN_O), dim, 0, dim};
    LOOM_CHECK(loom_load_linear(L, &ly->wo, pk, &o, 1, qrows, (int64_t)d->q_head_begin * hd,
                                (int64_t)d->n_heads * hd, err));
#undef TNAME
    return LOOM_OK;
}

loom_status_t loom_blk_attn(loom_model_t *m, const loom_step_ops_t *so, int l, loom_err_t *err) {
    const loom_model_config_t *c = &m->cfg;
    const loom_shard_dims_t *d = &m->dims;
    loom_backend_t *be = m->be;
    const loom_layer_t *ly = &m->layers[l];
    const int n = so->n, hd = c->head_dim;
    const int nh = d->n_heads, nkv = d->n_kv_heads, qd = m->qkv_dim;
    /* xb holds rmsnorm(x) * attn_norm */
    const loom_blk_linear_t qkv = {.w = &ly->wqkv, .bias = ly->bqkv, .proj = LOOM_PROJ_QKV, .layer = l, .expert = -1};
    LOOM_CHECK(loom_blk_linear(m, so->adapters, &qkv, m->qkv, m->xb, n, err));
    float *q = m->qkv, *k = m->qkv + nh * hd, *v = k + nkv * hd;
    if (ly->q_norm) {
        loom_op_head_rmsnorm(be, q, qd, n, nh, hd, ly->q_norm, c->norm_eps);
        loom_op_head_rmsnorm(be, k, qd, n, nkv, hd, ly->k_norm, c->norm_eps);
    }
    loom_op_rope_kv_write(be, q, k, v, qd, n, nh, nkv, hd, so->d_pos, ly->inv_freq, &ly->kv, so->d_slots);
    loom_attn_args_t a = {
        .n = n,
        .n_heads = nh,
        .n_kv_heads = nkv,
        .head_dim = hd,
        /* yarn and longrope scale q and k by their attention factor (with partial rotary
         * folded into the rotary rows at load); Gemma sets the scale */
        .scale = (c->rotary_dim < hd ? 1.0f : c->rope_attn_factor * c->rope_attn_factor) *
             (c->query_scale > 0 ? c->query_scale : 1.0f / sqrtf((float)hd)),
        .q = q,
        .q_stride = qd,
        .out = m->att,
        .out_stride = nh * hd,
        .kv = ly->kv,
        .block_size = m->block_size,
        .tok_seq = so->d_seq,
        .tok_pos = so->d_pos,
        .block_tables = so->d_bt,
        .max_blocks = so->max_blocks,
        .max_ctx = so->max_ctx,
        .window = ly->window,
        .softcap = c->attn_softcap,
        .sinks = ly->sinks,
    };
    loom_op_attention(be, &a);
    const loom_blk_linear_t o = {.w = &ly->wo, .bias = ly->bo, .reduce = 1, .proj = LOOM_PROJ_O, .layer = l, .expert = -1};
    return loom_blk_linear(m, so->adapters, &o, m->xb2, m->att, n, err);
}

/* The RoPE table of the kernels: pair (j, j + head_dim/2) turns at pos x
 * out[j]. With partial rotary the rows of q and k were permuted at load
 * (rotary_perm) so that the first rotary_dim/2 pairs are the rotary ones,
 * with the frequencies of a head rotary_dim wide; the rest get 0, which
 * leaves them as they are. */
void loom_blk_attn_rope_table(const loom_model_config_t *c, float *out) {
    int half = c->head_dim / 2, rd = c->rotary_dim;
    for (int j = 0; j < half; j++) {
        if (j >= rd / 2) {
            out[j] = 0.0f;
            continue;
        }
        double inv = pow((double)c->rope_theta, -2.0 * j / (double)rd);
        if (c->rope_scaling == LOOM_ROPE_LONGROPE) {
            inv /= c->rope_ext_factor[j];
        } else if (c->rope_scaling == LOOM_ROPE_LINEAR) {
            inv /= c->rope_factor;
        } else if (c->rope_scaling == LOOM_ROPE_YARN) {
            /* NTK-by-parts: dimensions that turn fewer than beta_slow times
             * over the original context are interpolated (/ factor), those
             * that turn more than beta_fast times kept, a linear ramp between */
            double d = rd, base = c->rope_theta, orig = c->rope_orig_max_pos;
            double lo = d * log(orig / (c->rope_beta_fast * 2.0 * M_PI)) / (2.0 * log(base));
            double hi = d * log(orig / (c->rope_beta_slow * 2.0 * M_PI)) / (2.0 * log(base));
            if (c->rope_truncate) {
                lo = floor(lo);
                hi = ceil(hi);
            }
            if (lo < 0) lo = 0;
            if (hi > d - 1) hi = d - 1;
            if (lo == hi) hi += 0.001;
            double ramp = ((double)j - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double extrap = 1.0 - ramp; /* weight of the unscaled frequency */
            inv = inv / c->rope_factor * (1.0 - extrap) + inv * extrap;
        } else if (c->rope_scaling == LOOM_ROPE_LLAMA3) {
            double orig = c->rope_orig_max_pos, factor = c->rope_factor;
            double lo = c->rope_low_freq_factor, hi = c->rope_high_freq_factor;
            double wavelen = 2.0 * M_PI / inv;
            if (wavelen > orig / lo) {
                inv = inv / factor;
            } else if (wavelen >= orig / hi) {
                double smooth = (orig / wavelen - lo) / (hi - lo);
                inv = (1.0 - smooth) * inv / factor + smooth * inv;
            }
        }
        out[j] = (float)inv;
    }
}
/* The checkpoint loader's shared part: host staging, block and slice reads
 * (with the NaN/Inf scan), uploads, the partial-rotary permutes, the one
 * path every matmul weight takes (loom_load_linear: stored quantized,
 * float, or quantized on load, sliced for a TP rank), the TP split of the
 * intermediate size, the embedding's scaling and the read estimate. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fp8.h"
#include "common/log.h"
#include "common/util.h"
#include "worker/engine/model_impl.h"
#include "worker/qweights.h"

float *loom_load_staging(loom_loader_t *L, size_t n) {
    if (n > L->tmp_cap) {
        free(L->tmp);
        L->tmp = malloc(n * sizeof(float));
        L->tmp_cap = L->tmp ? n : 0;
    }
    return L->tmp;
}

/* The cheap scan that refuses NaN and Inf weights, naming the tensor. One
 * pass over what was just read, next to the conversion that read it. */
loom_status_t loom_load_check_finite(const float *x, size_t n, const char *name, const char *file, loom_err_t *err) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s holds %s (element %zu of the slice read)",
                                name, file ? file : "the checkpoint", isnan(x[i]) ? "NaN" : "Inf", i);
    return LOOM_OK;
}

/* Reads rows [r0, r0+nr) x cols [c0, c0+nc) of a (rows, cols) tensor into dst. */
loom_status_t loom_load_read_block(loom_loader_t *L, const char *name, int64_t rows, int64_t cols,
                                int64_t r0, int64_t nr, int64_t c0, int64_t nc, float *dst,
                                loom_err_t *err) {
    const loom_st_tensor_t *t = loom_st_find(L->st, name);
    int64_t shape[2] = {rows, cols};
    int64_t ncols = cols > 0 ? nc : rows;
    if (t && t->dtype == LOOM_DT_F8_E4M3 && L->m->cfg.ckpt_quant == LOOM_CKPT_FP8 && cols > 0) {
        /* an FP8 block checkpoint (DeepSeek-V3): codes x the weight_scale_inv of each one's block */
        char sname[320];
        snprintf(sname, sizeof sname, "%s_scale_inv", name);
        LOOM_CHECK(loom_st_get_dtype(L->st, name, LOOM_DT_F8_E4M3, 2, shape, &t, err));
        LOOM_CHECK(loom_st_read_fp8(L->st, t, loom_st_find(L->st, sname), L->m->cfg.ckpt_block[0],
                                    L->m->cfg.ckpt_block[1], r0, nr, c0, ncols, dst, err));
        return loom_load_check_finite(dst, (size_t)nr * (size_t)ncols, name, t->file, err);
    }
    LOOM_CHECK(loom_st_get(L->st, name, cols > 0 ? 2 : 1, cols > 0 ? shape : &rows, &t, err));
    LOOM_CHECK(loom_st_read_f32(L->st, t, r0, nr, c0, ncols, dst, err));
    return loom_load_check_finite(dst, (size_t)nr * (size_t)ncols, name, t->file, err);
}

/* Reads elements [e0, e0+ne) of a 1-D tensor of n elements into dst. */
loom_status_t loom_load_read_slice(loom_loader_t *L, const char *name, int64_t n, int64_t e0, int64_t ne, float *dst,
                                loom_err_t *err) {
    const loom_st_tensor_t *t;
    LOOM_CHECK(loom_st_get(L->st, name, 1, &n, &t, err));
    LOOM_CHECK(loom_st_read_f32(L->st, t, 0, 1, e0, ne, dst, err));
    return loom_load_check_finite(dst, (size_t)ne, name, t->file, err);
}

/* A float vector of the host to the device (norm gains, biases, sinks). */
loom_status_t loom_load_upload_host(loom_loader_t *L, const float *h, size_t n, float **out,
                                 const char *what, loom_err_t *err) {
    *out = loom_backend_alloc(L->m->be, n * sizeof(float));
    if (!*out) return loom_err_set(err, LOOM_ERR_NOMEM, "out of device memory for %s", what);
    loom_backend_upload(L->m->be, *out, h, n * sizeof(float));
    L->m->weight_bytes += n * sizeof(float);
    return LOOM_OK;
}

loom_status_t loom_load_upload_vec_add(loom_loader_t *L, const char *name, int64_t n, float add,
                                    float **out, loom_err_t *err) {
    float *h = loom_load_staging(L, (size_t)n);
    if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading %s", name);
    LOOM_CHECK(loom_load_read_block(L, name, n, 0, 0, 1, 0, n, h, err));
    for (int64_t i = 0; add != 0.0f && i < n; i++)
        h[i] += add;
    return loom_load_upload_host(L, h, (size_t)n, out, name, err);
}

loom_status_t loom_load_upload_weight(loom_loader_t *L, loom_weight_t *w, int64_t rows, int64_t cols,
                                   const char *what, loom_err_t *err) {
    loom_status_t s = loom_weight_upload(L->m->be, w, rows, cols, L->tmp, err);
    if (s == LOOM_ERR_NOMEM)
        return loom_err_set(err, s, "out of device memory uploading %s (%lld x %lld)", what,
                            (long long)rows, (long long)cols);
    if (s == LOOM_OK) {
        L->m->weight_bytes += loom_weight_bytes(w);
        L->m->matmul_bytes += loom_weight_bytes(w);
    }
    return s;
}

loom_status_t loom_load_upload_qweight(loom_loader_t *L, loom_weight_t *w, const loom_qtensor_t *t, const char *what,
                                    loom_err_t *err) {
    loom_status_t s = loom_weight_upload_quant(L->m->be, w, t, err);
    if (s == LOOM_ERR_NOMEM)
        return loom_err_set(err, s, "out of device memory uploading %s (%lld x %lld)", what, (long long)t->rows,
                            (long long)t->cols);
    if (s < 0) {
        loom_err_t e = *err;
        return loom_err_set(err, s, "%s: %s", what, e.msg);
    }
    L->m->weight_bytes += loom_weight_bytes(w);
    L->m->matmul_bytes += loom_weight_bytes(w);
    L->m->n_quantized++;
    return LOOM_OK;
}

/* An RMSNorm gain: Gemma stores w and scales by (1 + w), folded in here. */
loom_status_t loom_load_upload_norm(loom_loader_t *L, const char *name, int64_t n, float **out, loom_err_t *err) {
    return loom_load_upload_vec_add(L, name, n, L->m->cfg.gemma ? 1.0f : 0.0f, out, err);
}

/* Partial rotary (Phi-4-mini): Transformers turns dims [0, rd) of each q
 * and k head, pairing o with o + rd/2, and passes [rd, hd) through; the
 * kernels pair p with p + hd/2. So dim o of a head is stored at
 * rotary_slot(o): the rotary halves at [0, rd/2) and [hd/2, hd/2 + rd/2),
 * the others in the gaps, whose frequencies are 0. q.k is unchanged (q and
 * k are permuted alike; v is not). Longrope's and yarn's attention factor
 * multiplies cos and sin, so only the rotary dims: it is folded into their
 * rows here instead of the attention scale. */
static int rotary_slot(int o, int hd, int rd) {
    int half = hd / 2, r = rd / 2, pass = (hd - rd) / 2;
    if (o < r) return o;
    if (o < rd) return half + o - r;
    if (o < rd + pass) return r + o - rd;
    return half + r + o - rd - pass;
}

/* Rows [0, nrows) of a (., cols) float matrix are whole heads of hd rows:
 * each head's rows moved to their slots, the rotary ones times af. */
void loom_load_rotary_permute_f32(float *h, int64_t nrows, int64_t cols, int hd, int rd, float af) {
    float *tmp = loom_xmalloc((size_t)hd * (size_t)cols * sizeof(float));
    for (int64_t r0 = 0; r0 < nrows; r0 += hd) {
        float *head = h + (size_t)r0 * (size_t)cols;
        memcpy(tmp, head, (size_t)hd * (size_t)cols * sizeof(float));
        for (int o = 0; o < hd; o++) {
            float *dst = head + (size_t)rotary_slot(o, hd, rd) * (size_t)cols, *src = tmp + (size_t)o * (size_t)cols;
            for (int64_t c = 0; c < cols; c++) dst[c] = o < rd ? src[c] * af : src[c];
        }
    }
    free(tmp);
}

/* The same on a quantized tensor: codes, scales (and mins) row by row; the
 * factor scales a row's scales and mins. */
static void rotary_permute_q(loom_qtensor_t *t, int64_t nrows, int hd, int rd, float af) {
    size_t cb = loom_qtensor_code_bytes(t) / (size_t)t->rows, sc = loom_qtensor_scale_count(t) / (size_t)t->rows;
    uint8_t *tq = loom_xmalloc((size_t)hd * cb);
    float *ts = loom_xmalloc((size_t)hd * sc * sizeof(float)), *tm = loom_xmalloc((size_t)hd * sc * sizeof(float));
    for (int64_t r0 = 0; r0 < nrows; r0 += hd) {
        uint8_t *q = (uint8_t *)t->q + (size_t)r0 * cb;
        float *sv = t->scales + (size_t)r0 * sc, *mv = t->mins ? t->mins + (size_t)r0 * sc : NULL;
        memcpy(tq, q, (size_t)hd * cb);
        memcpy(ts, sv, (size_t)hd * sc * sizeof(float));
        if (mv) memcpy(tm, mv, (size_t)hd * sc * sizeof(float));
        for (int o = 0; o < hd; o++) {
            size_t p = (size_t)rotary_slot(o, hd, rd);
            float f = o < rd ? af : 1.0f;
            memcpy(q + p * cb, tq + (size_t)o * cb, cb);
            for (size_t j = 0; j < sc; j++) {
                sv[p * sc + j] = ts[(size_t)o * sc + j] * f;
                if (mv) mv[p * sc + j] = tm[(size_t)o * sc + j] * f;
            }
        }
    }
    free(tq);
    free(ts);
    free(tm);
}
loom_status_t loom_load_float_cols(loom_loader_t *L, const char *what, int64_t cols, int64_t c0, int64_t nc,
                                loom_float_cols_t *fc, loom_err_t *err) {
    loom_quant_spec_t q = L->m->opt.quant;
    if (q.quant == LOOM_QUANT_Q4 && cols % q.group) {
        LOOM_WARN(
            "%s: 4-bit group %d does not divide its %lld input columns; quantizing it as int8",
            what, q.group, (long long)cols);
        q = (loom_quant_spec_t){.quant = LOOM_QUANT_INT8};
    }
    if (q.quant == LOOM_QUANT_Q4 && (c0 % q.group || nc % q.group))
        return loom_err_set(
            err, LOOM_ERR_INVALID_ARGUMENT,
            "%s: this tensor-parallel rank's input columns [%lld, %lld) are not whole 4-bit groups "
            "of %d; use fewer TP ranks or a smaller group",
            what, (long long)c0, (long long)(c0 + nc), q.group);
    int whole_rows = q.quant != LOOM_QUANT_NONE && q.quant != LOOM_QUANT_Q4 && nc != cols;
    *fc = (loom_float_cols_t){.q = q,
                         .cols = cols,
                         .c0 = c0,
                         .nc = nc,
                         .whole_rows = whole_rows,
                         .rc0 = whole_rows ? 0 : c0,
                         .rnc = whole_rows ? cols : nc};
    return LOOM_OK;
}

/* Uploads the (rows, fc->rnc) float matrix in the staging buffer as w,
 * quantized as fc says, keeping input columns [c0, c0+nc). */
loom_status_t loom_load_upload_float_linear(loom_loader_t *L, loom_weight_t *w, const char *what,
                                         const loom_float_cols_t *fc, int64_t rows, loom_err_t *err) {
    if (fc->q.quant == LOOM_QUANT_NONE) return loom_load_upload_weight(L, w, rows, fc->nc, what, err);
    loom_qtensor_t qt = {0};
    LOOM_CHECK(loom_quantize(&fc->q, L->tmp, rows, fc->rnc, &qt, err));
    if (fc->whole_rows) {
        loom_qtensor_t full = qt;
        loom_qw_slice_cols(&full, fc->c0, fc->nc, &qt);
        loom_qtensor_free(&full);
    }
    loom_status_t s = loom_load_upload_qweight(L, w, &qt, what, err);
    loom_qtensor_free(&qt);
    return s;
}

/* Loads one matmul weight: the row blocks of n parts stacked (q/k/v, gate/up:
 * column-parallel), restricted to input columns [c0, c0+nc) of cols (o, down:
 * row-parallel). Linears the checkpoint stores quantized are sliced as stored;
 * float ones are quantized here when opt.quant asks. Per-channel schemes
 * (int8, fp8) quantize whole rows before taking the columns, so every grid
 * gets the same scales; 4-bit groups are local, so a rank quantizes only its
 * columns, which must be whole groups. A 4-bit group that does not divide the
 * linear's input columns falls back to int8 for that linear (logged). */
loom_status_t loom_load_linear(loom_loader_t *L, loom_weight_t *w, const char *what, const loom_lin_part_t *parts, int n,
                                 int64_t cols, int64_t c0, int64_t nc, loom_err_t *err) {
    loom_model_t *m = L->m;
    char name[300];
    int nq = 0;
    int64_t rows = 0;
    for (int i = 0; i < n; i++) {
        nq += loom_qw_stored(L->st, parts[i].prefix);
        rows += parts[i].nr;
    }
    loom_status_t s = LOOM_OK;
    loom_qtensor_t qt = {0};
    if (nq) {
        if (nq != n)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: the checkpoint stores some of its parts quantized and some not", what);
        loom_qtensor_t qp[3] = {{0}};
        LOOM_ASSERT(n <= 3);
        for (int i = 0; i < n && s == LOOM_OK; i++)
            s = loom_qw_read(L->st, &m->cfg, parts[i].prefix, parts[i].rows, cols, parts[i].r0, parts[i].nr, c0, nc,
                             &qp[i], err);
        for (int i = 0; i < n && s == LOOM_OK; i++) {
            snprintf(name, sizeof name, "%s.scales", parts[i].prefix);
            s = loom_load_check_finite(qp[i].scales, loom_qtensor_scale_count(&qp[i]), name, NULL, err);
            if (s == LOOM_OK && qp[i].mins) {
                snprintf(name, sizeof name, "%s.mins", parts[i].prefix);
                s = loom_load_check_finite(qp[i].mins, loom_qtensor_scale_count(&qp[i]), name, NULL, err);
            }
        }
        if (s == LOOM_OK) s = loom_qw_stack_rows(qp, n, what, &qt, err);
        for (int i = 0; i < n; i++) loom_qtensor_free(&qp[i]);
        if (s == LOOM_OK && L->rotary_rows)
            rotary_permute_q(&qt, L->rotary_rows, m->cfg.head_dim, m->cfg.rotary_dim, m->cfg.rope_attn_factor);
        if (s == LOOM_OK) s = loom_load_upload_qweight(L, w, &qt, what, err);
        loom_qtensor_free(&qt);
        return s;
    }

    loom_float_cols_t fc;
    LOOM_CHECK(loom_load_float_cols(L, what, cols, c0, nc, &fc, err));
    float *h = loom_load_staging(L, (size_t)rows * (size_t)fc.rnc);
    if (!h) return loom_err_set(err, LOOM_ERR_NOMEM, "out of host memory loading %s", what);
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "%s.weight", parts[i].prefix);
        LOOM_CHECK(loom_load_read_block(L, name, parts[i].rows, cols, parts[i].r0, parts[i].nr, fc.rc0,
                              fc.rnc, h + (size_t)off * (size_t)fc.rnc, err));
        off += parts[i].nr;
    }
    if (L->rotary_rows)
        loom_load_rotary_permute_f32(h, L->rotary_rows, fc.rnc, m->cfg.head_dim, m->cfg.rotary_dim,
                           m->cfg.rope_attn_factor);
    return loom_load_upload_float_linear(L, w, what, &fc, rows, err);
}

/* With quantized weights, the intermediate size is split across TP ranks on
 * 32-column blocks (whole 4-bit groups when the group divides it) instead of
 * evenly: the CPU backend rounds activations to int8 per 32 columns, and a
 * down_proj slice that starts on a block boundary sees exactly the blocks
 * (and groups) one process sees, so every grid gives the same ids. */
#define QUANT_SPLIT_COLS 32

loom_status_t loom_load_align_split(const loom_model_config_t *cfg, const loom_shard_spec_t *spec,
                                 const loom_model_options_t *opt, int hidden, int *begin, int *len,
                                 loom_err_t *err) {
    /* an FP8 block checkpoint is float once loaded (dequantized): split as one */
    int quantized = opt->quant.quant != LOOM_QUANT_NONE ||
                    (cfg->ckpt_quant != LOOM_CKPT_FLOAT && cfg->ckpt_quant != LOOM_CKPT_FP8);
    if (!quantized || spec->tp_size == 1) return LOOM_OK;
    int group = opt->quant.quant == LOOM_QUANT_Q4 ? opt->quant.group : cfg->ckpt_group;
    int unit = group > QUANT_SPLIT_COLS && hidden % group == 0 ? group : QUANT_SPLIT_COLS;
    int units = (hidden + unit - 1) / unit, ub, ul;
    if (units < spec->tp_size)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "intermediate size %d has %d blocks of %d columns, fewer than %d TP ranks: use fewer "
                            "ranks for quantized weights",
                            hidden, units, unit, spec->tp_size);
    loom_split_range(units, spec->tp_size, spec->tp_rank, &ub, &ul);
    *begin = ub * unit;
    *len = LOOM_MIN((ub + ul) * unit, hidden) - *begin;
    return LOOM_OK;
}

loom_status_t loom_load_align_hidden_split(const loom_model_config_t *cfg, const loom_shard_spec_t *spec,
                                        const loom_model_options_t *opt, loom_shard_dims_t *d, loom_err_t *err) {
    return loom_load_align_split(cfg, spec, opt, cfg->hidden_dim, &d->hidden_begin, &d->hidden, err);
}

/* x rounded to the precision of dtype (BF16 / F16: nearest even), as the
 * checkpoint's dtype holds it. */
static float round_to(float x, loom_dtype_t dt) {
    if (dt == LOOM_DT_BF16) {
        uint32_t u;
        memcpy(&u, &x, 4);
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        memcpy(&x, &u, 4);
        return x;
    }
    if (dt == LOOM_DT_F16) return loom_f16_to_f32(loom_f32_to_f16(x));
    return x;
}

/* Gemma scales the embedding rows by sqrt(hidden_size), the factor and the
 * product in the embedding's dtype (Gemma3TextScaledWordEmbedding); done
 * once here on the table. A tied LM head reads the unscaled checkpoint. */
void loom_load_scale_embedding(float *h, size_t n, float scale, loom_dtype_t dt) {
    const float s = round_to(scale, dt);
    for (size_t i = 0; i < n; i++) h[i] = round_to(h[i] * s, dt);
}

/* Bytes this shard will read from the checkpoint, for the progress line:
 * its layers' tensors split tp ways, the embedding whole, the head (or a
 * tied embedding) split tp ways. An estimate (norms are read whole,
 * replicated KV heads too), so the line says "~" until done. */
uint64_t loom_load_read_estimate(const loom_model_config_t *cfg, const loom_st_t *st, const loom_shard_spec_t *spec) {
    uint64_t total = 0, tp = (uint64_t)(spec->tp_size > 0 ? spec->tp_size : 1);
    int has_lm_head = 0;
    for (int i = 0; i < loom_st_count(st); i++) has_lm_head |= !strncmp(loom_st_at(st, i)->name, "lm_head", 7);
    for (int i = 0; i < loom_st_count(st); i++) {
        const loom_st_tensor_t *t = loom_st_at(st, i);
        int layer;
        if (sscanf(t->name, "model.layers.%d.", &layer) == 1) {
            if (layer >= spec->layer_begin && layer < spec->layer_end) total += t->nbytes / tp;
        } else if (!strncmp(t->name, "model.embed_tokens", 18)) {
            if (spec->has_embed) total += t->nbytes;
            if (spec->has_head && cfg->tie_embeddings && !has_lm_head) total += t->nbytes / tp;
        } else if (!strncmp(t->name, "lm_head", 7)) {
            if (spec->has_head) total += t->nbytes / tp;
        } else if (spec->has_head) {
            total += t->nbytes; /* the final norm */
        }
    }
    return total;
}

const char *loom_load_name(loom_loader_t *L, int gl, loom_tn_role_t role, int expert, char *buf, size_t size) {
    const char *s = loom_arch_tensor_name(L->m->arch, &L->m->cfg, gl, role, expert, buf, size);
    LOOM_ASSERT(s != NULL); /* the family's load_layer asks only for the roles its table has */
    return s;
}

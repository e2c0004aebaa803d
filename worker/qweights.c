/* Quantized linears from checkpoints into the canonical host layout, and the
 * slicing and stacking the loader needs (see qweights.h). Packing orders of
 * the foreign formats are documented in docs/model-format.md. */
#include "worker/qweights.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* AWQ (GEMM) packs 8 output columns per int32 word in the order
 * 0, 2, 4, 6, 1, 3, 5, 7: nibble k holds column k_order[k]. The inverse:
 * column j sits in nibble k_awq_nibble[j]. */
static const int k_awq_nibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};

static void qt_alloc(loom_qtensor_t *t, loom_quant_t quant, int64_t rows, int64_t cols, int group, int with_min) {
    memset(t, 0, sizeof *t);
    t->quant = quant;
    t->rows = rows;
    t->cols = cols;
    t->group = group;
    t->owned = 1;
    t->q = loom_xcalloc(loom_qtensor_code_bytes(t) ? loom_qtensor_code_bytes(t) : 1, 1);
    size_t ns = loom_qtensor_scale_count(t);
    t->scales = loom_xcalloc(ns ? ns : 1, sizeof(float));
    if (with_min) t->mins = loom_xcalloc(ns ? ns : 1, sizeof(float));
}

static void set_code4(loom_qtensor_t *t, int64_t r, int64_t c, unsigned v) {
    uint8_t *b = (uint8_t *)t->q + (size_t)r * (size_t)(t->cols / 2) + (size_t)(c / 2);
    *b = (c & 1) ? (uint8_t)((*b & 0x0f) | (v << 4)) : (uint8_t)((*b & 0xf0) | (v & 15));
}

int loom_qw_stored(const loom_st_t *st, const char *prefix) {
    char name[300];
    snprintf(name, sizeof name, "%s.qweight", prefix);
    return loom_st_find(st, name) != NULL;
}

static const char *shape_str(const loom_st_tensor_t *t, char *buf, size_t cap) {
    size_t n = 0;
    n += (size_t)snprintf(buf + n, cap - n, "[");
    for (int i = 0; i < t->n_dims && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
    return buf;
}

/* Finds prefix.suffix and checks its dtype (one of two) and 2-D shape. */
static loom_status_t get2(loom_st_t *st, const char *prefix, const char *suffix, const char *need, int dt_mask,
                          int64_t d0, int64_t d1, const loom_st_tensor_t **out, loom_err_t *err) {
    char name[300], have[96];
    snprintf(name, sizeof name, "%s.%s", prefix, suffix);
    const loom_st_tensor_t *t = loom_st_find(st, name);
    if (!t) return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' is missing (%s.qweight is quantized)", name, prefix);
    if (!(dt_mask & (1 << t->dtype)))
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s has dtype %s, expected %s", name, t->file,
                            loom_dtype_name(t->dtype), need);
    if (t->n_dims != 2 || t->shape[0] != d0 || t->shape[1] != d1)
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s has shape %s, expected [%lld, %lld]", name,
                            t->file, shape_str(t, have, sizeof have), (long long)d0, (long long)d1);
    *out = t;
    return LOOM_OK;
}

#define FLOAT_MASK ((1 << LOOM_DT_F32) | (1 << LOOM_DT_F16) | (1 << LOOM_DT_BF16))

static loom_status_t check_group_slice(const char *prefix, int group, int64_t c0, int64_t nc, loom_err_t *err) {
    if (c0 % group || nc % group)
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "linear '%s': this tensor-parallel rank's input columns [%lld, %lld) are not whole "
                            "groups of %d; use fewer TP ranks",
                            prefix, (long long)c0, (long long)(c0 + nc), group);
    return LOOM_OK;
}

/* Loom's own layout: qweight I8 (INT8), U8 (Q4, two codes a byte) or
 * F8_E4M3 (FP8); scales F32 (rows, groups); mins (Q4 with min). */
static loom_status_t read_loom(loom_st_t *st, const char *prefix, int64_t rows, int64_t cols, int64_t r0, int64_t nr,
                               int64_t c0, int64_t nc, loom_qtensor_t *out, loom_err_t *err) {
    char name[300], have[96];
    snprintf(name, sizeof name, "%s.qweight", prefix);
    const loom_st_tensor_t *qw = loom_st_find(st, name);
    loom_quant_t quant;
    int64_t code_cols = cols;
    switch (qw->dtype) {
    case LOOM_DT_I8: quant = LOOM_QUANT_INT8; break;
    case LOOM_DT_F8_E4M3: quant = LOOM_QUANT_FP8; break;
    case LOOM_DT_U8:
        quant = LOOM_QUANT_Q4;
        code_cols = cols / 2;
        if (cols % 2)
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s': 4-bit codes need an even column count, not %lld",
                                name, (long long)cols);
        break;
    case LOOM_DT_I32:
        return loom_err_set(err, LOOM_ERR_FORMAT,
                            "tensor '%s' holds packed int32 words but config.json has no awq or gptq "
                            "quantization_config",
                            name);
    default:
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s has dtype %s, expected I8, U8 or F8_E4M3", name,
                            qw->file, loom_dtype_name(qw->dtype));
    }
    if (qw->n_dims != 2 || qw->shape[0] != rows || qw->shape[1] != code_cols)
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s has shape %s, expected [%lld, %lld]", name,
                            qw->file, shape_str(qw, have, sizeof have), (long long)rows, (long long)code_cols);

    snprintf(name, sizeof name, "%s.scales", prefix);
    const loom_st_tensor_t *sc = loom_st_find(st, name);
    if (!sc) return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' is missing (%s.qweight is quantized)", name, prefix);
    if (sc->n_dims != 2 || sc->shape[0] != rows || sc->shape[1] < 1)
        return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' in %s has shape %s, expected [%lld, groups]", name,
                            sc->file, shape_str(sc, have, sizeof have), (long long)rows);
    int64_t groups = sc->shape[1];
    int group;
    if (quant != LOOM_QUANT_Q4) {
        if (groups != 1)
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' has %lld scales a row; %s has one",
                                name, (long long)groups, quant == LOOM_QUANT_INT8 ? "int8" : "fp8");
        group = (int)nc;
    } else {
        if (cols % groups)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "tensor '%s': %lld groups a row do not divide %lld input columns", name,
                                (long long)groups, (long long)cols);
        int64_t g = cols / groups;
        if (g != 32 && g != 64 && g != 128)
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s': group size %lld (supported: 32, 64, 128)", name,
                                (long long)g);
        group = (int)g;
        LOOM_CHECK(check_group_slice(prefix, group, c0, nc, err));
    }
    const loom_st_tensor_t *mn = NULL;
    snprintf(name, sizeof name, "%s.mins", prefix);
    if (loom_st_find(st, name)) {
        if (quant != LOOM_QUANT_Q4)
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s': only 4-bit weights have mins", name);
        LOOM_CHECK(get2(st, prefix, "mins", "F32", FLOAT_MASK, rows, groups, &mn, err));
    }

    qt_alloc(out, quant, nr, nc, group, mn != NULL);
    loom_status_t s;
    if (quant == LOOM_QUANT_Q4) {
        s = loom_st_read_raw(st, qw, r0, nr, c0 / 2, nc / 2, out->q, err);
        if (s == LOOM_OK) s = loom_st_read_f32(st, sc, r0, nr, c0 / group, nc / group, out->scales, err);
        if (s == LOOM_OK && mn) s = loom_st_read_f32(st, mn, r0, nr, c0 / group, nc / group, out->mins, err);
    } else {
        s = loom_st_read_raw(st, qw, r0, nr, c0, nc, out->q, err);
        if (s == LOOM_OK) s = loom_st_read_f32(st, sc, r0, nr, 0, 1, out->scales, err);
    }
    if (s < 0) loom_qtensor_free(out);
    return s;
}

/* AWQ (GEMM) and GPTQ: 4-bit codes and zero points packed in int32 words,
 * f16 scales (groups, rows). Converted to Q4 with min. */
static loom_status_t read_packed(loom_st_t *st, const loom_model_config_t *cfg, const char *prefix, int64_t rows,
                                 int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc, loom_qtensor_t *out,
                                 loom_err_t *err) {
    int awq = cfg->ckpt_quant == LOOM_CKPT_AWQ;
    int g = cfg->ckpt_group;
    const char *method = awq ? "AWQ" : "GPTQ";
    if (rows % 8 || cols % 8)
        return loom_err_set(err, LOOM_ERR_FORMAT, "linear '%s' (%lld x %lld): %s packs 8 codes a word", prefix,
                            (long long)rows, (long long)cols, method);
    if (cols % g)
        return loom_err_set(err, LOOM_ERR_FORMAT, "linear '%s': group size %d does not divide %lld input columns",
                            prefix, g, (long long)cols);
    if (g != 32 && g != 64 && g != 128)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "linear '%s': %s group size %d (supported: 32, 64, 128)",
                            prefix, method, g);
    LOOM_CHECK(check_group_slice(prefix, g, c0, nc, err));
    int64_t groups = cols / g;
    const loom_st_tensor_t *qw, *qz, *sc;
    const int i32 = 1 << LOOM_DT_I32;
    if (awq)
        LOOM_CHECK(get2(st, prefix, "qweight", "I32", i32, cols, rows / 8, &qw, err));
    else
        LOOM_CHECK(get2(st, prefix, "qweight", "I32", i32, cols / 8, rows, &qw, err));
    LOOM_CHECK(get2(st, prefix, "qzeros", "I32", i32, groups, rows / 8, &qz, err));
    LOOM_CHECK(get2(st, prefix, "scales", "F16", FLOAT_MASK, groups, rows, &sc, err));
    char name[300];
    snprintf(name, sizeof name, "%s.g_idx", prefix);
    const loom_st_tensor_t *gi = loom_st_find(st, name);
    if (gi) {
        if (gi->dtype != LOOM_DT_I32 || gi->n_dims != 1 || gi->shape[0] != cols)
            return loom_err_set(err, LOOM_ERR_FORMAT, "tensor '%s' must be I32 [%lld]", name, (long long)cols);
        int32_t *idx = loom_xmalloc((size_t)cols * sizeof(int32_t));
        loom_status_t s = loom_st_read_raw(st, gi, 0, 1, 0, cols, idx, err);
        int64_t bad = -1;
        for (int64_t i = 0; s == LOOM_OK && i < cols && bad < 0; i++)
            if (idx[i] != i / g) bad = i;
        free(idx);
        LOOM_CHECK(s);
        if (bad >= 0)
            return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                                "tensor '%s': act-order groups (desc_act; column %lld is out of place) are not "
                                "supported: Loom's 4-bit layout needs contiguous groups; quantize without desc_act",
                                name, (long long)bad);
    }

    /* the packed words that cover output rows [r0, r0+nr) */
    int64_t p0 = r0 / 8, p1 = (r0 + nr + 7) / 8, np = p1 - p0, ng = nc / g;
    int64_t gq0 = c0 / g;
    int32_t *w = NULL, *z = loom_xmalloc((size_t)(ng * np) * sizeof(int32_t));
    float *s16 = loom_xmalloc((size_t)(ng * nr) * sizeof(float));
    loom_status_t s;
    if (awq) {
        w = loom_xmalloc((size_t)(nc * np) * sizeof(int32_t));
        s = loom_st_read_raw(st, qw, c0, nc, p0, np, w, err);
    } else {
        w = loom_xmalloc((size_t)(nc / 8 * nr) * sizeof(int32_t));
        s = loom_st_read_raw(st, qw, c0 / 8, nc / 8, r0, nr, w, err);
    }
    if (s == LOOM_OK) s = loom_st_read_raw(st, qz, gq0, ng, p0, np, z, err);
    if (s == LOOM_OK) s = loom_st_read_f32(st, sc, gq0, ng, r0, nr, s16, err);
    if (s == LOOM_OK) {
        qt_alloc(out, LOOM_QUANT_Q4, nr, nc, g, 1);
        int zplus = !awq && cfg->ckpt_zeros_minus1;
        for (int64_t r = 0; r < nr; r++) {
            int64_t o = r0 + r, pc = o / 8 - p0;
            int shift_o = 4 * (awq ? k_awq_nibble[o % 8] : (int)(o % 8));
            for (int64_t gg = 0; gg < ng; gg++) {
                uint32_t zw = (uint32_t)z[gg * np + pc];
                int zero = (int)((zw >> shift_o) & 15) + zplus;
                float scale = s16[gg * nr + r];
                out->scales[r * ng + gg] = scale;
                out->mins[r * ng + gg] = -scale * (float)zero;
            }
            for (int64_t c = 0; c < nc; c++) {
                uint32_t word = awq ? (uint32_t)w[c * np + pc] : (uint32_t)w[(c / 8) * nr + r];
                int shift = awq ? shift_o : 4 * (int)(c % 8);
                set_code4(out, r, c, (word >> shift) & 15);
            }
        }
    }
    free(w);
    free(z);
    free(s16);
    return s;
}

loom_status_t loom_qw_read(loom_st_t *st, const loom_model_config_t *cfg, const char *prefix, int64_t rows,
                           int64_t cols, int64_t r0, int64_t nr, int64_t c0, int64_t nc, loom_qtensor_t *out,
                           loom_err_t *err) {
    memset(out, 0, sizeof *out);
    if (cfg->ckpt_quant == LOOM_CKPT_AWQ || cfg->ckpt_quant == LOOM_CKPT_GPTQ)
        return read_packed(st, cfg, prefix, rows, cols, r0, nr, c0, nc, out, err);
    return read_loom(st, prefix, rows, cols, r0, nr, c0, nc, out, err);
}

void loom_qw_slice_cols(const loom_qtensor_t *t, int64_t c0, int64_t nc, loom_qtensor_t *out) {
    int q4 = t->quant == LOOM_QUANT_Q4;
    LOOM_ASSERT(c0 >= 0 && nc > 0 && c0 + nc <= t->cols);
    LOOM_ASSERT(!q4 || (c0 % t->group == 0 && nc % t->group == 0));
    qt_alloc(out, t->quant, t->rows, nc, q4 ? t->group : (int)nc, t->mins != NULL);
    size_t src_row = loom_qtensor_code_bytes(t) / (size_t)t->rows, dst_row = loom_qtensor_code_bytes(out) / (size_t)t->rows;
    size_t off = q4 ? (size_t)c0 / 2 : (size_t)c0;
    int64_t sg = t->cols / t->group, dg = out->cols / out->group, g0 = q4 ? c0 / t->group : 0;
    for (int64_t r = 0; r < t->rows; r++) {
        memcpy((uint8_t *)out->q + (size_t)r * dst_row, (const uint8_t *)t->q + (size_t)r * src_row + off, dst_row);
        memcpy(out->scales + r * dg, t->scales + r * sg + g0, (size_t)dg * sizeof(float));
        if (t->mins) memcpy(out->mins + r * dg, t->mins + r * sg + g0, (size_t)dg * sizeof(float));
    }
}

loom_status_t loom_qw_stack_rows(const loom_qtensor_t *parts, int n, const char *what, loom_qtensor_t *out,
                                 loom_err_t *err) {
    LOOM_ASSERT(n > 0);
    int64_t rows = 0;
    for (int i = 0; i < n; i++) {
        const loom_qtensor_t *p = &parts[i];
        if (p->quant != parts[0].quant || p->group != parts[0].group || p->cols != parts[0].cols ||
            !p->mins != !parts[0].mins)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: its parts are stored with different quantization schemes or groups", what);
        rows += p->rows;
    }
    qt_alloc(out, parts[0].quant, rows, parts[0].cols, parts[0].group, parts[0].mins != NULL);
    size_t cb = 0, sb = 0;
    for (int i = 0; i < n; i++) {
        const loom_qtensor_t *p = &parts[i];
        size_t c = loom_qtensor_code_bytes(p), s = loom_qtensor_scale_count(p);
        memcpy((uint8_t *)out->q + cb, p->q, c);
        memcpy(out->scales + sb, p->scales, s * sizeof(float));
        if (p->mins) memcpy(out->mins + sb, p->mins, s * sizeof(float));
        cb += c;
        sb += s;
    }
    return LOOM_OK;
}

/* Reference quantization: the canonical host layout of kernels/quant.h,
 * quantize and dequantize in plain C. Backends check their kernels against
 * loom_dequantize_rows; the loader and `loom quantize` use loom_quantize. */
#include "kernels/quant.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

int loom_quant_spec_parse(const char *s, loom_quant_spec_t *out) {
    loom_quant_spec_t r = {LOOM_QUANT_NONE, 0, 0};
    if (!s) return 0;
    if (!strcmp(s, "none") || !strcmp(s, "")) {
    } else if (!strcmp(s, "int8")) {
        r.quant = LOOM_QUANT_INT8;
    } else if (!strcmp(s, "fp8")) {
        r.quant = LOOM_QUANT_FP8;
    } else if (!strncmp(s, "q4", 2)) {
        const char *p = s + 2;
        r.quant = LOOM_QUANT_Q4;
        r.group = LOOM_Q4_GROUP_DEFAULT;
        if (!strncmp(p, "_min", 4)) {
            r.with_min = 1;
            p += 4;
        }
        if (*p == ':') {
            char *end;
            long g = strtol(p + 1, &end, 10);
            if (end == p + 1 || *end || (g != 32 && g != 64 && g != 128)) return 0;
            r.group = (int)g;
        } else if (*p) {
            return 0;
        }
    } else {
        return 0;
    }
    *out = r;
    return 1;
}

const char *loom_quant_spec_name(const loom_quant_spec_t *s, char *buf, size_t cap) {
    switch (s->quant) {
    case LOOM_QUANT_INT8: snprintf(buf, cap, "int8"); break;
    case LOOM_QUANT_FP8: snprintf(buf, cap, "fp8"); break;
    case LOOM_QUANT_Q4:
        if (s->group == LOOM_Q4_GROUP_DEFAULT)
            snprintf(buf, cap, "q4%s", s->with_min ? "_min" : "");
        else
            snprintf(buf, cap, "q4%s:%d", s->with_min ? "_min" : "", s->group);
        break;
    default: snprintf(buf, cap, "none"); break;
    }
    return buf;
}

size_t loom_qtensor_code_bytes(const loom_qtensor_t *t) {
    size_t n = (size_t)t->rows * (size_t)t->cols;
    return t->quant == LOOM_QUANT_Q4 ? n / 2 : n;
}

size_t loom_qtensor_scale_count(const loom_qtensor_t *t) {
    if (t->group <= 0) return 0;
    return (size_t)t->rows * (size_t)(t->cols / t->group);
}

size_t loom_qtensor_bytes(const loom_qtensor_t *t) {
    size_t s = loom_qtensor_scale_count(t) * sizeof(float);
    return loom_qtensor_code_bytes(t) + s + (t->mins ? s : 0);
}

loom_status_t loom_qtensor_check(const loom_qtensor_t *t, const char *what, loom_err_t *err) {
    if (!what) what = "weight";
    if (t->rows <= 0 || t->cols <= 0 || t->rows > INT32_MAX || t->cols > INT32_MAX)
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: shape (%lld, %lld)", what,
                            (long long)t->rows, (long long)t->cols);
    switch (t->quant) {
    case LOOM_QUANT_INT8:
    case LOOM_QUANT_FP8:
        if (t->group != t->cols)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: per-channel scheme with group %d != %lld",
                                what, t->group, (long long)t->cols);
        if (t->mins)
            return loom_err_set(err, LOOM_ERR_FORMAT, "%s: per-channel scheme has no mins", what);
        break;
    case LOOM_QUANT_Q4:
        if (t->group != 32 && t->group != 64 && t->group != 128)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: 4-bit group size %d (supported: 32, 64, 128)", what, t->group);
        if (t->cols % t->group)
            return loom_err_set(err, LOOM_ERR_FORMAT,
                                "%s: group size %d does not divide %lld input columns", what,
                                t->group, (long long)t->cols);
        break;
    default:
        return loom_err_set(err, LOOM_ERR_FORMAT, "%s: not a quantized tensor", what);
    }
    if (!t->q) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: missing codes", what);
    if (!t->scales) return loom_err_set(err, LOOM_ERR_FORMAT, "%s: missing scales", what);
    return LOOM_OK;
}

/* --- fp8 e4m3 ---------------------------------------------------------- */

float loom_fp8_e4m3_to_f32(uint8_t v) {
    int sign = v >> 7, exp = (v >> 3) & 15, man = v & 7;
    float r;
    if (exp == 15 && man == 7) return NAN;
    if (exp == 0)
        r = ldexpf((float)man, -9); /* subnormal: man/8 * 2^-6 */
    else
        r = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -r : r;
}

uint8_t loom_f32_to_fp8_e4m3(float f) {
    uint8_t sign = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (isnan(f)) return 0x7f;
    if (a >= 448.0f) return sign | 0x7e; /* saturate to the largest finite */
    int code;
    if (a < ldexpf(1.0f, -6)) {
        code = (int)rintf(a * 512.0f); /* subnormals: steps of 2^-9; 8 is the smallest normal */
    } else {
        int e;
        float m = frexpf(a, &e); /* a = 2m * 2^(e-1), 2m in [1, 2) */
        int k = (int)rintf((2.0f * m - 1.0f) * 8.0f), biased = e + 6;
        code = (biased << 3) + k; /* k = 8 carries into the exponent */
    }
    /* rintf rounds ties to even, and a code's parity is its mantissa's */
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

/* --- quantize / dequantize --------------------------------------------- */

static int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static void quantize_row_q4(const float *w, int64_t cols, int group, int with_min, uint8_t *q,
                            float *scales, float *mins) {
    memset(q, 0, (size_t)cols / 2);
    for (int64_t g0 = 0; g0 < cols; g0 += group) {
        float lo = w[g0], hi = w[g0], ext = 0.0f; /* ext: the value of largest magnitude */
        for (int64_t c = g0; c < g0 + group; c++) {
            lo = fminf(lo, w[c]);
            hi = fmaxf(hi, w[c]);
            if (fabsf(w[c]) > fabsf(ext)) ext = w[c];
        }
        float s, m = 0.0f;
        if (with_min) {
            s = (hi - lo) / 15.0f;
            m = lo;
        } else {
            /* Codes -8..7 are lopsided: map the extreme value to -8 exactly
             * (the scale takes its sign), so nothing is clipped. */
            s = ext / -8.0f;
        }
        float inv = s != 0.0f ? 1.0f / s : 0.0f;
        for (int64_t c = g0; c < g0 + group; c++) {
            int code = with_min ? clampi((int)lrintf((w[c] - m) * inv), 0, 15)
                                : clampi((int)lrintf(w[c] * inv) + 8, 0, 15);
            q[c / 2] |= (uint8_t)(code << ((c & 1) * 4));
        }
        scales[g0 / group] = s;
        if (with_min) mins[g0 / group] = m;
    }
}

loom_status_t loom_quantize(const loom_quant_spec_t *spec, const float *w, int64_t rows,
                            int64_t cols, loom_qtensor_t *out, loom_err_t *err) {
    loom_qtensor_t t = {.quant = spec->quant, .rows = rows, .cols = cols, .owned = 1};
    t.group = spec->quant == LOOM_QUANT_Q4 ? spec->group : (int)cols;
    if (spec->quant == LOOM_QUANT_NONE)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "quantize: no scheme");
    if (rows <= 0 || cols <= 0)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "quantize: shape (%lld, %lld)",
                            (long long)rows, (long long)cols);
    if (spec->quant == LOOM_QUANT_Q4 && cols % spec->group)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT,
                            "quantize: group size %d does not divide %lld input columns",
                            spec->group, (long long)cols);
    t.q = malloc(loom_qtensor_code_bytes(&t));
    t.scales = malloc(loom_qtensor_scale_count(&t) * sizeof(float));
    if (spec->quant == LOOM_QUANT_Q4 && spec->with_min)
        t.mins = malloc(loom_qtensor_scale_count(&t) * sizeof(float));
    if (!t.q || !t.scales || (spec->with_min && spec->quant == LOOM_QUANT_Q4 && !t.mins)) {
        loom_qtensor_free(&t);
        return loom_err_set(err, LOOM_ERR_NOMEM, "quantize: out of memory for (%lld, %lld)",
                            (long long)rows, (long long)cols);
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *wr = w + r * cols;
        if (t.quant == LOOM_QUANT_Q4) {
            size_t gs = (size_t)(cols / t.group);
            quantize_row_q4(wr, cols, t.group, spec->with_min, (uint8_t *)t.q + r * (cols / 2),
                            t.scales + r * gs, t.mins ? t.mins + r * gs : NULL);
            continue;
        }
        float amax = 0.0f;
        for (int64_t c = 0; c < cols; c++) amax = fmaxf(amax, fabsf(wr[c]));
        float s = t.quant == LOOM_QUANT_INT8 ? amax / 127.0f : amax / 448.0f;
        float inv = s > 0.0f ? 1.0f / s : 0.0f;
        t.scales[r] = s;
        if (t.quant == LOOM_QUANT_INT8) {
            int8_t *q = (int8_t *)t.q + r * cols;
            for (int64_t c = 0; c < cols; c++) q[c] = (int8_t)clampi((int)lrintf(wr[c] * inv), -127, 127);
        } else {
            uint8_t *q = (uint8_t *)t.q + r * cols;
            for (int64_t c = 0; c < cols; c++) q[c] = loom_f32_to_fp8_e4m3(wr[c] * inv);
        }
    }
    *out = t;
    return LOOM_OK;
}

void loom_dequantize_rows(const loom_qtensor_t *t, int64_t r0, int64_t r1, float *out) {
    const int64_t cols = t->cols;
    for (int64_t r = r0; r < r1; r++) {
        float *o = out + (r - r0) * cols;
        if (t->quant == LOOM_QUANT_Q4) {
            const uint8_t *q = (const uint8_t *)t->q + r * (cols / 2);
            const int64_t gs = cols / t->group;
            const float *s = t->scales + r * gs, *m = t->mins ? t->mins + r * gs : NULL;
            for (int64_t c = 0; c < cols; c++) {
                int code = (q[c / 2] >> ((c & 1) * 4)) & 15;
                int64_t g = c / t->group;
                o[c] = m ? s[g] * (float)code + m[g] : s[g] * (float)(code - 8);
            }
        } else if (t->quant == LOOM_QUANT_INT8) {
            const int8_t *q = (const int8_t *)t->q + r * cols;
            for (int64_t c = 0; c < cols; c++) o[c] = t->scales[r] * (float)q[c];
        } else {
            const uint8_t *q = (const uint8_t *)t->q + r * cols;
            for (int64_t c = 0; c < cols; c++) o[c] = t->scales[r] * loom_fp8_e4m3_to_f32(q[c]);
        }
    }
}

void loom_qtensor_free(loom_qtensor_t *t) {
    if (!t) return;
    if (t->owned) {
        free(t->q);
        free(t->scales);
        free(t->mins);
    }
    t->q = NULL;
    t->scales = t->mins = NULL;
    t->owned = 0;
}

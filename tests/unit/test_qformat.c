/* The CUDA quantized kernels' decoding (kernels/cuda/qformat.h), run on the
 * CPU: every code of every scheme against the reference dequantizer
 * (loom_dequantize_rows), and the kernels' index math -- 16-byte loads,
 * 4-byte words, the group of each load, 8-column dequantization -- replayed
 * in plain C against float64 math on the dequantized matrix. Needs no GPU
 * and no CUDA toolkit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/qformat.h"
#include "kernels/quant.h"
#include "tests/test.h"

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static float frand(void) { /* uniform in [-1, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

static uint32_t word_at(const uint8_t *p) { /* little-endian, as the GPU loads it */
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void test_codes(void) {
    for (int b = 0; b < 256; b++) {
        if ((b & 0x7f) == 0x7f) continue; /* NaN in e4m3 */
        float want = loom_fp8_e4m3_to_f32((uint8_t)b), got = loom_qd_fp8((uint32_t)b);
        CHECKF(memcmp(&want, &got, sizeof got) == 0, "e4m3 %#x: %g, reference %g", b, (double)got, (double)want);
    }
    for (int b = 0; b < 256; b++)
        for (int k = 0; k < 4; k++) {
            float f[4], f8[8];
            uint32_t u = (uint32_t)b << (8 * k) | 0x5au << (8 * ((k + 1) % 4));
            loom_qd_int8x4(u, f);
            CHECKF(f[k] == (float)(int8_t)b, "int8 byte %d = %d decodes as %g", k, (int8_t)b, (double)f[k]);
            loom_qd_fp8x4(u, f);
            if ((b & 0x7f) != 0x7f) CHECK(f[k] == loom_fp8_e4m3_to_f32((uint8_t)b));
            loom_qd_q4x8(u, 8.0f, f8);
            CHECK(f8[2 * k] == (float)(b & 15) - 8.0f && f8[2 * k + 1] == (float)(b >> 4) - 8.0f);
            loom_qd_q4x8(u, 0.0f, f8);
            CHECK(f8[2 * k] == (float)(b & 15) && f8[2 * k + 1] == (float)(b >> 4));
        }
}

/* y(rows) = W x as qgemv_kernel computes it: per 16-byte load of a row, the
 * words decoded in order; Q4 sums a load then applies its group's scale
 * (and min * sum(x)); INT8 / FP8 apply the row's scale at the end. */
static void emulate_qgemv(const loom_qtensor_t *t, const float *x, float *y) {
    const int q4 = t->quant == LOOM_QUANT_Q4, pw = q4 ? 8 : 4, e = 4 * pw;
    const int64_t nv = t->cols / e, row_bytes = q4 ? t->cols / 2 : t->cols;
    const int64_t gpr = q4 ? t->cols / t->group : 1;
    const int loads_per_group = q4 ? t->group / e : 1;
    const uint8_t *q = t->q;
    for (int64_t r = 0; r < t->rows; r++) {
        float acc = 0.0f;
        for (int64_t v = 0; v < nv; v++) {
            float p = 0.0f, xs = 0.0f;
            for (int j = 0; j < 4; j++) {
                float wf[8] = {0};
                uint32_t u = word_at(q + r * row_bytes + v * 16 + j * 4);
                if (q4)
                    loom_qd_q4x8(u, t->mins ? 0.0f : 8.0f, wf);
                else if (t->quant == LOOM_QUANT_INT8)
                    loom_qd_int8x4(u, wf);
                else
                    loom_qd_fp8x4(u, wf);
                const float *xp = x + v * e + j * pw;
                for (int k = 0; k < pw; k++) {
                    xs += xp[k];
                    if (q4)
                        p = fmaf(wf[k], xp[k], p);
                    else
                        acc = fmaf(wf[k], xp[k], acc);
                }
            }
            if (q4) {
                int64_t g = v / loads_per_group;
                acc = fmaf(t->scales[r * gpr + g], p, acc);
                if (t->mins) acc = fmaf(t->mins[r * gpr + g], xs, acc);
            }
        }
        y[r] = q4 ? acc : t->scales[r] * acc;
    }
}

/* dequant8_kernel's thread i: row r0 + i / (cols/8), columns 8 * (i % (cols/8)). */
static void emulate_dequant8(const loom_qtensor_t *t, int64_t r0, int64_t r1, float *out) {
    const int64_t c8 = t->cols / 8, cols = t->cols;
    const uint8_t *q = t->q;
    for (int64_t i = 0; i < (r1 - r0) * c8; i++) {
        const int64_t r = r0 + i / c8, c = (i % c8) * 8;
        float f[8], s, m = 0.0f;
        if (t->quant == LOOM_QUANT_Q4) {
            const int64_t g = r * (cols / t->group) + c / t->group;
            s = t->scales[g];
            if (t->mins) m = t->mins[g];
            loom_qd_q4x8(word_at(q + r * (cols / 2) + c / 2), t->mins ? 0.0f : 8.0f, f);
        } else {
            s = t->scales[r];
            for (int h = 0; h < 2; h++) {
                uint32_t u = word_at(q + r * cols + c + 4 * h);
                if (t->quant == LOOM_QUANT_INT8)
                    loom_qd_int8x4(u, f + 4 * h);
                else
                    loom_qd_fp8x4(u, f + 4 * h);
            }
        }
        for (int k = 0; k < 8; k++) out[(r - r0) * cols + c + k] = t->mins ? loom_qd_affine(s, f[k], m) : s * f[k];
    }
}

static void check_scheme(const char *name, int64_t rows, int64_t cols) {
    loom_quant_spec_t spec;
    REQUIRE(loom_quant_spec_parse(name, &spec));
    float *w = malloc((size_t)(rows * cols) * sizeof *w), *x = malloc((size_t)cols * sizeof *x);
    for (int64_t i = 0; i < rows * cols; i++) w[i] = frand() * (1.0f + (float)(i % 7));
    for (int64_t i = 0; i < cols; i++) x[i] = frand();
    loom_qtensor_t t;
    loom_err_t err = {0};
    REQUIRE(loom_quantize(&spec, w, rows, cols, &t, &err) == LOOM_OK);
    float *ref = malloc((size_t)(rows * cols) * sizeof *ref), *got = malloc((size_t)(rows * cols) * sizeof *got);
    loom_dequantize_rows(&t, 0, rows, ref);

    /* every element through the scalar path (qgemv_any_kernel, dequant_any_kernel) */
    long bad = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float v = loom_qd_value((int)t.quant, t.q, t.scales, t.mins, cols, t.group, r, c);
            if (v != ref[r * cols + c] && bad++ < 3)
                fprintf(stderr, "  %s (%lld, %lld): %g, reference %g\n", name, (long long)r, (long long)c, (double)v,
                        (double)ref[r * cols + c]);
        }
    CHECKF(bad == 0, "%s: %ld elements of the scalar decoder differ from loom_dequantize_rows", name, bad);

    /* the 8-column dequantization, rows 1..rows-1 (a panel not at row 0) */
    if (cols % 8 == 0) {
        emulate_dequant8(&t, 1, rows, got);
        char what[80];
        snprintf(what, sizeof what, "dequant8 %s (%lld x %lld)", name, (long long)rows, (long long)cols);
        CHECK(test_allclose(what, got, ref + cols, (long)((rows - 1) * cols), 0, 0)); /* bit for bit */
    }

    /* the vector GEMV against float64 on the dequantized matrix */
    if (cols % (t.quant == LOOM_QUANT_Q4 ? 32 : 16) == 0) {
        float *y = malloc((size_t)rows * sizeof *y), *yr = malloc((size_t)rows * sizeof *yr);
        emulate_qgemv(&t, x, y);
        double amax = 0;
        for (int64_t r = 0; r < rows; r++) {
            double s = 0, sa = 0;
            for (int64_t c = 0; c < cols; c++) {
                s += (double)ref[r * cols + c] * x[c];
                sa += fabs((double)ref[r * cols + c] * x[c]);
            }
            yr[r] = (float)s;
            amax = fmax(amax, sa);
        }
        char what[80];
        snprintf(what, sizeof what, "qgemv %s (%lld x %lld)", name, (long long)rows, (long long)cols);
        /* f32 accumulation of cols terms: ~sqrt(cols) * 2^-24 * sum|w x|, 4x margin */
        CHECK(test_allclose(what, y, yr, (long)rows, 4.0 * sqrt((double)cols) * 6e-8 * amax + 1e-6, 1e-5));
        free(y), free(yr);
    }
    loom_qtensor_free(&t);
    free(w), free(x), free(ref), free(got);
}

static void test_schemes(void) {
    static const char *names[] = {"int8", "fp8", "q4", "q4:64", "q4:128", "q4_min", "q4_min:64", "q4_min:128"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        check_scheme(names[i], 7, 512);
        check_scheme(names[i], 33, 384);  /* 3 groups of 128, 12 of 32 */
        check_scheme(names[i], 3, 128);
    }
    /* shapes only the scalar path serves */
    check_scheme("int8", 5, 100);
    check_scheme("fp8", 9, 24);
    check_scheme("int8", 2, 7);
    check_scheme("q4", 4, 96);
}

int main(void) {
    RUN(test_codes);
    RUN(test_schemes);
    return test_summary();
}

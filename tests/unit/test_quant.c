/* Quantized weights: the reference quantizer's error bounds and layout, the
 * e4m3 conversions, scheme names, tensor checks, and the CPU backend's
 * matmul on quantized weights against float32 math on the dequantized
 * matrix (every path: GEMV sizes and GEMM sizes). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/quant.h"
#include "tests/test.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in [-1, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

static float *rand_matrix(int64_t rows, int64_t cols) {
    float *w = malloc((size_t)(rows * cols) * sizeof *w);
    for (int64_t i = 0; i < rows * cols; i++) w[i] = frand();
    return w;
}

static void test_spec_parse(void) {
    loom_quant_spec_t s;
    char buf[32];
    CHECK(loom_quant_spec_parse("int8", &s) && s.quant == LOOM_QUANT_INT8);
    CHECK(loom_quant_spec_parse("fp8", &s) && s.quant == LOOM_QUANT_FP8);
    CHECK(loom_quant_spec_parse("q4", &s) && s.quant == LOOM_QUANT_Q4 && s.group == 32 && !s.with_min);
    CHECK(loom_quant_spec_parse("q4_min:128", &s) && s.group == 128 && s.with_min);
    CHECK(!strcmp(loom_quant_spec_name(&s, buf, sizeof buf), "q4_min:128"));
    CHECK(loom_quant_spec_parse("none", &s) && s.quant == LOOM_QUANT_NONE);
    CHECK(!loom_quant_spec_parse("q4:33", &s));
    CHECK(!loom_quant_spec_parse("q4x", &s));
    CHECK(!loom_quant_spec_parse("int4", &s));
    CHECK(!loom_quant_spec_parse(NULL, &s));
}

static void test_fp8(void) {
    CHECK(loom_fp8_e4m3_to_f32(0x7e) == 448.0f);
    CHECK(loom_fp8_e4m3_to_f32(0x01) == ldexpf(1.0f, -9));
    CHECK(loom_fp8_e4m3_to_f32(0x38) == 1.0f);
    CHECK(isnan(loom_fp8_e4m3_to_f32(0x7f)));
    for (int v = 0; v < 256; v++) { /* every finite code round-trips */
        if ((v & 0x7f) == 0x7f) continue;
        float f = loom_fp8_e4m3_to_f32((uint8_t)v);
        uint8_t back = loom_f32_to_fp8_e4m3(f);
        CHECKF(back == v || (f == 0.0f && (back & 0x7f) == 0), "code %#x -> %g -> %#x", v, f, back);
    }
    CHECK(loom_f32_to_fp8_e4m3(1000.0f) == 0x7e);
    CHECK(loom_f32_to_fp8_e4m3(-1000.0f) == 0xfe);
    /* 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): ties to even. */
    CHECK(loom_f32_to_fp8_e4m3(1.0625f) == 0x38);
}

/* Max |w - dequant(quant(w))| over the matrix, relative to the bound the
 * scheme promises: half a step of the row's or group's scale. */
static void check_roundtrip(const char *name, int64_t rows, int64_t cols) {
    loom_quant_spec_t spec;
    REQUIRE(loom_quant_spec_parse(name, &spec));
    float *w = rand_matrix(rows, cols), *d = malloc((size_t)(rows * cols) * sizeof *d);
    loom_qtensor_t t;
    loom_err_t err;
    REQUIRE(loom_quantize(&spec, w, rows, cols, &t, &err) == LOOM_OK);
    CHECK(loom_qtensor_check(&t, name, &err) == LOOM_OK);
    loom_dequantize_rows(&t, 0, rows, d);
    double worst = 0.0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float s = t.scales[r * (cols / t.group) + c / t.group];
            double e = fabs((double)w[r * cols + c] - d[r * cols + c]);
            /* fp8 steps are relative: 2^-4 of the value's binade, times the scale */
            double a = fabs(w[r * cols + c]), as = fabs(s);
            double bound = spec.quant == LOOM_QUANT_FP8 ? fmax(a / 16.0, as * ldexpf(1.0f, -10))
                                                        : 0.5 * as;
            /* symmetric Q4: the side opposite the extreme stops at 7 steps */
            if (spec.quant == LOOM_QUANT_Q4 && !spec.with_min && a > 7.5 * as) bound = a - 7.0 * as;
            if (e > bound * 1.0001 + 1e-7) worst = fmax(worst, e / bound);
        }
    CHECKF(worst == 0.0, "%s: error %.3f x the bound", name, worst);
    loom_qtensor_free(&t);
    loom_qtensor_free(&t);
    free(w);
    free(d);
}

static void test_roundtrip(void) {
    check_roundtrip("int8", 17, 96);
    check_roundtrip("fp8", 9, 64);
    check_roundtrip("q4", 13, 128);
    check_roundtrip("q4:128", 5, 256);
    check_roundtrip("q4_min", 11, 64);
    check_roundtrip("q4_min:64", 3, 192);
}

static void test_layout(void) {
    /* One row, group 32 symmetric: codes land low nibble first. */
    float w[32] = {0};
    w[0] = -8.0f;
    w[1] = 7.0f;
    w[2] = 1.0f;
    loom_quant_spec_t spec = {LOOM_QUANT_Q4, 32, 0};
    loom_qtensor_t t;
    REQUIRE(loom_quantize(&spec, w, 1, 32, &t, NULL) == LOOM_OK);
    const uint8_t *q = t.q;
    CHECK(t.scales[0] == 1.0f);        /* the extreme, -8, maps to code 0 */
    CHECK(q[0] == (0x0 | (0xf << 4))); /* -8 -> code 0, 7 -> code 15 */
    CHECK(q[1] == (9 | (8 << 4)));     /* 1 -> 9, 0 -> 8 */
    loom_qtensor_free(&t);
    w[0] = 8.0f; /* a positive extreme gets a negative scale: 8 -> code 0 */
    REQUIRE(loom_quantize(&spec, w, 1, 32, &t, NULL) == LOOM_OK);
    q = t.q;
    CHECK(t.scales[0] == -1.0f);
    CHECK((q[0] & 15) == 0 && (q[0] >> 4) == 1); /* 7 -> -7 + 8 = 1 */
    loom_qtensor_free(&t);
}

static void test_check_errors(void) {
    float s = 1.0f;
    uint8_t q[64] = {0};
    loom_err_t err;
    loom_qtensor_t t = {.quant = LOOM_QUANT_Q4, .rows = 1, .cols = 48, .group = 32, .q = q,
                        .scales = &s};
    CHECK(loom_qtensor_check(&t, "layers.0.mlp.down_proj", &err) == LOOM_ERR_FORMAT);
    CHECK(strstr(err.msg, "layers.0.mlp.down_proj") && strstr(err.msg, "does not divide"));
    t.cols = 64;
    t.scales = NULL;
    CHECK(loom_qtensor_check(&t, "x", &err) == LOOM_ERR_FORMAT && strstr(err.msg, "scales"));
    t.scales = &s;
    t.group = 48;
    CHECK(loom_qtensor_check(&t, "x", &err) == LOOM_ERR_FORMAT);
    t.quant = LOOM_QUANT_INT8;
    t.group = 64;
    CHECK(loom_qtensor_check(&t, "x", &err) == LOOM_OK);
    loom_quant_spec_t spec = {LOOM_QUANT_Q4, 32, 0};
    float w[40] = {0};
    CHECK(loom_quantize(&spec, w, 1, 40, &t, &err) == LOOM_ERR_INVALID_ARGUMENT);
}

/* The backend's matmul on a quantized weight equals x · dequant(W)ᵀ. */
static void check_matmul(loom_backend_t *be, const char *name, int64_t rows, int64_t cols, int n) {
    loom_quant_spec_t spec;
    REQUIRE(loom_quant_spec_parse(name, &spec));
    float *w = rand_matrix(rows, cols), *x = rand_matrix(n, cols);
    float *d = malloc((size_t)(rows * cols) * sizeof *d);
    float *y = malloc((size_t)(n * rows) * sizeof *y), *ref = calloc((size_t)(n * rows), sizeof *ref);
    loom_qtensor_t t;
    REQUIRE(loom_quantize(&spec, w, rows, cols, &t, NULL) == LOOM_OK);
    loom_dequantize_rows(&t, 0, rows, d);
    for (int i = 0; i < n; i++)
        for (int64_t r = 0; r < rows; r++) {
            double acc = 0.0;
            for (int64_t c = 0; c < cols; c++) acc += (double)x[i * cols + c] * d[r * cols + c];
            ref[i * rows + r] = (float)acc;
        }
    loom_weight_t qw;
    loom_err_t err;
    REQUIRE(loom_weight_upload_quant(be, &qw, &t, &err) == LOOM_OK);
    CHECK(qw.quant == spec.quant && qw.rows == rows && qw.cols == cols);
    CHECK(loom_weight_bytes(&qw) == loom_qtensor_bytes(&t));
    loom_op_matmul(be, y, x, &qw, n);
    double worst = 0.0, mag = 0.0;
    for (int64_t i = 0; i < n * rows; i++) {
        worst = fmax(worst, fabs((double)y[i] - ref[i]));
        mag = fmax(mag, fabs((double)ref[i]));
    }
    /* Activations may be quantized to 8 bits by a kernel: allow 1% of the
     * output's scale. */
    CHECKF(worst <= 0.01 * mag + 1e-4, "%s (%lld x %lld, n=%d): max error %g of %g", name,
           (long long)rows, (long long)cols, n, worst, mag);
    loom_weight_free(be, &qw);
    loom_qtensor_free(&t);
    free(w);
    free(x);
    free(d);
    free(y);
    free(ref);
}

static void test_cpu_matmul(void) {
    loom_backend_config_t cfg = {.version = LOOM_BACKEND_CONFIG_VERSION, .kind = LOOM_DEVICE_CPU,
                                 .n_threads = 2, .weight_dtype = LOOM_DT_F32};
    loom_backend_t *be = NULL;
    REQUIRE(loom_backend_create(&cfg, &be, NULL) == LOOM_OK);
    const char *schemes[] = {"int8", "fp8", "q4", "q4:128", "q4_min", "q4_min:64"};
    const int ns[] = {1, 3, 8, 33, 80};
    for (size_t s = 0; s < sizeof schemes / sizeof *schemes; s++)
        for (size_t k = 0; k < sizeof ns / sizeof *ns; k++) {
            check_matmul(be, schemes[s], 67, 256, ns[k]);
            check_matmul(be, schemes[s], 300, 128, ns[k]);
        }
    loom_backend_destroy(&be);
}

int main(void) {
    RUN(test_spec_parse);
    RUN(test_fp8);
    RUN(test_roundtrip);
    RUN(test_layout);
    RUN(test_check_errors);
    RUN(test_cpu_matmul);
    return test_summary();
}

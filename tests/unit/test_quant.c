/* Quantized weights: the reference quantizer's error bounds and layout, the
 * e4m3 conversions, scheme names, tensor checks, and the CPU backend's
 * matmul on quantized weights against float32 math on the dequantized
 * matrix (every scheme and path, n = 1..80 and prefill sizes, 1 and 2
 * threads), and each instruction set of the quantized kernels against
 * their scalar reference. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/backend.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/qgemv.h"
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
    /* Against a search for the nearest code (ties to the even one) over a
     * geometric sweep and every midpoint between neighbouring codes. */
    int bad = 0;
    for (float x = 1e-6f; x < 500.0f; x *= 1.0007f) {
        float probes[3] = {x, 0.0f, 0.0f};
        int np = 1;
        if (x < 448.0f) {
            uint8_t c = loom_f32_to_fp8_e4m3(x);
            if (c < 0x7e) probes[np++] = 0.5f * (loom_fp8_e4m3_to_f32(c) + loom_fp8_e4m3_to_f32(c + 1));
        }
        for (int p = 0; p < np; p++) {
            float a = probes[p], bd = INFINITY;
            int best = 0x7e;
            for (int c = 0; c <= 0x7e && a < 448.0f; c++) {
                float d = fabsf(loom_fp8_e4m3_to_f32((uint8_t)c) - a);
                if (d < bd || (d == bd && !(c & 1))) bd = d, best = c;
            }
            bad += loom_f32_to_fp8_e4m3(a) != best || loom_f32_to_fp8_e4m3(-a) != (0x80 | best);
        }
    }
    CHECKF(bad == 0, "%d values round to another code than the nearest", bad);
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

/* y(n, rows) = x · dequant(t)ᵀ in double: the float math every kernel is
 * held to. */
static float *float_reference(const loom_qtensor_t *t, const float *x, int n) {
    const int64_t rows = t->rows, cols = t->cols;
    float *d = malloc((size_t)(rows * cols) * sizeof *d);
    float *ref = malloc((size_t)((int64_t)n * rows) * sizeof *ref);
    loom_dequantize_rows(t, 0, rows, d);
    for (int i = 0; i < n; i++)
        for (int64_t r = 0; r < rows; r++) {
            double acc = 0.0;
            for (int64_t c = 0; c < cols; c++) acc += (double)x[i * cols + c] * d[r * cols + c];
            ref[i * rows + r] = (float)acc;
        }
    free(d);
    return ref;
}

/* Max |y - ref| against tol · max |ref|; prints the first mismatches. */
static void compare(const char *what, const float *y, const float *ref, int64_t count,
                    double tol) {
    double worst = 0.0, mag = 0.0;
    int64_t worst_i = 0;
    for (int64_t i = 0; i < count; i++) mag = fmax(mag, fabs((double)ref[i]));
    int shown = 0;
    for (int64_t i = 0; i < count; i++) {
        double e = fabs((double)y[i] - ref[i]);
        if (!(e <= tol * mag + 1e-5) && shown++ < 3)
            fprintf(stderr, "  %s: [%lld] %g, expected %g\n", what, (long long)i, y[i], ref[i]);
        if (!(e <= worst)) {
            worst = e;
            worst_i = i;
        }
    }
    CHECKF(worst <= tol * mag + 1e-5, "%s: max error %g at %lld (scale %g, tolerance %g)", what,
           worst, (long long)worst_i, mag, tol * mag);
}

/* Activations are rounded to int8 per 32 columns by the quantized kernels:
 * allow 1% of the output's scale (the worst seen here is about 0.8%, on
 * short rows). */
#define MATMUL_TOL 0.01

/* The backend's matmul on a quantized weight equals x · dequant(W)ᵀ, on
 * every path. */
static void check_matmul(loom_backend_t *be, const char *name, int64_t rows, int64_t cols,
                         const int *ns, size_t n_ns) {
    loom_quant_spec_t spec;
    REQUIRE(loom_quant_spec_parse(name, &spec));
    int max_n = 0;
    for (size_t k = 0; k < n_ns; k++) max_n = ns[k] > max_n ? ns[k] : max_n;
    float *w = rand_matrix(rows, cols), *x = rand_matrix(max_n, cols);
    float *y = malloc((size_t)(max_n * rows) * sizeof *y);
    loom_qtensor_t t;
    REQUIRE(loom_quantize(&spec, w, rows, cols, &t, NULL) == LOOM_OK);
    float *ref = float_reference(&t, x, max_n); /* row i of x gives row i of ref for every n */
    loom_weight_t qw;
    loom_err_t err;
    REQUIRE(loom_weight_upload_quant(be, &qw, &t, &err) == LOOM_OK);
    CHECK(qw.quant == spec.quant && qw.rows == rows && qw.cols == cols);
    CHECK(loom_weight_bytes(&qw) == loom_qtensor_bytes(&t));
    static const loom_cpu_mm_path_t paths[] = {LOOM_CPU_MM_AUTO, LOOM_CPU_MM_GEMV,
                                               LOOM_CPU_MM_SGEMM, LOOM_CPU_MM_IGEMM};
    static const char *path_names[] = {"auto", "gemv", "sgemm", "igemm"};
    for (size_t k = 0; k < n_ns; k++)
        for (int p = 0; p < 4; p++) {
            const int n = ns[k];
            char what[96];
            snprintf(what, sizeof what, "%s %lldx%lld n=%d %s threads=%d", name, (long long)rows,
                     (long long)cols, n, path_names[p], loom_backend_threads(be));
            for (int64_t i = 0; i < n * rows; i++) y[i] = NAN; /* an unwritten output fails */
            loom_cpu_matmul_path(be, y, x, &qw, n, paths[p]);
            compare(what, y, ref, n * rows, MATMUL_TOL);
        }
    loom_weight_free(be, &qw);
    loom_qtensor_free(&t);
    free(w);
    free(x);
    free(y);
    free(ref);
}

static const char *k_schemes[] = {"int8", "fp8", "q4", "q4:64", "q4:128",
                                  "q4_min", "q4_min:64", "q4_min:128"};

static void test_cpu_matmul(void) {
    /* n = 1..17 and around the GEMV/sgemm switch, up to 80; then prefill. */
    int ns[40];
    size_t n_ns = 0;
    for (int n = 1; n <= 17; n++) ns[n_ns++] = n;
    static const int more[] = {24, 31, 32, 33, 48, 64, 80};
    for (size_t k = 0; k < sizeof more / sizeof *more; k++) ns[n_ns++] = more[k];
    static const int prefill[] = {128, 201};
    for (int threads = 1; threads <= 2; threads++) {
        loom_backend_config_t cfg = {.version = LOOM_BACKEND_CONFIG_VERSION,
                                     .kind = LOOM_DEVICE_CPU, .n_threads = threads,
                                     .weight_dtype = LOOM_DT_F32};
        loom_backend_t *be = NULL;
        REQUIRE(loom_backend_create(&cfg, &be, NULL) == LOOM_OK);
        for (size_t s = 0; s < sizeof k_schemes / sizeof *k_schemes; s++) {
            /* odd row counts (tiles of 4 with 1-3 left over), 128..384 columns */
            check_matmul(be, k_schemes[s], 67, 256, ns, n_ns);
            check_matmul(be, k_schemes[s], 301, 128, ns, 8);
            check_matmul(be, k_schemes[s], 30, 384, prefill, 2);
        }
        /* Q4 kernels take blocks two at a time: an odd count leaves one. */
        check_matmul(be, "q4", 33, 96, ns, n_ns);
        check_matmul(be, "q4_min", 33, 160, ns, n_ns);
        /* INT8 and FP8 have no groups: columns need not be a multiple of 32. */
        check_matmul(be, "int8", 37, 100, ns, n_ns);
        check_matmul(be, "fp8", 37, 100, ns, n_ns);
        check_matmul(be, "int8", 5, 20, ns, 5);
        loom_backend_destroy(&be);
    }
}

/* t in the CPU backend's stored layout (qgemv.h), in two row ranges as
 * the backend's threads split it; free with free_repacked. */
static void repack_for_cpu(loom_weight_t *qw, const loom_qtensor_t *t) {
    const size_t ns = loom_qtensor_scale_count(t) * sizeof(float);
    *qw = (loom_weight_t){.rows = t->rows, .cols = t->cols, .quant = t->quant, .group = t->group};
    qw->data = malloc(loom_qtensor_code_bytes(t));
    qw->scales = malloc(ns);
    qw->mins = t->mins ? malloc(ns) : NULL;
    REQUIRE(qw->data && qw->scales && (!t->mins || qw->mins));
    loom_cpu_q_repack(qw, t, 0, t->rows / 3);
    loom_cpu_q_repack(qw, t, t->rows / 3, t->rows);
}

static void free_repacked(loom_weight_t *qw) {
    free(qw->data);
    free(qw->scales);
    free(qw->mins);
}

/* Every instruction set this CPU has against the scalar reference on the
 * same int8 activations: only the order of the float sums differs. */
static void check_isas(const char *name, int64_t rows, int64_t cols, int n) {
    loom_quant_spec_t spec;
    REQUIRE(loom_quant_spec_parse(name, &spec));
    float *w = rand_matrix(rows, cols), *x = rand_matrix(n, cols);
    float *y = malloc((size_t)(n * rows) * sizeof *y), *ref = malloc((size_t)(n * rows) * sizeof *ref);
    float *d = malloc((size_t)(rows * cols) * sizeof *d), *dref = malloc((size_t)(rows * cols) * sizeof *dref);
    loom_qtensor_t t;
    REQUIRE(loom_quantize(&spec, w, rows, cols, &t, NULL) == LOOM_OK);
    loom_weight_t qw;
    repack_for_cpu(&qw, &t);
    void *scratch = loom_aligned_alloc(loom_cpu_qx_bytes(n, cols));
    loom_cpu_qx_t qx;
    loom_cpu_qx_init(&qx, scratch, x, n, &qw);
    loom_cpu_qx_quantize(&qx, 0, n);
    loom_cpu_qgemv(LOOM_CPU_ISA_SCALAR, ref, rows, &qx, &qw, 0, rows);
    loom_dequantize_rows(&t, 0, rows, dref);
    for (loom_cpu_isa_t isa = LOOM_CPU_ISA_SCALAR; isa < LOOM_CPU_ISA_COUNT; isa++) {
        if (!loom_cpu_isa_supported(isa)) {
            fprintf(stderr, "  skipped: %s on %s (this CPU lacks it)\n", name, loom_cpu_isa_name(isa));
            continue;
        }
        char what[96];
        snprintf(what, sizeof what, "%s %lldx%lld n=%d %s", name, (long long)rows,
                 (long long)cols, n, loom_cpu_isa_name(isa));
        for (int64_t i = 0; i < n * rows; i++) y[i] = NAN;
        /* two row ranges, the split a thread pool makes */
        loom_cpu_qgemv(isa, y, rows, &qx, &qw, 0, rows / 3);
        loom_cpu_qgemv(isa, y, rows, &qx, &qw, rows / 3, rows);
        compare(what, y, ref, n * rows, 2e-6);
        for (int64_t i = 0; i < n * rows; i++) y[i] = NAN;
        loom_cpu_qgemm(isa, y, rows, &qx, &qw, 0, rows / 3);
        loom_cpu_qgemm(isa, y, rows, &qx, &qw, rows / 3, rows);
        char gwhat[112];
        snprintf(gwhat, sizeof gwhat, "%s qgemm", what);
        compare(gwhat, y, ref, n * rows, 2e-6);
        loom_cpu_q_dequant_rows(isa, d, &qw, 0, rows);
        strcat(what, " dequant");
        compare(what, d, dref, rows * cols, 1e-6); /* an FMA or a multiply and an add */
    }
    loom_aligned_free(scratch);
    free_repacked(&qw);
    loom_qtensor_free(&t);
    free(w);
    free(x);
    free(y);
    free(ref);
    free(d);
    free(dref);
}

static void test_isas(void) {
    fprintf(stderr, "  quantized kernels: best instruction set here is %s\n",
            loom_cpu_isa_name(loom_cpu_isa_detect()));
    for (size_t s = 0; s < sizeof k_schemes / sizeof *k_schemes; s++)
        for (int n = 1; n <= 9; n++) check_isas(k_schemes[s], 23, 256, n);
    check_isas("q4", 9, 160, 3); /* an odd number of blocks */
    check_isas("q4_min", 10, 96, 5);
    check_isas("int8", 9, 1000, 3);
    check_isas("fp8", 9, 1003, 2);
}

/* The integer GEMM (loom_cpu_qgemm, 8-row panels) on every instruction set
 * this CPU has, against the float product on the dequantized matrix: rows
 * that leave 1-7 past the last panel, columns spanning several 16-block
 * panels and (INT8) a float tail, n from 1 to 130. */
static void check_qgemm(const char *name, int64_t rows, int64_t cols) {
    static const int ns[] = {1, 2, 3, 5, 17, 64, 130};
    const int max_n = 130;
    loom_quant_spec_t spec;
    REQUIRE(loom_quant_spec_parse(name, &spec));
    float *w = rand_matrix(rows, cols), *x = rand_matrix(max_n, cols);
    float *y = malloc((size_t)(max_n * rows) * sizeof *y);
    loom_qtensor_t t;
    REQUIRE(loom_quantize(&spec, w, rows, cols, &t, NULL) == LOOM_OK);
    float *ref = float_reference(&t, x, max_n);
    loom_weight_t qw;
    repack_for_cpu(&qw, &t);
    void *scratch = loom_aligned_alloc(loom_cpu_qx_bytes(max_n, cols));
    for (loom_cpu_isa_t isa = LOOM_CPU_ISA_SCALAR; isa < LOOM_CPU_ISA_COUNT; isa++) {
        if (!loom_cpu_isa_supported(isa)) {
            fprintf(stderr, "  skipped: qgemm %s %s (this CPU lacks it)\n", name,
                    loom_cpu_isa_name(isa));
            continue;
        }
        for (size_t k = 0; k < sizeof ns / sizeof *ns; k++) {
            const int n = ns[k];
            loom_cpu_qx_t qx;
            loom_cpu_qx_init(&qx, scratch, x, n, &qw);
            loom_cpu_qx_quantize(&qx, 0, n);
            char what[96];
            snprintf(what, sizeof what, "qgemm %s %lldx%lld n=%d %s", name, (long long)rows,
                     (long long)cols, n, loom_cpu_isa_name(isa));
            for (int64_t i = 0; i < n * rows; i++) y[i] = NAN;
            loom_cpu_qgemm(isa, y, rows, &qx, &qw, 0, 16); /* two panels, as a thread's chunk */
            loom_cpu_qgemm(isa, y, rows, &qx, &qw, 16, rows);
            compare(what, y, ref, n * rows, MATMUL_TOL);
        }
    }
    loom_aligned_free(scratch);
    free_repacked(&qw);
    loom_qtensor_free(&t);
    free(w);
    free(x);
    free(y);
    free(ref);
}

static void test_qgemm(void) {
    check_qgemm("int8", 29, 1000);  /* 31 blocks + 8 float columns; 3 panels + 5 rows */
    check_qgemm("int8", 21, 20);    /* no whole block */
    check_qgemm("q4", 37, 1056);    /* 33 blocks: 3 panels of columns */
    check_qgemm("q4", 19, 160);     /* an odd number of blocks */
    check_qgemm("q4:128", 27, 640);
    check_qgemm("q4_min", 23, 96);
    check_qgemm("q4_min:64", 17, 576);
    check_qgemm("q4_min:128", 31, 1152);
}

/* INT8 code -128 (possible in imported checkpoints, never made by the
 * quantizer) at the extremes of the AVX2 sign trick's int16 range. */
static void test_int8_extremes(void) {
    enum { ROWS = 6, COLS = 96 };
    int8_t q[ROWS * COLS];
    float scales[ROWS], x[3 * COLS];
    for (int i = 0; i < ROWS * COLS; i++) q[i] = (int8_t)(i % 3 == 0 ? -128 : i % 3 == 1 ? 127 : -127);
    for (int r = 0; r < ROWS; r++) scales[r] = 0.01f * (float)(r + 1);
    for (int i = 0; i < 3 * COLS; i++) x[i] = i % 2 ? 1.0f : -1.0f; /* rounds to ±127 */
    loom_qtensor_t t = {.quant = LOOM_QUANT_INT8, .rows = ROWS, .cols = COLS, .group = COLS,
                        .q = q, .scales = scales};
    float *ref = float_reference(&t, x, 3);
    loom_backend_config_t cfg = {.version = LOOM_BACKEND_CONFIG_VERSION, .kind = LOOM_DEVICE_CPU,
                                 .n_threads = 1, .weight_dtype = LOOM_DT_F32};
    loom_backend_t *be = NULL;
    REQUIRE(loom_backend_create(&cfg, &be, NULL) == LOOM_OK);
    loom_weight_t qw;
    REQUIRE(loom_weight_upload_quant(be, &qw, &t, NULL) == LOOM_OK);
    float y[3 * ROWS];
    loom_cpu_matmul_path(be, y, x, &qw, 3, LOOM_CPU_MM_GEMV);
    compare("int8 extremes", y, ref, 3 * ROWS, 1e-6);
    loom_weight_free(be, &qw);
    loom_backend_destroy(&be);
    free(ref);
}

int main(void) {
    RUN(test_spec_parse);
    RUN(test_fp8);
    RUN(test_roundtrip);
    RUN(test_layout);
    RUN(test_check_errors);
    RUN(test_isas);
    RUN(test_qgemm);
    RUN(test_int8_extremes);
    RUN(test_cpu_matmul);
    return test_summary();
}

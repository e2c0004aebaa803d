/* Every op of the CUDA backend against the CPU backend (the reference) on
 * fresh random inputs and odd shapes: outputs are poisoned with NaN first so
 * unwritten elements fail, and compared with a tolerance tied to the dtype
 * (bf16 activations in cuBLAS GEMMs, TF32 in the attention tiles, fp32
 * elsewhere). Sampling must match exactly (ids and candidate order; keys to
 * the last bit except Gumbel noise, which may differ by an ulp of the double
 * log). Quantized weights (every scheme of kernels/quant.h) are checked
 * against the CPU backend on the same canonical tensor. Without a GPU it
 * prints "skipped: no GPU" and exits 77 (ctest's SKIP_RETURN_CODE).
 *
 *   test_cuda_ops [--flash] [--seed N]  (seed default: from the clock, printed; LOOM_TEST_SEED too;
 *                                       --flash: only the FA2-style prefill kernel's checks) */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "common/log.h"
#include "common/util.h"
#include "kernels/backend.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/lora.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/cublaslt_dl.h"
#include "kernels/cuda/flash.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/opmath.h"
#include "kernels/quant.h"
#include "tests/test.h"
#include "worker/moe_ds.h"

#define SKIP_CODE 77

static unsigned long long g_rng;
static loom_backend_t *g_cpu[3];  /* F32, BF16, F16 weights */
static loom_backend_t *g_cuda[3]; /* exact F32, BF16, F16 */
static const loom_dtype_t k_dts[3] = {LOOM_DT_F32, LOOM_DT_BF16, LOOM_DT_F16};

static float randf(float scale) {
    return test_randf(&g_rng, scale);
}
static int randi(int n) { /* [0, n) */
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int)((g_rng >> 33) % (unsigned long long)n);
}

static float *rand_host(size_t n, float scale) {
    float *h = loom_xmalloc(n * sizeof *h + 4);
    for (size_t i = 0; i < n; i++) h[i] = randf(scale);
    return h;
}

/* Device copy of host data on backend be. */
static void *to_dev(loom_backend_t *be, const void *h, size_t bytes) {
    void *d = loom_backend_alloc(be, bytes ? bytes : 4);
    LOOM_ASSERT(d != NULL);
    loom_backend_upload(be, d, h, bytes);
    return d;
}

static void *poisoned(loom_backend_t *be, size_t bytes) {
    void *d = loom_backend_alloc(be, bytes ? bytes : 4);
    LOOM_ASSERT(d != NULL);
    loom_backend_memset(be, d, 0xff, bytes); /* NaN in every float */
    return d;
}

static float *from_dev(loom_backend_t *be, const void *d, size_t n) {
    float *h = loom_xmalloc(n * sizeof *h + 4);
    loom_backend_download(be, h, d, n * sizeof *h);
    return h;
}

static int close_dev(const char *what, loom_backend_t *be, const float *d, const float *ref, size_t n, double atol,
                     double rtol) {
    float *h = from_dev(be, d, n);
    int ok = test_allclose(what, h, ref, (long)n, atol, rtol);
    free(h);
    return ok;
}

/* --- memory ---------------------------------------------------------------------- */

static void test_memory(void) {
    loom_backend_t *be = g_cuda[1];
    CHECK(loom_backend_kind(be) == LOOM_DEVICE_CUDA);
    CHECK(loom_backend_stream(be) != NULL);
    size_t n = (size_t)5 << 20; /* 20 MB: crosses the upload ring several times */
    float *h = rand_host(n, 1.0f);
    float *d = to_dev(be, h, n * 4);
    float *d2 = poisoned(be, n * 4);
    loom_backend_copy(be, d2, d, n * 4);
    CHECK(close_dev("upload/copy/download", be, d2, h, n, 0, 0));
    loom_backend_memset(be, d2 + 3, 0, 40);
    float *back = from_dev(be, d2, 16);
    CHECK(back[2] == h[2] && back[3] == 0.0f && back[12] == 0.0f && back[13] == h[13]);
    free(back);
    loom_err_t err = {0};
    CHECK(loom_backend_synchronize(be, &err) == LOOM_OK);
    CHECK(loom_backend_mem_free(be) > 0);
    /* out of memory is an answer, not a crash */
    CHECK(loom_backend_alloc(be, (size_t)1 << 52) == NULL);
    loom_weight_t w;
    CHECK(loom_weight_upload(be, &w, 1 << 30, 1 << 30, h, &err) == LOOM_ERR_NOMEM);
    loom_backend_free(be, d);
    loom_backend_free(be, d2);
    free(h);
}

/* Half-precision weights are rounded exactly as the CPU backend rounds them. */
static void test_weight_upload(void) {
    for (int t = 1; t < 3; t++) {
        int64_t rows = 1037, cols = 4100; /* 17 MB of f32: several staging pieces */
        float *h = rand_host((size_t)rows * cols, 2.0f);
        loom_weight_t wg, wc;
        loom_err_t err = {0};
        REQUIRE(loom_weight_upload(g_cuda[t], &wg, rows, cols, h, &err) == LOOM_OK);
        REQUIRE(loom_weight_upload(g_cpu[t], &wc, rows, cols, h, &err) == LOOM_OK);
        CHECK(wg.dtype == k_dts[t] && loom_weight_bytes(&wg) == loom_weight_bytes(&wc));
        uint16_t *got = loom_xmalloc(loom_weight_bytes(&wg));
        loom_backend_download(g_cuda[t], got, wg.data, loom_weight_bytes(&wg));
        size_t bad = 0;
        for (size_t i = 0; i < (size_t)rows * cols; i++) bad += got[i] != ((const uint16_t *)wc.data)[i];
        CHECKF(bad == 0, "%zu of %lld %s weights differ from the CPU's rounding", bad, (long long)(rows * cols),
               loom_dtype_name(k_dts[t]));
        free(got);
        loom_weight_free(g_cuda[t], &wg);
        loom_weight_free(g_cpu[t], &wc);
        free(h);
    }
}

/* --- matmul ---------------------------------------------------------------------- */

static void check_matmul(int t, int64_t rows, int64_t cols, int n) {
    float *hw = rand_host((size_t)rows * cols, 1.0f), *hx = rand_host((size_t)n * cols, 1.0f);
    loom_weight_t wg, wc;
    loom_err_t err = {0};
    LOOM_ASSERT(loom_weight_upload(g_cuda[t], &wg, rows, cols, hw, &err) == LOOM_OK);
    LOOM_ASSERT(loom_weight_upload(g_cpu[t], &wc, rows, cols, hw, &err) == LOOM_OK);
    float *ref = loom_xmalloc((size_t)n * rows * sizeof *ref);
    loom_op_matmul(g_cpu[t], ref, hx, &wc, n);
    float *dx = to_dev(g_cuda[t], hx, (size_t)n * cols * 4), *dy = poisoned(g_cuda[t], (size_t)n * rows * 4);
    loom_op_matmul(g_cuda[t], dy, dx, &wg, n);
    if (n <= LOOM_CUDA_GEMV_MAX_N) { /* every GEMV variant gives the default's bits (opmath.h) */
        float *y0 = from_dev(g_cuda[t], dy, (size_t)n * rows);
        for (int v = 1; v < LOOM_OM_GEMV_VARIANTS; v++) {
            float *dv = poisoned(g_cuda[t], (size_t)n * rows * 4);
            loom_cuda_set_gemv_variant(g_cuda[t], v);
            loom_op_matmul(g_cuda[t], dv, dx, &wg, n);
            loom_cuda_set_gemv_variant(g_cuda[t], 0);
            float *yv = from_dev(g_cuda[t], dv, (size_t)n * rows);
            CHECKF(!memcmp(y0, yv, (size_t)n * rows * 4), "gemv variant %d: other bits than the default (rows %lld "
                   "cols %lld n %d)", v, (long long)rows, (long long)cols, n);
            free(yv);
            loom_backend_free(g_cuda[t], dv);
        }
        free(y0);
    }
    /* GEMV (n <= 4) keeps x in f32; cuBLAS rounds it to the weight dtype:
     * error ~ sqrt(cols) * unit roundoff * E|x w| */
    double u = t == 0 ? 1e-6 : n <= 4 ? 2e-6 : t == 1 ? 4e-3 : 5e-4;
    char what[96];
    snprintf(what, sizeof what, "matmul %s rows %lld cols %lld n %d", loom_dtype_name(k_dts[t]), (long long)rows,
             (long long)cols, n);
    CHECK(close_dev(what, g_cuda[t], dy, ref, (size_t)n * rows, 4.0 * u * sqrt((double)cols) + 1e-5, 1e-3));
    loom_backend_free(g_cuda[t], dx);
    loom_backend_free(g_cuda[t], dy);
    loom_weight_free(g_cuda[t], &wg);
    loom_weight_free(g_cpu[t], &wc);
    free(hw);
    free(hx);
    free(ref);
}

static void test_matmul(void) {
    static const int shapes[][3] = {
        {1, 8, 1},      {37, 64, 1},   {4099, 136, 1}, {4099, 136, 2}, {129, 4104, 3}, {130, 4096, 4},
        {255, 520, 5},  {1000, 1024, 17}, {96, 100, 2}, {97, 100, 9},   {33, 7, 3},     {6144, 4096, 1},
        {512, 1000, 33}, {300, 4096, 64},
    };
    for (int t = 0; t < 3; t++)
        for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++) check_matmul(t, shapes[s][0], shapes[s][1], shapes[s][2]);
}

/* loom_op_matmul_bias: on CUDA with bf16/f16 weights and n >= 64,
 * cuBLASLt's bias epilogue (counted: every such call takes it where
 * cuBLASLt loads), else matmul + add_bias; against the CPU's matmul and
 * bias add, on odd shapes, with the epilogue on and off. */
static void test_matmul_bias(void) {
    static const int shapes[][3] = {{1000, 1024, 100}, {97, 104, 64}, {4096 + 512 * 2, 4096, 512}, {37, 64, 3},
                                    {130, 256, 63}};
    const loom_cublaslt_api_t *lt = NULL;
    loom_err_t err = {0};
    const int have_lt = loom_cublaslt_load(&lt, &err) == LOOM_OK;
    for (int t = 1; t < 3; t++)
        for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++)
            for (int on = 1; on >= 0; on--) {
                const int64_t rows = shapes[s][0], cols = shapes[s][1];
                const int n = shapes[s][2];
                float *hw = rand_host((size_t)rows * cols, 1.0f), *hx = rand_host((size_t)n * cols, 1.0f),
                      *hb = rand_host((size_t)rows, 2.0f);
                loom_weight_t wg, wc;
                LOOM_ASSERT(loom_weight_upload(g_cuda[t], &wg, rows, cols, hw, &err) == LOOM_OK);
                LOOM_ASSERT(loom_weight_upload(g_cpu[t], &wc, rows, cols, hw, &err) == LOOM_OK);
                float *ref = loom_xmalloc((size_t)n * rows * sizeof *ref);
                loom_op_matmul(g_cpu[t], ref, hx, &wc, n);
                for (int i = 0; i < n; i++)
                    for (int64_t r = 0; r < rows; r++) ref[i * rows + r] += hb[r];
                float *dx = to_dev(g_cuda[t], hx, (size_t)n * cols * 4), *db = to_dev(g_cuda[t], hb, (size_t)rows * 4),
                      *dy = poisoned(g_cuda[t], (size_t)n * rows * 4);
                loom_cuda_set_lt_bias(g_cuda[t], on);
                const uint64_t before = loom_cuda_lt_bias_count(g_cuda[t]);
                loom_op_matmul_bias(g_cuda[t], dy, dx, &wg, db, n);
                const int took = loom_cuda_lt_bias_count(g_cuda[t]) > before;
                char what[128];
                snprintf(what, sizeof what, "matmul_bias %s rows %lld cols %lld n %d, epilogue %s",
                         loom_dtype_name(k_dts[t]), (long long)rows, (long long)cols, n, on ? "on" : "off");
                CHECKF(took == (on && have_lt && n >= 64), "%s: epilogue %s", what, /* LT_BIAS_MIN_N */
                       took ? "taken" : "not taken");
                const double u = n <= 4 ? 2e-6 : t == 1 ? 4e-3 : 5e-4;
                CHECK(close_dev(what, g_cuda[t], dy, ref, (size_t)n * rows, 4.0 * u * sqrt((double)cols) + 1e-5,
                                1e-3));
                loom_backend_free(g_cuda[t], dx);
                loom_backend_free(g_cuda[t], db);
                loom_backend_free(g_cuda[t], dy);
                loom_weight_free(g_cuda[t], &wg);
                loom_weight_free(g_cpu[t], &wc);
                free(hw), free(hx), free(hb), free(ref);
            }
    loom_cuda_set_lt_bias(g_cuda[1], 1);
    loom_cuda_set_lt_bias(g_cuda[2], 1);
}

/* --- quantized matmul --------------------------------------------------------------- */

static int g_cc; /* compute capability of cuda:0, 10 * major + minor */

/* One scheme and shape: the same canonical tensor on the CPU backend (the
 * reference: float32 math on the dequantized matrix) and on the CUDA
 * backends with exact f32 (t = 0) and bf16 (t = 1) weights. Tolerances:
 * the GEMV (n <= 8) and the f32 prefill keep f32 activations and weights,
 * so only the summation order differs (~sqrt(cols) * 2^-24 * |w x|); the
 * bf16 prefill rounds x and the dequantized W to bf16 (~sqrt(cols) * 2^-9),
 * as check_matmul allows for bf16 weights. */
static void check_qmatmul(const char *scheme, int t, int64_t rows, int64_t cols, int n) {
    loom_quant_spec_t spec;
    LOOM_ASSERT(loom_quant_spec_parse(scheme, &spec));
    float *hw = rand_host((size_t)rows * cols, 1.0f), *hx = rand_host((size_t)n * cols, 1.0f);
    loom_qtensor_t q;
    loom_weight_t wg, wc;
    loom_err_t err = {0};
    LOOM_ASSERT(loom_quantize(&spec, hw, rows, cols, &q, &err) == LOOM_OK);
    char what[128];
    snprintf(what, sizeof what, "qmatmul %s on %s rows %lld cols %lld n %d", scheme,
             t == 0 ? "f32" : "bf16", (long long)rows, (long long)cols, n);
    loom_status_t st = loom_weight_upload_quant(g_cuda[t], &wg, &q, &err);
    if (spec.quant == LOOM_QUANT_FP8 && g_cc < 89) {
        CHECKF(st == LOOM_ERR_UNSUPPORTED && strstr(err.msg, "compute capability"),
               "%s: fp8 on a %d.%d device gave %d (%s)", what, g_cc / 10, g_cc % 10, (int)st, err.msg);
        loom_qtensor_free(&q);
        free(hw), free(hx);
        return;
    }
    CHECKF(st == LOOM_OK, "%s: upload: %s", what, err.msg);
    if (st != LOOM_OK) {
        loom_qtensor_free(&q);
        free(hw), free(hx);
        return;
    }
    LOOM_ASSERT(loom_weight_upload_quant(g_cpu[0], &wc, &q, &err) == LOOM_OK);
    CHECK(wg.quant == spec.quant && wg.group == q.group && loom_weight_bytes(&wg) == loom_weight_bytes(&wc));
    float *ref = loom_xmalloc((size_t)n * rows * sizeof *ref);
    /* the sgemm path: the CPU's quantized GEMV rounds x to int8 (qgemv.c),
     * which is not the reference the CUDA kernels are held to */
    loom_cpu_matmul_path(g_cpu[0], ref, hx, &wc, n, LOOM_CPU_MM_SGEMM);
    float *dx = to_dev(g_cuda[t], hx, (size_t)n * cols * 4), *dy = poisoned(g_cuda[t], (size_t)n * rows * 4);
    loom_op_matmul(g_cuda[t], dy, dx, &wg, n);
    if (n <= 2) { /* every quantized GEMV variant gives the default's bits (opmath.h) */
        float *y0 = from_dev(g_cuda[t], dy, (size_t)n * rows);
        for (int v = 1; v < LOOM_OM_QGEMV_VARIANTS; v++) {
            float *dv = poisoned(g_cuda[t], (size_t)n * rows * 4);
            loom_cuda_set_qgemv_variant(g_cuda[t], v);
            loom_op_matmul(g_cuda[t], dv, dx, &wg, n);
            loom_cuda_set_qgemv_variant(g_cuda[t], 0);
            float *yv = from_dev(g_cuda[t], dv, (size_t)n * rows);
            CHECKF(!memcmp(y0, yv, (size_t)n * rows * 4), "%s: qgemv variant %d: other bits than the default", what,
                   v);
            free(yv);
            loom_backend_free(g_cuda[t], dv);
        }
        free(y0);
    }
    double u = n <= 8 || t == 0 ? 2e-6 : 4e-3;
    CHECK(close_dev(what, g_cuda[t], dy, ref, (size_t)n * rows, 4.0 * u * sqrt((double)cols) + 1e-5, 1e-3));
    /* x not 16-byte aligned: the scalar GEMV */
    if (n <= 8 && t == 0) {
        float *dx1 = poisoned(g_cuda[t], ((size_t)n * cols + 1) * 4);
        loom_backend_upload(g_cuda[t], dx1 + 1, hx, (size_t)n * cols * 4);
        loom_backend_memset(g_cuda[t], dy, 0xff, (size_t)n * rows * 4);
        loom_op_matmul(g_cuda[t], dy, dx1 + 1, &wg, n);
        char w2[160];
        snprintf(w2, sizeof w2, "%s, unaligned x", what);
        CHECK(close_dev(w2, g_cuda[t], dy, ref, (size_t)n * rows, 4.0 * u * sqrt((double)cols) + 1e-5, 1e-3));
        loom_backend_free(g_cuda[t], dx1);
    }
    loom_backend_free(g_cuda[t], dx);
    loom_backend_free(g_cuda[t], dy);
    loom_weight_free(g_cuda[t], &wg);
    loom_weight_free(g_cpu[0], &wc);
    loom_qtensor_free(&q);
    free(hw), free(hx), free(ref);
}

/* The small-n tensor-core kernel (qmma.cu) on bf16 weights, n from the
 * GEMV's crossover up to 64: odd rows (past a 64-row block), columns past a
 * 64-column step, k split (few rows, many columns) and not; held to the
 * bf16 prefill's tolerance (x rounded to bf16; INT8/FP8 codes are exact
 * in the tile). The shapes are ones the kernel takes (checked), so the
 * calls do not fall back to dequantize + cuBLAS. */
static void test_quant_mma(void) {
    static const char *schemes[] = {"int8", "fp8", "q4", "q4_min:64", "q4_min:128"};
    static const int shapes[][3] = {{77, 256, 9}, {130, 4096, 33}, {1000, 1152, 64}, {45, 1024, 17}, {4099, 512, 24}};
    loom_cuda_set_qmma_max_n(g_cuda[1], 64);
    for (size_t s = 0; s < LOOM_ARRAY_LEN(schemes); s++)
        for (size_t h = 0; h < LOOM_ARRAY_LEN(shapes); h++) {
            const int64_t rows = shapes[h][0], cols = shapes[h][1];
            loom_quant_spec_t spec;
            LOOM_ASSERT(loom_quant_spec_parse(schemes[s], &spec));
            const int group = spec.quant == LOOM_QUANT_Q4 ? spec.group : (int)cols;
            if (cols % group) continue;
            CHECKF(loom_cuda_qmma_fits((int)spec.quant, rows, cols, group, shapes[h][2], (const void *)16,
                                       (const void *)16),
                   "qmma takes %s %lld x %lld", schemes[s], (long long)rows, (long long)cols);
            check_qmatmul(schemes[s], 1, rows, cols, shapes[h][2]);
        }
    loom_cuda_set_qmma_max_n(g_cuda[1], -1);
}

/* FP8 prefill through cuBLASLt (fp8_gemm on; backend_cuda.c matmul_fp8):
 * x quantized per token, each output within fp8act.h's bound of the CPU's
 * float32 product over the dequantized weights; on sm_89+ with cuBLASLt
 * 12.9+ the calls must take that path (counted), elsewhere the old one. */
static void test_fp8_gemm(void) {
    static const int shapes[][3] = {{256, 1024, 100}, {1008, 4096, 77}, {48, 272, 9}};
    loom_quant_spec_t spec;
    LOOM_ASSERT(loom_quant_spec_parse("fp8", &spec));
    loom_backend_t *be = g_cuda[1];
    const loom_cublaslt_api_t *lt = NULL;
    loom_err_t err = {0};
    const int expect = g_cc >= 89 && loom_cublaslt_load(&lt, &err) == LOOM_OK && lt->version >= 120900;
    if (g_cc < 89) {
        printf("  fp8 GEMM: skipped (compute capability %d.%d)\n", g_cc / 10, g_cc % 10);
        return;
    }
    loom_cuda_set_fp8_gemm(be, 1);
    loom_cuda_set_qmma_max_n(be, 0);
    for (size_t h = 0; h < LOOM_ARRAY_LEN(shapes); h++) {
        const int64_t rows = shapes[h][0], cols = shapes[h][1];
        const int n = shapes[h][2];
        float *hw = rand_host((size_t)rows * cols, 1.0f), *hx = rand_host((size_t)n * cols, 1.0f);
        loom_qtensor_t q;
        LOOM_ASSERT(loom_quantize(&spec, hw, rows, cols, &q, &err) == LOOM_OK);
        loom_weight_t wg;
        REQUIRE(loom_weight_upload_quant(be, &wg, &q, &err) == LOOM_OK);
        float *dx = to_dev(be, hx, (size_t)n * cols * 4), *dy = poisoned(be, (size_t)n * rows * 4);
        const uint64_t before = loom_cuda_fp8_gemm_count(be);
        loom_op_matmul(be, dy, dx, &wg, n);
        float *y = from_dev(be, dy, (size_t)n * rows);
        CHECKF(loom_cuda_fp8_gemm_count(be) - before == (uint64_t)expect, "fp8 GEMM %lld x %lld n %d: path %s",
               (long long)rows, (long long)cols, n, expect ? "not taken" : "taken without cuBLASLt 12.9");
        int bad = 0;
        for (int t = 0; t < n; t++) {
            float amax = 0.0f;
            for (int64_t c = 0; c < cols; c++) amax = fmaxf(amax, fabsf(hx[t * cols + c]));
            for (int64_t r = 0; r < rows; r++) {
                double ref = 0.0, swx = 0.0, sw = 0.0;
                for (int64_t c = 0; c < cols; c++) {
                    const double wv = (double)q.scales[r] * loom_fp8_e4m3_to_f32(((const uint8_t *)q.q)[r * cols + c]);
                    ref += wv * hx[t * cols + c], swx += fabs(wv * hx[t * cols + c]), sw += fabs(wv);
                }
                const double bound = ldexp(swx, -4) + ldexp(sw, -10) * (amax / 448.0) + 1e-5 * swx + 1e-6;
                bad += !(fabs(y[t * rows + r] - ref) <= bound);
            }
        }
        CHECKF(!bad, "fp8 GEMM %lld x %lld n %d: %d outputs past the bound", (long long)rows, (long long)cols, n, bad);
        free(y), free(hw), free(hx);
        loom_backend_free(be, dx);
        loom_backend_free(be, dy);
        loom_weight_free(be, &wg);
        loom_qtensor_free(&q);
    }
    loom_cuda_set_fp8_gemm(be, 0);
    loom_cuda_set_qmma_max_n(be, -1);
}

static void test_quant_matmul(void) {
    static const char *schemes[] = {"int8", "fp8", "q4", "q4:64", "q4:128", "q4_min", "q4_min:64", "q4_min:128"};
    /* decode: n = 1..8 on the GEMV (vector path; 100 and 48 columns: the
     * scalar path for INT8/FP8, 48 is no 4-bit shape) */
    static const int dshapes[][2] = {{4099, 512}, {130, 4096}, {37, 384}, {29, 100}, {11, 48}};
    for (size_t s = 0; s < LOOM_ARRAY_LEN(schemes); s++)
        for (size_t h = 0; h < LOOM_ARRAY_LEN(dshapes); h++)
            for (int n = 1; n <= 8; n++) {
                int64_t rows = dshapes[h][0], cols = dshapes[h][1];
                if (!strncmp(schemes[s], "q4", 2) && cols % 128) continue; /* 4-bit: every group size divides */
                check_qmatmul(schemes[s], n % 2, rows, cols, n);
            }
    /* prefill: dequantize + cuBLAS, f32 and bf16 */
    static const int pshapes[][3] = {{1000, 1024, 64}, {300, 4096, 512}, {97, 100, 9}, {513, 256, 200}};
    for (size_t s = 0; s < LOOM_ARRAY_LEN(schemes); s++)
        for (size_t h = 0; h < LOOM_ARRAY_LEN(pshapes); h++)
            for (int t = 0; t < 2; t++) {
                int64_t rows = pshapes[h][0], cols = pshapes[h][1];
                if (!strncmp(schemes[s], "q4", 2) && cols % 128) continue;
                check_qmatmul(schemes[s], t, rows, cols, pshapes[h][2]);
            }
    /* 5000 x 4096 in f32 is two 64 MiB panels of dequantized rows */
    check_qmatmul("int8", 0, 5000, 4096, 64);
    check_qmatmul("q4_min:64", 0, 5000, 4096, 64);
    check_qmatmul("fp8", 0, 5000, 4096, 64);
    /* a recorded decode step with a quantized weight replays like the eager ops */
    {
        loom_backend_t *be = g_cuda[1];
        int n = 3, dim = 512, rows = 700;
        loom_quant_spec_t spec;
        LOOM_ASSERT(loom_quant_spec_parse("q4_min", &spec));
        float *hw = rand_host((size_t)rows * dim, 1.0f), *hg = rand_host((size_t)dim, 1.0f);
        loom_qtensor_t q;
        loom_weight_t w;
        loom_err_t err = {0};
        LOOM_ASSERT(loom_quantize(&spec, hw, rows, dim, &q, &err) == LOOM_OK);
        REQUIRE(loom_weight_upload_quant(be, &w, &q, &err) == LOOM_OK);
        float *dg = to_dev(be, hg, (size_t)dim * 4), *dx = poisoned(be, (size_t)n * dim * 4);
        float *dxn = poisoned(be, (size_t)n * dim * 4), *dy = poisoned(be, (size_t)n * rows * 4);
        float *eager = loom_xmalloc((size_t)n * rows * 4);
        for (int it = 0; it < 3; it++) {
            float *hx = rand_host((size_t)n * dim, 2.0f);
            loom_backend_upload(be, dx, hx, (size_t)n * dim * 4);
            loom_op_rmsnorm(be, dxn, dx, dg, n, dim, 1e-5f);
            loom_op_matmul(be, dy, dxn, &w, n);
            loom_backend_download(be, eager, dy, (size_t)n * rows * 4);
            loom_backend_memset(be, dy, 0xff, (size_t)n * rows * 4);
            if (!loom_backend_graph_begin(be, 4242)) {
                loom_op_rmsnorm(be, dxn, dx, dg, n, dim, 1e-5f);
                loom_op_matmul(be, dy, dxn, &w, n);
            }
            CHECK(loom_backend_graph_end(be, 4242) == 0);
            CHECK(close_dev("quantized graph replay", be, dy, eager, (size_t)n * rows, 0, 0));
            free(hx);
        }
        loom_backend_free(be, dg), loom_backend_free(be, dx), loom_backend_free(be, dxn), loom_backend_free(be, dy);
        loom_weight_free(be, &w);
        loom_qtensor_free(&q);
        free(hw), free(hg), free(eager);
    }
    /* a tensor that fails the checks is an error naming the problem, not a crash */
    loom_qtensor_t bad = {.quant = LOOM_QUANT_Q4, .rows = 4, .cols = 96, .group = 64};
    uint8_t codes[4 * 48];
    float sc[8];
    bad.q = codes, bad.scales = sc;
    loom_weight_t w;
    loom_err_t err = {0};
    CHECK(loom_weight_upload_quant(g_cuda[1], &w, &bad, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "does not divide"));
    bad.group = 32, bad.scales = NULL;
    CHECK(loom_weight_upload_quant(g_cuda[1], &w, &bad, &err) == LOOM_ERR_FORMAT && strstr(err.msg, "scales"));
}

/* --- element-wise ---------------------------------------------------------------------- */

static void test_rmsnorm_add(void) {
    static const int shapes[][2] = {{1, 4096}, {3, 64}, {5, 1001}, {17, 4100}, {9, 8}};
    loom_backend_t *be = g_cuda[1], *cpu = g_cpu[1];
    for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++) {
        int n = shapes[s][0], dim = shapes[s][1];
        size_t nd = (size_t)n * dim;
        float *x = rand_host(nd, 3.0f), *a = rand_host(nd, 1.0f), *g = rand_host((size_t)dim, 1.5f);
        float *ref = loom_xmalloc(nd * 4), *xr = loom_xmalloc(nd * 4);
        float *dx = to_dev(be, x, nd * 4), *da = to_dev(be, a, nd * 4), *dg = to_dev(be, g, (size_t)dim * 4);
        float *dy = poisoned(be, nd * 4);
        loom_op_rmsnorm(cpu, ref, x, g, n, dim, 1e-5f);
        loom_op_rmsnorm(be, dy, dx, dg, n, dim, 1e-5f);
        CHECK(close_dev("rmsnorm", be, dy, ref, nd, 1e-5, 1e-5));
        loom_op_rmsnorm(be, dx, dx, dg, n, dim, 1e-5f); /* in place */
        CHECK(close_dev("rmsnorm in place", be, dx, ref, nd, 1e-5, 1e-5));
        /* residual add + norm, against add then rmsnorm on the CPU */
        loom_backend_upload(be, dx, x, nd * 4);
        memcpy(xr, x, nd * 4);
        loom_op_add(cpu, xr, a, (int64_t)nd);
        loom_op_rmsnorm(cpu, ref, xr, g, n, dim, 1e-5f);
        loom_backend_memset(be, dy, 0xff, nd * 4);
        loom_op_add_rmsnorm(be, dx, da, dy, dg, n, dim, 1e-5f);
        CHECK(close_dev("add_rmsnorm x", be, dx, xr, nd, 0, 0));
        CHECK(close_dev("add_rmsnorm y", be, dy, ref, nd, 1e-5, 1e-5));
        /* plain residual add, odd lengths */
        loom_backend_upload(be, dx, x, nd * 4);
        loom_op_add(be, dx, da, (int64_t)nd - 1);
        memcpy(xr, x, nd * 4);
        loom_op_add(cpu, xr, a, (int64_t)nd - 1);
        CHECK(close_dev("add", be, dx, xr, nd, 0, 0));
        /* bias on every row (g as the bias) */
        loom_backend_upload(be, dx, x, nd * 4);
        loom_op_add_bias(be, dx, dg, n, dim);
        memcpy(xr, x, nd * 4);
        loom_op_add_bias(cpu, xr, g, n, dim);
        CHECK(close_dev("add_bias", be, dx, xr, nd, 0, 0));
        float *bufs[] = {dx, da, dg, dy};
        for (size_t i = 0; i < LOOM_ARRAY_LEN(bufs); i++) loom_backend_free(be, bufs[i]);
        free(x), free(a), free(g), free(ref), free(xr);
    }
}

/* RMSNorm and SiLU*mul write the narrowed GEMM input themselves when a cuBLAS
 * matmul follows: the result must be that of the plain path. */
static void test_fused_gemm_input(void) {
    for (int t = 1; t < 3; t++) {
        loom_backend_t *be = g_cuda[t], *cpu = g_cpu[t];
        int n = 23, dim = 520, hidden = 1000;
        float *x = rand_host((size_t)n * dim, 2.0f), *g = rand_host((size_t)dim, 1.0f);
        float *gu = rand_host((size_t)n * 2 * hidden, 2.0f);
        float *w1 = rand_host((size_t)hidden * dim, 1.0f), *w2 = rand_host((size_t)dim * hidden, 1.0f);
        loom_weight_t g1, g2, c1, c2;
        loom_err_t err = {0};
        LOOM_ASSERT(loom_weight_upload(be, &g1, hidden, dim, w1, &err) == LOOM_OK);
        LOOM_ASSERT(loom_weight_upload(be, &g2, dim, hidden, w2, &err) == LOOM_OK);
        LOOM_ASSERT(loom_weight_upload(cpu, &c1, hidden, dim, w1, &err) == LOOM_OK);
        LOOM_ASSERT(loom_weight_upload(cpu, &c2, dim, hidden, w2, &err) == LOOM_OK);
        float *xn = loom_xmalloc((size_t)n * dim * 4), *y1 = loom_xmalloc((size_t)n * hidden * 4);
        float *h = loom_xmalloc((size_t)n * hidden * 4), *y2 = loom_xmalloc((size_t)n * dim * 4);
        loom_op_rmsnorm(cpu, xn, x, g, n, dim, 1e-5f);
        loom_op_matmul(cpu, y1, xn, &c1, n);
        loom_op_silu_mul(cpu, h, gu, n, hidden);
        loom_op_matmul(cpu, y2, h, &c2, n);
        float *dx = to_dev(be, x, (size_t)n * dim * 4), *dg = to_dev(be, g, (size_t)dim * 4);
        float *dgu = to_dev(be, gu, (size_t)n * 2 * hidden * 4), *dxn = poisoned(be, (size_t)n * dim * 4);
        float *dy1 = poisoned(be, (size_t)n * hidden * 4), *dh = poisoned(be, (size_t)n * hidden * 4);
        float *dy2 = poisoned(be, (size_t)n * dim * 4);
        loom_op_rmsnorm(be, dxn, dx, dg, n, dim, 1e-5f);
        loom_op_matmul(be, dy1, dxn, &g1, n);
        loom_op_silu_mul(be, dh, dgu, n, hidden);
        loom_op_matmul(be, dy2, dh, &g2, n);
        double u = t == 1 ? 4e-3 : 5e-4;
        CHECK(close_dev("rmsnorm -> matmul", be, dy1, y1, (size_t)n * hidden, 4 * u * sqrt(dim), 1e-3));
        CHECK(close_dev("silu_mul -> matmul", be, dy2, y2, (size_t)n * dim, 8 * u * sqrt(hidden), 1e-3));
        /* a matmul of another buffer in between must not pick up a stale copy */
        loom_op_rmsnorm(be, dxn, dx, dg, n, dim, 1e-5f);
        loom_op_matmul(be, dy2, dh, &g2, n);
        loom_op_matmul(be, dy1, dxn, &g1, n);
        CHECK(close_dev("matmul after another", be, dy1, y1, (size_t)n * hidden, 4 * u * sqrt(dim), 1e-3));
        float *bufs[] = {dx, dg, dgu, dxn, dy1, dh, dy2};
        for (size_t i = 0; i < LOOM_ARRAY_LEN(bufs); i++) loom_backend_free(be, bufs[i]);
        loom_weight_free(be, &g1), loom_weight_free(be, &g2), loom_weight_free(cpu, &c1), loom_weight_free(cpu, &c2);
        free(x), free(g), free(gu), free(w1), free(w2), free(xn), free(y1), free(h), free(y2);
    }
}

static void test_silu_gather(void) {
    loom_backend_t *be = g_cuda[1], *cpu = g_cpu[1];
    static const int shapes[][2] = {{1, 14336}, {3, 172}, {7, 101}, {2, 4}};
    for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++) {
        int n = shapes[s][0], hidden = shapes[s][1];
        float *gu = rand_host((size_t)n * 2 * hidden, 6.0f), *ref = loom_xmalloc((size_t)n * hidden * 4);
        loom_op_silu_mul(cpu, ref, gu, n, hidden);
        float *dgu = to_dev(be, gu, (size_t)n * 2 * hidden * 4), *dout = poisoned(be, (size_t)n * hidden * 4);
        loom_op_silu_mul(be, dout, dgu, n, hidden);
        CHECK(close_dev("silu_mul", be, dout, ref, (size_t)n * hidden, 1e-6, 1e-5));
        loom_backend_free(be, dgu), loom_backend_free(be, dout);
        free(gu), free(ref);
    }
    static const int gshapes[][3] = {{5, 64, 512}, {3, 4096, 100}, {9, 33, 40}, {1, 1, 3}}; /* n, dim, table rows */
    for (size_t s = 0; s < LOOM_ARRAY_LEN(gshapes); s++) {
        int n = gshapes[s][0], dim = gshapes[s][1], rows = gshapes[s][2];
        float *table = rand_host((size_t)rows * dim, 1.0f), *ref = loom_xmalloc((size_t)n * dim * 4);
        int32_t idx[16];
        for (int i = 0; i < n; i++) idx[i] = randi(rows);
        loom_op_embed(cpu, ref, table, idx, n, dim);
        float *dt = to_dev(be, table, (size_t)rows * dim * 4), *dout = poisoned(be, (size_t)n * dim * 4);
        int32_t *di = to_dev(be, idx, (size_t)n * 4);
        loom_op_embed(be, dout, dt, di, n, dim);
        CHECK(close_dev("embed", be, dout, ref, (size_t)n * dim, 0, 0));
        loom_backend_memset(be, dout, 0xff, (size_t)n * dim * 4);
        loom_op_gather_rows(be, dout, dt, di, n, dim);
        CHECK(close_dev("gather_rows", be, dout, ref, (size_t)n * dim, 0, 0));
        loom_backend_free(be, dt), loom_backend_free(be, dout), loom_backend_free(be, di);
        free(table), free(ref);
    }
}

/* --- Mixture of Experts --------------------------------------------------------------- */

/* The router on the device against the host's (loom_moe_route_row); the
 * batched expert GEMV against the CPU's matmul of each pair's expert (one expert NULL: zeros); the
 * combine against the CPU backend's. Odd shapes take the kernels' scalar path. */
static void check_moe(int t, int E, int k, int n, int64_t rows, int64_t cols, int norm) {
    loom_backend_t *be = g_cuda[t], *cpu = g_cpu[t];
    loom_err_t err = {0};
    char what[128];
    snprintf(what, sizeof what, "moe %s E %d k %d n %d rows %lld cols %lld",
             loom_dtype_name(k_dts[t]), E, k, n, (long long)rows, (long long)cols);
    /* route */
    float *logits = rand_host((size_t)n * E, 3.0f);
    if (n > 1) logits[E + 1] = logits[E]; /* a tie */
    int32_t *rsel = loom_xmalloc((size_t)n * k * 4);
    float *rw = loom_xmalloc((size_t)n * k * 4);
    float *probs = loom_xmalloc((size_t)E * 4);
    for (int i = 0; i < n; i++)
        loom_moe_route_row(logits + (size_t)i * E, E, k, norm, probs, rsel + (size_t)i * k,
                           rw + (size_t)i * k);
    free(probs);
    for (int i = 0; i < n; i++)
        for (int j = 1; j < k; j++)
            CHECK(rsel[i * k + j - 1] < rsel[i * k + j]); /* ascending experts */
    float *dl = to_dev(be, logits, (size_t)n * E * 4), *dw = poisoned(be, (size_t)n * k * 4);
    int32_t *dsel = poisoned(be, (size_t)n * k * 4);
    loom_op_moe_route(be, dl, n, E, k, norm, dsel, dw);
    int32_t *gsel = (int32_t *)from_dev(be, dsel, (size_t)n * k);
    int same = 1;
    for (int i = 0; i < n * k; i++)
        same &= gsel[i] == rsel[i];
    if (!same) fprintf(stderr, "FAIL: %s: the device routed to other experts\n", what);
    CHECK(same);
    CHECK(close_dev(what, be, dw, rw, (size_t)n * k, 1e-6, 1e-5));
    /* gemv: expert E - 1 is another rank's */
    float **hw = loom_xcalloc((size_t)E, sizeof *hw);
    loom_weight_t *wg = loom_xcalloc((size_t)E, sizeof *wg),
                  *wc = loom_xcalloc((size_t)E, sizeof *wc);
    for (int e = 0; e < E - 1; e++) {
        hw[e] = rand_host((size_t)rows * cols, 1.0f);
        LOOM_ASSERT(loom_weight_upload(be, &wg[e], rows, cols, hw[e], &err) == LOOM_OK);
        LOOM_ASSERT(loom_weight_upload(cpu, &wc[e], rows, cols, hw[e], &err) == LOOM_OK);
    }
    if (loom_backend_moe_device(be, wg, E, k) != LOOM_CUDA_GEMV_MAX_N) {
        fprintf(stderr, "FAIL: cuda declines MoE on the device (%s, E %d, k %d)\n",
                loom_dtype_name(k_dts[t]), E, k);
        CHECK(0);
    }
    void *dtab = loom_backend_moe_table(be, wg, E);
    LOOM_ASSERT(dtab != NULL);
    const int P = n * k;
    for (int xdiv = 1; xdiv <= k; xdiv += k > 1 ? k - 1 : 1) {
        const int nx = (P + xdiv - 1) / xdiv;
        float *hx = rand_host((size_t)nx * cols, 1.0f), *ref = loom_xmalloc((size_t)P * rows * 4);
        for (int q = 0; q < P; q++) {
            if (rsel[q] == E - 1) {
                memset(ref + (size_t)q * rows, 0, (size_t)rows * 4);
                continue;
            }
            loom_op_matmul(cpu, ref + (size_t)q * rows, hx + (size_t)(q / xdiv) * cols,
                           &wc[rsel[q]], 1);
        }
        float *dx = to_dev(be, hx, (size_t)nx * cols * 4), *dy = poisoned(be, (size_t)P * rows * 4);
        loom_op_moe_gemv(be, dy, dx, xdiv, dsel, P, dtab, k_dts[t], rows, cols);
        double u = t == 0 ? 1e-6 : 2e-6;
        CHECK(close_dev(what, be, dy, ref, (size_t)P * rows, 4.0 * u * sqrt((double)cols) + 1e-5,
                        1e-3));
        loom_backend_free(be, dx), loom_backend_free(be, dy);
        free(hx), free(ref);
    }
    /* combine: pairs in reverse order, one skipped; then accumulated */
    int32_t *pos = loom_xmalloc((size_t)P * 4);
    for (int q = 0; q < P; q++)
        pos[q] = q == 1 ? -1 : P - 1 - q;
    float *hy = rand_host((size_t)P * cols, 1.0f), *ref = rand_host((size_t)n * cols, 1.0f);
    float *dout = to_dev(be, ref, (size_t)n * cols * 4), *dy = to_dev(be, hy, (size_t)P * cols * 4);
    int32_t *dpos = to_dev(be, pos, (size_t)P * 4);
    for (int acc = 0; acc <= 1; acc++) {
        loom_op_moe_combine(cpu, ref, hy, pos, rw, n, k, (int)cols, acc);
        loom_op_moe_combine(be, dout, dy, dpos, dw, n, k, (int)cols, acc);
        CHECK(close_dev(what, be, dout, ref, (size_t)n * cols, 1e-5, 1e-5));
    }
    loom_backend_free(be, dout), loom_backend_free(be, dy), loom_backend_free(be, dpos);
    free(pos), free(hy), free(ref);
    for (int e = 0; e < E - 1; e++) {
        loom_weight_free(be, &wg[e]);
        loom_weight_free(cpu, &wc[e]);
        free(hw[e]);
    }
    loom_backend_free(be, dtab);
    free(hw), free(wg), free(wc);
    /* expert biases on the pairs' rows (GPT-OSS): y(p) += bias(sel[p]) */
    {
        const int bc = (int)cols;
        float *hb = rand_host((size_t)E * bc, 1.0f), *hy0 = rand_host((size_t)P * bc, 1.0f);
        float *refb = loom_xmalloc((size_t)P * bc * 4);
        for (int q = 0; q < P; q++)
            for (int c = 0; c < bc; c++) refb[(size_t)q * bc + c] = hy0[(size_t)q * bc + c] + hb[(size_t)rsel[q] * bc + c];
        float *db = to_dev(be, hb, (size_t)E * bc * 4), *dyb = to_dev(be, hy0, (size_t)P * bc * 4);
        loom_op_moe_add_bias(be, dyb, dsel, P, db, bc);
        CHECK(close_dev("moe_add_bias", be, dyb, refb, (size_t)P * bc, 0, 0));
        loom_backend_free(be, db), loom_backend_free(be, dyb);
        free(hb), free(hy0), free(refb);
    }
    loom_backend_free(be, dl), loom_backend_free(be, dw), loom_backend_free(be, dsel);
    free(logits), free(rsel), free(rw), free(gsel);
}

static void test_moe(void) {
    /* E, k, n, rows, cols, norm: Mixtral-like, Qwen3-MoE-like (128 experts,
     * k 8), odd shapes (scalar path), one expert per token */
    static const int cases[][6] = {
        {8, 2, 4, 512, 256, 1}, {128, 8, 3, 96, 128, 1}, {60, 4, 2, 37, 101, 0},
        {5, 1, 1, 8, 12, 0},    {40, 3, 4, 200, 72, 1},
    };
    for (int t = 0; t < 3; t++)
        for (size_t c = 0; c < LOOM_ARRAY_LEN(cases); c++)
            check_moe(t, cases[c][0], cases[c][1], cases[c][2], cases[c][3], cases[c][4],
                      cases[c][5]);
    /* taken: float experts of one dtype (the others another rank's);
     * declined: too many experts, k above 32, a quantized or an other-dtype
     * expert, no expert held */
    static loom_weight_t ex[LOOM_CUDA_MOE_MAX_EXPERTS + 1];
    static int dummy;
    for (int e = 0; e < 8; e++)
        ex[e] = (loom_weight_t){.data = &dummy, .dtype = LOOM_DT_BF16, .rows = 4, .cols = 8};
    ex[5].data = NULL;
    CHECK(loom_backend_moe_device(g_cuda[1], ex, 8, 2) == LOOM_CUDA_GEMV_MAX_N);
    CHECK(loom_backend_moe_device(g_cuda[1], ex, LOOM_CUDA_MOE_MAX_EXPERTS + 1, 2) == 0);
    CHECK(loom_backend_moe_device(g_cuda[1], ex, 64, 33) == 0);
    ex[3].quant = LOOM_QUANT_INT8;
    CHECK(loom_backend_moe_device(g_cuda[1], ex, 8, 2) == 0);
    ex[3].quant = LOOM_QUANT_NONE, ex[3].dtype = LOOM_DT_F32;
    CHECK(loom_backend_moe_device(g_cuda[1], ex, 8, 2) == 0);
    CHECK(loom_backend_moe_device(g_cuda[1], ex + 16, 8, 2) == 0);
}

/* DeepSeekMoE's router on the device (loom_op_moe_route_ds) against the host's
 * (worker/moe_ds.c): V3's and Kimi-K2's shapes, V2's softmax routers, the
 * kernel's limits; ids exactly (a mismatch only at a near tie of the host's
 * biased scores, expf's last bit), weights within f32 rounding. Routers the
 * kernel does not take are declined. */
static void test_moe_route_ds(void) {
    loom_backend_t *be = g_cuda[1];
    static const loom_moe_ds_route_t shapes[] = {
        {256, 8, 1, LOOM_DS_TOPK_NOAUX_TC, 8, 4, 1, 2.5f},       {384, 8, 1, LOOM_DS_TOPK_NOAUX_TC, 1, 1, 1, 2.827f},
        {8, 2, 1, LOOM_DS_TOPK_NOAUX_TC, 2, 1, 1, 2.5f},         {160, 6, 0, LOOM_DS_TOPK_GROUP_LIMITED, 8, 3, 0, 16.0f},
        {64, 6, 0, LOOM_DS_TOPK_GREEDY, 1, 1, 0, 1.0f},          {1024, 32, 1, LOOM_DS_TOPK_NOAUX_TC, 32, 3, 1, 1.0f},
    };
    enum { N = 37 };
    for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++) {
        const loom_moe_ds_route_t *r = &shapes[s];
        const int E = r->n_experts, K = r->top_k;
        float *logits = rand_host((size_t)N * E, 4.0f), *bias = rand_host((size_t)E, 0.3f);
        for (int e = 1; e < E; e += 7) logits[e] = logits[e - 1]; /* ties in token 0 */
        int32_t *rsel = loom_xmalloc((size_t)N * K * 4), ids[32];
        float *rw = loom_xmalloc((size_t)N * K * 4), *scratch = loom_xmalloc((size_t)2 * E * 4);
        for (int t = 0; t < N; t++) {
            loom_moe_route_deepseek(r, logits + (size_t)t * E, r->sigmoid ? bias : NULL, scratch, ids,
                                    rw + (size_t)t * K);
            for (int k = 0; k < K; k++) rsel[t * K + k] = ids[k];
        }
        float *dl = to_dev(be, logits, (size_t)N * E * 4), *db = to_dev(be, bias, (size_t)E * 4);
        float *dw = poisoned(be, (size_t)N * K * 4);
        int32_t *dsel = poisoned(be, (size_t)N * K * 4);
        const loom_moe_ds_args_t a = {.n_experts = E, .top_k = K, .sigmoid = r->sigmoid, .method = (int)r->method,
                                      .n_group = r->n_group, .topk_group = r->topk_group,
                                      .norm_topk_prob = r->norm_topk_prob,
                                      .routed_scaling_factor = r->routed_scaling_factor,
                                      .bias = r->sigmoid ? db : NULL};
        CHECK(loom_backend_moe_route_ds_supported(be, &a));
        loom_op_moe_route_ds(be, dl, N, &a, dsel, dw);
        int32_t *gsel = (int32_t *)from_dev(be, dsel, (size_t)N * K);
        int same = 1;
        for (int i = 0; i < N * K; i++) same &= gsel[i] == rsel[i];
        char what[96];
        snprintf(what, sizeof what, "moe_route_ds E %d k %d groups %d/%d method %d", E, K, r->n_group,
                 r->topk_group, (int)r->method);
        if (!same) fprintf(stderr, "FAIL: %s: the device routed to other experts\n", what);
        CHECK(same);
        CHECK(close_dev(what, be, dw, rw, (size_t)N * K, 1e-6, 1e-5));
        loom_backend_free(be, dl), loom_backend_free(be, db), loom_backend_free(be, dw), loom_backend_free(be, dsel);
        free(logits), free(bias), free(rsel), free(rw), free(scratch), free(gsel);
    }
    /* declined: more than 1024 experts, k above 32, more than 32 groups, groups of one with noaux_tc */
    loom_moe_ds_args_t a = {.n_experts = 2048, .top_k = 8, .sigmoid = 1, .method = LOOM_DS_TOPK_NOAUX_TC,
                            .n_group = 8, .topk_group = 4, .norm_topk_prob = 1, .routed_scaling_factor = 1.0f};
    CHECK(!loom_backend_moe_route_ds_supported(be, &a));
    a.n_experts = 256, a.top_k = 33;
    CHECK(!loom_backend_moe_route_ds_supported(be, &a));
    a.top_k = 8, a.n_group = 64;
    CHECK(!loom_backend_moe_route_ds_supported(be, &a));
    a.n_group = 256, a.topk_group = 8;
    CHECK(!loom_backend_moe_route_ds_supported(be, &a));
    a.n_group = 8, a.topk_group = 4;
    CHECK(loom_backend_moe_route_ds_supported(be, &a));
    CHECK(!loom_backend_moe_route_ds_supported(g_cpu[1], &a)); /* the CPU routes DeepSeek on the host */
}

/* --- LoRA deltas ------------------------------------------------------------------ */

/* loom_op_lora on the device against the CPU's per-row reference: rows of
 * several adapters, base rows (-1), a slot of rank 0, odd shapes, strided
 * x and y. */
static void check_lora(int n, int64_t in, int64_t out, int n_slots, const int *ranks) {
    loom_backend_t *be = g_cuda[0];
    loom_lora_op_slot_t hs[8], ds[8];
    void *dev[16];
    int max_r = 1;
    for (int s = 0; s < n_slots; s++) {
        int r = ranks[s];
        float *a = rand_host((size_t)(r * in), 0.1f), *bt = rand_host((size_t)(r * out), 0.1f);
        hs[s] = (loom_lora_op_slot_t){.a = a, .bt = bt, .r = r, .scale = 0.25f + (float)s};
        ds[s] = hs[s];
        ds[s].a = dev[2 * s] = to_dev(be, a, (size_t)(r * in) * sizeof(float));
        ds[s].bt = dev[2 * s + 1] = to_dev(be, bt, (size_t)(r * out) * sizeof(float));
        if (r > max_r) max_r = r;
    }
    int64_t ldx = in + 3, ldy = out + 5;
    int32_t *slot = loom_xmalloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) slot[i] = randi(n_slots + 1) - 1;
    float *x = rand_host((size_t)(n * ldx), 1.0f), *y = rand_host((size_t)(n * ldy), 1.0f);
    float *dx = to_dev(be, x, (size_t)(n * ldx) * sizeof(float)), *dy = to_dev(be, y, (size_t)(n * ldy) * sizeof(float));
    int32_t *dslot = to_dev(be, slot, (size_t)n * sizeof(int32_t));
    loom_op_lora(be, dy, ldy, dx, ldx, n, in, out, dslot, ds, n_slots, max_r);
    loom_err_t err = {0};
    CHECK(loom_backend_synchronize(be, &err) == LOOM_OK);
    loom_cpu_lora_ref(y, ldy, x, ldx, n, in, out, slot, hs, n_slots);
    char what[96];
    snprintf(what, sizeof what, "lora n %d in %lld out %lld slots %d", n, (long long)in, (long long)out, n_slots);
    CHECK(close_dev(what, be, dy, y, (size_t)(n * ldy), 1e-4, 1e-3));
    for (int s = 0; s < n_slots; s++) {
        free((void *)hs[s].a), free((void *)hs[s].bt);
        loom_backend_free(be, dev[2 * s]), loom_backend_free(be, dev[2 * s + 1]);
    }
    loom_backend_free(be, dx), loom_backend_free(be, dy), loom_backend_free(be, dslot);
    free(slot), free(x), free(y);
}

static void test_lora(void) {
    static const int r4[4] = {1, 16, 0, 7}, r8[8] = {16, 8, 16, 4, 16, 1, 16, 2}, r1[1] = {64};
    check_lora(13, 37, 29, 4, r4);
    check_lora(32, 203, 257, 8, r8);
    check_lora(1, 512, 1024, 1, r1);
    check_lora(70, 96, 131, 4, r4);
}

/* --- RoPE and the KV write ---------------------------------------------------------- */

static void test_rope_kv(void) {
    loom_backend_t *be = g_cuda[1], *cpu = g_cpu[1];
    static const int shapes[][4] = {{5, 8, 4, 8}, {7, 32, 8, 128}, {3, 4, 2, 64}, {2, 3, 1, 6}, {1, 32, 8, 128}};
    for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++) {
        int n = shapes[s][0], nh = shapes[s][1], nkv = shapes[s][2], hd = shapes[s][3];
        int stride = (nh + 2 * nkv) * hd + (s & 1); /* odd strides too */
        size_t total = (size_t)n * stride;
        float *x = rand_host(total, 2.0f), *inv = loom_xmalloc((size_t)hd / 2 * 4);
        for (int j = 0; j < hd / 2; j++) inv[j] = (float)pow(10000.0, -2.0 * j / hd);
        int32_t pos[8], slots[8];
        int n_blocks = 4, B = 16, kv_dim = nkv * hd;
        for (int i = 0; i < n; i++) {
            pos[i] = i == 0 ? 0 : randi(200000);
            slots[i] = i == 1 ? -1 : i * 7 % (n_blocks * B); /* one padding token */
        }
        size_t cache = (size_t)n_blocks * B * kv_dim;
        float *kc = rand_host(cache, 1.0f), *vc = rand_host(cache, 1.0f);
        float *xr = loom_xmalloc(total * 4), *kcr = loom_xmalloc(cache * 4), *vcr = loom_xmalloc(cache * 4);
        memcpy(xr, x, total * 4), memcpy(kcr, kc, cache * 4), memcpy(vcr, vc, cache * 4);
        float *q = xr, *k = xr + nh * hd, *v = k + kv_dim;
        loom_op_rope(cpu, q, stride, n, nh, hd, pos, inv);
        loom_op_rope(cpu, k, stride, n, nkv, hd, pos, inv);
        loom_kv_layer_t ckv = {.k = kcr, .v = vcr, .dtype = LOOM_DT_F32};
        loom_op_kv_write(cpu, &ckv, k, v, stride, slots, n, nkv, hd);
        float *dx = to_dev(be, x, total * 4), *dinv = to_dev(be, inv, (size_t)hd / 2 * 4);
        int32_t *dpos = to_dev(be, pos, (size_t)n * 4), *dslots = to_dev(be, slots, (size_t)n * 4);
        float *dkc = to_dev(be, kc, cache * 4), *dvc = to_dev(be, vc, cache * 4);
        /* separate ops */
        float *dq = dx, *dk = dx + nh * hd, *dv = dk + kv_dim;
        loom_op_rope(be, dq, stride, n, nh, hd, dpos, dinv);
        loom_op_rope(be, dk, stride, n, nkv, hd, dpos, dinv);
        loom_kv_layer_t dkv = {.k = dkc, .v = dvc, .dtype = LOOM_DT_F32};
        loom_op_kv_write(be, &dkv, dk, dv, stride, dslots, n, nkv, hd);
        CHECK(close_dev("rope", be, dx, xr, total, 2e-6, 2e-6));
        CHECK(close_dev("kv_write k", be, dkc, kcr, cache, 2e-6, 2e-6));
        CHECK(close_dev("kv_write v", be, dvc, vcr, cache, 0, 0));
        /* fused */
        loom_backend_upload(be, dx, x, total * 4);
        loom_backend_upload(be, dkc, kc, cache * 4);
        loom_backend_upload(be, dvc, vc, cache * 4);
        loom_op_rope_kv_write(be, dq, dk, dv, stride, n, nh, nkv, hd, dpos, dinv, &dkv, dslots);
        CHECK(close_dev("rope_kv_write x", be, dx, xr, total, 2e-6, 2e-6));
        CHECK(close_dev("rope_kv_write k", be, dkc, kcr, cache, 2e-6, 2e-6));
        CHECK(close_dev("rope_kv_write v", be, dvc, vcr, cache, 0, 0));
        /* bf16 and fp8 caches: the fused write against the CPU's f32 result
         * narrowed on the host (round to nearest even both ways: exact) */
        static const loom_dtype_t narrow[] = {LOOM_DT_BF16, LOOM_DT_F8_E4M3};
        for (size_t t = 0; t < LOOM_ARRAY_LEN(narrow); t++) {
            const size_t es = loom_dtype_size(narrow[t]);
            void *nk = loom_xcalloc(cache, es), *nv = loom_xcalloc(cache, es);
            loom_kv_layer_t nkv_l = {.k = to_dev(be, nk, cache * es), .v = to_dev(be, nv, cache * es),
                                     .dtype = narrow[t]};
            loom_backend_upload(be, dx, x, total * 4);
            loom_op_rope_kv_write(be, dq, dk, dv, stride, n, nh, nkv, hd, dpos, dinv, &nkv_l, dslots);
            loom_backend_download(be, nk, nkv_l.k, cache * es);
            loom_backend_download(be, nv, nkv_l.v, cache * es);
            int bad = 0;
            for (int i = 0; i < n; i++) {
                if (slots[i] < 0) continue;
                for (int e = 0; e < kv_dim; e++) {
                    size_t off = (size_t)slots[i] * kv_dim + e;
                    for (int isv = 0; isv < 2; isv++) {
                        float want = (isv ? vcr : kcr)[off];
                        const void *got = isv ? nv : nk;
                        int same = narrow[t] == LOOM_DT_BF16
                                       ? ((const uint16_t *)got)[off] == loom_f32_to_bf16(want)
                                       : ((const uint8_t *)got)[off] == loom_f32_to_fp8_e4m3(want);
                        /* the rotated k may differ from the CPU's by an ulp: allow the neighbour code */
                        if (!same && !isv) {
                            float g = narrow[t] == LOOM_DT_BF16 ? loom_bf16_to_f32(((const uint16_t *)got)[off])
                                                                : loom_fp8_e4m3_to_f32(((const uint8_t *)got)[off]);
                            same = fabsf(g - want) <= (narrow[t] == LOOM_DT_BF16 ? 8e-3f : 7e-2f) * fabsf(want) + 1e-6f;
                        }
                        if (!same && bad++ < 3)
                            fprintf(stderr, "  rope_kv_write %s %c[slot %d, %d]: got other code than %g\n",
                                    loom_kv_dtype_name(narrow[t]), isv ? 'v' : 'k', slots[i], e, (double)want);
                    }
                }
            }
            CHECKF(!bad, "rope_kv_write into a %s cache (n %d nh %d nkv %d hd %d): %d mismatches",
                   loom_kv_dtype_name(narrow[t]), n, nh, nkv, hd, bad);
            loom_backend_free(be, nkv_l.k), loom_backend_free(be, nkv_l.v);
            free(nk), free(nv);
        }
        void *bufs[] = {dx, dinv, dpos, dslots, dkc, dvc};
        for (size_t i = 0; i < LOOM_ARRAY_LEN(bufs); i++) loom_backend_free(be, bufs[i]);
        free(x), free(inv), free(kc), free(vc), free(xr), free(kcr), free(vcr);
    }
}

/* --- attention ----------------------------------------------------------------------- */

/* The KV cache dtypes the CUDA backend has. */
static const loom_dtype_t k_kv_dts[] = {LOOM_DT_F32, LOOM_DT_BF16, LOOM_DT_F8_E4M3, LOOM_DT_I8};

typedef struct attn_case {
    int nh, nkv, hd, B;
    int latent; /* MLA's latent layout: V is K's memory (and scales) */
    int vd;     /* V's head dim where it is not hd (decompressed MLA: kv.v_dim); 0: hd */
} attn_case_t;

/* The families' extras: a sliding window, a logit soft cap, sinks. */
typedef struct attn_extra {
    int window;
    float softcap;
    int sinks;
} attn_extra_t;
static const attn_extra_t *g_extra; /* of the run_attention calls in progress; NULL: none */
static int g_fa_checked;             /* calls run_attention also ran through the FA2-style kernel */
/* fp8 caches with per-tensor scales (run_attention): K and V values
 * multiplied by these (far beyond 448), stored divided by scales that keep
 * them below it, q divided by K's so the scores stay as peaky as usual.
 * 0: no scales. */
static float g_fp8_mul[2];

/* Narrows n floats of x into the cache elements nb of dt (not I8); FP8
 * (scale fs, 0: 1) writes the dequantized values back into x, which the
 * CPU reference then reads. */
static void narrow_cache(loom_dtype_t dt, float fs, float *x, void *nb, size_t n) {
    for (size_t e = 0; e < n; e++) {
        if (dt == LOOM_DT_BF16) {
            ((uint16_t *)nb)[e] = loom_f32_to_bf16(x[e]);
        } else if (dt == LOOM_DT_F8_E4M3) {
            const float s = fs > 0.0f ? fs : 1.0f;
            ((uint8_t *)nb)[e] = loom_f32_to_fp8_e4m3(fs > 0.0f ? x[e] * (1.0f / s) : x[e]);
            x[e] = fs > 0.0f ? loom_fp8_e4m3_to_f32(((uint8_t *)nb)[e]) * s : loom_fp8_e4m3_to_f32(((uint8_t *)nb)[e]);
        } else {
            ((float *)nb)[e] = x[e];
        }
    }
}

/* A batch: n_seqs sequences with context lengths ctx[s]; tokens listed as
 * (seq, pos). Builds a random cache in dt and shuffled block tables, runs
 * both backends and compares: BF16 on both; FP8 (which the CPU lacks)
 * against the CPU on the e4m3 values widened to f32 on the host. The
 * softmaxes' log-sum-exp (loom_attn_args_t.lse) is compared too, where
 * there are no sinks. */
static void run_attention(const attn_case_t *ac, loom_dtype_t dt, int n_seqs, const int *ctx, int n,
                          const int32_t *tok_seq, const int32_t *tok_pos, const char *what) {
    loom_backend_t *be = g_cuda[1], *cpu = g_cpu[1];
    const int nh = ac->nh, nkv = ac->nkv, hd = ac->hd, B = ac->B, kv_dim = nkv * hd;
    const int vd = ac->vd ? ac->vd : hd, v_dim = nkv * vd;
    int max_blocks = 1, total_blocks = 0, max_ctx = 1;
    for (int s = 0; s < n_seqs; s++) {
        int nb = (ctx[s] + B - 1) / B;
        max_blocks = LOOM_MAX(max_blocks, nb + 1);
        total_blocks += nb;
    }
    for (int i = 0; i < n; i++) max_ctx = LOOM_MAX(max_ctx, tok_pos[i] + 1);
    int n_blocks = total_blocks + 3;
    /* block ids: a shuffled permutation, -1 past each sequence's end */
    int32_t *perm = loom_xmalloc((size_t)n_blocks * 4);
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = randi(i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int32_t *bt = loom_xmalloc((size_t)n_seqs * max_blocks * 4);
    for (int s = 0, used = 0; s < n_seqs; s++) {
        int nb = (ctx[s] + B - 1) / B;
        for (int j = 0; j < max_blocks; j++) bt[(size_t)s * max_blocks + j] = j < nb ? perm[used + j] : -1;
        used += nb;
    }
    const attn_extra_t ex = g_extra ? *g_extra : (attn_extra_t){0};
    if (ex.window > 0) /* blocks wholly before every token's window are freed: never read */
        for (int s = 0; s < n_seqs; s++) {
            int lo = 1 << 30;
            for (int i = 0; i < n; i++)
                if (tok_seq[i] == s) lo = LOOM_MIN(lo, tok_pos[i] + 1 > ex.window ? tok_pos[i] + 1 - ex.window : 0);
            for (int j = 0; j < max_blocks && (j + 1) * B <= lo; j++) bt[(size_t)s * max_blocks + j] = -1;
        }
    size_t cache = (size_t)n_blocks * B * kv_dim, vcache = (size_t)n_blocks * B * v_dim;
    float *kc = rand_host(cache, 1.0f), *vc = rand_host(vcache, 1.0f);
    if (ac->latent) memcpy(vc, kc, cache * sizeof(float)); /* the same row as K and as V */
    const int scaled = dt == LOOM_DT_F8_E4M3 && g_fp8_mul[0] > 0.0f;
    const float fs[2] = {scaled ? g_fp8_mul[0] / 300.0f : 0.0f, scaled ? g_fp8_mul[1] / 300.0f : 0.0f};
    if (scaled) {
        for (size_t e = 0; e < cache; e++) kc[e] *= g_fp8_mul[0];
        for (size_t e = 0; e < vcache; e++) vc[e] *= g_fp8_mul[1];
    }
    const size_t es = loom_dtype_size(dt);
    void *kn = loom_xmalloc(cache * es), *vn = loom_xmalloc(vcache * es); /* the cache in dt */
    const size_t cells = (size_t)n_blocks * B;
    float *ksc = NULL, *vsc = NULL;
    if (dt == LOOM_DT_I8) { /* quantised by the CPU backend; both backends read the same codes */
        ksc = loom_xmalloc(cells * nkv * 4), vsc = loom_xmalloc(cells * nkv * 4);
        int32_t *all = loom_xmalloc(cells * 4);
        for (size_t i = 0; i < cells; i++) all[i] = (int32_t)i;
        if (vd == hd) {
            loom_kv_layer_t ql = {.k = kn, .v = vn, .k_scale = ksc, .v_scale = vsc, .dtype = LOOM_DT_I8};
            loom_op_kv_write(cpu, &ql, kc, vc, kv_dim, all, (int)cells, nkv, hd);
        } else { /* rows of two widths: K and V each written as both halves of a layer of its own */
            loom_kv_layer_t qk = {.k = kn, .v = kn, .k_scale = ksc, .v_scale = ksc, .dtype = LOOM_DT_I8};
            loom_op_kv_write(cpu, &qk, kc, kc, kv_dim, all, (int)cells, nkv, hd);
            loom_kv_layer_t qv = {.k = vn, .v = vn, .k_scale = vsc, .v_scale = vsc, .dtype = LOOM_DT_I8};
            loom_op_kv_write(cpu, &qv, vc, vc, v_dim, all, (int)cells, nkv, vd);
        }
        free(all);
    } else {
        narrow_cache(dt, fs[0], kc, kn, cache);
        narrow_cache(dt, fs[1], vc, vn, vcache);
    }
    int q_stride = (nh + 2 * nkv) * hd, out_stride = nh * vd;
    float *q = rand_host((size_t)n * q_stride, 3.0f); /* peaky attention, not a plain average */
    for (size_t e = 0; scaled && e < (size_t)n * q_stride; e++) q[e] /= g_fp8_mul[0];
    float *ref = loom_xmalloc((size_t)n * out_stride * 4);
    loom_attn_args_t a = {.n = n, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 1.0f / sqrtf((float)hd),
                          .q = q, .q_stride = q_stride, .out = ref, .out_stride = out_stride,
                          .kv = {.k = kc, .v = vc, .dtype = LOOM_DT_F32}, .block_size = B, .tok_seq = tok_seq,
                          .tok_pos = tok_pos, .block_tables = bt, .max_blocks = max_blocks, .max_ctx = max_ctx};
    if (dt == LOOM_DT_BF16) a.kv = (loom_kv_layer_t){.k = kn, .v = vn, .dtype = LOOM_DT_BF16};
    if (dt == LOOM_DT_I8)
        a.kv = (loom_kv_layer_t){.k = kn, .v = vn, .k_scale = ksc, .v_scale = vsc, .dtype = LOOM_DT_I8};
    if (ac->latent) a.kv.v = a.kv.k, a.kv.v_scale = a.kv.k_scale;
    a.kv.v_dim = vd != hd ? vd : 0;
    float *sinks = ex.sinks ? rand_host((size_t)nh, 3.0f) : NULL;
    a.window = ex.window, a.softcap = ex.softcap, a.sinks = sinks;
    float *lse = sinks ? NULL : loom_xmalloc((size_t)n * nh * 4); /* not with sinks (backend.h) */
    a.lse = lse;
    loom_op_attention(cpu, &a);
    loom_attn_args_t g = a;
    g.q = to_dev(be, q, (size_t)n * q_stride * 4);
    g.out = poisoned(be, (size_t)n * out_stride * 4);
    g.lse = lse ? poisoned(be, (size_t)n * nh * 4) : NULL;
    g.kv = (loom_kv_layer_t){.k = to_dev(be, kn, cache * es), .dtype = dt, .fp8_scale = {fs[0], fs[1]},
                             .v_dim = a.kv.v_dim};
    g.kv.v = ac->latent ? g.kv.k : to_dev(be, vn, vcache * es);
    if (dt == LOOM_DT_I8) {
        g.kv.k_scale = to_dev(be, ksc, cells * nkv * 4);
        g.kv.v_scale = ac->latent ? g.kv.k_scale : to_dev(be, vsc, cells * nkv * 4);
    }
    g.sinks = sinks ? to_dev(be, sinks, (size_t)nh * 4) : NULL;
    g.tok_seq = to_dev(be, tok_seq, (size_t)n * 4);
    g.tok_pos = to_dev(be, tok_pos, (size_t)n * 4);
    g.block_tables = to_dev(be, bt, (size_t)n_seqs * max_blocks * 4);
    loom_op_attention(be, &g);
    char buf[160];
    snprintf(buf, sizeof buf,
             "attention %s %s (nh %d nkv %d hd %d vd %d B %d%s%s, n %d, window %d softcap %g sinks %d)",
             loom_kv_dtype_name(dt), what, nh, nkv, hd, vd, B, ac->latent ? " latent" : "",
             scaled ? " fp8 scales" : "", n, ex.window, (double)ex.softcap, ex.sinks);
    /* up to 8 tokens every token goes through the fp32 kernel; above, chunks
     * use the tile kernel, TF32 on tensor cores (~1e-3 on scores and values);
     * heads above 256 take the wide kernel, fp32 throughout (576-long dots) */
    double tol = hd > 256 ? 1e-4 : n <= 8 ? 2e-5 : 1e-2;
    const double atol = scaled ? tol * g_fp8_mul[1] : tol; /* the values are that much larger */
    CHECK(close_dev(buf, be, g.out, ref, (size_t)n * out_stride, atol, tol));
    char lbuf[200];
    snprintf(lbuf, sizeof lbuf, "%s lse", buf);
    /* the scores' rounding (TF32 in tiles) moves max + log(sum) by about as much as it moves a score */
    if (lse) CHECK(close_dev(lbuf, be, g.lse, lse, (size_t)n * nh, 4 * tol, tol));
    if (dt == LOOM_DT_BF16 && !ac->latent && vd == hd && loom_fa_head_dim_ok(hd) && g_cc >= 80 && n >= 9) {
        /* the same call with the chunks through the FA2-style kernel (flash.cu): Q and P rounded to bf16
         * for the tensor cores, f32 accumulation (its CPU replay, test_cuda_math, sees at most 3e-3 on these
         * inputs against float64) */
        float *fo = poisoned(be, (size_t)n * out_stride * 4);
        loom_attn_args_t f = g;
        f.out = fo;
        f.lse = lse ? poisoned(be, (size_t)n * nh * 4) : NULL;
        loom_cuda_set_attn_prefill_variant(be, LOOM_FA_VARIANT_FA2);
        loom_op_attention(be, &f);
        loom_cuda_set_attn_prefill_variant(be, LOOM_FA_VARIANT_TILE);
        char fbuf[200];
        snprintf(fbuf, sizeof fbuf, "%s fa2", buf);
        CHECK(close_dev(fbuf, be, fo, ref, (size_t)n * out_stride, 1e-2, 1e-2));
        if (lse) {
            snprintf(fbuf, sizeof fbuf, "%s fa2 lse", buf);
            CHECK(close_dev(fbuf, be, f.lse, lse, (size_t)n * nh, 4e-2, 1e-2));
            loom_backend_free(be, f.lse);
        }
        loom_backend_free(be, fo);
        g_fa_checked++;
    }
    void *bufs[] = {(void *)g.q, g.out, g.kv.k, ac->latent ? NULL : g.kv.v, (void *)g.tok_seq, (void *)g.tok_pos,
                    (void *)g.block_tables, g.kv.k_scale, ac->latent ? NULL : g.kv.v_scale, (void *)g.sinks, g.lse};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(bufs); i++)
        if (bufs[i]) loom_backend_free(be, bufs[i]);
    free(perm), free(bt), free(kc), free(vc), free(kn), free(vn), free(q), free(ref), free(ksc), free(vsc), free(sinks);
    free(lse);
}

static void test_attention(void) {
    static const attn_case_t cases[] = {
        {32, 8, 128, 16, 0, 0}, /* Llama-3-8B: tiles of 16 tokens x 4 heads */
        {8, 4, 8, 16, 0, 0},    /* stories260K */
        {8, 2, 64, 16, 0, 0},   {12, 12, 64, 7, 0, 0}, /* MHA, odd block size: tiles of 64 tokens */
        {28, 4, 128, 16, 0, 0},                  /* group 7: tiles of 9 tokens */
        {4, 1, 256, 32, 0, 0},  {6, 2, 36, 16, 0, 0},  /* head_dim not a multiple of 16: one token at a time */
        {6, 3, 6, 5, 0, 0},                      /* head_dim not a multiple of 4: scalar path */
        {16, 1, 128, 16, 0, 0},                  /* group 16: two passes of 8 heads */
        {64, 1, 64, 16, 0, 0},                   /* group 64: no tiles */
        /* the wide kernel: DeepSeek-V3's latent rows (512 + 64) as MQA, V the same memory as K, at TP 8
         * (16 heads: one tile of heads per token), 40 heads (3 chunks, the last partial), 4 heads (tiles of 4 tokens);
         * and wide GQA heads with a V of their own (tiles of 5 tokens x 3 heads) */
        {16, 1, 576, 64, 1, 0},
        {40, 1, 576, 64, 1, 0},
        {4, 1, 576, 16, 1, 0},
        {6, 2, 320, 16, 0, 0},
        /* V rows narrower than K's (decompressed MLA, --disable-mla: DeepSeek-V3's 192 and 128 at TP 8, MHA;
         * GQA with an odd block size), V wider than K, V not a multiple of 16 (one token at a time), and
         * the scalar path (head dims not multiples of 4) */
        {16, 16, 192, 16, 0, 128},
        {8, 2, 192, 7, 0, 128},
        {8, 4, 64, 16, 0, 128},
        {6, 3, 36, 16, 0, 20},
        {6, 3, 6, 5, 0, 10},
    };
    enum { MAXN = 420 };
    int32_t seq[MAXN], pos[MAXN];
    for (size_t c = 0; c < LOOM_ARRAY_LEN(cases); c++) {
        const attn_case_t *ac = &cases[c];
        /* one decode token at various context lengths: many key splits */
        static const int lens[] = {1, 17, 1000, 4099};
        for (size_t l = 0; l < LOOM_ARRAY_LEN(lens); l++) {
            seq[0] = 0, pos[0] = lens[l] - 1;
            for (size_t d = 0; d < LOOM_ARRAY_LEN(k_kv_dts); d++)
                run_attention(ac, k_kv_dts[d], 1, &lens[l], 1, seq, pos, "decode");
        }
        /* a decode batch of 37 sequences */
        int ctx[40];
        for (int s = 0; s < 37; s++) {
            ctx[s] = 1 + randi(700);
            seq[s] = s, pos[s] = ctx[s] - 1;
        }
        for (size_t d = 0; d < LOOM_ARRAY_LEN(k_kv_dts); d++)
            run_attention(ac, k_kv_dts[d], 37, ctx, 37, seq, pos, "decode batch");
        /* mixed: 5 decodes, a 70-token chunk at 30..99, a 3-token chunk, a 20-token chunk from 0 */
        int n = 0;
        int mctx[8] = {50, 300, 7, 90, 1, 100, 12, 20};
        for (int s = 0; s < 5; s++) seq[n] = s, pos[n] = mctx[s] - 1, n++;
        for (int p = 30; p < 100; p++) seq[n] = 5, pos[n] = p, n++;
        for (int p = 9; p < 12; p++) seq[n] = 6, pos[n] = p, n++;
        for (int p = 0; p < 20; p++) seq[n] = 7, pos[n] = p, n++;
        for (size_t d = 0; d < LOOM_ARRAY_LEN(k_kv_dts); d++)
            run_attention(ac, k_kv_dts[d], 8, mctx, n, seq, pos, "mixed");
        /* a prefill of 300 tokens, and a short one (key splits in the tile kernel) */
        int pctx = 300;
        for (int p = 0; p < 300; p++) seq[p] = 0, pos[p] = p;
        for (size_t d = 0; d < LOOM_ARRAY_LEN(k_kv_dts); d++)
            run_attention(ac, k_kv_dts[d], 1, &pctx, 300, seq, pos, "prefill 300");
        int sctx = 530;
        for (int p = 0; p < 20; p++) seq[p] = 0, pos[p] = 510 + p;
        for (size_t d = 0; d < LOOM_ARRAY_LEN(k_kv_dts); d++)
            run_attention(ac, k_kv_dts[d], 1, &sctx, 20, seq, pos, "prefill 20 at 510");
    }
}

/* The FA2-style prefill kernel (flash.cu) on bf16 caches, first of a
 * device run (tests/gpu/run.sh's flash step: test_cuda_ops --flash):
 * prefills from 0 and after a cached prefix, a mixed batch, every group
 * size class (tiles of 64, 21, 16, 9 and 2 tokens), odd block sizes, and
 * each family's extra. run_attention runs it beside the tile kernel on
 * every bf16 chunk it takes, and its plan is checked here: bf16 chunks
 * with head_dim 64 or 128 take it, everything else keeps the tile kernel. */
static void test_attention_flash(void) {
    static const attn_case_t cases[] = {{32, 8, 128, 16, 0, 0}, {8, 8, 64, 7, 0, 0}, {12, 4, 64, 16, 0, 0},
                                        {28, 4, 128, 5, 0, 0},  {64, 2, 128, 16, 0, 0}};
    static const attn_extra_t extras[] = {{0, 0.0f, 0}, {37, 0.0f, 0}, {0, 50.0f, 0}, {0, 0.0f, 1}, {61, 30.0f, 1}};
    enum { MAXN = 300 };
    int32_t seq[MAXN], pos[MAXN];
    const int before = g_fa_checked;
    for (size_t c = 0; c < LOOM_ARRAY_LEN(cases); c++)
        for (size_t x = 0; x < LOOM_ARRAY_LEN(extras); x++) {
            g_extra = &extras[x];
            int pctx = 300;
            for (int p = 0; p < 300; p++) seq[p] = 0, pos[p] = p;
            run_attention(&cases[c], LOOM_DT_BF16, 1, &pctx, 300, seq, pos, "prefill 300");
            int sctx = 1100;
            for (int p = 0; p < 90; p++) seq[p] = 0, pos[p] = 1010 + p;
            run_attention(&cases[c], LOOM_DT_BF16, 1, &sctx, 90, seq, pos, "prefill 90 at 1010");
            int n = 0, mctx[4] = {400, 260, 33, 3};
            seq[n] = 0, pos[n] = 399, n++;
            for (int p = 60; p < 260; p++) seq[n] = 1, pos[n] = p, n++;
            for (int p = 0; p < 33; p++) seq[n] = 2, pos[n] = p, n++;
            for (int p = 0; p < 3; p++) seq[n] = 3, pos[n] = p, n++;
            run_attention(&cases[c], LOOM_DT_BF16, 4, mctx, n, seq, pos, "mixed");
            g_extra = NULL;
        }
    CHECK(g_cc < 80 || g_fa_checked > before);
    /* the plan: which calls take it */
    loom_cuda_attn_t a = {.n = 64, .n_heads = 32, .n_kv_heads = 8, .head_dim = 128, .q_stride = 48 * 128,
                          .out_stride = 32 * 128, .kv_kind = LOOM_CUDA_BF16, .block_size = 16,
                          .prefill_variant = LOOM_FA_VARIANT_FA2};
    static _Alignas(16) float dummy[64];
    a.q = dummy, a.out = dummy, a.k_cache = dummy, a.v_cache = dummy;
    const size_t smem = 227 * 1024;
    loom_cuda_attn_plan_t pl = loom_cuda_attention_plan(&a, 132, smem, 1 << 24);
    CHECK(pl.tq == 16 && pl.fa2 && pl.smem_tile == loom_fa_smem_bytes(128));
    a.prefill_variant = LOOM_FA_VARIANT_TILE;
    pl = loom_cuda_attention_plan(&a, 132, smem, 1 << 24);
    CHECK(pl.tq == 16 && !pl.fa2);
    a.prefill_variant = LOOM_FA_VARIANT_FA2;
    a.kv_kind = LOOM_CUDA_FP8; /* other caches, other head sizes: the tile kernel */
    CHECK(!loom_cuda_attention_plan(&a, 132, smem, 1 << 24).fa2);
    a.kv_kind = LOOM_CUDA_BF16, a.head_dim = 256;
    CHECK(!loom_cuda_attention_plan(&a, 132, smem, 1 << 24).fa2);
    a.head_dim = 128, a.n = 4; /* decode steps: no tiles at all */
    pl = loom_cuda_attention_plan(&a, 132, smem, 1 << 24);
    CHECK(pl.tq == 1 && !pl.fa2);
}

/* The families' attention: Mistral's window, Gemma 2's soft cap (and its
 * local layers' window), GPT-OSS's sinks (and its banded layers), on
 * decode batches, long single decodes (key splits), mixed batches and
 * prefill chunks (the tile kernel), every KV dtype. */
static void test_attention_extras(void) {
    static const attn_case_t cases[] = {{8, 2, 64, 16, 0, 0}, {16, 8, 256, 16, 0, 0}, {64, 8, 64, 16, 0, 0},
                                        {6, 3, 36, 7, 0, 0},  {6, 2, 300, 9, 0, 0} /* the wide kernel */};
    static const attn_extra_t extras[] = {
        {4096, 0.0f, 0}, {37, 0.0f, 0}, {0, 50.0f, 0}, {129, 50.0f, 0}, {0, 0.0f, 1}, {128, 0.0f, 1}, {61, 30.0f, 1},
    };
    enum { MAXN = 300 };
    int32_t seq[MAXN], pos[MAXN];
    for (size_t c = 0; c < LOOM_ARRAY_LEN(cases); c++)
        for (size_t x = 0; x < LOOM_ARRAY_LEN(extras); x++) {
            const attn_case_t *ac = &cases[c];
            g_extra = &extras[x];
            for (size_t d = 0; d < LOOM_ARRAY_LEN(k_kv_dts); d++) {
                const loom_dtype_t dt = k_kv_dts[d];
                int len = 5000;
                seq[0] = 0, pos[0] = len - 1;
                run_attention(ac, dt, 1, &len, 1, seq, pos, "decode");
                int ctx[24];
                for (int s = 0; s < 24; s++) ctx[s] = 1 + randi(600), seq[s] = s, pos[s] = ctx[s] - 1;
                run_attention(ac, dt, 24, ctx, 24, seq, pos, "decode batch");
                int n = 0, mctx[3] = {400, 260, 33};
                seq[n] = 0, pos[n] = 399, n++;
                for (int p = 60; p < 260; p++) seq[n] = 1, pos[n] = p, n++;
                for (int p = 0; p < 33; p++) seq[n] = 2, pos[n] = p, n++;
                run_attention(ac, dt, 3, mctx, n, seq, pos, "mixed");
            }
            g_extra = NULL;
        }
}

/* fp8 caches with per-tensor K and V scales: values far beyond 448 stored
 * without clamping, K's scale folded into the queries and V's into the
 * outputs, by every kernel (one-row, tiles, splits, the wide kernel on
 * latent rows, where V is K's memory and shares its scale). */
static void test_attention_fp8_scaled(void) {
    static const attn_case_t cases[] = {{32, 8, 128, 16, 0, 0}, {6, 2, 36, 7, 0, 0}, {16, 1, 576, 64, 1, 0}};
    enum { MAXN = 300 };
    int32_t seq[MAXN], pos[MAXN];
    for (size_t c = 0; c < LOOM_ARRAY_LEN(cases); c++) {
        g_fp8_mul[0] = 500.0f, g_fp8_mul[1] = cases[c].latent ? 500.0f : 700.0f;
        int len = 3000;
        seq[0] = 0, pos[0] = len - 1;
        run_attention(&cases[c], LOOM_DT_F8_E4M3, 1, &len, 1, seq, pos, "decode");
        int ctx[12];
        for (int s = 0; s < 12; s++) ctx[s] = 1 + randi(400), seq[s] = s, pos[s] = ctx[s] - 1;
        run_attention(&cases[c], LOOM_DT_F8_E4M3, 12, ctx, 12, seq, pos, "decode batch");
        int pctx = 200;
        for (int p = 0; p < 200; p++) seq[p] = 0, pos[p] = p;
        run_attention(&cases[c], LOOM_DT_F8_E4M3, 1, &pctx, 200, seq, pos, "prefill 200");
        g_fp8_mul[0] = g_fp8_mul[1] = 0.0f;
    }
}

/* --- the families' element-wise ops --------------------------------------------------------- */

/* act_mul for every activation, the clamped SwiGLU and the soft cap
 * against the CPU backend, odd shapes included. */
static void test_family_ops(void) {
    loom_backend_t *be = g_cuda[1], *cpu = g_cpu[1];
    static const int shapes[][2] = {{1, 14336}, {3, 172}, {7, 101}, {9, 2880}, {2, 4}};
    for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++) {
        int n = shapes[s][0], hidden = shapes[s][1];
        const size_t no = (size_t)n * hidden;
        float *gu = rand_host(no * 2, 9.0f), *ref = loom_xmalloc(no * 4);
        float *dgu = to_dev(be, gu, no * 2 * 4), *dout = poisoned(be, no * 4);
        for (int act = LOOM_ACT_SILU; act <= LOOM_ACT_RELU2; act++) {
            loom_op_act_mul(cpu, (loom_act_t)act, ref, gu, n, hidden);
            loom_backend_memset(be, dout, 0xff, no * 4);
            loom_op_act_mul(be, (loom_act_t)act, dout, dgu, n, hidden);
            char what[64];
            snprintf(what, sizeof what, "act_mul %d (n %d hidden %d)", act, n, hidden);
            CHECK(close_dev(what, be, dout, ref, no, 1e-5, 1e-5));
        }
        loom_op_swiglu_clamp(cpu, ref, gu, n, hidden, 1.702f, 7.0f);
        loom_backend_memset(be, dout, 0xff, no * 4);
        loom_op_swiglu_clamp(be, dout, dgu, n, hidden, 1.702f, 7.0f);
        CHECK(close_dev("swiglu_clamp", be, dout, ref, no, 1e-5, 1e-5));
        for (size_t i = 0; i < no; i++) ref[i] = gu[i] * 10.0f;
        float *dx = to_dev(be, ref, no * 4);
        loom_op_softcap(cpu, ref, (int64_t)no, 30.0f);
        loom_op_softcap(be, dx, (int64_t)no, 30.0f);
        CHECK(close_dev("softcap", be, dx, ref, no, 1e-5, 1e-5));
        loom_backend_free(be, dgu), loom_backend_free(be, dout), loom_backend_free(be, dx);
        free(gu), free(ref);
    }
}

/* The int8 KV write (plain and fused with RoPE) against the CPU backend's,
 * code for code; the fp8 write clamps to +-448 instead of writing NaN. */
static void test_kv_i8_fp8(void) {
    loom_backend_t *be = g_cuda[1], *cpu = g_cpu[1];
    static const int shapes[][4] = {{5, 8, 4, 8}, {7, 32, 8, 128}, {3, 6, 3, 36}, {2, 3, 1, 6}};
    for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++) {
        int n = shapes[s][0], nh = shapes[s][1], nkv = shapes[s][2], hd = shapes[s][3], kv_dim = nkv * hd;
        int stride = (nh + 2 * nkv) * hd, cells = 64;
        size_t total = (size_t)n * stride, cache = (size_t)cells * kv_dim;
        float *x = rand_host(total, 3.0f), *inv = loom_xmalloc((size_t)hd / 2 * 4);
        for (int j = 0; j < hd / 2; j++) inv[j] = (float)pow(10000.0, -2.0 * j / hd);
        int32_t pos[8], slots[8];
        for (int i = 0; i < n; i++) pos[i] = randi(5000), slots[i] = i == 1 ? -1 : (i * 13) % cells;
        int8_t *kr = loom_xcalloc(cache, 1), *vr = loom_xcalloc(cache, 1), *kg = loom_xmalloc(cache),
               *vg = loom_xmalloc(cache);
        float *ksr = loom_xcalloc((size_t)cells * nkv, 4), *vsr = loom_xcalloc((size_t)cells * nkv, 4);
        float *ksg = loom_xmalloc((size_t)cells * nkv * 4), *vsg = loom_xmalloc((size_t)cells * nkv * 4);
        loom_kv_layer_t ckv = {.k = kr, .v = vr, .k_scale = ksr, .v_scale = vsr, .dtype = LOOM_DT_I8};
        loom_kv_layer_t dkv = {.k = to_dev(be, kr, cache), .v = to_dev(be, vr, cache),
                               .k_scale = to_dev(be, ksr, (size_t)cells * nkv * 4),
                               .v_scale = to_dev(be, vsr, (size_t)cells * nkv * 4), .dtype = LOOM_DT_I8};
        float *dx = to_dev(be, x, total * 4), *dinv = to_dev(be, inv, (size_t)hd / 2 * 4);
        int32_t *dpos = to_dev(be, pos, (size_t)n * 4), *dslots = to_dev(be, slots, (size_t)n * 4);
        for (int fused = 0; fused < 2; fused++) {
            float *xr = loom_xmalloc(total * 4);
            memcpy(xr, x, total * 4);
            loom_backend_upload(be, dx, x, total * 4);
            if (fused) {
                loom_op_rope(cpu, xr, stride, n, nh, hd, pos, inv);
                loom_op_rope(cpu, xr + nh * hd, stride, n, nkv, hd, pos, inv);
                loom_op_rope_kv_write(be, dx, dx + nh * hd, dx + nh * hd + kv_dim, stride, n, nh, nkv, hd, dpos,
                                      dinv, &dkv, dslots);
            } else {
                loom_op_kv_write(be, &dkv, dx + nh * hd, dx + nh * hd + kv_dim, stride, dslots, n, nkv, hd);
            }
            loom_op_kv_write(cpu, &ckv, xr + nh * hd, xr + nh * hd + kv_dim, stride, slots, n, nkv, hd);
            loom_backend_download(be, kg, dkv.k, cache), loom_backend_download(be, vg, dkv.v, cache);
            loom_backend_download(be, ksg, dkv.k_scale, (size_t)cells * nkv * 4);
            loom_backend_download(be, vsg, dkv.v_scale, (size_t)cells * nkv * 4);
            int bad = 0;
            for (size_t e = 0; e < cache; e++) /* the rotated keys may differ by an ulp: one code */
                bad += abs(kg[e] - kr[e]) > (fused ? 1 : 0) || vg[e] != vr[e];
            for (int e = 0; e < cells * nkv; e++)
                bad += fabsf(ksg[e] - ksr[e]) > (fused ? 1e-6f * fabsf(ksr[e]) : 0.0f) || vsg[e] != vsr[e];
            CHECKF(!bad, "int8 kv_write%s (n %d nh %d nkv %d hd %d): %d mismatches", fused ? " fused" : "", n, nh,
                   nkv, hd, bad);
            free(xr);
        }
        /* fp8: values beyond 448 become 448 (0x7e), never NaN */
        for (size_t i = 0; i < total; i++) x[i] *= 400.0f;
        loom_backend_upload(be, dx, x, total * 4);
        loom_kv_layer_t f8 = {.k = poisoned(be, cache), .v = poisoned(be, cache), .dtype = LOOM_DT_F8_E4M3};
        loom_op_kv_write(be, &f8, dx + nh * hd, dx + nh * hd + kv_dim, stride, dslots, n, nkv, hd);
        uint8_t *f8h = loom_xmalloc(cache);
        loom_backend_download(be, f8h, f8.k, cache);
        int badf = 0;
        for (int i = 0; i < n; i++) {
            if (slots[i] < 0) continue;
            for (int e = 0; e < kv_dim; e++) {
                const float want = x[(size_t)i * stride + nh * hd + e];
                const uint8_t got = f8h[(size_t)slots[i] * kv_dim + e];
                const uint8_t want8 = loom_f32_to_fp8_e4m3(want > 448.0f ? 448.0f : want < -448.0f ? -448.0f : want);
                badf += got != want8;
            }
        }
        CHECKF(!badf, "fp8 kv_write beyond 448: %d codes not clamped", badf);
        /* with per-tensor scales: x / s, e4m3-rounded, nothing clamped (|x| <= 1200, s_k 3, s_v 4.5) */
        f8.fp8_scale[0] = 3.0f, f8.fp8_scale[1] = 4.5f;
        loom_op_kv_write(be, &f8, dx + nh * hd, dx + nh * hd + kv_dim, stride, dslots, n, nkv, hd);
        uint8_t *f8v = loom_xmalloc(cache);
        loom_backend_download(be, f8h, f8.k, cache), loom_backend_download(be, f8v, f8.v, cache);
        badf = 0;
        for (int i = 0; i < n; i++) {
            if (slots[i] < 0) continue;
            for (int e = 0; e < kv_dim; e++) {
                const float *row = x + (size_t)i * stride + nh * hd;
                badf += f8h[(size_t)slots[i] * kv_dim + e] != loom_f32_to_fp8_e4m3(row[e] * (1.0f / 3.0f));
                badf += f8v[(size_t)slots[i] * kv_dim + e] != loom_f32_to_fp8_e4m3(row[kv_dim + e] * (1.0f / 4.5f));
            }
        }
        CHECKF(!badf, "fp8 kv_write with per-tensor scales: %d codes differ", badf);
        free(f8v);
        void *bufs[] = {dkv.k, dkv.v, dkv.k_scale, dkv.v_scale, dx, dinv, dpos, dslots, f8.k, f8.v};
        for (size_t i = 0; i < LOOM_ARRAY_LEN(bufs); i++) loom_backend_free(be, bufs[i]);
        free(x), free(inv), free(kr), free(vr), free(kg), free(vg), free(ksr), free(vsr), free(ksg), free(vsg);
        free(f8h);
    }
}

/* --- decompressed MLA: V rows of their own width, the prefill's gather and merge ---------------------- */

/* kv_write with V rows narrower (or wider) than K's (loom_kv_layer_t.v_dim)
 * into every cache dtype, against the CPU's write (F32, BF16, I8 code for
 * code; FP8 against the CPU's f32 rows narrowed on the host); then
 * loom_op_kv_gather of a sequence's K rows through a shuffled block table
 * (against the CPU's gather, or the host's decode of the fp8 codes times
 * K's scale), and loom_op_attn_merge against the CPU's. */
static void test_mla_decompressed_ops(void) {
    loom_backend_t *be = g_cuda[1], *cpu = g_cpu[1];
    static const int shapes[][4] = {{9, 16, 192, 128}, {5, 3, 6, 10}, {4, 2, 64, 128}}; /* n, nkv, hd, vd */
    for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++) {
        const int n = shapes[s][0], nkv = shapes[s][1], hd = shapes[s][2], vd = shapes[s][3];
        const int kv_dim = nkv * hd, v_dim = nkv * vd, B = 5, n_blocks = 6, cells = B * n_blocks;
        const int stride = kv_dim + v_dim + (int)(s & 1); /* [k | v] rows, an odd stride too */
        float *x = rand_host((size_t)n * stride, 2.0f);
        int32_t slots[16], bt[6];
        for (int b = 0; b < n_blocks; b++) bt[b] = n_blocks - 1 - b; /* blocks out of order */
        for (int i = 0; i < n; i++) slots[i] = i == 2 ? -1 : bt[i / B] * B + i % B; /* positions 0..n-1, one padding */
        float *dx = to_dev(be, x, (size_t)n * stride * 4);
        int32_t *dslots = to_dev(be, slots, (size_t)n * 4), *dbt = to_dev(be, bt, sizeof bt);
        for (size_t d = 0; d < LOOM_ARRAY_LEN(k_kv_dts); d++) {
            const loom_dtype_t dt = k_kv_dts[d];
            const size_t es = loom_dtype_size(dt), kc = (size_t)cells * kv_dim, vc = (size_t)cells * v_dim;
            const loom_dtype_t cdt = dt == LOOM_DT_F8_E4M3 ? LOOM_DT_F32 : dt; /* the CPU's cache */
            const size_t ces = loom_dtype_size(cdt);
            void *hk = loom_xcalloc(kc, ces), *hv = loom_xcalloc(vc, ces);
            float *hks = loom_xcalloc((size_t)cells * nkv, 4), *hvs = loom_xcalloc((size_t)cells * nkv, 4);
            loom_kv_layer_t ckv = {.k = hk, .v = hv, .dtype = cdt, .block_size = B, .v_dim = vd};
            if (dt == LOOM_DT_I8) ckv.k_scale = hks, ckv.v_scale = hvs;
            loom_op_kv_write(cpu, &ckv, x, x + kv_dim, stride, slots, n, nkv, hd);
            void *zk = loom_xcalloc(kc, es), *zv = loom_xcalloc(vc, es);
            loom_kv_layer_t gkv = {.k = to_dev(be, zk, kc * es), .v = to_dev(be, zv, vc * es), .dtype = dt,
                                   .block_size = B, .v_dim = vd, .fp8_scale = {2.0f, 0.5f}};
            if (dt == LOOM_DT_I8) {
                gkv.k_scale = to_dev(be, hks, (size_t)cells * nkv * 4);
                gkv.v_scale = to_dev(be, hks, (size_t)cells * nkv * 4);
                loom_backend_memset(be, gkv.k_scale, 0, (size_t)cells * nkv * 4);
                loom_backend_memset(be, gkv.v_scale, 0, (size_t)cells * nkv * 4);
            }
            loom_op_kv_write(be, &gkv, dx, dx + kv_dim, stride, dslots, n, nkv, hd);
            void *gk = loom_xmalloc(kc * es), *gv = loom_xmalloc(vc * es);
            loom_backend_download(be, gk, gkv.k, kc * es), loom_backend_download(be, gv, gkv.v, vc * es);
            int bad = 0;
            for (int isv = 0; isv < 2; isv++) {
                const size_t m = isv ? vc : kc;
                const void *got = isv ? gv : gk, *want = isv ? hv : hk;
                for (size_t e = 0; e < m; e++) {
                    int same;
                    if (dt == LOOM_DT_F8_E4M3)
                        same = ((const uint8_t *)got)[e] ==
                               loom_f32_to_fp8_e4m3(((const float *)want)[e] * (isv ? 2.0f : 0.5f));
                    else
                        same = !memcmp((const char *)got + e * es, (const char *)want + e * es, es);
                    if (!same && bad++ < 3)
                        fprintf(stderr, "  kv_write v_dim %s %c[%zu]: other code than the CPU's\n",
                                loom_kv_dtype_name(dt), isv ? 'v' : 'k', e);
                }
            }
            if (dt == LOOM_DT_I8) { /* the scales too */
                float *gs = from_dev(be, gkv.k_scale, (size_t)cells * nkv);
                float *gvs = from_dev(be, gkv.v_scale, (size_t)cells * nkv);
                for (int e = 0; e < cells * nkv; e++) bad += gs[e] != hks[e] || gvs[e] != hvs[e];
                free(gs), free(gvs);
            }
            CHECKF(!bad, "kv_write with v_dim into %s (n %d nkv %d hd %d vd %d): %d mismatches", loom_kv_dtype_name(dt),
                   n, nkv, hd, vd, bad);
            /* the gather: positions [1, n) of the sequence (padding's slot never written: zeros either way) */
            const int p0 = 1, cn = n - 1;
            float *ref = loom_xmalloc((size_t)cn * kv_dim * 4);
            if (dt == LOOM_DT_F8_E4M3) {
                for (int p = p0; p < p0 + cn; p++)
                    for (int e = 0; e < kv_dim; e++) {
                        const size_t off = ((size_t)bt[p / B] * B + p % B) * kv_dim + e;
                        ref[(size_t)(p - p0) * kv_dim + e] = loom_fp8_e4m3_to_f32(((uint8_t *)gk)[off]) * 2.0f;
                    }
            } else {
                loom_op_kv_gather(cpu, &ckv, bt, p0, cn, nkv, hd, ref);
            }
            float *drows = poisoned(be, (size_t)cn * kv_dim * 4);
            loom_op_kv_gather(be, &gkv, dbt, p0, cn, nkv, hd, drows);
            char what[128];
            snprintf(what, sizeof what, "kv_gather %s (cn %d nkv %d hd %d)", loom_kv_dtype_name(dt), cn, nkv, hd);
            CHECK(close_dev(what, be, drows, ref, (size_t)cn * kv_dim, 0, 0));
            void *bufs[] = {gkv.k, gkv.v, gkv.k_scale, gkv.v_scale, drows};
            for (size_t i = 0; i < LOOM_ARRAY_LEN(bufs); i++)
                if (bufs[i]) loom_backend_free(be, bufs[i]);
            free(hk), free(hv), free(hks), free(hvs), free(zk), free(zv), free(gk), free(gv), free(ref);
        }
        loom_backend_free(be, dx), loom_backend_free(be, dslots), loom_backend_free(be, dbt);
        free(x);
    }
    /* the merge of two partial outputs by their log-sum-exp, lse far apart too */
    static const int ms[][3] = {{7, 16, 128}, {1, 3, 10}, {33, 2, 300}};
    for (size_t s = 0; s < LOOM_ARRAY_LEN(ms); s++) {
        const int n = ms[s][0], nh = ms[s][1], vd = ms[s][2];
        const size_t rows = (size_t)n * nh, m = rows * vd;
        float *out = rand_host(m, 1.0f), *o = rand_host(m, 1.0f);
        float *la = rand_host(rows, 5.0f), *lb = rand_host(rows, 5.0f);
        la[0] += 80.0f; /* one part's weight underflows */
        float *d_out = to_dev(be, out, m * 4), *d_la = to_dev(be, la, rows * 4);
        float *d_o = to_dev(be, o, m * 4), *d_lb = to_dev(be, lb, rows * 4);
        loom_op_attn_merge(cpu, out, la, o, lb, n, nh, vd);
        loom_op_attn_merge(be, d_out, d_la, d_o, d_lb, n, nh, vd);
        char what[96];
        snprintf(what, sizeof what, "attn_merge out (n %d nh %d vd %d)", n, nh, vd);
        CHECK(close_dev(what, be, d_out, out, m, 1e-6, 1e-6));
        snprintf(what, sizeof what, "attn_merge lse (n %d nh %d vd %d)", n, nh, vd);
        CHECK(close_dev(what, be, d_la, la, rows, 1e-6, 1e-6));
        loom_backend_free(be, d_out), loom_backend_free(be, d_la);
        loom_backend_free(be, d_o), loom_backend_free(be, d_lb);
        free(out), free(o), free(la), free(lb);
    }
}

/* --- sampling ----------------------------------------------------------------------------- */

static void check_parts(const loom_sample_part_t *g, const loom_sample_part_t *c, const loom_sampling_t *s,
                        int vocab_size, const char *what) {
    loom_sample_mode_t mode = loom_sample_mode(s, vocab_size);
    CHECKF(g->n == c->n, "%s: %d candidates, CPU %d", what, g->n, c->n);
    CHECKF(g->max_z == c->max_z, "%s: max_z %.9g, CPU %.9g", what, (double)g->max_z, (double)c->max_z);
    if (mode == LOOM_SAMPLE_FILTERED)
        CHECKF(fabs((double)g->sum_exp - c->sum_exp) <= 1e-5 * fabs((double)c->sum_exp), "%s: sum_exp %.9g, CPU %.9g",
               what, (double)g->sum_exp, (double)c->sum_exp);
    int n = LOOM_MIN(g->n, c->n), bad = 0;
    for (int j = 0; j < n; j++) {
        double tol = mode == LOOM_SAMPLE_GUMBEL ? 1e-6 * (1 + fabs((double)c->keys[j])) : 0;
        if (g->ids[j] != c->ids[j] || fabs((double)g->keys[j] - c->keys[j]) > tol) {
            if (bad++ < 3)
                fprintf(stderr, "  %s: candidate %d: id %d key %.9g, CPU id %d key %.9g\n", what, j, g->ids[j],
                        (double)g->keys[j], c->ids[j], (double)c->keys[j]);
        }
    }
    CHECKF(bad == 0, "%s: %d of %d candidates differ", what, bad, n);
}

static void test_sampling(void) {
    loom_backend_t *be = g_cuda[1], *cpu = g_cpu[1];
    static const int shards[][3] = {{512, 0, 512}, {128256, 0, 128256}, {700, 1000, 100000}, {3, 5, 8}};
    const loom_sampling_t params[] = {
        {.temperature = 0},
        {.temperature = 0.7f, .seed = 11},
        {.temperature = 1.0f, .top_k = 50, .seed = 12},
        {.temperature = 0.8f, .top_p = 0.9f, .seed = 13},
        {.temperature = 1.3f, .top_k = 1024, .top_p = 0.5f, .seed = 14},
        {.temperature = 1.0f, .top_k = 5, .seed = 15},
        {.temperature = 0},
        {.temperature = 0.5f, .top_k = 1, .seed = 16},
    };
    const int rows = (int)LOOM_ARRAY_LEN(params);
    for (size_t sh = 0; sh < LOOM_ARRAY_LEN(shards); sh++) {
        int vs = shards[sh][0], off = shards[sh][1], vocab = shards[sh][2];
        float *logits = loom_xmalloc((size_t)rows * vs * 4);
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < vs; i++) {
                float v = randf(8.0f);
                if (r % 2 == 0) v = floorf(v * 4.0f) / 4.0f; /* many ties */
                if (randi(50) == 0) v = -INFINITY;
                logits[(size_t)r * vs + i] = v;
            }
        if (vs > 10) logits[(size_t)6 * vs + 3] = logits[(size_t)6 * vs + 7] = 100.0f; /* greedy tie: id 3 wins */
        uint64_t steps[LOOM_ARRAY_LEN(params)];
        int k[LOOM_ARRAY_LEN(params)];
        loom_sample_part_t pg[LOOM_ARRAY_LEN(params)], pc[LOOM_ARRAY_LEN(params)];
        for (int r = 0; r < rows; r++) {
            steps[r] = (uint64_t)randi(1000);
            k[r] = loom_sample_k(&params[r], vocab);
            pg[r] = (loom_sample_part_t){.ids = loom_xmalloc(4096), .keys = loom_xmalloc(4096)};
            pc[r] = (loom_sample_part_t){.ids = loom_xmalloc(4096), .keys = loom_xmalloc(4096)};
        }
        loom_op_sample_shard(cpu, logits, rows, vs, off, vocab, params, steps, k, pc);
        float *dl = to_dev(be, logits, (size_t)rows * vs * 4);
        loom_op_sample_shard(be, dl, rows, vs, off, vocab, params, steps, k, pg);
        for (int r = 0; r < rows; r++) {
            char what[80];
            snprintf(what, sizeof what, "sample shard %d+%d of %d, row %d", off, vs, vocab, r);
            check_parts(&pg[r], &pc[r], &params[r], vocab, what);
            CHECK(loom_sample_merge(&pg[r], 1, vocab, &params[r], steps[r]) ==
                  loom_sample_merge(&pc[r], 1, vocab, &params[r], steps[r]));
            free(pg[r].ids), free(pg[r].keys), free(pc[r].ids), free(pc[r].keys);
        }
        loom_backend_free(be, dl);
        free(logits);
    }
}

/* --- graphs -------------------------------------------------------------------------------- */

/* A recorded op sequence replays on fresh inputs with the same results as
 * running the ops directly. */
static void test_graphs(void) {
    loom_backend_t *be = g_cuda[1];
    CHECK(loom_backend_has_graphs(be) && !loom_backend_has_graphs(g_cpu[0]));
    int n = 3, dim = 256, rows = 300;
    float *hw = rand_host((size_t)rows * dim, 1.0f), *hg = rand_host((size_t)dim, 1.0f);
    loom_weight_t w;
    loom_err_t err = {0};
    REQUIRE(loom_weight_upload(be, &w, rows, dim, hw, &err) == LOOM_OK);
    float *dg = to_dev(be, hg, (size_t)dim * 4), *dx = poisoned(be, (size_t)n * dim * 4);
    float *dxn = poisoned(be, (size_t)n * dim * 4), *dy = poisoned(be, (size_t)n * rows * 4);
    float *eager = loom_xmalloc((size_t)n * rows * 4);
    uint64_t rec0, rep0, rec1, rep1;
    loom_cuda_graph_stats(be, &rec0, &rep0);
    for (int it = 0; it < 4; it++) {
        float *hx = rand_host((size_t)n * dim, 2.0f);
        loom_backend_upload(be, dx, hx, (size_t)n * dim * 4);
        loom_op_rmsnorm(be, dxn, dx, dg, n, dim, 1e-5f);
        loom_op_matmul(be, dy, dxn, &w, n);
        loom_backend_download(be, eager, dy, (size_t)n * rows * 4);
        loom_backend_memset(be, dy, 0xff, (size_t)n * rows * 4);
        int replay = loom_backend_graph_begin(be, 42);
        CHECK(replay == (it > 0));
        if (!replay) {
            loom_op_rmsnorm(be, dxn, dx, dg, n, dim, 1e-5f);
            loom_op_matmul(be, dy, dxn, &w, n);
        }
        CHECK(loom_backend_graph_end(be, 42) == 0);
        CHECK(close_dev("graph replay", be, dy, eager, (size_t)n * rows, 0, 0));
        free(hx);
    }
    loom_cuda_graph_stats(be, &rec1, &rep1);
    CHECK(rec1 - rec0 == 1 && rep1 - rep0 == 3);
    loom_backend_free(be, dg); /* frees drop the graphs */
    CHECK(loom_backend_graph_begin(be, 42) == 0);
    loom_op_rmsnorm(be, dxn, dx, dx, n, dim, 1e-5f);
    CHECK(loom_backend_graph_end(be, 42) == 0);
    loom_backend_free(be, dx), loom_backend_free(be, dxn), loom_backend_free(be, dy);
    loom_weight_free(be, &w);
    free(hw), free(hg), free(eager);
}

int main(int argc, char **argv) {
    loom_log_init("test_cuda_ops");
    if (!loom_backend_available(LOOM_DEVICE_CUDA, 0)) {
        printf("skipped: no GPU\n");
        return SKIP_CODE;
    }
    unsigned long long seed = (unsigned long long)time(NULL);
    const char *env = getenv("LOOM_TEST_SEED");
    if (env) seed = strtoull(env, NULL, 10);
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], NULL, 10);
    g_rng = seed * 2654435761ull + 1;
    fprintf(stderr, "test_cuda_ops: seed %llu (rerun with --seed %llu)\n", seed, seed);
    loom_err_t err = {0};
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) {
        fprintf(stderr, "test_cuda_ops: cannot read the compute capability of cuda:0\n");
        return 1;
    }
    g_cc = 10 * major + minor;
    for (int t = 0; t < 3; t++) {
        loom_backend_config_t cc = {.version = LOOM_BACKEND_CONFIG_VERSION, .kind = LOOM_DEVICE_CPU,
                                    .weight_dtype = k_dts[t]};
        loom_backend_config_t gc = {.version = LOOM_BACKEND_CONFIG_VERSION, .kind = LOOM_DEVICE_CUDA,
                                    .weight_dtype = k_dts[t], .exact_f32 = 1};
        if (loom_backend_create(&cc, &g_cpu[t], &err) < 0 || loom_backend_create(&gc, &g_cuda[t], &err) < 0) {
            fprintf(stderr, "test_cuda_ops: %s\n", err.msg);
            return 1;
        }
    }
    if (argc > 1 && !strcmp(argv[1], "--flash")) { /* tests/gpu/run.sh's first step */
        RUN(test_attention_flash);
        return test_summary();
    }
    RUN(test_memory);
    RUN(test_weight_upload);
    RUN(test_matmul);
    RUN(test_matmul_bias);
    RUN(test_quant_matmul);
    RUN(test_quant_mma);
    RUN(test_fp8_gemm);
    RUN(test_rmsnorm_add);
    RUN(test_fused_gemm_input);
    RUN(test_silu_gather);
    RUN(test_moe);
    RUN(test_moe_route_ds);
    RUN(test_lora);
    RUN(test_rope_kv);
    RUN(test_attention);
    RUN(test_attention_extras);
    RUN(test_attention_flash);
    RUN(test_attention_fp8_scaled);
    RUN(test_family_ops);
    RUN(test_kv_i8_fp8);
    RUN(test_mla_decompressed_ops);
    RUN(test_sampling);
    RUN(test_graphs);
    for (int t = 0; t < 3; t++) {
        loom_backend_destroy(&g_cuda[t]);
        loom_backend_destroy(&g_cpu[t]);
    }
    return test_summary();
}

/* CPU backend op tests: every op against a plain C loop written here (double
 * accumulation), on odd shapes, with 1, 2 and 3 threads, outputs poisoned
 * with NaN beforehand so an element the op forgot to write fails. Also the
 * thread pool (every task runs exactly once) and the GEMV kernel alone. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "kernels/backend.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/gemv.h"
#include "kernels/cpu/threadpool.h"
#include "tests/test.h"

static const int k_threads[] = {1, 2, 3};

static loom_backend_t *make_backend(int n_threads, loom_dtype_t dt) {
    loom_backend_config_t cfg = {.version = LOOM_BACKEND_CONFIG_VERSION,
                                 .kind = LOOM_DEVICE_CPU,
                                 .n_threads = n_threads,
                                 .weight_dtype = dt};
    loom_backend_t *be = NULL;
    loom_err_t err;
    if (loom_backend_create(&cfg, &be, &err) != LOOM_OK) {
        fprintf(stderr, "backend create: %s\n", err.msg);
        return NULL;
    }
    return be;
}

static float *alloc_f(size_t n) {
    float *p = loom_aligned_alloc((n ? n : 1) * sizeof *p);
    if (!p) abort();
    return p;
}

static void poison(float *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = NAN;
}

static void fill(float *p, size_t n, unsigned long long *st, float scale) {
    for (size_t i = 0; i < n; i++)
        p[i] = test_randf(st, scale);
}

/* Float rounded through the weight dtype, as the backend stores it. */
static float through(loom_dtype_t dt, float v) {
    if (dt == LOOM_DT_BF16) return loom_bf16_to_f32(loom_f32_to_bf16(v));
    if (dt == LOOM_DT_F16) return loom_f16_to_f32(loom_f32_to_f16(v));
    return v;
}

/* --- thread pool ------------------------------------------------------- */

#define TP_MAX_TASKS 300

struct tp_ctx {
    _Atomic int count[TP_MAX_TASKS];
    _Atomic int bad_thread;
    int n_threads;
};

static void tp_task(void *p, int task, int thread) {
    struct tp_ctx *c = p;
    if (thread < 0 || thread >= c->n_threads) atomic_fetch_add(&c->bad_thread, 1);
    atomic_fetch_add(&c->count[task], 1);
}

static void test_threadpool(void) {
    for (int nt = 1; nt <= 4; nt++) {
        for (int spin = 0; spin < 2; spin++) {
            loom_threadpool_t *pool = loom_threadpool_create(nt);
            REQUIRE(pool);
            CHECK(loom_threadpool_size(pool) == nt);
            if (!spin) loom_threadpool_set_spin_ns(pool, 0); /* every wait goes to the futex */
            static struct tp_ctx c;
            int bad = 0;
            for (int it = 0; it < 1500; it++) {
                int n = (it * 37) % TP_MAX_TASKS;
                for (int t = 0; t < TP_MAX_TASKS; t++)
                    atomic_store(&c.count[t], 0);
                atomic_store(&c.bad_thread, 0);
                c.n_threads = nt;
                loom_parallel_for(pool, n, tp_task, &c);
                for (int t = 0; t < TP_MAX_TASKS; t++)
                    if (atomic_load(&c.count[t]) != (t < n ? 1 : 0)) bad++;
                if (atomic_load(&c.bad_thread)) bad++;
            }
            CHECKF(bad == 0, "threads %d spin %d: %d wrong task counts", nt, spin, bad);
            loom_threadpool_destroy(&pool);
            CHECK(pool == NULL);
            loom_threadpool_destroy(&pool);
        }
    }
}

/* --- basics ------------------------------------------------------------ */

static void test_backend_basics(void) {
    loom_backend_t *be = make_backend(0, LOOM_DT_F32);
    REQUIRE(be);
    CHECK(!strcmp(loom_backend_name(be), "cpu"));
    CHECK(loom_backend_kind(be) == LOOM_DEVICE_CPU);
    CHECK(loom_backend_threads(be) >= 1);
    CHECK(loom_backend_mem_free(be) > 0);
    float *p = loom_backend_alloc(be, 1000);
    REQUIRE(p);
    CHECK(((uintptr_t)p & 63) == 0);
    float src[250], dst[250];
    for (int i = 0; i < 250; i++)
        src[i] = (float)i;
    loom_backend_upload(be, p, src, sizeof src);
    loom_backend_download(be, dst, p, sizeof dst);
    CHECK(!memcmp(src, dst, sizeof src));
    float *p2 = loom_backend_alloc(be, sizeof src);
    REQUIRE(p2);
    loom_backend_copy(be, p2, p, sizeof src);
    loom_backend_download(be, dst, p2, sizeof dst);
    CHECK(!memcmp(src, dst, sizeof src));
    loom_backend_free(be, p2);
    CHECK(loom_backend_stream(be) == NULL);
    loom_backend_memset(be, p, 0, 1000);
    loom_backend_download(be, dst, p, sizeof dst);
    CHECK(dst[0] == 0.0f && dst[249] == 0.0f);
    CHECK(loom_backend_synchronize(be, NULL) == LOOM_OK);
    loom_backend_free(be, p);
    loom_backend_destroy(&be);
    CHECK(be == NULL);
    loom_backend_destroy(&be);

    loom_backend_config_t cfg = {.version = LOOM_BACKEND_CONFIG_VERSION,
                                 .weight_dtype = LOOM_DT_I8};
    loom_err_t err;
    CHECK(loom_backend_create(&cfg, &be, &err) == LOOM_ERR_UNSUPPORTED && be == NULL);
}

/* Weights share huge-page slabs: many small ones, one larger than a slab,
 * freed in mixed order and re-uploaded, each keeping its own values (a
 * matmul with x = e_c reads column c back). */
static void test_weight_slabs(void) {
    loom_backend_t *be = make_backend(2, LOOM_DT_F32);
    REQUIRE(be);
    enum { NW = 40 };
    loom_weight_t w[NW];
    const int cols = 64;
    float *x = alloc_f((size_t)cols), *y = alloc_f(1 << 18);
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < NW; i++) {
            /* weight 7 alone (9M floats, 36 MB) outgrows a 32 MiB slab */
            const int rows = i == 7 ? (9 << 20) / cols : 1000 + 37 * i;
            float *h = alloc_f((size_t)rows * cols);
            for (int64_t k = 0; k < (int64_t)rows * cols; k++) h[k] = (float)(i * 1000 + round + k % cols);
            REQUIRE(loom_weight_upload(be, &w[i], rows, cols, h, NULL) == LOOM_OK);
            CHECK(((uintptr_t)w[i].data & 63) == 0);
            loom_aligned_free(h);
        }
        for (int i = 0; i < NW; i += 3) loom_weight_free(be, &w[i]); /* every third first */
        int bad = 0;
        for (int i = 0; i < NW; i++) {
            if (i % 3 == 0) continue;
            for (int k = 0; k < cols; k++) x[k] = k == 5 ? 1.0f : 0.0f;
            loom_op_matmul(be, y, x, &w[i], 1);
            int rows = (int)w[i].rows;
            if (rows > (1 << 18)) rows = 1 << 18; /* y holds the first rows */
            if (y[0] != (float)(i * 1000 + round + 5) || y[rows - 1] != y[0]) bad++;
        }
        CHECK(bad == 0);
        for (int i = 0; i < NW; i++)
            if (i % 3) loom_weight_free(be, &w[i]);
    }
    /* empty weights (a rank's share can be 0 rows) between two others */
    loom_weight_t e[3];
    REQUIRE(loom_weight_upload(be, &e[0], 3, cols, y, NULL) == LOOM_OK);
    REQUIRE(loom_weight_upload(be, &e[1], 0, cols, y, NULL) == LOOM_OK);
    REQUIRE(loom_weight_upload(be, &e[2], 3, cols, y, NULL) == LOOM_OK);
    CHECK(e[1].data != e[0].data && e[1].data != e[2].data);
    for (int i = 0; i < 3; i++) loom_weight_free(be, &e[i]);
    loom_aligned_free(x);
    loom_aligned_free(y);
    loom_backend_destroy(&be);
}

/* --- matmul ------------------------------------------------------------ */

/* y = x · Wᵀ in double over the stored (rounded) weights when `round`. */
static void naive_matmul(float *y, const float *x, const float *w, int n, int rows, int cols,
                         loom_dtype_t dt) {
    for (int i = 0; i < n; i++)
        for (int r = 0; r < rows; r++) {
            double s = 0;
            for (int k = 0; k < cols; k++)
                s += (double)x[(int64_t)i * cols + k] * through(dt, w[(int64_t)r * cols + k]);
            y[(int64_t)i * rows + r] = (float)s;
        }
}

static int check_matmul(loom_backend_t *be, loom_dtype_t dt, int n, int rows, int cols,
                        unsigned long long *st) {
    float *w = alloc_f((size_t)rows * cols), *x = alloc_f((size_t)n * cols);
    float *y = alloc_f((size_t)n * rows), *ref = alloc_f((size_t)n * rows),
          *ref32 = alloc_f((size_t)n * rows);
    fill(w, (size_t)rows * cols, st, 1.0f);
    fill(x, (size_t)n * cols, st, 1.0f);
    loom_weight_t wt;
    int ok = 0;
    if (loom_weight_upload(be, &wt, rows, cols, w, NULL) != LOOM_OK) goto out;
    CHECK(wt.dtype == dt && wt.rows == rows && wt.cols == cols);
    CHECK(loom_weight_bytes(&wt) == (size_t)rows * cols * (dt == LOOM_DT_F32 ? 4 : 2));
    naive_matmul(ref, x, w, n, rows, cols, dt);
    naive_matmul(ref32, x, w, n, rows, cols, LOOM_DT_F32);
    ok = 1;
    /* The automatic choice, then each algorithm forced for every n. */
    for (int path = LOOM_CPU_MM_AUTO; path <= LOOM_CPU_MM_SGEMM; path++) {
        poison(y, (size_t)n * rows);
        if (path == LOOM_CPU_MM_AUTO)
            loom_op_matmul(be, y, x, &wt, n);
        else
            loom_cpu_matmul_path(be, y, x, &wt, n, (loom_cpu_mm_path_t)path);
        char what[96];
        snprintf(what, sizeof what, "matmul %s t%d n%d %dx%d path%d", loom_dtype_name(dt),
                 loom_backend_threads(be), n, rows, cols, path);
        /* Rounding of a length-cols float dot product grows like sqrt(cols). */
        double atol = 1e-5 * sqrt(1.0 + cols / 256.0);
        ok &= test_allclose(what, y, ref, (long)n * rows, atol, 1e-5);
        if (dt != LOOM_DT_F32) {
            /* And close to the unrounded weights: bf16 keeps 8 significant
             * bits, so each product is off by up to 2^-9 relative and the
             * random-sign errors add up like sqrt(cols). */
            strcat(what, " vs f32");
            ok &= test_allclose(what, y, ref32, (long)n * rows,
                                1e-2 * (1.0 + sqrt((double)cols) / 4), 1e-2);
        }
    }
    loom_weight_free(be, &wt);
    CHECK(wt.data == NULL);
out:
    free(w);
    free(x);
    free(y);
    free(ref);
    free(ref32);
    return ok;
}

static void test_matmul(void) {
    static const int cols_[] = {1, 7, 13, 67, 257}, rows_[] = {5, 33, 100};
    static const int ns[] = {1, 2, 3, 5, 8, 17, 40};
    static const loom_dtype_t dts[] = {LOOM_DT_F32, LOOM_DT_BF16, LOOM_DT_F16};
    unsigned long long st = 42;
    for (size_t d = 0; d < LOOM_ARRAY_LEN(dts); d++)
        for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
            loom_backend_t *be = make_backend(k_threads[t], dts[d]);
            REQUIRE(be);
            int bad = 0;
            for (size_t a = 0; a < LOOM_ARRAY_LEN(cols_); a++)
                for (size_t b = 0; b < LOOM_ARRAY_LEN(rows_); b++)
                    for (size_t c = 0; c < LOOM_ARRAY_LEN(ns); c++)
                        if (!check_matmul(be, dts[d], ns[c], rows_[b], cols_[a], &st) && ++bad > 3)
                            goto next;
            /* Larger: the parallel GEMV split, and several widened sgemm blocks. */
            check_matmul(be, dts[d], 4, 611, 1029, &st);
            check_matmul(be, dts[d], 7, 300, 515, &st);
            check_matmul(be, dts[d], 19, 2100, 257, &st);
            check_matmul(be, dts[d], 70, 90, 515, &st); /* past both automatic thresholds */
        next:
            loom_backend_destroy(&be);
        }
}

/* The GEMV kernel and its scalar reference on row ranges, all tile shapes. */
static void test_gemv_kernel(void) {
    unsigned long long st = 7;
    const int rows = 23, cols = 45;
    float w[23 * 45], x[9 * 45], y[9 * 23], ref[9 * 23];
    uint16_t wh[23 * 45];
    fill(w, LOOM_ARRAY_LEN(w), &st, 1.0f);
    fill(x, LOOM_ARRAY_LEN(x), &st, 1.0f);
    for (int dt = 0; dt < 3; dt++) {
        loom_dtype_t d = dt == 0 ? LOOM_DT_F32 : dt == 1 ? LOOM_DT_BF16 : LOOM_DT_F16;
        const void *wp = w;
        if (d != LOOM_DT_F32) {
            loom_cpu_narrow(wh, d, w, rows * cols);
            wp = wh;
        }
        for (int n = 1; n <= 9; n++) {
            poison(y, LOOM_ARRAY_LEN(y));
            poison(ref, LOOM_ARRAY_LEN(ref));
            loom_cpu_gemv(y, rows, x, n, wp, d, cols, 3, 22);
            loom_cpu_gemv_ref(ref, rows, x, n, wp, d, cols, 3, 22);
            int bad = 0;
            for (int i = 0; i < n; i++)
                for (int r = 0; r < rows; r++) {
                    float a = y[i * rows + r], b = ref[i * rows + r];
                    if (r >= 3 && r < 22)
                        bad += !(fabsf(a - b) <= 1e-5f + 1e-5f * fabsf(b));
                    else
                        bad += !(isnan(a) && isnan(b)); /* outside [r0, r1) untouched */
                }
            CHECKF(bad == 0, "%s n=%d: %d bad", loom_dtype_name(d), n, bad);
        }
        float wide[10 * 45];
        loom_cpu_widen_rows(wide, wp, d, cols, 5, 15);
        int bad = 0;
        for (int i = 0; i < 10 * cols; i++)
            bad += wide[i] != through(d, w[5 * cols + i]);
        CHECKF(bad == 0, "widen %s: %d bad", loom_dtype_name(d), bad);
    }
}

/* --- element-wise ops -------------------------------------------------- */

static void test_rmsnorm(void) {
    static const int dims[] = {1, 7, 13, 67, 257, 4096};
    static const int ns[] = {1, 3, 17};
    unsigned long long st = 3;
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t a = 0; a < LOOM_ARRAY_LEN(dims); a++)
            for (size_t b = 0; b < LOOM_ARRAY_LEN(ns); b++)
                for (int inplace = 0; inplace < 2; inplace++) {
                    int n = ns[b], dim = dims[a];
                    size_t sz = (size_t)n * dim;
                    float *x = alloc_f(sz), *y = alloc_f(sz), *ref = alloc_f(sz), *g = alloc_f(dim);
                    fill(x, sz, &st, 2.0f);
                    fill(g, dim, &st, 1.5f);
                    float eps = 1e-5f;
                    for (int i = 0; i < n; i++) {
                        double ss = 0;
                        for (int j = 0; j < dim; j++)
                            ss += (double)x[i * dim + j] * x[i * dim + j];
                        double inv = 1.0 / sqrt(ss / dim + eps);
                        for (int j = 0; j < dim; j++)
                            ref[i * dim + j] = (float)(x[i * dim + j] * inv * g[j]);
                    }
                    if (inplace) {
                        loom_op_rmsnorm(be, x, x, g, n, dim, eps);
                        memcpy(y, x, sz * sizeof *y);
                    } else {
                        poison(y, sz);
                        loom_op_rmsnorm(be, y, x, g, n, dim, eps);
                    }
                    char what[64];
                    snprintf(what, sizeof what, "rmsnorm t%d n%d dim%d%s", k_threads[t], n, dim,
                             inplace ? " in place" : "");
                    test_allclose(what, y, ref, (long)sz, 1e-5, 1e-5);
                    free(x);
                    free(y);
                    free(ref);
                    free(g);
                }
        loom_backend_destroy(&be);
    }
}

static void test_add(void) {
    static const int64_t ns[] = {1, 7, 13, 4095, 4096, 4097, 100003};
    unsigned long long st = 4;
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t a = 0; a < LOOM_ARRAY_LEN(ns); a++) {
            int64_t n = ns[a];
            float *y = alloc_f((size_t)n + 1), *x = alloc_f((size_t)n), *ref = alloc_f((size_t)n);
            fill(y, (size_t)n, &st, 1.0f);
            fill(x, (size_t)n, &st, 1.0f);
            y[n] = 12345.0f; /* guard */
            for (int64_t i = 0; i < n; i++)
                ref[i] = y[i] + x[i];
            loom_op_add(be, y, x, n);
            char what[48];
            snprintf(what, sizeof what, "add t%d n%lld", k_threads[t], (long long)n);
            test_allclose(what, y, ref, (long)n, 0, 0);
            CHECK(y[n] == 12345.0f);
            free(y);
            free(x);
            free(ref);
        }
        loom_backend_destroy(&be);
    }
}

static void test_add_bias(void) {
    static const int shapes[][2] = {{1, 1}, {1, 13}, {3, 7}, {17, 192}, {64, 33}, {5, 4097}};
    unsigned long long st = 41;
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t a = 0; a < LOOM_ARRAY_LEN(shapes); a++) {
            int n = shapes[a][0], cols = shapes[a][1];
            size_t sz = (size_t)n * cols;
            float *y = alloc_f(sz + 1), *b = alloc_f((size_t)cols), *ref = alloc_f(sz);
            fill(y, sz, &st, 1.0f);
            fill(b, (size_t)cols, &st, 1.0f);
            y[sz] = 12345.0f; /* guard */
            for (int i = 0; i < n; i++)
                for (int j = 0; j < cols; j++) ref[(size_t)i * cols + j] = y[(size_t)i * cols + j] + b[j];
            loom_op_add_bias(be, y, b, n, cols);
            char what[64];
            snprintf(what, sizeof what, "add_bias t%d n%d cols%d", k_threads[t], n, cols);
            test_allclose(what, y, ref, (long)sz, 0, 0);
            CHECK(y[sz] == 12345.0f);
            free(y);
            free(b);
            free(ref);
        }
        loom_backend_destroy(&be);
    }
}

/* loom_op_matmul_bias where the backend has no fused op: exactly matmul
 * then add_bias. */
static void test_matmul_bias(void) {
    enum { ROWS = 19, COLS = 40, N = 5 };
    unsigned long long st = 43;
    loom_backend_t *be = make_backend(1, LOOM_DT_F32);
    REQUIRE(be);
    float *w = alloc_f(ROWS * COLS), *x = alloc_f(N * COLS), *b = alloc_f(ROWS), *y = alloc_f(N * ROWS),
          *ref = alloc_f(N * ROWS);
    fill(w, ROWS * COLS, &st, 1.0f), fill(x, N * COLS, &st, 1.0f), fill(b, ROWS, &st, 1.0f);
    loom_weight_t lw;
    REQUIRE(loom_weight_upload(be, &lw, ROWS, COLS, w, NULL) == LOOM_OK);
    loom_op_matmul(be, ref, x, &lw, N);
    loom_op_add_bias(be, ref, b, N, ROWS);
    loom_op_matmul_bias(be, y, x, &lw, b, N);
    test_allclose("matmul_bias", y, ref, N * ROWS, 0, 0);
    loom_weight_free(be, &lw);
    free(w), free(x), free(b), free(y), free(ref);
    loom_backend_destroy(&be);
}

static void test_silu_mul(void) {
    static const int hs[] = {1, 7, 13, 67, 257, 1031};
    static const int ns[] = {1, 5, 40};
    unsigned long long st = 5;
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t a = 0; a < LOOM_ARRAY_LEN(hs); a++)
            for (size_t b = 0; b < LOOM_ARRAY_LEN(ns); b++) {
                int n = ns[b], h = hs[a];
                float *gu = alloc_f((size_t)n * 2 * h), *out = alloc_f((size_t)n * h),
                      *ref = alloc_f((size_t)n * h);
                fill(gu, (size_t)n * 2 * h, &st, 12.0f);
                gu[0] = -100.0f; /* exp overflow and underflow ends */
                if (h > 3) gu[1] = 100.0f, gu[2] = 0.0f, gu[3] = -87.5f;
                for (int i = 0; i < n; i++)
                    for (int j = 0; j < h; j++) {
                        double g = gu[(int64_t)i * 2 * h + j], u = gu[(int64_t)i * 2 * h + h + j];
                        ref[(int64_t)i * h + j] = (float)(g / (1.0 + exp(-g)) * u);
                    }
                poison(out, (size_t)n * h);
                loom_op_silu_mul(be, out, gu, n, h);
                char what[48];
                snprintf(what, sizeof what, "silu_mul t%d n%d h%d", k_threads[t], n, h);
                test_allclose(what, out, ref, (long)n * h, 1e-6, 1e-5);
                free(gu);
                free(out);
                free(ref);
            }
        loom_backend_destroy(&be);
    }
}

/* Every activation of loom_op_act_mul against its definition in double. */
static double act_ref(loom_act_t act, double x) {
    switch (act) {
    case LOOM_ACT_SILU: return x / (1.0 + exp(-x));
    case LOOM_ACT_GELU: return 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
    case LOOM_ACT_GELU_TANH: return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case LOOM_ACT_QUICK_GELU: return x / (1.0 + exp(-1.702 * x));
    case LOOM_ACT_RELU: return x > 0 ? x : 0.0;
    case LOOM_ACT_RELU2: return x > 0 ? x * x : 0.0;
    }
    return NAN;
}

static void test_act_mul(void) {
    static const loom_act_t acts[] = {LOOM_ACT_SILU, LOOM_ACT_GELU, LOOM_ACT_GELU_TANH, LOOM_ACT_QUICK_GELU,
                                      LOOM_ACT_RELU, LOOM_ACT_RELU2};
    static const int hs[] = {1, 13, 257}, ns[] = {1, 40};
    unsigned long long st = 15;
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t k = 0; k < LOOM_ARRAY_LEN(acts); k++) {
            CHECK(loom_backend_act_supported(be, acts[k]));
            for (size_t a = 0; a < LOOM_ARRAY_LEN(hs); a++)
                for (size_t b = 0; b < LOOM_ARRAY_LEN(ns); b++) {
                    int n = ns[b], h = hs[a];
                    float *gu = alloc_f((size_t)n * 2 * h), *out = alloc_f((size_t)n * h),
                          *ref = alloc_f((size_t)n * h);
                    fill(gu, (size_t)n * 2 * h, &st, 6.0f);
                    gu[0] = -30.0f;
                    for (int i = 0; i < n; i++)
                        for (int j = 0; j < h; j++)
                            ref[(int64_t)i * h + j] = (float)(act_ref(acts[k], gu[(int64_t)i * 2 * h + j]) *
                                                              gu[(int64_t)i * 2 * h + h + j]);
                    poison(out, (size_t)n * h);
                    loom_op_act_mul(be, acts[k], out, gu, n, h);
                    char what[64];
                    snprintf(what, sizeof what, "act_mul %d t%d n%d h%d", (int)acts[k], k_threads[t], n, h);
                    test_allclose(what, out, ref, (long)n * h, 1e-6, 1e-5);
                    free(gu);
                    free(out);
                    free(ref);
                }
        }
        loom_backend_destroy(&be);
    }
}

/* GPT-OSS's clamped SwiGLU against the formula in double: gate and up
 * drawn in [-12, 12] so both clamps (gate above 7, |up| above 7) are hit. */
static void test_swiglu_clamp(void) {
    static const int hs[] = {1, 13, 257}, ns[] = {1, 40};
    unsigned long long st = 16;
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        CHECK(loom_backend_swiglu_clamp_supported(be));
        for (size_t a = 0; a < LOOM_ARRAY_LEN(hs); a++)
            for (size_t b = 0; b < LOOM_ARRAY_LEN(ns); b++) {
                int n = ns[b], h = hs[a], clamped = 0;
                float *gu = alloc_f((size_t)n * 2 * h), *out = alloc_f((size_t)n * h),
                      *ref = alloc_f((size_t)n * h);
                fill(gu, (size_t)n * 2 * h, &st, 12.0f);
                for (int i = 0; i < n; i++)
                    for (int j = 0; j < h; j++) {
                        double g = gu[(int64_t)i * 2 * h + j], u = gu[(int64_t)i * 2 * h + h + j];
                        clamped += g > 7.0 || fabs(u) > 7.0;
                        g = g > 7.0 ? 7.0 : g;
                        u = u > 7.0 ? 7.0 : u < -7.0 ? -7.0 : u;
                        ref[(int64_t)i * h + j] = (float)((u + 1.0) * g / (1.0 + exp(-1.702 * g)));
                    }
                poison(out, (size_t)n * h);
                loom_op_swiglu_clamp(be, out, gu, n, h, 1.702f, 7.0f);
                char what[64];
                snprintf(what, sizeof what, "swiglu_clamp t%d n%d h%d", k_threads[t], n, h);
                test_allclose(what, out, ref, (long)n * h, 1e-6, 1e-5);
                if (n * h > 100) CHECK(clamped > 0);
                free(gu);
                free(out);
                free(ref);
            }
        loom_backend_destroy(&be);
    }
}

/* Per-head RMSNorm of strided rows (Qwen3's q/k norms) against the loop. */
static void test_head_rmsnorm(void) {
    unsigned long long st = 16;
    loom_backend_t *be = make_backend(2, LOOM_DT_F32);
    REQUIRE(be);
    const int n = 7, heads = 3, hd = 24, stride = 100;
    float *x = alloc_f((size_t)n * stride), *ref = alloc_f((size_t)n * stride), *g = alloc_f(hd);
    fill(x, (size_t)n * stride, &st, 3.0f);
    fill(g, hd, &st, 1.0f);
    memcpy(ref, x, (size_t)n * stride * sizeof(float));
    for (int i = 0; i < n; i++)
        for (int h = 0; h < heads; h++) {
            float *v = ref + (int64_t)i * stride + 5 + h * hd;
            double ss = 0;
            for (int d = 0; d < hd; d++) ss += (double)v[d] * v[d];
            double inv = 1.0 / sqrt(ss / hd + 1e-6);
            for (int d = 0; d < hd; d++) v[d] = (float)(v[d] * inv * g[d]);
        }
    loom_op_head_rmsnorm(be, x + 5, stride, n, heads, hd, g, 1e-6f);
    test_allclose("head_rmsnorm (the columns around the heads untouched)", x, ref, (long)n * stride, 1e-6, 1e-5);
    free(x);
    free(ref);
    free(g);
    loom_backend_destroy(&be);
}

static void test_embed_gather(void) {
    unsigned long long st = 6;
    const int vocab = 37;
    static const int dims[] = {1, 13, 257, 4096};
    static const int ns[] = {1, 5, 40};
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t a = 0; a < LOOM_ARRAY_LEN(dims); a++)
            for (size_t b = 0; b < LOOM_ARRAY_LEN(ns); b++) {
                int dim = dims[a], n = ns[b];
                float *table = alloc_f((size_t)vocab * dim), *x = alloc_f((size_t)n * dim),
                      *ref = alloc_f((size_t)n * dim);
                int32_t ids[40];
                fill(table, (size_t)vocab * dim, &st, 1.0f);
                for (int i = 0; i < n; i++)
                    ids[i] = (int32_t)((i * 7 + 3) % vocab); /* repeats */
                for (int i = 0; i < n; i++)
                    memcpy(ref + (int64_t)i * dim, table + (int64_t)ids[i] * dim,
                           (size_t)dim * sizeof(float));
                poison(x, (size_t)n * dim);
                loom_op_embed(be, x, table, ids, n, dim);
                test_allclose("embed", x, ref, (long)n * dim, 0, 0);
                poison(x, (size_t)n * dim);
                loom_op_gather_rows(be, x, table, ids, n, dim);
                test_allclose("gather_rows", x, ref, (long)n * dim, 0, 0);
                free(table);
                free(x);
                free(ref);
            }
        loom_backend_destroy(&be);
    }
}

/* out(t) = [acc ? out(t) : 0] + sum_j w y(pos), in j order, pos < 0 skipped:
 * against a double sum, over thread counts and a k of 1. */
static void test_moe_combine(void) {
    unsigned long long st = 11;
    static const int shapes[][3] = {
        {1, 1, 7}, {5, 2, 64}, {3, 8, 257}, {40, 4, 16}}; /* n, k, dim */
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t a = 0; a < LOOM_ARRAY_LEN(shapes); a++) {
            const int n = shapes[a][0], k = shapes[a][1], dim = shapes[a][2], P = n * k;
            float *y = alloc_f((size_t)P * dim), *w = alloc_f((size_t)P),
                  *out = alloc_f((size_t)n * dim), *ref = alloc_f((size_t)n * dim);
            int32_t *pos = malloc((size_t)P * sizeof *pos);
            fill(y, (size_t)P * dim, &st, 1.0f);
            fill(w, (size_t)P, &st, 1.0f);
            fill(out, (size_t)n * dim, &st, 1.0f);
            for (int q = 0; q < P; q++)
                pos[q] = q % 3 == 2 ? -1 : (q * 5 + 1) % P; /* any order, skips */
            for (int acc = 0; acc <= 1; acc++) {
                for (int i = 0; i < n; i++)
                    for (int d = 0; d < dim; d++) {
                        double v = acc ? out[(int64_t)i * dim + d] : 0.0;
                        for (int j = 0; j < k; j++)
                            if (pos[i * k + j] >= 0)
                                v += (double)w[i * k + j] * y[(int64_t)pos[i * k + j] * dim + d];
                        ref[(int64_t)i * dim + d] = (float)v;
                    }
                if (!acc) poison(out, (size_t)n * dim);
                loom_op_moe_combine(be, out, y, pos, w, n, k, dim, acc);
                test_allclose(acc ? "moe_combine accumulate" : "moe_combine", out, ref,
                              (long)n * dim, 1e-6, 1e-5);
            }
            free(y), free(w), free(out), free(ref), free(pos);
        }
        loom_backend_destroy(&be);
    }
}

/* The CPU's decode MoE ops: route against a brute-force top-k of a double
 * softmax (ascending experts, renormalised or not), the batched GEMV against
 * double dot products, an expert another rank holds giving zeros. */
static void test_moe_route_gemv(void) {
    unsigned long long st = 12;
    enum { E = 6, K = 2, N = 3, ROWS = 5, COLS = 7 };
    loom_backend_t *be = make_backend(2, LOOM_DT_F32);
    REQUIRE(be);
    float logits[N * E], w[N * K], hw[E][ROWS * COLS], x[N * COLS], y[N * K * ROWS];
    int32_t sel[N * K];
    fill(logits, N * E, &st, 3.0f);
    for (int norm = 0; norm <= 1; norm++) {
        loom_op_moe_route(be, logits, N, E, K, norm, sel, w);
        for (int t = 0; t < N; t++) {
            const float *l = logits + t * E;
            double mx = l[0], sum = 0, p[E];
            for (int e = 1; e < E; e++)
                mx = l[e] > mx ? l[e] : mx;
            for (int e = 0; e < E; e++)
                sum += p[e] = exp(l[e] - mx);
            int b0 = 0, b1 = -1;
            for (int e = 1; e < E; e++)
                b0 = p[e] > p[b0] ? e : b0;
            for (int e = 0; e < E; e++)
                if (e != b0 && (b1 < 0 || p[e] > p[b1])) b1 = e;
            int lo = b0 < b1 ? b0 : b1, hi = b0 < b1 ? b1 : b0;
            CHECK(sel[t * K] == lo && sel[t * K + 1] == hi);
            double z = norm ? p[b0] + p[b1] : sum;
            CHECK(fabs(w[t * K] - p[lo] / z) < 1e-6 && fabs(w[t * K + 1] - p[hi] / z) < 1e-6);
        }
    }
    loom_weight_t ex[E] = {{0}};
    for (int e = 0; e < E; e++) {
        fill(hw[e], ROWS * COLS, &st, 1.0f);
        if (e != 2) REQUIRE(loom_weight_upload(be, &ex[e], ROWS, COLS, hw[e], NULL) == LOOM_OK);
    }
    CHECK(loom_backend_moe_device(be, ex, E, K) == 1 &&
          loom_backend_moe_device(be, ex, E, E + 1) == 0);
    void *table = loom_backend_moe_table(be, ex, E);
    REQUIRE(table);
    for (int t = 0; t < N; t++)
        sel[t * K] = 2, sel[t * K + 1] = (t * 2 + 1) % E; /* 2: not held */
    fill(x, N * COLS, &st, 1.0f);
    for (int xdiv = 1; xdiv <= K; xdiv++) {
        poison(y, N * K * ROWS);
        loom_op_moe_gemv(be, y, x, xdiv, sel, N * K / (3 - xdiv), table, LOOM_DT_F32, ROWS, COLS);
        for (int p = 0; p < N * K / (3 - xdiv); p++)
            for (int r = 0; r < ROWS; r++) {
                double ref = 0;
                for (int c = 0; c < COLS; c++)
                    ref += sel[p] == 2
                               ? 0.0
                               : (double)hw[sel[p]][r * COLS + c] * x[(p / xdiv) * COLS + c];
                CHECK(fabs(y[p * ROWS + r] - ref) < 1e-5);
            }
    }
    loom_backend_free(be, table);
    for (int e = 0; e < E; e++)
        if (e != 2) loom_weight_free(be, &ex[e]);
    loom_backend_destroy(&be);
}

static void test_rope(void) {
    static const int hds[] = {2, 6, 14, 64, 128};
    static const int nhs[] = {1, 3, 8};
    static const int ns[] = {1, 4, 33};
    unsigned long long st = 8;
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t a = 0; a < LOOM_ARRAY_LEN(hds); a++)
            for (size_t b = 0; b < LOOM_ARRAY_LEN(nhs); b++)
                for (size_t c = 0; c < LOOM_ARRAY_LEN(ns); c++) {
                    int hd = hds[a], nh = nhs[b], n = ns[c], half = hd / 2;
                    int stride = nh * hd + 5; /* rows with other data after the heads */
                    float *x = alloc_f((size_t)n * stride), *ref = alloc_f((size_t)n * stride);
                    float inv_freq[64];
                    int32_t pos[33];
                    for (int j = 0; j < half; j++)
                        inv_freq[j] = (float)pow(500000.0, -2.0 * j / hd);
                    for (int i = 0; i < n; i++)
                        pos[i] = i == 0 ? 8191 : (int32_t)((i * 977 + 13) % 8192);
                    fill(x, (size_t)n * stride, &st, 1.0f);
                    memcpy(ref, x, (size_t)n * stride * sizeof *x);
                    for (int i = 0; i < n; i++)
                        for (int h = 0; h < nh; h++)
                            for (int j = 0; j < half; j++) {
                                float *r = ref + (int64_t)i * stride + h * hd;
                                double ang = (double)pos[i] * (double)inv_freq[j];
                                double x0 = r[j], x1 = r[j + half];
                                r[j] = (float)(x0 * cos(ang) - x1 * sin(ang));
                                r[j + half] = (float)(x1 * cos(ang) + x0 * sin(ang));
                            }
                    loom_op_rope(be, x, stride, n, nh, hd, pos, inv_freq);
                    char what[64];
                    snprintf(what, sizeof what, "rope t%d hd%d nh%d n%d", k_threads[t], hd, nh, n);
                    test_allclose(what, x, ref, (long)n * stride, 1e-6, 1e-5);
                    free(x);
                    free(ref);
                }
        loom_backend_destroy(&be);
    }
}

/* --- KV cache ---------------------------------------------------------- */

static const loom_dtype_t k_kv_dts[] = {LOOM_DT_F32, LOOM_DT_BF16, LOOM_DT_I8};

/* A KV cache of n_slots token rows (nkv heads of hd) in dt, host memory. */
typedef struct test_kv {
    loom_kv_layer_t kv;
    size_t elems, heads;
} test_kv_t;

static test_kv_t test_kv_alloc(loom_dtype_t dt, size_t n_slots, int nkv, int hd) {
    test_kv_t c = {.kv.dtype = dt, .elems = n_slots * nkv * hd, .heads = n_slots * nkv};
    size_t es = loom_dtype_size(dt);
    c.kv.k = loom_aligned_alloc(c.elems * es + 64);
    c.kv.v = loom_aligned_alloc(c.elems * es + 64);
    if (!c.kv.k || !c.kv.v) abort();
    if (dt == LOOM_DT_I8) {
        c.kv.k_scale = alloc_f(c.heads);
        c.kv.v_scale = alloc_f(c.heads);
    }
    return c;
}

static void test_kv_free(test_kv_t *c) {
    loom_aligned_free(c->kv.k);
    loom_aligned_free(c->kv.v);
    loom_aligned_free(c->kv.k_scale);
    loom_aligned_free(c->kv.v_scale);
}

/* Reference narrowing of one head's row (hd floats), written here:
 * bf16 round-to-nearest-even, int8 absmax/127 with rounding half away from
 * zero (ties are measure-zero on random data). NaN rows (unwritten slots)
 * become bf16 NaN, or codes 0 with a NaN scale. */
static void ref_store(loom_dtype_t dt, void *codes, float *scale, const float *x, int hd) {
    if (dt == LOOM_DT_F32) {
        memcpy(codes, x, (size_t)hd * sizeof(float));
    } else if (dt == LOOM_DT_BF16) {
        for (int d = 0; d < hd; d++)
            ((uint16_t *)codes)[d] = isnan(x[d]) ? 0x7fc0 : loom_f32_to_bf16(x[d]);
    } else {
        double amax = 0;
        for (int d = 0; d < hd; d++)
            amax = fmax(amax, fabs((double)x[d]));
        *scale = isnan(x[0]) ? NAN : (float)(amax / 127.0);
        for (int d = 0; d < hd; d++)
            ((int8_t *)codes)[d] =
                isnan(x[0]) || amax == 0 ? 0 : (int8_t)lround((double)x[d] * 127.0 / amax);
    }
}

/* Element e of a cache as float32 (the value the kernels compute with). */
static float kv_value(const loom_kv_layer_t *kv, int is_v, size_t e, int hd) {
    const void *c = is_v ? kv->v : kv->k;
    if (kv->dtype == LOOM_DT_F32) return ((const float *)c)[e];
    if (kv->dtype == LOOM_DT_BF16) return loom_bf16_to_f32(((const uint16_t *)c)[e]);
    const float *sc = is_v ? kv->v_scale : kv->k_scale;
    return sc[e / (size_t)hd] * (float)((const int8_t *)c)[e];
}

/* kv_write into every dtype: F32 exact; BF16 the nearest-even rounding; I8
 * codes within one step of the reference (float vs double rounding) and
 * the value within half a step (scale / 2) of the input; unwritten slots
 * keep their sentinel. */
static void test_kv_write(void) {
    unsigned long long st = 9;
    static const int shapes[][2] = {{1, 1}, {1, 13}, {3, 7}, {4, 64}}; /* nkv, hd */
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t di = 0; di < LOOM_ARRAY_LEN(k_kv_dts); di++)
            for (size_t a = 0; a < LOOM_ARRAY_LEN(shapes); a++) {
                const loom_dtype_t dt = k_kv_dts[di];
                const int nkv = shapes[a][0], hd = shapes[a][1], kv_dim = nkv * hd;
                const int B = 3, n_blocks = 50, n = 70, stride = 3 * kv_dim + 2;
                const size_t n_slots = (size_t)n_blocks * B, es = loom_dtype_size(dt);
                test_kv_t c = test_kv_alloc(dt, n_slots, nkv, hd);
                memset(c.kv.k, 0x5a, c.elems * es);
                memset(c.kv.v, 0x5a, c.elems * es);
                for (size_t h = 0; dt == LOOM_DT_I8 && h < c.heads; h++)
                    c.kv.k_scale[h] = c.kv.v_scale[h] = -7.0f;
                float *k = alloc_f((size_t)n * stride), *v = alloc_f((size_t)n * stride);
                fill(k, (size_t)n * stride, &st, 1.0f);
                fill(v, (size_t)n * stride, &st, 1.0f);
                for (int e = 0; e < hd; e++) /* an all-zero head: scale 0, codes 0 */
                    k[e] = 0.0f;
                int32_t slots[70];
                char *written = calloc(n_slots, 1);
                for (int i = 0; i < n; i++) {
                    slots[i] = i % 11 == 4 ? -1 : (int32_t)((i * 61 + 5) % (int)n_slots);
                    if (slots[i] >= 0) written[slots[i]] = 1;
                }
                loom_op_kv_write(be, &c.kv, k, v, stride, slots, n, nkv, hd);
                int bad = 0;
                for (int i = 0; i < n && bad < 5; i++) {
                    if (slots[i] < 0) continue;
                    for (int h = 0; h < nkv; h++)
                        for (int isv = 0; isv < 2; isv++) {
                            const float *x = (isv ? v : k) + (int64_t)i * stride + h * hd;
                            const size_t e0 = ((size_t)slots[i] * nkv + h) * hd;
                            char want[256];
                            float wscale = 0.0f;
                            ref_store(dt, want, &wscale, x, hd);
                            const char *got = (const char *)(isv ? c.kv.v : c.kv.k) + e0 * es;
                            if (dt == LOOM_DT_I8) {
                                const float sc = (isv ? c.kv.v_scale : c.kv.k_scale)[e0 / hd];
                                if (!(fabsf(sc - wscale) <= 1e-6f * wscale)) bad++;
                                for (int d = 0; d < hd; d++) {
                                    int dq = (int8_t)got[d] - (int8_t)want[d];
                                    float val = kv_value(&c.kv, isv, e0 + d, hd);
                                    if (dq < -1 || dq > 1 ||
                                        !(fabsf(val - x[d]) <= 0.5001f * wscale))
                                        bad++;
                                }
                            } else if (memcmp(got, want, (size_t)hd * es)) {
                                bad++;
                            }
                        }
                }
                for (size_t sl = 0; sl < n_slots && !bad; sl++) {
                    if (written[sl]) continue;
                    const unsigned char *kb = (const unsigned char *)c.kv.k + sl * kv_dim * es;
                    for (size_t b = 0; b < (size_t)kv_dim * es; b++)
                        if (kb[b] != 0x5a) bad++;
                    if (dt == LOOM_DT_I8 && c.kv.v_scale[sl * nkv] != -7.0f) bad++;
                }
                CHECKF(!bad, "kv_write %s t%d nkv%d hd%d: %d mismatches", loom_kv_dtype_name(dt),
                       k_threads[t], nkv, hd, bad);
                if (dt == LOOM_DT_I8) CHECK(c.kv.k_scale[(size_t)slots[0] * nkv] == 0.0f);
                free(written);
                free(k);
                free(v);
                test_kv_free(&c);
            }
        loom_backend_destroy(&be);
    }
}

/* A pool with each block contiguous across layers (worker/engine/kv.c):
 * kv_write and attention through block_stride give the same bits as the
 * layer-major layout, for every dtype; the spans' padding stays untouched. */
static void test_kv_block_strided(void) {
    unsigned long long st = 21;
    loom_backend_t *be = make_backend(2, LOOM_DT_F32);
    REQUIRE(be);
    CHECK(loom_backend_kv_block_strided(be));
    for (size_t di = 0; di < LOOM_ARRAY_LEN(k_kv_dts); di++) {
        const loom_dtype_t dt = k_kv_dts[di];
        const int nkv = 2, hd = 16, nh = 4, kv_dim = nkv * hd, B = 4, n_blocks = 12, n_seqs = 2;
        const int max_blocks = 5, n = n_seqs * max_blocks * B;
        const size_t es = loom_dtype_size(dt), codes = (size_t)B * kv_dim * es + 64;
        const size_t scales = dt == LOOM_DT_I8 ? (size_t)B * nkv * sizeof(float) + 64 : 0;
        const size_t span = 3 * (2 * codes + 2 * scales); /* as if 3 layers, this one the middle */
        test_kv_t lm = test_kv_alloc(dt, (size_t)n_blocks * B, nkv, hd);
        char *pool = loom_aligned_alloc(span * n_blocks);
        REQUIRE(pool);
        memset(pool, 0x5a, span * n_blocks);
        char *l1 = pool + 2 * codes + 2 * scales;
        loom_kv_layer_t sk = {.k = l1, .v = l1 + codes, .dtype = dt, .block_size = B,
                              .block_stride = (int64_t)(span / es), .scale_block_stride = (int64_t)(span / 4)};
        if (scales) {
            sk.k_scale = (float *)(l1 + 2 * codes);
            sk.v_scale = (float *)(l1 + 2 * codes + scales);
        }
        const int stride = 2 * kv_dim, q_stride = nh * hd;
        float *k = alloc_f((size_t)n * stride), *v = alloc_f((size_t)n * stride), *q = alloc_f((size_t)n * q_stride);
        float *o1 = alloc_f((size_t)n * nh * hd), *o2 = alloc_f((size_t)n * nh * hd);
        fill(k, (size_t)n * stride, &st, 1.0f);
        fill(v, (size_t)n * stride, &st, 1.0f);
        fill(q, (size_t)n * q_stride, &st, 1.0f);
        int32_t bt[2 * 5] = {7, 2, 11, 0, 5, 3, 9, 1, 10, 4}, slots[40], seq[40], pos[40];
        for (int i = 0; i < n; i++) {
            seq[i] = i / (max_blocks * B);
            pos[i] = i % (max_blocks * B);
            slots[i] = bt[seq[i] * max_blocks + pos[i] / B] * B + pos[i] % B;
        }
        loom_op_kv_write(be, &lm.kv, k, v, stride, slots, n, nkv, hd);
        loom_op_kv_write(be, &sk, k, v, stride, slots, n, nkv, hd);
        loom_attn_args_t a = {.n = n, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd,
                              .scale = 0.25f, .q = q, .q_stride = q_stride, .out = o1,
                              .out_stride = nh * hd, .kv = lm.kv, .block_size = B, .tok_seq = seq,
                              .tok_pos = pos, .block_tables = bt, .max_blocks = max_blocks,
                              .max_ctx = max_blocks * B};
        loom_op_attention(be, &a);
        a.kv = sk;
        a.out = o2;
        loom_op_attention(be, &a);
        CHECKF(!memcmp(o1, o2, sizeof(float) * (size_t)n * nh * hd), "strided attention %s differs",
               loom_kv_dtype_name(dt));
        int bad = 0; /* layers 0 and 2 of every block, and block 6 and 8 (unused), untouched */
        for (int b = 0; b < n_blocks; b++) {
            const int used = b != 6 && b != 8;
            for (size_t o = 0; o < span; o++) {
                const int in_l1 = o >= 2 * codes + 2 * scales && o < 4 * codes + 4 * scales;
                if ((!in_l1 || !used) && (unsigned char)pool[(size_t)b * span + o] != 0x5a) bad++;
            }
        }
        CHECKF(!bad, "strided kv_write %s: %d bytes outside the layer's spans", loom_kv_dtype_name(dt), bad);
        free(k);
        free(v);
        free(q);
        free(o1);
        free(o2);
        loom_aligned_free(pool);
        test_kv_free(&lm);
    }
    loom_backend_destroy(&be);
}

/* V heads narrower than K's (loom_kv_layer_t.v_dim; decompressed MLA keeps
 * K of nope + rope dims and V of v_head_dim): kv_write and attention over
 * such a pool, layer-major and block-strided, give the bits of the same
 * cache with V zero-padded to K's width (the plain layout the other
 * attention tests check against the double loop), in its first v_dim
 * columns of each head (within f32 rounding where v_dim is odd: the
 * weighted sum goes scalar); the padded run's other columns are 0. GQA
 * groups 1 and 3, v_dim a multiple of 16, of 8 only and odd. */
/* loom_attn_args_t.lse: each softmax's log-sum-exp, max + log(sum exp), of the scaled scores of positions
 * [0, pos], against a double sum; with two threads and one; the output as without it. */
static void test_attention_lse(void) {
    for (size_t ti = 0; ti < 2; ti++) {
        loom_backend_t *be = make_backend(k_threads[ti], LOOM_DT_F32);
        REQUIRE(be);
        CHECK(loom_backend_attn_lse_supported(be));
        unsigned long long st = 31;
        const int nkv = 2, nh = 4, hd = 16, vd = 8, B = 4, n = 11, kd = nkv * hd, vdim = nkv * vd;
        float *k = alloc_f((size_t)n * kd), *v = alloc_f((size_t)n * vdim), *q = alloc_f((size_t)n * nh * hd);
        float *o1 = alloc_f((size_t)n * nh * vd), *o2 = alloc_f((size_t)n * nh * vd), *lse = alloc_f((size_t)n * nh);
        fill(k, (size_t)n * kd, &st, 2.0f);
        fill(v, (size_t)n * vdim, &st, 1.0f);
        fill(q, (size_t)n * nh * hd, &st, 2.0f);
        poison(lse, (size_t)n * nh);
        int32_t bt[3] = {0, 1, 2}, seq[11] = {0}, pos[11];
        for (int i = 0; i < n; i++) pos[i] = i;
        loom_attn_args_t a = {.n = n, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.3f, .q = q,
                              .q_stride = nh * hd, .out = o1, .out_stride = nh * vd,
                              .kv = {.k = k, .v = v, .dtype = LOOM_DT_F32, .block_size = B, .v_dim = vd},
                              .block_size = B, .tok_seq = seq, .tok_pos = pos, .block_tables = bt, .max_blocks = 3,
                              .max_ctx = n};
        loom_op_attention(be, &a);
        a.out = o2;
        a.lse = lse;
        loom_op_attention(be, &a);
        CHECK(memcmp(o1, o2, (size_t)n * nh * vd * sizeof(float)) == 0);
        double worst = 0;
        for (int i = 0; i < n; i++)
            for (int h = 0; h < nh; h++) {
                double mx = -INFINITY, sum = 0, sc[11];
                for (int p = 0; p <= i; p++) {
                    double d = 0;
                    for (int j = 0; j < hd; j++)
                        d += (double)q[((size_t)i * nh + h) * hd + j] * k[(size_t)p * kd + (size_t)(h / 2) * hd + j];
                    sc[p] = d * 0.3f;
                    mx = sc[p] > mx ? sc[p] : mx;
                }
                for (int p = 0; p <= i; p++) sum += exp(sc[p] - mx);
                worst = fmax(worst, fabs(lse[i * nh + h] - (mx + log(sum))));
            }
        CHECKF(worst < 1e-4, "lse off by %g", worst);
        loom_aligned_free(k), loom_aligned_free(v), loom_aligned_free(q);
        loom_aligned_free(o1), loom_aligned_free(o2), loom_aligned_free(lse);
        loom_backend_destroy(&be);
    }
}

/* The decompressed MLA prefill's two helpers. loom_op_attn_merge: attention over keys [0, L) equals the
 * merge of attention over [0, c) and over [c, L) (each its own block-table view of one cache), output and
 * lse, V narrower than K. loom_op_kv_gather: a sequence's K rows through a shuffled block table, two heads,
 * as kv_write stored them (f32 exact, bf16 rounded, int8 within half a step of its head's scale). */
static void test_attn_merge_gather(void) {
    loom_backend_t *be = make_backend(2, LOOM_DT_F32);
    REQUIRE(be);
    unsigned long long st = 41;
    const int nkv = 2, nh = 4, hd = 16, vd = 8, B = 4, L = 23, c = 12, n_blocks = 6, kd = nkv * hd, vdim = nkv * vd;
    float *k = alloc_f((size_t)n_blocks * B * kd), *v = alloc_f((size_t)n_blocks * B * vdim);
    float *q = alloc_f((size_t)nh * hd), *full = alloc_f((size_t)nh * vd), *oa = alloc_f((size_t)nh * vd);
    float *ob = alloc_f((size_t)nh * vd), *lf = alloc_f(nh), *la = alloc_f(nh), *lb = alloc_f(nh);
    fill(k, (size_t)n_blocks * B * kd, &st, 2.0f);
    fill(v, (size_t)n_blocks * B * vdim, &st, 1.0f);
    fill(q, (size_t)nh * hd, &st, 2.0f);
    int32_t bt[6] = {0, 1, 2, 3, 4, 5}, seq[1] = {0}, pos[1];
    loom_attn_args_t a = {.n = 1, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.3f, .q = q,
                          .q_stride = nh * hd, .out_stride = nh * vd,
                          .kv = {.k = k, .v = v, .dtype = LOOM_DT_F32, .block_size = B, .v_dim = vd},
                          .block_size = B, .tok_seq = seq, .tok_pos = pos, .block_tables = bt, .max_blocks = 6,
                          .max_ctx = L};
    pos[0] = L - 1, a.out = full, a.lse = lf; /* keys [0, L) */
    loom_op_attention(be, &a);
    pos[0] = c - 1, a.out = oa, a.lse = la; /* keys [0, c) */
    loom_op_attention(be, &a);
    a.block_tables = bt + c / B, a.max_blocks = 6 - c / B; /* keys [c, L): the blocks from c on */
    pos[0] = L - 1 - c, a.out = ob, a.lse = lb;
    loom_op_attention(be, &a);
    loom_op_attn_merge(be, oa, la, ob, lb, 1, nh, vd);
    CHECK(test_allclose("attn_merge out", oa, full, (long)nh * vd, 1e-5, 1e-5));
    CHECK(test_allclose("attn_merge lse", la, lf, nh, 1e-5, 1e-5));
    loom_aligned_free(k), loom_aligned_free(v), loom_aligned_free(q), loom_aligned_free(full);
    loom_aligned_free(oa), loom_aligned_free(ob), loom_aligned_free(lf), loom_aligned_free(la), loom_aligned_free(lb);

    CHECK(loom_backend_kv_gather_supported(be));
    for (size_t di = 0; di < LOOM_ARRAY_LEN(k_kv_dts); di++) {
        const loom_dtype_t dt = k_kv_dts[di];
        const int n = 14, p0 = 3, cn = 9; /* positions [0, n) written, [p0, p0 + cn) gathered */
        int32_t tbl[4] = {5, 2, 0, 4}, slots[14];
        for (int i = 0; i < n; i++) slots[i] = tbl[i / B] * B + i % B;
        const size_t cells = (size_t)n_blocks * B, es = loom_dtype_size(dt);
        void *kc = loom_aligned_alloc(cells * kd * es), *vc = loom_aligned_alloc(cells * kd * es);
        float *ks = alloc_f(cells * nkv), *vs = alloc_f(cells * nkv), *x = alloc_f((size_t)n * kd);
        float *rows = alloc_f((size_t)cn * kd);
        REQUIRE(kc && vc);
        fill(x, (size_t)n * kd, &st, 3.0f);
        poison(rows, (size_t)cn * kd);
        loom_kv_layer_t kv = {.k = kc, .v = vc, .dtype = dt, .block_size = B};
        if (dt == LOOM_DT_I8) kv.k_scale = ks, kv.v_scale = vs;
        loom_op_kv_write(be, &kv, x, x, kd, slots, n, nkv, hd);
        loom_op_kv_gather(be, &kv, tbl, p0, cn, nkv, hd, rows);
        double worst = 0, allowed = 0;
        for (int p = 0; p < cn; p++)
            for (int e = 0; e < kd; e++) {
                const float want = x[(size_t)(p0 + p) * kd + e], got = rows[(size_t)p * kd + e];
                const double tol = dt == LOOM_DT_F32 ? 0
                                   : dt == LOOM_DT_BF16
                                       ? fabs((double)loom_bf16_to_f32(loom_f32_to_bf16(want)) - want)
                                       : 0.5 * ks[(size_t)slots[p0 + p] * nkv + e / hd] * (1 + 1e-6);
                worst = fmax(worst, fabs((double)got - want) - tol);
                allowed = fmax(allowed, tol);
            }
        CHECKF(worst <= 0, "kv_gather %s: %g beyond its rounding (up to %g)", loom_kv_dtype_name(dt), worst, allowed);
        loom_aligned_free(kc), loom_aligned_free(vc), loom_aligned_free(ks), loom_aligned_free(vs);
        loom_aligned_free(x), loom_aligned_free(rows);
    }
    loom_backend_destroy(&be);
}

static void test_kv_v_dim(void) {
    static const int vds[] = {16, 8, 13}, groups[] = {1, 3};
    unsigned long long st = 23;
    loom_backend_t *be = make_backend(2, LOOM_DT_F32);
    REQUIRE(be);
    CHECK(loom_backend_kv_v_dim(be));
    for (size_t di = 0; di < LOOM_ARRAY_LEN(k_kv_dts); di++)
        for (size_t vi = 0; vi < LOOM_ARRAY_LEN(vds); vi++)
            for (size_t gi = 0; gi < LOOM_ARRAY_LEN(groups); gi++)
                for (int strided = 0; strided < 2; strided++) {
                    const loom_dtype_t dt = k_kv_dts[di];
                    const int nkv = 2, hd = 24, vd = vds[vi], nh = nkv * groups[gi], B = 3, n_blocks = 14;
                    const int max_blocks = 5, n_seqs = 2, n = n_seqs * max_blocks * B; /* 15 positions each */
                    const size_t es = loom_dtype_size(dt), cells = (size_t)n_blocks * B * nkv;
                    const int i8 = dt == LOOM_DT_I8;
                    /* the padded pool, layer-major: K and V of hd */
                    test_kv_t pad = test_kv_alloc(dt, (size_t)n_blocks * B, nkv, hd);
                    /* the narrow pool: K of hd, V of vd; strided: per block K codes, V codes, K and V scales */
#define UP64(x) (((x) + 63) / 64 * 64)
                    const size_t kb = UP64((size_t)B * nkv * hd * es), vb = UP64((size_t)B * nkv * vd * es);
                    const size_t sb = i8 ? UP64((size_t)B * nkv * sizeof(float)) : 0, span = kb + vb + 2 * sb;
                    const size_t kl = UP64(cells * hd * es), vl = UP64(cells * vd * es);
#undef UP64
                    const size_t bytes = LOOM_MAX(span * n_blocks, kl + vl + 2 * cells * sizeof(float));
                    char *mem = loom_aligned_alloc(bytes);
                    REQUIRE(mem);
                    memset(mem, 0, bytes);
                    loom_kv_layer_t nk = {.dtype = dt, .block_size = B, .v_dim = vd};
                    if (strided) {
                        nk.k = mem;
                        nk.v = mem + kb;
                        nk.k_scale = i8 ? (float *)(mem + kb + vb) : NULL;
                        nk.v_scale = i8 ? (float *)(mem + kb + vb + sb) : NULL;
                        nk.block_stride = (int64_t)(span / es);
                        nk.scale_block_stride = (int64_t)(span / sizeof(float));
                    } else {
                        nk.k = mem;
                        nk.v = mem + kl;
                        nk.k_scale = i8 ? (float *)(mem + kl + vl) : NULL;
                        nk.v_scale = i8 ? nk.k_scale + cells : NULL;
                    }
                    const int kst = nkv * (hd + vd), pst = 2 * nkv * hd, q_stride = nh * hd;
                    float *kvn = alloc_f((size_t)n * kst), *kvp = alloc_f((size_t)n * pst);
                    float *q = alloc_f((size_t)n * q_stride), *on = alloc_f((size_t)n * nh * vd),
                          *op = alloc_f((size_t)n * nh * hd);
                    fill(kvn, (size_t)n * kst, &st, 1.0f);
                    fill(q, (size_t)n * q_stride, &st, 1.0f);
                    memset(kvp, 0, (size_t)n * pst * sizeof(float));
                    for (int i = 0; i < n; i++) { /* the same K; V zero-padded from vd to hd a head */
                        memcpy(kvp + (size_t)i * pst, kvn + (size_t)i * kst, (size_t)nkv * hd * sizeof(float));
                        for (int h = 0; h < nkv; h++)
                            memcpy(kvp + (size_t)i * pst + (size_t)(nkv + h) * hd,
                                   kvn + (size_t)i * kst + (size_t)nkv * hd + (size_t)h * vd, (size_t)vd * sizeof(float));
                    }
                    int32_t bt[2 * 5] = {7, 2, 11, 0, 13, 3, 9, 1, 10, 4}, slots[30], seq[30], pos[30];
                    for (int i = 0; i < n; i++) {
                        seq[i] = i / (max_blocks * B);
                        pos[i] = i % (max_blocks * B);
                        slots[i] = bt[seq[i] * max_blocks + pos[i] / B] * B + pos[i] % B;
                    }
                    loom_op_kv_write(be, &nk, kvn, kvn + (size_t)nkv * hd, kst, slots, n, nkv, hd);
                    loom_op_kv_write(be, &pad.kv, kvp, kvp + (size_t)nkv * hd, pst, slots, n, nkv, hd);
                    loom_attn_args_t a = {.n = n, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd,
                                          .scale = 0.2f, .q = q, .q_stride = q_stride, .out = on,
                                          .out_stride = nh * vd, .kv = nk, .block_size = B, .tok_seq = seq,
                                          .tok_pos = pos, .block_tables = bt, .max_blocks = max_blocks,
                                          .max_ctx = max_blocks * B};
                    loom_op_attention(be, &a);
                    a.kv = pad.kv;
                    a.out = op;
                    a.out_stride = nh * hd;
                    loom_op_attention(be, &a);
                    /* bits where both weigh V on the same SIMD path (vd a multiple of 8); an odd vd goes
                     * scalar (no FMA): f32 rounding apart */
                    const double tol = vd % 8 ? 1e-5 : 0.0;
                    int bad = 0;
                    for (int i = 0; i < n; i++)
                        for (int h = 0; h < nh; h++)
                            for (int d = 0; d < hd; d++) {
                                const float p = op[((size_t)i * nh + h) * hd + d];
                                const float o = d < vd ? on[((size_t)i * nh + h) * vd + d] : 0.0f;
                                bad += !(fabs((double)p - o) <= tol * (1.0 + fabs((double)p)));
                            }
                    CHECKF(!bad, "attention with V heads of %d (K %d) %s, %d heads over %d, %s: %d values differ "
                           "from the zero-padded cache", vd, hd, loom_kv_dtype_name(dt), nh, nkv,
                           strided ? "block-strided" : "layer-major", bad);
                    free(kvn);
                    free(kvp);
                    free(q);
                    free(on);
                    free(op);
                    loom_aligned_free(mem);
                    test_kv_free(&pad);
                }
    loom_backend_destroy(&be);
}

static void test_kv_dtypes(void) {
    loom_dtype_t dt;
    CHECK(loom_kv_dtype_parse("bf16", &dt) && dt == LOOM_DT_BF16);
    CHECK(loom_kv_dtype_parse("int8", &dt) && dt == LOOM_DT_I8);
    CHECK(loom_kv_dtype_parse("fp8", &dt) && dt == LOOM_DT_F8_E4M3);
    CHECK(!loom_kv_dtype_parse("auto", &dt) && !loom_kv_dtype_parse("f16", &dt));
    CHECK(loom_kv_head_bytes(LOOM_DT_F32, 64) == 256 &&
          loom_kv_head_bytes(LOOM_DT_BF16, 64) == 128);
    CHECK(loom_kv_head_bytes(LOOM_DT_I8, 64) == 68);
    loom_backend_t *be = make_backend(1, LOOM_DT_F32);
    REQUIRE(be);
    loom_err_t err = {0};
    CHECK(loom_backend_kv_resolve(be, "auto", &dt, &err) == LOOM_OK && dt == LOOM_DT_F32);
    CHECK(loom_backend_kv_resolve(be, "int8", &dt, &err) == LOOM_OK && dt == LOOM_DT_I8);
    CHECK(loom_backend_kv_resolve(be, "fp8", &dt, &err) == LOOM_ERR_UNSUPPORTED);
    CHECK(strstr(err.msg, "fp8") && strstr(err.msg, "int8"));
    CHECK(loom_backend_kv_resolve(be, "q4", &dt, &err) == LOOM_ERR_INVALID_ARGUMENT);
    CHECK(!loom_backend_kv_supported(be, LOOM_DT_F8_E4M3));
    loom_backend_destroy(&be);
}

/* --- attention --------------------------------------------------------- */

struct attn_case {
    int nh, nkv, hd, B;
    int n_seqs;
    int seq_len[4];  /* cached positions after this step */
    int new_toks[4]; /* tokens of the sequence in this step (1 = decode) */
    int window;      /* sliding window (0: none) */
    float softcap;   /* attention logit soft cap (0: none) */
    int sinks;       /* GPT-OSS attention sinks: one logit per head in [-3, 3] (0: none) */
};

static void naive_attention(float *out, int out_stride, const float *q, int q_stride,
                            const float *kc, const float *vc, int n, int nh, int nkv, int hd, int B,
                            const int32_t *tok_seq, const int32_t *tok_pos, const int32_t *bt,
                            int max_blocks, float scale, int window, double softcap,
                            const float *sinks) {
    int kv_dim = nkv * hd;
    double *sc = malloc(sizeof(double) * 20000);
    for (int i = 0; i < n; i++)
        for (int h = 0; h < nh; h++) {
            int kvh = h / (nh / nkv), L = tok_pos[i] + 1;
            int p0 = window > 0 && L > window ? L - window : 0; /* (pos - window, pos] */
            const float *qh = q + (int64_t)i * q_stride + h * hd;
            double m = -INFINITY, sum = 0;
            for (int p = p0; p < L; p++) {
                int64_t slot = (int64_t)bt[tok_seq[i] * max_blocks + p / B] * B + p % B;
                const float *k = kc + slot * kv_dim + kvh * hd;
                double s = 0;
                for (int d = 0; d < hd; d++)
                    s += (double)qh[d] * k[d];
                sc[p] = s * scale;
                if (softcap > 0) sc[p] = softcap * tanh(sc[p] / softcap); /* before the softmax */
                if (sc[p] > m) m = sc[p];
            }
            if (sinks && sinks[h] > m) m = sinks[h];
            for (int p = p0; p < L; p++)
                sum += (sc[p] = exp(sc[p] - m));
            if (sinks) sum += exp(sinks[h] - m); /* in the denominator, with no value */
            for (int d = 0; d < hd; d++) {
                double acc = 0;
                for (int p = p0; p < L; p++) {
                    int64_t slot = (int64_t)bt[tok_seq[i] * max_blocks + p / B] * B + p % B;
                    acc += sc[p] / sum * vc[slot * kv_dim + kvh * hd + d];
                }
                out[(int64_t)i * out_stride + h * hd + d] = (float)acc;
            }
        }
    free(sc);
}

/* Attention over a cache in dt: against the double-precision loop on the
 * cache's own float32 values (the kernel's arithmetic; f32 tolerance), and
 * for BF16 / I8 against the loop on the unrounded values with the dtype's
 * tolerance (atol = rtol = 2e-2 for bf16, 4e-2 for int8; inputs in [-1, 1],
 * q in [-2, 2]). */
static int run_attention_case(loom_backend_t *be, const struct attn_case *c, loom_dtype_t dt,
                              unsigned long long *st) {
    const int nh = c->nh, nkv = c->nkv, hd = c->hd, B = c->B, kv_dim = nkv * hd;
    int max_blocks = 0, total_blocks = 0, n = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        int nb = (c->seq_len[s] + B - 1) / B;
        max_blocks = LOOM_MAX(max_blocks, nb);
        total_blocks += nb;
        n += c->new_toks[s];
    }
    const int n_blocks = total_blocks + 3; /* a few blocks nobody owns */
    /* Shuffled block ids: the sequences' blocks are scattered over the pool. */
    int32_t *perm = malloc(sizeof(int32_t) * n_blocks);
    for (int b = 0; b < n_blocks; b++)
        perm[b] = b;
    for (int b = n_blocks - 1; b > 0; b--) {
        *st = *st * 6364136223846793005ull + 1442695040888963407ull;
        int j = (int)((*st >> 33) % (unsigned)(b + 1));
        int32_t tmp = perm[b];
        perm[b] = perm[j];
        perm[j] = tmp;
    }
    int32_t *bt = malloc(sizeof(int32_t) * c->n_seqs * max_blocks);
    for (int i = 0; i < c->n_seqs * max_blocks; i++)
        bt[i] = -1;
    int next = 0;
    for (int s = 0; s < c->n_seqs; s++)
        for (int b = 0; b < (c->seq_len[s] + B - 1) / B; b++)
            bt[s * max_blocks + b] = perm[next++];

    /* A window: the blocks wholly before every query's window point at a
     * spare (NaN) block, as freed blocks would be gone: reading one fails. */
    if (c->window > 0) {
        int first_tok = 0;
        for (int s = 0; s < c->n_seqs; s++) {
            int lo = c->seq_len[s] - c->new_toks[s] + 1 - c->window; /* the first query's first position */
            for (int b = 0; lo > 0 && (b + 1) * B <= lo; b++) bt[s * max_blocks + b] = perm[total_blocks];
            first_tok += c->new_toks[s];
        }
        (void)first_tok;
    }
    /* Unwritten cache slots hold NaN: reading past a sequence's end fails. */
    size_t csz = (size_t)n_blocks * B * kv_dim;
    float *kc = alloc_f(csz), *vc = alloc_f(csz);
    poison(kc, csz);
    poison(vc, csz);
    for (int s = 0; s < c->n_seqs; s++)
        for (int p = 0; p < c->seq_len[s]; p++) {
            if (bt[s * max_blocks + p / B] == perm[total_blocks]) continue; /* before the window: left NaN */
            int64_t slot = (int64_t)bt[s * max_blocks + p / B] * B + p % B;
            fill(kc + slot * kv_dim, kv_dim, st, 1.0f);
            fill(vc + slot * kv_dim, kv_dim, st, 1.0f);
        }
    /* Tokens interleaved across sequences; a prefill chunk is consecutive positions. */
    int32_t *tok_seq = malloc(sizeof(int32_t) * n), *tok_pos = malloc(sizeof(int32_t) * n);
    int i = 0, max_ctx = 0;
    for (int s = c->n_seqs - 1; s >= 0; s--)
        for (int j = 0; j < c->new_toks[s]; j++, i++) {
            tok_seq[i] = s;
            tok_pos[i] = c->seq_len[s] - c->new_toks[s] + j;
            max_ctx = LOOM_MAX(max_ctx, tok_pos[i] + 1);
        }
    const int q_stride = (nh + 2 * nkv) * hd, out_stride = nh * hd + 3;
    float *q = alloc_f((size_t)n * q_stride), *out = alloc_f((size_t)n * out_stride),
          *ref = alloc_f((size_t)n * out_stride);
    fill(q, (size_t)n * q_stride, st, 2.0f);
    poison(out, (size_t)n * out_stride);
    for (size_t e = 0; e < (size_t)n * out_stride; e++)
        ref[e] = out[e] = -3.0f;
    for (int r = 0; r < n; r++) /* the head region must be written */
        poison(out + (int64_t)r * out_stride, (size_t)nh * hd);
    float scale = 1.0f / sqrtf((float)hd);
    test_kv_t qc = test_kv_alloc(dt, (size_t)n_blocks * B, nkv, hd);
    float *kd = alloc_f(csz), *vd = alloc_f(csz), *ref32 = alloc_f((size_t)n * out_stride);
    const size_t es = loom_dtype_size(dt);
    for (size_t h = 0; h < qc.heads; h++) {
        ref_store(dt, (char *)qc.kv.k + h * hd * es, dt == LOOM_DT_I8 ? qc.kv.k_scale + h : NULL,
                  kc + h * hd, hd);
        ref_store(dt, (char *)qc.kv.v + h * hd * es, dt == LOOM_DT_I8 ? qc.kv.v_scale + h : NULL,
                  vc + h * hd, hd);
    }
    for (size_t e = 0; e < csz; e++) {
        kd[e] = kv_value(&qc.kv, 0, e, hd);
        vd[e] = kv_value(&qc.kv, 1, e, hd);
    }
    memcpy(ref32, ref, (size_t)n * out_stride * sizeof(float));
    float *sinks = NULL;
    if (c->sinks) { /* some above every score of their head, some below */
        sinks = alloc_f((size_t)nh);
        fill(sinks, (size_t)nh, st, 3.0f);
    }
    naive_attention(ref, out_stride, q, q_stride, kd, vd, n, nh, nkv, hd, B, tok_seq, tok_pos, bt,
                    max_blocks, scale, c->window, c->softcap, sinks);
    naive_attention(ref32, out_stride, q, q_stride, kc, vc, n, nh, nkv, hd, B, tok_seq, tok_pos, bt,
                    max_blocks, scale, c->window, c->softcap, sinks);
    loom_attn_args_t a = {.n = n,
                          .n_heads = nh,
                          .n_kv_heads = nkv,
                          .head_dim = hd,
                          .scale = scale,
                          .q = q,
                          .q_stride = q_stride,
                          .out = out,
                          .out_stride = out_stride,
                          .kv = qc.kv,
                          .block_size = B,
                          .tok_seq = tok_seq,
                          .tok_pos = tok_pos,
                          .block_tables = bt,
                          .max_blocks = max_blocks,
                          .max_ctx = max_ctx,
                          .window = c->window,
                          .softcap = c->softcap,
                          .sinks = sinks};
    loom_op_attention(be, &a);
    char what[128];
    snprintf(what, sizeof what,
             "attention %s t%d nh%d nkv%d hd%d B%d n%d ctx%d window%d softcap%g sinks%d",
             loom_kv_dtype_name(dt), loom_backend_threads(be), nh, nkv, hd, B, n, max_ctx,
             c->window, (double)c->softcap, c->sinks);
    int ok = test_allclose(what, out, ref, (long)n * out_stride, 1e-5, 1e-4);
    if (dt != LOOM_DT_F32) {
        const double tol = dt == LOOM_DT_BF16 ? 2e-2 : 4e-2;
        strncat(what, " vs f32", sizeof what - strlen(what) - 1);
        ok &= test_allclose(what, out, ref32, (long)n * out_stride, tol, tol);
    }
    if (sinks) { /* without them the weights sum to 1: the outputs must move */
        float *o2 = alloc_f((size_t)n * out_stride);
        memcpy(o2, out, (size_t)n * out_stride * sizeof(float));
        a.sinks = NULL;
        a.out = o2;
        loom_op_attention(be, &a);
        double dmax = 0;
        for (size_t e = 0; e < (size_t)n * out_stride; e++)
            dmax = fmax(dmax, fabs((double)o2[e] - out[e]));
        CHECKF(dmax > 1e-2, "%s: the sinks change the output by only %g", what, dmax);
        free(o2);
    }
    test_kv_free(&qc);
    free(sinks);
    free(kd);
    free(vd);
    free(ref32);
    free(perm);
    free(bt);
    free(kc);
    free(vc);
    free(tok_seq);
    free(tok_pos);
    free(q);
    free(out);
    free(ref);
    return ok;
}

static void test_attention(void) {
    /* group sizes 3 and 7 take passes of 3 and 3 + 2 + 2 heads; hd 24 = 16 + 8 */
    static const int ratios[] = {1, 2, 3, 4, 7}, Bs[] = {1, 3, 16}, hds[] = {8, 13, 24, 64};
    unsigned long long st = 10;
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t di = 0; di < LOOM_ARRAY_LEN(k_kv_dts); di++) {
            const loom_dtype_t dt = k_kv_dts[di];
            for (size_t r = 0; r < LOOM_ARRAY_LEN(ratios); r++)
                for (size_t b = 0; b < LOOM_ARRAY_LEN(Bs); b++)
                    for (size_t h = 0; h < LOOM_ARRAY_LEN(hds); h++) {
                        /* decodes (1 token) mixed with prefill chunks, lengths 1..70 */
                        struct attn_case c = {.nh = 2 * ratios[r],
                                              .nkv = 2,
                                              .hd = hds[h],
                                              .B = Bs[b],
                                              .n_seqs = 4,
                                              .seq_len = {1, 37, 70, 9},
                                              .new_toks = {1, 5, 1, 9}};
                        run_attention_case(be, &c, dt, &st);
                    }
            /* One decode token and one KV head: the head split path. */
            struct attn_case one = {.nh = 4,
                                    .nkv = 1,
                                    .hd = 16,
                                    .B = 16,
                                    .n_seqs = 1,
                                    .seq_len = {50},
                                    .new_toks = {1}};
            run_attention_case(be, &one, dt, &st);
            /* A context longer than the preallocated scratch. */
            struct attn_case lng = {.nh = 4,
                                    .nkv = 1,
                                    .hd = 8,
                                    .B = 16,
                                    .n_seqs = 2,
                                    .seq_len = {9000, 20},
                                    .new_toks = {1, 2}};
            run_attention_case(be, &lng, dt, &st);
            /* Sliding windows: shorter and longer than the contexts, a block multiple and not, with the
             * blocks wholly before the window poisoned (decodes and prefill chunks that straddle it). */
            static const int windows[] = {1, 5, 24, 69}, wBs[] = {3, 16};
            for (size_t w = 0; w < LOOM_ARRAY_LEN(windows); w++)
                for (size_t b = 0; b < LOOM_ARRAY_LEN(wBs); b++) {
                    struct attn_case c = {.nh = 6, .nkv = 2, .hd = 24, .B = wBs[b], .n_seqs = 4,
                                          .seq_len = {1, 37, 70, 30}, .new_toks = {1, 5, 1, 9},
                                          .window = windows[w]};
                    run_attention_case(be, &c, dt, &st);
                }
            /* Soft-capped scores (Gemma 2): the scores here are about N(0, 1), so a cap of 0.3 flattens
             * most of them and 2 only the tails; with windows and without, odd head dims. */
            static const float caps[] = {0.3f, 2.0f};
            static const int cwins[] = {0, 5}, chds[] = {13, 24};
            for (size_t k = 0; k < LOOM_ARRAY_LEN(caps); k++)
                for (size_t w = 0; w < LOOM_ARRAY_LEN(cwins); w++)
                    for (size_t h = 0; h < LOOM_ARRAY_LEN(chds); h++) {
                        struct attn_case c = {.nh = 6, .nkv = 2, .hd = chds[h], .B = 3, .n_seqs = 4,
                                              .seq_len = {1, 37, 70, 30}, .new_toks = {1, 5, 1, 9},
                                              .window = cwins[w], .softcap = caps[k]};
                        run_attention_case(be, &c, dt, &st);
                    }
            /* Attention sinks (GPT-OSS), with GQA groups of 1 and 3, windows and without; a check
             * that they matter: the same case without sinks must differ. */
            static const int swins[] = {0, 4}, sgrp[] = {1, 3};
            for (size_t w = 0; w < LOOM_ARRAY_LEN(swins); w++)
                for (size_t g = 0; g < LOOM_ARRAY_LEN(sgrp); g++) {
                    struct attn_case c = {.nh = 2 * sgrp[g],
                                          .nkv = 2,
                                          .hd = 16,
                                          .B = 3,
                                          .n_seqs = 4,
                                          .seq_len = {1, 37, 70, 30},
                                          .new_toks = {1, 5, 1, 9},
                                          .window = swins[w],
                                          .sinks = 1};
                    run_attention_case(be, &c, dt, &st);
                }
        }
        loom_backend_destroy(&be);
    }
}

/* loom_op_softcap (final logit soft-capping) against tanh in double: odd
 * lengths (the SIMD body and the scalar tail, one row and the threaded
 * rows of 4096), values from tiny to far beyond the cap, and signed zero. */
static void test_softcap(void) {
    static const int ns[] = {1, 7, 8, 29, 3 * 4096 + 13};
    static const float caps[] = {30.0f, 50.0f, 0.5f};
    unsigned long long st = 21;
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        for (size_t ci = 0; ci < LOOM_ARRAY_LEN(caps); ci++)
            for (size_t ni = 0; ni < LOOM_ARRAY_LEN(ns); ni++) {
                const int n = ns[ni];
                const float cap = caps[ci];
                float *x = alloc_f((size_t)n), *ref = alloc_f((size_t)n);
                fill(x, (size_t)n, &st, 4.0f * cap); /* |x| up to 4 caps */
                for (int i = 0; i < n; i += 5) x[i] *= 1e-4f;
                if (n > 3) x[3] = 1e6f, x[2] = -1e6f, x[1] = -0.0f;
                for (int i = 0; i < n; i++) ref[i] = (float)(cap * tanh((double)x[i] / cap));
                loom_op_softcap(be, x, n, cap);
                char what[96];
                snprintf(what, sizeof what, "softcap t%d n%d cap%g", loom_backend_threads(be), n, (double)cap);
                /* |d| <= a few float32 ulps of the cap, and tanh's own relative error */
                test_allclose(what, x, ref, n, 4e-7 * cap, 2e-6);
                for (int i = 0; i < n; i++)
                    CHECKF(fabsf(x[i]) <= cap, "%s: |x[%d]| = %g beyond the cap", what, i, (double)x[i]);
                free(x);
                free(ref);
            }
        loom_backend_destroy(&be);
    }
}

/* --- sampling ---------------------------------------------------------- */

static void test_sample_shard(void) {
    unsigned long long st = 11;
    const int n_rows = 6, vocab = 1000, shard = 333, offset = 333;
    float *logits = alloc_f((size_t)n_rows * shard);
    fill(logits, (size_t)n_rows * shard, &st, 5.0f);
    loom_sampling_t params[6] = {
        {0.0f, 0, 1.0f, 1, 0.0f}, {0.8f, 0, 1.0f, 2, 0.1f}, {1.0f, 40, 1.0f, 3, 0.0f},
        {0.7f, 0, 0.9f, 4, 0.0f}, {1.2f, 5, 0.5f, 5, 0.0f}, {0.0f, 0, 1.0f, 6, 0.0f},
    };
    uint64_t steps[6] = {0, 1, 2, 3, 100, 7};
    int k[6];
    for (int r = 0; r < n_rows; r++)
        k[r] = loom_sample_k(&params[r], vocab);
    for (size_t t = 0; t < LOOM_ARRAY_LEN(k_threads); t++) {
        loom_backend_t *be = make_backend(k_threads[t], LOOM_DT_F32);
        REQUIRE(be);
        loom_sample_part_t parts[6], refs[6];
        int32_t ids[6][LOOM_SAMPLE_MAX_CAND], rids[6][LOOM_SAMPLE_MAX_CAND];
        float keys[6][LOOM_SAMPLE_MAX_CAND], rkeys[6][LOOM_SAMPLE_MAX_CAND];
        for (int r = 0; r < n_rows; r++) {
            parts[r] = (loom_sample_part_t){.ids = ids[r], .keys = keys[r], .n = -1};
            refs[r] = (loom_sample_part_t){.ids = rids[r], .keys = rkeys[r]};
            loom_sample_shard(logits + r * shard, shard, offset, vocab, &params[r], steps[r], k[r],
                              &refs[r]);
        }
        loom_op_sample_shard(be, logits, n_rows, shard, offset, vocab, params, steps, k, parts);
        for (int r = 0; r < n_rows; r++) {
            CHECKF(parts[r].n == refs[r].n && parts[r].max_z == refs[r].max_z &&
                       parts[r].sum_exp == refs[r].sum_exp,
                   "row %d", r);
            for (int j = 0; j < refs[r].n && j < parts[r].n; j++)
                CHECKF(ids[r][j] == rids[r][j] && keys[r][j] == rkeys[r][j], "row %d cand %d", r,
                       j);
        }
        loom_backend_destroy(&be);
    }
    free(logits);
}

int main(void) {
    RUN(test_threadpool);
    RUN(test_backend_basics);
    RUN(test_weight_slabs);
    RUN(test_gemv_kernel);
    RUN(test_matmul);
    RUN(test_rmsnorm);
    RUN(test_add);
    RUN(test_add_bias);
    RUN(test_matmul_bias);
    RUN(test_silu_mul);
    RUN(test_embed_gather);
    RUN(test_moe_combine);
    RUN(test_moe_route_gemv);
    RUN(test_rope);
    RUN(test_kv_dtypes);
    RUN(test_kv_write);
    RUN(test_kv_block_strided);
    RUN(test_attention);
    RUN(test_kv_v_dim);
    RUN(test_attention_lse);
    RUN(test_attn_merge_gather);
    RUN(test_softcap);
    RUN(test_swiglu_clamp);
    RUN(test_act_mul);
    RUN(test_head_rmsnorm);
    RUN(test_sample_shard);
    return test_summary();
}

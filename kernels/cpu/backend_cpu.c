/* The CPU backend: host memory, weights in f32/bf16/f16, and every op of
 * backend.h on a fork-join thread pool. It is the reference the other
 * backends are compared with, and the fallback when there is no GPU.
 *
 * Matmul: up to loom_cpu_gemv_max_n() rows of x use the hand-written GEMV
 * (gemv.c), parallel over chunks of W's rows; more rows use OpenBLAS sgemm
 * (half-precision weights are widened block by block into a scratch buffer
 * first). Quantized weights (qgemv.c) use their GEMV kernel up to
 * loom_cpu_qgemv_max_n() rows and the integer GEMM above (FP8: dequantized
 * blocks for sgemm). Small
 * element-wise ops run inline on the calling thread, since a
 * dispatch costs more than the work; see docs/kernels-cpu.md for the
 * measurements behind the thresholds. Not thread-safe: one caller at a time. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "kernels/backend_impl.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/gemv.h"
#include "kernels/cpu/lora.h"
#include "kernels/cpu/qgemv.h"
#include "kernels/cpu/threadpool.h"
#include "kernels/cpu/vec.h"

/* Largest n served by the GEMV kernel, by weight dtype. Measured crossovers
 * against OpenBLAS's SkylakeX sgemm (docs/kernels-cpu.md): f32 sgemm wins
 * from n = 16-48 depending on the shape; bf16/f16 pay the widening before
 * sgemm, and sgemm still wins from n = 32-64. */
#ifndef LOOM_CPU_GEMV_MAX_N_F32
#define LOOM_CPU_GEMV_MAX_N_F32 32
#endif
#ifndef LOOM_CPU_GEMV_MAX_N_HALF
#define LOOM_CPU_GEMV_MAX_N_HALF 32
#endif
/* Largest n served by the quantized GEMV kernels (qgemv.c) per scheme;
 * above it INT8 and Q4 use the integer GEMM (loom_cpu_qgemm) and FP8 its
 * dequantized blocks for sgemm. Measured crossovers (bench_kernels --only
 * qcross, docs/kernels-cpu.md, AVX2 and AVX-512 VNNI paths of one Xeon):
 * the integer GEMM beats the Q4 GEMV from n = 8 on both paths and the INT8
 * GEMV from n = 16-32 (AVX2); it beats dequantize + sgemm at every n
 * measured up to 512 but a few noisy INT8 ones. (Those crossovers were
 * measured with the GEMV on a row layout; with the panels stored at upload
 * both paths run the same tiles, so for INT8 and Q4 the limits only name
 * the path, LOOM_CPU_MM_GEMV or _IGEMM.) FP8's GEMV computes in float and
 * loses to sgemm from n = 32. x goes through the kernels
 * QX_ROWS rows at a time, so its int8 copy stays in L1/L2 and the scratch
 * has a fixed size. */
#ifndef LOOM_CPU_QGEMV_MAX_N_INT8
#define LOOM_CPU_QGEMV_MAX_N_INT8 16
#endif
#ifndef LOOM_CPU_QGEMV_MAX_N_Q4
#define LOOM_CPU_QGEMV_MAX_N_Q4 4
#endif
#ifndef LOOM_CPU_QGEMV_MAX_N_FP8
#define LOOM_CPU_QGEMV_MAX_N_FP8 16
#endif
#define QX_ROWS 64
/* Bytes of f32 W rows widened per sgemm block for half-precision weights. */
#ifndef WIDEN_BLOCK_BYTES
#define WIDEN_BLOCK_BYTES (8u << 20)
#endif
/* Attention scores preallocated per thread (e.g. 8 heads x 4096 positions). */
#define ATTN_SCRATCH_INIT_FLOATS (8u * 4096u)
/* Element counts below which an op runs inline rather than on the pool. */
#define PAR_MIN_ELEMS      (1 << 15)
#define GEMV_PAR_MIN_BYTES (1 << 16)

/* Weights are carved out of slabs of at least WSLAB_BYTES, 2 MiB aligned
 * and madvise(MADV_HUGEPAGE)'d, so that weights smaller than a huge page
 * (a quantized layer's matrices, 0.3-3 MB on the ~125M model) are streamed
 * through huge pages too: with 4 KiB pages the quantized decode passes ran
 * 10-25 % slower (docs/kernels-cpu.md). A slab's untouched tail costs
 * address space only. */
#ifndef WSLAB_BYTES
#define WSLAB_BYTES ((size_t)32 << 20)
#endif

typedef struct wslab {
    struct wslab *next;
    uint8_t *base;
    size_t size, used; /* bytes; used grows only */
    int live;          /* weight arrays still allocated from it */
} wslab_t;

typedef struct cpu_backend {
    struct loom_backend base;
    int n_threads;
    loom_threadpool_t *pool;
    float *widen;         /* (widen_cap) f32 block of W rows for sgemm on bf16/f16 */
    size_t widen_cap;     /* floats */
    float **attn_scratch; /* (n_threads) per-thread attention scores */
    size_t attn_cap;      /* floats per thread */
    loom_cpu_isa_t isa;   /* quantized kernels' instruction set (cpuid at create) */
    void *qx;             /* (qx_cap) activations rounded to int8 for the quantized GEMV */
    size_t qx_cap;        /* bytes */
    wslab_t *slabs;       /* weight memory, newest first */
    float *lora_ws;       /* (lora_cap) loom_cpu_lora_sgmv's workspace */
    size_t lora_cap;      /* floats */
} cpu_backend_t;

static cpu_backend_t *cpu(loom_backend_t *be) {
    return (cpu_backend_t *)be;
}

/* Splits [0, total) into chunks for the pool: at least `min_chunk` items,
 * about `per_thread` chunks per thread, multiples of `align`. */
static int64_t chunk_size(const cpu_backend_t *c, int64_t total, int64_t min_chunk, int per_thread,
                          int64_t align) {
    int64_t parts = (int64_t)c->n_threads * per_thread;
    int64_t ch = (total + parts - 1) / parts;
    if (ch < min_chunk) ch = min_chunk;
    ch = (ch + align - 1) / align * align;
    return ch > 0 ? ch : 1;
}

static int n_chunks(int64_t total, int64_t chunk) {
    return (int)((total + chunk - 1) / chunk);
}

/* --- memory ------------------------------------------------------------ */

/* Large buffers (weights, KV caches) are 2 MiB aligned and asked to be backed
 * by transparent huge pages: GEMV and attention stream them, and with 4 KiB
 * pages a KV head's rows (one every nkv*hd*4 bytes) each sit on their own
 * page, so TLB misses would cost more than the loads. */
#ifndef HUGE_MIN_BYTES
#define HUGE_MIN_BYTES ((size_t)4 << 20)
#endif
#define HUGE_ALIGN ((size_t)2 << 20)

static void *host_alloc(size_t bytes) {
    if (bytes < HUGE_MIN_BYTES) return loom_aligned_alloc(bytes);
    void *p = NULL;
    if (posix_memalign(&p, HUGE_ALIGN, bytes) != 0) return NULL;
    madvise(p, bytes, MADV_HUGEPAGE); /* advice only: failure leaves 4 KiB pages */
    return p;
}

/* Both kinds come from posix_memalign. */
static void host_free(void *p) {
    loom_aligned_free(p);
}

/* A 64-byte aligned weight array from the newest slab, or a new slab. An
 * empty array still takes 64 bytes, so every array lies inside its slab. */
static void *weight_alloc(cpu_backend_t *c, size_t bytes) {
    bytes = bytes ? (bytes + 63) & ~(size_t)63 : 64;
    wslab_t *s = c->slabs;
    if (!s || s->size - s->used < bytes) {
        size_t size = LOOM_MAX(WSLAB_BYTES, (bytes + HUGE_ALIGN - 1) / HUGE_ALIGN * HUGE_ALIGN);
        s = malloc(sizeof *s);
        if (!s) return NULL;
        *s = (wslab_t){.next = c->slabs, .base = host_alloc(size), .size = size};
        if (!s->base) {
            free(s);
            return NULL;
        }
        c->slabs = s;
    }
    void *p = s->base + s->used;
    s->used += bytes;
    s->live++;
    return p;
}

/* Releases a weight_alloc array; a slab goes back when its last array does. */
static void weight_release(cpu_backend_t *c, void *p) {
    if (!p) return;
    for (wslab_t **sp = &c->slabs; *sp; sp = &(*sp)->next) {
        wslab_t *s = *sp;
        if ((uint8_t *)p < s->base || (uint8_t *)p >= s->base + s->size) continue;
        LOOM_ASSERT(s->live > 0);
        if (--s->live == 0) {
            *sp = s->next;
            host_free(s->base);
            free(s);
        }
        return;
    }
    LOOM_ASSERT(!"weight array not from a slab");
}

static void *cpu_alloc(loom_backend_t *be, size_t bytes) {
    return host_alloc(bytes);
}
static void cpu_free(loom_backend_t *be, void *p) {
    host_free(p);
}
static void cpu_copy(loom_backend_t *be, void *dst, const void *src, size_t bytes) {
    memmove(dst, src, bytes);
}
static void cpu_memset(loom_backend_t *be, void *dst, int value, size_t bytes) {
    memset(dst, value, bytes);
}

static size_t cpu_mem_free(loom_backend_t *be) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return (size_t)kb * 1024u;
}

/* --- weights ----------------------------------------------------------- */

struct narrow_ctx {
    void *dst;
    loom_dtype_t dt;
    const float *src;
    int64_t n, chunk;
};

static void narrow_task(void *p, int task, int thread) {
    struct narrow_ctx *c = p;
    int64_t a = (int64_t)task * c->chunk, b = LOOM_MIN(a + c->chunk, c->n);
    loom_cpu_narrow((uint16_t *)c->dst + a, c->dt, c->src + a, b - a);
}

static int64_t widen_block_rows(int64_t cols) {
    int64_t r = (int64_t)(WIDEN_BLOCK_BYTES / sizeof(float)) / (cols > 0 ? cols : 1);
    return r < 8 ? 8 : r;
}

/* Grows the scratch that holds a block of W rows widened to f32 for sgemm. */
static loom_status_t reserve_widen(cpu_backend_t *c, int64_t rows, int64_t cols, loom_err_t *err) {
    size_t need = (size_t)LOOM_MIN(widen_block_rows(cols), rows) * (size_t)cols;
    if (need <= c->widen_cap) return LOOM_OK;
    float *nw = host_alloc(need * sizeof *nw);
    if (!nw)
        return loom_err_set(err, LOOM_ERR_NOMEM, "cpu: %zu bytes of widen scratch",
                            need * sizeof *nw);
    host_free(c->widen);
    c->widen = nw;
    c->widen_cap = need;
    return LOOM_OK;
}

static loom_status_t cpu_weight_upload(loom_backend_t *be, loom_weight_t *w, int64_t rows,
                                       int64_t cols, const float *host, loom_err_t *err) {
    cpu_backend_t *c = cpu(be);
    loom_dtype_t dt = be->cfg.weight_dtype;
    *w = (loom_weight_t){.data = NULL, .dtype = dt, .rows = rows, .cols = cols};
    if (rows < 0 || cols < 0 || rows > INT32_MAX || cols > INT32_MAX)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "weight shape (%lld, %lld)",
                            (long long)rows, (long long)cols);
    size_t n = (size_t)rows * (size_t)cols;
    if (dt != LOOM_DT_F32) { /* sgemm needs a widened block of rows: size it now, not per call */
        loom_status_t st = reserve_widen(c, rows, cols, err);
        if (st != LOOM_OK) return st;
    }
    w->data = weight_alloc(c, n * loom_dtype_size(dt));
    if (!w->data)
        return loom_err_set(err, LOOM_ERR_NOMEM, "cpu: out of memory for a %lld x %lld %s weight",
                            (long long)rows, (long long)cols, loom_dtype_name(dt));
    if (dt == LOOM_DT_F32) {
        memcpy(w->data, host, n * sizeof(float));
    } else {
        struct narrow_ctx nc = {w->data, dt, host, (int64_t)n, 0};
        nc.chunk = chunk_size(c, nc.n, 1 << 16, 4, 64);
        loom_parallel_for(c->pool, n_chunks(nc.n, nc.chunk), narrow_task, &nc);
    }
    return LOOM_OK;
}

/* Grows the scratch for n rows of x rounded to int8 (qgemv.h). */
static loom_status_t reserve_qx(cpu_backend_t *c, int n, int64_t cols, loom_err_t *err) {
    size_t need = loom_cpu_qx_bytes(n, cols);
    if (need <= c->qx_cap) return LOOM_OK;
    void *p = host_alloc(need);
    if (!p) return loom_err_set(err, LOOM_ERR_NOMEM, "cpu: %zu bytes of activation scratch", need);
    host_free(c->qx);
    c->qx = p;
    c->qx_cap = need;
    return LOOM_OK;
}

struct repack_ctx {
    loom_weight_t *w;
    const loom_qtensor_t *t;
    int64_t chunk;
};

static void repack_task(void *p, int task, int thread) {
    struct repack_ctx *c = p;
    int64_t a = (int64_t)task * c->chunk, b = LOOM_MIN(a + c->chunk, c->t->rows);
    loom_cpu_q_repack(c->w, c->t, a, b);
}

/* Quantized weights: codes, scales and mins repacked once for the kernels
 * (the 8-row panels of qgemv.h that decode and prefill both stream). The
 * scratch both matmul paths need is sized here, never per call. */
static loom_status_t cpu_weight_upload_quant(loom_backend_t *be, loom_weight_t *w,
                                             const loom_qtensor_t *t, loom_err_t *err) {
    cpu_backend_t *c = cpu(be);
    loom_status_t st = reserve_widen(c, t->rows, t->cols, err);
    if (st == LOOM_OK) st = reserve_qx(c, QX_ROWS, t->cols, err);
    if (st != LOOM_OK) return st;
    size_t codes = loom_qtensor_code_bytes(t), ns = loom_qtensor_scale_count(t) * sizeof(float);
    *w = (loom_weight_t){.dtype = t->quant == LOOM_QUANT_INT8 ? LOOM_DT_I8 : LOOM_DT_U8,
                         .rows = t->rows, .cols = t->cols, .quant = t->quant, .group = t->group};
    w->data = weight_alloc(c, codes);
    w->scales = w->data ? weight_alloc(c, ns) : NULL;
    if (t->mins && w->scales) w->mins = weight_alloc(c, ns);
    if (!w->data || !w->scales || (t->mins && !w->mins)) {
        weight_release(c, w->data);
        weight_release(c, w->scales);
        weight_release(c, w->mins);
        *w = (loom_weight_t){0};
        return loom_err_set(err, LOOM_ERR_NOMEM, "cpu: out of memory for a %lld x %lld weight",
                            (long long)t->rows, (long long)t->cols);
    }
    struct repack_ctx rc = {w, t, 0};
    rc.chunk = chunk_size(c, t->rows, 64, 4, 8);
    loom_parallel_for(c->pool, n_chunks(t->rows, rc.chunk), repack_task, &rc);
    return LOOM_OK;
}

static void cpu_weight_free(loom_backend_t *be, loom_weight_t *w) {
    weight_release(cpu(be), w->data);
    weight_release(cpu(be), w->scales);
    weight_release(cpu(be), w->mins);
    w->data = w->scales = w->mins = NULL;
}

/* --- matmul ------------------------------------------------------------ */

struct gemv_ctx {
    float *y;
    const float *x;
    int n;
    const loom_weight_t *w;
    int64_t chunk;
};

static void gemv_task(void *p, int task, int thread) {
    struct gemv_ctx *c = p;
    int64_t r0 = (int64_t)task * c->chunk, r1 = LOOM_MIN(r0 + c->chunk, c->w->rows);
    loom_cpu_gemv(c->y, c->w->rows, c->x, c->n, c->w->data, c->w->dtype, c->w->cols, r0, r1);
}

struct widen_ctx {
    float *dst;
    const loom_weight_t *w;
    int64_t r0, r1, chunk;
    loom_cpu_isa_t isa;
};

struct qgemv_ctx {
    float *y;
    loom_cpu_qx_t qx;
    const loom_weight_t *w;
    int64_t chunk;
    loom_cpu_isa_t isa;
    int gemm; /* loom_cpu_qgemm (8-row panels) rather than loom_cpu_qgemv */
};

static void qx_task(void *p, int task, int thread) {
    struct qgemv_ctx *c = p;
    loom_cpu_qx_quantize(&c->qx, task, task + 1);
}

static void qgemv_task(void *p, int task, int thread) {
    struct qgemv_ctx *c = p;
    int64_t r0 = (int64_t)task * c->chunk, r1 = LOOM_MIN(r0 + c->chunk, c->w->rows);
    (c->gemm ? loom_cpu_qgemm : loom_cpu_qgemv)(c->isa, c->y, c->w->rows, &c->qx, c->w, r0, r1);
}

/* The quantized GEMV on up to QX_ROWS rows of x: x rounded to int8 (one
 * task per row when there is enough of it), then chunks of W's rows in
 * parallel. */
static void quant_gemv_rows(cpu_backend_t *c, float *y, const float *x, const loom_weight_t *w,
                            int n, int gemm) {
    struct qgemv_ctx g = {.y = y, .w = w, .chunk = w->rows, .isa = c->isa, .gemm = gemm};
    loom_cpu_qx_init(&g.qx, c->qx, x, n, w);
    if (w->quant != LOOM_QUANT_FP8) {
        if ((int64_t)n * w->cols >= PAR_MIN_ELEMS && n > 1 && c->n_threads > 1)
            loom_parallel_for(c->pool, n, qx_task, &g);
        else
            loom_cpu_qx_quantize(&g.qx, 0, n);
    }
    if (loom_weight_bytes(w) >= GEMV_PAR_MIN_BYTES && c->n_threads > 1)
        g.chunk = chunk_size(c, w->rows, 16, 8, 8); /* whole stored panels */
    loom_parallel_for(c->pool, n_chunks(w->rows, g.chunk), qgemv_task, &g);
}

static void quant_gemv(cpu_backend_t *c, float *y, const float *x, const loom_weight_t *w, int n,
                       int gemm) {
    LOOM_ASSERT(c->qx_cap >= loom_cpu_qx_bytes(LOOM_MIN(n, QX_ROWS), w->cols));
    for (int i = 0; i < n; i += QX_ROWS)
        quant_gemv_rows(c, y + (int64_t)i * w->rows, x + (int64_t)i * w->cols, w,
                        LOOM_MIN(QX_ROWS, n - i), gemm);
}

static void widen_task(void *p, int task, int thread) {
    struct widen_ctx *c = p;
    int64_t a = c->r0 + (int64_t)task * c->chunk, b = LOOM_MIN(a + c->chunk, c->r1);
    if (c->w->quant != LOOM_QUANT_NONE) {
        loom_cpu_q_dequant_rows(c->isa, c->dst + (a - c->r0) * c->w->cols, c->w, a, b);
        return;
    }
    loom_cpu_widen_rows(c->dst + (a - c->r0) * c->w->cols, c->w->data, c->w->dtype, c->w->cols, a,
                        b);
}

int loom_cpu_qgemv_max_n(loom_quant_t q) {
    switch (q) {
    case LOOM_QUANT_INT8: return LOOM_CPU_QGEMV_MAX_N_INT8;
    case LOOM_QUANT_Q4: return LOOM_CPU_QGEMV_MAX_N_Q4;
    default: return LOOM_CPU_QGEMV_MAX_N_FP8;
    }
}

int loom_cpu_gemv_max_n(loom_dtype_t dt) {
    return dt == LOOM_DT_F32 ? LOOM_CPU_GEMV_MAX_N_F32 : LOOM_CPU_GEMV_MAX_N_HALF;
}

void loom_cpu_matmul_path(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w,
                          int n, loom_cpu_mm_path_t path) {
    cpu_backend_t *c = cpu(be);
    const int64_t rows = w->rows, cols = w->cols;
    if (rows == 0 || n <= 0) return;
    if (w->quant != LOOM_QUANT_NONE) {
        const int igemm = c->isa != LOOM_CPU_ISA_SCALAR && w->quant != LOOM_QUANT_FP8;
        if (path == LOOM_CPU_MM_AUTO)
            path = n <= loom_cpu_qgemv_max_n(w->quant) ? LOOM_CPU_MM_GEMV
                   : igemm                             ? LOOM_CPU_MM_IGEMM
                                                       : LOOM_CPU_MM_SGEMM;
        if (path == LOOM_CPU_MM_GEMV || path == LOOM_CPU_MM_IGEMM) {
            quant_gemv(c, y, x, w, n, path == LOOM_CPU_MM_IGEMM);
            return;
        }
    } else if (path == LOOM_CPU_MM_AUTO)
        path = n <= loom_cpu_gemv_max_n(w->dtype) ? LOOM_CPU_MM_GEMV : LOOM_CPU_MM_SGEMM;
    if (path == LOOM_CPU_MM_GEMV || cols == 0) {
        struct gemv_ctx g = {y, x, n, w, rows};
        size_t bytes = (size_t)rows * (size_t)cols * loom_dtype_size(w->dtype);
        if (bytes >= GEMV_PAR_MIN_BYTES && c->n_threads > 1)
            g.chunk = chunk_size(c, rows, 24, 8, 12); /* whole 3- and 4-row tiles */
        loom_parallel_for(c->pool, n_chunks(rows, g.chunk), gemv_task, &g);
        return;
    }
    if (w->quant == LOOM_QUANT_NONE && w->dtype == LOOM_DT_F32) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, (int)rows, (int)cols, 1.0f, x,
                    (int)cols, w->data, (int)cols, 0.0f, y, (int)rows);
        return;
    }
    const int64_t block = LOOM_MIN(widen_block_rows(cols), rows);
    LOOM_ASSERT((size_t)(block * cols) <= c->widen_cap);
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        struct widen_ctx wc = {c->widen, w, r0, LOOM_MIN(r0 + block, rows), 0, c->isa};
        wc.chunk = chunk_size(c, wc.r1 - wc.r0, 4, 1, 1);
        loom_parallel_for(c->pool, n_chunks(wc.r1 - wc.r0, wc.chunk), widen_task, &wc);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, (int)(wc.r1 - r0), (int)cols, 1.0f,
                    x, (int)cols, c->widen, (int)cols, 0.0f, y + r0, (int)rows);
    }
}

static void cpu_matmul(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w,
                       int n) {
    loom_cpu_matmul_path(be, y, x, w, n, LOOM_CPU_MM_AUTO);
}

/* --- element-wise ops -------------------------------------------------- */

/* Row-parallel ops share one context: task t covers rows [t*chunk, ...). */
struct rows_ctx {
    float *y;
    const float *x, *g;
    const int32_t *idx;
    int n, dim, stride, n_heads;
    float eps;
    int64_t chunk;
};

static void run_rows(cpu_backend_t *c, struct rows_ctx *rc, int64_t row_elems, loom_task_fn fn) {
    int64_t total = (int64_t)rc->n * row_elems;
    if (total < PAR_MIN_ELEMS || c->n_threads == 1 || rc->n == 1) {
        rc->chunk = rc->n;
        fn(rc, 0, 0);
        return;
    }
    int64_t min_rows = LOOM_MAX((int64_t)1, (PAR_MIN_ELEMS / 4) / LOOM_MAX(row_elems, (int64_t)1));
    rc->chunk = chunk_size(c, rc->n, min_rows, 2, 1);
    loom_parallel_for(c->pool, n_chunks(rc->n, rc->chunk), fn, rc);
}

#define ROW_RANGE(rc, task, i0, i1)                                                                \
    const int i0 = (int)((int64_t)(task) * (rc)->chunk);                                           \
    const int i1 = (int)LOOM_MIN((int64_t)i0 + (rc)->chunk, (int64_t)(rc)->n)

static void rmsnorm_task(void *p, int task, int thread) {
    struct rows_ctx *rc = p;
    ROW_RANGE(rc, task, i0, i1);
    for (int i = i0; i < i1; i++)
        loom_vec_rmsnorm(rc->y + (int64_t)i * rc->dim, rc->x + (int64_t)i * rc->dim, rc->g, rc->dim,
                         rc->eps);
}

static void cpu_rmsnorm(loom_backend_t *be, float *y, const float *x, const float *g, int n,
                        int dim, float eps) {
    struct rows_ctx rc = {.y = y, .x = x, .g = g, .n = n, .dim = dim, .eps = eps};
    run_rows(cpu(be), &rc, dim, rmsnorm_task);
}

static void add_task(void *p, int task, int thread) {
    struct rows_ctx *rc = p;
    ROW_RANGE(rc, task, i0, i1);
    loom_vec_add(rc->y + (int64_t)i0 * rc->dim, rc->x + (int64_t)i0 * rc->dim,
                 (int64_t)(i1 - i0) * rc->dim);
}

static void cpu_add(loom_backend_t *be, float *y, const float *a, int64_t n) {
    /* Cut into rows of 4096 (the partial tail runs inline) so row indices fit an int. */
    const int dim = 4096;
    int64_t full = n / dim;
    struct rows_ctx rc = {.y = y, .x = a, .n = (int)full, .dim = dim};
    if (full > 0) run_rows(cpu(be), &rc, dim, add_task);
    loom_vec_add(y + full * dim, a + full * dim, n - full * dim);
}

static void softcap_task(void *p, int task, int thread) {
    struct rows_ctx *rc = p;
    ROW_RANGE(rc, task, i0, i1);
    for (int i = i0; i < i1; i++) loom_vec_softcap(rc->y + (int64_t)i * rc->dim, rc->dim, rc->eps);
}

static void cpu_softcap(loom_backend_t *be, float *x, int64_t n, float cap) {
    const int dim = 4096; /* rows as cpu_add cuts them */
    int64_t full = n / dim;
    struct rows_ctx rc = {.y = x, .n = (int)full, .dim = dim, .eps = cap}; /* eps carries the cap */
    if (full > 0) run_rows(cpu(be), &rc, 8 * (int64_t)dim, softcap_task);
    loom_vec_softcap(x + full * dim, (int)(n - full * dim), cap);
}

static void add_bias_task(void *p, int task, int thread) {
    struct rows_ctx *rc = p;
    ROW_RANGE(rc, task, i0, i1);
    for (int i = i0; i < i1; i++) loom_vec_add(rc->y + (int64_t)i * rc->dim, rc->x, rc->dim);
}

static void cpu_add_bias(loom_backend_t *be, float *y, const float *bias, int n, int cols) {
    struct rows_ctx rc = {.y = y, .x = bias, .n = n, .dim = cols};
    run_rows(cpu(be), &rc, cols, add_bias_task);
}

static void silu_task(void *p, int task, int thread) {
    struct rows_ctx *rc = p;
    ROW_RANGE(rc, task, i0, i1);
    for (int i = i0; i < i1; i++) {
        const float *gu = rc->x + (int64_t)i * 2 * rc->dim;
        loom_vec_silu_mul(rc->y + (int64_t)i * rc->dim, gu, gu + rc->dim, rc->dim);
    }
}

static void cpu_silu_mul(loom_backend_t *be, float *out, const float *gu, int n, int hidden) {
    struct rows_ctx rc = {.y = out, .x = gu, .n = n, .dim = hidden};
    run_rows(cpu(be), &rc, 3 * (int64_t)hidden, silu_task);
}

struct act_ctx {
    struct rows_ctx rc;
    loom_act_t act;
};

static void act_task(void *p, int task, int thread) {
    struct act_ctx *ac = p;
    struct rows_ctx *rc = &ac->rc;
    ROW_RANGE(rc, task, i0, i1);
    for (int i = i0; i < i1; i++) {
        const float *gu = rc->x + (int64_t)i * 2 * rc->dim;
        loom_vec_act_mul(ac->act, rc->y + (int64_t)i * rc->dim, gu, gu + rc->dim, rc->dim);
    }
}

static void cpu_act_mul(loom_backend_t *be, loom_act_t act, float *out, const float *gu, int n, int hidden) {
    struct act_ctx ac = {.rc = {.y = out, .x = gu, .n = n, .dim = hidden}, .act = act};
    run_rows(cpu(be), &ac.rc, 8 * (int64_t)hidden, act_task); /* &ac.rc == &ac */
}

struct swiglu_ctx {
    struct rows_ctx rc;
    float alpha, limit;
};

static void swiglu_clamp_task(void *p, int task, int thread) {
    struct swiglu_ctx *sc = p;
    struct rows_ctx *rc = &sc->rc;
    ROW_RANGE(rc, task, i0, i1);
    for (int i = i0; i < i1; i++) {
        const float *g = rc->x + (int64_t)i * 2 * rc->dim, *u = g + rc->dim;
        float *y = rc->y + (int64_t)i * rc->dim;
        for (int j = 0; j < rc->dim; j++) {
            float gj = g[j] < sc->limit ? g[j] : sc->limit; /* min(gate, limit); NaN stays NaN */
            float uj = u[j] < -sc->limit ? -sc->limit : u[j] > sc->limit ? sc->limit : u[j];
            y[j] = (uj + 1.0f) * (gj / (1.0f + expf(-sc->alpha * gj)));
        }
    }
}

static void cpu_swiglu_clamp(loom_backend_t *be, float *out, const float *gu, int n, int hidden,
                             float alpha, float limit) {
    struct swiglu_ctx sc = {
        .rc = {.y = out, .x = gu, .n = n, .dim = hidden}, .alpha = alpha, .limit = limit};
    run_rows(cpu(be), &sc.rc, 8 * (int64_t)hidden, swiglu_clamp_task); /* &sc.rc == &sc */
}

static void gather_task(void *p, int task, int thread) {
    struct rows_ctx *rc = p;
    ROW_RANGE(rc, task, i0, i1);
    for (int i = i0; i < i1; i++)
        memcpy(rc->y + (int64_t)i * rc->dim, rc->x + (int64_t)rc->idx[i] * rc->dim,
               (size_t)rc->dim * sizeof(float));
}

static void cpu_embed(loom_backend_t *be, float *x, const float *table, const int32_t *ids, int n,
                      int dim) {
    struct rows_ctx rc = {.y = x, .x = table, .idx = ids, .n = n, .dim = dim};
    run_rows(cpu(be), &rc, dim, gather_task);
}

static void cpu_gather_rows(loom_backend_t *be, float *dst, const float *src, const int32_t *rows,
                            int n, int dim) {
    struct rows_ctx rc = {.y = dst, .x = src, .idx = rows, .n = n, .dim = dim};
    run_rows(cpu(be), &rc, dim, gather_task);
}

struct combine_ctx {
    struct rows_ctx rc; /* y = out, x = the pair rows, idx = pos, n tokens of dim */
    const float *w;
    int k, accumulate;
};

static void combine_task(void *p, int task, int thread) {
    (void)thread;
    struct combine_ctx *cc = p;
    struct rows_ctx *rc = &cc->rc;
    ROW_RANGE(rc, task, i0, i1);
    const int64_t dim = rc->dim;
    for (int t = i0; t < i1; t++) {
        float *o = rc->y + (int64_t)t * dim;
        if (!cc->accumulate) memset(o, 0, (size_t)dim * sizeof(float));
        for (int j = 0; j < cc->k; j++) {
            int64_t at = (int64_t)t * cc->k + j;
            if (rc->idx[at] < 0) continue;
            const float *y = rc->x + (int64_t)rc->idx[at] * dim, w = cc->w[at];
            for (int64_t d = 0; d < dim; d++)
                o[d] += w * y[d];
        }
    }
}

static void cpu_moe_combine(loom_backend_t *be, float *out, const float *y, const int32_t *pos,
                            const float *w, int n, int k, int dim, int accumulate) {
    struct combine_ctx cc = {.rc = {.y = out, .x = y, .idx = pos, .n = n, .dim = dim},
                             .w = w,
                             .k = k,
                             .accumulate = accumulate};
    run_rows(cpu(be), &cc.rc, (int64_t)k * dim, combine_task);
}

/* Decode steps of one token run a MoE block here without the grouping:
 * its k pairs read the same k experts a group would. The table is the
 * experts' weights themselves (any scheme the matmul reads). */
static int cpu_moe_device(loom_backend_t *be, const loom_weight_t *experts, int n_experts, int k) {
    (void)be, (void)experts;
    return k >= 1 && k <= n_experts ? 1 : 0;
}

static void *cpu_moe_table(loom_backend_t *be, const loom_weight_t *experts, int n_experts) {
    const loom_weight_t **t = cpu_alloc(be, (size_t)n_experts * sizeof *t);
    if (!t) return NULL;
    for (int e = 0; e < n_experts; e++)
        t[e] = experts[e].data ? &experts[e] : NULL;
    return t;
}

static void cpu_moe_route(loom_backend_t *be, const float *logits, int n, int n_experts, int k,
                          int norm, int32_t *sel, float *w) {
    (void)be;
    float *probs = loom_xmalloc((size_t)n_experts * sizeof *probs);
    for (int t = 0; t < n; t++)
        loom_moe_route_row(logits + (int64_t)t * n_experts, n_experts, k, norm, probs,
                           sel + (int64_t)t * k, w + (int64_t)t * k);
    free(probs);
}

static void cpu_moe_gemv(loom_backend_t *be, float *y, const float *x, int xdiv, const int32_t *sel,
                         int n_pairs, const void *table, loom_dtype_t dtype, int64_t rows,
                         int64_t cols) {
    (void)dtype;
    const loom_weight_t *const *t = table;
    for (int p = 0; p < n_pairs; p++) {
        float *yp = y + (int64_t)p * rows;
        if (t[sel[p]])
            cpu_matmul(be, yp, x + (int64_t)(p / xdiv) * cols, t[sel[p]], 1);
        else
            memset(yp, 0, (size_t)rows * sizeof *yp);
    }
}

static void rope_task(void *p, int task, int thread) {
    struct rows_ctx *rc = p;
    ROW_RANGE(rc, task, i0, i1);
    for (int i = i0; i < i1; i++)
        loom_vec_rope(rc->y + (int64_t)i * rc->stride, rc->n_heads, rc->dim, rc->idx[i], rc->g);
}

static void cpu_rope(loom_backend_t *be, float *x, int stride, int n, int n_heads, int hd,
                     const int32_t *pos, const float *inv_freq) {
    struct rows_ctx rc = {
        .y = x, .g = inv_freq, .idx = pos, .n = n, .dim = hd, .stride = stride, .n_heads = n_heads};
    /* sincos in double costs about as much as 16 rotated elements. */
    run_rows(cpu(be), &rc, (int64_t)n_heads * hd + 8 * hd, rope_task);
}

struct kv_ctx {
    const loom_kv_layer_t *kv;
    const float *k, *v;
    int stride, nkv, hd;
    const int32_t *slots;
};

/* One token's K and V rows into its slot, narrowed to the cache's dtype. */
static void kv_write_row(const loom_kv_layer_t *kv, void *cache, float *scales, const float *x,
                         int64_t slot, int nkv, int hd) {
    const int64_t kv_dim = (int64_t)nkv * hd, e = loom_kv_row(kv, slot, kv_dim);
    switch (kv->dtype) {
    case LOOM_DT_F32: memcpy((float *)cache + e, x, (size_t)kv_dim * sizeof(float)); break;
    case LOOM_DT_BF16: loom_vec_f32_to_bf16((uint16_t *)cache + e, x, (int)kv_dim); break;
    case LOOM_DT_I8:
        for (int h = 0; h < nkv; h++)
            scales[loom_kv_scale_row(kv, slot, nkv) + h] =
                loom_vec_f32_to_i8((int8_t *)cache + e + (int64_t)h * hd, x + (int64_t)h * hd, hd);
        break;
    default: LOOM_ASSERT(!"KV dtype the CPU backend does not support");
    }
}

static void kv_write_task(void *p, int i, int thread) {
    struct kv_ctx *c = p;
    int64_t s = c->slots[i];
    if (s < 0) return; /* padding token */
    kv_write_row(c->kv, c->kv->k, c->kv->k_scale, c->k + (int64_t)i * c->stride, s, c->nkv, c->hd);
    kv_write_row(c->kv, c->kv->v, c->kv->v_scale, c->v + (int64_t)i * c->stride, s, c->nkv,
                 c->kv->v_dim ? c->kv->v_dim : c->hd);
}

static int cpu_kv_supported(const loom_backend_t *be, loom_dtype_t dtype) {
    (void)be;
    return dtype == LOOM_DT_F32 || dtype == LOOM_DT_BF16 || dtype == LOOM_DT_I8;
}

static void cpu_kv_write(loom_backend_t *be, const loom_kv_layer_t *kv, const float *k, const float *v,
                         int stride, const int32_t *slots, int n, int nkv, int hd) {
    LOOM_ASSERT(cpu_kv_supported(be, kv->dtype));
    LOOM_ASSERT(kv->dtype != LOOM_DT_I8 || (kv->k_scale && kv->v_scale));
    struct kv_ctx kc = {kv, k, v, stride, nkv, hd, slots};
    if ((int64_t)n * nkv * hd >= PAR_MIN_ELEMS)
        loom_parallel_for(cpu(be)->pool, n, kv_write_task, &kc);
    else
        for (int i = 0; i < n; i++)
            kv_write_task(&kc, i, 0);
}

/* --- OpenBLAS kernels ------------------------------------------------- */

/* The family OpenBLAS should use on this CPU, if it has a better one than
 * the fallbacks below. */
static const char *blas_family(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
        return "SkylakeX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
    return NULL;
}

void loom_cpu_blas_check(char **argv) {
    static const char *const fallbacks[] = {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem",
                                            "Katmai", "Coppermine", "Northwood", "Banias", "Atom"};
    if (getenv("OPENBLAS_CORETYPE")) return;
    const char *core = openblas_get_corename(), *family = blas_family();
    if (!core || !family) return;
    int fallback = 0;
    for (size_t i = 0; i < LOOM_ARRAY_LEN(fallbacks); i++)
        fallback |= !strcasecmp(core, fallbacks[i]);
    if (!fallback) return;
    if (setenv("OPENBLAS_CORETYPE", family, 1) || setenv("LOOM_OPENBLAS_REPLACED", core, 1)) return;
    execv("/proc/self/exe", argv);
    unsetenv("OPENBLAS_CORETYPE"); /* exec failed: carry on with the slow kernels */
    unsetenv("LOOM_OPENBLAS_REPLACED");
}

const char *loom_cpu_blas_core(const char **replaced) {
    if (replaced) *replaced = getenv("LOOM_OPENBLAS_REPLACED");
    return openblas_get_corename();
}

/* --- attention --------------------------------------------------------- */

struct attn_ctx {
    const loom_attn_args_t *a;
    int hpt;
    float **scratch;
};

static void attn_task(void *p, int task, int thread) {
    struct attn_ctx *c = p;
    loom_cpu_attention_task(c->a, c->hpt, task, c->scratch[thread]);
}

static void cpu_attention(loom_backend_t *be, const loom_attn_args_t *a) {
    cpu_backend_t *c = cpu(be);
    LOOM_ASSERT(a->n_kv_heads > 0 && a->n_heads % a->n_kv_heads == 0 && a->block_size > 0);
    int hpt = loom_cpu_attention_heads_per_task(a, c->n_threads);
    size_t need = loom_cpu_attention_scratch_floats(a, a->n_heads / a->n_kv_heads);
    if (need > c->attn_cap) { /* grows with the longest context seen, never per call */
        size_t cap = LOOM_MAX(need, c->attn_cap * 2);
        for (int t = 0; t < c->n_threads; t++) {
            loom_aligned_free(c->attn_scratch[t]);
            c->attn_scratch[t] = loom_aligned_alloc(cap * sizeof(float));
            if (!c->attn_scratch[t]) {
                fprintf(stderr, "loom cpu: out of memory for %zu bytes of attention scratch\n",
                        cap * sizeof(float));
                abort();
            }
        }
        c->attn_cap = cap;
    }
    struct attn_ctx ac = {a, hpt, c->attn_scratch};
    loom_parallel_for(c->pool, a->n * (a->n_heads / hpt), attn_task, &ac);
}

/* Two attention outputs over disjoint keys, merged by their log-sum-exp (backend.h). */
static void cpu_attn_merge(loom_backend_t *be, float *out, float *lse_run, const float *o, const float *lse, int n,
                           int nh, int vd) {
    (void)be;
    for (int64_t r = 0; r < (int64_t)n * nh; r++) {
        const float la = lse_run[r], lb = lse[r], mx = LOOM_MAX(la, lb);
        const float wa = expf(la - mx), wb = expf(lb - mx), inv = 1.0f / (wa + wb);
        float *oa = out + r * vd;
        const float *ob = o + r * vd;
        for (int k = 0; k < vd; k++) oa[k] = (oa[k] * wa + ob[k] * wb) * inv;
        lse_run[r] = mx + logf(wa + wb);
    }
}

/* K rows of positions [p0, p0 + cn) as float32 (backend.h). */
static void cpu_kv_gather(loom_backend_t *be, const loom_kv_layer_t *kv, const int32_t *bt, int p0, int cn, int nkv,
                          int hd, float *rows) {
    (void)be;
    const int B = kv->block_size;
    const int64_t w = (int64_t)nkv * hd;
    LOOM_ASSERT(B > 0 && cpu_kv_supported(be, kv->dtype) && (kv->dtype != LOOM_DT_I8 || kv->k_scale));
    for (int p = p0; p < p0 + cn; p++) {
        LOOM_ASSERT(bt[p / B] >= 0);
        const int64_t slot = (int64_t)bt[p / B] * B + p % B, e = loom_kv_row(kv, slot, w);
        float *dst = rows + (int64_t)(p - p0) * w;
        if (kv->dtype == LOOM_DT_F32) {
            memcpy(dst, (const float *)kv->k + e, (size_t)w * sizeof(float));
        } else if (kv->dtype == LOOM_DT_BF16) {
            const uint16_t *src = (const uint16_t *)kv->k + e;
            for (int64_t j = 0; j < w; j++) {
                const uint32_t u = (uint32_t)src[j] << 16;
                memcpy(&dst[j], &u, sizeof u);
            }
        } else {
            const int8_t *src = (const int8_t *)kv->k + e;
            const float *sc = kv->k_scale + loom_kv_scale_row(kv, slot, nkv);
            for (int64_t j = 0; j < w; j++) dst[j] = (float)src[j] * sc[j / hd];
        }
    }
}

/* --- sampling ---------------------------------------------------------- */

struct sample_ctx {
    const float *logits;
    int vocab_shard, id_offset, vocab_size;
    const loom_sampling_t *params;
    const uint64_t *steps;
    const int *k;
    loom_sample_part_t *parts;
};

static void sample_task(void *p, int r, int thread) {
    struct sample_ctx *c = p;
    loom_sample_shard(c->logits + (int64_t)r * c->vocab_shard, c->vocab_shard, c->id_offset,
                      c->vocab_size, &c->params[r], c->steps[r], c->k[r], &c->parts[r]);
}

static void cpu_sample_shard(loom_backend_t *be, const float *logits, int n_rows, int vocab_shard,
                             int id_offset, int vocab_size, const loom_sampling_t *params,
                             const uint64_t *steps, const int *k, loom_sample_part_t *parts) {
    struct sample_ctx sc = {logits, vocab_shard, id_offset, vocab_size, params, steps, k, parts};
    loom_parallel_for(cpu(be)->pool, n_rows, sample_task, &sc);
}

/* LoRA deltas. Prefill-sized batches group the rows by adapter for sgemm
 * (loom_cpu_lora_sgmv); decode-sized ones run on the pool in two passes,
 * so they never wait on OpenBLAS's threads beside the pool's: the shrink
 * t_i = scale A_s x_i over rows, then the expand y_i += t_i Bt_s over
 * column chunks (each chunk of Bt stays in cache across the rows of its
 * adapter). Each output element sums its r terms in order k = 0..r-1,
 * whatever the split. */
#define LORA_SGEMM_ROWS 64
#define LORA_PAR_MIN_MACS (128 * 1024) /* below, one thread: a pool dispatch costs more than the work */

struct lora_ctx {
    float *y;
    const float *x;
    int64_t ldy, ldx, in, out, chunk;
    int n, n_slots, max_r;
    const int32_t *row_slot;
    const loom_lora_op_slot_t *slots;
    float *t; /* (n, max_r) */
};

static const loom_lora_op_slot_t *lora_row(const struct lora_ctx *lc, int i) {
    int s = lc->row_slot[i];
    if (s < 0 || s >= lc->n_slots || lc->slots[s].r <= 0) return NULL;
    return &lc->slots[s];
}

static void lora_shrink_task(void *p, int task, int thread) {
    (void)thread;
    struct lora_ctx *lc = p;
    const loom_lora_op_slot_t *sl = lora_row(lc, task);
    if (!sl) return;
    const float *xi = lc->x + (int64_t)task * lc->ldx;
    float *t = lc->t + (int64_t)task * lc->max_r;
    for (int k = 0; k < sl->r; k++) t[k] = sl->scale * loom_vec_dot(sl->a + (int64_t)k * lc->in, xi, (int)lc->in);
}

static void lora_expand_task(void *p, int task, int thread) {
    (void)thread;
    struct lora_ctx *lc = p;
    int64_t c0 = (int64_t)task * lc->chunk, c1 = LOOM_MIN(c0 + lc->chunk, lc->out);
    for (int i = 0; i < lc->n; i++) {
        const loom_lora_op_slot_t *sl = lora_row(lc, i);
        if (!sl) continue;
        float *yi = lc->y + (int64_t)i * lc->ldy + c0;
        const float *t = lc->t + (int64_t)i * lc->max_r;
        for (int k = 0; k < sl->r; k++) loom_vec_axpy(yi, t[k], sl->bt + (int64_t)k * lc->out + c0, (int)(c1 - c0));
    }
}

static void cpu_lora(loom_backend_t *be, float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in,
                     int64_t out, const int32_t *row_slot, const loom_lora_op_slot_t *slots, int n_slots, int max_r) {
    cpu_backend_t *c = cpu(be);
    size_t need = LOOM_MAX(loom_cpu_lora_workspace(n, in, max_r), (size_t)n * (size_t)max_r);
    if (need > c->lora_cap) {
        free(c->lora_ws);
        c->lora_ws = loom_xmalloc(need * sizeof(float));
        c->lora_cap = need;
    }
    if (n >= LORA_SGEMM_ROWS) {
        loom_cpu_lora_sgmv(y, ldy, x, ldx, n, in, out, row_slot, slots, n_slots, c->lora_ws);
        return;
    }
    struct lora_ctx lc = {.y = y, .x = x, .ldy = ldy, .ldx = ldx, .in = in, .out = out, .n = n,
                          .n_slots = n_slots, .max_r = max_r, .row_slot = row_slot, .slots = slots,
                          .t = c->lora_ws};
    int any = 0;
    for (int i = 0; i < n && !any; i++) any = lora_row(&lc, i) != NULL;
    if (!any) return;
    int serial = c->n_threads == 1 || (int64_t)n * max_r * (in + out) < LORA_PAR_MIN_MACS;
    if (serial || n == 1) {
        for (int i = 0; i < n; i++) lora_shrink_task(&lc, i, 0);
    } else {
        loom_parallel_for(c->pool, n, lora_shrink_task, &lc);
    }
    lc.chunk = chunk_size(c, out, 64, 2, 16);
    int tasks = (int)n_chunks(out, lc.chunk);
    if (serial || tasks == 1) {
        lc.chunk = out;
        lora_expand_task(&lc, 0, 0);
    } else {
        loom_parallel_for(c->pool, tasks, lora_expand_task, &lc);
    }
}

/* --- lifecycle --------------------------------------------------------- */

static void cpu_destroy(loom_backend_t *be) {
    cpu_backend_t *c = cpu(be);
    loom_threadpool_destroy(&c->pool);
    if (c->attn_scratch)
        for (int t = 0; t < c->n_threads; t++)
            loom_aligned_free(c->attn_scratch[t]);
    free(c->attn_scratch);
    host_free(c->widen);
    host_free(c->qx);
    free(c->lora_ws);
    while (c->slabs) { /* weights the caller did not free */
        wslab_t *s = c->slabs;
        c->slabs = s->next;
        host_free(s->base);
        free(s);
    }
    free(c);
}

static const loom_backend_ops_t cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .memset = cpu_memset,
    .copy = cpu_copy,
    .synchronize = NULL,
    .mem_free = cpu_mem_free,
    .stream = NULL,
    .weight_upload = cpu_weight_upload,
    .weight_free = cpu_weight_free,
    .weight_upload_quant = cpu_weight_upload_quant,
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .add = cpu_add,
    .add_bias = cpu_add_bias,
    .silu_mul = cpu_silu_mul,
    .act_mul = cpu_act_mul,
    .swiglu_clamp = cpu_swiglu_clamp,
    .caps = LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ATTN_SOFTCAP | LOOM_CAP_ATTN_SINKS | LOOM_CAP_LOGIT_SOFTCAP |
            LOOM_CAP_ACT | LOOM_CAP_SWIGLU_CLAMP | LOOM_CAP_MOE | LOOM_CAP_KV_BF16 | LOOM_CAP_KV_I8 |
            LOOM_CAP_ATTN_WIDE | LOOM_CAP_ATTN_HUGE,
    .softcap = cpu_softcap,
    .embed = cpu_embed,
    .gather_rows = cpu_gather_rows,
    .moe_combine = cpu_moe_combine,
    .moe_route = cpu_moe_route,
    .moe_gemv = cpu_moe_gemv,
    .moe_device = cpu_moe_device,
    .moe_table = cpu_moe_table,
    .lora = cpu_lora,
    .rope = cpu_rope,
    .kv_supported = cpu_kv_supported,
    .kv_block_strided = 1,
    .kv_v_dim = 1,
    .attn_lse = 1,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .attn_merge = cpu_attn_merge,
    .kv_gather = cpu_kv_gather,
    .sample_shard = cpu_sample_shard,
};

uint32_t loom_backend_cpu_caps(void) { return cpu_ops.caps; }

loom_status_t loom_backend_cpu_create(const loom_backend_config_t *cfg, loom_backend_t **out,
                                      loom_err_t *err) {
    *out = NULL;
    loom_dtype_t dt = cfg->weight_dtype;
    if (dt != LOOM_DT_F32 && dt != LOOM_DT_BF16 && dt != LOOM_DT_F16)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "cpu backend: weight dtype %s (supported: F32, BF16, F16)",
                            loom_dtype_name(dt));
    int n_threads = cfg->n_threads;
    if (n_threads <= 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = online > 0 ? (int)online : 1;
    }
    if (n_threads > 1024)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "cpu backend: %d threads", n_threads);

    cpu_backend_t *c = calloc(1, sizeof *c);
    if (!c) return loom_err_set(err, LOOM_ERR_NOMEM, "cpu backend: out of memory");
    c->base.ops = &cpu_ops;
    c->base.cfg = *cfg;
    c->base.cfg.kind = LOOM_DEVICE_CPU;
    c->base.cfg.n_threads = n_threads;
    snprintf(c->base.name, sizeof c->base.name, "cpu");
    c->n_threads = n_threads;
    c->isa = loom_cpu_isa_select();
    c->attn_scratch = calloc((size_t)n_threads, sizeof *c->attn_scratch);
    if (!c->attn_scratch) goto fail_nomem;
    for (int t = 0; t < n_threads; t++) {
        c->attn_scratch[t] = loom_aligned_alloc(ATTN_SCRATCH_INIT_FLOATS * sizeof(float));
        if (!c->attn_scratch[t]) goto fail_nomem;
    }
    c->attn_cap = ATTN_SCRATCH_INIT_FLOATS;
    c->pool = loom_threadpool_create(n_threads);
    if (!c->pool) {
        cpu_destroy(&c->base);
        return loom_err_set(err, LOOM_ERR_INTERNAL, "cpu backend: cannot start %d threads",
                            n_threads);
    }
    openblas_set_num_threads(n_threads);
    const char *replaced, *core = loom_cpu_blas_core(&replaced);
    if (replaced)
        loom_log(LOOM_LOG_INFO, "cpu backend: %d threads; OpenBLAS core %s (OpenBLAS picked %s for this "
                 "CPU: OPENBLAS_CORETYPE set)", n_threads, core, replaced);
    else
        loom_log(LOOM_LOG_DEBUG, "cpu backend: %d threads; OpenBLAS core %s", n_threads, core);
    *out = &c->base;
    return LOOM_OK;

fail_nomem:
    cpu_destroy(&c->base);
    return loom_err_set(err, LOOM_ERR_NOMEM, "cpu backend: out of memory");
}

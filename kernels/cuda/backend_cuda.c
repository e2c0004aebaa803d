/* The CUDA backend: device memory, weights in bf16/f16 (or f32 when asked
 * for exactness), and every op of backend.h on one stream, plus CUDA graphs
 * for steps that repeat. The kernels live in the .cu files (kernels.h);
 * this file owns the state, cuBLAS, memory and graphs.
 *
 * Matmul: up to LOOM_CUDA_GEMV_MAX_N rows of x use the GEMV kernel (reads
 * f32 x directly); more rows use cuBLAS (bf16/f16 A and B, f32 C, f32
 * compute) on x narrowed on the device. RMSNorm and SiLU*mul write that
 * narrowed copy themselves when their output is a GEMM input ("shadow"):
 * the next matmul of exactly that buffer uses it instead of converting
 * again. The shadow is forgotten by every other op, so it can only be stale
 * if something outside the backend (the comm) writes the buffer between the
 * producer and the matmul, which the forward pass never does.
 *
 * Errors: allocation failures are returned (alloc gives NULL,
 * weight_upload LOOM_ERR_NOMEM); a failing CUDA call inside an op (which
 * has no way to return it) means a broken invariant or a lost device and
 * stops the process with the call site, as LOOM_ASSERT does.
 *
 * Graphs: graph_begin with an unknown key starts a stream capture (relaxed
 * mode, so scratch may still grow: replaced buffers are kept until the
 * graphs that may use them are dropped); graph_end instantiates and
 * launches. Up to MAX_GRAPHS are kept, least recently used evicted; all are
 * dropped when device memory is freed. Not thread-safe: one caller at a
 * time, as the CPU backend. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "kernels/backend_impl.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/cublas_dl.h"
#include "kernels/cuda/cublaslt_dl.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/flash.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/opmath.h"
#include "kernels/cuda/qformat.h"
#include "kernels/cuda/qmma.h"

_Static_assert((int)LOOM_QD_INT8 == (int)LOOM_QUANT_INT8 && (int)LOOM_QD_Q4 == (int)LOOM_QUANT_Q4 &&
                   (int)LOOM_QD_FP8 == (int)LOOM_QUANT_FP8,
               "qformat.h names the quantization kinds by their loom_quant_t values");
_Static_assert((int)LOOM_OM_ACT_SILU == (int)LOOM_ACT_SILU && (int)LOOM_OM_ACT_GELU == (int)LOOM_ACT_GELU &&
                   (int)LOOM_OM_ACT_GELU_TANH == (int)LOOM_ACT_GELU_TANH &&
                   (int)LOOM_OM_ACT_QUICK_GELU == (int)LOOM_ACT_QUICK_GELU &&
                   (int)LOOM_OM_ACT_RELU == (int)LOOM_ACT_RELU && (int)LOOM_OM_ACT_RELU2 == (int)LOOM_ACT_RELU2,
               "opmath.h names the activations by their loom_act_t values");

#define STAGE_BYTES   ((size_t)8 << 20)  /* each half of the pinned upload ring */
#define BLAS_WS_BYTES ((size_t)32 << 20) /* cuBLAS workspace (Hopper wants 32 MiB) */
#define MAX_GRAPHS    32
#define ATTN_PART_CAP ((size_t)64 << 20) /* most floats of split-attention partials */
#define WDQ_BYTES     ((size_t)64 << 20) /* dequantized weight panel for quantized prefill */

typedef struct dbuf {
    void *p;
    size_t bytes;
} dbuf_t;

typedef struct graph_slot {
    uint64_t key;
    cudaGraphExec_t exec; /* NULL: empty slot, or a key that failed to record */
    uint64_t used;        /* LRU clock */
    int failed;
} graph_slot_t;

typedef struct cuda_backend {
    struct loom_backend base;
    int dev, n_sms;
    int cc; /* compute capability, 10 * major + minor */
    size_t smem_optin;
    int wkind; /* LOOM_CUDA_BF16, _F16 or _F32: storage of matmul weights */
    int qgemv_max_n; /* quantized GEMV up to this n (-1: qgemv_default_max_n) */
    int attn_split_waves, attn_tile_min_n; /* the tuning table's (0: compiled defaults) */
    int gemv_variant, qgemv_variant;       /* the tuning table's decode GEMV variants (0: the defaults) */
    int qmma_max_n; /* quantized small-n tensor-core kernel up to this n (-1: LOOM_CUDA_QMMA_MAX_N) */
    int fp8_gemm;   /* FP8 prefill GEMMs through cuBLASLt (the tuning table's fp8_gemm; matmul_fp8) */
    int attn_prefill_variant;              /* the tuning table's (flash.h LOOM_FA_VARIANT_*; 0: tile) */
    cudaStream_t stream;
    /* the host-memory KV tier's transfers (loom_backend_xfer_*): made at first use */
    cudaStream_t xfer_stream;
    cudaEvent_t xfer_ev[2]; /* [0] the compute stream so far, [1] the transfers so far */
    const loom_cublas_api_t *blas_api; /* loaded at create (cublas_dl.h) */
    cublasHandle_t blas;
    void *blas_ws;

    /* uploads: pinned ring of two halves, each reusable once its event completes */
    uint8_t *stage;
    cudaEvent_t stage_ev[2];
    int stage_next;
    float *stage_dev; /* (2, STAGE_BYTES) device f32 for weight narrowing */

    /* scratch */
    dbuf_t act16;     /* narrowed matmul input (n, cols) */
    dbuf_t wdq;       /* rows of a quantized weight dequantized for cuBLAS */
    dbuf_t attn_part; /* split-attention partials */
    dbuf_t samp;      /* sampling parameters, output and slices */
    void *samp_host;  /* pinned mirror of the sampling parameters and output */
    size_t samp_host_bytes;
    unsigned long long *fp8_clamped; /* device counter: fp8 KV values clamped to +-448 */
    const float *shadow_of; /* act16 holds this buffer narrowed ... */
    size_t shadow_elems;    /* ... this many elements of it */

    /* graphs */
    graph_slot_t graphs[MAX_GRAPHS];
    uint64_t clock, n_recorded, n_replayed;
    int capturing;
    graph_slot_t *pending; /* replay to launch at graph_end */
    void **retired;        /* replaced scratch, freed with the graphs */
    int n_retired, cap_retired;
    dbuf_t lora_t;         /* (n, max_r) LoRA shrink outputs (loom_op_lora) */
    dbuf_t qmma_part;      /* split-K partial sums of the quantized tensor-core kernel */

    /* cuBLASLt (matmul_fp8), loaded at the first FP8 prefill GEMM */
    const loom_cublaslt_api_t *lt_api;
    cublasLtHandle_t lt;
    int lt_state;          /* 0 not tried, 1 ready, -1 unavailable (logged once) */
    dbuf_t x8;             /* x quantized per token to e4m3, then its scales */
    struct lt_plan {
        int what, kind;    /* LT_FP8 or LT_BIAS; the weights' storage (LT_BIAS) */
        int64_t rows, cols;
        int n, ok;         /* ok: 1 an algorithm, -1 none (the shape keeps the old path) */
        cublasLtMatmulDesc_t desc;
        cublasLtMatrixLayout_t a, b, d;
        cublasLtMatmulAlgo_t algo;
    } lt_plans[64];
    int lt_next;           /* the plan slot to reuse next (round robin) */
    uint64_t n_fp8_gemm;   /* GEMMs matmul_fp8 took */
    uint64_t n_lt_bias;    /* GEMMs cuda_matmul_bias ran with the bias epilogue */
    int fp8_warned;        /* fp8_gemm without outer-vector scales, logged */
    int lt_bias;           /* the bias epilogue (the tuning table's lt_bias, 0) */
} cuda_backend_t;

static cuda_backend_t *cu(loom_backend_t *be) {
    return (cuda_backend_t *)be;
}

/* --- checks ------------------------------------------------------------------- */

_Noreturn static void cuda_fail(const char *what, const char *why, const char *file, int line) {
    LOOM_ERROR("cuda: %s failed at %s:%d: %s", what, file, line, why);
    loom_assert_fail(what, file, line);
}

/* In ops (void): a failure stops the process with the call site. */
#define CUDA_ASSERT(call)                                                                          \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) cuda_fail(#call, cudaGetErrorString(e_), __FILE__, __LINE__);       \
    } while (0)
/* In functions that return a status: CUDA_CHECK (kernels/cuda/cuda_check.h). */
#define BLAS_ASSERT(call)                                                                          \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            cuda_fail(#call, loom_cublas_status_str(s_), __FILE__, __LINE__);                       \
    } while (0)

/* Every entry point makes the backend's device current for the calling thread. */
static void use(cuda_backend_t *c) {
    CUDA_ASSERT(cudaSetDevice(c->dev));
}

static int kind_of(loom_dtype_t dt) {
    return dt == LOOM_DT_BF16 ? LOOM_CUDA_BF16 : dt == LOOM_DT_F16 ? LOOM_CUDA_F16 : LOOM_CUDA_F32;
}

static cudaDataType_t blas_type(int kind) {
    return kind == LOOM_CUDA_BF16 ? CUDA_R_16BF : kind == LOOM_CUDA_F16 ? CUDA_R_16F : CUDA_R_32F;
}

static size_t kind_size(int kind) {
    return kind == LOOM_CUDA_F32 ? 4 : 2;
}

/* --- graphs and scratch ----------------------------------------------------------- */

static void drop_graphs(cuda_backend_t *c) {
    LOOM_ASSERT(!c->capturing);
    for (int i = 0; i < MAX_GRAPHS; i++) {
        if (c->graphs[i].exec) CUDA_ASSERT(cudaGraphExecDestroy(c->graphs[i].exec));
        c->graphs[i] = (graph_slot_t){0};
    }
    c->pending = NULL;
    if (c->n_retired) {
        CUDA_ASSERT(cudaStreamSynchronize(c->stream));
        for (int i = 0; i < c->n_retired; i++) CUDA_ASSERT(cudaFree(c->retired[i]));
        c->n_retired = 0;
    }
}

static int any_graph(const cuda_backend_t *c) {
    for (int i = 0; i < MAX_GRAPHS; i++)
        if (c->graphs[i].exec) return 1;
    return c->capturing;
}

/* Grows b to at least `bytes` (half again, to keep regrowth rare). The old
 * buffer may be baked into graphs or the capture in progress: it is kept
 * until the graphs are dropped. */
static void *reserve(cuda_backend_t *c, dbuf_t *b, size_t bytes) {
    if (bytes <= b->bytes) return b->p;
    size_t want = bytes + bytes / 2;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        e = cudaMalloc(&p, bytes);
        want = bytes;
    }
    if (e != cudaSuccess) {
        LOOM_ERROR("cuda: out of device memory for %zu bytes of scratch", bytes);
        cuda_fail("cudaMalloc(scratch)", cudaGetErrorString(e), __FILE__, __LINE__);
    }
    if (b->p) {
        if (any_graph(c)) {
            if (c->n_retired == c->cap_retired) {
                c->cap_retired = c->cap_retired ? 2 * c->cap_retired : 8;
                c->retired = loom_xrealloc(c->retired, (size_t)c->cap_retired * sizeof *c->retired);
            }
            c->retired[c->n_retired++] = b->p;
        } else {
            CUDA_ASSERT(cudaStreamSynchronize(c->stream));
            CUDA_ASSERT(cudaFree(b->p));
        }
    }
    if (b == &c->act16) c->shadow_of = NULL;
    b->p = p;
    b->bytes = want;
    return p;
}

static void shadow_clear(cuda_backend_t *c) {
    c->shadow_of = NULL;
    c->shadow_elems = 0;
}

/* The narrowed copy a producer op should write for y (n rows of dim), or
 * NULL when no cuBLAS matmul will read it (small n, f32 weights). */
static void *shadow_for(cuda_backend_t *c, const float *y, int n, int dim) {
    shadow_clear(c);
    if (n <= LOOM_CUDA_GEMV_MAX_N || c->wkind == LOOM_CUDA_F32) return NULL;
    size_t elems = (size_t)n * (size_t)dim;
    void *p = reserve(c, &c->act16, elems * 2);
    c->shadow_of = y;
    c->shadow_elems = elems;
    return p;
}

/* --- memory -------------------------------------------------------------------------- */

static void *cuda_alloc(loom_backend_t *be, size_t bytes) {
    cuda_backend_t *c = cu(be);
    use(c);
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cuda_free(loom_backend_t *be, void *p) {
    cuda_backend_t *c = cu(be);
    use(c);
    drop_graphs(c); /* they may point into p */
    shadow_clear(c);
    CUDA_ASSERT(cudaStreamSynchronize(c->stream));
    CUDA_ASSERT(cudaFree(p));
}

/* Host data goes through the pinned ring, so the copy is asynchronous and
 * the caller may reuse src as soon as this returns. */
static void ring_upload(cuda_backend_t *c, uint8_t *dst, const uint8_t *src, size_t bytes) {
    LOOM_ASSERT(!c->capturing);
    while (bytes) {
        size_t n = LOOM_MIN(bytes, STAGE_BYTES);
        int h = c->stage_next;
        c->stage_next ^= 1;
        CUDA_ASSERT(cudaEventSynchronize(c->stage_ev[h]));
        uint8_t *buf = c->stage + (size_t)h * STAGE_BYTES;
        memcpy(buf, src, n);
        CUDA_ASSERT(cudaMemcpyAsync(dst, buf, n, cudaMemcpyHostToDevice, c->stream));
        CUDA_ASSERT(cudaEventRecord(c->stage_ev[h], c->stream));
        dst += n, src += n, bytes -= n;
    }
}

static void cuda_upload(loom_backend_t *be, void *dst, const void *src, size_t bytes) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    ring_upload(c, dst, src, bytes);
}

static void cuda_download(loom_backend_t *be, void *dst, const void *src, size_t bytes) {
    cuda_backend_t *c = cu(be);
    use(c);
    LOOM_ASSERT(!c->capturing);
    CUDA_ASSERT(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    CUDA_ASSERT(cudaStreamSynchronize(c->stream));
}

static void cuda_memset(loom_backend_t *be, void *dst, int value, size_t bytes) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(cudaMemsetAsync(dst, value, bytes, c->stream));
}

static void cuda_copy(loom_backend_t *be, void *dst, const void *src, size_t bytes) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
}

static loom_status_t cuda_synchronize(loom_backend_t *be, loom_err_t *err) {
    cuda_backend_t *c = cu(be);
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    LOOM_ASSERT(!c->capturing);
    CUDA_CHECK(err, cudaStreamSynchronize(c->stream));
    return LOOM_OK;
}

static size_t cuda_mem_free(loom_backend_t *be) {
    cuda_backend_t *c = cu(be);
    use(c);
    size_t free_b = 0, total = 0;
    CUDA_ASSERT(cudaMemGetInfo(&free_b, &total));
    return free_b;
}

static void *cuda_stream(loom_backend_t *be) {
    return cu(be)->stream;
}

/* --- host transfers: pinned host memory, a side stream ordered with the
 * compute stream by events (the host never waits) ----------------------------- */

static void *cuda_host_alloc(loom_backend_t *be, size_t bytes) {
    cuda_backend_t *c = cu(be);
    use(c);
    void *p = NULL;
    if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cuda_host_free(loom_backend_t *be, void *p) {
    cuda_backend_t *c = cu(be);
    use(c);
    if (c->xfer_stream) CUDA_ASSERT(cudaStreamSynchronize(c->xfer_stream)); /* no copy still reads or writes it */
    CUDA_ASSERT(cudaFreeHost(p));
}

static void cuda_xfer_begin(loom_backend_t *be) {
    cuda_backend_t *c = cu(be);
    use(c);
    LOOM_ASSERT(!c->capturing);
    if (!c->xfer_stream) {
        CUDA_ASSERT(cudaStreamCreateWithFlags(&c->xfer_stream, cudaStreamNonBlocking));
        for (int i = 0; i < 2; i++) CUDA_ASSERT(cudaEventCreateWithFlags(&c->xfer_ev[i], cudaEventDisableTiming));
    }
    /* a saved block is read after the kernels that wrote it */
    CUDA_ASSERT(cudaEventRecord(c->xfer_ev[0], c->stream));
    CUDA_ASSERT(cudaStreamWaitEvent(c->xfer_stream, c->xfer_ev[0], 0));
}

static void cuda_xfer(loom_backend_t *be, void *dst, const void *src, size_t bytes, int to_host) {
    cuda_backend_t *c = cu(be);
    LOOM_ASSERT(c->xfer_stream);
    shadow_clear(c);
    CUDA_ASSERT(cudaMemcpyAsync(dst, src, bytes, to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                                c->xfer_stream));
}

static void cuda_xfer_end(loom_backend_t *be) {
    cuda_backend_t *c = cu(be);
    LOOM_ASSERT(c->xfer_stream);
    /* attention reads a loaded block, and a kernel overwrites a saved one, after the copies */
    CUDA_ASSERT(cudaEventRecord(c->xfer_ev[1], c->xfer_stream));
    CUDA_ASSERT(cudaStreamWaitEvent(c->stream, c->xfer_ev[1], 0));
}

/* --- weights ------------------------------------------------------------------------ */

static loom_status_t weight_alloc(cuda_backend_t *c, loom_weight_t *w, int64_t rows, int64_t cols,
                                  loom_err_t *err) {
    loom_dtype_t dt = c->base.cfg.weight_dtype;
    *w = (loom_weight_t){.data = NULL, .dtype = dt, .rows = rows, .cols = cols};
    if (rows < 0 || cols < 0 || rows > INT32_MAX || cols > INT32_MAX)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "weight shape (%lld, %lld)", (long long)rows,
                            (long long)cols);
    size_t bytes = (size_t)rows * (size_t)cols * kind_size(c->wkind);
    if (cudaMalloc(&w->data, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        w->data = NULL;
        return loom_err_set(err, LOOM_ERR_NOMEM, "%s: out of device memory for a %lld x %lld %s weight",
                            c->base.name, (long long)rows, (long long)cols, loom_dtype_name(dt));
    }
    return LOOM_OK;
}

/* f32 host rows are staged through the pinned ring and narrowed on the
 * device, half a ring at a time, so copies overlap the host memcpy. */
static loom_status_t cuda_weight_upload(loom_backend_t *be, loom_weight_t *w, int64_t rows, int64_t cols,
                                        const float *host, loom_err_t *err) {
    cuda_backend_t *c = cu(be);
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    LOOM_ASSERT(!c->capturing);
    shadow_clear(c);
    LOOM_CHECK(weight_alloc(c, w, rows, cols, err));
    size_t n = (size_t)rows * (size_t)cols;
    if (c->wkind == LOOM_CUDA_F32) {
        ring_upload(c, w->data, (const uint8_t *)host, n * sizeof(float));
        return LOOM_OK;
    }
    if (!c->stage_dev && cudaMalloc((void **)&c->stage_dev, 2 * STAGE_BYTES) != cudaSuccess) {
        (void)cudaGetLastError();
        c->stage_dev = NULL;
        CUDA_ASSERT(cudaFree(w->data));
        w->data = NULL;
        return loom_err_set(err, LOOM_ERR_NOMEM, "%s: out of device memory for upload staging", c->base.name);
    }
    const size_t per = STAGE_BYTES / sizeof(float);
    for (size_t off = 0; off < n; off += per) {
        size_t m = LOOM_MIN(per, n - off);
        int h = c->stage_next;
        c->stage_next ^= 1;
        CUDA_CHECK(err, cudaEventSynchronize(c->stage_ev[h]));
        uint8_t *buf = c->stage + (size_t)h * STAGE_BYTES;
        float *dev = c->stage_dev + (size_t)h * per;
        memcpy(buf, host + off, m * sizeof(float));
        CUDA_CHECK(err, cudaMemcpyAsync(dev, buf, m * sizeof(float), cudaMemcpyHostToDevice, c->stream));
        CUDA_CHECK(err, loom_cuda_convert((uint16_t *)w->data + off, c->wkind, dev, (int64_t)m, c->stream));
        CUDA_CHECK(err, cudaEventRecord(c->stage_ev[h], c->stream));
    }
    return LOOM_OK;
}

static void cuda_weight_free(loom_backend_t *be, loom_weight_t *w) {
    cuda_free(be, w->data);
    if (w->scales) cuda_free(be, w->scales);
    if (w->mins) cuda_free(be, w->mins);
    w->data = w->scales = w->mins = NULL;
}

/* Quantized weights keep the canonical layout (kernels/quant.h): codes,
 * f32 scales and mins, uploaded as they are; the kernels of qgemv.cu read
 * it directly. FP8 needs a device of compute capability 8.9 or newer
 * (Ada, Hopper), where e4m3 is a native type. */
static loom_status_t cuda_weight_upload_quant(loom_backend_t *be, loom_weight_t *w, const loom_qtensor_t *t,
                                              loom_err_t *err) {
    cuda_backend_t *c = cu(be);
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    LOOM_ASSERT(!c->capturing);
    shadow_clear(c);
    *w = (loom_weight_t){0};
    if (t->quant != LOOM_QUANT_INT8 && t->quant != LOOM_QUANT_Q4 && t->quant != LOOM_QUANT_FP8)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: no kernel for quantization %d", c->base.name,
                            (int)t->quant);
    if (t->quant == LOOM_QUANT_FP8 && c->cc < 89)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED,
                            "%s: fp8 (e4m3) weights need compute capability 8.9 or newer; this device is %d.%d",
                            c->base.name, c->cc / 10, c->cc % 10);
    const size_t codes = loom_qtensor_code_bytes(t), ns = loom_qtensor_scale_count(t) * sizeof(float);
    loom_weight_t q = {.dtype = t->quant == LOOM_QUANT_INT8 ? LOOM_DT_I8 : LOOM_DT_U8, .rows = t->rows,
                       .cols = t->cols, .quant = t->quant, .group = t->group};
    int ok = cudaMalloc(&q.data, codes) == cudaSuccess && cudaMalloc(&q.scales, ns) == cudaSuccess &&
             (!t->mins || cudaMalloc(&q.mins, ns) == cudaSuccess);
    if (!ok) {
        (void)cudaGetLastError();
        void *bufs[] = {q.data, q.scales, q.mins};
        for (size_t i = 0; i < LOOM_ARRAY_LEN(bufs); i++)
            if (bufs[i]) CUDA_CHECK(err, cudaFree(bufs[i]));
        return loom_err_set(err, LOOM_ERR_NOMEM, "%s: out of device memory for a %lld x %lld quantized weight",
                            c->base.name, (long long)t->rows, (long long)t->cols);
    }
    ring_upload(c, q.data, t->q, codes);
    ring_upload(c, q.scales, (const uint8_t *)t->scales, ns);
    if (t->mins) ring_upload(c, q.mins, (const uint8_t *)t->mins, ns);
    *w = q;
    return LOOM_OK;
}

loom_status_t loom_cuda_weight_random_quant(loom_backend_t *be, loom_weight_t *w, const loom_quant_spec_t *spec,
                                            int64_t rows, int64_t cols, uint64_t seed, float scale,
                                            loom_err_t *err) {
    cuda_backend_t *c = cu(be);
    LOOM_ASSERT(be->ops->weight_upload == cuda_weight_upload);
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    /* the shape checks and sizes of the canonical tensor (its codes and
     * scales are made on the device below: non-NULL stand-ins here) */
    loom_qtensor_t t = {.quant = spec->quant, .rows = rows, .cols = cols,
                        .group = spec->quant == LOOM_QUANT_Q4 ? spec->group : (int)cols, .q = w,
                        .scales = (float *)w, .mins = spec->with_min ? (float *)w : NULL};
    LOOM_CHECK(loom_qtensor_check(&t, "random weight", err));
    if (spec->quant == LOOM_QUANT_FP8 && c->cc < 89)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "%s: fp8 (e4m3) weights need compute capability 8.9 or newer",
                            c->base.name);
    *w = (loom_weight_t){.dtype = spec->quant == LOOM_QUANT_INT8 ? LOOM_DT_I8 : LOOM_DT_U8, .rows = rows,
                         .cols = cols, .quant = spec->quant, .group = t.group};
    const size_t codes = loom_qtensor_code_bytes(&t), ns = loom_qtensor_scale_count(&t);
    w->data = loom_backend_alloc(be, codes);
    w->scales = loom_backend_alloc(be, ns * sizeof(float));
    if (t.mins) w->mins = loom_backend_alloc(be, ns * sizeof(float));
    if (!w->data || !w->scales || (t.mins && !w->mins)) {
        void *bufs[] = {w->data, w->scales, w->mins};
        for (size_t i = 0; i < LOOM_ARRAY_LEN(bufs); i++)
            if (bufs[i]) loom_backend_free(be, bufs[i]);
        *w = (loom_weight_t){0};
        return loom_err_set(err, LOOM_ERR_NOMEM, "%s: out of device memory for a random quantized weight",
                            c->base.name);
    }
    /* |w| within about `scale`: int8 codes span +-127, 4-bit codes 16 steps, e4m3 codes [0.25, 1) */
    const float s = spec->quant == LOOM_QUANT_INT8 ? scale / 127.0f
                    : spec->quant == LOOM_QUANT_Q4 ? scale / 8.0f
                                                   : scale;
    CUDA_CHECK(err, loom_cuda_fill_codes(w->data, (int)spec->quant, (int64_t)codes, seed, c->stream));
    CUDA_CHECK(err, loom_cuda_fill_random(w->scales, LOOM_CUDA_F32, (int64_t)ns, seed + 1, 0.5f * s, s, c->stream));
    if (w->mins)
        CUDA_CHECK(err, loom_cuda_fill_random(w->mins, LOOM_CUDA_F32, (int64_t)ns, seed + 2, -scale, -0.5f * scale,
                                              c->stream));
    return LOOM_OK;
}

loom_status_t loom_cuda_weight_random(loom_backend_t *be, loom_weight_t *w, int64_t rows, int64_t cols,
                                      uint64_t seed, float scale, loom_err_t *err) {
    cuda_backend_t *c = cu(be);
    LOOM_ASSERT(be->ops->weight_upload == cuda_weight_upload);
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    LOOM_CHECK(weight_alloc(c, w, rows, cols, err));
    CUDA_CHECK(err, loom_cuda_fill_random(w->data, c->wkind, rows * cols, seed, -scale, scale, c->stream));
    return LOOM_OK;
}

void loom_cuda_fill_uniform(loom_backend_t *be, float *dst, size_t n, uint64_t seed, float lo, float hi) {
    cuda_backend_t *c = cu(be);
    LOOM_ASSERT(be->ops->weight_upload == cuda_weight_upload);
    use(c);
    CUDA_ASSERT(loom_cuda_fill_random(dst, LOOM_CUDA_F32, (int64_t)n, seed, lo, hi, c->stream));
}

int loom_cuda_sm_count(loom_backend_t *be) {
    LOOM_ASSERT(be->ops->weight_upload == cuda_weight_upload);
    return cu(be)->n_sms;
}

void loom_cuda_graph_stats(loom_backend_t *be, uint64_t *recorded, uint64_t *replayed) {
    LOOM_ASSERT(be->ops->weight_upload == cuda_weight_upload);
    *recorded = cu(be)->n_recorded;
    *replayed = cu(be)->n_replayed;
}

/* --- matmul ---------------------------------------------------------------------------- */

/* x (n, cols) as cuBLAS should read it for weights of `kind`: narrowed on
 * the device (or the shadow a producer op already wrote), or x itself for
 * f32. Clears the shadow. */
static const void *gemm_input(cuda_backend_t *c, const float *x, int n, int64_t cols, int kind) {
    const void *b = x;
    if (kind != LOOM_CUDA_F32) {
        const size_t elems = (size_t)n * (size_t)cols;
        if (c->shadow_of == x && c->shadow_elems == elems) {
            b = c->act16.p;
        } else {
            void *p = reserve(c, &c->act16, elems * 2);
            CUDA_ASSERT(loom_cuda_convert(p, kind, x, (int64_t)elems, c->stream));
            b = p;
        }
    }
    shadow_clear(c);
    return b;
}

/* Quantized weights: the GEMV kernel for up to qgemv_default_max_n() rows
 * of x; above, panels of W's rows (at most WDQ_BYTES) are dequantized into
 * the backend's weight dtype (bf16/f16, or f32 with exact_f32) and
 * multiplied by cuBLAS as float weights are. */
/* The largest n served by the quantized GEMV, per scheme. The kernel reads
 * x once per row and token, so its L1 traffic grows with n while the
 * weight bytes do not; dequantizing into bf16 for cuBLAS costs about
 * (1 + 2·2/bytes-per-weight) passes over the weights but reuses x in
 * tensor-core tiles. bench_gpu --quant-gemv measures both paths at each n
 * (docs/cuda.md, "Targets and results"); these are its crossovers on an
 * H200. */
static int qgemv_default_max_n(loom_quant_t q) {
    switch (q) {
    case LOOM_QUANT_Q4: return LOOM_CUDA_QGEMV_MAX_N_Q4;
    default: return LOOM_CUDA_QGEMV_MAX_N_8BIT;
    }
}

void loom_cuda_set_gemv_variant(loom_backend_t *be, int variant) {
    cu(be)->gemv_variant = variant >= 0 && variant < LOOM_OM_GEMV_VARIANTS ? variant : 0;
}

void loom_cuda_set_qgemv_variant(loom_backend_t *be, int variant) {
    cu(be)->qgemv_variant = variant >= 0 && variant < LOOM_OM_QGEMV_VARIANTS ? variant : 0;
}

void loom_cuda_set_attn_prefill_variant(loom_backend_t *be, int variant) {
    cu(be)->attn_prefill_variant = variant >= 0 && variant < LOOM_FA_VARIANTS ? variant : 0;
}

void loom_cuda_set_qgemv_max_n(loom_backend_t *be, int n) {
    cu(be)->qgemv_max_n = n < 0 ? -1 : LOOM_MIN(n, LOOM_CUDA_QGEMV_MAX_N);
}

void loom_cuda_set_qmma_max_n(loom_backend_t *be, int n) {
    cu(be)->qmma_max_n = n < 0 ? -1 : LOOM_MIN(n, LOOM_QM_MAX_N);
}

/* --- cuBLASLt: FP8 prefill GEMMs and the bias epilogue ------------------------------------ */

static void lt_plan_clear(cuda_backend_t *c, struct lt_plan *p) {
    if (p->desc) (void)c->lt_api->desc_destroy(p->desc);
    cublasLtMatrixLayout_t ls[] = {p->a, p->b, p->d};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(ls); i++)
        if (ls[i]) (void)c->lt_api->layout_destroy(ls[i]);
    *p = (struct lt_plan){0};
}

/* Loads cuBLASLt and makes its handle at the first call that wants it
 * (never while a graph records); when that fails, says so once and
 * returns 0: the callers keep cuBLAS and the separate passes. */
static int lt_ready(cuda_backend_t *c) {
    if (c->lt_state) return c->lt_state > 0;
    if (c->capturing) return 0;
    c->lt_state = -1;
    loom_err_t err = {0};
    if (loom_cublaslt_load(&c->lt_api, &err) != LOOM_OK) {
        LOOM_WARN("%s: %s; prefill GEMMs stay on cuBLAS (no FP8 GEMM, no bias epilogue)", c->base.name, err.msg);
        return 0;
    }
    cublasStatus_t st = c->lt_api->create(&c->lt);
    if (st != CUBLAS_STATUS_SUCCESS) {
        c->lt = NULL;
        LOOM_WARN("%s: cublasLtCreate: %s; prefill GEMMs stay on cuBLAS", c->base.name, loom_cublas_status_str(st));
        return 0;
    }
    c->lt_state = 1;
    LOOM_INFO("%s: cuBLASLt %zu loaded", c->base.name, c->lt_api->version);
    return 1;
}

enum { LT_FP8 = 1, LT_BIAS = 2 }; /* what a plan multiplies */

/* The descriptor, layouts and algorithm of one (what, kind, rows, cols, n),
 * made once (a 64-entry cache, round robin; a shape without an algorithm
 * is remembered as such). Column-major view as in cuda_matmul: D (rows, n)
 * = A^T B with A the weight (cols, rows), ld cols (the "TN" layout FP8
 * needs), B x (cols, n), D f32 with ld rows. LT_FP8: e4m3 A and B, their
 * scales outer vectors (w's row scales, x's token scales); LT_BIAS: A and
 * B of `kind`, CUBLASLT_EPILOGUE_BIAS adding an f32 vector of rows to every
 * column of D. Pointers (scales, bias) are set per call; those of the
 * first call are set before the heuristic too, which may read their
 * alignment. */
static struct lt_plan *lt_find(cuda_backend_t *c, int what, int kind, int64_t rows, int64_t cols, int n) {
    for (size_t i = 0; i < LOOM_ARRAY_LEN(c->lt_plans); i++) {
        struct lt_plan *p = &c->lt_plans[i];
        if (p->ok && p->what == what && p->kind == kind && p->rows == rows && p->cols == cols && p->n == n)
            return p; /* ok < 0: known to have no algorithm */
    }
    return NULL;
}

static struct lt_plan *lt_plan(cuda_backend_t *c, int what, int kind, int64_t rows, int64_t cols, int n,
                               const void *p0, const void *p1) {
    struct lt_plan *found = lt_find(c, what, kind, rows, cols, n);
    if (found) return found;
    struct lt_plan *p = &c->lt_plans[c->lt_next];
    c->lt_next = (c->lt_next + 1) % (int)LOOM_ARRAY_LEN(c->lt_plans);
    lt_plan_clear(c, p);
    const struct lt_plan key = {.what = what, .kind = kind, .rows = rows, .cols = cols, .n = n, .ok = -1};
    *p = key;
    const loom_cublaslt_api_t *a = c->lt_api;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cudaDataType_t ab = what == LT_FP8 ? CUDA_R_8F_E4M3 : blas_type(kind);
    const uint64_t ws = BLAS_WS_BYTES;
    cublasLtMatmulPreference_t pref = NULL;
    int ok = a->desc_create(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
             a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) == CUBLAS_STATUS_SUCCESS &&
             a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) == CUBLAS_STATUS_SUCCESS;
    if (what == LT_FP8) {
#if CUBLAS_VERSION >= 120900
        const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        const int8_t fast = 0; /* full f32 accumulation */
        ok = ok && a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &vec, sizeof vec) == CUBLAS_STATUS_SUCCESS &&
             a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec, sizeof vec) == CUBLAS_STATUS_SUCCESS &&
             a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast) == CUBLAS_STATUS_SUCCESS &&
             a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p0, sizeof p0) == CUBLAS_STATUS_SUCCESS &&
             a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p1, sizeof p1) == CUBLAS_STATUS_SUCCESS;
#else
        (void)p1;
        ok = 0;
#endif
    } else {
        const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        const int32_t bias_type = CUDA_R_32F;
        ok = ok && a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) == CUBLAS_STATUS_SUCCESS &&
             a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type) ==
                 CUBLAS_STATUS_SUCCESS &&
             a->desc_set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p0, sizeof p0) == CUBLAS_STATUS_SUCCESS;
    }
    ok = ok && a->layout_create(&p->a, ab, (uint64_t)cols, (uint64_t)rows, cols) == CUBLAS_STATUS_SUCCESS &&
         a->layout_create(&p->b, ab, (uint64_t)cols, (uint64_t)n, cols) == CUBLAS_STATUS_SUCCESS &&
         a->layout_create(&p->d, CUDA_R_32F, (uint64_t)rows, (uint64_t)n, rows) == CUBLAS_STATUS_SUCCESS &&
         a->pref_create(&pref) == CUBLAS_STATUS_SUCCESS &&
         a->pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) == CUBLAS_STATUS_SUCCESS;
    cublasLtMatmulHeuristicResult_t res;
    int got = 0;
    ok = ok && a->heuristic(c->lt, p->desc, p->a, p->b, p->d, p->d, pref, 1, &res, &got) == CUBLAS_STATUS_SUCCESS &&
         got > 0;
    if (pref) (void)a->pref_destroy(pref);
    if (ok) {
        p->algo = res.algo;
        p->ok = 1;
    } else {
        LOOM_INFO("%s: cuBLASLt has no %s algorithm for %lld x %lld at n = %d; that shape keeps cuBLAS",
                  c->base.name, what == LT_FP8 ? "FP8" : "bias-epilogue", (long long)rows, (long long)cols, n);
        lt_plan_clear(c, p);
        *p = key;
    }
    return p;
}

/* FP8 weights on sm_89+ with fp8_gemm on: x quantized per token to e4m3
 * (fp8act.cu) and one cublasLtMatmul with the weights' row scales and x's
 * token scales as outer vectors (fp8act.h: the math and its error bound),
 * instead of dequantizing W to bf16 (a read of 1 byte and a write of 2 per
 * weight, then cuBLAS's read of 2) -- the weights are read once, as bytes,
 * at FP8 tensor-core rate. Needs cuBLASLt 12.9+ (outer-vector scales).
 * Returns 0 when it does not take the call. */
static int matmul_fp8(cuda_backend_t *c, float *y, const float *x, const loom_weight_t *w, int n) {
    if (!c->fp8_gemm || w->quant != LOOM_QUANT_FP8 || c->cc < 89 || w->rows % 16 || w->cols % 16 ||
        ((uintptr_t)w->data & 15u) || c->capturing || !lt_ready(c))
        return 0;
    if (CUBLAS_VERSION < 120900 || c->lt_api->version < 120900) {
        if (!c->fp8_warned)
            LOOM_WARN("%s: fp8_gemm: cuBLASLt %zu (headers %d) has no outer-vector scales (12.9 or newer); FP8 "
                      "prefill dequantizes for cuBLAS",
                      c->base.name, c->lt_api->version, (int)CUBLAS_VERSION);
        c->fp8_warned = 1;
        return 0;
    }
    const size_t codes = ((size_t)n * (size_t)w->cols + 255) / 256 * 256;
    uint8_t *xq = reserve(c, &c->x8, codes + (size_t)n * sizeof(float));
    float *xs = (float *)(xq + codes);
    struct lt_plan *p = lt_plan(c, LT_FP8, 0, w->rows, w->cols, n, w->scales, xs);
    if (p->ok < 0) return 0;
    CUDA_ASSERT(loom_cuda_fp8_quant_rows(xq, xs, x, n, w->cols, c->stream));
#if CUBLAS_VERSION >= 120900
    const void *sa = w->scales, *sb = xs;
    BLAS_ASSERT(c->lt_api->desc_set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa));
    BLAS_ASSERT(c->lt_api->desc_set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb));
#endif
    const float one = 1.0f, zero = 0.0f;
    BLAS_ASSERT(c->lt_api->matmul(c->lt, p->desc, &one, w->data, p->a, xq, p->b, &zero, y, p->d, y, p->d, &p->algo,
                                  c->blas_ws, BLAS_WS_BYTES, c->stream));
    shadow_clear(c);
    c->n_fp8_gemm++;
    return 1;
}

/* y = x W^T + bias for bf16/f16 weights and n >= LT_BIAS_MIN_N (q/k/v of
 * Qwen2 and every other biased projection in prefill): cuBLASLt's bias
 * epilogue adds the bias as the GEMM writes y, which saves add_bias's pass
 * (a read and a write of n x rows floats and a launch). A plan is made per
 * (shape, n), asking cuBLASLt's heuristic once (host time, tens of
 * microseconds); below LT_BIAS_MIN_N tokens the pass saved is smaller than
 * that, and steps of changing small n (mixed batches) would keep asking.
 * The tuning table's lt_bias 0 turns it off. */
#define LT_BIAS_MIN_N 64
static void cuda_matmul(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w, int n);

static void cuda_matmul_bias(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w,
                             const float *bias, int n) {
    cuda_backend_t *c = cu(be);
    use(c);
    const int kind = kind_of(w->dtype);
    if (c->lt_bias && w->quant == LOOM_QUANT_NONE && kind != LOOM_CUDA_F32 && n >= LT_BIAS_MIN_N &&
        w->rows > 0 && w->cols > 0 && ((uintptr_t)bias & 15u) == 0 && lt_ready(c)) {
        /* while a graph records, only plans made before (the heuristic is
         * not asked under capture) */
        struct lt_plan *p = c->capturing ? lt_find(c, LT_BIAS, kind, w->rows, w->cols, n)
                                         : lt_plan(c, LT_BIAS, kind, w->rows, w->cols, n, bias, NULL);
        if (p && p->ok > 0) {
            const void *b = gemm_input(c, x, n, w->cols, kind);
            BLAS_ASSERT(c->lt_api->desc_set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
            const float one = 1.0f, zero = 0.0f;
            BLAS_ASSERT(c->lt_api->matmul(c->lt, p->desc, &one, w->data, p->a, b, p->b, &zero, y, p->d, y, p->d,
                                          &p->algo, c->blas_ws, BLAS_WS_BYTES, c->stream));
            c->n_lt_bias++;
            return;
        }
    }
    cuda_matmul(be, y, x, w, n);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_add_bias(y, bias, n, (int)w->rows, c->stream));
}

uint64_t loom_cuda_lt_bias_count(loom_backend_t *be) {
    return cu(be)->n_lt_bias;
}

void loom_cuda_set_lt_bias(loom_backend_t *be, int on) {
    cu(be)->lt_bias = on > 0;
}

void loom_cuda_set_fp8_gemm(loom_backend_t *be, int on) {
    cu(be)->fp8_gemm = on > 0;
}

uint64_t loom_cuda_fp8_gemm_count(loom_backend_t *be) {
    return cu(be)->n_fp8_gemm;
}

/* Above the GEMV's crossover and up to qmma_max_n tokens, with bf16 weights
 * (the kernel multiplies in bf16; f16 and exact f32 storage keep the
 * dequantizing path): the small-n tensor-core kernel (qmma.cu), which reads
 * the codes once instead of dequantizing the whole matrix for cuBLAS.
 * Returns 0 when it does not take the call. */
static int matmul_qmma(cuda_backend_t *c, float *y, const float *x, const loom_weight_t *w, int n) {
    const int max_n = c->qmma_max_n < 0 ? LOOM_CUDA_QMMA_MAX_N : c->qmma_max_n;
    if (n > max_n || c->wkind != LOOM_CUDA_BF16 ||
        !loom_cuda_qmma_fits((int)w->quant, w->rows, w->cols, w->group, n, x, w->data))
        return 0;
    const int ksplit = loom_qm_ksplit(w->rows, w->cols, c->n_sms);
    float *part = NULL;
    if (ksplit > 1) part = reserve(c, &c->qmma_part, (size_t)ksplit * (size_t)n * (size_t)w->rows * sizeof(float));
    CUDA_ASSERT(loom_cuda_qmma(y, x, w->data, w->scales, w->mins, (int)w->quant, w->rows, w->cols, w->group, n,
                               ksplit, part, c->stream));
    shadow_clear(c);
    return 1;
}

static void matmul_quant(cuda_backend_t *c, float *y, const float *x, const loom_weight_t *w, int n) {
    const int64_t rows = w->rows, cols = w->cols;
    if (n <= (c->qgemv_max_n < 0 ? qgemv_default_max_n(w->quant) : c->qgemv_max_n)) {
        CUDA_ASSERT(loom_cuda_qgemv(y, x, w->data, w->scales, w->mins, (int)w->quant, rows, cols, w->group, n,
                                    c->qgemv_variant, c->stream));
        shadow_clear(c);
        return;
    }
    if (matmul_qmma(c, y, x, w, n)) return;
    if (matmul_fp8(c, y, x, w, n)) return;
    const int kind = c->wkind;
    const void *b = gemm_input(c, x, n, cols, kind);
    const size_t row_bytes = (size_t)cols * kind_size(kind);
    int64_t panel = (int64_t)(WDQ_BYTES / row_bytes) / 128 * 128;
    panel = LOOM_MIN(LOOM_MAX(panel, 128), rows);
    void *wd = reserve(c, &c->wdq, (size_t)panel * row_bytes);
    const float one = 1.0f, zero = 0.0f;
    for (int64_t r0 = 0; r0 < rows; r0 += panel) {
        const int64_t m = LOOM_MIN(panel, rows - r0);
        CUDA_ASSERT(loom_cuda_dequant(wd, kind, w->data, w->scales, w->mins, (int)w->quant, r0, r0 + m, cols,
                                      w->group, c->stream));
        /* y^T rows [r0, r0 + m) (column-major, ldc = rows) = panel . x^T */
        BLAS_ASSERT(c->blas_api->gemm_ex(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, n, (int)cols, &one, wd, blas_type(kind),
                                 (int)cols, b, blas_type(kind), (int)cols, &zero, y + r0, CUDA_R_32F, (int)rows,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
}

static void cuda_matmul(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w, int n) {
    cuda_backend_t *c = cu(be);
    use(c);
    const int64_t rows = w->rows, cols = w->cols;
    const int kind = kind_of(w->dtype);
    if (rows == 0 || n <= 0) return;
    if (cols == 0) {
        shadow_clear(c);
        CUDA_ASSERT(cudaMemsetAsync(y, 0, (size_t)n * (size_t)rows * sizeof(float), c->stream));
        return;
    }
    if (w->quant != LOOM_QUANT_NONE) {
        matmul_quant(c, y, x, w, n);
        return;
    }
    if (n <= LOOM_CUDA_GEMV_MAX_N) {
        CUDA_ASSERT(loom_cuda_gemv(y, x, w->data, kind, rows, cols, n, c->gemv_variant, c->stream));
        shadow_clear(c);
        return;
    }
    const float one = 1.0f, zero = 0.0f;
    const void *b = gemm_input(c, x, n, cols, kind);
    /* Column-major view: y^T (rows, n) = W (cols, rows)^T . x^T (cols, n). */
    BLAS_ASSERT(c->blas_api->gemm_ex(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, n, (int)cols, &one, w->data,
                             blas_type(kind), (int)cols, b, blas_type(kind), (int)cols, &zero, y, CUDA_R_32F,
                             (int)rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* --- element-wise ops ---------------------------------------------------------------------- */

static void cuda_rmsnorm(loom_backend_t *be, float *y, const float *x, const float *g, int n, int dim,
                         float eps) {
    cuda_backend_t *c = cu(be);
    use(c);
    void *y16 = shadow_for(c, y, n, dim);
    CUDA_ASSERT(loom_cuda_rmsnorm(y, (float *)x, NULL, g, y16, c->wkind, n, dim, eps, c->stream));
}

static void cuda_add_rmsnorm(loom_backend_t *be, float *x, const float *a, float *y, const float *g, int n,
                             int dim, float eps) {
    cuda_backend_t *c = cu(be);
    use(c);
    void *y16 = shadow_for(c, y, n, dim);
    CUDA_ASSERT(loom_cuda_rmsnorm(y, x, a, g, y16, c->wkind, n, dim, eps, c->stream));
}

static void cuda_add(loom_backend_t *be, float *y, const float *a, int64_t n) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_add(y, a, n, c->stream));
}

static void cuda_add_bias(loom_backend_t *be, float *y, const float *bias, int n, int cols) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_add_bias(y, bias, n, cols, c->stream));
}

static void cuda_silu_mul(loom_backend_t *be, float *out, const float *gu, int n, int hidden) {
    cuda_backend_t *c = cu(be);
    use(c);
    void *o16 = shadow_for(c, out, n, hidden);
    CUDA_ASSERT(loom_cuda_silu_mul(out, o16, c->wkind, gu, n, hidden, c->stream));
}

static void cuda_act_mul(loom_backend_t *be, loom_act_t act, float *out, const float *gu, int n, int hidden) {
    cuda_backend_t *c = cu(be);
    use(c);
    void *o16 = shadow_for(c, out, n, hidden);
    CUDA_ASSERT(loom_cuda_act_mul(out, o16, c->wkind, gu, n, hidden, (int)act, c->stream));
}

static void cuda_swiglu_clamp(loom_backend_t *be, float *out, const float *gu, int n, int hidden, float alpha,
                              float limit) {
    cuda_backend_t *c = cu(be);
    use(c);
    void *o16 = shadow_for(c, out, n, hidden);
    CUDA_ASSERT(loom_cuda_swiglu_clamp(out, o16, c->wkind, gu, n, hidden, alpha, limit, c->stream));
}

static void cuda_softcap(loom_backend_t *be, float *x, int64_t n, float cap) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_softcap(x, n, cap, c->stream));
}

static void cuda_gather_rows(loom_backend_t *be, float *dst, const float *src, const int32_t *rows, int n,
                             int dim) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_gather_rows(dst, src, rows, n, dim, c->stream));
}

/* --- Mixture of Experts (moe.cu) ---------------------------------------------------------- */

static void cuda_moe_combine(loom_backend_t *be, float *out, const float *y, const int32_t *pos,
                             const float *w, int n, int k, int dim, int accumulate) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_moe_combine(out, y, pos, w, n, k, dim, accumulate, c->stream));
}

static void cuda_moe_route(loom_backend_t *be, const float *logits, int n, int n_experts, int k,
                           int norm, int32_t *sel, float *w) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_moe_route(logits, n, n_experts, k, norm, sel, w, c->stream));
}

static void cuda_moe_gemv(loom_backend_t *be, float *y, const float *x, int xdiv,
                          const int32_t *sel, int n_pairs, const void *table, loom_dtype_t dtype,
                          int64_t rows, int64_t cols) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_moe_gemv(y, x, xdiv, sel, n_pairs, (const void *const *)table,
                                   kind_of(dtype), rows, cols, c->stream));
}

static void cuda_moe_add_bias(loom_backend_t *be, float *y, const int32_t *sel, int n_pairs, const float *bias,
                              int cols) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_moe_add_bias(y, sel, n_pairs, bias, cols, c->stream));
}

static int cuda_moe_route_ds_fits(const loom_moe_ds_args_t *r) {
    return loom_cuda_moe_route_ds_fits(r->n_experts, r->top_k, r->method, r->n_group, r->topk_group);
}

static void cuda_moe_route_ds(loom_backend_t *be, const float *logits, int n, const loom_moe_ds_args_t *r,
                              int32_t *sel, float *w) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_moe_route_ds(logits, n, r->n_experts, r->top_k, r->sigmoid, r->method, r->n_group,
                                       r->topk_group, r->norm_topk_prob, r->routed_scaling_factor, r->bias, sel,
                                       w, c->stream));
}

/* LoRA deltas (lora.cu): the slots' table goes by value into the kernels. */
static void cuda_lora(loom_backend_t *be, float *y, int64_t ldy, const float *x, int64_t ldx, int n, int64_t in,
                      int64_t out, const int32_t *row_slot, const loom_lora_op_slot_t *slots, int n_slots,
                      int max_r) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    LOOM_ASSERT(n_slots <= LOOM_CUDA_LORA_MAX_SLOTS);
    loom_cuda_lora_table_t tab = {.n = n_slots};
    for (int i = 0; i < n_slots; i++)
        tab.s[i] = (loom_cuda_lora_slot_t){.a = slots[i].a, .bt = slots[i].bt, .r = slots[i].r,
                                           .scale = slots[i].scale};
    float *t = reserve(c, &c->lora_t, (size_t)n * (size_t)max_r * sizeof(float));
    CUDA_ASSERT(loom_cuda_lora(y, ldy, x, ldx, n, in, out, row_slot, &tab, max_r, t, c->stream));
}

/* Float experts of one dtype (moe.cu reads their data directly) and the
 * router sizes moe.cu takes: decode steps of up to LOOM_CUDA_GEMV_MAX_N
 * tokens (beyond, grouping by expert reads less). */
static int cuda_moe_device(loom_backend_t *be, const loom_weight_t *experts, int n_experts, int k) {
    (void)be;
    if (n_experts < 1 || n_experts > LOOM_CUDA_MOE_MAX_EXPERTS || k < 1 || k > 32 || k > n_experts)
        return 0;
    int dt = -1;
    for (int e = 0; e < n_experts; e++) {
        const loom_weight_t *w = &experts[e];
        if (!w->data) continue;
        if (w->quant != LOOM_QUANT_NONE ||
            (w->dtype != LOOM_DT_F32 && w->dtype != LOOM_DT_BF16 && w->dtype != LOOM_DT_F16) ||
            (dt >= 0 && (int)w->dtype != dt))
            return 0;
        dt = (int)w->dtype;
    }
    return dt >= 0 ? LOOM_CUDA_GEMV_MAX_N : 0;
}

/* A device array of the experts' data pointers (NULL: another rank's). */
static void *cuda_moe_table(loom_backend_t *be, const loom_weight_t *experts, int n_experts) {
    const void **h = loom_xcalloc((size_t)n_experts, sizeof *h);
    for (int e = 0; e < n_experts; e++)
        h[e] = experts[e].data;
    void *d = cuda_alloc(be, (size_t)n_experts * sizeof *h);
    if (d) cuda_upload(be, d, h, (size_t)n_experts * sizeof *h);
    free(h);
    return d;
}

static void cuda_rope(loom_backend_t *be, float *x, int stride, int n, int n_heads, int hd, const int32_t *pos,
                      const float *inv_freq) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_rope(x, stride, n, n_heads, hd, pos, inv_freq, c->stream));
}

/* KV caches: F32, BF16, FP8 e4m3 (clamped to +-448 and counted) and I8
 * (the CPU backend's layout: a scale per token and KV head). */
static int cuda_kv_supported(const loom_backend_t *be, loom_dtype_t dtype) {
    (void)be;
    return dtype == LOOM_DT_F32 || dtype == LOOM_DT_BF16 || dtype == LOOM_DT_F8_E4M3 || dtype == LOOM_DT_I8;
}

static int cuda_kv_kind(loom_dtype_t dtype) {
    LOOM_ASSERT(cuda_kv_supported(NULL, dtype));
    return dtype == LOOM_DT_BF16      ? LOOM_CUDA_BF16
           : dtype == LOOM_DT_F8_E4M3 ? LOOM_CUDA_FP8
           : dtype == LOOM_DT_I8      ? LOOM_CUDA_I8
                                      : LOOM_CUDA_F32;
}

static void cuda_kv_write(loom_backend_t *be, const loom_kv_layer_t *kv, const float *k, const float *v,
                          int stride, const int32_t *slots, int n, int nkv, int hd) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_kv_write(kv->k, kv->v, cuda_kv_kind(kv->dtype), kv->k_scale, kv->v_scale, kv->fp8_scale, k,
                                   v, stride, slots, n, nkv, hd, kv->v_dim, c->fp8_clamped, c->stream));
}

static void cuda_rope_kv_write(loom_backend_t *be, float *q, float *k, const float *v, int stride, int n, int nh,
                               int nkv, int hd, const int32_t *pos, const float *inv_freq,
                               const loom_kv_layer_t *kv, const int32_t *slots) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_rope_kv_write(q, k, v, stride, n, nh, nkv, hd, pos, inv_freq, kv->k, kv->v,
                                        cuda_kv_kind(kv->dtype), kv->k_scale, kv->v_scale, kv->fp8_scale, slots,
                                        kv->v_dim, c->fp8_clamped, c->stream));
}

/* --- attention ------------------------------------------------------------------------------- */

static void cuda_attention(loom_backend_t *be, const loom_attn_args_t *a) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    LOOM_ASSERT(a->n_kv_heads > 0 && a->n_heads % a->n_kv_heads == 0 && a->block_size > 0);
    if (a->head_dim > LOOM_OM_WIDE_MAX_HD) { /* refused at load (LOOM_CAP_ATTN_HUGE) */
        LOOM_ERROR("cuda attention: head_dim %d is above the kernels' limit of %d", a->head_dim,
                   LOOM_OM_WIDE_MAX_HD);
        LOOM_ASSERT(a->head_dim <= LOOM_OM_WIDE_MAX_HD);
    }
    const loom_cuda_attn_t ca = {
        .n = a->n, .n_heads = a->n_heads, .n_kv_heads = a->n_kv_heads, .head_dim = a->head_dim,
        .scale = a->scale, .q = a->q, .q_stride = a->q_stride, .out = a->out, .out_stride = a->out_stride,
        .k_cache = a->kv.k, .v_cache = a->kv.v, .kv_kind = cuda_kv_kind(a->kv.dtype),
        .block_size = a->block_size, .tok_seq = a->tok_seq,
        .tok_pos = a->tok_pos, .block_tables = a->block_tables, .max_blocks = a->max_blocks,
        .window = a->window, .softcap = a->softcap, .sinks = a->sinks,
        .k_scale = a->kv.k_scale, .v_scale = a->kv.v_scale,
        .fp8_scale = {a->kv.fp8_scale[0], a->kv.fp8_scale[1]},
        .split_waves = c->attn_split_waves, .tile_min_n = c->attn_tile_min_n,
        .prefill_variant = c->cc >= 80 ? c->attn_prefill_variant : LOOM_FA_VARIANT_TILE, /* cp.async, bf16 mma */
        .v_dim = a->kv.v_dim, .lse = a->lse,
    };
    /* The grid depends on n and the head counts only (never on max_ctx), so
     * a recorded graph stays valid as contexts grow. */
    loom_cuda_attn_plan_t pl = loom_cuda_attention_plan(&ca, c->n_sms, c->smem_optin, ATTN_PART_CAP);
    LOOM_ASSERT(pl.smem <= c->smem_optin && pl.smem_tile <= c->smem_optin);
    float *part = pl.part_floats ? reserve(c, &c->attn_part, pl.part_floats * sizeof(float)) : NULL;
    CUDA_ASSERT(loom_cuda_attention(&ca, &pl, part, c->stream));
}

static void cuda_attn_merge(loom_backend_t *be, float *out, float *lse_run, const float *o, const float *lse, int n,
                            int nh, int vd) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    CUDA_ASSERT(loom_cuda_attn_merge(out, lse_run, o, lse, n, nh, vd, c->stream));
}

static void cuda_kv_gather(loom_backend_t *be, const loom_kv_layer_t *kv, const int32_t *bt, int p0, int cn, int nkv,
                           int hd, float *rows) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    LOOM_ASSERT(!kv->block_stride && kv->block_size > 0);
    CUDA_ASSERT(loom_cuda_kv_gather(kv->k, cuda_kv_kind(kv->dtype), kv->k_scale, kv->fp8_scale[0], bt,
                                    kv->block_size, p0, cn, nkv, hd, rows, c->stream));
}

/* --- sampling ------------------------------------------------------------------------------- */

static size_t align16(size_t b) {
    return (b + 15) & ~(size_t)15;
}

static void cuda_sample_shard(loom_backend_t *be, const float *logits, int n_rows, int vocab_shard, int id_offset,
                              int vocab_size, const loom_sampling_t *params, const uint64_t *steps, const int *k,
                              loom_sample_part_t *parts) {
    cuda_backend_t *c = cu(be);
    use(c);
    LOOM_ASSERT(!c->capturing);
    shadow_clear(c);
    /* host layout: rows | hdr (n_rows, 4) | ids (total) | keys (total); the device mirrors it, plus slices */
    size_t total = 0;
    for (int r = 0; r < n_rows; r++) {
        loom_sample_mode_t mode = loom_sample_mode(&params[r], vocab_size);
        int kk = mode == LOOM_SAMPLE_FILTERED ? LOOM_MIN(k[r], vocab_shard) : 1;
        if (k[r] > 0 && vocab_shard > 0) total += (size_t)kk;
    }
    const size_t rows_b = align16((size_t)n_rows * sizeof(loom_cuda_sample_row_t));
    const size_t hdr_b = align16((size_t)n_rows * 4 * sizeof(float));
    const size_t ids_b = align16(total * sizeof(int32_t)), keys_b = align16(total * sizeof(float));
    const size_t out_b = hdr_b + ids_b + keys_b;
    const size_t slices_b = loom_cuda_sample_scratch_floats(n_rows, vocab_shard) * sizeof(float);
    if (rows_b + out_b > c->samp_host_bytes) {
        if (c->samp_host) CUDA_ASSERT(cudaFreeHost(c->samp_host));
        c->samp_host = NULL;
        c->samp_host_bytes = 0;
        size_t want = (rows_b + out_b) * 2;
        CUDA_ASSERT(cudaHostAlloc(&c->samp_host, want, cudaHostAllocDefault));
        c->samp_host_bytes = want;
    }
    uint8_t *dev = reserve(c, &c->samp, rows_b + out_b + slices_b);
    uint8_t *host = c->samp_host;
    loom_cuda_sample_row_t *hr = (loom_cuda_sample_row_t *)host;
    int any_f = 0, any_p = 0;
    size_t off = 0;
    for (int r = 0; r < n_rows; r++) {
        loom_sample_mode_t mode = loom_sample_mode(&params[r], vocab_size);
        loom_cuda_sample_row_t row = {.inv_t = 1.0f, .mode = -1, .seed = params[r].seed, .step = steps[r]};
        if (k[r] > 0 && vocab_shard > 0) {
            int kk = mode == LOOM_SAMPLE_FILTERED ? LOOM_MIN(k[r], vocab_shard) : 1;
            LOOM_ASSERT(kk <= LOOM_SAMPLE_MAX_CAND);
            row.mode = (int)mode;
            row.k = kk;
            row.out_off = (int)off;
            if (mode != LOOM_SAMPLE_GREEDY) row.inv_t = 1.0f / params[r].temperature;
            off += (size_t)kk;
            if (mode == LOOM_SAMPLE_FILTERED) any_f = 1;
            else any_p = 1;
        }
        hr[r] = row;
    }
    float *d_hdr = (float *)(dev + rows_b);
    int32_t *d_ids = (int32_t *)(dev + rows_b + hdr_b);
    float *d_keys = (float *)(dev + rows_b + hdr_b + ids_b);
    float *d_slices = (float *)(dev + rows_b + out_b);
    CUDA_ASSERT(cudaMemcpyAsync(dev, host, rows_b, cudaMemcpyHostToDevice, c->stream));
    CUDA_ASSERT(loom_cuda_sample(logits, n_rows, vocab_shard, id_offset, (const loom_cuda_sample_row_t *)dev, any_f,
                                 any_p, d_hdr, d_ids, d_keys, d_slices, c->stream));
    CUDA_ASSERT(cudaMemcpyAsync(host + rows_b, dev + rows_b, out_b, cudaMemcpyDeviceToHost, c->stream));
    CUDA_ASSERT(cudaStreamSynchronize(c->stream));
    const float *hdr = (const float *)(host + rows_b);
    const int32_t *ids = (const int32_t *)(host + rows_b + hdr_b);
    const float *keys = (const float *)(host + rows_b + hdr_b + ids_b);
    for (int r = 0; r < n_rows; r++) {
        loom_sample_part_t *p = &parts[r];
        if (hr[r].mode < 0) {
            p->max_z = -INFINITY;
            p->sum_exp = 0.0f;
            p->n = 0;
            continue;
        }
        int32_t cnt;
        memcpy(&cnt, &hdr[4 * r + 2], sizeof cnt);
        LOOM_ASSERT(cnt >= 0 && cnt <= hr[r].k);
        p->max_z = hdr[4 * r];
        p->sum_exp = hdr[4 * r + 1];
        p->n = cnt;
        memcpy(p->ids, ids + hr[r].out_off, (size_t)cnt * sizeof(int32_t));
        memcpy(p->keys, keys + hr[r].out_off, (size_t)cnt * sizeof(float));
    }
}

/* --- graphs ---------------------------------------------------------------------------------- */

static graph_slot_t *find_graph(cuda_backend_t *c, uint64_t key) {
    for (int i = 0; i < MAX_GRAPHS; i++)
        if ((c->graphs[i].exec || c->graphs[i].failed) && c->graphs[i].key == key) return &c->graphs[i];
    return NULL;
}

static graph_slot_t *free_slot(cuda_backend_t *c) {
    graph_slot_t *lru = &c->graphs[0];
    for (int i = 0; i < MAX_GRAPHS; i++) {
        graph_slot_t *g = &c->graphs[i];
        if (!g->exec && !g->failed) return g;
        if (g->used < lru->used) lru = g;
    }
    if (lru->exec) CUDA_ASSERT(cudaGraphExecDestroy(lru->exec));
    *lru = (graph_slot_t){0};
    return lru;
}

static int cuda_graph_begin(loom_backend_t *be, uint64_t key) {
    cuda_backend_t *c = cu(be);
    use(c);
    LOOM_ASSERT(!c->capturing && !c->pending);
    shadow_clear(c);
    graph_slot_t *g = find_graph(c, key);
    if (g && g->failed) return 0;
    if (g) {
        g->used = ++c->clock;
        c->pending = g;
        return 1;
    }
    cudaError_t e = cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        LOOM_WARN("%s: cannot record a graph (%s); running ops directly", c->base.name, cudaGetErrorString(e));
        g = free_slot(c);
        *g = (graph_slot_t){.key = key, .failed = 1, .used = ++c->clock};
        return 0;
    }
    c->capturing = 1;
    return 0;
}

static int cuda_graph_end(loom_backend_t *be, uint64_t key) {
    cuda_backend_t *c = cu(be);
    use(c);
    shadow_clear(c);
    if (c->pending) {
        LOOM_ASSERT(c->pending->key == key);
        CUDA_ASSERT(cudaGraphLaunch(c->pending->exec, c->stream));
        c->pending = NULL;
        c->n_replayed++;
        return 0;
    }
    if (!c->capturing) return 0;
    c->capturing = 0;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    if (e == cudaSuccess && graph) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) CUDA_ASSERT(cudaGraphDestroy(graph));
    graph_slot_t *g = free_slot(c);
    if (e != cudaSuccess || !exec) {
        (void)cudaGetLastError();
        LOOM_WARN("%s: recording a graph failed (%s); this step shape runs without one", c->base.name,
                  cudaGetErrorString(e));
        *g = (graph_slot_t){.key = key, .failed = 1, .used = ++c->clock};
        return 1; /* the recorded ops never ran */
    }
    *g = (graph_slot_t){.key = key, .exec = exec, .used = ++c->clock};
    CUDA_ASSERT(cudaGraphLaunch(exec, c->stream));
    c->n_recorded++;
    return 0;
}

static void cuda_graph_drop(loom_backend_t *be) {
    cuda_backend_t *c = cu(be);
    CUDA_ASSERT(cudaSetDevice(c->dev));
    CUDA_ASSERT(cudaStreamSynchronize(c->stream));
    drop_graphs(c);
}

/* --- lifecycle ------------------------------------------------------------------------------- */

static void cuda_destroy(loom_backend_t *be) {
    cuda_backend_t *c = cu(be);
    if (cudaSetDevice(c->dev) != cudaSuccess) (void)cudaGetLastError();
    if (c->capturing) {
        cudaGraph_t g = NULL;
        if (cudaStreamEndCapture(c->stream, &g) == cudaSuccess && g) cudaGraphDestroy(g);
        (void)cudaGetLastError();
        c->capturing = 0;
    }
    if (c->stream) (void)cudaStreamSynchronize(c->stream);
    if (c->fp8_clamped) {
        unsigned long long n = 0;
        if (cudaMemcpy(&n, c->fp8_clamped, sizeof n, cudaMemcpyDeviceToHost) == cudaSuccess && n)
            LOOM_WARN("%s: %llu fp8 KV value(s) beyond +-448 were clamped", c->base.name, n);
        (void)cudaFree(c->fp8_clamped);
    }
    for (int i = 0; i < MAX_GRAPHS; i++)
        if (c->graphs[i].exec) (void)cudaGraphExecDestroy(c->graphs[i].exec);
    for (int i = 0; i < c->n_retired; i++) (void)cudaFree(c->retired[i]);
    free(c->retired);
    dbuf_t *bufs[] = {&c->act16, &c->wdq, &c->attn_part, &c->samp, &c->lora_t, &c->qmma_part, &c->x8};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(bufs); i++)
        if (bufs[i]->p) (void)cudaFree(bufs[i]->p);
    if (c->stage_dev) (void)cudaFree(c->stage_dev);
    if (c->samp_host) (void)cudaFreeHost(c->samp_host);
    if (c->stage) (void)cudaFreeHost(c->stage);
    for (int h = 0; h < 2; h++)
        if (c->stage_ev[h]) (void)cudaEventDestroy(c->stage_ev[h]);
    if (c->blas) (void)c->blas_api->destroy(c->blas);
    for (size_t i = 0; i < LOOM_ARRAY_LEN(c->lt_plans); i++) lt_plan_clear(c, &c->lt_plans[i]);
    if (c->lt) (void)c->lt_api->destroy(c->lt);
    if (c->blas_ws) (void)cudaFree(c->blas_ws);
    if (c->stream) (void)cudaStreamDestroy(c->stream);
    if (c->xfer_stream) {
        (void)cudaStreamSynchronize(c->xfer_stream);
        (void)cudaStreamDestroy(c->xfer_stream);
        for (int i = 0; i < 2; i++) (void)cudaEventDestroy(c->xfer_ev[i]);
    }
    (void)cudaGetLastError();
    free(c);
}

static const loom_backend_ops_t cuda_ops = {
    .name = "cuda",
    .destroy = cuda_destroy,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .memset = cuda_memset,
    .copy = cuda_copy,
    .synchronize = cuda_synchronize,
    .mem_free = cuda_mem_free,
    .stream = cuda_stream,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .xfer_begin = cuda_xfer_begin,
    .xfer = cuda_xfer,
    .xfer_end = cuda_xfer_end,
    .weight_upload = cuda_weight_upload,
    .weight_free = cuda_weight_free,
    .weight_upload_quant = cuda_weight_upload_quant,
    .matmul = cuda_matmul,
    .rmsnorm = cuda_rmsnorm,
    .add = cuda_add,
    .silu_mul = cuda_silu_mul,
    .embed = cuda_gather_rows,
    .gather_rows = cuda_gather_rows,
    .moe_combine = cuda_moe_combine,
    .moe_route = cuda_moe_route,
    .moe_gemv = cuda_moe_gemv,
    .lora = cuda_lora,
    .moe_device = cuda_moe_device,
    .moe_table = cuda_moe_table,
    .moe_add_bias = cuda_moe_add_bias,
    .moe_route_ds = cuda_moe_route_ds,
    .moe_route_ds_fits = cuda_moe_route_ds_fits,
    .rope = cuda_rope,
    .kv_supported = cuda_kv_supported,
    .kv_v_dim = 1,
    .attn_lse = 1,
    .kv_write = cuda_kv_write,
    .attention = cuda_attention,
    .attn_merge = cuda_attn_merge,
    .kv_gather = cuda_kv_gather,
    .sample_shard = cuda_sample_shard,
    .add_rmsnorm = cuda_add_rmsnorm,
    .rope_kv_write = cuda_rope_kv_write,
    .add_bias = cuda_add_bias,
    .matmul_bias = cuda_matmul_bias,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_drop = cuda_graph_drop,
    .act_mul = cuda_act_mul,
    .swiglu_clamp = cuda_swiglu_clamp,
    .softcap = cuda_softcap,
    /* every capability the CPU backend has, and fp8 KV (docs/cuda.md) */
    .caps = LOOM_CAP_ATTN_WINDOW | LOOM_CAP_ATTN_SOFTCAP | LOOM_CAP_ATTN_SINKS | LOOM_CAP_LOGIT_SOFTCAP |
            LOOM_CAP_ACT | LOOM_CAP_SWIGLU_CLAMP | LOOM_CAP_MOE | LOOM_CAP_KV_BF16 | LOOM_CAP_KV_I8 |
            LOOM_CAP_KV_FP8 | LOOM_CAP_ATTN_WIDE,
};

uint32_t loom_backend_cuda_caps(void) { return cuda_ops.caps; }

int loom_backend_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { /* no driver or no device: none */
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

static loom_status_t init_device(cuda_backend_t *c, loom_err_t *err) {
    CUDA_CHECK(err, cudaSetDevice(c->dev));
    int sms = 0, optin = 0, major = 0, minor = 0;
    CUDA_CHECK(err, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c->dev));
    CUDA_CHECK(err, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->dev));
    CUDA_CHECK(err, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, c->dev));
    c->cc = 10 * major + minor;
    CUDA_CHECK(err, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c->dev));
    c->n_sms = sms;
    c->smem_optin = (size_t)optin;
    CUDA_CHECK(err, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    loom_status_t st = loom_cublas_load(&c->blas_api, err);
    if (st != LOOM_OK) return st;
    cublasStatus_t bs = c->blas_api->create(&c->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        c->blas = NULL;
        return loom_err_set(err, LOOM_ERR_INTERNAL, "%s: cuBLAS: %s", c->base.name, loom_cublas_status_str(bs));
    }
    CUDA_CHECK(err, cudaMalloc(&c->blas_ws, BLAS_WS_BYTES));
    if ((bs = c->blas_api->set_stream(c->blas, c->stream)) != CUBLAS_STATUS_SUCCESS ||
        (bs = c->blas_api->set_workspace(c->blas, c->blas_ws, BLAS_WS_BYTES)) != CUBLAS_STATUS_SUCCESS)
        return loom_err_set(err, LOOM_ERR_INTERNAL, "%s: cuBLAS: %s", c->base.name, loom_cublas_status_str(bs));
    CUDA_CHECK(err, cudaHostAlloc((void **)&c->stage, 2 * STAGE_BYTES, cudaHostAllocDefault));
    for (int h = 0; h < 2; h++) CUDA_CHECK(err, cudaEventCreateWithFlags(&c->stage_ev[h], cudaEventDisableTiming));
    CUDA_CHECK(err, loom_cuda_attention_init(c->smem_optin));
    CUDA_CHECK(err, cudaMalloc((void **)&c->fp8_clamped, sizeof *c->fp8_clamped));
    CUDA_CHECK(err, cudaMemset(c->fp8_clamped, 0, sizeof *c->fp8_clamped));
    return LOOM_OK;
}

/* The tuning table: `key value` lines ('#' starts a comment) that override
 * compiled defaults, written by tests/gpu/run.sh from its measurements
 * (docs/cuda.md, "Tuning"). Read from $LOOM_CUDA_TUNING, else from
 * loom-cuda-tuning.tsv next to the binary; no file: the defaults. Keys:
 *   attn_split_waves  waves of blocks per SM the attention splits aim at (2)
 *   attn_tile_min_n   fewest tokens of a step that use the tile kernel (9)
 *   qgemv_max_n       largest n of the quantized GEMV, every scheme (per scheme)
 *   gemv_variant      the decode GEMV's rows per warp and loads in flight (0; opmath.h)
 *   qgemv_variant     the same for the quantized GEMV (0; opmath.h)
 *   qmma_max_n        largest n of the quantized tensor-core kernel (LOOM_CUDA_QMMA_MAX_N, 0: off)
 *   fp8_gemm          1: FP8 prefill GEMMs through cuBLASLt, x quantized per token (0; fp8act.h)
 *   lt_bias           1: biased prefill GEMMs through cuBLASLt's bias epilogue (0)
 *   attn_prefill_variant  the kernel of prefill chunks: 0 the tile kernel, 1 the
 *                     FA2-style kernel where it applies (0; flash.h) */
static void read_tuning(cuda_backend_t *c) {
    char path[4096];
    const char *env = getenv("LOOM_CUDA_TUNING");
    if (env && *env) {
        snprintf(path, sizeof path, "%s", env);
    } else {
        ssize_t len = readlink("/proc/self/exe", path, sizeof path - 32);
        if (len <= 0) return;
        path[len] = 0;
        char *slash = strrchr(path, '/');
        if (!slash) return;
        strcpy(slash + 1, "loom-cuda-tuning.tsv");
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        if (env && *env) LOOM_WARN("%s: cannot read the tuning table %s; using the defaults", c->base.name, path);
        return;
    }
    char line[256];
    int n_set = 0;
    while (fgets(line, sizeof line, f)) {
        char key[64];
        long v;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        if (sscanf(line, "%63s", key) != 1) continue; /* blank */
        if (sscanf(line, "%63s %ld", key, &v) != 2 || v < -1 || v > 4096) {
            LOOM_WARN("%s: %s: ignoring the line '%s'", c->base.name, path, key);
            continue;
        }
        if (!strcmp(key, "attn_split_waves") && v >= 1 && v <= 16) c->attn_split_waves = (int)v;
        else if (!strcmp(key, "attn_tile_min_n") && v >= 2) c->attn_tile_min_n = (int)v;
        else if (!strcmp(key, "qgemv_max_n") && v >= -1) c->qgemv_max_n = v < 0 ? -1 : (int)LOOM_MIN(v, LOOM_CUDA_QGEMV_MAX_N);
        else if (!strcmp(key, "gemv_variant") && v >= 0 && v < LOOM_OM_GEMV_VARIANTS) c->gemv_variant = (int)v;
        else if (!strcmp(key, "qgemv_variant") && v >= 0 && v < LOOM_OM_QGEMV_VARIANTS) c->qgemv_variant = (int)v;
        else if (!strcmp(key, "qmma_max_n") && v >= -1) c->qmma_max_n = v < 0 ? -1 : (int)LOOM_MIN(v, LOOM_QM_MAX_N);
        else if (!strcmp(key, "fp8_gemm") && (v == 0 || v == 1)) c->fp8_gemm = (int)v;
        else if (!strcmp(key, "lt_bias") && (v == 0 || v == 1)) c->lt_bias = (int)v;
        else if (!strcmp(key, "attn_prefill_variant") && v >= 0 && v < LOOM_FA_VARIANTS) c->attn_prefill_variant = (int)v;
        else {
            LOOM_WARN("%s: %s: unknown key or value out of range: %s %ld", c->base.name, path, key, v);
            continue;
        }
        n_set++;
    }
    fclose(f);
    LOOM_INFO("%s: tuning table %s (%d value%s)", c->base.name, path, n_set, n_set == 1 ? "" : "s");
}

loom_status_t loom_backend_cuda_create(const loom_backend_config_t *cfg, loom_backend_t **out, loom_err_t *err) {
    *out = NULL;
    int count = loom_backend_cuda_device_count();
    if (count <= 0)
        return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "cuda:%d requested, but no CUDA device is available",
                            cfg->device_index);
    if (cfg->device_index < 0 || cfg->device_index >= count)
        return loom_err_set(err, LOOM_ERR_INVALID_ARGUMENT, "cuda:%d requested, but this machine has %d device%s",
                            cfg->device_index, count, count == 1 ? "" : "s");
    loom_dtype_t dt = cfg->weight_dtype;
    if (dt == LOOM_DT_F32 && !cfg->exact_f32) dt = LOOM_DT_BF16;
    if (dt != LOOM_DT_F32 && dt != LOOM_DT_BF16 && dt != LOOM_DT_F16)
        return loom_err_set(err, LOOM_ERR_UNSUPPORTED, "cuda backend: weight dtype %s (supported: F32, BF16, F16)",
                            loom_dtype_name(dt));
    cuda_backend_t *c = calloc(1, sizeof *c);
    if (!c) return loom_err_set(err, LOOM_ERR_NOMEM, "cuda backend: out of memory");
    c->base.ops = &cuda_ops;
    c->base.cfg = *cfg;
    c->base.cfg.kind = LOOM_DEVICE_CUDA;
    c->base.cfg.weight_dtype = dt;
    snprintf(c->base.name, sizeof c->base.name, "cuda:%d", cfg->device_index);
    c->dev = cfg->device_index;
    c->qgemv_max_n = -1;
    c->qmma_max_n = -1;
    c->lt_bias = 0; /* off until a device ran it right (run.sh's tune writes lt_bias 1) */
    c->wkind = kind_of(dt);
    read_tuning(c);
    loom_status_t s = init_device(c, err);
    if (s < 0) {
        cuda_destroy(&c->base);
        return s;
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, c->dev) == cudaSuccess) {
        LOOM_INFO("%s: %s, %d SMs, %.1f GB, weights stored as %s", c->base.name, prop.name, c->n_sms,
                  (double)prop.totalGlobalMem / 1e9, loom_dtype_name(dt));
    } else {
        (void)cudaGetLastError();
    }
    *out = &c->base;
    return LOOM_OK;
}

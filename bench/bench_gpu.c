/* Decode and prefill on cuda:0 with a random model built directly in device
 * memory (default: Llama-3-8B shape in bf16, 15 GB of weights generated in
 * milliseconds, no checkpoint), against two ceilings measured in the same
 * run:
 *   - copy bandwidth: cudaMemcpy device-to-device of 2 GiB, bytes read plus
 *     written, best of 10. Batch-1 decode is memory-bound: MBU = bytes a step
 *     must read (every matmul weight and norm once, one embedding row per
 *     token, the KV cache of each sequence) / step time / copy bandwidth.
 *   - cuBLAS rate: the four GEMMs of a layer at the prefill length with bf16
 *     inputs and f32 output (what the backend calls), best of 5. Prefill
 *     ratio = time of those GEMMs x layers / time of the whole prefill.
 * The forward pass is model.c's op sequence; decode steps run as CUDA
 * graphs (one per batch size), and sample greedily on the device. Variants:
 * model.c's ops as they are, the fused ops (add + RMSNorm, RoPE + KV write),
 * and without graphs. With --quantization the matmul weights are a
 * quantized scheme (kernels/quant.h; random codes and scales made on the
 * device) and MBU counts the quantized bytes.
 *
 * --quant-gemv LIST measures the quantized matmul alone, per scheme, on the
 * MLP shapes of the model (gate+up and down): GEMV at n = 1 and 8 as GB/s
 * of weight bytes read and its ratio to the copy bandwidth, and the prefill
 * (dequantize + cuBLAS) at the prefill length against the bf16 GEMM; above
 * the GEMV, n = 8..64 through the small-n tensor-core kernel (qmma.cu)
 * against dequantize + cuBLAS (the tuning table's qmma_max_n).
 * --mla HEADS times DeepSeek-V3's absorbed latent attention alone (the wide
 * kernel: 576-wide rows, one KV head, V the same memory): decode at
 * --batches with context --ctx (latent GB/s against the copy bandwidth) and
 * a prefill of --prefill tokens (TFLOP/s).
 * --skip-model runs only those (and the copy bandwidth).
 *
 *   bench_gpu [--layers 32] [--dim 4096] [--heads 32] [--kv-heads 8] [--hidden 14336]
 *             [--vocab 128256] [--dtype bf16] [--quantization SCHEME] [--ctx 1024] [--tokens 32]
 *             [--prefill 512] [--batches 1,8,32] [--quant-gemv int8,fp8,q4,...] [--skip-model]
 *             [--json FILE] */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/util.h"
#include "kernels/backend.h"
#include "kernels/cuda/backend_cuda.h"

#define B_SIZE 16

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "bench_gpu: %s failed at %s:%d: %s\n", #call, __FILE__, __LINE__,      \
                    cudaGetErrorString(e_));                                                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

typedef struct layer {
    float *attn_norm, *ffn_norm; /* (dim) */
    loom_weight_t wqkv, wo, w13, w2;
    loom_kv_layer_t kv; /* (n_blocks, B, nkv, hd) f32 */
} layer_t;

typedef struct bench {
    loom_backend_t *be;
    int layers, dim, nh, nkv, hd, hidden, vocab, qkv_dim, max_tokens, max_rows, n_blocks;
    layer_t *ly;
    float *embed, *final_norm, *inv_freq;
    loom_weight_t head;
    float *x, *xb, *xb2, *qkv, *att, *gu, *hb, *xl, *logits;
    int32_t *meta_h, *meta_d;
    double weight_bytes; /* read per step: matmul weights and norms */
    double params;       /* matmul parameters */
    loom_quant_spec_t quant; /* matmul weights' scheme (NONE: bf16/f16) */
} bench_t;

static void *dalloc(bench_t *b, size_t bytes) {
    void *p = loom_backend_alloc(b->be, bytes);
    if (!p) {
        fprintf(stderr, "bench_gpu: out of device memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static void weight(bench_t *b, loom_weight_t *w, int64_t rows, int64_t cols, uint64_t seed) {
    loom_err_t err = {0};
    const float scale = 1.0f / sqrtf((float)cols);
    loom_status_t st = b->quant.quant == LOOM_QUANT_NONE
                           ? loom_cuda_weight_random(b->be, w, rows, cols, seed, scale, &err)
                           : loom_cuda_weight_random_quant(b->be, w, &b->quant, rows, cols, seed, scale, &err);
    if (st < 0) {
        fprintf(stderr, "bench_gpu: %s\n", err.msg);
        exit(1);
    }
    b->weight_bytes += (double)loom_weight_bytes(w);
    b->params += (double)rows * (double)cols;
}

static float *vec(bench_t *b, size_t n, uint64_t seed, float lo, float hi) {
    float *p = dalloc(b, n * sizeof(float));
    loom_cuda_fill_uniform(b->be, p, n, seed, lo, hi);
    return p;
}

static void build(bench_t *b) {
    size_t T = (size_t)b->max_tokens, R = (size_t)b->max_rows;
    b->qkv_dim = (b->nh + 2 * b->nkv) * b->hd;
    b->ly = loom_xcalloc((size_t)b->layers, sizeof *b->ly);
    size_t per = (size_t)b->n_blocks * B_SIZE * b->nkv * b->hd;
    for (int l = 0; l < b->layers; l++) {
        layer_t *y = &b->ly[l];
        y->attn_norm = vec(b, (size_t)b->dim, 100 + l, 0.9f, 1.1f);
        y->ffn_norm = vec(b, (size_t)b->dim, 200 + l, 0.9f, 1.1f);
        b->weight_bytes += 2.0 * b->dim * 4;
        weight(b, &y->wqkv, b->qkv_dim, b->dim, 1000 + 4 * (uint64_t)l);
        weight(b, &y->wo, b->dim, (int64_t)b->nh * b->hd, 1001 + 4 * (uint64_t)l);
        weight(b, &y->w13, 2 * (int64_t)b->hidden, b->dim, 1002 + 4 * (uint64_t)l);
        weight(b, &y->w2, b->dim, b->hidden, 1003 + 4 * (uint64_t)l);
        y->kv = (loom_kv_layer_t){.k = vec(b, per, 300 + l, -1.0f, 1.0f),
                                  .v = vec(b, per, 400 + l, -1.0f, 1.0f), .dtype = LOOM_DT_F32};
    }
    b->embed = vec(b, (size_t)b->vocab * b->dim, 7, -0.05f, 0.05f);
    b->final_norm = vec(b, (size_t)b->dim, 8, 0.9f, 1.1f);
    b->weight_bytes += b->dim * 4.0;
    weight(b, &b->head, b->vocab, b->dim, 9);
    float inv[512];
    for (int j = 0; j < b->hd / 2; j++) inv[j] = (float)pow(500000.0, -2.0 * j / b->hd);
    b->inv_freq = dalloc(b, (size_t)b->hd / 2 * 4);
    loom_backend_upload(b->be, b->inv_freq, inv, (size_t)b->hd / 2 * 4);
    b->x = dalloc(b, T * b->dim * 4);
    b->xb = dalloc(b, T * b->dim * 4);
    b->xb2 = dalloc(b, T * b->dim * 4);
    b->qkv = dalloc(b, T * b->qkv_dim * 4);
    b->att = dalloc(b, T * b->nh * b->hd * 4);
    b->gu = dalloc(b, T * 2 * b->hidden * 4);
    b->hb = dalloc(b, T * b->hidden * 4);
    b->xl = dalloc(b, R * b->dim * 4);
    b->logits = dalloc(b, R * b->vocab * 4);
    size_t meta = 4 * T + R + R * 256;
    b->meta_h = loom_xmalloc(meta * 4);
    b->meta_d = dalloc(b, meta * 4);
}

/* One step, model.c's sequence of ops (fused: the residual add with the next
 * norm, RoPE with the KV write). Metadata: tokens, pos, slots, tok_seq (n
 * each), logit rows (nl), block tables (n_seqs, mb), already uploaded. */
static void forward(bench_t *b, int n, int nl, int mb, int fused) {
    loom_backend_t *be = b->be;
    const int dim = b->dim, hd = b->hd, nh = b->nh, nkv = b->nkv, qd = b->qkv_dim;
    const int32_t *d_tok = b->meta_d, *d_pos = d_tok + n, *d_slots = d_tok + 2 * n, *d_seq = d_tok + 3 * n;
    const int32_t *d_rows = d_tok + 4 * n, *d_bt = d_rows + nl;
    loom_op_embed(be, b->x, b->embed, d_tok, n, dim);
    for (int l = 0; l < b->layers; l++) {
        layer_t *y = &b->ly[l];
        if (!fused || l == 0) loom_op_rmsnorm(be, b->xb, b->x, y->attn_norm, n, dim, 1e-5f);
        loom_op_matmul(be, b->qkv, b->xb, &y->wqkv, n);
        float *q = b->qkv, *k = q + nh * hd, *v = k + nkv * hd;
        if (fused) {
            loom_op_rope_kv_write(be, q, k, v, qd, n, nh, nkv, hd, d_pos, b->inv_freq, &y->kv, d_slots);
        } else {
            loom_op_rope(be, q, qd, n, nh, hd, d_pos, b->inv_freq);
            loom_op_rope(be, k, qd, n, nkv, hd, d_pos, b->inv_freq);
            loom_op_kv_write(be, &y->kv, k, v, qd, d_slots, n, nkv, hd);
        }
        loom_attn_args_t a = {.n = n, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd,
                              .scale = 1.0f / sqrtf((float)hd), .q = q, .q_stride = qd, .out = b->att,
                              .out_stride = nh * hd, .kv = y->kv,
                              .block_size = B_SIZE, .tok_seq = d_seq, .tok_pos = d_pos, .block_tables = d_bt,
                              .max_blocks = mb, .max_ctx = mb * B_SIZE};
        loom_op_attention(be, &a);
        loom_op_matmul(be, b->xb2, b->att, &y->wo, n);
        if (fused) {
            loom_op_add_rmsnorm(be, b->x, b->xb2, b->xb, y->ffn_norm, n, dim, 1e-5f);
        } else {
            loom_op_add(be, b->x, b->xb2, (int64_t)n * dim);
            loom_op_rmsnorm(be, b->xb, b->x, y->ffn_norm, n, dim, 1e-5f);
        }
        loom_op_matmul(be, b->gu, b->xb, &y->w13, n);
        loom_op_silu_mul(be, b->hb, b->gu, n, b->hidden);
        loom_op_matmul(be, b->xb2, b->hb, &y->w2, n);
        if (fused && l + 1 < b->layers)
            loom_op_add_rmsnorm(be, b->x, b->xb2, b->xb, b->ly[l + 1].attn_norm, n, dim, 1e-5f);
        else
            loom_op_add(be, b->x, b->xb2, (int64_t)n * dim);
    }
    if (nl > 0) {
        loom_op_gather_rows(be, b->xl, b->x, d_rows, nl, dim);
        loom_op_rmsnorm(be, b->xl, b->xl, b->final_norm, nl, dim, 1e-5f);
        loom_op_matmul(be, b->logits, b->xl, &b->head, nl);
    }
}

/* Sequences s0..s0+ns-1 own blocks [s * per_seq, (s + 1) * per_seq). */
typedef struct batch {
    int ns, per_seq, s0;
    int32_t *ctx;  /* (ns) tokens in the cache */
    int32_t *next; /* (ns) next token */
} batch_t;

static int upload_step(bench_t *b, const batch_t *bt, int seq, int p0, int n_prefill, int *n_out, int *nl_out) {
    int32_t *h = b->meta_h;
    int n = n_prefill ? n_prefill : bt->ns, nl = n_prefill ? 1 : bt->ns, ns = n_prefill ? 1 : bt->ns;
    int mb = 16;
    while (mb < bt->per_seq) mb *= 2;
    for (int i = 0; i < n; i++) {
        int s = n_prefill ? seq : i, p = n_prefill ? p0 + i : bt->ctx[i];
        int blk = (bt->s0 + s) * bt->per_seq + p / B_SIZE;
        h[i] = n_prefill ? (int32_t)((p * 7919u + 13u) % (unsigned)b->vocab) : bt->next[i];
        h[n + i] = p;
        h[2 * n + i] = blk * B_SIZE + p % B_SIZE;
        h[3 * n + i] = n_prefill ? 0 : i;
    }
    for (int i = 0; i < nl; i++) h[4 * n + i] = n_prefill ? n - 1 : i;
    for (int r = 0; r < ns; r++) {
        int s = n_prefill ? seq : r;
        for (int j = 0; j < mb; j++) h[4 * n + nl + r * mb + j] = j < bt->per_seq ? (bt->s0 + s) * bt->per_seq + j : -1;
    }
    loom_backend_upload(b->be, b->meta_d, h, (size_t)(4 * n + nl + ns * mb) * 4);
    *n_out = n;
    *nl_out = nl;
    return mb;
}

static double now_s(void) {
    return loom_now_s();
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Device-to-device copy bandwidth, GB/s counting reads and writes. */
static double copy_gbs(bench_t *b) {
    size_t bytes = (size_t)2 << 30;
    void *src = dalloc(b, bytes), *dst = dalloc(b, bytes);
    cudaStream_t s = loom_backend_stream(b->be);
    loom_backend_memset(b->be, src, 1, bytes);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double best = 0;
    for (int i = 0; i < 12; i++) {
        CK(cudaEventRecord(e0, s));
        CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 2) best = fmax(best, 2.0 * (double)bytes / (ms * 1e-3) / 1e9);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    loom_backend_free(b->be, src);
    loom_backend_free(b->be, dst);
    return best;
}

/* Seconds of one layer's four GEMMs at m tokens through cuBLAS (bf16 in,
 * f32 out, f32 compute), best of 5. */
static double gemm_layer_s(bench_t *b, int m, cudaDataType_t dt) {
    const int shapes[4][2] = {{b->qkv_dim, b->dim}, {b->dim, b->nh * b->hd}, {2 * b->hidden, b->dim}, {b->dim, b->hidden}};
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "bench_gpu: cublasCreate failed\n");
        exit(1);
    }
    cudaStream_t s = loom_backend_stream(b->be);
    cublasSetStream(h, s);
    size_t maxk = (size_t)LOOM_MAX(b->hidden, b->dim), maxn = (size_t)2 * b->hidden;
    void *x = dalloc(b, (size_t)m * maxk * 2);
    float *y = dalloc(b, (size_t)m * maxn * 4);
    loom_backend_memset(b->be, x, 0x3c, (size_t)m * maxk * 2); /* 0x3c3c: 0.0115 in bf16, 1.06 in f16 */
    /* quantized layers hold codes, not bf16: cuBLAS then reads one dense
     * scratch matrix of the largest shape (the timing does not depend on
     * the values) */
    const void *ws[4] = {b->ly[0].wqkv.data, b->ly[0].wo.data, b->ly[0].w13.data, b->ly[0].w2.data};
    void *dense = NULL;
    if (b->quant.quant != LOOM_QUANT_NONE) {
        size_t maxw = 0;
        for (int g = 0; g < 4; g++) maxw = LOOM_MAX(maxw, (size_t)shapes[g][0] * shapes[g][1]);
        dense = dalloc(b, maxw * 2);
        loom_backend_memset(b->be, dense, 0x3c, maxw * 2);
        for (int g = 0; g < 4; g++) ws[g] = dense;
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const float one = 1.0f, zero = 0.0f;
    double best = 1e30;
    for (int rep = 0; rep < 7; rep++) {
        CK(cudaEventRecord(e0, s));
        for (int g = 0; g < 4; g++)
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, shapes[g][0], m, shapes[g][1], &one, ws[g], dt,
                         shapes[g][1], x, dt, shapes[g][1], &zero, y, CUDA_R_32F, shapes[g][0], CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep >= 2) best = fmin(best, ms * 1e-3);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    cublasDestroy(h);
    loom_backend_free(b->be, x);
    loom_backend_free(b->be, y);
    if (dense) loom_backend_free(b->be, dense);
    return best;
}

/* Prefills every sequence of the batch to ctx tokens, in chunks. */
static void prefill_batch(bench_t *b, batch_t *bt, int ctx, int chunk) {
    for (int s = 0; s < bt->ns; s++) {
        for (int p0 = 0; p0 < ctx; p0 += chunk) {
            int n, nl, c = LOOM_MIN(chunk, ctx - p0);
            int mb = upload_step(b, bt, s, p0, c, &n, &nl);
            forward(b, n, nl, mb, 1);
        }
        bt->ctx[s] = ctx;
        bt->next[s] = (int32_t)(s * 31 % b->vocab);
    }
}

typedef struct result {
    const char *name;
    int batch;
    double step_s, tok_s, gbs, mbu;
} result_t;

/* Decode steps at batch bt->ns: forward (as a graph when asked) + device greedy sampling. */
static result_t decode(bench_t *b, batch_t *bt, int tokens, int graphs, int fused, double copy, const char *name) {
    int ns = bt->ns;
    loom_sampling_t *sp = loom_xcalloc((size_t)ns, sizeof *sp);
    uint64_t *steps = loom_xcalloc((size_t)ns, sizeof *steps);
    int *k = loom_xmalloc((size_t)ns * sizeof *k);
    loom_sample_part_t *parts = loom_xcalloc((size_t)ns, sizeof *parts);
    int32_t *ids = loom_xmalloc((size_t)ns * 4);
    float *keys = loom_xmalloc((size_t)ns * 4);
    for (int i = 0; i < ns; i++) {
        k[i] = 1;
        parts[i].ids = ids + i;
        parts[i].keys = keys + i;
    }
    double *t = loom_xmalloc((size_t)(tokens + 3) * sizeof *t);
    double kv_bytes = 0;
    for (int it = 0; it < tokens + 3; it++) {
        double t0 = now_s();
        int n, nl, mb = upload_step(b, bt, 0, 0, 0, &n, &nl);
        uint64_t key = (uint64_t)n | (uint64_t)fused << 24 | (uint64_t)mb << 32;
        int replay = graphs && loom_backend_graph_begin(b->be, key);
        if (!replay) forward(b, n, nl, mb, fused);
        if (graphs && loom_backend_graph_end(b->be, key)) forward(b, n, nl, mb, fused);
        loom_op_sample_shard(b->be, b->logits, ns, b->vocab, 0, b->vocab, sp, steps, k, parts);
        t[it] = now_s() - t0;
        if (it == 3) {
            kv_bytes = 0;
            for (int i = 0; i < ns; i++) kv_bytes += (double)(bt->ctx[i] + 1) * b->nkv * b->hd * 4.0 * 2 * b->layers;
        }
        for (int i = 0; i < ns; i++) {
            bt->next[i] = ids[i];
            bt->ctx[i]++;
        }
    }
    result_t r = {.name = name, .batch = ns};
    r.step_s = median(t + 3, tokens); /* the first steps record the graph */
    r.tok_s = ns / r.step_s;
    double bytes = b->weight_bytes + kv_bytes + (double)ns * b->dim * 4;
    r.gbs = bytes / r.step_s / 1e9;
    r.mbu = r.gbs / copy;
    free(sp), free(steps), free(k), free(parts), free(ids), free(keys), free(t);
    return r;
}

/* Seconds per loom_op_matmul of w at n rows of x, median of `reps` (after warm-up). */
static double time_matmul(bench_t *b, const loom_weight_t *w, const float *x, float *y, int n, int reps) {
    cudaStream_t s = loom_backend_stream(b->be);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double t[64];
    reps = LOOM_MIN(reps, 64);
    for (int i = 0; i < reps + 2; i++) {
        CK(cudaEventRecord(e0, s));
        loom_op_matmul(b->be, y, x, w, n);
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 2) t[i - 2] = ms * 1e-3;
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return median(t, reps);
}

typedef struct qresult {
    char scheme[16];
    const char *shape;
    double gemv1_gbs, gemv8_gbs, prefill_ratio;
    /* the crossover: GB/s of weight bytes at each of kCrossN through the
     * GEMV kernel and through dequantize + cuBLAS */
    double gemv_gbs[6], deq_gbs[6];
    /* above the GEMV: the small-n tensor-core kernel (qmma.cu) against
     * dequantize + cuBLAS at each of kMmaN (GB/s of weight bytes) */
    double mma_gbs[6], mma_deq_gbs[6];
    /* FP8 only: the prefill through cuBLASLt's FP8 GEMM (fp8_gemm on; x
     * quantized per token) against bf16 weights; 0 when it was not taken */
    double fp8_gemm_ratio;
} qresult_t;

static const int kCrossN[6] = {1, 2, 3, 4, 6, 8};
static const int kMmaN[6] = {8, 16, 24, 32, 48, 64};

/* The quantized matmul alone on the MLP shapes: GEMV GB/s (weight bytes read
 * per second) at n = 1 and 8, and prefill time against bf16 weights. */
static int quant_gemv(bench_t *b, const char *list, int prefill, double copy, qresult_t *out, int max) {
    const int64_t shapes[2][2] = {{2 * (int64_t)b->hidden, b->dim}, {b->dim, b->hidden}};
    const char *names[2] = {"gate+up", "down"};
    const size_t maxk = (size_t)LOOM_MAX(b->hidden, b->dim), maxn = (size_t)2 * b->hidden;
    float *x = dalloc(b, (size_t)prefill * maxk * 4), *y = dalloc(b, (size_t)prefill * maxn * 4);
    loom_cuda_fill_uniform(b->be, x, (size_t)prefill * maxk, 5, -1.0f, 1.0f);
    int nq = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    printf("\nquantized matmul alone (GB/s of weight bytes read; MBU vs copy %.0f GB/s):\n", copy);
    printf("  %-12s %-8s %10s %6s %10s %6s %14s\n", "scheme", "shape", "n=1 GB/s", "MBU", "n=8 GB/s", "MBU",
           "prefill/bf16");
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && nq < max; tok = strtok_r(NULL, ",", &save)) {
        loom_quant_spec_t spec;
        if (!loom_quant_spec_parse(tok, &spec) || spec.quant == LOOM_QUANT_NONE) {
            fprintf(stderr, "bench_gpu: unknown scheme '%s' in --quant-gemv\n", tok);
            continue;
        }
        for (int h = 0; h < 2 && nq < max; h++) {
            loom_weight_t wq, wb;
            loom_err_t err = {0};
            const float scale = 1.0f / sqrtf((float)shapes[h][1]);
            if (loom_cuda_weight_random_quant(b->be, &wq, &spec, shapes[h][0], shapes[h][1], 77, scale, &err) < 0) {
                printf("  %-12s %-8s skipped: %s\n", tok, names[h], err.msg);
                break;
            }
            if (loom_cuda_weight_random(b->be, &wb, shapes[h][0], shapes[h][1], 78, scale, &err) < 0) {
                fprintf(stderr, "bench_gpu: %s\n", err.msg);
                exit(1);
            }
            qresult_t *r = &out[nq++];
            snprintf(r->scheme, sizeof r->scheme, "%s", tok);
            r->shape = names[h];
            const double bytes = (double)loom_weight_bytes(&wq);
            for (int i = 0; i < 6; i++) {
                loom_cuda_set_qgemv_max_n(b->be, 8);
                r->gemv_gbs[i] = bytes / time_matmul(b, &wq, x, y, kCrossN[i], 20) / 1e9;
                loom_cuda_set_qgemv_max_n(b->be, 0);
                r->deq_gbs[i] = bytes / time_matmul(b, &wq, x, y, kCrossN[i], 20) / 1e9;
            }
            loom_cuda_set_qgemv_max_n(b->be, 0);
            for (int i = 0; i < 6; i++) {
                loom_cuda_set_qmma_max_n(b->be, 64);
                r->mma_gbs[i] = bytes / time_matmul(b, &wq, x, y, kMmaN[i], 20) / 1e9;
                loom_cuda_set_qmma_max_n(b->be, 0);
                r->mma_deq_gbs[i] = bytes / time_matmul(b, &wq, x, y, kMmaN[i], 20) / 1e9;
            }
            loom_cuda_set_qmma_max_n(b->be, -1);
            loom_cuda_set_qgemv_max_n(b->be, -1);
            r->gemv1_gbs = r->gemv_gbs[0];
            r->gemv8_gbs = r->gemv_gbs[5];
            const double bf16_s = time_matmul(b, &wb, x, y, prefill, 5);
            r->prefill_ratio = bf16_s / time_matmul(b, &wq, x, y, prefill, 5);
            r->fp8_gemm_ratio = 0.0;
            if (spec.quant == LOOM_QUANT_FP8) {
                loom_cuda_set_fp8_gemm(b->be, 1);
                const uint64_t before = loom_cuda_fp8_gemm_count(b->be);
                const double lt_s = time_matmul(b, &wq, x, y, prefill, 5);
                if (loom_cuda_fp8_gemm_count(b->be) > before) r->fp8_gemm_ratio = bf16_s / lt_s;
                loom_cuda_set_fp8_gemm(b->be, 0);
                printf("  %-12s %-8s prefill through cuBLASLt FP8: %s%.2f of bf16's speed\n", "", "",
                       r->fp8_gemm_ratio > 0 ? "" : "not taken (see the log) ", r->fp8_gemm_ratio);
            }
            printf("  %-12s %-8s %10.0f %6.3f %10.0f %6.3f %14.2f\n", tok, names[h], r->gemv1_gbs, r->gemv1_gbs / copy,
                   r->gemv8_gbs, r->gemv8_gbs / copy, r->prefill_ratio);
            printf("  %-12s %-8s GB/s at n =", "", "");
            for (int i = 0; i < 6; i++) printf(" %d: %.0f|%.0f", kCrossN[i], r->gemv_gbs[i], r->deq_gbs[i]);
            printf("  (GEMV|dequant+cuBLAS)\n");
            printf("  %-12s %-8s GB/s at n =", "", "");
            for (int i = 0; i < 6; i++) printf(" %d: %.0f|%.0f", kMmaN[i], r->mma_gbs[i], r->mma_deq_gbs[i]);
            printf("  (tensor-core qmma|dequant+cuBLAS)\n");
            loom_weight_free(b->be, &wq);
            loom_weight_free(b->be, &wb);
        }
    }
    loom_backend_free(b->be, x);
    loom_backend_free(b->be, y);
    return nq;
}

/* --- DeepSeek's latent attention alone (--mla) ------------------------------------------------- */

typedef struct mla_result {
    int heads, batch, tokens; /* tokens > batch: a prefill of that many tokens of one sequence */
    double call_s, gbs, tflops;
} mla_result_t;

static int parse_list(const char *s, int *out, int max);

/* The absorbed MLA attention of DeepSeek-V3 (attention.cu's wide kernel):
 * MQA of `heads` query heads over one latent KV head of 576 values (512 +
 * 64), V the same memory as K, a bf16 cache. Decode at each batch with
 * context ctx (latent GB/s = cache bytes read / call time, against the copy
 * bandwidth), and a prefill of `prefill` tokens of one sequence (TFLOP/s of
 * its scores and values). */
static int mla_bench(bench_t *b, const char *heads_s, const int *batches, int nb, int ctx, int prefill,
                     mla_result_t *out, int max) {
    enum { HD = 576, CHUNK = 4096, REPS = 10 };
    int heads[8], nh = parse_list(heads_s, heads, 8), max_batch = 1, max_h = 1, n = 0;
    for (int i = 0; i < nb; i++) max_batch = LOOM_MAX(max_batch, batches[i]);
    for (int i = 0; i < nh; i++) max_h = LOOM_MAX(max_h, heads[i]);
    prefill = LOOM_MIN(prefill, ctx);
    const int per_seq = (ctx + B_SIZE - 1) / B_SIZE, max_tok = LOOM_MAX(max_batch, prefill);
    const size_t cells = (size_t)max_batch * per_seq * B_SIZE;
    loom_backend_t *be = b->be;
    cudaStream_t st = loom_backend_stream(be);
    loom_kv_layer_t kv = {.k = dalloc(b, cells * HD * 2), .dtype = LOOM_DT_BF16};
    kv.v = kv.k; /* the latent layout */
    float *src = vec(b, (size_t)CHUNK * HD, 7, -1.0f, 1.0f);
    int32_t *ih = loom_xmalloc((size_t)LOOM_MAX(CHUNK, max_batch * per_seq) * 4), *slots = dalloc(b, CHUNK * 4);
    for (size_t c0 = 0; c0 < cells; c0 += CHUNK) { /* the cache through kv_write, a chunk of rows at a time */
        const int k = (int)LOOM_MIN((size_t)CHUNK, cells - c0);
        for (int i = 0; i < k; i++) ih[i] = (int32_t)(c0 + (size_t)i);
        loom_backend_upload(be, slots, ih, (size_t)k * 4);
        loom_op_kv_write(be, &kv, src, src, HD, slots, k, 1, HD);
    }
    int32_t *bt = dalloc(b, (size_t)max_batch * per_seq * 4), *seq = dalloc(b, (size_t)max_tok * 4),
            *pos = dalloc(b, (size_t)max_tok * 4), *sh = loom_xmalloc((size_t)max_tok * 4),
            *ph = loom_xmalloc((size_t)max_tok * 4);
    for (int i = 0; i < max_batch * per_seq; i++) ih[i] = i;
    loom_backend_upload(be, bt, ih, (size_t)max_batch * per_seq * 4);
    float *q = vec(b, (size_t)max_tok * max_h * HD, 8, -0.05f, 0.05f), *o = dalloc(b, (size_t)max_tok * max_h * HD * 4);
    for (int h = 0; h < nh && n < max; h++)
        for (int i = 0; i <= nb && n < max; i++) {
            const int pre = i == nb, toks = pre ? prefill : batches[i];
            for (int t = 0; t < toks; t++) sh[t] = pre ? 0 : t, ph[t] = pre ? t : ctx - 1;
            loom_backend_upload(be, seq, sh, (size_t)toks * 4);
            loom_backend_upload(be, pos, ph, (size_t)toks * 4);
            loom_attn_args_t a = {.n = toks, .n_heads = heads[h], .n_kv_heads = 1, .head_dim = HD,
                                  .scale = 0.1352f / sqrtf(192.0f), .q = q, .q_stride = heads[h] * HD, .out = o,
                                  .out_stride = heads[h] * HD, .kv = kv, .block_size = B_SIZE, .tok_seq = seq,
                                  .tok_pos = pos, .block_tables = bt, .max_blocks = per_seq, .max_ctx = ctx};
            loom_op_attention(be, &a); /* warm-up */
            CK(cudaStreamSynchronize(st));
            double s0 = now_s();
            for (int r = 0; r < REPS; r++) loom_op_attention(be, &a);
            CK(cudaStreamSynchronize(st));
            const double t = (now_s() - s0) / REPS;
            const double keys = pre ? (double)toks * (toks + 1) / 2 : (double)toks * ctx;
            out[n++] = (mla_result_t){.heads = heads[h], .batch = pre ? 1 : toks, .tokens = toks, .call_s = t,
                                      .gbs = pre ? 0.0 : keys * HD * 2 / t / 1e9,
                                      .tflops = keys * heads[h] * 2.0 * (HD + HD) / t / 1e12};
        }
    loom_backend_free(be, kv.k), loom_backend_free(be, src), loom_backend_free(be, slots);
    loom_backend_free(be, bt), loom_backend_free(be, seq), loom_backend_free(be, pos);
    loom_backend_free(be, q), loom_backend_free(be, o);
    free(ih), free(sh), free(ph);
    return n;
}

static int parse_list(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 4096) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

int main(int argc, char **argv) {
    loom_log_init("bench_gpu");
    bench_t b = {.layers = 32, .dim = 4096, .nh = 32, .nkv = 8, .hd = 128, .hidden = 14336, .vocab = 128256};
    const char *dtype = "bf16", *batches_s = "1,8,32", *json = NULL, *quant_s = "none", *qgemv_s = NULL,
               *mla_s = NULL;
    int ctx = 1024, tokens = 32, prefill = 512, skip_model = 0;
    loom_opt_t opts[] = {
        {"layers", LOOM_OPT_INT, &b.layers, "N", "layers (default 32)", 1, 1024, NULL},
        {"dim", LOOM_OPT_INT, &b.dim, "N", "hidden size (default 4096)", 8, 65536, NULL},
        {"heads", LOOM_OPT_INT, &b.nh, "N", "query heads (default 32)", 1, 1024, NULL},
        {"kv-heads", LOOM_OPT_INT, &b.nkv, "N", "KV heads (default 8)", 1, 1024, NULL},
        {"head-dim", LOOM_OPT_INT, &b.hd, "N", "head dim (default 128)", 2, 256, NULL},
        {"hidden", LOOM_OPT_INT, &b.hidden, "N", "MLP size (default 14336)", 1, 1 << 20, NULL},
        {"vocab", LOOM_OPT_INT, &b.vocab, "N", "vocabulary (default 128256)", 16, 1 << 22, NULL},
        {"dtype", LOOM_OPT_STR, &dtype, "TYPE", "weights: bf16 (default) or f16", 1, 0, NULL},
        {"quantization", LOOM_OPT_STR, &quant_s, "SCHEME",
         "matmul weights: none (default), int8, fp8, q4, q4:128, q4_min, q4_min:128", 1, 0, NULL},
        {"quant-gemv", LOOM_OPT_STR, &qgemv_s, "LIST", "also time the quantized matmul alone for these schemes", 1, 0,
         NULL},
        {"mla", LOOM_OPT_STR, &mla_s, "HEADS",
         "also time DeepSeek-V3's latent attention alone (576-wide rows) for these head counts, at --batches and "
         "--ctx, and a prefill of --prefill tokens",
         1, 0, NULL},
        {"skip-model", LOOM_OPT_FLAG, &skip_model, NULL, "only the copy bandwidth, --quant-gemv and --mla", 0, 0,
         NULL},
        {"ctx", LOOM_OPT_INT, &ctx, "N", "context of each sequence before decoding (default 1024)", 1, 1 << 17, NULL},
        {"tokens", LOOM_OPT_INT, &tokens, "N", "timed decode steps (default 32)", 4, 4096, NULL},
        {"prefill", LOOM_OPT_INT, &prefill, "N", "prefill chunk, also the measured prefill (default 512)", 16, 8192,
         NULL},
        {"batches", LOOM_OPT_STR, &batches_s, "LIST", "decode batch sizes (default 1,8,32)", 1, 0, NULL},
        {"json", LOOM_OPT_STR, &json, "FILE", "also write the results as JSON", 1, 0, NULL},
    };
    int r = loom_cli_parse(argc, argv, 1, opts, (int)LOOM_ARRAY_LEN(opts), "bench_gpu [options]",
                           "Decode MBU and prefill rate of the CUDA backend on a random model.");
    if (r) return r < 0 ? 2 : 0;
    int batches[16];
    int nb = parse_list(batches_s, batches, 16);
    if (nb < 1 || b.nh % b.nkv) {
        fprintf(stderr, "bench_gpu: bad --batches or heads not a multiple of kv-heads\n");
        return 2;
    }
    if (!loom_quant_spec_parse(quant_s, &b.quant)) {
        fprintf(stderr, "bench_gpu: unknown --quantization '%s'\n", quant_s);
        return 2;
    }
    if (!loom_backend_available(LOOM_DEVICE_CUDA, 0)) {
        printf("skipped: no GPU\n");
        return 77;
    }
    loom_dtype_t dt = !strcmp(dtype, "f16") ? LOOM_DT_F16 : LOOM_DT_BF16;
    loom_err_t err = {0};
    loom_backend_config_t bc = {.version = LOOM_BACKEND_CONFIG_VERSION, .kind = LOOM_DEVICE_CUDA, .weight_dtype = dt};
    if (loom_backend_create(&bc, &b.be, &err) < 0) {
        fprintf(stderr, "bench_gpu: %s\n", err.msg);
        return 1;
    }
    int max_batch = 1;
    for (int i = 0; i < nb; i++) max_batch = LOOM_MAX(max_batch, batches[i]);
    /* batch 1 runs three variants, each tokens + 3 steps */
    const int per_seq = (ctx + 3 * (tokens + 3) + 1 + B_SIZE - 1) / B_SIZE;
    if (per_seq > 256) {
        fprintf(stderr, "bench_gpu: --ctx too long for the metadata buffer\n");
        return 2;
    }
    b.max_tokens = LOOM_MAX(prefill, max_batch);
    b.max_rows = max_batch;
    b.n_blocks = max_batch * per_seq;
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    double t0 = now_s();
    double copy = copy_gbs(&b);
    printf("device: %s, %d SMs; copy bandwidth %.0f GB/s (read + write)\n", prop.name, loom_cuda_sm_count(b.be), copy);
    qresult_t qres[32];
    int nq = qgemv_s ? quant_gemv(&b, qgemv_s, prefill, copy, qres, (int)LOOM_ARRAY_LEN(qres)) : 0;
    mla_result_t mres[64];
    int nm = mla_s ? mla_bench(&b, mla_s, batches, nb, ctx, prefill, mres, (int)LOOM_ARRAY_LEN(mres)) : 0;
    if (nm) {
        printf("\nMLA attention alone (576-wide latent rows, bf16, context %d):\n  %6s %6s %7s %10s %9s %6s %8s\n",
               ctx, "heads", "batch", "tokens", "call us", "GB/s", "ratio", "TFLOP/s");
        for (int i = 0; i < nm; i++)
            printf("  %6d %6d %7d %10.1f %9.0f %6.3f %8.1f\n", mres[i].heads, mres[i].batch, mres[i].tokens,
                   mres[i].call_s * 1e6, mres[i].gbs, mres[i].gbs / copy, mres[i].tflops);
    }
    if (skip_model) {
        if (json) {
            FILE *f = fopen(json, "w");
            if (f) {
                fprintf(f, "{\"device\":\"%s\",\"copy_gbs\":%.1f,\"prefill_tokens\":%d,\"quant_gemv\":[", prop.name,
                        copy, prefill);
                for (int i = 0; i < nq; i++) {
                    fprintf(f, "%s{\"scheme\":\"%s\",\"shape\":\"%s\",\"gemv1_gbs\":%.1f,\"gemv8_gbs\":%.1f,"
                               "\"mbu1\":%.4f,\"mbu8\":%.4f,\"prefill_vs_bf16\":%.4f,\"prefill_fp8_gemm_vs_bf16\":%.4f,"
                               "\"crossover\":[",
                            i ? "," : "", qres[i].scheme, qres[i].shape, qres[i].gemv1_gbs, qres[i].gemv8_gbs,
                            qres[i].gemv1_gbs / copy, qres[i].gemv8_gbs / copy, qres[i].prefill_ratio,
                            qres[i].fp8_gemm_ratio);
                    for (int j = 0; j < 6; j++)
                        fprintf(f, "%s{\"n\":%d,\"gemv_gbs\":%.1f,\"dequant_gbs\":%.1f}", j ? "," : "",
                                kCrossN[j], qres[i].gemv_gbs[j], qres[i].deq_gbs[j]);
                    fprintf(f, "],\"mma_crossover\":[");
                    for (int j = 0; j < 6; j++)
                        fprintf(f, "%s{\"n\":%d,\"mma_gbs\":%.1f,\"dequant_gbs\":%.1f}", j ? "," : "", kMmaN[j],
                                qres[i].mma_gbs[j], qres[i].mma_deq_gbs[j]);
                    fprintf(f, "]}");
                }
                fprintf(f, "],\"mla\":[");
                for (int i = 0; i < nm; i++)
                    fprintf(f, "%s{\"heads\":%d,\"batch\":%d,\"tokens\":%d,\"ctx\":%d,\"call_s\":%.7f,"
                               "\"gbs\":%.1f,\"ratio\":%.4f,\"tflops\":%.2f}",
                            i ? "," : "", mres[i].heads, mres[i].batch, mres[i].tokens, ctx, mres[i].call_s,
                            mres[i].gbs, mres[i].gbs / copy, mres[i].tflops);
                fprintf(f, "]}\n");
                fclose(f);
            }
        }
        loom_backend_destroy(&b.be);
        return 0;
    }
    build(&b);
    CK(cudaStreamSynchronize(loom_backend_stream(b.be)));
    double params = b.params;
    char wname[24];
    if (b.quant.quant != LOOM_QUANT_NONE)
        loom_quant_spec_name(&b.quant, wname, sizeof wname);
    else
        snprintf(wname, sizeof wname, "%s", dtype);
    printf("model: random, %d layers, dim %d, %d/%d heads x %d, hidden %d, vocab %d: %.2fB parameters, %.2f GB %s "
           "(built in %.1f s)\n",
           b.layers, b.dim, b.nh, b.nkv, b.hd, b.hidden, b.vocab, params / 1e9, b.weight_bytes / 1e9, wname,
           now_s() - t0);

    /* prefill: one sequence, `prefill` tokens from position 0 */
    batch_t pb = {.ns = 1, .per_seq = per_seq, .s0 = 0};
    pb.ctx = loom_xcalloc(1, 4);
    pb.next = loom_xcalloc(1, 4);
    double pt[5];
    for (int rep = 0; rep < 5; rep++) {
        int n, nl, mb = upload_step(&b, &pb, 0, 0, prefill, &n, &nl);
        CK(cudaStreamSynchronize(loom_backend_stream(b.be)));
        double s0 = now_s();
        forward(&b, n, nl, mb, 1);
        CK(cudaStreamSynchronize(loom_backend_stream(b.be)));
        pt[rep] = now_s() - s0;
    }
    double pre_s = median(pt + 1, 4);
    double layer_flops = 2.0 * prefill *
                         ((double)b.qkv_dim * b.dim + (double)b.dim * b.nh * b.hd + 2.0 * b.hidden * b.dim +
                          (double)b.dim * b.hidden);
    double gemm_s = gemm_layer_s(&b, prefill, dt == LOOM_DT_F16 ? CUDA_R_16F : CUDA_R_16BF) * b.layers;
    double pre_tf = layer_flops * b.layers / pre_s / 1e12, gemm_tf = layer_flops * b.layers / gemm_s / 1e12;

    result_t res[32];
    int nr = 0;
    for (int i = 0; i < nb; i++) {
        batch_t bt = {.ns = batches[i], .per_seq = per_seq, .s0 = 0};
        bt.ctx = loom_xcalloc((size_t)bt.ns, 4);
        bt.next = loom_xcalloc((size_t)bt.ns, 4);
        prefill_batch(&b, &bt, ctx, prefill);
        res[nr++] = decode(&b, &bt, tokens, 1, 1, copy, "graph, fused ops");
        if (bt.ns == 1) {
            res[nr++] = decode(&b, &bt, tokens, 1, 0, copy, "graph, model.c ops");
            res[nr++] = decode(&b, &bt, tokens, 0, 1, copy, "no graph, fused ops");
        }
        free(bt.ctx), free(bt.next);
    }
    uint64_t rec = 0, rep = 0;
    loom_cuda_graph_stats(b.be, &rec, &rep);
    printf("\nprefill %d tokens: %.2f ms, %.0f TFLOP/s; cuBLAS GEMMs alone %.2f ms, %.0f TFLOP/s -> ratio %.2f\n",
           prefill, pre_s * 1e3, pre_tf, gemm_s * 1e3, gemm_tf, gemm_s / pre_s);
    printf("decode (context %d, graphs recorded %llu, replayed %llu):\n", ctx, (unsigned long long)rec,
           (unsigned long long)rep);
    printf("  %-22s %6s %10s %10s %9s %6s\n", "variant", "batch", "step ms", "tokens/s", "GB/s", "MBU");
    for (int i = 0; i < nr; i++)
        printf("  %-22s %6d %10.3f %10.1f %9.0f %6.3f\n", res[i].name, res[i].batch, res[i].step_s * 1e3, res[i].tok_s,
               res[i].gbs, res[i].mbu);
    if (json) {
        FILE *f = fopen(json, "w");
        if (f) {
            fprintf(f, "{\"device\":\"%s\",\"copy_gbs\":%.1f,\"params\":%.0f,\"dtype\":\"%s\",\"prefill_tokens\":%d,"
                       "\"prefill_s\":%.6f,\"prefill_tflops\":%.2f,\"gemm_tflops\":%.2f,\"prefill_ratio\":%.4f,"
                       "\"decode\":[",
                    prop.name, copy, params, wname, prefill, pre_s, pre_tf, gemm_tf, gemm_s / pre_s);
            for (int i = 0; i < nr; i++)
                fprintf(f, "%s{\"variant\":\"%s\",\"batch\":%d,\"step_s\":%.6f,\"tok_s\":%.2f,\"gbs\":%.1f,\"mbu\":%.4f}",
                        i ? "," : "", res[i].name, res[i].batch, res[i].step_s, res[i].tok_s, res[i].gbs, res[i].mbu);
            fprintf(f, "]}\n");
            fclose(f);
        }
    }
    free(pb.ctx), free(pb.next);
    loom_backend_destroy(&b.be); /* the device memory goes with the process */
    return 0;
}

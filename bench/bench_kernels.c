/* Benchmarks of the CPU backend's kernels, with the napkin math next to each
 * time: the machine's triad bandwidth, GEMV GB/s as a fraction of it, the
 * GEMV/sgemm crossover, sgemm GFLOP/s at prefill sizes, thread-pool dispatch
 * latency, paged attention decode, MLA decode attention (latent against
 * decompressed caches), the small element-wise ops, and the
 * quantized matmuls (decode MBU per scheme on the ~125M benchmark model's
 * shapes, the quantized GEMV / dequantize+sgemm crossover, prefill against
 * f32).
 *
 *   bench_kernels [--threads N] [--quick] [--only
 * triad|gemv|crossover|prefill|dispatch|attention|mla|eltwise|quant|qdecode|qcross|qprefill|qhot]
 *
 * Weights and KV caches are cycled through several copies totalling more than
 * the last-level cache, so every call streams from DRAM as in a real decode
 * (and the compiler cannot hoist a repeated call). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/membw.h"
#include "common/util.h"
#include "kernels/backend.h"
#include "kernels/cpu/backend_cpu.h"
#include "kernels/cpu/qgemv.h"
#include "kernels/cpu/threadpool.h"

#define COLD_BYTES ((size_t)96 << 20) /* > 32 MiB L3: copies cycled per call */

static int g_quick;
static const char *g_only; /* run one section */

static int want(const char *section) {
    return !g_only || !strcmp(g_only, section);
}

static void *xalloc(size_t n) {
    void *p = loom_aligned_alloc(n);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

static void fill_rand(float *p, size_t n, uint64_t seed) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (float)((int32_t)(s >> 40) - (1 << 23)) / (float)(1 << 23);
    }
}

static loom_backend_t *make_backend(int n_threads, loom_dtype_t dt) {
    loom_backend_config_t cfg = {.version = LOOM_BACKEND_CONFIG_VERSION,
                                 .kind = LOOM_DEVICE_CPU,
                                 .n_threads = n_threads,
                                 .weight_dtype = dt};
    loom_backend_t *be = NULL;
    loom_err_t err;
    if (loom_backend_create(&cfg, &be, &err) != LOOM_OK) {
        fprintf(stderr, "backend: %s\n", err.msg);
        exit(1);
    }
    return be;
}

/* A weight uploaded in enough copies that cycling through them misses the cache. */
struct cold_weight {
    loom_weight_t w[16];
    int n;
};

static void cold_weight_init(struct cold_weight *cw, loom_backend_t *be, loom_dtype_t dt, int rows,
                             int cols) {
    size_t bytes = (size_t)rows * cols * loom_dtype_size(dt);
    cw->n = (int)LOOM_MIN((size_t)16, LOOM_MAX((size_t)2, COLD_BYTES / bytes + 1));
    float *host = xalloc((size_t)rows * cols * sizeof(float));
    fill_rand(host, (size_t)rows * cols, (uint64_t)rows * 31 + (uint64_t)cols);
    for (int i = 0; i < cw->n; i++) {
        loom_err_t err;
        if (loom_weight_upload(be, &cw->w[i], rows, cols, host, &err) != LOOM_OK) {
            fprintf(stderr, "upload: %s\n", err.msg);
            exit(1);
        }
    }
    loom_aligned_free(host);
}

static void cold_weight_free(struct cold_weight *cw, loom_backend_t *be) {
    for (int i = 0; i < cw->n; i++)
        loom_weight_free(be, &cw->w[i]);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

struct timing {
    double min, med; /* seconds per call */
};

/* Times matmuls on each path in turn (interleaved, so a burst of load from
 * other processes hits every path alike), cycling the weight copies. The
 * machine is shared: `min` is what the kernel can do, `med` what it did. */
static void time_paths(loom_backend_t *be, struct cold_weight *cw, float *y, const float *x, int n,
                       const loom_cpu_mm_path_t *paths, int n_paths, int reps, struct timing *out) {
    double t[4][64];
    reps = LOOM_MAX(1, LOOM_MIN(reps, 64));
    for (int p = 0; p < n_paths; p++) /* warm up threads and code */
        loom_cpu_matmul_path(be, y, x, &cw->w[0], n, paths[p]);
    for (int r = 0; r < reps; r++)
        for (int p = 0; p < n_paths; p++) {
            uint64_t t0 = loom_now_ns();
            loom_cpu_matmul_path(be, y, x, &cw->w[(r * n_paths + p + 1) % cw->n], n, paths[p]);
            t[p][r] = (double)(loom_now_ns() - t0) * 1e-9;
        }
    for (int p = 0; p < n_paths; p++) {
        qsort(t[p], (size_t)reps, sizeof(double), cmp_double);
        out[p] = (struct timing){t[p][0], t[p][reps / 2]};
    }
}

static int reps_for(double est_s) {
    int r = (int)(0.12 / (est_s > 1e-6 ? est_s : 1e-6));
    if (g_quick) r /= 4;
    return LOOM_MAX(3, LOOM_MIN(r, 64));
}

static void bench_gemv(int n_threads, double triad) {
    static const int shapes[][2] = {{768, 768}, {2048, 768}, {4096, 4096}, {14336, 4096}};
    static const loom_dtype_t dts[] = {LOOM_DT_F32, LOOM_DT_BF16, LOOM_DT_F16};
    static const int ns[] = {1, 2, 4, 8};
    printf("\n== GEMV (decode matmul), %d threads: y(n, rows) = x(n, cols) W^T, weights cold ==\n",
           n_threads);
    printf("%-12s %-5s %2s %9s %9s %9s %8s %8s %8s %8s\n", "rows x cols", "dtype", "n", "MB moved",
           "med us", "best us", "med GB/s", "best", "med/tri", "best/tri");
    size_t n_shapes = g_quick ? 3 : LOOM_ARRAY_LEN(shapes);
    for (size_t d = 0; d < LOOM_ARRAY_LEN(dts); d++) {
        loom_backend_t *be = make_backend(n_threads, dts[d]);
        for (size_t s = 0; s < n_shapes; s++) {
            int rows = shapes[s][0], cols = shapes[s][1];
            if (dts[d] == LOOM_DT_F16 && rows != 4096) continue; /* one f16 row is enough */
            struct cold_weight cw;
            cold_weight_init(&cw, be, dts[d], rows, cols);
            float *x = xalloc(sizeof(float) * 8 * (size_t)cols),
                  *y = xalloc(sizeof(float) * 8 * (size_t)rows);
            fill_rand(x, 8 * (size_t)cols, 5);
            for (size_t i = 0; i < LOOM_ARRAY_LEN(ns); i++) {
                int n = ns[i];
                double bytes = (double)loom_weight_bytes(&cw.w[0]) + 4.0 * n * (rows + cols);
                double est = bytes / (triad * 1e9);
                const loom_cpu_mm_path_t path = LOOM_CPU_MM_GEMV;
                struct timing t;
                time_paths(be, &cw, y, x, n, &path, 1, reps_for(est), &t);
                printf("%5dx%-6d %-5s %2d %9.1f %9.1f %9.1f %8.2f %8.2f %8.2f %8.2f\n", rows, cols,
                       loom_dtype_name(dts[d]), n, bytes / 1e6, t.med * 1e6, t.min * 1e6,
                       bytes / t.med / 1e9, bytes / t.min / 1e9, bytes / t.med / 1e9 / triad,
                       bytes / t.min / 1e9 / triad);
            }
            loom_aligned_free(x);
            loom_aligned_free(y);
            cold_weight_free(&cw, be);
        }
        loom_backend_destroy(&be);
    }
}

/* GEMV kernel vs sgemm per n: where does sgemm start winning? */
static void bench_crossover(int n_threads) {
    static const int shapes[][2] = {{4096, 4096}, {2048, 768}, {4096, 14336}};
    static const int ns[] = {4, 8, 16, 24, 32, 48, 64, 96, 128};
    static const loom_dtype_t dts[] = {LOOM_DT_F32, LOOM_DT_BF16};
    printf(
        "\n== GEMV kernel vs sgemm by n, %d threads (auto: GEMV for n <= %d f32, <= %d bf16) ==\n",
        n_threads, loom_cpu_gemv_max_n(LOOM_DT_F32), loom_cpu_gemv_max_n(LOOM_DT_BF16));
    printf("%-12s %-5s %3s %10s %10s %10s %10s %10s %10s  %s\n", "rows x cols", "dtype", "n",
           "gemv best", "sgemm best", "gemv med", "sgemm med", "gemv GF/s", "sgemm GF/s",
           "faster (best)");
    for (size_t d = 0; d < LOOM_ARRAY_LEN(dts); d++) {
        loom_backend_t *be = make_backend(n_threads, dts[d]);
        for (size_t s = 0; s < LOOM_ARRAY_LEN(shapes); s++) {
            int rows = shapes[s][0], cols = shapes[s][1];
            struct cold_weight cw;
            cold_weight_init(&cw, be, dts[d], rows, cols);
            float *x = xalloc(sizeof(float) * 128 * (size_t)cols),
                  *y = xalloc(sizeof(float) * 128 * (size_t)rows);
            fill_rand(x, 128 * (size_t)cols, 6);
            for (size_t i = 0; i < LOOM_ARRAY_LEN(ns); i++) {
                int n = ns[i];
                if (g_quick && (n & (n - 1))) continue;
                double flops = 2.0 * n * rows * cols;
                double est = (double)loom_weight_bytes(&cw.w[0]) / 15e9 + flops / 100e9;
                int reps = reps_for(est);
                const loom_cpu_mm_path_t paths[2] = {LOOM_CPU_MM_GEMV, LOOM_CPU_MM_SGEMM};
                struct timing t[2];
                time_paths(be, &cw, y, x, n, paths, 2, reps, t);
                printf("%5dx%-6d %-5s %3d %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f  %s\n", rows,
                       cols, loom_dtype_name(dts[d]), n, t[0].min * 1e6, t[1].min * 1e6,
                       t[0].med * 1e6, t[1].med * 1e6, flops / t[0].min / 1e9,
                       flops / t[1].min / 1e9, t[0].min <= t[1].min ? "gemv" : "sgemm");
            }
            loom_aligned_free(x);
            loom_aligned_free(y);
            cold_weight_free(&cw, be);
        }
        loom_backend_destroy(&be);
    }
}

static void bench_prefill(int n_threads) {
    static const int ns[] = {128, 512};
    static const loom_dtype_t dts[] = {LOOM_DT_F32, LOOM_DT_BF16};
    const int rows = 4096, cols = 4096;
    printf("\n== prefill matmul (sgemm), %d threads, %dx%d weights ==\n", n_threads, rows, cols);
    printf("%-5s %4s %10s %10s %10s %10s\n", "dtype", "n", "GFLOP", "med ms", "best ms",
           "best GF/s");
    for (size_t d = 0; d < LOOM_ARRAY_LEN(dts); d++) {
        loom_backend_t *be = make_backend(n_threads, dts[d]);
        struct cold_weight cw;
        cold_weight_init(&cw, be, dts[d], rows, cols);
        float *x = xalloc(sizeof(float) * 512 * (size_t)cols),
              *y = xalloc(sizeof(float) * 512 * (size_t)rows);
        fill_rand(x, 512 * (size_t)cols, 7);
        for (size_t i = 0; i < LOOM_ARRAY_LEN(ns); i++) {
            int n = ns[i];
            double flops = 2.0 * n * rows * cols;
            const loom_cpu_mm_path_t path = LOOM_CPU_MM_SGEMM;
            struct timing t;
            time_paths(be, &cw, y, x, n, &path, 1, g_quick ? 2 : 4, &t);
            printf("%-5s %4d %10.2f %10.2f %10.2f %10.1f\n", loom_dtype_name(dts[d]), n,
                   flops / 1e9, t.med * 1e3, t.min * 1e3, flops / t.min / 1e9);
        }
        loom_aligned_free(x);
        loom_aligned_free(y);
        cold_weight_free(&cw, be);
        loom_backend_destroy(&be);
    }
}

/* A task of fixed work, so a dispatch's cost is the time beyond the work:
 * with empty tasks the caller would run them all before a worker woke. */
struct spin_ctx {
    long iters;
    volatile double sink[64 * 8];
};

static void spin_task(void *p, int task, int thread) {
    struct spin_ctx *c = p;
    double v = (double)task;
    for (long i = 0; i < c->iters; i++)
        v = v * 0.999999 + 1e-9;
    c->sink[thread * 8] = v;
}

static void bench_dispatch(int n_threads) {
    printf("\n== thread pool dispatch, %d threads: n_threads tasks of 2 us each ==\n", n_threads);
    struct spin_ctx c = {.iters = 1000};
    for (int cal = 0; cal < 3; cal++) { /* calibrate iters to ~2 us */
        uint64_t t0 = loom_now_ns();
        for (int i = 0; i < 100; i++)
            spin_task(&c, i, 0);
        double us = (double)(loom_now_ns() - t0) * 1e-3 / 100;
        c.iters = (long)((double)c.iters * 2.0 / us);
        if (c.iters < 1) c.iters = 1;
    }
    uint64_t t0 = loom_now_ns();
    for (int i = 0; i < 1000; i++)
        spin_task(&c, i, 0);
    double work_us = (double)(loom_now_ns() - t0) * 1e-3 / 1000;
    printf("one task inline: %.2f us; ideal parallel_for = one task's time\n", work_us);
    printf("%-30s %8s %8s %12s\n", "mode", "median", "p90 us", "overhead us");
    for (int mode = 0; mode < 3; mode++) {
        loom_threadpool_t *pool = loom_threadpool_create(n_threads);
        if (!pool) return;
        if (mode == 1) loom_threadpool_set_spin_ns(pool, 0);
        int iters = mode == 0 ? 20000 : 3000;
        if (g_quick) iters /= 4;
        double *t = xalloc(sizeof(double) * (size_t)iters);
        loom_parallel_for(pool, n_threads, spin_task, &c);
        for (int i = 0; i < iters; i++) {
            if (mode == 2) usleep(200); /* longer than the spin: the workers are asleep */
            uint64_t d0 = loom_now_ns();
            loom_parallel_for(pool, n_threads, spin_task, &c);
            t[i] = (double)(loom_now_ns() - d0) * 1e-3;
        }
        qsort(t, (size_t)iters, sizeof *t, cmp_double);
        double med = t[iters / 2], p90 = t[iters * 9 / 10];
        printf("%-30s %8.2f %8.2f %12.2f\n",
               mode == 0   ? "back-to-back (workers spin)"
               : mode == 1 ? "no spin (futex every time)"
                           : "after 200 us idle (asleep)",
               med, p90, med - work_us);
        loom_aligned_free(t);
        loom_threadpool_destroy(&pool);
    }
}

/* Paged decode attention per KV cache dtype. Bytes = the K and V rows read
 * (and the int8 scales); FLOPs = 4 * ctx * nh * hd per sequence. */
static void bench_attention(int n_threads) {
    static const int cfgs[][3] = {{32, 8, 128}, {32, 4, 64}}; /* nh, nkv, hd */
    static const int ctxs[] = {512, 2048};
    static const int batches[] = {1, 4};
    static const loom_dtype_t kv_dts[] = {LOOM_DT_F32, LOOM_DT_BF16, LOOM_DT_I8};
    const int B = 16;
    printf("\n== paged attention decode, %d threads, block %d, caches cold ==\n", n_threads, B);
    printf("%-13s %-5s %5s %5s %10s %10s %9s %9s\n", "nh/nkv/hd", "KV", "ctx", "seqs", "MB K+V", "us/call",
           "GB/s", "GFLOP/s");
    loom_backend_t *be = make_backend(n_threads, LOOM_DT_F32);
    for (size_t c = 0; c < LOOM_ARRAY_LEN(cfgs); c++)
        for (size_t x = 0; x < LOOM_ARRAY_LEN(ctxs); x++)
            for (size_t b = 0; b < LOOM_ARRAY_LEN(batches); b++)
                for (size_t k = 0; k < LOOM_ARRAY_LEN(kv_dts); k++) {
                    const loom_dtype_t kdt = kv_dts[k];
                    const int nh = cfgs[c][0], nkv = cfgs[c][1], hd = cfgs[c][2], ctx = ctxs[x];
                    const int seqs = batches[b];
                    const int bps = ctx / B, n_blocks = bps * seqs;
                    const size_t heads = (size_t)n_blocks * B * nkv, elems = heads * hd;
                    const size_t cache_bytes = elems * loom_dtype_size(kdt);
                    int layers = (int)LOOM_MIN((size_t)16, COLD_BYTES / (2 * cache_bytes) + 1);
                    char *kc = loom_backend_alloc(be, cache_bytes * layers),
                         *vc = loom_backend_alloc(be, cache_bytes * layers);
                    float *ks = loom_backend_alloc(be, heads * sizeof(float) * layers),
                          *vs = loom_backend_alloc(be, heads * sizeof(float) * layers);
                    if (!kc || !vc || !ks || !vs) {
                        fprintf(stderr, "out of memory for the KV cache\n");
                        exit(1);
                    }
                    /* random values in each dtype: f32 in [-1, 1), their bf16, int8 codes with scale 1/127 */
                    float *tmp = xalloc(sizeof(float) * elems);
                    for (int l = 0; l < layers; l++)
                        for (int kv = 0; kv < 2; kv++) {
                            fill_rand(tmp, elems, (uint64_t)(2 * l + kv + 1));
                            char *dst = (kv ? vc : kc) + (size_t)l * cache_bytes;
                            for (size_t e = 0; e < elems; e++) {
                                if (kdt == LOOM_DT_F32) ((float *)dst)[e] = tmp[e];
                                else if (kdt == LOOM_DT_BF16) ((uint16_t *)dst)[e] = loom_f32_to_bf16(tmp[e]);
                                else ((int8_t *)dst)[e] = (int8_t)(tmp[e] * 127.0f);
                            }
                        }
                    for (size_t e = 0; e < heads * layers; e++)
                        ks[e] = vs[e] = 1.0f / 127.0f;
                    loom_aligned_free(tmp);
                    int32_t *bt = xalloc(sizeof(int32_t) * n_blocks);
                    for (int i = 0; i < n_blocks; i++)
                        bt[i] = (int32_t)((i * 7919) % n_blocks); /* scattered */
                    int32_t seq_ids[4], pos[4];
                    for (int s = 0; s < seqs; s++)
                        seq_ids[s] = s, pos[s] = ctx - 1;
                    float *q = xalloc(sizeof(float) * seqs * nh * hd),
                          *out = xalloc(sizeof(float) * seqs * nh * hd);
                    fill_rand(q, (size_t)seqs * nh * hd, 3);
                    loom_attn_args_t a = {.n = seqs,
                                          .n_heads = nh,
                                          .n_kv_heads = nkv,
                                          .head_dim = hd,
                                          .scale = 1.0f / sqrtf((float)hd),
                                          .q = q,
                                          .q_stride = nh * hd,
                                          .out = out,
                                          .out_stride = nh * hd,
                                          .block_size = B,
                                          .tok_seq = seq_ids,
                                          .tok_pos = pos,
                                          .block_tables = bt,
                                          .max_blocks = bps,
                                          .max_ctx = ctx};
                    double bytes = 2.0 * ctx * nkv * (double)loom_kv_head_bytes(kdt, hd) * seqs;
                    double flops = 4.0 * ctx * nh * hd * seqs;
                    int reps = g_quick ? 8 : 30;
                    double best = 1e9;
                    for (int r = 0; r < reps; r++) {
                        const size_t l = (size_t)(r % layers);
                        a.kv = (loom_kv_layer_t){.k = kc + l * cache_bytes,
                                                 .v = vc + l * cache_bytes,
                                                 .k_scale = kdt == LOOM_DT_I8 ? ks + l * heads : NULL,
                                                 .v_scale = kdt == LOOM_DT_I8 ? vs + l * heads : NULL,
                                                 .dtype = kdt};
                        uint64_t t0 = loom_now_ns();
                        loom_op_attention(be, &a);
                        double t = (double)(loom_now_ns() - t0) * 1e-9;
                        if (r > 0 && t < best) best = t;
                    }
                    printf("%3d/%d/%-7d %-5s %5d %5d %10.1f %10.1f %9.2f %9.1f\n", nh, nkv, hd,
                           loom_kv_dtype_name(kdt), ctx, seqs, bytes / 1e6, best * 1e6, bytes / best / 1e9,
                           flops / best / 1e9);
                    loom_backend_free(be, kc);
                    loom_backend_free(be, vc);
                    loom_backend_free(be, ks);
                    loom_backend_free(be, vs);
                    loom_aligned_free(bt);
                    loom_aligned_free(q);
                    loom_aligned_free(out);
                }
    loom_backend_destroy(&be);
}

/* One MLA layer's decode attention over 32 streams of `ctx` tokens, the
 * latent cache against decompressed keys and values, at the 1.28 B bench
 * shape (gen_deepseek.py --shape bench1b: 16 heads, kv_lora 256 + rope 32,
 * nope 64, v 64). Latent: each head is MQA over the cache row itself (one
 * KV head of 288 values, K and V the same memory, as the engine's latent
 * layout). Decompressed: 16 KV heads of nope + rope = 96 values, V padded
 * to 96 as the op takes one head dim (V's true 64 would read a sixth less
 * than measured). Attention only: the absorbed path's q and o matrices are
 * weights, in the decode's matmuls. Caches of both beyond any L3, one call
 * a step, best of the reps. */
static void bench_mla(int n_threads) {
    const int B = 16, seqs = 32, nh = 16, ctxs[] = {512, 2048};
    static const loom_dtype_t dts[] = {LOOM_DT_F32, LOOM_DT_BF16};
    printf("\n== MLA decode attention, %d streams, %d threads, 16 heads: latent (288) vs decompressed (96) ==\n",
           seqs, n_threads);
    printf("%-12s %-5s %5s %10s %10s %9s %16s\n", "cache", "KV", "ctx", "MB read", "us/step", "GB/s",
           "decompressed/latent");
    loom_backend_t *be = make_backend(n_threads, LOOM_DT_F32);
    for (size_t x = 0; x < LOOM_ARRAY_LEN(ctxs); x++)
        for (size_t d = 0; d < LOOM_ARRAY_LEN(dts); d++) {
            const int ctx = ctxs[x], bps = ctx / B, n_blocks = bps * seqs;
            const loom_dtype_t dt = dts[d];
            double us[2] = {0, 0};
            for (int latent = 1; latent >= 0; latent--) {
                const int nkv = latent ? 1 : nh, hd = latent ? 288 : 96;
                const size_t elems = (size_t)n_blocks * B * nkv * hd, bytes = elems * loom_dtype_size(dt);
                char *kc = loom_backend_alloc(be, bytes), *vc = latent ? kc : loom_backend_alloc(be, bytes);
                if (!kc || !vc) {
                    fprintf(stderr, "out of memory for the MLA caches\n");
                    exit(1);
                }
                float *tmp = xalloc(sizeof(float) * elems);
                for (int kv = 0; kv < (latent ? 1 : 2); kv++) {
                    fill_rand(tmp, elems, (uint64_t)(kv + 5));
                    char *dst = kv ? vc : kc;
                    for (size_t e = 0; e < elems; e++) {
                        if (dt == LOOM_DT_F32) ((float *)dst)[e] = tmp[e];
                        else ((uint16_t *)dst)[e] = loom_f32_to_bf16(tmp[e]);
                    }
                }
                loom_aligned_free(tmp);
                int32_t *bt = xalloc(sizeof(int32_t) * n_blocks), seq_ids[32], pos[32];
                for (int i = 0; i < n_blocks; i++) bt[i] = (int32_t)((i * 7919) % n_blocks);
                for (int i = 0; i < seqs; i++) seq_ids[i] = i, pos[i] = ctx - 1;
                float *q = xalloc(sizeof(float) * seqs * nh * hd), *out = xalloc(sizeof(float) * seqs * nh * hd);
                fill_rand(q, (size_t)seqs * nh * hd, 3);
                loom_attn_args_t a = {.n = seqs, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd,
                                      .scale = 1.0f / sqrtf(96.0f), .q = q, .q_stride = nh * hd, .out = out,
                                      .out_stride = nh * hd, .block_size = B, .tok_seq = seq_ids, .tok_pos = pos,
                                      .block_tables = bt, .max_blocks = bps, .max_ctx = ctx,
                                      .kv = {.k = kc, .v = vc, .dtype = dt}};
                double read = (double)bytes * (latent ? 1 : 2), best = 1e9;
                for (int r = 0; r < (g_quick ? 5 : 15); r++) {
                    uint64_t t0 = loom_now_ns();
                    loom_op_attention(be, &a);
                    double t = (double)(loom_now_ns() - t0) * 1e-9;
                    if (r > 0 && t < best) best = t;
                }
                us[latent] = best * 1e6;
                printf("%-12s %-5s %5d %10.1f %10.1f %9.2f", latent ? "latent" : "decompressed",
                       loom_kv_dtype_name(dt), ctx, read / 1e6, best * 1e6, read / best / 1e9);
                if (!latent) printf(" %15.2fx", us[0] / us[1]);
                printf("\n");
                loom_backend_free(be, kc);
                if (!latent) loom_backend_free(be, vc);
                loom_aligned_free(bt);
                loom_aligned_free(q);
                loom_aligned_free(out);
            }
        }
    loom_backend_destroy(&be);
}

/* The small ops at decode (n = 1) and prefill (n = 512) shapes of an 8B-class layer. */
static void bench_eltwise(int n_threads) {
    const int dim = 4096, hidden = 14336, nh = 32, hd = 128;
    printf("\n== element-wise ops, %d threads (decode runs inline below %d elements) ==\n",
           n_threads, 1 << 15);
    printf("%-10s %4s %10s %10s %9s\n", "op", "n", "MB moved", "us/call", "GB/s");
    loom_backend_t *be = make_backend(n_threads, LOOM_DT_F32);
    const int nmax = 512;
    float *x = xalloc(sizeof(float) * nmax * 2 * (size_t)hidden),
          *y = xalloc(sizeof(float) * nmax * (size_t)hidden);
    float *g = xalloc(sizeof(float) * dim), *inv = xalloc(sizeof(float) * hd / 2);
    int32_t *pos = xalloc(sizeof(int32_t) * nmax);
    fill_rand(x, (size_t)nmax * 2 * hidden, 9);
    fill_rand(g, dim, 10);
    for (int j = 0; j < hd / 2; j++)
        inv[j] = (float)pow(500000.0, -2.0 * j / hd);
    for (int i = 0; i < nmax; i++)
        pos[i] = i;
    static const int ns[] = {1, 512};
    for (int op = 0; op < 4; op++)
        for (int k = 0; k < 2; k++) {
            int n = ns[k], iters = n == 1 ? 2000 : 20;
            if (g_quick) iters /= 4;
            double bytes = 0;
            const char *name = "";
            uint64_t t0 = 0;
            for (int it = -1; it < iters; it++) {
                if (it == 0) t0 = loom_now_ns();
                switch (op) {
                case 0:
                    name = "rmsnorm";
                    bytes = 8.0 * n * dim;
                    loom_op_rmsnorm(be, y, x, g, n, dim, 1e-5f);
                    break;
                case 1:
                    name = "add";
                    bytes = 12.0 * n * dim;
                    loom_op_add(be, y, x, (int64_t)n * dim);
                    break;
                case 2:
                    name = "silu_mul";
                    bytes = 12.0 * n * hidden;
                    loom_op_silu_mul(be, y, x, n, hidden);
                    break;
                case 3:
                    name = "rope(q)";
                    bytes = 8.0 * n * nh * hd;
                    loom_op_rope(be, y, nh * hd, n, nh, hd, pos, inv);
                    break;
                }
            }
            double t = (double)(loom_now_ns() - t0) * 1e-9 / iters;
            printf("%-10s %4d %10.3f %10.2f %9.2f\n", name, n, bytes / 1e6, t * 1e6,
                   bytes / t / 1e9);
        }
    loom_aligned_free(x);
    loom_aligned_free(y);
    loom_aligned_free(g);
    loom_aligned_free(inv);
    loom_aligned_free(pos);
    loom_backend_destroy(&be);
}

/* --- quantized weights --------------------------------------------------- */

/* The matmuls of one token of the ~125M benchmark model (bench_grid.py:
 * dim 768, hidden 2048, 12 layers, 12 heads / 4 KV heads of 64, vocab
 * 32000): fused q/k/v, o, fused gate/up, down per layer, then the LM head. */
enum { M_LAYERS = 12, M_DIM = 768, M_HIDDEN = 2048, M_QKV = 768 + 2 * 256, M_VOCAB = 32000 };
static const int k_model_shapes[5][2] = {
    {M_QKV, M_DIM}, {M_DIM, M_DIM}, {2 * M_HIDDEN, M_DIM}, {M_DIM, M_HIDDEN}, {M_VOCAB, M_DIM}};
static const char *k_model_names[5] = {"qkv", "o", "gate_up", "down", "lm_head"};

struct qmodel {
    loom_weight_t w[M_LAYERS * 4 + 1]; /* layer l's four, then the LM head */
    int n;
    size_t bytes;
};

static void upload_any(loom_backend_t *be, loom_weight_t *w, const char *scheme, const float *host,
                       int rows, int cols) {
    loom_quant_spec_t spec;
    loom_err_t err;
    loom_status_t st;
    if (!loom_quant_spec_parse(scheme, &spec)) {
        fprintf(stderr, "bad scheme %s\n", scheme);
        exit(1);
    }
    if (spec.quant == LOOM_QUANT_NONE) {
        st = loom_weight_upload(be, w, rows, cols, host, &err);
    } else {
        loom_qtensor_t t;
        st = loom_quantize(&spec, host, rows, cols, &t, &err);
        if (st == LOOM_OK) st = loom_weight_upload_quant(be, w, &t, &err);
        loom_qtensor_free(&t);
    }
    if (st != LOOM_OK) {
        fprintf(stderr, "upload %s: %s\n", scheme, err.msg);
        exit(1);
    }
}

static void qmodel_init(struct qmodel *m, loom_backend_t *be, const char *scheme) {
    float *host = xalloc(sizeof(float) * (size_t)M_VOCAB * M_DIM);
    m->n = M_LAYERS * 4 + 1;
    m->bytes = 0;
    for (int i = 0; i < m->n; i++) {
        const int *shape = k_model_shapes[i == m->n - 1 ? 4 : i % 4];
        fill_rand(host, (size_t)shape[0] * shape[1], (uint64_t)i + 11);
        upload_any(be, &m->w[i], scheme, host, shape[0], shape[1]);
        m->bytes += loom_weight_bytes(&m->w[i]);
    }
    loom_aligned_free(host);
}

static void qmodel_free(struct qmodel *m, loom_backend_t *be) {
    for (int i = 0; i < m->n; i++)
        loom_weight_free(be, &m->w[i]);
}

/* One pass over every matmul of the model (a token's worth of weights, far
 * more than L3 for every scheme), n rows of x. */
static double qmodel_pass(loom_backend_t *be, struct qmodel *m, float *y, const float *x, int n,
                          loom_cpu_mm_path_t path) {
    uint64_t t0 = loom_now_ns();
    for (int i = 0; i < m->n; i++)
        loom_cpu_matmul_path(be, y, x, &m->w[i], n, path);
    return (double)(loom_now_ns() - t0) * 1e-9;
}

static const char *k_bench_schemes[] = {"none", "int8", "q4", "q4:128", "q4_min", "fp8"};

#define N_BENCH_SCHEMES ((int)LOOM_ARRAY_LEN(k_bench_schemes))

/* Decode: passes at n = 1 and 4, the schemes interleaved pass by pass so
 * a burst of load from other processes hits all of them alike. */
static void bench_quant_decode(int n_threads, double triad) {
    printf("\n== quantized decode matmuls, %d threads, %s kernels: every matmul of the ~125M "
           "model (12 layers + LM head) per pass, schemes interleaved ==\n",
           n_threads, loom_cpu_isa_name(loom_cpu_isa_detect()));
    printf("MBU = bytes of weights (codes + scales) read per pass / time / triad (%.2f GB/s)\n",
           triad);
    printf("%-7s %2s %9s %9s %9s %8s %8s %8s %8s %9s\n", "scheme", "n", "MB/pass", "med ms",
           "best ms", "med GB/s", "best", "med MBU", "best MBU", "vs f32");
    float *x = xalloc(sizeof(float) * 16 * M_HIDDEN), *y = xalloc(sizeof(float) * 16 * M_VOCAB);
    fill_rand(x, 16 * (size_t)M_HIDDEN, 9);
    static const int ns[] = {1, 4};
    enum { REPS = 20 };
    const int reps = g_quick ? 5 : REPS;
    loom_backend_t *be = make_backend(n_threads, LOOM_DT_F32);
    struct qmodel *m = xalloc(sizeof *m * N_BENCH_SCHEMES);
    for (int s = 0; s < N_BENCH_SCHEMES; s++) qmodel_init(&m[s], be, k_bench_schemes[s]);
    for (size_t k = 0; k < LOOM_ARRAY_LEN(ns); k++) {
        const int n = ns[k];
        double t[N_BENCH_SCHEMES][REPS];
        for (int s = 0; s < N_BENCH_SCHEMES; s++) /* warm up */
            qmodel_pass(be, &m[s], y, x, n, LOOM_CPU_MM_AUTO);
        for (int r = 0; r < reps; r++)
            for (int s = 0; s < N_BENCH_SCHEMES; s++)
                t[s][r] = qmodel_pass(be, &m[s], y, x, n, LOOM_CPU_MM_AUTO);
        for (int s = 0; s < N_BENCH_SCHEMES; s++) qsort(t[s], (size_t)reps, sizeof(double), cmp_double);
        for (int s = 0; s < N_BENCH_SCHEMES; s++) {
            double b = (double)m[s].bytes, med = t[s][reps / 2], best = t[s][0];
            printf("%-7s %2d %9.1f %9.2f %9.2f %8.2f %8.2f %8.2f %8.2f %8.2fx\n",
                   k_bench_schemes[s], n, b / 1e6, med * 1e3, best * 1e3, b / med / 1e9,
                   b / best / 1e9, b / med / 1e9 / triad, b / best / 1e9 / triad, t[0][0] / best);
        }
    }
    /* Each matmul's own time within the model's stream (so still cold). */
    double per[N_BENCH_SCHEMES][5];
    for (int s = 0; s < N_BENCH_SCHEMES; s++)
        for (int k = 0; k < 5; k++) per[s][k] = 1e9;
    for (int r = 0; r < (g_quick ? 3 : 8); r++)
        for (int s = 0; s < N_BENCH_SCHEMES; s++)
            for (int i = 0; i < m[s].n; i++) {
                int k = i == m[s].n - 1 ? 4 : i % 4;
                uint64_t t0 = loom_now_ns();
                loom_cpu_matmul_path(be, y, x, &m[s].w[i], 1, LOOM_CPU_MM_AUTO);
                per[s][k] = LOOM_MIN(per[s][k], (double)(loom_now_ns() - t0) * 1e-9);
            }
    printf("\nper matmul, n = 1 (best time within the model's stream, MBU vs the same triad):\n");
    printf("%-7s", "scheme");
    for (int k = 0; k < 5; k++) printf(" %10s %5s", k_model_names[k], "MBU");
    printf("\n");
    for (int s = 0; s < N_BENCH_SCHEMES; s++) {
        printf("%-7s", k_bench_schemes[s]);
        for (int k = 0; k < 5; k++) {
            double b = (double)loom_weight_bytes(&m[s].w[k == 4 ? m[s].n - 1 : k]);
            printf(" %8.1fus %5.2f", per[s][k] * 1e6, b / per[s][k] / 1e9 / triad);
        }
        printf("\n");
    }
    for (int s = 0; s < N_BENCH_SCHEMES; s++) qmodel_free(&m[s], be);
    loom_aligned_free(m);
    loom_backend_destroy(&be);
    loom_aligned_free(x);
    loom_aligned_free(y);
}

/* Quantized GEMV kernel vs dequantize + sgemm by n, on the model's gate/up
 * and down shapes (weights cold: copies cycled), with f32 sgemm alongside. */
static void bench_quant_crossover(int n_threads) {
    static const int ns[] = {1, 4, 8, 16, 32, 64, 128, 256, 512};
    static const char *schemes[] = {"int8", "q4", "q4_min:128", "fp8"};
    static const int shapes[][2] = {{2 * M_HIDDEN, M_DIM}, {M_DIM, M_HIDDEN}};
    printf("\n== quantized: GEMV kernel vs integer GEMM vs dequantize + sgemm by n, %d threads, "
           "isa %s (auto: GEMV for n <= %d INT8, %d Q4, %d FP8, then igemm; sgemm for FP8) ==\n",
           n_threads, loom_cpu_isa_name(loom_cpu_isa_select()),
           loom_cpu_qgemv_max_n(LOOM_QUANT_INT8), loom_cpu_qgemv_max_n(LOOM_QUANT_Q4),
           loom_cpu_qgemv_max_n(LOOM_QUANT_FP8));
    printf("%-7s %-12s %3s %10s %10s %10s %10s %10s %10s %10s %8s  %s\n", "scheme", "rows x cols",
           "n", "gemv best", "igemm best", "sgemm best", "gemv GF/s", "igemm GF/s", "sgemm GF/s",
           "f32 GF/s", "best/f32", "fastest");
    loom_backend_t *be = make_backend(n_threads, LOOM_DT_F32);
    float *host = xalloc(sizeof(float) * (size_t)M_VOCAB * M_DIM);
    float *x = xalloc(sizeof(float) * 512 * M_HIDDEN), *y = xalloc(sizeof(float) * 512 * M_VOCAB);
    fill_rand(x, 512 * (size_t)M_HIDDEN, 10);
    for (size_t s = 0; s < LOOM_ARRAY_LEN(schemes); s++)
        for (size_t h = 0; h < LOOM_ARRAY_LEN(shapes); h++) {
            const int rows = shapes[h][0], cols = shapes[h][1];
            struct cold_weight cw, cf;
            cold_weight_init(&cf, be, LOOM_DT_F32, rows, cols); /* f32 sgemm, the baseline */
            fill_rand(host, (size_t)rows * cols, 12);
            upload_any(be, &cw.w[0], schemes[s], host, rows, cols);
            size_t bytes = loom_weight_bytes(&cw.w[0]);
            cw.n = (int)LOOM_MIN((size_t)16, LOOM_MAX((size_t)2, COLD_BYTES / bytes + 1));
            for (int i = 1; i < cw.n; i++) upload_any(be, &cw.w[i], schemes[s], host, rows, cols);
            for (size_t k = 0; k < LOOM_ARRAY_LEN(ns); k++) {
                const int n = ns[k];
                if (g_quick && (n & (n - 1))) continue;
                double flops = 2.0 * n * rows * cols;
                double est = (double)bytes / 15e9 + flops / 100e9;
                const loom_cpu_mm_path_t paths[3] = {LOOM_CPU_MM_GEMV, LOOM_CPU_MM_IGEMM,
                                                     LOOM_CPU_MM_SGEMM};
                const loom_cpu_mm_path_t f32_path = LOOM_CPU_MM_AUTO;
                struct timing t[3], tf;
                time_paths(be, &cw, y, x, n, paths, 3, reps_for(est), t);
                time_paths(be, &cf, y, x, n, &f32_path, 1, reps_for(est), &tf);
                int bi = 0;
                for (int p = 1; p < 3; p++)
                    if (t[p].min < t[bi].min) bi = p;
                static const char *names[3] = {"gemv", "igemm", "sgemm"};
                printf("%-7s %5dx%-6d %3d %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %8.2f  "
                       "%s\n",
                       schemes[s], rows, cols, n, t[0].min * 1e6, t[1].min * 1e6, t[2].min * 1e6,
                       flops / t[0].min / 1e9, flops / t[1].min / 1e9, flops / t[2].min / 1e9,
                       flops / tf.min / 1e9, tf.min / t[bi].min, names[bi]);
            }
            cold_weight_free(&cw, be);
            cold_weight_free(&cf, be);
        }
    loom_aligned_free(host);
    loom_aligned_free(x);
    loom_aligned_free(y);
    loom_backend_destroy(&be);
}

/* Prefill: a pass over the model's matmuls at n = 128 and 512, each scheme
 * against f32 sgemm in the same run, interleaved pass by pass. */
static void bench_quant_prefill(int n_threads) {
    static const int ns[] = {128, 512};
    printf("\n== quantized prefill, %d threads: every matmul of the ~125M model, n rows, "
           "schemes interleaved ==\n",
           n_threads);
    printf("%-7s %4s %10s %10s %10s %10s\n", "scheme", "n", "med ms", "best ms", "best GF/s",
           "vs f32");
    float *x = xalloc(sizeof(float) * 512 * M_HIDDEN), *y = xalloc(sizeof(float) * 512 * M_VOCAB);
    fill_rand(x, 512 * (size_t)M_HIDDEN, 13);
    double flops_pass = 0;
    for (int i = 0; i < M_LAYERS * 4 + 1; i++) {
        const int *shape = k_model_shapes[i == M_LAYERS * 4 ? 4 : i % 4];
        flops_pass += 2.0 * shape[0] * shape[1];
    }
    loom_backend_t *be = make_backend(n_threads, LOOM_DT_F32);
    struct qmodel *m = xalloc(sizeof *m * N_BENCH_SCHEMES);
    for (int s = 0; s < N_BENCH_SCHEMES; s++) qmodel_init(&m[s], be, k_bench_schemes[s]);
    for (size_t k = 0; k < LOOM_ARRAY_LEN(ns); k++) {
        const int n = ns[k], reps = g_quick ? 2 : 3;
        double t[N_BENCH_SCHEMES][3];
        for (int s = 0; s < N_BENCH_SCHEMES; s++) qmodel_pass(be, &m[s], y, x, n, LOOM_CPU_MM_AUTO);
        for (int r = 0; r < reps; r++)
            for (int s = 0; s < N_BENCH_SCHEMES; s++)
                t[s][r] = qmodel_pass(be, &m[s], y, x, n, LOOM_CPU_MM_AUTO);
        for (int s = 0; s < N_BENCH_SCHEMES; s++) {
            qsort(t[s], (size_t)reps, sizeof(double), cmp_double);
            printf("%-7s %4d %10.1f %10.1f %10.1f %9.2fx\n", k_bench_schemes[s], n,
                   t[s][reps / 2] * 1e3, t[s][0] * 1e3, flops_pass * n / t[s][0] / 1e9,
                   t[0][0] / t[s][0]);
        }
    }
    for (int s = 0; s < N_BENCH_SCHEMES; s++) qmodel_free(&m[s], be);
    loom_aligned_free(m);
    loom_backend_destroy(&be);
    loom_aligned_free(x);
    loom_aligned_free(y);
}

/* The decode GEMV's arithmetic ceiling: one thread, n = 1, one matrix of
 * the model's down shape (768 x 2048) hot in L2, so the time is the
 * kernel's instructions, not DRAM (the machine's load matters less too:
 * best of many short calls). Bytes and MACs per second. */
static void bench_quant_hot(void) {
    static const char *schemes[] = {"int8", "q4", "q4:128", "q4_min"};
    enum { ROWS = M_DIM, COLS = M_HIDDEN, CALLS = 400 };
    printf("\n== quantized GEMV hot in L2, 1 thread, n = 1, %dx%d, isa %s: best of %d calls ==\n", ROWS,
           COLS, loom_cpu_isa_name(loom_cpu_isa_select()), CALLS);
    printf("%-7s %8s %10s %9s %9s\n", "scheme", "KB", "best us", "GB/s", "GMAC/s");
    loom_backend_t *be = make_backend(1, LOOM_DT_F32);
    float *host = xalloc(sizeof(float) * (size_t)ROWS * COLS), *x = xalloc(sizeof(float) * COLS);
    float *y = xalloc(sizeof(float) * ROWS);
    fill_rand(host, (size_t)ROWS * COLS, 21);
    fill_rand(x, COLS, 22);
    for (size_t s = 0; s < LOOM_ARRAY_LEN(schemes); s++) {
        loom_weight_t w;
        upload_any(be, &w, schemes[s], host, ROWS, COLS);
        double best = 1e9;
        for (int c = 0; c < CALLS; c++) {
            uint64_t t0 = loom_now_ns();
            loom_cpu_matmul_path(be, y, x, &w, 1, LOOM_CPU_MM_GEMV);
            best = LOOM_MIN(best, (double)(loom_now_ns() - t0) * 1e-9);
        }
        const double b = (double)loom_weight_bytes(&w);
        printf("%-7s %8.0f %10.1f %9.2f %9.2f\n", schemes[s], b / 1024, best * 1e6, b / best / 1e9,
               (double)ROWS * COLS / best / 1e9);
        loom_weight_free(be, &w);
    }
    loom_aligned_free(host);
    loom_aligned_free(x);
    loom_aligned_free(y);
    loom_backend_destroy(&be);
}

static void bench_quant(int n_threads, double triad) {
    if (want("quant") || want("qdecode")) bench_quant_decode(n_threads, triad);
    if (want("quant") || want("qcross")) bench_quant_crossover(n_threads);
    if (want("quant") || want("qprefill")) bench_quant_prefill(n_threads);
}

int main(int argc, char **argv) {
    loom_cpu_blas_check(argv); /* first: it may re-execute */
    int n_threads = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            n_threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick"))
            g_quick = 1;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            g_only = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--threads N] [--quick] [--only SECTION]\n", argv[0]);
            return 2;
        }
    }
    if (n_threads <= 0) n_threads = (int)LOOM_MAX(1L, sysconf(_SC_NPROCESSORS_ONLN));
    uint64_t t0 = loom_now_ns();
    double triad1 = 0, triad = 0;
    if (want("triad") || want("gemv") || want("quant") || want("qdecode")) {
        triad1 = loom_bench_triad_gbs(1);
        triad = n_threads == 1 ? triad1 : loom_bench_triad_gbs(n_threads);
        printf("== triad (STREAM convention, 24 B/element, 3 x 64 MiB) ==\n");
        printf("1 thread: %.2f GB/s   %d threads: %.2f GB/s\n", triad1, n_threads, triad);
    }
    if (want("gemv")) {
        /* The machine is shared: measure again next to the table, keep the best. */
        triad = LOOM_MAX(triad, loom_bench_triad_gbs(n_threads));
        printf("triad used for the ratios: %.2f GB/s (best of two runs)\n", triad);
        bench_gemv(n_threads, triad);
        if (n_threads > 1 && !g_quick) {
            triad1 = LOOM_MAX(triad1, loom_bench_triad_gbs(1));
            printf("\n(single thread, for scale; triad %.2f GB/s)", triad1);
            bench_gemv(1, triad1);
        }
    }
    if (want("crossover")) bench_crossover(n_threads);
    if (want("prefill")) bench_prefill(n_threads);
    if (want("dispatch")) bench_dispatch(n_threads);
    if (want("attention")) bench_attention(n_threads);
    if (want("mla")) bench_mla(n_threads);
    if (want("eltwise")) bench_eltwise(n_threads);
    if (want("qhot")) bench_quant_hot();
    if (want("quant") || want("qdecode") || want("qcross") || want("qprefill")) {
        triad = LOOM_MAX(triad, loom_bench_triad_gbs(n_threads));
        printf("\ntriad used for the quantized ratios: %.2f GB/s (best of the runs)\n", triad);
        bench_quant(n_threads, triad);
    }
    printf("\ntotal %.1f s\n", (double)(loom_now_ns() - t0) * 1e-9);
    return 0;
}

/* Paged GQA attention (see attention.h). Per task, block by block of the
 * sequence's block table: pass 1 computes the scaled scores q·k of every
 * cached position [0, pos] for each query head of the task into scratch;
 * with a soft cap (Gemma 2) each score s becomes cap * tanh(s / cap); a
 * numerically stable softmax follows (subtract the max, exp, sum; an
 * attention sink, GPT-OSS's, adds exp(sink) to the sum and no value); pass 2
 * accumulates the value rows weighted by the unnormalised probabilities,
 * one KV block (B rows) at a time, and divides by the sum at the end.
 * Both passes read the cache in its own dtype: a BF16 element is widened in
 * a register (a shift), an I8 one converted (its row's scale is folded into
 * the score, or into the probability that weights the V row), so a narrow
 * cache moves half or a quarter of the bytes and costs one or two extra
 * instructions per 8 elements. Up to three query heads of the task share
 * each loaded and widened K or V vector (GQA), with four keys per pass over
 * K: 12 accumulators, one reduction per 4 scores per head.
 * V rows may be narrower than K's (kv.v_dim: decompressed MLA's 128 against
 * 192); the weighted sum and the output heads then have V's width.
 * Decode napkin math: 2 * ctx * hd * e bytes of K/V per KV head (e = 4 f32,
 * 2 bf16, 1 + 4/hd int8), and 4 * ctx * hd FLOPs per query head. */
#include "kernels/cpu/attention.h"

#include <math.h>
#include <string.h>

#include "common/util.h"
#include "kernels/cpu/vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTN_SIMD 1
#endif

enum { MAX_G = 3 }; /* query heads per pass over a block */
#ifndef PF_BLOCKS
#define PF_BLOCKS 2
#endif

int loom_cpu_attention_heads_per_task(const loom_attn_args_t *a, int n_threads) {
    const int group = a->n_heads / a->n_kv_heads;
    int hpt = group;
    for (; hpt > 1; hpt--) {
        if (group % hpt) continue;
        if ((int64_t)a->n * (a->n_heads / hpt) >= 2 * (int64_t)n_threads) break;
    }
    return hpt;
}

size_t loom_cpu_attention_scratch_floats(const loom_attn_args_t *a, int heads_per_task) {
    /* scores (hpt, max_ctx), 1/sum (hpt), a block's scaled weights (hpt, B)
     * and its key scales (B) */
    const size_t B = (size_t)a->block_size, hpt = (size_t)heads_per_task;
    return hpt * ((size_t)(a->max_ctx > 0 ? a->max_ctx : 1) + 1) + hpt * B + B;
}

/* Asks for the next block's rows of this KV head while the current block is
 * computed: the rows are nkv*hd elements apart, a stride the hardware
 * prefetchers do not follow across pages. */
static void prefetch_block(const loom_kv_layer_t *kv, const void *cache, size_t esize, const int32_t *bt,
                           int next_p0, int L, int B, int64_t kv_dim, int kvh, int hd) {
    if (next_p0 >= L) return;
    const int64_t row_bytes = kv_dim * (int64_t)esize;
    const char *row = (const char *)cache + (loom_kv_row(kv, (int64_t)bt[next_p0 / B] * B, kv_dim) +
                                             (int64_t)kvh * hd) * (int64_t)esize;
    const int np = LOOM_MIN(B, L - next_p0);
    const int64_t bytes = (int64_t)hd * (int64_t)esize;
    for (int p = 0; p < np; p++, row += row_bytes)
        for (int64_t off = 0; off < bytes; off += 64)
            __builtin_prefetch(row + off, 0, 2);
}

/* At block p0: the block PF_BLOCKS ahead (at p0 = 0: the PF_BLOCKS after
 * it), so about PF_BLOCKS blocks of rows are in flight while one is
 * computed. */
static void prefetch_ahead(const loom_kv_layer_t *kv, const void *cache, size_t esize, const int32_t *bt,
                           int p0, int L, int B, int64_t kv_dim, int kvh, int hd) {
    for (int j = p0 ? PF_BLOCKS : 0; j <= PF_BLOCKS; j++)
        prefetch_block(kv, cache, esize, bt, p0 + j * B, L, B, kv_dim, kvh, hd);
}

/* Element e of a cache as float (I8: the code, unscaled). */
static inline float kv_at(const void *base, loom_dtype_t dt, int64_t e) {
    if (dt == LOOM_DT_F32) return ((const float *)base)[e];
    if (dt == LOOM_DT_BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)base)[e] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return (float)((const int8_t *)base)[e];
}

/* Scores of keys [p, p + n) of a block for G heads (scalar):
 * s[g * ls + j] = (q_g · k_j) * ksc[j] (ksc NULL: * scale). */
static void scores_scalar(int G, const float *q, int hd, const void *k, loom_dtype_t dt, int64_t ks,
                          int p, int n, const float *ksc, float scale, float *s, int64_t ls) {
    for (int g = 0; g < G; g++)
        for (int j = p; j < p + n; j++) {
            float acc = 0.0f;
            for (int d = 0; d < hd; d++)
                acc += q[(int64_t)g * hd + d] * kv_at(k, dt, (int64_t)j * ks + d);
            s[(int64_t)g * ls + j] = acc * (ksc ? ksc[j] : scale);
        }
}

/* out[g] += sum_p w[g * lw + p] * v_p for G heads (scalar). */
static void wsum_scalar(int G, float *out, int hd, const float *w, int64_t lw, const void *v,
                        loom_dtype_t dt, int64_t vs, int np) {
    for (int g = 0; g < G; g++)
        for (int p = 0; p < np; p++)
            for (int d = 0; d < hd; d++)
                out[(int64_t)g * hd + d] += w[(int64_t)g * lw + p] * kv_at(v, dt, (int64_t)p * vs + d);
}

#ifdef ATTN_SIMD
static inline __attribute__((always_inline)) __m256 load8(const void *base, const loom_dtype_t dt,
                                                          int64_t e) {
    if (dt == LOOM_DT_F32) return _mm256_loadu_ps((const float *)base + e);
    if (dt == LOOM_DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + e))),
            16));
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + e))));
}

/* Scores of keys [0, np) of a block for G heads, four keys per pass (hd a
 * multiple of 8); the last np % 4 keys go scalar. */
static inline __attribute__((always_inline)) void scores_simd(const int G, const loom_dtype_t dt,
                                                              const float *q, int hd, const void *k,
                                                              int64_t ks, int np, const float *ksc,
                                                              float scale, float *s, int64_t ls) {
    int p = 0;
    for (; p + 4 <= np; p += 4) {
        __m256 acc[MAX_G][4];
        for (int g = 0; g < G; g++)
            for (int j = 0; j < 4; j++)
                acc[g][j] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 8) {
            __m256 kv[4];
            for (int j = 0; j < 4; j++)
                kv[j] = load8(k, dt, (int64_t)(p + j) * ks + d);
            for (int g = 0; g < G; g++) {
                const __m256 qv = _mm256_loadu_ps(q + (int64_t)g * hd + d);
                for (int j = 0; j < 4; j++)
                    acc[g][j] = _mm256_fmadd_ps(qv, kv[j], acc[g][j]);
            }
        }
        const __m128 sc = ksc ? _mm_loadu_ps(ksc + p) : _mm_set1_ps(scale);
        for (int g = 0; g < G; g++) { /* lanes end up as the four keys' sums */
            __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]),
                                      _mm256_hadd_ps(acc[g][2], acc[g][3]));
            __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(s + (int64_t)g * ls + p, _mm_mul_ps(r, sc));
        }
    }
    if (p < np) scores_scalar(G, q, hd, k, dt, ks, p, np - p, ksc, scale, s, ls);
}

/* out[g] += sum_p w[g * lw + p] * v_p for G heads, 16 columns per pass
 * (hd a multiple of 8). */
static inline __attribute__((always_inline)) void wsum_simd(const int G, const loom_dtype_t dt,
                                                            float *out, int hd, const float *w,
                                                            int64_t lw, const void *v, int64_t vs,
                                                            int np) {
    int d = 0;
    for (; d + 16 <= hd; d += 16) {
        __m256 acc[MAX_G][2];
        for (int g = 0; g < G; g++) {
            acc[g][0] = _mm256_loadu_ps(out + (int64_t)g * hd + d);
            acc[g][1] = _mm256_loadu_ps(out + (int64_t)g * hd + d + 8);
        }
        for (int p = 0; p < np; p++) {
            const __m256 v0 = load8(v, dt, (int64_t)p * vs + d), v1 = load8(v, dt, (int64_t)p * vs + d + 8);
            for (int g = 0; g < G; g++) {
                const __m256 wp = _mm256_broadcast_ss(w + (int64_t)g * lw + p);
                acc[g][0] = _mm256_fmadd_ps(wp, v0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(wp, v1, acc[g][1]);
            }
        }
        for (int g = 0; g < G; g++) {
            _mm256_storeu_ps(out + (int64_t)g * hd + d, acc[g][0]);
            _mm256_storeu_ps(out + (int64_t)g * hd + d + 8, acc[g][1]);
        }
    }
    if (d < hd) {
        __m256 acc[MAX_G];
        for (int g = 0; g < G; g++)
            acc[g] = _mm256_loadu_ps(out + (int64_t)g * hd + d);
        for (int p = 0; p < np; p++) {
            const __m256 v0 = load8(v, dt, (int64_t)p * vs + d);
            for (int g = 0; g < G; g++)
                acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + (int64_t)g * lw + p), v0, acc[g]);
        }
        for (int g = 0; g < G; g++)
            _mm256_storeu_ps(out + (int64_t)g * hd + d, acc[g]);
    }
}

/* One specialisation per (heads per pass, dtype): the dtype's loads and
 * the accumulator count are compile-time constants. */
#define ATTN_SPECS(X) \
    X(1, F32) X(2, F32) X(3, F32) X(1, BF16) X(2, BF16) X(3, BF16) X(1, I8) X(2, I8) X(3, I8)
#define ATTN_DEFINE(G, DT)                                                                        \
    static void scores_##G##_##DT(const float *q, int hd, const void *k, int64_t ks, int np,      \
                                  const float *ksc, float scale, float *s, int64_t ls) {         \
        scores_simd(G, LOOM_DT_##DT, q, hd, k, ks, np, ksc, scale, s, ls);                       \
    }                                                                                             \
    static void wsum_##G##_##DT(float *out, int hd, const float *w, int64_t lw, const void *v,   \
                                int64_t vs, int np) {                                             \
        wsum_simd(G, LOOM_DT_##DT, out, hd, w, lw, v, vs, np);                                    \
    }
ATTN_SPECS(ATTN_DEFINE)
#undef ATTN_DEFINE
#endif

static void scores_block(int G, loom_dtype_t dt, const float *q, int hd, const void *k, int64_t ks,
                         int np, const float *ksc, float scale, float *s, int64_t ls) {
#ifdef ATTN_SIMD
    if (hd % 8 == 0) {
#define ATTN_CASE(GG, DT)                                                                         \
    if (G == GG && dt == LOOM_DT_##DT) {                                                          \
        scores_##GG##_##DT(q, hd, k, ks, np, ksc, scale, s, ls);                                  \
        return;                                                                                   \
    }
        ATTN_SPECS(ATTN_CASE)
#undef ATTN_CASE
    }
#endif
    scores_scalar(G, q, hd, k, dt, ks, 0, np, ksc, scale, s, ls);
}

static void wsum_block(int G, loom_dtype_t dt, float *out, int hd, const float *w, int64_t lw,
                       const void *v, int64_t vs, int np) {
#ifdef ATTN_SIMD
    if (hd % 8 == 0) {
#define ATTN_CASE(GG, DT)                                                                         \
    if (G == GG && dt == LOOM_DT_##DT) {                                                          \
        wsum_##GG##_##DT(out, hd, w, lw, v, vs, np);                                              \
        return;                                                                                   \
    }
        ATTN_SPECS(ATTN_CASE)
#undef ATTN_CASE
    }
#endif
    wsum_scalar(G, out, hd, w, lw, v, dt, vs, np);
}

/* Heads in the next pass: at most MAX_G, and no pass of one head when two
 * passes of two will do (4 = 2 + 2, 7 = 3 + 2 + 2). */
static int pass_heads(int left) {
    return left <= MAX_G ? left : left == 4 ? 2 : MAX_G;
}

void loom_cpu_attention_task(const loom_attn_args_t *a, int hpt, int task, float *scratch) {
    const int nh = a->n_heads, hd = a->head_dim, B = a->block_size, nkv = a->n_kv_heads;
    const int vd = a->kv.v_dim ? a->kv.v_dim : hd; /* V's head dim (decompressed MLA: not K's) */
    const int group = nh / nkv, tasks_per_token = nh / hpt;
    const int i = task / tasks_per_token, h0 = (task % tasks_per_token) * hpt, kvh = h0 / group;
    const int64_t kv_dim = (int64_t)nkv * hd, v_dim = (int64_t)nkv * vd;
    const int32_t *bt = a->block_tables + (int64_t)a->tok_seq[i] * a->max_blocks;
    const int L = a->tok_pos[i] + 1;
    const loom_dtype_t dt = a->kv.dtype;
    LOOM_ASSERT(L >= 1 && L <= a->max_ctx);
    LOOM_ASSERT(dt == LOOM_DT_F32 || dt == LOOM_DT_BF16 ||
                (dt == LOOM_DT_I8 && a->kv.k_scale && a->kv.v_scale));
    const float *q = a->q + (int64_t)i * a->q_stride + (int64_t)h0 * hd;
    float *out = a->out + (int64_t)i * a->out_stride + (int64_t)h0 * vd;
    const size_t esize = loom_dtype_size(dt);
    float *scores = scratch;                        /* (hpt, L) */
    float *inv_sum = scores + (int64_t)hpt * a->max_ctx; /* (hpt) */
    float *wblk = inv_sum + hpt;                    /* (hpt, B): I8 V weights */
    float *ksc = wblk + (int64_t)hpt * B;           /* (B): I8 key scales */

    /* A sliding window starts at p_lo; whole blocks before it are skipped
     * (their table entries may be freed), the positions of its first block
     * before p_lo get no weight. */
    const int p_lo = a->window > 0 && L > a->window ? L - a->window : 0;
    const int b_lo = p_lo / B * B;
    for (int p0 = b_lo; p0 < L; p0 += B) {
        const int np = LOOM_MIN(B, L - p0);
        const int64_t slot0 = (int64_t)bt[p0 / B] * B;
        const int64_t row0 = loom_kv_row(&a->kv, slot0, kv_dim), srow0 = loom_kv_scale_row(&a->kv, slot0, nkv);
        const char *k = (const char *)a->kv.k + ((row0 + (int64_t)kvh * hd) * (int64_t)esize);
        prefetch_ahead(&a->kv, a->kv.k, esize, bt, p0, L, B, kv_dim, kvh, hd);
        if (dt == LOOM_DT_I8)
            for (int p = 0; p < np; p++)
                ksc[p] = a->kv.k_scale[srow0 + (int64_t)p * nkv + kvh] * a->scale;
        for (int g = 0; g < hpt;) {
            const int G = pass_heads(hpt - g);
            scores_block(G, dt, q + (int64_t)g * hd, hd, k, kv_dim, np, dt == LOOM_DT_I8 ? ksc : NULL,
                         a->scale, scores + (int64_t)g * L + p0, L);
            g += G;
        }
    }
    prefetch_ahead(&a->kv, a->kv.v, esize, bt, b_lo, L, B, v_dim, kvh, vd); /* during the softmax */
    for (int g = 0; g < hpt; g++) {
        float *s = scores + (int64_t)g * L;
        if (a->softcap > 0) loom_vec_softcap(s + p_lo, L - p_lo, a->softcap); /* before the softmax */
        float mx = loom_vec_max(s + p_lo, L - p_lo);
        if (a->sinks) { /* GPT-OSS: one more logit in the denominator, with no value */
            const float sk = a->sinks[h0 + g];
            mx = sk > mx ? sk : mx;
            inv_sum[g] = 1.0f / (loom_vec_exp_sub_sum(s + p_lo, L - p_lo, mx) + expf(sk - mx));
        } else {
            const float sum = loom_vec_exp_sub_sum(s + p_lo, L - p_lo, mx);
            inv_sum[g] = 1.0f / sum;
            if (a->lse) a->lse[(int64_t)i * nh + h0 + g] = mx + logf(sum);
        }
        for (int p = b_lo; p < p_lo; p++) s[p] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)hpt * (size_t)vd);
    for (int p0 = b_lo; p0 < L; p0 += B) {
        const int np = LOOM_MIN(B, L - p0);
        const int64_t slot0 = (int64_t)bt[p0 / B] * B;
        const int64_t row0 = loom_kv_row(&a->kv, slot0, v_dim), srow0 = loom_kv_scale_row(&a->kv, slot0, nkv);
        const char *v = (const char *)a->kv.v + ((row0 + (int64_t)kvh * vd) * (int64_t)esize);
        if (p0 > b_lo) prefetch_ahead(&a->kv, a->kv.v, esize, bt, p0, L, B, v_dim, kvh, vd);
        const float *w = scores + p0;
        int64_t lw = L;
        if (dt == LOOM_DT_I8) { /* fold each row's scale into its weights */
            for (int g = 0; g < hpt; g++)
                for (int p = 0; p < np; p++)
                    wblk[(int64_t)g * B + p] =
                        scores[(int64_t)g * L + p0 + p] * a->kv.v_scale[srow0 + (int64_t)p * nkv + kvh];
            w = wblk, lw = B;
        }
        for (int g = 0; g < hpt;) {
            const int G = pass_heads(hpt - g);
            wsum_block(G, dt, out + (int64_t)g * vd, vd, w + (int64_t)g * lw, lw, v, v_dim, np);
            g += G;
        }
    }
    for (int g = 0; g < hpt; g++)
        loom_vec_scale(out + (int64_t)g * vd, inv_sum[g], out + (int64_t)g * vd, vd);
}

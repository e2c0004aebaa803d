/* Per-element math of the CUDA kernels that are not plain arithmetic:
 * attention's key range (sliding windows, flash-decoding splits), logit soft
 * caps, the online softmax and its attention sink, the int8 and fp8 KV
 * (de)quantisation, and the MLP activations. Every function is
 * __host__ __device__ under nvcc and static inline C elsewhere, so
 * tests/unit/test_cuda_math.c replays the very code the GPU runs against
 * float64 and against the CPU backend (as qformat.h does for weights). */
#ifndef LOOM_CUDA_OPMATH_H
#define LOOM_CUDA_OPMATH_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define LOOM_OM static __host__ __device__ __forceinline__
#else
#define LOOM_OM static inline
#endif

/* --- attention's key range ------------------------------------------------------ */

/* Keys per step of both attention kernels (a warp's 32 lanes). */
#define LOOM_OM_KEYS 32

/* First key position a query at `pos` attends to: pos + 1 - window under a
 * sliding window of `window` (> 0) positions, else 0. */
LOOM_OM int loom_om_window_lo(int pos, int window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* The key slice [*k0, *k1) of split s of n_split over the range [lo, hi):
 * equal slices rounded up to whole steps of LOOM_OM_KEYS; a slice past the
 * end is empty (*k0 >= *k1). */
LOOM_OM void loom_om_split_range(int lo, int hi, int n_split, int s, int *k0, int *k1) {
    const int len = hi - lo;
    int chunk = (len + n_split - 1) / n_split;
    chunk = (chunk + LOOM_OM_KEYS - 1) / LOOM_OM_KEYS * LOOM_OM_KEYS;
    *k0 = lo + s * chunk;
    *k1 = *k0 + chunk < hi ? *k0 + chunk : hi;
}

/* --- wide heads (MLA's latent rows: 576 for DeepSeek-V3) -------------------------- */

/* attention.cu's wide kernel (head_dim above 256) works on tiles of
 * LOOM_OM_WIDE_ROWS query rows, (token, head) pairs, against steps of
 * LOOM_OM_WIDE_KEYS keys, everything in fp32 on CUDA cores; up to
 * LOOM_OM_WIDE_MAX_HD elements a row. */
#define LOOM_OM_WIDE_ROWS 16
#define LOOM_OM_WIDE_KEYS 16
#define LOOM_OM_WIDE_MAX_HD 768

/* Query heads of one KV head a wide tile takes: all `group` of them up to
 * LOOM_OM_WIDE_ROWS, else LOOM_OM_WIDE_ROWS (a KV head's heads are cut
 * into chunks, one tile each; MQA's 128 heads are 8 chunks). */
LOOM_OM int loom_om_wide_heads(int group) {
    return group < LOOM_OM_WIDE_ROWS ? group : LOOM_OM_WIDE_ROWS;
}
/* Tokens of one sequence a wide tile takes (its unit's rows, `tq`): as many
 * as fill the tile with the chunk's heads, so a prefill chunk reads each
 * key once for LOOM_OM_WIDE_ROWS query rows. */
LOOM_OM int loom_om_wide_tq(int group) {
    return LOOM_OM_WIDE_ROWS / loom_om_wide_heads(group);
}
/* Chunks of heads per KV head. */
LOOM_OM int loom_om_wide_chunks(int group) {
    const int hc = loom_om_wide_heads(group);
    return (group + hc - 1) / hc;
}

/* --- the decode GEMV's variants (gemv.cu; the tuning table's gemv_variant) ------------ */

/* Rows of W per warp (R) and 16-byte loads per row in flight per lane (U)
 * of the vector GEMV for nt tokens: variant 0 (the default) 2 rows for
 * nt <= 2, else 4, R * U = 8 loads in flight; 1 one row per warp, 8 loads
 * (a grid 2-4x larger, for shapes with few rows); 2 the default's rows with
 * twice the loads in flight (16). Every variant walks a lane's vectors of
 * a row in the same order (lane, lane + 32, ...), so they give the same
 * bits; only the memory-level parallelism differs. */
#define LOOM_OM_GEMV_VARIANTS 3
LOOM_OM void loom_om_gemv_plan(int variant, int nt, int *rows_per_warp, int *loads) {
    const int r = variant == 1 ? 1 : nt <= 2 ? 2 : 4;
    *rows_per_warp = r;
    *loads = (variant == 2 ? 16 : 8) / r;
}

/* The quantized GEMV's (qgemv.cu; the tuning table's qgemv_variant), for
 * nt tokens: variant 0 (the default) R = 4 rows a warp for nt <= 2, 2 for
 * nt <= 4, else 1, U = 2 loads a row in flight; for nt <= 2, variant 1 R =
 * 2 with U = 4 and variant 2 R = 1 with U = 8: the same 8 loads in flight
 * a lane, spread over fewer rows (a grid 2-4x larger). More tokens keep the
 * default (their partial sums take the registers: more loads in flight
 * spill under the kernel's 128-register bound). The same bits for every
 * variant, as the GEMV's. */
#define LOOM_OM_QGEMV_VARIANTS 3
LOOM_OM void loom_om_qgemv_plan(int variant, int nt, int *rows_per_warp, int *loads) {
    const int r = nt <= 2 ? 4 : nt <= 4 ? 2 : 1;
    if (nt > 2 || variant <= 0 || variant >= LOOM_OM_QGEMV_VARIANTS) {
        *rows_per_warp = r, *loads = 2;
        return;
    }
    *rows_per_warp = variant == 1 ? 2 : 1;
    *loads = 8 / *rows_per_warp;
}

/* --- scores and the online softmax ------------------------------------------------ */

/* Gemma 2's logit soft cap on a scaled score: cap * tanh(s / cap); cap <= 0
 * leaves s as it is. */
LOOM_OM float loom_om_softcap(float s, float cap) {
    return cap > 0.0f ? cap * tanhf(s * (1.0f / cap)) : s;
}

/* The factor exp(m_old - m_new) that rescales a running sum and accumulator
 * when the running max moves from m_old to m_new (>= m_old); 1 while both
 * are -inf (no key seen yet), 0 for a state that saw no key merged into one
 * that did. */
LOOM_OM float loom_om_rescale(float m_old, float m_new) {
    return m_new == -INFINITY ? 1.0f : m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
}

/* Folds GPT-OSS's attention sink into a finished softmax state (max *m,
 * sum *l, accumulator acc): the sink is one more partial state {max = sink,
 * sum = 1, no value}, merged as the split partials are. This is the same as
 * starting the running max at the sink logit and the sum at 1, but counts
 * the sink once however many warps and splits shared the keys. Returns the
 * factor acc must be multiplied by. */
LOOM_OM float loom_om_sink_fold(float *m, float *l, float sink) {
    const float mn = *m > sink ? *m : sink;
    const float f = loom_om_rescale(*m, mn);
    *l = *l * f + expf(sink - mn);
    *m = mn;
    return f;
}

/* --- KV cache element types ------------------------------------------------------- */

/* int8 KV (the CPU backend's layout, kernels/backend.h): one float32 scale
 * per token and KV head, scale = absmax / 127, code = round-half-even(x *
 * 127 / absmax) clamped to [-127, 127]; an all-zero row has scale 0 and
 * codes 0. x = scale * code. */
LOOM_OM float loom_om_i8_scale(float absmax) {
    return absmax / 127.0f;
}
LOOM_OM float loom_om_i8_inv(float absmax) {
    return absmax > 0.0f ? 127.0f / absmax : 0.0f;
}
LOOM_OM int loom_om_i8_code(float x, float inv) {
    const float r = rintf(x * inv); /* round half to even, as nearbyintf on the CPU */
    return (int)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
}

/* fp8 e4m3 KV: the largest finite magnitude. Values beyond it are clamped
 * to +-448 on the write (never NaN) and counted (loom_cuda_kv_write's
 * `clamped` counter). */
#define LOOM_OM_FP8_MAX 448.0f
LOOM_OM float loom_om_fp8_clamp(float x) {
    return x > LOOM_OM_FP8_MAX ? LOOM_OM_FP8_MAX : x < -LOOM_OM_FP8_MAX ? -LOOM_OM_FP8_MAX : x;
}
/* The per-tensor scale of an fp8 cache (kernels/backend.h's fp8_scale):
 * 0 (none given) and anything not a positive finite number count as 1. */
LOOM_OM float loom_om_fp8_scale(float s) {
    return s > 0.0f && s < INFINITY ? s : 1.0f;
}
/* What the write stores for x under scale s, before the e4m3 rounding:
 * x / s clamped to +-448 (the division as a multiplication by 1 / s, so a
 * scale of 1 leaves x exactly as it was). The attention kernels fold s
 * back in at no cost per element: K's into the query's pre-scale, V's into
 * the normalised output. */
LOOM_OM float loom_om_fp8_store(float x, float inv_scale) {
    return loom_om_fp8_clamp(x * inv_scale);
}

/* --- DeepSeekMoE's router (worker/moe_ds.c; moe.cu's ds_route_kernel) ---------------- */

/* topk_method, as loom_ds_topk_t (common/model_config.h) */
enum { LOOM_OM_DS_GREEDY = 0, LOOM_OM_DS_GROUP_LIMITED = 1, LOOM_OM_DS_NOAUX_TC = 2 };

/* Whether candidate (v, i) beats (bv, bi) in an arg-max with ties to the
 * lower index; an index of `none` is no candidate. */
LOOM_OM int loom_om_better(float v, int i, float bv, int bi, int none) {
    return i != none && (bi == none || v > bv || (v == bv && i < bi));
}

/* A group's rank of its experts' biased scores c[0..per): the sum of its
 * best two (noaux_tc, top2 = 1; per >= 2) or its best (group-limited greedy),
 * in the host router's scan order. */
LOOM_OM float loom_om_ds_group_score(const float *c, int per, int top2) {
    if (!top2) {
        float m = c[0];
        for (int i = 1; i < per; i++) m = c[i] > m ? c[i] : m;
        return m;
    }
    int a = c[1] > c[0] ? 1 : 0, b = 1 - a;
    for (int i = 2; i < per; i++) {
        if (c[i] > c[a]) {
            b = a;
            a = i;
        } else if (c[i] > c[b]) {
            b = i;
        }
    }
    return c[a] + c[b];
}

/* A chosen expert's weight from its unbiased score: divided by the chosen
 * scores' sum (summed in double, ascending expert order) when renorm, then
 * times the routed scaling factor, in double as the host does. */
LOOM_OM float loom_om_ds_weight(float score, double sum, int renorm, float scaling) {
    const double norm = renorm ? 1.0 / (sum + 1e-20) : 1.0;
    return (float)(score * norm * scaling);
}

/* --- MLP activations ------------------------------------------------------------------ */

/* The activations of loom_act_t (kernels/backend.h), by value. */
enum {
    LOOM_OM_ACT_SILU = 0,
    LOOM_OM_ACT_GELU,
    LOOM_OM_ACT_GELU_TANH,
    LOOM_OM_ACT_QUICK_GELU,
    LOOM_OM_ACT_RELU,
    LOOM_OM_ACT_RELU2,
};

/* act(x) of one gate element (the CPU's loom_vec_act_mul, scalar form). */
LOOM_OM float loom_om_act(int act, float x) {
    switch (act) {
    case LOOM_OM_ACT_GELU:
        return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case LOOM_OM_ACT_GELU_TANH:
        return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
    case LOOM_OM_ACT_QUICK_GELU:
        return x / (1.0f + expf(-1.702f * x));
    case LOOM_OM_ACT_RELU:
        return x > 0.0f ? x : 0.0f;
    case LOOM_OM_ACT_RELU2:
        return x > 0.0f ? x * x : 0.0f;
    default:
        return x / (1.0f + expf(-x)); /* SILU */
    }
}

/* GPT-OSS's clamped SwiGLU of one (gate, up) pair: g = min(gate, limit),
 * u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g), with the
 * CPU's comparisons (a NaN gate becomes limit there too). */
LOOM_OM float loom_om_swiglu_clamp(float gate, float up, float alpha, float limit) {
    const float g = gate < limit ? gate : limit;
    const float u = up < -limit ? -limit : up > limit ? limit : up;
    return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
}

#endif

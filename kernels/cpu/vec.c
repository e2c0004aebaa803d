/* Vector kernels of the CPU backend (see vec.h). The SIMD exp is a Cephes-
 * style range reduction (x = n·ln2 + r, |r| <= ln2/2) with a degree-6
 * polynomial for e^r, about 2 ulp over the clamped range [-87.3, 88]: below
 * that it returns ~1e-38 instead of 0, which no softmax or SiLU notices. */
#include "kernels/cpu/vec.h"

#include <math.h>
#include <string.h>

#include "common/status.h"
#include "common/util.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOOM_VEC_SIMD 1

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

float loom_vec_dot(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.0f;
#ifdef LOOM_VEC_SIMD
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s = hsum8(_mm256_add_ps(s0, s1));
#endif
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

void loom_vec_dot4(const float *q, const float *k, int64_t k_stride, int n, float out[4]) {
    const float *k0 = k, *k1 = k + k_stride, *k2 = k + 2 * k_stride, *k3 = k + 3 * k_stride;
    int i = 0;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#ifdef LOOM_VEC_SIMD
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 8 <= n; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
    }
    /* Reduce the four accumulators at once: lanes end up as (s0, s1, s2, s3). */
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    float tmp[4];
    _mm_storeu_ps(tmp, r);
    s0 = tmp[0], s1 = tmp[1], s2 = tmp[2], s3 = tmp[3];
#endif
    for (; i < n; i++) {
        s0 += q[i] * k0[i];
        s1 += q[i] * k1[i];
        s2 += q[i] * k2[i];
        s3 += q[i] * k3[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

void loom_vec_bf16_to_f32(float *y, const uint16_t *x, int n) {
    int i = 0;
#ifdef LOOM_VEC_SIMD
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i)));
        _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    for (; i < n; i++) {
        uint32_t u = (uint32_t)x[i] << 16;
        memcpy(y + i, &u, sizeof u);
    }
}

void loom_vec_i8_to_f32(float *y, const int8_t *x, float scale, int n) {
    int i = 0;
#ifdef LOOM_VEC_SIMD
    __m256 vs = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(x + i)));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), vs));
    }
#endif
    for (; i < n; i++)
        y[i] = scale * (float)x[i];
}

void loom_vec_f32_to_bf16(uint16_t *y, const float *x, int n) {
    for (int i = 0; i < n; i++)
        y[i] = loom_f32_to_bf16(x[i]);
}

float loom_vec_f32_to_i8(int8_t *y, const float *x, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < n; i++) {
        float r = nearbyintf(x[i] * inv);
        y[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    return s;
}

void loom_vec_wsum_rows(float *y, const float *w, const float *v, int64_t v_stride, int np, int n) {
    int d = 0;
#ifdef LOOM_VEC_SIMD
    for (; d + 32 <= n; d += 32) { /* 4 accumulators stay in registers across the rows */
        __m256 a0 = _mm256_loadu_ps(y + d), a1 = _mm256_loadu_ps(y + d + 8),
               a2 = _mm256_loadu_ps(y + d + 16), a3 = _mm256_loadu_ps(y + d + 24);
        const float *vp = v + d;
        for (int p = 0; p < np; p++, vp += v_stride) {
            __m256 wp = _mm256_broadcast_ss(w + p);
            a0 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(vp), a0);
            a1 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(vp + 8), a1);
            a2 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(vp + 16), a2);
            a3 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(vp + 24), a3);
        }
        _mm256_storeu_ps(y + d, a0);
        _mm256_storeu_ps(y + d + 8, a1);
        _mm256_storeu_ps(y + d + 16, a2);
        _mm256_storeu_ps(y + d + 24, a3);
    }
    for (; d + 8 <= n; d += 8) {
        __m256 a0 = _mm256_loadu_ps(y + d);
        const float *vp = v + d;
        for (int p = 0; p < np; p++, vp += v_stride)
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w + p), _mm256_loadu_ps(vp), a0);
        _mm256_storeu_ps(y + d, a0);
    }
#endif
    for (; d < n; d++) {
        float a = y[d];
        for (int p = 0; p < np; p++)
            a += w[p] * v[p * v_stride + d];
        y[d] = a;
    }
}

void loom_vec_axpy(float *y, float a, const float *x, int n) {
    int i = 0;
#ifdef LOOM_VEC_SIMD
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i,
                         _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++)
        y[i] += a * x[i];
}

void loom_vec_scale(float *y, float a, const float *x, int n) {
    int i = 0;
#ifdef LOOM_VEC_SIMD
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++)
        y[i] = a * x[i];
}

void loom_vec_add(float *y, const float *a, int64_t n) {
    int64_t i = 0;
#ifdef LOOM_VEC_SIMD
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(a + i)));
#endif
    for (; i < n; i++)
        y[i] += a[i];
}

float loom_vec_max(const float *x, int n) {
    float m = -INFINITY;
    int i = 0;
#ifdef LOOM_VEC_SIMD
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8)
            vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm_cvtss_f32(h);
    }
#endif
    for (; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

float loom_vec_exp_sub_sum(float *x, int n, float sub) {
    int i = 0;
    float s = 0.0f;
#ifdef LOOM_VEC_SIMD
    __m256 vs = _mm256_setzero_ps(), vsub = _mm256_set1_ps(sub);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vsub));
        _mm256_storeu_ps(x + i, e);
        vs = _mm256_add_ps(vs, e);
    }
    s = hsum8(vs);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - sub);
        s += x[i];
    }
    return s;
}

void loom_vec_rmsnorm(float *y, const float *x, const float *g, int dim, float eps) {
    int i = 0;
    float ss = 0.0f;
#ifdef LOOM_VEC_SIMD
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; i + 16 <= dim; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        s0 = _mm256_fmadd_ps(a, a, s0);
        s1 = _mm256_fmadd_ps(b, b, s1);
    }
    for (; i + 8 <= dim; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i);
        s0 = _mm256_fmadd_ps(a, a, s0);
    }
    ss = hsum8(_mm256_add_ps(s0, s1));
#endif
    for (; i < dim; i++)
        ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    i = 0;
#ifdef LOOM_VEC_SIMD
    __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= dim; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv),
                                              _mm256_loadu_ps(g + i)));
#endif
    for (; i < dim; i++)
        y[i] = x[i] * inv * g[i];
}

void loom_vec_silu_mul(float *out, const float *gate, const float *up, int hidden) {
    int i = 0;
#ifdef LOOM_VEC_SIMD
    __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= hidden; i += 8) {
        __m256 gv = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < hidden; i++)
        out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void loom_vec_softcap(float *x, int n, float cap) {
    const float inv = 1.0f / cap;
    int i = 0;
#ifdef LOOM_VEC_SIMD
    const __m256 vinv = _mm256_set1_ps(inv), vcap = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f),
                 sign = _mm256_set1_ps(-0.0f), m2 = _mm256_set1_ps(-2.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv);
        const __m256 e = exp8(_mm256_mul_ps(m2, _mm256_andnot_ps(sign, y))); /* exp(-2|y|) in (0, 1] */
        const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(vcap, _mm256_or_ps(t, _mm256_and_ps(sign, y))));
    }
#endif
    for (; i < n; i++) x[i] = cap * tanhf(x[i] * inv);
}

/* Scalar: these activations serve the non-Llama families, whose decode is
 * bound by the weight reads, not by this pass over the hidden rows. */
void loom_vec_act_mul(loom_act_t act, float *out, const float *gate, const float *up, int hidden) {
    if (act == LOOM_ACT_SILU) {
        loom_vec_silu_mul(out, gate, up, hidden);
        return;
    }
    int i = 0;
#ifdef LOOM_VEC_SIMD
    if (act == LOOM_ACT_GELU_TANH) { /* Gemma's GeGLU: 0.5(1 + tanh z) = sigmoid(2z), z = k(x + 0.044715x^3) */
        const __m256 one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(0.044715f),
                     m2k = _mm256_set1_ps(-2.0f * 0.79788456080286536f);
        for (; i + 8 <= hidden; i += 8) {
            __m256 x = _mm256_loadu_ps(gate + i);
            __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            __m256 e = exp8(_mm256_mul_ps(m2k, _mm256_add_ps(x, _mm256_mul_ps(c, x3))));
            __m256 g = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(g, _mm256_loadu_ps(up + i)));
        }
    }
#endif
    for (; i < hidden; i++) {
        const float x = gate[i];
        float a;
        switch (act) {
        case LOOM_ACT_GELU: a = 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); break;
        case LOOM_ACT_GELU_TANH:
            a = 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
            break;
        case LOOM_ACT_QUICK_GELU: a = x / (1.0f + expf(-1.702f * x)); break;
        case LOOM_ACT_RELU: a = x > 0 ? x : 0.0f; break;
        case LOOM_ACT_RELU2: a = x > 0 ? x * x : 0.0f; break;
        default: LOOM_ASSERT(!"unknown activation"); a = 0; break;
        }
        out[i] = a * up[i];
    }
}

void loom_vec_rope(float *x, int n_heads, int hd, int32_t pos, const float *inv_freq) {
    LOOM_ASSERT(hd % 2 == 0 && hd <= LOOM_VEC_ROPE_MAX_HD);
    const int half = hd / 2;
    float c[LOOM_VEC_ROPE_MAX_HD / 2], s[LOOM_VEC_ROPE_MAX_HD / 2];
    for (int j = 0; j < half; j++) {
        double sn, cs;
        sincos((double)pos * (double)inv_freq[j], &sn, &cs);
        c[j] = (float)cs;
        s[j] = (float)sn;
    }
    for (int h = 0; h < n_heads; h++) {
        float *x0 = x + (int64_t)h * hd, *x1 = x0 + half;
        int j = 0;
#ifdef LOOM_VEC_SIMD
        for (; j + 8 <= half; j += 8) {
            __m256 a = _mm256_loadu_ps(x0 + j), b = _mm256_loadu_ps(x1 + j);
            __m256 vc = _mm256_loadu_ps(c + j), vs = _mm256_loadu_ps(s + j);
            _mm256_storeu_ps(x0 + j, _mm256_fmsub_ps(a, vc, _mm256_mul_ps(b, vs)));
            _mm256_storeu_ps(x1 + j, _mm256_fmadd_ps(b, vc, _mm256_mul_ps(a, vs)));
        }
#endif
        for (; j < half; j++) {
            float a = x0[j], b = x1[j];
            x0[j] = a * c[j] - b * s[j];
            x1[j] = b * c[j] + a * s[j];
        }
    }
}

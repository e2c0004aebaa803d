/* Quantized-weight kernels of the CPU backend (see qgemv.h). x is rounded
 * to int8 per 32 columns once per call; each 32-column block of 8 weight
 * rows (one stored panel) then costs 8 broadcast integer dot products
 * (AVX2 vpmaddubsw, or AVX-512 VNNI vpdpbusd on ymm), one int->float
 * conversion and one FMA with the 8 rows' scales times x's. Weights stream
 * from DRAM once per call; x stays in L1. The SIMD code is compiled with target attributes and
 * chosen at run time, so one binary serves AVX2-only and VNNI machines (and
 * a build without -march=native still gets both). */
#include "kernels/cpu/qgemv.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

static float fp8_value(uint8_t v) {
    return loom_fp8_e4m3_to_f32(v);
}

/* --- the stored layout (qgemv.h) ---------------------------------------- */

/* Rows held in whole 8-row panels; the rest keep the row layout. */
static int64_t panel_rows(const loom_weight_t *w) {
    return w->quant == LOOM_QUANT_FP8 ? 0 : w->rows / 8 * 8;
}

static int64_t row_bytes_of(const loom_weight_t *w) {
    return w->quant == LOOM_QUANT_Q4 ? w->cols / 2 : w->cols;
}

/* Bytes of one block of one row: 16 (Q4) or 32 (INT8). */
static int block_bytes_of(const loom_weight_t *w) {
    return w->quant == LOOM_QUANT_Q4 ? LOOM_QBLOCK / 2 : LOOM_QBLOCK;
}

/* Where byte j of row r's block blk (row layout order) is stored. */
static int64_t code_offset(const loom_weight_t *w, int64_t r, int64_t blk, int j) {
    const int64_t rb = row_bytes_of(w);
    const int bb = block_bytes_of(w);
    if (r >= panel_rows(w)) return r * rb + blk * bb + j;
    return (r / 8) * 8 * rb + blk * bb * 8 + (j / 4) * 32 + (r % 8) * 4 + j % 4;
}

/* Where INT8 column c >= (cols / 32) · 32 (the float-path tail) of row r is. */
static int64_t tail_offset(const loom_weight_t *w, int64_t r, int64_t c) {
    if (r >= panel_rows(w)) return r * w->cols + c;
    const int64_t whole = w->cols / LOOM_QBLOCK * LOOM_QBLOCK, tail = w->cols - whole;
    return (r / 8) * 8 * w->cols + whole * 8 + (r % 8) * tail + (c - whole);
}

/* Index of Q4 group g of row r in the stored scales (and mins). */
static int64_t group_index(const loom_weight_t *w, int64_t r, int64_t g) {
    const int64_t ng = w->cols / w->group;
    if (r >= panel_rows(w)) return r * ng + g;
    return ((r / 8) * ng + g) * 8 + r % 8;
}

/* The stored byte of INT8 / FP8 column c of row r. */
static uint8_t byte_at(const loom_weight_t *w, int64_t r, int64_t c) {
    const uint8_t *data = w->data;
    if (w->quant == LOOM_QUANT_FP8) return data[r * w->cols + c];
    if (c >= w->cols / LOOM_QBLOCK * LOOM_QBLOCK) return data[tail_offset(w, r, c)];
    return data[code_offset(w, r, c / LOOM_QBLOCK, (int)(c % LOOM_QBLOCK))];
}

/* The code of Q4 column c of row r. */
static int q4_code_at(const loom_weight_t *w, int64_t r, int64_t c) {
    const int64_t blk = c / LOOM_QBLOCK, j = c % LOOM_QBLOCK;
    const uint8_t b = ((const uint8_t *)w->data)[code_offset(w, r, blk, (int)(j & 15))];
    return j < 16 ? b & 15 : b >> 4;
}

/* Row r's block blk in row layout order: a pointer into the data, or the
 * bytes gathered from its panel into buf. */
static const uint8_t *row_block(const loom_weight_t *w, int64_t r, int64_t blk, uint8_t *buf) {
    const int bb = block_bytes_of(w);
    if (r >= panel_rows(w)) return (const uint8_t *)w->data + code_offset(w, r, blk, 0);
    for (int j = 0; j < bb; j += 4)
        memcpy(buf + j, (const uint8_t *)w->data + code_offset(w, r, blk, j), 4);
    return buf;
}

/* --- scalar reference ------------------------------------------------- */

/* One block of INT8 codes (stored q + 128) times int8 x, as sum(u·x) -
 * 128·sum(x): GCC 12.2 at -O3 with AVX-512 VNNI turns the direct
 * sum((u - 128)·x) into a vpdpbusd that loses the offset (wrong sums). */
static int32_t dot_i8_block(const uint8_t *q, const int8_t *x) {
    int32_t dot = 0, sum = 0;
    for (int j = 0; j < LOOM_QBLOCK; j++) {
        dot += q[j] * x[j];
        sum += x[j];
    }
    return dot - 128 * sum;
}

static void qgemv_scalar(float *y, int64_t ldy, const loom_cpu_qx_t *qx, const loom_weight_t *w,
                         int64_t r0, int64_t r1) {
    const int64_t cols = w->cols;
    const float *scales = w->scales, *mins = w->mins;
    uint8_t buf[LOOM_QBLOCK];
    for (int64_t r = r0; r < r1; r++)
        for (int i = 0; i < qx->n; i++) {
            const float *x = qx->x + (int64_t)i * cols;
            const int8_t *xq = qx->q + (int64_t)i * qx->nb * LOOM_QBLOCK;
            const float *xd = qx->d + (int64_t)i * qx->nb;
            double acc = 0.0;
            if (w->quant == LOOM_QUANT_FP8) {
                for (int64_t c = 0; c < cols; c++)
                    acc += (double)x[c] * fp8_value(byte_at(w, r, c));
                y[(int64_t)i * ldy + r] = (float)(acc * scales[r]);
            } else if (w->quant == LOOM_QUANT_INT8) {
                for (int blk = 0; blk < qx->nb; blk++)
                    acc += (double)xd[blk] *
                           dot_i8_block(row_block(w, r, blk, buf), xq + blk * LOOM_QBLOCK);
                for (int64_t c = (int64_t)qx->nb * LOOM_QBLOCK; c < cols; c++)
                    acc += ((int)byte_at(w, r, c) - 128) * (double)x[c];
                y[(int64_t)i * ldy + r] = (float)(acc * scales[r]);
            } else {
                const int64_t gb = w->group / LOOM_QBLOCK;
                for (int blk = 0; blk < qx->nb; blk++) {
                    int32_t dot = 0, sum = 0;
                    for (int j = 0; j < LOOM_QBLOCK; j++) {
                        int v = xq[blk * LOOM_QBLOCK + j];
                        dot += q4_code_at(w, r, (int64_t)blk * LOOM_QBLOCK + j) * v;
                        sum += v;
                    }
                    const int64_t g = group_index(w, r, blk / gb);
                    double off = mins ? mins[g] : -8.0 * scales[g];
                    acc += (double)xd[blk] * (scales[g] * (double)dot + off * sum);
                }
                y[(int64_t)i * ldy + r] = (float)acc;
            }
        }
}

static void dequant_scalar(float *dst, const loom_weight_t *w, int64_t r0, int64_t r1) {
    const int64_t cols = w->cols;
    const float *scales = w->scales, *mins = w->mins;
    for (int64_t r = r0; r < r1; r++) {
        float *o = dst + (r - r0) * cols;
        if (w->quant == LOOM_QUANT_Q4) {
            for (int64_t c = 0; c < cols; c++) {
                const int64_t g = group_index(w, r, c / w->group);
                const int code = q4_code_at(w, r, c);
                o[c] = mins ? scales[g] * (float)code + mins[g] : scales[g] * (float)(code - 8);
            }
        } else {
            for (int64_t c = 0; c < cols; c++) {
                const uint8_t b = byte_at(w, r, c);
                o[c] = scales[r] *
                       (w->quant == LOOM_QUANT_INT8 ? (float)((int)b - 128) : fp8_value(b));
            }
        }
    }
}

/* --- activations ------------------------------------------------------ */

size_t loom_cpu_qx_bytes(int n, int64_t cols) {
    size_t nb = (size_t)(cols / LOOM_QBLOCK);
    return (size_t)n * (nb * LOOM_QBLOCK + nb * sizeof(float) + (nb + 1) * sizeof(float)) + 64;
}

void loom_cpu_qx_init(loom_cpu_qx_t *qx, void *scratch, const float *x, int n,
                      const loom_weight_t *w) {
    const int nb = (int)(w->cols / LOOM_QBLOCK);
    const int ng = w->quant == LOOM_QUANT_Q4 ? (int)(w->cols / w->group) : 1;
    uint8_t *p = scratch;
    *qx = (loom_cpu_qx_t){.x = x, .n = n, .nb = nb, .ng = ng, .cols = w->cols};
    qx->q = (int8_t *)p;
    qx->d = (float *)(p + (size_t)n * nb * LOOM_QBLOCK);
    qx->s = qx->d + (size_t)n * nb;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define QGEMV_X86 1
#include <cpuid.h>
#include <immintrin.h>
/* Regions compiled for a wider target than the build's, chosen at run time;
 * GCC and clang spell them differently. */
/* _Pragma takes one string literal, hence the long lines. */
/* clang-format off */
#if defined(__clang__)
#define QGEMV_AVX2_BEGIN _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define QGEMV_VNNI_BEGIN _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni\"))), apply_to = function)")
#define QGEMV_AVXVNNI_BEGIN _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c,avxvnni\"))), apply_to = function)")
#define QGEMV_TARGET_END _Pragma("clang attribute pop")
#else
#define QGEMV_AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define QGEMV_VNNI_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni\")")
#define QGEMV_AVXVNNI_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,avxvnni\")")
#define QGEMV_TARGET_END _Pragma("GCC pop_options")
#endif
/* clang-format on */
#endif

#ifdef QGEMV_X86
QGEMV_AVX2_BEGIN

/* One block of 32: max |x|, then q = round(x · 127 / max) (to nearest
 * even, as lrintf in the default rounding mode: both paths agree exactly). */
static void quantize_block_avx2(const float *x, int8_t *q, float *d, int32_t *sum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        m = _mm256_max_ps(m, _mm256_and_ps(v[k], absmask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    *d = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i iv[4];
    for (int k = 0; k < 4; k++) iv[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
    /* Pack 32 int32 to 32 int8; the packs work per 128-bit lane, so fix the
     * order with one permute. */
    __m256i w16a = _mm256_packs_epi32(iv[0], iv[1]), w16b = _mm256_packs_epi32(iv[2], iv[3]);
    __m256i b8 = _mm256_packs_epi16(w16a, w16b);
    b8 = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, b8);
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *sum = _mm_cvtsi128_si32(s4);
}

QGEMV_TARGET_END
#endif

static void quantize_block_scalar(const float *x, int8_t *q, float *d, int32_t *sum) {
    float amax = 0.0f;
    for (int j = 0; j < LOOM_QBLOCK; j++) amax = fmaxf(amax, fabsf(x[j]));
    *d = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int j = 0; j < LOOM_QBLOCK; j++) {
        q[j] = (int8_t)lrintf(x[j] * inv);
        s += q[j];
    }
    *sum = s;
}

void loom_cpu_qx_quantize(loom_cpu_qx_t *qx, int i0, int i1) {
#ifdef QGEMV_X86
    const int simd = __builtin_cpu_supports("avx2");
#endif
    const int gb = qx->ng > 0 ? qx->nb / qx->ng : 0;
    for (int i = i0; i < i1; i++) {
        const float *x = qx->x + (int64_t)i * qx->cols;
        int8_t *q = qx->q + (int64_t)i * qx->nb * LOOM_QBLOCK;
        float *d = qx->d + (int64_t)i * qx->nb, *s = qx->s + (int64_t)i * qx->ng;
        for (int g = 0; g < qx->ng; g++) s[g] = 0.0f;
        for (int blk = 0; blk < qx->nb; blk++) {
            int32_t sum;
            const float *xb = x + (int64_t)blk * LOOM_QBLOCK;
            int8_t *qb = q + (int64_t)blk * LOOM_QBLOCK;
#ifdef QGEMV_X86
            if (simd)
                quantize_block_avx2(xb, qb, &d[blk], &sum);
            else
#endif
                quantize_block_scalar(xb, qb, &d[blk], &sum);
            s[gb ? blk / gb : 0] += d[blk] * (float)sum;
        }
    }
}

/* --- repacking --------------------------------------------------------- */

void loom_cpu_q_repack(loom_weight_t *w, const loom_qtensor_t *t, int64_t r0, int64_t r1) {
    const int64_t cols = t->cols;
    uint8_t *data = w->data;
    float *scales = w->scales, *mins = w->mins;
    if (t->quant == LOOM_QUANT_FP8) {
        memcpy(data + r0 * cols, (const uint8_t *)t->q + r0 * cols, (size_t)((r1 - r0) * cols));
        memcpy(scales + r0, t->scales + r0, (size_t)(r1 - r0) * sizeof(float));
        return;
    }
    const int64_t nb = cols / LOOM_QBLOCK;
    for (int64_t r = r0; r < r1; r++) {
        if (t->quant == LOOM_QUANT_Q4) {
            const uint8_t *src = (const uint8_t *)t->q + r * (cols / 2);
            for (int64_t blk = 0; blk < nb; blk++)
                for (int j = 0; j < 16; j++) {
                    const int64_t c = blk * LOOM_QBLOCK + j, c2 = c + 16;
                    const uint8_t lo = (src[c / 2] >> ((c & 1) * 4)) & 15;
                    const uint8_t hi = (src[c2 / 2] >> ((c2 & 1) * 4)) & 15;
                    data[code_offset(w, r, blk, j)] = (uint8_t)(lo | hi << 4);
                }
            const int64_t ng = cols / t->group;
            for (int64_t g = 0; g < ng; g++) {
                scales[group_index(w, r, g)] = t->scales[r * ng + g];
                if (t->mins) mins[group_index(w, r, g)] = t->mins[r * ng + g];
            }
        } else {
            const uint8_t *src = (const uint8_t *)t->q + r * cols;
            for (int64_t blk = 0; blk < nb; blk++)
                for (int j = 0; j < LOOM_QBLOCK; j++)
                    data[code_offset(w, r, blk, j)] = src[blk * LOOM_QBLOCK + j] ^ 0x80;
            for (int64_t c = nb * LOOM_QBLOCK; c < cols; c++)
                data[tail_offset(w, r, c)] = src[c] ^ 0x80;
            scales[r] = t->scales[r];
        }
    }
}

/* --- SIMD kernels ------------------------------------------------------ */

/* The tiles prefetch the W rows this many tiles ahead: four tiles (a few KB)
 * streamed 10-15 % faster than the next tile alone at n = 1 on the ~125M
 * model's shapes (eight was no better; eight or sixteen were no better on a
 * 653M model streaming from DRAM either). */
#ifndef QT_PF_TILES
#define QT_PF_TILES 4
#endif

#ifdef QGEMV_X86
QGEMV_AVX2_BEGIN

static inline __attribute__((always_inline)) float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) float dot_f32(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= n; k += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    float s = hsum8(acc);
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

/* 32 Q4 codes of one block, in column order, as bytes 0..15. */
static inline __attribute__((always_inline)) __m256i q4_codes(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
}

/* 16 e4m3 bytes to floats / 256 (lo: bytes 0-7, hi: 8-15). e4m3's bits
 * shifted into f16's place give the same value scaled by 2^-8 (f16's
 * exponent bias is 8 more), subnormals included: sign-extending to 16 bits
 * and shifting left by 7 puts the sign in bit 15 and the magnitude in bits
 * 7-13; bit 14 (a copy of the sign) is cleared. The caller multiplies 256
 * back in with the row's scale. */
static inline __attribute__((always_inline)) void fp8x16_to_f32_div256(const uint8_t *p, __m256 *lo,
                                                                        __m256 *hi) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbfff));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

static inline __attribute__((always_inline)) __m256i dot_u8s8_avx2(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

/* INT8 codes stored as q + 128: back to signed, then |q| · (x with q's
 * sign), which keeps vpmaddubsw's int16 pair sums below saturation
 * (2 · 128 · 127 < 32768). */
static inline __attribute__((always_inline)) __m256i dot_i8_avx2(__m256i w, __m256i x) {
    __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return dot_u8s8_avx2(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q));
}

/* Two u8·s8 products summed in int16 before vpmaddwd: Q4 codes are at most
 * 15, so a lane's four products stay within 4 · 15 · 127. */
static inline __attribute__((always_inline)) __m256i dot2_u8s8_avx2(__m256i w0, __m256i x0,
                                                                    __m256i w1, __m256i x1) {
    __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

#define QT(name) name##_avx2
#define QT_DOT_U8(w, x) dot_u8s8_avx2(w, x)
#define QT_DOT_U8_PAIR(w0, x0, w1, x1) dot2_u8s8_avx2(w0, x0, w1, x1)
#define QT_DOT_I8(w, x) dot_i8_avx2(w, x)
#define QT_I8_BIAS 0
#define QT_RM 2
#define QT_NXM 3
#include "kernels/cpu/qgemv_tiles.h"
#undef QT
#undef QT_DOT_U8
#undef QT_DOT_U8_PAIR
#undef QT_DOT_I8
#undef QT_I8_BIAS
#undef QT_RM
#undef QT_NXM

/* The integer GEMM's block dots (qgemm_tiles.h): c[t] lane a holds row
 * a's codes for columns 4t..4t+3, met by x's word t broadcast. */
static inline __attribute__((always_inline)) __m256i bcast_x4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Q4: eight vpmaddubsw summed in int16 (codes <= 15, |x| <= 127: at most
 * 8 · 2 · 15 · 127 = 30480), one vpmaddwd to int32. */
static inline __attribute__((always_inline)) __m256i blk_q4_avx2(const __m256i *c,
                                                                 const int8_t *xp) {
    __m256i s = _mm256_maddubs_epi16(c[0], bcast_x4(xp));
    for (int t = 1; t < 8; t++)
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(c[t], bcast_x4(xp + 4 * t)));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* INT8 (signed codes): |q| · sign(x, q) per word, each to int32 (a pair
 * may reach 2 · 128 · 127, so no int16 sums across words). */
static inline __attribute__((always_inline)) __m256i blk_i8_avx2(const __m256i *c,
                                                                 const int8_t *xp) {
    __m256i s = _mm256_setzero_si256();
    for (int t = 0; t < 8; t++) {
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(c[t]),
                                               _mm256_sign_epi8(bcast_x4(xp + 4 * t), c[t]));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
    return s;
}

#define QG(name) name##_avx2
#define QG_BLK_Q4(c, xp) blk_q4_avx2(c, xp)
#define QG_BLK_I8(c, xp) blk_i8_avx2(c, xp)
#define QG_I8_XOR 0x80u
#define QG_I8_BIAS 0
#define QG_NX 4
#include "kernels/cpu/qgemm_tiles.h"
#undef QG
#undef QG_BLK_Q4
#undef QG_BLK_I8
#undef QG_I8_XOR
#undef QG_I8_BIAS
#undef QG_NX

/* FP8 rows [r, r + R) against x rows [i, i + NX), in float (speed is
 * secondary for FP8 on the CPU), 16 columns per step. */
static inline __attribute__((always_inline)) void fp8_tile(const int R, const int NX, float *y,
                                                           int64_t ldy, const float *x, int i,
                                                           const loom_weight_t *w, int64_t r) {
    const int64_t cols = w->cols;
    const uint8_t *codes = (const uint8_t *)w->data + r * cols;
    const float *ws = (const float *)w->scales + r;
    __m256 acc[4][2];
    for (int a = 0; a < R; a++)
        for (int b = 0; b < NX; b++)
            acc[a][b] = _mm256_setzero_ps();
    /* Prefetch rows ahead as the INT8/Q4 tiles do. An address: it may run
     * past W. */
    const uintptr_t pf = (uintptr_t)(codes + QT_PF_TILES * R * cols);
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        if ((k & 63) == 0)
            for (int a = 0; a < R; a++)
                __builtin_prefetch((const void *)(pf + (uintptr_t)(a * cols + k)), 0, 2);
        for (int a = 0; a < R; a++) {
            __m256 wlo, whi;
            fp8x16_to_f32_div256(codes + a * cols + k, &wlo, &whi);
            for (int b = 0; b < NX; b++) {
                const float *xb = x + (int64_t)(i + b) * cols + k;
                acc[a][b] = _mm256_fmadd_ps(wlo, _mm256_loadu_ps(xb), acc[a][b]);
                acc[a][b] = _mm256_fmadd_ps(whi, _mm256_loadu_ps(xb + 8), acc[a][b]);
            }
        }
    }
    for (int a = 0; a < R; a++)
        for (int b = 0; b < NX; b++) {
            const float *xb = x + (int64_t)(i + b) * cols;
            float v = hsum8(acc[a][b]) * 256.0f;
            for (int64_t c = k; c < cols; c++) v += xb[c] * fp8_value(codes[a * cols + c]);
            y[(int64_t)(i + b) * ldy + r + a] = ws[a] * v;
        }
}

__attribute__((noinline)) static void rows_fp8_avx2(float *y, int64_t ldy, const float *x, int n,
                                                    const loom_weight_t *w, int64_t r0,
                                                    int64_t r1) {
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        int i = 0;
        for (; i + 2 <= n; i += 2) fp8_tile(4, 2, y, ldy, x, i, w, r);
        if (i < n) fp8_tile(4, 1, y, ldy, x, i, w, r);
    }
    for (; r < r1; r++)
        for (int i = 0; i < n; i++) fp8_tile(1, 1, y, ldy, x, i, w, r);
}

__attribute__((noinline)) static void dequant_avx2(float *dst, const loom_weight_t *w, int64_t r0,
                                                   int64_t r1) {
    const int64_t cols = w->cols, nb = cols / LOOM_QBLOCK;
    const float *scales = w->scales, *mins = w->mins;
    uint8_t buf[LOOM_QBLOCK];
    for (int64_t r = r0; r < r1; r++) {
        float *o = dst + (r - r0) * cols;
        if (w->quant == LOOM_QUANT_Q4) {
            const int64_t gb = w->group / LOOM_QBLOCK;
            for (int64_t blk = 0; blk < nb; blk++) {
                const int64_t g = group_index(w, r, blk / gb);
                const __m256 s = _mm256_set1_ps(scales[g]);
                const __m256 off = _mm256_set1_ps(mins ? mins[g] : -8.0f * scales[g]);
                __m128i b = _mm_loadu_si128((const __m128i *)row_block(w, r, blk, buf));
                __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
                __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
                __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                for (int k = 0; k < 4; k++) {
                    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[k]));
                    _mm256_storeu_ps(o + blk * LOOM_QBLOCK + 8 * k, _mm256_fmadd_ps(f, s, off));
                }
            }
            continue;
        }
        const int fp8 = w->quant == LOOM_QUANT_FP8;
        const __m256 s = _mm256_set1_ps(scales[r] * (fp8 ? 256.0f : 1.0f));
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) {
            __m256 f0, f1;
            if (!fp8 && c / LOOM_QBLOCK < nb) {
                const uint8_t *q = row_block(w, r, c / LOOM_QBLOCK, buf) + c % LOOM_QBLOCK;
                __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)q),
                                          _mm_set1_epi8((char)0x80));
                f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
            } else if (fp8) {
                fp8x16_to_f32_div256((const uint8_t *)w->data + r * cols + c, &f0, &f1);
            } else {
                break; /* INT8's float-path tail */
            }
            _mm256_storeu_ps(o + c, _mm256_mul_ps(f0, s));
            _mm256_storeu_ps(o + c + 8, _mm256_mul_ps(f1, s));
        }
        for (; c < cols; c++) {
            const uint8_t b = byte_at(w, r, c);
            o[c] = scales[r] * (fp8 ? fp8_value(b) : (float)((int)b - 128));
        }
    }
}

QGEMV_TARGET_END

/* The same tiles with VNNI: one vpdpbusd per block and row pair; INT8 codes
 * go in as unsigned (q + 128) and the 128 · sum(x) is taken off at the end.
 * 32 ymm registers allow 4 x 4 tiles. */
QGEMV_VNNI_BEGIN

static inline __attribute__((always_inline)) __m256i dot_u8s8_vnni(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}

#define QT(name) name##_vnni
#define QT_DOT_U8(w, x) dot_u8s8_vnni(w, x)
#define QT_DOT_U8_PAIR(w0, x0, w1, x1) \
    _mm256_dpbusd_epi32(dot_u8s8_vnni(w0, x0), w1, x1)
#define QT_DOT_I8(w, x) dot_u8s8_vnni(w, x)
#define QT_I8_BIAS 128
#define QT_RM 4
#define QT_NXM 4
#include "kernels/cpu/qgemv_tiles.h"
#undef QT
#undef QT_DOT_U8
#undef QT_DOT_U8_PAIR
#undef QT_DOT_I8
#undef QT_I8_BIAS
#undef QT_RM
#undef QT_NXM

/* Eight vpdpbusd per block in two chains (its latency is ~5 cycles). */
static inline __attribute__((always_inline)) __m256i blk_u8_vnni(const __m256i *c,
                                                                 const int8_t *xp) {
    __m256i s0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c[0], bcast_x4(xp));
    __m256i s1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c[1], bcast_x4(xp + 4));
    for (int t = 2; t < 8; t += 2) {
        s0 = _mm256_dpbusd_epi32(s0, c[t], bcast_x4(xp + 4 * t));
        s1 = _mm256_dpbusd_epi32(s1, c[t + 1], bcast_x4(xp + 4 * t + 4));
    }
    return _mm256_add_epi32(s0, s1);
}

#define QG(name) name##_vnni
#define QG_BLK_Q4(c, xp) blk_u8_vnni(c, xp)
#define QG_BLK_I8(c, xp) blk_u8_vnni(c, xp)
#define QG_I8_XOR 0u
#define QG_I8_BIAS 128
#define QG_NX 8
#include "kernels/cpu/qgemm_tiles.h"
#undef QG
#undef QG_BLK_Q4
#undef QG_BLK_I8
#undef QG_I8_XOR
#undef QG_I8_BIAS
#undef QG_NX

QGEMV_TARGET_END

/* AVX-VNNI (VEX-encoded vpdpbusd, no AVX-512: Alder Lake and later, Zen 5):
 * VNNI's dots in the AVX2 tile shapes, which fit 16 ymm registers. */
QGEMV_AVXVNNI_BEGIN

static inline __attribute__((always_inline)) __m256i dot_u8s8_avxvnni(__m256i w, __m256i x) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
}

#define QT(name) name##_avxvnni
#define QT_DOT_U8(w, x) dot_u8s8_avxvnni(w, x)
#define QT_DOT_U8_PAIR(w0, x0, w1, x1) _mm256_dpbusd_avx_epi32(dot_u8s8_avxvnni(w0, x0), w1, x1)
#define QT_DOT_I8(w, x) dot_u8s8_avxvnni(w, x)
#define QT_I8_BIAS 128
#define QT_RM 2
#define QT_NXM 3
#include "kernels/cpu/qgemv_tiles.h"
#undef QT
#undef QT_DOT_U8
#undef QT_DOT_U8_PAIR
#undef QT_DOT_I8
#undef QT_I8_BIAS
#undef QT_RM
#undef QT_NXM

static inline __attribute__((always_inline)) __m256i blk_u8_avxvnni(const __m256i *c,
                                                                    const int8_t *xp) {
    __m256i s0 = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), c[0], bcast_x4(xp));
    __m256i s1 = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), c[1], bcast_x4(xp + 4));
    for (int t = 2; t < 8; t += 2) {
        s0 = _mm256_dpbusd_avx_epi32(s0, c[t], bcast_x4(xp + 4 * t));
        s1 = _mm256_dpbusd_avx_epi32(s1, c[t + 1], bcast_x4(xp + 4 * t + 4));
    }
    return _mm256_add_epi32(s0, s1);
}

#define QG(name) name##_avxvnni
#define QG_BLK_Q4(c, xp) blk_u8_avxvnni(c, xp)
#define QG_BLK_I8(c, xp) blk_u8_avxvnni(c, xp)
#define QG_I8_XOR 0u
#define QG_I8_BIAS 128
#define QG_NX 4
#include "kernels/cpu/qgemm_tiles.h"
#undef QG
#undef QG_BLK_Q4
#undef QG_BLK_I8
#undef QG_I8_XOR
#undef QG_I8_BIAS
#undef QG_NX

QGEMV_TARGET_END
#endif /* QGEMV_X86 */

/* --- dispatch ---------------------------------------------------------- */

int loom_cpu_isa_supported(loom_cpu_isa_t isa) {
#ifdef QGEMV_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    switch (isa) {
    case LOOM_CPU_ISA_SCALAR: return 1;
    case LOOM_CPU_ISA_AVX2: return avx2;
    case LOOM_CPU_ISA_VNNI:
        return avx2 && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
    case LOOM_CPU_ISA_AVXVNNI: {
        /* CPUID.(EAX=7, ECX=1):EAX bit 4 (GCC 12's __builtin_cpu_supports
         * answers 0 for "avxvnni" on a CPU that has it). cpuid traps to the
         * hypervisor in a VM, and every kernel call asserts its isa: ask
         * once (0 unknown, 1 no, 2 yes; racing threads store the same). */
        static int known;
        int k = __atomic_load_n(&known, __ATOMIC_RELAXED);
        if (!k) {
            unsigned a = 0, b = 0, c = 0, d = 0;
            k = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1) ? 2 : 1;
            __atomic_store_n(&known, k, __ATOMIC_RELAXED);
        }
        return avx2 && k == 2;
    }
    }
#endif
    return isa == LOOM_CPU_ISA_SCALAR;
}

loom_cpu_isa_t loom_cpu_isa_detect(void) {
    if (loom_cpu_isa_supported(LOOM_CPU_ISA_VNNI)) return LOOM_CPU_ISA_VNNI;
    if (loom_cpu_isa_supported(LOOM_CPU_ISA_AVXVNNI)) return LOOM_CPU_ISA_AVXVNNI;
    if (loom_cpu_isa_supported(LOOM_CPU_ISA_AVX2)) return LOOM_CPU_ISA_AVX2;
    return LOOM_CPU_ISA_SCALAR;
}

loom_cpu_isa_t loom_cpu_isa_select(void) {
    const loom_cpu_isa_t best = loom_cpu_isa_detect();
    const char *e = getenv("LOOM_CPU_ISA");
    if (!e || !*e) return best;
    int want = -1;
    if (!strcmp(e, "generic") || !strcmp(e, "scalar"))
        want = LOOM_CPU_ISA_SCALAR;
    else if (!strcmp(e, "avx2"))
        want = LOOM_CPU_ISA_AVX2;
    else if (!strcmp(e, "avxvnni") || !strcmp(e, "avx-vnni"))
        want = LOOM_CPU_ISA_AVXVNNI;
    else if (!strcmp(e, "avx512") || !strcmp(e, "avx512-vnni") || !strcmp(e, "vnni"))
        want = LOOM_CPU_ISA_VNNI;
    if (want < 0 || !loom_cpu_isa_supported((loom_cpu_isa_t)want)) {
        loom_log(LOOM_LOG_WARN, "LOOM_CPU_ISA=%s: %s; using %s", e,
                 want < 0 ? "unknown (avx2, avxvnni, avx512 or generic)" : "this CPU lacks it",
                 loom_cpu_isa_name(best));
        return best;
    }
    return (loom_cpu_isa_t)want;
}

const char *loom_cpu_isa_name(loom_cpu_isa_t isa) {
    switch (isa) {
    case LOOM_CPU_ISA_AVX2: return "avx2";
    case LOOM_CPU_ISA_VNNI: return "avx512-vnni";
    case LOOM_CPU_ISA_AVXVNNI: return "avx-vnni";
    default: return "scalar";
    }
}

/* Rows [r0, r1) of a SIMD isa: the whole stored panels through the integer
 * GEMM's tiles, rows past the panels through the 4-row tiles on the row
 * layout, rows of a panel that r0 or r1 cuts through the reference. */
static void qrows_simd(loom_cpu_isa_t isa, float *y, int64_t ldy, const loom_cpu_qx_t *qx,
                       const loom_weight_t *w, int64_t r0, int64_t r1) {
#ifdef QGEMV_X86
    const int q4 = w->quant == LOOM_QUANT_Q4;
    const int64_t pr = qx->nb > 0 ? panel_rows(w) : 0;
    const int64_t h1 = LOOM_MIN((r0 + 7) / 8 * 8, LOOM_MIN(r1, pr)); /* [r0, h1): cut panel */
    const int64_t p0 = (r0 + 7) / 8 * 8, p1 = LOOM_MIN(r1 / 8 * 8, pr);
    const int64_t np = p1 > p0 ? (p1 - p0) / 8 : 0;
    if (r0 < h1) qgemv_scalar(y, ldy, qx, w, r0, h1);
    if (np && isa == LOOM_CPU_ISA_VNNI)
        (q4 ? panels_q4_vnni : panels_i8_vnni)(y, ldy, qx, w, p0, np);
    else if (np && isa == LOOM_CPU_ISA_AVXVNNI)
        (q4 ? panels_q4_avxvnni : panels_i8_avxvnni)(y, ldy, qx, w, p0, np);
    else if (np)
        (q4 ? panels_q4_avx2 : panels_i8_avx2)(y, ldy, qx, w, p0, np);
    const int64_t c0 = LOOM_MAX(LOOM_MAX(p1, h1), r0), c1 = LOOM_MIN(r1, pr);
    if (c0 < c1) qgemv_scalar(y, ldy, qx, w, c0, c1); /* a panel cut by r1 */
    const int64_t t0 = LOOM_MAX(r0, pr);                /* rows past the panels */
    if (t0 >= r1) return;
    if (isa == LOOM_CPU_ISA_VNNI)
        (q4 ? rows_q4_vnni : rows_i8_vnni)(y, ldy, qx, w, t0, r1);
    else if (isa == LOOM_CPU_ISA_AVXVNNI)
        (q4 ? rows_q4_avxvnni : rows_i8_avxvnni)(y, ldy, qx, w, t0, r1);
    else
        (q4 ? rows_q4_avx2 : rows_i8_avx2)(y, ldy, qx, w, t0, r1);
#else
    (void)isa;
    qgemv_scalar(y, ldy, qx, w, r0, r1);
#endif
}

void loom_cpu_qgemv(loom_cpu_isa_t isa, float *y, int64_t ldy, const loom_cpu_qx_t *qx,
                    const loom_weight_t *w, int64_t r0, int64_t r1) {
    LOOM_ASSERT(loom_cpu_isa_supported(isa));
#ifdef QGEMV_X86
    if (isa != LOOM_CPU_ISA_SCALAR && w->quant == LOOM_QUANT_FP8) {
        rows_fp8_avx2(y, ldy, qx->x, qx->n, w, r0, r1);
        return;
    }
#endif
    if (isa != LOOM_CPU_ISA_SCALAR)
        qrows_simd(isa, y, ldy, qx, w, r0, r1);
    else
        qgemv_scalar(y, ldy, qx, w, r0, r1);
}

void loom_cpu_qgemm(loom_cpu_isa_t isa, float *y, int64_t ldy, const loom_cpu_qx_t *qx,
                    const loom_weight_t *w, int64_t r0, int64_t r1) {
    loom_cpu_qgemv(isa, y, ldy, qx, w, r0, r1);
}

void loom_cpu_q_dequant_rows(loom_cpu_isa_t isa, float *dst, const loom_weight_t *w, int64_t r0,
                             int64_t r1) {
#ifdef QGEMV_X86
    if (isa != LOOM_CPU_ISA_SCALAR) {
        dequant_avx2(dst, w, r0, r1);
        return;
    }
#endif
    dequant_scalar(dst, w, r0, r1);
}

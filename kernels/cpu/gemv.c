/* Decode matmul kernels (see gemv.h). The AVX2/FMA path computes a tile of
 * R weight rows × NX rows of x with R·NX accumulators held in registers, so
 * each 32-byte chunk of W is loaded once per tile and feeds NX FMAs. Tiles of
 * x are walked innermost, so a group of W rows (a few KB to tens of KB) is
 * reused from L1/L2 for every x tile and streamed from DRAM only once.
 * Half-precision weights are widened in registers: bf16 by a 16-bit shift,
 * f16 by F16C's vcvtph2ps. */
#include "kernels/cpu/gemv.h"

#include <string.h>

#include "common/util.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOOM_GEMV_SIMD 1
#endif

static inline float weight_at(const void *w, loom_dtype_t dt, int64_t i) {
    switch (dt) {
    case LOOM_DT_BF16:
        return loom_bf16_to_f32(((const uint16_t *)w)[i]);
    case LOOM_DT_F16:
        return loom_f16_to_f32(((const uint16_t *)w)[i]);
    default:
        return ((const float *)w)[i];
    }
}

void loom_cpu_gemv_ref(float *y, int64_t ldy, const float *x, int n, const void *w, loom_dtype_t dt,
                       int64_t cols, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        for (int i = 0; i < n; i++) {
            const float *xi = x + (int64_t)i * cols;
            double s = 0.0; /* a long serial float sum would drift past 1e-5 */
            for (int64_t k = 0; k < cols; k++)
                s += xi[k] * weight_at(w, dt, r * cols + k);
            y[(int64_t)i * ldy + r] = (float)s;
        }
    }
}

#ifdef LOOM_GEMV_SIMD

static inline __attribute__((always_inline)) __m256 load_w8(const void *w, loom_dtype_t dt,
                                                            int64_t i) {
    if (dt == LOOM_DT_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
#ifdef __F16C__
    if (dt == LOOM_DT_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
#endif
    return _mm256_loadu_ps((const float *)w + i);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Keeps v in a register: without it GCC folds the load of a W (or x) vector
 * into every FMA that uses it, which turns R + NX loads per tile step into
 * R·NX and makes the kernel load-bound. */
#define IN_REG(v) __asm__("" : "+x"(v))

/* One tile: rows [r, r+R) of W against rows [0, NX) of x (stride cols).
 * R, NX and dt are constants after inlining, so the accumulator array lives
 * in registers: R·NX accumulators + R weights + 1 x vector <= 16 ymm. */
static inline __attribute__((always_inline)) void tile(const int R, const int NX,
                                                       const loom_dtype_t dt, float *y, int64_t ldy,
                                                       const float *x, const void *w, int64_t cols,
                                                       int64_t r) {
    __m256 acc[4][4];
    for (int a = 0; a < R; a++)
        for (int b = 0; b < NX; b++)
            acc[a][b] = _mm256_setzero_ps();
    /* Software prefetch (to L2) of the next tile's rows, which follow these
     * in memory, spread over this tile's iterations: the hardware
     * prefetchers lose time re-training on every new group of rows, which
     * halved the bandwidth of short-row matrices (cols <= 1024). Measured
     * gains: 2048x768 bf16 16 -> 39 GB/s; no loss on 4096x4096. */
    const int esize = dt == LOOM_DT_F32 ? 4 : 2;
    const int pf_lines = (R * 8 * esize + 63) / 64;
    /* An address, not a pointer: it runs past the end of W on the last tile. */
    const uintptr_t pf = (uintptr_t)w + (uintptr_t)((r + R) * cols * esize);
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) {
        for (int q = 0; q < pf_lines; q++)
            __builtin_prefetch((const void *)(pf + (uintptr_t)(k * R * esize + q * 64)), 0, 2);
        __m256 wv[4];
        for (int a = 0; a < R; a++) {
            wv[a] = load_w8(w, dt, (r + a) * cols + k);
            if (NX > 1) IN_REG(wv[a]);
        }
        for (int b = 0; b < NX; b++) {
            __m256 xv = _mm256_loadu_ps(x + b * cols + k);
            if (R > 1) IN_REG(xv);
            for (int a = 0; a < R; a++)
                acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);
        }
    }
    for (int a = 0; a < R; a++) {
        for (int b = 0; b < NX; b++) {
            float s = hsum8(acc[a][b]);
            for (int64_t kk = k; kk < cols; kk++)
                s += x[b * cols + kk] * weight_at(w, dt, (r + a) * cols + kk);
            y[b * ldy + r + a] = s;
        }
    }
}

/* All rows [r0, r1) for one dtype. x is cut into tiles of up to 4 rows, W
 * into groups of R rows with the tile shape picked per tile height (R·NX
 * accumulators: 4x1, 4x2, 3x3, 3x4); the x tiles of one W group run back to
 * back, so the group is read from DRAM once and from L1/L2 after. */
static inline __attribute__((always_inline)) void gemv_dt(const loom_dtype_t dt, float *y,
                                                          int64_t ldy, const float *x, int n,
                                                          const void *w, int64_t cols, int64_t r0,
                                                          int64_t r1) {
    const int R = n >= 3 ? 3 : 4;
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
        int i = 0;
        if (R == 3) {
            for (; i + 4 <= n; i += 4)
                tile(3, 4, dt, y + i * ldy, ldy, x + i * cols, w, cols, r);
            const float *xi = x + i * cols;
            float *yi = y + i * ldy;
            switch (n - i) {
            case 3:
                tile(3, 3, dt, yi, ldy, xi, w, cols, r);
                break;
            case 2:
                tile(3, 2, dt, yi, ldy, xi, w, cols, r);
                break;
            case 1:
                tile(3, 1, dt, yi, ldy, xi, w, cols, r);
                break;
            default:
                break;
            }
        } else if (n == 2) {
            tile(4, 2, dt, y, ldy, x, w, cols, r);
        } else {
            tile(4, 1, dt, y, ldy, x, w, cols, r);
        }
    }
    for (; r < r1; r++) {
        int i = 0;
        for (; i + 4 <= n; i += 4)
            tile(1, 4, dt, y + i * ldy, ldy, x + i * cols, w, cols, r);
        for (; i < n; i++)
            tile(1, 1, dt, y + i * ldy, ldy, x + i * cols, w, cols, r);
    }
}

__attribute__((noinline)) static void gemv_f32(float *y, int64_t ldy, const float *x, int n,
                                               const void *w, int64_t cols, int64_t r0,
                                               int64_t r1) {
    gemv_dt(LOOM_DT_F32, y, ldy, x, n, w, cols, r0, r1);
}

__attribute__((noinline)) static void gemv_bf16(float *y, int64_t ldy, const float *x, int n,
                                                const void *w, int64_t cols, int64_t r0,
                                                int64_t r1) {
    gemv_dt(LOOM_DT_BF16, y, ldy, x, n, w, cols, r0, r1);
}

#ifdef __F16C__
__attribute__((noinline)) static void gemv_f16(float *y, int64_t ldy, const float *x, int n,
                                               const void *w, int64_t cols, int64_t r0,
                                               int64_t r1) {
    gemv_dt(LOOM_DT_F16, y, ldy, x, n, w, cols, r0, r1);
}
#endif

#endif /* LOOM_GEMV_SIMD */

void loom_cpu_gemv(float *y, int64_t ldy, const float *x, int n, const void *w, loom_dtype_t dt,
                   int64_t cols, int64_t r0, int64_t r1) {
#ifdef LOOM_GEMV_SIMD
    switch (dt) {
    case LOOM_DT_F32:
        gemv_f32(y, ldy, x, n, w, cols, r0, r1);
        return;
    case LOOM_DT_BF16:
        gemv_bf16(y, ldy, x, n, w, cols, r0, r1);
        return;
#ifdef __F16C__
    case LOOM_DT_F16:
        gemv_f16(y, ldy, x, n, w, cols, r0, r1);
        return;
#endif
    default:
        break;
    }
#endif
    loom_cpu_gemv_ref(y, ldy, x, n, w, dt, cols, r0, r1);
}

void loom_cpu_widen_rows(float *dst, const void *w, loom_dtype_t dt, int64_t cols, int64_t r0,
                         int64_t r1) {
    int64_t n = (r1 - r0) * cols, base = r0 * cols;
    if (dt == LOOM_DT_F32) {
        memcpy(dst, (const float *)w + base, (size_t)n * sizeof *dst);
        return;
    }
    int64_t i = 0;
#ifdef LOOM_GEMV_SIMD
    if (dt == LOOM_DT_BF16)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, load_w8(w, LOOM_DT_BF16, base + i));
#ifdef __F16C__
    if (dt == LOOM_DT_F16)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, load_w8(w, LOOM_DT_F16, base + i));
#endif
#endif
    for (; i < n; i++)
        dst[i] = weight_at(w, dt, base + i);
}

void loom_cpu_narrow(void *dst, loom_dtype_t dt, const float *src, int64_t n) {
    uint16_t *d = dst;
    if (dt == LOOM_DT_BF16)
        for (int64_t i = 0; i < n; i++)
            d[i] = loom_f32_to_bf16(src[i]);
    else
        for (int64_t i = 0; i < n; i++)
            d[i] = loom_f32_to_f16(src[i]);
}

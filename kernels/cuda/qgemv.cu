/* Matmul on quantized weights (kernels/quant.h, canonical layout kept on the
 * device): W8A16 / W4A16 / FP8 GEMV for decode and the dequantization that
 * feeds cuBLAS for prefill. Activations stay f32 (they are read from L1/L2,
 * not DRAM); codes are decoded by the functions of qformat.h, which the CPU
 * unit tests run against the reference dequantizer.
 *
 * GEMV: one warp owns R rows; each lane streams 16-byte loads of codes
 * (16 int8 / e4m3 codes, or 32 4-bit codes) with ld.global.cs, U loads per
 * row in flight, decodes them word by word and multiplies with the f32
 * activations of up to NT = 8 tokens. A 4-bit load covers 32 columns that
 * start at a multiple of 32, so it lies inside one scale group (groups are
 * 32, 64 or 128): the lane sums code * x over the load, then applies the
 * group's scale once (and min * sum(x) for Q4 with min). INT8 and FP8 have
 * one scale per row, applied after the warp's reduction.
 *
 * Napkin math (H200, ~4.3 TB/s copy bandwidth, n = 1): a 4096 x 14336
 * matrix is 117.4 MB in bf16; Q4 with group 32 is 29.4 MB of codes + 7.3 MB
 * of f32 scales = 36.7 MB, ~8.5 us at full bandwidth; INT8 is 58.7 MB + 16 KB.
 * Decoding costs about 4 instructions per 4-bit code (shift and mask, the
 * magic-number subtraction, the FMA): at 8.6e12 codes/s (4.3 TB/s) that is
 * ~150 thread-instructions per SM-clock (132 SMs at 1.75 GHz), against the
 * 128 an SM issues, so Q4 GEMV at n = 1 sits at the edge of memory-bound on
 * Hopper; INT8 and FP8 (half the codes per byte) are comfortably below.
 *
 * Prefill: rows of W are dequantized in panels into a bf16/f16 (or f32)
 * scratch, 8 columns per thread, and multiplied with cublasGemmEx by the
 * backend (backend_cuda.c). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/opmath.h"
#include "kernels/cuda/qformat.h"

namespace {

constexpr int kWarps = 8;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Decodes word j (0..3) of a 16-byte load: 4 codes (INT8, FP8) or 8 (Q4). */
template <int QK, bool MIN>
struct Codes {
    static constexpr int kPerWord = QK == LOOM_QD_Q4 ? 8 : 4;
    __device__ __forceinline__ static void word(uint32_t u, float *f) {
        if (QK == LOOM_QD_Q4)
            loom_qd_q4x8(u, MIN ? 0.0f : 8.0f, f);
        else if (QK == LOOM_QD_INT8)
            loom_qd_int8x4(u, f);
        else
            loom_qd_fp8x4_fast(u, f);
    }
};

__device__ __forceinline__ uint32_t word_of(const uint4 &v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

/* Vector path: every row is a whole number of 16-byte loads (cols % 16 == 0
 * for INT8/FP8, always true for Q4) and x is 16-byte aligned. */
template <int QK, bool MIN, int NT, int R, int U>
__global__ void __launch_bounds__(kWarps * 32, 2)
    qgemv_kernel(float *__restrict__ y, const float *__restrict__ x, const uint8_t *__restrict__ q,
                 const float *__restrict__ scales, const float *__restrict__ mins, int64_t rows, int64_t cols,
                 int group) {
    constexpr int PW = Codes<QK, MIN>::kPerWord;
    constexpr int E = 4 * PW; /* columns per 16-byte load */
    constexpr bool Q4 = QK == LOOM_QD_Q4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row0 = ((int64_t)blockIdx.x * kWarps + warp) * R;
    if (row0 >= rows) return; /* whole warp */
    const int64_t nv = cols / E;                  /* loads per row */
    const int64_t row_bytes = Q4 ? cols / 2 : cols;
    const int64_t gpr = Q4 ? cols / group : 1;     /* scale groups per row */
    const int loads_per_group = Q4 ? group / E : 1;
    const uint4 *wr[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        wr[r] = reinterpret_cast<const uint4 *>(q + (row0 + r < rows ? row0 + r : row0) * row_bytes);
    float acc[NT][R];
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[t][r] = 0.0f;

    for (int64_t v0 = lane; v0 < nv; v0 += 32 * U) {
        uint4 wv[R][U];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++)
                wv[r][u] = v0 + u * 32 < nv && row0 + r < rows ? __ldcs(wr[r] + v0 + u * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t v = v0 + u * 32;
            if (v >= nv) break;
            /* Q4: per-load partial sums, scaled once by the load's group */
            float p[NT][R], xs[NT];
#pragma unroll
            for (int t = 0; t < NT; t++) {
                xs[t] = 0.0f;
#pragma unroll
                for (int r = 0; r < R; r++) p[t][r] = 0.0f;
            }
            /* more than 4 tokens: one word at a time, or the compiler
             * hoists every x load of the 16-byte load and spills */
#pragma unroll(NT > 4 ? 1 : 4)
            for (int j = 0; j < 4; j++) {
                float wf[R][PW];
#pragma unroll
                for (int r = 0; r < R; r++) Codes<QK, MIN>::word(word_of(wv[r][u], j), wf[r]);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    const float4 *xp = reinterpret_cast<const float4 *>(x + t * cols + v * E + j * PW);
                    float xf[PW];
#pragma unroll
                    for (int k = 0; k < PW / 4; k++) {
                        const float4 xv = __ldg(xp + k);
                        xf[4 * k] = xv.x, xf[4 * k + 1] = xv.y, xf[4 * k + 2] = xv.z, xf[4 * k + 3] = xv.w;
                    }
                    if constexpr (MIN)
#pragma unroll
                        for (int e = 0; e < PW; e++) xs[t] += xf[e];
#pragma unroll
                    for (int r = 0; r < R; r++)
#pragma unroll
                        for (int e = 0; e < PW; e++) {
                            if constexpr (Q4)
                                p[t][r] = fmaf(wf[r][e], xf[e], p[t][r]);
                            else
                                acc[t][r] = fmaf(wf[r][e], xf[e], acc[t][r]);
                        }
                }
            }
            if constexpr (Q4) {
                const int64_t g = v / loads_per_group;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const int64_t rr = row0 + r < rows ? row0 + r : row0;
                    const float s = __ldg(scales + rr * gpr + g);
                    const float m = MIN ? __ldg(mins + rr * gpr + g) : 0.0f;
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        acc[t][r] = fmaf(s, p[t][r], acc[t][r]);
                        if (MIN) acc[t][r] = fmaf(m, xs[t], acc[t][r]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (row0 + r >= rows) break;
        const float s = Q4 ? 1.0f : __ldg(scales + row0 + r);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float sum = warp_sum(acc[t][r]);
            if (lane == 0) y[t * rows + row0 + r] = s * sum;
        }
    }
}

/* Any shape or alignment: one warp per row, one element at a time. */
__global__ void __launch_bounds__(kWarps * 32)
    qgemv_any_kernel(float *y, const float *x, const uint8_t *q, const float *scales, const float *mins, int quant,
                     int64_t rows, int64_t cols, int group, int n) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (row >= rows) return;
    float acc[LOOM_CUDA_QGEMV_MAX_N];
#pragma unroll
    for (int t = 0; t < LOOM_CUDA_QGEMV_MAX_N; t++) acc[t] = 0.0f;
    for (int64_t c = lane; c < cols; c += 32) {
        const float w = loom_qd_value(quant, q, scales, mins, cols, group, row, c);
#pragma unroll
        for (int t = 0; t < LOOM_CUDA_QGEMV_MAX_N; t++)
            if (t < n) acc[t] = fmaf(w, x[t * cols + c], acc[t]);
    }
#pragma unroll
    for (int t = 0; t < LOOM_CUDA_QGEMV_MAX_N; t++) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t < n) y[t * rows + row] = s;
    }
}

template <int QK, bool MIN, int NT, int R, int U>
cudaError_t launch_ru(float *y, const float *x, const uint8_t *q, const float *scales, const float *mins,
                      int64_t rows, int64_t cols, int group, cudaStream_t s) {
    const int64_t blocks = (rows + kWarps * R - 1) / (kWarps * R);
    qgemv_kernel<QK, MIN, NT, R, U><<<(unsigned)blocks, kWarps * 32, 0, s>>>(y, x, q, scales, mins, rows, cols, group);
    return cudaGetLastError();
}

/* The default: 4 rows x 2 loads in flight per lane for n <= 2; fewer rows
 * for more tokens keep the partial sums (NT x R) in registers. The tuning
 * table's variants (opmath.h's loom_om_qgemv_plan, n <= 2): the same 8
 * loads in flight over 2 rows or 1. */
template <int QK, bool MIN, int NT>
cudaError_t launch_vec(float *y, const float *x, const uint8_t *q, const float *scales, const float *mins,
                       int64_t rows, int64_t cols, int group, int variant, cudaStream_t s) {
    constexpr int R = NT <= 2 ? 4 : NT <= 4 ? 2 : 1;
    if constexpr (NT <= 2) {
        if (variant == 1) return launch_ru<QK, MIN, NT, 2, 4>(y, x, q, scales, mins, rows, cols, group, s);
        if (variant == 2) return launch_ru<QK, MIN, NT, 1, 8>(y, x, q, scales, mins, rows, cols, group, s);
    }
    return launch_ru<QK, MIN, NT, R, 2>(y, x, q, scales, mins, rows, cols, group, s);
}

template <int QK, bool MIN>
cudaError_t launch_n(float *y, const float *x, const uint8_t *q, const float *scales, const float *mins, int64_t rows,
                     int64_t cols, int group, int n, int v, cudaStream_t s) {
    switch (n) {
    case 1: return launch_vec<QK, MIN, 1>(y, x, q, scales, mins, rows, cols, group, v, s);
    case 2: return launch_vec<QK, MIN, 2>(y, x, q, scales, mins, rows, cols, group, v, s);
    case 3: return launch_vec<QK, MIN, 3>(y, x, q, scales, mins, rows, cols, group, v, s);
    case 4: return launch_vec<QK, MIN, 4>(y, x, q, scales, mins, rows, cols, group, v, s);
    case 5: return launch_vec<QK, MIN, 5>(y, x, q, scales, mins, rows, cols, group, v, s);
    case 6: return launch_vec<QK, MIN, 6>(y, x, q, scales, mins, rows, cols, group, v, s);
    case 7: return launch_vec<QK, MIN, 7>(y, x, q, scales, mins, rows, cols, group, v, s);
    default: return launch_vec<QK, MIN, 8>(y, x, q, scales, mins, rows, cols, group, v, s);
    }
}

/* --- dequantization for prefill -------------------------------------------------------- */

template <int KIND>
__device__ __forceinline__ void store8_half(void *out, int64_t i, const float *f);

template <int KIND>
__device__ __forceinline__ void store8(void *out, int64_t i, const float *f) {
    if constexpr (KIND == LOOM_CUDA_F32) {
        float4 *o = reinterpret_cast<float4 *>(static_cast<float *>(out) + i);
        o[0] = make_float4(f[0], f[1], f[2], f[3]);
        o[1] = make_float4(f[4], f[5], f[6], f[7]);
    } else {
        store8_half<KIND>(out, i, f);
    }
}

template <int KIND>
__device__ __forceinline__ void store8_half(void *out, int64_t i, const float *f) {
    uint32_t h[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        uint16_t a, b;
        if constexpr (KIND == LOOM_CUDA_BF16) {
            a = __bfloat16_as_ushort(__float2bfloat16_rn(f[2 * k]));
            b = __bfloat16_as_ushort(__float2bfloat16_rn(f[2 * k + 1]));
        } else {
            a = __half_as_ushort(__float2half_rn(f[2 * k]));
            b = __half_as_ushort(__float2half_rn(f[2 * k + 1]));
        }
        h[k] = (uint32_t)a | (uint32_t)b << 16;
    }
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(out) + i) = make_uint4(h[0], h[1], h[2], h[3]);
}

template <int KIND>
__device__ __forceinline__ void store1(void *out, int64_t i, float f) {
    if constexpr (KIND == LOOM_CUDA_F32)
        static_cast<float *>(out)[i] = f;
    else if constexpr (KIND == LOOM_CUDA_BF16)
        static_cast<__nv_bfloat16 *>(out)[i] = __float2bfloat16_rn(f);
    else
        static_cast<__half *>(out)[i] = __float2half_rn(f);
}

/* out(r1 - r0, cols) = rows [r0, r1) of W dequantized; cols % 8 == 0, each
 * thread writes 8 columns (inside one Q4 group: groups are multiples of 32). */
template <int KIND>
__global__ void dequant8_kernel(void *out, const uint8_t *__restrict__ q, const float *__restrict__ scales,
                                const float *__restrict__ mins, int quant, int64_t r0, int64_t n_rows, int64_t cols,
                                int group) {
    const int64_t c8 = cols / 8;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_rows * c8) return;
    const int64_t r = r0 + i / c8, c = (i % c8) * 8;
    float f[8];
    float s, m = 0.0f;
    if (quant == LOOM_QD_Q4) {
        const uint32_t u = *reinterpret_cast<const uint32_t *>(q + r * (cols / 2) + c / 2);
        const int64_t g = r * (cols / group) + c / group;
        s = scales[g];
        if (mins) m = mins[g];
        loom_qd_q4x8(u, mins ? 0.0f : 8.0f, f);
    } else {
        const uint2 u = *reinterpret_cast<const uint2 *>(q + r * cols + c);
        s = scales[r];
        if (quant == LOOM_QD_INT8) {
            loom_qd_int8x4(u.x, f);
            loom_qd_int8x4(u.y, f + 4);
        } else {
            loom_qd_fp8x4_fast(u.x, f);
            loom_qd_fp8x4_fast(u.y, f + 4);
        }
    }
#pragma unroll
    for (int k = 0; k < 8; k++) f[k] = mins ? loom_qd_affine(s, f[k], m) : s * f[k];
    store8<KIND>(out, (r - r0) * cols + c, f);
}

template <int KIND>
__global__ void dequant_any_kernel(void *out, const uint8_t *q, const float *scales, const float *mins, int quant,
                                   int64_t r0, int64_t n_rows, int64_t cols, int group) {
    const int64_t total = n_rows * cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
        store1<KIND>(out, i, loom_qd_value(quant, q, scales, mins, cols, group, r0 + i / cols, i % cols));
}

template <int KIND>
cudaError_t launch_dequant(void *out, const uint8_t *q, const float *scales, const float *mins, int quant, int64_t r0,
                           int64_t r1, int64_t cols, int group, cudaStream_t s) {
    const int threads = 256;
    const int64_t n_rows = r1 - r0;
    if (cols % 8 == 0) {
        const int64_t blocks = (n_rows * (cols / 8) + threads - 1) / threads;
        if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
        dequant8_kernel<KIND><<<(unsigned)blocks, threads, 0, s>>>(out, q, scales, mins, quant, r0, n_rows, cols,
                                                                    group);
    } else {
        const int64_t blocks = (n_rows * cols + threads - 1) / threads;
        dequant_any_kernel<KIND><<<(unsigned)(blocks < 65536 ? blocks : 65536), threads, 0, s>>>(
            out, q, scales, mins, quant, r0, n_rows, cols, group);
    }
    return cudaGetLastError();
}

/* --- random codes (benchmarks) ----------------------------------------------------------- */

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Random code bytes; e4m3 codes are kept to exponents 5..6 (|v| in
 * [0.25, 1)), so a random FP8 model stays finite through its layers. */
__global__ void fill_codes_kernel(uint8_t *dst, int quant, int64_t n, uint64_t seed) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint8_t b = (uint8_t)(mix64(seed * 0x9e3779b97f4a7c15ull + (uint64_t)i) >> 24);
        if (quant == LOOM_QD_FP8) b = (uint8_t)((b & 0x80u) | 0x28u | (b & 0x0fu));
        dst[i] = b;
    }
}

} /* namespace */

extern "C" cudaError_t loom_cuda_qgemv(float *y, const float *x, const void *q, const float *scales, const float *mins,
                                       int quant, int64_t rows, int64_t cols, int group, int n, int variant,
                                       cudaStream_t s) {
    if (n < 1 || n > LOOM_CUDA_QGEMV_MAX_N || rows <= 0)
        return n == 0 || rows == 0 ? cudaSuccess : cudaErrorInvalidValue;
    if (variant < 0 || variant >= LOOM_OM_QGEMV_VARIANTS) return cudaErrorInvalidValue;
    if (cols <= 0 || group <= 0 || cols % group) return cudaErrorInvalidValue;
    if (quant == LOOM_QD_Q4 && group % 32) return cudaErrorInvalidValue;
    if ((rows + kWarps - 1) / kWarps > 0x7fffffff) return cudaErrorInvalidValue;
    const uint8_t *qb = static_cast<const uint8_t *>(q);
    const int64_t e = quant == LOOM_QD_Q4 ? 32 : 16;
    const bool vec = cols % e == 0 && ((uintptr_t)x & 15u) == 0 && ((uintptr_t)q & 15u) == 0;
    if (!vec) {
        const int64_t blocks = (rows + kWarps - 1) / kWarps;
        qgemv_any_kernel<<<(unsigned)blocks, kWarps * 32, 0, s>>>(y, x, qb, scales, mins, quant, rows, cols, group, n);
        return cudaGetLastError();
    }
    switch (quant) {
    case LOOM_QD_INT8: return launch_n<LOOM_QD_INT8, false>(y, x, qb, scales, mins, rows, cols, group, n, variant, s);
    case LOOM_QD_FP8: return launch_n<LOOM_QD_FP8, false>(y, x, qb, scales, mins, rows, cols, group, n, variant, s);
    case LOOM_QD_Q4:
        return mins ? launch_n<LOOM_QD_Q4, true>(y, x, qb, scales, mins, rows, cols, group, n, variant, s)
                    : launch_n<LOOM_QD_Q4, false>(y, x, qb, scales, mins, rows, cols, group, n, variant, s);
    default: return cudaErrorInvalidValue;
    }
}

extern "C" cudaError_t loom_cuda_dequant(void *out, int kind, const void *q, const float *scales, const float *mins,
                                         int quant, int64_t r0, int64_t r1, int64_t cols, int group, cudaStream_t s) {
    if (r1 <= r0) return cudaSuccess;
    if (r0 < 0 || cols <= 0 || group <= 0 || cols % group) return cudaErrorInvalidValue;
    if (quant != LOOM_QD_INT8 && quant != LOOM_QD_Q4 && quant != LOOM_QD_FP8) return cudaErrorInvalidValue;
    const uint8_t *qb = static_cast<const uint8_t *>(q);
    switch (kind) {
    case LOOM_CUDA_BF16: return launch_dequant<LOOM_CUDA_BF16>(out, qb, scales, mins, quant, r0, r1, cols, group, s);
    case LOOM_CUDA_F16: return launch_dequant<LOOM_CUDA_F16>(out, qb, scales, mins, quant, r0, r1, cols, group, s);
    default: return launch_dequant<LOOM_CUDA_F32>(out, qb, scales, mins, quant, r0, r1, cols, group, s);
    }
}

extern "C" cudaError_t loom_cuda_fill_codes(void *dst, int quant, int64_t bytes, uint64_t seed, cudaStream_t s) {
    if (bytes <= 0) return cudaSuccess;
    const int64_t blocks = (bytes + 255) / 256;
    fill_codes_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, s>>>(static_cast<uint8_t *>(dst), quant,
                                                                               bytes, seed);
    return cudaGetLastError();
}

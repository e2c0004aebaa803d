/* Decode matmul: y(n, rows) = x(n, cols) . W^T for n <= 4 rows of x, the
 * memory-bound case. W (bf16, f16 or f32) is streamed once with 16-byte
 * loads that bypass L1 (__ldcs), R rows per warp and U loads per row in
 * flight per lane; x (f32, small) stays in L1/L2 and is shared by the warp's
 * rows. Each lane accumulates in f32, the warp reduces with shuffles.
 *
 * The tuning table's gemv_variant picks R and U (opmath.h's
 * loom_om_gemv_plan): the default, one row per warp, or twice the loads in
 * flight; the same bits either way.
 *
 * Napkin math (H200, Llama-3-8B, n = 1): 15 GB of bf16 weights per token at
 * ~4.3 TB/s is ~3.5 ms; a warp keeps R*U = 8 loads of 512 B in flight, and
 * 16-24 warps per SM give 64-96 KB in flight per SM, above the ~30 KB that
 * latency x bandwidth asks for. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/opmath.h"
#include "kernels/cuda/wide.cuh"

namespace {

using loom_cuda::load_w;
using loom_cuda::warp_sum;
using loom_cuda::Wide;

constexpr int kWarps = 8;

/* Vector path: cols % 8 == 0, so every row is a whole number of 16-byte
 * loads and x rows (cols * 4 bytes) stay 16-byte aligned. */
template <int KIND, int NT, int R, int U>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_kernel(float *__restrict__ y, const float *__restrict__ x, const uint4 *__restrict__ w, int64_t rows,
                int64_t cols) {
    constexpr int E = Wide<KIND>::kElems;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row0 = ((int64_t)blockIdx.x * kWarps + warp) * R;
    if (row0 >= rows) return; /* whole warp */
    const int64_t nv = cols / E; /* 16-byte vectors per row */
    const uint4 *wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) wr[r] = w + (row0 + r < rows ? row0 + r : row0) * nv;
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
            float wf[R][E];
#pragma unroll
            for (int r = 0; r < R; r++) Wide<KIND>::unpack(wv[r][u], wf[r]);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float4 *xp = reinterpret_cast<const float4 *>(x + t * cols + v * E);
                float xf[E];
#pragma unroll
                for (int q = 0; q < E / 4; q++) {
                    float4 xv = __ldg(xp + q);
                    xf[4 * q] = xv.x, xf[4 * q + 1] = xv.y, xf[4 * q + 2] = xv.z, xf[4 * q + 3] = xv.w;
                }
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int e = 0; e < E; e++) acc[t][r] = fmaf(wf[r][e], xf[e], acc[t][r]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            float s = warp_sum(acc[t][r]);
            if (lane == 0 && row0 + r < rows) y[t * rows + row0 + r] = s;
        }
}

/* Any shape: one warp per row, 4-byte loads. */
template <int KIND>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_any_kernel(float *y, const float *x, const void *w, int64_t rows, int64_t cols, int n) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (row >= rows) return;
    float acc[LOOM_CUDA_GEMV_MAX_N] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t c = lane; c < cols; c += 32) {
        const float wv = load_w<KIND>(w, row * cols + c);
#pragma unroll
        for (int t = 0; t < LOOM_CUDA_GEMV_MAX_N; t++)
            if (t < n) acc[t] = fmaf(wv, x[t * cols + c], acc[t]);
    }
#pragma unroll
    for (int t = 0; t < LOOM_CUDA_GEMV_MAX_N; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0 && t < n) y[t * rows + row] = s;
    }
}

/* R rows per warp and U loads per row in flight, loom_om_gemv_plan's. The
 * default: fewer rows per warp for small n keep registers low and the grid
 * large, R * U = 8 loads in flight per lane either way. */
template <int KIND, int NT, int R, int U>
cudaError_t launch_ru(float *y, const float *x, const void *w, int64_t rows, int64_t cols, cudaStream_t s) {
    const int64_t blocks = (rows + kWarps * R - 1) / (kWarps * R);
    gemv_kernel<KIND, NT, R, U><<<(unsigned)blocks, kWarps * 32, 0, s>>>(y, x, (const uint4 *)w, rows, cols);
    return cudaGetLastError();
}

template <int KIND, int NT>
cudaError_t launch_vec(float *y, const float *x, const void *w, int64_t rows, int64_t cols, int variant,
                       cudaStream_t s) {
    constexpr int R = NT <= 2 ? 2 : 4;
    switch (variant) {
    case 1: return launch_ru<KIND, NT, 1, 8>(y, x, w, rows, cols, s);
    case 2: return launch_ru<KIND, NT, R, 16 / R>(y, x, w, rows, cols, s);
    default: return launch_ru<KIND, NT, R, 8 / R>(y, x, w, rows, cols, s);
    }
}

template <int KIND>
cudaError_t launch_kind(float *y, const float *x, const void *w, int64_t rows, int64_t cols, int n, int variant,
                        cudaStream_t s) {
    const bool vec = cols % 8 == 0 && ((uintptr_t)x & 15u) == 0 && ((uintptr_t)w & 15u) == 0;
    if (!vec) {
        const int64_t blocks = (rows + kWarps - 1) / kWarps;
        gemv_any_kernel<KIND><<<(unsigned)blocks, kWarps * 32, 0, s>>>(y, x, w, rows, cols, n);
        return cudaGetLastError();
    }
    switch (n) {
    case 1: return launch_vec<KIND, 1>(y, x, w, rows, cols, variant, s);
    case 2: return launch_vec<KIND, 2>(y, x, w, rows, cols, variant, s);
    case 3: return launch_vec<KIND, 3>(y, x, w, rows, cols, variant, s);
    default: return launch_vec<KIND, 4>(y, x, w, rows, cols, variant, s);
    }
}

} /* namespace */

extern "C" cudaError_t loom_cuda_gemv(float *y, const float *x, const void *w, int kind, int64_t rows,
                                      int64_t cols, int n, int variant, cudaStream_t s) {
    if (n < 1 || n > LOOM_CUDA_GEMV_MAX_N || rows <= 0) return n == 0 || rows == 0 ? cudaSuccess : cudaErrorInvalidValue;
    if (cols <= 0 || variant < 0 || variant >= LOOM_OM_GEMV_VARIANTS) return cudaErrorInvalidValue;
    if ((rows + kWarps - 1) / kWarps > 0x7fffffff) return cudaErrorInvalidValue;
    switch (kind) {
    case LOOM_CUDA_BF16: return launch_kind<LOOM_CUDA_BF16>(y, x, w, rows, cols, n, variant, s);
    case LOOM_CUDA_F16: return launch_kind<LOOM_CUDA_F16>(y, x, w, rows, cols, n, variant, s);
    default: return launch_kind<LOOM_CUDA_F32>(y, x, w, rows, cols, n, variant, s);
    }
}

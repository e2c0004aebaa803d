/* The scale math of the FP8 prefill GEMM (backend_cuda.c's matmul_fp8 over
 * cuBLASLt, fp8act.cu's activation quantizer): __host__ __device__ under
 * nvcc and static inline C elsewhere, replayed on the CPU against float64 by
 * tests/unit/test_cuda_math.c.
 *
 * FP8 weights are e4m3 codes with one f32 scale per row (kernels/quant.h);
 * cuBLASLt multiplies e4m3 by e4m3 only, so x is quantized per token: row t
 * of x gets s_t = amax_t / 448 and codes e4m3(x / s_t) (round to nearest
 * even, saturating). With the weights' row scales w_r and x's token scales
 * s_t as cuBLASLt's outer-vector scales (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F),
 *   y[t][r] = w_r * s_t * sum_c code_w[r][c] * code_x[t][c]
 * with f32 accumulation. The weights are used exactly; the error is x's
 * rounding: |code_x * s_t - x| <= 2^-4 |x| for normal codes (3 mantissa
 * bits) and <= 2^-10 s_t below them (subnormal steps of 2^-9 s_t), so
 *   |y - y_exact| <= 2^-4 sum_c |w x| + 2^-10 s_t sum_c |w|   (+ f32 sums)
 * -- sixteen times bf16's 2^-8 per product (both roundings), which is why
 * the path is opt-in (the tuning table's fp8_gemm). */
#ifndef LOOM_CUDA_FP8ACT_H
#define LOOM_CUDA_FP8ACT_H

#include <math.h>

#ifdef __CUDACC__
#define LOOM_F8 static __host__ __device__ __forceinline__
#else
#define LOOM_F8 static inline
#endif

#define LOOM_F8_MAX 448.0f /* largest finite e4m3 */

/* A token's scale from the largest |x| of its row: amax / 448, or 1 when
 * the row is all zeros or not finite (its codes then saturate or are 0). */
LOOM_F8 float loom_f8_token_scale(float amax) {
    return amax > 0.0f && amax <= 3.4e38f ? amax / LOOM_F8_MAX : 1.0f;
}

/* The value rounded to e4m3 for element x of a token with scale s. */
LOOM_F8 float loom_f8_scaled(float x, float s) {
    return x / s;
}

/* The error bound above for one output, from sum |w x|, sum |w| (the
 * dequantized weights) and the token's scale. */
LOOM_F8 double loom_f8_bound(double sum_wx, double sum_w, float s) {
    return ldexp(sum_wx, -4) + ldexp(sum_w, -10) * s;
}

#endif

/* Per-token e4m3 quantization of activations for the FP8 prefill GEMM
 * (fp8act.h has the math and its error bound): one block per token finds
 * amax, then writes e4m3(x / s) with the hardware conversion (round to
 * nearest even, saturating at 448), and s. */
#include <cuda_fp8.h>
#include <stdint.h>

#include "kernels/cuda/fp8act.h"
#include "kernels/cuda/kernels.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    fp8_quant_rows_kernel(uint8_t *__restrict__ q, float *__restrict__ scales, const float *__restrict__ x,
                          int64_t cols) {
    __shared__ float red[kThreads / 32];
    const int64_t t = blockIdx.x;
    const float *xr = x + t * cols;
    float m = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) m = fmaxf(m, fabsf(xr[c]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; w++) m = fmaxf(m, red[w]);
    const float s = loom_f8_token_scale(m);
    uint8_t *qr = q + t * cols;
    for (int64_t c = threadIdx.x; c < cols; c += kThreads)
        qr[c] = (uint8_t)__nv_cvt_float_to_fp8(loom_f8_scaled(xr[c], s), __NV_SATFINITE, __NV_E4M3);
    if (threadIdx.x == 0) scales[t] = s;
}

} /* namespace */

extern "C" cudaError_t loom_cuda_fp8_quant_rows(void *q, float *scales, const float *x, int n, int64_t cols,
                                                cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    if (cols <= 0) return cudaErrorInvalidValue;
    fp8_quant_rows_kernel<<<(unsigned)n, kThreads, 0, s>>>(static_cast<uint8_t *>(q), scales, x, cols);
    return cudaGetLastError();
}

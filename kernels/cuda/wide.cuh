/* Device helpers shared by the GEMV kernels (gemv.cu, moe.cu): weight
 * elements widened to float, one at a time or 16 bytes at a time, and warp
 * reductions (inline device code: each .cu gets its own copy). */
#ifndef LOOM_CUDA_WIDE_CUH
#define LOOM_CUDA_WIDE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kernels/cuda/kernels.h"

namespace loom_cuda {

/* Widens the 16 bytes of a load into floats: 8 bf16/f16 or 4 f32. */
template <int KIND> struct Wide;

template <> struct Wide<LOOM_CUDA_BF16> {
    static constexpr int kElems = 8;
    __device__ __forceinline__ static void unpack(uint4 v, float *f) {
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            f[2 * i] = __uint_as_float(u[i] << 16);
            f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        }
    }
};

template <> struct Wide<LOOM_CUDA_F16> {
    static constexpr int kElems = 8;
    __device__ __forceinline__ static void unpack(uint4 v, float *f) {
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            __half2_raw r;
            r.x = (unsigned short)(u[i] & 0xffffu);
            r.y = (unsigned short)(u[i] >> 16);
            float2 p = __half22float2(__half2(r));
            f[2 * i] = p.x;
            f[2 * i + 1] = p.y;
        }
    }
};

template <> struct Wide<LOOM_CUDA_F32> {
    static constexpr int kElems = 4;
    __device__ __forceinline__ static void unpack(uint4 v, float *f) {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* One weight element of `KIND`, widened. */
template <int KIND> __device__ __forceinline__ float load_w(const void *w, int64_t i) {
    if (KIND == LOOM_CUDA_BF16)
        return __uint_as_float((uint32_t) reinterpret_cast<const uint16_t *>(w)[i] << 16);
    if (KIND == LOOM_CUDA_F16) return __half2float(reinterpret_cast<const __half *>(w)[i]);
    return reinterpret_cast<const float *>(w)[i];
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

} /* namespace loom_cuda */

#endif

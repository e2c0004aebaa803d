/* Element-wise and row-wise kernels of the CUDA backend: dtype conversion,
 * RMSNorm (with the residual add fused in), SiLU*mul and the other gated
 * activations (GeGLU, GPT-OSS's clamped SwiGLU), the logit soft cap, row
 * gathers, RoPE and the paged KV write (f32, bf16, fp8 e4m3 clamped and
 * counted, int8 with a scale per token and head). All are memory-bound: each moves its bytes once, with
 * 16-byte accesses when the row length is a multiple of 4 floats (rows are
 * then 16-byte aligned, since buffers come from cudaMalloc), plain 4-byte
 * accesses otherwise. Numerics follow the CPU reference (kernels/cpu/vec.c):
 * same operation order, IEEE division and sqrt, expf, RoPE angles in double. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/opmath.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxGrid = 8192; /* grid-stride kernels: enough blocks to fill any GPU */

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32); every thread gets it. */
__device__ float block_sum(float v) {
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads(); /* red may still be read by a previous call */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ uint32_t pack2(float a, float b, int kind) {
    if (kind == LOOM_CUDA_BF16) {
        __nv_bfloat162_raw r = __floats2bfloat162_rn(a, b);
        return (uint32_t)r.x | ((uint32_t)r.y << 16);
    }
    __half2_raw r = __floats2half2_rn(a, b);
    return (uint32_t)r.x | ((uint32_t)r.y << 16);
}

/* Stores 4 floats at element index i (a multiple of 4) of a buffer of kind. */
__device__ __forceinline__ void store4(void *dst, int kind, int64_t i, float4 v) {
    if (kind == LOOM_CUDA_F32)
        reinterpret_cast<float4 *>(dst)[i >> 2] = v;
    else
        reinterpret_cast<uint2 *>(dst)[i >> 2] = make_uint2(pack2(v.x, v.y, kind), pack2(v.z, v.w, kind));
}

__device__ __forceinline__ void store1(void *dst, int kind, int64_t i, float v) {
    if (kind == LOOM_CUDA_BF16)
        reinterpret_cast<__nv_bfloat16 *>(dst)[i] = __float2bfloat16_rn(v);
    else if (kind == LOOM_CUDA_F16)
        reinterpret_cast<__half *>(dst)[i] = __float2half_rn(v);
    else
        reinterpret_cast<float *>(dst)[i] = v;
}

__device__ __forceinline__ int64_t grid_index() {
    return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
    return (int64_t)gridDim.x * blockDim.x;
}

int grid_for(int64_t items, int threads) {
    int64_t b = (items + threads - 1) / threads;
    return (int)(b < 1 ? 1 : b > kMaxGrid ? kMaxGrid : b);
}

bool aligned16(const void *p) {
    return ((uintptr_t)p & 15u) == 0;
}

/* --- conversion and random fill -------------------------------------------- */

__global__ void convert_vec_kernel(void *dst, int kind, const float4 *src, int64_t n4) {
    for (int64_t i = grid_index(); i < n4; i += grid_stride()) store4(dst, kind, i * 4, src[i]);
}

__global__ void convert_kernel(void *dst, int kind, const float *src, int64_t begin, int64_t n) {
    for (int64_t i = begin + grid_index(); i < n; i += grid_stride()) store1(dst, kind, i, src[i]);
}

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

__global__ void fill_random_kernel(void *dst, int kind, int64_t n, uint64_t seed, float lo, float span) {
    for (int64_t i = grid_index(); i < n; i += grid_stride()) {
        uint64_t h = mix64(seed ^ mix64((uint64_t)i));
        float u = (float)(h >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
        store1(dst, kind, i, lo + span * u);
    }
}

/* --- RMSNorm (+ residual) ---------------------------------------------------- */

/* One block per row. Pass 1 (optionally adding the residual and writing x
 * back) sums squares; pass 2 scales. Each thread revisits only the elements
 * it wrote in pass 1, so y == x and the write-back need no extra barrier. */
template <bool VEC>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_kernel(float *y, float *x, const float *a, const float *g, void *y16, int kind16, int dim,
                   float eps) {
    const int64_t base = (int64_t)blockIdx.x * dim;
    float ss = 0.0f;
    if (VEC) {
        float4 *x4 = reinterpret_cast<float4 *>(x + base);
        const float4 *a4 = a ? reinterpret_cast<const float4 *>(a + base) : nullptr;
        for (int j = threadIdx.x; j < dim / 4; j += blockDim.x) {
            float4 v = x4[j];
            if (a4) {
                float4 r = a4[j];
                v.x += r.x, v.y += r.y, v.z += r.z, v.w += r.w;
                x4[j] = v;
            }
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            float v = x[base + j];
            if (a) {
                v += a[base + j];
                x[base + j] = v;
            }
            ss += v * v;
        }
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    if (VEC) {
        const float4 *x4 = reinterpret_cast<const float4 *>(x + base);
        const float4 *g4 = reinterpret_cast<const float4 *>(g);
        float4 *y4 = reinterpret_cast<float4 *>(y + base);
        for (int j = threadIdx.x; j < dim / 4; j += blockDim.x) {
            float4 v = x4[j], w = g4[j], o;
            o.x = v.x * inv * w.x, o.y = v.y * inv * w.y, o.z = v.z * inv * w.z, o.w = v.w * inv * w.w;
            y4[j] = o;
            if (y16) store4(y16, kind16, base + 4 * (int64_t)j, o);
        }
    } else {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            float o = x[base + j] * inv * g[j];
            y[base + j] = o;
            if (y16) store1(y16, kind16, base + j, o);
        }
    }
}

/* --- residual add, SiLU*mul, gathers ----------------------------------------- */

__global__ void add_vec_kernel(float4 *y, const float4 *a, int64_t n4) {
    for (int64_t i = grid_index(); i < n4; i += grid_stride()) {
        float4 v = y[i], r = a[i];
        v.x += r.x, v.y += r.y, v.z += r.z, v.w += r.w;
        y[i] = v;
    }
}

__global__ void add_kernel(float *y, const float *a, int64_t begin, int64_t n) {
    for (int64_t i = begin + grid_index(); i < n; i += grid_stride()) y[i] += a[i];
}

/* y(n, cols) += bias(cols) */
__global__ void add_bias_kernel(float *y, const float *bias, int64_t total, int cols) {
    for (int64_t i = grid_index(); i < total; i += grid_stride()) y[i] += bias[i % cols];
}

__device__ __forceinline__ float silu_mul1(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

template <bool VEC>
__global__ void silu_mul_kernel(float *out, void *out16, int kind16, const float *gu, int n, int hidden) {
    const int w = VEC ? hidden / 4 : hidden;
    const int64_t total = (int64_t)n * w;
    for (int64_t e = grid_index(); e < total; e += grid_stride()) {
        const int64_t row = e / w, j = e % w;
        const float *gr = gu + row * 2 * hidden;
        if (VEC) {
            float4 g = reinterpret_cast<const float4 *>(gr)[j];
            float4 u = reinterpret_cast<const float4 *>(gr + hidden)[j];
            float4 o = make_float4(silu_mul1(g.x, u.x), silu_mul1(g.y, u.y), silu_mul1(g.z, u.z),
                                   silu_mul1(g.w, u.w));
            reinterpret_cast<float4 *>(out + row * hidden)[j] = o;
            if (out16) store4(out16, kind16, row * hidden + 4 * j, o);
        } else {
            float o = silu_mul1(gr[j], gr[hidden + j]);
            out[row * hidden + j] = o;
            if (out16) store1(out16, kind16, row * hidden + j, o);
        }
    }
}

/* out(n, hidden) = act(gate) * up, or the clamped SwiGLU when act < 0, on
 * (n, 2 * hidden) rows of gate then up; out16 as silu_mul_kernel. */
__global__ void act_mul_kernel(float *out, void *out16, int kind16, const float *gu, int n, int hidden, int act,
                               float alpha, float limit) {
    const int64_t total = (int64_t)n * hidden;
    for (int64_t e = grid_index(); e < total; e += grid_stride()) {
        const int64_t row = e / hidden, j = e % hidden;
        const float g = gu[row * 2 * hidden + j], u = gu[row * 2 * hidden + hidden + j];
        const float o = act < 0 ? loom_om_swiglu_clamp(g, u, alpha, limit) : loom_om_act(act, g) * u;
        out[e] = o;
        if (out16) store1(out16, kind16, e, o);
    }
}

__global__ void softcap_kernel(float *x, int64_t n, float cap) {
    for (int64_t e = grid_index(); e < n; e += grid_stride()) x[e] = loom_om_softcap(x[e], cap);
}

template <bool VEC>
__global__ void gather_rows_kernel(float *dst, const float *src, const int32_t *idx, int dim) {
    const int64_t r = idx[blockIdx.x];
    const float *s = src + r * dim;
    float *d = dst + (int64_t)blockIdx.x * dim;
    if (VEC)
        for (int j = threadIdx.x; j < dim / 4; j += blockDim.x)
            reinterpret_cast<float4 *>(d)[j] = reinterpret_cast<const float4 *>(s)[j];
    else
        for (int j = threadIdx.x; j < dim; j += blockDim.x) d[j] = s[j];
}

/* --- RoPE and the KV write ------------------------------------------------------- */

/* cos/sin of pos * inv_freq[j] for the row's position into cs[0..half) and
 * cs[half..hd), computed in double like the CPU reference. */
__device__ void rope_table(float *cs, int32_t pos, const float *inv_freq, int half) {
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        double sn, c;
        sincos((double)pos * (double)inv_freq[j], &sn, &c);
        cs[j] = (float)c;
        cs[half + j] = (float)sn;
    }
    __syncthreads();
}

/* Rotates pair (j, j + half) of head h; heads [0, n_a) live at a, the rest at b. */
__device__ __forceinline__ void rope_pair(float *a, int n_a, float *b, int hd, int h, int j,
                                          const float *cs) {
    const int half = hd / 2;
    float *x0 = (h < n_a ? a + (int64_t)h * hd : b + (int64_t)(h - n_a) * hd) + j;
    const float c = cs[j], s = cs[half + j];
    const float p = x0[0], q = x0[half];
    x0[0] = fmaf(p, c, -(q * s));
    x0[half] = fmaf(q, c, p * s);
}

__global__ void rope_kernel(float *x, int stride, int n_heads, int hd, const int32_t *pos,
                            const float *inv_freq) {
    extern __shared__ float cs[];
    const int half = hd / 2;
    rope_table(cs, pos[blockIdx.x], inv_freq, half);
    float *row = x + (int64_t)blockIdx.x * stride;
    for (int e = threadIdx.x; e < n_heads * half; e += blockDim.x)
        rope_pair(row, n_heads, row, hd, e / half, e % half, cs);
}

template <bool VEC>
__device__ __forceinline__ void copy_row(float *dst, const float *src, int len) {
    if (VEC)
        for (int j = threadIdx.x; j < len / 4; j += blockDim.x)
            reinterpret_cast<float4 *>(dst)[j] = reinterpret_cast<const float4 *>(src)[j];
    else
        for (int j = threadIdx.x; j < len; j += blockDim.x) dst[j] = src[j];
}

/* One K or V row into the cache, narrowed to the cache's element type. */
template <bool VEC>
__device__ __forceinline__ void write_row(float *dst, const float *src, int len) {
    copy_row<VEC>(dst, src, len);
}
template <bool VEC>
__device__ __forceinline__ void write_row(__nv_bfloat16 *dst, const float *src, int len) {
    for (int j = threadIdx.x; j < len; j += blockDim.x) dst[j] = __float2bfloat16_rn(src[j]);
}
/* The fp8 write divides by the tensor's scale, clamps to +-448 (opmath.h)
 * and counts the clamped values. */
__device__ __forceinline__ void write_fp8(__nv_fp8_e4m3 *dst, const float *src, int len, float inv,
                                          unsigned long long *clamped) {
    unsigned n = 0;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const float x = src[j] * inv, c = loom_om_fp8_store(src[j], inv);
        n += c != x;
        dst[j] = __nv_fp8_e4m3(c);
    }
    if (clamped && __syncthreads_or(n != 0) && n) atomicAdd(clamped, (unsigned long long)n);
}

/* int8 rows: warp w of the block takes heads w, w + warps, ...: the head's
 * absmax, its scale into scales[head], then the codes (opmath.h). */
__device__ __forceinline__ void write_i8(int8_t *dst, float *scales, const float *src, int nkv, int hd) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int h = threadIdx.x >> 5; h < nkv; h += warps) {
        const float *x = src + (int64_t)h * hd;
        float amax = 0.0f;
        for (int j = lane; j < hd; j += 32) amax = fmaxf(amax, fabsf(x[j]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float inv = loom_om_i8_inv(amax);
        for (int j = lane; j < hd; j += 32) dst[(int64_t)h * hd + j] = (int8_t)loom_om_i8_code(x[j], inv);
        if (lane == 0) scales[h] = loom_om_i8_scale(amax);
    }
}

/* One token's K and V rows into its slot (the whole block). */
struct KvDst {
    void *k, *v;
    float *ks, *vs;
    float k_inv, v_inv; /* fp8: 1 / the per-tensor scales */
    unsigned long long *clamped;
    int vd;             /* V's head dim (decompressed MLA: narrower than K's); 0: K's */
};

template <typename T, bool VEC>
__device__ __forceinline__ void write_kv(const KvDst &d, int64_t slot, const float *k, const float *v, int nkv,
                                         int hd) {
    T *kc = static_cast<T *>(d.k), *vc = static_cast<T *>(d.v);
    const int vd = d.vd > 0 ? d.vd : hd;
    const int64_t kv_dim = (int64_t)nkv * hd, v_dim = (int64_t)nkv * vd;
    if constexpr (std::is_same<T, int8_t>::value) {
        write_i8(kc + slot * kv_dim, d.ks + slot * nkv, k, nkv, hd);
        write_i8(vc + slot * v_dim, d.vs + slot * nkv, v, nkv, vd);
    } else if constexpr (std::is_same<T, __nv_fp8_e4m3>::value) {
        write_fp8(kc + slot * kv_dim, k, (int)kv_dim, d.k_inv, d.clamped);
        if (vc != kc || v != k) write_fp8(vc + slot * v_dim, v, (int)v_dim, d.v_inv, d.clamped);
    } else {
        write_row<VEC>(kc + slot * kv_dim, k, (int)kv_dim);
        write_row<VEC>(vc + slot * v_dim, v, (int)v_dim);
    }
}

template <typename T, bool VEC>
__global__ void kv_write_kernel(KvDst d, const float *k, const float *v, int stride, const int32_t *slots, int nkv,
                                int hd) {
    const int64_t slot = slots[blockIdx.x];
    if (slot < 0) return; /* padding token */
    const int64_t src = (int64_t)blockIdx.x * stride;
    write_kv<T, VEC>(d, slot, k + src, v + src, nkv, hd);
}

/* One block per token: rotate its q and k heads, then (after a barrier, so
 * the rotated k written by other threads is visible) write k and v into the
 * cache slot. */
template <typename T, bool VEC>
__global__ void rope_kv_write_kernel(float *q, float *k, const float *v, int stride, int nh, int nkv,
                                     int hd, const int32_t *pos, const float *inv_freq, KvDst d,
                                     const int32_t *slots) {
    extern __shared__ float cs[];
    const int half = hd / 2;
    const int64_t src = (int64_t)blockIdx.x * stride;
    rope_table(cs, pos[blockIdx.x], inv_freq, half);
    for (int e = threadIdx.x; e < (nh + nkv) * half; e += blockDim.x)
        rope_pair(q + src, nh, k + src, hd, e / half, e % half, cs);
    __syncthreads();
    const int64_t slot = slots[blockIdx.x];
    if (slot < 0) return;
    write_kv<T, VEC>(d, slot, k + src, v + src, nkv, hd);
}

template <typename T>
cudaError_t launch_kv_write(const KvDst &d, const float *k, const float *v, int stride, const int32_t *slots, int n,
                            int nkv, int hd, bool vec, cudaStream_t s) {
    if (vec)
        kv_write_kernel<T, true><<<n, 128, 0, s>>>(d, k, v, stride, slots, nkv, hd);
    else
        kv_write_kernel<T, false><<<n, 128, 0, s>>>(d, k, v, stride, slots, nkv, hd);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rope_kv_write(float *q, float *k, const float *v, int stride, int n, int nh, int nkv,
                                 int hd, const int32_t *pos, const float *inv_freq, const KvDst &d,
                                 const int32_t *slots, bool vec, cudaStream_t s) {
    const size_t smem = (size_t)hd * sizeof(float);
    if (vec)
        rope_kv_write_kernel<T, true><<<n, 128, smem, s>>>(q, k, v, stride, nh, nkv, hd, pos, inv_freq, d, slots);
    else
        rope_kv_write_kernel<T, false><<<n, 128, smem, s>>>(q, k, v, stride, nh, nkv, hd, pos, inv_freq, d, slots);
    return cudaGetLastError();
}

} /* namespace */

/* --- launchers --------------------------------------------------------------------- */

extern "C" cudaError_t loom_cuda_convert(void *dst, int kind, const float *src, int64_t n, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    int64_t n4 = 0;
    if (aligned16(src) && ((uintptr_t)dst & 15u) == 0) {
        n4 = n / 4;
        if (n4 > 0) convert_vec_kernel<<<grid_for(n4, kThreads), kThreads, 0, s>>>(dst, kind, (const float4 *)src, n4);
    }
    if (n4 * 4 < n) convert_kernel<<<grid_for(n - n4 * 4, kThreads), kThreads, 0, s>>>(dst, kind, src, n4 * 4, n);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_fill_random(void *dst, int kind, int64_t n, uint64_t seed, float lo, float hi,
                                             cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    fill_random_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(dst, kind, n, seed, lo, hi - lo);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_rmsnorm(float *y, float *x, const float *a, const float *g, void *y16,
                                         int kind16, int n, int dim, float eps, cudaStream_t s) {
    if (n <= 0 || dim <= 0) return cudaSuccess;
    const bool vec = dim % 4 == 0 && aligned16(x) && aligned16(y) && aligned16(g) && (!a || aligned16(a)) &&
                     ((uintptr_t)y16 & 7u) == 0;
    if (vec)
        rmsnorm_kernel<true><<<n, kThreads, 0, s>>>(y, x, a, g, y16, kind16, dim, eps);
    else
        rmsnorm_kernel<false><<<n, kThreads, 0, s>>>(y, x, a, g, y16, kind16, dim, eps);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_add(float *y, const float *a, int64_t n, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    int64_t n4 = 0;
    if (aligned16(y) && aligned16(a)) {
        n4 = n / 4;
        if (n4 > 0) add_vec_kernel<<<grid_for(n4, kThreads), kThreads, 0, s>>>((float4 *)y, (const float4 *)a, n4);
    }
    if (n4 * 4 < n) add_kernel<<<grid_for(n - n4 * 4, kThreads), kThreads, 0, s>>>(y, a, n4 * 4, n);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_add_bias(float *y, const float *bias, int n, int cols, cudaStream_t s) {
    const int64_t total = (int64_t)n * cols;
    if (total <= 0) return cudaSuccess;
    add_bias_kernel<<<grid_for(total, kThreads), kThreads, 0, s>>>(y, bias, total, cols);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_silu_mul(float *out, void *out16, int kind16, const float *gu, int n,
                                          int hidden, cudaStream_t s) {
    if (n <= 0 || hidden <= 0) return cudaSuccess;
    const bool vec = hidden % 4 == 0 && aligned16(out) && aligned16(gu) && ((uintptr_t)out16 & 7u) == 0;
    const int64_t items = (int64_t)n * (vec ? hidden / 4 : hidden);
    if (vec)
        silu_mul_kernel<true><<<grid_for(items, kThreads), kThreads, 0, s>>>(out, out16, kind16, gu, n, hidden);
    else
        silu_mul_kernel<false><<<grid_for(items, kThreads), kThreads, 0, s>>>(out, out16, kind16, gu, n, hidden);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_gather_rows(float *dst, const float *src, const int32_t *idx, int n, int dim,
                                             cudaStream_t s) {
    if (n <= 0 || dim <= 0) return cudaSuccess;
    const int threads = dim >= 1024 ? 256 : 128;
    if (dim % 4 == 0 && aligned16(dst) && aligned16(src))
        gather_rows_kernel<true><<<n, threads, 0, s>>>(dst, src, idx, dim);
    else
        gather_rows_kernel<false><<<n, threads, 0, s>>>(dst, src, idx, dim);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_rope(float *x, int stride, int n, int n_heads, int hd, const int32_t *pos,
                                      const float *inv_freq, cudaStream_t s) {
    if (n <= 0 || n_heads <= 0 || hd < 2) return cudaSuccess;
    rope_kernel<<<n, 128, (size_t)hd * sizeof(float), s>>>(x, stride, n_heads, hd, pos, inv_freq);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_kv_write(void *k_cache, void *v_cache, int kv_kind, float *k_scale,
                                          float *v_scale, const float *fp8_scale, const float *k, const float *v,
                                          int stride, const int32_t *slots, int n, int nkv, int hd, int v_dim,
                                          unsigned long long *clamped, cudaStream_t s) {
    const int kv_dim = nkv * hd, vd = v_dim > 0 ? v_dim : hd;
    if (n <= 0 || kv_dim <= 0) return cudaSuccess;
    if (kv_kind == LOOM_CUDA_I8 && (!k_scale || !v_scale)) return cudaErrorInvalidValue;
    const bool vec = kv_kind == LOOM_CUDA_F32 && kv_dim % 4 == 0 && (nkv * vd) % 4 == 0 && stride % 4 == 0 &&
                     aligned16(k) && aligned16(v) && aligned16(k_cache) && aligned16(v_cache);
    const KvDst d = {k_cache, v_cache, k_scale, v_scale, 1.0f / loom_om_fp8_scale(fp8_scale ? fp8_scale[0] : 0.0f),
                     1.0f / loom_om_fp8_scale(fp8_scale ? fp8_scale[1] : 0.0f), clamped, vd};
    switch (kv_kind) {
    case LOOM_CUDA_F32: return launch_kv_write<float>(d, k, v, stride, slots, n, nkv, hd, vec, s);
    case LOOM_CUDA_BF16: return launch_kv_write<__nv_bfloat16>(d, k, v, stride, slots, n, nkv, hd, false, s);
    case LOOM_CUDA_FP8: return launch_kv_write<__nv_fp8_e4m3>(d, k, v, stride, slots, n, nkv, hd, false, s);
    case LOOM_CUDA_I8: return launch_kv_write<int8_t>(d, k, v, stride, slots, n, nkv, hd, false, s);
    default: return cudaErrorInvalidValue;
    }
}

extern "C" cudaError_t loom_cuda_rope_kv_write(float *q, float *k, const float *v, int stride, int n, int nh,
                                               int nkv, int hd, const int32_t *pos, const float *inv_freq,
                                               void *k_cache, void *v_cache, int kv_kind, float *k_scale,
                                               float *v_scale, const float *fp8_scale, const int32_t *slots,
                                               int v_dim, unsigned long long *clamped, cudaStream_t s) {
    if (n <= 0 || hd < 2) return cudaSuccess;
    if (kv_kind == LOOM_CUDA_I8 && (!k_scale || !v_scale)) return cudaErrorInvalidValue;
    const int kv_dim = nkv * hd, vd = v_dim > 0 ? v_dim : hd;
    const bool vec = kv_kind == LOOM_CUDA_F32 && kv_dim % 4 == 0 && (nkv * vd) % 4 == 0 && stride % 4 == 0 &&
                     aligned16(k) && aligned16(v) && aligned16(k_cache) && aligned16(v_cache);
    const KvDst d = {k_cache, v_cache, k_scale, v_scale, 1.0f / loom_om_fp8_scale(fp8_scale ? fp8_scale[0] : 0.0f),
                     1.0f / loom_om_fp8_scale(fp8_scale ? fp8_scale[1] : 0.0f), clamped, vd};
    switch (kv_kind) {
    case LOOM_CUDA_F32:
        return launch_rope_kv_write<float>(q, k, v, stride, n, nh, nkv, hd, pos, inv_freq, d, slots, vec, s);
    case LOOM_CUDA_BF16:
        return launch_rope_kv_write<__nv_bfloat16>(q, k, v, stride, n, nh, nkv, hd, pos, inv_freq, d, slots, false,
                                                   s);
    case LOOM_CUDA_FP8:
        return launch_rope_kv_write<__nv_fp8_e4m3>(q, k, v, stride, n, nh, nkv, hd, pos, inv_freq, d, slots, false,
                                                   s);
    case LOOM_CUDA_I8:
        return launch_rope_kv_write<int8_t>(q, k, v, stride, n, nh, nkv, hd, pos, inv_freq, d, slots, false, s);
    default: return cudaErrorInvalidValue;
    }
}

extern "C" cudaError_t loom_cuda_act_mul(float *out, void *out16, int kind16, const float *gu, int n, int hidden,
                                         int act, cudaStream_t s) {
    if (n <= 0 || hidden <= 0) return cudaSuccess;
    if (act < LOOM_OM_ACT_SILU || act > LOOM_OM_ACT_RELU2) return cudaErrorInvalidValue;
    act_mul_kernel<<<grid_for((int64_t)n * hidden, kThreads), kThreads, 0, s>>>(out, out16, kind16, gu, n, hidden,
                                                                                act, 0.0f, 0.0f);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_swiglu_clamp(float *out, void *out16, int kind16, const float *gu, int n,
                                              int hidden, float alpha, float limit, cudaStream_t s) {
    if (n <= 0 || hidden <= 0) return cudaSuccess;
    act_mul_kernel<<<grid_for((int64_t)n * hidden, kThreads), kThreads, 0, s>>>(out, out16, kind16, gu, n, hidden,
                                                                                -1, alpha, limit);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_softcap(float *x, int64_t n, float cap, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    if (!(cap > 0.0f)) return cudaErrorInvalidValue;
    softcap_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(x, n, cap);
    return cudaGetLastError();
}

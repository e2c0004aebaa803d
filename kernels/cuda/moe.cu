/* Mixture-of-Experts kernels (loom_op_moe_* in kernels/backend.h): the
 * router's top-k, the batched expert GEMV of a decode step and the weighted
 * combine of the experts' outputs.
 *
 * The batched GEMV gives every (token, choice) pair its own slice of the
 * grid (blockIdx.y): a decode step of n tokens and top-k reads n*k expert
 * matrices, each once, which is what a memory-bound step costs anyway when
 * the pairs mostly choose different experts (Mixtral: 8 experts, k = 2; a
 * batch of 4 already touches most of them). The weight pointer comes from a
 * device table indexed by the chosen expert, so no host round trip and no
 * per-expert launch: the whole block is five kernels a CUDA graph records. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/opmath.h"
#include "kernels/cuda/wide.cuh"

namespace {

using loom_cuda::load_w;
using loom_cuda::warp_max;
using loom_cuda::warp_sum;
using loom_cuda::Wide;

constexpr int kWarps = 8;
constexpr int kRouteMaxExperts = LOOM_CUDA_MOE_MAX_EXPERTS; /* floats of shared memory per warp */
constexpr int kRouteWarps = 4;

/* One warp per token: softmax over E logits, then k rounds of arg-max over
 * the experts not yet taken (ties to the lower id), stored in ascending
 * expert order, as loom_moe_route_row in kernels/backend.c. */
__global__ void __launch_bounds__(kRouteWarps * 32)
    route_kernel(const float *__restrict__ logits, int n, int E, int k, int norm,
                 int32_t *__restrict__ sel, float *__restrict__ w) {
    __shared__ float probs[kRouteWarps][kRouteMaxExperts];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * kRouteWarps + warp;
    if (t >= n) return; /* whole warp */
    const float *l = logits + (int64_t)t * E;
    float *p = probs[warp];
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32)
        mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32) {
        p[e] = expf(l[e] - mx);
        sum += p[e];
    }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += 32)
        p[e] /= sum;
    __syncwarp();
    float ksum = 0.0f, mw = 0.0f;
    int mine = E;
    for (int j = 0; j < k; j++) {
        float bv = -1.0f;
        int be = E;
        for (int e = lane; e < E; e += 32)
            if (p[e] > bv) { /* ascending e per lane: the first of equals stays */
                bv = p[e];
                be = e;
            }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (ov > bv || (ov == bv && oe < be)) {
                bv = ov;
                be = oe;
            }
        }
        if (lane == j) { /* lane j keeps choice j */
            mine = be;
            mw = bv;
        }
        ksum += bv; /* largest first, as the host sums */
        __syncwarp();
        if (lane == 0) p[be] = -2.0f; /* taken: below every probability */
        __syncwarp();
    }
    if (norm) mw /= ksum;
    /* stored in ascending expert order: lane j's place is the number of
     * chosen experts below its own (they are distinct) */
    int rank = 0;
    for (int i = 0; i < k; i++) rank += __shfl_sync(0xffffffffu, mine, i) < mine;
    if (lane < k) {
        sel[(int64_t)t * k + rank] = mine;
        w[(int64_t)t * k + rank] = mw;
    }
}

/* DeepSeekMoE's router (worker/moe_ds.c is the host's), one warp per token:
 * scores (sigmoid, or a softmax summed in double), the correction bias added
 * for the choice only; for the grouped methods lane g ranks group g
 * (loom_om_ds_group_score) and topk_group warp arg-max rounds keep groups;
 * then k arg-max rounds over the kept groups' experts (each lane holds the
 * taken bits of its experts lane + 32 j), ties to the lower group or expert
 * as on the host; the weights from the unbiased scores, their sum in double
 * in ascending expert order (loom_om_ds_weight), stored in ascending expert
 * order. E <= 1024, k <= 32, n_group <= 32. */
constexpr int kDsMaxGroups = 32;

/* The warp's best (value, index) by loom_om_better, on every lane. */
__device__ __forceinline__ void warp_best(float *bv, int *bi, int none) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, *bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, *bi, o);
        if (loom_om_better(ov, oi, *bv, *bi, none)) {
            *bv = ov;
            *bi = oi;
        }
    }
}

__global__ void __launch_bounds__(kRouteWarps * 32)
    ds_route_kernel(const float *__restrict__ logits, int n, int E, int k, int sigmoid, int method, int G, int TG,
                    int renorm, float scaling, const float *__restrict__ bias, int32_t *__restrict__ sel,
                    float *__restrict__ w) {
    __shared__ float scores[kRouteWarps][kRouteMaxExperts], choice[kRouteWarps][kRouteMaxExperts];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t t = (int64_t)blockIdx.x * kRouteWarps + warp;
    if (t >= n) return; /* whole warp */
    const float *l = logits + t * E;
    float *sc = scores[warp], *ch = choice[warp];
    if (sigmoid) {
        for (int e = lane; e < E; e += 32) sc[e] = 1.0f / (1.0f + expf(-l[e]));
    } else { /* softmax in float, the sum in double */
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
        mx = warp_max(mx);
        double sum = 0.0;
        for (int e = lane; e < E; e += 32) sum += sc[e] = expf(l[e] - mx);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        for (int e = lane; e < E; e += 32) sc[e] = (float)(sc[e] / sum);
    }
    for (int e = lane; e < E; e += 32) ch[e] = sc[e] + (bias ? bias[e] : 0.0f);
    __syncwarp();
    const bool grouped = method != LOOM_OM_DS_GREEDY && G > 1;
    const int per = grouped ? E / G : E;
    unsigned keep = 0xffffffffu; /* bit g: group g kept */
    if (grouped) {
        const float gs = lane < G ? loom_om_ds_group_score(ch + lane * per, per, method == LOOM_OM_DS_NOAUX_TC)
                                  : 0.0f;
        bool gtaken = lane >= G;
        keep = 0;
        for (int j = 0; j < TG; j++) {
            float bv = gs;
            int bi = gtaken ? G : lane;
            warp_best(&bv, &bi, G);
            keep |= 1u << bi;
            if (lane == bi) gtaken = true;
        }
    }
    unsigned taken = 0; /* bit q: expert lane + 32 q */
    for (int q = 0, e = lane; e < E; q++, e += 32)
        if (!(keep >> (e / per) & 1u)) taken |= 1u << q;
    int mine = E;
    float mscore = 0.0f;
    for (int j = 0; j < k; j++) {
        float bv = 0.0f;
        int be = E;
        for (int q = 0, e = lane; e < E; q++, e += 32)
            if (!(taken >> q & 1u) && loom_om_better(ch[e], e, bv, be, E)) {
                bv = ch[e];
                be = e;
            }
        warp_best(&bv, &be, E);
        if ((be & 31) == lane) taken |= 1u << (be >> 5);
        if (lane == j) {
            mine = be;
            mscore = sc[be];
        }
    }
    /* ascending expert order: a choice's place is the number of chosen experts below it */
    int rank = 0;
    for (int i = 0; i < k; i++) rank += __shfl_sync(0xffffffffu, mine, i) < mine;
    double sum = 0.0;
    for (int r = 0; r < k; r++) {
        const unsigned at = __ballot_sync(0xffffffffu, lane < k && rank == r);
        sum += (double)__shfl_sync(0xffffffffu, mscore, __ffs(at) - 1);
    }
    if (lane < k) {
        sel[t * k + rank] = mine;
        w[t * k + rank] = loom_om_ds_weight(mscore, sum, sigmoid && renorm, scaling);
    }
}

/* y(p, rows) = W_{sel[p]} x(p / xdiv): blockIdx.y is the pair, each warp R
 * rows of its expert's matrix. VEC: cols % 8 == 0 and 16-byte aligned
 * weights and x, read with 16-byte loads (weights streamed past L1). */
template <int KIND, bool VEC>
__global__ void __launch_bounds__(kWarps * 32)
    moe_gemv_kernel(float *__restrict__ y, const float *__restrict__ x, int xdiv,
                    const int32_t *__restrict__ sel, const void *const *__restrict__ table,
                    int64_t rows, int64_t cols) {
    constexpr int R = 2, U = 4, E = Wide<KIND>::kElems;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int p = blockIdx.y;
    const int64_t row0 = ((int64_t)blockIdx.x * kWarps + warp) * R;
    if (row0 >= rows) return; /* whole warp */
    const void *w = table[sel[p]];
    float *yp = y + (int64_t)p * rows;
    if (!w) { /* another rank's expert: contributes nothing */
        if (lane < R && row0 + lane < rows) yp[row0 + lane] = 0.0f;
        return;
    }
    const float *xp = x + (int64_t)(p / xdiv) * cols;
    float acc[R] = {0.0f, 0.0f};
    if (VEC) {
        const int64_t nv = cols / E;
        const uint4 *wr[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            wr[r] = reinterpret_cast<const uint4 *>(w) + (row0 + r < rows ? row0 + r : row0) * nv;
        for (int64_t v0 = lane; v0 < nv; v0 += 32 * U) {
            uint4 wv[R][U];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++)
                    wv[r][u] =
                        v0 + u * 32 < nv ? __ldcs(wr[r] + v0 + u * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t v = v0 + u * 32;
                if (v >= nv) break;
                const float4 *x4 = reinterpret_cast<const float4 *>(xp + v * E);
                float xf[E];
#pragma unroll
                for (int q = 0; q < E / 4; q++) {
                    float4 xv = __ldg(x4 + q);
                    xf[4 * q] = xv.x, xf[4 * q + 1] = xv.y, xf[4 * q + 2] = xv.z,
                           xf[4 * q + 3] = xv.w;
                }
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float wf[E];
                    Wide<KIND>::unpack(wv[r][u], wf);
#pragma unroll
                    for (int e = 0; e < E; e++)
                        acc[r] = fmaf(wf[e], xf[e], acc[r]);
                }
            }
        }
    } else {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (row0 + r >= rows) break;
            for (int64_t c = lane; c < cols; c += 32)
                acc[r] = fmaf(load_w<KIND>(w, (row0 + r) * cols + c), xp[c], acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < rows) yp[row0 + r] = s;
    }
}

template <int KIND>
cudaError_t launch_gemv(float *y, const float *x, int xdiv, const int32_t *sel, int n_pairs,
                        const void *const *table, int64_t rows, int64_t cols, cudaStream_t s) {
    const int64_t blocks = (rows + kWarps * 2 - 1) / (kWarps * 2);
    const dim3 grid((unsigned)blocks, (unsigned)n_pairs);
    /* x rows are 16-byte aligned when the base is and cols % 4 == 0; the
     * experts' weights come from cudaMalloc (256-byte aligned) */
    const bool vec = cols % 8 == 0 && ((uintptr_t)x & 15u) == 0;
    if (vec)
        moe_gemv_kernel<KIND, true>
            <<<grid, kWarps * 32, 0, s>>>(y, x, xdiv, sel, table, rows, cols);
    else
        moe_gemv_kernel<KIND, false>
            <<<grid, kWarps * 32, 0, s>>>(y, x, xdiv, sel, table, rows, cols);
    return cudaGetLastError();
}

/* out(t) = [acc ? out(t) : 0] + sum_j w[t k + j] y(pos[t k + j]), j in order. */
__global__ void combine_kernel(float *__restrict__ out, const float *__restrict__ y,
                               const int32_t *__restrict__ pos, const float *__restrict__ w, int k,
                               int dim, int accumulate) {
    const int64_t t = blockIdx.x;
    const int d = blockIdx.y * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    float *o = out + (int64_t)t * dim + d;
    float a = accumulate ? *o : 0.0f;
    for (int j = 0; j < k; j++) {
        const int q = pos[(int64_t)t * k + j];
        if (q >= 0) a += w[(int64_t)t * k + j] * y[(int64_t)q * dim + d];
    }
    *o = a;
}

} /* namespace */

extern "C" cudaError_t loom_cuda_moe_route(const float *logits, int n, int n_experts, int k,
                                           int norm, int32_t *sel, float *w, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    if (n_experts < 1 || n_experts > LOOM_CUDA_MOE_MAX_EXPERTS || k < 1 || k > n_experts || k > 32)
        return cudaErrorInvalidValue;
    route_kernel<<<(unsigned)((n + kRouteWarps - 1) / kRouteWarps), kRouteWarps * 32, 0, s>>>(
        logits, n, n_experts, k, norm, sel, w);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_moe_gemv(float *y, const float *x, int xdiv, const int32_t *sel,
                                          int n_pairs, const void *const *table, int kind,
                                          int64_t rows, int64_t cols, cudaStream_t s) {
    if (n_pairs <= 0 || rows <= 0)
        return n_pairs == 0 || rows == 0 ? cudaSuccess : cudaErrorInvalidValue;
    if (cols <= 0 || xdiv < 1 || n_pairs > 65535 ||
        (rows + 2 * kWarps - 1) / (2 * kWarps) > 0x7fffffff)
        return cudaErrorInvalidValue;
    switch (kind) {
    case LOOM_CUDA_BF16:
        return launch_gemv<LOOM_CUDA_BF16>(y, x, xdiv, sel, n_pairs, table, rows, cols, s);
    case LOOM_CUDA_F16:
        return launch_gemv<LOOM_CUDA_F16>(y, x, xdiv, sel, n_pairs, table, rows, cols, s);
    default:
        return launch_gemv<LOOM_CUDA_F32>(y, x, xdiv, sel, n_pairs, table, rows, cols, s);
    }
}

/* y(p, cols) += bias(sel[p], cols): GPT-OSS's expert biases on the rows of
 * the batched expert GEMV. */
__global__ void moe_add_bias_kernel(float *y, const int32_t *sel, const float *bias, int cols) {
    const int p = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c < cols) y[(int64_t)p * cols + c] += bias[(int64_t)sel[p] * cols + c];
}

extern "C" cudaError_t loom_cuda_moe_route_ds(const float *logits, int n, int n_experts, int k, int sigmoid,
                                              int method, int n_group, int topk_group, int renorm, float scaling,
                                              const float *bias, int32_t *sel, float *w, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    if (!loom_cuda_moe_route_ds_fits(n_experts, k, method, n_group, topk_group)) return cudaErrorInvalidValue;
    const unsigned blocks = (unsigned)((n + kRouteWarps - 1) / kRouteWarps);
    ds_route_kernel<<<blocks, kRouteWarps * 32, 0, s>>>(logits, n, n_experts, k, sigmoid, method, n_group,
                                                       topk_group, renorm, scaling, bias, sel, w);
    return cudaGetLastError();
}

extern "C" int loom_cuda_moe_route_ds_fits(int n_experts, int k, int method, int n_group, int topk_group) {
    if (n_experts < 1 || n_experts > kRouteMaxExperts || k < 1 || k > 32 || k > n_experts) return 0;
    if (method == LOOM_OM_DS_GREEDY || n_group <= 1) return 1;
    const int per = n_experts / (n_group > 0 ? n_group : 1);
    return n_group <= kDsMaxGroups && n_experts % n_group == 0 && topk_group >= 1 && topk_group <= n_group &&
           k <= topk_group * per && (method != LOOM_OM_DS_NOAUX_TC || per >= 2);
}

extern "C" cudaError_t loom_cuda_moe_add_bias(float *y, const int32_t *sel, int n_pairs, const float *bias,
                                              int cols, cudaStream_t s) {
    if (n_pairs <= 0 || cols <= 0) return cudaSuccess;
    if (n_pairs > 65535 * 1024) return cudaErrorInvalidValue;
    const int threads = 256;
    const dim3 grid((unsigned)n_pairs, (unsigned)((cols + threads - 1) / threads));
    moe_add_bias_kernel<<<grid, threads, 0, s>>>(y, sel, bias, cols);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_moe_combine(float *out, const float *y, const int32_t *pos,
                                             const float *w, int n, int k, int dim, int accumulate,
                                             cudaStream_t s) {
    if (n <= 0 || dim <= 0) return cudaSuccess;
    if (k < 1) return cudaErrorInvalidValue;
    const int threads = 256;
    const dim3 grid((unsigned)n, (unsigned)((dim + threads - 1) / threads));
    combine_kernel<<<grid, threads, 0, s>>>(out, y, pos, w, k, dim, accumulate);
    return cudaGetLastError();
}

/* Sampling reductions on the device, bit-for-bit the semantics of
 * loom_sample_shard (kernels/sampling.c) so that a GPU shard reports the
 * same candidates as the CPU on the same logits:
 *  - greedy / Gumbel rows: z = logit (* 1/T with round-to-nearest, no FMA
 *    contraction), key = z + g with g = (float)-log(-log(u)) computed in
 *    double from the same splitmix64 hash of (seed, step, id); the best key
 *    wins, ties to the smaller id. Two passes: blocks over slices of the row,
 *    then one warp per row over the slices.
 *  - filtered rows (top-k / top-p): one block per row computes max z and
 *    sum exp(z - max) (double accumulation, as the CPU), then an exact top-k
 *    by radix select on order-preserving keys (4 passes of 8 bits), collects
 *    the keys above the threshold and the lowest ids among the ties at it
 *    (ordered compaction), and sorts the k <= 1024 candidates best first
 *    with a bitonic network. */
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/kernels.h"

namespace {

constexpr int kPlainThreads = 256;
constexpr int kMaxSlices = 64;
constexpr int kSliceElems = 8192;
constexpr int kFiltThreads = 1024;
constexpr int kMaxCand = 1024; /* LOOM_SAMPLE_MAX_CAND */
constexpr unsigned kFull = 0xffffffffu;
enum { kGreedy = 0, kGumbel = 1, kFiltered = 2 };

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

__device__ __forceinline__ float gumbel(uint64_t seed, uint64_t step, uint64_t id) {
    const uint64_t h = splitmix64(seed ^ splitmix64(step ^ splitmix64(id + 0x632be59bd9b4e019ull)));
    const double u = ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    return (float)-log(-log(u));
}

__device__ __forceinline__ bool better(float ka, int ia, float kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

__device__ __forceinline__ float z_of(const loom_cuda_sample_row_t &r, float logit) {
    return r.mode == kGreedy ? logit : __fmul_rn(logit, r.inv_t);
}

/* --- greedy and Gumbel ------------------------------------------------------------- */

__global__ void __launch_bounds__(kPlainThreads)
    plain_slices_kernel(const float *logits, int vocab, int id_offset, const loom_cuda_sample_row_t *rows,
                        int slices, float *scratch) {
    const int r = blockIdx.y;
    const loom_cuda_sample_row_t rp = rows[r];
    if (rp.mode != kGreedy && rp.mode != kGumbel) return;
    const int chunk = (vocab + slices - 1) / slices;
    const int begin = blockIdx.x * chunk, end = min(vocab, begin + chunk);
    const float *lr = logits + (int64_t)r * vocab;
    float best = -INFINITY, mz = -INFINITY;
    int bid = INT32_MAX;
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float z = z_of(rp, lr[i]);
        const int id = id_offset + i;
        const float key = rp.mode == kGumbel ? __fadd_rn(z, gumbel(rp.seed, rp.step, (uint64_t)id)) : z;
        mz = fmaxf(mz, z);
        if (better(key, id, best, bid)) best = key, bid = id;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float k2 = __shfl_xor_sync(kFull, best, o);
        const int i2 = __shfl_xor_sync(kFull, bid, o);
        if (better(k2, i2, best, bid)) best = k2, bid = i2;
        mz = fmaxf(mz, __shfl_xor_sync(kFull, mz, o));
    }
    __shared__ float sk[kPlainThreads / 32], sz[kPlainThreads / 32];
    __shared__ int si[kPlainThreads / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sk[warp] = best, si[warp] = bid, sz[warp] = mz;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) {
            if (better(sk[w], si[w], best, bid)) best = sk[w], bid = si[w];
            mz = fmaxf(mz, sz[w]);
        }
        float *o = scratch + ((size_t)r * slices + blockIdx.x) * 3;
        o[0] = best;
        o[1] = __int_as_float(bid);
        o[2] = mz;
    }
}

__global__ void plain_merge_kernel(int id_offset, const loom_cuda_sample_row_t *rows, int slices,
                                   const float *scratch, float *hdr, int32_t *ids, float *keys) {
    const int r = blockIdx.x;
    const loom_cuda_sample_row_t rp = rows[r];
    if (rp.mode != kGreedy && rp.mode != kGumbel) return;
    float best = -INFINITY, mz = -INFINITY;
    int bid = INT32_MAX;
    for (int c = threadIdx.x; c < slices; c += 32) {
        const float *s = scratch + ((size_t)r * slices + c) * 3;
        const int id = __float_as_int(s[1]);
        if (better(s[0], id, best, bid)) best = s[0], bid = id;
        mz = fmaxf(mz, s[2]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float k2 = __shfl_xor_sync(kFull, best, o);
        const int i2 = __shfl_xor_sync(kFull, bid, o);
        if (better(k2, i2, best, bid)) best = k2, bid = i2;
        mz = fmaxf(mz, __shfl_xor_sync(kFull, mz, o));
    }
    if (threadIdx.x == 0) {
        hdr[4 * r] = mz;
        hdr[4 * r + 1] = 0.0f;
        hdr[4 * r + 2] = __int_as_float(1);
        ids[rp.out_off] = bid == INT32_MAX ? id_offset : bid; /* every key NaN: the CPU keeps id_offset */
        keys[rp.out_off] = best;
    }
}

/* --- top-k / top-p ------------------------------------------------------------------- */

/* Order-preserving map of a float to uint32 (larger float, larger key);
 * -0 ranks with +0 (they compare equal on the CPU), NaN lowest. */
__device__ __forceinline__ uint32_t ordered(float z) {
    if (z != z) return 0u;
    if (z == 0.0f) z = 0.0f;
    const uint32_t u = __float_as_uint(z);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ float block_max(float v, float *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : -INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
    return v;
}

__device__ double block_sum_d(double v, double *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

__global__ void __launch_bounds__(kFiltThreads)
    filtered_kernel(const float *logits, int vocab, int id_offset, const loom_cuda_sample_row_t *rows, float *hdr,
                    int32_t *ids, float *keys) {
    const int r = blockIdx.x;
    const loom_cuda_sample_row_t rp = rows[r];
    if (rp.mode != kFiltered) return;
    const float *lr = logits + (int64_t)r * vocab;
    const int k = min(rp.k, min(vocab, kMaxCand));
    __shared__ float redf[32];
    __shared__ double redd[32];
    __shared__ int hist[256];
    __shared__ int s_sel, s_remaining, s_cnt, s_taken, s_wtot[32];
    __shared__ float ck[kMaxCand];
    __shared__ int ci[kMaxCand];

    /* max z and sum exp(z - max) over the shard */
    float m = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, __fmul_rn(lr[i], rp.inv_t));
    m = block_max(m, redf);
    double sum = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += exp((double)(__fmul_rn(lr[i], rp.inv_t) - m));
    sum = block_sum_d(sum, redd);

    /* radix select: the k-th largest ordered key T, and how many keys equal
     * to T belong to the top k (`remaining` once the digits are fixed) */
    uint32_t prefix = 0u, mask = 0u;
    if (threadIdx.x == 0) s_remaining = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) hist[d] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const uint32_t u = ordered(__fmul_rn(lr[i], rp.inv_t));
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int cum = 0, rem = s_remaining, sel = 0;
            for (int d = 255; d >= 0; d--) {
                if (cum + hist[d] >= rem) {
                    sel = d;
                    break;
                }
                cum += hist[d];
            }
            s_sel = sel;
            s_remaining = rem - cum;
        }
        __syncthreads();
        prefix |= (uint32_t)s_sel << shift;
        mask |= 255u << shift;
    }
    const uint32_t T = prefix;
    const int need_eq = s_remaining; /* >= 1 */
    const int n_gt = k - need_eq;

    /* keys above T, in any order */
    if (threadIdx.x == 0) s_cnt = 0, s_taken = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float z = __fmul_rn(lr[i], rp.inv_t);
        if (ordered(z) > T) {
            const int slot = atomicAdd(&s_cnt, 1);
            if (slot < kMaxCand) ck[slot] = z, ci[slot] = id_offset + i;
        }
    }
    /* ties at T: the need_eq smallest ids, by an ordered compaction in index order */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int base = 0; base < vocab; base += blockDim.x) {
        __syncthreads();
        const int taken = s_taken;
        if (taken >= need_eq) break; /* uniform: read after the barrier */
        const int i = base + threadIdx.x;
        float z = 0.0f;
        bool eq = false;
        if (i < vocab) {
            z = __fmul_rn(lr[i], rp.inv_t);
            eq = ordered(z) == T;
        }
        const unsigned b = __ballot_sync(kFull, eq);
        if (lane == 0) s_wtot[warp] = __popc(b);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < nw; w++) {
            if (w < warp) before += s_wtot[w];
            total += s_wtot[w];
        }
        const int at = taken + before + __popc(b & ((1u << lane) - 1u));
        if (eq && at < need_eq) ck[n_gt + at] = z, ci[n_gt + at] = id_offset + i;
        __syncthreads(); /* everyone has read s_taken and s_wtot */
        if (threadIdx.x == 0) s_taken = taken + total;
    }
    __syncthreads();

    /* bitonic sort of the k candidates, best first; sentinels pad to a power of two */
    int P = 1;
    while (P < k) P <<= 1;
    for (int t = k + threadIdx.x; t < P; t += blockDim.x) ck[t] = -INFINITY, ci[t] = INT32_MAX;
    for (int size = 2; size <= P; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int t = threadIdx.x; t < P; t += blockDim.x) {
                const int u = t ^ stride;
                if (u <= t) continue;
                const bool best_first = (t & size) == 0;
                const float ka = ck[t], kb = ck[u];
                const int ia = ci[t], ib = ci[u];
                if (best_first ? better(kb, ib, ka, ia) : better(ka, ia, kb, ib)) {
                    ck[t] = kb, ci[t] = ib;
                    ck[u] = ka, ci[u] = ia;
                }
            }
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        ids[rp.out_off + j] = ci[j];
        keys[rp.out_off + j] = ck[j];
    }
    if (threadIdx.x == 0) {
        hdr[4 * r] = m;
        hdr[4 * r + 1] = (float)sum;
        hdr[4 * r + 2] = __int_as_float(k);
    }
}

int slices_for(int vocab) {
    int s = (vocab + kSliceElems - 1) / kSliceElems;
    return s < 1 ? 1 : s > kMaxSlices ? kMaxSlices : s;
}

} /* namespace */

extern "C" size_t loom_cuda_sample_scratch_floats(int n_rows, int vocab_shard) {
    return (size_t)(n_rows > 0 ? n_rows : 0) * (size_t)slices_for(vocab_shard) * 3;
}

extern "C" cudaError_t loom_cuda_sample(const float *logits, int n_rows, int vocab_shard, int id_offset,
                                        const loom_cuda_sample_row_t *rows, int any_filtered, int any_plain,
                                        float *hdr, int32_t *ids, float *keys, float *scratch, cudaStream_t s) {
    if (n_rows <= 0 || vocab_shard <= 0) return cudaSuccess;
    if (n_rows > 65535) return cudaErrorInvalidValue;
    cudaError_t e;
    if (any_plain) {
        const int slices = slices_for(vocab_shard);
        plain_slices_kernel<<<dim3((unsigned)slices, (unsigned)n_rows), kPlainThreads, 0, s>>>(
            logits, vocab_shard, id_offset, rows, slices, scratch);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
        plain_merge_kernel<<<(unsigned)n_rows, 32, 0, s>>>(id_offset, rows, slices, scratch, hdr, ids, keys);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (any_filtered) {
        filtered_kernel<<<(unsigned)n_rows, kFiltThreads, 0, s>>>(logits, vocab_shard, id_offset, rows, hdr, ids,
                                                                   keys);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    return cudaSuccess;
}

/* Paged GQA attention over the cache (n_blocks, B, nkv, hd) for
 * mixed batches: each token i has a sequence tok_seq[i] and a position
 * tok_pos[i] and attends causally to the cached keys [0, tok_pos[i]] of its
 * sequence through the block table.
 *
 * Work units. Tokens are cut into units of consecutive rows of one sequence
 * that never cross a multiple of `tq` (a unit starts at i when i % tq == 0 or
 * tok_seq[i - 1] != tok_seq[i]). Decode tokens are units of one row;
 * a prefill chunk becomes units of tq rows. Both kernels below run on a grid
 * (n, n_kv_heads, n_split); block (i, kvh, s) handles the unit that starts at
 * token i (other blocks exit at once) for the query heads of KV head kvh
 * (GQA: the KV head's keys and values are read once for its `group` query
 * heads), over the s-th slice of the unit's key range (flash-decoding
 * split; the slices are merged by attn_combine_kernel when n_split > 1).
 *
 *  - attn_decode_kernel (units of one row): fp32 throughout. Each warp walks
 *    groups of 32 keys, one key per lane for the scores (q is broadcast from
 *    shared memory), keeps an online softmax per head and accumulates
 *    p * V with lanes across head_dim; the 8 warps' states are merged in
 *    shared memory at the end. Memory-bound: every K and V row of the range
 *    is read once.
 *  - attn_tile_kernel (units of 2..tq rows, head_dim % 16 == 0): up to 64
 *    query rows (tq tokens x group heads) against 32 keys at a time, the two
 *    products (Q K^T and P V) on tensor cores in TF32 (WMMA m16n16k8, fp32
 *    accumulation), the online softmax in fp32 in shared memory; or, when the
 *    tuning table's attn_prefill_variant asks for it and the call qualifies
 *    (bf16 cache, head_dim 64 or 128), flash.cu's FA2-style kernel on the
 *    same units (plan.fa2).
 *
 * The cache holds float32, bf16, fp8 e4m3 or int8 elements (template KT):
 * both kernels widen each K and V element to float32 as they load it, so
 * only the bytes read change. int8 rows carry one scale per token and KV
 * head (the CPU backend's layout): the decode kernel multiplies a key's
 * score by its scale and a value's weight by its scale, the tile kernel
 * dequantizes the rows it stages in shared memory.
 *
 * The families' extras (kernels/cuda/opmath.h holds their math, replayed
 * on the CPU by tests/unit/test_cuda_math.c):
 *  - sliding window: a query at pos reads keys [window_lo(pos), pos]; the
 *    split slices cut that range, so a windowed layer reads window keys
 *    whatever the context (the tile kernel's range starts at its rows'
 *    lowest bound and masks the rest per row);
 *  - logit soft cap: each scaled score s becomes cap * tanh(s / cap) before
 *    the running max;
 *  - attention sink: one more partial state {max = sink, sum = 1, no value}
 *    merged where the output is normalised (the one-split epilogue or the
 *    combine kernel), so it is counted once however the keys were shared.
 *
 *
 * Heads wider than 256 (MLA's latent rows) take attn_wide_kernel (below)
 * for every unit instead of the two kernels above.
 *
 * Decode napkin math: per token and KV head, ctx * hd * 2 * e bytes of K
 * and V (e = 4, 2, 1); 4 * ctx * hd * group FLOPs. */
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <mma.h>
#include <stdint.h>

#include "kernels/cuda/flash.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/opmath.h"
#include "kernels/cuda/qformat.h"

namespace {

using namespace nvcuda;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kKeys = LOOM_OM_KEYS; /* keys per step, both kernels */
constexpr int kTileRows = 64;  /* query rows per tile */
static_assert(kTileRows == LOOM_FA_ROWS, "flash.cu takes the tile kernel's units");
constexpr int kMaxSplit = 32;
constexpr int kMaxHd = 256;    /* head_dim limit of both kernels */
constexpr unsigned kFull = 0xffffffffu;

struct Params {
    const float *q;
    const void *kc, *vc; /* elements of the kernel's KT */
    float *out;
    const int32_t *tok_seq, *tok_pos, *bt;
    int n, nh, nkv, hd, group, q_stride, out_stride, B, max_blocks, tq, n_split;
    int vd;      /* V's head dim: hd, or decompressed MLA's narrower values (kv.v_dim) */
    float scale;
    float *part; /* (n, nh, n_split, vd) accumulators, then (n, nh, n_split, 2) {max, sum} */
    float *lse;  /* (n, nh) max + log(sum) of each softmax, or NULL */
    int window;          /* > 0: sliding window */
    float softcap;       /* > 0: logit soft cap */
    const float *sinks;  /* (nh) or NULL */
    const float *ksc, *vsc; /* int8 cache: (n_blocks * B, nkv) scales; NULL otherwise */
    int hc, n_chunks;       /* wide kernel: query heads per tile, chunks of them per KV head */
    bool same_kv;           /* wide kernel: V is K's memory (MLA's latent rows), staged once */
    float kts, vts;         /* fp8 cache: K's and V's per-tensor scales (1 otherwise) */
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    return v;
}

/* Loads of cache elements widened to float32: ld1 element d of a row, ld4
 * elements [4*d4, 4*d4 + 4) (rows of hd % 4 == 0 elements, 16-byte aligned
 * pool: 16, 8 or 4 byte accesses). */
__device__ __forceinline__ float ld1(const float *row, int d) {
    return __ldg(row + d);
}
__device__ __forceinline__ float ld1(const __nv_bfloat16 *row, int d) {
    return __bfloat162float(row[d]);
}
__device__ __forceinline__ float ld1(const __nv_fp8_e4m3 *row, int d) {
    return static_cast<float>(row[d]);
}
__device__ __forceinline__ float4 ld4(const float *row, int d4) {
    return __ldg(reinterpret_cast<const float4 *>(row) + d4);
}
__device__ __forceinline__ float4 ld4(const __nv_bfloat16 *row, int d4) {
    const uint2 u = __ldg(reinterpret_cast<const uint2 *>(row) + d4);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float fp8_byte(unsigned b) {
    __nv_fp8_e4m3 f;
    f.__x = (__nv_fp8_storage_t)(b & 0xffu);
    return static_cast<float>(f);
}
__device__ __forceinline__ float4 ld4(const __nv_fp8_e4m3 *row, int d4) {
    const unsigned u = __ldg(reinterpret_cast<const unsigned *>(row) + d4);
    return make_float4(fp8_byte(u), fp8_byte(u >> 8), fp8_byte(u >> 16), fp8_byte(u >> 24));
}
__device__ __forceinline__ float ld1(const int8_t *row, int d) {
    return (float)row[d];
}
__device__ __forceinline__ float4 ld4(const int8_t *row, int d4) {
    float f[4];
    loom_qd_int8x4(__ldg(reinterpret_cast<const unsigned *>(row) + d4), f);
    return make_float4(f[0], f[1], f[2], f[3]);
}

/* The int8 scale of a cache row (1 for the other element types). */
template <typename KT>
__device__ __forceinline__ float row_scale(const float *sc, int slot, int nkv, int kvh) {
    return 1.0f;
}
template <>
__device__ __forceinline__ float row_scale<int8_t>(const float *sc, int slot, int nkv, int kvh) {
    return __ldg(sc + (int64_t)slot * nkv + kvh);
}

/* Normalised output of a finished softmax state (max m, sum l, unnormalised
 * accumulator o), the head's sink folded in, times V's per-tensor scale
 * (fp8: the values were summed as stored). */
__device__ __forceinline__ float finish(const Params &p, int head, float m, float l, float o) {
    if (p.sinks) o *= loom_om_sink_fold(&m, &l, p.sinks[head]);
    return l > 0.0f ? o / l * p.vts : 0.0f;
}

__device__ __forceinline__ bool unit_starts(const Params &p, int i) {
    return i % p.tq == 0 || p.tok_seq[i - 1] != p.tok_seq[i];
}

/* Whether token i + 1 belongs to the unit of token i. */
__device__ __forceinline__ bool unit_continues(const Params &p, int i) {
    return p.tq > 1 && i + 1 < p.n && (i + 1) % p.tq != 0 && p.tok_seq[i + 1] == p.tok_seq[i];
}

/* The key slice [k0, k1) of split s over the keys [lo, hi). */
__device__ __forceinline__ void split_range(const Params &p, int lo, int hi, int s, int *k0, int *k1) {
    loom_om_split_range(lo, hi, p.n_split, s, k0, k1);
}

/* Cache slot (block * B + offset, an int32 like the slots of the API) of
 * key position `pos`, or -1 when the block table has no block there (never
 * for valid plans: such a key is then skipped instead of read out of
 * bounds). Its row of KV head kvh starts at slot * nkv * hd + kvh * hd. */
__device__ __forceinline__ int key_slot(const Params &p, const int32_t *bt, int pos) {
    const int blk = bt[pos / p.B];
    return blk < 0 ? -1 : blk * p.B + pos % p.B;
}

__device__ __forceinline__ int64_t slot_offset(const Params &p, int slot, int kvh) {
    return (int64_t)slot * ((int64_t)p.nkv * p.hd) + (int64_t)kvh * p.hd;
}

/* The same for V, whose rows are nkv heads of vd. */
__device__ __forceinline__ int64_t vslot_offset(const Params &p, int slot, int kvh) {
    return (int64_t)slot * ((int64_t)p.nkv * p.vd) + (int64_t)kvh * p.vd;
}

/* The log-sum-exp of a finished softmax state (no sinks: the API refuses both). */
__device__ __forceinline__ void put_lse(const Params &p, int token, int head, float m, float l) {
    if (p.lse) p.lse[(int64_t)token * p.nh + head] = m + logf(l);
}

__device__ __forceinline__ size_t part_index(const Params &p, int token, int head, int s) {
    return ((size_t)token * p.nh + head) * p.n_split + s;
}

__device__ __forceinline__ float *part_ml(const Params &p) {
    return p.part + (size_t)p.n * p.nh * p.n_split * p.vd;
}

/* --- one-row units ---------------------------------------------------------------------- */

/* GC: query heads handled per pass (a power of two >= min(group, 8)).
 * VEC: head_dim % 4 == 0 and 16-byte aligned rows (float4 accesses). */
template <typename KT, int GC, bool VEC>
__global__ void __launch_bounds__(kThreads, 2) attn_decode_kernel(Params p) {
    extern __shared__ __align__(128) float sm[];
    const int i = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    if (!unit_starts(p, i) || unit_continues(p, i)) return; /* a tile unit, or inside one */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hd = p.hd, vd = p.vd, G = p.group;
    const int pos = p.tok_pos[i];
    int k0, k1;
    split_range(p, loom_om_window_lo(pos, p.window), pos + 1, split, &k0, &k1);
    if (k0 >= k1) { /* nothing in this slice: an empty partial (n_split > 1 here) */
        float *ml = part_ml(p);
        for (int g = threadIdx.x; g < G; g += blockDim.x) {
            const size_t pi = part_index(p, i, kvh * G + g, split);
            ml[2 * pi] = -INFINITY;
            ml[2 * pi + 1] = 0.0f;
        }
        return;
    }
    const int32_t *bt = p.bt + (int64_t)p.tok_seq[i] * p.max_blocks;

    /* shared: q (G, hd) pre-scaled | per-warp max, sum (kWarps, GC) | per-warp acc (kWarps, GC, vd) */
    float *qs = sm;
    float *wm = qs + ((G * hd + 3) & ~3);
    float *wl = wm + kWarps * GC;
    float *wacc = wl + kWarps * GC;
    const float *qrow = p.q + (int64_t)i * p.q_stride + (int64_t)kvh * G * hd;
    const float qscale = p.scale * p.kts; /* K's per-tensor scale folded into q */
    for (int e = threadIdx.x; e < G * hd; e += blockDim.x) qs[e] = qrow[e] * qscale;
    __syncthreads();

    constexpr int HV = VEC ? kMaxHd / 128 : kMaxHd / 32; /* accumulator slots per lane */
    /* loads in flight: unrolled key and value loops, unless the registers are
     * all taken by 8 heads of accumulators */
    for (int g0 = 0; g0 < G; g0 += GC) {
        const int gc = min(GC, G - g0);
        float m[GC], l[GC];
        float acc[GC][VEC ? 4 * HV : HV];
#pragma unroll
        for (int h = 0; h < GC; h++) {
            m[h] = -INFINITY;
            l[h] = 0.0f;
#pragma unroll
            for (int c = 0; c < (VEC ? 4 * HV : HV); c++) acc[h][c] = 0.0f;
        }
        for (int kb = k0 + warp * kKeys; kb < k1; kb += kWarps * kKeys) {
            /* scores: lane j takes key kb + j */
            const int key = kb + lane;
            const int slot = key < k1 ? key_slot(p, bt, key) : -1;
            float s[GC];
#pragma unroll
            for (int h = 0; h < GC; h++) s[h] = 0.0f;
            if (slot >= 0) {
                const KT *kr = static_cast<const KT *>(p.kc) + slot_offset(p, slot, kvh);
                if (VEC) {
#pragma unroll (GC <= 4 ? 4 : 1)
                    for (int d4 = 0; d4 < hd / 4; d4 += 2) { /* 8 elements per lane per step */
                        const float4 a = ld4(kr, d4);
                        const float4 b = d4 + 1 < hd / 4 ? ld4(kr, d4 + 1) : make_float4(0, 0, 0, 0);
#pragma unroll
                        for (int h = 0; h < GC; h++) {
                            if (h < gc) {
                                const float4 *q4 = reinterpret_cast<const float4 *>(qs + (g0 + h) * hd);
                                const float4 qa = q4[d4];
                                const float4 qb = d4 + 1 < hd / 4 ? q4[d4 + 1] : make_float4(0, 0, 0, 0);
                                s[h] += qa.x * a.x + qa.y * a.y + qa.z * a.z + qa.w * a.w + qb.x * b.x +
                                        qb.y * b.y + qb.z * b.z + qb.w * b.w;
                            }
                        }
                    }
                } else {
                    for (int d = 0; d < hd; d++) {
                        const float kv = ld1(kr, d);
#pragma unroll
                        for (int h = 0; h < GC; h++)
                            if (h < gc) s[h] = fmaf(qs[(g0 + h) * hd + d], kv, s[h]);
                    }
                }
            }
            /* int8 keys' scales, then the soft cap */
            const float ks = slot >= 0 ? row_scale<KT>(p.ksc, slot, p.nkv, kvh) : 0.0f;
#pragma unroll
            for (int h = 0; h < GC; h++) s[h] = loom_om_softcap(s[h] * ks, p.softcap);
            /* online softmax per head over this group of keys */
            float pr[GC];
#pragma unroll
            for (int h = 0; h < GC; h++) {
                const float sv = slot >= 0 ? s[h] : -INFINITY;
                const float mn = fmaxf(m[h], warp_max(sv));
                /* lane 0's key is always in range, but its block may be missing */
                const float alpha = mn == -INFINITY ? 1.0f : expf(m[h] - mn);
                pr[h] = slot >= 0 ? expf(sv - mn) : 0.0f;
                l[h] = l[h] * alpha + warp_sum(pr[h]);
                m[h] = mn;
#pragma unroll
                for (int c = 0; c < (VEC ? 4 * HV : HV); c++) acc[h][c] *= alpha;
            }
            /* acc += p_j * V[j], lanes across head_dim */
            const int nk = min(kKeys, k1 - kb);
#pragma unroll (GC <= 4 ? 4 : 1)
            for (int j = 0; j < nk; j++) {
                const int slotj = __shfl_sync(kFull, slot, j);
                float pj[GC];
#pragma unroll
                for (int h = 0; h < GC; h++) pj[h] = __shfl_sync(kFull, pr[h], j);
                if (slotj < 0) continue; /* same for the whole warp */
                const float vs = row_scale<KT>(p.vsc, slotj, p.nkv, kvh);
#pragma unroll
                for (int h = 0; h < GC; h++) pj[h] *= vs;
                const KT *vr = static_cast<const KT *>(p.vc) + vslot_offset(p, slotj, kvh);
                if (VEC) {
#pragma unroll
                    for (int c = 0; c < HV; c++) {
                        const int d4 = lane + 32 * c;
                        if (d4 < vd / 4) {
                            const float4 v = ld4(vr, d4);
#pragma unroll
                            for (int h = 0; h < GC; h++) {
                                acc[h][4 * c] = fmaf(pj[h], v.x, acc[h][4 * c]);
                                acc[h][4 * c + 1] = fmaf(pj[h], v.y, acc[h][4 * c + 1]);
                                acc[h][4 * c + 2] = fmaf(pj[h], v.z, acc[h][4 * c + 2]);
                                acc[h][4 * c + 3] = fmaf(pj[h], v.w, acc[h][4 * c + 3]);
                            }
                        }
                    }
                } else {
#pragma unroll
                    for (int c = 0; c < HV; c++) {
                        const int d = lane + 32 * c;
                        if (d < vd) {
                            const float v = ld1(vr, d);
#pragma unroll
                            for (int h = 0; h < GC; h++) acc[h][c] = fmaf(pj[h], v, acc[h][c]);
                        }
                    }
                }
            }
        }
        /* merge the warps' states */
#pragma unroll
        for (int h = 0; h < GC; h++) {
            if (h >= gc) continue;
            if (lane == 0) {
                wm[warp * GC + h] = m[h];
                wl[warp * GC + h] = l[h];
            }
            float *wa = wacc + ((size_t)warp * GC + h) * vd;
#pragma unroll
            for (int c = 0; c < HV; c++) {
                if (VEC) {
                    const int d4 = lane + 32 * c;
                    if (d4 < vd / 4)
                        reinterpret_cast<float4 *>(wa)[d4] =
                            make_float4(acc[h][4 * c], acc[h][4 * c + 1], acc[h][4 * c + 2], acc[h][4 * c + 3]);
                } else {
                    const int d = lane + 32 * c;
                    if (d < vd) wa[d] = acc[h][c];
                }
            }
        }
        __syncthreads();
        float *ml = part_ml(p);
        for (int e = threadIdx.x; e < gc * vd; e += blockDim.x) {
            const int h = e / vd, d = e % vd;
            float M = -INFINITY;
            for (int w = 0; w < kWarps; w++) M = fmaxf(M, wm[w * GC + h]);
            float L = 0.0f, o = 0.0f;
            if (M != -INFINITY)
                for (int w = 0; w < kWarps; w++) {
                    const float mw = wm[w * GC + h];
                    if (mw == -INFINITY) continue; /* that warp saw no key */
                    const float f = expf(mw - M);
                    L += wl[w * GC + h] * f;
                    o += wacc[((size_t)w * GC + h) * vd + d] * f;
                }
            const int head = kvh * G + g0 + h;
            if (p.n_split == 1) {
                p.out[(int64_t)i * p.out_stride + (int64_t)head * vd + d] = finish(p, head, M, L, o);
                if (d == 0) put_lse(p, i, head, M, L);
            } else {
                const size_t pi = part_index(p, i, head, split);
                p.part[pi * vd + d] = o;
                if (d == 0) {
                    ml[2 * pi] = M;
                    ml[2 * pi + 1] = L;
                }
            }
        }
        __syncthreads(); /* wm/wl/wacc are reused by the next pass */
    }
}

/* --- tiles of rows ---------------------------------------------------------------------------- */

/* Shared memory of the tile kernel, in floats; ld = hd + 4 keeps WMMA
 * pointers 32-byte aligned (hd % 16 == 0) and shifts rows across banks.
 * hd here is the wider of K's and V's head dims: Q and K rows use the
 * first hd_k floats of a row, V and O rows the first vd. */
__host__ __device__ constexpr int tile_ld(int hd) {
    return hd + 4;
}
constexpr int kLdS = kKeys + 4;
__host__ __device__ constexpr size_t tile_smem_floats(int hd) {
    return (size_t)(2 * kTileRows + 2 * kKeys) * tile_ld(hd) /* Q, O, K, V */ + (size_t)kTileRows * kLdS /* S */ +
           3 * kTileRows /* row max, sum, alpha */ + 4 * kTileRows /* row ints */ + kKeys /* key slots */ +
           8 /* unit info */;
}

typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> FragBt;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> FragB;
typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> FragC;

template <typename F>
__device__ __forceinline__ void to_tf32(F &f) {
#pragma unroll
    for (int t = 0; t < f.num_elements; t++) f.x[t] = wmma::__float_to_tf32(f.x[t]);
}

template <typename KT>
__global__ void __launch_bounds__(kThreads) attn_tile_kernel(Params p) {
    extern __shared__ __align__(128) float sm[];
    const int i = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    if (!unit_starts(p, i) || !unit_continues(p, i)) return; /* one-row units go to the decode kernel */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hd = p.hd, vd = p.vd, G = p.group, ld = tile_ld(max(hd, vd));
    float *Qs = sm;
    float *Os = Qs + kTileRows * ld;
    float *Ks = Os + kTileRows * ld;
    float *Vs = Ks + kKeys * ld;
    float *Ss = Vs + kKeys * ld;
    float *rmax = Ss + kTileRows * kLdS, *rsum = rmax + kTileRows, *ralpha = rsum + kTileRows;
    int *rpos = reinterpret_cast<int *>(ralpha + kTileRows);
    int *rflag = rpos + kTileRows, *rposu = rflag + kTileRows, *rlo = rposu + kTileRows;
    int *kslot = rlo + kTileRows, *info = kslot + kKeys;

    /* the unit's rows: consecutive tokens of this sequence up to the next multiple of tq */
    const int seq = p.tok_seq[i], lim = p.tq - i % p.tq;
    if (threadIdx.x < kTileRows) {
        const int t = threadIdx.x, j = i + t;
        const bool in = t == 0 || (t < lim && j < p.n && p.tok_seq[j] == seq);
        rflag[t] = in;
        rposu[t] = in ? p.tok_pos[j] : -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int R = 1, mp = rposu[0], lp = rposu[0];
        while (R < kTileRows && rflag[R]) {
            mp = max(mp, rposu[R]);
            lp = min(lp, rposu[R++]);
        }
        info[0] = R;
        info[1] = mp;
        info[2] = loom_om_window_lo(lp, p.window);
    }
    __syncthreads();
    const int R = info[0], QR = R * G;
    int k0, k1;
    split_range(p, info[2], info[1] + 1, split, &k0, &k1);
    float *ml = part_ml(p);
    if (k0 >= k1) {
        for (int r = threadIdx.x; r < QR; r += blockDim.x) {
            const size_t pi = part_index(p, i + r / G, kvh * G + r % G, split);
            ml[2 * pi] = -INFINITY;
            ml[2 * pi + 1] = 0.0f;
        }
        return;
    }
    const int32_t *bt = p.bt + (int64_t)seq * p.max_blocks;

    /* Q rows (token r / G, head r % G), pre-scaled; rows >= QR are zero. O = 0. */
    const int hd4 = hd / 4, vd4 = vd / 4;
    for (int e = threadIdx.x; e < kTileRows * hd4; e += blockDim.x) {
        const int r = e / hd4, d4 = e % hd4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < QR) {
            const float *qr = p.q + (int64_t)(i + r / G) * p.q_stride + (int64_t)(kvh * G + r % G) * hd;
            v = reinterpret_cast<const float4 *>(qr)[d4];
            const float qs = p.scale * p.kts; /* K's per-tensor scale folded into q */
            v.x *= qs, v.y *= qs, v.z *= qs, v.w *= qs;
        }
        reinterpret_cast<float4 *>(Qs + r * ld)[d4] = v;
    }
    for (int e = threadIdx.x; e < kTileRows * vd4; e += blockDim.x)
        reinterpret_cast<float4 *>(Os + (e / vd4) * ld)[e % vd4] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (threadIdx.x < kTileRows) {
        const int r = threadIdx.x;
        rpos[r] = r < QR ? rposu[r / G] : -1;
        rlo[r] = r < QR ? loom_om_window_lo(rposu[r / G], p.window) : 0;
        rmax[r] = -INFINITY;
        rsum[r] = 0.0f;
    }
    const int row_tiles = (QR + 15) / 16, col_tiles = vd / 16;

    for (int kb = k0; kb < k1; kb += kKeys) {
        if (threadIdx.x < kKeys) {
            const int key = kb + threadIdx.x;
            kslot[threadIdx.x] = key < k1 ? key_slot(p, bt, key) : -1;
        }
        __syncthreads(); /* kslot ready; the previous step's readers of Ks/Vs/Ss are done */
        if (vd == hd) { /* K and V rows of one width: one pass, both loads in flight */
            for (int e = threadIdx.x; e < kKeys * hd4; e += blockDim.x) {
                const int j = e / hd4, d4 = e % hd4;
                const int slot = kslot[j];
                float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kv;
                if (slot >= 0) {
                    const int64_t off = slot_offset(p, slot, kvh);
                    kv = ld4(static_cast<const KT *>(p.kc) + off, d4);
                    vv = ld4(static_cast<const KT *>(p.vc) + off, d4);
                    const float ks = row_scale<KT>(p.ksc, slot, p.nkv, kvh);
                    const float vs = row_scale<KT>(p.vsc, slot, p.nkv, kvh);
                    kv.x *= ks, kv.y *= ks, kv.z *= ks, kv.w *= ks;
                    vv.x *= vs, vv.y *= vs, vv.z *= vs, vv.w *= vs;
                }
                reinterpret_cast<float4 *>(Ks + j * ld)[d4] = kv;
                reinterpret_cast<float4 *>(Vs + j * ld)[d4] = vv;
            }
        } else { /* V rows of vd (decompressed MLA) */
            for (int e = threadIdx.x; e < kKeys * hd4; e += blockDim.x) {
                const int j = e / hd4, d4 = e % hd4;
                const int slot = kslot[j];
                float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (slot >= 0) {
                    kv = ld4(static_cast<const KT *>(p.kc) + slot_offset(p, slot, kvh), d4);
                    const float ks = row_scale<KT>(p.ksc, slot, p.nkv, kvh);
                    kv.x *= ks, kv.y *= ks, kv.z *= ks, kv.w *= ks;
                }
                reinterpret_cast<float4 *>(Ks + j * ld)[d4] = kv;
            }
            for (int e = threadIdx.x; e < kKeys * vd4; e += blockDim.x) {
                const int j = e / vd4, d4 = e % vd4;
                const int slot = kslot[j];
                float4 vv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (slot >= 0) {
                    vv = ld4(static_cast<const KT *>(p.vc) + vslot_offset(p, slot, kvh), d4);
                    const float vs = row_scale<KT>(p.vsc, slot, p.nkv, kvh);
                    vv.x *= vs, vv.y *= vs, vv.z *= vs, vv.w *= vs;
                }
                reinterpret_cast<float4 *>(Vs + j * ld)[d4] = vv;
            }
        }
        __syncthreads();
        /* S = Q K^T: warp w computes the 16x16 tile (w / 2, w % 2) */
        {
            const int rt = warp >> 1, ct = warp & 1;
            if (rt < row_tiles) {
                FragC c;
                wmma::fill_fragment(c, 0.0f);
                for (int kk = 0; kk < hd; kk += 8) {
                    FragA a;
                    FragBt b;
                    wmma::load_matrix_sync(a, Qs + rt * 16 * ld + kk, ld);
                    wmma::load_matrix_sync(b, Ks + ct * 16 * ld + kk, ld);
                    to_tf32(a);
                    to_tf32(b);
                    wmma::mma_sync(c, a, b, c);
                }
                wmma::store_matrix_sync(Ss + rt * 16 * kLdS + ct * 16, c, kLdS, wmma::mem_row_major);
            }
        }
        __syncthreads();
        /* online softmax, warp w owns rows w, w + 8, ...; lane = key; O rows rescaled here */
        for (int r = warp; r < QR; r += kWarps) {
            const int key = kb + lane;
            const bool valid = kslot[lane] >= 0 && key <= rpos[r] && key >= rlo[r];
            const float s = valid ? loom_om_softcap(Ss[r * kLdS + lane], p.softcap) : -INFINITY;
            const float mo = rmax[r], mn = fmaxf(mo, warp_max(s));
            const float alpha = mn == -INFINITY ? 1.0f : expf(mo - mn);
            const float pr = valid ? expf(s - mn) : 0.0f;
            const float sum = warp_sum(pr);
            Ss[r * kLdS + lane] = pr;
            if (lane == 0) {
                rmax[r] = mn;
                rsum[r] = rsum[r] * alpha + sum;
            }
            if (alpha != 1.0f)
                for (int d = lane; d < vd; d += 32) Os[r * ld + d] *= alpha;
        }
        __syncthreads();
        /* O += P V: tiles (row tile, col tile) dealt round-robin to the warps */
        for (int t = warp; t < row_tiles * col_tiles; t += kWarps) {
            const int rt = t / col_tiles, ct = t % col_tiles;
            FragC c;
            wmma::load_matrix_sync(c, Os + rt * 16 * ld + ct * 16, ld, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < kKeys; kk += 8) {
                FragA a;
                FragB b;
                wmma::load_matrix_sync(a, Ss + rt * 16 * kLdS + kk, kLdS);
                wmma::load_matrix_sync(b, Vs + kk * ld + ct * 16, ld);
                to_tf32(a);
                to_tf32(b);
                wmma::mma_sync(c, a, b, c);
            }
            wmma::store_matrix_sync(Os + rt * 16 * ld + ct * 16, c, ld, wmma::mem_row_major);
        }
        /* the barrier at the top of the next step orders these stores */
    }
    __syncthreads();
    for (int e = threadIdx.x; e < QR * vd; e += blockDim.x) {
        const int r = e / vd, d = e % vd;
        const int token = i + r / G, head = kvh * G + r % G;
        if (p.n_split == 1) {
            p.out[(int64_t)token * p.out_stride + (int64_t)head * vd + d] =
                finish(p, head, rmax[r], rsum[r], Os[r * ld + d]);
            if (d == 0) put_lse(p, token, head, rmax[r], rsum[r]);
        } else {
            const size_t pi = part_index(p, token, head, split);
            p.part[pi * vd + d] = Os[r * ld + d];
            if (d == 0) {
                ml[2 * pi] = rmax[r];
                ml[2 * pi + 1] = rsum[r];
            }
        }
    }
}

/* --- wide heads (head_dim above 256: MLA's latent rows) ------------------------------------------ */

/* MLA's absorbed attention is MQA over the latent cache: one KV head whose
 * 576-element row (DeepSeek-V3's 512 latent + 64 rope values) is the key
 * and, in the latent layout, also the value (v points at k). Rows that wide
 * do not fit the kernels above (their accumulators, a head's slots per
 * lane, and the tile kernel's 64 x (hd + 4) shared tiles), so they have a
 * kernel of their own, for decode and prefill alike:
 *  - a block takes a tile of LOOM_OM_WIDE_ROWS (16) query rows, (token,
 *    head) pairs: hc = min(group, 16) heads of one chunk of a KV head's
 *    query heads (grid.y = KV head x chunk), times tq = 16 / hc consecutive
 *    tokens of one sequence (the units of the kernels above, cut at
 *    multiples of tq), so each key row staged in shared memory serves 16
 *    query rows;
 *  - steps of LOOM_OM_WIDE_KEYS (16) keys: the step's K rows are widened
 *    to f32 (and dequantized) into shared memory, once when V is K's memory;
 *    thread t scores row t / 16 against key t % 16 (rows padded to hd + 1
 *    floats, so the 16 keys of a warp fall in 16 banks); one warp per row
 *    runs the online softmax over the step; then each thread accumulates
 *    p * V for its own columns (t, t + 256, t + 512) of all 16 rows in
 *    registers;
 *  - flash-decoding splits of the key range and their merge, windows, soft
 *    caps, sinks and the int8 scales as in the kernels above (the same
 *    partials layout, merged by attn_combine_kernel).
 * fp32 on CUDA cores throughout: the tile is smem-bandwidth-bound (a score
 * reads two floats per FMA), fine for decode, where the latent rows are
 * read once per 16 query rows, and a first version for prefill; its loops
 * are emulated by tests/unit/test_cuda_math.c against the CPU backend. */
constexpr int kWR = LOOM_OM_WIDE_ROWS;
constexpr int kWK = LOOM_OM_WIDE_KEYS;
constexpr int kWJ = (LOOM_OM_WIDE_MAX_HD + kThreads - 1) / kThreads; /* accumulator columns per thread */
static_assert(kWR * kWK == kThreads, "one score per thread");
static_assert(kWR <= 2 * kWarps, "a warp runs the softmax of at most two rows");

__host__ __device__ constexpr size_t wide_smem_floats(int hd, bool same) {
    return (size_t)(kWR + kWK * (same ? 1 : 2)) * (size_t)(hd + 1) /* Q, K, V */ + kWR * kWK /* S */ +
           3 * kWR /* row max, sum, alpha */ + 3 * kWR /* row ints */ + kWK /* key slots */ + 4 /* unit info */;
}

template <typename KT, bool VEC>
__global__ void __launch_bounds__(kThreads) attn_wide_kernel(Params p) {
    extern __shared__ __align__(128) float sm[];
    const int i = blockIdx.x, kvh = blockIdx.y / p.n_chunks, chunk = blockIdx.y % p.n_chunks, split = blockIdx.z;
    if (!unit_starts(p, i)) return; /* inside a unit: its first token's block has it */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int hd = p.hd, G = p.group, HC = p.hc, ld = hd + 1;
    float *Qs = sm;
    float *Ks = Qs + kWR * ld;
    float *Vs = p.same_kv ? Ks : Ks + kWK * ld;
    float *Ss = Vs + kWK * ld;
    float *rmax = Ss + kWR * kWK, *rsum = rmax + kWR, *ralpha = rsum + kWR;
    int *rpos = reinterpret_cast<int *>(ralpha + kWR), *rlo = rpos + kWR, *rhead = rlo + kWR;
    int *kslot = rhead + kWR, *info = kslot + kWK;

    const int seq = p.tok_seq[i];
    if (tid == 0) { /* the unit: consecutive tokens of this sequence up to the next multiple of tq */
        int R = 1, mp = p.tok_pos[i], lp = mp;
        while (unit_continues(p, i + R - 1)) {
            mp = max(mp, p.tok_pos[i + R]);
            lp = min(lp, p.tok_pos[i + R]);
            R++;
        }
        info[0] = R;
        info[1] = mp;
        info[2] = loom_om_window_lo(lp, p.window);
    }
    __syncthreads();
    if (tid < kWR) { /* row r: token i + r / HC, head chunk * HC + r % HC of this KV head */
        const int r = tid, u = r / HC, g = chunk * HC + r % HC;
        const bool valid = u < info[0] && g < G;
        rpos[r] = valid ? p.tok_pos[i + u] : -1;
        rlo[r] = valid ? loom_om_window_lo(p.tok_pos[i + u], p.window) : 0;
        rhead[r] = valid ? kvh * G + g : -1;
        rmax[r] = -INFINITY;
        rsum[r] = 0.0f;
    }
    int k0, k1;
    split_range(p, info[2], info[1] + 1, split, &k0, &k1);
    __syncthreads();
    if (k0 >= k1) { /* nothing in this slice: empty partials (n_split > 1 here) */
        if (tid < kWR && rhead[tid] >= 0) {
            const size_t pi = part_index(p, i + tid / HC, rhead[tid], split);
            part_ml(p)[2 * pi] = -INFINITY;
            part_ml(p)[2 * pi + 1] = 0.0f;
        }
        return;
    }
    const int32_t *bt = p.bt + (int64_t)seq * p.max_blocks;
    for (int e = tid; e < kWR * hd; e += blockDim.x) { /* Q rows, pre-scaled; missing rows zero */
        const int r = e / hd, d = e % hd;
        Qs[r * ld + d] = rhead[r] >= 0 ? p.q[(int64_t)(i + r / HC) * p.q_stride + (int64_t)rhead[r] * hd + d] *
                                             (p.scale * p.kts)
                                       : 0.0f;
    }
    float acc[kWR][kWJ];
#pragma unroll
    for (int r = 0; r < kWR; r++)
#pragma unroll
        for (int c = 0; c < kWJ; c++) acc[r][c] = 0.0f;

    for (int kb = k0; kb < k1; kb += kWK) {
        if (tid < kWK) {
            const int key = kb + tid;
            kslot[tid] = key < k1 ? key_slot(p, bt, key) : -1;
        }
        __syncthreads(); /* kslot ready; the previous step's readers of Ks, Vs and Ss are done */
        const KT *kc = static_cast<const KT *>(p.kc), *vc = static_cast<const KT *>(p.vc);
        if (VEC) {
            const int hd4 = hd / 4;
            for (int e = tid; e < kWK * hd4; e += blockDim.x) {
                const int j = e / hd4, d4 = e % hd4, slot = kslot[j];
                float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kv;
                if (slot >= 0) {
                    const int64_t off = slot_offset(p, slot, kvh);
                    const float ks = row_scale<KT>(p.ksc, slot, p.nkv, kvh);
                    kv = ld4(kc + off, d4);
                    kv.x *= ks, kv.y *= ks, kv.z *= ks, kv.w *= ks;
                    if (!p.same_kv) {
                        const float vs = row_scale<KT>(p.vsc, slot, p.nkv, kvh);
                        vv = ld4(vc + off, d4);
                        vv.x *= vs, vv.y *= vs, vv.z *= vs, vv.w *= vs;
                    }
                }
                float *kr = Ks + j * ld + 4 * d4;
                kr[0] = kv.x, kr[1] = kv.y, kr[2] = kv.z, kr[3] = kv.w;
                if (!p.same_kv) {
                    float *vr = Vs + j * ld + 4 * d4;
                    vr[0] = vv.x, vr[1] = vv.y, vr[2] = vv.z, vr[3] = vv.w;
                }
            }
        } else {
            for (int e = tid; e < kWK * hd; e += blockDim.x) {
                const int j = e / hd, d = e % hd, slot = kslot[j];
                float kv = 0.0f, vv = 0.0f;
                if (slot >= 0) {
                    const int64_t off = slot_offset(p, slot, kvh);
                    kv = ld1(kc + off, d) * row_scale<KT>(p.ksc, slot, p.nkv, kvh);
                    if (!p.same_kv) vv = ld1(vc + off, d) * row_scale<KT>(p.vsc, slot, p.nkv, kvh);
                }
                Ks[j * ld + d] = kv;
                if (!p.same_kv) Vs[j * ld + d] = vv;
            }
        }
        __syncthreads();
        { /* S: thread t scores row t / kWK against key t % kWK */
            const int r = tid / kWK, j = tid % kWK, key = kb + j;
            const bool valid = kslot[j] >= 0 && key >= rlo[r] && key <= rpos[r];
            float sc = 0.0f;
            if (valid)
                for (int d = 0; d < hd; d++) sc = fmaf(Qs[r * ld + d], Ks[j * ld + d], sc);
            Ss[r * kWK + j] = valid ? loom_om_softcap(sc, p.softcap) : -INFINITY;
        }
        __syncthreads();
        for (int r = warp; r < kWR; r += kWarps) { /* the online softmax of row r over the step */
            const float sv = lane < kWK ? Ss[r * kWK + lane] : -INFINITY;
            const float mo = rmax[r], mn = fmaxf(mo, warp_max(sv));
            const float alpha = mn == -INFINITY ? 1.0f : expf(mo - mn);
            const float pr = sv != -INFINITY ? expf(sv - mn) : 0.0f;
            const float sum = warp_sum(pr);
            if (lane < kWK) Ss[r * kWK + lane] = pr;
            if (lane == 0) {
                rmax[r] = mn;
                rsum[r] = rsum[r] * alpha + sum;
                ralpha[r] = alpha;
            }
        }
        __syncthreads();
        /* acc(r, columns tid + 256 c) = acc * alpha + sum_j p(r, j) V(j); a missing key's V row is zeros */
#pragma unroll
        for (int r = 0; r < kWR; r++) {
            const float a = ralpha[r];
#pragma unroll
            for (int c = 0; c < kWJ; c++) acc[r][c] *= a;
        }
        const int nk = min(kWK, k1 - kb);
        for (int j = 0; j < nk; j++) {
            float v[kWJ];
#pragma unroll
            for (int c = 0; c < kWJ; c++) {
                const int d = tid + c * kThreads;
                v[c] = d < hd ? Vs[j * ld + d] : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < kWR; r++) {
                const float pj = Ss[r * kWK + j];
#pragma unroll
                for (int c = 0; c < kWJ; c++) acc[r][c] = fmaf(pj, v[c], acc[r][c]);
            }
        }
    }
    float *ml = part_ml(p);
#pragma unroll
    for (int r = 0; r < kWR; r++) {
        const int head = rhead[r];
        if (head < 0) continue;
        const int token = i + r / HC;
#pragma unroll
        for (int c = 0; c < kWJ; c++) {
            const int d = tid + c * kThreads;
            if (d >= hd) continue;
            if (p.n_split == 1) {
                p.out[(int64_t)token * p.out_stride + (int64_t)head * hd + d] = finish(p, head, rmax[r], rsum[r], acc[r][c]);
                if (d == 0) put_lse(p, token, head, rmax[r], rsum[r]);
            } else {
                const size_t pi = part_index(p, token, head, split);
                p.part[pi * hd + d] = acc[r][c];
                if (d == 0) {
                    ml[2 * pi] = rmax[r];
                    ml[2 * pi + 1] = rsum[r];
                }
            }
        }
    }
}

/* --- merging the splits --------------------------------------------------------------------------- */

__global__ void attn_combine_kernel(Params p) {
    const int i = blockIdx.x / p.nh, head = blockIdx.x % p.nh;
    const float *ml = part_ml(p);
    const size_t p0 = part_index(p, i, head, 0);
    float M = -INFINITY;
    for (int s = 0; s < p.n_split; s++) M = fmaxf(M, ml[2 * (p0 + s)]);
    float L = 0.0f;
    for (int s = 0; s < p.n_split; s++) {
        const float ms = ml[2 * (p0 + s)];
        if (ms != -INFINITY) L += ml[2 * (p0 + s) + 1] * expf(ms - M);
    }
    if (threadIdx.x == 0) put_lse(p, i, head, M, L); /* before a sink's fold (the two never meet) */
    /* the accumulators are weighed against the splits' max Ms; the sink's
     * fold moves M and returns the factor from Ms to it */
    const float Ms = M;
    const float f = p.sinks ? loom_om_sink_fold(&M, &L, p.sinks[head]) : 1.0f;
    const float inv = L > 0.0f ? f / L * p.vts : 0.0f;
    for (int d = threadIdx.x; d < p.vd; d += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < p.n_split; s++) {
            const float ms = ml[2 * (p0 + s)];
            if (ms != -INFINITY) o += p.part[(p0 + s) * p.vd + d] * expf(ms - Ms);
        }
        p.out[(int64_t)i * p.out_stride + (int64_t)head * p.vd + d] = o * inv;
    }
}

/* --- the decompressed MLA prefill's helpers (attn_mla.c) ------------------------------------------------- */

/* One block per (token, head) row: out and lse_run merged with o and lse by their log-sum-exp. */
__global__ void attn_merge_kernel(float *out, float *lse_run, const float *o, const float *lse, int vd) {
    const int64_t r = blockIdx.x;
    const float la = lse_run[r], lb = lse[r], mx = fmaxf(la, lb);
    const float wa = expf(la - mx), wb = expf(lb - mx), inv = 1.0f / (wa + wb);
    for (int k = threadIdx.x; k < vd; k += blockDim.x)
        out[r * vd + k] = (out[r * vd + k] * wa + o[r * vd + k] * wb) * inv;
    __syncthreads(); /* every thread has read lse_run[r] */
    if (threadIdx.x == 0) lse_run[r] = mx + logf(wa + wb);
}

/* One block per position: its K row (nkv heads of hd) widened to f32, scaled. */
template <typename KT>
__global__ void kv_gather_kernel(const KT *kc, const float *ksc, float ts, const int32_t *bt, int B, int p0, int nkv,
                                 int hd, float *rows) {
    const int p = p0 + blockIdx.x, blk = bt[p / B];
    const int64_t w = (int64_t)nkv * hd;
    float *dst = rows + (int64_t)blockIdx.x * w;
    if (blk < 0) { /* never for valid calls: zeros rather than a read out of bounds */
        for (int64_t j = threadIdx.x; j < w; j += blockDim.x) dst[j] = 0.0f;
        return;
    }
    const int slot = blk * B + p % B;
    const KT *src = kc + (int64_t)slot * w;
    for (int64_t j = threadIdx.x; j < w; j += blockDim.x)
        dst[j] = ld1(src, (int)j) * row_scale<KT>(ksc, slot, nkv, (int)(j / hd)) * ts;
}

template <typename KT>
cudaError_t launch_kv_gather(const void *k, const float *ksc, float ts, const int32_t *bt, int B, int p0, int cn,
                             int nkv, int hd, float *rows, cudaStream_t s) {
    kv_gather_kernel<KT><<<(unsigned)cn, 256, 0, s>>>(static_cast<const KT *>(k), ksc, ts, bt, B, p0, nkv, hd, rows);
    return cudaGetLastError();
}

/* --- host side -------------------------------------------------------------------------------------- */

bool aligned16(const void *ptr) {
    return ((uintptr_t)ptr & 15u) == 0;
}

int group_chunk(int group) {
    return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8;
}

/* V's head dim: v_dim where it is set, else K's. */
int v_dim_of(const loom_cuda_attn_t *a) {
    return a->v_dim > 0 ? a->v_dim : a->head_dim;
}

bool use_vec(const loom_cuda_attn_t *a) {
    return a->head_dim % 4 == 0 && v_dim_of(a) % 4 == 0 && a->q_stride % 4 == 0 && a->out_stride % 4 == 0 &&
           aligned16(a->q) && aligned16(a->out) && aligned16(a->k_cache) && aligned16(a->v_cache);
}

size_t decode_smem(const loom_cuda_attn_t *a) {
    const int G = a->n_heads / a->n_kv_heads, GC = group_chunk(G), hd = a->head_dim;
    return (((size_t)G * hd + 3) / 4 * 4 + 2 * (size_t)kWarps * GC + (size_t)kWarps * GC * v_dim_of(a)) *
           sizeof(float);
}

template <typename KT, int GC, bool VEC>
void set_decode_attr(size_t bytes, cudaError_t *e) {
    cudaError_t r = cudaFuncSetAttribute(attn_decode_kernel<KT, GC, VEC>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (r != cudaSuccess && *e == cudaSuccess) *e = r;
}

template <typename KT>
void set_attrs(size_t bytes, cudaError_t *e) {
    set_decode_attr<KT, 1, true>(bytes, e);
    set_decode_attr<KT, 2, true>(bytes, e);
    set_decode_attr<KT, 4, true>(bytes, e);
    set_decode_attr<KT, 8, true>(bytes, e);
    set_decode_attr<KT, 1, false>(bytes, e);
    set_decode_attr<KT, 2, false>(bytes, e);
    set_decode_attr<KT, 4, false>(bytes, e);
    set_decode_attr<KT, 8, false>(bytes, e);
    const void *fns[] = {(const void *)attn_tile_kernel<KT>, (const void *)attn_wide_kernel<KT, true>,
                         (const void *)attn_wide_kernel<KT, false>};
    for (const void *f : fns) {
        cudaError_t r = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
        if (r != cudaSuccess && *e == cudaSuccess) *e = r;
    }
}

template <typename KT, int GC, bool VEC>
void launch_decode(const Params &p, dim3 grid, size_t smem, cudaStream_t s) {
    attn_decode_kernel<KT, GC, VEC><<<grid, kThreads, smem, s>>>(p);
}

template <typename KT, bool VEC>
void launch_decode_g(const Params &p, dim3 grid, size_t smem, cudaStream_t s) {
    switch (group_chunk(p.group)) {
    case 1: launch_decode<KT, 1, VEC>(p, grid, smem, s); break;
    case 2: launch_decode<KT, 2, VEC>(p, grid, smem, s); break;
    case 4: launch_decode<KT, 4, VEC>(p, grid, smem, s); break;
    default: launch_decode<KT, 8, VEC>(p, grid, smem, s); break;
    }
}

bool same_kv(const loom_cuda_attn_t *a) {
    return a->k_cache == a->v_cache && a->k_scale == a->v_scale;
}

/* The kernels for one cache element type: the wide kernel alone for heads
 * above kMaxHd, else the one-row and tile kernels; the split merge. */
template <typename KT>
cudaError_t launch_all(const Params &p, const loom_cuda_attn_t *a, const loom_cuda_attn_plan_t *plan, bool vec,
                       cudaStream_t s) {
    const dim3 grid((unsigned)p.n, (unsigned)p.nkv, (unsigned)plan->n_split);
    if (p.hd > kMaxHd) {
        const dim3 wgrid((unsigned)p.n, (unsigned)(p.nkv * p.n_chunks), (unsigned)plan->n_split);
        if (vec)
            attn_wide_kernel<KT, true><<<wgrid, kThreads, plan->smem, s>>>(p);
        else
            attn_wide_kernel<KT, false><<<wgrid, kThreads, plan->smem, s>>>(p);
        cudaError_t e = cudaGetLastError();
        if (e == cudaSuccess && plan->n_split > 1) {
            attn_combine_kernel<<<(unsigned)((int64_t)p.n * p.nh), 128, 0, s>>>(p);
            e = cudaGetLastError();
        }
        return e;
    }
    if (vec)
        launch_decode_g<KT, true>(p, grid, plan->smem, s);
    else
        launch_decode_g<KT, false>(p, grid, plan->smem, s);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    if (plan->tq > 1 && plan->fa2) {
        if ((e = loom_cuda_flash_prefill(a, plan, p.part, s)) != cudaSuccess) return e;
    } else if (plan->tq > 1) {
        attn_tile_kernel<KT><<<grid, kThreads, plan->smem_tile, s>>>(p);
        if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    if (plan->n_split > 1) {
        attn_combine_kernel<<<(unsigned)((int64_t)p.n * p.nh), 128, 0, s>>>(p);
        e = cudaGetLastError();
    }
    return e;
}

} /* namespace */

extern "C" cudaError_t loom_cuda_attention_init(size_t max_smem_optin) {
    cudaError_t e = cudaSuccess;
    set_attrs<float>(max_smem_optin, &e);
    set_attrs<__nv_bfloat16>(max_smem_optin, &e);
    set_attrs<__nv_fp8_e4m3>(max_smem_optin, &e);
    set_attrs<int8_t>(max_smem_optin, &e);
    const cudaError_t ef = loom_cuda_flash_init(max_smem_optin);
    return e != cudaSuccess ? e : ef;
}

extern "C" loom_cuda_attn_plan_t loom_cuda_attention_plan(const loom_cuda_attn_t *a, int n_sms, size_t max_smem,
                                                          size_t part_cap) {
    loom_cuda_attn_plan_t pl = {1, 1, 0, 0, 0, 0};
    static_assert(sizeof(pl) == 2 * sizeof(int) + 4 * sizeof(size_t), "plan layout");
    const int G = a->n_heads / a->n_kv_heads, hd = a->head_dim, vd = v_dim_of(a);
    const int64_t waves = a->split_waves > 0 ? a->split_waves : 2;
    const size_t per_split = (size_t)a->n * a->n_heads * ((size_t)vd + 2);
    if (hd > kMaxHd) { /* the wide kernel: units of tq tokens, a tile per chunk of heads */
        pl.tq = loom_om_wide_tq(G);
        pl.smem = wide_smem_floats(hd, same_kv(a)) * sizeof(float);
        const int64_t tiles = (int64_t)a->n * a->n_kv_heads * loom_om_wide_chunks(G);
        int64_t ns = (waves * (int64_t)n_sms + tiles - 1) / tiles;
        ns = ns > kMaxSplit ? kMaxSplit : ns < 1 ? 1 : ns;
        while (ns > 1 && (size_t)ns * per_split > part_cap) ns--;
        pl.n_split = (int)ns;
        pl.part_floats = ns > 1 ? (size_t)ns * per_split : 0;
        (void)max_smem; /* the caller checks smem against the device */
        return pl;
    }
    pl.smem = decode_smem(a);
    const size_t tile_bytes = tile_smem_floats(hd > vd ? hd : vd) * sizeof(float);
    /* Tiles only pay off for chunks of tokens; below tile_min_n (9) every one goes alone. */
    const int tile_min_n = a->tile_min_n > 0 ? a->tile_min_n : 9;
    if (use_vec(a) && hd % 16 == 0 && vd % 16 == 0 && hd <= kMaxHd && vd <= kMaxHd && G <= kTileRows / 2 &&
        a->n >= tile_min_n && tile_bytes <= max_smem) {
        pl.tq = kTileRows / G;
        pl.smem_tile = tile_bytes;
        /* the FA2-style kernel for the same units where it applies (flash.h): V rows as wide as K's */
        if (a->prefill_variant == LOOM_FA_VARIANT_FA2 && a->kv_kind == LOOM_CUDA_BF16 && loom_fa_head_dim_ok(hd) &&
            vd == hd && loom_fa_smem_bytes(hd) <= max_smem) {
            pl.fa2 = 1;
            pl.smem_tile = loom_fa_smem_bytes(hd);
        }
    }
    /* Enough blocks for split_waves (2) waves of the SMs when there are few units. */
    const int64_t units = (int64_t)a->n * a->n_kv_heads;
    int64_t ns = (waves * (int64_t)n_sms + units - 1) / units;
    if (ns > kMaxSplit) ns = kMaxSplit;
    if (ns < 1) ns = 1;
    while (ns > 1 && (size_t)ns * per_split > part_cap) ns--;
    pl.n_split = (int)ns;
    pl.part_floats = ns > 1 ? (size_t)ns * per_split : 0;
    return pl;
}

extern "C" cudaError_t loom_cuda_attention(const loom_cuda_attn_t *a, const loom_cuda_attn_plan_t *plan, float *part,
                                           cudaStream_t s) {
    if (a->n <= 0) return cudaSuccess;
    const int G = a->n_heads / a->n_kv_heads, vd = v_dim_of(a);
    /* V rows narrower (or wider) than K's: the one-row and tile kernels, up to kMaxHd */
    if (vd != a->head_dim && (a->head_dim > kMaxHd || vd > kMaxHd)) return cudaErrorInvalidValue;
    if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads != 0 || a->head_dim <= 0 || a->head_dim > LOOM_OM_WIDE_MAX_HD ||
        a->block_size <= 0 || plan->n_split < 1 || plan->n_split > kMaxSplit || (plan->n_split > 1 && !part) ||
        a->n_kv_heads > 65535)
        return cudaErrorInvalidValue;
    Params p;
    p.q = a->q, p.kc = a->k_cache, p.vc = a->v_cache, p.out = a->out;
    p.tok_seq = a->tok_seq, p.tok_pos = a->tok_pos, p.bt = a->block_tables;
    p.n = a->n, p.nh = a->n_heads, p.nkv = a->n_kv_heads, p.hd = a->head_dim, p.group = G;
    p.q_stride = a->q_stride, p.out_stride = a->out_stride, p.B = a->block_size, p.max_blocks = a->max_blocks;
    p.tq = plan->tq, p.n_split = plan->n_split, p.scale = a->scale, p.part = part;
    p.vd = vd, p.lse = a->lse;
    p.window = a->window, p.softcap = a->softcap, p.sinks = a->sinks;
    p.ksc = a->k_scale, p.vsc = a->v_scale;
    p.hc = loom_om_wide_heads(G), p.n_chunks = loom_om_wide_chunks(G), p.same_kv = same_kv(a);
    const bool fp8 = a->kv_kind == LOOM_CUDA_FP8;
    p.kts = fp8 ? loom_om_fp8_scale(a->fp8_scale[0]) : 1.0f;
    p.vts = fp8 ? loom_om_fp8_scale(a->fp8_scale[1]) : 1.0f;
    if (a->head_dim > kMaxHd && (plan->tq != loom_om_wide_tq(G) || a->n_kv_heads * p.n_chunks > 65535))
        return cudaErrorInvalidValue;
    if (a->window < 0 || a->softcap < 0.0f || (a->kv_kind == LOOM_CUDA_I8 && (!p.ksc || !p.vsc)) ||
        (a->lse && a->sinks))
        return cudaErrorInvalidValue;
    switch (a->kv_kind) {
    case LOOM_CUDA_F32: return launch_all<float>(p, a, plan, use_vec(a), s);
    case LOOM_CUDA_BF16: return launch_all<__nv_bfloat16>(p, a, plan, use_vec(a), s);
    case LOOM_CUDA_FP8: return launch_all<__nv_fp8_e4m3>(p, a, plan, use_vec(a), s);
    case LOOM_CUDA_I8: return launch_all<int8_t>(p, a, plan, use_vec(a), s);
    default: return cudaErrorInvalidValue;
    }
}

extern "C" cudaError_t loom_cuda_attn_merge(float *out, float *lse_run, const float *o, const float *lse, int n, int nh,
                                            int vd, cudaStream_t s) {
    if (n <= 0) return cudaSuccess;
    if (nh <= 0 || vd <= 0) return cudaErrorInvalidValue;
    attn_merge_kernel<<<(unsigned)((int64_t)n * nh), 128, 0, s>>>(out, lse_run, o, lse, vd);
    return cudaGetLastError();
}

extern "C" cudaError_t loom_cuda_kv_gather(const void *k_cache, int kv_kind, const float *k_scale, float fp8_scale,
                                           const int32_t *bt, int block_size, int p0, int cn, int nkv, int hd,
                                           float *rows, cudaStream_t s) {
    if (cn <= 0) return cudaSuccess;
    if (block_size <= 0 || p0 < 0 || nkv <= 0 || hd <= 0 || (kv_kind == LOOM_CUDA_I8 && !k_scale))
        return cudaErrorInvalidValue;
    switch (kv_kind) {
    case LOOM_CUDA_F32: return launch_kv_gather<float>(k_cache, NULL, 1.0f, bt, block_size, p0, cn, nkv, hd, rows, s);
    case LOOM_CUDA_BF16:
        return launch_kv_gather<__nv_bfloat16>(k_cache, NULL, 1.0f, bt, block_size, p0, cn, nkv, hd, rows, s);
    case LOOM_CUDA_FP8:
        return launch_kv_gather<__nv_fp8_e4m3>(k_cache, NULL, loom_om_fp8_scale(fp8_scale), bt, block_size, p0, cn,
                                               nkv, hd, rows, s);
    case LOOM_CUDA_I8:
        return launch_kv_gather<int8_t>(k_cache, k_scale, 1.0f, bt, block_size, p0, cn, nkv, hd, rows, s);
    default: return cudaErrorInvalidValue;
    }
}

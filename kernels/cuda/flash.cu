/* FlashAttention-2-style prefill on the paged bf16 cache: the units of more
 * than one row (attention.cu's tile units: consecutive tokens of one
 * sequence, tq = 64 / group of them, times the group's query heads) when
 * the tuning table's attn_prefill_variant is fa2 (flash.h).
 *
 * A CTA of 4 warps takes one unit and KV head: 64 query rows, 16 a warp.
 * Each warp keeps its rows of Q (bf16, pre-scaled) as mma A fragments in
 * registers for the whole key range, and its rows of the output as f32
 * accumulators. The keys and values come in tiles of 64 rows, read from
 * the block table row by row and copied into shared memory with cp.async,
 * two stages: tile t + 1 is in flight while tile t is multiplied. Per tile
 * a warp computes S = Q K^T (mma.sync m16n8k16, bf16 in, f32 out), masks it
 * (causal by position, sliding window, missing blocks), soft-caps it, and
 * updates each row's running max and sum in registers (the four lanes of
 * a row's quad exchange their maxima with two shuffles; the sums stay per
 * lane until the end); the accumulator is rescaled and P (rounded to
 * bf16) goes straight from the S accumulators into the A operand of
 * O += P V, whose layouts agree lane by lane. The sink is folded in where
 * the row is normalised, as the other kernels fold it; key splits write
 * the same partials as the tile kernel, merged by attention.cu's combine.
 *
 * Inline PTX rather than WMMA: the online softmax needs to know which row
 * and key each accumulator register holds, and P must be fed back as an A
 * operand without a trip through shared memory; WMMA's fragment layouts
 * are opaque, mma.sync's are documented (flash.h's helpers spell them out,
 * and the CPU replay in tests/unit/test_cuda_math.c follows them).
 *
 * Napkin math, a unit of 64 rows against L keys: 4 * 64 * L * hd FLOPs on
 * tensor cores; 2 * L * hd * 2 bytes of K and V read once for the group's
 * heads (the tile kernel reads the same bytes, widened to f32 in shared
 * memory, and multiplies in TF32 through shared memory). */
#include <cuda_bf16.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/flash.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/opmath.h"

namespace {

constexpr int kWarps = LOOM_FA_WARPS;
constexpr int kThreads = 32 * kWarps;
constexpr int kKeys = LOOM_FA_KEYS;
constexpr int kNt = kKeys / 8; /* n-tiles of 8 keys in a warp's S */
constexpr unsigned kFull = 0xffffffffu;

struct FParams {
    const float *q;
    const __nv_bfloat16 *kc, *vc;
    float *out;
    const int32_t *tok_seq, *tok_pos, *bt;
    int n, nh, nkv, group, q_stride, out_stride, B, max_blocks, tq, n_split, window;
    float scale, softcap;
    const float *sinks; /* (nh) or NULL */
    float *part;        /* as attention.cu's: (n, nh, n_split, hd) accumulators, then {max, sum} */
    float *lse;         /* (n, nh) max + log(sum) of each softmax, or NULL */
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (lo) in the low half */
    return *reinterpret_cast<const uint32_t *>(&v);
}

__device__ __forceinline__ uint32_t pack_raw(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}

/* c += a b over one m16n8k16 tile, bf16 in, f32 accumulation. */
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap(); /* the plan never picks this kernel below sm_80 */
#endif
}

/* 16 bytes global -> shared without registers; zeros when !valid (src-size 0). */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ bool unit_starts(const FParams &p, int i) {
    return i % p.tq == 0 || p.tok_seq[i - 1] != p.tok_seq[i];
}
__device__ __forceinline__ bool unit_continues(const FParams &p, int i) {
    return p.tq > 1 && i + 1 < p.n && (i + 1) % p.tq != 0 && p.tok_seq[i + 1] == p.tok_seq[i];
}

template <int HD>
__global__ void __launch_bounds__(kThreads) flash_prefill_kernel(FParams p) {
    constexpr int LD = HD + LOOM_FA_PAD, KT = HD / 16, DT = HD / 8;
    extern __shared__ __align__(128) __nv_bfloat16 fsm[]; /* (stage, K | V, key, LD) */
    __shared__ int kvalid[2][kKeys];                       /* a staged key's block exists */
    __shared__ int info[4];
    const int i = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    if (!unit_starts(p, i) || !unit_continues(p, i)) return; /* one-row units are the decode kernel's */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, G = p.group;
    const int seq = p.tok_seq[i];
    if (threadIdx.x == 0) { /* the unit: consecutive tokens of this sequence up to the next multiple of tq */
        const int lim = p.tq - i % p.tq;
        int R = 1, pmin = p.tok_pos[i], pmax = pmin;
        while (R < lim && i + R < p.n && p.tok_seq[i + R] == seq) {
            pmin = min(pmin, p.tok_pos[i + R]);
            pmax = max(pmax, p.tok_pos[i + R]);
            R++;
        }
        info[0] = R, info[1] = pmin, info[2] = pmax;
    }
    __syncthreads();
    const int QR = info[0] * G;
    int k0, k1;
    loom_fa_unit_range(info[1], info[2], p.window, p.n_split, split, &k0, &k1);
    float *ml = p.part + (size_t)p.n * p.nh * p.n_split * HD;
    if (k0 >= k1) { /* nothing in this slice: empty partials (n_split > 1 here) */
        for (int r = threadIdx.x; r < QR; r += kThreads) {
            const size_t pi = ((size_t)(i + r / G) * p.nh + kvh * G + r % G) * p.n_split + split;
            ml[2 * pi] = -INFINITY;
            ml[2 * pi + 1] = 0.0f;
        }
        return;
    }
    const int32_t *bt = p.bt + (int64_t)seq * p.max_blocks;

    /* this lane's two rows (h = 0: g, h = 1: g + 8 of the warp's 16) */
    int posr[2], lor[2];
    int lo_min = INT_MAX, pos_max = -1;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = 16 * warp + loom_fa_c_row(lane, 2 * h);
        posr[h] = r < QR ? p.tok_pos[i + r / G] : -1; /* a row past the unit: every key masked */
        lor[h] = r < QR ? loom_om_window_lo(posr[h], p.window) : INT_MAX;
        lo_min = min(lo_min, lor[h]);
        pos_max = max(pos_max, posr[h]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        lo_min = min(lo_min, __shfl_xor_sync(kFull, lo_min, o));
        pos_max = max(pos_max, __shfl_xor_sync(kFull, pos_max, o));
    }

    /* Q: the warp's 16 rows as A fragments, pre-scaled, bf16 */
    uint32_t qa[KT][4];
#pragma unroll
    for (int kk = 0; kk < KT; kk++)
#pragma unroll
        for (int a = 0; a < 4; a++) {
            const int r = 16 * warp + loom_fa_a_row(lane, a), d = 16 * kk + loom_fa_a_col(lane, a);
            float2 v = make_float2(0.0f, 0.0f);
            if (r < QR)
                v = *reinterpret_cast<const float2 *>(p.q + (int64_t)(i + r / G) * p.q_stride +
                                                      (int64_t)(kvh * G + r % G) * HD + d);
            qa[kk][a] = pack_bf16(v.x * p.scale, v.y * p.scale);
        }
    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[d][c] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    /* stage(tile, buf): the tile's K and V rows into stage buf, one cp.async per 16 bytes */
    auto stage = [&](int tile, int buf) {
        __nv_bfloat16 *Kd = fsm + (size_t)buf * 2 * kKeys * LD, *Vd = Kd + kKeys * LD;
        for (int c = threadIdx.x; c < kKeys * HD / 8; c += kThreads) {
            int j, col;
            loom_fa_chunk(c, HD, &j, &col);
            const int slot = loom_fa_tile_slot(bt, p.B, k0, k1, tile, j);
            const int64_t off = slot >= 0 ? (int64_t)slot * p.nkv * HD + (int64_t)kvh * HD + col : 0;
            cp_async16(Kd + j * LD + col, p.kc + off, slot >= 0);
            cp_async16(Vd + j * LD + col, p.vc + off, slot >= 0);
            if (col == 0) kvalid[buf][j] = slot >= 0;
        }
        cp_async_commit();
    };

    const int nt = loom_fa_n_tiles(k0, k1);
    stage(0, 0);
    for (int t = 0; t < nt; t++) {
        const int buf = t & 1;
        if (t + 1 < nt) { /* the next tile's copies go out before this one is waited for */
            stage(t + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); /* tile t staged by every thread */
        const int kb = k0 + t * kKeys;
        if (loom_fa_tile_live(kb, lo_min, pos_max)) {
            const __nv_bfloat16 *Ks = fsm + (size_t)buf * 2 * kKeys * LD, *Vs = Ks + kKeys * LD;
            float s[kNt][4];
#pragma unroll
            for (int nn = 0; nn < kNt; nn++)
#pragma unroll
                for (int c = 0; c < 4; c++) s[nn][c] = 0.0f;
            /* S = Q K^T: B's column n is key 8 nn + n, its k rows are head elements */
#pragma unroll
            for (int kk = 0; kk < KT; kk++)
#pragma unroll
                for (int nn = 0; nn < kNt; nn++) {
                    const __nv_bfloat16 *kr = Ks + (8 * nn + loom_fa_b_n(lane)) * LD + 16 * kk;
                    mma_bf16(s[nn], qa[kk], *reinterpret_cast<const uint32_t *>(kr + loom_fa_b_k(lane, 0)),
                             *reinterpret_cast<const uint32_t *>(kr + loom_fa_b_k(lane, 1)));
                }
            /* mask, soft cap, the online softmax of each of the lane's two rows */
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float r[2 * kNt];
#pragma unroll
                for (int nn = 0; nn < kNt; nn++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int j = 8 * nn + loom_fa_c_col(lane, 2 * h + e);
                        r[2 * nn + e] = loom_fa_score(s[nn][2 * h + e], kb + j, kvalid[buf][j] ? 0 : -1, lor[h],
                                                      posr[h], p.softcap);
                    }
                float mx = loom_fa_max(r, 2 * kNt);
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
                const float alpha = loom_fa_row_update(&m[h], &l[h], r, 2 * kNt, mx);
#pragma unroll
                for (int nn = 0; nn < kNt; nn++) s[nn][2 * h] = r[2 * nn], s[nn][2 * h + 1] = r[2 * nn + 1];
#pragma unroll
                for (int d = 0; d < DT; d++) o[d][2 * h] *= alpha, o[d][2 * h + 1] *= alpha;
            }
            /* O += P V, 16 keys at a time: P's A fragments are S's accumulators */
#pragma unroll
            for (int kc = 0; kc < kKeys / 16; kc++) {
                uint32_t pa[4];
#pragma unroll
                for (int a = 0; a < 4; a++)
                    pa[a] = pack_bf16(s[loom_fa_p_tile(kc, a)][loom_fa_p_elem(a, 0)],
                                      s[loom_fa_p_tile(kc, a)][loom_fa_p_elem(a, 1)]);
                const __nv_bfloat16 *v0 = Vs + (16 * kc + loom_fa_b_k(lane, 0)) * LD + loom_fa_b_n(lane);
                const __nv_bfloat16 *v1 = Vs + (16 * kc + loom_fa_b_k(lane, 1)) * LD + loom_fa_b_n(lane);
#pragma unroll
                for (int d = 0; d < DT; d++)
                    mma_bf16(o[d], pa, pack_raw(v0[8 * d], v0[8 * d + LD]), pack_raw(v1[8 * d], v1[8 * d + LD]));
            }
        }
        __syncthreads(); /* every warp is done with stage buf before tile t + 2 is copied into it */
    }

    /* the quad's partial sums, then the rows out (or their split partials) */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(kFull, l[h], 1);
        l[h] += __shfl_xor_sync(kFull, l[h], 2);
        const int r = 16 * warp + loom_fa_c_row(lane, 2 * h);
        if (r >= QR) continue;
        const int token = i + r / G, head = kvh * G + r % G;
        if (p.n_split == 1) {
            const float f = loom_fa_out_scale(m[h], l[h], p.sinks ? p.sinks + head : nullptr);
            float *orow = p.out + (int64_t)token * p.out_stride + (int64_t)head * HD;
#pragma unroll
            for (int d = 0; d < DT; d++)
                *reinterpret_cast<float2 *>(orow + 8 * d + loom_fa_c_col(lane, 2 * h)) =
                    make_float2(o[d][2 * h] * f, o[d][2 * h + 1] * f);
            if (p.lse && lane % 4 == 0) p.lse[(int64_t)token * p.nh + head] = m[h] + logf(l[h]);
        } else {
            const size_t pi = ((size_t)token * p.nh + head) * p.n_split + split;
            float *prow = p.part + pi * HD;
#pragma unroll
            for (int d = 0; d < DT; d++)
                *reinterpret_cast<float2 *>(prow + 8 * d + loom_fa_c_col(lane, 2 * h)) =
                    make_float2(o[d][2 * h], o[d][2 * h + 1]);
            if (lane % 4 == 0) {
                ml[2 * pi] = m[h];
                ml[2 * pi + 1] = l[h];
            }
        }
    }
}

} /* namespace */

extern "C" cudaError_t loom_cuda_flash_init(size_t max_smem_optin) {
    cudaError_t e = cudaFuncSetAttribute(flash_prefill_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)max_smem_optin);
    cudaError_t e2 = cudaFuncSetAttribute(flash_prefill_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          (int)max_smem_optin);
    return e != cudaSuccess ? e : e2;
}

extern "C" cudaError_t loom_cuda_flash_prefill(const loom_cuda_attn_t *a, const loom_cuda_attn_plan_t *plan,
                                               float *part, cudaStream_t s) {
    const int hd = a->head_dim;
    if (a->kv_kind != LOOM_CUDA_BF16 || !loom_fa_head_dim_ok(hd) || plan->tq * (a->n_heads / a->n_kv_heads) >
        LOOM_FA_ROWS || plan->tq < 2 || (a->v_dim > 0 && a->v_dim != hd) || (a->lse && a->sinks))
        return cudaErrorInvalidValue;
    FParams p;
    p.q = a->q, p.kc = static_cast<const __nv_bfloat16 *>(a->k_cache);
    p.vc = static_cast<const __nv_bfloat16 *>(a->v_cache), p.out = a->out;
    p.tok_seq = a->tok_seq, p.tok_pos = a->tok_pos, p.bt = a->block_tables;
    p.n = a->n, p.nh = a->n_heads, p.nkv = a->n_kv_heads, p.group = a->n_heads / a->n_kv_heads;
    p.q_stride = a->q_stride, p.out_stride = a->out_stride, p.B = a->block_size, p.max_blocks = a->max_blocks;
    p.tq = plan->tq, p.n_split = plan->n_split, p.window = a->window;
    p.scale = a->scale, p.softcap = a->softcap, p.sinks = a->sinks, p.part = part, p.lse = a->lse;
    const dim3 grid((unsigned)a->n, (unsigned)a->n_kv_heads, (unsigned)plan->n_split);
    const size_t smem = loom_fa_smem_bytes(hd);
    if (hd == 64)
        flash_prefill_kernel<64><<<grid, kThreads, smem, s>>>(p);
    else
        flash_prefill_kernel<128><<<grid, kThreads, smem, s>>>(p);
    return cudaGetLastError();
}

/* The FlashAttention-2-style prefill kernel on the paged bf16 cache
 * (kernels/cuda/flash.cu): its tile shape, schedule and index math, the
 * m16n8k16 fragment layouts it relies on, and the per-tile online softmax
 * update every lane runs on its registers. Every helper is
 * __host__ __device__ under nvcc and static inline C elsewhere (opmath.h's
 * LOOM_OM), so tests/unit/test_cuda_math.c replays the kernel's arithmetic,
 * lane by lane, against float64 without a GPU. */
#ifndef LOOM_CUDA_FLASH_H
#define LOOM_CUDA_FLASH_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda/opmath.h"

/* A CTA: LOOM_FA_WARPS warps of 16 query rows each (rows are (token, query
 * head) pairs of one KV head, as the tile kernel's), against tiles of
 * LOOM_FA_KEYS keys, double-buffered in shared memory. */
#define LOOM_FA_WARPS 4
#define LOOM_FA_ROWS (16 * LOOM_FA_WARPS)
#define LOOM_FA_KEYS 64
#define LOOM_FA_PAD 8 /* bf16 elements after each staged row: rows start 16 bytes apart in the banks */

/* The tuning table's attn_prefill_variant: which kernel takes the prefill
 * chunks (units of more than one row). */
enum { LOOM_FA_VARIANT_TILE = 0, LOOM_FA_VARIANT_FA2 = 1, LOOM_FA_VARIANTS = 2 };

/* Head sizes the kernel is built for (its registers hold a warp's 16 rows
 * of Q and of the output: 256 would spill). */
LOOM_OM int loom_fa_head_dim_ok(int hd) {
    return hd == 64 || hd == 128;
}

/* Staged row length in bf16 elements, and the dynamic shared memory: two
 * stages of a K tile and a V tile. */
LOOM_OM int loom_fa_ld(int hd) {
    return hd + LOOM_FA_PAD;
}
LOOM_OM size_t loom_fa_smem_bytes(int hd) {
    return (size_t)2 * 2 * LOOM_FA_KEYS * (size_t)loom_fa_ld(hd) * 2;
}

/* --- the m16n8k16 bf16 fragments (PTX ISA, "Matrix fragments for mma.m16n8k16
 * with floating point type"): lane = 4 * g + t ---------------------------------------- */

/* Accumulator (16 x 8, f32) element c in 0..3 of a lane: row g + 8 (c / 2),
 * column 2 t + c % 2. */
LOOM_OM int loom_fa_c_row(int lane, int c) {
    return lane / 4 + 8 * (c / 2);
}
LOOM_OM int loom_fa_c_col(int lane, int c) {
    return 2 * (lane % 4) + c % 2;
}
/* A (16 x 16, row major) register a in 0..3 holds the pair of columns
 * (col, col + 1) of one row; the lower half holds the lower column. */
LOOM_OM int loom_fa_a_row(int lane, int a) {
    return lane / 4 + 8 * (a % 2);
}
LOOM_OM int loom_fa_a_col(int lane, int a) {
    return 2 * (lane % 4) + 8 * (a / 2);
}
/* B (16 x 8, "col": k fastest) register b in 0..1 holds the pair of k rows
 * (k, k + 1) of column n. */
LOOM_OM int loom_fa_b_k(int lane, int b) {
    return 2 * (lane % 4) + 8 * b;
}
LOOM_OM int loom_fa_b_n(int lane) {
    return lane / 4;
}

/* P = exp(S - max), rounded to bf16, is O += P V's A operand: element e (0:
 * the low half) of A register a for the keys [16 kc, 16 kc + 16) is the
 * accumulator element loom_fa_p_elem(a, e) of S's n-tile loom_fa_p_tile(kc,
 * a), in the same lane (the two layouts agree, so P never leaves the
 * registers). */
LOOM_OM int loom_fa_p_tile(int kc, int a) {
    return 2 * kc + a / 2;
}
LOOM_OM int loom_fa_p_elem(int a, int e) {
    return 2 * (a % 2) + e;
}

/* --- schedule ------------------------------------------------------------------------ */

/* The key range [*k0, *k1) of split s for a unit whose rows sit at
 * positions pos_min..pos_max: from the lowest row's window start to the
 * highest row, cut as the other kernels cut it (opmath.h). */
LOOM_OM void loom_fa_unit_range(int pos_min, int pos_max, int window, int n_split, int s, int *k0, int *k1) {
    loom_om_split_range(loom_om_window_lo(pos_min, window), pos_max + 1, n_split, s, k0, k1);
}

/* K/V tiles over [k0, k1). */
LOOM_OM int loom_fa_n_tiles(int k0, int k1) {
    return k1 > k0 ? (k1 - k0 + LOOM_FA_KEYS - 1) / LOOM_FA_KEYS : 0;
}

/* The cache slot (block * B + offset) row j of tile `tile` reads: key
 * k0 + tile * LOOM_FA_KEYS + j through the sequence's block table bt; -1
 * past k1 or where the table has no block (the row is staged as zeros and
 * its scores masked). */
LOOM_OM int loom_fa_tile_slot(const int32_t *bt, int B, int k0, int k1, int tile, int j) {
    const int key = k0 + tile * LOOM_FA_KEYS + j;
    if (key >= k1) return -1;
    const int blk = bt[key / B];
    return blk < 0 ? -1 : blk * B + key % B;
}

/* The 16-byte chunk c (8 bf16) of a staged tile: row c / (hd / 8), first
 * element 8 * (c % (hd / 8)); a tile has LOOM_FA_KEYS * hd / 8 of them,
 * dealt round-robin to the CTA's threads. */
LOOM_OM void loom_fa_chunk(int c, int hd, int *row, int *col) {
    *row = c / (hd / 8);
    *col = 8 * (c % (hd / 8));
}

/* Whether a warp whose rows see keys [lo_min, pos_max] has anything to do
 * in the tile of keys [kb, kb + LOOM_FA_KEYS): tiles wholly above every
 * row (causal) or wholly below every window are skipped. */
LOOM_OM int loom_fa_tile_live(int kb, int lo_min, int pos_max) {
    return kb <= pos_max && kb + LOOM_FA_KEYS > lo_min;
}

/* --- scores and the online softmax ------------------------------------------------ */

/* A scaled score of the query at `pos` (window start lo) against `key` in
 * cache slot `slot`: soft-capped, or -inf where the key is masked. */
LOOM_OM float loom_fa_score(float s, int key, int slot, int lo, int pos, float cap) {
    return slot >= 0 && key >= lo && key <= pos ? loom_om_softcap(s, cap) : -INFINITY;
}

LOOM_OM float loom_fa_max(const float *s, int n) {
    float m = -INFINITY;
    for (int j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* One tile's update of one row's state as one lane holds it: the lane's n
 * scores s[] of the row (masked: -inf) become probabilities exp(s - max),
 * the running max *m moves to max(*m, row_max) where row_max is the row's
 * maximum over the tile (every lane of the row's quad reduced), and the
 * lane's partial sum *l (of its own columns; the quad's sums are added at
 * the end) is rescaled and grows. Returns the factor the lane's
 * accumulators of that row are multiplied by. */
LOOM_OM float loom_fa_row_update(float *m, float *l, float *s, int n, float row_max) {
    const float mn = *m > row_max ? *m : row_max;
    const float alpha = loom_om_rescale(*m, mn);
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        s[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - mn);
        sum += s[j];
    }
    *l = *l * alpha + sum;
    *m = mn;
    return alpha;
}

/* The factor a finished row's accumulator is multiplied by: 1 / sum, the
 * head's sink (NULL: none) folded in as the other kernels fold it; 0 for a
 * row that saw no key. */
LOOM_OM float loom_fa_out_scale(float m, float l, const float *sink) {
    const float f = sink ? loom_om_sink_fold(&m, &l, *sink) : 1.0f;
    return l > 0.0f ? f / l : 0.0f;
}

#ifdef __CUDACC__
#include <cuda_runtime.h>
struct loom_cuda_attn;
struct loom_cuda_attn_plan;
/* Raises the kernel's dynamic shared memory limit (loom_cuda_attention_init). */
extern "C" cudaError_t loom_cuda_flash_init(size_t max_smem_optin);
/* Runs the units of more than one row of a bf16 cache in place of the tile
 * kernel (attention.cu's launch_all; plan->fa2 set by the plan): the same
 * grid (n, n_kv_heads, n_split), the same units and split partials. */
extern "C" cudaError_t loom_cuda_flash_prefill(const struct loom_cuda_attn *a, const struct loom_cuda_attn_plan *plan,
                                               float *part, cudaStream_t s);
#endif

#endif

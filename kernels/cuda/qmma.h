/* Index math and tile decoding of qmma.cu, the small-n tensor-core kernel
 * for quantized weights: every function is __host__ __device__ under nvcc
 * and static inline C elsewhere, so tests/unit/test_cuda_math.c replays the
 * kernel's tiles, fragments and split-K ranges on the CPU against float64
 * (as qformat.h and opmath.h do for the other kernels).
 *
 * The kernel computes y(n, rows) = x(n, cols) . W^T for 1 <= n <=
 * LOOM_QM_MAX_N with mma.sync.m16n8k16 (bf16 in, f32 accumulate): a block
 * owns LOOM_QM_BM rows of W (4 warps x 16) and one split of the k range;
 * per step of LOOM_QM_BK columns it decodes the step's codes into a bf16
 * tile in shared memory and narrows the matching columns of x to bf16 next
 * to it, then each warp runs BK / 16 x NT / 8 mma on its 16 rows. */
#ifndef LOOM_CUDA_QMMA_H
#define LOOM_CUDA_QMMA_H

#include <stdint.h>

#include "kernels/cuda/qformat.h"

#ifdef __CUDACC__
#define LOOM_QM static __host__ __device__ __forceinline__
#else
#define LOOM_QM static inline
#endif

#define LOOM_QM_BM      64  /* rows of W per block: 4 warps of 16 */
#define LOOM_QM_BK      64  /* columns per k step */
#define LOOM_QM_THREADS 128
#define LOOM_QM_MAX_N   64  /* most tokens a call takes */
#define LOOM_QM_PAD     8   /* bf16 of padding per shared-memory row (bank spread) */
#define LOOM_QM_MAX_SPLIT 16

/* Tokens a launch is compiled for: n rounded up to 8, 16, 32 or 64. */
LOOM_QM int loom_qm_nt(int n) {
    return n <= 8 ? 8 : n <= 16 ? 16 : n <= 32 ? 32 : 64;
}

/* The mma.m16n8k16 fragments (PTX ISA, "Matrix Fragments for
 * mma.m16n8k16" with .bf16): lane = 4 * g + t. A (16 x 16, row-major):
 * element i (0..7) of a lane; B (16 x 8, column-major): element i (0..3);
 * C (16 x 8): element i (0..3). Pairs (i, i + 1), i even, are adjacent
 * columns (A) or k (B) and travel in one 32-bit register. */
LOOM_QM void loom_qm_a_rc(int lane, int i, int *r, int *c) {
    const int g = lane >> 2, t = lane & 3;
    *r = g + 8 * ((i >> 1) & 1);
    *c = 2 * t + (i & 1) + 8 * (i >> 2);
}
LOOM_QM void loom_qm_b_kn(int lane, int i, int *k, int *n) {
    const int g = lane >> 2, t = lane & 3;
    *k = 2 * t + (i & 1) + 8 * (i >> 1);
    *n = g;
}
LOOM_QM void loom_qm_c_rn(int lane, int i, int *r, int *n) {
    const int g = lane >> 2, t = lane & 3;
    *r = g + 8 * (i >> 1);
    *n = 2 * t + (i & 1);
}

/* k splits of a call: enough blocks for two waves of n_sms (row blocks x
 * splits), at most LOOM_QM_MAX_SPLIT and at most one split per 4 k steps
 * (each split's partial sums cost a write and a read of n x rows floats). */
LOOM_QM int loom_qm_ksplit(int64_t rows, int64_t cols, int n_sms) {
    const int64_t row_blocks = (rows + LOOM_QM_BM - 1) / LOOM_QM_BM;
    const int64_t ksteps = (cols + LOOM_QM_BK - 1) / LOOM_QM_BK;
    int64_t s = (2 * (int64_t)n_sms + row_blocks - 1) / row_blocks;
    if (s > ksteps / 4) s = ksteps / 4;
    if (s > LOOM_QM_MAX_SPLIT) s = LOOM_QM_MAX_SPLIT;
    return s < 1 ? 1 : (int)s;
}

/* The k steps [*k0, *k1) of split s of ksplit: equal runs, the last ones
 * possibly shorter or empty. */
LOOM_QM void loom_qm_split_range(int64_t ksteps, int ksplit, int s, int64_t *k0, int64_t *k1) {
    const int64_t chunk = (ksteps + ksplit - 1) / ksplit;
    *k0 = s * chunk < ksteps ? s * chunk : ksteps;
    *k1 = *k0 + chunk < ksteps ? *k0 + chunk : ksteps;
}

/* Loads of codes per k step: 16 bytes each, 16 8-bit codes or 32 4-bit
 * codes; load i of a step covers tile row i / per_row, columns from
 * (i % per_row) * width. */
LOOM_QM int loom_qm_width(int quant) {
    return quant == LOOM_QD_Q4 ? 32 : 16;
}
LOOM_QM int loom_qm_loads(int quant) {
    return LOOM_QM_BM * (LOOM_QM_BK / loom_qm_width(quant));
}
LOOM_QM void loom_qm_load_rc(int quant, int i, int *r, int *c) {
    const int w = loom_qm_width(quant), per_row = LOOM_QM_BK / w;
    *r = i / per_row;
    *c = (i % per_row) * w;
}

/* float -> bf16 bits, round to nearest even (finite values). */
LOOM_QM uint32_t loom_qm_bf16(float f) {
    uint32_t u;
#ifdef __CUDA_ARCH__
    u = __float_as_uint(f);
#else
    memcpy(&u, &f, sizeof u);
#endif
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* Two bf16 (bits) in one word, the first in the low half. */
LOOM_QM uint32_t loom_qm_pack(uint32_t lo, uint32_t hi) {
    return lo | hi << 16;
}

/* One word of a 16-byte load decoded into the bf16 the tile holds: INT8
 * and e4m3 codes as they are (exact in bf16: 8 and 4 significant bits),
 * their row scale applied to the f32 sums; 4-bit codes as scale * (code -
 * 8), or scale * code + min, rounded once to bf16 (the values today's
 * dequantize-then-cuBLAS path multiplies). out gets 2 words (8-bit) or 4
 * (4-bit). */
LOOM_QM void loom_qm_decode_word(int quant, int with_min, uint32_t u, float s, float m, uint32_t *out) {
    float f[8];
    if (quant == LOOM_QD_Q4) {
        loom_qd_q4x8(u, with_min ? 0.0f : 8.0f, f);
        for (int k = 0; k < 8; k++) f[k] = with_min ? loom_qd_affine(s, f[k], m) : s * f[k];
        for (int k = 0; k < 4; k++) out[k] = loom_qm_pack(loom_qm_bf16(f[2 * k]), loom_qm_bf16(f[2 * k + 1]));
        return;
    }
    if (quant == LOOM_QD_INT8)
        loom_qd_int8x4(u, f);
    else
        loom_qd_fp8x4(u, f);
    for (int k = 0; k < 2; k++) out[k] = loom_qm_pack(loom_qm_bf16(f[2 * k]), loom_qm_bf16(f[2 * k + 1]));
}

#endif

/* CPU kernels for quantized weights (kernels/quant.h schemes): the decode
 * matmul y(n, rows) = x(n, cols) · Wᵀ with the activations rounded to int8
 * per 32 columns and integer dot products, and the rows dequantized to f32
 * for sgemm at prefill sizes. See docs/kernels-cpu.md for the measurements.
 *
 * The CPU backend repacks the canonical layout once, at upload, into the
 * layout both the decode GEMV and the prefill GEMM stream (loom_weight_t;
 * one copy, so memory does not double):
 *   INT8 and Q4 data: rows in panels of 8 (rows [8p, 8p + 8) for p <
 *         rows / 8); the rows past the last whole panel keep the row layout
 *         below, at their usual offset r · row_bytes. A panel is 8 ·
 *         row_bytes bytes at 8p · row_bytes: for each 32-column block k,
 *         W4 = 4 (Q4) or 8 (INT8) vectors of 32 bytes, where byte 4a + j of
 *         vector t is byte 4t + j of row a's block in the row layout (a
 *         4-byte transpose); then (INT8) the cols % 32 float-path columns
 *         of its 8 rows, row after row. One broadcast 4-byte word of x then
 *         feeds 8 rows in one vpmaddubsw / vpdpbusd, one lane per row.
 *   Row layout: INT8 byte = q + 128 (unsigned, as VNNI's vpdpbusd wants
 *         its first operand); Q4: in every 32-column block of a row (16
 *         bytes) byte j holds column j in its low nibble and column j + 16
 *         in its high nibble, so one shift and one mask give 32 codes in
 *         column order.
 *   Q4 scales (and mins): float, the canonical (rows, cols/group) for the
 *         rows past the panels; within panel p, group g of its 8 rows is 8
 *         floats at (p · ng + g) · 8 (one vector, lane a = row a).
 *   INT8 and FP8 scales: float (rows), as canonical.
 *   FP8   data: e4m3 bytes (rows, cols) unchanged.
 * The byte count (loom_weight_bytes) is the canonical one. */
#ifndef LOOM_CPU_QGEMV_H
#define LOOM_CPU_QGEMV_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "kernels/quant.h"

#define LOOM_QBLOCK 32 /* activation columns per int8 scale */

/* Instruction sets the kernels are built for, picked at run time. */
typedef enum loom_cpu_isa {
    LOOM_CPU_ISA_SCALAR = 0, /* the plain C reference */
    LOOM_CPU_ISA_AVX2,       /* AVX2 + FMA + F16C: vpmaddubsw / vpmaddwd */
    LOOM_CPU_ISA_VNNI,       /* AVX-512 VNNI + VL + BW on ymm: vpdpbusd */
    LOOM_CPU_ISA_AVXVNNI,    /* AVX2 + AVX-VNNI (VEX vpdpbusd), 16 registers:
                              * the AVX2 tile shapes with VNNI's dots */
} loom_cpu_isa_t;
#define LOOM_CPU_ISA_COUNT 4

/* The best instruction set this CPU has (cpuid): VNNI, else AVX-VNNI, else
 * AVX2, else the scalar reference. */
loom_cpu_isa_t loom_cpu_isa_detect(void);
/* Whether this CPU can run isa (the scalar reference always). */
int loom_cpu_isa_supported(loom_cpu_isa_t isa);
const char *loom_cpu_isa_name(loom_cpu_isa_t isa);
/* loom_cpu_isa_detect, or the path LOOM_CPU_ISA names (avx2, avxvnni,
 * avx512, generic) when this CPU has it (else a warning and the detected one):
 * tests and benchmarks force each path with it. */
loom_cpu_isa_t loom_cpu_isa_select(void);

/* Rows of x rounded to int8 per block of 32 columns: q = round(x / d) with
 * d = max|x| / 127 of the block. Columns past the last whole block (cols %
 * 32) stay in float and are read from x. */
typedef struct loom_cpu_qx {
    const float *x; /* (n, cols) the float rows */
    int8_t *q;      /* (n, nb * 32) */
    float *d;       /* (n, nb) block scales */
    float *s;       /* (n, ng) per weight group: sum over its blocks of d · sum(q) */
    int n, nb, ng;  /* rows, whole blocks, weight groups (Q4: cols/group; else 1) */
    int64_t cols;
} loom_cpu_qx_t;

/* Scratch bytes loom_cpu_qx_init needs for n rows of cols. */
size_t loom_cpu_qx_bytes(int n, int64_t cols);
/* Lays qx out in `scratch` (loom_cpu_qx_bytes(n, cols), 64-byte aligned)
 * for x and weight w; no rows are quantized yet. */
void loom_cpu_qx_init(loom_cpu_qx_t *qx, void *scratch, const float *x, int n,
                      const loom_weight_t *w);
/* Quantizes rows [i0, i1) of qx->x (callers split the rows across threads). */
void loom_cpu_qx_quantize(loom_cpu_qx_t *qx, int i0, int i1);

/* Writes rows [r0, r1) of the canonical t into w's data, scales and mins
 * in the layout above (w: t's rows, cols, quant and group, buffers of
 * loom_qtensor_code_bytes and scale count; any row range, so threads may
 * split the rows). */
void loom_cpu_q_repack(loom_weight_t *w, const loom_qtensor_t *t, int64_t r0, int64_t r1);

/* y[i*ldy + r] = sum_k x[i, k] · W[r, k] for i in [0, qx->n), r in [r0,
 * r1), on a repacked quantized w. INT8 and Q4 use qx's int8 rows; FP8 reads
 * the float rows. An isa this CPU lacks is a programmer error. */
void loom_cpu_qgemv(loom_cpu_isa_t isa, float *y, int64_t ldy, const loom_cpu_qx_t *qx,
                    const loom_weight_t *w, int64_t r0, int64_t r1);

/* The same product as loom_cpu_qgemv for many rows of x (prefill, batched
 * decode): each 8-row panel against every row of x, a run of 16 blocks (2
 * or 4 KB, in L1) at a time, so one broadcast of x feeds 8 rows and a
 * block's float work is one vector for 8 rows. loom_cpu_qgemv is the same
 * kernel on the same stored panels; rows past the last whole panel go
 * through the 4-row tiles of qgemv_tiles.h, rows of a panel cut by r0 or
 * r1 (never in the backend's splits, which keep whole panels) and the
 * scalar isa through the reference, FP8 through its float tiles. Sums in another order than the
 * scalar reference: equal up to float rounding. */
void loom_cpu_qgemm(loom_cpu_isa_t isa, float *y, int64_t ldy, const loom_cpu_qx_t *qx,
                    const loom_weight_t *w, int64_t r0, int64_t r1);

/* dst[(r - r0) * cols + k] = W[r, k] in f32 for r in [r0, r1) (sgemm). */
void loom_cpu_q_dequant_rows(loom_cpu_isa_t isa, float *dst, const loom_weight_t *w, int64_t r0,
                             int64_t r1);

#endif

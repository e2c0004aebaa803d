/* CPU matrix-vector kernels for the decode matmul: y(n, rows) = x(n, cols) · Wᵀ
 * for a few rows of x, with W (rows, cols) row-major in f32, bf16 or f16.
 * Each call covers a range of W's rows, so callers split the rows across
 * threads; every W row is read from memory once for all n rows of x. */
#ifndef LOOM_CPU_GEMV_H
#define LOOM_CPU_GEMV_H

#include <stdint.h>

#include "common/dtype.h"

/* y[i*ldy + r] = sum_k x[i*cols + k] * W[r, k] for i in [0, n), r in [r0, r1).
 * w is the whole matrix; dt is F32, BF16 or F16. */
void loom_cpu_gemv(float *y, int64_t ldy, const float *x, int n, const void *w, loom_dtype_t dt,
                   int64_t cols, int64_t r0, int64_t r1);

/* The plain scalar loop, the reference the SIMD path is tested against. */
void loom_cpu_gemv_ref(float *y, int64_t ldy, const float *x, int n, const void *w, loom_dtype_t dt,
                       int64_t cols, int64_t r0, int64_t r1);

/* dst[(r - r0) * cols + k] = float(W[r, k]) for r in [r0, r1): a block of
 * rows widened to f32 (for sgemm on half-precision weights). */
void loom_cpu_widen_rows(float *dst, const void *w, loom_dtype_t dt, int64_t cols, int64_t r0,
                         int64_t r1);

/* Narrows n floats to bf16 (round to nearest even) or f16. */
void loom_cpu_narrow(void *dst, loom_dtype_t dt, const float *src, int64_t n);

#endif

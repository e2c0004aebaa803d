/* What the CPU backend exposes beyond the vtable, for its own tests and
 * benchmarks: the matmul with its algorithm chosen by the caller. */
#ifndef LOOM_BACKEND_CPU_H
#define LOOM_BACKEND_CPU_H

#include "kernels/backend.h"

typedef enum {
    LOOM_CPU_MM_AUTO = 0, /* GEMV up to loom_cpu_gemv_max_n() rows of x, sgemm above */
    LOOM_CPU_MM_GEMV,     /* the hand-written GEMV kernel for any n (quantized: qgemv.c) */
    LOOM_CPU_MM_SGEMM,    /* OpenBLAS sgemm (bf16/f16 weights widened, quantized
                           * ones dequantized, per block) */
    LOOM_CPU_MM_IGEMM,    /* quantized weights: the integer GEMM of qgemv.c
                           * (loom_cpu_qgemm); as SGEMM for float weights */
} loom_cpu_mm_path_t;

/* loom_op_matmul on a CPU backend with the path forced. */
void loom_cpu_matmul_path(loom_backend_t *be, float *y, const float *x, const loom_weight_t *w,
                          int n, loom_cpu_mm_path_t path);
/* The largest n the automatic choice serves with the GEMV kernel for
 * weights stored as dt. */
int loom_cpu_gemv_max_n(loom_dtype_t dt);
/* The same for quantized weights of scheme q (the kernels of qgemv.c, then
 * dequantized blocks for sgemm). */
int loom_cpu_qgemv_max_n(loom_quant_t q);

/* OpenBLAS picks its kernels by CPU model when it loads, and a build that
 * predates the CPU falls back to its SSE3 "Prescott" kernels: sgemm (all of
 * prefill) runs 3-5x slower. When that happened on a CPU with AVX2 or
 * AVX-512 and OPENBLAS_CORETYPE is unset, this sets OPENBLAS_CORETYPE to the
 * matching family (SkylakeX, Haswell) and re-executes the
 * program with the same arguments; it returns when there is nothing to do
 * or the exec fails. Call it first thing in main. */
void loom_cpu_blas_check(char **argv);
/* The OpenBLAS core in use and, after loom_cpu_blas_check re-executed the
 * program, the one OpenBLAS had picked (else NULL). */
const char *loom_cpu_blas_core(const char **replaced);

#endif

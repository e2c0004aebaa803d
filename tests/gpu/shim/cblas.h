/* A stand-in for <cblas.h> in the standalone GPU test build (tests/gpu/
 * CMakeLists.txt), which must build with the CUDA toolkit alone: the three
 * declarations the CPU backend uses, served by a plain C sgemm in
 * cblas_shim.c. There the CPU backend is only the reference, so speed does
 * not matter; the regular build links OpenBLAS. */
#ifndef LOOM_TEST_CBLAS_SHIM_H
#define LOOM_TEST_CBLAS_SHIM_H

typedef enum { CblasRowMajor = 101, CblasColMajor = 102 } CBLAS_ORDER;
typedef enum { CblasNoTrans = 111, CblasTrans = 112, CblasConjTrans = 113 } CBLAS_TRANSPOSE;

/* C(m, n) = alpha * op(A)(m, k) . op(B)(k, n) + beta * C */
void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k,
                 float alpha, const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc);
void openblas_set_num_threads(int n);
char *openblas_get_corename(void);

#endif

/* Plain C sgemm for the standalone GPU test build (see cblas.h here). Row-
 * and column-major, any transposes; accumulates in double so the reference
 * is, if anything, more exact than OpenBLAS. */
#include "cblas.h"

#include <stddef.h>

void openblas_set_num_threads(int n) {
    (void)n;
}

char *openblas_get_corename(void) {
    static char name[] = "shim";
    return name;
}

/* Element (i, j) of op(X) for a row-major X with leading dimension ld. */
static float at(const float *x, int ld, int trans, int i, int j) {
    return trans ? x[(size_t)j * ld + i] : x[(size_t)i * ld + j];
}

void cblas_sgemm(CBLAS_ORDER order, CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int m, int n, int k,
                 float alpha, const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    if (order == CblasColMajor) { /* C^T = op(B)^T op(A)^T in row-major terms */
        cblas_sgemm(CblasRowMajor, trans_b, trans_a, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
        return;
    }
    const int ta = trans_a != CblasNoTrans, tb = trans_b != CblasNoTrans;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0.0;
            if (!ta && tb) { /* the CPU backend's case: both rows contiguous */
                const float *ar = a + (size_t)i * lda, *br = b + (size_t)j * ldb;
                for (int p = 0; p < k; p++) s += (double)ar[p] * br[p];
            } else {
                for (int p = 0; p < k; p++) s += (double)at(a, lda, ta, i, p) * at(b, ldb, tb, p, j);
            }
            float *cij = c + (size_t)i * ldc + j;
            *cij = (float)(alpha * s) + (beta != 0.0f ? beta * *cij : 0.0f);
        }
}

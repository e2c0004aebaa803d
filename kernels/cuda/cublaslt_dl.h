/* cuBLASLt, loaded at run time as cublas_dl.h loads cuBLAS: the FP8 GEMM
 * of quantized prefill (backend_cuda.c) needs cublasLtMatmul, which plain
 * cuBLAS does not offer. A process without the library (or with one that
 * lacks a symbol) keeps today's paths; the backend logs that once. */
#ifndef LOOM_KERNELS_CUDA_CUBLASLT_DL_H
#define LOOM_KERNELS_CUDA_CUBLASLT_DL_H

#include <cublasLt.h>

#include "common/status.h"

typedef struct loom_cublaslt_api {
    size_t version; /* cublasLtGetVersion(): 10000 * major + 100 * minor + patch */
    cublasStatus_t (*create)(cublasLtHandle_t *handle);
    cublasStatus_t (*destroy)(cublasLtHandle_t handle);
    cublasStatus_t (*desc_create)(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute, cudaDataType_t scale);
    cublasStatus_t (*desc_destroy)(cublasLtMatmulDesc_t desc);
    cublasStatus_t (*desc_set)(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void *buf,
                               size_t size);
    cublasStatus_t (*layout_create)(cublasLtMatrixLayout_t *layout, cudaDataType type, uint64_t rows, uint64_t cols,
                                    int64_t ld);
    cublasStatus_t (*layout_destroy)(cublasLtMatrixLayout_t layout);
    cublasStatus_t (*pref_create)(cublasLtMatmulPreference_t *pref);
    cublasStatus_t (*pref_destroy)(cublasLtMatmulPreference_t pref);
    cublasStatus_t (*pref_set)(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                               const void *buf, size_t size);
    cublasStatus_t (*heuristic)(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                                cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                cublasLtMatmulPreference_t pref, int requested,
                                cublasLtMatmulHeuristicResult_t *results, int *returned);
    cublasStatus_t (*matmul)(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void *alpha, const void *a,
                             cublasLtMatrixLayout_t adesc, const void *b, cublasLtMatrixLayout_t bdesc,
                             const void *beta, const void *c, cublasLtMatrixLayout_t cdesc, void *d,
                             cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t *algo, void *workspace,
                             size_t workspace_bytes, cudaStream_t stream);
} loom_cublaslt_api_t;

/* Loads the API once per process (libcublasLt.so.13, else .12, from the
 * loader's path or beside libcudart); on failure *out is NULL and err says
 * why (LOOM_ERR_UNAVAILABLE). */
loom_status_t loom_cublaslt_load(const loom_cublaslt_api_t **out, loom_err_t *err);

#endif

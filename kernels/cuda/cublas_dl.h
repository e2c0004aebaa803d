/* cuBLAS, loaded when the first CUDA backend is created rather than linked.
 *
 * Linking libcublas makes every process pay for its static initializers
 * (about 0.4 s and 220 MB of resident memory at start-up, measured on the
 * CPU-only build machine) even when it never touches a GPU: `loom health`,
 * a CPU worker, every test. The few entry points the backend calls are
 * resolved here with dlopen(3) instead, once, under a lock. */
#ifndef LOOM_KERNELS_CUDA_CUBLAS_DL_H
#define LOOM_KERNELS_CUDA_CUBLAS_DL_H

#include <cublas_v2.h>

#include "common/status.h"

typedef struct loom_cublas_api {
    cublasStatus_t (*create)(cublasHandle_t *handle);
    cublasStatus_t (*destroy)(cublasHandle_t handle);
    cublasStatus_t (*set_stream)(cublasHandle_t handle, cudaStream_t stream);
    cublasStatus_t (*set_workspace)(cublasHandle_t handle, void *ws, size_t bytes);
    cublasStatus_t (*gemm_ex)(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                              int m, int n, int k, const void *alpha, const void *a, cudaDataType atype,
                              int lda, const void *b, cudaDataType btype, int ldb, const void *beta,
                              void *c, cudaDataType ctype, int ldc, cublasComputeType_t compute,
                              cublasGemmAlgo_t algo);
    const char *(*status_string)(cublasStatus_t status);
} loom_cublas_api_t;

/* Loads the API once per process (later calls return the same table); on
 * failure *out is NULL and err names the library and dlerror()'s reason. */
loom_status_t loom_cublas_load(const loom_cublas_api_t **out, loom_err_t *err);

/* The status as text (also when the library could not be loaded). */
const char *loom_cublas_status_str(cublasStatus_t status);

/* dlopen(3)s a CUDA library by soname from the loader's search path, else
 * beside the libcudart this process runs with (the toolkit's lib
 * directory, also when only libcudart's directory is on the runpath); NULL
 * with dlerror()'s reason in why. Shared by the cuBLAS and cuBLASLt loaders. */
void *loom_cuda_dlopen(const char *soname, char *why, size_t why_cap);

#endif

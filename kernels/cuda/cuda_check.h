/* The one CUDA_CHECK, for C files that call the CUDA runtime (the CUDA
 * backend, the NCCL data plane): CUDA_CHECK(err, call) in a function that
 * returns loom_status_t returns CUDA_ON_ERROR(err, "call", error, file,
 * line) when the call fails. The default handler maps the error onto a
 * status (out of memory, no device / driver: unavailable, else internal),
 * logs the call site and fills err; a file that must do more (the NCCL data
 * plane aborts its communicators) defines CUDA_ON_ERROR before including
 * this header. */
#ifndef LOOM_CUDA_CHECK_H
#define LOOM_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#include "common/log.h"
#include "common/status.h"

static inline loom_status_t loom_cuda_status(loom_err_t *err, const char *what, cudaError_t e, const char *file,
                                             int line) {
    loom_status_t code = e == cudaErrorMemoryAllocation ? LOOM_ERR_NOMEM
                         : e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver
                             ? LOOM_ERR_UNAVAILABLE
                             : LOOM_ERR_INTERNAL;
    (void)cudaGetLastError(); /* clear a non-sticky error */
    LOOM_ERROR("cuda: %s failed at %s:%d: %s", what, file, line, cudaGetErrorString(e));
    return loom_err_set(err, code, "cuda: %s failed: %s", what, cudaGetErrorString(e));
}

#ifndef CUDA_ON_ERROR
#define CUDA_ON_ERROR(err, what, e, file, line) loom_cuda_status((err), (what), (e), (file), (line))
#endif

#define CUDA_CHECK(err, call)                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return CUDA_ON_ERROR((err), #call, e_, __FILE__, __LINE__);         \
    } while (0)

#endif

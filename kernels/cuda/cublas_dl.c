/* cuBLAS through dlopen: see cublas_dl.h. */
#include "kernels/cuda/cublas_dl.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define STR_(x) #x
#define STR(x)  STR_(x)
#define CUBLAS_SONAME "libcublas.so." STR(CUBLAS_VER_MAJOR)

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static loom_cublas_api_t g_api;
static int g_loaded;          /* 1 loaded, -1 failed */
static char g_why[512];       /* why the load failed */

void *loom_cuda_dlopen(const char *soname, char *why, size_t why_cap) {
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    snprintf(why, why_cap, "%s", dlerror());
    Dl_info info;
    if (dladdr((void *)cudaGetDeviceCount, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash) {
            char path[1024];
            snprintf(path, sizeof path, "%.*s/%s", (int)(slash - info.dli_fname), info.dli_fname, soname);
            if ((h = dlopen(path, RTLD_NOW | RTLD_LOCAL))) return h;
        }
    }
    return NULL;
}

static int resolve(void *h, void **slot, const char *name) {
    *slot = dlsym(h, name);
    if (*slot) return 1;
    snprintf(g_why, sizeof g_why, "%s has no symbol %s", CUBLAS_SONAME, name);
    return 0;
}

loom_status_t loom_cublas_load(const loom_cublas_api_t **out, loom_err_t *err) {
    pthread_mutex_lock(&g_lock);
    if (!g_loaded) {
        void *h = loom_cuda_dlopen(CUBLAS_SONAME, g_why, sizeof g_why);
        loom_cublas_api_t a;
        int ok = h != NULL;
        ok = ok && resolve(h, (void **)&a.create, "cublasCreate_v2");
        ok = ok && resolve(h, (void **)&a.destroy, "cublasDestroy_v2");
        ok = ok && resolve(h, (void **)&a.set_stream, "cublasSetStream_v2");
        ok = ok && resolve(h, (void **)&a.set_workspace, "cublasSetWorkspace_v2");
        ok = ok && resolve(h, (void **)&a.gemm_ex, "cublasGemmEx");
        ok = ok && resolve(h, (void **)&a.status_string, "cublasGetStatusString");
        if (ok) g_api = a;
        else if (h) dlclose(h);
        g_loaded = ok ? 1 : -1;
    }
    int loaded = g_loaded;
    pthread_mutex_unlock(&g_lock);
    *out = loaded > 0 ? &g_api : NULL;
    if (loaded > 0) return LOOM_OK;
    return loom_err_set(err, LOOM_ERR_UNAVAILABLE,
                        "cuBLAS could not be loaded (%s); put the CUDA toolkit's lib directory on "
                        "LD_LIBRARY_PATH",
                        g_why);
}

const char *loom_cublas_status_str(cublasStatus_t status) {
    if (g_loaded > 0) return g_api.status_string(status);
    static char buf[32];
    snprintf(buf, sizeof buf, "cuBLAS status %d", (int)status);
    return buf;
}

/* cuBLASLt through dlopen: see cublaslt_dl.h. */
#include "kernels/cuda/cublaslt_dl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "kernels/cuda/cublas_dl.h"

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static loom_cublaslt_api_t g_api;
static int g_loaded;    /* 1 loaded, -1 failed */
static char g_why[512]; /* why the load failed */

/* The C API used here is the same in cuBLASLt 12 and 13. */
static const char *const k_sonames[] = {"libcublasLt.so.13", "libcublasLt.so.12"};

static int resolve(void *h, void **slot, const char *name) {
    *slot = dlsym(h, name);
    if (*slot) return 1;
    snprintf(g_why, sizeof g_why, "libcublasLt has no symbol %s", name);
    return 0;
}

loom_status_t loom_cublaslt_load(const loom_cublaslt_api_t **out, loom_err_t *err) {
    pthread_mutex_lock(&g_lock);
    if (!g_loaded) {
        void *h = NULL;
        for (size_t i = 0; i < sizeof k_sonames / sizeof k_sonames[0] && !h; i++) h = loom_cuda_dlopen(k_sonames[i], g_why, sizeof g_why);
        loom_cublaslt_api_t a = {0};
        size_t (*version)(void) = NULL;
        int ok = h != NULL;
        ok = ok && resolve(h, (void **)&version, "cublasLtGetVersion");
        ok = ok && resolve(h, (void **)&a.create, "cublasLtCreate");
        ok = ok && resolve(h, (void **)&a.destroy, "cublasLtDestroy");
        ok = ok && resolve(h, (void **)&a.desc_create, "cublasLtMatmulDescCreate");
        ok = ok && resolve(h, (void **)&a.desc_destroy, "cublasLtMatmulDescDestroy");
        ok = ok && resolve(h, (void **)&a.desc_set, "cublasLtMatmulDescSetAttribute");
        ok = ok && resolve(h, (void **)&a.layout_create, "cublasLtMatrixLayoutCreate");
        ok = ok && resolve(h, (void **)&a.layout_destroy, "cublasLtMatrixLayoutDestroy");
        ok = ok && resolve(h, (void **)&a.pref_create, "cublasLtMatmulPreferenceCreate");
        ok = ok && resolve(h, (void **)&a.pref_destroy, "cublasLtMatmulPreferenceDestroy");
        ok = ok && resolve(h, (void **)&a.pref_set, "cublasLtMatmulPreferenceSetAttribute");
        ok = ok && resolve(h, (void **)&a.heuristic, "cublasLtMatmulAlgoGetHeuristic");
        ok = ok && resolve(h, (void **)&a.matmul, "cublasLtMatmul");
        if (ok) {
            a.version = version();
            g_api = a;
        } else if (h) {
            dlclose(h);
        }
        g_loaded = ok ? 1 : -1;
    }
    int loaded = g_loaded;
    pthread_mutex_unlock(&g_lock);
    *out = loaded > 0 ? &g_api : NULL;
    if (loaded > 0) return LOOM_OK;
    return loom_err_set(err, LOOM_ERR_UNAVAILABLE, "cuBLASLt could not be loaded (%s)", g_why);
}

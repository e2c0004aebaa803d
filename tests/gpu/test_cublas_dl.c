/* cuBLAS is loaded at backend creation, not linked (kernels/cuda/cublas_dl.h):
 * this runs on any machine with the toolkit, GPU or not, so that a missing
 * symbol shows here and not first on a GPU machine. It also checks that the
 * process did not get cuBLAS by linking. */
#include <dlfcn.h>
#include <string.h>

#include "kernels/cuda/cublas_dl.h"
#include "kernels/cuda/cublaslt_dl.h"
#include "tests/test.h"

#define STR_(x) #x
#define STR(x)  STR_(x)

static void test_not_linked(void) {
    /* RTLD_NOLOAD: a handle only if the library is already in the process */
    void *h = dlopen("libcublas.so." STR(CUBLAS_VER_MAJOR), RTLD_NOW | RTLD_NOLOAD);
    CHECKF(h == NULL, "cuBLAS was loaded before any backend asked for it");
    if (h) dlclose(h);
}

static void test_load(void) {
    const loom_cublas_api_t *api = NULL;
    loom_err_t err = {0};
    loom_status_t st = loom_cublas_load(&api, &err);
    REQUIRE(st == LOOM_OK && api != NULL);
    CHECK(api->create && api->destroy && api->set_stream && api->set_workspace && api->gemm_ex &&
          api->status_string);
    const loom_cublas_api_t *again = NULL;
    CHECK(loom_cublas_load(&again, &err) == LOOM_OK && again == api);
    /* the library's own text, not the fallback of an unloaded library */
    const char *text = loom_cublas_status_str(CUBLAS_STATUS_NOT_INITIALIZED);
    CHECKF(strncmp(text, "cuBLAS status ", 14) != 0, "%s", text);
}

/* cuBLASLt (cublaslt_dl.h) the same way: not linked, every symbol found */
static void test_lt(void) {
    void *h = dlopen("libcublasLt.so." STR(CUBLAS_VER_MAJOR), RTLD_NOW | RTLD_NOLOAD);
    CHECKF(h == NULL, "cuBLASLt was loaded before any backend asked for it");
    if (h) dlclose(h);
    const loom_cublaslt_api_t *api = NULL, *again = NULL;
    loom_err_t err = {0};
    REQUIRE(loom_cublaslt_load(&api, &err) == LOOM_OK && api != NULL);
    CHECK(api->create && api->destroy && api->desc_create && api->desc_destroy && api->desc_set &&
          api->layout_create && api->layout_destroy && api->pref_create && api->pref_destroy && api->pref_set &&
          api->heuristic && api->matmul);
    CHECKF(api->version / 10000 == CUBLAS_VER_MAJOR || api->version / 10000 == 12, "version %zu", api->version);
    CHECK(loom_cublaslt_load(&again, &err) == LOOM_OK && again == api);
}

int main(void) {
    RUN(test_not_linked);
    RUN(test_lt);
    RUN(test_load);
    return test_summary();
}

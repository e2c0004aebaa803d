/* Element type names and sizes (safetensors spellings). */
#include "common/dtype.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} k_dtypes[LOOM_DT_COUNT] = {
    [LOOM_DT_F32] = {"F32", 4},    [LOOM_DT_F16] = {"F16", 2},          [LOOM_DT_BF16] = {"BF16", 2},
    [LOOM_DT_F64] = {"F64", 8},    [LOOM_DT_I64] = {"I64", 8},          [LOOM_DT_I32] = {"I32", 4},
    [LOOM_DT_I16] = {"I16", 2},    [LOOM_DT_I8] = {"I8", 1},            [LOOM_DT_U8] = {"U8", 1},
    [LOOM_DT_BOOL] = {"BOOL", 1},  [LOOM_DT_F8_E4M3] = {"F8_E4M3", 1}, [LOOM_DT_F8_E5M2] = {"F8_E5M2", 1},
};

size_t loom_dtype_size(loom_dtype_t t) {
    return (unsigned)t < LOOM_DT_COUNT ? k_dtypes[t].size : 0;
}

const char *loom_dtype_name(loom_dtype_t t) {
    return (unsigned)t < LOOM_DT_COUNT ? k_dtypes[t].name : "?";
}

int loom_dtype_from_name(const char *name, loom_dtype_t *out) {
    for (int i = 0; i < LOOM_DT_COUNT; i++) {
        if (!strcmp(name, k_dtypes[i].name)) {
            *out = (loom_dtype_t)i;
            return 1;
        }
    }
    return 0;
}

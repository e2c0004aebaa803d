/* Element types of tensors in files and in backend buffers. */
#ifndef LOOM_DTYPE_H
#define LOOM_DTYPE_H

#include <stddef.h>

typedef enum loom_dtype {
    LOOM_DT_F32 = 0,
    LOOM_DT_F16,
    LOOM_DT_BF16,
    LOOM_DT_F64,
    LOOM_DT_I64,
    LOOM_DT_I32,
    LOOM_DT_I16,
    LOOM_DT_I8,
    LOOM_DT_U8,
    LOOM_DT_BOOL,
    LOOM_DT_F8_E4M3,
    LOOM_DT_F8_E5M2,
    LOOM_DT_COUNT
} loom_dtype_t;

size_t loom_dtype_size(loom_dtype_t t);     /* bytes per element */
const char *loom_dtype_name(loom_dtype_t t); /* safetensors spelling: "F32", "BF16", ... */
int loom_dtype_from_name(const char *name, loom_dtype_t *out); /* 0 if unknown */

#endif
